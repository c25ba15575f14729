//! The ledger's counters and latency histograms: what happened to its keys
//! and calls so far, as `stats()` and the metrics export read it. They hold
//! no key state; the ledger reports each event to them once.

use std::time::Duration;

use crate::stats::{LatencyHistogram, ManagerStats};

/// When a tier call started and ended (ledger ticks): splits the time to
/// verdict of its keys.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CallSpan {
    pub(crate) started: u64,
    pub(crate) ended: u64,
}

/// The counts and histograms of one ledger.
///
/// Invariant: every count only grows and counts each event once (a key's
/// result once per probe, a call once when it is handed out and once when
/// its outcome is applied), and each histogram holds one sample per event
/// it times once [`settle`](Self::settle) has run (every flush runs it):
/// until then a run of equal samples may be held back.
#[derive(Debug)]
pub(super) struct Counters {
    pub(super) lookups: u64,
    pub(super) hits: u64,
    pub(super) misses: u64,
    pub(super) errors: u64,
    pub(super) timeouts: u64,
    pub(super) forced_misses: u64,
    pub(super) stale_results_dropped: u64,
    pub(super) late_answers_dropped: u64,
    pub(super) deferred: u64,
    pub(super) calls_started: u64,
    pub(super) calls_finished: u64,
    /// The first failed call's cause, kept for `stats()`.
    first_error: Option<String>,
    call_latency: LatencyHistogram,
    time_to_verdict: LatencyHistogram,
    /// The parts of `time_to_verdict`, for calls with a [`CallSpan`]: from
    /// the flush to the call's start, the call, and from its end to the
    /// verdict being applied.
    verdict_queueing: LatencyHistogram,
    verdict_round_trip: LatencyHistogram,
    verdict_publication: LatencyHistogram,
}

impl Counters {
    pub(super) fn new() -> Self {
        Self {
            lookups: 0,
            hits: 0,
            misses: 0,
            errors: 0,
            timeouts: 0,
            forced_misses: 0,
            stale_results_dropped: 0,
            late_answers_dropped: 0,
            deferred: 0,
            calls_started: 0,
            calls_finished: 0,
            first_error: None,
            call_latency: LatencyHistogram::new(),
            time_to_verdict: LatencyHistogram::new(),
            verdict_queueing: LatencyHistogram::new(),
            verdict_round_trip: LatencyHistogram::new(),
            verdict_publication: LatencyHistogram::new(),
        }
    }

    /// Records the samples the histograms hold back.
    #[inline]
    pub(super) fn settle(&mut self) {
        self.time_to_verdict.settle();
        self.verdict_queueing.settle();
        self.verdict_round_trip.settle();
        self.verdict_publication.settle();
        self.call_latency.settle();
    }

    /// A call's outcome was applied; the call took `elapsed`.
    #[inline]
    pub(super) fn call_finished(&mut self, elapsed: Duration) {
        self.calls_finished += 1;
        self.call_latency.record(elapsed);
    }

    /// Keeps `cause` as the first failure's, unless one is kept already.
    pub(super) fn note_failure(&mut self, cause: impl FnOnce() -> String) {
        self.first_error.get_or_insert_with(cause);
    }

    /// Records `count` times to verdict of keys flushed at `flushed_at`
    /// (ticks plus one; 0: none, and nothing is recorded) whose verdicts
    /// became available at `now_ticks`, and their split when the call's
    /// `span` is known.
    #[inline]
    pub(super) fn record_verdict_times(
        &mut self,
        flushed_at: u64,
        now_ticks: u64,
        count: u64,
        span: Option<CallSpan>,
    ) {
        if count > 0 && flushed_at > 0 {
            let flushed = flushed_at - 1;
            let waited = now_ticks.saturating_sub(flushed);
            self.time_to_verdict
                .record_n(Duration::from_nanos(waited), count);
            if let Some(span) = span {
                let nanos = Duration::from_nanos;
                self.verdict_queueing
                    .record_n(nanos(span.started.saturating_sub(flushed)), count);
                self.verdict_round_trip
                    .record_n(nanos(span.ended.saturating_sub(span.started)), count);
                self.verdict_publication
                    .record_n(nanos(now_ticks.saturating_sub(span.ended)), count);
            }
        }
    }

    /// The counts and histograms for the metrics export, beside the gauges
    /// the ledger reads from its other parts.
    pub(super) fn view(&self, gauges: Gauges) -> crate::metrics::LedgerView<'_> {
        crate::metrics::LedgerView {
            lookups: self.lookups,
            hits: self.hits,
            misses: self.misses,
            errors: self.errors,
            timeouts: self.timeouts,
            deferred: self.deferred,
            forced_misses: self.forced_misses,
            stale_results_dropped: self.stale_results_dropped,
            late_answers_dropped: self.late_answers_dropped,
            calls_started: self.calls_started,
            calls_finished: self.calls_finished,
            calls_in_flight: gauges.calls_in_flight,
            calls_waiting: gauges.calls_waiting,
            tracked_keys: gauges.tracked_keys,
            queued_keys: gauges.queued_keys,
            time_to_verdict: &self.time_to_verdict,
            tier_call_latency: &self.call_latency,
        }
    }

    /// The counts and the histograms' summaries; the ledger fills in the
    /// rest of the snapshot.
    pub(super) fn stats(&self) -> ManagerStats {
        ManagerStats {
            lookups: self.lookups,
            hits: self.hits,
            misses: self.misses,
            errors: self.errors,
            timeouts: self.timeouts,
            forced_misses: self.forced_misses,
            stale_results_dropped: self.stale_results_dropped,
            late_answers_dropped: self.late_answers_dropped,
            deferred: self.deferred,
            calls_started: self.calls_started,
            calls_finished: self.calls_finished,
            tier_call_latency: self.call_latency.summary(),
            time_to_verdict: self.time_to_verdict.summary(),
            verdict_queueing: self.verdict_queueing.summary(),
            verdict_round_trip: self.verdict_round_trip.summary(),
            verdict_publication: self.verdict_publication.summary(),
            first_error: self.first_error.clone(),
            ..ManagerStats::default()
        }
    }
}

/// The gauges of the metrics export, read from the ledger's other parts.
#[derive(Debug, Clone, Copy)]
pub(super) struct Gauges {
    pub(super) calls_in_flight: usize,
    pub(super) calls_waiting: usize,
    pub(super) tracked_keys: usize,
    pub(super) queued_keys: usize,
}
