//! kvbench: kvtier's benchmarks, each with its baseline measured in the same run.
//!
//! ```text
//! cargo run --release -p examples --bin kvbench -- w1 --json
//! cargo run --release -p examples --bin kvbench -- all
//! ```
//!
//! Every measurement prints one JSON line with `workload`, `tier`, `params`
//! and the workload's figures; without `--json` a readable summary follows.

#![warn(clippy::unwrap_used)]

use std::collections::HashMap;
use std::hint::black_box;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use examples::{CountingAlloc, Rng, key_from_id, micros, quantile};
use kvtier_core::{AsyncLookupManager, LookupVerdict, ManagerConfig, OffloadKey, ReqContext};
use kvtier_disk::{DiskConfig, DiskTier, FsyncPolicy};
use kvtier_mock::{MockConfig, MockTier, RequestFault};
use serde_json::{Value, json};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc::new();

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Workload {
    /// Hot path: lookups of resolved keys against a bare HashMap.
    W1,
    /// Scheduler step cycle on the zero-latency mock tier.
    W2,
    /// W2 with one request's tier call taking 200 ms.
    #[value(name = "w2-slow")]
    W2Slow,
    /// Manager memory per tracked key.
    Mem,
    /// Redis tier (single node and cluster) next to redis-benchmark.
    W3,
    /// S3 tier at concurrency 1, 16, 64 next to a raw aws-sdk-s3 HEAD loop.
    W4,
    /// Disk tier: batch lookups, reopen time, store throughput.
    W5,
    /// Every workload above.
    All,
}

/// kvtier benchmarks; each reports its same-run baseline and the ratio.
#[derive(Debug, Parser)]
#[command(name = "kvbench", version)]
struct Cli {
    /// Which workload to run.
    #[arg(value_enum)]
    workload: Workload,
    /// Print only JSON lines.
    #[arg(long)]
    json: bool,
    /// Smaller sizes, for a smoke run (figures are then not comparable).
    #[arg(long)]
    quick: bool,
    /// In w2/w2-slow, wait the 1 ms between steps by spinning instead of
    /// sleeping (shows the cost without cold caches after a sleep).
    #[arg(long)]
    spin_poll: bool,
    /// Directory for on-disk workloads (a temporary directory inside it is
    /// used and removed). Default: the system's temporary directory.
    #[arg(long)]
    dir: Option<std::path::PathBuf>,
    /// Seed of every random choice.
    #[arg(long, default_value_t = 42)]
    seed: u64,
}

type Failure = Box<dyn std::error::Error>;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let workloads: &[Workload] = match cli.workload {
        Workload::All => &[
            Workload::W1,
            Workload::W2,
            Workload::W2Slow,
            Workload::Mem,
            Workload::W3,
            Workload::W4,
            Workload::W5,
        ],
        ref one => std::slice::from_ref(one),
    };
    let mut lines = Vec::new();
    for &w in workloads {
        // `all` runs what is configured: the server workloads need their services.
        let needs = match w {
            Workload::W3 => Some("KVTIER_REDIS_URL"),
            Workload::W4 => Some("KVTIER_S3_ENDPOINT"),
            _ => None,
        };
        if cli.workload == Workload::All
            && let Some(var) = needs
            && std::env::var_os(var).is_none()
        {
            eprintln!(
                "kvbench: {w:?} skipped: {var} is not set (run `scripts/services.sh start` and `source .services/env`)"
            );
            continue;
        }
        // Server workloads measure several configurations: a line each.
        let result = match w {
            Workload::W1 => w1(&cli).map(|line| vec![line]),
            Workload::W2 => step_cycle(&cli, false).map(|line| vec![line]),
            Workload::W2Slow => step_cycle(&cli, true).map(|line| vec![line]),
            Workload::Mem => mem(&cli).map(|line| vec![line]),
            Workload::W3 => w3(&cli),
            Workload::W4 => w4(&cli),
            Workload::W5 => w5(&cli).map(|line| vec![line]),
            Workload::All => continue,
        };
        match result {
            Ok(more) => {
                for line in more {
                    println!("{line}");
                    lines.push(line);
                }
            }
            Err(err) => {
                eprintln!("kvbench: {w:?} failed: {err}");
                return ExitCode::FAILURE;
            }
        }
    }
    if !cli.json {
        print_table(&lines);
    }
    ExitCode::SUCCESS
}

fn print_table(lines: &[Value]) {
    println!();
    println!("{:<10} {:<6} figures", "workload", "tier");
    for line in lines {
        let figures: Vec<String> = line
            .as_object()
            .into_iter()
            .flatten()
            .filter(|(k, _)| !matches!(k.as_str(), "workload" | "tier" | "params"))
            .map(|(k, v)| match v.as_f64() {
                Some(f) if f.fract() != 0.0 => format!("{k}={f:.3}"),
                _ => format!("{k}={v}"),
            })
            .collect();
        println!(
            "{:<10} {:<6} {}",
            line["workload"].as_str().unwrap_or("?"),
            line["tier"].as_str().unwrap_or("?"),
            figures.join("  ")
        );
    }
}

fn quiet_mock() -> Arc<MockTier> {
    Arc::new(MockTier::new(MockConfig {
        record_calls: false,
        ..MockConfig::default()
    }))
}

/// Looks up every key until none is pending.
fn resolve_all<T: kvtier_core::Tier>(
    m: &mut AsyncLookupManager<T>,
    keys: &[OffloadKey],
    ctx: &ReqContext,
) -> Result<(), Failure> {
    let start = Instant::now();
    loop {
        let mut pending = 0;
        for k in keys {
            if m.lookup(k, ctx)? == LookupVerdict::Pending {
                pending += 1;
            }
        }
        if pending == 0 {
            return Ok(());
        }
        if start.elapsed() > Duration::from_secs(60) {
            return Err(format!("{pending} keys still pending after 60 s").into());
        }
        m.flush();
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// W1: 100k resolved keys, 1M lookups in a precomputed random order, next to
/// a bare HashMap::get over the same keys in the same order.
fn w1(cli: &Cli) -> Result<Value, Failure> {
    let n_keys: usize = 100_000;
    let n_lookups: usize = if cli.quick { 100_000 } else { 1_000_000 };
    let keys: Vec<OffloadKey> = (0..n_keys as u64).map(|i| key_from_id(i, 36)).collect();
    let tier = quiet_mock();
    tier.insert(keys.iter().step_by(2).cloned());
    let mut m = AsyncLookupManager::from_arc(
        Arc::clone(&tier),
        ManagerConfig {
            max_queued_keys: n_keys * 2,
            ..ManagerConfig::named("mock")
        },
    )?;
    let ctx = ReqContext::new("w1");
    resolve_all(&mut m, &keys, &ctx)?;

    let mut rng = Rng::new(cli.seed);
    let order: Vec<usize> = (0..n_lookups)
        .map(|_| rng.below(n_keys as u64) as usize)
        .collect();
    // The manager's own key maps pass the key's precomputed hash through.
    let fast: HashMap<OffloadKey, bool, kvtier_core::BuildPrehashed> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| (k.clone(), i % 2 == 0))
        .collect();
    let std_map: HashMap<OffloadKey, bool> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| (k.clone(), i % 2 == 0))
        .collect();

    // Interleave the three measurements, five rounds, and keep each one's median.
    let (mut ours, mut base, mut base_std) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..5 {
        let t = Instant::now();
        let mut hits = 0usize;
        for &i in &order {
            if m.lookup(black_box(&keys[i]), &ctx)? == LookupVerdict::Hit {
                hits += 1;
            }
        }
        ours.push(t.elapsed().as_nanos() as f64 / n_lookups as f64);
        black_box(hits);

        for (map_ns, map) in [(&mut base, &fast as &dyn Lookup), (&mut base_std, &std_map)] {
            let t = Instant::now();
            let mut hits = 0usize;
            for &i in &order {
                if map.get_bool(black_box(&keys[i])) {
                    hits += 1;
                }
            }
            map_ns.push(t.elapsed().as_nanos() as f64 / n_lookups as f64);
            black_box(hits);
        }
    }
    let ns = quantile(&mut ours, 0.5);
    let baseline = quantile(&mut base, 0.5);
    let baseline_std = quantile(&mut base_std, 0.5);
    m.shutdown();
    Ok(json!({
        "workload": "w1",
        "tier": "mock",
        "params": { "keys": n_keys, "lookups": n_lookups, "key_len": 36, "requests": 1, "rounds": 5,
                    "baseline": "HashMap<OffloadKey, bool> with the manager's prehashed hasher" },
        "ns_per_lookup": round3(ns),
        "baseline_ns_per_lookup": round3(baseline),
        "ratio": round3(ns / baseline),
        "baseline_std_hasher_ns_per_lookup": round3(baseline_std),
        "ratio_std_hasher": round3(ns / baseline_std),
    }))
}

