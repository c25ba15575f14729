//! The manager's state machine, without threads or clocks ("sans-IO"):
//! the API for custom transports.
//!
//! [`Ledger`] holds every key's lookup state and decides what to probe; it
//! never calls a tier and never reads the clock: time comes in as an
//! argument. [`AsyncLookupManager`](crate::AsyncLookupManager) drives it from
//! the scheduler thread and carries its [`TierCall`]s to a worker. Anything
//! else that can carry a call and bring its answer back can drive it the same
//! way: an event loop of your own, a binding with its own runtime, a
//! simulation, a test delivering results late, twice or out of order.
//!
//! # Driving it yourself
//!
//! The loop a transport runs: look keys up, [`flush`](Ledger::flush) once per
//! scheduler step, start every call [`next_call`](Ledger::next_call) hands
//! out, [`complete`](Ledger::complete) each with its outcome, and call
//! [`expire`](Ledger::expire) now and then so a call that never answers
//! resolves at its deadline. [`flush_and_start`](Ledger::flush_and_start)
//! is a flush followed by every `next_call` at the same instant, in less
//! work: what the manager runs at each step.
//!
//! ```
//! use std::time::{Duration, Instant};
//! use kvtier_core::ledger::{CallOutcome, LazyNow, Ledger};
//! use kvtier_core::{LookupVerdict, ManagerConfig, OffloadKey, ReqContext};
//!
//! let now = Instant::now();
//! let mut ledger = Ledger::new(&ManagerConfig::named("my-transport"), now);
//! let ctx = ReqContext::new("req-1");
//! let (cached, cold) = (OffloadKey::new(&[1; 36]), OffloadKey::new(&[2; 36]));
//!
//! // The scheduler asks; nothing is known yet.
//! for key in [&cached, &cold] {
//!     assert_eq!(ledger.lookup(key, &ctx, &mut LazyNow::at(now))?, LookupVerdict::Pending);
//! }
//! ledger.flush(now);
//!
//! // The transport: carry each call to the tier (here, answered in place)
//! // and hand the outcome back with the call's id.
//! while let Some(call) = ledger.next_call(now) {
//!     assert_eq!(call.ctx.req_id(), "req-1");
//!     let found = call.keys.iter().map(|k| *k == cached).collect();
//!     ledger.complete(call.id, CallOutcome::Answered(found), Duration::from_micros(50), now);
//! }
//!
//! // The next step answers from the ledger.
//! let mut later = LazyNow::at(now + Duration::from_millis(1));
//! assert_eq!(ledger.lookup(&cached, &ctx, &mut later)?, LookupVerdict::Hit);
//! assert_eq!(ledger.lookup(&cold, &ctx, &mut later)?, LookupVerdict::Miss);
//! ledger.cleanup("req-1");
//! assert!(ledger.is_empty());
//! # Ok::<(), kvtier_core::LookupError>(())
//! ```
//!
//! The ledger identifies a block by its key bytes alone, across requests:
//! two requests asking for the same bytes share one probe and one verdict.
//! Keys of different tenants must therefore differ in their bytes; see
//! [`ReqContext`].
//!
//! # Why it is correct without locks
//!
//! The ledger is owned by one thread (`&mut self` on every method), so the
//! reference's "ownership instead of locks" is enforced by the compiler.
//! Everything that crosses threads is a value: a [`TierCall`] going out, a
//! [`CallOutcome`] coming back.
//!
//! # Key lifecycle
//!
//! ```text
//!  lookup (new key)            flush_and_start (room for the call)          complete
//! ───────────────▶ Probing ─────────────────────────────────▶ Probing ──────▶ Present | Absent
//!   (in the flush batch)  │ flush (no room)          ▲ next_call (in flight) │ error, wrong length,
//!                         └──────────▶ Queued ───────┘                       │ deadline
//!                                                                            └─▶ Failed ──(back-off, lookup)──▶ Probing
//!   mark_miss, from any phase ──▶ ForcedMiss (a later answer is dropped)
//! ```
//!
//! A key in `Probing` waits for the flush if its generation is the ledger's
//! batch generation or later (the first generation handed out since the
//! last flush), and is in a running call otherwise: a flush that starts a
//! request's call at once hands its keys over without visiting them.
//!
//! - **Generations.** Every probe of a key gets a fresh generation number; a
//!   result is applied only if the key still has that generation and is in
//!   flight. A late answer for a key that was cleaned up and looked up again,
//!   re-probed, or forced to miss is dropped and counted.
//! - **Enqueue once.** A key enters a tier call at most once per generation:
//!   a flush takes the probes looked up since the last one, and only a
//!   `Queued` key is sent by `next_call`. A probe of the flush batch whose
//!   key was forgotten or forced to miss before the flush marks the batch
//!   dirty, and that flush checks every key before sending it.
//! - **In-flight retention.** `cleanup` releases a request's references; a
//!   key left without references is forgotten unless its probe is running,
//!   in which case it stays until the answer lands, so a new request can
//!   share the running probe. The answer then frees it.
//! - **Failures are not truth.** A failed or timed-out probe answers miss
//!   (the safe choice for a scheduler) but is counted apart and probed again
//!   by the first lookup after `failure_backoff`, in the background: the key
//!   keeps answering miss until the new probe lands, so a failing tier never
//!   makes a request wait twice.
//! - **Bounded waits.** A flushed key is answered within two call timeouts:
//!   one waiting for a free call slot, one in the call.
//! - **`mark_miss` wins.** After a failed load the scheduler forces a miss;
//!   no later answer can turn it back into a hit (the livelock of vLLM #49176).
//! - **Time to verdict** runs from the flush that submitted a key to the
//!   moment its first answer (or failure) is applied, which is when any
//!   lookup of it can return the verdict: the manager applies answers at
//!   the first lookup, flush or drain after they arrive. One histogram
//!   update per call the flush started (one per key for a call of a
//!   queued group), nothing per lookup. A re-check after a failure is
//!   not timed (its requests had their miss), nor an answer nobody waits
//!   for any more.
//!
//! # Layout
//!
//! Every tracked key lives in one slab entry with a stable index ("slot",
//! `slab.rs`). The only hash probe is `lookup`'s (and `mark_miss`'s), in an
//! index of slots keyed by the key's precomputed hash (`index.rs`): chunks
//! of one cache line, twelve one-byte tags beside their twelve slots, so a
//! lookup reads one line of the index and then the entry. Removal leaves
//! no tombstone (each chunk counts the keys that overflowed past it, as in
//! folly's F14), so the scheduler's churn leaves nothing behind to lengthen
//! a search. An entry is split in two: the hot part is one 64-byte,
//! cache-line-aligned value (`table.rs`): the key, a word holding the
//! probe's 56-bit generation and the status byte (phase, "revalidating",
//! "orphan"), and the serials of the request that last took or showed a
//! reference and of the one that created the key, so the lookup of a key
//! by its creator, or by the request that asked last, reads nothing else.
//! The cold part (reference count, queue or retry time) sits in a
//! parallel array of the same fixed-size segment (one segment lookup
//! reaches both), read only when a request first refers to a key, when a
//! key is queued or fails, and at cleanup: an answer to a call the flush
//! started reads the hot part only (a key nobody refers to any more is
//! marked orphan there).
//! Everything downstream (the flush batch and the queued groups of
//! `batch.rs`, running calls, a request's references) holds
//! `(slot, generation)` pairs and reaches the entry by index; the
//! generation check makes a pair whose slot was freed or reused harmless.
//! A run of the flush batch keeps its keys too, copied at their lookup, so
//! the call a flush starts at once takes that list as it is: between a
//! key's lookup and its answer, nothing walks it. Queue deadlines are kept
//! per group and flush, not per key. The vectors of a step (a request's
//! run of probes and of keys, which the manager's worker gives back
//! emptied, and its lists of created and shared keys) are recycled, so a
//! steady step loop allocates nothing per request. The request of the
//! previous lookup is known by the address of its id's `Arc`, and a
//! request switch finds a registered request by that address, so neither
//! reads the id string. The values that cross to a transport
//! ([`TierCall`], [`CallOutcome`], [`LazyNow`]) are in `call.rs`.

