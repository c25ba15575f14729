//! Helpers shared by the disk tier's tests.
#![allow(dead_code)]

use std::path::Path;

use kvtier_core::OffloadKey;
use kvtier_disk::{DiskConfig, FsyncPolicy};

/// A 36-byte key for `i`.
pub fn key(i: u64) -> OffloadKey {
    let mut bytes = [0u8; 36];
    bytes[..8].copy_from_slice(&i.to_be_bytes());
    bytes[8..16].copy_from_slice(&(i.wrapping_mul(0x9E37_79B9_7F4A_7C15)).to_le_bytes());
    OffloadKey::new(&bytes)
}

/// A batch for the in-place forms: each key with its block.
pub fn pairs<'a>(keys: &'a [OffloadKey], blocks: &'a [Vec<u8>]) -> Vec<(&'a OffloadKey, &'a [u8])> {
    keys.iter()
        .zip(blocks)
        .map(|(k, b)| (k, b.as_slice()))
        .collect()
}

/// The payload stored under key `i` (version `v`): length and bytes derived from both.
pub fn payload(i: u64, v: u64, max: usize) -> Vec<u8> {
    let len = 1 + ((i.wrapping_mul(31) ^ v.wrapping_mul(17)) as usize % max.max(1));
    (0..len)
        .map(|j| (i as usize + j * 7 + v as usize * 13) as u8)
        .collect()
}

/// A small configuration: 64 KiB segments, 4 MiB capacity, 64 initial slots.
pub fn small(dir: &Path) -> DiskConfig {
    DiskConfig {
        segment_bytes: 64 << 10,
        capacity_bytes: 4 << 20,
        initial_slots: 64,
        fsync: FsyncPolicy::Never,
        ..DiskConfig::new(dir)
    }
}

// The on-disk layout (format version 2, documented in the crate's private
// `format` module, whose unit tests pin these values): where the tests write
// their damage.

/// Where the index header's unchecksummed counters start.
pub const COUNTERS_AT: usize = 512;
/// Bytes of a segment record before its key.
pub const RECORD_HEADER_SIZE: usize = 32;

/// A put's payload starts at a multiple of this many bytes in its segment.
pub const PAYLOAD_ALIGN: usize = 64;

/// The zero bytes between the key and the payload of a put written at
/// `offset` of its segment.
pub fn payload_gap(offset: usize, key_len: usize) -> usize {
    (PAYLOAD_ALIGN - (offset + RECORD_HEADER_SIZE + key_len) % PAYLOAD_ALIGN) % PAYLOAD_ALIGN
}

/// Bytes of one put record written at `offset`: header, key, gap, payload,
/// padded to 8.
pub fn put_record_size(offset: usize, key_len: usize, payload_len: usize) -> usize {
    (RECORD_HEADER_SIZE + key_len + payload_gap(offset, key_len) + payload_len + 7) & !7
}

/// Where the payload of a put written at `offset` starts.
pub fn payload_at(offset: usize, key_len: usize) -> usize {
    offset + RECORD_HEADER_SIZE + key_len + payload_gap(offset, key_len)
}
