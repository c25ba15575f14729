//! The manager end to end, on the real worker, against the fault-injecting tier of `testkit`: each
//! behaviour of the reference design, and each defect of the reference that
//! ours must not have. No test asserts a speed; time limits here only stop a
//! broken build from hanging.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kvtier_core::testkit::{FaultConfig, FaultOutcome, FaultTier, RequestFault};
use kvtier_core::{
    AsyncLookupManager, Blocking, LookupError, LookupVerdict, ManagerConfig, ManagerError,
    OffloadKey, PrefixVerdict, ReqContext, SyncTier, Tier, TierError,
};

const GUARD: Duration = Duration::from_secs(20);

fn key(i: u32) -> OffloadKey {
    OffloadKey::from_block_hash(&[0x5a; 32], i)
}

fn keys(range: std::ops::Range<u32>) -> Vec<OffloadKey> {
    range.map(key).collect()
}

fn config() -> ManagerConfig {
    ManagerConfig {
        failure_backoff_ms: 50,
        ..ManagerConfig::named("mock")
    }
}

fn manager(tier: &Arc<FaultTier>, cfg: ManagerConfig) -> AsyncLookupManager<Arc<FaultTier>> {
    AsyncLookupManager::new(Arc::clone(tier), cfg).expect("manager starts")
}

/// Looks `key` up (without flushing) until it has a verdict.
fn wait_verdict<T: Tier>(
    m: &mut AsyncLookupManager<T>,
    key: &OffloadKey,
    ctx: &ReqContext,
) -> LookupVerdict {
    let start = Instant::now();
    loop {
        match m.lookup(key, ctx).expect("valid key") {
            LookupVerdict::Pending => {
                assert!(start.elapsed() < GUARD, "no verdict for {key:?}");
                m.drain_results();
                std::thread::sleep(Duration::from_millis(1));
            }
            v => return v,
        }
    }
}

fn wait_until(mut cond: impl FnMut() -> bool, what: &str) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < GUARD, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn resolve_prefix<T: Tier>(
    m: &mut AsyncLookupManager<T>,
    prompt: &[OffloadKey],
    ctx: &ReqContext,
) -> usize {
    let start = Instant::now();
    loop {
        match m.lookup_prefix(prompt, ctx).expect("valid keys") {
            PrefixVerdict::Ready(n) => return n,
            PrefixVerdict::Pending => {
                assert!(start.elapsed() < GUARD, "prefix never resolved");
                m.flush();
                std::thread::sleep(Duration::from_millis(1));
            }
        }
    }
}

#[test]
fn a_key_shared_by_requests_is_probed_once() {
    let tier = Arc::new(FaultTier::default());
    tier.insert([key(1)]);
    let mut m = manager(&tier, config());
    let (a, b) = (ReqContext::new("a"), ReqContext::new("b"));
    assert_eq!(m.lookup(&key(1), &a), Ok(LookupVerdict::Pending));
    assert_eq!(m.lookup(&key(1), &b), Ok(LookupVerdict::Pending));
    m.flush();
    assert_eq!(wait_verdict(&mut m, &key(1), &a), LookupVerdict::Hit);
    assert_eq!(wait_verdict(&mut m, &key(1), &b), LookupVerdict::Hit);
    let calls = tier.calls();
    assert_eq!(calls.len(), 1);
    assert_eq!(calls[0].keys, vec![key(1)]);
    assert_eq!(
        calls[0].req_id, "a",
        "probed with the context of the first asker"
    );
}

#[test]
fn keys_are_grouped_into_one_call_per_request() {
    let tier = Arc::new(FaultTier::default());
    let mut m = manager(&tier, config());
    let (a, b) = (ReqContext::new("a"), ReqContext::new("b"));
    for i in 0..3 {
        m.lookup(&key(i), &a).unwrap();
        m.lookup(&key(10 + i), &b).unwrap();
    }
    m.flush();
    wait_until(
        || tier.calls().iter().all(|c| c.finished.is_some()) && tier.calls().len() == 2,
        "two calls",
    );
    let mut calls = tier.calls();
    calls.sort_by(|x, y| x.req_id.cmp(&y.req_id));
    assert_eq!(calls[0].req_id, "a");
    assert_eq!(calls[0].keys, keys(0..3));
    assert_eq!(calls[1].req_id, "b");
    assert_eq!(calls[1].keys, keys(10..13));
}

