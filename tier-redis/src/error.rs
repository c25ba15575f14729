//! Errors of the Redis tier, classified with the client's own predicates.

use kvtier_core::{TierError, TierErrorKind};
use redis::{ErrorKind, RedisError, ServerErrorKind};

/// What went wrong talking to Redis. Messages name the endpoint (without
/// credentials) and the operation.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RedisTierError {
    /// A configuration value is missing or out of range.
    #[error("invalid Redis tier configuration: {field} {reason}")]
    InvalidConfig {
        /// The field.
        field: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// The tier's I/O runtime (the thread its connections run on) could not
    /// be started.
    #[error("could not start the Redis tier's I/O runtime: {source}")]
    Runtime {
        /// Why.
        #[source]
        source: kvtier_core::ManagerError,
    },
    /// The server refused the credentials.
    #[error("{endpoint}: authentication failed during {op}")]
    Auth {
        /// Where.
        endpoint: String,
        /// What was being done.
        op: &'static str,
        /// The client's error.
        #[source]
        source: RedisError,
    },
    /// The server refused a command to the tier's user (`NOPERM`: an ACL
    /// denies it the command or the key): the credentials work, but may
    /// not do this.
    #[error("{endpoint}: permission denied during {op}: {source}")]
    Permission {
        /// Where.
        endpoint: String,
        /// What was being done.
        op: &'static str,
        /// The client's error (the server's message names the command).
        #[source]
        source: RedisError,
    },
    /// No answer in time (connect or response timeout).
    #[error("{endpoint}: timed out during {op}")]
    Timeout {
        /// Where.
        endpoint: String,
        /// What was being done.
        op: &'static str,
        /// The client's error.
        #[source]
        source: RedisError,
    },
    /// The server cannot be reached, or the connection dropped.
    #[error("{endpoint}: unreachable or disconnected during {op}: {source}")]
    Unavailable {
        /// Where.
        endpoint: String,
        /// What was being done.
        op: &'static str,
        /// The client's error.
        #[source]
        source: RedisError,
    },
    /// The cluster is down, resharding, or a master is missing.
    #[error("{endpoint}: cluster unavailable during {op}: {source}")]
    ClusterDown {
        /// Where.
        endpoint: String,
        /// What was being done.
        op: &'static str,
        /// The client's error.
        #[source]
        source: RedisError,
    },
    /// Any other error from the client or the server.
    #[error("{endpoint}: {op} failed: {source}")]
    Command {
        /// Where.
        endpoint: String,
        /// What was being done.
        op: &'static str,
        /// The client's error.
        #[source]
        source: RedisError,
    },
    /// The reply is not in Redis's protocol (RESP): another kind of server
    /// listens at this address. `hint` guesses which ("got HTTP?") when the
    /// reply looks like one.
    #[error("{endpoint} is not a Redis server ({hint}): the reply to {op} is not RESP")]
    NotRedis {
        /// Where.
        endpoint: String,
        /// What was being done.
        op: &'static str,
        /// What the reply looks like.
        hint: &'static str,
    },
    /// A reply of the wrong shape or length.
    #[error("{endpoint}: unexpected reply to {op}: {detail}")]
    UnexpectedReply {
        /// Where.
        endpoint: String,
        /// What was being done.
        op: &'static str,
        /// What was wrong.
        detail: String,
    },
}

impl RedisTierError {
    /// Classifies a client error with the client's own predicates.
    pub(crate) fn classify(endpoint: &str, op: &'static str, source: RedisError) -> Self {
        let endpoint = endpoint.to_owned();
        let kind = source.kind();
        if kind == ErrorKind::Server(ServerErrorKind::NoPerm) {
            Self::Permission {
                endpoint,
                op,
                source,
            }
        } else if kind == ErrorKind::AuthenticationFailed {
            Self::Auth {
                endpoint,
                op,
                source,
            }
        } else if source.is_timeout() {
            Self::Timeout {
                endpoint,
                op,
                source,
            }
        } else if source.is_connection_refusal()
            || source.is_connection_dropped()
            || source.is_io_error()
            || kind == ErrorKind::ClusterConnectionNotFound
        {
            Self::Unavailable {
                endpoint,
                op,
                source,
            }
        } else if kind == ErrorKind::Parse {
            // redis-rs names the bytes it could not parse; an HTTP reply
            // starts with `H` (72).
            let hint = if source.to_string().contains("`72`") {
                "got HTTP?"
            } else {
                "got another protocol"
            };
            Self::NotRedis { endpoint, op, hint }
        } else if matches!(
            kind,
            ErrorKind::Server(ServerErrorKind::ClusterDown)
                | ErrorKind::Server(ServerErrorKind::MasterDown)
                | ErrorKind::Server(ServerErrorKind::TryAgain)
                | ErrorKind::Server(ServerErrorKind::BusyLoading)
        ) {
            Self::ClusterDown {
                endpoint,
                op,
                source,
            }
        } else {
            Self::Command {
                endpoint,
                op,
                source,
            }
        }
    }

    /// The lookup-core classification of this error.
    pub fn tier_kind(&self) -> TierErrorKind {
        match self {
            Self::InvalidConfig { .. } | Self::Auth { .. } | Self::NotRedis { .. } => {
                TierErrorKind::Config
            }
            Self::Permission { .. } => TierErrorKind::PermissionDenied,
            Self::Timeout { .. } => TierErrorKind::Timeout,
            Self::Unavailable { .. } | Self::ClusterDown { .. } => TierErrorKind::Unavailable,
            Self::Command { .. } | Self::UnexpectedReply { .. } | Self::Runtime { .. } => {
                TierErrorKind::Other
            }
        }
    }
}

impl From<RedisTierError> for TierError {
    fn from(err: RedisTierError) -> Self {
        TierError::new(err.tier_kind(), err.to_string()).with_source(err)
    }
}

/// The crate's results.
pub(crate) type Result<T, E = RedisTierError> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reply_that_is_not_resp_names_a_server_that_is_not_redis() {
        for (reply, hint) in [
            (&b"HTTP/1.1 400 Bad Request\r\n\r\n"[..], "got HTTP?"),
            (&b"SSH-2.0-OpenSSH_9.2\r\n"[..], "got another protocol"),
        ] {
            let Err(parse) = redis::parse_redis_value(reply) else {
                panic!("{reply:?} parsed as RESP");
            };
            let err = RedisTierError::classify("redis://127.0.0.1:80/", "PING", parse);
            let text = err.to_string();
            assert_eq!(
                text,
                format!(
                    "redis://127.0.0.1:80/ is not a Redis server ({hint}): the reply to PING is not RESP"
                )
            );
            assert_eq!(err.tier_kind(), TierErrorKind::Config);
        }
    }
}
