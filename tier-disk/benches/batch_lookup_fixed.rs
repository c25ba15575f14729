//! A fixed amount of batch-lookup work, for instruction counts that do not
//! depend on timing:
//!
//! ```text
//! valgrind --tool=callgrind --toggle-collect='*DiskTier::contains_many*' \
//!     target/release/deps/batch_lookup_fixed-<hash>
//! ```
//!
//! 100 batches of 1,024 keys (half present) over `KVTIER_BENCH_KEYS`
//! (default 100,000) keys; prints the hit count so the work is not elided.

mod common;

fn main() {
    let n = common::key_count(100_000);
    let dir = tempfile::tempdir().expect("bench directory");
    let tier = common::filled_tier(dir.path(), n);
    let batches = common::batches(n, 100);
    let mut hits = 0usize;
    for batch in &batches {
        let found = tier.contains_many(batch).expect("right key size");
        hits += found.iter().filter(|&&f| f).count();
    }
    assert_eq!(hits, batches.len() * common::BATCH / 2, "exact lookups");
    println!(
        "batch_lookup_fixed: {hits} hits in {} batches of {n} keys",
        batches.len()
    );
}
