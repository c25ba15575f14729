//! [`TierStack`]: one prefix question over several tiers in priority order.

use std::sync::Arc;
use std::task::Poll;

use crate::config::ManagerConfig;
use crate::error::{LookupError, ManagerError};
use crate::key::{OffloadKey, ReqContext};
use crate::ledger::{LookupVerdict, PrefixVerdict};
use crate::manager::{AsyncLookupManager, ShutdownReport};
use crate::runtime::Spawner;
use crate::stats::ManagerStats;
use crate::store::BlockStore;
use crate::tier::{BoxFuture, Tier};

/// The object-safe twin of [`AsyncLookupManager`], so that managers of
/// different tier types can share one collection. Every
/// `AsyncLookupManager<T>` implements it; generic code keeps using the
/// manager itself, which costs no dynamic call.
pub trait DynLookupManager: Send {
    /// [`AsyncLookupManager::tier_name`].
    fn tier_name(&self) -> &str;
    /// [`AsyncLookupManager::lookup`].
    ///
    /// # Errors
    /// As [`AsyncLookupManager::lookup`].
    fn lookup(&mut self, key: &OffloadKey, ctx: &ReqContext) -> Result<LookupVerdict, LookupError>;
    /// [`AsyncLookupManager::lookup_prefix`].
    ///
    /// # Errors
    /// As [`AsyncLookupManager::lookup_prefix`].
    fn lookup_prefix(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
    ) -> Result<PrefixVerdict, LookupError>;
    /// [`AsyncLookupManager::flush`].
    fn flush(&mut self);
    /// [`AsyncLookupManager::drain_results`].
    fn drain_results(&mut self);
    /// [`AsyncLookupManager::mark_miss`].
    fn mark_miss(&mut self, keys: &[OffloadKey]);
    /// [`AsyncLookupManager::mark_present`].
    fn mark_present(&mut self, keys: &[OffloadKey]);
    /// [`AsyncLookupManager::cleanup`].
    fn cleanup(&mut self, req_id: &str);
    /// [`AsyncLookupManager::stats`].
    fn stats(&self) -> ManagerStats;
    /// [`AsyncLookupManager::is_idle`].
    fn is_idle(&self) -> bool;
    /// [`AsyncLookupManager::shutdown`].
    fn shutdown(&mut self) -> ShutdownReport;
    /// [`AsyncLookupManager::shutdown_async`]. The default runs the blocking
    /// [`shutdown`](Self::shutdown) when called; implementations that can
    /// await should override it.
    fn shutdown_async(&mut self) -> BoxFuture<'_, ShutdownReport> {
        let report = self.shutdown();
        Box::pin(std::future::ready(report))
    }
}

impl<T: Tier> DynLookupManager for AsyncLookupManager<T> {
    fn tier_name(&self) -> &str {
        AsyncLookupManager::tier_name(self)
    }
    fn lookup(&mut self, key: &OffloadKey, ctx: &ReqContext) -> Result<LookupVerdict, LookupError> {
        AsyncLookupManager::lookup(self, key, ctx)
    }
    fn lookup_prefix(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
    ) -> Result<PrefixVerdict, LookupError> {
        AsyncLookupManager::lookup_prefix(self, keys, ctx)
    }
    fn flush(&mut self) {
        AsyncLookupManager::flush(self);
    }
    fn drain_results(&mut self) {
        AsyncLookupManager::drain_results(self);
    }
    fn mark_miss(&mut self, keys: &[OffloadKey]) {
        AsyncLookupManager::mark_miss(self, keys);
    }
    fn mark_present(&mut self, keys: &[OffloadKey]) {
        AsyncLookupManager::mark_present(self, keys);
    }
    fn cleanup(&mut self, req_id: &str) {
        AsyncLookupManager::cleanup(self, req_id);
    }
    fn stats(&self) -> ManagerStats {
        AsyncLookupManager::stats(self)
    }
    fn is_idle(&self) -> bool {
        AsyncLookupManager::is_idle(self)
    }
    fn shutdown(&mut self) -> ShutdownReport {
        AsyncLookupManager::shutdown(self)
    }
    fn shutdown_async(&mut self) -> BoxFuture<'_, ShutdownReport> {
        Box::pin(AsyncLookupManager::shutdown_async(self))
    }
}

