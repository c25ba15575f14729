//! Storage with stable indices: the key table's slab and its segmented vector.

/// Index of a key's entry in the key table.
pub(super) type Slot = u32;

/// log2 of the number of values in one [`SegVec`] segment.
const SEGMENT_SHIFT: u32 = 10;
const SEGMENT_LEN: usize = 1 << SEGMENT_SHIFT;

/// A vector in fixed segments of `SEGMENT_LEN` values, each allocated
/// exactly: growing never copies the values and leaves at most one segment
/// partly unused, where a doubling `Vec` leaves up to half its capacity
/// (and the key table is most of the manager's memory).
#[derive(Debug)]
pub(super) struct SegVec<T> {
    segments: Vec<Vec<T>>,
    len: usize,
}

impl<T> Default for SegVec<T> {
    fn default() -> Self {
        Self {
            segments: Vec::new(),
            len: 0,
        }
    }
}

impl<T> SegVec<T> {
    #[inline(always)]
    pub(super) fn get(&self, i: usize) -> Option<&T> {
        self.segments
            .get(i >> SEGMENT_SHIFT)?
            .get(i & (SEGMENT_LEN - 1))
    }

    #[inline]
    pub(super) fn get_mut(&mut self, i: usize) -> Option<&mut T> {
        self.segments
            .get_mut(i >> SEGMENT_SHIFT)?
            .get_mut(i & (SEGMENT_LEN - 1))
    }

    #[inline]
    pub(super) fn push(&mut self, value: T) {
        match self.segments.last_mut() {
            Some(segment) if segment.len() < SEGMENT_LEN => segment.push(value),
            _ => {
                let mut segment = Vec::with_capacity(SEGMENT_LEN);
                segment.push(value);
                self.segments.push(segment);
            }
        }
        self.len += 1;
    }

    /// Stores `value` at `i` (an existing index) or at the end (`i == len`).
    #[inline]
    pub(super) fn set(&mut self, i: usize, value: T) {
        match self.get_mut(i) {
            Some(v) => *v = value,
            None => self.push(value),
        }
    }

    #[inline]
    pub(super) fn clear(&mut self) {
        self.segments.clear();
        self.len = 0;
    }

    #[inline]
    pub(super) fn iter_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.segments.iter_mut().flatten()
    }
}

/// Values with stable `u32` indices; freed indices are reused, most
/// recently freed first (its memory is likely still cached).
#[derive(Debug)]
pub(super) struct Slab<T> {
    entries: SegVec<Option<T>>,
    free: Vec<Slot>,
    pub(super) len: usize,
}

impl<T> Default for Slab<T> {
    fn default() -> Self {
        Self {
            entries: SegVec::default(),
            free: Vec::new(),
            len: 0,
        }
    }
}

impl<T> Slab<T> {
    /// Stores `value`; `None` when all 2^32 indices are taken.
    #[inline]
    pub(super) fn insert(&mut self, value: T) -> Option<Slot> {
        let slot = match self.free.pop() {
            Some(slot) => {
                self.entries.set(slot as usize, Some(value));
                slot
            }
            None => {
                let slot = Slot::try_from(self.entries.len).ok()?;
                self.entries.push(Some(value));
                slot
            }
        };
        self.len += 1;
        Some(slot)
    }

    #[inline]
    pub(super) fn get(&self, slot: Slot) -> Option<&T> {
        self.entries.get(slot as usize)?.as_ref()
    }

    #[inline]
    pub(super) fn get_mut(&mut self, slot: Slot) -> Option<&mut T> {
        self.entries.get_mut(slot as usize)?.as_mut()
    }

    #[inline]
    pub(super) fn remove(&mut self, slot: Slot) -> Option<T> {
        let value = self.entries.get_mut(slot as usize)?.take()?;
        self.len -= 1;
        if self.len == 0 {
            // Start again from index 0: keeps indices dense after a burst.
            self.entries.clear();
            self.free.clear();
        } else {
            self.free.push(slot);
        }
        Some(value)
    }

    #[inline]
    pub(super) fn iter_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.entries.iter_mut().flatten()
    }
}
