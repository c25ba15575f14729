//! An in-memory [`Tier`](kvtier_core::Tier) with fault injection, for tests, examples and
//! benchmarks.
//!
//! [`MockTier`] holds a set of keys and answers `batch_lookup` from it, after
//! an injected latency (fixed plus seeded jitter). It can fail, hang, panic
//! or answer the wrong number of results with configured probabilities, and
//! slow down or fail chosen requests. Every decision comes from a seeded
//! generator indexed by the call number, so a run is reproducible. Every call
//! is recorded, with the answer it gave (the truth at probe time), for
//! assertions.
//!
//! The implementation is `kvtier_core::testkit::FaultTier` (the core's own
//! tests use it without depending on a tier crate); this crate gives it its
//! tier name for programs, examples and benchmarks. It also implements
//! [`BlockStore`](kvtier_core::BlockStore), in memory.
//!
//! ```
//! use kvtier_core::{AsyncLookupManager, LookupVerdict, ManagerConfig, OffloadKey, ReqContext};
//! use std::sync::Arc;
//! use kvtier_mock::{MockConfig, MockTier};
//!
//! let tier = Arc::new(MockTier::new(MockConfig::default()));
//! let key = OffloadKey::new(&[1; 36]);
//! tier.insert([key.clone()]);
//!
//! let mut manager = AsyncLookupManager::from_arc(Arc::clone(&tier), ManagerConfig::named("mock"))?;
//! let ctx = ReqContext::new("r1");
//! assert_eq!(manager.lookup(&key, &ctx)?, LookupVerdict::Pending);
//! manager.flush();
//! while manager.lookup(&key, &ctx)? == LookupVerdict::Pending {
//!     std::thread::sleep(std::time::Duration::from_millis(1));
//! }
//! assert_eq!(manager.lookup(&key, &ctx)?, LookupVerdict::Hit);
//! assert_eq!(tier.calls().len(), 1);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![deny(missing_docs)]

pub use kvtier_core::testkit::{
    CallRecord, FaultConfig as MockConfig, FaultOutcome as MockOutcome, FaultTier as MockTier,
    RequestFault,
};
