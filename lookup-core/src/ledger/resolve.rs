//! The ledger's resolution of keys: a call's answers or failure applied to
//! each of its keys, and queued keys timing out at their deadline.

use std::time::Instant;

use super::counters::{CallSpan, Counters};
use super::outstanding::OutstandingCall;
use super::table::{Phase, Probe};
use super::{CallOutcome, Ledger, ticks};
use crate::error::TierErrorKind;

/// What a call says of one of its keys (see `Ledger::resolve`).
#[derive(Debug, Clone, Copy)]
enum KeyResult {
    /// The tier answered: the key is present or not.
    Answer(bool),
    /// The call failed or timed out: probe again from `retry_at` (ticks).
    Failed { retry_at: u64 },
}

impl Ledger {
    /// Applies the tier's answer for each key of `call`, one per key, and
    /// times the first verdicts among them.
    #[inline(always)]
    pub(super) fn apply_answers(
        &mut self,
        call: &OutstandingCall,
        found: Vec<bool>,
        now_ticks: u64,
        span: Option<CallSpan>,
    ) {
        let flushed_at = call.flushed_at;
        let answers = call.probes.iter().zip(found);
        if flushed_at == 0 {
            // A queued group's call: each key waited from its own flush.
            let mut run = FlushRun::default();
            for (&probe, present) in answers {
                if let Some(timed) = self.resolve(probe, KeyResult::Answer(present), 0) {
                    run.add(&mut self.counters, timed, now_ticks, span);
                }
            }
            run.record(&mut self.counters, now_ticks, span);
            return;
        }
        // A call the flush handed out at once: its keys' first verdicts all
        // waited from that flush, recorded as one sample.
        let mut first_verdicts = 0;
        for (&probe, present) in answers {
            let timed = self.resolve(probe, KeyResult::Answer(present), flushed_at);
            first_verdicts += u64::from(timed.is_some_and(|t| t != 0));
        }
        self.counters
            .record_verdict_times(flushed_at, now_ticks, first_verdicts, span);
    }

    /// Logs and counts the cause of a call of `keys` keys that did not
    /// answer with one result per key; returns the kind its keys fail with.
    #[cold]
    pub(super) fn note_failure(&mut self, outcome: CallOutcome, keys: usize) -> TierErrorKind {
        match outcome {
            CallOutcome::Answered(found) => {
                tracing::warn!(
                    tier = %self.tier,
                    keys,
                    results = found.len(),
                    "tier answered with the wrong number of results; resolving its keys as errors"
                );
                self.counters
                    .note_failure(|| format!("answered {} results for {keys} keys", found.len()));
                TierErrorKind::WrongResultCount
            }
            CallOutcome::Failed(err) => {
                tracing::warn!(tier = %self.tier, keys, error = %err, "tier call failed");
                self.counters.note_failure(|| crate::error::one_line(&err));
                err.kind()
            }
            CallOutcome::TimedOut => {
                let timeout_ms = self.call_timeout.as_millis();
                tracing::warn!(
                    tier = %self.tier,
                    keys,
                    timeout_ms = timeout_ms as u64,
                    "tier call exceeded its deadline"
                );
                self.counters.note_failure(|| {
                    format!("no answer within the call deadline ({timeout_ms} ms)")
                });
                TierErrorKind::Timeout
            }
        }
    }

    /// Fails every key of `call` with `kind`: each answers miss, counted as
    /// a timeout or an error, until a lookup past the back-off probes it
    /// again.
    pub(super) fn apply_failure(
        &mut self,
        call: &OutstandingCall,
        kind: TierErrorKind,
        now: Instant,
        now_ticks: u64,
        span: Option<CallSpan>,
    ) {
        let timed_out = kind == TierErrorKind::Timeout;
        let retry_at = ticks(self.epoch, now + self.failure_backoff);
        let flushed_at = call.flushed_at;
        let mut first_verdicts = 0;
        let mut run = FlushRun::default();
        for &probe in &call.probes {
            let result = KeyResult::Failed { retry_at };
            let Some(timed) = self.resolve(probe, result, flushed_at) else {
                continue;
            };
            if timed_out {
                self.counters.timeouts += 1;
            } else {
                self.counters.errors += 1;
            }
            if flushed_at == 0 {
                run.add(&mut self.counters, timed, now_ticks, span);
            } else {
                first_verdicts += u64::from(timed != 0);
            }
        }
        run.record(&mut self.counters, now_ticks, span);
        self.counters
            .record_verdict_times(flushed_at, now_ticks, first_verdicts, span);
    }

