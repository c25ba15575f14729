//! scheduler_sim: a vLLM-like scheduler loop over kvtier, the project's main job.
//!
//! Secondary tiers in one `TierStack`, in priority order: the disk tier in a
//! temporary directory (the embedded default: fast, small, evicting), then
//! whatever the flags add (`--redis`, `--redis-cluster`, `--s3`), then the
//! mock tier as a slow remote tier that keeps everything. Requests arrive
//! with prompts that share system-prompt prefixes (and follow-up turns that
//! extend earlier prompts). Every step the scheduler asks, for each waiting
//! request, how many leading blocks exist anywhere and where, never waiting
//! for a tier. A request whose answer is ready is scheduled and its blocks
//! are loaded: from disk for real (payload and checksum), from other tiers
//! with an injected failure rate. A failed load marks the block missing in
//! its tier (`mark_miss`), which ends the retry loop, and the request asks
//! again. After its compute time a request's blocks are written to every
//! tier (remote tiers in the background). The step ends with `flush`.
//!
//! ```text
//! cargo run --release -p examples --bin scheduler_sim
//! cargo run --release -p examples --bin scheduler_sim -- --redis redis://127.0.0.1:16379/ \
//!     --s3 kvtier-test --s3-endpoint http://127.0.0.1:19000 --plot ttv.svg
//! ```

#![warn(clippy::unwrap_used)]

use std::collections::{HashSet, VecDeque};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use examples::{Rng, key_from_id, micros, quantile};
use lookup_core::{
    AsyncLookupManager, ManagerConfig, ManagerStats, OffloadKey, ReqContext, StackVerdict,
    TierStack,
};
use serde_json::json;
use tier_disk::{DiskConfig, DiskTier, FsyncPolicy};
use tier_mock::{MockConfig, MockTier};
use tier_redis::{RedisConfig, RedisTier};
use tier_s3::{S3Config, S3Tier};

/// Simulates a vLLM-like scheduler asking secondary tiers for cached prefixes.
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
    /// Fraction of requests that are follow-up turns of an earlier one.
    #[arg(long, default_value_t = 0.3)]
    follow_ups: f64,
    /// Simulated model execution per step, in microseconds (the scheduler sleeps).
    #[arg(long, default_value_t = 1000)]
    step_us: u64,
    /// Steps a scheduled request computes before its blocks are stored.
    #[arg(long, default_value_t = 10)]
    compute_steps: usize,
    /// Directory of the disk tier (default: a temporary directory, removed at the end).
    #[arg(long)]
    disk_dir: Option<PathBuf>,
    /// Capacity of the disk tier, in MiB (small, so that it evicts).
    #[arg(long, default_value_t = 32)]
    disk_capacity_mib: u64,
    /// Bytes of KV data per block.
    #[arg(long, default_value_t = 16 << 10)]
    block_bytes: usize,
    /// Add a Redis tier at this URL (after disk).
    #[arg(long)]
    redis: Option<String>,
    /// Add a Redis Cluster tier with these seed URLs, comma-separated.
    #[arg(long)]
    redis_cluster: Option<String>,
    /// Add an S3 tier with this bucket (credentials from the AWS chain).
    #[arg(long)]
    s3: Option<String>,
    /// Endpoint of the S3-compatible server (path-style addressing).
    #[arg(long)]
    s3_endpoint: Option<String>,
    /// Leave out the mock remote tier.
    #[arg(long)]
    no_mock: bool,
    /// Latency of the mock tier's lookups, in microseconds.
    #[arg(long, default_value_t = 300)]
    mock_latency_us: u64,
    /// Jitter added to the mock tier's latency, in microseconds.
    #[arg(long, default_value_t = 400)]
    mock_jitter_us: u64,
    /// Probability that loading a block from a tier other than disk fails (exercises mark_miss).
    #[arg(long, default_value_t = 0.01)]
    load_failure: f64,
    /// Write an SVG plot of the time-to-answer CDF (per request, arrival to answer).
    #[arg(long)]
    plot: Option<PathBuf>,
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
    arrived: Instant,
    arrived_step: usize,
}

