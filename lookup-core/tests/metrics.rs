//! The manager's metrics through the `metrics` facade equal its `stats()`:
//! counters once published (at flush, at drain and at shutdown), one
//! histogram sample per tier call and per first verdict, gauges that count
//! what runs and come back to 0 when the manager goes, and a series per
//! manager. A recorder local to the test thread collects what the manager
//! publishes; the tier runs on the real worker. No test asserts a speed;
//! time limits only stop a broken build from hanging.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvtier_core::testkit::{FaultConfig, FaultTier};
use kvtier_core::{
    AsyncLookupManager, LookupVerdict, ManagerConfig, ManagerStats, OffloadKey, ReqContext, Tier,
    TierError, TierErrorKind, metrics as names,
};
use metrics::{
    Counter, Gauge, Histogram, HistogramFn, Key, KeyName, Metadata, Recorder, SharedString, Unit,
};

const GUARD: Duration = Duration::from_secs(20);

/// Every sample of one histogram.
#[derive(Default)]
struct Samples(Mutex<Vec<f64>>);

impl HistogramFn for Samples {
    fn record(&self, value: f64) {
        self.0.lock().expect("not poisoned").push(value);
    }
}

/// A series: (name, `tier` label, `manager` label).
type Series = (String, String, String);

/// Collects counters, gauges and histograms by series.
#[derive(Default)]
struct Collect {
    counters: Mutex<HashMap<Series, Arc<AtomicU64>>>,
    gauges: Mutex<HashMap<Series, Arc<AtomicU64>>>,
    histograms: Mutex<HashMap<Series, Arc<Samples>>>,
}

fn id(key: &Key) -> Series {
    let label = |name: &str| {
        key.labels()
            .find(|l| l.key() == name)
            .map(|l| l.value().to_owned())
            .unwrap_or_default()
    };
    (
        key.name().to_owned(),
        label(names::TIER_LABEL),
        label(names::MANAGER_LABEL),
    )
}

/// The one series of metric `name` and tier `tier` in `map`, or, with
/// `manager`, of that manager.
fn series<T: Clone>(
    map: &Mutex<HashMap<Series, T>>,
    name: &str,
    tier: &str,
    manager: Option<&str>,
) -> T {
    let map = map.lock().expect("not poisoned");
    let found: Vec<&T> = map
        .iter()
        .filter(|((n, t, m), _)| n == name && t == tier && manager.is_none_or(|want| m == want))
        .map(|(_, v)| v)
        .collect();
    match found.as_slice() {
        [one] => (*one).clone(),
        [] => panic!("{name} of {tier} ({manager:?}) not registered"),
        _ => panic!("{name} of {tier}: one series per manager, name the manager"),
    }
}

impl Recorder for Collect {
    fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
    fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
        let mut map = self.counters.lock().expect("not poisoned");
        Counter::from_arc(Arc::clone(map.entry(id(key)).or_default()))
    }
    fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
        let mut map = self.gauges.lock().expect("not poisoned");
        Gauge::from_arc(Arc::clone(map.entry(id(key)).or_default()))
    }
    fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> Histogram {
        let mut map = self.histograms.lock().expect("not poisoned");
        Histogram::from_arc(Arc::clone(map.entry(id(key)).or_default()))
    }
}

impl Collect {
    fn counter_of(&self, name: &str, tier: &str, manager: Option<&str>) -> u64 {
        series(&self.counters, name, tier, manager).load(Ordering::Relaxed)
    }
    fn gauge(&self, name: &str, tier: &str) -> f64 {
        self.gauge_of(name, tier, None)
    }
    fn gauge_of(&self, name: &str, tier: &str, manager: Option<&str>) -> f64 {
        f64::from_bits(series(&self.gauges, name, tier, manager).load(Ordering::Relaxed))
    }
    fn samples(&self, name: &str, tier: &str) -> Vec<f64> {
        series(&self.histograms, name, tier, None)
            .0
            .lock()
            .expect("not poisoned")
            .clone()
    }
    /// The `manager` labels of the series of counter `name` and tier `tier`.
    fn managers(&self, name: &str, tier: &str) -> Vec<String> {
        let map = self.counters.lock().expect("not poisoned");
        let mut managers: Vec<String> = map
            .keys()
            .filter(|(n, t, _)| n == name && t == tier)
            .map(|(_, _, m)| m.clone())
            .collect();
        managers.sort();
        managers
    }