/// How a [`TierStack`] treats a block that is still pending in a preferred tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StackPolicy {
    /// A block pending in a tier that comes before every tier known to hold
    /// it keeps the answer pending: the block is loaded from the best tier
    /// that has it. The default.
    #[default]
    PreferEarlierTiers,
    /// The first tier (in order) that has resolved a hit is taken, even while
    /// an earlier tier is still pending: faster answers, sometimes from a
    /// slower tier.
    FirstResolvedHit,
}

/// The answer of [`TierStack::lookup_prefix`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StackVerdict {
    /// Some block before the first block missing everywhere has no answer yet.
    Pending,
    /// `locations.len()` leading blocks exist; `locations[i]` is the index of
    /// the tier to load block `i` from.
    Ready {
        /// Per leading block, the index (in the stack) of the tier holding it.
        locations: Vec<usize>,
    },
}

impl StackVerdict {
    /// The number of leading blocks found, if the answer is ready.
    pub fn blocks(&self) -> Option<usize> {
        match self {
            Self::Pending => None,
            Self::Ready { locations } => Some(locations.len()),
        }
    }
}

/// Where one block stands across the tiers.
enum Block {
    Found(usize),
    Missing,
    Pending,
}

/// Several lookup managers in priority order (fastest first: disk, then
/// Redis, then S3), answering one question per request: how many leading
/// blocks exist anywhere, and where is each.
///
/// `flush`, `cleanup`, `shutdown` and `stats` fan out to every tier;
/// `mark_miss` names its tier.
///
/// Built with [`with_spawner`](Self::with_spawner), the stack starts the
/// managers it [`add`](Self::add)s on one [`Spawner`]: one worker runtime
/// (one OS thread for `Spawner::dedicated(name, 1)`) serves every tier,
/// while each tier keeps its own limits and deadlines. Managers built
/// elsewhere can still be added with [`with`](Self::with) and
/// [`push`](Self::push).
///
/// ```
/// use std::sync::Arc;
/// use kvtier_core::{AsyncLookupManager, ManagerConfig, OffloadKey, ReqContext, Spawner, StackPolicy,
///                   StackVerdict, TierStack, Tier, TierError};
///
/// struct Holds(Vec<u8>);
/// impl Tier for Holds {
///     async fn batch_lookup(&self, keys: &[OffloadKey], _: &ReqContext) -> Result<Vec<bool>, TierError> {
///         Ok(keys.iter().map(|k| self.0.contains(&k.as_bytes()[0])).collect())
///     }
/// }
///
/// let mut stack = TierStack::default()
///     .with(AsyncLookupManager::new(Holds(vec![0, 1]), ManagerConfig::named("near"))?)
///     .with(AsyncLookupManager::new(Holds(vec![0, 2, 3]), ManagerConfig::named("far"))?);
/// let prompt: Vec<OffloadKey> = (0u8..5).map(|b| OffloadKey::new(&[b; 36])).collect();
/// let ctx = ReqContext::new("r");
/// let verdict = loop {
///     match stack.lookup_prefix(&prompt, &ctx)? {
///         StackVerdict::Pending => { stack.flush(); std::thread::sleep(std::time::Duration::from_millis(1)); }
///         ready => break ready,
///     }
/// };
/// // Blocks 0 and 1 from "near", 2 and 3 from "far"; block 4 is nowhere.
/// assert_eq!(verdict, StackVerdict::Ready { locations: vec![0, 0, 1, 1] });
/// stack.cleanup("r");
/// stack.shutdown();
///
/// // The same two tiers sharing one runtime thread (the stack above ran two):
/// let spawner = Spawner::dedicated("kvtier-stack", 1)?;
/// let mut shared = TierStack::with_spawner(StackPolicy::default(), spawner);
/// shared
///     .add(Arc::new(Holds(vec![0, 1])), ManagerConfig::named("near"))?
///     .add(Arc::new(Holds(vec![0, 2, 3])), ManagerConfig::named("far"))?;
/// assert_eq!(shared.tier_names(), ["near", "far"]);
/// shared.shutdown();
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Default)]
pub struct TierStack {
    tiers: Vec<Box<dyn DynLookupManager>>,
    policy: StackPolicy,
    spawner: Option<Spawner>,
}

