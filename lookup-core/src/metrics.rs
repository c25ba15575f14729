//! Per-manager metrics through the [`metrics`] facade, so any exporter
//! (Prometheus, StatsD, OpenTelemetry, …) can publish them.
//!
//! Every manager registers the metrics below with whatever recorder is
//! installed when it is built (install the exporter first: a manager built
//! before any recorder exists publishes nothing), under two labels:
//!
//! - `tier`: its [`tier_name`](crate::ManagerConfig::tier_name);
//! - `manager`: a number unique among the managers of the process, in the
//!   order they were built from 1
//!   ([`AsyncLookupManager::manager_id`](crate::AsyncLookupManager::manager_id)),
//!   so two managers with the same tier name (two Redis tiers, a manager
//!   rebuilt after a shutdown) keep series of their own rather than adding
//!   into one. Sum over `manager` for a per-tier figure.
//!
//! When a manager goes (dropped, with or without a shutdown first), its
//! gauges return to 0 and its counters are final: a call it abandoned
//! counts as finished, its keys as errors. A shut-down manager's gauges
//! show what it still tracks until it is dropped.
//!
//! | name | kind | what |
//! |---|---|---|
//! | `kvtier_lookups_total` | counter | keys asked for through `lookup` / `lookup_prefix` ([`ManagerStats::lookups`](crate::ManagerStats::lookups)) |
//! | `kvtier_hits_total` | counter | keys the tier said exist |
//! | `kvtier_misses_total` | counter | keys the tier said do not exist |
//! | `kvtier_errors_total` | counter | keys whose tier call failed, panicked or answered the wrong number of results |
//! | `kvtier_timeouts_total` | counter | keys whose tier call, or wait for a call, exceeded its deadline |
//! | `kvtier_deferred_total` | counter | new keys answered pending because the backlog was full |
//! | `kvtier_forced_misses_total` | counter | keys forced to miss by `mark_miss` |
//! | `kvtier_stale_results_dropped_total` | counter | results dropped because their key changed meanwhile |
//! | `kvtier_late_answers_dropped_total` | counter | answers that arrived after their call's deadline |
//! | `kvtier_tier_calls_started_total` | counter | tier calls started (handed to the worker, which runs each when a call slot is free) |
//! | `kvtier_tier_calls_finished_total` | counter | tier calls finished (answered, failed or timed out) |
//! | `kvtier_calls_in_flight` | gauge | tier calls running now (each holds one of the `max_calls_in_flight` call slots) |
//! | `kvtier_calls_waiting` | gauge | tier calls handed to the worker and waiting for a free call slot now |
//! | `kvtier_tracked_keys` | gauge | keys with state in the manager now |
//! | `kvtier_queued_keys` | gauge | keys waiting for a flush or a call slot now |
//! | `kvtier_time_to_verdict_seconds` | histogram | from the flush that submitted a key to its first verdict being available (the tier's answer applied) |
//! | `kvtier_tier_call_duration_seconds` | histogram | duration of a tier call |
//! | `kvtier_keys_per_call` | histogram | keys in a tier call, recorded when it starts |
//!
//! The counters equal the fields of the same name in
//! [`stats()`](crate::AsyncLookupManager::stats) once published, and the
//! two latency histograms hold the samples behind its
//! [`LatencySummary`](crate::LatencySummary)s.
//!
//! # Cost
//!
//! Nothing is published on the lookup path. Counter deltas and gauges are
//! published at each `flush`, each `drain_results` (which `lookup` runs
//! when results are waiting) and at shutdown; the latency histograms'
//! new samples are published from the manager's own histograms at most once
//! per second, and in full at shutdown, so a counter or histogram may lag
//! the manager by one step (or one second) between those points.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use ::metrics::{Counter, Gauge, Histogram, Unit};

use crate::stats::LatencyHistogram;

