//! The native tiers (Redis, S3, disk) behind the Python managers: each built
//! on the one runtime its manager runs on, released by `shutdown()`, and
//! their stores, loads and removes, which wait without the GIL.

use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError, RwLock};
use std::time::Duration;

use pyo3::prelude::*;

use kvtier_core::{
    BlockOutcome, BlockStore, DynBlockStore, ManagerConfig, OffloadKey, ReqContext, Spawner, Tier,
    TierError, TierErrorKind,
};
use kvtier_disk::{DiskConfig, DiskTier};
use kvtier_redis::{RedisConfig, RedisTier};
use kvtier_s3::{S3Config, S3Tier};

use crate::errors::{self, TierError as PyTierError};

/// The upper bound of one store / load / remove, over the tiers' own
/// timeouts: the caller never hangs.
const CALL_LIMIT: Duration = Duration::from_secs(60);

/// A tier that [`close`](Self::close) lets go of: its manager and its Python
/// object keep this wrapper, and the tier itself (a disk tier's directory
/// lock, Redis connections, the runtime they hold) goes once the calls
/// running then are over. A call after that fails as
/// [`Unavailable`](TierErrorKind::Unavailable).
#[derive(Debug)]
pub(crate) struct Closable<T>(RwLock<Option<Arc<T>>>);

impl<T> Closable<T> {
    pub(crate) fn new(tier: T) -> Self {
        Self(RwLock::new(Some(Arc::new(tier))))
    }

    /// The tier, unless closed.
    fn get(&self) -> Result<Arc<T>, TierError> {
        self.0
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .ok_or_else(|| TierError::new(TierErrorKind::Unavailable, "the tier was shut down"))
    }

    /// Lets go of the tier.
    pub(crate) fn close(&self) {
        let tier = self
            .0
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        drop(tier);
    }
}

impl<T: Tier> Tier for Closable<T> {
    async fn batch_lookup(
        &self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
    ) -> Result<Vec<bool>, TierError> {
        self.get()?.batch_lookup(keys, ctx).await
    }
}

impl<T: BlockStore> BlockStore for Closable<T> {
    async fn store(&self, key: &OffloadKey, block: &[u8]) -> Result<(), TierError> {
        self.get()?.store(key, block).await
    }
    async fn load(&self, key: &OffloadKey) -> Result<Option<Vec<u8>>, TierError> {
        self.get()?.load(key).await
    }
    async fn remove(&self, key: &OffloadKey) -> Result<(), TierError> {
        self.get()?.remove(key).await
    }
    async fn store_many(&self, blocks: &[(OffloadKey, Vec<u8>)]) -> Result<(), TierError> {
        self.get()?.store_many(blocks).await
    }
    async fn load_many(&self, keys: &[OffloadKey]) -> Result<Vec<Option<Vec<u8>>>, TierError> {
        self.get()?.load_many(keys).await
    }
    async fn remove_many(&self, keys: &[OffloadKey]) -> Result<(), TierError> {
        self.get()?.remove_many(keys).await
    }
    async fn store_batch(&self, blocks: &[(&OffloadKey, &[u8])]) -> Vec<BlockOutcome> {
        match self.get() {
            Ok(tier) => tier.store_batch(blocks).await,
            Err(err) => BlockOutcome::all_failed(blocks.len(), err),
        }
    }
    async fn load_batch(&self, regions: &mut [(&OffloadKey, &mut [u8])]) -> Vec<BlockOutcome> {
        match self.get() {
            Ok(tier) => tier.load_batch(regions).await,
            Err(err) => BlockOutcome::all_failed(regions.len(), err),
        }
    }
    fn io_blocks_thread(&self) -> bool {
        self.get().is_ok_and(|tier| tier.io_blocks_thread())
    }
    fn known_len(&self, key: &OffloadKey) -> Option<usize> {
        self.get().ok()?.known_len(key)
    }
    fn manager_config(&self, config: ManagerConfig) -> ManagerConfig {
        match self.get() {
            Ok(tier) => tier.manager_config(config),
            Err(_) => config,
        }
    }
}

