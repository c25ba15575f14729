//! Errors: what a tier reports ([`TierError`]) and what the manager reports
//! to its caller ([`LookupError`], [`ManagerError`]).

use std::fmt;

/// What went wrong in a tier call, classified where the backend error enters.
///
/// The manager never turns a tier error into a cached "absent": the keys of a
/// failed call answer [`Miss`](crate::LookupVerdict::Miss) for safety, are
/// counted under `errors` (not `misses`), and are probed again after the
/// configured back-off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum TierErrorKind {
    /// The backend could not be reached or dropped the connection.
    Unavailable,
    /// The backend did not answer in time (its own timeout, not the manager's deadline).
    Timeout,
    /// The backend asked us to slow down.
    Throttled,
    /// Credentials, missing bucket or similar: retrying will not help.
    Config,
    /// The backend refused the operation to the tier's credentials (an ACL
    /// or policy denies it): the credentials work, but may not do this;
    /// retrying will not help.
    PermissionDenied,
    /// The caller passed something the tier cannot accept (for example a key of the wrong size).
    InvalidInput,
    /// Stored data failed a checksum or could not be parsed.
    Corrupt,
    /// The tier answered with a different number of results than keys.
    WrongResultCount,
    /// A stored block's length differs from the region it was to be loaded
    /// into (see [`LengthMismatch`](crate::LengthMismatch)).
    LengthMismatch,
    /// The operation was cancelled before it started (a transfer job still
    /// queued when the queue drained or shut down).
    Cancelled,
    /// The tier's future panicked.
    Panicked,
    /// Anything else.
    Other,
}

impl TierErrorKind {
    /// Whether the same call may succeed later without a change of configuration.
    pub fn is_transient(self) -> bool {
        matches!(
            self,
            Self::Unavailable
                | Self::Timeout
                | Self::Throttled
                | Self::Other
                | Self::Panicked
                | Self::Cancelled
        )
    }

    /// Short stable name, for logs and metrics labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Unavailable => "unavailable",
            Self::Timeout => "timeout",
            Self::Throttled => "throttled",
            Self::Config => "config",
            Self::PermissionDenied => "permission_denied",
            Self::InvalidInput => "invalid_input",
            Self::Corrupt => "corrupt",
            Self::WrongResultCount => "wrong_result_count",
            Self::LengthMismatch => "length_mismatch",
            Self::Cancelled => "cancelled",
            Self::Panicked => "panicked",
            Self::Other => "other",
        }
    }
}

impl fmt::Display for TierErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An error returned by a [`Tier`](crate::Tier): a kind, a message with
/// context (endpoint, bucket, path, key count) and the backend's own error.
///
/// Tier crates keep their own detailed error enums and convert them into this
/// type at the trait boundary, choosing the kind with the backend's own
/// predicates.
#[derive(Debug, thiserror::Error)]
#[error("{kind} error: {message}")]
pub struct TierError {
    kind: TierErrorKind,
    message: String,
    #[source]
    source: Option<Box<dyn std::error::Error + Send + Sync + 'static>>,
}

impl TierError {
    /// A new error of `kind` with a message that says what was being done.
    pub fn new(kind: TierErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            source: None,
        }
    }

    /// Attaches the backend's own error.
    #[must_use]
    pub fn with_source(mut self, source: impl std::error::Error + Send + Sync + 'static) -> Self {
        self.source = Some(Box::new(source));
        self
    }

    /// The classification.
    pub fn kind(&self) -> TierErrorKind {
        self.kind
    }

    /// The message, without the kind prefix.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Shorthand for `self.kind().is_transient()`.
    pub fn is_transient(&self) -> bool {
        self.kind.is_transient()
    }
}

/// An error returned to the scheduler by the manager's lookup calls.
///
/// None of these is a tier failure: tier failures never reach the scheduler
/// as errors, they resolve keys as counted misses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LookupError {
    /// The key is shorter than the configured `min_key_len` (1 unless the
    /// tier's keys have one length) or longer than `max_key_len`.
    #[error("invalid key of {len} bytes: {}", key_lengths(*min, *max))]
    InvalidKey {
        /// The key's length.
        len: usize,
        /// The configured minimum.
        min: usize,
        /// The configured maximum.
        max: usize,
    },
    /// The manager was shut down; it answers no more lookups.
    #[error("the lookup manager for tier '{tier}' is shut down")]
    ShutDown {
        /// The tier's name.
        tier: String,
    },
}

/// What an [`LookupError::InvalidKey`] says keys must be.
fn key_lengths(min: usize, max: usize) -> String {
    if min == max {
        format!("keys must be {max} bytes long")
    } else {
        format!("keys must be {min} to {max} bytes long")
    }
}

/// An error building a manager.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ManagerError {
    /// A configuration value is out of range.
    #[error("invalid lookup manager configuration: {field} {reason}")]
    InvalidConfig {
        /// The offending field.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The worker thread or its runtime could not be started.
    #[error("could not start the lookup worker for tier '{tier}': {source}")]
    Spawn {
        /// The tier's name (the spawner's, from
        /// [`Spawner::dedicated`](crate::Spawner::dedicated)).
        tier: String,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// [`Spawner::current`](crate::Spawner::current) was called outside a
    /// tokio runtime.
    #[error("no tokio runtime to run the lookup worker on: {source}")]
    NoRuntime {
        /// Tokio's error.
        #[source]
        source: tokio::runtime::TryCurrentError,
    },
}

/// `err` and its sources on one line, `a: b: c`, leaving out a source whose
/// text the line already holds (wrappers often repeat their source). The
/// form of [`ManagerStats::first_error`](crate::ManagerStats::first_error);
/// programs can print their own errors the same way.
pub fn one_line(err: &dyn std::error::Error) -> String {
    let mut line = err.to_string();
    let mut source = err.source();
    while let Some(e) = source {
        let text = e.to_string();
        if !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        source = e.source();
    }
    line
}

#[cfg(test)]
mod one_line_tests {
    use super::*;

    #[test]
    fn sources_join_on_one_line_without_repeats() {
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "connection refused");
        let err =
            TierError::new(TierErrorKind::Unavailable, "connect to 127.0.0.1:1").with_source(io);
        assert_eq!(
            one_line(&err),
            "unavailable error: connect to 127.0.0.1:1: connection refused"
        );
        let repeated = TierError::new(TierErrorKind::Other, "connection refused").with_source(
            std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "connection refused"),
        );
        assert_eq!(one_line(&repeated), "other error: connection refused");
    }
}
