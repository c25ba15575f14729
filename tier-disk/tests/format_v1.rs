//! A directory written by an earlier build (index format version 1,
//! records "KVR1", no gap before the payload) opens in this build, with
//! every block it held, whether its index is used (and upgraded to
//! version 2) or rebuilt from its segments; blocks stored afterwards (with
//! the version-2 gap) sit beside the old ones across a reopen.
//!
//! The fixture (`tests/fixtures/format-v1`) was written by the build before
//! the format change: keys `[i; 36]` for i in 0..6, the payload of key `i`
//! 100 + 97 i bytes (`j * 31 + i`), key 5 then removed; 4 KiB segments.
mod common;

use std::os::unix::fs::FileExt;
use std::path::Path;

use kvtier_core::OffloadKey;
use kvtier_disk::{DiskConfig, DiskTier, FsyncPolicy};

fn fixture_key(i: u8) -> OffloadKey {
    OffloadKey::new(&[i; 36])
}

fn fixture_payload(i: u8) -> Vec<u8> {
    (0..(100 + 97 * i as usize))
        .map(|j| (j as u8).wrapping_mul(31).wrapping_add(i))
        .collect()
}

fn config(dir: &Path) -> DiskConfig {
    DiskConfig {
        key_len: 36,
        initial_slots: 16,
        segment_bytes: 4096,
        capacity_bytes: 1 << 20,
        fsync: FsyncPolicy::Always,
        ..DiskConfig::new(dir)
    }
}

/// A copy of the fixture in a temporary directory.
fn copy_fixture() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let from = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/format-v1");
    for name in ["index.kvx", "seg-0000000000000001.kvs"] {
        std::fs::copy(from.join(name), dir.path().join(name)).unwrap();
    }
    dir
}

fn index_version(dir: &Path) -> u32 {
    let mut version = [0u8; 4];
    std::fs::File::open(dir.join("index.kvx"))
        .unwrap()
        .read_exact_at(&mut version, 8)
        .unwrap();
    u32::from_le_bytes(version)
}

/// Every fixture block loads back as stored; key 5 stays removed.
fn check_fixture_blocks(tier: &DiskTier) {
    for i in 0..5 {
        assert_eq!(
            tier.load_blocking(&fixture_key(i)).unwrap(),
            Some(fixture_payload(i)),
            "key {i}"
        );
    }
    assert_eq!(tier.load_blocking(&fixture_key(5)).unwrap(), None);
    let present = tier
        .contains_many(&(0..6).map(fixture_key).collect::<Vec<_>>())
        .unwrap();
    assert_eq!(present, [true, true, true, true, true, false]);
}

#[test]
fn a_version_1_directory_opens_with_its_index_and_is_upgraded() {
    let dir = copy_fixture();
    assert_eq!(index_version(dir.path()), 1, "the fixture is version 1");
    {
        let tier = DiskTier::open(config(dir.path())).unwrap();
        assert!(!tier.stats().rebuilt_index, "the version-1 index is used");
        assert_eq!(index_version(dir.path()), 2, "upgraded at open");
        check_fixture_blocks(&tier);
        // New blocks (version-2 records) beside the old ones.
        for i in 1000..1020 {
            tier.store_blocking(&common::key(i), &common::payload(i, 0, 700))
                .unwrap();
        }
        tier.close().unwrap();
    }
    let tier = DiskTier::open(config(dir.path())).unwrap();
    check_fixture_blocks(&tier);
    for i in 1000..1020 {
        assert_eq!(
            tier.load_blocking(&common::key(i)).unwrap(),
            Some(common::payload(i, 0, 700))
        );
    }
}

#[test]
fn a_version_1_directory_without_its_index_is_rebuilt_from_its_records() {
    let dir = copy_fixture();
    std::fs::remove_file(dir.path().join("index.kvx")).unwrap();
    let tier = DiskTier::open(config(dir.path())).unwrap();
    let stats = tier.stats();
    assert!(stats.rebuilt_index);
    assert_eq!(stats.rebuild_damaged, 0, "every KVR1 record reads as valid");
    check_fixture_blocks(&tier);
    tier.store_blocking(&common::key(1000), b"new").unwrap();
    tier.close().unwrap();
    drop(tier);
    // Mixed segments (KVR1 then KVR2 records) rebuild too.
    std::fs::remove_file(dir.path().join("index.kvx")).unwrap();
    let tier = DiskTier::open(config(dir.path())).unwrap();
    assert_eq!(tier.stats().rebuild_damaged, 0);
    check_fixture_blocks(&tier);
    assert_eq!(
        tier.load_blocking(&common::key(1000)).unwrap().as_deref(),
        Some(&b"new"[..])
    );
}

/// An index from a later format version is refused, untouched.
#[test]
fn an_index_of_a_later_version_is_refused_untouched() {
    let dir = copy_fixture();
    let path = dir.path().join("index.kvx");
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[8..12].copy_from_slice(&3u32.to_le_bytes());
    let crc = crc32(&bytes[0..60]);
    bytes[60..64].copy_from_slice(&crc.to_le_bytes());
    std::fs::write(&path, &bytes).unwrap();
    let err = DiskTier::open(config(dir.path())).unwrap_err();
    assert!(err.to_string().contains("format version 3"), "{err}");
    assert_eq!(std::fs::read(&path).unwrap(), bytes, "left untouched");
}

/// crc32 (IEEE), bit by bit: the test does not trust the crate's own.
fn crc32(bytes: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in bytes {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                (crc >> 1) ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// What version 2 is for: every put this build writes starts its payload
/// at a multiple of 64 bytes in its segment, whatever came before it (odd
/// payload lengths, remove records) and across segment rolls; and the
/// blocks load back. Walks the segment files record by record.
#[test]
fn every_payload_this_build_writes_starts_64_byte_aligned() {
    let dir = tempfile::tempdir().unwrap();
    let tier = DiskTier::open(common::small(dir.path())).unwrap();
    for i in 0..300u64 {
        tier.store_blocking(&common::key(i), &common::payload(i, 0, 3000))
            .unwrap();
        if i % 7 == 0 {
            tier.remove_blocking(&common::key(i)).unwrap();
        }
    }
    let mut segments: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "kvs"))
        .collect();
    segments.sort();
    assert!(segments.len() >= 3, "the test must cross segment rolls");
    let mut puts = 0;
    for path in &segments {
        let bytes = std::fs::read(path).unwrap();
        let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
        let mut at = 0;
        while at + common::RECORD_HEADER_SIZE <= bytes.len() {
            assert_eq!(&bytes[at..at + 4], b"KVR2", "{} at {at}", path.display());
            let (kind, key_len, payload_len, gap) = (
                u32_at(at + 8),
                u32_at(at + 12),
                u32_at(at + 16),
                u32_at(at + 24),
            );
            let payload_start = at + common::RECORD_HEADER_SIZE + key_len + gap;
            if kind == 0 {
                assert_eq!(payload_start % 64, 0, "{} at {at}", path.display());
                assert!(gap < 64);
                puts += 1;
            }
            at = (payload_start + payload_len + 7) & !7;
        }
        assert_eq!(
            at,
            bytes.len(),
            "{}: records end where the file does",
            path.display()
        );
    }
    assert_eq!(puts, 300);
    for i in (0..300u64).filter(|i| i % 7 != 0) {
        assert_eq!(
            tier.load_blocking(&common::key(i)).unwrap(),
            Some(common::payload(i, 0, 3000))
        );
    }
}