/// The runtime of a native manager and its tier: `worker_threads` threads
/// (S3: at least `io_threads`), named after the tier.
pub(crate) fn spawner(config: &ManagerConfig, threads: usize) -> PyResult<Spawner> {
    Spawner::dedicated(format!("kvtier-lookup-{}", config.tier_name), threads)
        .map_err(errors::build_error)
}

/// A Redis tier; with `check`, one PING now (connection, credentials).
pub(crate) fn redis(
    py: Python<'_>,
    config: RedisConfig,
    spawner: &Spawner,
    check: bool,
) -> PyResult<Closable<RedisTier>> {
    let tier = RedisTier::with_spawner(config, spawner).map_err(errors::config_error)?;
    if check {
        start_up_check(py, "redis", "PING", spawner, tier.ping())?;
    }
    Ok(Closable::new(tier))
}

/// Runs a tier's start-up check on its runtime, without the GIL, within
/// [`CALL_LIMIT`]: its failure is the `TierError` subclass of its kind,
/// naming the tier, the check and the cause.
fn start_up_check<E: Into<TierError> + Send>(
    py: Python<'_>,
    kind: &str,
    op: &str,
    spawner: &Spawner,
    check: impl Future<Output = Result<(), E>> + Send,
) -> PyResult<()> {
    let outcome = crate::lifecycle::allow_threads(py, || {
        spawner
            .handle()
            .block_on(async { tokio::time::timeout(CALL_LIMIT, check).await })
    });
    let error = match outcome {
        Ok(Ok(())) => return Ok(()),
        Ok(Err(e)) => e.into(),
        Err(_) => TierError::new(
            TierErrorKind::Timeout,
            format!("no answer within {} s", CALL_LIMIT.as_secs()),
        ),
    };
    Err(errors::tier_error(
        py,
        &format!("the {kind} tier's start-up check ({op}; check=False skips it)"),
        &error,
    ))
}

/// An S3 tier; with `check`, one HeadBucket now (endpoint, bucket,
/// credentials).
pub(crate) fn s3(
    py: Python<'_>,
    config: S3Config,
    spawner: &Spawner,
    check: bool,
) -> PyResult<Closable<S3Tier>> {
    config.validate().map_err(errors::config_error)?;
    let built = crate::lifecycle::allow_threads(py, || {
        spawner
            .handle()
            .block_on(S3Tier::with_spawner(config, spawner))
    });
    let tier = built.map_err(errors::config_error)?;
    if check {
        start_up_check(py, "s3", "HeadBucket", spawner, tier.check())?;
    }
    Ok(Closable::new(tier))
}

/// A disk tier, its directory opened (created if missing) and locked; with
/// `check`, a file is also written to it and removed. A field out of range
/// is a `ValueError`; a directory that cannot be used, the `TierError`
/// subclass of its kind.
pub(crate) fn disk(
    py: Python<'_>,
    config: DiskConfig,
    check: bool,
) -> PyResult<Closable<DiskTier>> {
    config.validate().map_err(errors::config_error)?;
    let dir = config.path.clone();
    let opened = crate::lifecycle::allow_threads(py, || {
        let tier = DiskTier::open(config)?;
        if check {
            write_check(&dir)?;
        }
        Ok::<_, kvtier_disk::DiskError>(tier)
    });
    let tier = opened.map_err(|e| {
        errors::tier_error(
            py,
            "the disk tier's start-up check (open, lock and write its directory)",
            &e.into(),
        )
    })?;
    Ok(Closable::new(tier))
}

/// Writes a small file in `dir` and removes it: the segments to come can
/// be written there.
fn write_check(dir: &std::path::Path) -> Result<(), kvtier_disk::DiskError> {
    let probe = dir.join(format!(".kvtier-write-check-{}", std::process::id()));
    let written = std::fs::write(&probe, b"kvtier");
    let _ = std::fs::remove_file(&probe);
    written.map_err(|e| kvtier_disk::DiskError::io("write a file in", dir, e))
}

