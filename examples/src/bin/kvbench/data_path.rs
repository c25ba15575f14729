//! data-path (old id `w6`), the block data path: blocks stored and then loaded
//! through the core's transfer queue, one row per tier and block size,
//! next to the tier's raw client in the same run and to `memcpy` of the
//! same bytes.
//!
//! A tier is a [`DataPathTier`]: it opens the store the queue runs on and
//! runs its raw baseline. The disk tier is here; the Redis and S3 rows are
//! in `data_path/remote.rs` (their baselines: a raw redis-rs pipeline per
//! job, a raw aws-sdk-s3 loop at the same concurrency). `--tiers` picks
//! them (default every tier; Redis and S3 need their servers).

use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use examples::{key_from_id, percentile};
use kvtier_core::{
    DynBlockStore, HostMemory, JobReport, OffloadKey, Region, Spawner, TransferConfig,
    TransferQueue,
};
use kvtier_disk::{DiskConfig, DiskTier, FsyncPolicy};
use serde_json::{Value, json};

use crate::common::{paired_ratio, round3};

mod remote;
use crate::{Cli, Failure};

/// The block sizes of every tier's rows: 256 KiB and 2 MiB (a Llama-3-8B
/// block of 16 tokens).
const BLOCK_SIZES: [usize; 2] = [256 << 10, 2 << 20];

/// Bytes a job carries: vLLM submits a request's blocks as one job.
const JOB_BYTES: usize = 32 << 20;

/// data-path (w6): one row per tier and block size; see the module docs.
pub(crate) fn data_path(cli: &Cli) -> Result<Vec<Value>, Failure> {
    let tiers = std::env::var("KVBENCH_W6_TIERS").unwrap_or_else(|_| "disk,redis,s3".to_owned());
    let mut lines = Vec::new();
    for name in tiers.split(',').map(str::trim).filter(|t| !t.is_empty()) {
        for block_bytes in BLOCK_SIZES {
            let mut tier: Box<dyn DataPathTier> = match name {
                "disk" => Box::new(Disk::new(cli)?),
                "redis" => Box::new(remote::Redis::new()?),
                "s3" => Box::new(remote::S3::new()?),
                other => {
                    return Err(
                        format!("KVBENCH_W6_TIERS: no tier {other:?} (disk, redis, s3)").into(),
                    );
                }
            };
            lines.push(row(cli, tier.as_mut(), block_bytes)?);
        }
    }
    Ok(lines)
}

/// A tier as this workload measures it.
trait DataPathTier {
    /// `params.tier`.
    fn name(&self) -> &'static str;
    /// Bytes stored and loaded per row and round.
    fn total_bytes(&self, quick: bool) -> usize;
    /// Extra `params` of the row.
    fn params(&self) -> Value;
    /// Jobs in flight through the queue, and workers of the baseline.
    fn concurrency(&self) -> usize;
    /// A fresh store for one round (empty, or with keys unique to it),
    /// and whatever the round's baseline needs.
    fn open(
        &mut self,
        round: usize,
        keys: &[OffloadKey],
    ) -> Result<Arc<dyn DynBlockStore>, Failure>;
    /// Ends a round: closes the store and frees what it and the baseline
    /// used.
    fn close(&mut self) -> Result<(), Failure>;
    /// The raw client stores blocks `wave` from their rows (or, with
    /// `load`, loads them into their rows), with `threads` workers; the
    /// seconds it took.
    fn baseline(
        &mut self,
        blocks: &mut Blocks,
        wave: Range<usize>,
        threads: usize,
        load: bool,
    ) -> Result<f64, Failure>;
}

/// The blocks of one row: keys, and host memory holding one block per
/// row, each filled from a stream seeded by its row (regenerated to check
/// what loads back).
struct Blocks {
    keys: Vec<OffloadKey>,
    memory: Arc<HostMemory>,
    block: usize,
    seed: u64,
}

/// The 8-byte words of row `row`'s block (xorshift64).
fn stream(seed: u64, row: usize) -> impl Iterator<Item = [u8; 8]> {
    let mut x = (seed ^ (row as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)) | 1;
    std::iter::repeat_with(move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x.to_le_bytes()
    })
}

