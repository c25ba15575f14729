//! Defects found by an adversarial run (issue 11, items 2 to 5): a rebuilt
//! index that serves older bytes or brings back a removed key, a deleted
//! segment whose keys stay hits, and crafted files that panic or lie.

mod common;

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::Path;

use common::{COUNTERS_AT, key, payload, payload_at, put_record_size, small};
use kvtier_disk::{DiskError, DiskTier};

const KEY_LEN: usize = 36;

fn segment(dir: &Path, id: u64) -> std::path::PathBuf {
    dir.join(format!("seg-{id:016x}.kvs"))
}

fn flip(path: &Path, at: u64) {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut byte = [0u8];
    file.read_exact_at(&mut byte, at).unwrap();
    file.write_all_at(&[byte[0] ^ 0x5a], at).unwrap();
}

/// The two ways the index gets lost: deleted, or a header byte flipped.
fn lose_index(dir: &Path, how: usize) {
    let index = dir.join("index.kvx");
    if how == 0 {
        std::fs::remove_file(index).unwrap();
    } else {
        flip(&index, 20);
    }
}

fn write_counter(dir: &Path, at: usize, value: u64) {
    let file = OpenOptions::new()
        .write(true)
        .open(dir.join("index.kvx"))
        .unwrap();
    file.write_all_at(&value.to_le_bytes(), at as u64).unwrap();
}

// Item 2.
#[test]
fn a_rebuild_never_serves_the_value_a_damaged_newer_record_replaced() {
    for how in 0..2 {
        let dir = tempfile::tempdir().unwrap();
        let (a, b) = (vec![b'A'; 100], vec![b'B'; 100]);
        {
            let tier = DiskTier::open(small(dir.path())).unwrap();
            tier.store_blocking(&key(1), &a).unwrap();
            tier.store_blocking(&key(1), &b).unwrap();
            tier.store_blocking(&key(2), b"other").unwrap();
            tier.close().unwrap();
        }
        lose_index(dir.path(), how);
        // B's record follows A's; damage one byte of B's payload.
        let b_at = put_record_size(0, KEY_LEN, a.len());
        flip(
            &segment(dir.path(), 1),
            (payload_at(b_at, KEY_LEN) + 10) as u64,
        );
        let tier = DiskTier::open(small(dir.path())).unwrap();
        let stats = tier.stats();
        assert!(stats.rebuilt_index);
        assert_eq!((stats.rebuild_damaged, stats.rebuild_dropped_keys), (1, 0));
        assert_eq!(
            tier.load_blocking(&key(1)).unwrap(),
            None,
            "loss {how}: a damaged newest record must leave its key absent, never older"
        );
        assert!(!tier.contains_many(&[key(1)]).unwrap()[0]);
        // The record's extent is known: what follows it is kept.
        assert_eq!(
            tier.load_blocking(&key(2)).unwrap().as_deref(),
            Some(&b"other"[..])
        );
    }
}

// Item 3.
#[test]
fn a_rebuild_never_brings_back_a_key_whose_remove_record_is_damaged() {
    for how in 0..2 {
        for byte in [4usize, 10, common::RECORD_HEADER_SIZE + 3] {
            let dir = tempfile::tempdir().unwrap();
            let old = payload(1, 0, 500);
            {
                let tier = DiskTier::open(small(dir.path())).unwrap();
                tier.store_blocking(&key(1), &old).unwrap();
                assert!(tier.remove_blocking(&key(1)).unwrap());
                tier.close().unwrap();
            }
            // A later segment (opened after the close) stores another key.
            {
                let tier = DiskTier::open(small(dir.path())).unwrap();
                tier.store_blocking(&key(2), b"later").unwrap();
                tier.close().unwrap();
            }
            lose_index(dir.path(), how);
            let remove_at = put_record_size(0, KEY_LEN, old.len());
            flip(&segment(dir.path(), 1), (remove_at + byte) as u64);
            let tier = DiskTier::open(small(dir.path())).unwrap();
            let stats = tier.stats();
            assert!(stats.rebuilt_index);
            // Logged and counted: one damaged place, key 1 dropped with it.
            assert_eq!((stats.rebuild_damaged, stats.rebuild_dropped_keys), (1, 1));
            assert_eq!(
                tier.load_blocking(&key(1)).unwrap(),
                None,
                "loss {how}, byte {byte}: a removed key came back"
            );
            assert!(!tier.contains_many(&[key(1)]).unwrap()[0]);
            // Later segments are newer than the damage: kept.
            assert_eq!(
                tier.load_blocking(&key(2)).unwrap().as_deref(),
                Some(&b"later"[..])
            );
        }
    }
}

