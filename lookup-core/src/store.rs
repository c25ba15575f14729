//! [`BlockStore`]: one interface to store, load and remove blocks in any
//! tier, one key at a time or in batches copied straight between the
//! caller's memory and the tier ([`BlockOutcome`] per key).

use std::fmt;
use std::future::Future;
use std::sync::Arc;

use crate::config::ManagerConfig;
use crate::error::{ManagerError, TierError, TierErrorKind};
use crate::key::OffloadKey;
use crate::manager::AsyncLookupManager;
use crate::runtime::Spawner;
use crate::tier::{BoxFuture, Tier};

/// A tier that can also store, load and remove blocks: the write side of a
/// [`Tier`], with one set of types for every backend.
///
/// The lookup side stays [`Tier::batch_lookup`], which the manager calls on
/// its worker. `BlockStore` is what the rest of the engine calls: an offload
/// path storing blocks it evicted from the GPU, a load path reading them
/// back, an admin tool removing them. Tier-specific options (a Redis time to
/// live, an S3 storage class) live in the tier's configuration, so code
/// written against this trait runs on every tier.
///
/// # Contract
///
/// - After `store(key, block)` returns `Ok`, `batch_lookup` answers `true`
///   for `key` and `load(key)` returns `Some(block)` until the key is removed
///   or the tier evicts or expires it (tiers with a capacity or a time to
///   live say so in their docs).
/// - Storing a key again replaces its block.
/// - `load` of an absent key is `Ok(None)`, never an error; `remove` of an
///   absent key is `Ok(())` (removal is idempotent).
/// - An error means the operation may not have happened: the tier could not
///   tell, or refused the input (a key of the wrong size is
///   [`TierErrorKind::InvalidInput`](crate::TierErrorKind::InvalidInput)).
///   The tier's own typed error is the [`source`](std::error::Error::source)
///   of the [`TierError`], for callers that want the detail.
/// - The batched forms answer or act per position; the provided ones loop
///   over the single forms, and tiers override them with one round trip
///   (a Redis pipeline, concurrent S3 requests, one index lock).
/// - The in-place batch forms, [`store_batch`](Self::store_batch) and
///   [`load_batch`](Self::load_batch), answer one [`BlockOutcome`] per
///   position, in order, and never fail as a whole: a batch the tier could
///   not run at all (a server down) answers every key
///   [`Failed`](BlockOutcome::Failed) with one shared error. Duplicates are
///   acted on at every position (a later store of a key wins). A load
///   writes only inside the regions it is given; a stored block whose
///   length differs from its region's is
///   [`TierErrorKind::LengthMismatch`] for that key (with a
///   [`LengthMismatch`] source), and the region is left as it was.
/// - Futures must be cancellation safe in the sense of [`Tier`]: dropping one
///   leaves the tier usable (a dropped `store` may or may not have stored).
///
/// # Example
///
/// Code written once against the trait, used with any tier:
///
/// ```
/// use kvtier_core::{BlockStore, OffloadKey, TierError};
///
/// async fn offload<S: BlockStore>(store: &S, blocks: &[(OffloadKey, Vec<u8>)])
///     -> Result<(), TierError> {
///     store.store_many(blocks).await
/// }
/// ```
pub trait BlockStore: Tier {
    /// Stores `block` under `key`, replacing any block stored there.
    ///
    /// # Errors
    /// A [`TierError`] when the block may not have been stored.
    fn store(
        &self,
        key: &OffloadKey,
        block: &[u8],
    ) -> impl Future<Output = Result<(), TierError>> + Send;

    /// The block stored under `key`, or `None` if there is none.
    ///
    /// # Errors
    /// A [`TierError`] when the tier cannot tell (never for an absent key).
    fn load(
        &self,
        key: &OffloadKey,
    ) -> impl Future<Output = Result<Option<Vec<u8>>, TierError>> + Send;

    /// Removes the block stored under `key`, if any.
    ///
    /// # Errors
    /// A [`TierError`] when the block may still be stored.
    fn remove(&self, key: &OffloadKey) -> impl Future<Output = Result<(), TierError>> + Send;

    /// Stores every `(key, block)`; the provided form stores them in turn.
    ///
    /// # Errors
    /// The first [`TierError`]; blocks before it may have been stored.
    fn store_many(
        &self,
        blocks: &[(OffloadKey, Vec<u8>)],
    ) -> impl Future<Output = Result<(), TierError>> + Send {
        async move {
            for (key, block) in blocks {
                self.store(key, block).await?;
            }
            Ok(())
        }
    }

