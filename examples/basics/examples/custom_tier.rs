//! How to plug your own backend into kvtier: implement one method.
//!
//! Two tiers here: an async one (what a network client looks like), which
//! also implements `BlockStore` (store, load, remove), and a synchronous one (an in-process index or a blocking client), wrapped in
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

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, RwLock, RwLockReadGuard, RwLockWriteGuard};
use std::time::Duration;

use kvtier_core::testkit::{self, Fixture};
use kvtier_core::{
    AsyncLookupManager, BlockStore, Blocking, ManagerConfig, OffloadKey, ReqContext, StackVerdict,
    SyncTier, Tier, TierError, TierErrorKind, TierStack,
};

/// An async tier: say, a key-value service reached over the network.
#[derive(Default)]
struct RemoteIndex {
    blocks: RwLock<HashMap<OffloadKey, Vec<u8>>>,
}

impl RemoteIndex {
    fn read(&self) -> Result<RwLockReadGuard<'_, HashMap<OffloadKey, Vec<u8>>>, TierError> {
        self.blocks
            .read()
            .map_err(|_| TierError::new(TierErrorKind::Other, "remote index lock poisoned"))
    }

    fn write(&self) -> Result<RwLockWriteGuard<'_, HashMap<OffloadKey, Vec<u8>>>, TierError> {
        self.blocks
            .write()
            .map_err(|_| TierError::new(TierErrorKind::Other, "remote index lock poisoned"))
    }
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
        let held = self.read()?;
        Ok(keys.iter().map(|k| held.contains_key(k)).collect())
    }
}

/// The write side, one interface for every tier: what the engine's offload
/// and load paths call, and what the conformance suite writes through.
/// The batched forms (`store_many`, ...) have provided defaults; a real
/// client overrides them with one round trip.
impl BlockStore for RemoteIndex {
    async fn store(&self, key: &OffloadKey, block: &[u8]) -> Result<(), TierError> {
        self.write()?.insert(key.clone(), block.to_vec());
        Ok(())
    }

    async fn load(&self, key: &OffloadKey) -> Result<Option<Vec<u8>>, TierError> {
        Ok(self.read()?.get(key).cloned())
    }

    async fn remove(&self, key: &OffloadKey) -> Result<(), TierError> {
        self.write()?.remove(key);
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
    let remote = Arc::new(RemoteIndex::default());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()?;
    // The offload path stores six blocks through `BlockStore`.
    let blocks: Vec<(OffloadKey, Vec<u8>)> = (0..6).map(|i| (block(i), vec![0; 64])).collect();
    rt.block_on(remote.store_many(&blocks))?;

    let mut stack = TierStack::default()
        .with(AsyncLookupManager::new(
            Blocking::new(local),
            ManagerConfig::named("local"),
        )?)
        .with(remote.manager(ManagerConfig::named("remote"))?);

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
    rt.block_on(testkit::run_all(&Fixture::new(remote).with_name("remote")));
    println!("remote: the conformance suite passed");
    Ok(())
}
