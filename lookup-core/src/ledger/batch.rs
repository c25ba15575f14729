//! The flush batch: the probes of keys looked up since the last flush, in
//! runs of one request each, with their keys, and which probes it holds.

use super::slab::Slot;
use super::table::{Probe, generation_before};
use crate::key::{OffloadKey, ReqContext};

/// Room reserved for a request's keys when it first looks one up (grows
/// as usual past it).
pub(super) const RUN_CAPACITY: usize = 32;

/// How many emptied probe vectors of `RUN_CAPACITY` a batch keeps for its
/// next runs (one per request of a typical step; each is 512 bytes).
const SPARE_RUNS: usize = 64;

/// Keys looked up since the last flush, in runs of one request each (a
/// scheduler looks up a request's keys together).
///
/// Invariant: a key in phase `Probing` waits in the batch exactly when its
/// probe's generation is [`generation`](Self::generation) or later (see
/// [`holds`](Self::holds)); every other `Probing` key is in a call handed
/// out. A run's probe whose key left that phase since it was pushed (the
/// key forgotten or forced to miss) is stale, and the batch is then
/// [`dirty`](Self::dirty).
#[derive(Debug, Default)]
pub(super) struct Batch {
    pub(super) runs: Vec<BatchRun>,
    pub(super) len: usize,
    /// The generation of the first probe the batch may hold.
    generation: u64,
    /// Whether a probe of the batch went stale since it was pushed: the
    /// flush then checks each key before handing it to a call.
    pub(super) dirty: bool,
    /// Counts the flushes: a request's `batch_epoch` equal to it means the
    /// request already has a run in this batch.
    pub(super) epoch: u64,
    /// Whether a request has two runs in this batch (its lookups were
    /// interleaved with another's): a flush then merges them into one call
    /// and cannot start any run's call on its own.
    pub(super) interleaved: bool,
    /// Emptied probe vectors of answered calls, reused by new runs: a step
    /// then allocates no vector per request.
    spare: Vec<Vec<Probe>>,
    /// Emptied key lists of answered calls, given back by the transport
    /// (see `Ledger::reuse_keys`), reused the same way.
    spare_keys: Vec<Vec<OffloadKey>>,
}

#[derive(Debug)]
pub(super) struct BatchRun {
    /// The request's slot and serial in the registry when it looked up.
    pub(super) request: (Slot, u32),
    pub(super) ctx: ReqContext,
    pub(super) probes: Vec<Probe>,
    /// The key of each probe, in the same order: the key list of the call
    /// a flush can start at once, handed over as it is.
    pub(super) keys: Vec<OffloadKey>,
}

impl Batch {
    /// Adds `probe` of `key` to the request's current run; `true` if it
    /// started a new run (see `interleaved`).
    #[inline(always)]
    pub(super) fn push(
        &mut self,
        request: Slot,
        serial: u32,
        ctx: &ReqContext,
        probe: Probe,
        key: &OffloadKey,
    ) -> bool {
        self.len += 1;
        match self.runs.last_mut() {
            Some(run) if run.request == (request, serial) => {
                run.probes.push(probe);
                run.keys.push(key.clone());
                false
            }
            _ => {
                self.new_run(request, serial, ctx, probe, key);
                true
            }
        }
    }

    #[inline(never)]
    fn new_run(
        &mut self,
        request: Slot,
        serial: u32,
        ctx: &ReqContext,
        probe: Probe,
        key: &OffloadKey,
    ) {
        // A scheduler looks up a request's keys together: start with room
        // for a typical run, not one key.
        let mut probes = self
            .spare
            .pop()
            .unwrap_or_else(|| Vec::with_capacity(RUN_CAPACITY));
        probes.push(probe);
        let mut keys = self
            .spare_keys
            .pop()
            .unwrap_or_else(|| Vec::with_capacity(RUN_CAPACITY));
        keys.push(key.clone());
        self.runs.push(BatchRun {
            request: (request, serial),
            ctx: ctx.clone(),
            probes,
            keys,
        });
    }

    /// Keeps an emptied probe vector of the usual size for a later run.
    #[inline]
    pub(super) fn recycle(&mut self, mut probes: Vec<Probe>) {
        if probes.capacity() == RUN_CAPACITY && self.spare.len() < SPARE_RUNS {
            probes.clear();
            self.spare.push(probes);
        }
    }

    /// Keeps a call's key list of the usual size, emptied, for a later run.
    #[inline]
    pub(super) fn recycle_keys(&mut self, mut keys: Vec<OffloadKey>) {
        if keys.capacity() == RUN_CAPACITY && self.spare_keys.len() < SPARE_RUNS {
            keys.clear();
            self.spare_keys.push(keys);
        }
    }

    #[inline]
    pub(super) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether a `Probing` key's probe of generation `generation` waits in
    /// the batch (rather than in a call handed out).
    #[inline]
    pub(super) fn holds(&self, generation: u64) -> bool {
        !generation_before(generation, self.generation)
    }

    /// The flush: the runs, whether a request has two of them, and whether
    /// a probe went stale. The next batch starts empty, in a new epoch, and
    /// holds the probes from generation `next` on.
    #[inline]
    pub(super) fn take(&mut self, next: u64) -> Flushed {
        self.len = 0;
        self.epoch += 1;
        self.generation = next;
        Flushed {
            runs: std::mem::take(&mut self.runs),
            interleaved: std::mem::take(&mut self.interleaved),
            dirty: std::mem::take(&mut self.dirty),
        }
    }

    /// Drops every run (no key is tracked any more), in a new epoch.
    pub(super) fn clear(&mut self) {
        self.len = 0;
        self.epoch += 1;
        self.interleaved = false;
        self.dirty = false;
        self.runs.clear();
    }

    /// Starts the batch's generations at `generation`, for a ledger that has
    /// handed out no probe yet.
    #[cfg(feature = "testkit")]
    pub(super) fn start_at(&mut self, generation: u64) {
        self.generation = generation;
    }
}

/// What a flush takes from the batch.
#[derive(Debug)]
pub(super) struct Flushed {
    pub(super) runs: Vec<BatchRun>,
    /// Whether a request has two runs: they are merged into one group, so
    /// no run's call can start on its own.
    pub(super) interleaved: bool,
    /// Whether a probe went stale since it was pushed.
    pub(super) dirty: bool,
}
