//! The host memory that jobs of a queue have claimed, by address: a load
//! job's regions are written, so they may overlap no region of any job; a
//! store job's regions are only read, so they may overlap each other but
//! no load's.

use std::collections::BTreeMap;
use std::ops::Range;

/// Address ranges claimed by the jobs queued or running.
#[derive(Debug, Default)]
pub(super) struct Busy {
    /// Ranges loads write, `start → end`; never overlapping each other.
    written: BTreeMap<usize, usize>,
    /// Ranges stores read, `(start, end) → how many claims`.
    read: BTreeMap<(usize, usize), u32>,
    /// The longest range ever read: a read range overlapping `r` starts
    /// after `r.start - longest_read`.
    longest_read: usize,
}

impl Busy {
    /// The first range of `ranges` (by position) that a load may not write
    /// because a claimed range overlaps it.
    pub(super) fn write_conflict(&self, ranges: &[Range<usize>]) -> Option<usize> {
        ranges
            .iter()
            .position(|r| !r.is_empty() && (self.overlaps_written(r) || self.overlaps_read(r)))
    }

    /// The first range of `ranges` that a store may not read because a load
    /// writes into it.
    pub(super) fn read_conflict(&self, ranges: &[Range<usize>]) -> Option<usize> {
        ranges
            .iter()
            .position(|r| !r.is_empty() && self.overlaps_written(r))
    }

    /// Claims `ranges` for a load; they overlap nothing claimed (checked by
    /// [`write_conflict`](Self::write_conflict)) nor each other.
    pub(super) fn claim_written(&mut self, ranges: &[Range<usize>]) {
        for r in ranges.iter().filter(|r| !r.is_empty()) {
            self.written.insert(r.start, r.end);
        }
    }

    /// Claims `ranges` for a store.
    pub(super) fn claim_read(&mut self, ranges: &[Range<usize>]) {
        for r in ranges.iter().filter(|r| !r.is_empty()) {
            *self.read.entry((r.start, r.end)).or_insert(0) += 1;
            self.longest_read = self.longest_read.max(r.len());
        }
    }

    /// Releases the claims of a load.
    pub(super) fn release_written(&mut self, ranges: &[Range<usize>]) {
        for r in ranges.iter().filter(|r| !r.is_empty()) {
            self.written.remove(&r.start);
        }
    }

    /// Releases the claims of a store.
    pub(super) fn release_read(&mut self, ranges: &[Range<usize>]) {
        for r in ranges.iter().filter(|r| !r.is_empty()) {
            if let Some(count) = self.read.get_mut(&(r.start, r.end)) {
                *count -= 1;
                if *count == 0 {
                    self.read.remove(&(r.start, r.end));
                }
            }
        }
        if self.read.is_empty() {
            self.longest_read = 0;
        }
    }

    fn overlaps_written(&self, r: &Range<usize>) -> bool {
        // The written ranges are disjoint: only the last one starting before
        // `r` ends can reach into it.
        self.written
            .range(..r.end)
            .next_back()
            .is_some_and(|(_, &end)| end > r.start)
    }

    fn overlaps_read(&self, r: &Range<usize>) -> bool {
        let from = r.start.saturating_sub(self.longest_read);
        self.read
            .range((from, 0)..(r.end, 0))
            .any(|(&(_, end), _)| end > r.start)
    }
}

/// The first pair of `ranges` (positions) that overlap, if any.
pub(super) fn overlapping_pair(ranges: &[Range<usize>]) -> Option<(usize, usize)> {
    let mut order: Vec<usize> = (0..ranges.len())
        .filter(|&i| !ranges[i].is_empty())
        .collect();
    order.sort_unstable_by_key(|&i| ranges[i].start);
    order
        .windows(2)
        .find(|w| ranges[w[0]].end > ranges[w[1]].start)
        .map(|w| (w[0].min(w[1]), w[0].max(w[1])))
}

#[cfg(test)]
mod tests {
    // One-range slices are what these tests pass, on purpose.
    #![allow(clippy::single_range_in_vec_init)]
    use super::*;

    #[test]
    fn loads_conflict_with_everything_and_stores_only_with_loads() {
        let mut busy = Busy::default();
        busy.claim_written(&[100..200]);
        busy.claim_read(&[300..400, 300..400, 350..360]);
        assert_eq!(busy.write_conflict(&[0..100, 200..300, 400..500]), None);
        assert_eq!(busy.write_conflict(&[0..100, 199..201]), Some(1));
        assert_eq!(busy.write_conflict(&[0..1, 399..400]), Some(1));
        assert_eq!(busy.write_conflict(&[355..356]), Some(0));
        assert_eq!(busy.read_conflict(&[300..400, 150..151]), Some(1));
        assert_eq!(busy.read_conflict(&[0..100, 200..1000]), None);
        busy.release_read(&[300..400]);
        assert_eq!(
            busy.write_conflict(&[390..391]),
            Some(0),
            "one claim remains"
        );
        busy.release_read(&[300..400, 350..360]);
        assert_eq!(busy.write_conflict(&[300..400]), None);
        busy.release_written(&[100..200]);
        assert_eq!(busy.read_conflict(&[0..1000]), None);
        assert_eq!(
            busy.write_conflict(&[5..5]),
            None,
            "empty ranges claim nothing"
        );
    }

    #[test]
    fn overlapping_pairs_are_found_in_any_order() {
        assert_eq!(overlapping_pair(&[0..10, 20..30, 10..20]), None);
        assert_eq!(overlapping_pair(&[20..30, 0..10, 25..26]), Some((0, 2)));
        assert_eq!(overlapping_pair(&[5..5, 5..5]), None);
    }
}
