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
//! A call is outstanding from the moment the ledger hands it out until its
//! outcome is completed, and at most `max_calls_in_flight` calls are
//! outstanding at once: for a transport that starts every call it is
//! handed, the calls running on the tier. A transport that queues calls
//! before it runs them (as the manager's worker does, so the next call is
//! at hand when one ends) raises the bound with
//! [`with_max_outstanding_calls`](Ledger::with_max_outstanding_calls) and
//! bounds what runs itself.
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
//!   mark_present, from any phase ──▶ Present (a new generation: a later answer is dropped)
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
//! - **`mark_present` supersedes probes.** A finished store is newer than
//!   any probe in flight: the key answers hit at once under a fresh
//!   generation, so a late probe answer cannot turn it back into a miss
//!   (vLLM 0.34's `mark_present`).
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
//! The ledger is the face of seven parts, each a type in a module of its
//! own that owns one invariant (its doc says which):
//!
//! - the tracked keys, `KeyTable` (`table.rs`, over `slab.rs` and
//!   `index.rs`);
//! - the request registry, `Requests` (`requests.rs`): serials, the keys
//!   each request refers to, the request of the previous lookup;
//! - the flush batch, `Batch` (`batch.rs`): probes looked up since the
//!   last flush;
//! - the ready queue, `ReadyQueue` (`queue.rs`): flushed keys waiting for a
//!   call slot, with their deadlines;
//! - the calls handed out, `OutstandingCalls` (`outstanding.rs`), with
//!   their deadlines;
//! - step admission, `Steps` (`steps.rs`);
//! - the counters and histograms, `Counters` (`counters.rs`).
//!
//! The ledger's own operations that span them are in `lookup.rs`,
//! `flush.rs` and `resolve.rs`; the values that cross to a transport
//! ([`TierCall`], [`CallOutcome`], [`LazyNow`]) in `call.rs`.
//!
//! Every tracked key lives in one slab entry with a stable index ("slot").
//! The only hash probe is `lookup`'s (and `mark_miss`'s), in an index of
//! slots keyed by the key's precomputed hash: chunks of one cache line,
//! twelve one-byte tags beside their twelve slots, so a lookup reads one
//! line of the index and then the entry. Removal leaves no tombstone (each
//! chunk counts the keys that overflowed past it, as in folly's F14), so
//! the scheduler's churn leaves nothing behind to lengthen a search. An
//! entry is split in two: the hot part is one 64-byte, cache-line-aligned
//! value: the key, a word holding the probe's 56-bit generation and the
//! status byte (phase, "revalidating", "orphan"), and the serials of the
//! request that last took or showed a reference and of the one that
//! created the key, so the lookup of a key by its creator, or by the
//! request that asked last, reads nothing else. The cold part (reference
//! count, queue or retry time) sits in a parallel array of the same
//! fixed-size segment (one segment lookup reaches both), read only when a
//! request first refers to a key, when a key is queued or fails, and at
//! cleanup: an answer to a call the flush started reads the hot part only
//! (a key nobody refers to any more is marked orphan there).
//!
//! Everything downstream (the flush batch, the queued groups, the calls
//! handed out, a request's references) holds `(slot, generation)` pairs
//! and reaches the entry by index; the generation check makes a pair whose
//! slot was freed or reused harmless. A run of the flush batch keeps its
//! keys too, copied at their lookup, so the call a flush starts at once
//! takes that list as it is: between a key's lookup and its answer,
//! nothing walks it. Queue deadlines are kept per group and flush, not per
//! key. The vectors of a step (a request's run of probes and of keys,
//! which the manager's worker gives back emptied, and its lists of created
//! and shared keys) are recycled, so a steady step loop allocates nothing
//! per request. The request of the previous lookup is known by the address
//! of its id's `Arc`, and a request switch finds a registered request by
//! that address, so neither reads the id string.

mod batch;
mod call;
mod counters;
mod flush;
mod index;
mod lookup;
mod outstanding;
mod queue;
mod requests;
mod resolve;
mod slab;
mod steps;
mod table;
#[cfg(test)]
mod tests;

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::ManagerConfig;
use crate::error::{LookupError, TierError, TierErrorKind};
use crate::key::{OffloadKey, ReqContext};
use crate::stats::ManagerStats;