mod batch;
mod call;
mod counters;
mod index;
mod outstanding;
mod requests;
mod slab;
mod steps;
mod table;
#[cfg(test)]
mod tests;

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::ManagerConfig;
use crate::error::{LookupError, TierError, TierErrorKind};
use crate::key::{OffloadKey, ReqContext};
use crate::stats::ManagerStats;

/// The verdict types, also here for code that names them by this path.
pub use crate::verdict::{LookupVerdict, PrefixVerdict};
use batch::{Batch, Group};
pub use call::{CallId, CallOutcome, LazyNow, TierCall};
use counters::{Counters, Gauges};
use outstanding::{OutstandingCall, OutstandingCalls};
use requests::{Requests, id_address};
use slab::Slot;
use steps::Steps;
use table::{
    KeyCold, KeyEntry, KeyTable, NO_REQUEST, Phase, Probe, generation_before, next_generation,
};

type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// Nanoseconds from `epoch` to `t` (0 for earlier times); 584 years fit.
fn ticks(epoch: Instant, t: Instant) -> u64 {
    u64::try_from(t.saturating_duration_since(epoch).as_nanos()).unwrap_or(u64::MAX)
}

/// What a call says of one of its keys (see `Ledger::resolve`).
#[derive(Debug, Clone, Copy)]
enum KeyResult {
    /// The tier answered: the key is present or not.
    Answer(bool),
    /// The call failed or timed out: probe again from `retry_at` (ticks).
    Failed { retry_at: u64 },
}