    /// Every counter equals the field of the same meaning in `stats`.
    fn assert_counters_equal(&self, stats: &ManagerStats) {
        self.assert_counters_of_equal(None, stats);
    }

    /// Every counter of manager `manager` (the only one of its tier if
    /// `None`) equals the field of the same meaning in `stats`.
    fn assert_counters_of_equal(&self, manager: Option<&str>, stats: &ManagerStats) {
        let tier = stats.tier.as_str();
        for (name, expected) in [
            (names::LOOKUPS, stats.lookups),
            (names::HITS, stats.hits),
            (names::MISSES, stats.misses),
            (names::ERRORS, stats.errors),
            (names::TIMEOUTS, stats.timeouts),
            (names::DEFERRED, stats.deferred),
            (names::FORCED_MISSES, stats.forced_misses),
            (names::STALE_RESULTS_DROPPED, stats.stale_results_dropped),
            (names::LATE_ANSWERS_DROPPED, stats.late_answers_dropped),
            (names::CALLS_STARTED, stats.calls_started),
            (names::CALLS_FINISHED, stats.calls_finished),
        ] {
            assert_eq!(
                self.counter_of(name, tier, manager),
                expected,
                "{name} of {tier} ({manager:?})"
            );
        }
    }
}

/// Even first bytes exist; request "broken" fails every call.
struct Evens;

impl Tier for Evens {
    async fn batch_lookup(
        &self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
    ) -> Result<Vec<bool>, TierError> {
        if ctx.req_id() == "broken" {
            return Err(TierError::new(
                TierErrorKind::Unavailable,
                "broken on purpose",
            ));
        }
        Ok(keys.iter().map(|k| k.as_bytes()[0] % 2 == 0).collect())
    }
}

fn key(i: u8) -> OffloadKey {
    OffloadKey::new(&[i; 36])
}

