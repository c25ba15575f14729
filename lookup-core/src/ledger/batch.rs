//! The flush batch: keys looked up since the last flush, in runs of one
//! request each, and the groups a flush turns them into.

use super::slab::Slot;
use super::table::Probe;
use crate::key::{OffloadKey, ReqContext};

/// Room reserved for a request's keys when it first looks one up (grows
/// as usual past it).
pub(super) const RUN_CAPACITY: usize = 32;

/// How many emptied probe vectors of `RUN_CAPACITY` a batch keeps for its
/// next runs (one per request of a typical step; each is 512 bytes).
const SPARE_RUNS: usize = 64;

/// Keys looked up since the last flush, in runs of one request each (a
/// scheduler looks up a request's keys together).
#[derive(Debug, Default)]
pub(super) struct Batch {
    pub(super) runs: Vec<BatchRun>,
    pub(super) len: usize,
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
    /// The request's slot and serial in `request_slab` when it looked up.
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

    /// The runs, and whether a request has two of them; the next batch
    /// starts empty, in a new epoch.
    #[inline]
    pub(super) fn take(&mut self) -> (Vec<BatchRun>, bool) {
        self.len = 0;
        self.epoch += 1;
        let interleaved = std::mem::take(&mut self.interleaved);
        (std::mem::take(&mut self.runs), interleaved)
    }
}

#[derive(Debug)]
pub(super) struct Group {
    pub(super) seq: u64,
    pub(super) step: u64,
    /// The request's slot and serial in `request_slab`, as in [`BatchRun`].
    pub(super) request: (Slot, u32),
    pub(super) ctx: ReqContext,
    pub(super) probes: Vec<Probe>,
}
