//! The stack of tiers the simulation asks, fastest first: the disk tier,
//! then Redis / Redis Cluster / S3 as the flags add them, then the mock
//! remote tier. Each is checked before the run.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use examples::Rng;
use kvtier_core::{BlockStore, DynBlockStore, ManagerConfig, OffloadKey, TierStack, one_line};
use kvtier_disk::{DiskConfig, DiskTier, FsyncPolicy};
use kvtier_mock::{MockConfig, MockTier};
use kvtier_redis::{RedisConfig, RedisTier, RedisTierError};
use kvtier_s3::{S3Config, S3Tier};
use tokio::runtime::Runtime;

use crate::Failure;
use crate::cli::Cli;

/// A tier of the stack, as the simulation stores into and loads from it:
/// every tier through the one `BlockStore` interface.
pub(crate) struct SimTier {
    pub(crate) store: Arc<dyn DynBlockStore>,
    /// Size of the blocks the simulation stores here.
    pub(crate) block_bytes: usize,
    /// Whether a found block is loaded back and checked (the local disk);
    /// remote loads are simulated with `--load-failure`.
    pub(crate) verify_loads: bool,
    /// Blocks whose store was issued: a hit for any other block is a verdict error.
    pub(crate) stored: HashSet<OffloadKey>,
}

impl SimTier {
    fn new(store: Arc<dyn DynBlockStore>, block_bytes: usize, verify_loads: bool) -> Self {
        Self {
            store,
            block_bytes,
            verify_loads,
            stored: HashSet::new(),
        }
    }
}

/// The stack with its tiers, in the same order.
pub(crate) struct Tiers {
    pub(crate) stack: TierStack,
    /// `tiers[i]` is the tier of the stack's manager `i`.
    pub(crate) tiers: Vec<SimTier>,
    pub(crate) disk: Arc<DiskTier>,
    pub(crate) disk_dir: PathBuf,
    /// The disk tier's temporary directory, removed when dropped (last).
    _temp: Option<tempfile::TempDir>,
}

/// The disk tier's configuration: `--disk-capacity-mib`, in segments of an
/// eighth of it (64 KiB to 1 GiB), no fsync (the directory is scratch).
///
/// # Errors
/// A block of `--block-bytes` that does not fit in a segment, naming the
/// disk tier and both flags.
fn disk_config(cli: &Cli, dir: &Path) -> Result<DiskConfig, Failure> {
    // At most 2^20 MiB: no overflow.
    let capacity = cli.disk_capacity_mib << 20;
    let config = DiskConfig {
        capacity_bytes: capacity,
        segment_bytes: (capacity / 8).clamp(64 << 10, 1 << 30),
        fsync: FsyncPolicy::Never,
        ..DiskConfig::new(dir)
    };
    if cli.block_bytes > config.max_payload() {
        return Err(format!(
            "disk tier: a block of --block-bytes {} does not fit in a disk segment of {} bytes \
             (at most {} bytes of payload; segments are an eighth of --disk-capacity-mib {}): \
             lower --block-bytes or raise --disk-capacity-mib",
            cli.block_bytes,
            config.segment_bytes,
            config.max_payload(),
            cli.disk_capacity_mib
        )
        .into());
    }
    Ok(config)
}

/// The manager configuration of the tier `name`: `--call-timeout-ms` as
/// its call deadline, the defaults otherwise.
fn manager_config(cli: &Cli, name: &str) -> ManagerConfig {
    ManagerConfig {
        call_timeout_ms: cli.call_timeout_ms,
        ..ManagerConfig::named(name)
    }
}

/// `err` as a one-line cause naming `what` (a tier).
pub(crate) fn tier_failed(what: &str, err: &dyn std::error::Error) -> Failure {
    let what = if what.contains(" tier") {
        what.to_owned()
    } else {
        format!("{what} tier")
    };
    format!("{what}: {}", one_line(err)).into()
}

impl Tiers {
    /// Opens and checks every tier the flags ask for (the disk directory
    /// opens, Redis answers PING, S3's HeadBucket finds the bucket) and
    /// builds the stack. A failure names the tier.
    pub(crate) fn open(cli: &Cli, rt: &Runtime) -> Result<Self, Failure> {
        let temp = match &cli.disk_dir {
            Some(_) => None,
            None => Some(tempfile::Builder::new().prefix("kvtier-sim").tempdir()?),
        };
        let disk_dir = match (&cli.disk_dir, &temp) {
            (Some(dir), _) => dir.clone(),
            (None, Some(t)) => t.path().to_owned(),
            (None, None) => return Err("no disk directory".into()),
        };
        let disk_config = disk_config(cli, &disk_dir)?;
        let disk = Arc::new(DiskTier::open(disk_config).map_err(|e| tier_failed("disk", &e))?);

        let mut stack = TierStack::default();
        let mut tiers: Vec<SimTier> = Vec::new();
        stack.push(Box::new(disk.manager(manager_config(cli, "disk"))?));
        tiers.push(SimTier::new(
            Arc::clone(&disk) as Arc<dyn DynBlockStore>,
            cli.block_bytes,
            true,
        ));
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
                .map_err(|e| match e {
                    // The CA file is --redis-ca's: say so.
                    RedisTierError::InvalidConfig {
                        field: "tls_ca_cert",
                        ..
                    } => tier_failed(&format!("{name} tier: --redis-ca"), &e),
                    e => tier_failed(name, &e),
                })?,
            );
            rt.block_on(tier.ping())
                .map_err(|e| tier_failed(name, &e))?;
            stack.push(Box::new(tier.manager(manager_config(cli, name))?));
            tiers.push(SimTier::new(tier, 64, false));
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
            stack.push(Box::new(tier.manager(manager_config(cli, "s3"))?));
            tiers.push(SimTier::new(tier, 64, false));
        }
        if !cli.no_mock {
            let mock = Arc::new(MockTier::new(MockConfig {
                seed: cli.seed,
                latency_us: cli.mock_latency_us,
                jitter_us: cli.mock_jitter_us,
                record_calls: false,
                ..MockConfig::default()
            }));
            stack.push(Box::new(mock.manager(manager_config(cli, "mock"))?));
            tiers.push(SimTier::new(mock, 64, false));
        }
        Ok(Self {
            stack,
            tiers,
            disk,
            disk_dir,
            _temp: temp,
        })
    }
}
