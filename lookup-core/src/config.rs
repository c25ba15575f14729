//! Manager configuration: one serde struct, the same from TOML, JSON or code.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::error::ManagerError;

/// How an [`AsyncLookupManager`](crate::AsyncLookupManager) behaves.
///
/// Every field has a default (see [`Default`]); a TOML table may name only
/// the fields it changes:
///
/// ```
/// let cfg: kvtier_core::ManagerConfig =
///     serde_json::from_str(r#"{ "call_timeout_ms": 250, "max_calls_in_flight": 8 }"#).unwrap();
/// assert_eq!(cfg.call_timeout(), std::time::Duration::from_millis(250));
/// assert_eq!(cfg.max_key_len, 64);
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ManagerConfig {
    /// Name used in logs, spans, stats and, for a manager with a runtime of
    /// its own, its threads' name (`kvtier-lookup-<tier_name>`). Default `"tier"`.
    pub tier_name: String,
    /// Longest key accepted, in bytes. Default 64 (vLLM's keys are 36).
    pub max_key_len: usize,
    /// Shortest key accepted, in bytes. Default 1. A tier whose keys have
    /// one length sets both bounds to it in
    /// [`BlockStore::manager_config`](crate::BlockStore::manager_config)
    /// (a disk tier: its `key_len`), so a key of another length is refused
    /// at the lookup, as [`LookupError::InvalidKey`](crate::LookupError::InvalidKey).
    pub min_key_len: usize,
    /// Deadline of one tier call, in milliseconds. On expiry the call's keys
    /// answer miss, are counted as timeouts, and a late answer is discarded.
    /// Default 1000.
    pub call_timeout_ms: u64,
    /// How long a key whose probe failed or timed out keeps answering miss
    /// before a lookup probes it again, in milliseconds. Default 500.
    pub failure_backoff_ms: u64,
    /// Tier calls running at once: the worker's call slots. Default 32.
    ///
    /// The manager also hands the worker up to this many more calls, which
    /// wait for a free slot (`calls_waiting` in the stats, the
    /// `kvtier_calls_waiting` gauge), so the next call starts the moment one
    /// ends, without waiting for the scheduler's next flush or drain. A
    /// handed-over call's deadline runs from the hand-over, so its wait for a
    /// free slot counts against it. `calls_in_flight` in the stats and the
    /// `kvtier_calls_in_flight` gauge count the calls running, never more
    /// than this.
    pub max_calls_in_flight: usize,
    /// Flushed steps with calls still running or waiting. A step beyond this
    /// waits (nothing blocks: its keys stay pending). Default 8.
    pub max_steps_in_flight: usize,
    /// Keys flushed but not yet handed to the tier. When the backlog reaches
    /// this, lookups of new keys answer pending without being tracked, and
    /// are counted as `deferred`. Default 65536.
    pub max_queued_keys: usize,
    /// Largest number of keys in one tier call; a request's group beyond this
    /// is split. Default 4096.
    pub max_keys_per_call: usize,
    /// How long `shutdown` waits for running calls and the worker, in
    /// milliseconds. Default 1000.
    pub shutdown_timeout_ms: u64,
    /// Threads of the worker's tokio runtime, for a manager that starts its
    /// own ([`AsyncLookupManager::new`](crate::AsyncLookupManager::new) and
    /// friends): 1 runs a current-thread runtime on one worker thread, more
    /// a multi-thread runtime (see [`Spawner::dedicated`](crate::Spawner::dedicated)).
    /// Ignored for a manager given a spawner. Default 1.
    pub worker_threads: usize,
}

impl Default for ManagerConfig {
    fn default() -> Self {
        Self {
            tier_name: "tier".to_owned(),
            max_key_len: 64,
            min_key_len: 1,
            call_timeout_ms: 1000,
            failure_backoff_ms: 500,
            max_calls_in_flight: 32,
            max_steps_in_flight: 8,
            max_queued_keys: 65_536,
            max_keys_per_call: 4096,
            shutdown_timeout_ms: 1000,
            worker_threads: 1,
        }
    }
}

impl ManagerConfig {
    /// Largest `max_calls_in_flight`: the most permits a tokio semaphore holds.
    pub const MAX_CALLS_IN_FLIGHT: usize = tokio::sync::Semaphore::MAX_PERMITS;

    /// Largest `worker_threads`: each is an OS thread started with the manager.
    pub const MAX_WORKER_THREADS: usize = 1024;

