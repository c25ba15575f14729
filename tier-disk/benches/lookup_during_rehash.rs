//! Lookup latency while stores trigger a rehash (issue 12 item 3), without
//! building the whole kvbench (`kvbench w5` reports the same figures as
//! `lookup_during_rehash_*`):
//!
//! ```text
//! cargo bench -p kvtier-disk --bench lookup_during_rehash
//! ```
//!
//! `KVTIER_BENCH_KEYS` keys (default 1,000,000) in an index at about 48 %
//! load take new keys on a writer thread until the index has rehashed (past
//! 70 % load) and a tenth as many after the swap; meanwhile this thread
//! looks up 1,024-key batches (half present) on a fixed schedule, one every
//! 2 ms. Each latency counts from the lookup's scheduled start, so a
//! lookup held up by the writer, and every one queued behind it, counts in
//! full (no coordinated omission). Every answer is checked. The same
//! schedule without the writer, for 2 s before it starts, is the baseline
//! (`no_writer_*`): on a loaded machine both include time spent waiting for
//! a CPU. Prints one JSON line.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{batches, filled_tier, key, key_count};

const INTERVAL: Duration = Duration::from_millis(2);

fn quantile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn main() {
    // `cargo bench` passes `--bench`; a filter that is not ours skips the run.
    if std::env::args()
        .skip(1)
        .any(|a| !a.starts_with('-') && !"lookup_during_rehash".contains(&a))
    {
        return;
    }
    let n = key_count(1_000_000);
    let dir = tempfile::tempdir().expect("temp dir");
    let fill = Instant::now();
    let tier = Arc::new(filled_tier(dir.path(), n));
    let fill_s = fill.elapsed().as_secs_f64();
    let batches = batches(n, 256);
    // The baseline, in the same run: the same schedule, no writer.
    let idle_until = Instant::now() + Duration::from_secs(2);
    let (idle, _) = paced(&tier, &batches, || Instant::now() >= idle_until);
    let done = Arc::new(AtomicBool::new(false));
    let writer = {
        let (tier, done) = (Arc::clone(&tier), Arc::clone(&done));
        std::thread::spawn(move || {
            // Far above the absent keys of the batches (n..2n).
            const FIRST: u64 = 1 << 40;
            let before = tier.stats().rehashes;
            let (mut id, mut end) = (FIRST, None);
            loop {
                tier.store_blocking(&key(id), &id.to_le_bytes())
                    .expect("store during the rehash");
                id += 1;
                match end {
                    None if id.is_multiple_of(1024) && tier.stats().rehashes > before => {
                        end = Some(id + n / 10);
                    }
                    Some(end) if id >= end => break,
                    _ => {}
                }
            }
            done.store(true, Ordering::Release);
            id - FIRST
        })
    };
    let (samples, service) = paced(&tier, &batches, || done.load(Ordering::Acquire));
    let stores = writer.join().expect("writer thread");
    println!(
        "{{\"bench\":\"lookup_during_rehash\",\"keys\":{n},\"fill_s\":{fill_s:.3},\"interval_us\":{},\"lookups\":{},\"stores\":{stores},\"rehashes\":{},\"p50_us\":{:.1},\"p99_us\":{:.1},\"p999_us\":{:.1},\"max_us\":{:.1},\"service_p99_us\":{:.1},\"service_max_us\":{:.1},\"no_writer_p99_us\":{:.1},\"no_writer_max_us\":{:.1}}}",
        INTERVAL.as_micros(),
        samples.len(),
        tier.stats().rehashes,
        quantile(&samples, 0.5),
        quantile(&samples, 0.99),
        quantile(&samples, 0.999),
        quantile(&samples, 1.0),
        quantile(&service, 0.99),
        quantile(&service, 1.0),
        quantile(&idle, 0.99),
        quantile(&idle, 1.0),
    );
}

/// Looks up `batches` in turn, one every [`INTERVAL`], until `stop`; returns
/// the latencies from each scheduled start and from each actual start, in
/// microseconds, sorted. Checks every answer.
fn paced(
    tier: &kvtier_disk::DiskTier,
    batches: &[Vec<kvtier_core::OffloadKey>],
    stop: impl Fn() -> bool,
) -> (Vec<f64>, Vec<f64>) {
    let mut samples: Vec<f64> = Vec::new();
    // From the lookup's actual start: what the lookup itself took.
    let mut service: Vec<f64> = Vec::new();
    let start = Instant::now();
    while !stop() {
        let due = start + INTERVAL * samples.len() as u32;
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        let batch = &batches[samples.len() % batches.len()];
        let began = Instant::now();
        let found = tier.contains_many(batch).expect("lookup");
        service.push(began.elapsed().as_secs_f64() * 1e6);
        samples.push(due.elapsed().as_secs_f64() * 1e6);
        for (j, hit) in found.iter().enumerate() {
            assert_eq!(*hit, j % 2 == 0, "a lookup answered wrong");
        }
    }
    samples.sort_by(f64::total_cmp);
    service.sort_by(f64::total_cmp);
    (samples, service)
}
