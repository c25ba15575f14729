//! The request registry: each live request's serial and the keys it holds
//! references to, found by the id's address or the id itself, with the
//! request of the previous lookup cached.

use std::collections::HashMap;
use std::sync::Arc;

use super::FastMap;
use super::batch::RUN_CAPACITY;
use super::slab::{Slab, Slot};
use super::table::{KeyTable, NO_REQUEST};
use crate::key::ReqContext;

/// A request's shared references are compacted (sorted, duplicates
/// released) when their number reaches this, or twice the number left by
/// the previous compaction.
pub(super) const SHARED_COMPACT_MIN: usize = 64;

/// How many emptied key lists of cleaned-up requests the registry keeps for
/// new requests (128 bytes each).
const SPARE_LISTS: usize = 128;

/// The keys created by another request that a request also refers to: one
/// entry per reference taken. Taking a reference is a push, with no
/// membership check: a request that asks again for a key it already shares
/// (after another request asked for it in between) pushes it again and
/// holds one more reference, which its cleanup releases like the first.
/// When the list doubles it is compacted: sorted, and each duplicate's extra
/// reference released at once, so it never holds more than twice the keys
/// it refers to.
///
/// A request usually asks for its keys in the same order every step, so a
/// cursor follows the list: a key found at the cursor (or, the scan having
/// started again, at the front) is one the request already holds, and no
/// reference is taken again. Only a key in the list proves membership
/// (the request's reference keeps the key and its slot alive), so a
/// cursor gone stale costs a duplicate reference at most, never a wrong one.
#[derive(Debug, Default)]
pub(super) struct SharedRefs {
    pub(super) slots: Vec<Slot>,
    compact_at: usize,
    /// Where the next shared key the request asks for probably is.
    cursor: usize,
}

impl SharedRefs {
    /// Whether `slot` is at the cursor, just before it (asked for again: a
    /// prefix scan, then a lookup; a failed key's re-check) or at the front
    /// of the list; then the request holds it, and the cursor moves past it.
    #[inline(always)]
    pub(super) fn follows(&mut self, slot: Slot) -> bool {
        if self.slots.get(self.cursor) == Some(&slot) {
            self.cursor += 1;
            true
        } else {
            self.follows_not_next(slot)
        }
    }

    /// [`follows`](Self::follows) for a key not at the cursor.
    #[inline]
    fn follows_not_next(&mut self, slot: Slot) -> bool {
        if self.cursor > 0 && self.slots.get(self.cursor - 1) == Some(&slot) {
            true
        } else if self.slots.first() == Some(&slot) {
            self.cursor = 1;
            true
        } else {
            false
        }
    }

    /// Sorts the list and releases each duplicate's extra reference in
    /// `keys` (the entry left holds one, so no key is freed here).
    #[cold]
    pub(super) fn compact(&mut self, keys: &mut KeyTable) {
        self.slots.sort_unstable();
        let mut kept = 0;
        for i in 0..self.slots.len() {
            let slot = self.slots[i];
            if kept > 0 && self.slots[kept - 1] == slot {
                if let Some((_, cold)) = keys.get_both(slot) {
                    cold.refs = cold.refs.saturating_sub(1);
                }
            } else {
                self.slots[kept] = slot;
                kept += 1;
            }
        }
        self.slots.truncate(kept);
        self.compact_at = 2 * kept;
        self.cursor = 0;
    }
}

/// One live request.
#[derive(Debug)]
pub(super) struct RequestEntry {
    pub(super) serial: u32,
    /// Keys this request created: it holds a reference to each (their
    /// entries name it as `creator`, so no set membership is needed).
    pub(super) created: Vec<Slot>,
    /// Keys created by another request that this one also refers to.
    pub(super) shared: SharedRefs,
    /// The sequence number of this request's group still waiting in the
    /// ready queue, if any (a flush tops it up instead of queueing another).
    pub(super) queued_group: Option<u64>,
    /// The batch epoch of this request's last run (see `Batch::epoch`).
    pub(super) batch_epoch: u64,
}

/// The request of the previous lookup: the address of its id's `Arc`
/// (compared with the asking context's, never dereferenced), its slot and
/// serial. The address cannot be another request's while it is cached:
/// the `Arc` is the one the request was registered with, kept by
/// `by_id` until its cleanup (which forgets this), or a clone in
/// `last_hold`. No reference is counted per request switch, so the
/// scheduler thread never touches the `Arc`'s count, which the worker
/// writes when it drops a finished call's context.
#[derive(Debug, Clone, Copy)]
pub(super) struct LastRequest {
    /// 0 for none: no `Arc` is at address 0.
    pub(super) id: usize,
    pub(super) slot: Slot,
    pub(super) serial: u32,
}

