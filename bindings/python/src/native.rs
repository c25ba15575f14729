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

pub(crate) fn redis(config: RedisConfig, spawner: &Spawner) -> PyResult<Closable<RedisTier>> {
    let tier = RedisTier::with_spawner(config, spawner).map_err(errors::config_error)?;
    Ok(Closable::new(tier))
}

pub(crate) fn s3(
    py: Python<'_>,
    config: S3Config,
    spawner: &Spawner,
) -> PyResult<Closable<S3Tier>> {
    config.validate().map_err(errors::config_error)?;
    let built = crate::lifecycle::allow_threads(py, || {
        spawner
            .handle()
            .block_on(S3Tier::with_spawner(config, spawner))
    });
    Ok(Closable::new(built.map_err(errors::config_error)?))
}

pub(crate) fn disk(py: Python<'_>, config: DiskConfig) -> PyResult<Closable<DiskTier>> {
    let tier = crate::lifecycle::allow_threads(py, || DiskTier::open(config))
        .map_err(errors::config_error)?;
    Ok(Closable::new(tier))
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
}

impl Blocks {
    pub(crate) fn new(kind: &'static str, store: Arc<dyn DynBlockStore>, spawner: Spawner) -> Self {
        Self {
            kind,
            store,
            spawner,
            shutdown_timeout: Duration::from_secs(5),
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
        }
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
        self.run(py, "store", self.store.store_dyn(key, data))
    }

    pub(crate) fn load(&self, py: Python<'_>, key: &OffloadKey) -> PyResult<Option<Vec<u8>>> {
        self.run(py, "load", self.store.load_dyn(key))
    }

    pub(crate) fn remove(&self, py: Python<'_>, key: &OffloadKey) -> PyResult<()> {
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