/// Counter: keys asked for through `lookup` or `lookup_prefix`.
pub const LOOKUPS: &str = "kvtier_lookups_total";
/// Counter: keys the tier said exist.
pub const HITS: &str = "kvtier_hits_total";
/// Counter: keys the tier said do not exist.
pub const MISSES: &str = "kvtier_misses_total";
/// Counter: keys whose tier call failed, panicked or answered the wrong number of results.
pub const ERRORS: &str = "kvtier_errors_total";
/// Counter: keys whose tier call, or wait for a call, exceeded its deadline.
pub const TIMEOUTS: &str = "kvtier_timeouts_total";
/// Counter: new keys answered pending because the backlog was full.
pub const DEFERRED: &str = "kvtier_deferred_total";
/// Counter: keys forced to miss by `mark_miss`.
pub const FORCED_MISSES: &str = "kvtier_forced_misses_total";
/// Counter: results dropped because their key was cleaned up, re-probed or forced to miss meanwhile.
pub const STALE_RESULTS_DROPPED: &str = "kvtier_stale_results_dropped_total";
/// Counter: tier answers that arrived after their call's deadline.
pub const LATE_ANSWERS_DROPPED: &str = "kvtier_late_answers_dropped_total";
/// Counter: tier calls started.
pub const CALLS_STARTED: &str = "kvtier_tier_calls_started_total";
/// Counter: tier calls finished (answered, failed or timed out).
pub const CALLS_FINISHED: &str = "kvtier_tier_calls_finished_total";
/// Gauge: tier calls running now (each holds one of the `max_calls_in_flight` call slots).
pub const CALLS_IN_FLIGHT: &str = "kvtier_calls_in_flight";
/// Gauge: tier calls handed to the worker and waiting for a free call slot now.
pub const CALLS_WAITING: &str = "kvtier_calls_waiting";
/// Gauge: keys with state in the manager now.
pub const TRACKED_KEYS: &str = "kvtier_tracked_keys";
/// Gauge: keys waiting for a flush or a call slot now.
pub const QUEUED_KEYS: &str = "kvtier_queued_keys";
/// Histogram, seconds: from the flush that submitted a key to its first verdict being available (the tier's answer applied).
pub const TIME_TO_VERDICT: &str = "kvtier_time_to_verdict_seconds";
/// Histogram, seconds: duration of a tier call.
pub const TIER_CALL_DURATION: &str = "kvtier_tier_call_duration_seconds";
/// Histogram: keys in a tier call, recorded when it starts.
pub const KEYS_PER_CALL: &str = "kvtier_keys_per_call";
/// A label every metric carries: the tier's name.
pub const TIER_LABEL: &str = "tier";
/// A label every metric carries: the manager's number, unique in the
/// process (see [`AsyncLookupManager::manager_id`](crate::AsyncLookupManager::manager_id)).
pub const MANAGER_LABEL: &str = "manager";

/// The counters in the order of [`LedgerView::counts`], with their help text.
const COUNTERS: [(&str, &str); 11] = [
    (LOOKUPS, "Keys asked for through lookup or lookup_prefix."),
    (HITS, "Keys the tier said exist."),
    (MISSES, "Keys the tier said do not exist."),
    (
        ERRORS,
        "Keys whose tier call failed, panicked or answered the wrong number of results.",
    ),
    (
        TIMEOUTS,
        "Keys whose tier call, or wait for a call, exceeded its deadline.",
    ),
    (
        DEFERRED,
        "New keys answered pending because the backlog was full.",
    ),
    (FORCED_MISSES, "Keys forced to miss by mark_miss."),
    (
        STALE_RESULTS_DROPPED,
        "Results dropped because their key was cleaned up, re-probed or forced to miss meanwhile.",
    ),
    (
        LATE_ANSWERS_DROPPED,
        "Tier answers that arrived after their call's deadline.",
    ),
    (
        CALLS_STARTED,
        "Tier calls started (handed to the worker, which runs each when a call slot is free).",
    ),
    (
        CALLS_FINISHED,
        "Tier calls finished (answered, failed or timed out).",
    ),
];

