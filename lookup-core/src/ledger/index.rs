//! The key table's index: a hash table of slab slots in chunks of one cache
//! line each, twelve one-byte tags next to their twelve slots.
//!
//! A lookup reads one line of the index (the home chunk of the key's hash:
//! its tags and the slots they stand for) and then the entry itself, where a
//! table of separate control bytes and slots (hashbrown's) reads two lines
//! of the index first. Collisions probe the next chunks in order.
//!
//! Removal leaves no tombstone. Each chunk counts the entries that passed
//! it because it was full when they were inserted ("overflow", as in
//! folly's F14): a search stops at the first chunk whose count is 0, or
//! after one round of the chunks (every chunk may count an overflow at
//! once, and an entry is always less than a round from its home), and a
//! removal decrements the counts along the entry's probe path, so the
//! table after a removal is the table as if the entry had never been
//! inserted. Under the scheduler's churn (every step inserts and removes a
//! cohort of keys) nothing is left behind to lengthen a search, where
//! tombstones would lengthen every unsuccessful search until the next
//! rehash.
//!
//! The number of chunks is not a power of two: the home chunk is the high
//! half of the hash times the chunk count (a multiply, no division), so the
//! table grows by half, and its memory per key stays close to its load
//! factor's. The tag is the hash's low seven bits, with the high bit set
//! (0 marks a free place).

use super::slab::Slot;

/// Places per chunk.
const WIDTH: usize = 12;
/// At most this many entries per chunk on average before the table grows.
const MAX_LOAD: usize = 10;
/// The bits of a mask that stand for places (see [`Chunk::matches`]).
const PLACES: u32 = (1 << WIDTH) - 1;

/// One cache line: the tags, the overflow count, and the slots.
#[derive(Clone, Copy, Debug, Default)]
#[repr(C, align(64))]
struct Chunk {
    /// Bytes 0..12: a tag per place (0: free); 12..14: the overflow count
    /// (little-endian, saturating: once at its maximum it stays there,
    /// which only makes searches go on, until the next rehash); 14..16:
    /// unused.
    head: [u8; 16],
    slots: [Slot; WIDTH],
}

impl Chunk {
    /// Bit `i` set for each place `i` whose tag is `tag`.
    #[inline(always)]
    fn matches(&self, tag: u8) -> u32 {
        bytes_equal(&self.head, tag) & PLACES
    }

    /// Bit `i` set for each free place `i`.
    #[inline(always)]
    fn free(&self) -> u32 {
        bytes_equal(&self.head, 0) & PLACES
    }

    #[inline(always)]
    fn overflow(&self) -> u16 {
        u16::from_le_bytes([self.head[12], self.head[13]])
    }

    #[inline(always)]
    fn set_overflow(&mut self, count: u16) {
        [self.head[12], self.head[13]] = count.to_le_bytes();
    }
}

/// The first place a mask from [`Chunk::matches`] or [`Chunk::free`] has.
#[inline(always)]
fn place(mask: u32) -> usize {
    mask.trailing_zeros() as usize
}

/// Bit `i` set for each byte `i` of `bytes` equal to `byte`: one compare of
/// 16 bytes at once.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn bytes_equal(bytes: &[u8; 16], byte: u8) -> u32 {
    use std::arch::x86_64::{_mm_cmpeq_epi8, _mm_loadu_si128, _mm_movemask_epi8, _mm_set1_epi8};
    // SAFETY: SSE2, which these need, is part of every x86_64 target; the
    // unaligned load reads the 16 bytes of `bytes`, no more.
    let mask = unsafe {
        let v = _mm_loadu_si128(bytes.as_ptr().cast());
        _mm_movemask_epi8(_mm_cmpeq_epi8(v, _mm_set1_epi8(byte as i8)))
    };
    mask as u32
}

/// [`bytes_equal`] elsewhere, a byte at a time.
#[cfg(not(target_arch = "x86_64"))]
#[inline(always)]
fn bytes_equal(bytes: &[u8; 16], byte: u8) -> u32 {
    bytes
        .iter()
        .enumerate()
        .fold(0, |mask, (i, &b)| mask | (u32::from(b == byte) << i))
}

