//! The ledger's flush: the batch's runs become calls handed out at once or
//! groups in the ready queue, and a group's call is handed out.

use std::time::Instant;

use super::batch::BatchRun;
use super::outstanding::OutstandingCall;
use super::table::{Phase, Probe};
use super::{Ledger, TierCall, ticks};
use crate::key::{OffloadKey, ReqContext};

/// The times of one flush.
#[derive(Debug, Clone, Copy)]
struct FlushTimes {
    now: Instant,
    /// `now` in ticks plus one (0 stands for "no flush time").
    flushed_at: u64,
    /// When a key this flush queues times out, in ticks.
    queue_deadline: u64,
}

/// What one flush makes of its runs: the step it opens.
#[derive(Debug, Clone, Copy, Default)]
struct StepMade {
    /// Groups queued and calls handed out.
    groups: usize,
    /// Whether a call was handed out.
    started: bool,
}

impl Ledger {
    /// `flush`, handing each run's call out directly while `start` is
    /// given, no group waits and the limits allow (see `flush_and_start`).
    pub(super) fn flush_runs(&mut self, now: Instant, mut start: Option<&mut Vec<TierCall>>) {
        self.counters.settle();
        if self.batch.is_empty() {
            return;
        }
        let times = FlushTimes {
            now,
            flushed_at: ticks(self.epoch, now) + 1,
            queue_deadline: ticks(self.epoch, now + self.call_timeout),
        };
        // Every probe of the batch is now flushed: those of runs started
        // below stay `Probing`, now in flight; the others are queued.
        let flushed = self.batch.take(self.next_generation);
        if flushed.interleaved {
            // A request's runs are merged into one group (see `queue_run`).
            start = None;
        }
        let mut step = StepMade::default();
        for run in flushed.runs {
            match start.as_deref_mut() {
                Some(calls) if self.starts_at_once(&run, step.started) => {
                    if let Some(call) = self.start_run(run, flushed.dirty, times) {
                        step.started = true;
                        step.groups += 1;
                        calls.push(call);
                    }
                }
                _ => step.groups += self.queue_run(run, times),
            }
        }
        self.steps.open(step.groups, step.started);
    }

    /// Whether `run`'s call is handed out right at the flush: `next_call`
    /// would start it right after, as nothing waits ahead of it, no later
    /// run of the request would join it, and the limits allow a call.
    #[inline]
    fn starts_at_once(&self, run: &BatchRun, step_started: bool) -> bool {
        self.ready.is_empty()
            && run.probes.len() <= self.max_keys_per_call
            && self.may_start_call(step_started)
    }

    /// Hands out the call of one flushed run, its probes and keys as they
    /// are: its keys stay `Probing`, now in flight, with no pass over them.
    /// When the batch is `dirty` the keys still waiting for this flush are
    /// picked out first (the others were cleaned up or forced to miss since
    /// their lookup). `None` if none is left.
    fn start_run(&mut self, run: BatchRun, dirty: bool, times: FlushTimes) -> Option<TierCall> {
        let (mut probes, mut keys) = (run.probes, run.keys);
        if dirty {
            self.drop_stale(&mut probes, &mut keys);
            if probes.is_empty() {
                self.batch.recycle(probes);
                return None;
            }
        }
        if let Some(request) = self.requests.live_mut(run.request) {
            // Nothing waits in the ready queue: a recorded group is gone.
            request.queued_group = None;
        }
        self.ready.skip_seq();
        let step = self.steps.next();
        Some(self.hand_out(step, probes, keys, run.ctx, times.now, times.flushed_at))
    }