impl std::fmt::Debug for TierStack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TierStack")
            .field(
                "tiers",
                &self.tiers.iter().map(|t| t.tier_name()).collect::<Vec<_>>(),
            )
            .field("policy", &self.policy)
            .field("spawner", &self.spawner)
            .finish()
    }
}

impl TierStack {
    /// An empty stack with `policy`.
    pub fn new(policy: StackPolicy) -> Self {
        Self {
            tiers: Vec::new(),
            policy,
            spawner: None,
        }
    }

    /// An empty stack with `policy` whose [`add`](Self::add)ed tiers all run
    /// on `spawner`. The stack keeps its clone until it drops (each manager
    /// releases its own at shutdown), so a dedicated spawner's runtime stops
    /// once the stack and every other clone are gone.
    pub fn with_spawner(policy: StackPolicy, spawner: Spawner) -> Self {
        Self {
            tiers: Vec::new(),
            policy,
            spawner: Some(spawner),
        }
    }

    /// The spawner [`add`](Self::add) starts managers on, if the stack has one.
    pub fn spawner(&self) -> Option<&Spawner> {
        self.spawner.as_ref()
    }

    /// Starts a manager for `tier` and adds it after the tiers already
    /// there: on the stack's spawner
    /// ([`AsyncLookupManager::with_spawner`]), or, for a stack without one,
    /// on a runtime of its own ([`AsyncLookupManager::from_arc`]).
    ///
    /// # Errors
    /// As [`AsyncLookupManager::with_spawner`] and
    /// [`AsyncLookupManager::from_arc`]; the stack is unchanged.
    pub fn add<T: Tier>(
        &mut self,
        tier: Arc<T>,
        config: ManagerConfig,
    ) -> Result<&mut Self, ManagerError> {
        let manager = match &self.spawner {
            Some(spawner) => AsyncLookupManager::with_spawner(tier, config, spawner)?,
            None => AsyncLookupManager::from_arc(tier, config)?,
        };
        self.push(Box::new(manager));
        Ok(self)
    }

    /// [`add`](Self::add) for a [`BlockStore`], with the defaults of its
    /// [`manager_config`](BlockStore::manager_config) (its name, its key
    /// length): `stack.add_store(&disk, ManagerConfig::default())`. For a
    /// stack without a spawner, the manager is the store's own
    /// [`manager`](BlockStore::manager): a runtime of its own, unless the
    /// store runs it on a runtime it owns (as the Redis tier does).
    ///
    /// # Errors
    /// As [`add`](Self::add).
    pub fn add_store<S: BlockStore>(
        &mut self,
        store: &Arc<S>,
        config: ManagerConfig,
    ) -> Result<&mut Self, ManagerError> {
        let manager = match &self.spawner {
            Some(spawner) => store.manager_on(config, spawner)?,
            None => store.manager(config)?,
        };
        self.push(Box::new(manager));
        Ok(self)
    }

    /// Adds a tier after the ones already there (lower priority).
    #[must_use]
    pub fn with(mut self, manager: impl DynLookupManager + 'static) -> Self {
        self.push(Box::new(manager));
        self
    }

    /// Adds a boxed tier after the ones already there.
    pub fn push(&mut self, manager: Box<dyn DynLookupManager>) {
        self.tiers.push(manager);
    }

    /// Number of tiers.
    pub fn len(&self) -> usize {
        self.tiers.len()
    }

    /// Whether the stack has no tier.
    pub fn is_empty(&self) -> bool {
        self.tiers.is_empty()
    }

    /// The tier at `index`.
    pub fn tier(&mut self, index: usize) -> Option<&mut dyn DynLookupManager> {
        Some(self.tiers.get_mut(index)?.as_mut())
    }

    /// The tiers' names, in order.
    pub fn tier_names(&self) -> Vec<String> {
        self.tiers
            .iter()
            .map(|t| t.tier_name().to_owned())
            .collect()
    }

