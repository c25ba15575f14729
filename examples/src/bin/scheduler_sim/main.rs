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
//!     --s3 kvtier-test --s3-endpoint http://127.0.0.1:19000 --plot
//! ```
//!
//! With `--prometheus 127.0.0.1:9000`, every tier's counters and histograms
//! (see `kvtier_core::metrics`) are served in Prometheus text format while
//! the simulation runs (and `--prometheus-linger-ms` after it ends).
//!
//! Every tier is checked before the run (Redis answers PING, S3 finds the
//! bucket with these credentials); a tier that fails the check ends the
//! program with a non-zero exit and one line naming the tier and the cause.

#![warn(clippy::unwrap_used)]

use std::collections::{HashSet, VecDeque};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use examples::{Rng, key_from_id, micros, plot, quantile};
use kvtier_core::{
    BlockStore, DynBlockStore, ManagerConfig, ManagerStats, OffloadKey, ReqContext, StackVerdict,
    TierStack, one_line,
};
use kvtier_disk::{DiskConfig, DiskTier, FsyncPolicy};
use kvtier_mock::{MockConfig, MockTier};
use kvtier_redis::{RedisConfig, RedisTier};
use kvtier_s3::{S3Config, S3Tier};
use serde_json::json;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

/// Simulates a vLLM-like scheduler asking kvtier's secondary tiers (disk,
/// then Redis / S3 if given, then a mock remote tier) for cached prefixes,
/// and reports hit rates, time to answer and each tier's errors.
#[derive(Debug, Parser)]
#[command(name = "scheduler_sim", version)]
#[command(group(clap::ArgGroup::new("redis_tier").args(["redis", "redis_cluster"]).multiple(true)))]
struct Cli {
    /// Scheduler steps to run (at least 1).
    #[arg(long, default_value_t = 2000, value_parser = at_least_one)]
    steps: usize,
    /// Requests arriving over the run (at least 1).
    #[arg(long, default_value_t = 1000, value_parser = at_least_one)]
    requests: usize,
    /// Distinct system prompts the requests share.
    #[arg(long, default_value_t = 8)]
    system_prompts: u64,
    /// Blocks in a system prompt.
    #[arg(long, default_value_t = 24)]
    system_blocks: usize,
    /// Blocks of each request's own text (at most this many, at least 1).
    #[arg(long, default_value_t = 16, value_parser = at_least_one)]
    user_blocks: usize,
    /// Fraction of requests that are follow-up turns of an earlier one (0 to 1).
    #[arg(long, default_value_t = 0.3, value_parser = fraction)]
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
    /// Bytes of KV data per block (at least 1).
    #[arg(long, default_value_t = 16 << 10, value_parser = at_least_one)]
    block_bytes: usize,
    /// Add a Redis tier at this URL (after disk): redis://, rediss:// (TLS) or redis+unix://.
    #[arg(long)]
    redis: Option<String>,
    /// Add a Redis Cluster tier with these seed URLs, comma-separated.
    #[arg(long)]
    redis_cluster: Option<String>,
    /// PEM file of a private CA that signed the Redis servers' TLS certificates
    /// (for rediss:// URLs; `scripts/services.sh` writes one as KVTIER_REDIS_TLS_CA).
    #[arg(long, requires = "redis_tier")]
    redis_ca: Option<PathBuf>,
    /// Add an S3 tier with this bucket (credentials from the AWS chain).
    #[arg(long)]
    s3: Option<String>,
    /// Endpoint of the S3-compatible server (path-style addressing); needs --s3.
    #[arg(long, requires = "s3")]
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
    /// Probability (0 to 1) that loading a block from a tier other than disk fails (exercises mark_miss).
    #[arg(long, default_value_t = 0.01, value_parser = fraction)]
    load_failure: f64,
    /// Plot time to answer (arrival to answer, per request) overall and per
    /// tier, as PATH.svg and PATH.png (default target/scheduler_sim/time_to_answer).
    #[arg(long, value_name = "PATH", num_args = 0..=1,
          default_missing_value = "target/scheduler_sim/time_to_answer")]
    plot: Option<PathBuf>,
    /// Seed of every random choice.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// Print the summary as one JSON line.
    #[arg(long)]
    json: bool,
    /// Serve every tier's metrics (kvtier_core::metrics) in Prometheus text
    /// format at http://ADDR/ (any path), e.g. 127.0.0.1:9000.
    #[arg(long, value_name = "ADDR")]
    prometheus: Option<std::net::SocketAddr>,
    /// After the summary, keep serving --prometheus this many milliseconds
    /// before exiting, so that a scraper sees the final counters.
    #[arg(long, value_name = "MS", requires = "prometheus")]
    prometheus_linger_ms: Option<u64>,
}

