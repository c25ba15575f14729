//! The batch forms against real servers: what a partial failure answers
//! (keys absent or removed behind the tier's back, one cluster master
//! killed or stopped), the TTL and key prefix on batch stores, and many
//! keys over every master of a cluster. Round trips at 2 MiB and odd sizes
//! on a single node, over TLS and on a cluster are the conformance suite's
//! (`tests/conformance.rs`).

use kvtier_test_services as support;

use std::collections::HashSet;
use std::process::Command;
use std::sync::Arc;

use kvtier_core::testkit::{self, block_of, unique_keys};
use kvtier_core::{BlockOutcome, BlockStore, OffloadKey, TierErrorKind};
use kvtier_redis::{RedisConfig, RedisTier, key_slot};
use support::PrivateCluster;

/// The two private-cluster tests run one at a time: each times a master's
/// silence or death against the response timeout, and two clusters of
/// three servers beside the other tests crowd a 2-core machine enough for a
/// running master to miss the deadline too.
static ONE_CLUSTER_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const PREFIX: &str = "kvtier-batch:";

/// Blocks of `len` bytes for `keys`.
fn blocks(keys: &[OffloadKey], len: usize) -> Vec<(OffloadKey, Vec<u8>)> {
    keys.iter().map(|k| (k.clone(), block_of(k, len))).collect()
}

/// Loads `keys` into regions of `len` bytes (filled with 0xEE first).
async fn load(
    tier: &RedisTier,
    keys: &[OffloadKey],
    len: usize,
) -> (Vec<BlockOutcome>, Vec<Vec<u8>>) {
    testkit::load_regions(tier, keys, &vec![len; keys.len()], 0xEE).await
}

/// Sends `signal` (`STOP`: up but silent; `CONT`) to process `pid`.
fn signal(pid: &str, signal: &str) {
    let sent = Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid)
        .status()
        .unwrap();
    assert!(sent.success(), "kill -{signal} {pid}: {sent}");
}