    /// Largest value of a `*_ms` field: 100 years. A deadline is the present
    /// instant plus the duration, and an `Instant` holds 64-bit nanoseconds
    /// on some platforms (584 years), so a longer one could overflow it.
    pub const MAX_DURATION_MS: u64 = 100 * 365 * 24 * 3600 * 1000;

    /// The default configuration with another tier name.
    pub fn named(tier_name: impl Into<String>) -> Self {
        Self {
            tier_name: tier_name.into(),
            ..Self::default()
        }
    }

    /// This configuration, renamed `name` if it still has the default name:
    /// how each tier crate's `manager()` names its manager.
    #[must_use]
    pub fn or_named(mut self, name: &str) -> Self {
        if self.tier_name == Self::default().tier_name {
            self.tier_name = name.to_owned();
        }
        self
    }

    /// `call_timeout_ms` as a duration.
    pub fn call_timeout(&self) -> Duration {
        Duration::from_millis(self.call_timeout_ms)
    }

    /// `failure_backoff_ms` as a duration.
    pub fn failure_backoff(&self) -> Duration {
        Duration::from_millis(self.failure_backoff_ms)
    }

    /// `shutdown_timeout_ms` as a duration.
    pub fn shutdown_timeout(&self) -> Duration {
        Duration::from_millis(self.shutdown_timeout_ms)
    }

    /// Checks every field's range: rejects every value the manager cannot
    /// run with (zero limits, an empty name or one with a NUL, limits above
    /// [`MAX_CALLS_IN_FLIGHT`](Self::MAX_CALLS_IN_FLIGHT) and
    /// [`MAX_WORKER_THREADS`](Self::MAX_WORKER_THREADS), durations above
    /// [`MAX_DURATION_MS`](Self::MAX_DURATION_MS)). Other limits size
    /// nothing up front, so any positive value runs.
    ///
    /// # Errors
    /// [`ManagerError::InvalidConfig`] naming the first field out of range.
    pub fn validate(&self) -> Result<(), ManagerError> {
        let positive: [(&'static str, u64); 8] = [
            ("max_key_len", self.max_key_len as u64),
            ("min_key_len", self.min_key_len as u64),
            ("call_timeout_ms", self.call_timeout_ms),
            ("max_calls_in_flight", self.max_calls_in_flight as u64),
            ("max_steps_in_flight", self.max_steps_in_flight as u64),
            ("max_queued_keys", self.max_queued_keys as u64),
            ("max_keys_per_call", self.max_keys_per_call as u64),
            ("worker_threads", self.worker_threads as u64),
        ];
        for (field, value) in positive {
            if value == 0 {
                return Err(ManagerError::InvalidConfig {
                    field,
                    reason: "must be at least 1".to_owned(),
                });
            }
        }
        let bad = |field, reason: String| Err(ManagerError::InvalidConfig { field, reason });
        if self.min_key_len > self.max_key_len {
            return bad(
                "min_key_len",
                format!("must be at most max_key_len ({})", self.max_key_len),
            );
        }
        if self.tier_name.is_empty() {
            return bad("tier_name", "must not be empty".to_owned());
        }
        // The name is part of the worker's thread names, which the OS takes
        // as C strings.
        if self.tier_name.contains('\0') {
            return bad("tier_name", "must not contain a NUL character".to_owned());
        }
        // The worker's call slots are a tokio semaphore of this many permits.
        if self.max_calls_in_flight > Self::MAX_CALLS_IN_FLIGHT {
            return bad(
                "max_calls_in_flight",
                format!("must be at most {}", Self::MAX_CALLS_IN_FLIGHT),
            );
        }
        if self.worker_threads > Self::MAX_WORKER_THREADS {
            return bad(
                "worker_threads",
                format!("must be at most {}", Self::MAX_WORKER_THREADS),
            );
        }
        // Deadlines and retry times are the present instant plus these.
        for (field, value) in [
            ("call_timeout_ms", self.call_timeout_ms),
            ("failure_backoff_ms", self.failure_backoff_ms),
            ("shutdown_timeout_ms", self.shutdown_timeout_ms),
        ] {
            if value > Self::MAX_DURATION_MS {
                return bad(
                    field,
                    format!(
                        "must be at most {} (100 years), not {value}",
                        Self::MAX_DURATION_MS
                    ),
                );
            }
        }
        Ok(())
    }
}
