//! `disk` (alias `w5`; JSON `"workload": "w5"`), the disk tier: batch
//! lookups next to a `HashSet` and to one `stat()` per file, reopen time,
//! lookup latency while stores trigger a rehash, and store throughput next
//! to a raw write.

use std::hint::black_box;
use std::sync::Arc;
use std::time::{Duration, Instant};

use examples::{Rng, key_from_id, micros, percentile};
use kvtier_core::OffloadKey;
use kvtier_disk::{DiskConfig, DiskTier, FsyncPolicy};
use serde_json::{Value, json};

use crate::common::round3;
use crate::{Cli, Failure};

fn bench_dir(cli: &Cli, name: &str) -> Result<tempfile::TempDir, Failure> {
    let mut builder = tempfile::Builder::new();
    builder.prefix(name);
    Ok(match &cli.dir {
        Some(dir) => builder.tempdir_in(dir)?,
        None => builder.tempdir()?,
    })
}

fn disk_config(path: &std::path::Path, fsync: FsyncPolicy) -> DiskConfig {
    DiskConfig {
        capacity_bytes: 8 << 30,
        segment_bytes: 256 << 20,
        fsync,
        ..DiskConfig::new(path)
    }
}

/// Stores `n` keys with 16-byte payloads, then closes cleanly.
fn fill_disk(path: &std::path::Path, n: u64) -> Result<(), Failure> {
    let tier = DiskTier::open(DiskConfig {
        initial_slots: n * 2,
        ..disk_config(path, FsyncPolicy::Never)
    })?;
    for i in 0..n {
        tier.store_blocking(&key_from_id(i, 36), &i.to_le_bytes().repeat(2))?;
    }
    tier.close()?;
    Ok(())
}

/// Median of `runs` timings of `f`, in milliseconds.
fn median_ms(runs: usize, mut f: impl FnMut() -> Result<(), Failure>) -> Result<f64, Failure> {
    let mut samples = Vec::with_capacity(runs);
    for _ in 0..runs {
        let t = Instant::now();
        f()?;
        samples.push(t.elapsed().as_secs_f64() * 1e3);
    }
    Ok(percentile(&samples, 0.5))
}

