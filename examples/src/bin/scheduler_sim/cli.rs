//! The command line: every flag of the simulation, with its default and
//! the range clap enforces.

use std::path::PathBuf;

use clap::Parser;

/// Simulates a vLLM-like scheduler asking kvtier's secondary tiers (disk,
/// then Redis / S3 if given, then a mock remote tier) for cached prefixes,
/// and reports hit rates, time to answer and each tier's errors.
#[derive(Debug, Parser)]
#[command(name = "scheduler_sim", version)]
#[command(group(clap::ArgGroup::new("redis_tier").args(["redis", "redis_cluster"]).multiple(true)))]
pub(crate) struct Cli {
    /// Scheduler steps to run (at least 1).
    #[arg(long, default_value_t = 2000, value_parser = at_least_one)]
    pub(crate) steps: usize,
    /// Requests arriving over the run (at least 1).
    #[arg(long, default_value_t = 1000, value_parser = at_least_one)]
    pub(crate) requests: usize,
    /// Distinct system prompts the requests share.
    #[arg(long, default_value_t = 8)]
    pub(crate) system_prompts: u64,
    /// Blocks in a system prompt.
    #[arg(long, default_value_t = 24)]
    pub(crate) system_blocks: usize,
    /// Blocks of each request's own text (at most this many, at least 1).
    #[arg(long, default_value_t = 16, value_parser = at_least_one)]
    pub(crate) user_blocks: usize,
    /// Fraction of requests that are follow-up turns of an earlier one (0 to 1).
    #[arg(long, default_value_t = 0.3, value_parser = fraction)]
    pub(crate) follow_ups: f64,
    /// Simulated model execution per step, in microseconds (the scheduler sleeps).
    #[arg(long, default_value_t = 1000)]
    pub(crate) step_us: u64,
    /// Steps a scheduled request computes before its blocks are stored.
    #[arg(long, default_value_t = 10)]
    pub(crate) compute_steps: usize,
    /// Directory of the disk tier (default: a temporary directory, removed at the end).
    #[arg(long)]
    pub(crate) disk_dir: Option<PathBuf>,
    /// Capacity of the disk tier, in MiB (small, so that it evicts).
    #[arg(long, default_value_t = 32)]
    pub(crate) disk_capacity_mib: u64,
    /// Bytes of KV data per block (at least 1).
    #[arg(long, default_value_t = 16 << 10, value_parser = at_least_one)]
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
    /// Latency of the mock tier's lookups, in microseconds.
    #[arg(long, default_value_t = 300)]
    pub(crate) mock_latency_us: u64,
    /// Jitter added to the mock tier's latency, in microseconds.
    #[arg(long, default_value_t = 400)]
    pub(crate) mock_jitter_us: u64,
    /// Probability (0 to 1) that loading a block from a tier other than disk fails (exercises mark_miss).
    #[arg(long, default_value_t = 0.01, value_parser = fraction)]
    pub(crate) load_failure: f64,
    /// Plot time to answer (arrival to answer, per request) overall and per
    /// tier, as PATH.svg and PATH.png (default target/scheduler_sim/time_to_answer).
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
    /// before exiting, so that a scraper sees the final counters.
    #[arg(long, value_name = "MS", requires = "prometheus")]
    pub(crate) prometheus_linger_ms: Option<u64>,
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