fn redis_cli(port: u16, args: &[&str]) -> String {
    let out = Command::new("redis-cli")
        .arg("-p")
        .arg(port.to_string())
        .args(args)
        .output()
        .expect("redis-cli runs");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

#[tokio::test]
async fn absent_and_removed_keys_answer_absent_the_rest_load() {
    let Some(url) = support::service(
        "KVTIER_REDIS_URL",
        "absent_and_removed_keys_answer_absent_the_rest_load",
    ) else {
        return;
    };
    let config = RedisConfig {
        key_prefix: PREFIX.into(),
        ..RedisConfig::from_url(url)
    };
    let tier = RedisTier::new(config.clone()).unwrap();
    let other = RedisTier::new(config).unwrap();
    let keys = unique_keys(12, 36);
    let stored = blocks(&keys[..8], 300_001);
    let outcomes = tier.store_batch(&testkit::store_pairs(&stored)).await;
    assert!(outcomes.iter().all(BlockOutcome::is_done), "{outcomes:?}");
    // Removed behind the tier's back: by another client.
    other.remove(&keys[2]).await.unwrap();
    other.remove(&keys[5]).await.unwrap();
    let (outcomes, regions) = load(&tier, &keys, 300_001).await;
    for (i, outcome) in outcomes.iter().enumerate() {
        if i >= 8 || i == 2 || i == 5 {
            assert!(
                matches!(outcome, BlockOutcome::Absent),
                "key {i}: {outcome:?}"
            );
            assert!(
                regions[i].iter().all(|&b| b == 0xEE),
                "key {i}: region touched"
            );
        } else {
            assert!(outcome.is_done(), "key {i}: {outcome:?}");
            assert_eq!(regions[i], stored[i].1, "key {i}");
        }
    }
}

#[tokio::test]
async fn batch_stores_keep_the_prefix_and_the_ttl() {
    let Some(url) = support::service(
        "KVTIER_REDIS_URL",
        "batch_stores_keep_the_prefix_and_the_ttl",
    ) else {
        return;
    };
    let tier = RedisTier::new(RedisConfig {
        key_prefix: "kvtier-batch-ttl:".into(),
        ttl_ms: Some(60_000),
        ..RedisConfig::from_url(url.clone())
    })
    .unwrap();
    let keys = unique_keys(3, 36);
    let stored = blocks(&keys, 4097);
    let outcomes = tier.store_batch(&testkit::store_pairs(&stored)).await;
    assert!(outcomes.iter().all(BlockOutcome::is_done), "{outcomes:?}");
    // A raw client sees the names and their time to live.
    let mut raw = redis::Client::open(url.as_str())
        .unwrap()
        .get_connection()
        .unwrap();
    for key in &keys {
        let mut name = b"kvtier-batch-ttl:".to_vec();
        name.extend_from_slice(key.as_bytes());
        let pttl: i64 = redis::cmd("PTTL").arg(&name).query(&mut raw).unwrap();
        assert!((1..=60_000).contains(&pttl), "PTTL {pttl}");
        let len: i64 = redis::cmd("STRLEN").arg(&name).query(&mut raw).unwrap();
        assert_eq!(len, 4097);
    }
}

/// A private cluster whose nodes keep answering for their own slots when
/// another master is down (`cluster-require-full-coverage no`), and the
/// index of the node holding each key's slot.
struct Cluster {
    cluster: PrivateCluster,
}

impl Cluster {
    fn start(test: &str) -> Option<Self> {
        let redis = support::binary("redis-server", test)?;
        let cluster = PrivateCluster::start(&redis);
        for node in &cluster.nodes {
            redis_cli(
                node.port,
                &["CONFIG", "SET", "cluster-require-full-coverage", "no"],
            );
        }
        Some(Self { cluster })
    }

    /// A tier over it, failing fast: a timeout long enough for a debug
    /// build on a busy machine to move a batch's chunks.
    fn tier(&self) -> RedisTier {
        RedisTier::new(RedisConfig {
            key_prefix: PREFIX.into(),
            connect_timeout_ms: 200,
            // Wide enough for a running master's 8 MiB pipeline on a loaded
            // 2-core machine (1.5 s timed one out while other builds ran);
            // a silent master still fails within it.
            response_timeout_ms: 3000,
            ..RedisConfig::cluster(self.cluster.urls())
        })
        .unwrap()
    }

    /// The process id of node `node`, from its INFO (ask it before
    /// stopping the node: a stopped node answers nothing).
    fn pid(&self, node: usize) -> String {
        redis_cli(self.cluster.nodes[node].port, &["INFO", "server"])
            .lines()
            .find_map(|l| l.strip_prefix("process_id:").map(|p| p.trim().to_owned()))
            .expect("INFO names the pid")
    }

    /// The node (index) owning the slot of each key's name in `tier`, from
    /// CLUSTER SLOTS.
    fn owners(&self, tier: &RedisTier, keys: &[OffloadKey]) -> Vec<usize> {
        let slots = redis_cli(self.cluster.nodes[0].port, &["CLUSTER", "SLOTS"]);
        // redis-cli prints each range as: start, end, host, port, id, ...
        let lines: Vec<&str> = slots.lines().collect();
        let mut ranges = Vec::new();
        let ports: Vec<String> = self
            .cluster
            .nodes
            .iter()
            .map(|n| n.port.to_string())
            .collect();
        let mut i = 0;
        while i + 3 < lines.len() {
            if let (Ok(start), Ok(end), Some(node)) = (
                lines[i].parse::<u16>(),
                lines[i + 1].parse::<u16>(),
                ports.iter().position(|p| p == lines[i + 3]),
            ) {
                ranges.push((start, end, node));
                i += 4;
                continue;
            }
            i += 1;
        }
        keys.iter()
            .map(|key| {
                let slot = key_slot(&tier.key_name(key));
                ranges
                    .iter()
                    .find(|&&(s, e, _)| s <= slot && slot <= e)
                    .map(|&(_, _, node)| node)
                    .expect("every slot has a master")
            })
            .collect()
    }
}

/// Checks a batch against the owners of its keys: keys on `down` failed
/// (with an error that is not a miss), every other key done.
fn only_the_down_node_fails(outcomes: &[BlockOutcome], owners: &[usize], down: usize, what: &str) {
    for (i, (outcome, &owner)) in outcomes.iter().zip(owners).enumerate() {
        if owner == down {
            let err = outcome
                .error()
                .unwrap_or_else(|| panic!("{what}: key {i} on the down master: {outcome:?}"));
            assert!(
                matches!(
                    err.kind(),
                    TierErrorKind::Unavailable | TierErrorKind::Timeout
                ),
                "{what}: key {i}: {err}"
            );
        } else {
            assert!(
                outcome.is_done(),
                "{what}: key {i} on a live master: {outcome:?}"
            );
        }
    }
}

/// One master killed: a store and a load of keys over every master answer
/// done for exactly the keys of the live masters (byte for byte), failed
/// for the killed master's.
#[tokio::test]
async fn a_killed_cluster_master_fails_exactly_its_own_keys() {
    let test = "a_killed_cluster_master_fails_exactly_its_own_keys";
    let _one = ONE_CLUSTER_AT_A_TIME.lock().await;
    let Some(mut cluster) = Cluster::start(test) else {
        return;
    };
    let tier = cluster.tier();
    let keys = unique_keys(48, 36);
    let owners = cluster.owners(&tier, &keys);
    assert_eq!(
        owners.iter().collect::<HashSet<_>>().len(),
        3,
        "keys on every master"
    );
    let before = blocks(&keys[..24], 65_537);
    let outcomes = tier.store_batch(&testkit::store_pairs(&before)).await;
    assert!(outcomes.iter().all(BlockOutcome::is_done), "{outcomes:?}");

    cluster.cluster.nodes[1].kill();
    let after = blocks(&keys[24..], 65_537);
    let outcomes = tier.store_batch(&testkit::store_pairs(&after)).await;
    only_the_down_node_fails(&outcomes, &owners[24..], 1, "store");
    let (outcomes, regions) = load(&tier, &keys, 65_537).await;
    only_the_down_node_fails(&outcomes, &owners, 1, "load");
    for (i, outcome) in outcomes.iter().enumerate() {
        if outcome.is_done() {
            assert_eq!(regions[i], block_of(&keys[i], 65_537), "key {i}");
        }
    }
}

/// One master stopped (SIGSTOP: up, but silent) while a batch runs: its
/// keys fail as timeouts within the response timeout, every other key is
/// done; once it runs again, every key answered done loads back.
#[tokio::test]
async fn a_stopped_cluster_master_fails_exactly_its_own_keys() {
    let test = "a_stopped_cluster_master_fails_exactly_its_own_keys";
    let _one = ONE_CLUSTER_AT_A_TIME.lock().await;
    let Some(cluster) = Cluster::start(test) else {
        return;
    };
    let tier = Arc::new(cluster.tier());
    let keys = unique_keys(48, 36);
    let owners = cluster.owners(&tier, &keys);
    // Connections made and the slot map cached first, by a batch over every
    // master. (An empty batch, as this test had, does neither: the batch
    // below then asked for the slot map itself, racing the SIGSTOP, and
    // when the cluster client sent CLUSTER SLOTS to the stopped master the
    // whole batch timed out. That was the "running masters time out too"
    // seen in about one run in three.)
    let warm: Vec<(OffloadKey, Vec<u8>)> =
        keys.iter().map(|k| (k.clone(), b"warm".to_vec())).collect();
    let warmed = tier.store_batch(&testkit::store_pairs(&warm)).await;
    assert!(warmed.iter().all(BlockOutcome::is_done), "{warmed:?}");
    let pid = cluster.pid(2);
    let stored = blocks(&keys, 1 << 20);
    let batch = {
        let tier = Arc::clone(&tier);
        let stored = stored.clone();
        tokio::spawn(async move { tier.store_batch(&testkit::store_pairs(&stored)).await })
    };
    signal(&pid, "STOP");
    let started = std::time::Instant::now();
    let outcomes = batch.await.unwrap();
    let took = started.elapsed();
    signal(&pid, "CONT");
    // The stopped master may have taken some of its keys before the stop:
    // those answer done or failed. Every key of the running masters is
    // done: a timeout is not asked again key by key, so nothing sends the
    // cluster client into a slot refresh that would hold up their
    // pipelines.
    let mut running_done = 0;
    for (i, (outcome, &owner)) in outcomes.iter().zip(&owners).enumerate() {
        if owner != 2 {
            match outcome {
                BlockOutcome::Done => running_done += 1,
                other => panic!("key {i} on a running master: {other:?}"),
            }
        }
    }
    eprintln!("{running_done} keys of the running masters done");
    let failed = outcomes.iter().filter(|o| !o.is_done()).count();
    eprintln!("{failed} keys failed while master 2 was stopped, in {took:?}");
    assert!(took < std::time::Duration::from_secs(10), "took {took:?}");
    // Every key answered done is stored, byte for byte.
    let (loaded, regions) = load(&tier, &keys, 1 << 20).await;
    for (i, outcome) in outcomes.iter().enumerate() {
        if outcome.is_done() {
            assert!(loaded[i].is_done(), "key {i}: {:?}", loaded[i]);
            assert!(regions[i] == stored[i].1, "key {i} stored wrong");
        }
    }
}

/// A tier whose slot map is not cached yet (its first batch) while one
/// master is silent: the map comes from a node that answers, and the
/// running masters' keys are stored. Eight fresh tiers in turn, each
/// connecting and fetching its map while the master is stopped.
#[tokio::test]
async fn a_slot_map_fetched_while_a_master_is_silent_serves_the_running_masters() {
    let test = "a_slot_map_fetched_while_a_master_is_silent_serves_the_running_masters";
    let _one = ONE_CLUSTER_AT_A_TIME.lock().await;
    let Some(cluster) = Cluster::start(test) else {
        return;
    };
    let keys = unique_keys(64, 36);
    // Names as every tier over it gives them (same configuration).
    let owners = cluster.owners(&cluster.tier(), &keys);
    let running: Vec<OffloadKey> = keys
        .iter()
        .zip(&owners)
        .filter(|&(_, &owner)| owner != 2)
        .map(|(k, _)| k.clone())
        .collect();
    assert!(
        running.len() >= 20,
        "{} keys on running masters",
        running.len()
    );
    let stored = blocks(&running, 4096);
    let pid = cluster.pid(2);
    signal(&pid, "STOP");
    let mut failures = Vec::new();
    for attempt in 0..8 {
        let tier = RedisTier::new(RedisConfig {
            key_prefix: PREFIX.into(),
            connect_timeout_ms: 200,
            response_timeout_ms: 1000,
            ..RedisConfig::cluster(cluster.cluster.urls())
        })
        .unwrap();
        let outcomes = tier.store_batch(&testkit::store_pairs(&stored)).await;
        if let Some(failed) = outcomes.iter().find(|o| !o.is_done()) {
            failures.push(format!("attempt {attempt}: {failed:?}"));
        }
    }
    signal(&pid, "CONT");
    assert!(
        failures.is_empty(),
        "{} of 8 fresh tiers failed: {failures:#?}",
        failures.len()
    );
}

/// A batch of many keys over every master (more than a pipeline chunk per
/// master) round-trips, and loads into regions of the wrong length fail
/// only those keys.
#[tokio::test]
async fn many_keys_over_every_master_round_trip() {
    let Some(urls) = support::service(
        "KVTIER_REDIS_CLUSTER_URLS",
        "many_keys_over_every_master_round_trip",
    ) else {
        return;
    };
    let tier = RedisTier::new(RedisConfig {
        key_prefix: PREFIX.into(),
        pipeline_chunk: 16,
        ..RedisConfig::cluster(urls.split(','))
    })
    .unwrap();
    let keys = unique_keys(300, 36);
    let stored: Vec<(OffloadKey, Vec<u8>)> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| (k.clone(), block_of(k, 1 + i * 37)))
        .collect();
    let outcomes = tier.store_batch(&testkit::store_pairs(&stored)).await;
    assert!(outcomes.iter().all(BlockOutcome::is_done));
    let lens: Vec<usize> = stored
        .iter()
        .enumerate()
        .map(|(i, (_, b))| if i % 50 == 7 { b.len() + 1 } else { b.len() })
        .collect();
    let (outcomes, regions) = testkit::load_regions(&tier, &keys, &lens, 0).await;
    for (i, outcome) in outcomes.iter().enumerate() {
        if i % 50 == 7 {
            assert_eq!(
                outcome.error().map(|e| e.kind()),
                Some(TierErrorKind::LengthMismatch),
                "key {i}"
            );
            assert!(
                regions[i].iter().all(|&b| b == 0),
                "key {i}: region touched"
            );
        } else {
            assert!(outcome.is_done(), "key {i}: {outcome:?}");
            assert!(regions[i] == stored[i].1, "key {i}");
        }
    }
}