/// The verdict types, also here for code that names them by this path.
pub use crate::verdict::{LookupVerdict, PrefixVerdict};
use batch::Batch;
pub use call::{CallId, CallOutcome, LazyNow, TierCall};
use counters::{CallSpan, Counters, Gauges};
use outstanding::OutstandingCalls;
use queue::ReadyQueue;
use requests::{Requests, id_address};
use steps::Steps;
use table::{KeyTable, Phase};

type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

/// How many keys ahead [`Ledger::lookup_each`] prefetches an entry (and
/// twice that, an index line).
const PREFETCH_AHEAD: usize = 8;

/// From this many keys on, [`Ledger::lookup_each`] prefetches: a shorter
/// list is most likely a request's keys asked again, already cached, where
/// the prefetches would be work for nothing.
const PREFETCH_MIN_KEYS: usize = 64;

/// Nanoseconds from `epoch` to `t` (0 for earlier times); 584 years fit.
fn ticks(epoch: Instant, t: Instant) -> u64 {
    u64::try_from(t.saturating_duration_since(epoch).as_nanos()).unwrap_or(u64::MAX)
}

/// The manager's state machine; see the [module docs](self).
#[derive(Debug)]
pub struct Ledger {
    tier: Arc<str>,
    min_key_len: usize,
    max_key_len: usize,
    call_timeout: Duration,
    failure_backoff: Duration,
    max_queued_keys: usize,
    max_keys_per_call: usize,
    /// Times are kept as nanoseconds since this instant ("ticks"): 8 bytes
    /// instead of 16 in every key's state.
    epoch: Instant,
    /// The generation the next probe gets.
    next_generation: u64,