impl LastRequest {
    /// No request cached: no context's address matches it.
    const NONE: Self = Self {
        id: 0,
        slot: 0,
        serial: NO_REQUEST,
    };
}

/// The address of a context's id, to compare with [`LastRequest::id`].
#[inline(always)]
pub(super) fn id_address(ctx: &ReqContext) -> usize {
    Arc::as_ptr(ctx.req_id_arc()).cast::<u8>().addr()
}

/// The live requests.
///
/// Invariant: no two live requests share a serial (serials are 32 bits, in
/// every key's hot entry; when they run out the live requests are
/// renumbered from 0), and `last`, when set, names the live request whose
/// id `Arc` is at its address, an `Arc` kept alive by `by_id` or
/// `last_hold` for as long as it is cached.
#[derive(Debug)]
pub(super) struct Requests {
    /// Request id → its entry in `slab`.
    by_id: FastMap<Arc<str>, Slot>,
    /// The address of each id `Arc` in `by_id` → the same entry: a request
    /// switch finds its request from the context's pointer, without reading
    /// the id, whose line the worker writes when it drops a finished call's
    /// context (and which a scheduler's long-lived request has not touched
    /// for a while).
    by_address: FastMap<usize, Slot>,
    slab: Slab<RequestEntry>,
    /// The request of the previous lookup, to skip hashing its id again.
    pub(super) last: LastRequest,
    /// A clone of the previous lookup's id when it is not the `Arc` the
    /// request was registered with (a caller passing another context with
    /// the same id): keeps its address that request's while it is cached.
    last_hold: Option<Arc<str>>,
    next_serial: u32,
    /// Emptied key lists of cleaned-up requests, of `RUN_CAPACITY`, reused
    /// by new requests: a step then allocates no list per request.
    spare_lists: Vec<Vec<Slot>>,
}

impl Default for Requests {
    fn default() -> Self {
        Self {
            by_id: FastMap::default(),
            by_address: FastMap::default(),
            slab: Slab::default(),
            last: LastRequest::NONE,
            last_hold: None,
            next_serial: 0,
            spare_lists: Vec::new(),
        }
    }
}

impl Requests {
    /// The entry at `request`.
    #[inline(always)]
    pub(super) fn get_mut(&mut self, request: Slot) -> Option<&mut RequestEntry> {
        self.slab.get_mut(request)
    }

    /// The entry at `request.0` if it still has serial `request.1` (the
    /// request that made a run or group is still live).
    #[inline]
    pub(super) fn live_mut(&mut self, request: (Slot, u32)) -> Option<&mut RequestEntry> {
        self.slab
            .get_mut(request.0)
            .filter(|r| r.serial == request.1)
    }

    /// Whether the request at `request` holds `slot` by its cursor (see
    /// [`SharedRefs::follows`]).
    #[inline(always)]
    pub(super) fn follows(&mut self, request: Slot, slot: Slot) -> bool {
        self.slab
            .get_mut(request)
            .is_some_and(|req| req.shared.follows(slot))
    }

    /// Records that the request at `request` created `slot`.
    #[inline]
    pub(super) fn add_created(&mut self, request: Slot, slot: Slot) {
        if let Some(req) = self.slab.get_mut(request) {
            if req.created.capacity() == 0 {
                req.created = new_list(&mut self.spare_lists);
            }
            req.created.push(slot);
        }
    }

    /// Takes a reference of the request at `request` to `slot`, created by
    /// another request, unless its cursor shows it holds one (`not_held`:
    /// the caller asked the cursor already, and it did not). `None` if no
    /// reference was taken; else whether the request's shared list is due
    /// for [`compact`](SharedRefs::compact).
    #[inline]
    pub(super) fn share(&mut self, request: Slot, slot: Slot, not_held: bool) -> Option<bool> {
        let req = self.slab.get_mut(request)?;
        if !not_held && req.shared.follows(slot) {
            return None;
        }
        let shared = &mut req.shared;
        if shared.slots.capacity() == 0 {
            shared.slots = new_list(&mut self.spare_lists);
        }
        shared.slots.push(slot);
        shared.cursor = shared.slots.len();
        Some(shared.slots.len() >= shared.compact_at.max(SHARED_COMPACT_MIN))
    }

