//! kvbench: kvtier's benchmarks, each with its baseline measured in the same run.
//!
//! ```text
//! cargo run --release -p examples --bin kvbench -- w1 --json
//! cargo run --release -p examples --bin kvbench -- all
//! ```
//!
//! Every measurement prints one JSON line with `workload`, `tier`, `params`
//! and the workload's figures; without `--json` a readable summary follows.
//!
//! One module per workload (`w1` … `w5`, `mem`), each holding its baseline;
//! `common` holds what several of them share.

#![warn(clippy::unwrap_used)]

mod common;
mod mem;
mod w1;
mod w2;
mod w3;
mod w4;
mod w5;

use std::process::ExitCode;

use clap::{Parser, ValueEnum};
use examples::CountingAlloc;
use serde_json::Value;

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
            Workload::W1 => w1::w1(&cli).map(|line| vec![line]),
            Workload::W2 => w2::step_cycle(&cli, false).map(|line| vec![line]),
            Workload::W2Slow => w2::step_cycle(&cli, true).map(|line| vec![line]),
            Workload::Mem => mem::mem(&cli).map(|line| vec![line]),
            Workload::W3 => w3::w3(&cli),
            Workload::W4 => w4::w4(&cli),
            Workload::W5 => w5::w5(&cli).map(|line| vec![line]),
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