impl Blocks {
    fn new(n: usize, block: usize, first_id: u64) -> Result<Self, Failure> {
        if !block.is_multiple_of(8) {
            return Err("block sizes are multiples of 8 bytes".into());
        }
        let mut blocks = Self {
            keys: (0..n as u64)
                .map(|i| key_from_id(first_id + i, 36))
                .collect(),
            memory: Arc::new(HostMemory::zeroed(n * block)?),
            block,
            seed: first_id,
        };
        blocks.fill()?;
        Ok(blocks)
    }

    /// Writes every row's block into it.
    fn fill(&mut self) -> Result<(), Failure> {
        let (block, seed) = (self.block, self.seed);
        let bytes = Self::bytes(&mut self.memory)?;
        for (row, block_bytes) in bytes.chunks_mut(block).enumerate() {
            for (word, value) in block_bytes.chunks_exact_mut(8).zip(stream(seed, row)) {
                word.copy_from_slice(&value);
            }
        }
        Ok(())
    }

    fn bytes(memory: &mut Arc<HostMemory>) -> Result<&mut [u8], Failure> {
        Ok(Arc::get_mut(memory)
            .ok_or("a transfer job still holds the benchmark's memory")?
            .as_mut_slice())
    }

    /// Zeroes rows `rows`.
    fn clear_rows(&mut self, rows: Range<usize>) -> Result<(), Failure> {
        let block = self.block;
        Self::bytes(&mut self.memory)?
            .get_mut(rows.start * block..rows.end * block)
            .ok_or("rows past the last block")?
            .fill(0);
        Ok(())
    }

    /// How many of rows `rows` differ from what was stored.
    fn wrong_rows(&mut self, rows: Range<usize>) -> Result<usize, Failure> {
        let (block, seed) = (self.block, self.seed);
        let bytes = Self::bytes(&mut self.memory)?;
        Ok(rows
            .filter(|&row| {
                bytes.get(row * block..(row + 1) * block).is_none_or(|got| {
                    got.chunks_exact(8)
                        .zip(stream(seed, row))
                        .any(|(word, value)| word != value)
                })
            })
            .count())
    }
}

/// Flushes dirty pages machine-wide (untimed), so a pass does not pay for
/// the writeback of the one before it.
fn settle() {
    let _ = std::process::Command::new("sync").status();
}

/// Submits blocks `wave` as jobs of [`JOB_BYTES`], all at once, and
/// waits for their reports; the seconds it took.
fn run_wave(
    queue: &TransferQueue,
    blocks: &Blocks,
    wave: Range<usize>,
    load: bool,
) -> Result<f64, Failure> {
    let per_job = (JOB_BYTES / blocks.block).max(1);
    let started = Instant::now();
    let mut jobs = 0;
    for first in wave.clone().step_by(per_job) {
        let rows = first..(first + per_job).min(wave.end);
        let keys = blocks
            .keys
            .get(rows.clone())
            .ok_or("a wave past the last block")?;
        let regions = Region::rows(rows, blocks.block).ok_or("row offsets overflow")?;
        let memory = blocks.memory.clone();
        if load {
            queue.submit_load(keys.to_vec(), memory, regions)?;
        } else {
            queue.submit_store(keys.to_vec(), memory, regions)?;
        }
        jobs += 1;
    }
    let mut reports: Vec<JobReport> = Vec::with_capacity(jobs);
    while reports.len() < jobs {
        if started.elapsed() > Duration::from_secs(600) {
            return Err(format!("{} of {jobs} jobs ended within 600 s", reports.len()).into());
        }
        queue.wait_for_reports(Duration::from_millis(100));
        reports.extend(queue.poll());
    }
    let seconds = started.elapsed().as_secs_f64();
    if let Some(bad) = reports.iter().find(|r| !r.ok()) {
        let why = bad
            .first_error()
            .map_or_else(|| "absent keys".to_owned(), |e| e.to_string());
        return Err(format!("job {} failed: {why}", bad.id).into());
    }
    Ok(seconds)
}

/// Copies the row's bytes into a second buffer: the best of three, GB/s.
fn memcpy_gb_per_s(blocks: &mut Blocks) -> Result<f64, Failure> {
    let source = Blocks::bytes(&mut blocks.memory)?;
    let mut target = vec![0u8; source.len()];
    target.copy_from_slice(source); // fault the target's pages in
    let mut best = f64::INFINITY;
    for _ in 0..3 {
        let t = Instant::now();
        target.copy_from_slice(std::hint::black_box(&*source));
        std::hint::black_box(&target);
        best = best.min(t.elapsed().as_secs_f64());
    }
    Ok(source.len() as f64 / best / 1e9)
}

