//! The in-place batch forms on disk: batches spanning segments, blocks
//! refused alone, damaged records and missing segments answered per key.

mod common;

use std::os::unix::fs::FileExt;

use common::{key, pairs, payload, payload_at, small};
use kvtier_core::{BlockOutcome, OffloadKey, TierErrorKind};
use kvtier_disk::DiskTier;

/// Loads `keys` into regions of `lens` bytes; the outcomes and the regions.
fn load(tier: &DiskTier, keys: &[OffloadKey], lens: &[usize]) -> (Vec<BlockOutcome>, Vec<Vec<u8>>) {
    let mut regions: Vec<Vec<u8>> = lens.iter().map(|&len| vec![0xEE; len]).collect();
    let outcomes = {
        let mut batch: Vec<(&OffloadKey, &mut [u8])> = keys
            .iter()
            .zip(regions.iter_mut())
            .map(|(k, r)| (k, r.as_mut_slice()))
            .collect();
        tier.load_batch_blocking(&mut batch)
    };
    (outcomes, regions)
}

#[test]
fn a_batch_spanning_several_segments_round_trips_and_survives_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let tier = DiskTier::open(small(dir.path())).unwrap();
    let keys: Vec<OffloadKey> = (0..60).map(key).collect();
    // 3,001 to 7,000 bytes each: about five 64 KiB segments.
    let blocks: Vec<Vec<u8>> = (0..60)
        .map(|i| {
            let mut block = payload(i, 1, 4000);
            block.resize(block.len() + 3000, i as u8);
            block
        })
        .collect();
    let batch = pairs(&keys, &blocks);
    let outcomes = tier.store_batch_blocking(&batch);
    assert!(outcomes.iter().all(BlockOutcome::is_done), "{outcomes:?}");
    assert!(
        tier.stats().segments >= 3,
        "the batch spans segments: {:?}",
        tier.stats()
    );
    let lens: Vec<usize> = blocks.iter().map(Vec::len).collect();
    let (outcomes, regions) = load(&tier, &keys, &lens);
    assert!(outcomes.iter().all(BlockOutcome::is_done), "{outcomes:?}");
    assert_eq!(regions, blocks);
    drop(tier);
    let tier = DiskTier::open(small(dir.path())).unwrap();
    let (outcomes, regions) = load(&tier, &keys, &lens);
    assert!(
        outcomes.iter().all(BlockOutcome::is_done),
        "after reopen: {outcomes:?}"
    );
    assert_eq!(regions, blocks, "after reopen");
}

/// Payloads of megabytes (read through the load's 512 KiB pieces, across
/// their boundaries) mixed with small ones in one batch, across segment
/// rolls: every one loads byte for byte, after a reopen too, and after a
/// rebuild from the segments alone (which reads each head and checks each
/// payload's crc).
#[test]
fn large_and_small_payloads_round_trip_and_rebuild() {
    let dir = tempfile::tempdir().unwrap();
    let config = || kvtier_disk::DiskConfig {
        segment_bytes: 8 << 20,
        capacity_bytes: 1 << 30,
        ..small(dir.path())
    };
    let tier = DiskTier::open(config()).unwrap();
    let lens = [
        (2 << 20) + 13,
        100,
        512 << 10,
        (512 << 10) + 1,
        3 << 20,
        7,
        (2 << 20) + 4096,
        1 << 20,
        (1 << 20) + 63,
        5,
    ];
    let keys: Vec<OffloadKey> = (0..lens.len() as u64).map(key).collect();
    let blocks: Vec<Vec<u8>> = lens
        .iter()
        .enumerate()
        .map(|(i, &len)| {
            (0..len)
                .map(|b| (b * 7 + i * 13 + b / 4099) as u8)
                .collect()
        })
        .collect();
    let outcomes = tier.store_batch_blocking(&pairs(&keys, &blocks));
    assert!(outcomes.iter().all(BlockOutcome::is_done), "{outcomes:?}");
    assert!(tier.stats().segments >= 2, "{:?}", tier.stats());
    let loads_back = |tier: &DiskTier, when: &str| {
        let (outcomes, regions) = load(tier, &keys, &lens);
        assert!(
            outcomes.iter().all(BlockOutcome::is_done),
            "{when}: {outcomes:?}"
        );
        assert!(regions == blocks, "{when}: the bytes differ");
        assert_eq!(tier.stats().corrupt_loads, 0, "{when}");
    };
    loads_back(&tier, "stored");
    drop(tier);
    loads_back(&DiskTier::open(config()).unwrap(), "reopened");
    std::fs::remove_file(dir.path().join("index.kvx")).unwrap();
    loads_back(
        &DiskTier::open(config()).unwrap(),
        "rebuilt from the segments",
    );
}

