//! The command line: every flag of the simulation with its default and the
//! range clap enforces (out of range: exit 2, naming the flag), and the
//! checks that span several flags.

use std::path::PathBuf;

use clap::builder::RangedU64ValueParser;
use clap::{CommandFactory, Parser};

/// Most blocks all prompts of a run may hold (`--requests` times the blocks
/// of a prompt): the simulation keeps every request's keys, and each tier
/// the keys stored in it.
pub(crate) const MAX_RUN_BLOCKS: u64 = 5_000_000;

/// Simulates a vLLM-like scheduler asking kvtier's secondary tiers (disk,
/// then Redis / S3 if given, then a mock remote tier) for cached prefixes,
/// and reports hit rates, time to answer and each tier's errors.
#[derive(Debug, Parser)]
#[command(name = "scheduler_sim", version)]
#[command(group(clap::ArgGroup::new("redis_tier").args(["redis", "redis_cluster"]).multiple(true)))]
pub(crate) struct Cli {
    /// Scheduler steps to run (1 to 1,000,000).
    #[arg(long, default_value_t = 2000,
          value_parser = RangedU64ValueParser::<usize>::new().range(1..=1_000_000))]
    pub(crate) steps: usize,
    /// Requests arriving over the run (1 to 1,000,000; with the blocks per
    /// prompt, at most 5,000,000 blocks in all).
    #[arg(long, default_value_t = 1000,
          value_parser = RangedU64ValueParser::<usize>::new().range(1..=1_000_000))]
    pub(crate) requests: usize,
    /// Distinct system prompts the requests share (1 to 1,000,000).
    #[arg(long, default_value_t = 8,
          value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub(crate) system_prompts: u64,
    /// Blocks in a system prompt (0 to 256).
    #[arg(long, default_value_t = 24,
          value_parser = RangedU64ValueParser::<usize>::new().range(0..=256))]
    pub(crate) system_blocks: usize,
    /// Blocks of each request's own text: from 1 to this many (1 to 256).
    #[arg(long, default_value_t = 16,
          value_parser = RangedU64ValueParser::<usize>::new().range(1..=256))]
    pub(crate) user_blocks: usize,
    /// Fraction of requests that are follow-up turns of an earlier one (0 to 1).
    #[arg(long, default_value_t = 0.3, value_parser = fraction)]
    pub(crate) follow_ups: f64,
    /// Simulated model execution per step, in microseconds; the scheduler
    /// sleeps (0 to 10,000,000).
    #[arg(long, default_value_t = 1000,
          value_parser = clap::value_parser!(u64).range(0..=10_000_000))]
    pub(crate) step_us: u64,
    /// Steps a scheduled request computes before its blocks are stored
    /// (0 to 1,000,000).
    #[arg(long, default_value_t = 10,
          value_parser = RangedU64ValueParser::<usize>::new().range(0..=1_000_000))]
    pub(crate) compute_steps: usize,
    /// Directory of the disk tier (default: a temporary directory, removed at the end).
    #[arg(long)]
    pub(crate) disk_dir: Option<PathBuf>,
    /// Capacity of the disk tier, in MiB, small so that it evicts (1 to
    /// 1,048,576). Its segments are an eighth of it (64 KiB to 1 GiB).
    #[arg(long, default_value_t = 32,
          value_parser = clap::value_parser!(u64).range(1..=1_048_576))]
    pub(crate) disk_capacity_mib: u64,
    /// Bytes of KV data per block (1 to 1,048,576); a block must fit in a
    /// disk segment.
    #[arg(long, default_value_t = 16 << 10,
          value_parser = RangedU64ValueParser::<usize>::new().range(1..=1_048_576))]
    pub(crate) block_bytes: usize,
    /// Add a Redis tier at this URL (after disk): redis://, rediss:// (TLS) or redis+unix://.
    #[arg(long)]
    pub(crate) redis: Option<String>,
    /// Add a Redis Cluster tier with these seed URLs, comma-separated.
    #[arg(long)]
    pub(crate) redis_cluster: Option<String>,
    /// PEM file of a private CA that signed the Redis servers' TLS certificates
    /// (for rediss:// URLs; `scripts/services.sh` writes one as KVTIER_REDIS_TLS_CA).
    #[arg(long, requires = "redis_tier")]
    pub(crate) redis_ca: Option<PathBuf>,
    /// Add an S3 tier with this bucket (credentials from the AWS chain).
    #[arg(long)]
    pub(crate) s3: Option<String>,
    /// Endpoint of the S3-compatible server (path-style addressing); needs --s3.
    #[arg(long, requires = "s3")]
    pub(crate) s3_endpoint: Option<String>,
    /// Leave out the mock remote tier.
    #[arg(long)]
    pub(crate) no_mock: bool,
    /// Latency of the mock tier's lookups, in microseconds (0 to 10,000,000).
    #[arg(long, default_value_t = 300,
          value_parser = clap::value_parser!(u64).range(0..=10_000_000))]
    pub(crate) mock_latency_us: u64,
    /// Jitter added to the mock tier's latency, in microseconds (0 to 10,000,000).
    #[arg(long, default_value_t = 400,
          value_parser = clap::value_parser!(u64).range(0..=10_000_000))]
    pub(crate) mock_jitter_us: u64,
    /// Probability (0 to 1) that loading a block from a tier other than disk fails (exercises mark_miss).
    #[arg(long, default_value_t = 0.01, value_parser = fraction)]
    pub(crate) load_failure: f64,
    /// Deadline of each tier call (a lookup batch), in milliseconds (1 to
    /// 600,000). A run in which a tier misses it for most of its keys fails.
    #[arg(long, value_name = "MS", default_value_t = 1000,
          value_parser = clap::value_parser!(u64).range(1..=600_000))]
    pub(crate) call_timeout_ms: u64,
    /// Plot time to answer (arrival to answer, per request) overall and per
    /// tier, as PATH.svg and PATH.png (default target/scheduler_sim/time_to_answer).
    /// Checked before the run; written after the summary.
    #[arg(long, value_name = "PATH", num_args = 0..=1,
          default_missing_value = "target/scheduler_sim/time_to_answer")]
    pub(crate) plot: Option<PathBuf>,
    /// Seed of every random choice.
    #[arg(long, default_value_t = 7)]
    pub(crate) seed: u64,
    /// Print the summary as one JSON line.
    #[arg(long)]
    pub(crate) json: bool,
    /// Serve every tier's metrics (kvtier_core::metrics) in Prometheus text
    /// format at http://ADDR/ (any path), e.g. 127.0.0.1:9000.
    #[arg(long, value_name = "ADDR")]
    pub(crate) prometheus: Option<std::net::SocketAddr>,
    /// After the summary, keep serving --prometheus this many milliseconds
    /// before exiting, so that a scraper sees the final counters (0 to 3,600,000).
    #[arg(long, value_name = "MS", requires = "prometheus",
          value_parser = clap::value_parser!(u64).range(0..=3_600_000))]
    pub(crate) prometheus_linger_ms: Option<u64>,
}

impl Cli {
    /// Parses the command line; a value out of its range, or flags that
    /// together ask too much, end the program with clap's usage error
    /// (exit 2) naming the flags.
    pub(crate) fn parse_checked() -> Self {
        let cli = Self::parse();
        let per_prompt = u64::try_from(cli.system_blocks + cli.user_blocks).unwrap_or(u64::MAX);
        let blocks = u64::try_from(cli.requests)
            .unwrap_or(u64::MAX)
            .saturating_mul(per_prompt);
        if blocks > MAX_RUN_BLOCKS {
            Self::command()
                .error(
                    clap::error::ErrorKind::ValueValidation,
                    format!(
                        "--requests {} with up to --system-blocks {} + --user-blocks {} blocks \
                         per prompt is up to {blocks} blocks; at most {MAX_RUN_BLOCKS} in a run",
                        cli.requests, cli.system_blocks, cli.user_blocks
                    ),
                )
                .exit();
        }
        cli
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