/// Both baseline maps behind one call, so the timing loop is shared.
trait Lookup {
    fn get_bool(&self, key: &OffloadKey) -> bool;
}

impl<S: std::hash::BuildHasher> Lookup for HashMap<OffloadKey, bool, S> {
    #[inline]
    fn get_bool(&self, key: &OffloadKey) -> bool {
        self.get(key).copied().unwrap_or(false)
    }
}

fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

struct Request {
    ctx: ReqContext,
    keys: Vec<OffloadKey>,
    present: Vec<bool>,
    verdicts: Vec<Option<LookupVerdict>>,
}

struct Cohort {
    arrival_step: usize,
    flushed_at: Option<Instant>,
    /// Per request: context, keys, whether each key exists, verdicts so far.
    requests: Vec<Request>,
    remaining: usize,
}

/// The 1 ms between two scheduler steps, slept or (`--spin-poll`) spun;
/// the manager's step loop and its baseline are paced by this one function.
fn pace_step(cli: &Cli) {
    if cli.spin_poll {
        let t = Instant::now();
        while t.elapsed() < Duration::from_millis(1) {
            std::hint::spin_loop();
        }
    } else {
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// W2 and W2-slow: a cohort of 64 requests × 32 keys arrives every step;
/// each step looks up every (request, key) without a verdict, flushes, and
/// sleeps 1 ms. Half of each request's keys are shared by 4 requests, half
/// of all keys exist in the tier.
fn step_cycle(cli: &Cli, slow: bool) -> Result<Value, Failure> {
    const REQUESTS: usize = 64;
    const KEYS: usize = 32;
    const SHARERS: usize = 4;
    const SLOW: Duration = Duration::from_millis(200);
    let cohorts = if cli.quick { 30 } else { 200 };
    let workload = if slow { "w2-slow" } else { "w2" };

    let tier = quiet_mock();
    let mut rng = Rng::new(cli.seed);
    let mut truth: HashMap<OffloadKey, bool> = HashMap::new();
    let mut next_id = 1u64 << 40;
    let mut make_key = |truth: &mut HashMap<OffloadKey, bool>| {
        next_id += 1;
        let key = key_from_id(next_id, 32);
        let present = rng.chance(0.5);
        if present {
            tier.insert([key.clone()]);
        }
        truth.insert(key.clone(), present);
        key
    };
    let mut pending_cohorts: Vec<Cohort> = Vec::new();
    for c in 0..cohorts {
        let shared: Vec<Vec<OffloadKey>> = (0..REQUESTS / SHARERS)
            .map(|_| (0..KEYS / 2).map(|_| make_key(&mut truth)).collect())
            .collect();
        let requests = (0..REQUESTS)
            .map(|r| {
                let mut keys = shared[r / SHARERS].clone();
                keys.extend((0..KEYS / 2).map(|_| make_key(&mut truth)));
                Request {
                    ctx: ReqContext::new(format!("c{c}-r{r}")),
                    present: keys.iter().map(|k| truth[k]).collect(),
                    keys,
                    verdicts: vec![None; KEYS],
                }
            })
            .collect();
        pending_cohorts.push(Cohort {
            arrival_step: 0,
            flushed_at: None,
            requests,
            remaining: REQUESTS * KEYS,
        });
    }
    if slow {
        tier.set_request_fault("c0-r0", RequestFault::Delay(SLOW));
    }
    // The same cohorts for the minimal step loop, run after the manager's.
    let plan: Vec<Vec<(Vec<OffloadKey>, Vec<bool>)>> = pending_cohorts
        .iter()
        .map(|c| {
            c.requests
                .iter()
                .map(|r| (r.keys.clone(), r.present.clone()))
                .collect()
        })
        .collect();
    pending_cohorts.reverse(); // pop() yields cohort 0 first

    let mut m = AsyncLookupManager::from_arc(Arc::clone(&tier), ManagerConfig::named("mock"))?;
    let mut active: Vec<(usize, Cohort)> = Vec::new();
    let mut step = 0usize;
    let mut next_cohort = 0usize;
    let (mut sched_us, mut steps_to_resolve, mut ttv_us, mut slow_ttv_us) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    let mut verdict_errors = 0u64;
    let mut flush_us = Vec::new();
    let started = Instant::now();
    while !(pending_cohorts.is_empty() && active.is_empty()) {
        if started.elapsed() > Duration::from_secs(120) {
            return Err("step cycle did not finish within 120 s".into());
        }
        if let Some(mut cohort) = pending_cohorts.pop() {
            cohort.arrival_step = step;
            active.push((next_cohort, cohort));
            next_cohort += 1;
        }
        let t0 = Instant::now();
        for (c, cohort) in &mut active {
            for (r, req) in cohort.requests.iter_mut().enumerate() {
                for ((key, verdict), &present) in req
                    .keys
                    .iter()
                    .zip(req.verdicts.iter_mut())
                    .zip(&req.present)
                {
                    if verdict.is_some() {
                        continue;
                    }
                    let v = m.lookup(key, &req.ctx)?;
                    if v == LookupVerdict::Pending {
                        continue;
                    }
                    *verdict = Some(v);
                    cohort.remaining -= 1;
                    if (v == LookupVerdict::Hit) != present {
                        verdict_errors += 1;
                    }
                    if let Some(flushed_at) = cohort.flushed_at {
                        let ttv = micros(t0.saturating_duration_since(flushed_at));
                        if slow && *c == 0 && r < SHARERS {
                            slow_ttv_us.push(ttv);
                        } else if !slow || *c > 0 {
                            ttv_us.push(ttv);
                        }
                    }
                }
            }
        }
        let t_flush = Instant::now();
        m.flush();
        let t1 = Instant::now();
        sched_us.push(micros(t1 - t0));
        flush_us.push(micros(t1 - t_flush));
        for (_, cohort) in &mut active {
            cohort.flushed_at.get_or_insert(t1);
        }
        active.retain(|(_, cohort)| {
            if cohort.remaining > 0 {
                return true;
            }
            steps_to_resolve.push((step - cohort.arrival_step) as f64);
            for req in &cohort.requests {
                m.cleanup(req.ctx.req_id());
            }
            false
        });
        step += 1;
        pace_step(cli);
    }
    // Let any retained in-flight probe land, then check nothing is left.
    let wait = Instant::now();
    while !m.is_idle() && wait.elapsed() < Duration::from_secs(5) {
        m.drain_results();
        std::thread::sleep(Duration::from_millis(1));
    }
    let state_empty = m.is_idle();
    let stats = m.stats();
    m.shutdown();
    let mut base_us = minimal_step_loop(cli, &plan)?;
    let sched_p50 = quantile(&mut sched_us, 0.5);
    let base_p50 = quantile(&mut base_us, 0.5);
    let mut line = json!({
        "workload": workload,
        "tier": "mock",
        "params": { "cohorts": cohorts, "requests_per_step": REQUESTS, "keys_per_request": KEYS,
                    "key_len": 32, "shared_fraction": 0.5, "sharers_per_key": SHARERS,
                    "present_fraction": 0.5, "poll_ms": 1, "spin_poll": cli.spin_poll,
                    "slow_request_ms": if slow { SLOW.as_millis() as u64 } else { 0 },
                    "ttv_scope": if slow { "cohorts after the slow one" } else { "all keys" } },
        "scheduler_us_per_step": round3(sched_p50),
        "baseline_us_per_step": round3(base_p50),
        "ratio": round3(sched_p50 / base_p50),
        "baseline": "minimal step loop: HashMap<OffloadKey, u8> get-or-insert and a push per new key, one get per resolved key, answers applied with one get_mut per key, flush moves each request's Vec",
        "scheduler_us_per_step_p99": round3(quantile(&mut sched_us, 0.99)),
        "flush_us_per_step": round3(quantile(&mut flush_us, 0.5)),
        "steps_to_resolve": quantile(&mut steps_to_resolve, 0.5),
        "ttv_p50_us": round3(quantile(&mut ttv_us, 0.5)),
        "ttv_p99_us": round3(quantile(&mut ttv_us, 0.99)),
        "verdict_errors": verdict_errors,
        "state_empty_after_cleanup": state_empty,
        "tier_calls": stats.calls_started,
        "errors": stats.errors + stats.timeouts,
    });
    if slow {
        line["slow_request_ttv_p50_us"] = json!(round3(quantile(&mut slow_ttv_us, 0.5)));
    }
    Ok(line)
}

/// W2's baseline: the step loop any correct ledger must run, over the same
/// cohorts with the same schedule (a cohort arrives each step, its keys are
/// answered by the next step), timed over the same window (answers applied,
/// lookups, flush). A new key is a get-or-insert into a
/// `HashMap<OffloadKey, u8>` plus a push onto its request's batch; a
/// resolved key one `get`; flush moves each request's `Vec` out whole. The
/// tier's answers are computed outside the timed window (the manager's come
/// from its worker thread), and applied inside it with one `get_mut` per key.
/// Returns the microseconds of each step.
fn minimal_step_loop(
    cli: &Cli,
    plan: &[Vec<(Vec<OffloadKey>, Vec<bool>)>],
) -> Result<Vec<f64>, Failure> {
    const PENDING: u8 = 0;
    const HIT: u8 = 1;
    const MISS: u8 = 2;
    struct Req<'a> {
        keys: &'a [OffloadKey],
        present: &'a [bool],
        verdicts: Vec<u8>,
    }
    let mut state: HashMap<OffloadKey, u8, kvtier_core::BuildPrehashed> = HashMap::default();
    let truth: HashMap<&OffloadKey, bool> = plan
        .iter()
        .flatten()
        .flat_map(|(keys, present)| keys.iter().zip(present.iter().copied()))
        .collect();
    let mut upcoming = plan.iter();
    let mut active: Vec<(Vec<Req<'_>>, usize)> = Vec::new();
    let mut answers: Vec<(Vec<OffloadKey>, Vec<bool>)> = Vec::new();
    let mut step_us = Vec::new();
    let mut verdict_errors = 0u64;
    let started = Instant::now();
    while upcoming.len() > 0 || !active.is_empty() {
        if started.elapsed() > Duration::from_secs(120) {
            return Err("minimal step loop did not finish within 120 s".into());
        }
        if let Some(cohort) = upcoming.next() {
            let reqs: Vec<Req<'_>> = cohort
                .iter()
                .map(|(keys, present)| Req {
                    keys,
                    present,
                    verdicts: vec![PENDING; keys.len()],
                })
                .collect();
            let remaining = reqs.iter().map(|r| r.keys.len()).sum();
            active.push((reqs, remaining));
        }
        let t0 = Instant::now();
        for (keys, found) in answers.drain(..) {
            for (key, present) in keys.iter().zip(found) {
                if let Some(s) = state.get_mut(key) {
                    *s = if present { HIT } else { MISS };
                }
            }
        }
        let mut batch: Vec<Vec<OffloadKey>> = Vec::new();
        for (reqs, remaining) in &mut active {
            for req in reqs.iter_mut() {
                let mut new_keys = Vec::new();
                for ((key, verdict), &present) in req
                    .keys
                    .iter()
                    .zip(req.verdicts.iter_mut())
                    .zip(req.present)
                {
                    if *verdict != PENDING {
                        continue;
                    }
                    match state.get(black_box(key)) {
                        Some(&PENDING) => continue,
                        Some(&v) => {
                            *verdict = v;
                            *remaining -= 1;
                            if (v == HIT) != present {
                                verdict_errors += 1;
                            }
                        }
                        None => {
                            state.insert(key.clone(), PENDING);
                            new_keys.push(key.clone());
                        }
                    }
                }
                if !new_keys.is_empty() {
                    batch.push(new_keys);
                }
            }
        }
        // flush: each request's keys move out whole.
        let flushed = black_box(std::mem::take(&mut batch));
        step_us.push(micros(t0.elapsed()));
        // The tier's side, outside the scheduler's time.
        for keys in flushed {
            let found = keys
                .iter()
                .map(|k| truth.get(k).copied().unwrap_or(false))
                .collect();
            answers.push((keys, found));
        }
        active.retain(|(reqs, remaining)| {
            if *remaining > 0 {
                return true;
            }
            for req in reqs {
                for key in req.keys {
                    state.remove(key);
                }
            }
            false
        });
        pace_step(cli);
    }
    if verdict_errors > 0 || !state.is_empty() {
        return Err(format!(
            "minimal step loop: {verdict_errors} wrong verdicts, {} keys left",
            state.len()
        )
        .into());
    }
    Ok(step_us)
}

/// Memory: live heap bytes of the manager per tracked key, 1,000 requests of
/// 100 distinct resolved keys each, measured with a counting allocator.
fn mem(cli: &Cli) -> Result<Value, Failure> {
    let (requests, per_request) = if cli.quick { (100, 100) } else { (1000, 100) };
    let tier = quiet_mock();
    let contexts: Vec<ReqContext> = (0..requests)
        .map(|r| ReqContext::new(format!("mem-{r}")))
        .collect();
    let prompts: Vec<Vec<OffloadKey>> = (0..requests)
        .map(|r| {
            (0..per_request)
                .map(|i| key_from_id((r * per_request + i) as u64, 36))
                .collect()
        })
        .collect();
    tier.insert(prompts.iter().flatten().step_by(2).cloned());
    let mut m = AsyncLookupManager::from_arc(
        Arc::clone(&tier),
        ManagerConfig {
            max_queued_keys: requests * per_request * 2,
            ..ManagerConfig::named("mock")
        },
    )?;
    // Warm the worker and the histograms so their one-off allocations are not counted.
    let warm = ReqContext::new("warm");
    resolve_all(&mut m, &[key_from_id(u64::MAX, 36)], &warm)?;
    m.cleanup("warm");
    m.drain_results();

    ALLOC.set_enabled(true);
    let before = ALLOC.live_bytes();
    for (ctx, prompt) in contexts.iter().zip(&prompts) {
        for k in prompt {
            m.lookup(k, ctx)?;
        }
    }
    m.flush();
    for (ctx, prompt) in contexts.iter().zip(&prompts) {
        resolve_all(&mut m, prompt, ctx)?;
    }
    let tracked = m.stats().tracked_keys;
    let after = ALLOC.live_bytes();
    ALLOC.set_enabled(false);
    for ctx in &contexts {
        m.cleanup(ctx.req_id());
    }
    let per_key = (after - before) as f64 / tracked.max(1) as f64;
    m.shutdown();
    Ok(json!({
        "workload": "mem",
        "tier": "mock",
        "params": { "requests": requests, "keys_per_request": per_request, "key_len": 36,
                    "state": "resolved, one request per key" },
        "tracked_keys": tracked,
        "bytes_per_tracked_key": round3(per_key),
        "baseline_bytes_per_key": std::mem::size_of::<(OffloadKey, bool)>(),
    }))
}

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
        tier.store(&key_from_id(i, 36), &i.to_le_bytes().repeat(2))?;
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
    Ok(quantile(&mut samples, 0.5))
}

/// W5: the disk tier. Lookups of 1,024-key batches (half present) over a
/// 1M-key index next to an in-memory HashSet and to one stat() per key on
/// one-file-per-block storage (vLLM's file-system tier); reopen time at 10k
/// and 1M keys; store throughput of 256 KiB payloads next to a raw
/// sequential write of the same bytes.
fn w5(cli: &Cli) -> Result<Value, Failure> {
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
            tier.store(&key_from_id(i as u64, 36), &block)?;
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
        "mb_per_s": round3(store_rates[0]),
        "baseline_mb_per_s": round3(raw_rates[0]),
        "ratio": round3(store_rates[0] / raw_rates[0]),
        "mb_per_s_fsync_always": round3(store_rates[1]),
        "baseline_mb_per_s_fsync_each": round3(raw_rates[1]),
        "ratio_fsync_always": round3(store_rates[1] / raw_rates[1]),
    }))
}

