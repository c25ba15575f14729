//! scheduler_sim: a vLLM-like scheduler loop over kvtier, the project's main job.
//!
//! Two secondary tiers, each behind its own `AsyncLookupManager`: the disk
//! tier in a temporary directory (fast, small, evicting) and the mock tier
//! as a slower remote tier that keeps everything. Requests arrive with
//! prompts that share system-prompt prefixes. Every step the scheduler asks,
//! for each waiting request, how many leading blocks exist in either tier
//! (disk first), never waiting for a tier. A request whose answer is ready
//! is scheduled and its blocks are loaded: from disk for real (payload and
//! checksum), from the remote with an injected failure rate. A failed load
//! marks the block missing in that tier with `mark_miss`, which ends the
//! retry loop, and the request asks again. After its compute time a
//! request's blocks are stored in both tiers. The step ends with `flush` on
//! both managers. A summary follows.
//!
//! ```text
//! cargo run --release -p examples --bin scheduler_sim
//! cargo run --release -p examples --bin scheduler_sim -- --steps 5000 --mock-latency-us 800 --json
//! ```

#![warn(clippy::unwrap_used)]

use std::collections::{HashSet, VecDeque};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use examples::{Rng, key_from_id, micros, quantile};
use lookup_core::{
    AsyncLookupManager, LookupVerdict, ManagerConfig, ManagerStats, OffloadKey, ReqContext, Tier,
};
use serde_json::json;
use tier_disk::{DiskConfig, DiskTier, FsyncPolicy};
use tier_mock::{MockConfig, MockTier};

/// Simulates a vLLM-like scheduler asking a secondary tier for cached prefixes.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    /// Scheduler steps to run.
    #[arg(long, default_value_t = 2000)]
    steps: usize,
    /// Requests arriving over the run.
    #[arg(long, default_value_t = 1000)]
    requests: usize,
    /// Distinct system prompts the requests share.
    #[arg(long, default_value_t = 8)]
    system_prompts: u64,
    /// Blocks in a system prompt.
    #[arg(long, default_value_t = 24)]
    system_blocks: usize,
    /// Blocks of each request's own text (at most this many, at least 1).
    #[arg(long, default_value_t = 16)]
    user_blocks: usize,
    /// Simulated model execution per step, in microseconds (the scheduler sleeps).
    #[arg(long, default_value_t = 1000)]
    step_us: u64,
    /// Steps a scheduled request computes before its blocks are stored.
    #[arg(long, default_value_t = 10)]
    compute_steps: usize,
    /// Latency of the mock tier's lookups, in microseconds.
    #[arg(long, default_value_t = 300)]
    mock_latency_us: u64,
    /// Jitter added to the mock tier's latency, in microseconds.
    #[arg(long, default_value_t = 400)]
    mock_jitter_us: u64,
    /// Probability that loading a block from the remote tier fails (exercises mark_miss).
    #[arg(long, default_value_t = 0.01)]
    load_failure: f64,
    /// Fraction of requests that are follow-up turns of an earlier one.
    #[arg(long, default_value_t = 0.3)]
    follow_ups: f64,
    /// Directory of the disk tier (default: a temporary directory, removed at the end).
    #[arg(long)]
    disk_dir: Option<std::path::PathBuf>,
    /// Capacity of the disk tier, in MiB (small, so that it evicts).
    #[arg(long, default_value_t = 32)]
    disk_capacity_mib: u64,
    /// Bytes of KV data per block.
    #[arg(long, default_value_t = 16 << 10)]
    block_bytes: usize,
    /// Seed of every random choice.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Print the summary as one JSON line.
    #[arg(long)]
    json: bool,
}

struct Request {
    ctx: ReqContext,
    keys: Vec<OffloadKey>,
    arrived_step: usize,
}

struct Running {
    request: Request,
    done_step: usize,
}

fn system_block(prompt: u64, i: usize) -> OffloadKey {
    // A chained content hash in vLLM; here a stable id per (prompt, position).
    key_from_id((prompt << 32) | i as u64, 36)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("error")),
        )
        .with_writer(std::io::stderr)
        .init();
    match run(&cli) {
        Ok(ok) if ok => ExitCode::SUCCESS,
        Ok(_) => ExitCode::FAILURE,
        Err(err) => {
            eprintln!("scheduler_sim: {err}");
            ExitCode::FAILURE
        }
    }
}