/// disk: the disk tier. Lookups of 1,024-key batches (half present) over a
/// 1M-key index next to an in-memory HashSet and to one stat() per key on
/// one-file-per-block storage (vLLM's file-system tier); reopen time at 10k
/// and 1M keys; lookup latency while stores grow the 1M-key index past a
/// rehash; store throughput of 256 KiB payloads next to a raw
/// sequential write of the same bytes.
pub(crate) fn disk_tier(cli: &Cli) -> Result<Value, Failure> {
    let n_keys: u64 = if cli.quick { 100_000 } else { 1_000_000 };
    let n_files: u64 = if cli.quick { 10_000 } else { 100_000 };
    const BATCH: usize = 1024;
    let batches = if cli.quick { 50 } else { 300 };
    let mut rng = Rng::new(cli.seed);

    // Batches: half present keys (ids below n), half absent (ids above).
    let make_batches = |rng: &mut Rng, universe: u64| -> Vec<Vec<OffloadKey>> {
        (0..batches)
            .map(|_| {
                (0..BATCH)
                    .map(|j| {
                        let id = rng.below(universe);
                        key_from_id(if j % 2 == 0 { id } else { universe + id }, 36)
                    })
                    .collect()
            })
            .collect()
    };

    let big = bench_dir(cli, "kvbench-w5-1m")?;
    let fill = Instant::now();
    fill_disk(big.path(), n_keys)?;
    let fill_s = fill.elapsed().as_secs_f64();
    let batches_big = make_batches(&mut rng, n_keys);

    let tier = DiskTier::open(disk_config(big.path(), FsyncPolicy::Never))?;
    let t = Instant::now();
    let mut hits = 0usize;
    for batch in &batches_big {
        hits += tier.contains_many(batch)?.iter().filter(|&&f| f).count();
    }
    let disk_keys_per_s = (batches * BATCH) as f64 / t.elapsed().as_secs_f64();
    if hits != batches * BATCH / 2 {
        return Err(format!(
            "disk lookups found {hits} of {} present keys",
            batches * BATCH / 2
        )
        .into());
    }
    drop(tier);

    let set: std::collections::HashSet<OffloadKey> =
        (0..n_keys).map(|i| key_from_id(i, 36)).collect();
    let t = Instant::now();
    let mut set_hits = 0usize;
    for batch in &batches_big {
        set_hits += black_box(batch.iter().map(|k| set.contains(k)).collect::<Vec<bool>>())
            .iter()
            .filter(|&&f| f)
            .count();
    }
    let hashset_keys_per_s = (batches * BATCH) as f64 / t.elapsed().as_secs_f64();
    black_box(set_hits);
    drop(set);

    // One file per block, named by the key's hex, and one stat per key.
    let files = bench_dir(cli, "kvbench-w5-files")?;
    for i in 0..n_files {
        std::fs::File::create(files.path().join(key_from_id(i, 36).to_hex()))?;
    }
    let batches_files = make_batches(&mut rng, n_files);
    let t = Instant::now();
    let mut stat_hits = 0usize;
    for batch in &batches_files {
        for k in batch {
            if std::fs::metadata(files.path().join(k.to_hex())).is_ok() {
                stat_hits += 1;
            }
        }
    }
    let stat_keys_per_s = (batches * BATCH) as f64 / t.elapsed().as_secs_f64();
    if stat_hits != batches * BATCH / 2 {
        return Err(format!("stat found {stat_hits} of {} files", batches * BATCH / 2).into());
    }
    drop(files);

    // Reopen: a clean close, then open again (median of 5).
    let small = bench_dir(cli, "kvbench-w5-10k")?;
    fill_disk(small.path(), 10_000)?;
    let reopen = |path: &std::path::Path| -> Result<(), Failure> {
        DiskTier::open(disk_config(path, FsyncPolicy::Never))?;
        Ok(())
    };
    let reopen_10k = median_ms(5, || reopen(small.path()))?;
    let reopen_1m = median_ms(5, || reopen(big.path()))?;
    let during_rehash = lookups_during_rehash(big.path(), n_keys, &batches_big)?;
    drop(big);
    drop(small);

    // Stores of 256 KiB payloads, next to a raw sequential write.
    let payloads = if cli.quick { 64 } else { 400 };
    let block = vec![0xA5u8; 256 << 10];
    let mb = (payloads * block.len()) as f64 / (1 << 20) as f64;
    let mut store_rates = Vec::new();
    for fsync in [FsyncPolicy::Never, FsyncPolicy::Always] {
        let dir = bench_dir(cli, "kvbench-w5-store")?;
        let tier = DiskTier::open(disk_config(dir.path(), fsync))?;
        let t = Instant::now();
        for i in 0..payloads {
            tier.store_blocking(&key_from_id(i as u64, 36), &block)?;
        }
        tier.sync()?;
        store_rates.push(mb / t.elapsed().as_secs_f64());
    }
    let mut raw_rates = Vec::new();
    for sync_each in [false, true] {
        let dir = bench_dir(cli, "kvbench-w5-raw")?;
        let mut file = std::fs::File::create(dir.path().join("raw"))?;
        let t = Instant::now();
        for _ in 0..payloads {
            std::io::Write::write_all(&mut file, &block)?;
            if sync_each {
                file.sync_data()?;
            }
        }
        file.sync_all()?;
        raw_rates.push(mb / t.elapsed().as_secs_f64());
    }

    Ok(json!({
        "workload": "w5",
        "tier": "disk",
        "params": { "keys": n_keys, "batch": BATCH, "batches": batches, "present_fraction": 0.5,
                    "key_len": 36, "stat_files": n_files, "store_payload_bytes": block.len(),
                    "store_payloads": payloads, "fill_s": round3(fill_s) },
        "keys_per_s": disk_keys_per_s.round(),
        "hashset_keys_per_s": hashset_keys_per_s.round(),
        "ratio_vs_hashset": round3(disk_keys_per_s / hashset_keys_per_s),
        "stat_keys_per_s": stat_keys_per_s.round(),
        "ratio_vs_stat": round3(disk_keys_per_s / stat_keys_per_s),
        "reopen_ms_10k": round3(reopen_10k),
        "reopen_ms_1m": round3(reopen_1m),
        "reopen_ratio": round3(reopen_1m / reopen_10k),
        "lookup_during_rehash_p50_us": round3(during_rehash.p50_us),
        "lookup_during_rehash_p99_us": round3(during_rehash.p99_us),
        "lookup_during_rehash_max_us": round3(during_rehash.max_us),
        "lookup_during_rehash_service_p99_us": round3(during_rehash.service_p99_us),
        "lookup_during_rehash_no_writer_p99_us": round3(during_rehash.no_writer_p99_us),
        "lookup_during_rehash_no_writer_service_p99_us": round3(during_rehash.no_writer_service_p99_us),
        "lookup_during_rehash_lookups": during_rehash.lookups,
        "lookup_during_rehash_stores": during_rehash.stores,
        "lookup_during_rehash_rehashes": during_rehash.rehashes,
        "lookup_during_rehash_interval_us": REHASH_LOOKUP_INTERVAL.as_micros() as u64,
        "mb_per_s": round3(store_rates[0]),
        "baseline_mb_per_s": round3(raw_rates[0]),
        "ratio": round3(store_rates[0] / raw_rates[0]),
        "mb_per_s_fsync_always": round3(store_rates[1]),
        "baseline_mb_per_s_fsync_each": round3(raw_rates[1]),
        "ratio_fsync_always": round3(store_rates[1] / raw_rates[1]),
    }))
}

