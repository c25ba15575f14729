//! [`KeyMemo`]: the keys a manager built from `bytes` objects, by object
//! identity, so a key passed again step after step is not hashed again.

use pyo3::ffi;
use pyo3::prelude::*;

use kvtier_core::{INLINE_KEY_CAPACITY, OffloadKey};

use crate::convert::KeyObj;

/// Keys built from `bytes` objects, by object identity.
///
/// A scheduler asks for a request's keys step after step, mostly with the
/// same `bytes` objects; building a key hashes its bytes, which costs more
/// than the rest of a resolved lookup's binding. The memo holds a reference
/// to each object it keys (so its address cannot be reused while it is
/// here, and `bytes` is immutable): a hit is a few address comparisons in
/// a [`MEMO_WAYS`]-way set-associative table of [`MEMO_SETS`] sets, and the
/// key's bytes are not read. Only exact `bytes` objects of at most
/// [`INLINE_KEY_CAPACITY`] bytes are kept (their release runs no Python
/// code, and they are small). A caller that passes new objects each time
/// gains nothing from it: when a window of [`MEMO_WINDOW`] insertions saw
/// fewer hits than half that, the memo empties and the next
/// [`MEMO_BYPASS`] keys it does not have are built without being kept.
/// Used with the GIL held only (the lookups' fast path).
#[derive(Default)]
pub(crate) struct KeyMemo {
    /// `MEMO_WAYS * MEMO_SETS` entries once used, set after set (the
    /// latest insertion first).
    slots: Vec<MemoSlot>,
    /// The key of the last key `insert` did not keep (`push_key` builds
    /// such keys in place and leaves this slot as it was).
    scratch: Option<OffloadKey>,
    /// Keys asked for since the window started (counted per call).
    asked: usize,
    /// Insertions since the window started.
    inserted: usize,
    /// Keys left that are built without being kept.
    bypass: usize,
    /// A list of keys for `lookup_many`'s batched path, kept between calls
    /// (emptied) so that it allocates once.
    batch: Vec<OffloadKey>,
}

/// One entry of the memo: an object it holds and its key.
struct MemoSlot {
    obj: Option<Py<PyAny>>,
    key: OffloadKey,
}

/// Sets of the key memo: 8,192 entries of 56 bytes (about 460 KB,
/// allocated on first use), holding at most that many small `bytes`
/// objects. Four ways: 2,048 keys of a step then rarely crowd a set.
const MEMO_SETS: usize = 2048;

/// Entries per set of the key memo.
const MEMO_WAYS: usize = 4;

/// Insertions per window of the memo's hit rate.
const MEMO_WINDOW: usize = MEMO_WAYS * MEMO_SETS;

/// When a window saw fewer hits than half its insertions' count, the next
/// this many keys the memo does not have are built without being kept.
const MEMO_BYPASS: usize = 16 * MEMO_WINDOW;

impl KeyMemo {
    /// The first of the slots of `ptr`'s set.
    #[inline(always)]
    fn set_of(ptr: *mut ffi::PyObject) -> usize {
        // Object addresses are 16-byte aligned; a multiplicative hash
        // spreads them, its top bits index the set.
        let h = ((ptr as usize as u64) >> 4).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        MEMO_WAYS * (h >> (64 - MEMO_SETS.trailing_zeros())) as usize
    }

    /// The key of the `bytes` object `obj`.
    ///
    /// # Safety
    /// `obj` is alive for the call (the GIL is held: `py`).
    #[inline]
    pub(crate) unsafe fn key(&mut self, py: Python<'_>, obj: KeyObj) -> &OffloadKey {
        let ptr = obj.as_ptr();
        if !self.slots.is_empty() {
            let at = Self::slot_with(&self.slots, ptr);
            if at != usize::MAX {
                return &self.slots[at].key;
            }
        }
        // SAFETY: forwarded.
        unsafe { self.insert(py, obj) }
    }

    /// Pushes the key of the `bytes` object `obj` onto `out`: [`key`](Self::key)
    /// without the copy through the scratch slot while the memo stands
    /// aside (a long list of keys never seen again), the batched path's
    /// common case.
    ///
    /// # Safety
    /// As for [`key`](Self::key).
    #[inline(always)]
    pub(crate) unsafe fn push_key(
        &mut self,
        py: Python<'_>,
        obj: KeyObj,
        out: &mut Vec<OffloadKey>,
    ) {
        if self.slots.is_empty() && self.bypass > 0 {
            // What `insert` does while bypassing, the key built where it
            // is kept (see `OffloadKey::write_new`).
            self.bypass -= 1;
            out.reserve(1);
            // SAFETY: forwarded.
            let bytes = unsafe { obj.bytes() };
            OffloadKey::write_new(&mut out.spare_capacity_mut()[0], bytes);
            // SAFETY: the item past the length was just initialised.
            unsafe { out.set_len(out.len() + 1) };
            return;
        }
        // SAFETY: forwarded.
        out.push(unsafe { self.key(py, obj) }.clone());
    }