/// The manager's state machine; see the [module docs](self).
#[derive(Debug)]
pub struct Ledger {
    tier: Arc<str>,
    max_key_len: usize,
    call_timeout: Duration,
    failure_backoff: Duration,
    max_queued_keys: usize,
    max_keys_per_call: usize,

    /// Times are kept as nanoseconds since this instant ("ticks"): 8 bytes
    /// instead of 16 in every key's state.
    epoch: Instant,
    keys: KeyTable,
    requests: Requests,
    next_generation: u64,

    batch: Batch,
    /// The generation of the first probe the flush batch may hold: a key in
    /// phase `Probing` with a generation below it was flushed and its call
    /// started (it is in flight), one at or above it waits for the flush.
    batch_generation: u64,
    /// Whether a probe of the flush batch went stale since it was pushed
    /// (its key forgotten by a cleanup or forced to miss): the flush then
    /// checks each key before handing it to a call.
    batch_dirty: bool,
    ready: VecDeque<Group>,
    next_group_seq: u64,
    queued_keys: usize,

    /// (deadline in ticks, flush time in ticks plus one, group sequence
    /// number) of every group a flush queued keys in, in flush order: a key
    /// still waiting for a call at its deadline resolves as a timeout, so a
    /// saturated or hung tier cannot make keys wait unbounded. One entry per
    /// group and flush, not per key: the keys an entry covers are those of
    /// its group still queued with that flush time.
    queue_deadlines: VecDeque<(u64, u64, u64)>,
    calls: OutstandingCalls,
    steps: Steps,

    counters: Counters,
}

impl Ledger {
    /// An empty ledger with the limits of `cfg` (assumed valid), whose
    /// clock starts at `now`: every time handed to it later is measured
    /// from `now` (an earlier one counts as `now`).
    pub fn new(cfg: &ManagerConfig, now: Instant) -> Self {
        Self {
            tier: Arc::from(cfg.tier_name.as_str()),
            max_key_len: cfg.max_key_len,
            call_timeout: cfg.call_timeout(),
            failure_backoff: cfg.failure_backoff(),
            max_queued_keys: cfg.max_queued_keys.max(1),
            max_keys_per_call: cfg.max_keys_per_call.max(1),
            epoch: now,
            keys: KeyTable::default(),
            requests: Requests::default(),
            next_generation: 0,
            batch: Batch::default(),
            batch_generation: 0,
            batch_dirty: false,
            ready: VecDeque::new(),
            next_group_seq: 0,
            queued_keys: 0,
            queue_deadlines: VecDeque::new(),
            calls: OutstandingCalls::new(cfg.call_timeout(), cfg.max_calls_in_flight),
            steps: Steps::new(cfg.max_steps_in_flight),
            counters: Counters::new(),
        }
    }

    /// The tier's name.
    pub fn tier_name(&self) -> &str {
        &self.tier
    }