#[test]
fn a_key_is_enqueued_once_however_often_it_is_asked() {
    let tier = Arc::new(FaultTier::new(FaultConfig::with_latency(
        Duration::from_millis(20),
    )));
    let mut m = manager(&tier, config());
    let ctx = ReqContext::new("a");
    for _ in 0..5 {
        for k in keys(0..4) {
            m.lookup(&k, &ctx).unwrap();
        }
        m.flush();
    }
    for k in keys(0..4) {
        assert_eq!(wait_verdict(&mut m, &k, &ctx), LookupVerdict::Miss);
    }
    let probed: Vec<OffloadKey> = tier.calls().into_iter().flat_map(|c| c.keys).collect();
    assert_eq!(probed.len(), 4, "each key probed once: {probed:?}");
}

#[test]
fn an_in_flight_probe_outlives_cleanup_and_is_shared_by_a_new_request() {
    let tier = Arc::new(FaultTier::new(FaultConfig::with_latency(
        Duration::from_millis(50),
    )));
    tier.insert([key(1)]);
    let mut m = manager(&tier, config());
    m.lookup(&key(1), &ReqContext::new("first")).unwrap();
    m.flush();
    wait_until(|| tier.in_flight() == 1, "the probe to start");
    m.cleanup("first");
    assert_eq!(
        m.stats().tracked_keys,
        1,
        "in-flight key retained after cleanup"
    );
    let second = ReqContext::new("second");
    assert_eq!(m.lookup(&key(1), &second), Ok(LookupVerdict::Pending));
    m.flush();
    assert_eq!(wait_verdict(&mut m, &key(1), &second), LookupVerdict::Hit);
    assert_eq!(
        tier.call_count(),
        1,
        "the new request shared the running probe"
    );
    m.cleanup("second");
    assert!(m.is_idle());
}

#[test]
fn an_unreferenced_in_flight_key_is_freed_when_its_answer_lands() {
    let tier = Arc::new(FaultTier::new(FaultConfig::with_latency(
        Duration::from_millis(30),
    )));
    let mut m = manager(&tier, config());
    m.lookup(&key(1), &ReqContext::new("a")).unwrap();
    m.flush();
    m.cleanup("a");
    assert!(!m.is_idle());
    wait_until(
        || tier.calls().first().is_some_and(|c| c.finished.is_some()),
        "answer",
    );
    wait_until(
        || {
            m.drain_results();
            m.is_idle()
        },
        "state to empty",
    );
    assert_eq!(m.stats().misses, 1);
}

#[test]
fn a_late_answer_for_an_older_generation_is_dropped() {
    // Request a probes key 1 (slow); after cleanup the key is gone, so a new
    // request creates a new generation. The tier changes in between: the old
    // answer ("absent") must not overwrite the new one ("present").
    let tier = Arc::new(FaultTier::default());
    tier.set_request_fault("a", RequestFault::Delay(Duration::from_millis(150)));
    let mut m = manager(&tier, config());
    m.lookup(&key(1), &ReqContext::new("a")).unwrap();
    m.flush();
    wait_until(|| tier.in_flight() == 1, "the slow probe to start");
    m.mark_miss([&key(1)]); // resolved: cleanup may now forget it
    m.cleanup("a");
    assert!(m.stats().tracked_keys == 0);
    tier.insert([key(1)]);
    let b = ReqContext::new("b");
    m.lookup(&key(1), &b).unwrap();
    m.flush();
    assert_eq!(wait_verdict(&mut m, &key(1), &b), LookupVerdict::Hit);
    wait_until(|| tier.in_flight() == 0, "the slow probe to end");
    wait_until(
        || {
            m.drain_results();
            m.stats().stale_results_dropped == 1
        },
        "the stale answer to be dropped",
    );
    assert_eq!(m.lookup(&key(1), &b), Ok(LookupVerdict::Hit));
}

