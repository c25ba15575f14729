//! A fixed amount of batch-lookup work, for comparisons that do not depend
//! on what else runs on the machine:
//!
//! ```text
//! valgrind --tool=callgrind --toggle-collect='*DiskTier::contains_many*' \
//!     target/release/deps/batch_lookup_fixed-<hash>
//! ```
//!
//! 100 batches of 1,024 keys (half present) over `KVTIER_BENCH_KEYS`
//! (default 100,000) keys, twice (a fresh mapping, then a mapped one), then
//! the same batches on an in-memory `HashSet`.
//! Prints both rates by wall time and by this thread's CPU time (which a
//! loaded machine disturbs less: time spent descheduled is not counted).

mod common;

use std::collections::HashSet;
use std::hint::black_box;
use std::time::Instant;

use kvtier_core::OffloadKey;

/// This thread's CPU time in seconds.
fn thread_cpu_s() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out-pointer to a timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// Page faults of this thread so far (minor and major).
fn faults() -> i64 {
    // SAFETY: an all-zero rusage is valid, and getrusage fills it.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: a valid out-pointer to an rusage.
    unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut usage) };
    usage.ru_minflt + usage.ru_majflt
}

/// Runs `f` over every batch; returns (hits, keys/s by wall, keys/s by CPU).
fn rate(
    batches: &[Vec<OffloadKey>],
    mut f: impl FnMut(&[OffloadKey]) -> Vec<bool>,
) -> (usize, f64, f64) {
    let (wall, cpu) = (Instant::now(), thread_cpu_s());
    let mut hits = 0;
    for batch in batches {
        hits += black_box(f(batch)).iter().filter(|&&found| found).count();
    }
    let keys = (batches.len() * common::BATCH) as f64;
    (
        hits,
        keys / wall.elapsed().as_secs_f64(),
        keys / (thread_cpu_s() - cpu),
    )
}

fn main() {
    let n = common::key_count(100_000);
    let dir = tempfile::tempdir().expect("bench directory");
    let tier = common::filled_tier(dir.path(), n);
    let batches = common::batches(n, 100);
    // First pass: a fresh mapping (every page faults in once), as kvbench
    // w5 measures; second pass: the same batches again, pages mapped.
    let cold_faults = faults();
    let (hits, cold_wall, cold_cpu) =
        rate(&batches, |b| tier.contains_many(b).expect("right key size"));
    assert_eq!(hits, batches.len() * common::BATCH / 2, "exact lookups");
    let cold_faults = faults() - cold_faults;
    let (_, disk_wall, disk_cpu) =
        rate(&batches, |b| tier.contains_many(b).expect("right key size"));
    drop(tier);
    let set: HashSet<OffloadKey> = (0..n).map(common::key).collect();
    let (set_hits, set_wall, set_cpu) =
        rate(&batches, |b| b.iter().map(|k| set.contains(k)).collect());
    assert_eq!(set_hits, hits, "same answers");
    println!(
        "batch_lookup_fixed: {n} keys, {} batches: disk first pass {:.2}M keys/s wall \
         {:.2}M cpu ({cold_faults} page faults), again {:.2}M wall {:.2}M cpu; HashSet {:.2}M wall {:.2}M cpu; \
         disk (again)/HashSet {:.2} wall {:.2} cpu",
        batches.len(),
        cold_wall / 1e6,
        cold_cpu / 1e6,
        disk_wall / 1e6,
        disk_cpu / 1e6,
        set_wall / 1e6,
        set_cpu / 1e6,
        disk_wall / set_wall,
        disk_cpu / set_cpu,
    );
}
