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

mod cli;
mod report;
mod sim;
mod tiers;
mod workload;

use std::io::IsTerminal as _;
use std::process::ExitCode;
use std::time::Duration;

use clap::CommandFactory as _;
use examples::plot;
use kvtier_core::one_line;
use tracing_subscriber::fmt::format::FmtSpan;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{EnvFilter, reload};

use crate::cli::Cli;
use crate::sim::Sim;

/// Any failure of the program, shown as one line.
pub(crate) type Failure = Box<dyn std::error::Error>;

fn main() -> ExitCode {
    let cli = Cli::parse_checked();
    if let Some(path) = &cli.plot
        && let Err(why) = plot::check_output(path)
    {
        Cli::command()
            .error(
                clap::error::ErrorKind::ValueValidation,
                format!("invalid value '{}' for '--plot': {why}", path.display()),
            )
            .exit();
    }
    let start_logging = init_logging();
    match run(&cli, &start_logging) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(err) => {
            eprintln!("scheduler_sim: {}", one_line(err.as_ref()));
            ExitCode::FAILURE
        }
    }
}

/// Logs to stderr, filtered by `RUST_LOG` (a filter that does not parse is
/// reported once and ignored), colour only on a terminal. Each tier call's
/// `tier_call` span is logged when it closes, with its outcome and time
/// (`RUST_LOG=kvtier_core=debug`). Returns what starts the default logging:
/// tiers log a misconfiguration once at ERROR, and at start-up the failed
/// check's one-line cause says the same, so without `RUST_LOG` logging
/// starts (at ERROR) only after the checks.
fn init_logging() -> impl Fn() {
    let from_env = match std::env::var("RUST_LOG") {
        Ok(spec) if !spec.trim().is_empty() => match EnvFilter::try_new(&spec) {
            Ok(filter) => Some(filter),
            Err(err) => {
                eprintln!(
                    "scheduler_sim: RUST_LOG={spec:?} ignored: {err} \
                     (e.g. RUST_LOG=kvtier_core=debug shows every tier call)"
                );
                None
            }
        },
        _ => None,
    };
    let user_filter = from_env.is_some();
    let (filter, handle) = reload::Layer::new(from_env.unwrap_or_else(|| EnvFilter::new("off")));
    tracing_subscriber::registry()
        .with(filter)
        .with(
            tracing_subscriber::fmt::layer()
                .with_writer(std::io::stderr)
                .with_ansi(std::io::stderr().is_terminal())
                .with_span_events(FmtSpan::CLOSE),
        )
        .init();
    move || {
        if !user_filter {
            let _ = handle.modify(|f| *f = EnvFilter::new("error"));
        }
    }
}

fn run(cli: &Cli, start_logging: &dyn Fn()) -> Result<bool, Failure> {
    if cli.plot.is_some() {
        plot::check_font().map_err(|why| format!("--plot: {why}"))?;
    }
    // Before any manager exists: each registers its metrics with the
    // recorder installed when it is built.
    if let Some(addr) = cli.prometheus {
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .with_http_listener(addr)
            .install()
            .map_err(|e| format!("prometheus exporter on {addr}: {}", one_line(&e)))?;
    }
    let mut sim = Sim::set_up(cli)?;
    // Every tier passed its check: from here on, tier errors are logged.
    start_logging();
    while !sim.is_done() {
        sim.step()?;
    }
    let report = sim.finish();

    // The summary first, so that nothing after it can lose it.
    let summary = report.json();
    if cli.json {
        println!("{summary}");
    } else {
        report.print_text(&summary);
    }
    let mut ok = true;
    if let Some(path) = &cli.plot {
        let title = "scheduler_sim: time to answer per request (arrival to answer)";
        match plot::write_cdf(path, title, &report.groups()) {
            Ok((svg, png)) if !cli.json => {
                println!("\nplot written to {} and {}", svg.display(), png.display());
            }
            Ok(_) => {}
            Err(err) => {
                eprintln!(
                    "scheduler_sim: --plot {}: {}",
                    path.display(),
                    one_line(err.as_ref())
                );
                ok = false;
            }
        }
    }
    if report.failed_stores > 0 {
        // Writes that failed (timeouts under load) leave blocks out of a
        // tier; lookups stay correct, so this is reported, not fatal.
        eprintln!(
            "scheduler_sim: warning: {} background store batches failed",
            report.failed_stores
        );
    }
    for failure in report.failures() {
        eprintln!("scheduler_sim: run failed: {failure}");
        ok = false;
    }
    if let Some(ms) = cli.prometheus_linger_ms {
        std::thread::sleep(Duration::from_millis(ms));
    }
    Ok(ok)
}
