//! The index the batch-lookup benches probe: the kvbench w5 shape (36-byte
//! keys, 16-byte payloads, twice as many slots as keys, closed and reopened)
//! and 1,024-key batches, half present and half absent.

use std::path::Path;

use kvtier_core::OffloadKey;
use kvtier_disk::{DiskConfig, DiskTier, FsyncPolicy};

/// Keys per batch, as a scheduler asks for them.
pub const BATCH: usize = 1024;
/// Key length (a 32-byte block hash and a 4-byte extra).
pub const KEY_LEN: usize = 36;

/// A deterministic 36-byte key for `id` (the id in the first bytes).
pub fn key(id: u64) -> OffloadKey {
    let mut bytes = [0u8; KEY_LEN];
    let mut x = id ^ 0x6b76_7469_6572;
    for chunk in bytes.chunks_mut(8) {
        x = splitmix(x);
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
    bytes[..8].copy_from_slice(&id.to_be_bytes());
    OffloadKey::new(&bytes)
}

fn splitmix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn config(path: &Path, slots: u64) -> DiskConfig {
    DiskConfig {
        key_len: KEY_LEN,
        capacity_bytes: 8 << 30,
        segment_bytes: 256 << 20,
        initial_slots: slots,
        fsync: FsyncPolicy::Never,
        ..DiskConfig::new(path)
    }
}

/// Stores keys `0..n`, closes cleanly and opens the tier again.
pub fn filled_tier(path: &Path, n: u64) -> DiskTier {
    let tier = DiskTier::open(config(path, n * 2)).expect("open the bench tier");
    for i in 0..n {
        tier.store_blocking(&key(i), &i.to_le_bytes().repeat(2))
            .expect("store a bench key");
    }
    tier.close().expect("close the bench tier");
    drop(tier);
    DiskTier::open(config(path, n * 2)).expect("reopen the bench tier")
}

/// `count` batches over keys `0..n`: even positions present, odd absent.
pub fn batches(n: u64, count: usize) -> Vec<Vec<OffloadKey>> {
    let mut x = 0x5eed_u64;
    (0..count)
        .map(|_| {
            (0..BATCH)
                .map(|j| {
                    x = splitmix(x);
                    let id = x % n;
                    key(if j % 2 == 0 { id } else { n + id })
                })
                .collect()
        })
        .collect()
}

/// How many keys the index holds: `KVTIER_BENCH_KEYS`, else `default`.
pub fn key_count(default: u64) -> u64 {
    std::env::var("KVTIER_BENCH_KEYS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}
