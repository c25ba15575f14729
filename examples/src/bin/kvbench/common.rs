//! What several workloads share: the quiet mock tier, resolving keys,
//! rounding and ratios, and the two ways of driving a step (back to back,
//! polled).

use std::sync::Arc;
use std::time::{Duration, Instant};

use examples::{micros, percentile};
use kvtier_core::{AsyncLookupManager, LookupVerdict, OffloadKey, ReqContext};
use kvtier_mock::{MockConfig, MockTier};

use crate::Failure;

pub(crate) fn quiet_mock() -> Arc<MockTier> {
    Arc::new(MockTier::new(MockConfig {
        record_calls: false,
        ..MockConfig::default()
    }))
}

/// Looks up every key until none is pending.
pub(crate) fn resolve_all<T: kvtier_core::Tier>(
    m: &mut AsyncLookupManager<T>,
    keys: &[OffloadKey],
    ctx: &ReqContext,
) -> Result<(), Failure> {
    let start = Instant::now();
    loop {
        let mut pending = 0;
        for k in keys {
            if m.lookup(k, ctx)? == LookupVerdict::Pending {
                pending += 1;
            }
        }
        if pending == 0 {
            return Ok(());
        }
        if start.elapsed() > Duration::from_secs(60) {
            return Err(format!("{pending} keys still pending after 60 s").into());
        }
        m.flush();
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// The manager's time to verdict (from each key's flush to its verdict
/// being applied) and its three parts: queueing (flush to the tier call's
/// start: the hand-off to the worker, its wake-up, a free call slot), the
/// round trip (the tier call) and publication (the call's end to the
/// verdict being applied: the result's trip back and the scheduler's next
/// poll). Each part's percentiles are its own; they need not add up.
pub(crate) fn ttv_split(stats: &kvtier_core::ManagerStats) -> serde_json::Value {
    let part = |s: kvtier_core::LatencySummary| {
        serde_json::json!({ "count": s.count, "p50_us": s.p50_us, "p99_us": s.p99_us,
                            "max_us": s.max_us, "mean_us": round3(s.mean_us) })
    };
    serde_json::json!({
        "total": part(stats.time_to_verdict),
        "queueing": part(stats.verdict_queueing),
        "round_trip": part(stats.verdict_round_trip),
        "publication": part(stats.verdict_publication),
    })
}

pub(crate) fn round3(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

/// The median of `ours[i] / baseline[i]`: each round's rate against the
/// baseline measured right after it, so drifts of the machine between rounds
/// cancel out.
pub(crate) fn paired_ratio(ours: &[f64], baseline: &[f64]) -> f64 {
    let ratios: Vec<f64> = ours.iter().zip(baseline).map(|(a, b)| a / b).collect();
    percentile(&ratios, 0.5)
}

/// One step of the redis or s3 workload: its request, its keys, and which of them exist.
pub(crate) type Step = (ReqContext, Vec<OffloadKey>, Vec<bool>);

/// A wake hook that unparks the calling thread: a scheduler with nothing to
/// do sleeps until the manager publishes a result, instead of spinning.
pub(crate) fn unpark_me() -> impl Fn() + Send + Sync + 'static {
    let me = std::thread::current();
    move || me.unpark()
}

/// Issues every step at once (lookups, then a flush per step), waits until
/// nothing is queued or in flight (parked until the manager's wake hook, see
/// [`unpark_me`], or 1 ms), then checks every verdict against the truth and
/// cleans up. Returns keys/s and the number of wrong verdicts.
pub(crate) fn back_to_back<T: kvtier_core::Tier>(
    m: &mut AsyncLookupManager<T>,
    steps: &[Step],
    limit: Duration,
) -> Result<(f64, u64), Failure> {
    back_to_back_then(m, steps, limit, || {})
}

/// [`back_to_back`], calling `timed_end` as the timed part ends (before the
/// verdicts are checked and the steps cleaned up): where a caller samples
/// what the timed part alone cost.
pub(crate) fn back_to_back_then<T: kvtier_core::Tier>(
    m: &mut AsyncLookupManager<T>,
    steps: &[Step],
    limit: Duration,
    timed_end: impl FnOnce(),
) -> Result<(f64, u64), Failure> {
    let t = Instant::now();
    for (ctx, keys, _) in steps {
        for k in keys {
            m.lookup(k, ctx)?;
        }
        m.flush();
    }
    loop {
        m.drain_results();
        if !m.has_pending_calls() {
            break;
        }
        if t.elapsed() > limit {
            return Err(
                format!("steps issued back to back did not finish within {limit:?}").into(),
            );
        }
        std::thread::park_timeout(Duration::from_millis(1));
    }
    let keys: usize = steps.iter().map(|s| s.1.len()).sum();
    let keys_per_s = keys as f64 / t.elapsed().as_secs_f64();
    timed_end();
    let mut verdict_errors = 0;
    for (ctx, keys, truth) in steps {
        for (k, &present) in keys.iter().zip(truth) {
            if (m.lookup(k, ctx)? == LookupVerdict::Hit) != present {
                verdict_errors += 1;
            }
        }
        m.cleanup(ctx.req_id());
    }
    Ok((keys_per_s, verdict_errors))
}

/// Runs steps one at a time: lookups, flush, then polls every 0.1 ms until
/// every key has a verdict. Returns each key's time to verdict (µs, from the
/// flush) and the number of wrong verdicts.
pub(crate) fn polled<T: kvtier_core::Tier>(
    m: &mut AsyncLookupManager<T>,
    steps: Vec<Step>,
    limit: Duration,
) -> Result<(Vec<f64>, u64), Failure> {
    let mut sleeps = Vec::new();
    polled_with_sleeps(m, steps, limit, &mut sleeps)
}

/// [`polled`], also pushing onto `sleeps` how long each 0.1 ms sleep between
/// polls really took (µs): on a busy machine the scheduler's own wake-ups
/// are part of the time to verdict.
pub(crate) fn polled_with_sleeps<T: kvtier_core::Tier>(
    m: &mut AsyncLookupManager<T>,
    steps: Vec<Step>,
    limit: Duration,
    sleeps: &mut Vec<f64>,
) -> Result<(Vec<f64>, u64), Failure> {
    let mut ttv = Vec::new();
    let mut verdict_errors = 0;
    for (ctx, keys, truth) in steps {
        for k in &keys {
            m.lookup(k, &ctx)?;
        }
        let flushed = Instant::now();
        m.flush();
        let mut pending: Vec<usize> = (0..keys.len()).collect();
        while !pending.is_empty() {
            let slept = Instant::now();
            std::thread::sleep(Duration::from_micros(100));
            let now = Instant::now();
            sleeps.push(micros(now - slept));
            let mut still = Vec::with_capacity(pending.len());
            for i in pending {
                match m.lookup(&keys[i], &ctx)? {
                    LookupVerdict::Pending => still.push(i),
                    v => {
                        ttv.push(micros(now - flushed));
                        if (v == LookupVerdict::Hit) != truth[i] {
                            verdict_errors += 1;
                        }
                    }
                }
            }
            pending = still;
            if flushed.elapsed() > limit {
                return Err(format!("a step did not resolve within {limit:?}").into());
            }
        }
        m.cleanup(ctx.req_id());
    }
    Ok((ttv, verdict_errors))
}
