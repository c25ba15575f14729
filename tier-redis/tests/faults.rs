//! Faults against private servers: a server killed mid-run (lookups resolve
//! as counted errors within the manager's deadline, no panic), then
//! restarted (the same tier recovers without being rebuilt); the same for
//! one node of a 3-master cluster.

use kvtier_test_services as support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_core::testkit::{self, unique_keys};
use kvtier_core::{AsyncLookupManager, BlockStore, LookupVerdict, ManagerConfig, OffloadKey};
use kvtier_redis::{RedisConfig, RedisTier};
use support::{PrivateCluster, PrivateServer};

fn manager_config() -> ManagerConfig {
    ManagerConfig {
        call_timeout_ms: 2_000,
        failure_backoff_ms: 50,
        ..ManagerConfig::named("redis")
    }
}

/// Looks up `keys` for a fresh request until every key has a verdict.
fn verdicts(
    m: &mut AsyncLookupManager<RedisTier>,
    keys: &[OffloadKey],
    req: &str,
) -> Vec<LookupVerdict> {
    testkit::verdicts(m, keys, req, Duration::from_secs(10))
}

fn fast(config: RedisConfig) -> RedisConfig {
    RedisConfig {
        connect_timeout_ms: 200,
        response_timeout_ms: 500,
        key_prefix: "kvtier-fault:".into(),
        ..config
    }
}

/// What an outage must look like: each test's own bounds.
struct Outage {
    /// Keys stored before (every other one) and checked before and after.
    keys: usize,
    /// New keys looked up during the outage: all must answer miss.
    fresh: usize,
    /// The lookups during the outage answer within this.
    fail_within: Duration,
    /// At least this many keys counted as errors or timeouts, not misses.
    min_errors: u64,
    /// Stores work again within this after the restart.
    recover_within: Duration,
}

/// Stores every other key and checks the verdicts; `kill`s the server;
/// checks that fresh lookups fail fast as counted errors; `restart`s it;
/// stores again once the tier reconnects, and checks that the same tier and
/// manager answer right again.
fn outage_and_recovery<S>(
    server: &mut S,
    tier: Arc<RedisTier>,
    kill: fn(&mut S),
    restart: fn(&mut S),
    o: Outage,
) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let keys = unique_keys(o.keys, 36);
    let present: Vec<(OffloadKey, Vec<u8>)> = keys
        .iter()
        .step_by(2)
        .map(|k| (k.clone(), b"v".to_vec()))
        .collect();
    rt.block_on(tier.store_many(&present)).unwrap();
    let mut m = tier.manager(manager_config()).unwrap();
    let expected: Vec<LookupVerdict> = (0..o.keys)
        .map(|i| {
            if i % 2 == 0 {
                LookupVerdict::Hit
            } else {
                LookupVerdict::Miss
            }
        })
        .collect();
    assert_eq!(verdicts(&mut m, &keys, "before"), expected);

    kill(server);
    let start = Instant::now();
    let during = verdicts(&mut m, &unique_keys(o.fresh, 36), "during");
    assert!(
        during.iter().all(|&v| v == LookupVerdict::Miss),
        "lookups during the outage answer miss"
    );
    assert!(
        start.elapsed() < o.fail_within,
        "fails fast: {:?}",
        start.elapsed()
    );
    let stats = m.stats();
    assert!(
        stats.errors + stats.timeouts >= o.min_errors,
        "counted as errors, not misses: {stats:?}"
    );

    // The restarted server keeps nothing on disk: store again.
    restart(server);
    let recovered = Instant::now();
    while rt.block_on(tier.store_many(&present)).is_err() {
        assert!(
            recovered.elapsed() < o.recover_within,
            "the tier did not reconnect"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(verdicts(&mut m, &keys, "after"), expected);
    // The lean path is back too (it pauses for a second after trouble and
    // drops its dead connections): new lookups go through it again.
    let lean_before = tier.pipeline_stats().lean;
    let back = Instant::now();
    while tier.pipeline_stats().lean == lean_before {
        assert!(
            back.elapsed() < Duration::from_secs(10),
            "the lean path never resumed: {:?}",
            tier.pipeline_stats()
        );
        assert!(rt.block_on(tier.exists_many(&keys)).is_ok());
        std::thread::sleep(Duration::from_millis(100));
    }
    m.shutdown();
}

#[test]
fn a_killed_server_gives_counted_errors_and_the_tier_recovers_after_restart() {
    let Some(redis) = support::binary(
        "redis-server",
        "a_killed_server_gives_counted_errors_and_the_tier_recovers_after_restart",
    ) else {
        return;
    };
    let mut server = PrivateServer::redis(redis);
    let tier = Arc::new(RedisTier::new(fast(RedisConfig::from_url(server.url()))).unwrap());
    outage_and_recovery(
        &mut server,
        tier,
        PrivateServer::kill,
        PrivateServer::start,
        Outage {
            keys: 64,
            fresh: 32,
            fail_within: Duration::from_secs(5),
            min_errors: 32,
            recover_within: Duration::from_secs(10),
        },
    );
}

#[test]
fn a_killed_cluster_node_gives_counted_errors_and_the_cluster_tier_recovers() {
    let Some(redis) = support::binary(
        "redis-server",
        "a_killed_cluster_node_gives_counted_errors_and_the_cluster_tier_recovers",
    ) else {
        return;
    };
    let mut cluster = PrivateCluster::start(&redis);
    let tier = Arc::new(RedisTier::new(fast(RedisConfig::cluster(cluster.urls()))).unwrap());
    outage_and_recovery(
        &mut cluster,
        tier,
        |c| c.nodes[1].kill(),
        |c| {
            c.nodes[1].start();
            c.wait_ok();
        },
        Outage {
            keys: 90,
            fresh: 90,
            fail_within: Duration::from_secs(8),
            min_errors: 1,
            recover_within: Duration::from_secs(20),
        },
    );
}
