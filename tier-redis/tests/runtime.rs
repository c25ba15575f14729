//! Runtime safety (issue 12 item 2): stores and lookups made from a tokio
//! runtime that is then dropped must not leave the tier's connections on a
//! dead driver. The lookup manager's worker, on a runtime of its own or on
//! the tier's dedicated one (the last test), must still answer exactly:
//! single node with and without the lean path, and a cluster.

use kvtier_test_services as support;

use std::sync::Arc;
use std::time::Duration;

use kvtier_core::testkit::{self, unique_keys};
use kvtier_core::{
    AsyncLookupManager, BlockStore, LookupVerdict, ManagerConfig, OffloadKey, ReqContext, Spawner,
    StackPolicy, Tier, TierStack,
};
use kvtier_redis::{RedisConfig, RedisTier};

fn configs(test: &str) -> Vec<(&'static str, RedisConfig)> {
    let mut configs = Vec::new();
    let prefix = "kvtier-runtime:".to_owned();
    if let Some(url) = support::service("KVTIER_REDIS_URL", test) {
        let single = RedisConfig {
            key_prefix: prefix.clone(),
            ..RedisConfig::from_url(url)
        };
        configs.push((
            "single, redis-rs",
            RedisConfig {
                lean_pipelines: false,
                ..single.clone()
            },
        ));
        configs.push(("single, lean", single));
    }
    if let Some(urls) = support::service("KVTIER_REDIS_CLUSTER_URLS", test) {
        configs.push((
            "cluster",
            RedisConfig {
                key_prefix: prefix,
                ..RedisConfig::cluster(urls.split(','))
            },
        ));
    }
    configs
}

/// Looks up `keys` for a fresh request until every key has a verdict.
fn verdicts(
    m: &mut AsyncLookupManager<RedisTier>,
    keys: &[OffloadKey],
    req: &str,
) -> Vec<LookupVerdict> {
    testkit::verdicts(m, keys, req, Duration::from_secs(20))
}

/// A runtime that lives for one block of work, as a request handler's or a
/// binding's may.
fn short_lived_runtime(multi_thread: bool) -> tokio::runtime::Runtime {
    if multi_thread {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap()
    } else {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }
}

