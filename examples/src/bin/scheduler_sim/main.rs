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

use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use examples::plot;
use kvtier_core::one_line;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

use crate::cli::Cli;
use crate::sim::Sim;

/// Any failure of the program, shown as one line.
pub(crate) type Failure = Box<dyn std::error::Error>;

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

fn run(cli: &Cli, start_logging: &dyn Fn()) -> Result<bool, Failure> {
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

    let plotted = match &cli.plot {
        Some(path) => Some(plot::write_cdf(
            path,
            "scheduler_sim: time to answer per request (arrival to answer)",
            &report.groups(),
        )?),
        None => None,
    };
    let summary = report.json();
    if cli.json {
        println!("{summary}");
    } else {
        report.print_text(&summary);
        if let Some((svg, png)) = &plotted {
            println!("\nplot written to {} and {}", svg.display(), png.display());
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
    if let Some(ms) = cli.prometheus_linger_ms {
        std::thread::sleep(Duration::from_millis(ms));
    }
    Ok(report.success())
}
