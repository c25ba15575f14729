//! Shared pieces of kvtier's programs: `scheduler_sim` (the main job),
//! `kvbench` (benchmarks) and the examples meant to be copied.
//!
//! Nothing here is needed to use kvtier; it is what the programs share.

#![deny(missing_docs)]
#![warn(clippy::unwrap_used)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicIsize, Ordering};
use std::time::Duration;

use kvtier_core::OffloadKey;

pub mod plot;

/// A global allocator that counts live heap bytes, for memory figures.
///
/// Install it in a binary with
/// `#[global_allocator] static ALLOC: CountingAlloc = CountingAlloc::new();`.
#[derive(Debug)]
pub struct CountingAlloc {
    live: AtomicIsize,
    enabled: AtomicBool,
}

impl CountingAlloc {
    /// A counter at zero, switched off (it then costs one relaxed load per
    /// allocation and no shared write).
    pub const fn new() -> Self {
        Self {
            live: AtomicIsize::new(0),
            enabled: AtomicBool::new(false),
        }
    }

    /// Starts or stops counting. Bytes freed while counting that were
    /// allocated before it started make the figure lower, so measure a
    /// difference between two readings taken while counting.
    pub fn set_enabled(&self, on: bool) {
        self.enabled.store(on, Ordering::SeqCst);
    }

    fn add(&self, delta: isize) {
        if self.enabled.load(Ordering::Relaxed) {
            self.live.fetch_add(delta, Ordering::Relaxed);
        }
    }

    /// Heap bytes allocated and not yet freed.
    pub fn live_bytes(&self) -> isize {
        self.live.load(Ordering::SeqCst)
    }
}

impl Default for CountingAlloc {
    fn default() -> Self {
        Self::new()
    }
}

// SAFETY: every method forwards to `System` with the caller's arguments
// unchanged, and only adds bookkeeping on an atomic counter.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as is; the caller upholds `alloc`'s contract.
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            self.add(layout.size() as isize);
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded as is; the caller upholds `dealloc`'s contract.
        unsafe { System.dealloc(ptr, layout) };
        self.add(-(layout.size() as isize));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded as is; the caller upholds `realloc`'s contract.
        let new = unsafe { System.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            self.add(new_size as isize - layout.size() as isize);
        }
        new
    }
}

/// SplitMix64, for reproducible workloads without a dependency.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }

    /// True with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        ((self.next_u64() >> 11) as f64 / (1u64 << 53) as f64) < p
    }
}

/// A key of `len` bytes (at least 8) derived from `id`, the way a content
/// hash would look: well mixed, unique per id.
pub fn key_from_id(id: u64, len: usize) -> OffloadKey {
    let mut rng = Rng::new(id ^ 0x6b76_7469_6572);
    let mut bytes = vec![0u8; len.max(8)];
    for chunk in bytes.chunks_mut(8) {
        let word = rng.next_u64().to_le_bytes();
        chunk.copy_from_slice(&word[..chunk.len()]);
    }
    // The id itself in the first bytes makes uniqueness obvious.
    bytes[..8].copy_from_slice(&id.to_be_bytes());
    OffloadKey::new(&bytes)
}

/// The `q` percentile (`q` from 0 to 1) of `samples` by nearest rank: the
/// smallest sample with at least a fraction `q` of all samples at or below
/// it, so it is always one of the samples (a mark drawn at `(p, q)` lies
/// on the empirical CDF). NaN samples are ignored; 0 when none is left.
///
/// Every figure the programs print (scheduler_sim's header, table, JSON
/// and plot; kvbench's medians and percentiles) comes from this function.
pub fn percentile(samples: &[f64], q: f64) -> f64 {
    let mut sorted: Vec<f64> = samples.iter().copied().filter(|v| !v.is_nan()).collect();
    sorted.sort_by(f64::total_cmp);
    percentile_of_sorted(&sorted, q)
}

/// [`percentile`] of samples already sorted in increasing order.
pub fn percentile_of_sorted(sorted: &[f64], q: f64) -> f64 {
    let n = sorted.len();
    if n == 0 {
        return 0.0;
    }
    // The rank ceil(q * n), from 1 to n; the tolerance keeps a product such
    // as 0.29 * 100 = 28.999999999999996 at rank 29.
    let rank = (q.clamp(0.0, 1.0) * n as f64 - 1e-9).ceil();
    let index = if rank < 1.0 {
        0
    } else {
        (rank as usize - 1).min(n - 1)
    };
    sorted[index]
}

/// Microseconds as a float.
pub fn micros(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_unique_and_sized() {
        let a = key_from_id(1, 32);
        let b = key_from_id(2, 32);
        assert_ne!(a, b);
        assert_eq!(a.len(), 32);
        assert_eq!(key_from_id(1, 32), a);
    }

    #[test]
    fn percentiles_of_a_known_distribution() {
        // 1, 2, ..., 1000 in a scrambled order: the q percentile is 1000 q.
        let mut rng = Rng::new(3);
        let mut samples: Vec<f64> = (1..=1000).map(f64::from).collect();
        for i in (1..samples.len()).rev() {
            let j = rng.below(i as u64 + 1) as usize;
            samples.swap(i, j);
        }
        for (q, expected) in [
            (0.0, 1.0),
            (0.001, 1.0),
            (0.29, 290.0),
            (0.5, 500.0),
            (0.9, 900.0),
            (0.99, 990.0),
            (0.999, 999.0),
            (1.0, 1000.0),
        ] {
            assert_eq!(percentile(&samples, q), expected, "q = {q}");
        }
        // Five samples: the median is the third, p90 and p99 the largest.
        let five = [5.0, 1.0, 3.0, 2.0, 4.0];
        assert_eq!(percentile(&five, 0.5), 3.0);
        assert_eq!(percentile(&five, 0.9), 5.0);
        assert_eq!(percentile(&five, 0.2), 1.0);
        assert_eq!(percentile(&five, 0.21), 2.0);
        assert_eq!(percentile(&[], 0.5), 0.0);
        assert_eq!(percentile(&[f64::NAN, 2.0], 0.5), 2.0);
    }

    #[test]
    fn the_median_of_two_modes_is_a_sample_of_the_lower_half() {
        // Half the requests answered in 0.03 ms, half in 2 ms: the median is
        // the 32nd of 64 samples, 0.03, by every figure that prints one.
        let samples: Vec<f64> = (0..64)
            .map(|i| if i % 2 == 0 { 0.03 } else { 2.0 })
            .collect();
        assert_eq!(percentile(&samples, 0.5), 0.03);
        assert_eq!(percentile(&samples, 0.51), 2.0);
    }
}
