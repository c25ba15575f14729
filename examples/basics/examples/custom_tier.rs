//! How to plug your own backend into kvtier: implement one method.
//!
//! Two tiers here: an async one (what a network client looks like) and a
//! synchronous one (an in-process index or a blocking client), wrapped in
//! `Blocking` so it runs on the worker's blocking pool. Both go into one
//! `TierStack`, which tells, per leading block, which tier to load from.
//! At the end the async tier goes through `kvtier_core::testkit`, the
//! conformance suite every kvtier tier passes: put that call in a test of
//! your own tier's crate (`lookup-core` with the `testkit` feature as a
//! dev-dependency).
//!
//! ```text
//! cargo run --example custom_tier
//! ```

#![warn(clippy::unwrap_used)]

use std::collections::HashSet;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use kvtier_core::testkit::{self, TierFixture};
use kvtier_core::{
    AsyncLookupManager, Blocking, ManagerConfig, OffloadKey, ReqContext, StackVerdict, SyncTier,
    Tier, TierError, TierErrorKind, TierStack,
};

/// An async tier: say, a key-value service reached over the network.
struct RemoteIndex {
    keys: RwLock<HashSet<OffloadKey>>,
}

impl Tier for RemoteIndex {
    /// The contract: one bool per key, in order; an absent key is `false`;
    /// an error only when the tier cannot tell.
    async fn batch_lookup(
        &self,
        keys: &[OffloadKey],
        _ctx: &ReqContext,
    ) -> Result<Vec<bool>, TierError> {
        // A real client would send one batched request here. It answers from
        // the keys alone: the manager shares one answer among every request
        // asking for the same key, so a multi-tenant backend keeps tenants
        // apart by their keys (a salted block hash) or by a tier instance
        // per tenant, never by the request.
        tokio::time::sleep(Duration::from_millis(2)).await;
        let keys_held = self
            .keys
            .read()
            .map_err(|_| TierError::new(TierErrorKind::Other, "remote index lock poisoned"))?;
        Ok(keys.iter().map(|k| keys_held.contains(k)).collect())
    }
}

/// What the conformance suite needs: the tier, and a way to put keys in
/// and take them out (your tier's own store and remove).
struct RemoteFixture(Arc<RemoteIndex>);

impl RemoteIndex {
    fn write(&self) -> Result<std::sync::RwLockWriteGuard<'_, HashSet<OffloadKey>>, TierError> {
        self.keys
            .write()
            .map_err(|_| TierError::new(TierErrorKind::Other, "remote index lock poisoned"))
    }
}

impl TierFixture for RemoteFixture {
    type Tier = RemoteIndex;

    fn tier(&self) -> Arc<RemoteIndex> {
        Arc::clone(&self.0)
    }

    async fn insert(&self, keys: &[OffloadKey]) -> Result<(), TierError> {
        self.0.write()?.extend(keys.iter().cloned());
        Ok(())
    }

    async fn remove(&self, keys: &[OffloadKey]) -> Result<(), TierError> {
        let mut held = self.0.write()?;
        for key in keys {
            held.remove(key);
        }
        Ok(())
    }
}

/// A synchronous tier: say, a local index behind a blocking API.
struct LocalIndex {
    keys: HashSet<OffloadKey>,
}

impl SyncTier for LocalIndex {
    fn batch_lookup_blocking(
        &self,
        keys: &[OffloadKey],
        _ctx: &ReqContext,
    ) -> Result<Vec<bool>, TierError> {
        Ok(keys.iter().map(|k| self.keys.contains(k)).collect())
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let block = |i: u32| OffloadKey::from_block_hash(&[0x42; 32], i);
    let local = LocalIndex {
        keys: (0..3).map(block).collect(),
    };
    let remote = Arc::new(RemoteIndex {
        keys: RwLock::new((0..6).map(block).collect()),
    });

    let mut stack = TierStack::default()
        .with(AsyncLookupManager::new(
            Blocking::new(local),
            ManagerConfig::named("local"),
        )?)
        .with(AsyncLookupManager::from_arc(
            Arc::clone(&remote),
            ManagerConfig::named("remote"),
        )?);

    let prompt: Vec<OffloadKey> = (0..8).map(block).collect();
    let ctx = ReqContext::new("request-1");
    let locations = loop {
        match stack.lookup_prefix(&prompt, &ctx)? {
            StackVerdict::Ready { locations } => break locations,
            StackVerdict::Pending => {
                stack.flush();
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    };
    let names = stack.tier_names();
    for (i, t) in locations.iter().enumerate() {
        println!("block {i}: load from {}", names[*t]);
    }
    println!("{} of {} blocks cached", locations.len(), prompt.len());
    assert_eq!(locations, [0, 0, 0, 1, 1, 1]);

    stack.cleanup(ctx.req_id());
    for stats in stack.stats() {
        println!(
            "{}: {} calls, {} hits, {} misses",
            stats.tier, stats.calls_finished, stats.hits, stats.misses
        );
    }
    stack.shutdown();

    // The conformance suite: key order, duplicates, removals, large and
    // concurrent batches, and the tier behind a real manager. It panics
    // with the failed rule's name, as a test should.
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()?
        .block_on(testkit::run_all(&RemoteFixture(remote)));
    println!("remote: the conformance suite passed");
    Ok(())
}