    /// The request's slot and serial if it is registered (the previous
    /// lookup's, or found by its id's address or its id).
    #[inline]
    pub(super) fn find(&mut self, ctx: &ReqContext) -> Option<(Slot, u32)> {
        let address = id_address(ctx);
        let last = self.last;
        if last.id == address {
            return Some((last.slot, last.serial));
        }
        // The context carries the id `Arc` the request was registered with
        // (kept in `by_id` until its cleanup): the same request.
        if let Some(&slot) = self.by_address.get(&address)
            && let Some(entry) = self.slab.get(slot)
        {
            let serial = entry.serial;
            self.cache(address, slot, serial, None);
            return Some((slot, serial));
        }
        let (registered, &slot) = self.by_id.get_key_value(ctx.req_id())?;
        let serial = self.slab.get(slot)?.serial;
        let hold =
            (!Arc::ptr_eq(registered, ctx.req_id_arc())).then(|| Arc::clone(ctx.req_id_arc()));
        self.cache(address, slot, serial, hold);
        Some((slot, serial))
    }

    /// Whether serials ran out: the next [`register`](Self::register) needs
    /// [`renumber`](Self::renumber) first.
    #[inline]
    pub(super) fn serials_exhausted(&self) -> bool {
        self.next_serial == NO_REQUEST
    }

    /// Registers a request not yet known; `None` if 2^32 requests are live.
    #[inline]
    pub(super) fn register(&mut self, ctx: &ReqContext) -> Option<(Slot, u32)> {
        let serial = self.next_serial;
        if serial == NO_REQUEST {
            return None;
        }
        let slot = self.slab.insert(
            RequestEntry {
                serial,
                created: Vec::new(),
                shared: SharedRefs::default(),
                queued_group: None,
                batch_epoch: u64::MAX,
            },
            (),
        )?;
        self.next_serial += 1;
        self.by_id.insert(Arc::clone(ctx.req_id_arc()), slot);
        let address = id_address(ctx);
        self.by_address.insert(address, slot);
        self.cache(address, slot, serial, None);
        Some((slot, serial))
    }

    fn cache(&mut self, id: usize, slot: Slot, serial: u32, hold: Option<Arc<str>>) {
        self.last = LastRequest { id, slot, serial };
        self.last_hold = hold;
    }

    /// Gives the live requests the serials 0, 1, …; returns the map from
    /// old serials to new ones, for the runs and groups that name them, and
    /// forgets the cached request. Key marks naming old serials are for the
    /// caller to forget.
    #[cold]
    pub(super) fn renumber(&mut self) -> HashMap<u32, u32> {
        let mut renumbered = HashMap::new();
        let mut next = 0u32;
        for (entry, ()) in self.slab.iter_mut() {
            renumbered.insert(entry.serial, next);
            entry.serial = next;
            next = next.saturating_add(1);
        }
        self.cache(0, 0, NO_REQUEST, None);
        self.next_serial = next;
        renumbered
    }

    /// Unregisters request `req_id` and returns its entry, whose references
    /// are for the caller to release.
    pub(super) fn remove(&mut self, req_id: &str) -> Option<RequestEntry> {
        let (id, slot) = self.by_id.remove_entry(req_id)?;
        self.by_address
            .remove(&Arc::as_ptr(&id).cast::<u8>().addr());
        let entry = self.slab.remove(slot)?;
        if self.last.serial == entry.serial {
            self.cache(0, 0, NO_REQUEST, None);
        }
        Some(entry)
    }

    /// Keeps a removed entry's key lists, emptied, for new requests.
    pub(super) fn recycle(&mut self, entry: RequestEntry) {
        for mut list in [entry.created, entry.shared.slots] {
            if list.capacity() == RUN_CAPACITY && self.spare_lists.len() < SPARE_LISTS {
                list.clear();
                self.spare_lists.push(list);
            }
        }
    }

    pub(super) fn len(&self) -> usize {
        self.by_id.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.by_id.is_empty() && self.by_address.is_empty()
    }

    /// Starts serials at `serial`, to test their wrap-around.
    #[cfg(test)]
    pub(super) fn set_next_serial(&mut self, serial: u32) {
        self.next_serial = serial;
    }

    /// The number of entries on the shared list of request `req_id`.
    #[cfg(test)]
    pub(super) fn shared_len(&self, req_id: &str) -> usize {
        let slot = self.by_id[req_id];
        self.slab.get(slot).map_or(0, |r| r.shared.slots.len())
    }
}

/// An empty key list with room for `RUN_CAPACITY` keys, reused if one is spare.
#[inline]
fn new_list(spare: &mut Vec<Vec<Slot>>) -> Vec<Slot> {
    spare
        .pop()
        .unwrap_or_else(|| Vec::with_capacity(RUN_CAPACITY))
}