    keys: KeyTable,
    requests: Requests,
    batch: Batch,
    ready: ReadyQueue,
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
            min_key_len: cfg.min_key_len.max(1),
            max_key_len: cfg.max_key_len,
            call_timeout: cfg.call_timeout(),
            failure_backoff: cfg.failure_backoff(),
            max_queued_keys: cfg.max_queued_keys.max(1),
            max_keys_per_call: cfg.max_keys_per_call.max(1),
            epoch: now,
            next_generation: 0,
            keys: KeyTable::default(),
            requests: Requests::default(),
            batch: Batch::default(),
            ready: ReadyQueue::default(),
            calls: OutstandingCalls::new(cfg.call_timeout(), cfg.max_calls_in_flight),
            steps: Steps::new(cfg.max_steps_in_flight),
            counters: Counters::new(),
        }
    }

    /// This ledger with up to `max` calls outstanding at once (handed out,
    /// not yet completed) instead of `max_calls_in_flight`: for a transport
    /// that runs at most `max_calls_in_flight` of the calls it is handed and
    /// queues the others (see the [module docs](self)).
    #[must_use]
    pub fn with_max_outstanding_calls(mut self, max: usize) -> Self {
        self.calls.set_max(max);
        self
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
    /// [`LookupError::InvalidKey`] for a key shorter than `min_key_len` (an
    /// empty one always) or longer than `max_key_len`.
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
            if len < self.min_key_len || len > self.max_key_len {
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

    /// [`lookup`](Self::lookup) of each of `keys` in order, each answer
    /// handed to `answer` with its index. Of a long list, the table's
    /// memory for the keys a few places ahead is prefetched, so that the
    /// cache misses of keys spread over a large table overlap instead of
    /// following each other.
    ///
    /// # Errors
    /// The first key's error stops the loop; the keys before it were
    /// looked up (and answered).
    #[inline]
    pub fn lookup_each(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
        now: &mut LazyNow,
        mut answer: impl FnMut(usize, LookupVerdict),
    ) -> Result<(), LookupError> {
        if keys.len() < PREFETCH_MIN_KEYS {
            for (i, key) in keys.iter().enumerate() {
                answer(i, self.lookup(key, ctx, now)?);
            }
            return Ok(());
        }
        // Index lines `2 * PREFETCH_AHEAD` keys ahead, entries (through
        // the index lines, arrived by then) `PREFETCH_AHEAD` ahead.
        for key in &keys[..2 * PREFETCH_AHEAD] {
            self.keys.prefetch_index(key);
        }
        for key in &keys[..PREFETCH_AHEAD] {
            self.keys.prefetch_entry(key);
        }
        for (i, key) in keys.iter().enumerate() {
            if let Some(ahead) = keys.get(i + 2 * PREFETCH_AHEAD) {
                self.keys.prefetch_index(ahead);
            }
            if let Some(ahead) = keys.get(i + PREFETCH_AHEAD) {
                self.keys.prefetch_entry(ahead);
            }
            answer(i, self.lookup(key, ctx, now)?);
        }
        Ok(())
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

    /// Starts probe generations at `generation` (modulo 2^56, their width),
    /// to test their wrap-around: a ledger that has handed out no probe yet
    /// behaves the same from any starting generation. Does nothing once a
    /// key is tracked.
    #[cfg(feature = "testkit")]
    #[doc(hidden)]
    pub fn start_generations_at(&mut self, generation: u64) {
        if self.is_empty() {
            self.next_generation = generation & table::GENERATION_MASK;
            self.batch.start_at(self.next_generation);
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

    /// The next tier call to start, if the limits allow one: at most
    /// `max_calls_in_flight` calls outstanding (or the bound set by
    /// [`with_max_outstanding_calls`](Self::with_max_outstanding_calls)) and
    /// `max_steps_in_flight` steps with calls at once.
    /// The call's keys move to in-flight; its deadline starts `now`.
    pub fn next_call(&mut self, now: Instant) -> Option<TierCall> {
        loop {
            let group = self.ready.front()?;
            if !self.may_start_call(self.steps.is_started(group.step)) {
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
            // Keys still queued move to in flight, and their keys are copied
            // into the call's list in the same pass.
            let mut probes = group.probes;
            let Some(keys) = self.move_in_flight(&mut probes) else {
                // Every key was cleaned up or forced to miss while waiting.
                self.steps.finish_group(group.step);
                continue;
            };
            self.steps.start(group.step);
            return Some(self.hand_out(group.step, probes, keys, group.ctx, now, 0));
        }
    }

    /// Applies the outcome of call `id`, which took `elapsed`. An answer for
    /// a call that already timed out is dropped and counted.
    pub fn complete(&mut self, id: CallId, outcome: CallOutcome, elapsed: Duration, now: Instant) {
        self.finish_call(id, outcome, elapsed, None, now);
    }

    /// [`complete`](Self::complete) for a call whose transport handed its
    /// outcome back at `ended`, `elapsed` after the tier call started: the
    /// times to verdict of its keys are then also split into queueing (from
    /// the flush to the call's start), the round trip (the call) and
    /// publication (from `ended` to the verdict being applied); see
    /// [`ManagerStats::verdict_queueing`].
    pub fn complete_ended(
        &mut self,
        id: CallId,
        outcome: CallOutcome,
        elapsed: Duration,
        ended: Instant,
        now: Instant,
    ) {
        let span = CallSpan {
            started: ended
                .checked_sub(elapsed)
                .map_or(0, |started| ticks(self.epoch, started)),
            ended: ticks(self.epoch, ended),
        };
        self.finish_call(id, outcome, elapsed, Some(span), now);
    }

    fn finish_call(
        &mut self,
        id: CallId,
        outcome: CallOutcome,
        elapsed: Duration,
        span: Option<CallSpan>,
        now: Instant,
    ) {
        let Some(call) = self.calls.finish(id) else {
            self.counters.late_answers_dropped += 1;
            return;
        };
        self.counters.call_finished(elapsed);
        self.steps.finish_group(call.step);
        let now_ticks = ticks(self.epoch, now);
        match outcome {
            CallOutcome::Answered(found) if found.len() == call.probes.len() => {
                self.apply_answers(&call, found, now_ticks, span);
            }
            failed => {
                let kind = self.note_failure(failed, call.probes.len());
                self.apply_failure(&call, kind, now, now_ticks, span);
            }
        }
        self.batch.recycle(call.probes);
    }

    /// Gives back the key list of a finished call, for a later call to
    /// reuse instead of allocating one. Optional: a transport that drops
    /// its calls' lists loses nothing but the reuse.
    #[inline]
    pub fn reuse_keys(&mut self, keys: Vec<OffloadKey>) {
        self.batch.recycle_keys(keys);
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
        self.expire_queued(now);
        self.ready.shrink();
        self.calls.compact();
    }

    /// The earliest deadline of an outstanding call.
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
                // Kept only for a running probe's answer, which does not
                // matter any more: forget it (a late answer is then dropped).
                self.keys.remove(slot);
            } else {
                if state.status().is(Phase::Probing) && self.batch.holds(state.generation()) {
                    // Its probe in the flush batch is stale now.
                    self.batch.dirty = true;
                }
                state.set_phase(Phase::ForcedMiss);
            }
        }
    }

    /// Records that `keys` were stored in the tier: each answers
    /// [`Hit`](LookupVerdict::Hit) at once, and no probe started before
    /// (waiting for the flush or a call slot, or running) can turn it back
    /// into a miss, as in vLLM 0.34's `mark_present`.
    ///
    /// A finished store is newer than any probe in flight, so it supersedes
    /// them: the key gets a fresh generation, and a stale probe's answer
    /// then fails the generation check and is dropped (counted in
    /// `stale_results_dropped`). Keys the ledger does not track are skipped
    /// (a verdict no request holds could never be released), as are keys
    /// already present; a key nobody refers to any more (kept only for its
    /// running probe) is forgotten. Unlike [`mark_miss`](Self::mark_miss),
    /// this also replaces a forced miss: the block is there now.
    pub fn mark_present<'a>(&mut self, keys: impl IntoIterator<Item = &'a OffloadKey>) {
        for key in keys {
            let Some(slot) = self.keys.find(key) else {
                continue;
            };
            let generation = self.next_generation;
            let Some((state, cold)) = self.keys.get_both(slot) else {
                continue;
            };
            let status = state.status();
            if status.is(Phase::Present) {
                continue;
            }
            debug_assert_eq!(status.orphan(), cold.refs == 0);
            if status.orphan() {
                // Kept only for a running probe's answer: forget it (the
                // late answer is then dropped).
                self.keys.remove(slot);
                continue;
            }
            if status.is(Phase::Probing) && self.batch.holds(state.generation()) {
                // Its probe in the flush batch is stale now.
                self.batch.dirty = true;
            }
            self.next_generation = table::next_generation(generation);
            state.set_generation(generation);
            state.set_answer(true);
        }
    }

    /// Releases every reference of request `req_id`. Keys left without
    /// references are forgotten, except those whose probe is running: they
    /// stay until the answer lands.
    pub fn cleanup(&mut self, req_id: &str) {
        let Some(entry) = self.requests.remove(req_id) else {
            return;
        };
        let batch = &mut self.batch;
        let mut release = |keys: &mut KeyTable, slot| {
            let Some((state, cold)) = keys.get_both(slot) else {
                return;
            };
            cold.refs = cold.refs.saturating_sub(1);
            if cold.refs > 0 {
                return;
            }
            if state.status().is(Phase::Probing) {
                if !batch.holds(state.generation()) {
                    // In flight: kept for its answer, which forgets it.
                    state.set_orphan(true);
                    return;
                }
                // Its probe in the flush batch is stale now.
                batch.dirty = true;
            }
            keys.remove(slot);
        };
        for &slot in entry.created.iter().chain(&entry.shared.slots) {
            release(&mut self.keys, slot);
        }
        self.requests.recycle(entry);
        if self.keys.is_empty() {
            // Nothing refers to queued entries any more.
            self.batch.clear();
        }
    }

    /// Resolves every outstanding call as failed, for shutdown: their keys
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

    /// Whether any key waits for a flush or a call slot, or any call is
    /// outstanding (cheap, unlike [`stats`](Self::stats)).
    pub fn has_pending_calls(&self) -> bool {
        !self.calls.is_empty() || self.ready.keys > 0 || !self.batch.is_empty()
    }

    /// Number of tier calls outstanding: handed out, not yet completed.
    pub fn outstanding_calls(&self) -> usize {
        self.calls.len()
    }

    /// Number of tier calls outstanding.
    #[deprecated(note = "renamed `outstanding_calls`: a transport may not run every call it holds")]
    pub fn running_calls(&self) -> usize {
        self.outstanding_calls()
    }

    /// Whether the ledger holds no key, request, queued group or
    /// outstanding call.
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
            calls_waiting: 0,
            tracked_keys: self.keys.len(),
            queued_keys: self.ready.keys + self.batch.len,
        })
    }

    /// A snapshot of the counters and histograms. The ledger counts every
    /// outstanding call in `calls_in_flight` (it cannot tell one running
    /// from one its transport queued) and none in `calls_waiting`.
    pub fn stats(&self) -> ManagerStats {
        ManagerStats {
            tier: self.tier.to_string(),
            calls_in_flight: self.calls.len(),
            tracked_keys: self.keys.len(),
            in_flight_keys: self.calls.keys(),
            queued_keys: self.ready.keys + self.batch.len,
            tracked_requests: self.requests.len(),
            ..self.counters.stats()
        }
    }
}