/// Looks every key up, flushing, until none is pending.
fn resolve(m: &mut AsyncLookupManager<Evens>, keys: &[OffloadKey], ctx: &ReqContext) {
    let start = Instant::now();
    loop {
        let mut pending = false;
        for k in keys {
            pending |= m.lookup(k, ctx).expect("valid key") == LookupVerdict::Pending;
        }
        if !pending {
            return;
        }
        assert!(start.elapsed() < GUARD, "keys never resolved");
        m.flush();
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn published_metrics_equal_stats() {
    let recorder = Collect::default();
    // Handles are taken when the manager is built: with the recorder in place.
    let mut m = metrics::with_local_recorder(&recorder, || {
        AsyncLookupManager::new(
            Evens,
            ManagerConfig {
                // Room for 8 new keys: the 9th of a step is deferred.
                max_queued_keys: 8,
                failure_backoff_ms: 60_000,
                ..ManagerConfig::named("evens")
            },
        )
        .expect("manager starts")
    });
    let tier = "evens";

    let good = ReqContext::new("good");
    let prompt: Vec<OffloadKey> = (0..10).map(key).collect();
    resolve(&mut m, &prompt, &good);
    let broken = ReqContext::new("broken");
    let failing: Vec<OffloadKey> = (100..103).map(key).collect();
    resolve(&mut m, &failing, &broken);
    m.mark_miss(&prompt[..2]);
    // A flush publishes what happened since the last one.
    m.flush();
    let stats = m.stats();
    recorder.assert_counters_equal(&stats);
    assert_eq!((stats.hits, stats.misses), (5, 5), "{stats:?}");
    assert_eq!(stats.errors, 3, "{stats:?}");
    assert!(stats.deferred > 0, "{stats:?}");
    assert_eq!(stats.forced_misses, 2, "{stats:?}");
    assert_eq!(
        recorder.gauge(names::TRACKED_KEYS, tier),
        stats.tracked_keys as f64
    );
    assert_eq!(recorder.gauge(names::CALLS_IN_FLIGHT, tier), 0.0);

    // One keys-per-call sample per started call, adding up to the keys sent.
    let per_call = recorder.samples(names::KEYS_PER_CALL, tier);
    assert_eq!(per_call.len() as u64, stats.calls_started);
    assert_eq!(
        per_call.iter().sum::<f64>(),
        13.0,
        "10 good and 3 failing keys"
    );

    m.cleanup("good");
    m.cleanup("broken");
    m.shutdown();
    // Shutdown publishes everything, the latency histograms in full.
    let stats = m.stats();
    recorder.assert_counters_equal(&stats);
    let durations = recorder.samples(names::TIER_CALL_DURATION, tier);
    assert_eq!(durations.len() as u64, stats.tier_call_latency.count);
    assert_eq!(durations.len() as u64, stats.calls_finished);
    let verdicts = recorder.samples(names::TIME_TO_VERDICT, tier);
    assert_eq!(verdicts.len() as u64, stats.time_to_verdict.count);
    assert!(!verdicts.is_empty());
    // Seconds: every sample is at most the largest, in microseconds / 1e6.
    let max_s = stats.time_to_verdict.max_us as f64 / 1e6;
    assert!(
        verdicts.iter().all(|&s| s > 0.0 && s <= max_s * 1.001),
        "{verdicts:?} vs max {max_s}"
    );
}

#[test]
fn a_manager_built_without_a_recorder_publishes_nothing_and_works() {
    let mut m = AsyncLookupManager::new(Evens, ManagerConfig::named("quiet")).expect("starts");
    let ctx = ReqContext::new("r");
    resolve(&mut m, &[key(2), key(3)], &ctx);
    assert_eq!(m.stats().hits, 1);
    m.shutdown();
}

/// Waits until `cond` holds.
fn wait_until(mut cond: impl FnMut() -> bool, what: &str) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < GUARD, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A tier whose every call hangs until it is cancelled.
fn hanging_tier() -> Arc<FaultTier> {
    Arc::new(FaultTier::new(FaultConfig {
        hang_probability: 1.0,
        record_calls: false,
        ..FaultConfig::default()
    }))
}

/// A manager of `tier` named `name` running at most `calls` calls at once,
/// whose calls never time out during a test, built with `recorder`.
fn hung_manager(
    recorder: &Collect,
    tier: &Arc<FaultTier>,
    name: &str,
    calls: usize,
) -> AsyncLookupManager<FaultTier> {
    metrics::with_local_recorder(recorder, || {
        AsyncLookupManager::from_arc(
            Arc::clone(tier),
            ManagerConfig {
                max_calls_in_flight: calls,
                call_timeout_ms: 600_000,
                shutdown_timeout_ms: 200,
                ..ManagerConfig::named(name)
            },
        )
        .expect("manager starts")
    })
}

/// Looks up one key for each of `requests` requests and flushes.
fn one_call_per_request(m: &mut AsyncLookupManager<FaultTier>, requests: u8) {
    for r in 0..requests {
        let ctx = ReqContext::new(format!("r{r}"));
        assert_eq!(m.lookup(&key(r), &ctx), Ok(LookupVerdict::Pending));
    }
    m.flush();
}

#[test]
fn calls_in_flight_counts_the_calls_running_on_the_tier() {
    let recorder = Collect::default();
    let tier = hanging_tier();
    let mut m = hung_manager(&recorder, &tier, "two-slots", 2);
    let id = m.manager_id().to_string();
    let manager = Some(id.as_str());
    // Six requests of one key each: two calls run, two wait at the worker
    // for a call slot, and two groups wait in the manager for room.
    one_call_per_request(&mut m, 6);
    wait_until(|| tier.in_flight() == 2, "two calls to run");
    m.drain_results();
    let stats = m.stats();
    let gauge = |name| recorder.gauge_of(name, "two-slots", manager);
    assert_eq!(gauge(names::CALLS_IN_FLIGHT), 2.0, "{stats:?}");
    assert_eq!(stats.calls_in_flight, tier.in_flight());
    assert_eq!(gauge(names::CALLS_WAITING), 2.0, "{stats:?}");
    assert_eq!(stats.calls_waiting, 2);
    assert_eq!(
        (stats.calls_started, stats.queued_keys),
        (4, 2),
        "{stats:?}"
    );

    let report = m.shutdown();
    assert_eq!(
        (report.abandoned_calls, report.unstarted_calls),
        (2, 2),
        "{report:?}"
    );
    let stats = m.stats();
    assert_eq!((stats.calls_in_flight, stats.calls_waiting), (0, 0));
    assert_eq!(gauge(names::CALLS_IN_FLIGHT), 0.0);
    assert_eq!(gauge(names::CALLS_WAITING), 0.0);
    recorder.assert_counters_of_equal(manager, &stats);
}

#[test]
fn a_manager_dropped_while_calls_run_leaves_its_gauges_at_zero() {
    let recorder = Collect::default();
    let tier = hanging_tier();
    let mut m = hung_manager(&recorder, &tier, "dropped", 50);
    let id = m.manager_id().to_string();
    let manager = Some(id.as_str());
    one_call_per_request(&mut m, 50);
    wait_until(|| tier.in_flight() == 50, "fifty calls to run");
    m.drain_results();
    let gauge = |name| recorder.gauge_of(name, "dropped", manager);
    assert_eq!(gauge(names::CALLS_IN_FLIGHT), 50.0);
    assert_eq!(gauge(names::TRACKED_KEYS), 50.0);
    drop(m);
    for name in [
        names::CALLS_IN_FLIGHT,
        names::CALLS_WAITING,
        names::TRACKED_KEYS,
        names::QUEUED_KEYS,
    ] {
        assert_eq!(gauge(name), 0.0, "{name} after the drop");
    }
    let counter = |name| recorder.counter_of(name, "dropped", manager);
    assert_eq!(
        (
            counter(names::CALLS_STARTED),
            counter(names::CALLS_FINISHED)
        ),
        (50, 50),
        "every call started is finished"
    );
    assert_eq!(counter(names::ERRORS), 50, "the abandoned calls' keys");
}

#[test]
fn a_manager_shut_down_with_calls_hung_then_dropped_leaves_its_gauges_at_zero() {
    let recorder = Collect::default();
    let tier = hanging_tier();
    let mut m = hung_manager(&recorder, &tier, "shut", 3);
    let id = m.manager_id().to_string();
    let manager = Some(id.as_str());
    one_call_per_request(&mut m, 8);
    wait_until(|| tier.in_flight() == 3, "three calls to run");
    let report = m.shutdown();
    assert_eq!(
        (report.abandoned_calls, report.unstarted_calls),
        (3, 3),
        "{report:?}"
    );
    let gauge = |name| recorder.gauge_of(name, "shut", manager);
    assert_eq!(gauge(names::CALLS_IN_FLIGHT), 0.0);
    assert_eq!(gauge(names::CALLS_WAITING), 0.0);
    // Still tracked (the requests were not cleaned up), until the drop.
    assert_eq!(gauge(names::TRACKED_KEYS), 8.0);
    let counter = |name| recorder.counter_of(name, "shut", manager);
    assert_eq!(
        counter(names::CALLS_FINISHED),
        counter(names::CALLS_STARTED)
    );
    drop(m);
    assert_eq!(gauge(names::TRACKED_KEYS), 0.0);
    assert_eq!(gauge(names::QUEUED_KEYS), 0.0);
}

#[test]
fn managers_with_the_same_tier_name_publish_series_of_their_own() {
    let recorder = Collect::default();
    let (mut a, mut b) = metrics::with_local_recorder(&recorder, || {
        let twin = || AsyncLookupManager::new(Evens, ManagerConfig::named("twin"));
        (twin().expect("a starts"), twin().expect("b starts"))
    });
    assert_ne!(a.manager_id(), b.manager_id());
    let prompt_a: Vec<OffloadKey> = (0..4).map(key).collect();
    let prompt_b: Vec<OffloadKey> = (10..13).map(key).collect();
    resolve(&mut a, &prompt_a, &ReqContext::new("a"));
    resolve(&mut b, &prompt_b, &ReqContext::new("b"));
    a.flush();
    b.flush();
    let mut ids = vec![a.manager_id().to_string(), b.manager_id().to_string()];
    ids.sort();
    assert_eq!(recorder.managers(names::LOOKUPS, "twin"), ids);
    for m in [&a, &b] {
        let id = m.manager_id().to_string();
        let stats = m.stats();
        recorder.assert_counters_of_equal(Some(&id), &stats);
        assert_eq!(
            recorder.gauge_of(names::TRACKED_KEYS, "twin", Some(&id)),
            stats.tracked_keys as f64
        );
    }
}
