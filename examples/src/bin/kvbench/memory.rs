//! `memory` (alias `mem`; JSON `"workload": "mem"`): the manager's live
//! heap bytes per tracked key.

use std::sync::Arc;

use examples::key_from_id;
use kvtier_core::{AsyncLookupManager, ManagerConfig, OffloadKey, ReqContext};
use serde_json::{Value, json};

use crate::common::{quiet_mock, resolve_all, round3};
use crate::{ALLOC, Cli, Failure};

/// Memory: live heap bytes of the manager per tracked key, 1,000 requests of
/// 100 distinct resolved keys each, measured with a counting allocator.
pub(crate) fn memory(cli: &Cli) -> Result<Value, Failure> {
    let (requests, per_request) = if cli.quick { (100, 100) } else { (1000, 100) };
    let tier = quiet_mock();
    let contexts: Vec<ReqContext> = (0..requests)
        .map(|r| ReqContext::new(format!("mem-{r}")))
        .collect();
    let prompts: Vec<Vec<OffloadKey>> = (0..requests)
        .map(|r| {
            (0..per_request)
                .map(|i| key_from_id((r * per_request + i) as u64, 36))
                .collect()
        })
        .collect();
    tier.insert(prompts.iter().flatten().step_by(2).cloned());
    let mut m = AsyncLookupManager::from_arc(
        Arc::clone(&tier),
        ManagerConfig {
            max_queued_keys: requests * per_request * 2,
            ..ManagerConfig::named("mock")
        },
    )?;
    // Warm the worker and the histograms so their one-off allocations are not counted.
    let warm = ReqContext::new("warm");
    resolve_all(&mut m, &[key_from_id(u64::MAX, 36)], &warm)?;
    m.cleanup("warm");
    m.drain_results();

    ALLOC.set_enabled(true);
    let before = ALLOC.live_bytes();
    for (ctx, prompt) in contexts.iter().zip(&prompts) {
        for k in prompt {
            m.lookup(k, ctx)?;
        }
    }
    m.flush();
    for (ctx, prompt) in contexts.iter().zip(&prompts) {
        resolve_all(&mut m, prompt, ctx)?;
    }
    let tracked = m.stats().tracked_keys;
    let after = ALLOC.live_bytes();
    ALLOC.set_enabled(false);
    for ctx in &contexts {
        m.cleanup(ctx.req_id());
    }
    let per_key = (after - before) as f64 / tracked.max(1) as f64;
    m.shutdown();
    Ok(json!({
        "workload": "mem",
        "tier": "mock",
        "params": { "requests": requests, "keys_per_request": per_request, "key_len": 36,
                    "state": "resolved, one request per key" },
        "tracked_keys": tracked,
        "bytes_per_tracked_key": round3(per_key),
        "baseline_bytes_per_key": std::mem::size_of::<(OffloadKey, bool)>(),
    }))
}
