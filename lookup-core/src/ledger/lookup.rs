//! The ledger's lookup beyond its common case: a new key, a new or
//! switching request, a reference taken, a failed key's re-check.

use super::slab::Slot;
use super::table::{KeyCold, KeyEntry, Phase, Probe, next_generation};
use super::{LazyNow, Ledger, LookupVerdict, ticks};
use crate::error::LookupError;
use crate::key::{OffloadKey, ReqContext};

impl Ledger {
    #[cold]
    pub(super) fn invalid_key(&self, len: usize) -> LookupError {
        LookupError::InvalidKey {
            len,
            min: self.min_key_len,
            max: self.max_key_len,
        }
    }

    /// `lookup` for every case but the common one: `found` is the key's
    /// slot, if it is tracked.
    #[inline(never)]
    pub(super) fn lookup_slow(
        &mut self,
        key: &OffloadKey,
        found: Option<Slot>,
        ctx: &ReqContext,
        now: &mut LazyNow,
    ) -> LookupVerdict {
        self.counters.lookups += 1;
        let Some((request, serial)) = self.request(ctx) else {
            // 2^32 live requests: not reachable in practice, never a panic.
            self.counters.deferred += 1;
            return LookupVerdict::Pending;
        };
        match found {
            Some(slot) => self.lookup_tracked(slot, request, serial, false, ctx, now),
            None => self.lookup_new(key, request, serial, ctx),
        }
    }

    /// `lookup` of a key not tracked yet: a new entry created by the
    /// request, and its first probe in the flush batch; pending either way.
    #[inline(always)]
    fn lookup_new(
        &mut self,
        key: &OffloadKey,
        request: Slot,
        serial: u32,
        ctx: &ReqContext,
    ) -> LookupVerdict {
        if self.batch.len + self.ready.keys >= self.max_queued_keys {
            self.counters.deferred += 1;
            return LookupVerdict::Pending;
        }
        let generation = self.next_generation;
        let Some(slot) = self.keys.insert(key.prehash(), KeyCold::NEW, || {
            KeyEntry::new(key.clone(), generation, serial)
        }) else {
            self.counters.deferred += 1;
            return LookupVerdict::Pending;
        };
        self.next_generation = next_generation(generation);
        self.push_probe(request, serial, ctx, (slot, generation), key);
        self.requests.add_created(request, slot);
        LookupVerdict::Pending
    }

    /// `lookup` of the tracked key at `slot` by the request at `request`
    /// (serial `serial`): takes the request's reference if the key's marks
    /// do not show it holds one, then answers from the entry. `not_held`:
    /// the caller found neither mark nor the request's cursor naming it.
    #[inline(never)]
    pub(super) fn lookup_tracked(
        &mut self,
        slot: Slot,
        request: Slot,
        serial: u32,
        not_held: bool,
        ctx: &ReqContext,
        now: &mut LazyNow,
    ) -> LookupVerdict {
        let Some((state, cold)) = self.keys.get_both(slot) else {
            return LookupVerdict::Pending; // unreachable: `find` returned it
        };
        let mut compact = false;
        if state.last_req != serial {
            state.last_req = serial;
            if state.creator != serial
                && let Some(due) = self.requests.share(request, slot, not_held)
            {
                cold.refs += 1;
                // Referred to again: not kept only for its answer any more.
                state.set_orphan(false);
                compact = due;
            }
        }
        let verdict = state.verdict();
        if compact {
            self.compact_request(request);
        }
        match verdict {
            Some(verdict) => verdict,
            None => self.lookup_failed(slot, request, serial, ctx, now),
        }
    }

    /// Compacts the shared references of the request at `request`.
    #[cold]
    fn compact_request(&mut self, request: Slot) {
        if let Some(req) = self.requests.get_mut(request) {
            req.shared.compact(&mut self.keys);
        }
    }

    /// A lookup of a key in phase `Failed`: miss, and past the back-off a
    /// new probe under a new generation (the failure was never the truth),
    /// answering miss meanwhile: a request that met the failure does not
    /// wait a second time.
    #[cold]
    fn lookup_failed(
        &mut self,
        slot: Slot,
        request: Slot,
        serial: u32,
        ctx: &ReqContext,
        now: &mut LazyNow,
    ) -> LookupVerdict {
        let now_ticks = ticks(self.epoch, now.get());
        let generation = self.next_generation;
        let Some((state, cold)) = self.keys.get_both(slot) else {
            return LookupVerdict::Miss;
        };
        if now_ticks >= cold.time {
            self.next_generation = next_generation(generation);
            state.set_generation(generation);
            state.set_phase(Phase::Probing);
            state.set_revalidating(true);
            cold.time = 0;
            let key = state.key.clone();
            self.push_probe(request, serial, ctx, (slot, generation), &key);
        }
        LookupVerdict::Miss
    }

    /// Adds a probe of `key` by the request at `request` to the flush
    /// batch; a run the request starts is noted on it, and its second run
    /// in one batch makes the batch interleaved (see `Batch::interleaved`).
    #[inline(always)]
    fn push_probe(
        &mut self,
        request: Slot,
        serial: u32,
        ctx: &ReqContext,
        probe: Probe,
        key: &OffloadKey,
    ) {
        if self.batch.push(request, serial, ctx, probe, key)
            && let Some(req) = self.requests.get_mut(request)
        {
            if req.batch_epoch == self.batch.epoch {
                self.batch.interleaved = true;
            }
            req.batch_epoch = self.batch.epoch;
        }
    }

    /// The request's slot and serial, registering a request seen for the
    /// first time; `None` only if 2^32 requests are live.
    fn request(&mut self, ctx: &ReqContext) -> Option<(Slot, u32)> {
        if let Some(found) = self.requests.find(ctx) {
            return Some(found);
        }
        if self.requests.serials_exhausted() {
            self.renumber_requests();
        }
        self.requests.register(ctx)
    }

    /// Gives the live requests the serials 0, 1, …, when 32-bit serials ran
    /// out (once every 2^32 requests): every key forgets its request marks
    /// (the next ask checks membership again, which is always correct), and
    /// the flush batch and the ready queue follow the new serials.
    #[cold]
    fn renumber_requests(&mut self) {
        let renumbered = self.requests.renumber();
        let renumber = |request: &mut (Slot, u32)| {
            request.1 = renumbered
                .get(&request.1)
                .copied()
                .unwrap_or(super::table::NO_REQUEST);
        };
        self.batch
            .runs
            .iter_mut()
            .map(|run| &mut run.request)
            .for_each(&renumber);
        self.ready.requests_mut().for_each(&renumber);
        self.keys.forget_request_marks();
    }

    /// Starts request serials at `serial`, to test their wrap-around.
    #[cfg(test)]
    pub(super) fn set_next_serial(&mut self, serial: u32) {
        self.requests.set_next_serial(serial);
    }
}