    /// Answers one key for one request, registering the request's reference
    /// and, for a key never seen (or failed and past its back-off), adding it
    /// to the next flush.
    ///
    /// # Errors
    /// [`LookupError::InvalidKey`] for an empty key or one longer than `max_key_len`.
    #[inline(always)]
    pub fn lookup(
        &mut self,
        key: &OffloadKey,
        ctx: &ReqContext,
        now: &mut LazyNow,
    ) -> Result<LookupVerdict, LookupError> {
        let entry = self.keys.find_entry(key);
        let Some((found, state)) = entry else {
            // Only valid keys enter the table: a tracked key needs no check.
            let len = key.len();
            if len == 0 || len > self.max_key_len {
                return Err(self.invalid_key(len));
            }
            return Ok(self.lookup_slow(key, None, ctx, now));
        };
        // The common case, answered from the key's hot entry alone: the
        // same request as the previous lookup asks again for a key it
        // already holds.
        let last = self.requests.last;
        if last.id == id_address(ctx) {
            let (request, serial) = (last.slot, last.serial);
            self.counters.lookups += 1;
            // The key is held if its mark or its creator names this request
            // or, when another request asked for it since (requests that
            // share blocks take turns, so the mark names another one), if
            // it is the next one this request shares, in the order it asked
            // before, or the one it just asked for. The mark stays: it names
            // a request that holds the key too.
            let held = state.last_req == serial
                || state.creator == serial
                || self.requests.follows(request, found);
            if held && let Some(verdict) = state.verdict() {
                return Ok(verdict);
            }
            // A key it may not hold yet, or a failed probe's: no need to
            // find the request again, nor to ask its cursor twice.
            return Ok(self.lookup_tracked(found, request, serial, !held, ctx, now));
        }
        Ok(self.lookup_slow(key, Some(found), ctx, now))
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

    #[cold]
    fn invalid_key(&self, len: usize) -> LookupError {
        LookupError::InvalidKey {
            len,
            max: self.max_key_len,
        }
    }

    /// `lookup` for every case but the common one: `found` is the key's
    /// slot, if it is tracked.
    #[inline(never)]
    fn lookup_slow(
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

        let Some(slot) = found else {
            if self.batch.len + self.queued_keys >= self.max_queued_keys {
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
            return LookupVerdict::Pending;
        };
        self.lookup_tracked(slot, request, serial, false, ctx, now)
    }

    /// `lookup` of the tracked key at `slot` by the request at `request`
    /// (serial `serial`): takes the request's reference if the key's marks
    /// do not show it holds one, then answers from the entry. `not_held`:
    /// the caller found neither mark nor the request's cursor naming it.
    #[inline(never)]
    fn lookup_tracked(
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

    /// How many leading `keys` are hits, with vLLM's scan: a resolved miss
    /// ends the scan, and an unresolved key before it makes the answer
    /// pending. Every unresolved key up to the first miss is registered, so
    /// the whole prompt is probed in one round trip.
    ///
    /// # Errors
    /// [`LookupError::InvalidKey`] for the first invalid key met; keys before
    /// it stay registered.
    pub fn lookup_prefix(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
        now: &mut LazyNow,
    ) -> Result<PrefixVerdict, LookupError> {
        let mut hits = 0;
        let mut pending = false;
        for key in keys {
            match self.lookup(key, ctx, now)? {
                LookupVerdict::Hit => hits += 1,
                LookupVerdict::Miss => break,
                LookupVerdict::Pending => pending = true,
            }
        }
        Ok(if pending {
            PrefixVerdict::Pending
        } else {
            PrefixVerdict::Ready(hits)
        })
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
            request.1 = renumbered.get(&request.1).copied().unwrap_or(NO_REQUEST);
        };
        for run in &mut self.batch.runs {
            renumber(&mut run.request);
        }
        for group in &mut self.ready {
            renumber(&mut group.request);
        }
        self.keys.forget_request_marks();
    }

    /// Starts request serials at `serial`, to test their wrap-around.
    #[cfg(test)]
    fn set_next_serial(&mut self, serial: u32) {
        self.requests.set_next_serial(serial);
    }

    /// Starts probe generations at `generation` (modulo 2^56, their width),
    /// to test their wrap-around: a ledger that has handed out no probe yet
    /// behaves the same from any starting generation. Does nothing once a
    /// key is tracked.
    #[cfg(feature = "testkit")]
    #[doc(hidden)]
    pub fn start_generations_at(&mut self, generation: u64) {
        if self.is_empty() {
            self.next_generation = generation & table::GENERATION_MASK;
            self.batch_generation = self.next_generation;
        }
    }

    /// Moves the keys looked up since the last flush into per-request groups
    /// waiting for a tier call. A request that still has a group waiting
    /// gets the new keys added to it (up to `max_keys_per_call`), so a
    /// backlog coalesces instead of growing a call per step.
    pub fn flush(&mut self, now: Instant) {
        self.flush_runs(now, None);
    }

    /// [`flush`](Self::flush), then every call [`next_call`](Self::next_call)
    /// would hand out at the same `now`, appended to `calls`: the same
    /// calls, ids and state as those two, in less work. When no group was
    /// waiting before the flush, a request's keys that can start at once
    /// go from the flush batch straight into their call, in one pass over
    /// them, without being queued first; the rest are queued and started
    /// as `next_call` would.
    pub fn flush_and_start(&mut self, now: Instant, calls: &mut Vec<TierCall>) {
        self.flush_runs(now, Some(&mut *calls));
        while let Some(call) = self.next_call(now) {
            calls.push(call);
        }
    }

    /// `flush`, starting each run's call directly while `start` is given,
    /// no group waits and the limits allow (see `flush_and_start`).
    fn flush_runs(&mut self, now: Instant, mut start: Option<&mut Vec<TierCall>>) {
        self.counters.settle();
        if self.batch.is_empty() {
            return;
        }
        let step = self.steps.next();
        let flushed_at = ticks(self.epoch, now) + 1;
        let queue_deadline = ticks(self.epoch, now + self.call_timeout);
        let mut new_groups = 0usize;
        let mut step_started = false;
        let max = self.max_keys_per_call;
        let (runs, interleaved) = self.batch.take();
        // Every probe of the batch is now flushed: those of runs started
        // below stay `Probing`, now in flight; the others are queued.
        self.batch_generation = self.next_generation;
        let dirty = std::mem::take(&mut self.batch_dirty);
        if interleaved {
            // A request's runs are merged into one group (see below).
            start = None;
        }
        for run in runs {
            // Started at once if `next_call` would start it right after this
            // flush: nothing waits ahead of it, no later run of the request
            // would join it, and the limits allow a call.
            if let Some(calls) = start.as_deref_mut()
                && self.ready.is_empty()
                && run.probes.len() <= max
                && self.may_start_call(step_started)
            {
                if let Some(call) = self.start_run(run, dirty, step, flushed_at, now) {
                    step_started = true;
                    new_groups += 1;
                    calls.push(call);
                }
                continue;
            }
            // Queue the run's keys still waiting for this flush (a key may
            // have been cleaned up or forced to miss since). The group keeps
            // the probes only: its call copies the keys when it starts.
            let mut probes = run.probes;
            let (keys, queued_keys) = (&mut self.keys, &mut self.queued_keys);
            probes.retain(|&probe| {
                let Some((state, cold)) = keys.probe_both(probe) else {
                    return false;
                };
                if !state.status().is(Phase::Probing) {
                    return false;
                }
                state.set_phase(Phase::Queued);
                cold.time = flushed_at;
                *queued_keys += 1;
                true
            });
            if probes.is_empty() {
                continue;
            }
            // Top up the request's group still waiting in `ready`, if any
            // (its index there: groups in `ready` have consecutive sequence
            // numbers, and none leaves it during a flush).
            let front_seq = self.ready.front().map_or(0, |g| g.seq);
            let request = self.requests.live_mut(run.request);
            if let Some(group) = request
                .as_ref()
                .and_then(|r| r.queued_group)
                .and_then(|seq| seq.checked_sub(front_seq))
                .and_then(|idx| usize::try_from(idx).ok())
                .and_then(|idx| self.ready.get_mut(idx))
                .filter(|g| g.request == run.request)
            {
                let take = max.saturating_sub(group.probes.len()).min(probes.len());
                if take > 0 {
                    group.probes.extend(probes.drain(..take));
                    self.queue_deadlines
                        .push_back((queue_deadline, flushed_at, group.seq));
                }
            }
            // The rest in new groups of at most `max_keys_per_call` keys; the
            // first reuses the run's vector.
            let mut last_seq = None;
            while !probes.is_empty() {
                let rest = if probes.len() > max {
                    probes.split_off(max)
                } else {
                    Vec::new()
                };
                let seq = self.next_group_seq;
                self.next_group_seq += 1;
                last_seq = Some(seq);
                self.queue_deadlines
                    .push_back((queue_deadline, flushed_at, seq));
                self.ready.push_back(Group {
                    seq,
                    step,
                    request: run.request,
                    ctx: run.ctx.clone(),
                    probes,
                });
                new_groups += 1;
                probes = rest;
            }
            if let (Some(seq), Some(request)) = (last_seq, request) {
                request.queued_group = Some(seq);
            }
        }
        self.steps.open(new_groups, step_started);
    }

    /// Starts the call of one flushed run, handing its probes and keys over
    /// as they are: its keys stay `Probing`, now in flight, with no pass
    /// over them. When the batch is `dirty` the keys still waiting for this
    /// flush are picked out first (the others were cleaned up or forced to
    /// miss since their lookup). `None` if none is left.
    fn start_run(
        &mut self,
        run: batch::BatchRun,
        dirty: bool,
        step: u64,
        flushed_at: u64,
        now: Instant,
    ) -> Option<TierCall> {
        let (mut probes, mut keys) = (run.probes, run.keys);
        if dirty {
            self.drop_stale(&mut probes, &mut keys);
            if probes.is_empty() {
                self.batch.recycle(probes);
                return None;
            }
        }
        if let Some(request) = self.requests.live_mut(run.request) {
            // Nothing waits in `ready`: a recorded group is gone.
            request.queued_group = None;
        }
        // The seq a queued group would have taken, so that later groups
        // are numbered as if this run had been queued and started.
        self.next_group_seq += 1;
        Some(self.register_call(step, probes, keys, run.ctx, now, flushed_at))
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
    fn move_in_flight(&mut self, probes: &mut Vec<Probe>) -> Option<Vec<OffloadKey>> {
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
    fn may_start_call(&self, step_started: bool) -> bool {
        self.calls.has_room() && self.steps.admits(step_started)
    }

    /// Records a call about to be handed out, running from `now`, whose
    /// keys were flushed at `flushed_at` (0: each at its own, see
    /// `OutstandingCall`).
    fn register_call(
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

    /// The next tier call to start, if the limits allow one: at most
    /// `max_calls_in_flight` calls and `max_steps_in_flight` steps at once.
    /// The call's keys move to in-flight; its deadline starts `now`.
    pub fn next_call(&mut self, now: Instant) -> Option<TierCall> {
        loop {
            let group = self.ready.front()?;
            let step_started = self.steps.is_started(group.step);
            if !self.may_start_call(step_started) {
                return None;
            }
            let group = self.ready.pop_front()?;
            if let Some(request) = self
                .requests
                .live_mut(group.request)
                .filter(|r| r.queued_group == Some(group.seq))
            {
                request.queued_group = None;
            }
            self.queued_keys = self.queued_keys.saturating_sub(group.probes.len());

            // Keys still queued move to in flight, and their keys are copied
            // into the call's list in the same pass.
            let mut probes = group.probes;
            let Some(keys) = self.move_in_flight(&mut probes) else {
                // Every key was cleaned up or forced to miss while waiting.
                self.steps.finish_group(group.step);
                continue;
            };
            self.steps.start(group.step);
            return Some(self.register_call(group.step, probes, keys, group.ctx, now, 0));
        }
    }

    /// Applies the outcome of call `id`, which took `elapsed`. An answer for
    /// a call that already timed out is dropped and counted.
    pub fn complete(&mut self, id: CallId, outcome: CallOutcome, elapsed: Duration, now: Instant) {
        let Some(call) = self.calls.finish(id) else {
            self.counters.late_answers_dropped += 1;
            return;
        };
        self.counters.call_finished(elapsed);
        self.steps.finish_group(call.step);
        let now_ticks = ticks(self.epoch, now);

        let failure = match outcome {
            CallOutcome::Answered(found) if found.len() == call.probes.len() => {
                let mut first_verdicts = 0;
                for (&probe, present) in call.probes.iter().zip(found) {
                    let timed = self.resolve(probe, KeyResult::Answer(present), call.flushed_at);
                    self.time_first_verdict(timed, call.flushed_at, now_ticks, &mut first_verdicts);
                }
                self.counters
                    .record_verdict_times(call.flushed_at, now_ticks, first_verdicts);
                self.batch.recycle(call.probes);
                return;
            }
            CallOutcome::Answered(found) => {
                tracing::warn!(
                    tier = %self.tier,
                    keys = call.probes.len(),
                    results = found.len(),
                    "tier answered with the wrong number of results; resolving its keys as errors"
                );
                self.counters.note_failure(|| {
                    format!(
                        "answered {} results for {} keys",
                        found.len(),
                        call.probes.len()
                    )
                });
                TierErrorKind::WrongResultCount
            }
            CallOutcome::Failed(err) => {
                tracing::warn!(tier = %self.tier, keys = call.probes.len(), error = %err, "tier call failed");
                self.counters.note_failure(|| crate::error::one_line(&err));
                err.kind()
            }
            CallOutcome::TimedOut => {
                tracing::warn!(
                    tier = %self.tier,
                    keys = call.probes.len(),
                    timeout_ms = self.call_timeout.as_millis() as u64,
                    "tier call exceeded its deadline"
                );
                self.counters.note_failure(|| {
                    format!(
                        "no answer within the call deadline ({} ms)",
                        self.call_timeout.as_millis()
                    )
                });
                TierErrorKind::Timeout
            }
        };
        let timed_out = failure == TierErrorKind::Timeout;
        let retry_at = ticks(self.epoch, now + self.failure_backoff);
        let mut first_verdicts = 0;
        for &probe in &call.probes {
            let result = KeyResult::Failed { retry_at };
            let Some(timed) = self.resolve(probe, result, call.flushed_at) else {
                continue;
            };
            if timed_out {
                self.counters.timeouts += 1;
            } else {
                self.counters.errors += 1;
            }
            self.time_first_verdict(Some(timed), call.flushed_at, now_ticks, &mut first_verdicts);
        }
        self.counters
            .record_verdict_times(call.flushed_at, now_ticks, first_verdicts);
        self.batch.recycle(call.probes);
    }

    /// Notes a first verdict that `resolve` says to time (`timed`, the
    /// key's flush time): counted in `count` when it is the call's own
    /// flush time `call_flushed_at` (recorded at once, after the loop),
    /// recorded now when the key has a flush time of its own.
    #[inline(always)]
    fn time_first_verdict(
        &mut self,
        timed: Option<u64>,
        call_flushed_at: u64,
        now_ticks: u64,
        count: &mut u64,
    ) {
        match timed {
            Some(0) | None => {}
            Some(_) if call_flushed_at != 0 => *count += 1,
            Some(flushed_at) => self.counters.record_verdict_times(flushed_at, now_ticks, 1),
        }
    }

    /// Gives back the key list of a finished call, for a later call to
    /// reuse instead of allocating one. Optional: a transport that drops
    /// its calls' lists loses nothing but the reuse.
    #[inline]
    pub fn reuse_keys(&mut self, keys: Vec<OffloadKey>) {
        self.batch.recycle_keys(keys);
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

    /// Resolves as timeouts every call whose deadline is `now` or earlier
    /// (the worker enforces deadlines too; this is the backstop for a worker
    /// that cannot, such as a tier blocking its thread), and every key still
    /// waiting for a call a whole call timeout after the flush that queued
    /// it (all call slots taken by a slow or hung tier). A flushed key so
    /// gets its verdict within two call timeouts.
    pub fn expire(&mut self, now: Instant) {
        while let Some(id) = self.calls.next_expired(now) {
            self.complete(id, CallOutcome::TimedOut, self.call_timeout, now);
        }
        // Keys flushed a whole call timeout ago and still waiting for a call.
        let now_ticks = ticks(self.epoch, now);
        let retry_at = ticks(self.epoch, now + self.failure_backoff);
        while let Some(&(deadline, flushed_at, seq)) = self.queue_deadlines.front() {
            // The group, if it still waits in `ready` (groups there have
            // consecutive sequence numbers).
            let front_seq = self.ready.front().map_or(0, |g| g.seq);
            let group = seq
                .checked_sub(front_seq)
                .and_then(|idx| usize::try_from(idx).ok())
                .and_then(|idx| self.ready.get(idx))
                .filter(|g| g.seq == seq);
            if group.is_some() && deadline > now_ticks {
                break;
            }
            // Expired, or stale (the group started): either way the entry
            // goes, which keeps the queue as short as the groups waiting.
            self.queue_deadlines.pop_front();
            let Some(group) = group else {
                continue;
            };
            let mut first_verdicts = 0;
            for &probe in &group.probes {
                // Still queued since this flush (a key queued by a later
                // flush, topping up the group, has an entry of its own).
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
                .record_verdict_times(flushed_at, now_ticks, first_verdicts);
        }
        if self.queue_deadlines.capacity() > 4 * self.queue_deadlines.len().max(1024) {
            self.queue_deadlines
                .shrink_to(2 * self.queue_deadlines.len().max(1024));
        }
        self.calls.compact();
    }

    /// The earliest deadline of a running call.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.calls.next_deadline()
    }

    /// Forces the verdict of `keys` to miss after a failed load, so the
    /// scheduler stops re-issuing a doomed load. A later tier answer cannot
    /// undo it; it lasts while a request refers to the key. Keys the ledger
    /// does not track are skipped, and a key nobody refers to any more (kept
    /// only for its running probe) is forgotten.
    pub fn mark_miss<'a>(&mut self, keys: impl IntoIterator<Item = &'a OffloadKey>) {
        for key in keys {
            let Some(slot) = self.keys.find(key) else {
                continue;
            };
            let Some((state, cold)) = self.keys.get_both(slot) else {
                continue;
            };
            self.counters.forced_misses += 1;
            debug_assert_eq!(state.status().orphan(), cold.refs == 0);
            if state.status().orphan() {
                // Kept only for a running probe's answer, which no longer
                // matters: forget it (a late answer is then dropped).
                self.keys.remove(slot);
            } else {
                if state.status().is(Phase::Probing)
                    && !generation_before(state.generation(), self.batch_generation)
                {
                    // Its probe in the flush batch is stale now.
                    self.batch_dirty = true;
                }
                state.set_phase(Phase::ForcedMiss);
            }
        }
    }

    /// Releases every reference of request `req_id`. Keys left without
    /// references are forgotten, except those whose probe is running: they
    /// stay until the answer lands.
    pub fn cleanup(&mut self, req_id: &str) {
        let Some(entry) = self.requests.remove(req_id) else {
            return;
        };
        let batch_generation = self.batch_generation;
        let mut dirty = false;
        let mut release = |keys: &mut KeyTable, slot: Slot| {
            if let Some((state, cold)) = keys.get_both(slot) {
                cold.refs = cold.refs.saturating_sub(1);
                if cold.refs > 0 {
                    return;
                }
                if state.status().is(Phase::Probing) {
                    if generation_before(state.generation(), batch_generation) {
                        // In flight: kept for its answer, which forgets it.
                        state.set_orphan(true);
                        return;
                    }
                    // Its probe in the flush batch is stale now.
                    dirty = true;
                }
                keys.remove(slot);
            }
        };
        for &slot in entry.created.iter().chain(&entry.shared.slots) {
            release(&mut self.keys, slot);
        }
        self.batch_dirty |= dirty;
        self.requests.recycle(entry);
        if self.keys.is_empty() {
            // Nothing refers to queued entries any more.
            self.batch.take();
            self.batch_dirty = false;
        }
    }

    /// Resolves every running call as failed, for shutdown: their keys
    /// answer miss (counted as errors).
    pub fn abandon_running(&mut self, now: Instant) {
        for id in self.calls.ids() {
            self.complete(
                id,
                CallOutcome::Failed(TierError::new(
                    TierErrorKind::Unavailable,
                    "the lookup manager shut down before the tier answered",
                )),
                Duration::ZERO,
                now,
            );
        }
        // Shutdown: every held-back sample is recorded now.
        self.counters.settle();
    }

    /// Whether any key waits for a flush or a call slot, or any call runs
    /// (cheap, unlike [`stats`](Self::stats)).
    pub fn has_pending_calls(&self) -> bool {
        !self.calls.is_empty() || self.queued_keys > 0 || !self.batch.is_empty()
    }

    /// Number of tier calls running.
    pub fn running_calls(&self) -> usize {
        self.calls.len()
    }

    /// Whether the ledger holds no key, request, queued group or running call.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
            && self.requests.is_empty()
            && self.calls.is_empty()
            && self.ready.is_empty()
            && self.batch.is_empty()
    }

    /// The counters and histograms as they are, for the metrics export:
    /// cheap enough for every flush (no summary, no allocation).
    pub(crate) fn metrics_view(&self) -> crate::metrics::LedgerView<'_> {
        self.counters.view(Gauges {
            calls_in_flight: self.calls.len(),
            tracked_keys: self.keys.len(),
            queued_keys: self.queued_keys + self.batch.len,
        })
    }

    /// A snapshot of the counters and histograms.
    pub fn stats(&self) -> ManagerStats {
        ManagerStats {
            tier: self.tier.to_string(),
            tracked_keys: self.keys.len(),
            in_flight_keys: self.calls.keys(),
            queued_keys: self.queued_keys + self.batch.len,
            tracked_requests: self.requests.len(),
            ..self.counters.stats()
        }
    }
}
