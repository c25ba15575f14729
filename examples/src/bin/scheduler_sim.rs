//! scheduler_sim: a vLLM-like scheduler loop over kvtier, the project's main job.
//!
//! Requests arrive with prompts that share system-prompt prefixes. Every step
//! the scheduler asks, for each waiting request, how many leading blocks
//! exist in the secondary tier (`lookup_prefix`), never waiting for the
//! tier; a request whose answer is ready is scheduled, its hit blocks are
//! "loaded" (a load can fail: the block is then marked missing with
//! `mark_miss`, which ends the retry loop), and after its compute time the
//! blocks it computed are stored in the tier for later requests. The step
//! ends with `flush`. A summary follows.
//!
//! ```text
//! cargo run --release -p examples --bin scheduler_sim
//! cargo run --release -p examples --bin scheduler_sim -- --steps 5000 --mock-latency-us 800 --json
//! ```

#![warn(clippy::unwrap_used)]

use std::collections::VecDeque;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use examples::{Rng, key_from_id, micros, quantile};
use lookup_core::{AsyncLookupManager, ManagerConfig, OffloadKey, PrefixVerdict, ReqContext};
use serde_json::json;
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
    /// Probability that loading a hit block fails (exercises mark_miss).
    #[arg(long, default_value_t = 0.01)]
    load_failure: f64,
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

