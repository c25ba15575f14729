//! kvbench: kvtier's benchmarks, each with its baseline measured in the same run.
//!
//! ```text
//! cargo run --release -p examples --bin kvbench -- hot-lookup --json
//! cargo run --release -p examples --bin kvbench -- all
//! ```
//!
//! Every measurement prints one JSON line with `workload`, `tier`, `params`
//! and the workload's figures; without `--json` a readable summary follows.
//! Workloads have names (`hot-lookup`, `step-cycle`, `memory`, `redis`, `s3`,
//! `disk`) and answer to their old ids too (`w1` … `w5`, `mem`), which the
//! JSON lines keep as their `workload` field, for the scripts that read them.
//! `data-path` (`w6`) stores and loads blocks through the transfer queue.
//!
//! One module per workload, each holding its baseline; `common` holds what
//! several of them share.

#![warn(clippy::unwrap_used)]

mod common;
mod data_path;
mod disk_tier;
mod hot_lookup;
mod memory;
mod redis_tier;
mod s3_tier;
mod step_cycle;

use std::process::ExitCode;

use clap::{Parser, ValueEnum};
use examples::CountingAlloc;
use serde_json::Value;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc::new();

/// A workload, by name; each also answers to its old id (the alias), which
/// its JSON lines keep as their `workload` field.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Workload {
    /// Hot path: lookups of resolved keys next to a bare HashMap (alias w1).
    #[value(name = "hot-lookup", alias = "w1")]
    HotLookup,
    /// Scheduler step cycle on the zero-latency mock tier next to
    /// the minimal step loop (alias w2).
    #[value(name = "step-cycle", alias = "w2")]
    StepCycle,
    /// step-cycle with one request's tier call taking 200 ms (alias w2-slow).
    #[value(name = "step-cycle-slow", alias = "w2-slow")]
    StepCycleSlow,
    /// Manager memory per tracked key (alias mem).
    #[value(name = "memory", alias = "mem")]
    Memory,
    /// Redis tier (single node and cluster) next to
    /// redis-benchmark; needs KVTIER_REDIS_URL (alias w3).
    #[value(name = "redis", alias = "w3")]
    Redis,
    /// S3 tier at concurrency 1, 16, 64 next to a raw aws-sdk-s3
    /// HEAD loop; needs KVTIER_S3_ENDPOINT (alias w4).
    #[value(name = "s3", alias = "w4")]
    S3,
    /// Disk tier: batch lookups, reopen time, store throughput (alias w5).
    #[value(name = "disk", alias = "w5")]
    Disk,
    /// The block data path: blocks stored and loaded through the transfer
    /// queue, per tier and block size, next to the raw client (alias w6).
    #[value(name = "data-path", alias = "w6")]
    DataPath,
    /// Every workload above (the server ones when their services are set).
    All,
}

impl Workload {
    /// Every workload `all` runs, in order.
    const EVERY: [Self; 8] = [
        Self::HotLookup,
        Self::StepCycle,
        Self::StepCycleSlow,
        Self::Memory,
        Self::Redis,
        Self::S3,
        Self::Disk,
        Self::DataPath,
    ];

    /// The name `kvbench` is called with.
    fn name(self) -> &'static str {
        match self {
            Self::HotLookup => "hot-lookup",
            Self::StepCycle => "step-cycle",
            Self::StepCycleSlow => "step-cycle-slow",
            Self::Memory => "memory",
            Self::Redis => "redis",
            Self::S3 => "s3",
            Self::Disk => "disk",
            Self::DataPath => "data-path",
            Self::All => "all",
        }
    }

    /// The environment variable a server workload needs, if any.
    fn needs(self) -> Option<&'static str> {
        match self {
            Self::Redis => Some("KVTIER_REDIS_URL"),
            Self::S3 => Some("KVTIER_S3_ENDPOINT"),
            _ => None,
        }
    }

    /// Runs the workload: one JSON line per configuration it measures.
    fn run(self, cli: &Cli) -> Result<Vec<Value>, Failure> {
        let one = |line: Value| vec![line];
        match self {
            Self::HotLookup => hot_lookup::hot_lookup(cli).map(one),
            Self::StepCycle => step_cycle::step_cycle(cli, false).map(one),
            Self::StepCycleSlow => step_cycle::step_cycle(cli, true).map(one),
            Self::Memory => memory::memory(cli).map(one),
            Self::Redis => redis_tier::redis_tier(cli),
            Self::S3 => s3_tier::s3_tier(cli),
            Self::Disk => disk_tier::disk_tier(cli).map(one),
            Self::DataPath => data_path::data_path(cli),
            Self::All => Ok(Vec::new()),
        }
    }
}

/// kvtier benchmarks; each reports its same-run baseline and the ratio.
#[derive(Debug, Parser)]
#[command(name = "kvbench", version)]
#[command(
    after_help = "Old ids still work: w1 = hot-lookup, w2 = step-cycle, w2-slow = \
    step-cycle-slow, mem = memory, w3 = redis, w4 = s3, w5 = disk, w6 = data-path; each JSON line keeps the \
    id as its \"workload\" field."
)]
struct Cli {
    /// Which workload to run: a name, or its old id (listed below).
    #[arg(value_enum)]
    workload: Workload,
    /// Print only JSON lines.
    #[arg(long)]
    json: bool,
    /// Smaller sizes, for a smoke run (figures are then not comparable).
    #[arg(long)]
    quick: bool,
    /// In step-cycle(-slow), wait the 1 ms between steps by spinning instead of
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
        Workload::All => &Workload::EVERY,
        ref one => std::slice::from_ref(one),
    };
    let mut lines = Vec::new();
    for &w in workloads {
        // `all` runs what is configured: the server workloads need their services.
        if cli.workload == Workload::All
            && let Some(var) = w.needs()
            && std::env::var_os(var).is_none()
        {
            eprintln!(
                "kvbench: {} skipped: {var} is not set (run `scripts/services.sh start` and `source .services/env`)",
                w.name()
            );
            continue;
        }
        match w.run(&cli) {
            Ok(more) => {
                for line in more {
                    println!("{line}");
                    lines.push((w.name(), line));
                }
            }
            Err(err) => {
                eprintln!("kvbench: {} failed: {err}", w.name());
                return ExitCode::FAILURE;
            }
        }
    }
    if !cli.json {
        print_table(&lines);
    }
    ExitCode::SUCCESS
}

fn print_table(lines: &[(&str, Value)]) {
    println!();
    println!("{:<16} {:<8} {:<6} figures", "workload", "id", "tier");
    for (name, line) in lines {
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
            "{:<16} {:<8} {:<6} {}",
            name,
            line["workload"].as_str().unwrap_or("?"),
            line["tier"].as_str().unwrap_or("?"),
            figures.join("  ")
        );
    }
}
