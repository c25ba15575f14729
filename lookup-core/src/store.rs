//! [`BlockStore`]: one interface to store, load and remove blocks in any tier.

use std::future::Future;
use std::sync::Arc;

use crate::config::ManagerConfig;
use crate::error::{ManagerError, TierError};
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
}