#[test]
fn mark_miss_forces_a_miss_until_the_key_is_released() {
    let tier = Arc::new(FaultTier::default());
    tier.insert([key(1)]);
    let mut m = manager(&tier, config());
    let ctx = ReqContext::new("a");
    m.lookup(&key(1), &ctx).unwrap();
    m.flush();
    assert_eq!(wait_verdict(&mut m, &key(1), &ctx), LookupVerdict::Hit);
    m.mark_miss([&key(1), &key(99)]); // 99 is unknown: skipped
    assert_eq!(m.lookup(&key(1), &ctx), Ok(LookupVerdict::Miss));
    assert_eq!(m.stats().forced_misses, 1);
    m.cleanup("a");
    // Released: a new lookup probes afresh.
    assert_eq!(m.lookup(&key(1), &ctx), Ok(LookupVerdict::Pending));
}

// Defect 5: mark_miss on an in-flight key must not panic, and a late
// "present" must not overwrite it.
#[test]
fn mark_miss_wins_over_a_late_present_answer() {
    let tier = Arc::new(FaultTier::new(FaultConfig::with_latency(
        Duration::from_millis(40),
    )));
    tier.insert([key(1)]);
    let mut m = manager(&tier, config());
    let ctx = ReqContext::new("a");
    m.lookup(&key(1), &ctx).unwrap();
    m.flush();
    wait_until(|| tier.in_flight() == 1, "probe running");
    m.mark_miss([&key(1)]);
    wait_until(|| tier.in_flight() == 0, "probe done");
    wait_until(
        || {
            m.drain_results();
            m.stats().stale_results_dropped == 1
        },
        "late answer dropped",
    );
    assert_eq!(m.lookup(&key(1), &ctx), Ok(LookupVerdict::Miss));
    assert_eq!(m.stats().hits, 0);
}