    /// The block stored under each key, in order; the provided form loads
    /// them in turn.
    ///
    /// # Errors
    /// The first [`TierError`].
    fn load_many(
        &self,
        keys: &[OffloadKey],
    ) -> impl Future<Output = Result<Vec<Option<Vec<u8>>>, TierError>> + Send {
        async move {
            let mut blocks = Vec::with_capacity(keys.len());
            for key in keys {
                blocks.push(self.load(key).await?);
            }
            Ok(blocks)
        }
    }

    /// Stores each `(key, block)` of `blocks`, borrowed from the caller, and
    /// answers one [`BlockOutcome`] per position, in order:
    /// [`Done`](BlockOutcome::Done) once the block is stored as
    /// [`store`](Self::store) promises, or
    /// [`Failed`](BlockOutcome::Failed) when it may not be. Never
    /// [`Absent`](BlockOutcome::Absent). A key repeated in the batch ends
    /// with its last block.
    ///
    /// The provided form stores the blocks in turn with
    /// [`store`](Self::store); tiers override it with their native batch
    /// (one append, one pipeline, concurrent requests).
    ///
    /// # Cancellation safety
    /// Dropping the future part way leaves every key stored or not, as a
    /// dropped [`store`](Self::store) does.
    fn store_batch(
        &self,
        blocks: &[(&OffloadKey, &[u8])],
    ) -> impl Future<Output = Vec<BlockOutcome>> + Send {
        async move {
            let mut outcomes = Vec::with_capacity(blocks.len());
            for &(key, block) in blocks {
                outcomes.push(match self.store(key, block).await {
                    Ok(()) => BlockOutcome::Done,
                    Err(err) => BlockOutcome::failed(err),
                });
            }
            outcomes
        }
    }

    /// Loads the block of each key into its region, caller-owned memory of
    /// exactly the block's length, and answers one [`BlockOutcome`] per
    /// position, in order: [`Done`](BlockOutcome::Done) when the region
    /// holds the block, byte for byte; [`Absent`](BlockOutcome::Absent) when
    /// no block is stored under the key (the region is left as it was);
    /// [`Failed`](BlockOutcome::Failed) otherwise (the region's bytes are
    /// then unspecified, except on a [`LengthMismatch`], which leaves it as
    /// it was). Nothing is written outside the regions.
    ///
    /// The provided form loads the blocks in turn with
    /// [`load`](Self::load) and copies each into its region (an allocation
    /// per block); tiers override it to copy straight from the tier into
    /// the region (a read from the segment file, a reply parsed in place).
    ///
    /// # Cancellation safety
    /// Dropping the future part way leaves the regions of the keys not yet
    /// answered with unspecified bytes, and the tier usable; once dropped,
    /// nothing writes into the regions any more (they are borrowed).
    fn load_batch(
        &self,
        regions: &mut [(&OffloadKey, &mut [u8])],
    ) -> impl Future<Output = Vec<BlockOutcome>> + Send {
        async move {
            let mut outcomes = Vec::with_capacity(regions.len());
            for (key, region) in regions.iter_mut() {
                outcomes.push(match self.load(key).await {
                    Ok(Some(block)) if block.len() == region.len() => {
                        region.copy_from_slice(&block);
                        BlockOutcome::Done
                    }
                    Ok(Some(block)) => {
                        BlockOutcome::failed(LengthMismatch::error(block.len(), region.len()))
                    }
                    Ok(None) => BlockOutcome::Absent,
                    Err(err) => BlockOutcome::failed(err),
                });
            }
            outcomes
        }
    }

    /// The length of the block stored under `key`, when the store knows it
    /// without reading a block or asking a server (a local index; it may
    /// wait briefly on the store's own lock, and a memory-mapped index may
    /// fault a page in); `None` when it would have to ask (a remote tier:
    /// the provided form) or the key is not stored. Called once per key of
    /// each load submitted to a [`TransferQueue`](crate::TransferQueue), on
    /// the submitting thread. A [`TransferQueue`](crate::TransferQueue) refuses
    /// a load at submission whose region's length differs from a length
    /// known here ([`SubmitError::LengthMismatch`](crate::SubmitError::LengthMismatch));
    /// the load itself checks every key again.
    fn known_len(&self, key: &OffloadKey) -> Option<usize> {
        let _ = key;
        None
    }

    /// Whether this store's futures do their I/O on the thread that polls
    /// them, blocking it (a local disk's reads and writes), rather than
    /// waiting on the runtime. A [`TransferQueue`](crate::TransferQueue)
    /// then runs its jobs on the runtime's blocking threads. The provided
    /// form answers `false`.
    fn io_blocks_thread(&self) -> bool {
        false
    }

