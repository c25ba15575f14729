//! Storage with stable indices: the key table's slab, in fixed segments.

/// Index of a key's entry in the key table.
pub(super) type Slot = u32;

/// log2 of the number of entries in one segment.
const SEGMENT_SHIFT: u32 = 10;
const SEGMENT_LEN: usize = 1 << SEGMENT_SHIFT;

/// One segment: `SEGMENT_LEN` entries and their cold parts, allocated
/// whole when the segment is added.
#[derive(Debug)]
struct Segment<T, C> {
    hot: [Option<T>; SEGMENT_LEN],
    cold: [C; SEGMENT_LEN],
}

/// Values with stable `u32` indices, each with a cold part `C` kept in a
/// parallel array (reached through the same segment, so reading both parts
/// costs one segment lookup); freed indices are reused, most recently freed
/// first (its memory is likely still cached).
///
/// The entries live in fixed segments of `SEGMENT_LEN`, each allocated
/// exactly: growing never copies them and leaves at most one segment partly
/// unused, where a doubling `Vec` leaves up to half its capacity (and the
/// key table is most of the manager's memory). A fixed segment also needs
/// no bounds check within it.
#[derive(Debug)]
pub(super) struct Slab<T, C = ()> {
    segments: Vec<Box<Segment<T, C>>>,
    /// Indices `0..end` were handed out at least once since the slab was
    /// last empty; entries past it are `None`.
    end: usize,
    free: Vec<Slot>,
    pub(super) len: usize,
}

impl<T, C> Default for Slab<T, C> {
    fn default() -> Self {
        Self {
            segments: Vec::new(),
            end: 0,
            free: Vec::new(),
            len: 0,
        }
    }
}

impl<T, C: Copy + Default> Slab<T, C> {
    /// Stores `value` with its cold part; `None` when all 2^32 indices are
    /// taken.
    #[inline]
    pub(super) fn insert(&mut self, value: T, cold: C) -> Option<Slot> {
        self.insert_with(cold, || value)
    }

    /// [`insert`](Self::insert) of the value `make` returns, made once its
    /// place is known (so it can be built there rather than copied).
    #[inline(always)]
    pub(super) fn insert_with(&mut self, cold: C, make: impl FnOnce() -> T) -> Option<Slot> {
        let slot = match self.free.pop() {
            Some(slot) => slot,
            None => {
                let slot = Slot::try_from(self.end).ok()?;
                if self.end >> SEGMENT_SHIFT == self.segments.len() {
                    self.add_segment();
                }
                self.end += 1;
                slot
            }
        };
        let Segment {
            hot,
            cold: cold_part,
        } = &mut **self.segments.get_mut(slot as usize >> SEGMENT_SHIFT)?;
        let i = slot as usize & (SEGMENT_LEN - 1);
        // A free index holds `None`: nothing to drop (no drop glue to run).
        debug_assert!(hot[i].is_none(), "slab index {slot} handed out twice");
        std::mem::forget(hot[i].replace(make()));
        cold_part[i] = cold;
        self.len += 1;
        Some(slot)
    }

    /// Adds a segment, built in place on the heap (it is 80 KiB for the key
    /// table: `Box::new` would build it on the stack first).
    #[cold]
    fn add_segment(&mut self) {
        let mut segment = Box::<Segment<T, C>>::new_uninit();
        let p = segment.as_mut_ptr();
        // SAFETY: `p` points to memory for one `Segment`; every element of
        // both its arrays (its only fields) is written before
        // `assume_init`, through raw pointers that never read it.
        let segment = unsafe {
            let hot = (&raw mut (*p).hot).cast::<Option<T>>();
            let cold = (&raw mut (*p).cold).cast::<C>();
            for i in 0..SEGMENT_LEN {
                hot.add(i).write(None);
                cold.add(i).write(C::default());
            }
            segment.assume_init()
        };
        self.segments.push(segment);
    }

    #[inline(always)]
    pub(super) fn get(&self, slot: Slot) -> Option<&T> {
        let hot = &self.segments.get(slot as usize >> SEGMENT_SHIFT)?.hot;
        hot[slot as usize & (SEGMENT_LEN - 1)].as_ref()
    }

