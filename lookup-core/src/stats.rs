//! What a manager reports about itself: the [`ManagerStats`] snapshot and
//! the latency histograms behind it.

use std::time::Duration;

use hdrhistogram::Histogram;
use serde::Serialize;

/// Percentiles of one latency histogram, in microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct LatencySummary {
    /// Number of samples.
    pub count: u64,
    /// Median.
    pub p50_us: u64,
    /// 90th percentile.
    pub p90_us: u64,
    /// 99th percentile.
    pub p99_us: u64,
    /// Largest sample.
    pub max_us: u64,
    /// Mean.
    pub mean_us: f64,
}

/// A snapshot of a manager's counters; see [`AsyncLookupManager::stats`](crate::AsyncLookupManager::stats).
///
/// `hits`, `misses`, `errors` and `timeouts` count keys resolved by tier
/// calls, each key once per probe. A key that failed is counted under
/// `errors` or `timeouts`, never under `misses`, even though it answers
/// miss to the scheduler.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ManagerStats {
    /// The tier's name.
    pub tier: String,
    /// Keys asked for through `lookup` or `lookup_prefix`.
    pub lookups: u64,
    /// Keys the tier said exist.
    pub hits: u64,
    /// Keys the tier said do not exist.
    pub misses: u64,
    /// Keys whose tier call failed, panicked or answered the wrong number of results.
    pub errors: u64,
    /// Keys whose tier call exceeded its deadline.
    pub timeouts: u64,
    /// Keys forced to miss by `mark_miss`.
    pub forced_misses: u64,
    /// Results dropped because their key was cleaned up, re-probed or forced to miss meanwhile.
    pub stale_results_dropped: u64,
    /// Tier answers that arrived after their call's deadline and were discarded.
    pub late_answers_dropped: u64,
    /// New keys not tracked because the backlog was full (answered pending).
    pub deferred: u64,
    /// Tier calls started: handed to the worker, which runs each when one
    /// of its `max_calls_in_flight` call slots is free.
    pub calls_started: u64,
    /// Tier calls finished (answered, failed or timed out).
    pub calls_finished: u64,
    /// Tier calls running now: each holds one of the worker's
    /// `max_calls_in_flight` call slots, started on the tier and not yet
    /// answered.
    pub calls_in_flight: usize,
    /// Tier calls handed to the worker and waiting there for a free call
    /// slot now (the manager keeps up to `max_calls_in_flight` of them, so
    /// a call that ends is followed at once by the next).
    pub calls_waiting: usize,
    /// Keys with state in the manager now.
    pub tracked_keys: usize,
    /// Keys in tier calls started and not yet finished now (running, or
    /// waiting for a call slot).
    pub in_flight_keys: usize,
    /// Keys flushed and waiting for a tier call (or looked up and not yet flushed).
    pub queued_keys: usize,
    /// Requests with references now.
    pub tracked_requests: usize,
    /// Tier call duration.
    pub tier_call_latency: LatencySummary,
    /// Time from the flush that submitted a key to its first verdict becoming available:
    /// the tier's answer (or its failure) applied, at the first `lookup`, `flush` or
    /// drain after it arrived; from then on every lookup of the key returns it. One
    /// sample per key; a re-check after a failure and an answer for a key nobody
    /// refers to any more are not counted.
    pub time_to_verdict: LatencySummary,
    /// The first part of `time_to_verdict`: from the flush to the start of
    /// the tier call (handing the call to the worker, the worker waking up,
    /// waiting for a call slot). One sample per first verdict from a tier
    /// call that ran on the worker (not a timeout the manager applied
    /// itself); the three parts of a sample add up to its time to verdict,
    /// their percentiles need not.
    pub verdict_queueing: LatencySummary,
    /// The second part of `time_to_verdict`: the tier call itself (the
    /// round trip to the tier), weighted per key, unlike `tier_call_latency`.
    pub verdict_round_trip: LatencySummary,
    /// The last part of `time_to_verdict`: from the end of the tier call to
    /// the verdict being applied (the result's trip back to the scheduler's
    /// thread, and the wait for its next `lookup`, `flush` or drain).
    pub verdict_publication: LatencySummary,
    /// The first failed tier call's cause (an error, a timeout or a wrong
    /// number of results), as one line; `None` while no call has failed.
    /// A program can print it next to `errors` and `timeouts`, so a
    /// misconfigured tier is named with its cause rather than only counted.
    pub first_error: Option<String>,
}