fn run(cli: &Cli) -> Result<bool, Box<dyn std::error::Error>> {
    let tier = Arc::new(MockTier::new(MockConfig {
        seed: cli.seed,
        latency_us: cli.mock_latency_us,
        jitter_us: cli.mock_jitter_us,
        record_calls: false,
        ..MockConfig::default()
    }));
    let mut manager =
        AsyncLookupManager::from_arc(Arc::clone(&tier), ManagerConfig::named("mock"))?;

    let mut rng = Rng::new(cli.seed);
    let mut next_user_block = 1u64 << 48;
    let mut incoming: VecDeque<Request> = (0..cli.requests)
        .map(|i| {
            let prompt = rng.below(cli.system_prompts.max(1));
            let mut keys: Vec<OffloadKey> = (0..cli.system_blocks)
                .map(|b| system_block(prompt, b))
                .collect();
            let own = 1 + rng.below(cli.user_blocks.max(1) as u64) as usize;
            for _ in 0..own {
                next_user_block += 1;
                keys.push(key_from_id(next_user_block, 36));
            }
            Request {
                ctx: ReqContext::new(format!("req-{i}")),
                keys,
                arrived_step: 0,
            }
        })
        .collect();
    // Arrivals spread evenly over the first 80% of the run.
    let arrival_span = (cli.steps * 4 / 5).max(1);
    let per_step = cli.requests.div_ceil(arrival_span);

    let mut waiting: Vec<Request> = Vec::new();
    let mut running: Vec<Running> = Vec::new();
    let (mut sched_us, mut wait_steps) = (Vec::new(), Vec::new());
    let (mut scheduled, mut finished, mut blocks_asked, mut blocks_hit) =
        (0usize, 0usize, 0usize, 0usize);
    let (mut load_failures, mut verdict_errors) = (0usize, 0usize);
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
        // Schedule every waiting request whose prefix answer is ready.
        let mut still_waiting = Vec::with_capacity(waiting.len());
        for request in waiting.drain(..) {
            match manager.lookup_prefix(&request.keys, &request.ctx)? {
                PrefixVerdict::Pending => still_waiting.push(request),
                PrefixVerdict::Ready(hits) => {
                    // A hit must really be there (nothing is ever removed here).
                    verdict_errors += request.keys[..hits]
                        .iter()
                        .filter(|k| !tier.contains(k))
                        .count();
                    // Load the hit blocks; a failed load marks the block missing
                    // and the request asks again next step.
                    if hits > 0 && rng.chance(cli.load_failure) {
                        load_failures += 1;
                        let failed = rng.below(hits as u64) as usize;
                        manager.mark_miss([&request.keys[failed]]);
                        still_waiting.push(request);
                        continue;
                    }
                    scheduled += 1;
                    blocks_asked += request.keys.len();
                    blocks_hit += hits;
                    wait_steps.push((step - request.arrived_step) as f64);
                    running.push(Running {
                        request,
                        done_step: step + cli.compute_steps,
                    });
                }
            }
        }
        waiting = still_waiting;
        manager.flush();
        sched_us.push(micros(t0.elapsed()));

        // Requests done computing store their blocks and leave.
        running.retain(|r| {
            if r.done_step > step {
                return true;
            }
            tier.insert(r.request.keys.iter().cloned());
            manager.cleanup(r.request.ctx.req_id());
            finished += 1;
            false
        });
        step += 1;
        std::thread::sleep(Duration::from_micros(cli.step_us));
    }
    let wall = started.elapsed();
    let idle_deadline = Instant::now() + Duration::from_secs(5);
    while !manager.is_idle() && Instant::now() < idle_deadline {
        manager.drain_results();
        std::thread::sleep(Duration::from_millis(1));
    }
    let state_empty = manager.is_idle();
    let stats = manager.stats();
    let report = manager.shutdown();

    let hit_rate = blocks_hit as f64 / blocks_asked.max(1) as f64;
    let summary = json!({
        "tier": stats.tier,
        "steps": step,
        "requests_finished": finished,
        "requests_scheduled": scheduled,
        "prefix_hit_rate": (hit_rate * 1000.0).round() / 1000.0,
        "lookups": stats.lookups,
        "hits": stats.hits,
        "misses": stats.misses,
        "errors": stats.errors,
        "timeouts": stats.timeouts,
        "load_failures_marked_miss": load_failures,
        "verdict_errors": verdict_errors,
        "ttv_p50_us": stats.time_to_verdict.p50_us,
        "ttv_p99_us": stats.time_to_verdict.p99_us,
        "tier_call_p50_us": stats.tier_call_latency.p50_us,
        "tier_call_p99_us": stats.tier_call_latency.p99_us,
        "scheduler_us_per_step_p50": quantile(&mut sched_us, 0.5).round(),
        "scheduler_us_per_step_p99": quantile(&mut sched_us, 0.99).round(),
        "wait_steps_p50": quantile(&mut wait_steps, 0.5),
        "wait_steps_p99": quantile(&mut wait_steps, 0.99),
        "state_empty_after_cleanup": state_empty,
        "worker_stopped": report.worker_stopped,
        "wall_s": (wall.as_secs_f64() * 100.0).round() / 100.0,
    });
    if cli.json {
        println!("{summary}");
    } else {
        println!(
            "scheduler_sim: {} steps, {} requests finished in {:.2} s",
            step,
            finished,
            wall.as_secs_f64()
        );
        println!("{:<28} {}", "tier", stats.tier);
        for (label, value) in [
            ("prefix hit rate", format!("{:.1}%", hit_rate * 100.0)),
            ("lookups", stats.lookups.to_string()),
            (
                "hits / misses",
                format!("{} / {}", stats.hits, stats.misses),
            ),
            (
                "errors / timeouts",
                format!("{} / {}", stats.errors, stats.timeouts),
            ),
            ("failed loads (mark_miss)", load_failures.to_string()),
            ("verdict errors", verdict_errors.to_string()),
            (
                "time-to-verdict p50 / p99",
                format!(
                    "{} / {} µs",
                    stats.time_to_verdict.p50_us, stats.time_to_verdict.p99_us
                ),
            ),
            (
                "tier call p50 / p99",
                format!(
                    "{} / {} µs",
                    stats.tier_call_latency.p50_us, stats.tier_call_latency.p99_us
                ),
            ),
            (
                "scheduler per step p50 / p99",
                format!(
                    "{} / {} µs",
                    summary["scheduler_us_per_step_p50"], summary["scheduler_us_per_step_p99"]
                ),
            ),
            (
                "steps waiting p50 / p99",
                format!(
                    "{} / {}",
                    summary["wait_steps_p50"], summary["wait_steps_p99"]
                ),
            ),
            ("state empty after cleanup", state_empty.to_string()),
        ] {
            println!("{label:<28} {value}");
        }
    }
    Ok(verdict_errors == 0 && state_empty && finished == cli.requests)
}