/// Where a leading block was found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    Disk,
    Remote,
}

/// The scan over both tiers: block by block, disk first, then remote; a
/// block missing in both ends the prefix; a block whose answer is pending
/// in a tier that comes before any tier known to hold it makes the whole
/// answer pending (every unresolved block is still registered, so the
/// prompt resolves in one round trip).
fn stacked_prefix<A: Tier, B: Tier>(
    disk: &mut AsyncLookupManager<A>,
    remote: &mut AsyncLookupManager<B>,
    keys: &[OffloadKey],
    ctx: &ReqContext,
) -> Result<Option<Vec<Source>>, lookup_core::LookupError> {
    let mut found = Vec::new();
    let mut pending = false;
    for key in keys {
        let source = match disk.lookup(key, ctx)? {
            LookupVerdict::Hit => Some(Source::Disk),
            verdict => {
                let on_disk_pending = verdict == LookupVerdict::Pending;
                match remote.lookup(key, ctx)? {
                    LookupVerdict::Hit if !on_disk_pending => Some(Source::Remote),
                    LookupVerdict::Miss if !on_disk_pending => None,
                    _ => {
                        pending = true;
                        Some(Source::Remote) // placeholder while pending
                    }
                }
            }
        };
        match source {
            Some(s) => found.push(s),
            None => break,
        }
    }
    Ok((!pending).then_some(found))
}

fn block_payload(key: &OffloadKey, len: usize) -> Vec<u8> {
    let seed = key.as_bytes();
    (0..len).map(|i| seed[i % seed.len()] ^ (i as u8)).collect()
}