// Defect 4: a failure is a counted error, not a cached "absent", and the key
// is probed again after the back-off.
#[test]
fn a_failed_probe_is_an_error_and_is_retried_after_backoff() {
    let tier = Arc::new(FaultTier::new(FaultConfig {
        failure_probability: 1.0,
        ..FaultConfig::default()
    }));
    tier.insert([key(1)]);
    let mut m = manager(&tier, config());
    let ctx = ReqContext::new("a");
    m.lookup(&key(1), &ctx).unwrap();
    m.flush();
    assert_eq!(wait_verdict(&mut m, &key(1), &ctx), LookupVerdict::Miss);
    let stats = m.stats();
    assert_eq!((stats.errors, stats.misses), (1, 0), "{stats:?}");
    let first = stats.first_error.expect("the failure's cause is kept");
    assert!(first.contains("injected"), "{first}");

    tier.set_config(FaultConfig::default()); // the tier recovers
    std::thread::sleep(Duration::from_millis(60)); // past the 50 ms back-off
    // Re-probed in the background: still a miss meanwhile, never pending again.
    assert_eq!(m.lookup(&key(1), &ctx), Ok(LookupVerdict::Miss));
    m.flush();
    let start = Instant::now();
    while m.lookup(&key(1), &ctx) != Ok(LookupVerdict::Hit) {
        assert!(start.elapsed() < GUARD, "the re-probe never landed");
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(tier.call_count(), 2);
    // The first cause stays: a later success does not erase it.
    assert_eq!(m.stats().first_error.as_deref(), Some(first.as_str()));
}

// Defect 1: a short answer resolves every key (as errors) and leaks nothing.
#[test]
fn a_wrong_length_answer_resolves_every_key_as_an_error() {
    let tier = Arc::new(FaultTier::new(FaultConfig {
        wrong_length_probability: 1.0,
        ..FaultConfig::default()
    }));
    tier.insert(keys(0..4));
    let mut m = manager(&tier, config());
    let ctx = ReqContext::new("a");
    for k in keys(0..4) {
        m.lookup(&k, &ctx).unwrap();
    }
    m.flush();
    for k in keys(0..4) {
        assert_eq!(wait_verdict(&mut m, &k, &ctx), LookupVerdict::Miss);
    }
    assert!(matches!(
        tier.calls()[0].outcome,
        FaultOutcome::WrongLength(_)
    ));
    let stats = m.stats();
    assert_eq!((stats.errors, stats.hits, stats.misses), (4, 0, 0));
    let first = stats.first_error.expect("the cause is kept");
    assert!(first.contains("for 4 keys"), "{first}");
    m.cleanup("a");
    assert!(m.is_idle(), "no state leaked");
}

// Defect 2: a panicking tier call neither kills the worker nor loses results.
#[test]
fn a_panicking_tier_call_does_not_stop_the_worker() {
    let tier = Arc::new(FaultTier::new(FaultConfig {
        panic_probability: 1.0,
        ..FaultConfig::default()
    }));
    tier.insert([key(1), key(2)]);
    let mut m = manager(&tier, config());
    let ctx = ReqContext::new("a");
    m.lookup(&key(1), &ctx).unwrap();
    m.flush();
    assert_eq!(wait_verdict(&mut m, &key(1), &ctx), LookupVerdict::Miss);
    assert_eq!(m.stats().errors, 1);
    let cause = m.stats().first_error.unwrap_or_default();
    assert!(cause.contains("panicked"), "{cause}");
    tier.set_config(FaultConfig::default());
    m.lookup(&key(2), &ctx).unwrap();
    m.flush();
    assert_eq!(wait_verdict(&mut m, &key(2), &ctx), LookupVerdict::Hit);
}

// Defect 3: results are seen by any later lookup, with or without a flush.
#[test]
fn results_are_seen_without_another_flush() {
    let tier = Arc::new(FaultTier::new(FaultConfig::with_latency(
        Duration::from_millis(5),
    )));
    tier.insert([key(1)]);
    let mut m = manager(&tier, config());
    let ctx = ReqContext::new("a");
    m.lookup(&key(1), &ctx).unwrap();
    m.flush();
    // Pending on the first lookups after the flush, then the answer lands;
    // no flush and no explicit drain in between.
    let start = Instant::now();
    let verdict = loop {
        match m.lookup(&key(1), &ctx).unwrap() {
            LookupVerdict::Pending => {
                assert!(start.elapsed() < GUARD);
                std::thread::sleep(Duration::from_millis(1));
            }
            v => break v,
        }
    };
    assert_eq!(verdict, LookupVerdict::Hit);
}

// Defect 6: one slow request does not hold back the others of its step.
#[test]
fn each_request_is_published_when_its_own_call_returns() {
    let tier = Arc::new(FaultTier::default());
    tier.insert([key(1), key(2)]);
    tier.set_request_fault("slow", RequestFault::Delay(Duration::from_secs(3)));
    let mut m = manager(
        &tier,
        ManagerConfig {
            call_timeout_ms: 10_000,
            ..config()
        },
    );
    let (slow, fast) = (ReqContext::new("slow"), ReqContext::new("fast"));
    m.lookup(&key(1), &slow).unwrap();
    m.lookup(&key(2), &fast).unwrap();
    m.flush();
    assert_eq!(wait_verdict(&mut m, &key(2), &fast), LookupVerdict::Hit);
    assert_eq!(
        m.lookup(&key(1), &slow),
        Ok(LookupVerdict::Pending),
        "the fast request resolved while the slow one is still running"
    );
}

#[test]
fn a_call_past_its_deadline_resolves_as_timeouts_and_its_late_answer_is_dropped() {
    let tier = Arc::new(FaultTier::default());
    tier.insert([key(1)]);
    tier.set_request_fault("a", RequestFault::Delay(Duration::from_millis(300)));
    let mut m = manager(
        &tier,
        ManagerConfig {
            call_timeout_ms: 50,
            failure_backoff_ms: 60_000,
            ..config()
        },
    );
    let ctx = ReqContext::new("a");
    m.lookup(&key(1), &ctx).unwrap();
    m.flush();
    assert_eq!(wait_verdict(&mut m, &key(1), &ctx), LookupVerdict::Miss);
    let stats = m.stats();
    assert_eq!(
        (stats.timeouts, stats.errors, stats.misses),
        (1, 0, 0),
        "{stats:?}"
    );
    // The tier's call was cancelled by the deadline: it never answered.
    wait_until(|| tier.in_flight() == 0, "the call to be cancelled");
    assert_eq!(tier.calls()[0].outcome, FaultOutcome::Unfinished);
    assert_eq!(
        m.lookup(&key(1), &ctx),
        Ok(LookupVerdict::Miss),
        "still in back-off"
    );
}

// Defect 7: the backlog is bounded, and a slow tier sees coalesced calls.
#[test]
fn the_backlog_is_bounded_and_coalesces_behind_a_slow_tier() {
    let tier = Arc::new(FaultTier::new(FaultConfig::with_latency(
        Duration::from_millis(100),
    )));
    let mut m = manager(
        &tier,
        ManagerConfig {
            max_calls_in_flight: 1,
            max_queued_keys: 100,
            call_timeout_ms: 10_000,
            ..config()
        },
    );
    let ctx = ReqContext::new("a");
    // 20 steps of 10 new keys each, back to back, while one call is running.
    for step in 0..20u32 {
        for k in keys(step * 10..step * 10 + 10) {
            m.lookup(&k, &ctx).unwrap();
        }
        m.flush();
    }
    let stats = m.stats();
    assert!(stats.queued_keys <= 100, "{stats:?}");
    // 200 keys: 10 in the running call, 10 in a call handed to the worker
    // and waiting for the slot, 100 queued, the other 80 deferred.
    assert!(
        stats.deferred >= 80,
        "keys past the bound are deferred: {stats:?}"
    );
    // Everything tracked resolves, in few calls: the waiting steps coalesced.
    wait_until(
        || {
            m.drain_results();
            let s = m.stats();
            s.queued_keys == 0 && s.in_flight_keys == 0
        },
        "the backlog to clear",
    );
    assert!(
        tier.call_count() <= 3,
        "coalesced into few calls, got {}",
        tier.call_count()
    );
    // A deferred key is tracked once there is room.
    assert_eq!(m.lookup(&key(199), &ctx), Ok(LookupVerdict::Pending));
    m.flush();
    assert_eq!(wait_verdict(&mut m, &key(199), &ctx), LookupVerdict::Miss);
}

#[test]
fn at_most_the_configured_number_of_calls_run_at_once() {
    let tier = Arc::new(FaultTier::new(FaultConfig::with_latency(
        Duration::from_millis(20),
    )));
    let mut m = manager(
        &tier,
        ManagerConfig {
            max_calls_in_flight: 3,
            ..config()
        },
    );
    let contexts: Vec<ReqContext> = (0..12).map(|i| ReqContext::new(format!("r{i}"))).collect();
    for (i, ctx) in contexts.iter().enumerate() {
        m.lookup(&key(i as u32), ctx).unwrap();
    }
    m.flush();
    for (i, ctx) in contexts.iter().enumerate() {
        assert_eq!(
            wait_verdict(&mut m, &key(i as u32), ctx),
            LookupVerdict::Miss
        );
    }
    assert_eq!(tier.call_count(), 12);
    assert!(
        tier.max_in_flight() <= 3,
        "max in flight {}",
        tier.max_in_flight()
    );
}

#[test]
fn a_call_waiting_for_a_slot_starts_when_one_frees_without_the_scheduler() {
    let tier = Arc::new(FaultTier::new(FaultConfig::with_latency(
        Duration::from_millis(40),
    )));
    let mut m = manager(
        &tier,
        ManagerConfig {
            max_calls_in_flight: 1,
            ..config()
        },
    );
    let (a, b) = (ReqContext::new("a"), ReqContext::new("b"));
    m.lookup(&key(1), &a).unwrap();
    m.lookup(&key(2), &b).unwrap();
    m.flush();
    // No drain, lookup or flush from here: the scheduler is busy elsewhere.
    // The second call must still start when the first ends.
    let deadline = Instant::now() + Duration::from_secs(5);
    while tier.call_count() < 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(tier.call_count(), 2, "the waiting call never started");
    assert!(tier.max_in_flight() <= 1, "{}", tier.max_in_flight());
    assert_eq!(wait_verdict(&mut m, &key(2), &b), LookupVerdict::Miss);
}

#[test]
fn lookup_prefix_submits_the_whole_prompt_in_one_step() {
    let tier = Arc::new(FaultTier::default());
    tier.insert(keys(0..5));
    let mut m = manager(&tier, config());
    let ctx = ReqContext::new("a");
    let prompt = keys(0..8);
    assert_eq!(m.lookup_prefix(&prompt, &ctx), Ok(PrefixVerdict::Pending));
    m.flush();
    assert_eq!(resolve_prefix(&mut m, &prompt, &ctx), 5);
    assert_eq!(tier.call_count(), 1, "one round trip for the whole prompt");
    assert_eq!(tier.calls()[0].keys, prompt);
    // A resolved miss ends the scan: keys after it are not registered.
    let longer: Vec<OffloadKey> = keys(0..8).into_iter().chain(keys(100..110)).collect();
    assert_eq!(m.lookup_prefix(&longer, &ctx), Ok(PrefixVerdict::Ready(5)));
    assert_eq!(m.stats().queued_keys, 0);
}

#[test]
fn shutdown_applies_answers_that_arrive_during_its_grace() {
    let tier = Arc::new(FaultTier::new(FaultConfig::with_latency(
        Duration::from_millis(30),
    )));
    tier.insert(keys(0..3));
    let mut m = manager(&tier, config());
    let ctx = ReqContext::new("a");
    for k in keys(0..3) {
        m.lookup(&k, &ctx).unwrap();
    }
    m.flush();
    let report = m.shutdown();
    assert!(report.worker_stopped);
    assert_eq!(report.abandoned_calls, 0);
    assert_eq!(m.stats().hits, 3, "drained on shutdown");
}

#[test]
fn shutdown_is_bounded_and_idempotent_when_a_tier_call_hangs() {
    let tier = Arc::new(FaultTier::new(FaultConfig {
        hang_probability: 1.0,
        ..FaultConfig::default()
    }));
    let mut m = manager(
        &tier,
        ManagerConfig {
            shutdown_timeout_ms: 200,
            call_timeout_ms: 60_000,
            ..config()
        },
    );
    let ctx = ReqContext::new("a");
    m.lookup(&key(1), &ctx).unwrap();
    m.flush();
    wait_until(|| tier.in_flight() == 1, "the hung call to start");
    let report = m.shutdown();
    assert!(
        report.worker_stopped,
        "a cancellable hang is abandoned cleanly"
    );
    assert!(report.elapsed < Duration::from_secs(5), "{report:?}");
    assert_eq!(report.abandoned_calls, 1);
    assert_eq!(m.stats().errors, 1);
    assert_eq!(m.shutdown(), report, "idempotent");
    assert_eq!(
        m.lookup(&key(1), &ctx),
        Err(LookupError::ShutDown {
            tier: "mock".into()
        })
    );
    m.flush(); // a no-op
    m.drain_results();
    assert!(
        m.lookup(&key(1), &ctx).is_err(),
        "draining results after shutdown must not let lookups through"
    );
    m.cleanup("a");
    assert!(m.is_idle());
}

/// A tier that blocks its thread inside an async fn (a bug in the tier):
/// the worker cannot even be told to stop.
struct ThreadBlocker;

impl Tier for ThreadBlocker {
    async fn batch_lookup(
        &self,
        keys: &[OffloadKey],
        _: &ReqContext,
    ) -> Result<Vec<bool>, TierError> {
        std::thread::sleep(Duration::from_secs(3));
        Ok(vec![false; keys.len()])
    }
}

#[test]
fn shutdown_returns_even_when_a_tier_blocks_the_worker_thread() {
    let mut m = AsyncLookupManager::new(
        ThreadBlocker,
        ManagerConfig {
            shutdown_timeout_ms: 200,
            call_timeout_ms: 100,
            ..config()
        },
    )
    .unwrap();
    let ctx = ReqContext::new("a");
    m.lookup(&key(1), &ctx).unwrap();
    m.flush();
    std::thread::sleep(Duration::from_millis(150));
    // The worker is stuck, but the scheduler-side deadline still resolves the key.
    m.drain_results();
    assert_eq!(m.lookup(&key(1), &ctx), Ok(LookupVerdict::Miss));
    assert_eq!(m.stats().timeouts, 1);
    let report = m.shutdown();
    assert!(!report.worker_stopped, "the worker was detached");
    assert!(report.elapsed < Duration::from_secs(2), "{report:?}");
}

struct SlowSync;

impl SyncTier for SlowSync {
    fn batch_lookup_blocking(
        &self,
        keys: &[OffloadKey],
        _: &ReqContext,
    ) -> Result<Vec<bool>, TierError> {
        std::thread::sleep(Duration::from_secs(3));
        Ok(vec![true; keys.len()])
    }
}

#[test]
fn a_blocking_sync_tier_neither_stalls_other_calls_nor_shutdown() {
    let mut m = AsyncLookupManager::new(
        Blocking::new(SlowSync),
        ManagerConfig {
            shutdown_timeout_ms: 200,
            call_timeout_ms: 100,
            ..config()
        },
    )
    .unwrap();
    let ctx = ReqContext::new("a");
    m.lookup(&key(1), &ctx).unwrap();
    m.flush();
    assert_eq!(wait_verdict(&mut m, &key(1), &ctx), LookupVerdict::Miss);
    assert_eq!(m.stats().timeouts, 1);
    let report = m.shutdown();
    assert!(
        report.worker_stopped,
        "blocking pool threads are not waited for"
    );
    assert!(report.elapsed < Duration::from_secs(2), "{report:?}");
}

#[test]
fn dropping_a_manager_with_a_hung_call_does_not_hang() {
    let tier = Arc::new(FaultTier::new(FaultConfig {
        hang_probability: 1.0,
        ..FaultConfig::default()
    }));
    let start = Instant::now();
    {
        let mut m = manager(
            &tier,
            ManagerConfig {
                shutdown_timeout_ms: 100,
                ..config()
            },
        );
        m.lookup(&key(1), &ReqContext::new("a")).unwrap();
        m.flush();
        wait_until(|| tier.in_flight() == 1, "hung call");
    }
    assert!(start.elapsed() < Duration::from_secs(5));
}

#[test]
fn the_wake_hook_and_notifier_fire_on_results() {
    let tier = Arc::new(FaultTier::default());
    let woken = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&woken);
    let mut m = AsyncLookupManager::with_wake_hook(Arc::clone(&tier), config(), move || {
        counter.fetch_add(1, Ordering::SeqCst);
    })
    .unwrap();
    let notifier = m.notifier();
    let ctx = ReqContext::new("a");
    m.lookup(&key(1), &ctx).unwrap();
    m.flush();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        tokio::time::timeout(GUARD, notifier.notified())
            .await
            .expect("woken");
    });
    // The notifier fires before the hook runs (both on the worker): wait
    // for the hook rather than race it.
    wait_until(|| woken.load(Ordering::SeqCst) == 1, "wake hook");
    assert_eq!(m.lookup(&key(1), &ctx), Ok(LookupVerdict::Miss));
}