/// A microsecond histogram that never fails to record.
///
/// Equal samples in a row (the first verdicts of one step's keys mostly
/// fall in the same microsecond) are counted in `run` and recorded at once
/// when a different one comes, or at [`settle`](Self::settle): one histogram
/// update per run instead of one per sample. The summary includes the run.
#[derive(Debug, Clone)]
pub(crate) struct LatencyHistogram {
    hist: Histogram<u64>,
    /// (value in µs, how many times in a row) not yet in `hist`.
    run: (u64, u64),
}

impl LatencyHistogram {
    /// Up to one hour, three significant digits.
    const MAX_US: u64 = 3_600_000_000;

    pub(crate) fn new() -> Self {
        // The bounds are constants that hdrhistogram accepts; fall back to an
        // auto-resizing histogram rather than panic if that ever changes.
        let hist = Histogram::new_with_bounds(1, Self::MAX_US, 3)
            .or_else(|_| Histogram::new(3))
            .unwrap_or_else(|_| unreachable_histogram());
        Self { hist, run: (0, 0) }
    }

    #[inline]
    pub(crate) fn record(&mut self, d: Duration) {
        self.record_n(d, 1);
    }

    /// Records `count` samples of `d`.
    #[inline]
    pub(crate) fn record_n(&mut self, d: Duration, count: u64) {
        let us = u64::try_from(d.as_micros())
            .unwrap_or(u64::MAX)
            .clamp(1, Self::MAX_US);
        if self.run.0 == us {
            self.run.1 += count;
        } else {
            self.settle();
            self.run = (us, count);
        }
    }

    /// Records the run of equal samples still held back.
    #[inline]
    pub(crate) fn settle(&mut self) {
        let (us, count) = std::mem::take(&mut self.run);
        if count > 0 {
            self.hist.saturating_record_n(us, count);
        }
    }

    /// The recorded samples, for the metrics export: a run of equal samples
    /// still held back shows at the next [`settle`](Self::settle) (every
    /// flush).
    pub(crate) fn raw(&self) -> &Histogram<u64> {
        &self.hist
    }

    pub(crate) fn raw_mut(&mut self) -> &mut Histogram<u64> {
        &mut self.hist
    }

    pub(crate) fn summary(&self) -> LatencySummary {
        if self.run.1 > 0 {
            let mut settled = self.clone();
            settled.settle();
            return settled.summary();
        }
        let h = &self.hist;
        if h.is_empty() {
            return LatencySummary::default();
        }
        LatencySummary {
            count: h.len(),
            p50_us: h.value_at_quantile(0.50),
            p90_us: h.value_at_quantile(0.90),
            p99_us: h.value_at_quantile(0.99),
            max_us: h.max(),
            mean_us: h.mean(),
        }
    }
}

#[cold]
fn unreachable_histogram() -> Histogram<u64> {
    // sigfig 1 with auto-resize is always accepted.
    match Histogram::new(1) {
        Ok(h) => h,
        Err(e) => unreachable!("hdrhistogram rejected sigfig 1: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_of_equal_samples_count_like_single_records() {
        let samples = [5u64, 5, 5, 7, 7, 5, 1, 1, 0, 3_600_000_001];
        let mut coalesced = LatencyHistogram::new();
        let mut plain = Histogram::<u64>::new_with_bounds(1, LatencyHistogram::MAX_US, 3)
            .expect("valid bounds");
        for us in samples {
            coalesced.record(Duration::from_micros(us));
            plain.saturating_record(us.clamp(1, LatencyHistogram::MAX_US));
            // The summary includes the run still held back, at every point.
            let s = coalesced.summary();
            assert_eq!(s.count, plain.len());
            assert_eq!(s.max_us, plain.max());
            assert_eq!(s.p50_us, plain.value_at_quantile(0.5));
        }
        coalesced.settle();
        coalesced.settle();
        assert_eq!(coalesced.summary().count, samples.len() as u64);
        assert_eq!(coalesced.hist, plain);
    }
}