    /// Removes every key's block; the provided form removes them in turn.
    ///
    /// # Errors
    /// The first [`TierError`]; keys before it may have been removed.
    fn remove_many(
        &self,
        keys: &[OffloadKey],
    ) -> impl Future<Output = Result<(), TierError>> + Send {
        async move {
            for key in keys {
                self.remove(key).await?;
            }
            Ok(())
        }
    }

    /// The defaults this store fills into a manager's configuration: its
    /// name when `config` has none ([`ManagerConfig::or_named`]) and a key
    /// length it accepts. The provided form returns `config` unchanged.
    fn manager_config(&self, config: ManagerConfig) -> ManagerConfig {
        config
    }

    /// Starts an [`AsyncLookupManager`] answering lookups from this store,
    /// with [`manager_config`](Self::manager_config)'s defaults. The caller
    /// keeps the `Arc` to store, load and remove while the manager looks up.
    ///
    /// # Errors
    /// As [`AsyncLookupManager::new`].
    fn manager(
        self: &Arc<Self>,
        config: ManagerConfig,
    ) -> Result<AsyncLookupManager<Self>, ManagerError>
    where
        Self: Sized,
    {
        AsyncLookupManager::from_arc(Arc::clone(self), self.manager_config(config))
    }

    /// Like [`manager`](Self::manager), on `spawner`'s runtime (the
    /// caller's, or one shared by several managers); see [`Spawner`].
    ///
    /// # Errors
    /// As [`AsyncLookupManager::with_spawner`].
    fn manager_on(
        self: &Arc<Self>,
        config: ManagerConfig,
        spawner: &Spawner,
    ) -> Result<AsyncLookupManager<Self>, ManagerError>
    where
        Self: Sized,
    {
        AsyncLookupManager::with_spawner(Arc::clone(self), self.manager_config(config), spawner)
    }
}

/// The object-safe twin of [`BlockStore`], implemented for every store.
///
/// Use `Arc<dyn DynBlockStore>` to hold stores of different types in one
/// collection (an offload path writing to every tier of a stack, as
/// `scheduler_sim` does). Generic code should prefer [`BlockStore`], which
/// costs no allocation per call.
pub trait DynBlockStore: Send + Sync + 'static {
    /// [`BlockStore::store`], boxed.
    fn store_dyn<'a>(
        &'a self,
        key: &'a OffloadKey,
        block: &'a [u8],
    ) -> BoxFuture<'a, Result<(), TierError>>;
    /// [`BlockStore::load`], boxed.
    fn load_dyn<'a>(
        &'a self,
        key: &'a OffloadKey,
    ) -> BoxFuture<'a, Result<Option<Vec<u8>>, TierError>>;
    /// [`BlockStore::remove`], boxed.
    fn remove_dyn<'a>(&'a self, key: &'a OffloadKey) -> BoxFuture<'a, Result<(), TierError>>;
    /// [`BlockStore::store_many`], boxed.
    fn store_many_dyn<'a>(
        &'a self,
        blocks: &'a [(OffloadKey, Vec<u8>)],
    ) -> BoxFuture<'a, Result<(), TierError>>;
    /// [`BlockStore::load_many`], boxed.
    fn load_many_dyn<'a>(
        &'a self,
        keys: &'a [OffloadKey],
    ) -> BoxFuture<'a, Result<Vec<Option<Vec<u8>>>, TierError>>;
    /// [`BlockStore::remove_many`], boxed.
    fn remove_many_dyn<'a>(
        &'a self,
        keys: &'a [OffloadKey],
    ) -> BoxFuture<'a, Result<(), TierError>>;
    /// [`BlockStore::store_batch`], boxed.
    fn store_batch_dyn<'a>(
        &'a self,
        blocks: &'a [(&'a OffloadKey, &'a [u8])],
    ) -> BoxFuture<'a, Vec<BlockOutcome>>;
    /// [`BlockStore::load_batch`], boxed.
    fn load_batch_dyn<'a, 'r>(
        &'a self,
        regions: &'a mut [(&'r OffloadKey, &'r mut [u8])],
    ) -> BoxFuture<'a, Vec<BlockOutcome>>
    where
        'r: 'a;
    /// [`BlockStore::io_blocks_thread`].
    fn io_blocks_thread_dyn(&self) -> bool;
    /// [`BlockStore::known_len`].
    fn known_len_dyn(&self, key: &OffloadKey) -> Option<usize>;
}

