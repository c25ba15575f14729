//! The shortest correct use of one manager: paste this into your scheduler.
//!
//! ```text
//! cargo run --example minimal
//! ```

#![warn(clippy::unwrap_used)]

use std::sync::Arc;
use std::time::Duration;

use kvtier_core::{AsyncLookupManager, ManagerConfig, OffloadKey, PrefixVerdict, ReqContext};
use kvtier_mock::{MockConfig, MockTier};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // Any `Tier` works here: the disk, Redis or S3 tier, or your own.
    let tier = Arc::new(MockTier::new(MockConfig::with_latency(
        Duration::from_millis(2),
    )));
    let prompt: Vec<OffloadKey> = (0u32..8)
        .map(|i| OffloadKey::from_block_hash(&[7; 32], i))
        .collect();
    tier.insert(prompt[..5].iter().cloned()); // the first 5 blocks were offloaded earlier

    // One manager per tier, owned by the scheduler thread.
    let mut manager = AsyncLookupManager::from_arc(tier, ManagerConfig::named("mock"))?;
    let request = ReqContext::new("request-1");

    // The scheduler loop: never blocks on the tier.
    let mut step = 0;
    let cached = loop {
        step += 1;
        match manager.lookup_prefix(&prompt, &request)? {
            PrefixVerdict::Ready(blocks) => break blocks,
            PrefixVerdict::Pending => {} // keep the request waiting this step
        }
        manager.flush(); // once per step, after every lookup of the step
        std::thread::sleep(Duration::from_millis(1)); // the model runs here
    };
    println!(
        "request-1: {cached} of {} blocks cached (answered at step {step})",
        prompt.len()
    );

    manager.cleanup(request.req_id()); // when the request finishes
    let stats = manager.stats();
    println!(
        "tier calls: {}, hits: {}, misses: {}",
        stats.calls_finished, stats.hits, stats.misses
    );
    manager.shutdown(); // bounded, even if the tier hangs; Drop does it too
    assert_eq!(cached, 5);
    Ok(())
}