    /// Applies one key's result from a call whose keys were flushed at
    /// `call_flushed_at` (0: each at its own). `None` if it was not applied
    /// (a stale answer); else the flush time (ticks plus one) to time the
    /// key's first verdict from, or 0 when the result is not a first verdict
    /// a request waits for (a re-check of a failed probe, whose requests had
    /// a miss already, or a key nobody refers to any more). Inlined at each
    /// call site, where the kind of `result` is known: a tier's answer takes
    /// no branch on whether the key is present.
    #[inline(always)]
    fn resolve(&mut self, probe: Probe, result: KeyResult, call_flushed_at: u64) -> Option<u64> {
        let Some((state, cold)) = self.keys.probe_both(probe) else {
            self.counters.stale_results_dropped += 1;
            return None;
        };
        let status = state.status();
        if !status.is(Phase::Probing) {
            // Forgotten, re-probed, or forced to miss while in flight:
            // mark_miss wins.
            self.counters.stale_results_dropped += 1;
            return None;
        }
        if let KeyResult::Answer(present) = result {
            self.counters.hits += u64::from(present);
            self.counters.misses += u64::from(!present);
        }
        if status.orphan() {
            // Retained only for this answer; nobody is asking any more.
            self.keys.remove(probe.0);
            return Some(0);
        }
        let timed = if status.revalidating() {
            0
        } else if call_flushed_at != 0 {
            call_flushed_at
        } else {
            cold.time
        };
        match result {
            KeyResult::Answer(present) => state.set_answer(present),
            KeyResult::Failed { retry_at } => self.keys.set_failed(probe.0, retry_at),
        }
        Some(timed)
    }

    /// Times out every key still waiting for a call a whole call timeout
    /// after the flush that queued it.
    pub(super) fn expire_queued(&mut self, now: Instant) {
        let now_ticks = ticks(self.epoch, now);
        let retry_at = ticks(self.epoch, now + self.failure_backoff);
        while let Some((flushed_at, group)) = self.ready.next_expired(now_ticks) {
            let mut first_verdicts = 0;
            for &probe in &group.probes {
                // Still queued since this flush (a key queued by a later
                // flush, topping up the group, has a deadline of its own).
                let Some((state, cold)) = self.keys.probe_both(probe) else {
                    continue;
                };
                if state.status().is(Phase::Queued) && cold.time == flushed_at {
                    first_verdicts += u64::from(!state.status().revalidating());
                    self.keys.set_failed(probe.0, retry_at);
                    self.counters.timeouts += 1;
                }
            }
            self.counters
                .record_verdict_times(flushed_at, now_ticks, first_verdicts, None);
        }
    }
}

/// Keys of a queued group's call that were flushed at the same time, in a
/// row (a group's keys come mostly from one flush): their times to verdict
/// are one sample recorded `count` times, written once per run instead of
/// once per key.
#[derive(Default)]
struct FlushRun {
    /// The flush time (ticks plus one; 0: none) of the keys in the run.
    flushed_at: u64,
    count: u64,
}

impl FlushRun {
    /// Adds a key flushed at `flushed_at`, recording the run before it if
    /// that one was flushed at another time.
    #[inline]
    fn add(
        &mut self,
        counters: &mut Counters,
        flushed_at: u64,
        now_ticks: u64,
        span: Option<CallSpan>,
    ) {
        if flushed_at != self.flushed_at {
            self.record(counters, now_ticks, span);
            self.flushed_at = flushed_at;
        }
        self.count += 1;
    }

    /// Records the run (nothing for an empty one) and empties it.
    #[inline]
    fn record(&mut self, counters: &mut Counters, now_ticks: u64, span: Option<CallSpan>) {
        counters.record_verdict_times(self.flushed_at, now_ticks, self.count, span);
        self.count = 0;
    }
}
