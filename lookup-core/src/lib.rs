//! Non-blocking lookups of KV-cache blocks in secondary tiers.
//!
//! An LLM inference scheduler asks, every step and for every waiting
//! request, how many leading blocks of the prompt already exist in a
//! secondary tier (local disk, Redis, S3). A tier answers in micro- to
//! milliseconds; the scheduler must not wait. [`AsyncLookupManager`] answers
//! from state it owns ([`Hit`](LookupVerdict::Hit),
//! [`Miss`](LookupVerdict::Miss) or [`Pending`](LookupVerdict::Pending)),
//! batches new keys, and probes them on a background worker through the one
//! trait a backend implements, [`Tier`]. Tiers that also store blocks
//! implement [`BlockStore`], one write interface for every backend.
//!
//! The design follows vLLM's `AsyncLookupManager` (generations, in-flight
//! retention, enqueue-once, `mark_miss`) and fixes what its users hit:
//! every tier call has a deadline, shutdown is bounded even when a tier
//! hangs, each request's results are published as soon as its own call
//! returns, a slow step does not hold back later ones, the backlog is
//! bounded, and a failed probe is counted apart from a miss and retried.
//! [`ledger`] documents the state machine. [`TierStack`] asks several tiers
//! in priority order and says, per leading block, which tier to load from.
//!
//! # Tenants
//!
//! A block is identified by its key bytes alone: requests asking for the
//! same bytes share one probe and its verdict. To keep tenants apart, salt
//! each tenant's block hashes (vLLM's `cache_salt`), or give each tenant its
//! own tier instance (its own key prefix or directory) and its own manager.
//! See [`ReqContext`].
//!
//! # Runtimes
//!
//! Tier calls run on a tokio runtime chosen with a [`Spawner`]:
//!
//! - [`AsyncLookupManager::new`] starts a runtime of its own, on one thread
//!   (`worker_threads` in [`ManagerConfig`]), as the simplest choice for a
//!   synchronous scheduler.
//! - [`Spawner::dedicated`] starts one runtime that many managers share:
//!   [`TierStack::with_spawner`] and [`TierStack::add`] run a whole stack on
//!   one thread. It stops in the background when its last user drops.
//! - [`Spawner::from_handle`] runs the workers on the caller's runtime,
//!   starting no thread. A current-thread runtime runs them only while it is
//!   driven (see [`Spawner`]); a runtime that shuts down under a manager
//!   turns its calls into counted errors, never keys pending forever.
//!
//! [`AsyncLookupManager::shutdown`] blocks (bounded) for a synchronous
//! scheduler; [`AsyncLookupManager::shutdown_async`] awaits instead.
//! Dropping a manager never blocks: its running calls are aborted.
//!
//! # Example
//!
//! ```
//! use kvtier_core::{AsyncLookupManager, ManagerConfig, OffloadKey, PrefixVerdict, ReqContext,
//!                   Tier, TierError};
//!
//! // A tier: one method, one bool per key, in order.
//! struct Evens;
//! impl Tier for Evens {
//!     async fn batch_lookup(&self, keys: &[OffloadKey], _: &ReqContext)
//!         -> Result<Vec<bool>, TierError> {
//!         Ok(keys.iter().map(|k| k.as_bytes()[0] % 2 == 0).collect())
//!     }
//! }
//!
//! let mut manager = AsyncLookupManager::new(Evens, ManagerConfig::named("evens"))?;
//! let ctx = ReqContext::new("req-1");
//! let prompt: Vec<OffloadKey> = [[0u8; 36], [2; 36], [3; 36], [4; 36]]
//!     .iter().map(|k| OffloadKey::new(k)).collect();
//!
//! // The scheduler loop: look up, flush at the end of the step, repeat.
//! let hits = loop {
//!     match manager.lookup_prefix(&prompt, &ctx)? {
//!         PrefixVerdict::Ready(n) => break n,
//!         PrefixVerdict::Pending => {
//!             manager.flush();
//!             std::thread::sleep(std::time::Duration::from_millis(1));
//!         }
//!     }
//! };
//! assert_eq!(hits, 2); // [0], [2] exist; [3] does not, which ends the prefix
//! manager.cleanup("req-1");
//! manager.shutdown();
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Metrics
//!
//! Every manager publishes its counters (lookups, hits, misses, errors,
//! timeouts, deferred and forced misses, tier calls), gauges (calls in
//! flight, tracked and queued keys) and histograms (time to verdict, tier
//! call duration, keys per call) through the [`metrics`](::metrics) facade,
//! labelled `tier`, to whatever exporter the program installs before it
//! builds its managers. The [`metrics` module](crate::metrics) lists the
//! names. None of this runs on the lookup path, and
//! [`AsyncLookupManager::stats`] is unchanged.
//!
//! # Crate features
//!
//! - `testkit`: adds the `testkit` module, the conformance suite every tier
//!   crate runs, and `FaultTier`, an in-memory tier that injects latency,
//!   failures, hangs and panics, for tests of code built on the manager.

#![deny(missing_docs)]
#![warn(clippy::unwrap_used)]

mod config;
mod error;
mod key;
pub mod ledger;
mod manager;
pub mod metrics;
mod redact;
mod runtime;
mod stack;
mod stats;
mod store;
mod task;
mod tier;
pub mod transfer;
mod verdict;
mod worker;

#[cfg(feature = "testkit")]
pub mod testkit;

pub use config::ManagerConfig;
pub use error::{LookupError, ManagerError, TierError, TierErrorKind, one_line};
pub use key::{BuildPrehashed, INLINE_KEY_CAPACITY, OffloadKey, PrehashedHasher, ReqContext};
pub use manager::{AsyncLookupManager, ResultsNotifier, ShutdownReport};
pub use redact::redact_url;
pub use runtime::Spawner;
pub use stack::{DynLookupManager, StackPolicy, StackVerdict, TierStack};
pub use stats::{LatencySummary, ManagerStats};
pub use store::{BlockOutcome, BlockStore, DynBlockStore, LengthMismatch, SharedTierError};
pub use task::AbortOnDrop;
pub use tier::{Blocking, BoxFuture, DynTier, SyncTier, Tier};
pub use transfer::{
    DrainReport, HostAllocError, HostBuffer, HostMemory, JobId, JobKind, JobReport, Region,
    SubmitError, TransferConfig, TransferJob, TransferQueue, TransferStatus,
};
pub use verdict::{LookupVerdict, PrefixVerdict};
pub use worker::{WakeHook, current_call};