/// One row: `rounds` rounds, each storing every block through the queue
/// and through the raw client, then loading them back both ways. Each
/// pass goes in waves of `concurrency` jobs of [`JOB_BYTES`], the queue's
/// wave and the raw client's wave of the same blocks back to back, the
/// queue first on even waves and second on odd ones: the machine's drift
/// (other processes, writeback of dirty pages, reclaim) hits both sides
/// alike. Dirty pages are flushed before each pass. The row reports the
/// median rates of the rounds and the median of each round's ratio to its
/// own baseline; a first round, untimed, warms up.
fn row(cli: &Cli, tier: &mut dyn DataPathTier, block_bytes: usize) -> Result<Value, Failure> {
    let total = tier.total_bytes(cli.quick);
    let n = total / block_bytes;
    let rounds = if cli.quick { 1 } else { 5 };
    let threads = tier.concurrency();
    let config = TransferConfig {
        max_jobs_in_flight: threads,
        ..TransferConfig::default()
    };
    let mut blocks = Blocks::new(n, block_bytes, cli.seed << 32)?;
    let memcpy = memcpy_gb_per_s(&mut blocks)?;
    let gb = (n * block_bytes) as f64 / 1e9;
    let wave_blocks = (JOB_BYTES / block_bytes).max(1) * threads;
    let (mut store, mut load, mut base_store, mut base_load) = (vec![], vec![], vec![], vec![]);
    let mut wrong_rows = 0;
    let spawner = Spawner::dedicated("kvbench-w6", 1)?;
    // Round 0 warms up (untimed): the first gigabyte a process moves runs
    // slower on this machine, for the queue's side more than the raw one.
    let warm_up = usize::from(!cli.quick);
    for round in 0..rounds + warm_up {
        let queue =
            TransferQueue::from_dyn(tier.open(round, &blocks.keys)?, config.clone(), &spawner)?;
        for load_pass in [false, true] {
            settle();
            let (mut ours, mut raw) = (0.0, 0.0);
            for (w, first) in (0..n).step_by(wave_blocks).enumerate() {
                let wave = first..(first + wave_blocks).min(n);
                for queue_turn in [w % 2 == 0, w % 2 != 0] {
                    if queue_turn {
                        ours += run_wave(&queue, &blocks, wave.clone(), load_pass)?;
                    } else {
                        raw += tier.baseline(&mut blocks, wave.clone(), threads, load_pass)?;
                    }
                    if load_pass {
                        // Each side's load is checked, then undone (untimed).
                        wrong_rows += blocks.wrong_rows(wave.clone())?;
                        blocks.clear_rows(wave.clone())?;
                    }
                }
            }
            if round < warm_up {
                continue;
            }
            if load_pass {
                load.push(gb / ours);
                base_load.push(gb / raw);
            } else {
                store.push(gb / ours);
                base_store.push(gb / raw);
            }
        }
        drop(queue);
        tier.close()?;
        blocks.fill()?;
    }
    if wrong_rows > 0 {
        return Err(format!("{wrong_rows} rows loaded back wrong").into());
    }
    let store_ratio = paired_ratio(&store, &base_store);
    let load_ratio = paired_ratio(&load, &base_load);
    let median = |v: &[f64]| percentile(v, 0.5);
    Ok(json!({
        "workload": "w6",
        "tier": tier.name(),
        "params": {
            "tier": tier.name(), "block_bytes": block_bytes, "blocks": n, "total_bytes": n * block_bytes,
            "job_bytes": JOB_BYTES, "jobs_in_flight": config.max_jobs_in_flight,
            "bytes_in_flight": config.max_bytes_in_flight, "chunk_bytes": config.chunk_bytes,
            "concurrency": threads, "rounds": rounds, "tier_params": tier.params(),
        },
        "store_gb_per_s": round3(median(&store)),
        "load_gb_per_s": round3(median(&load)),
        "baseline_store_gb_per_s": round3(median(&base_store)),
        "baseline_load_gb_per_s": round3(median(&base_load)),
        "store_ratio": round3(store_ratio),
        "load_ratio": round3(load_ratio),
        "memcpy_gb_per_s": round3(memcpy),
    }))
}

/// The disk tier's segment size in these rows: its default.
const SEGMENT_BYTES: u64 = 64 << 20;