/// The median of `ours[i] / baseline[i]`: each round's rate against the
/// baseline measured right after it, so drifts of the machine between rounds
/// cancel out.
fn paired_ratio(ours: &[f64], baseline: &[f64]) -> f64 {
    let mut ratios: Vec<f64> = ours.iter().zip(baseline).map(|(a, b)| a / b).collect();
    quantile(&mut ratios, 0.5)
}

/// `host` and `port` of a `redis://host:port/...` URL.
fn host_port(url: &str) -> Option<(String, u16)> {
    let rest = url.split("://").nth(1)?;
    let authority = rest.split('/').next()?;
    let authority = authority.rsplit('@').next()?;
    let (host, port) = authority.rsplit_once(':')?;
    Some((host.to_owned(), port.parse().ok()?))
}

/// Slot ranges `(first, last, master index)` and each master's URL: from
/// `CLUSTER SLOTS` when `urls` are a cluster's seeds, else the one server
/// (with no ranges).
async fn redis_layout(urls: &[String]) -> Result<(Vec<(u16, u16, usize)>, Vec<String>), Failure> {
    if urls.len() < 2 {
        return Ok((Vec::new(), urls.to_vec()));
    }
    let seed = redis::Client::open(urls[0].as_str())?;
    let mut conn = seed.get_multiplexed_async_connection().await?;
    let reply: Vec<(u16, u16, (String, u16))> = redis::cmd("CLUSTER")
        .arg("SLOTS")
        .query_async::<Vec<redis::Value>>(&mut conn)
        .await?
        .into_iter()
        .map(|entry| {
            let redis::Value::Array(fields) = entry else {
                return Err("CLUSTER SLOTS: not an array");
            };
            let int = |v: &redis::Value| redis::from_redis_value_ref::<u16>(v).ok();
            let host_port = match fields.get(2) {
                Some(redis::Value::Array(node)) => node
                    .first()
                    .and_then(|h| redis::from_redis_value_ref::<String>(h).ok())
                    .zip(node.get(1).and_then(int)),
                _ => None,
            };
            match (
                fields.first().and_then(int),
                fields.get(1).and_then(int),
                host_port,
            ) {
                (Some(a), Some(b), Some(node)) => Ok((a, b, node)),
                _ => Err("CLUSTER SLOTS: unexpected entry"),
            }
        })
        .collect::<Result<_, _>>()?;
    let mut ranges = Vec::new();
    let mut masters: Vec<(String, u16)> = Vec::new();
    for (a, b, node) in reply {
        let idx = match masters.iter().position(|m| *m == node) {
            Some(i) => i,
            None => {
                masters.push(node);
                masters.len() - 1
            }
        };
        ranges.push((a, b, idx));
    }
    let urls = masters
        .iter()
        .map(|(host, port)| format!("redis://{host}:{port}/"))
        .collect();
    Ok((ranges, urls))
}