#[test]
fn invalid_keys_and_configurations_are_typed_errors() {
    let tier = Arc::new(FaultTier::default());
    let mut m = manager(
        &tier,
        ManagerConfig {
            max_key_len: 36,
            ..config()
        },
    );
    let ctx = ReqContext::new("a");
    assert_eq!(
        m.lookup(&OffloadKey::new(&[1; 37]), &ctx),
        Err(LookupError::InvalidKey {
            len: 37,
            min: 1,
            max: 36
        })
    );
    assert_eq!(
        m.lookup(&OffloadKey::new(&[]), &ctx),
        Err(LookupError::InvalidKey {
            len: 0,
            min: 1,
            max: 36
        })
    );
    assert!(m.is_idle(), "an invalid key leaves no state");
    let err = AsyncLookupManager::new(
        FaultTier::default(),
        ManagerConfig {
            max_calls_in_flight: 0,
            ..config()
        },
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            ManagerError::InvalidConfig {
                field: "max_calls_in_flight",
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn a_tier_with_one_key_length_refuses_others_at_the_lookup() {
    let tier = Arc::new(FaultTier::default());
    let mut m = manager(
        &tier,
        ManagerConfig {
            min_key_len: 36,
            max_key_len: 36,
            ..config()
        },
    );
    let ctx = ReqContext::new("a");
    let err = m.lookup(&OffloadKey::new(&[1; 35]), &ctx).unwrap_err();
    assert_eq!(
        err,
        LookupError::InvalidKey {
            len: 35,
            min: 36,
            max: 36
        }
    );
    assert_eq!(
        err.to_string(),
        "invalid key of 35 bytes: keys must be 36 bytes long"
    );
    assert_eq!(
        m.lookup(&OffloadKey::new(&[1; 36]), &ctx),
        Ok(LookupVerdict::Pending)
    );
    let err = ManagerConfig {
        min_key_len: 65,
        ..ManagerConfig::default()
    }
    .validate()
    .unwrap_err();
    assert!(
        matches!(
            err,
            ManagerError::InvalidConfig {
                field: "min_key_len",
                ..
            }
        ),
        "{err}"
    );
}

#[test]
fn stats_count_every_outcome_apart() {
    let tier = Arc::new(FaultTier::default());
    tier.insert([key(1)]);
    tier.set_request_fault("failing", RequestFault::Fail);
    let mut m = manager(&tier, config());
    let ok = ReqContext::new("ok");
    let failing = ReqContext::new("failing");
    m.lookup(&key(1), &ok).unwrap();
    m.lookup(&key(2), &ok).unwrap();
    m.lookup(&key(3), &failing).unwrap();
    m.flush();
    wait_verdict(&mut m, &key(1), &ok);
    wait_verdict(&mut m, &key(2), &ok);
    wait_verdict(&mut m, &key(3), &failing);
    let s = m.stats();
    assert_eq!(
        (s.hits, s.misses, s.errors, s.timeouts),
        (1, 1, 1, 0),
        "{s:?}"
    );
    assert_eq!(s.calls_started, 2);
    assert_eq!(s.calls_finished, 2);
    assert_eq!(s.tier_call_latency.count, 2);
    assert_eq!(s.time_to_verdict.count, 3);
    assert_eq!(s.tracked_requests, 2);
    assert_eq!(s.tier, "mock");
}

// Found by the model test: mark_miss on a key kept only for its running
// probe must not leave state behind once the probe answers.
#[test]
fn mark_miss_on_an_unreferenced_in_flight_key_leaks_nothing() {
    let tier = Arc::new(FaultTier::new(FaultConfig::with_latency(
        Duration::from_millis(30),
    )));
    let mut m = manager(&tier, config());
    m.lookup(&key(1), &ReqContext::new("a")).unwrap();
    m.flush();
    wait_until(|| tier.in_flight() == 1, "probe running");
    m.cleanup("a");
    m.mark_miss([&key(1)]);
    wait_until(
        || {
            m.drain_results();
            tier.in_flight() == 0 && m.stats().in_flight_keys == 0
        },
        "the probe to land",
    );
    assert!(m.is_idle(), "{:?}", m.stats());
}