    /// The index of the slot holding `ptr`, or `usize::MAX`.
    #[inline(always)]
    fn slot_with(slots: &[MemoSlot], ptr: *mut ffi::PyObject) -> usize {
        let set = Self::set_of(ptr);
        let ways = &slots[set..set + MEMO_WAYS];
        for (way, slot) in ways.iter().enumerate() {
            if slot.obj.as_ref().is_some_and(|o| o.as_ptr() == ptr) {
                return set + way;
            }
        }
        usize::MAX
    }

    /// `key` for an object not in the memo.
    ///
    /// # Safety
    /// As for `key`.
    #[inline(never)]
    unsafe fn insert(&mut self, py: Python<'_>, obj: KeyObj) -> &OffloadKey {
        let ptr = obj.as_ptr();
        // SAFETY: `obj` is alive and the GIL held (the contract).
        let key = unsafe { obj.key() };
        // SAFETY: as above.
        if self.bypass > 0
            || unsafe { ffi::Py_TYPE(ptr) } != std::ptr::addr_of_mut!(ffi::PyBytes_Type)
            || key.len() > INLINE_KEY_CAPACITY
        {
            // A subclass's instance (its release could run Python code),
            // or a long key (likely invalid, and the memo keeps objects
            // small), or the memo stands aside: not kept; the scratch slot
            // holds its key for this use.
            self.bypass = self.bypass.saturating_sub(1);
            return self.scratch.insert(key);
        }
        if self.inserted >= MEMO_WINDOW {
            // Every key asked for was a hit or an insertion (or one of
            // the few keys not kept).
            let hits = self.asked.saturating_sub(self.inserted);
            self.asked = 0;
            self.inserted = 0;
            if hits < MEMO_WINDOW / 2 {
                self.bypass = MEMO_BYPASS;
                self.release(py);
                return self.scratch.insert(key);
            }
        }
        if self.slots.is_empty() {
            let empty = OffloadKey::new(&[]);
            self.slots = (0..MEMO_WAYS * MEMO_SETS)
                .map(|_| MemoSlot {
                    obj: None,
                    key: empty.clone(),
                })
                .collect();
        }
        self.inserted += 1;
        // SAFETY: `ptr` is alive (the contract); a new reference, owned by
        // the memo.
        let held = unsafe { Borrowed::from_ptr(py, ptr) }.to_owned().unbind();
        // The new key goes first; the others move down one way, and the
        // last one leaves.
        let set = Self::set_of(ptr);
        let ways = &mut self.slots[set..set + MEMO_WAYS];
        ways.rotate_right(1);
        let leaving = std::mem::replace(
            &mut ways[0],
            MemoSlot {
                obj: Some(held),
                key,
            },
        );
        Self::drop_slot(py, leaving);
        &self.slots[set].key
    }

    /// Releases a slot's object now. (Dropped as a `Bound`, the reference
    /// is released at once; a `Py` dropped in a METH_FASTCALL entry point,
    /// where PyO3 does not count the GIL as held, would be deferred.) An
    /// exact `bytes` object's release runs no Python code.
    #[inline]
    fn drop_slot(py: Python<'_>, slot: MemoSlot) {
        if let Some(obj) = slot.obj {
            drop(obj.into_bound(py));
        }
    }

    /// The batch list (empty; see [`put_batch`](Self::put_batch)).
    #[inline]
    pub(crate) fn take_batch(&mut self) -> Vec<OffloadKey> {
        std::mem::take(&mut self.batch)
    }

    /// Keeps `keys`' allocation for the next batch (its keys are dropped).
    #[inline]
    pub(crate) fn put_batch(&mut self, mut keys: Vec<OffloadKey>) {
        keys.clear();
        self.batch = keys;
    }

    /// Notes that a call asks for `n` keys (once per call: the hit rate
    /// decides whether the memo is worth keeping objects for).
    #[inline(always)]
    pub(crate) fn count(&mut self, n: usize) {
        self.asked = self.asked.wrapping_add(n);
    }

    /// Releases every object and the table.
    #[cold]
    fn release(&mut self, py: Python<'_>) {
        for slot in std::mem::take(&mut self.slots) {
            Self::drop_slot(py, slot);
        }
    }
}