/// Lookups issued while stores grow the index, one every this often.
const REHASH_LOOKUP_INTERVAL: Duration = Duration::from_millis(2);

/// What [`lookups_during_rehash`] measured.
struct DuringRehash {
    p50_us: f64,
    p99_us: f64,
    max_us: f64,
    /// p99 of the lookups' own time (from their actual start).
    service_p99_us: f64,
    /// p99 of the same schedule without the writer (the machine alone).
    no_writer_p99_us: f64,
    /// p99 of the lookups' own time without the writer.
    no_writer_service_p99_us: f64,
    lookups: usize,
    stores: u64,
    rehashes: u64,
}

/// Lookup latency while stores trigger a rehash (issue 12 item 3): the
/// filled index at `path` (`n_keys` keys at about 48 % load) takes new keys
/// on a writer thread until it has grown past 70 % load and rehashed, and a
/// tenth as many after the swap; meanwhile this thread looks up `batches`
/// (half present) on a fixed schedule, one every [`REHASH_LOOKUP_INTERVAL`].
/// Each latency counts from the lookup's scheduled start, so a lookup held
/// up by the writer, and every one queued behind it, counts in full (no
/// coordinated omission). Every answer is checked. The same schedule
/// without the writer, for 2 s before it starts, is the baseline.
fn lookups_during_rehash(
    path: &std::path::Path,
    n_keys: u64,
    batches: &[Vec<OffloadKey>],
) -> Result<DuringRehash, Failure> {
    use std::sync::atomic::{AtomicBool, Ordering};
    let tier = Arc::new(DiskTier::open(disk_config(path, FsyncPolicy::Never))?);
    let idle_until = Instant::now() + Duration::from_secs(2);
    let (idle, idle_service) = paced(&tier, batches, || Instant::now() >= idle_until)?;
    let done = Arc::new(AtomicBool::new(false));
    let writer = {
        let (tier, done) = (Arc::clone(&tier), Arc::clone(&done));
        std::thread::spawn(move || -> Result<u64, String> {
            // Far above the absent keys of the batches (n_keys..2 * n_keys).
            const FIRST: u64 = 1 << 40;
            let before = tier.stats().rehashes;
            let mut id = FIRST;
            let mut after_swap = None;
            let result = loop {
                if let Err(err) = tier.store_blocking(&key_from_id(id, 36), &id.to_le_bytes()) {
                    break Err(err.to_string());
                }
                id += 1;
                match after_swap {
                    None if id.is_multiple_of(1024) && tier.stats().rehashes > before => {
                        after_swap = Some(id + n_keys / 10);
                    }
                    Some(end) if id >= end => break Ok(id - FIRST),
                    _ => {}
                }
            };
            done.store(true, Ordering::Release);
            result
        })
    };
    let (samples, service) = paced(&tier, batches, || done.load(Ordering::Acquire))?;
    let stores = writer.join().map_err(|_| "the writer thread panicked")??;
    let rehashes = tier.stats().rehashes;
    let lookups = samples.len();
    Ok(DuringRehash {
        p50_us: percentile(&samples, 0.5),
        p99_us: percentile(&samples, 0.99),
        max_us: percentile(&samples, 1.0),
        service_p99_us: percentile(&service, 0.99),
        no_writer_p99_us: percentile(&idle, 0.99),
        no_writer_service_p99_us: percentile(&idle_service, 0.99),
        lookups,
        stores,
        rehashes,
    })
}

/// Looks up `batches` in turn, one every [`REHASH_LOOKUP_INTERVAL`], until
/// `stop`; returns the latencies from each scheduled start and from each
/// actual start, in microseconds. Checks every answer.
fn paced(
    tier: &DiskTier,
    batches: &[Vec<OffloadKey>],
    stop: impl Fn() -> bool,
) -> Result<(Vec<f64>, Vec<f64>), Failure> {
    let (mut samples, mut service) = (Vec::new(), Vec::new());
    let start = Instant::now();
    while !stop() {
        let due = start + REHASH_LOOKUP_INTERVAL * samples.len() as u32;
        if let Some(wait) = due.checked_duration_since(Instant::now()) {
            std::thread::sleep(wait);
        }
        let batch = &batches[samples.len() % batches.len()];
        let began = Instant::now();
        let hits = tier.contains_many(batch)?.iter().filter(|&&f| f).count();
        service.push(micros(began.elapsed()));
        samples.push(micros(due.elapsed()));
        // Present keys are below `n_keys`, absent ones far above any store.
        let present = batch.iter().step_by(2).count();
        if hits != present {
            return Err(format!("a lookup found {hits} of {present} present keys").into());
        }
    }
    Ok((samples, service))
}