/// Stores keys 0..n with 1 KiB payloads (64 KiB segments: several segments).
fn populate(dir: &Path, n: u64) {
    let tier = DiskTier::open(small(dir)).unwrap();
    for i in 0..n {
        tier.store_blocking(&key(i), &payload(i, 0, 1000)).unwrap();
    }
    tier.close().unwrap();
}

/// Which keys of 0..n have their record in segment `id` (by reading it).
fn keys_in_segment(dir: &Path, id: u64, n: u64) -> Vec<u64> {
    let bytes = std::fs::read(segment(dir, id)).unwrap();
    // Walk the records (format version 2): the key follows each header.
    let u32_at = |at: usize| u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap()) as usize;
    let mut keys_here = Vec::new();
    let mut at = 0;
    while at + common::RECORD_HEADER_SIZE + KEY_LEN <= bytes.len() {
        let (key_len, payload_len, gap) = (u32_at(at + 12), u32_at(at + 16), u32_at(at + 24));
        let head = at + common::RECORD_HEADER_SIZE;
        keys_here.push(bytes[head..head + key_len].to_vec());
        at = (head + key_len + gap + payload_len + 7) & !7;
    }
    (0..n)
        .filter(|&i| keys_here.iter().any(|k| k == key(i).as_bytes()))
        .collect()
}

// Item 4, at open.
#[test]
fn opening_with_a_middle_segment_missing_drops_its_keys() {
    let dir = tempfile::tempdir().unwrap();
    populate(dir.path(), 400);
    assert!(segment(dir.path(), 3).exists());
    let lost = keys_in_segment(dir.path(), 2, 400);
    assert!(!lost.is_empty());
    std::fs::remove_file(segment(dir.path(), 2)).unwrap();
    let tier = DiskTier::open(small(dir.path())).unwrap();
    let found = tier
        .contains_many(&lost.iter().map(|&i| key(i)).collect::<Vec<_>>())
        .unwrap();
    assert!(
        found.iter().all(|f| !f),
        "keys of the missing segment are still hits"
    );
    assert_eq!(tier.len(), 400 - lost.len() as u64);
    assert_eq!(tier.stats().missing_segment_keys, lost.len() as u64);
    for i in (0..400).filter(|i| !lost.contains(i)) {
        assert_eq!(
            tier.load_blocking(&key(i)).unwrap(),
            Some(payload(i, 0, 1000))
        );
    }
}

// Item 4, at load.
#[test]
fn a_load_from_a_deleted_segment_removes_the_entry_and_counts() {
    let dir = tempfile::tempdir().unwrap();
    populate(dir.path(), 400);
    let lost = keys_in_segment(dir.path(), 2, 400);
    let tier = DiskTier::open(small(dir.path())).unwrap();
    std::fs::remove_file(segment(dir.path(), 2)).unwrap();
    let k = key(lost[0]);
    assert!(tier.contains_many(std::slice::from_ref(&k)).unwrap()[0]);
    assert_eq!(tier.load_blocking(&k).unwrap(), None);
    assert!(
        !tier.contains_many(std::slice::from_ref(&k)).unwrap()[0],
        "a failed load left a permanent hit"
    );
    assert_eq!(tier.stats().corrupt_loads, 1);
}

