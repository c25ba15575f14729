//! kvtier's first examples, in a package of their own so that they build in
//! seconds (the core, the mock tier and tokio; no Redis client, no AWS SDK):
//!
//! ```text
//! cargo run --example minimal       # one manager over one tier: the scheduler loop
//! cargo run --example custom_tier   # your own tiers in a TierStack, and their conformance run
//! ```
//!
//! The library itself is empty; the examples are in `examples/`.