/// The client library alone on `steps`' keys: one EXISTS pipeline per step
/// and master (keys grouped by master before the clock starts), over one
/// redis-rs multiplexed connection per master, eight steps in flight like
/// the manager's default. Returns keys/s; checks the number of hits.
async fn raw_redis_loop(urls: &[String], prefix: &str, steps: &[Step]) -> Result<f64, Failure> {
    use futures_util::StreamExt;
    let (ranges, masters) = redis_layout(urls).await?;
    let mut conns = Vec::new();
    for url in &masters {
        let client = redis::Client::open(url.as_str())?;
        conns.push(client.get_multiplexed_async_connection().await?);
    }
    let owner = |name: &[u8]| -> usize {
        let slot = kvtier_redis::slot::key_slot(name);
        ranges
            .iter()
            .find(|&&(a, b, _)| a <= slot && slot <= b)
            .map_or(0, |&(_, _, m)| m)
    };
    // Per step, per master: the full key names.
    let grouped: Vec<Vec<Vec<Vec<u8>>>> = steps
        .iter()
        .map(|(_, keys, _)| {
            let mut groups = vec![Vec::new(); conns.len()];
            for key in keys {
                let mut name = prefix.as_bytes().to_vec();
                name.extend_from_slice(key.as_bytes());
                groups[owner(&name)].push(name);
            }
            groups
        })
        .collect();
    let t = Instant::now();
    let work = grouped.iter().map(|groups| {
        let conns = &conns;
        async move {
            let pipelines =
                groups
                    .iter()
                    .zip(conns)
                    .filter(|(g, _)| !g.is_empty())
                    .map(|(names, conn)| {
                        let mut conn = conn.clone();
                        let mut pipe = redis::Pipeline::with_capacity(names.len());
                        for name in names {
                            let mut cmd = redis::Cmd::with_capacity(2, 6 + name.len());
                            cmd.arg("EXISTS").arg(name.as_slice());
                            pipe.add_command(cmd);
                        }
                        async move { pipe.query_async::<Vec<i64>>(&mut conn).await }
                    });
            let mut hits = 0usize;
            for answer in futures_util::future::join_all(pipelines).await {
                hits += answer?.iter().filter(|&&n| n > 0).count();
            }
            Ok::<usize, redis::RedisError>(hits)
        }
    });
    let hits: Vec<Result<usize, redis::RedisError>> = futures_util::stream::iter(work)
        .buffer_unordered(8)
        .collect()
        .await;
    let elapsed = t.elapsed().as_secs_f64();
    let hits: usize = hits.into_iter().sum::<Result<usize, _>>()?;
    let keys: usize = steps.iter().map(|s| s.1.len()).sum();
    let present: usize = steps
        .iter()
        .map(|s| s.2.iter().filter(|&&p| p).count())
        .sum();
    if hits != present {
        return Err(format!("raw redis-rs loop found {hits} of {present} keys").into());
    }
    Ok(keys as f64 / elapsed)
}

/// What redis-benchmark asks for: `EXISTS <key>`, where `__rand_int__` in
/// `key` is a 12-digit number below `keyspace` (and, on a cluster, `{tag}`
/// the hash tag of the connection's master).
struct BenchKeys {
    key: String,
    keyspace: u64,
}

impl BenchKeys {
    /// The usual redis-benchmark keys: short, and none of them exists.
    fn short_absent(cluster: bool) -> Self {
        Self {
            key: if cluster {
                "kvbench:base:{tag}:__rand_int__"
            } else {
                "kvbench:base:__rand_int__"
            }
            .to_owned(),
            keyspace: 1_000_000,
        }
    }
}

