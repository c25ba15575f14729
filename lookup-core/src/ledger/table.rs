//! The tracked keys: one slab entry per key, found through a table of
//! slots keyed by the key's precomputed hash; see the ledger's "Layout".

use super::index::{SlotIndex, prefetch_line};
use super::slab::{Slab, Slot};
use crate::key::OffloadKey;
use crate::verdict::LookupVerdict;

/// One probe of one key: its slot and the generation it was submitted under.
pub(super) type Probe = (Slot, u64);

/// Generations are 56 bits (they share a word with the status byte in
/// each key's hot entry) and wrap: see [`generation_before`].
pub(super) const GENERATION_MASK: u64 = (1 << 56) - 1;

/// Whether generation `a` was handed out before `b`, across a wrap: the
/// live generations (probes waiting for a flush, a call slot or an
/// answer) span far less than half the 2^56 of them.
#[inline(always)]
pub(super) fn generation_before(a: u64, b: u64) -> bool {
    a.wrapping_sub(b) & GENERATION_MASK >= 1 << 55
}

/// The generation after `g`.
#[inline(always)]
pub(super) fn next_generation(g: u64) -> u64 {
    (g + 1) & GENERATION_MASK
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(super) enum Phase {
    /// A probe is outstanding and not waiting for a call slot: in the flush
    /// batch if its generation is the ledger's `batch_generation` or later
    /// (looked up since the last flush), else in a running tier call. A
    /// flush that starts a request's call at once leaves its keys in this
    /// phase: it need not visit them.
    Probing,
    /// Flushed, waiting for room to start its tier call.
    Queued,
    Present,
    Absent,
    ForcedMiss,
    /// The probe failed or timed out; answer miss until the entry's
    /// `retry_at` (ledger ticks).
    Failed,
}

/// [`KeyEntry::verdict`] by the phase and "revalidating" bits of [`KeyStatus`].
const VERDICTS: [Option<LookupVerdict>; 16] = {
    let mut table = [None; 16];
    let mut i = 0;
    while i < 16 {
        let revalidating = i & 8 != 0;
        table[i] = match i & 7 {
            p if p == Phase::Present as usize => Some(LookupVerdict::Hit),
            p if p == Phase::Absent as usize || p == Phase::ForcedMiss as usize => {
                Some(LookupVerdict::Miss)
            }
            // A re-check of a failed probe answers miss, not pending: a
            // failure never makes a request wait.
            p if p == Phase::Probing as usize || p == Phase::Queued as usize => {
                Some(if revalidating {
                    LookupVerdict::Miss
                } else {
                    LookupVerdict::Pending
                })
            }
            _ => None, // Failed (and the unused phase values)
        };
        i += 1;
    }
    table
};

/// A request serial no request has: the "no request" mark of an entry.
pub(super) const NO_REQUEST: u32 = u32::MAX;

/// The hot part of a tracked key: what a lookup reads, in one cache line
/// (48 bytes of key, 8 of generation and status, 4 and 4 of request marks).
#[derive(Debug)]
#[repr(align(64))]
pub(super) struct KeyEntry {
    pub(super) key: OffloadKey,
    /// The generation of the key's current probe (the high 56 bits) and its
    /// [`KeyStatus`] (the low byte).
    probe: u64,
    /// The serial of the last request that took a reference or was found
    /// holding one: skips the membership check when it asks again.
    pub(super) last_req: u32,
    /// The serial of the request that created the entry (and holds a
    /// reference from then until its cleanup); `NO_REQUEST` once serials
    /// were renumbered. Its own asks need no membership check.
    pub(super) creator: u32,
}

/// A key's phase and two flags in one byte, so that a lookup reads them in
/// one load and indexes its verdict table with them as they are: bits 0..3
/// the [`Phase`], bit 3 "revalidating" (the previous probe failed and this
/// one re-checks it: answer miss, not pending, until it lands, so a failure
/// never makes a request wait), bit 4 "orphan" (no request refers to the
/// key any more, its [`KeyCold::refs`] is 0: it is kept only for its
/// running probe's answer, which then forgets it; an answer reads this bit
/// instead of the cold part).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) struct KeyStatus(u8);

const PHASE_BITS: u8 = 7;
const REVALIDATING: u8 = 1 << 3;
const ORPHAN: u8 = 1 << 4;

/// [`KeyStatus::phase`] by the phase bits (6 and 7 are never stored).
const PHASES: [Phase; 8] = [
    Phase::Probing,
    Phase::Queued,
    Phase::Present,
    Phase::Absent,
    Phase::ForcedMiss,
    Phase::Failed,
    Phase::Failed,
    Phase::Failed,
];

impl KeyStatus {
    /// A key looked up for the first time: probing (in the flush batch),
    /// no flag.
    pub(super) const NEW: Self = Self(Phase::Probing as u8);

    #[inline(always)]
    pub(super) fn phase(self) -> Phase {
        PHASES[usize::from(self.0 & PHASE_BITS)]
    }

    #[inline(always)]
    pub(super) fn is(self, phase: Phase) -> bool {
        self.0 & PHASE_BITS == phase as u8
    }

    #[inline(always)]
    pub(super) fn set_phase(&mut self, phase: Phase) {
        self.0 = (self.0 & !PHASE_BITS) | phase as u8;
    }

    #[inline(always)]
    pub(super) fn revalidating(self) -> bool {
        self.0 & REVALIDATING != 0
    }

    #[inline(always)]
    pub(super) fn set_revalidating(&mut self, on: bool) {
        self.set(REVALIDATING, on);
    }

    #[inline(always)]
    pub(super) fn orphan(self) -> bool {
        self.0 & ORPHAN != 0
    }

    #[inline(always)]
    pub(super) fn set_orphan(&mut self, on: bool) {
        self.set(ORPHAN, on);
    }

    #[inline(always)]
    fn set(&mut self, bit: u8, on: bool) {
        self.0 = if on { self.0 | bit } else { self.0 & !bit };
    }
}

impl std::fmt::Debug for KeyStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KeyStatus")
            .field("phase", &self.phase())
            .field("revalidating", &self.revalidating())
            .field("orphan", &self.orphan())
            .finish()
    }
}