#[test]
fn stores_from_a_dropped_runtime_then_manager_lookups_answer_exactly() {
    let mut failures = Vec::new();
    for (name, config) in configs("stores_from_a_dropped_runtime_then_manager_lookups") {
        for multi_thread in [false, true] {
            let tier = Arc::new(RedisTier::new(config.clone()).unwrap());
            let keys = unique_keys(300, 36);
            let present: Vec<(OffloadKey, Vec<u8>)> = keys
                .iter()
                .step_by(2)
                .map(|k| (k.clone(), b"block".to_vec()))
                .collect();
            let expected: Vec<LookupVerdict> = (0..keys.len())
                .map(|i| {
                    if i % 2 == 0 {
                        LookupVerdict::Hit
                    } else {
                        LookupVerdict::Miss
                    }
                })
                .collect();
            {
                // The first calls, so every connection (redis-rs's and the
                // lean path's) is made here, then the runtime goes.
                let rt = short_lived_runtime(multi_thread);
                rt.block_on(tier.store_many(&present)).unwrap();
                let found = rt
                    .block_on(tier.batch_lookup(&keys, &ReqContext::new("warm")))
                    .unwrap();
                assert_eq!(found.iter().filter(|&&f| f).count(), present.len());
            }
            let mut m = tier
                .manager(ManagerConfig {
                    call_timeout_ms: 5_000,
                    ..ManagerConfig::default()
                })
                .unwrap();
            let case = format!("{name}, multi-thread runtime {multi_thread}");
            let wrong = verdicts(&mut m, &keys, "after")
                .iter()
                .zip(&expected)
                .filter(|(got, want)| got != want)
                .count();
            let stats = m.stats();
            if wrong > 0 || stats.errors > 0 || stats.timeouts > 0 {
                failures.push(format!(
                    "{case}: {wrong} of {} verdicts wrong, {} errors, {} timeouts, first error {:?}",
                    keys.len(),
                    stats.errors,
                    stats.timeouts,
                    stats.first_error
                ));
                continue;
            }
            // Loads and removes from yet another runtime work too.
            let rt = short_lived_runtime(multi_thread);
            assert_eq!(
                rt.block_on(tier.load(&keys[0])).unwrap().as_deref(),
                Some(&b"block"[..]),
                "{name}"
            );
            let removed: Vec<OffloadKey> = present.iter().map(|(k, _)| k.clone()).collect();
            rt.block_on(tier.remove_many(&removed)).unwrap();
            drop(rt);
            assert!(
                verdicts(&mut m, &keys, "removed")
                    .iter()
                    .all(|&v| v == LookupVerdict::Miss),
                "{name}"
            );
            // The lean path never had to give up: its connections did not
            // die with the runtime.
            assert_eq!(
                tier.pipeline_stats().fallbacks,
                0,
                "{name}: {:?}",
                tier.pipeline_stats()
            );
            m.shutdown();
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// One spawner for the lookup manager and the tier's connections: one
/// thread for both, and stores from a dropped runtime still leave exact
/// lookups.
#[test]
fn one_shared_spawner_drives_the_manager_and_the_connections() {
    for (name, config) in configs("one_shared_spawner_drives_the_manager_and_the_connections") {
        let spawner = Spawner::dedicated("kvtier-test-redis", 1).unwrap();
        let tier = Arc::new(RedisTier::with_spawner(config, &spawner).unwrap());
        let keys = unique_keys(100, 36);
        let present: Vec<(OffloadKey, Vec<u8>)> = keys
            .iter()
            .step_by(3)
            .map(|k| (k.clone(), b"block".to_vec()))
            .collect();
        short_lived_runtime(false)
            .block_on(tier.store_many(&present))
            .unwrap();
        let mut m = tier.manager_on(ManagerConfig::default(), &spawner).unwrap();
        let verdicts = verdicts(&mut m, &keys, "shared");
        for (i, v) in verdicts.iter().enumerate() {
            let expected = if i % 3 == 0 {
                LookupVerdict::Hit
            } else {
                LookupVerdict::Miss
            };
            assert_eq!(*v, expected, "{name}: key {i}: {:?}", m.stats());
        }
        short_lived_runtime(true)
            .block_on(tier.remove_many(&keys))
            .unwrap();
        m.shutdown();
    }
}

/// Connections on the caller's runtime ([`Spawner::from_handle`]): once
/// that runtime is gone, calls are typed transient errors, never a panic
/// or a hang.
#[test]
fn calls_after_the_callers_runtime_is_gone_are_typed_errors() {
    for (name, config) in configs("calls_after_the_callers_runtime_is_gone_are_typed_errors") {
        let rt = short_lived_runtime(true);
        let tier =
            RedisTier::with_spawner(config, &Spawner::from_handle(rt.handle().clone())).unwrap();
        let keys = unique_keys(10, 36);
        rt.block_on(tier.store(&keys[0], b"block")).unwrap();
        assert!(rt.block_on(tier.exists_many(&keys)).unwrap()[0]);
        drop(rt);
        let other = short_lived_runtime(false);
        let err = other.block_on(tier.exists_many(&keys)).unwrap_err();
        assert!(err.tier_kind().is_transient(), "{name}: {err:?}");
        let err = other.block_on(tier.load(&keys[0])).unwrap_err();
        assert!(err.kind().is_transient(), "{name}: {err:?}");
    }
}

/// A tier keeps the dedicated spawner it was built with alive: the caller
/// drops its clone, and stores, loads and lookups (direct and through a
/// manager) still run on that spawner's runtime.
#[test]
fn a_tier_keeps_a_dedicated_spawner_it_was_given_alive() {
    for (name, config) in configs("a_tier_keeps_a_dedicated_spawner_it_was_given_alive") {
        let spawner = Spawner::dedicated("kvtier-redis-given", 1).unwrap();
        let tier = Arc::new(RedisTier::with_spawner(config, &spawner).unwrap());
        drop(spawner);
        let keys = unique_keys(4, 36);
        let rt = short_lived_runtime(false);
        rt.block_on(async {
            tier.store(&keys[0], b"spawner dropped").await.unwrap();
            assert_eq!(
                tier.load(&keys[0]).await.unwrap().as_deref(),
                Some(&b"spawner dropped"[..]),
                "{name}"
            );
            assert_eq!(
                tier.exists_many(&keys).await.unwrap(),
                [true, false, false, false],
                "{name}"
            );
        });
        let mut m = tier.manager(ManagerConfig::default()).unwrap();
        assert_eq!(
            verdicts(&mut m, &keys, "given")[..],
            [
                LookupVerdict::Hit,
                LookupVerdict::Miss,
                LookupVerdict::Miss,
                LookupVerdict::Miss
            ],
            "{name}"
        );
        rt.block_on(tier.remove_many(&keys)).unwrap();
        m.shutdown();
    }
}

#[cfg(target_os = "linux")]
/// Whether a thread named `name` is seen within `limit`: a new thread
/// names itself once it runs, so a count taken at once can miss it.
fn thread_seen_within(name: &str, limit: Duration) -> bool {
    let start = std::time::Instant::now();
    while start.elapsed() < limit {
        if testkit::threads_named(name) > 0 {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    false
}

#[cfg(target_os = "linux")]
/// Whether every thread named `name` has ended within `limit`.
fn gone_within(name: &str, limit: Duration) -> bool {
    let start = std::time::Instant::now();
    while testkit::threads_named(name) > 0 {
        if start.elapsed() >= limit {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    true
}

/// `tier.manager(...)` runs the lookup worker on the tier's own runtime when
/// the tier has a dedicated one (no thread of the manager's own, answers
/// exact), and on a runtime of its own when the tier runs on a caller's
/// runtime, which nothing promises to drive.
#[cfg(target_os = "linux")] // threads are counted in /proc
#[test]
fn a_managers_worker_runs_on_the_tiers_dedicated_runtime() {
    // Only this test names a manager "Z...": its thread is `kvtier-lookup-Z`.
    const THREAD: &str = "kvtier-lookup-Z";
    let wait = Duration::from_millis(500);
    for (name, config) in configs("a_managers_worker_runs_on_the_tiers_dedicated_runtime") {
        let keys = unique_keys(6, 36);
        let tier = Arc::new(RedisTier::new(config.clone()).unwrap());
        let mut m = tier.manager(ManagerConfig::named("Z-shared")).unwrap();
        let rt = short_lived_runtime(false);
        rt.block_on(tier.store(&keys[1], b"shared")).unwrap();
        let mut want = vec![LookupVerdict::Miss; keys.len()];
        want[1] = LookupVerdict::Hit;
        assert_eq!(verdicts(&mut m, &keys, "shared"), want, "{name}");
        assert_eq!(m.stats().errors + m.stats().timeouts, 0, "{name}");
        assert!(
            !thread_seen_within(THREAD, wait),
            "{name}: no thread of its own"
        );
        m.shutdown();
        // A stack without a spawner of its own starts the tier's manager the same way.
        let mut stack = TierStack::new(StackPolicy::default());
        stack
            .add_store(&tier, ManagerConfig::named("Z-stack"))
            .unwrap();
        assert!(
            !thread_seen_within(THREAD, wait),
            "{name}: a stack's manager, no thread of its own"
        );
        stack.shutdown();
        rt.block_on(tier.remove_many(&keys)).unwrap();
        // Asked for more worker threads than the tier's runtime has: its own.
        let m = tier
            .manager(ManagerConfig {
                worker_threads: 2,
                ..ManagerConfig::named("Z-two")
            })
            .unwrap();
        on_its_own_runtime(m, &format!("{name}: two worker threads"));
        // The same on a dedicated runtime the tier was given.
        let given = Spawner::dedicated("kvtier-redis-Zg", 1).unwrap();
        let tier = Arc::new(RedisTier::with_spawner(config.clone(), &given).unwrap());
        let mut m = tier.manager(ManagerConfig::named("Z-given")).unwrap();
        assert!(
            !thread_seen_within(THREAD, wait),
            "{name}: a given dedicated runtime, no thread of its own"
        );
        m.shutdown();

        let callers = Spawner::from_handle(rt.handle().clone());
        let tier = Arc::new(RedisTier::with_spawner(config, &callers).unwrap());
        let m = tier.manager(ManagerConfig::named("Z-own")).unwrap();
        on_its_own_runtime(m, &format!("{name}: a caller's runtime"));
    }

    /// `m` runs on a runtime of its own: its thread appears, and ends with
    /// it (before the next configuration looks).
    fn on_its_own_runtime(mut m: AsyncLookupManager<RedisTier>, what: &str) {
        assert!(
            thread_seen_within(THREAD, Duration::from_secs(5)),
            "{what}: a runtime of its own"
        );
        m.shutdown();
        assert!(
            gone_within(THREAD, Duration::from_secs(5)),
            "{what}: its threads ended"
        );
    }
}