/// Runs redis-benchmark with EXISTS on `keys`, 1,000 commands per pipeline
/// and `connections` connections (on a cluster, with `--cluster`: each
/// connection talks to one master, its keys carrying that master's hash
/// tag), on `cpus` if given, and returns its requests per second.
#[allow(clippy::too_many_arguments)]
fn redis_benchmark(
    host: &str,
    port: u16,
    cluster: bool,
    connections: usize,
    n: u64,
    keys: &BenchKeys,
    cpus: Option<&str>,
) -> Result<f64, Failure> {
    let mut cmd = match cpus {
        Some(cpus) => {
            let mut c = std::process::Command::new("taskset");
            c.args(["-c", cpus, "redis-benchmark"]);
            c
        }
        None => std::process::Command::new("redis-benchmark"),
    };
    cmd.args(["-h", host, "-p", &port.to_string(), "-P", "1000"]);
    cmd.args(["-c", &connections.to_string()]);
    if cluster {
        cmd.arg("--cluster");
    }
    let out = cmd
        .args(["-n", &n.to_string(), "-r", &keys.keyspace.to_string()])
        .args(["-q", "EXISTS", &keys.key])
        .stderr(std::process::Stdio::null())
        .output()?;
    let text = String::from_utf8_lossy(&out.stdout).replace('\r', "\n");
    let line = text
        .lines()
        .rev()
        .find(|l| l.contains("requests per second"))
        .ok_or_else(|| format!("redis-benchmark printed no rate: {text}"))?;
    let rps = line
        .split("requests per second")
        .next()
        .and_then(|s| s.split_whitespace().next_back())
        .and_then(|s| s.parse::<f64>().ok())
        .ok_or_else(|| format!("cannot read redis-benchmark's rate from {line:?}"))?;
    Ok(rps)
}

/// redis-benchmark keys that cost the server what the tier's keys cost:
/// names of `name_len` bytes, half of them present. The usual baseline asks
/// for short names that do not exist, which is cheaper for the server (no
/// key compare, no access-time update on a hit, fewer bytes to read and
/// hash) and so flatters it.
///
/// On a cluster, redis-benchmark replaces `{tag}` with a fixed hash tag per
/// master; a short SET run finds those tags. Then every even number below
/// the keyspace is stored under each tag (in the first run; later runs find
/// them), so half of what redis-benchmark asks for exists, as in w3.
async fn matched_bench_keys(
    urls: &[String],
    name_len: usize,
    present_per_master: u64,
) -> Result<BenchKeys, Failure> {
    let cluster = urls.len() > 1;
    let (_, masters) = redis_layout(urls).await?;
    let (host, port) = host_port(&urls[0]).ok_or("cannot read host:port from the Redis URL")?;
    let head = if cluster {
        "kvbench:mb:{tag}:"
    } else {
        "kvbench:mb:"
    };
    let pad = name_len
        .checked_sub(head.len() + 12)
        .ok_or("the tier's key names are too short for a matched baseline")?;
    let key = format!("{head}{}__rand_int__", "p".repeat(pad));
    let mut conns = Vec::with_capacity(masters.len());
    for master in &masters {
        conns.push(
            redis::Client::open(master.as_str())?
                .get_multiplexed_async_connection()
                .await?,
        );
    }
    // Each master's tag (redis-benchmark's own choice), or none.
    let mut tags: Vec<Option<String>> = vec![None; masters.len()];
    if cluster {
        const PROBE: &str = "kvbench:tagprobe:{tag}";
        let status = std::process::Command::new("redis-benchmark")
            .args(["-h", &host, "-p", &port.to_string(), "--cluster", "-q"])
            .args([
                "-c",
                &masters.len().to_string(),
                "-n",
                "300",
                "SET",
                PROBE,
                "x",
            ])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()?;
        if !status.success() {
            return Err(format!("redis-benchmark SET probe failed: {status}").into());
        }
        let open = PROBE.find('{').unwrap_or(0);
        for (conn, tag) in conns.iter_mut().zip(&mut tags) {
            let probes: Vec<String> = redis::cmd("KEYS")
                .arg("kvbench:tagprobe:*")
                .query_async(conn)
                .await?;
            *tag = probes
                .iter()
                .find_map(|k| k.get(open..open + "{tag}".len()))
                .map(str::to_owned);
            for probe in &probes {
                redis::cmd("DEL").arg(probe).query_async::<()>(conn).await?;
            }
        }
        if tags.iter().any(Option::is_none) {
            return Err("redis-benchmark's SET probe did not reach every master".into());
        }
    }
    for (conn, tag) in conns.iter_mut().zip(&tags) {
        let name = |id: u64| {
            let mut k = key.replace("__rand_int__", &format!("{id:012}"));
            if let Some(tag) = tag {
                k = k.replacen("{tag}", tag, 1);
            }
            k
        };
        // Stored already by an earlier run?
        let (last_even, last_odd) = (2 * (present_per_master - 1), 2 * present_per_master - 1);
        let (even, odd): (bool, bool) = redis::pipe()
            .exists(name(last_even))
            .exists(name(last_odd))
            .query_async(conn)
            .await?;
        if even && !odd {
            continue;
        }
        for start in (0..present_per_master).step_by(1000) {
            let mut pipe = redis::pipe();
            for i in start..(start + 1000).min(present_per_master) {
                pipe.set(name(2 * i), "x").ignore();
            }
            pipe.query_async::<()>(conn).await?;
        }
    }
    Ok(BenchKeys {
        key,
        keyspace: 2 * present_per_master,
    })
}

/// The Redis servers' processes, from the service script's pid files
/// (`KVTIER_REDIS_PIDFILE`, or the cluster's under
/// `KVTIER_REDIS_CLUSTER_PIDDIR`); empty when they are not known.
fn redis_server_pids(cluster: bool) -> Vec<u32> {
    let read = |path: &std::path::Path| {
        std::fs::read_to_string(path)
            .ok()
            .and_then(|s| s.trim().parse::<u32>().ok())
    };
    if !cluster {
        return std::env::var_os("KVTIER_REDIS_PIDFILE")
            .and_then(|p| read(std::path::Path::new(&p)))
            .into_iter()
            .collect();
    }
    let Some(dir) = std::env::var_os("KVTIER_REDIS_CLUSTER_PIDDIR") else {
        return Vec::new();
    };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut pids: Vec<u32> = entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("cluster-"))
        .filter_map(|e| read(&e.path().join("pid")))
        .collect();
    pids.sort_unstable();
    pids
}

/// The servers on CPU 0, this process (every thread) and the baseline
/// clients on the other CPUs, as when the servers have hosts of their own;
/// the previous affinities come back on drop. On a 2-core machine the
/// client otherwise competes with three servers for CPU time, which
/// measures the machine more than the client.
struct Pinning {
    /// (pid, its affinity mask before) for the servers and this process.
    previous: Vec<(u32, String)>,
    client_cpus: String,
}

impl Pinning {
    fn new(servers: &[u32]) -> Result<Self, String> {
        let cpus = std::thread::available_parallelism().map_or(1, usize::from);
        if cpus < 2 {
            return Err(format!("{cpus} CPU available"));
        }
        if servers.is_empty() {
            return Err("server processes unknown (no pid files from scripts/services.sh)".into());
        }
        let client_cpus = if cpus == 2 {
            "1".to_owned()
        } else {
            format!("1-{}", cpus - 1)
        };
        let mut pinning = Self {
            previous: Vec::new(),
            client_cpus,
        };
        let me = std::process::id();
        for &pid in servers.iter().chain([&me]) {
            let mask = taskset(&["-p", &pid.to_string()])?
                .rsplit(':')
                .next()
                .map(|m| m.trim().to_owned())
                .ok_or("cannot read taskset's mask")?;
            let cpus = if pid == me {
                pinning.client_cpus.clone()
            } else {
                "0".to_owned()
            };
            taskset(&["-a", "-p", "-c", &cpus, &pid.to_string()])?;
            pinning.previous.push((pid, mask));
        }
        Ok(pinning)
    }
}

impl Drop for Pinning {
    fn drop(&mut self) {
        for (pid, mask) in &self.previous {
            if let Err(e) = taskset(&["-a", "-p", mask, &pid.to_string()]) {
                eprintln!("kvbench: could not restore the CPU affinity of {pid}: {e}");
            }
        }
    }
}