/// Asks the processor to start loading the cache line at `p` (a hint: no
/// fault, no effect on what the program computes).
#[inline(always)]
pub(super) fn prefetch_line(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE, which the prefetch instruction needs, is part of every
    // x86_64 target; a prefetch never faults, whatever the address.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// The tag of a hash: its low seven bits, with the high bit set.
#[inline(always)]
fn tag_of(hash: u64) -> u8 {
    (hash as u8) | 0x80
}

/// A hash table of slab slots keyed by the hash of the entry at each slot;
/// the caller compares entries (see the module docs).
#[derive(Debug)]
pub(super) struct SlotIndex {
    /// Never empty: a search needs no check for a table without chunks.
    chunks: Box<[Chunk]>,
    len: usize,
    /// `MAX_LOAD` per chunk: an insertion at this many entries grows first.
    grow_at: usize,
}

impl Default for SlotIndex {
    fn default() -> Self {
        Self {
            chunks: vec![Chunk::default()].into_boxed_slice(),
            len: 0,
            grow_at: MAX_LOAD,
        }
    }
}

impl SlotIndex {
    /// The first chunk of `hash`'s probe sequence.
    #[inline(always)]
    fn home(&self, hash: u64) -> usize {
        ((u128::from(hash) * self.chunks.len() as u128) >> 64) as usize
    }

    #[inline(always)]
    fn next(&self, i: usize) -> usize {
        if i + 1 == self.chunks.len() { 0 } else { i + 1 }
    }

    /// The slot whose entry `is` says is the one hashed to `hash`.
    #[inline(always)]
    pub(super) fn find(&self, hash: u64, mut is: impl FnMut(Slot) -> bool) -> Option<Slot> {
        let tag = tag_of(hash);
        let mut i = self.home(hash);
        let mut passed = 0;
        loop {
            let chunk = &self.chunks[i];
            let mut found = chunk.matches(tag);
            while found != 0 {
                let slot = chunk.slots[place(found)];
                if is(slot) {
                    return Some(slot);
                }
                found &= found - 1;
            }
            if chunk.overflow() == 0 {
                return None;
            }
            // At most one round of the ring: every chunk may count an
            // overflow at once (the keys that spilled past each are still
            // there), and an entry is always less than a round from home.
            passed += 1;
            if passed == self.chunks.len() {
                return None;
            }
            i = self.next(i);
        }
    }

    /// Starts loading the chunk a search for `hash` reads first.
    #[inline(always)]
    pub(super) fn prefetch(&self, hash: u64) {
        prefetch_line(std::ptr::from_ref(&self.chunks[self.home(hash)]).cast());
    }

    /// The first slot of `hash`'s home chunk whose tag matches: the likely
    /// entry of a key hashed to `hash` (its key is not compared).
    #[inline(always)]
    pub(super) fn likely_slot(&self, hash: u64) -> Option<Slot> {
        let chunk = &self.chunks[self.home(hash)];
        let found = chunk.matches(tag_of(hash));
        (found != 0).then(|| chunk.slots[place(found)])
    }

    /// Adds `slot`, whose entry hashes to `hash` (not in the index yet);
    /// `rehash` gives the hash of any slot already in it, for growing.
    #[inline]
    pub(super) fn insert(&mut self, hash: u64, slot: Slot, rehash: impl Fn(Slot) -> u64) {
        if self.len >= self.grow_at {
            self.grow(rehash);
        }
        self.place(hash, slot);
        self.len += 1;
    }

    /// Puts `slot` in the first free place of `hash`'s probe sequence,
    /// counting an overflow in each full chunk passed (there is a free
    /// place: the load is below `WIDTH` per chunk).
    #[inline(always)]
    fn place(&mut self, hash: u64, slot: Slot) {
        let mut i = self.home(hash);
        loop {
            let chunk = &mut self.chunks[i];
            let free = chunk.free();
            if free != 0 {
                let at = place(free);
                chunk.head[at] = tag_of(hash);
                chunk.slots[at] = slot;
                return;
            }
            chunk.set_overflow(chunk.overflow().saturating_add(1));
            i = self.next(i);
        }
    }

    /// Removes `slot`, whose entry hashes to `hash`; `false` if it is not
    /// in the index.
    #[inline]
    pub(super) fn remove(&mut self, hash: u64, slot: Slot) -> bool {
        let tag = tag_of(hash);
        let home = self.home(hash);
        let mut i = home;
        loop {
            let chunk = &mut self.chunks[i];
            let mut found = chunk.matches(tag);
            while found != 0 {
                let at = place(found);
                if chunk.slots[at] == slot && chunk.head[at] == tag {
                    chunk.head[at] = 0;
                    self.len -= 1;
                    // The chunks it passed on insertion count it no more.
                    let mut j = home;
                    while j != i {
                        let passed = &mut self.chunks[j];
                        let count = passed.overflow();
                        if count != u16::MAX {
                            passed.set_overflow(count - 1);
                        }
                        j = self.next(j);
                    }
                    return true;
                }
                found &= found - 1;
            }
            if chunk.overflow() == 0 {
                return false;
            }
            i = self.next(i);
            // At most one round of the ring, as in `find`.
            if i == home {
                return false;
            }
        }
    }

    /// Half as many chunks again (at least one more), every slot placed
    /// anew from its hash; the overflow counts start over.
    #[cold]
    fn grow(&mut self, rehash: impl Fn(Slot) -> u64) {
        let n = self.chunks.len();
        let old = std::mem::replace(
            &mut self.chunks,
            vec![Chunk::default(); (n + n / 2).max(n + 1)].into_boxed_slice(),
        );
        self.grow_at = MAX_LOAD * self.chunks.len();
        for chunk in old.iter() {
            let mut taken = !chunk.free() & PLACES;
            while taken != 0 {
                let slot = chunk.slots[place(taken)];
                self.place(rehash(slot), slot);
                taken &= taken - 1;
            }
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.len
    }

    /// Every slot in the index, for checks.
    #[cfg(test)]
    fn slots(&self) -> Vec<Slot> {
        let mut all = Vec::new();
        for chunk in self.chunks.iter() {
            for at in 0..WIDTH {
                if chunk.head[at] != 0 {
                    all.push(chunk.slots[at]);
                }
            }
        }
        all.sort_unstable();
        all
    }

    /// The overflow counts the chunks would have if every slot in the
    /// index were inserted afresh, in the order of its place now.
    #[cfg(test)]
    fn overflow_counts(&self, rehash: impl Fn(Slot) -> u64) -> Vec<u16> {
        let mut counts = vec![0u16; self.chunks.len()];
        for (i, chunk) in self.chunks.iter().enumerate() {
            for at in 0..WIDTH {
                if chunk.head[at] != 0 {
                    let mut j = self.home(rehash(chunk.slots[at]));
                    while j != i {
                        counts[j] += 1;
                        j = self.next(j);
                    }
                }
            }
        }
        counts
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use proptest::prelude::*;

    use super::*;

    #[test]
    fn a_chunk_is_one_cache_line() {
        assert_eq!(std::mem::size_of::<Chunk>(), 64);
        assert_eq!(std::mem::align_of::<Chunk>(), 64);
    }

    #[test]
    fn tags_match_their_places_only() {
        let mut chunk = Chunk::default();
        for (i, tag) in [0x80u8, 0x81, 0xff, 0x80, 0x00, 0x9a]
            .into_iter()
            .enumerate()
        {
            chunk.head[i] = tag;
        }
        let places = |mask: u32| {
            (0..WIDTH)
                .filter(|i| mask >> i & 1 == 1)
                .collect::<Vec<_>>()
        };
        assert_eq!(places(chunk.free()), vec![4, 6, 7, 8, 9, 10, 11]);
        assert_eq!(places(chunk.matches(0x9a)), vec![5]);
        assert_eq!(places(chunk.matches(0xff)), vec![2]);
        assert_eq!(places(chunk.matches(0x80)), vec![0, 3]);
        // The count and the spare bytes are not places.
        chunk.set_overflow(0x8080);
        assert_eq!(chunk.overflow(), 0x8080);
        assert_eq!(places(chunk.matches(0x80)), vec![0, 3]);
        chunk.set_overflow(0);
        assert_eq!(places(chunk.free()), vec![4, 6, 7, 8, 9, 10, 11]);
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u16),
        Remove(u16),
        Find(u16),
    }

    /// Hashes with many collisions: few home chunks, few tags, so probe
    /// sequences are long, chunks overflow, and false tag matches abound.
    fn colliding_hash(id: u16) -> u64 {
        let home_bits = u64::from(id % 7) << 61;
        let tag_bits = u64::from(id % 3);
        home_bits | tag_bits | (u64::from(id) << 8)
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (0..600u16).prop_map(Op::Insert),
            3 => (0..600u16).prop_map(Op::Remove),
            3 => (0..600u16).prop_map(Op::Find),
        ]
    }

    /// Hashes spread over every chunk, as the keys' are: with few keys per
    /// chunk, every chunk can end up counting an overflow.
    fn uniform_hash(id: u16) -> u64 {
        let mut x = u64::from(id).wrapping_add(0x9e37_79b9_7f4a_7c15);
        x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        x ^ (x >> 31)
    }

    proptest! {
        /// The index against a map from slot to hash, with hashes that
        /// collide on purpose or spread evenly: every find, insert and
        /// removal agrees, and after each the overflow counts are those of
        /// the slots present inserted afresh (no tombstone, no count left
        /// behind).
        #[test]
        fn the_index_matches_a_map(
            ops in proptest::collection::vec(op(), 1..800),
            uniform in any::<bool>(),
        ) {
            let mut index = SlotIndex::default();
            let mut model: HashMap<Slot, u64> = HashMap::new();
            let hash = |slot: Slot| {
                if uniform {
                    uniform_hash(slot as u16)
                } else {
                    colliding_hash(slot as u16)
                }
            };
            for op in &ops {
                match *op {
                    Op::Insert(id) => {
                        let slot = Slot::from(id);
                        if let std::collections::hash_map::Entry::Vacant(absent) = model.entry(slot) {
                            index.insert(hash(slot), slot, hash);
                            absent.insert(hash(slot));
                        }
                    }
                    Op::Remove(id) => {
                        let slot = Slot::from(id);
                        prop_assert_eq!(index.remove(hash(slot), slot), model.remove(&slot).is_some());
                    }
                    Op::Find(id) => {
                        let slot = Slot::from(id);
                        let mut compared = 0;
                        let found = index.find(hash(slot), |s| {
                            compared += 1;
                            s == slot
                        });
                        prop_assert_eq!(found, model.contains_key(&slot).then_some(slot));
                        prop_assert!(compared <= model.len() + 1);
                    }
                }
                prop_assert_eq!(index.len(), model.len());
                let mut want: Vec<Slot> = model.keys().copied().collect();
                want.sort_unstable();
                prop_assert_eq!(index.slots(), want);
                let counts: Vec<u16> = index.chunks.iter().map(Chunk::overflow).collect();
                prop_assert_eq!(counts, index.overflow_counts(hash));
            }
        }
    }

    /// A hash whose home is chunk 0 of a 2-chunk table (`low`) or chunk 1,
    /// with a distinct tag and body per `id`.
    fn in_half(second: bool, id: u32) -> u64 {
        (u64::from(second) << 63) | (u64::from(id) << 8) | u64::from(id & 0x7f)
    }

    #[test]
    fn a_search_ends_when_every_chunk_has_overflowed() {
        // Once every chunk counts an overflow, a search for an absent key
        // still ends, after one round of the chunks.
        let mut index = SlotIndex::default();
        let hashes: std::cell::RefCell<HashMap<Slot, u64>> = Default::default();
        let add = |index: &mut SlotIndex, slot: Slot, hash: u64| {
            hashes.borrow_mut().insert(slot, hash);
            index.insert(hash, slot, |s| hashes.borrow()[&s]);
        };
        // 13 keys homed in chunk 0: the table grows to 2 chunks at the 11th,
        // chunk 0 fills at the 12th, and the 13th spills into chunk 1.
        for slot in 0..13 {
            add(&mut index, slot, in_half(false, slot));
        }
        assert_eq!(index.chunks.len(), 2);
        assert_eq!(index.chunks[0].overflow(), 1);
        // Eight of chunk 0's own keys leave (their path passed no chunk).
        for slot in 0..8 {
            assert!(index.remove(in_half(false, slot), slot));
        }
        // 12 keys homed in chunk 1: 11 fill it, the 12th spills into chunk 0.
        for slot in 100..112 {
            add(&mut index, slot, in_half(true, slot));
        }
        assert_eq!(index.chunks.len(), 2, "17 keys stay below the growth point");
        assert_eq!(
            (index.chunks[0].overflow(), index.chunks[1].overflow()),
            (1, 1)
        );
        // Every chunk has overflowed: a search for an absent key, and the
        // removal of one, end after one round of the ring.
        for second in [false, true] {
            let absent = in_half(second, 999);
            let mut compared = 0;
            assert_eq!(
                index.find(absent, |_| {
                    compared += 1;
                    false
                }),
                None
            );
            assert!(compared <= index.len());
            assert!(!index.remove(absent, 999));
        }
        // The keys present are all still found.
        for (&slot, &hash) in hashes.borrow().iter().filter(|(s, _)| **s >= 8) {
            assert_eq!(index.find(hash, |s| s == slot), Some(slot));
        }
    }

    #[test]
    fn a_search_past_a_removed_key_stops_where_a_fresh_table_would() {
        // Fill one home chunk and spill three keys into the next ones, then
        // remove the spilled keys: the home chunk's count is back to 0, so
        // a search for an absent key reads the home chunk only.
        let same_home = |id: u32| u64::from(id) << 8; // home 0 while chunks are few
        let mut index = SlotIndex::default();
        for slot in 0..(WIDTH as u32 + 3) {
            index.insert(same_home(slot), slot, same_home);
        }
        let home = index.home(same_home(0));
        assert!(index.chunks[home].overflow() > 0);
        for slot in WIDTH as u32..(WIDTH as u32 + 3) {
            assert!(index.remove(same_home(slot), slot));
        }
        assert_eq!(index.chunks[home].overflow(), 0);
        let mut compared = 0;
        assert_eq!(
            index.find(same_home(99), |_| {
                compared += 1;
                false
            }),
            None
        );
        assert!(compared <= WIDTH);
    }

    #[test]
    fn the_table_grows_by_half_and_keeps_every_slot() {
        let hash = |s: Slot| (u64::from(s)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let mut index = SlotIndex::default();
        let mut sizes = Vec::new();
        for slot in 0..100_000u32 {
            index.insert(hash(slot), slot, hash);
            if sizes.last() != Some(&index.chunks.len()) {
                sizes.push(index.chunks.len());
            }
        }
        assert!(
            sizes
                .windows(2)
                .all(|w| w[1] == (w[0] + w[0] / 2).max(w[0] + 1)),
            "{sizes:?}"
        );
        // Memory: at most 64 bytes per MAX_LOAD keys, times the growth.
        assert!(index.chunks.len() * 64 <= 100_000 * 64 * 3 / 2 / MAX_LOAD + 64);
        for slot in (0..100_000u32).step_by(7) {
            assert_eq!(index.find(hash(slot), |s| s == slot), Some(slot));
        }
        assert_eq!(index.find(hash(100_001), |s| s == 100_001), None);
    }
}
