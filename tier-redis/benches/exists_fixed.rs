//! A fixed amount of lookup work on a real Redis, for comparing two
//! versions of the client by instructions, which the servers sharing the
//! machine's cores do not disturb:
//!
//! ```text
//! source .services/env            # a running cluster (scripts/services.sh start)
//! cargo bench -p kvtier-redis --bench exists_fixed --no-run
//! for n in 50 150; do KVTIER_BENCH_BATCHES=$n valgrind --tool=callgrind \
//!     --callgrind-out-file=/tmp/cg.$n target/release/deps/exists_fixed-<hash>; done
//! ```
//!
//! The instructions of the client per key are the difference of the two
//! totals over the difference of keys looked up (`(I(150) - I(50)) /
//! (100 × 1,024)`): the set-up (connections, the keys made and stored)
//! is the same whatever the batches and cancels out; what is left is the
//! tier's work plus a clone of each key into its batch. Batches of 1,024
//! keys of 36 bytes (half present, taken in turn from two pools of 20,000),
//! eight at a time, go through `RedisTier::exists_many` on the cluster of
//! `KVTIER_REDIS_CLUSTER_URLS`, or on `KVTIER_REDIS_URL` without it. The
//! stored keys are removed at the end (and expire after ten minutes if a
//! run stops early). Prints the rate, and the process's CPU time per key
//! (the client's; the servers are other processes). Counts from one pair
//! of runs move a little with timing (how many reads a reply takes): for
//! an A/B, run each side more than once.

use std::time::Instant;

use kvtier_core::testkit::unique_keys;
use kvtier_core::{BlockStore, OffloadKey};
use kvtier_redis::{RedisConfig, RedisTier};

const BATCH: usize = 1024;
const IN_FLIGHT: usize = 8;
const KEY_LEN: usize = 36;

/// This process's CPU time in seconds (every thread).
fn process_cpu_s() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out-pointer to a timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // `cargo bench` runs every bench target with `--bench`; nothing to do
    // without a server.
    let set = |name| std::env::var(name).ok().filter(|v: &String| !v.is_empty());
    let config = match (set("KVTIER_REDIS_CLUSTER_URLS"), set("KVTIER_REDIS_URL")) {
        (Some(urls), _) => RedisConfig::cluster(urls.split(',')),
        (_, Some(url)) => RedisConfig::from_url(url),
        _ => {
            eprintln!(
                "exists_fixed: set KVTIER_REDIS_CLUSTER_URLS or KVTIER_REDIS_URL (source .services/env)"
            );
            return Ok(());
        }
    };
    let batches: usize = match set("KVTIER_BENCH_BATCHES") {
        None => 200,
        Some(v) => v
            .parse()
            .ok()
            .filter(|&n| n > 0)
            .ok_or_else(|| format!("KVTIER_BENCH_BATCHES is a positive count, not {v:?}"))?,
    };
    let tier = RedisTier::new(RedisConfig {
        key_prefix: format!("kvtier-exists-fixed:{}:", std::process::id()),
        // Room for callgrind's slowdown.
        response_timeout_ms: 60_000,
        // Gone by themselves if a run stops before removing them.
        ttl_ms: Some(600_000),
        ..config
    })?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    // Keys new to the server, half of them stored. The same set-up
    // whatever the batches, so that it cancels out.
    const POOL: usize = 20_000;
    let blocks: Vec<(OffloadKey, Vec<u8>)> = unique_keys(POOL, KEY_LEN)
        .into_iter()
        .map(|k| (k, b"x".to_vec()))
        .collect();
    let absent = unique_keys(POOL, KEY_LEN);
    for part in blocks.chunks(2_000) {
        rt.block_on(tier.store_many(part))?;
    }
    let lookups: Vec<Vec<OffloadKey>> = (0..batches)
        .map(|b| {
            (0..BATCH)
                .map(|j| {
                    let i = (b * BATCH + j) / 2 % POOL;
                    if j % 2 == 0 { &blocks[i].0 } else { &absent[i] }.clone()
                })
                .collect()
        })
        .collect();
    let (wall, cpu) = (Instant::now(), process_cpu_s());
    let found = rt.block_on(async {
        let mut found = 0usize;
        for group in lookups.chunks(IN_FLIGHT) {
            let answers =
                futures_util::future::join_all(group.iter().map(|keys| tier.exists_many(keys)))
                    .await;
            for answer in answers {
                found += answer?.iter().filter(|&&f| f).count();
            }
        }
        Ok::<_, kvtier_redis::RedisTierError>(found)
    })?;
    let (wall, cpu) = (wall.elapsed().as_secs_f64(), process_cpu_s() - cpu);
    let keys = (batches * BATCH) as f64;
    assert_eq!(
        found,
        batches * BATCH / 2,
        "every present key found, no other"
    );
    println!(
        "exists_fixed: {batches} batches of {BATCH}: {:.0} keys/s, client CPU {:.3} µs per key",
        keys / wall,
        cpu / keys * 1e6
    );
    let keys: Vec<OffloadKey> = blocks.into_iter().map(|(k, _)| k).collect();
    for part in keys.chunks(2_000) {
        rt.block_on(tier.remove_many(part))?;
    }
    Ok(())
}