    /// Where the entry at `slot` lives, without reading it (for a prefetch).
    #[inline(always)]
    pub(super) fn entry_ptr(&self, slot: Slot) -> Option<*const Option<T>> {
        let hot = &self.segments.get(slot as usize >> SEGMENT_SHIFT)?.hot;
        Some(hot.as_ptr().wrapping_add(slot as usize & (SEGMENT_LEN - 1)))
    }

    #[inline(always)]
    pub(super) fn get_mut(&mut self, slot: Slot) -> Option<&mut T> {
        let hot = &mut self.segments.get_mut(slot as usize >> SEGMENT_SHIFT)?.hot;
        hot[slot as usize & (SEGMENT_LEN - 1)].as_mut()
    }

    /// Both parts of the entry at `slot`, if it holds one.
    #[inline(always)]
    pub(super) fn get_both(&mut self, slot: Slot) -> Option<(&mut T, &mut C)> {
        let Segment { hot, cold } = &mut **self.segments.get_mut(slot as usize >> SEGMENT_SHIFT)?;
        let i = slot as usize & (SEGMENT_LEN - 1);
        Some((hot[i].as_mut()?, &mut cold[i]))
    }

    /// The cold part of the entry at `slot`, if it holds one.
    #[cfg(test)]
    pub(super) fn cold(&self, slot: Slot) -> Option<&C> {
        let Segment { hot, cold } = &**self.segments.get(slot as usize >> SEGMENT_SHIFT)?;
        let i = slot as usize & (SEGMENT_LEN - 1);
        hot[i].as_ref().map(|_| &cold[i])
    }

    #[inline]
    pub(super) fn remove(&mut self, slot: Slot) -> Option<T> {
        let hot = &mut self.segments.get_mut(slot as usize >> SEGMENT_SHIFT)?.hot;
        let value = hot[slot as usize & (SEGMENT_LEN - 1)].take()?;
        self.len -= 1;
        if self.len == 0 {
            // Start again from index 0: keeps indices dense after a burst.
            // Every entry is `None` now; the first segment stays, so a slab
            // that empties often does not allocate it again each time.
            self.segments.truncate(1);
            self.free.clear();
            self.end = 0;
        } else {
            self.free.push(slot);
        }
        Some(value)
    }

    /// Every entry with its cold part.
    #[inline]
    pub(super) fn iter_mut(&mut self) -> impl Iterator<Item = (&mut T, &mut C)> {
        self.segments.iter_mut().flat_map(|segment| {
            let Segment { hot, cold } = &mut **segment;
            hot.iter_mut()
                .zip(cold.iter_mut())
                .filter_map(|(h, c)| Some((h.as_mut()?, c)))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn indices_are_stable_reused_and_restart_when_empty() {
        let mut slab: Slab<u32, u8> = Slab::default();
        let slots: Vec<Slot> = (0..2 * SEGMENT_LEN as u32 + 5)
            .map(|v| slab.insert(v, (v % 7) as u8).unwrap())
            .collect();
        assert_eq!(slots, (0..2 * SEGMENT_LEN as u32 + 5).collect::<Vec<_>>());
        assert_eq!(
            slab.get(SEGMENT_LEN as u32 + 3),
            Some(&(SEGMENT_LEN as u32 + 3))
        );
        assert_eq!(slab.get(3 * SEGMENT_LEN as u32), None);
        assert_eq!(slab.remove(7), Some(7));
        assert_eq!(slab.get(7), None);
        assert_eq!(slab.cold(7), None);
        assert_eq!(slab.insert(100, 1), Some(7));
        assert_eq!(slab.get_both(7).map(|(v, c)| (*v, *c)), Some((100, 1)));
        assert_eq!(slab.iter_mut().count(), slots.len());
        for slot in slots {
            slab.remove(slot);
        }
        assert_eq!(slab.len, 0);
        assert_eq!(slab.insert(1, 0), Some(0));
    }
}
