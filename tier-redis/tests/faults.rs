//! Faults against private servers: a server killed mid-run (lookups resolve
//! as counted errors within the manager's deadline, no panic), then
//! restarted (the same tier recovers without being rebuilt); the same for
//! one node of a 3-master cluster.

mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use lookup_core::testkit::unique_keys;
use lookup_core::{AsyncLookupManager, LookupVerdict, ManagerConfig, OffloadKey, ReqContext};
use support::{PrivateCluster, PrivateRedis};
use tier_redis::{RedisConfig, RedisTier};

fn manager_config() -> ManagerConfig {
    ManagerConfig {
        call_timeout_ms: 2_000,
        failure_backoff_ms: 50,
        ..ManagerConfig::named("redis")
    }
}

/// Looks up `keys` for a fresh request until every key has a verdict.
fn verdicts(
    m: &mut AsyncLookupManager<Arc<RedisTier>>,
    keys: &[OffloadKey],
    req: &str,
) -> Vec<LookupVerdict> {
    let ctx = ReqContext::new(req);
    let start = Instant::now();
    loop {
        let v: Vec<LookupVerdict> = keys.iter().map(|k| m.lookup(k, &ctx).unwrap()).collect();
        if v.iter().all(|&v| v != LookupVerdict::Pending) {
            m.cleanup(req);
            return v;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "no verdict within 10 s: the deadline did not hold"
        );
        m.flush();
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn fast(config: RedisConfig) -> RedisConfig {
    RedisConfig {
        connect_timeout_ms: 200,
        response_timeout_ms: 500,
        key_prefix: "kvtier-fault:".into(),
        ..config
    }
}

#[test]
fn a_killed_server_gives_counted_errors_and_the_tier_recovers_after_restart() {
    if !support::have(
        "redis-server",
        "a_killed_server_gives_counted_errors_and_the_tier_recovers_after_restart",
    ) {
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let mut server = PrivateRedis::start(&[]);
    let tier = Arc::new(RedisTier::new(fast(RedisConfig::from_url(server.url()))).unwrap());
    let keys = unique_keys(64, 36);
    let present: Vec<(OffloadKey, Vec<u8>)> = keys
        .iter()
        .step_by(2)
        .map(|k| (k.clone(), b"v".to_vec()))
        .collect();
    rt.block_on(tier.store_many(&present, None)).unwrap();
    let mut m = tier.manager(manager_config()).unwrap();
    let expected: Vec<LookupVerdict> = (0..64)
        .map(|i| {
            if i % 2 == 0 {
                LookupVerdict::Hit
            } else {
                LookupVerdict::Miss
            }
        })
        .collect();
    assert_eq!(verdicts(&mut m, &keys, "before"), expected);

    server.kill();
    let fresh = unique_keys(32, 36);
    let start = Instant::now();
    let during = verdicts(&mut m, &fresh, "during");
    assert!(
        during.iter().all(|&v| v == LookupVerdict::Miss),
        "lookups during the outage answer miss"
    );
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "fails fast: {:?}",
        start.elapsed()
    );
    let stats = m.stats();
    assert!(
        stats.errors + stats.timeouts >= 32,
        "counted as errors, not misses: {stats:?}"
    );

    // Restart (data is gone: the server keeps nothing on disk), store again,
    // and the same tier and manager answer right.
    server.restart();
    let recovered = Instant::now();
    loop {
        if rt.block_on(tier.store_many(&present, None)).is_ok() {
            break;
        }
        assert!(
            recovered.elapsed() < Duration::from_secs(10),
            "the tier did not reconnect"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(verdicts(&mut m, &keys, "after"), expected);
    m.shutdown();
}

#[test]
fn a_killed_cluster_node_gives_counted_errors_and_the_cluster_tier_recovers() {
    if !support::have(
        "redis-server",
        "a_killed_cluster_node_gives_counted_errors_and_the_cluster_tier_recovers",
    ) {
        return;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let mut cluster = PrivateCluster::start();
    let tier = Arc::new(RedisTier::new(fast(RedisConfig::cluster(cluster.urls()))).unwrap());
    let keys = unique_keys(90, 36);
    let present: Vec<(OffloadKey, Vec<u8>)> = keys
        .iter()
        .step_by(2)
        .map(|k| (k.clone(), b"v".to_vec()))
        .collect();
    rt.block_on(tier.store_many(&present, None)).unwrap();
    let mut m = tier.manager(manager_config()).unwrap();
    let expected: Vec<LookupVerdict> = (0..90)
        .map(|i| {
            if i % 2 == 0 {
                LookupVerdict::Hit
            } else {
                LookupVerdict::Miss
            }
        })
        .collect();
    assert_eq!(verdicts(&mut m, &keys, "before"), expected);

    cluster.nodes[1].kill();
    let start = Instant::now();
    let during = verdicts(&mut m, &unique_keys(90, 36), "during");
    assert!(during.iter().all(|&v| v == LookupVerdict::Miss));
    assert!(
        start.elapsed() < Duration::from_secs(8),
        "fails within the deadline: {:?}",
        start.elapsed()
    );
    let stats = m.stats();
    assert!(stats.errors + stats.timeouts > 0, "{stats:?}");

    cluster.nodes[1].restart();
    cluster.wait_ok();
    let recovered = Instant::now();
    loop {
        if rt.block_on(tier.store_many(&present, None)).is_ok() {
            break;
        }
        assert!(
            recovered.elapsed() < Duration::from_secs(20),
            "the cluster tier did not recover"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(verdicts(&mut m, &keys, "after"), expected);
    m.shutdown();
}