/// The cold part of a tracked key, at the same slot as its [`KeyEntry`].
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct KeyCold {
    /// Requests holding a reference. Zero only while a probe runs (the key
    /// is retained for its answer, then forgotten; its entry is marked
    /// orphan meanwhile).
    pub(super) refs: u32,
    /// In phase `Failed`, when to probe again, in ledger ticks. For a key
    /// that waited in a queued group, from then until its answer, when the
    /// flush that queued it happened, in ledger ticks plus one (a key whose
    /// call the flush started at once has that time in its running call
    /// only). Not kept up to date otherwise.
    pub(super) time: u64,
}

impl KeyEntry {
    /// A key first looked up by the request with serial `creator`, probed
    /// under `generation`: in the flush batch, no flag.
    #[inline(always)]
    pub(super) fn new(key: OffloadKey, generation: u64, creator: u32) -> Self {
        Self {
            key,
            probe: generation << 8 | u64::from(KeyStatus::NEW.0),
            last_req: creator,
            creator,
        }
    }

    #[inline(always)]
    pub(super) fn generation(&self) -> u64 {
        self.probe >> 8
    }

    /// A new probe under `generation` (56 bits), the status unchanged.
    #[inline(always)]
    pub(super) fn set_generation(&mut self, generation: u64) {
        self.probe = generation << 8 | (self.probe & 0xff);
    }

    #[inline(always)]
    pub(super) fn status(&self) -> KeyStatus {
        KeyStatus(self.probe as u8)
    }

    #[inline(always)]
    fn update(&mut self, change: impl FnOnce(&mut KeyStatus)) {
        let mut status = self.status();
        change(&mut status);
        self.probe = (self.probe & !0xff) | u64::from(status.0);
    }

    #[inline(always)]
    pub(super) fn set_phase(&mut self, phase: Phase) {
        self.update(|s| s.set_phase(phase));
    }

    #[inline(always)]
    pub(super) fn set_revalidating(&mut self, on: bool) {
        self.update(|s| s.set_revalidating(on));
    }

    /// The tier's answer: phase `Present` or `Absent`, no longer
    /// revalidating, the orphan bit and generation unchanged.
    #[inline(always)]
    pub(super) fn set_answer(&mut self, present: bool) {
        const _: () = assert!(Phase::Present as u8 + 1 == Phase::Absent as u8);
        let phase = Phase::Absent as u64 - u64::from(present);
        self.probe = (self.probe & !u64::from(PHASE_BITS | REVALIDATING)) | phase;
    }

    #[inline(always)]
    pub(super) fn set_orphan(&mut self, on: bool) {
        self.update(|s| s.set_orphan(on));
    }