/// The number the next manager built gets (see [`MANAGER_LABEL`]).
static NEXT_MANAGER_ID: AtomicU64 = AtomicU64::new(1);

/// A number no other manager of the process has, in creation order from 1.
pub(crate) fn next_manager_id() -> u64 {
    NEXT_MANAGER_ID.fetch_add(1, Ordering::Relaxed)
}

/// How often the latency histograms' new samples are published at most
/// (walking an hdrhistogram costs microseconds; a step must not pay it).
const HISTOGRAM_EXPORT_INTERVAL: Duration = Duration::from_secs(1);

/// What the ledger shows the exporter: its counters and histograms as they
/// are, read without allocating or summarising.
pub(crate) struct LedgerView<'a> {
    pub(crate) lookups: u64,
    pub(crate) hits: u64,
    pub(crate) misses: u64,
    pub(crate) errors: u64,
    pub(crate) timeouts: u64,
    pub(crate) deferred: u64,
    pub(crate) forced_misses: u64,
    pub(crate) stale_results_dropped: u64,
    pub(crate) late_answers_dropped: u64,
    pub(crate) calls_started: u64,
    pub(crate) calls_finished: u64,
    pub(crate) calls_in_flight: usize,
    pub(crate) calls_waiting: usize,
    pub(crate) tracked_keys: usize,
    pub(crate) queued_keys: usize,
    pub(crate) time_to_verdict: &'a LatencyHistogram,
    pub(crate) tier_call_latency: &'a LatencyHistogram,
}

impl LedgerView<'_> {
    /// The counters, in the order of [`COUNTERS`].
    fn counts(&self) -> [u64; COUNTERS.len()] {
        [
            self.lookups,
            self.hits,
            self.misses,
            self.errors,
            self.timeouts,
            self.deferred,
            self.forced_misses,
            self.stale_results_dropped,
            self.late_answers_dropped,
            self.calls_started,
            self.calls_finished,
        ]
    }
}

/// One manager's metric handles and what of its counters and histograms
/// has been published so far. Owned by the manager, fed from its ledger.
pub(crate) struct TierMetrics {
    /// Each counter's handle and the value published so far.
    counters: [(Counter, u64); COUNTERS.len()],
    calls_in_flight: Gauge,
    calls_waiting: Gauge,
    tracked_keys: Gauge,
    queued_keys: Gauge,
    keys_per_call: Histogram,
    time_to_verdict: HistogramExport,
    tier_call_duration: HistogramExport,
    next_histogram_export: Option<Instant>,
}

impl TierMetrics {
    /// Registers the metrics of manager `manager` of tier `tier` with the
    /// installed recorder (none: handles that do nothing).
    pub(crate) fn new(tier: &str, manager: u64) -> Self {
        let manager = manager.to_string();
        let label = || {
            [
                (TIER_LABEL, tier.to_owned()),
                (MANAGER_LABEL, manager.clone()),
            ]
        };
        let counters = COUNTERS.map(|(name, help)| {
            ::metrics::describe_counter!(name, Unit::Count, help);
            (::metrics::counter!(name, &label()), 0)
        });
        ::metrics::describe_gauge!(
            CALLS_IN_FLIGHT,
            Unit::Count,
            "Tier calls running now (each holds one of the max_calls_in_flight call slots)."
        );
        ::metrics::describe_gauge!(
            CALLS_WAITING,
            Unit::Count,
            "Tier calls handed to the worker and waiting for a free call slot now."
        );
        ::metrics::describe_gauge!(
            TRACKED_KEYS,
            Unit::Count,
            "Keys with state in the manager now."
        );
        ::metrics::describe_gauge!(
            QUEUED_KEYS,
            Unit::Count,
            "Keys waiting for a flush or a call slot now."
        );
        ::metrics::describe_histogram!(
            TIME_TO_VERDICT,
            Unit::Seconds,
            "Time from the flush that submitted a key to its first verdict being available."
        );
        ::metrics::describe_histogram!(
            TIER_CALL_DURATION,
            Unit::Seconds,
            "Duration of a tier call."
        );
        ::metrics::describe_histogram!(
            KEYS_PER_CALL,
            Unit::Count,
            "Keys in a tier call, recorded when it starts."
        );
        Self {
            counters,
            calls_in_flight: ::metrics::gauge!(CALLS_IN_FLIGHT, &label()),
            calls_waiting: ::metrics::gauge!(CALLS_WAITING, &label()),
            tracked_keys: ::metrics::gauge!(TRACKED_KEYS, &label()),
            queued_keys: ::metrics::gauge!(QUEUED_KEYS, &label()),
            keys_per_call: ::metrics::histogram!(KEYS_PER_CALL, &label()),
            time_to_verdict: HistogramExport::new(::metrics::histogram!(TIME_TO_VERDICT, &label())),
            tier_call_duration: HistogramExport::new(::metrics::histogram!(
                TIER_CALL_DURATION,
                &label()
            )),
            next_histogram_export: None,
        }
    }