/// A count of at least 1.
fn at_least_one(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".to_owned()),
        Ok(n) => Ok(n),
        Err(e) => Err(format!("not a whole number: {e}")),
    }
}

/// A probability: a number from 0 to 1.
fn fraction(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(p) if (0.0..=1.0).contains(&p) => Ok(p),
        Ok(_) => Err("must be a number from 0 to 1".to_owned()),
        Err(e) => Err(format!("not a number: {e}")),
    }
}

/// `err` as a one-line cause naming `tier`.
fn tier_failed(tier: &str, err: &dyn std::error::Error) -> Box<dyn std::error::Error> {
    format!("{tier} tier: {}", one_line(err)).into()
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

/// A tier of the stack, as the simulation stores into and loads from it:
/// every tier through the one `BlockStore` interface.
struct SimTier {
    store: Arc<dyn DynBlockStore>,
    /// Size of the blocks the simulation stores here.
    block_bytes: usize,
    /// Whether a found block is loaded back and checked (the local disk);
    /// remote loads are simulated with `--load-failure`.
    verify_loads: bool,
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
    // Tiers log a misconfiguration once at ERROR. At start-up the failed
    // check's one-line cause says the same, so logging starts after the
    // checks (unless RUST_LOG asks for more).
    let from_env = tracing_subscriber::EnvFilter::try_from_default_env().ok();
    let user_filter = from_env.is_some();
    let (filter, reload) = tracing_subscriber::reload::Layer::new(
        from_env.unwrap_or_else(|| tracing_subscriber::EnvFilter::new("off")),
    );
    tracing_subscriber::registry()
        .with(filter)
        .with(tracing_subscriber::fmt::layer().with_writer(std::io::stderr))
        .init();
    let start_logging = move || {
        if !user_filter {
            let _ = reload.modify(|f| *f = tracing_subscriber::EnvFilter::new("error"));
        }
    };
    match run(&cli, &start_logging) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(err) => {
            eprintln!("scheduler_sim: {}", one_line(err.as_ref()));
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
fn run(cli: &Cli, start_logging: &dyn Fn()) -> Result<bool, Box<dyn std::error::Error>> {
    // Before any manager exists: each registers its metrics with the
    // recorder installed when it is built.
    if let Some(addr) = cli.prometheus {
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .with_http_listener(addr)
            .install()
            .map_err(|e| format!("prometheus exporter on {addr}: {}", one_line(&e)))?;
    }
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
    let disk = Arc::new(
        DiskTier::open(DiskConfig {
            capacity_bytes: capacity,
            segment_bytes: (capacity / 8).max(64 << 10),
            fsync: FsyncPolicy::Never,
            ..DiskConfig::new(&disk_dir)
        })
        .map_err(|e| tier_failed("disk", &e))?,
    );

    // The stack, fastest first.
    let mut stack = TierStack::default();
    let mut tiers: Vec<SimTier> = Vec::new();
    stack.push(Box::new(disk.manager(ManagerConfig::named("disk"))?));
    tiers.push(SimTier {
        store: Arc::clone(&disk) as Arc<dyn DynBlockStore>,
        block_bytes: cli.block_bytes,
        verify_loads: true,
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
        let tier = Arc::new(
            RedisTier::new(RedisConfig {
                key_prefix: run_prefix.clone(),
                tls_ca_cert: cli.redis_ca.clone(),
                ttl_ms: Some(3_600_000),
                ..config
            })
            .map_err(|e| tier_failed(name, &e))?,
        );
        rt.block_on(tier.ping())
            .map_err(|e| tier_failed(name, &e))?;
        stack.push(Box::new(tier.manager(ManagerConfig::named(name))?));
        tiers.push(SimTier {
            store: tier,
            block_bytes: 64,
            verify_loads: false,
            stored: HashSet::new(),
        });
    }
    if let Some(bucket) = &cli.s3 {
        let tier = Arc::new(
            rt.block_on(S3Tier::new(S3Config {
                endpoint: cli.s3_endpoint.clone(),
                force_path_style: cli.s3_endpoint.is_some(),
                prefix: run_prefix.replace(':', "/"),
                ..S3Config::new(bucket)
            }))
            .map_err(|e| tier_failed("s3", &e))?,
        );
        // HeadBucket: the bucket, the endpoint and the credentials, now.
        rt.block_on(tier.check())
            .map_err(|e| tier_failed("s3", &e))?;
        stack.push(Box::new(tier.manager(ManagerConfig::named("s3"))?));
        tiers.push(SimTier {
            store: tier,
            block_bytes: 64,
            verify_loads: false,
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
        stack.push(Box::new(mock.manager(ManagerConfig::named("mock"))?));
        tiers.push(SimTier {
            store: mock,
            block_bytes: 64,
            verify_loads: false,
            stored: HashSet::new(),
        });
    }

    // Every tier passed its check: from here on, tier errors are logged.
    start_logging();

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
    // Time to answer by the deepest tier that served one of the request's
    // blocks (the answer waited for that tier and every one before it);
    // the last group holds requests with no block found anywhere.
    let mut answer_ms_by_tier: Vec<Vec<f64>> = vec![Vec::new(); tiers.len() + 1];
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
                let tier = &tiers[t];
                let loaded = if tier.verify_loads {
                    rt.block_on(tier.store.load_dyn(key))?
                        .is_some_and(|b| b == block_payload(key, tier.block_bytes))
                } else {
                    !rng.chance(cli.load_failure)
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
            let answered_ms = request.arrived.elapsed().as_secs_f64() * 1e3;
            answer_ms.push(answered_ms);
            let deepest = locations.iter().copied().max().unwrap_or(tiers.len());
            answer_ms_by_tier[deepest].push(answered_ms);
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
                let blocks: Vec<(OffloadKey, Vec<u8>)> = keys
                    .iter()
                    .map(|k| (k.clone(), block_payload(k, tier.block_bytes)))
                    .collect();
                if tier.verify_loads {
                    // The local disk: stored now, so a failure stops the run.
                    rt.block_on(tier.store.store_many_dyn(&blocks))?;
                } else {
                    // Remote tiers: in the background, as an engine would.
                    let store = Arc::clone(&tier.store);
                    pending_stores
                        .push(rt.spawn(async move { store.store_many_dyn(&blocks).await.is_ok() }));
                }
            }
        }
        step += 1;
        std::thread::sleep(Duration::from_micros(cli.step_us));
    }
    progress.finish_and_clear();
    let wall = started.elapsed();
    // Remote stores run in the background; the run's blocks are written
    // before the summary, so a slow tier shows here, not as a silent pause.
    let unfinished = pending_stores.iter().filter(|h| !h.is_finished()).count();
    let store_bar = indicatif::ProgressBar::new(unfinished as u64);
    if unfinished > 0 {
        store_bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{elapsed_precise} [{bar:40}] {pos}/{len} background store batches to Redis / S3 still finishing",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
    }
    let failed_stores = rt.block_on(async {
        let mut failed = 0;
        for store in pending_stores {
            let was_finished = store.is_finished();
            if !store.await.unwrap_or(false) {
                failed += 1;
            }
            if !was_finished {
                store_bar.inc(1);
            }
        }
        failed
    });
    store_bar.finish_and_clear();
    let idle_deadline = Instant::now() + Duration::from_secs(5);
    while !stack.is_idle() && Instant::now() < idle_deadline {
        stack.drain_results();
        std::thread::sleep(Duration::from_millis(1));
    }
    let state_empty = stack.is_idle();
    let stats = stack.stats();
    let disk_stats = disk.stats();
    stack.shutdown();

    // "all requests", then one group per deepest serving tier.
    let names = stack.tier_names();
    let mut groups = vec![plot::Series {
        name: "all requests".to_owned(),
        samples_ms: answer_ms.clone(),
    }];
    for (i, samples) in answer_ms_by_tier.iter().enumerate() {
        if samples.is_empty() {
            continue;
        }
        groups.push(plot::Series {
            name: match names.get(i) {
                Some(name) => format!("deepest tier {name}"),
                None => "no block found".to_owned(),
            },
            samples_ms: samples.clone(),
        });
    }
    let plotted = match &cli.plot {
        Some(path) => Some(plot::write_cdf(
            path,
            "scheduler_sim: time to answer per request (arrival to answer)",
            &groups,
        )?),
        None => None,
    };
    let hit_rate = from.iter().sum::<usize>() as f64 / blocks_asked.max(1) as f64;
    let tier_json = |t: &ManagerStats, blocks: usize| {
        json!({
            "tier": t.tier, "blocks_served": blocks, "lookups": t.lookups, "hits": t.hits, "misses": t.misses,
            "errors": t.errors, "timeouts": t.timeouts, "forced_misses": t.forced_misses,
            "ttv_p50_us": t.time_to_verdict.p50_us, "ttv_p99_us": t.time_to_verdict.p99_us,
            "tier_call_p50_us": t.tier_call_latency.p50_us, "tier_call_p99_us": t.tier_call_latency.p99_us,
            "first_error": t.first_error,
        })
    };
    let group_json = |g: &plot::Series| {
        let (p50, p90, p99) = plot::percentiles(&g.samples_ms);
        json!({
            "group": g.name, "requests": g.samples_ms.len(),
            "p50_ms": (p50 * 100.0).round() / 100.0,
            "p90_ms": (p90 * 100.0).round() / 100.0,
            "p99_ms": (p99 * 100.0).round() / 100.0,
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
        "answer_ms_by_deepest_tier": groups.iter().map(group_json).collect::<Vec<_>>(),
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
        let with_errors: Vec<&ManagerStats> =
            stats.iter().filter(|t| t.first_error.is_some()).collect();
        if !with_errors.is_empty() {
            println!("\nfirst error of each tier that had errors or timeouts:");
            for t in with_errors {
                println!(
                    "  {}: {}",
                    t.tier,
                    t.first_error.as_deref().unwrap_or_default()
                );
            }
        }
        println!(
            "\n{:<32} {:>8} {:>10} {:>10} {:>10}",
            "time to answer (ms)", "requests", "p50", "p90", "p99"
        );
        for g in &groups {
            let (p50, p90, p99) = plot::percentiles(&g.samples_ms);
            println!(
                "{:<32} {:>8} {:>10.2} {:>10.2} {:>10.2}",
                g.name,
                g.samples_ms.len(),
                p50,
                p90,
                p99
            );
        }
        if let Some((svg, png)) = &plotted {
            println!("\nplot written to {} and {}", svg.display(), png.display());
        }
    }
    if failed_stores > 0 {
        // Writes that failed (timeouts under load) leave blocks out of a
        // tier; lookups stay correct, so this is reported, not fatal.
        eprintln!("scheduler_sim: warning: {failed_stores} background store batches failed");
    }
    if let Some(ms) = cli.prometheus_linger_ms {
        std::thread::sleep(Duration::from_millis(ms));
    }
    // Failure means a wrong answer or leaked state, never a slow tier.
    Ok(verdict_errors == 0 && state_empty && finished == cli.requests)
}