/// Stores, loads and removes of a native manager, on its runtime; taken
/// away by `shutdown()`.
#[derive(Clone)]
pub(crate) struct Blocks {
    /// The tier's kind, for messages.
    kind: &'static str,
    store: Arc<dyn DynBlockStore>,
    /// Keeps the runtime alive while a call runs on it.
    spawner: Spawner,
    /// The manager's `shutdown_timeout_ms`, which bounds its transfer jobs'
    /// shutdown too.
    shutdown_timeout: Duration,
    /// The lengths of key the manager's lookups accept: the same rule here.
    key_lens: (usize, usize),
}

impl Blocks {
    /// `config` is the manager's, as the tier adjusted it
    /// ([`BlockStore::manager_config`]): its key lengths apply here too.
    pub(crate) fn new(
        kind: &'static str,
        store: Arc<dyn DynBlockStore>,
        spawner: Spawner,
        config: &ManagerConfig,
    ) -> Self {
        Self {
            kind,
            store,
            spawner,
            shutdown_timeout: Duration::from_secs(5),
            key_lens: (config.min_key_len.max(1), config.max_key_len),
        }
    }

    /// These blocks, whose transfer jobs shut down within `timeout`.
    pub(crate) fn with_shutdown_timeout(mut self, timeout: Duration) -> Self {
        self.shutdown_timeout = timeout;
        self
    }

    /// The bound of the transfer jobs' shutdown.
    pub(crate) fn shutdown_timeout(&self) -> Duration {
        self.shutdown_timeout
    }

    /// The store and runtime a transfer queue runs on.
    pub(crate) fn queue_source(&self) -> crate::jobs::QueueSource {
        crate::jobs::QueueSource {
            store: Arc::clone(&self.store),
            spawner: self.spawner.clone(),
            key_lens: self.key_lens,
        }
    }

    /// A key of a length the lookups would refuse: the same `ValueError`.
    fn check_key(&self, key: &OffloadKey) -> PyResult<()> {
        let (min, max) = self.key_lens;
        if (min..=max).contains(&key.len()) {
            return Ok(());
        }
        Err(errors::lookup_error(kvtier_core::LookupError::InvalidKey {
            len: key.len(),
            min,
            max,
        }))
    }

    /// Runs `op` on the calling thread, inside the runtime (the tiers' I/O
    /// tasks run on its threads), without the GIL, within [`CALL_LIMIT`].
    fn run<T: Send>(
        &self,
        py: Python<'_>,
        what: &str,
        op: impl Future<Output = Result<T, TierError>> + Send,
    ) -> PyResult<T> {
        let outcome = crate::lifecycle::allow_threads(py, || {
            self.spawner
                .handle()
                .block_on(async { tokio::time::timeout(CALL_LIMIT, op).await })
        });
        match outcome {
            Ok(Ok(value)) => Ok(value),
            Ok(Err(e)) => Err(errors::tier_error(py, &format!("{} {what}", self.kind), &e)),
            Err(_) => Err(PyTierError::new_err(format!(
                "{} {what} did not finish within {} s",
                self.kind,
                CALL_LIMIT.as_secs()
            ))),
        }
    }

    pub(crate) fn store(&self, py: Python<'_>, key: &OffloadKey, data: &[u8]) -> PyResult<()> {
        self.check_key(key)?;
        self.run(py, "store", self.store.store_dyn(key, data))
    }

    pub(crate) fn load(&self, py: Python<'_>, key: &OffloadKey) -> PyResult<Option<Vec<u8>>> {
        self.check_key(key)?;
        self.run(py, "load", self.store.load_dyn(key))
    }

    pub(crate) fn remove(&self, py: Python<'_>, key: &OffloadKey) -> PyResult<()> {
        self.check_key(key)?;
        self.run(py, "remove", self.store.remove_dyn(key))
    }
}

/// [`Blocks`] until `shutdown()` takes them.
#[derive(Default)]
pub(crate) struct BlocksSlot(Mutex<Option<Blocks>>);

impl BlocksSlot {
    pub(crate) fn new(blocks: Option<Blocks>) -> Self {
        Self(Mutex::new(blocks))
    }

    /// The blocks, if the manager is native and not shut down.
    pub(crate) fn get(&self) -> Option<Blocks> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Takes them away (at shutdown): the runtime may stop once no call runs.
    pub(crate) fn take(&self) -> Option<Blocks> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).take()
    }
}