impl<S: BlockStore> DynBlockStore for S {
    fn store_dyn<'a>(
        &'a self,
        key: &'a OffloadKey,
        block: &'a [u8],
    ) -> BoxFuture<'a, Result<(), TierError>> {
        Box::pin(self.store(key, block))
    }
    fn load_dyn<'a>(
        &'a self,
        key: &'a OffloadKey,
    ) -> BoxFuture<'a, Result<Option<Vec<u8>>, TierError>> {
        Box::pin(self.load(key))
    }
    fn remove_dyn<'a>(&'a self, key: &'a OffloadKey) -> BoxFuture<'a, Result<(), TierError>> {
        Box::pin(self.remove(key))
    }
    fn store_many_dyn<'a>(
        &'a self,
        blocks: &'a [(OffloadKey, Vec<u8>)],
    ) -> BoxFuture<'a, Result<(), TierError>> {
        Box::pin(self.store_many(blocks))
    }
    fn load_many_dyn<'a>(
        &'a self,
        keys: &'a [OffloadKey],
    ) -> BoxFuture<'a, Result<Vec<Option<Vec<u8>>>, TierError>> {
        Box::pin(self.load_many(keys))
    }
    fn remove_many_dyn<'a>(
        &'a self,
        keys: &'a [OffloadKey],
    ) -> BoxFuture<'a, Result<(), TierError>> {
        Box::pin(self.remove_many(keys))
    }
    fn store_batch_dyn<'a>(
        &'a self,
        blocks: &'a [(&'a OffloadKey, &'a [u8])],
    ) -> BoxFuture<'a, Vec<BlockOutcome>> {
        Box::pin(self.store_batch(blocks))
    }
    fn load_batch_dyn<'a, 'r>(
        &'a self,
        regions: &'a mut [(&'r OffloadKey, &'r mut [u8])],
    ) -> BoxFuture<'a, Vec<BlockOutcome>>
    where
        'r: 'a,
    {
        Box::pin(self.load_batch(regions))
    }
    fn io_blocks_thread_dyn(&self) -> bool {
        self.io_blocks_thread()
    }
    fn known_len_dyn(&self, key: &OffloadKey) -> Option<usize> {
        self.known_len(key)
    }
}

/// A [`TierError`] shared by several keys: a batch that failed as a whole
/// answers the same error at every position.
pub type SharedTierError = Arc<TierError>;

/// What a batch form ([`BlockStore::store_batch`],
/// [`BlockStore::load_batch`]) did with one key.
#[derive(Debug, Clone)]
pub enum BlockOutcome {
    /// Stored; or loaded, and its region holds the block byte for byte.
    Done,
    /// A load found no block under the key; its region is as it was.
    /// Stores never answer this.
    Absent,
    /// The store may not have happened, or the load did not fill the region.
    Failed(SharedTierError),
}

impl BlockOutcome {
    /// `Failed(err)`.
    pub fn failed(err: TierError) -> Self {
        Self::Failed(Arc::new(err))
    }

    /// `n` outcomes, each `Failed` with the same `err`: how a tier answers a
    /// batch it could not run at all.
    pub fn all_failed(n: usize, err: TierError) -> Vec<Self> {
        let err = Arc::new(err);
        vec![Self::Failed(err); n]
    }

    /// Whether the key was stored or loaded.
    pub fn is_done(&self) -> bool {
        matches!(self, Self::Done)
    }

    /// The error of a `Failed` outcome.
    pub fn error(&self) -> Option<&SharedTierError> {
        match self {
            Self::Failed(err) => Some(err),
            _ => None,
        }
    }
}

/// Why a load refused a key: the stored block's length differs from its
/// region's. The [`source`](std::error::Error::source) of the
/// [`TierError`] (kind [`TierErrorKind::LengthMismatch`]) that
/// [`BlockStore::load_batch`] answers for that key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LengthMismatch {
    /// Bytes of the stored block.
    pub stored: usize,
    /// Bytes of the region.
    pub region: usize,
}

impl LengthMismatch {
    /// The [`TierError`] for a block of `stored` bytes and a region of
    /// `region` bytes.
    pub fn error(stored: usize, region: usize) -> TierError {
        let mismatch = Self { stored, region };
        TierError::new(TierErrorKind::LengthMismatch, mismatch.to_string()).with_source(mismatch)
    }
}

impl fmt::Display for LengthMismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "the stored block has {} bytes, the region {}",
            self.stored, self.region
        )
    }
}

impl std::error::Error for LengthMismatch {}