// Item 5, huge counters.
#[test]
fn huge_index_counters_are_recounted_not_trusted() {
    for (at, value) in [
        (COUNTERS_AT + 16, u64::MAX), // used
        (COUNTERS_AT + 8, u64::MAX),  // len
        (COUNTERS_AT + 16, 1 << 61),
        (COUNTERS_AT + 8, 1 << 61),
    ] {
        let dir = tempfile::tempdir().unwrap();
        populate(dir.path(), 20);
        write_counter(dir.path(), at, value);
        let tier = DiskTier::open(small(dir.path())).unwrap();
        assert_eq!(tier.len(), 20, "counter at {at} = {value}");
        for i in 20..200 {
            tier.store_blocking(&key(i), &payload(i, 0, 100)).unwrap();
        }
        assert_eq!(tier.len(), 200);
        for i in 0..200 {
            assert!(tier.load_blocking(&key(i)).unwrap().is_some());
        }
    }
}

// Item 5, a store that fails publishes nothing.
#[test]
fn a_header_len_of_2_pow_61_does_not_make_a_failed_store_visible() {
    let dir = tempfile::tempdir().unwrap();
    populate(dir.path(), 5);
    write_counter(dir.path(), COUNTERS_AT + 8, 1 << 61);
    let tier = DiskTier::open(small(dir.path())).unwrap();
    for i in 100..200 {
        match tier.store_blocking(&key(i), b"v") {
            Ok(()) => assert_eq!(
                tier.load_blocking(&key(i)).unwrap().as_deref(),
                Some(&b"v"[..])
            ),
            Err(err) => {
                assert!(
                    !tier.contains_many(&[key(i)]).unwrap()[0],
                    "store of {i} failed ({err}) yet its key is visible"
                );
                assert_eq!(tier.load_blocking(&key(i)).unwrap(), None);
            }
        }
    }
}

// Item 5, an empty segment with the largest id.
#[test]
fn a_segment_named_with_the_largest_id_is_a_typed_error() {
    let dir = tempfile::tempdir().unwrap();
    populate(dir.path(), 5);
    let crafted = segment(dir.path(), u64::MAX);
    std::fs::write(&crafted, b"").unwrap();
    match DiskTier::open(small(dir.path())) {
        Err(DiskError::SegmentIdOutOfRange { id, .. }) => assert_eq!(id, u64::MAX),
        Err(other) => panic!("expected SegmentIdOutOfRange, got {other}"),
        Ok(tier) => {
            // Whatever it does, a store it acknowledges must be visible.
            tier.store_blocking(&key(100), b"v").unwrap();
            panic!(
                "opened; the acknowledged store is visible: {}",
                tier.contains_many(&[key(100)]).unwrap()[0]
            );
        }
    }
    // Nothing was lost: without the crafted file everything is there.
    std::fs::remove_file(&crafted).unwrap();
    let tier = DiskTier::open(small(dir.path())).unwrap();
    assert_eq!(tier.len(), 5);
}

// Item 4, "a failed load of any kind": a read error, too.
#[test]
fn a_load_that_cannot_read_its_segment_removes_the_entry_and_counts() {
    let dir = tempfile::tempdir().unwrap();
    populate(dir.path(), 400);
    let lost = keys_in_segment(dir.path(), 2, 400);
    let tier = DiskTier::open(small(dir.path())).unwrap();
    // A directory where the segment was: it opens, but reading it fails (EISDIR).
    std::fs::remove_file(segment(dir.path(), 2)).unwrap();
    std::fs::create_dir(segment(dir.path(), 2)).unwrap();
    let k = key(lost[0]);
    match tier.load_blocking(&k) {
        Err(DiskError::Io { .. }) => {}
        other => panic!("expected an I/O error, got {other:?}"),
    }
    assert!(
        !tier.contains_many(std::slice::from_ref(&k)).unwrap()[0],
        "a failed load left a permanent hit"
    );
    assert_eq!(tier.stats().corrupt_loads, 1);
    // The error is reported once; after it the key is a plain miss.
    assert_eq!(tier.load_blocking(&k).unwrap(), None);
}
