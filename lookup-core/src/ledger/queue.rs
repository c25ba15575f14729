//! The ready queue: flushed keys waiting for a call slot, in groups of one
//! request each, and the deadlines by which each flush's keys must leave it.

use std::collections::VecDeque;

use super::slab::Slot;
use super::table::Probe;
use crate::key::ReqContext;

/// Keys of one request waiting for one call.
#[derive(Debug)]
pub(super) struct Group {
    pub(super) seq: u64,
    /// The step whose flush queued the group (see `Steps`).
    pub(super) step: u64,
    /// The request's slot and serial in the registry, as in a batch run.
    pub(super) request: (Slot, u32),
    pub(super) ctx: ReqContext,
    pub(super) probes: Vec<Probe>,
}

/// A deadline of the keys one flush queued in one group.
#[derive(Debug, Clone, Copy)]
struct QueueDeadline {
    /// When the keys time out, in ticks.
    at: u64,
    /// The flush that queued them, in ticks plus one: the keys it covers
    /// are those of the group still queued with this flush time.
    flushed_at: u64,
    seq: u64,
}

/// The groups waiting for a call, in the order their calls start.
///
/// Invariant: the groups have consecutive sequence numbers from front to
/// back (so one is found by its number without a search), and every flush
/// that queued keys in a group left one deadline for them in `deadlines`,
/// in flush order: a key still waiting at its deadline times out, so a
/// saturated or hung tier cannot make keys wait unbounded.
#[derive(Debug, Default)]
pub(super) struct ReadyQueue {
    groups: VecDeque<Group>,
    next_seq: u64,
    /// Probes in the groups (those whose key left phase `Queued` included,
    /// until their group starts).
    pub(super) keys: usize,
    /// One entry per group and flush, not per key.
    deadlines: VecDeque<QueueDeadline>,
}

impl ReadyQueue {
    /// The group with sequence number `seq`, if it waits.
    #[inline]
    fn position(&self, seq: u64) -> Option<usize> {
        let front = self.groups.front()?.seq;
        let idx = usize::try_from(seq.checked_sub(front)?).ok()?;
        (self.groups.get(idx)?.seq == seq).then_some(idx)
    }

    /// The number a queued group would take, taken by a run whose call a
    /// flush starts at once: later groups are numbered as if it had been
    /// queued and started.
    #[inline]
    pub(super) fn skip_seq(&mut self) {
        self.next_seq += 1;
    }

    /// Moves what fits of `probes`, flushed at `flushed_at` with deadline
    /// `deadline`, into group `seq` of `request` if it still waits, up to
    /// `max` probes in the group.
    pub(super) fn top_up(
        &mut self,
        seq: u64,
        request: (Slot, u32),
        probes: &mut Vec<Probe>,
        max: usize,
        deadline: u64,
        flushed_at: u64,
    ) {
        let Some(group) = self
            .position(seq)
            .and_then(|idx| self.groups.get_mut(idx))
            .filter(|g| g.request == request)
        else {
            return;
        };
        let take = max.saturating_sub(group.probes.len()).min(probes.len());
        if take > 0 {
            group.probes.extend(probes.drain(..take));
            self.deadlines.push_back(QueueDeadline {
                at: deadline,
                flushed_at,
                seq,
            });
        }
    }

    /// Queues `probes` in new groups of at most `max` probes (the first
    /// reuses the vector); returns how many, and the last one's number.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn push_groups(
        &mut self,
        step: u64,
        request: (Slot, u32),
        ctx: &ReqContext,
        mut probes: Vec<Probe>,
        max: usize,
        deadline: u64,
        flushed_at: u64,
    ) -> (usize, Option<u64>) {
        let mut groups = 0;
        let mut last_seq = None;
        while !probes.is_empty() {
            let rest = if probes.len() > max {
                probes.split_off(max)
            } else {
                Vec::new()
            };
            let seq = self.next_seq;
            self.next_seq += 1;
            last_seq = Some(seq);
            self.deadlines.push_back(QueueDeadline {
                at: deadline,
                flushed_at,
                seq,
            });
            self.groups.push_back(Group {
                seq,
                step,
                request,
                ctx: ctx.clone(),
                probes,
            });
            groups += 1;
            probes = rest;
        }
        (groups, last_seq)
    }

    /// The group whose call starts next.
    #[inline]
    pub(super) fn front(&self) -> Option<&Group> {
        self.groups.front()
    }

    /// Takes the front group off the queue (its probes no longer count in
    /// [`keys`](Self::keys)).
    #[inline]
    pub(super) fn pop_front(&mut self) -> Option<Group> {
        let group = self.groups.pop_front()?;
        self.keys = self.keys.saturating_sub(group.probes.len());
        Some(group)
    }

    /// The next deadline passed at `now_ticks` whose group still waits:
    /// the flush time of the keys it covers and their group. Deadlines of
    /// groups that started are dropped on the way.
    pub(super) fn next_expired(&mut self, now_ticks: u64) -> Option<(u64, &Group)> {
        while let Some(&QueueDeadline {
            at,
            flushed_at,
            seq,
        }) = self.deadlines.front()
        {
            let waiting = self.position(seq);
            if waiting.is_some() && at > now_ticks {
                return None;
            }
            // Expired, or stale (the group started): either way the entry
            // goes, which keeps the queue as short as the groups waiting.
            self.deadlines.pop_front();
            if let Some(idx) = waiting {
                return Some((flushed_at, self.groups.get(idx)?));
            }
        }
        None
    }

    /// Gives memory back after a backlog drained.
    pub(super) fn shrink(&mut self) {
        if self.deadlines.capacity() > 4 * self.deadlines.len().max(1024) {
            self.deadlines.shrink_to(2 * self.deadlines.len().max(1024));
        }
    }

    /// The request slot and serial of every group, to renumber.
    pub(super) fn requests_mut(&mut self) -> impl Iterator<Item = &mut (Slot, u32)> {
        self.groups.iter_mut().map(|g| &mut g.request)
    }

    #[inline]
    pub(super) fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }
}
