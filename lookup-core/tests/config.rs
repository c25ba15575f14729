//! Every configuration value the manager cannot run with is rejected by
//! `validate()` as `InvalidConfig`, and `AsyncLookupManager::new` returns
//! that error instead of panicking (or aborting) while it starts.

use kvtier_core::{
    AsyncLookupManager, ManagerConfig, ManagerError, OffloadKey, ReqContext, Tier, TierError,
};

struct Nothing;

impl Tier for Nothing {
    async fn batch_lookup(
        &self,
        keys: &[OffloadKey],
        _ctx: &ReqContext,
    ) -> Result<Vec<bool>, TierError> {
        Ok(vec![false; keys.len()])
    }
}

/// `config` is rejected, naming `field`, by `validate()` and by `new()`.
fn rejected(config: ManagerConfig, field: &str) {
    match AsyncLookupManager::new(Nothing, config.clone()) {
        Err(ManagerError::InvalidConfig { field: f, .. }) if f == field => {}
        Err(other) => panic!("new() with a bad {field}: {other:?}"),
        Ok(_) => panic!("new() with a bad {field} started a manager"),
    }
    match config.validate() {
        Err(ManagerError::InvalidConfig { field: f, .. }) if f == field => {}
        other => panic!("validate() of a bad {field}: {other:?}"),
    }
}

#[test]
fn max_calls_in_flight_above_the_semaphore_limit_is_rejected() {
    rejected(
        ManagerConfig {
            max_calls_in_flight: tokio::sync::Semaphore::MAX_PERMITS + 1,
            ..ManagerConfig::default()
        },
        "max_calls_in_flight",
    );
    rejected(
        ManagerConfig {
            max_calls_in_flight: usize::MAX,
            ..ManagerConfig::default()
        },
        "max_calls_in_flight",
    );
    // The limit itself runs.
    let config = ManagerConfig {
        max_calls_in_flight: ManagerConfig::MAX_CALLS_IN_FLIGHT,
        ..ManagerConfig::default()
    };
    config.validate().unwrap();
    AsyncLookupManager::new(Nothing, config).unwrap().shutdown();
}

#[test]
fn a_tier_name_with_a_nul_is_rejected() {
    rejected(ManagerConfig::named("s3\0evil"), "tier_name");
}

#[test]
fn a_tier_name_with_a_nul_is_rejected_with_a_multi_thread_worker() {
    rejected(
        ManagerConfig {
            worker_threads: 2,
            ..ManagerConfig::named("\0")
        },
        "tier_name",
    );
}

#[test]
fn worker_threads_beyond_the_limit_are_rejected() {
    rejected(
        ManagerConfig {
            worker_threads: usize::MAX,
            ..ManagerConfig::default()
        },
        "worker_threads",
    );
    rejected(
        ManagerConfig {
            worker_threads: ManagerConfig::MAX_WORKER_THREADS + 1,
            ..ManagerConfig::default()
        },
        "worker_threads",
    );
}

#[test]
fn a_call_timeout_beyond_the_limit_is_rejected() {
    rejected(
        ManagerConfig {
            call_timeout_ms: u64::MAX,
            ..ManagerConfig::default()
        },
        "call_timeout_ms",
    );
    rejected(
        ManagerConfig {
            call_timeout_ms: ManagerConfig::MAX_DURATION_MS + 1,
            ..ManagerConfig::default()
        },
        "call_timeout_ms",
    );
}

#[test]
fn a_failure_backoff_beyond_the_limit_is_rejected() {
    rejected(
        ManagerConfig {
            failure_backoff_ms: u64::MAX,
            ..ManagerConfig::default()
        },
        "failure_backoff_ms",
    );
}

#[test]
fn a_shutdown_timeout_beyond_the_limit_is_rejected() {
    rejected(
        ManagerConfig {
            shutdown_timeout_ms: u64::MAX,
            ..ManagerConfig::default()
        },
        "shutdown_timeout_ms",
    );
}

#[test]
fn the_longest_durations_allowed_run() {
    let config = ManagerConfig {
        call_timeout_ms: ManagerConfig::MAX_DURATION_MS,
        failure_backoff_ms: ManagerConfig::MAX_DURATION_MS,
        shutdown_timeout_ms: ManagerConfig::MAX_DURATION_MS,
        ..ManagerConfig::default()
    };
    config.validate().unwrap();
    let mut manager = AsyncLookupManager::new(Nothing, config).unwrap();
    let ctx = ReqContext::new("r");
    let key = OffloadKey::new(&[1; 36]);
    manager.lookup(&key, &ctx).unwrap();
    manager.flush();
    manager.drain_results();
    manager.shutdown();
}