struct Running {
    request: Request,
    done_step: usize,
}

/// A tier of the stack, as the simulation stores into and loads from it.
enum Backend {
    Disk(Arc<DiskTier>),
    Redis(Arc<RedisTier>),
    S3(Arc<S3Tier>),
    Mock(Arc<MockTier>),
}

struct SimTier {
    backend: Backend,
    /// Blocks whose store was issued: a hit for any other block is a verdict error.
    stored: HashSet<OffloadKey>,
}

fn system_block(prompt: u64, i: usize) -> OffloadKey {
    // A chained content hash in vLLM; here a stable id per (prompt, position).
    key_from_id((prompt << 32) | i as u64, 36)
}

fn block_payload(key: &OffloadKey, len: usize) -> Vec<u8> {
    let seed = key.as_bytes();
    (0..len).map(|i| seed[i % seed.len()] ^ (i as u8)).collect()
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
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(err) => {
            eprintln!("scheduler_sim: {err}");
            ExitCode::FAILURE
        }
    }
}

fn prompts(cli: &Cli, rng: &mut Rng) -> Vec<Vec<OffloadKey>> {
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
        for _ in 0..1 + rng.below(cli.user_blocks.max(1) as u64) {
            next_user_block += 1;
            keys.push(key_from_id(next_user_block, 36));
        }
        prompts.push(keys);
    }
    prompts
}

