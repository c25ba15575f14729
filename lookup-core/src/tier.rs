//! The one trait a tier implements, and adapters around it.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use crate::error::{TierError, TierErrorKind};
use crate::key::{OffloadKey, ReqContext};

/// A secondary tier that can tell, for a batch of keys, which exist.
///
/// This is the only method a backend writes; prefix counting, caching,
/// deduplication, deadlines and retries live in the manager, once.
///
/// # Contract
///
/// - The answer has exactly one `bool` per key, in the order of `keys`:
///   `true` if the block exists in the tier, `false` if it does not.
/// - An absent key is `Ok(false)`, never an error. An error means the tier
///   could not tell (unreachable, throttled, misconfigured); the manager
///   then resolves the keys as counted errors, not as misses, and probes
///   them again later.
/// - `keys` may be empty (answer `Ok(vec![])`) and may contain duplicates
///   (answer each position).
/// - The future runs on the manager's worker runtime (its
///   [`Spawner`](crate::Spawner)) and must not block its thread: wrap a
///   synchronous tier in [`Blocking`]. It may be dropped at any await point
///   when the call's deadline expires or the manager shuts down or drops
///   (cancellation safety: dropping it must leave the tier usable).
/// - It must not depend on I/O objects (connections, sockets, timers) bound
///   to another runtime that may stop first: a connection made on a
///   short-lived runtime (say, by a `store` in a test) loses its driver when
///   that runtime drops, and calls through it then hang until their
///   deadline or fail. The core cannot repair that; a tier makes its lookup
///   connections on the runtime its calls run on, or reconnects when a
///   connection's driver is gone (the Redis and S3 tier crates do this).
/// - It must not touch scheduler-owned state; it may be called concurrently
///   for different requests.
///
/// A wrong-length answer or a panic does not break the manager: the call's
/// keys resolve as counted errors.
///
/// # Example
///
/// ```
/// use kvtier_core::{OffloadKey, ReqContext, Tier, TierError};
/// use std::collections::HashSet;
///
/// struct Fixed(HashSet<OffloadKey>);
///
/// impl Tier for Fixed {
///     async fn batch_lookup(&self, keys: &[OffloadKey], _ctx: &ReqContext)
///         -> Result<Vec<bool>, TierError> {
///         Ok(keys.iter().map(|k| self.0.contains(k)).collect())
///     }
/// }
/// ```
pub trait Tier: Send + Sync + 'static {
    /// Checks which of `keys` exist in the tier, for the request in `ctx`.
    ///
    /// # Errors
    /// A [`TierError`] when the tier cannot tell; never for an absent key.
    fn batch_lookup(
        &self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
    ) -> impl Future<Output = Result<Vec<bool>, TierError>> + Send;
}

impl<T: Tier> Tier for Arc<T> {
    fn batch_lookup(
        &self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
    ) -> impl Future<Output = Result<Vec<bool>, TierError>> + Send {
        (**self).batch_lookup(keys, ctx)
    }
}

/// A tier that answers synchronously (an in-process index, a blocking client).
///
/// Wrap it in [`Blocking`] to use it as a [`Tier`]: each call then runs on
/// the worker runtime's blocking pool, so a slow or hung call never stalls
/// other calls, and the manager's deadline still applies.
///
/// The contract is [`Tier`]'s.
pub trait SyncTier: Send + Sync + 'static {
    /// Checks which of `keys` exist in the tier, for the request in `ctx`.
    ///
    /// # Errors
    /// A [`TierError`] when the tier cannot tell; never for an absent key.
    fn batch_lookup_blocking(
        &self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
    ) -> Result<Vec<bool>, TierError>;
}

/// Runs a [`SyncTier`] on the runtime's blocking pool; see [`SyncTier`].
#[derive(Debug, Clone, Default)]
pub struct Blocking<T>(pub Arc<T>);

impl<T> Blocking<T> {
    /// Wraps `tier`.
    pub fn new(tier: T) -> Self {
        Self(Arc::new(tier))
    }

    /// The wrapped tier.
    pub fn inner(&self) -> &Arc<T> {
        &self.0
    }
}

impl<T: SyncTier> Tier for Blocking<T> {
    async fn batch_lookup(
        &self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
    ) -> Result<Vec<bool>, TierError> {
        let tier = Arc::clone(&self.0);
        let keys = keys.to_vec();
        let ctx = ctx.clone();
        match tokio::task::spawn_blocking(move || tier.batch_lookup_blocking(&keys, &ctx)).await {
            Ok(answer) => answer,
            Err(join) if join.is_panic() => Err(TierError::new(
                TierErrorKind::Panicked,
                "synchronous batch_lookup panicked",
            )),
            Err(_) => Err(TierError::new(
                TierErrorKind::Other,
                "synchronous batch_lookup was cancelled",
            )),
        }
    }
}

/// A boxed future, as returned by [`DynTier`].
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The object-safe twin of [`Tier`], implemented for every tier.
///
/// Use `Arc<dyn DynTier>` to hold tiers of different types in one
/// collection; a boxed tier is itself a [`Tier`]. Generic code should prefer
/// [`Tier`], which costs no allocation per call.
pub trait DynTier: Send + Sync + 'static {
    /// [`Tier::batch_lookup`], boxed.
    fn batch_lookup_dyn<'a>(
        &'a self,
        keys: &'a [OffloadKey],
        ctx: &'a ReqContext,
    ) -> BoxFuture<'a, Result<Vec<bool>, TierError>>;
}

impl<T: Tier> DynTier for T {
    fn batch_lookup_dyn<'a>(
        &'a self,
        keys: &'a [OffloadKey],
        ctx: &'a ReqContext,
    ) -> BoxFuture<'a, Result<Vec<bool>, TierError>> {
        Box::pin(self.batch_lookup(keys, ctx))
    }
}

impl Tier for Arc<dyn DynTier> {
    async fn batch_lookup(
        &self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
    ) -> Result<Vec<bool>, TierError> {
        (**self).batch_lookup_dyn(keys, ctx).await
    }
}