    /// Queues the keys of `run` still waiting for this flush (a key may
    /// have been cleaned up or forced to miss since): first topping up the
    /// request's group still waiting, then in new groups of at most
    /// `max_keys_per_call` keys. A group keeps the probes only: its call
    /// copies the keys when it starts. Returns the number of new groups.
    fn queue_run(&mut self, run: BatchRun, times: FlushTimes) -> usize {
        let mut probes = run.probes;
        self.mark_queued(&mut probes, times.flushed_at);
        if probes.is_empty() {
            return 0;
        }
        let max = self.max_keys_per_call;
        let request = self.requests.live_mut(run.request);
        if let Some(seq) = request.as_ref().and_then(|r| r.queued_group) {
            let (deadline, flushed_at) = (times.queue_deadline, times.flushed_at);
            self.ready
                .top_up(seq, run.request, &mut probes, max, deadline, flushed_at);
        }
        let (groups, last_seq) = self.ready.push_groups(
            self.steps.next(),
            run.request,
            &run.ctx,
            probes,
            max,
            times.queue_deadline,
            times.flushed_at,
        );
        if let (Some(seq), Some(request)) = (last_seq, request) {
            request.queued_group = Some(seq);
        }
        groups
    }

    /// Moves each key of `probes` still waiting for the flush to `Queued`,
    /// flushed at `flushed_at`; `probes` keeps those only.
    fn mark_queued(&mut self, probes: &mut Vec<Probe>, flushed_at: u64) {
        let (keys, queued) = (&mut self.keys, &mut self.ready.keys);
        probes.retain(|&probe| {
            let Some((state, cold)) = keys.probe_both(probe) else {
                return false;
            };
            if !state.status().is(Phase::Probing) {
                return false;
            }
            state.set_phase(Phase::Queued);
            cold.time = flushed_at;
            *queued += 1;
            true
        });
    }

    /// Keeps the probes (and their keys, in the parallel list) whose key is
    /// still in phase `Probing` under the probe's generation.
    #[cold]
    fn drop_stale(&mut self, probes: &mut Vec<Probe>, keys: &mut Vec<OffloadKey>) {
        let mut kept = 0;
        for i in 0..probes.len() {
            let probe = probes[i];
            if self
                .keys
                .probe_both(probe)
                .is_some_and(|(state, _)| state.status().is(Phase::Probing))
            {
                probes[kept] = probe;
                keys.swap(kept, i);
                kept += 1;
            }
        }
        probes.truncate(kept);
        keys.truncate(kept);
    }

    /// Moves each key of a queued group's `probes` still queued to in
    /// flight and copies it into the call's key list, in one pass; `probes`
    /// keeps those keys only. `None` if none was left.
    pub(super) fn move_in_flight(&mut self, probes: &mut Vec<Probe>) -> Option<Vec<OffloadKey>> {
        let mut keys = Vec::with_capacity(probes.len());
        let mut kept = 0;
        for i in 0..probes.len() {
            let probe = probes[i];
            if let Some((state, _)) = self.keys.probe_both(probe)
                && state.status().is(Phase::Queued)
            {
                state.set_phase(Phase::Probing);
                keys.push(state.key.clone());
                probes[kept] = probe;
                kept += 1;
            }
        }
        probes.truncate(kept);
        (kept > 0).then_some(keys)
    }

    /// Whether the limits allow one more call, of a step that has
    /// (`step_started`) or has not started a call yet.
    #[inline]
    pub(super) fn may_start_call(&self, step_started: bool) -> bool {
        self.calls.has_room() && self.steps.admits(step_started)
    }

    /// Records a call of step `step` handed out at `now`, whose keys were
    /// flushed at `flushed_at` (0: each at its own, see `OutstandingCall`).
    pub(super) fn hand_out(
        &mut self,
        step: u64,
        probes: Vec<Probe>,
        keys: Vec<OffloadKey>,
        ctx: ReqContext,
        now: Instant,
        flushed_at: u64,
    ) -> TierCall {
        let call = OutstandingCall {
            step,
            probes,
            flushed_at,
        };
        let (id, deadline) = self.calls.hand_out(call, now);
        self.counters.calls_started += 1;
        TierCall {
            id,
            keys,
            ctx,
            deadline,
        }
    }
}