fn run(cli: &Cli) -> Result<bool, Box<dyn std::error::Error>> {
    let temp = match &cli.disk_dir {
        Some(_) => None,
        None => Some(tempfile::Builder::new().prefix("kvtier-sim").tempdir()?),
    };
    let disk_dir = match (&cli.disk_dir, &temp) {
        (Some(dir), _) => dir.clone(),
        (None, Some(t)) => t.path().to_owned(),
        (None, None) => return Err("no disk directory".into()),
    };
    let capacity = cli.disk_capacity_mib.max(2) << 20;
    let disk = Arc::new(DiskTier::open(DiskConfig {
        capacity_bytes: capacity,
        segment_bytes: (capacity / 8).max(64 << 10),
        fsync: FsyncPolicy::Never,
        ..DiskConfig::new(&disk_dir)
    })?);
    let remote = Arc::new(MockTier::new(MockConfig {
        seed: cli.seed,
        latency_us: cli.mock_latency_us,
        jitter_us: cli.mock_jitter_us,
        record_calls: false,
        ..MockConfig::default()
    }));
    let mut disk_mgr = disk.manager(ManagerConfig::named("disk"))?;
    let mut remote_mgr =
        AsyncLookupManager::from_arc(Arc::clone(&remote), ManagerConfig::named("remote"))?;

    let mut rng = Rng::new(cli.seed);
    let mut next_user_block = 1u64 << 48;
    let mut prompts: Vec<Vec<OffloadKey>> = Vec::with_capacity(cli.requests);
    for i in 0..cli.requests {
        // A follow-up turn extends an earlier conversation, which by then
        // may have been evicted from the small disk tier.
        let mut keys: Vec<OffloadKey> = if i > 100 && rng.chance(cli.follow_ups) {
            let earlier = i - 50 - rng.below((i - 50).min(400) as u64) as usize;
            prompts[earlier].clone()
        } else {
            let prompt = rng.below(cli.system_prompts.max(1));
            (0..cli.system_blocks)
                .map(|b| system_block(prompt, b))
                .collect()
        };
        let own = 1 + rng.below(cli.user_blocks.max(1) as u64) as usize;
        for _ in 0..own {
            next_user_block += 1;
            keys.push(key_from_id(next_user_block, 36));
        }
        prompts.push(keys);
    }
    let mut incoming: VecDeque<Request> = prompts
        .into_iter()
        .enumerate()
        .map(|(i, keys)| Request {
            ctx: ReqContext::new(format!("req-{i}")),
            keys,
            arrived_step: 0,
        })
        .collect();
    // Arrivals spread evenly over the first 80% of the run.
    let arrival_span = (cli.steps * 4 / 5).max(1);
    let per_step = cli.requests.div_ceil(arrival_span);

    let mut stored_on_disk: HashSet<OffloadKey> = HashSet::new();
    let mut waiting: Vec<Request> = Vec::new();
    let mut running: Vec<Running> = Vec::new();
    let (mut sched_us, mut wait_steps) = (Vec::new(), Vec::new());
    let (mut finished, mut blocks_asked, mut from_disk, mut from_remote) =
        (0usize, 0usize, 0usize, 0usize);
    let (mut failed_loads, mut verdict_errors) = (0usize, 0usize);
    let started = Instant::now();
    let mut step = 0;
    while step < cli.steps || !waiting.is_empty() || !running.is_empty() {
        if step > cli.steps * 4 + 10_000 {
            return Err("requests still unfinished long after the last step".into());
        }
        for _ in 0..per_step {
            if let Some(mut r) = incoming.pop_front() {
                r.arrived_step = step;
                waiting.push(r);
            }
        }
        let t0 = Instant::now();
        let mut load_time = Duration::ZERO;
        let mut still_waiting = Vec::with_capacity(waiting.len());
        'requests: for request in waiting.drain(..) {
            let Some(sources) =
                stacked_prefix(&mut disk_mgr, &mut remote_mgr, &request.keys, &request.ctx)?
            else {
                still_waiting.push(request);
                continue;
            };
            // Load every found block; a failed load marks it missing in its
            // tier and the request asks again next step. (Loads are timed
            // apart: an engine runs them off the scheduler thread.)
            let load_start = Instant::now();
            for (key, source) in request.keys.iter().zip(&sources) {
                let loaded = match source {
                    Source::Disk => {
                        if !stored_on_disk.contains(key) {
                            verdict_errors += 1; // a hit for a block never stored there
                        }
                        // Evicted since the lookup answered: a real failed load.
                        disk.load(key)?
                            .is_some_and(|bytes| bytes == block_payload(key, cli.block_bytes))
                    }
                    Source::Remote => {
                        if !remote.contains(key) {
                            verdict_errors += 1;
                        }
                        !rng.chance(cli.load_failure)
                    }
                };
                if !loaded {
                    load_time += load_start.elapsed();
                    failed_loads += 1;
                    match source {
                        Source::Disk => disk_mgr.mark_miss([key]),
                        Source::Remote => remote_mgr.mark_miss([key]),
                    }
                    still_waiting.push(request);
                    continue 'requests;
                }
            }
            load_time += load_start.elapsed();
            blocks_asked += request.keys.len();
            from_disk += sources.iter().filter(|s| **s == Source::Disk).count();
            from_remote += sources.iter().filter(|s| **s == Source::Remote).count();
            wait_steps.push((step - request.arrived_step) as f64);
            running.push(Running {
                request,
                done_step: step + cli.compute_steps,
            });
        }
        waiting = still_waiting;
        disk_mgr.flush();
        remote_mgr.flush();
        sched_us.push(micros(t0.elapsed().saturating_sub(load_time)));

        // Requests done computing store their blocks in both tiers and leave.
        let mut done = Vec::new();
        running.retain_mut(|r| {
            if r.done_step > step {
                return true;
            }
            done.push(std::mem::take(&mut r.request.keys));
            disk_mgr.cleanup(r.request.ctx.req_id());
            remote_mgr.cleanup(r.request.ctx.req_id());
            finished += 1;
            false
        });
        for keys in done {
            for key in &keys {
                disk.store(key, &block_payload(key, cli.block_bytes))?;
                stored_on_disk.insert(key.clone());
            }
            remote.insert(keys);
        }
        step += 1;
        std::thread::sleep(Duration::from_micros(cli.step_us));
    }
    let wall = started.elapsed();
    let idle_deadline = Instant::now() + Duration::from_secs(5);
    while !(disk_mgr.is_idle() && remote_mgr.is_idle()) && Instant::now() < idle_deadline {
        disk_mgr.drain_results();
        remote_mgr.drain_results();
        std::thread::sleep(Duration::from_millis(1));
    }
    let state_empty = disk_mgr.is_idle() && remote_mgr.is_idle();
    let tiers = [disk_mgr.stats(), remote_mgr.stats()];
    let disk_stats = disk.stats();
    disk_mgr.shutdown();
    remote_mgr.shutdown();
    drop(disk_mgr);
    drop(remote_mgr);

    let hit_rate = (from_disk + from_remote) as f64 / blocks_asked.max(1) as f64;
    let tier_json = |t: &ManagerStats| {
        json!({
            "tier": t.tier, "lookups": t.lookups, "hits": t.hits, "misses": t.misses,
            "errors": t.errors, "timeouts": t.timeouts, "forced_misses": t.forced_misses,
            "ttv_p50_us": t.time_to_verdict.p50_us, "ttv_p99_us": t.time_to_verdict.p99_us,
            "tier_call_p50_us": t.tier_call_latency.p50_us, "tier_call_p99_us": t.tier_call_latency.p99_us,
        })
    };
    let summary = json!({
        "steps": step,
        "requests_finished": finished,
        "prefix_hit_rate": (hit_rate * 1000.0).round() / 1000.0,
        "blocks_from_disk": from_disk,
        "blocks_from_remote": from_remote,
        "failed_loads_marked_miss": failed_loads,
        "verdict_errors": verdict_errors,
        "disk_evicted_segments": disk_stats.evicted_segments,
        "disk_bytes_used": disk_stats.bytes_used,
        "scheduler_us_per_step_note": "lookups and flushes; block loads and stores excluded",
        "scheduler_us_per_step_p50": quantile(&mut sched_us, 0.5).round(),
        "scheduler_us_per_step_p99": quantile(&mut sched_us, 0.99).round(),
        "wait_steps_p50": quantile(&mut wait_steps, 0.5),
        "wait_steps_p99": quantile(&mut wait_steps, 0.99),
        "state_empty_after_cleanup": state_empty,
        "wall_s": (wall.as_secs_f64() * 100.0).round() / 100.0,
        "tiers": [tier_json(&tiers[0]), tier_json(&tiers[1])],
    });
    if cli.json {
        println!("{summary}");
    } else {
        println!(
            "scheduler_sim: {step} steps, {finished} requests finished in {:.2} s (disk tier in {})",
            wall.as_secs_f64(),
            disk_dir.display()
        );
        println!(
            "prefix hit rate {:.1}%: {from_disk} blocks from disk, {from_remote} from remote; {failed_loads} failed loads marked missing; {verdict_errors} verdict errors",
            hit_rate * 100.0
        );
        println!(
            "disk: {} segments evicted, {} MiB used of {}",
            disk_stats.evicted_segments,
            disk_stats.bytes_used >> 20,
            capacity >> 20
        );
        println!(
            "scheduler per step p50 / p99: {} / {} µs; steps waiting p50 / p99: {} / {}; state empty after cleanup: {state_empty}",
            summary["scheduler_us_per_step_p50"],
            summary["scheduler_us_per_step_p99"],
            summary["wait_steps_p50"],
            summary["wait_steps_p99"]
        );
        println!();
        println!(
            "{:<8} {:>9} {:>8} {:>8} {:>7} {:>9} {:>7} {:>16} {:>16}",
            "tier",
            "lookups",
            "hits",
            "misses",
            "errors",
            "timeouts",
            "forced",
            "ttv p50/p99 µs",
            "call p50/p99 µs"
        );
        for t in &tiers {
            println!(
                "{:<8} {:>9} {:>8} {:>8} {:>7} {:>9} {:>7} {:>16} {:>16}",
                t.tier,
                t.lookups,
                t.hits,
                t.misses,
                t.errors,
                t.timeouts,
                t.forced_misses,
                format!("{}/{}", t.time_to_verdict.p50_us, t.time_to_verdict.p99_us),
                format!(
                    "{}/{}",
                    t.tier_call_latency.p50_us, t.tier_call_latency.p99_us
                ),
            );
        }
    }
    Ok(verdict_errors == 0 && state_empty && finished == cli.requests)
}