    /// The verdict the entry gives a request that holds it; `None` in phase
    /// `Failed` (which may start a new probe).
    ///
    /// Read from a table, not matched: resolved keys are hits and misses in
    /// no order a predictor can learn, and a branch (or jump table) on the
    /// phase mispredicts about every other lookup; each misprediction throws
    /// away the loads of the lookups the processor had started ahead, which
    /// on a table larger than the cache is most of their cost.
    #[inline(always)]
    pub(super) fn verdict(&self) -> Option<LookupVerdict> {
        VERDICTS[usize::from(self.status().0 & (PHASE_BITS | REVALIDATING))]
    }
}

impl KeyCold {
    /// The cold part of a new key: its creator's reference.
    pub(super) const NEW: Self = Self { refs: 1, time: 0 };
}

/// The tracked keys: entries in a slab, found through a table of slots.
#[derive(Debug, Default)]
pub(super) struct KeyTable {
    index: SlotIndex,
    /// Each entry's hot part, with its cold part in a parallel array.
    slab: Slab<KeyEntry, KeyCold>,
}

impl KeyTable {
    #[inline(always)]
    pub(super) fn find(&self, key: &OffloadKey) -> Option<Slot> {
        self.find_entry(key).map(|(slot, _)| slot)
    }

    /// Starts loading the index line a lookup of `key` reads first.
    #[inline(always)]
    pub(super) fn prefetch_index(&self, key: &OffloadKey) {
        self.index.prefetch(key.prehash());
    }

    /// Starts loading the entry a lookup of `key` likely reads (the index
    /// line is read: call [`prefetch_index`](Self::prefetch_index) some
    /// keys before).
    #[inline(always)]
    pub(super) fn prefetch_entry(&self, key: &OffloadKey) {
        if let Some(p) = self
            .index
            .likely_slot(key.prehash())
            .and_then(|slot| self.slab.entry_ptr(slot))
        {
            prefetch_line(p.cast());
        }
    }

    /// The key's slot and hot entry, read once.
    #[inline(always)]
    pub(super) fn find_entry(&self, key: &OffloadKey) -> Option<(Slot, &KeyEntry)> {
        let slab = &self.slab;
        let mut found = None;
        let slot = self.index.find(key.prehash(), |slot| {
            found = slab.get(slot).filter(|entry| entry.key == *key);
            found.is_some()
        })?;
        Some((slot, found?))
    }

    /// Adds the entry `make` builds (in place) for a key not in the table,
    /// whose prehash is `hash`; `None` if the slab is full.
    #[inline]
    pub(super) fn insert(
        &mut self,
        hash: u64,
        cold: KeyCold,
        make: impl FnOnce() -> KeyEntry,
    ) -> Option<Slot> {
        let slot = self.slab.insert_with(cold, make)?;
        let slab = &self.slab;
        self.index.insert(hash, slot, |s| {
            slab.get(s).map_or(0, |entry| entry.key.prehash())
        });
        Some(slot)
    }

    #[inline]
    pub(super) fn remove(&mut self, slot: Slot) {
        let Some(entry) = self.slab.get(slot) else {
            return;
        };
        self.index.remove(entry.key.prehash(), slot);
        self.slab.remove(slot);
    }

    /// Both parts of the entry at `slot`.
    #[inline]
    pub(super) fn get_both(&mut self, slot: Slot) -> Option<(&mut KeyEntry, &mut KeyCold)> {
        self.slab.get_both(slot)
    }

    /// The cold part of the entry at `slot`.
    #[cfg(test)]
    pub(super) fn cold(&self, slot: Slot) -> Option<&KeyCold> {
        self.slab.cold(slot)
    }

    /// Both parts of the entry at `slot` if it still holds probe `generation`
    /// (generations wrap only after 2^56 probes, far more than can be live
    /// at once, so this also proves it is the same key).
    #[inline]
    pub(super) fn probe_both(&mut self, probe: Probe) -> Option<(&mut KeyEntry, &mut KeyCold)> {
        self.get_both(probe.0)
            .filter(|(entry, _)| entry.generation() == probe.1)
    }

    /// Moves the key at `slot` to phase `Failed`, to be probed again at
    /// `retry_at` (ticks).
    #[inline]
    pub(super) fn set_failed(&mut self, slot: Slot, retry_at: u64) {
        if let Some((state, cold)) = self.slab.get_both(slot) {
            state.set_phase(Phase::Failed);
            state.set_revalidating(false);
            cold.time = retry_at;
        }
    }

    /// Forgets every entry's request marks (after request serials were
    /// renumbered): the next ask of each key checks membership again.
    pub(super) fn forget_request_marks(&mut self) {
        for (entry, _) in self.slab.iter_mut() {
            entry.last_req = NO_REQUEST;
            entry.creator = NO_REQUEST;
        }
    }