/// The disk tier, in a temporary directory (removed after each round),
/// with `fsync = never` on both sides: the baseline's `pwrite`s are not
/// synced either.
struct Disk {
    parent: Option<PathBuf>,
    dir: Option<tempfile::TempDir>,
    tier: Option<Arc<DiskTier>>,
    /// The baseline's files of the round.
    files: Option<tempfile::TempDir>,
}

impl Disk {
    fn new(cli: &Cli) -> Result<Self, Failure> {
        Ok(Self {
            parent: cli.dir.clone(),
            dir: None,
            tier: None,
            files: None,
        })
    }

    fn fresh_dir(&self, name: &str) -> Result<tempfile::TempDir, Failure> {
        let mut builder = tempfile::Builder::new();
        builder.prefix(name);
        Ok(match &self.parent {
            Some(parent) => builder.tempdir_in(parent)?,
            None => builder.tempdir()?,
        })
    }
}

fn block_file(dir: &Path, i: usize) -> PathBuf {
    dir.join(format!("blk-{i:08}"))
}

impl DataPathTier for Disk {
    fn name(&self) -> &'static str {
        "disk"
    }

    fn total_bytes(&self, quick: bool) -> usize {
        if quick { 64 << 20 } else { 512 << 20 }
    }

    fn params(&self) -> Value {
        json!({ "fsync": "never", "segment_bytes": SEGMENT_BYTES })
    }

    /// One: the tier appends every store to one segment under one lock
    /// (and the kernel serialises writes to one file), so workers in
    /// parallel would measure the filesystem's parallelism, not the tier's
    /// cost over it.
    fn concurrency(&self) -> usize {
        1
    }

    fn open(
        &mut self,
        _round: usize,
        _keys: &[OffloadKey],
    ) -> Result<Arc<dyn DynBlockStore>, Failure> {
        let dir = self.fresh_dir("kvbench-w6-disk")?;
        let tier = Arc::new(DiskTier::open(DiskConfig {
            capacity_bytes: 8 << 30,
            segment_bytes: SEGMENT_BYTES,
            fsync: FsyncPolicy::Never,
            ..DiskConfig::new(dir.path())
        })?);
        self.dir = Some(dir);
        self.files = Some(self.fresh_dir("kvbench-w6-files")?);
        self.tier = Some(Arc::clone(&tier));
        Ok(tier)
    }

    fn close(&mut self) -> Result<(), Failure> {
        if let Some(tier) = self.tier.take() {
            tier.close()?;
        }
        if let Some(dir) = self.dir.take() {
            dir.close()?;
        }
        if let Some(files) = self.files.take() {
            files.close()?;
        }
        Ok(())
    }

    /// `std::fs`: one file per block in one directory, `pwrite` from the
    /// block's row (`pread` into it to load), `threads` workers over
    /// contiguous shares of the wave.
    fn baseline(
        &mut self,
        blocks: &mut Blocks,
        wave: Range<usize>,
        threads: usize,
        load: bool,
    ) -> Result<f64, Failure> {
        let path = self.files.as_ref().ok_or("no round is open")?.path();
        raw_files(path, blocks, wave, threads, load)
    }
}

/// Writes (or reads) the file of each block of `wave` from (into) its row,
/// `threads` workers over contiguous shares; the seconds it took.
fn raw_files(
    path: &Path,
    blocks: &mut Blocks,
    wave: Range<usize>,
    threads: usize,
    load: bool,
) -> Result<f64, Failure> {
    let block = blocks.block;
    let share = wave.len().div_ceil(threads).max(1) * block;
    let bytes = Blocks::bytes(&mut blocks.memory)?
        .get_mut(wave.start * block..wave.end * block)
        .ok_or("a wave past the last block")?;
    let started = Instant::now();
    std::thread::scope(|s| -> Result<(), Failure> {
        let workers: Vec<_> = bytes
            .chunks_mut(share)
            .enumerate()
            .map(|(w, rows)| {
                let first = wave.start + w * share / block;
                s.spawn(move || -> std::io::Result<()> {
                    for (j, row) in rows.chunks_mut(block).enumerate() {
                        let name = block_file(path, first + j);
                        if load {
                            std::fs::File::open(name)?.read_exact_at(row, 0)?;
                        } else {
                            std::fs::File::create(name)?.write_all_at(row, 0)?;
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        for worker in workers {
            worker.join().map_err(|_| "a baseline worker panicked")??;
        }
        Ok(())
    })?;
    Ok(started.elapsed().as_secs_f64())
}