    /// A tier call of `keys` keys started.
    pub(crate) fn call_started(&self, keys: usize) {
        self.keys_per_call.record(keys as f64);
    }

    /// Publishes the counters' growth and the gauges; the histograms' new
    /// samples too if the last export is a second old.
    pub(crate) fn publish(&mut self, view: &LedgerView<'_>, now: Instant) {
        for ((handle, published), value) in self.counters.iter_mut().zip(view.counts()) {
            if value > *published {
                handle.increment(value - *published);
                *published = value;
            }
        }
        self.calls_in_flight.set(view.calls_in_flight as f64);
        self.calls_waiting.set(view.calls_waiting as f64);
        self.tracked_keys.set(view.tracked_keys as f64);
        self.queued_keys.set(view.queued_keys as f64);
        if self.next_histogram_export.is_none_or(|at| now >= at) {
            self.publish_histograms(view);
            self.next_histogram_export = Some(now + HISTOGRAM_EXPORT_INTERVAL);
        }
    }

    /// Publishes everything not yet published, histograms included.
    pub(crate) fn publish_all(&mut self, view: &LedgerView<'_>, now: Instant) {
        self.next_histogram_export = None;
        self.publish(view, now);
    }

    /// Sets every gauge to 0, for a manager that goes: it tracks nothing
    /// and runs no call any more.
    pub(crate) fn retire(&self) {
        for gauge in [
            &self.calls_in_flight,
            &self.calls_waiting,
            &self.tracked_keys,
            &self.queued_keys,
        ] {
            gauge.set(0.0);
        }
    }

    fn publish_histograms(&mut self, view: &LedgerView<'_>) {
        self.time_to_verdict.publish(view.time_to_verdict);
        self.tier_call_duration.publish(view.tier_call_latency);
    }
}

impl std::fmt::Debug for TierMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TierMetrics").finish_non_exhaustive()
    }
}

/// A microsecond hdrhistogram published as seconds: what was already
/// published is kept as a second histogram of the same shape, allocated up
/// front so that publishing never allocates.
struct HistogramExport {
    handle: Histogram,
    published: LatencyHistogram,
}

impl HistogramExport {
    fn new(handle: Histogram) -> Self {
        Self {
            handle,
            published: LatencyHistogram::new(),
        }
    }

    /// Publishes the samples of `source` not yet published, one
    /// `record_many` per bucket that grew.
    fn publish(&mut self, source: &LatencyHistogram) {
        let (source, published) = (source.raw(), self.published.raw_mut());
        if source.len() == published.len() {
            return;
        }
        for bucket in source.iter_recorded() {
            let value = bucket.value_iterated_to();
            let new = bucket
                .count_at_value()
                .saturating_sub(published.count_at(value));
            if new == 0 {
                continue;
            }
            // Both histograms have the same bounds: this cannot fail.
            if published.record_n(value, new).is_ok() {
                self.handle.record_many(
                    value as f64 / 1e6,
                    usize::try_from(new).unwrap_or(usize::MAX),
                );
            }
        }
    }
}