    #[inline]
    pub(super) fn len(&self) -> usize {
        self.slab.len
    }

    #[inline]
    pub(super) fn is_empty(&self) -> bool {
        self.slab.len == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL_PHASES: [Phase; 6] = [
        Phase::Probing,
        Phase::Queued,
        Phase::Present,
        Phase::Absent,
        Phase::ForcedMiss,
        Phase::Failed,
    ];

    fn entry(phase: Phase, revalidating: bool, orphan: bool) -> KeyEntry {
        let mut entry = KeyEntry::new(OffloadKey::new(&[7; 36]), GENERATION_MASK, 0);
        entry.set_phase(phase);
        entry.set_revalidating(revalidating);
        entry.set_orphan(orphan);
        entry
    }

    #[test]
    fn a_status_keeps_its_phase_and_flags_apart() {
        for phase in ALL_PHASES {
            for (revalidating, orphan) in
                [(false, false), (false, true), (true, false), (true, true)]
            {
                let mut s = entry(phase, revalidating, orphan).status();
                assert_eq!(s.phase(), phase);
                assert!(s.is(phase));
                assert_eq!((s.revalidating(), s.orphan()), (revalidating, orphan));
                for other in ALL_PHASES {
                    s.set_phase(other);
                    assert_eq!(s.phase(), other);
                    assert_eq!((s.revalidating(), s.orphan()), (revalidating, orphan));
                }
                s.set_orphan(!orphan);
                assert_eq!((s.revalidating(), s.orphan()), (revalidating, !orphan));
                s.set_revalidating(!revalidating);
                assert_eq!((s.revalidating(), s.orphan()), (!revalidating, !orphan));
                assert_eq!(s.phase(), Phase::Failed);
            }
        }
        assert_eq!(KeyStatus::NEW.phase(), Phase::Probing);
        assert!(!KeyStatus::NEW.orphan() && !KeyStatus::NEW.revalidating());
    }

    #[test]
    fn the_verdict_table_answers_by_phase_and_revalidation_only() {
        use LookupVerdict::*;
        use Phase::*;
        for orphan in [false, true] {
            let v = |phase, revalidating| entry(phase, revalidating, orphan).verdict();
            for revalidating in [false, true] {
                assert_eq!(v(Present, revalidating), Some(Hit));
                assert_eq!(v(Absent, revalidating), Some(Miss));
                assert_eq!(v(ForcedMiss, revalidating), Some(Miss));
                assert_eq!(v(Failed, revalidating), None);
            }
            for waiting in [Probing, Queued] {
                assert_eq!(v(waiting, false), Some(Pending));
                assert_eq!(v(waiting, true), Some(Miss), "a re-check never waits");
            }
        }
    }

    #[test]
    fn the_status_byte_leaves_the_generation_alone() {
        for generation in [0, 1, 0x00ab_cdef_0123_4567, GENERATION_MASK] {
            let mut e = KeyEntry::new(OffloadKey::new(b"k"), generation, 3);
            e.set_phase(Phase::Failed);
            e.set_orphan(true);
            e.set_revalidating(true);
            assert_eq!(e.generation(), generation);
            e.set_answer(true);
            assert_eq!(
                (e.status().phase(), e.status().orphan()),
                (Phase::Present, true)
            );
            assert!(!e.status().revalidating());
            e.set_answer(false);
            assert_eq!(e.status().phase(), Phase::Absent);
            e.set_phase(Phase::Failed);
            e.set_revalidating(true);
            e.set_generation(next_generation(generation));
            assert_eq!(e.generation(), (generation + 1) & GENERATION_MASK);
            let s = e.status();
            assert_eq!(
                (s.phase(), s.orphan(), s.revalidating()),
                (Phase::Failed, true, true)
            );
            assert_eq!((e.last_req, e.creator), (3, 3));
        }
    }

    #[test]
    fn generations_compare_across_the_wrap() {
        let top = GENERATION_MASK;
        assert_eq!(next_generation(top), 0);
        for (a, b) in [(0, 1), (top, 0), (top - 5, 3), (1 << 54, (1 << 54) + 9)] {
            assert!(generation_before(a, b), "{a} before {b}");
            assert!(!generation_before(b, a), "{b} not before {a}");
        }
        assert!(!generation_before(7, 7));
    }

    #[test]
    fn a_resolved_lookup_reads_one_cache_line() {
        assert_eq!(std::mem::size_of::<Option<KeyEntry>>(), 64);
        assert_eq!(std::mem::align_of::<KeyEntry>(), 64);
        assert_eq!(std::mem::size_of::<KeyCold>(), 16);
    }
}