#[allow(clippy::too_many_lines)]
fn run(cli: &Cli) -> Result<bool, Box<dyn std::error::Error>> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
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

    // The stack, fastest first.
    let mut stack = TierStack::default();
    let mut tiers: Vec<SimTier> = Vec::new();
    stack.push(Box::new(disk.manager(ManagerConfig::named("disk"))?));
    tiers.push(SimTier {
        backend: Backend::Disk(Arc::clone(&disk)),
        stored: HashSet::new(),
    });
    let run_prefix = format!(
        "sim-{:x}:",
        Rng::new(cli.seed ^ u64::from(std::process::id())).next_u64()
    );
    for (name, config) in [
        ("redis", cli.redis.as_ref().map(RedisConfig::from_url)),
        (
            "redis-cluster",
            cli.redis_cluster
                .as_ref()
                .map(|urls| RedisConfig::cluster(urls.split(','))),
        ),
    ] {
        let Some(config) = config else { continue };
        let tier = Arc::new(RedisTier::new(RedisConfig {
            key_prefix: run_prefix.clone(),
            ..config
        })?);
        rt.block_on(tier.ping())?;
        stack.push(Box::new(tier.manager(ManagerConfig::named(name))?));
        tiers.push(SimTier {
            backend: Backend::Redis(tier),
            stored: HashSet::new(),
        });
    }
    if let Some(bucket) = &cli.s3 {
        let tier = Arc::new(rt.block_on(S3Tier::new(S3Config {
            endpoint: cli.s3_endpoint.clone(),
            force_path_style: cli.s3_endpoint.is_some(),
            prefix: run_prefix.replace(':', "/"),
            ..S3Config::new(bucket)
        }))?);
        stack.push(Box::new(tier.manager(ManagerConfig::named("s3"))?));
        tiers.push(SimTier {
            backend: Backend::S3(tier),
            stored: HashSet::new(),
        });
    }
    if !cli.no_mock {
        let mock = Arc::new(MockTier::new(MockConfig {
            seed: cli.seed,
            latency_us: cli.mock_latency_us,
            jitter_us: cli.mock_jitter_us,
            record_calls: false,
            ..MockConfig::default()
        }));
        stack.push(Box::new(AsyncLookupManager::from_arc(
            Arc::clone(&mock),
            ManagerConfig::named("mock"),
        )?));
        tiers.push(SimTier {
            backend: Backend::Mock(mock),
            stored: HashSet::new(),
        });
    }

    let mut rng = Rng::new(cli.seed);
    let mut incoming: VecDeque<Request> = prompts(cli, &mut rng)
        .into_iter()
        .enumerate()
        .map(|(i, keys)| Request {
            ctx: ReqContext::new(format!("req-{i}")),
            keys,
            arrived: Instant::now(),
            arrived_step: 0,
        })
        .collect();
    // Arrivals spread evenly over the first 80% of the run.
    let per_step = cli.requests.div_ceil((cli.steps * 4 / 5).max(1));

    let progress = indicatif::ProgressBar::new(cli.requests as u64);
    progress.set_style(
        indicatif::ProgressStyle::with_template(
            "{elapsed_precise} [{bar:40}] {pos}/{len} requests {msg}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let mut waiting: Vec<Request> = Vec::new();
    let mut running: Vec<Running> = Vec::new();
    let mut pending_stores = Vec::new();
    let (mut sched_us, mut wait_steps, mut answer_ms) = (Vec::new(), Vec::new(), Vec::new());
    let mut from = vec![0usize; tiers.len()];
    let (mut finished, mut blocks_asked, mut failed_loads, mut verdict_errors) =
        (0usize, 0usize, 0usize, 0usize);
    let started = Instant::now();
    let mut step = 0;
    while step < cli.steps || !waiting.is_empty() || !running.is_empty() || !incoming.is_empty() {
        if step > cli.steps * 4 + 10_000 {
            return Err("requests still unfinished long after the last step".into());
        }
        for _ in 0..per_step {
            if let Some(mut r) = incoming.pop_front() {
                r.arrived = Instant::now();
                r.arrived_step = step;
                waiting.push(r);
            }
        }
        let t0 = Instant::now();
        let mut load_time = Duration::ZERO;
        let mut still_waiting = Vec::with_capacity(waiting.len());
        'requests: for request in waiting.drain(..) {
            let StackVerdict::Ready { locations } =
                stack.lookup_prefix(&request.keys, &request.ctx)?
            else {
                still_waiting.push(request);
                continue;
            };
            // Load every found block; a failed load marks it missing in its
            // tier and the request asks again next step. (Loads are timed
            // apart: an engine runs them off the scheduler thread.)
            let load_start = Instant::now();
            for (key, &t) in request.keys.iter().zip(&locations) {
                if !tiers[t].stored.contains(key) {
                    verdict_errors += 1; // a hit for a block never written there
                }
                let loaded = match &tiers[t].backend {
                    Backend::Disk(disk) => disk
                        .load(key)?
                        .is_some_and(|b| b == block_payload(key, cli.block_bytes)),
                    _ => !rng.chance(cli.load_failure),
                };
                if !loaded {
                    load_time += load_start.elapsed();
                    failed_loads += 1;
                    stack.mark_miss(t, std::slice::from_ref(key));
                    still_waiting.push(request);
                    continue 'requests;
                }
            }
            load_time += load_start.elapsed();
            blocks_asked += request.keys.len();
            for &t in &locations {
                from[t] += 1;
            }
            wait_steps.push((step - request.arrived_step) as f64);
            answer_ms.push(request.arrived.elapsed().as_secs_f64() * 1e3);
            running.push(Running {
                request,
                done_step: step + cli.compute_steps,
            });
        }
        waiting = still_waiting;
        stack.flush();
        sched_us.push(micros(t0.elapsed().saturating_sub(load_time)));

        // Requests done computing write their blocks to every tier and leave.
        let mut done = Vec::new();
        running.retain_mut(|r| {
            if r.done_step > step {
                return true;
            }
            done.push(std::mem::take(&mut r.request.keys));
            stack.cleanup(r.request.ctx.req_id());
            false
        });
        for keys in done {
            finished += 1;
            progress.inc(1);
            for tier in &mut tiers {
                tier.stored.extend(keys.iter().cloned());
                match &tier.backend {
                    Backend::Disk(disk) => {
                        for key in &keys {
                            disk.store(key, &block_payload(key, cli.block_bytes))?;
                        }
                    }
                    Backend::Mock(mock) => mock.insert(keys.iter().cloned()),
                    Backend::Redis(redis) => {
                        let redis = Arc::clone(redis);
                        let blocks: Vec<(OffloadKey, Vec<u8>)> = keys
                            .iter()
                            .map(|k| (k.clone(), block_payload(k, 64)))
                            .collect();
                        pending_stores.push(rt.spawn(async move {
                            redis
                                .store_many(&blocks, Some(Duration::from_secs(3600)))
                                .await
                                .is_ok()
                        }));
                    }
                    Backend::S3(s3) => {
                        let s3 = Arc::clone(s3);
                        let blocks: Vec<(OffloadKey, Vec<u8>)> = keys
                            .iter()
                            .map(|k| (k.clone(), block_payload(k, 64)))
                            .collect();
                        pending_stores
                            .push(rt.spawn(async move { s3.store_many(blocks).await.is_ok() }));
                    }
                }
            }
        }
        step += 1;
        std::thread::sleep(Duration::from_micros(cli.step_us));
    }
    progress.finish_and_clear();
    let wall = started.elapsed();
    let failed_stores = rt.block_on(async {
        let mut failed = 0;
        for store in pending_stores {
            if !store.await.unwrap_or(false) {
                failed += 1;
            }
        }
        failed
    });
    let idle_deadline = Instant::now() + Duration::from_secs(5);
    while !stack.is_idle() && Instant::now() < idle_deadline {
        stack.drain_results();
        std::thread::sleep(Duration::from_millis(1));
    }
    let state_empty = stack.is_idle();
    let stats = stack.stats();
    let disk_stats = disk.stats();
    stack.shutdown();

    if let Some(path) = &cli.plot {
        std::fs::write(
            path,
            cdf_svg(
                "time to answer per request (ms, arrival to answer)",
                &mut answer_ms.clone(),
            ),
        )?;
    }
    let hit_rate = from.iter().sum::<usize>() as f64 / blocks_asked.max(1) as f64;
    let tier_json = |t: &ManagerStats, blocks: usize| {
        json!({
            "tier": t.tier, "blocks_served": blocks, "lookups": t.lookups, "hits": t.hits, "misses": t.misses,
            "errors": t.errors, "timeouts": t.timeouts, "forced_misses": t.forced_misses,
            "ttv_p50_us": t.time_to_verdict.p50_us, "ttv_p99_us": t.time_to_verdict.p99_us,
            "tier_call_p50_us": t.tier_call_latency.p50_us, "tier_call_p99_us": t.tier_call_latency.p99_us,
        })
    };
    let summary = json!({
        "steps": step,
        "requests_finished": finished,
        "prefix_hit_rate": (hit_rate * 1000.0).round() / 1000.0,
        "failed_loads_marked_miss": failed_loads,
        "failed_background_stores": failed_stores,
        "verdict_errors": verdict_errors,
        "disk_evicted_segments": disk_stats.evicted_segments,
        "scheduler_us_per_step_note": "lookups and flushes; block loads and stores excluded",
        "scheduler_us_per_step_p50": quantile(&mut sched_us, 0.5).round(),
        "scheduler_us_per_step_p99": quantile(&mut sched_us, 0.99).round(),
        "wait_steps_p50": quantile(&mut wait_steps, 0.5),
        "wait_steps_p99": quantile(&mut wait_steps, 0.99),
        "answer_ms_p50": (quantile(&mut answer_ms, 0.5) * 100.0).round() / 100.0,
        "answer_ms_p99": (quantile(&mut answer_ms, 0.99) * 100.0).round() / 100.0,
        "state_empty_after_cleanup": state_empty,
        "wall_s": (wall.as_secs_f64() * 100.0).round() / 100.0,
        "tiers": stats.iter().zip(&from).map(|(t, &n)| tier_json(t, n)).collect::<Vec<_>>(),
    });
    if cli.json {
        println!("{summary}");
    } else {
        println!(
            "scheduler_sim: {step} steps, {finished} requests in {:.2} s; tiers: {} (disk in {})",
            wall.as_secs_f64(),
            stack.tier_names().join(" > "),
            disk_dir.display()
        );
        println!(
            "prefix hit rate {:.1}%; {failed_loads} failed loads marked missing; {verdict_errors} verdict errors; disk evicted {} segments",
            hit_rate * 100.0,
            disk_stats.evicted_segments
        );
        println!(
            "scheduler per step p50 / p99: {} / {} µs; time to answer p50 / p99: {} / {} ms; state empty after cleanup: {state_empty}",
            summary["scheduler_us_per_step_p50"],
            summary["scheduler_us_per_step_p99"],
            summary["answer_ms_p50"],
            summary["answer_ms_p99"]
        );
        println!();
        println!(
            "{:<14} {:>8} {:>9} {:>8} {:>8} {:>7} {:>9} {:>7} {:>16} {:>16}",
            "tier",
            "served",
            "lookups",
            "hits",
            "misses",
            "errors",
            "timeouts",
            "forced",
            "ttv p50/p99 µs",
            "call p50/p99 µs"
        );
        for (t, n) in stats.iter().zip(&from) {
            println!(
                "{:<14} {:>8} {:>9} {:>8} {:>8} {:>7} {:>9} {:>7} {:>16} {:>16}",
                t.tier,
                n,
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
        if let Some(path) = &cli.plot {
            println!("\nplot written to {}", path.display());
        }
    }
    if failed_stores > 0 {
        // Writes that failed (timeouts under load) leave blocks out of a
        // tier; lookups stay correct, so this is reported, not fatal.
        eprintln!("scheduler_sim: warning: {failed_stores} background store batches failed");
    }
    // Failure means a wrong answer or leaked state, never a slow tier.
    Ok(verdict_errors == 0 && state_empty && finished == cli.requests)
}

/// An SVG of the empirical CDF of `samples`.
fn cdf_svg(title: &str, samples: &mut [f64]) -> String {
    samples.sort_by(f64::total_cmp);
    let (w, h, pad) = (640.0, 400.0, 50.0);
    let max = samples.last().copied().unwrap_or(1.0).max(1e-9);
    let n = samples.len().max(1) as f64;
    let mut points = String::new();
    for (i, v) in samples.iter().enumerate() {
        let x = pad + v / max * (w - 2.0 * pad);
        let y = h - pad - (i + 1) as f64 / n * (h - 2.0 * pad);
        points.push_str(&format!("{x:.1},{y:.1} "));
    }
    let mut ticks = String::new();
    for k in 0..=4 {
        let f = f64::from(k) / 4.0;
        let x = pad + f * (w - 2.0 * pad);
        let y = h - pad - f * (h - 2.0 * pad);
        ticks.push_str(&format!(
            r##"<text x="{x:.0}" y="{:.0}" font-size="11" text-anchor="middle">{:.1}</text><text x="{:.0}" y="{y:.0}" font-size="11" text-anchor="end">{f:.2}</text><line x1="{pad}" y1="{y:.0}" x2="{:.0}" y2="{y:.0}" stroke="#eee"/>"##,
            h - pad + 16.0,
            f * max,
            pad - 6.0,
            w - pad
        ));
    }
    format!(
        r##"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}"><rect width="100%" height="100%" fill="white"/><text x="{:.0}" y="24" font-size="14" text-anchor="middle">{title} (n = {})</text>{ticks}<line x1="{pad}" y1="{:.0}" x2="{:.0}" y2="{:.0}" stroke="black"/><line x1="{pad}" y1="{pad}" x2="{pad}" y2="{:.0}" stroke="black"/><polyline fill="none" stroke="#1f77b4" stroke-width="2" points="{points}"/></svg>"##,
        w / 2.0,
        samples.len(),
        h - pad,
        w - pad,
        h - pad,
        h - pad
    )
}
