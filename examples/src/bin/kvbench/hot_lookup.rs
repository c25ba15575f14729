//! `hot-lookup` (alias `w1`; JSON `"workload": "w1"`), the hot path:
//! lookups of resolved keys next to a bare `HashMap`.

use std::collections::HashMap;
use std::hint::black_box;
use std::sync::Arc;
use std::time::Instant;

use examples::{Rng, key_from_id, percentile};
use kvtier_core::{AsyncLookupManager, LookupVerdict, ManagerConfig, OffloadKey, ReqContext, Tier};
use serde_json::{Value, json};

use crate::common::{paired_ratio, quiet_mock, resolve_all, round3};
use crate::{Cli, Failure};

/// hot-lookup: 100k resolved keys, 1M lookups in a precomputed random order, next to
/// a bare HashMap::get over the same keys in the same order.
pub(crate) fn hot_lookup(cli: &Cli) -> Result<Value, Failure> {
    let n_keys: usize = 100_000;
    let n_lookups: usize = if cli.quick { 100_000 } else { 1_000_000 };
    let keys: Vec<OffloadKey> = (0..n_keys as u64).map(|i| key_from_id(i, 36)).collect();
    let tier = quiet_mock();
    tier.insert(keys.iter().step_by(2).cloned());
    let mut m = AsyncLookupManager::from_arc(
        Arc::clone(&tier),
        ManagerConfig {
            max_queued_keys: n_keys * 2,
            ..ManagerConfig::named("mock")
        },
    )?;
    let ctx = ReqContext::new("w1");
    resolve_all(&mut m, &keys, &ctx)?;

    let mut rng = Rng::new(cli.seed);
    let order: Vec<usize> = (0..n_lookups)
        .map(|_| rng.below(n_keys as u64) as usize)
        .collect();
    // The manager's own key maps pass the key's precomputed hash through.
    let fast: HashMap<OffloadKey, bool, kvtier_core::BuildPrehashed> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| (k.clone(), i % 2 == 0))
        .collect();
    let std_map: HashMap<OffloadKey, bool> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| (k.clone(), i % 2 == 0))
        .collect();

    // Interleave the three measurements, five rounds, and keep each one's median.
    let (mut ours, mut base, mut base_std) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..5 {
        ours.push(time_manager(&mut m, &keys, &order, &ctx)?);

        base.push(time_map(&fast, &keys, &order));
        base_std.push(time_map(&std_map, &keys, &order));
    }
    // The ratios are the medians of the rounds' paired ratios: the machine's
    // drift between rounds cancels out.
    let ratio = paired_ratio(&ours, &base);
    let ratio_std = paired_ratio(&ours, &base_std);
    let ns = percentile(&ours, 0.5);
    let baseline = percentile(&base, 0.5);
    let baseline_std = percentile(&base_std, 0.5);
    m.shutdown();
    Ok(json!({
        "workload": "w1",
        "tier": "mock",
        "params": { "keys": n_keys, "lookups": n_lookups, "key_len": 36, "requests": 1, "rounds": 5,
                    "baseline": "HashMap<OffloadKey, bool> with the manager's prehashed hasher" },
        "ns_per_lookup": round3(ns),
        "baseline_ns_per_lookup": round3(baseline),
        "ratio": round3(ratio),
        "baseline_std_hasher_ns_per_lookup": round3(baseline_std),
        "ratio_std_hasher": round3(ratio_std),
    }))
}

/// Nanoseconds per `lookup` of `keys[i]` for each `i` in `order`: the
/// manager's side, a function of its own like the baseline's (so
/// `valgrind --tool=callgrind --toggle-collect='*time_*'` counts each side's
/// instructions).
#[inline(never)]
fn time_manager<T: Tier>(
    m: &mut AsyncLookupManager<T>,
    keys: &[OffloadKey],
    order: &[usize],
    ctx: &ReqContext,
) -> Result<f64, Failure> {
    let t = Instant::now();
    let mut hits = 0usize;
    for &i in order {
        if m.lookup(black_box(&keys[i]), ctx)? == LookupVerdict::Hit {
            hits += 1;
        }
    }
    let ns = t.elapsed().as_nanos() as f64 / order.len() as f64;
    black_box(hits);
    Ok(ns)
}

/// Nanoseconds per `get` of `keys[i]` for each `i` in `order`: the
/// baseline, monomorphised for each map (no dynamic call in its loop).
#[inline(never)]
fn time_map<S: std::hash::BuildHasher>(
    map: &HashMap<OffloadKey, bool, S>,
    keys: &[OffloadKey],
    order: &[usize],
) -> f64 {
    let t = Instant::now();
    let mut hits = 0usize;
    for &i in order {
        if map.get(black_box(&keys[i])).copied().unwrap_or(false) {
            hits += 1;
        }
    }
    let ns = t.elapsed().as_nanos() as f64 / order.len() as f64;
    black_box(hits);
    ns
}
