//! [`TierStack`]: one prefix question over several tiers in priority order.

use crate::error::LookupError;
use crate::key::{OffloadKey, ReqContext};
use crate::ledger::{LookupVerdict, PrefixVerdict};
use crate::manager::{AsyncLookupManager, ShutdownReport};
use crate::stats::ManagerStats;
use crate::tier::Tier;

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
    /// [`AsyncLookupManager::cleanup`].
    fn cleanup(&mut self, req_id: &str);
    /// [`AsyncLookupManager::stats`].
    fn stats(&self) -> ManagerStats;
    /// [`AsyncLookupManager::is_idle`].
    fn is_idle(&self) -> bool;
    /// [`AsyncLookupManager::shutdown`].
    fn shutdown(&mut self) -> ShutdownReport;
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
/// ```
/// use kvtier_core::{AsyncLookupManager, ManagerConfig, OffloadKey, ReqContext, StackVerdict, TierStack, Tier, TierError};
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
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Default)]
pub struct TierStack {
    tiers: Vec<Box<dyn DynLookupManager>>,
    policy: StackPolicy,
}

impl std::fmt::Debug for TierStack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TierStack")
            .field(
                "tiers",
                &self.tiers.iter().map(|t| t.tier_name()).collect::<Vec<_>>(),
            )
            .field("policy", &self.policy)
            .finish()
    }
}

impl TierStack {
    /// An empty stack with `policy`.
    pub fn new(policy: StackPolicy) -> Self {
        Self {
            tiers: Vec::new(),
            policy,
        }
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

    /// Shuts every tier down; each is bounded by its own shutdown timeout.
    pub fn shutdown(&mut self) -> Vec<ShutdownReport> {
        self.tiers.iter_mut().map(|t| t.shutdown()).collect()
    }
}