#[test]
fn refused_blocks_fail_alone() {
    let dir = tempfile::tempdir().unwrap();
    let tier = DiskTier::open(small(dir.path())).unwrap();
    let short = OffloadKey::new(&[1; 8]);
    let too_large = vec![0u8; tier.config().max_payload() + 1];
    let good = [payload(0, 0, 500), payload(2, 0, 500)];
    let (k0, k2) = (key(0), key(2));
    let outcomes = tier.store_batch_blocking(&[
        (&k0, &good[0]),
        (&short, b"refused"),
        (&k2, &good[1]),
        (&k2, &too_large),
    ]);
    assert!(
        outcomes[0].is_done() && outcomes[2].is_done(),
        "{outcomes:?}"
    );
    for i in [1, 3] {
        let err = outcomes[i]
            .error()
            .unwrap_or_else(|| panic!("block {i}: {:?}", outcomes[i]));
        assert_eq!(err.kind(), TierErrorKind::InvalidInput, "block {i}: {err}");
    }
    // The refused large payload of k2 came after its good one: the good one stays.
    let (outcomes, regions) = load(&tier, &[k0, short, k2], &[good[0].len(), 7, good[1].len()]);
    assert!(
        outcomes[0].is_done() && outcomes[2].is_done(),
        "{outcomes:?}"
    );
    assert_eq!(
        outcomes[1].error().map(|e| e.kind()),
        Some(TierErrorKind::InvalidInput)
    );
    assert_eq!([&regions[0], &regions[2]], [&good[0], &good[1]]);
}

#[test]
fn a_damaged_record_is_a_miss_and_its_neighbours_load() {
    let dir = tempfile::tempdir().unwrap();
    let tier = DiskTier::open(small(dir.path())).unwrap();
    let keys = [key(0), key(1), key(2)];
    let blocks = [vec![1u8; 1000], vec![2u8; 1000], vec![3u8; 1000]];
    let batch = pairs(&keys, &blocks);
    assert!(
        tier.store_batch_blocking(&batch)
            .iter()
            .all(BlockOutcome::is_done)
    );
    // The first record of the fresh tier's segment 1 starts at 0: damage
    // its payload.
    let segment = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.path().join("seg-0000000000000001.kvs"))
        .unwrap();
    segment
        .write_all_at(&[0xFF], (payload_at(0, 36) + 10) as u64)
        .unwrap();
    let (outcomes, regions) = load(&tier, &keys, &[1000; 3]);
    assert!(
        matches!(outcomes[0], BlockOutcome::Absent),
        "{:?}",
        outcomes[0]
    );
    assert!(
        outcomes[1].is_done() && outcomes[2].is_done(),
        "{outcomes:?}"
    );
    assert_eq!([&regions[1], &regions[2]], [&blocks[1], &blocks[2]]);
    assert_eq!(tier.stats().corrupt_loads, 1);
    assert_eq!(tier.contains_many(&keys).unwrap(), [false, true, true]);
}

/// A segment file removed behind the tier's back: its keys answer
/// `Absent` (and turn into misses), the keys of other segments load.
#[test]
fn keys_of_a_removed_segment_are_absent_and_the_others_load() {
    let dir = tempfile::tempdir().unwrap();
    let tier = DiskTier::open(small(dir.path())).unwrap();
    let keys: Vec<OffloadKey> = (0..40).map(key).collect();
    let blocks: Vec<Vec<u8>> = (0..40).map(|i| vec![i as u8; 6000]).collect();
    let batch = pairs(&keys, &blocks);
    assert!(
        tier.store_batch_blocking(&batch)
            .iter()
            .all(BlockOutcome::is_done)
    );
    std::fs::remove_file(dir.path().join("seg-0000000000000001.kvs")).unwrap();
    let (outcomes, regions) = load(&tier, &keys, &[6000; 40]);
    let absent: Vec<usize> = (0..40)
        .filter(|&i| matches!(outcomes[i], BlockOutcome::Absent))
        .collect();
    // 64 KiB segments hold ten 6,000-byte records.
    assert_eq!(absent, (0..10).collect::<Vec<_>>(), "{outcomes:?}");
    for i in 10..40 {
        assert!(outcomes[i].is_done(), "key {i}: {:?}", outcomes[i]);
        assert_eq!(regions[i], blocks[i], "key {i}");
    }
    assert_eq!(tier.contains_many(&keys[..10]).unwrap(), [false; 10]);
}
