//! The tier calls the ledger has handed out and whose outcome it has not
//! applied yet, with their deadlines and the limit on how many there are.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use super::FastMap;
use super::call::CallId;
use super::table::Probe;

/// A call handed out: what its outcome applies to.
#[derive(Debug)]
pub(super) struct OutstandingCall {
    /// The step whose group the call carries (see `Steps`).
    pub(super) step: u64,
    pub(super) probes: Vec<Probe>,
    /// When the flush that submitted every key of the call happened, in
    /// ticks plus one, for the time to verdict; 0 for a call of a queued
    /// group, whose keys each keep theirs (`KeyCold::time`).
    pub(super) flushed_at: u64,
}

/// The calls handed out and not yet answered, failed or timed out.
///
/// Invariant: every outstanding call has its deadline in `deadlines`, which
/// are in hand-out order and so in deadline order (every call gets the same
/// timeout); entries of calls that ended are dropped lazily, and never
/// outnumber the outstanding calls by more than twice plus 64 after
/// [`compact`](Self::compact).
#[derive(Debug)]
pub(super) struct OutstandingCalls {
    calls: FastMap<CallId, OutstandingCall>,
    deadlines: VecDeque<(Instant, CallId)>,
    next_id: u64,
    timeout: Duration,
    /// At most this many calls are outstanding at once.
    max: usize,
}

impl OutstandingCalls {
    pub(super) fn new(timeout: Duration, max: usize) -> Self {
        Self {
            calls: FastMap::default(),
            deadlines: VecDeque::new(),
            next_id: 0,
            timeout,
            max: max.max(1),
        }
    }

    /// Lets up to `max` calls be outstanding at once.
    pub(super) fn set_max(&mut self, max: usize) {
        self.max = max.max(1);
    }

    /// Whether one more call may be handed out.
    #[inline]
    pub(super) fn has_room(&self) -> bool {
        self.calls.len() < self.max
    }

    /// Records `call`, handed out at `now`: its id and deadline.
    #[inline]
    pub(super) fn hand_out(&mut self, call: OutstandingCall, now: Instant) -> (CallId, Instant) {
        let id = CallId(self.next_id);
        self.next_id += 1;
        let deadline = now + self.timeout;
        self.calls.insert(id, call);
        self.deadlines.push_back((deadline, id));
        (id, deadline)
    }

    /// Removes call `id`, whose outcome is being applied; `None` if it is
    /// not outstanding (it ended already).
    #[inline]
    pub(super) fn finish(&mut self, id: CallId) -> Option<OutstandingCall> {
        self.calls.remove(&id)
    }

    /// The next outstanding call whose deadline is `now` or earlier, taken
    /// off the deadline queue (its outcome is for the caller to apply).
    pub(super) fn next_expired(&mut self, now: Instant) -> Option<CallId> {
        while let Some(&(deadline, id)) = self.deadlines.front() {
            if deadline > now {
                return None;
            }
            self.deadlines.pop_front();
            if self.calls.contains_key(&id) {
                return Some(id);
            }
        }
        None
    }

    /// Drops the deadlines of calls that ended, when they outnumber the
    /// outstanding calls (ended calls' entries otherwise leave only as
    /// their deadlines pass).
    pub(super) fn compact(&mut self) {
        if self.deadlines.len() > 2 * self.calls.len() + 64 {
            let calls = &self.calls;
            self.deadlines.retain(|(_, id)| calls.contains_key(id));
        }
    }

    /// The earliest deadline of an outstanding call.
    pub(super) fn next_deadline(&self) -> Option<Instant> {
        self.deadlines
            .iter()
            .find(|(_, id)| self.calls.contains_key(id))
            .map(|&(deadline, _)| deadline)
    }

    /// The ids of every outstanding call.
    pub(super) fn ids(&self) -> Vec<CallId> {
        self.calls.keys().copied().collect()
    }

    /// Keys in outstanding calls.
    pub(super) fn keys(&self) -> usize {
        self.calls.values().map(|c| c.probes.len()).sum()
    }

    #[inline]
    pub(super) fn len(&self) -> usize {
        self.calls.len()
    }

    #[inline]
    pub(super) fn is_empty(&self) -> bool {
        self.calls.is_empty()
    }
}