    fn block(&mut self, key: &OffloadKey, ctx: &ReqContext) -> Result<Block, LookupError> {
        let mut pending_before = false;
        let mut first_hit = None;
        for (index, tier) in self.tiers.iter_mut().enumerate() {
            match tier.lookup(key, ctx)? {
                LookupVerdict::Hit => {
                    first_hit = Some(index);
                    break;
                }
                LookupVerdict::Miss => {}
                // Later tiers are still asked, so that every tier that may
                // be needed gets the key in this step.
                LookupVerdict::Pending => pending_before = true,
            }
        }
        Ok(match (first_hit, pending_before, self.policy) {
            (Some(index), false, _) | (Some(index), true, StackPolicy::FirstResolvedHit) => {
                Block::Found(index)
            }
            (Some(_), true, StackPolicy::PreferEarlierTiers) | (None, true, _) => Block::Pending,
            (None, false, _) => Block::Missing,
        })
    }

    /// How many leading `keys` exist in any tier, and where. A block missing
    /// in every tier ends the prefix; a block without an answer before it
    /// makes the whole answer pending (see [`StackPolicy`]). Every unresolved
    /// block up to the first missing one is registered in the tiers that may
    /// hold it, so a prompt resolves in one round trip.
    ///
    /// # Errors
    /// The first tier's [`LookupError`] (an invalid key, a shut-down tier).
    pub fn lookup_prefix(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
    ) -> Result<StackVerdict, LookupError> {
        let mut locations = Vec::new();
        let mut pending = false;
        for key in keys {
            match self.block(key, ctx)? {
                Block::Found(index) => locations.push(index),
                Block::Missing => break,
                Block::Pending => pending = true,
            }
        }
        Ok(if pending {
            StackVerdict::Pending
        } else {
            StackVerdict::Ready { locations }
        })
    }

    /// Flushes every tier (once per scheduler step).
    pub fn flush(&mut self) {
        for tier in &mut self.tiers {
            tier.flush();
        }
    }

    /// Applies waiting results in every tier.
    pub fn drain_results(&mut self) {
        for tier in &mut self.tiers {
            tier.drain_results();
        }
    }

    /// Marks `keys` missing in tier `index` after a failed load from it.
    /// An index past the end is ignored.
    pub fn mark_miss(&mut self, index: usize, keys: &[OffloadKey]) {
        if let Some(tier) = self.tiers.get_mut(index) {
            tier.mark_miss(keys);
        }
    }

    /// Marks `keys` present in tier `index` after a store to it finished.
    /// An index past the end is ignored.
    pub fn mark_present(&mut self, index: usize, keys: &[OffloadKey]) {
        if let Some(tier) = self.tiers.get_mut(index) {
            tier.mark_present(keys);
        }
    }

    /// Releases request `req_id` in every tier.
    pub fn cleanup(&mut self, req_id: &str) {
        for tier in &mut self.tiers {
            tier.cleanup(req_id);
        }
    }

    /// Stats of every tier, in order.
    pub fn stats(&self) -> Vec<ManagerStats> {
        self.tiers.iter().map(|t| t.stats()).collect()
    }

    /// Whether every tier is idle.
    pub fn is_idle(&self) -> bool {
        self.tiers.iter().all(|t| t.is_idle())
    }

    /// Shuts every tier down, one after the other, blocking this thread;
    /// each is bounded by its own shutdown timeout. For a synchronous
    /// scheduler; on a runtime use [`shutdown_async`](Self::shutdown_async).
    pub fn shutdown(&mut self) -> Vec<ShutdownReport> {
        self.tiers.iter_mut().map(|t| t.shutdown()).collect()
    }

    /// Shuts every tier down at once, awaiting instead of blocking: bounded
    /// by the longest tier's shutdown timeout. Reports are in tier order.
    /// See [`AsyncLookupManager::shutdown_async`].
    pub async fn shutdown_async(&mut self) -> Vec<ShutdownReport> {
        let futures: Vec<_> = self.tiers.iter_mut().map(|t| t.shutdown_async()).collect();
        join_all(futures).await
    }
}

/// Polls every future until all are ready; their outputs in order.
async fn join_all<R>(mut futures: Vec<BoxFuture<'_, R>>) -> Vec<R> {
    let mut outputs: Vec<Option<R>> = futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut all_ready = true;
        for (future, output) in futures.iter_mut().zip(outputs.iter_mut()) {
            if output.is_none() {
                match future.as_mut().poll(cx) {
                    Poll::Ready(value) => *output = Some(value),
                    Poll::Pending => all_ready = false,
                }
            }
        }
        if all_ready {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    })
    .await;
    outputs.into_iter().flatten().collect()
}