fn taskset(args: &[&str]) -> Result<String, String> {
    let out = std::process::Command::new("taskset")
        .args(args)
        .output()
        .map_err(|e| format!("taskset: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "taskset {}: {}",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// W3: the Redis tier through the manager. Preload 50,000 keys; steps of
/// 1,024 new keys (half present) from one request each: keys/s with steps
/// issued back to back, and time-to-verdict p50/p99 over 200 steps polled
/// every 0.1 ms. Next to redis-benchmark -P 1000 EXISTS on the same server
/// (`-c 1`; on a cluster `--cluster`, one connection per master, and the
/// literal `-c 1`), both on its usual keys (short, absent) and on keys that
/// cost the server what the tier's cost (as long, half present); each also
/// with the servers pinned to a CPU of their own (see [`Pinning`]).
fn w3(cli: &Cli) -> Result<Vec<Value>, Failure> {
    let single = std::env::var("KVTIER_REDIS_URL").ok();
    let cluster = std::env::var("KVTIER_REDIS_CLUSTER_URLS").ok();
    if single.is_none() && cluster.is_none() {
        return Err("w3 needs KVTIER_REDIS_URL and/or KVTIER_REDIS_CLUSTER_URLS: run `scripts/services.sh start` and `source .services/env`".into());
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let mut lines = Vec::new();
    for (label, config) in [
        ("redis", single.map(kvtier_redis::RedisConfig::from_url)),
        (
            "redis-cluster",
            cluster.map(|urls| kvtier_redis::RedisConfig::cluster(urls.split(','))),
        ),
    ] {
        let Some(config) = config else { continue };
        let urls: Vec<String> = if config.is_cluster() {
            config.cluster_urls.clone()
        } else {
            vec![config.url.clone()]
        };
        lines.push(w3_one(cli, &rt, label, config, &urls)?);
    }
    Ok(lines)
}

/// One step of w3: its request, its keys, and which of them exist.
type Step = (ReqContext, Vec<OffloadKey>, Vec<bool>);

fn w3_one(
    cli: &Cli,
    rt: &tokio::runtime::Runtime,
    label: &str,
    config: kvtier_redis::RedisConfig,
    urls: &[String],
) -> Result<Value, Failure> {
    const STEP: usize = 1024;
    const PRELOAD: u64 = 50_000;
    const KEY_LEN: usize = 36;
    const WIDE_STEPS: usize = 32;
    const WIDE_CALLS: usize = 64;
    let throughput_steps = if cli.quick { 10 } else { 96 }; // 96 × 512 distinct present keys < 50,000
    let ttv_steps = if cli.quick { 20 } else { 200 };
    // The tier's default prefix plus a run id (the run's keys are removed at
    // the end): names of 52 bytes, not much longer than the default's 43.
    let run = (Rng::new(cli.seed).next_u64() ^ u64::from(std::process::id())) as u32;
    let prefix = format!("kvtier:{run:08x}:");
    let tier = Arc::new(kvtier_redis::RedisTier::new(kvtier_redis::RedisConfig {
        key_prefix: prefix.clone(),
        ..config
    })?);
    let preload: Vec<OffloadKey> = (0..PRELOAD).map(|i| key_from_id(i, KEY_LEN)).collect();
    let blocks: Vec<(OffloadKey, Vec<u8>)> =
        preload.iter().map(|k| (k.clone(), b"x".to_vec())).collect();
    rt.block_on(tier.store_many(&blocks, None))?;
    let config = ManagerConfig {
        call_timeout_ms: 5_000,
        // The throughput run issues every step at once: room for all of
        // them, instead of the default backlog bound deferring some.
        max_queued_keys: throughput_steps * STEP,
        ..ManagerConfig::named(label)
    };
    let mut m = AsyncLookupManager::with_wake_hook(Arc::clone(&tier), config.clone(), unpark_me())?;
    // The same with wider in-flight limits (32 steps, 64 calls instead of 8
    // and 32): more pipelines per server at once, which a cluster on 2 cores
    // needs to keep its servers busy.
    let mut wide = AsyncLookupManager::with_wake_hook(
        Arc::clone(&tier),
        ManagerConfig {
            max_steps_in_flight: WIDE_STEPS,
            max_calls_in_flight: WIDE_CALLS,
            ..config
        },
        unpark_me(),
    )?;
    let mut rng = Rng::new(cli.seed);
    let mut absent_id = 1u64 << 50;
    let mut step_keys =
        |present: &mut dyn FnMut(usize) -> OffloadKey| -> (Vec<OffloadKey>, Vec<bool>) {
            let mut keys = Vec::with_capacity(STEP);
            let mut truth = Vec::with_capacity(STEP);
            for j in 0..STEP {
                if j % 2 == 0 {
                    keys.push(present(j));
                    truth.push(true);
                } else {
                    absent_id += 1;
                    keys.push(key_from_id(absent_id, KEY_LEN));
                    truth.push(false);
                }
            }
            (keys, truth)
        };

    // Throughput: every step issued at once, then wait for the last answer;
    // five rounds, each followed by the baselines; the medians of the rates
    // and of the rounds' paired ratios are kept. After a round's cleanup its
    // keys are new to the manager again.
    let rounds = if cli.quick { 1 } else { 5 };
    let cluster = urls.len() > 1;
    // redis-benchmark in cluster mode exits on a 250 ms tick after its last
    // reply (measured: 1M requests took 0.52 or 0.77 s by the wall clock,
    // never in between), so its rate is understated by up to a tick. Runs of
    // about 3 s keep that under 10%; against a single server it is exact.
    let (n, n_one_connection, n_pinned) = match (cli.quick, cluster) {
        (true, _) => (100_000, 100_000, 100_000),
        (false, false) => (1_000_000, 0, 1_000_000),
        // Pinned, the servers share one CPU: about half the rate.
        (false, true) => (6_000_000, 3_000_000, 3_000_000),
    };
    let usual_keys = BenchKeys::short_absent(cluster);
    let matched_keys = rt.block_on(matched_bench_keys(
        urls,
        tier.config().key_prefix.len() + KEY_LEN,
        PRELOAD / urls.len() as u64,
    ))?;
    let server_pids = redis_server_pids(cluster);
    let mut matched = Vec::new();
    let mut pinned_rates = Vec::new();
    let mut pinned_baselines = Vec::new();
    let mut pinned_matched = Vec::new();
    let mut pinned_skipped = None;
    let (host, port) = host_port(&urls[0]).ok_or("cannot read host:port from the Redis URL")?;
    let mut rates = Vec::new();
    let mut baselines = Vec::new();
    // On a cluster, also the issue's literal `-c 1`: one connection, which
    // then talks to a single master.
    let mut one_connection = Vec::new();
    // The client library alone: the same keys as EXISTS pipelines over
    // redis-rs, without the manager or the tier.
    let mut raw_client = Vec::new();
    let mut wide_rates = Vec::new();
    let mut verdict_errors = 0;
    for round in 0..rounds {
        let steps: Vec<Step> = (0..throughput_steps)
            .map(|s| {
                let (keys, truth) = step_keys(&mut |j| preload[s * STEP / 2 + j / 2].clone());
                (ReqContext::new(format!("w3-{round}-{s}")), keys, truth)
            })
            .collect();
        let (keys_per_s, errors) = back_to_back(&mut m, &steps, Duration::from_secs(120))?;
        rates.push(keys_per_s);
        verdict_errors += errors;
        let (keys_per_s, errors) = back_to_back(&mut wide, &steps, Duration::from_secs(120))?;
        wide_rates.push(keys_per_s);
        verdict_errors += errors;
        raw_client.push(rt.block_on(raw_redis_loop(urls, &prefix, &steps))?);
        baselines.push(redis_benchmark(
            &host,
            port,
            cluster,
            urls.len(),
            n,
            &usual_keys,
            None,
        )?);
        matched.push(redis_benchmark(
            &host,
            port,
            cluster,
            urls.len(),
            n,
            &matched_keys,
            None,
        )?);
        if cluster {
            one_connection.push(redis_benchmark(
                &host,
                port,
                true,
                1,
                n_one_connection,
                &usual_keys,
                None,
            )?);
        }
        // The same with the servers on a CPU of their own.
        match Pinning::new(&server_pids) {
            Ok(pinning) => {
                let cpus = Some(pinning.client_cpus.as_str());
                let (keys_per_s, errors) = back_to_back(&mut m, &steps, Duration::from_secs(120))?;
                pinned_rates.push(keys_per_s);
                verdict_errors += errors;
                pinned_baselines.push(redis_benchmark(
                    &host,
                    port,
                    cluster,
                    urls.len(),
                    n_pinned,
                    &usual_keys,
                    cpus,
                )?);
                pinned_matched.push(redis_benchmark(
                    &host,
                    port,
                    cluster,
                    urls.len(),
                    n_pinned,
                    &matched_keys,
                    cpus,
                )?);
            }
            Err(why) => pinned_skipped = Some(why),
        }
    }
    let ratio = paired_ratio(&rates, &baselines);
    let matched_ratio = paired_ratio(&rates, &matched);
    let matched_rate = quantile(&mut matched, 0.5);
    let wide_ratio = paired_ratio(&wide_rates, &baselines);
    let wide_rate = quantile(&mut wide_rates, 0.5);
    let raw_ratio = paired_ratio(&rates, &raw_client);
    let raw_vs_benchmark = paired_ratio(&raw_client, &baselines);
    let raw_rate = quantile(&mut raw_client, 0.5);
    let one_connection_ratio = cluster.then(|| paired_ratio(&rates, &one_connection));
    let one_connection_rate = cluster.then(|| quantile(&mut one_connection, 0.5).round());
    let keys_per_s = quantile(&mut rates, 0.5);
    let baseline = quantile(&mut baselines, 0.5);

    // Time to verdict: one step at a time, polled every 0.1 ms.
    let ttv_work: Vec<Step> = (0..ttv_steps)
        .map(|s| {
            let (keys, truth) = step_keys(&mut |_| preload[rng.below(PRELOAD) as usize].clone());
            (ReqContext::new(format!("w3-ttv-{s}")), keys, truth)
        })
        .collect();
    let (mut ttv, errors) = polled(&mut m, ttv_work, Duration::from_secs(30))?;
    verdict_errors += errors;
    // Leave the server as it was (the run's names are unique to it).
    rt.block_on(tier.remove_many(&preload))?;
    let stats = m.stats();
    let wide_stats = wide.stats();
    m.shutdown();
    wide.shutdown();

    let mut line = json!({
        "workload": "w3",
        "tier": label,
        "params": { "preload": PRELOAD, "keys_per_step": STEP, "present_fraction": 0.5,
                    "throughput_steps": throughput_steps, "ttv_steps": ttv_steps, "poll_us": 100,
                    "rounds": rounds,
                    "wide_limits": { "max_steps_in_flight": WIDE_STEPS, "max_calls_in_flight": WIDE_CALLS },
                    "baseline": "redis-benchmark -P 1000 EXISTS -c 1; on a cluster --cluster -c <masters> (and the literal -c 1, one master)",
                    "masters": urls.len() },
        "keys_per_s": keys_per_s.round(),
        "baseline_keys_per_s": baseline.round(),
        "ratio": round3(ratio),
        "wide_limits_keys_per_s": wide_rate.round(),
        "wide_limits_ratio": round3(wide_ratio),
        "raw_redis_rs_keys_per_s": raw_rate.round(),
        "ratio_vs_raw_redis_rs": round3(raw_ratio),
        "raw_redis_rs_vs_benchmark": round3(raw_vs_benchmark),
        "lean_pipelines": tier.pipeline_stats().lean,
        "lean_fallbacks": tier.pipeline_stats().fallbacks,
        "ttv_p50_us": round3(quantile(&mut ttv, 0.5)),
        "ttv_p99_us": round3(quantile(&mut ttv, 0.99)),
        "verdict_errors": verdict_errors,
        "errors": stats.errors + stats.timeouts + wide_stats.errors + wide_stats.timeouts,
    });
    line["baseline_matched_keys_per_s"] = json!(matched_rate.round());
    line["ratio_vs_matched"] = json!(round3(matched_ratio));
    line["params"]["matched_baseline"] = json!(format!(
        "redis-benchmark EXISTS {} -r {}: names as long as the tier's, half of them present",
        matched_keys.key, matched_keys.keyspace
    ));
    if pinned_rates.is_empty() {
        line["pinned_skipped"] = json!(pinned_skipped.unwrap_or_default());
    } else {
        line["pinned_ratio"] = json!(round3(paired_ratio(&pinned_rates, &pinned_baselines)));
        line["pinned_ratio_vs_matched"] =
            json!(round3(paired_ratio(&pinned_rates, &pinned_matched)));
        // After the paired ratios: `quantile` sorts.
        line["pinned_keys_per_s"] = json!(quantile(&mut pinned_rates, 0.5).round());
        line["pinned_baseline_keys_per_s"] = json!(quantile(&mut pinned_baselines, 0.5).round());
        line["pinned_baseline_matched_keys_per_s"] =
            json!(quantile(&mut pinned_matched, 0.5).round());
        line["params"]["pinned"] =
            json!("servers on CPU 0; kvbench and redis-benchmark on the other CPUs (taskset)");
    }
    if let (Some(rate), Some(ratio)) = (one_connection_rate, one_connection_ratio) {
        line["baseline_one_connection_keys_per_s"] = json!(rate);
        line["ratio_vs_one_connection"] = json!(round3(ratio));
    }
    Ok(line)
}

/// W4: the S3 tier through the manager at concurrency 1, 16 and 64. Preload
/// 2,000 objects; steps of 256 keys (half present): keys/s with steps issued
/// back to back, and time-to-verdict p50/p99 of steps issued one at a time
/// (polled every 0.1 ms). Next to a raw aws-sdk-s3 HEAD loop over the same
/// keys at the same concurrency, without the manager.
fn w4(cli: &Cli) -> Result<Vec<Value>, Failure> {
    use futures_util::StreamExt;
    let (Ok(endpoint), Ok(bucket)) = (
        std::env::var("KVTIER_S3_ENDPOINT"),
        std::env::var("KVTIER_S3_BUCKET"),
    ) else {
        return Err("w4 needs KVTIER_S3_ENDPOINT and KVTIER_S3_BUCKET: run `scripts/services.sh start` and `source .services/env`".into());
    };
    const STEP: usize = 256;
    const PRELOAD: u64 = 2_000;
    let throughput_steps = if cli.quick { 2 } else { 12 }; // 12 × 128 distinct present keys < 2,000
    let ttv_steps = if cli.quick { 2 } else { 10 };
    // A round lasts 0.5 to 1.5 s against a server that saturates both
    // cores, and its rate moves by ±15% from one round to the next: seven
    // rounds, and the median of the paired ratios.
    let rounds = if cli.quick { 1 } else { 7 };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let run = Rng::new(cli.seed).next_u64() ^ std::process::id() as u64;
    let base = kvtier_s3::S3Config {
        endpoint: Some(endpoint),
        force_path_style: true,
        prefix: format!("kvbench-{run:x}/"),
        ..kvtier_s3::S3Config::new(bucket.clone())
    };
    let preload: Vec<OffloadKey> = (0..PRELOAD).map(|i| key_from_id(i, 36)).collect();
    let loader = rt.block_on(kvtier_s3::S3Tier::new(base.clone()))?;
    let blocks: Vec<(OffloadKey, Vec<u8>)> =
        preload.iter().map(|k| (k.clone(), vec![0u8; 64])).collect();
    rt.block_on(kvtier_core::BlockStore::store_many(&loader, &blocks))?;
    let names: Vec<String> = preload.iter().map(|k| loader.object_name(k)).collect();

    let mut lines = Vec::new();
    let mut absent_id = 1u64 << 52;
    for concurrency in [1usize, 16, 64] {
        let tier = Arc::new(rt.block_on(kvtier_s3::S3Tier::new(kvtier_s3::S3Config {
            max_concurrent_requests: concurrency,
            ..base.clone()
        }))?);
        let mut m = AsyncLookupManager::with_wake_hook(
            Arc::clone(&tier),
            ManagerConfig {
                call_timeout_ms: 60_000,
                ..ManagerConfig::named("s3")
            },
            unpark_me(),
        )?;
        let mut make_step = |present: &mut dyn FnMut() -> usize| -> (Vec<OffloadKey>, Vec<bool>) {
            (0..STEP)
                .map(|j| {
                    if j % 2 == 0 {
                        (preload[present()].clone(), true)
                    } else {
                        absent_id += 1;
                        (key_from_id(absent_id, 36), false)
                    }
                })
                .unzip()
        };
        let mut next = 0usize;
        let steps: Vec<Step> = (0..throughput_steps)
            .map(|s| {
                let (keys, truth) = make_step(&mut || {
                    next += 1;
                    next - 1
                });
                (
                    ReqContext::new(format!("w4-{concurrency}-{s}")),
                    keys,
                    truth,
                )
            })
            .collect();
        // Baseline: the same keys, HEAD by HEAD with the SDK alone.
        let raw_names: Vec<String> = steps
            .iter()
            .flat_map(|(_, keys, _)| {
                keys.iter()
                    .map(|k| format!("{}{}", base.prefix, k.to_hex()))
            })
            .collect();
        debug_assert!(names.len() == PRELOAD as usize);
        let client = rt.block_on(async {
            let shared = aws_config::defaults(aws_config::BehaviorVersion::latest())
                .load()
                .await;
            let mut conf = aws_sdk_s3::config::Builder::from(&shared).force_path_style(true);
            if let Some(endpoint) = &base.endpoint {
                conf = conf.endpoint_url(endpoint);
            }
            let client = aws_sdk_s3::Client::from_conf(conf.build());
            let _ = client
                .head_object()
                .bucket(&bucket)
                .key("warm-up")
                .send()
                .await;
            client
        });
        let raw_loop = || {
            rt.block_on(async {
                let t = Instant::now();
                let heads = raw_names.iter().map(|name| {
                    let client = client.clone();
                    let bucket = bucket.clone();
                    async move {
                        client
                            .head_object()
                            .bucket(bucket)
                            .key(name)
                            .send()
                            .await
                            .is_ok()
                    }
                });
                let found = futures_util::stream::iter(heads)
                    .buffer_unordered(concurrency)
                    .filter(|&f| async move { f })
                    .count()
                    .await;
                (found, raw_names.len() as f64 / t.elapsed().as_secs_f64())
            })
        };
        // Rounds alternate between the manager and the raw loop; the median
        // rates and the median of each round's ratio are reported (this
        // machine's noise is larger than the difference).
        let (mut ours, mut raws) = (Vec::new(), Vec::new());
        let mut verdict_errors = 0;
        for _ in 0..rounds {
            let (keys_per_s, errors) = back_to_back(&mut m, &steps, Duration::from_secs(300))?;
            ours.push(keys_per_s);
            verdict_errors += errors;
            let (found, rate) = raw_loop();
            if found != raw_names.len() / 2 {
                return Err(format!(
                    "raw HEAD loop found {found} of {} objects",
                    raw_names.len() / 2
                )
                .into());
            }
            raws.push(rate);
        }
        let ratio = paired_ratio(&ours, &raws);
        let keys_per_s = quantile(&mut ours, 0.5);
        let raw = quantile(&mut raws, 0.5);
        let mut rng = Rng::new(cli.seed ^ concurrency as u64);
        let ttv_work: Vec<Step> = (0..ttv_steps)
            .map(|s| {
                let (keys, truth) = make_step(&mut || rng.below(PRELOAD) as usize);
                (
                    ReqContext::new(format!("w4-ttv-{concurrency}-{s}")),
                    keys,
                    truth,
                )
            })
            .collect();
        let (mut ttv, errors) = polled(&mut m, ttv_work, Duration::from_secs(120))?;
        verdict_errors += errors;
        let stats = m.stats();
        m.shutdown();
        lines.push(json!({
            "workload": "w4",
            "tier": "s3",
            "params": { "concurrency": concurrency, "preload": PRELOAD, "keys_per_step": STEP, "present_fraction": 0.5,
                        "throughput_steps": throughput_steps, "ttv_steps": ttv_steps, "poll_us": 100, "rounds": rounds,
                        "server": "s3s-fs on loopback", "baseline": "aws-sdk-s3 HEAD loop, buffer_unordered(concurrency)" },
            "keys_per_s": keys_per_s.round(),
            "baseline_keys_per_s": raw.round(),
            "ratio": round3(ratio),
            "ttv_p50_us": round3(quantile(&mut ttv, 0.5)),
            "ttv_p99_us": round3(quantile(&mut ttv, 0.99)),
            "verdict_errors": verdict_errors,
            "errors": stats.errors + stats.timeouts,
        }));
    }
    Ok(lines)
}

/// A wake hook that unparks the calling thread: a scheduler with nothing to
/// do sleeps until the manager publishes a result, instead of spinning.
fn unpark_me() -> impl Fn() + Send + Sync + 'static {
    let me = std::thread::current();
    move || me.unpark()
}

/// Issues every step at once (lookups, then a flush per step), waits until
/// nothing is queued or in flight (parked until the manager's wake hook, see
/// [`unpark_me`], or 1 ms), then checks every verdict against the truth and
/// cleans up. Returns keys/s and the number of wrong verdicts.
fn back_to_back<T: kvtier_core::Tier>(
    m: &mut AsyncLookupManager<T>,
    steps: &[Step],
    limit: Duration,
) -> Result<(f64, u64), Failure> {
    let t = Instant::now();
    for (ctx, keys, _) in steps {
        for k in keys {
            m.lookup(k, ctx)?;
        }
        m.flush();
    }
    loop {
        m.drain_results();
        if !m.has_pending_calls() {
            break;
        }
        if t.elapsed() > limit {
            return Err(
                format!("steps issued back to back did not finish within {limit:?}").into(),
            );
        }
        std::thread::park_timeout(Duration::from_millis(1));
    }
    let keys: usize = steps.iter().map(|s| s.1.len()).sum();
    let keys_per_s = keys as f64 / t.elapsed().as_secs_f64();
    let mut verdict_errors = 0;
    for (ctx, keys, truth) in steps {
        for (k, &present) in keys.iter().zip(truth) {
            if (m.lookup(k, ctx)? == LookupVerdict::Hit) != present {
                verdict_errors += 1;
            }
        }
        m.cleanup(ctx.req_id());
    }
    Ok((keys_per_s, verdict_errors))
}

/// Runs steps one at a time: lookups, flush, then polls every 0.1 ms until
/// every key has a verdict. Returns each key's time to verdict (µs, from the
/// flush) and the number of wrong verdicts.
fn polled<T: kvtier_core::Tier>(
    m: &mut AsyncLookupManager<T>,
    steps: Vec<Step>,
    limit: Duration,
) -> Result<(Vec<f64>, u64), Failure> {
    let mut ttv = Vec::new();
    let mut verdict_errors = 0;
    for (ctx, keys, truth) in steps {
        for k in &keys {
            m.lookup(k, &ctx)?;
        }
        let flushed = Instant::now();
        m.flush();
        let mut pending: Vec<usize> = (0..keys.len()).collect();
        while !pending.is_empty() {
            std::thread::sleep(Duration::from_micros(100));
            let now = Instant::now();
            let mut still = Vec::with_capacity(pending.len());
            for i in pending {
                match m.lookup(&keys[i], &ctx)? {
                    LookupVerdict::Pending => still.push(i),
                    v => {
                        ttv.push(micros(now - flushed));
                        if (v == LookupVerdict::Hit) != truth[i] {
                            verdict_errors += 1;
                        }
                    }
                }
            }
            pending = still;
            if flushed.elapsed() > limit {
                return Err(format!("a step did not resolve within {limit:?}").into());
            }
        }
        m.cleanup(ctx.req_id());
    }
    Ok((ttv, verdict_errors))
}
