//! The disk tier's own behaviour: round trips, persistence, bounds, typed
//! errors, rebuilds and recounts.

mod common;

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;

use common::{key, payload, small};
use kvtier_core::{OffloadKey, ReqContext, Tier, TierErrorKind};
use kvtier_disk::{DiskConfig, DiskError, DiskTier, FsyncPolicy};

#[test]
fn store_load_remove_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let tier = DiskTier::open(small(dir.path())).unwrap();
    for i in 0..100 {
        tier.store_blocking(&key(i), &payload(i, 0, 3000)).unwrap();
    }
    assert_eq!(tier.len(), 100);
    for i in 0..100 {
        assert_eq!(
            tier.load_blocking(&key(i)).unwrap(),
            Some(payload(i, 0, 3000))
        );
    }
    assert_eq!(tier.load_blocking(&key(1000)).unwrap(), None);
    // Replacing a key keeps one entry and returns the new payload.
    tier.store_blocking(&key(5), b"new").unwrap();
    assert_eq!(tier.len(), 100);
    assert_eq!(
        tier.load_blocking(&key(5)).unwrap().as_deref(),
        Some(&b"new"[..])
    );
    assert!(tier.remove_blocking(&key(5)).unwrap());
    assert!(!tier.remove_blocking(&key(5)).unwrap());
    assert_eq!(tier.load_blocking(&key(5)).unwrap(), None);
    assert_eq!(tier.len(), 99);
    // An empty payload is a payload.
    tier.store_blocking(&key(7), b"").unwrap();
    assert_eq!(tier.load_blocking(&key(7)).unwrap(), Some(Vec::new()));
}

#[test]
fn everything_survives_a_clean_reopen_without_recount() {
    let dir = tempfile::tempdir().unwrap();
    {
        let tier = DiskTier::open(small(dir.path())).unwrap();
        for i in 0..500 {
            tier.store_blocking(&key(i), &payload(i, 1, 500)).unwrap();
        }
        tier.remove_blocking(&key(3)).unwrap();
        tier.close().unwrap();
    }
    let tier = DiskTier::open(small(dir.path())).unwrap();
    let stats = tier.stats();
    assert!(!stats.recounted_index && !stats.rebuilt_index, "{stats:?}");
    assert_eq!(tier.len(), 499);
    for i in 0..500 {
        let expected = (i != 3).then(|| payload(i, 1, 500));
        assert_eq!(tier.load_blocking(&key(i)).unwrap(), expected, "key {i}");
    }
}

#[test]
fn the_index_grows_and_stays_exact() {
    let dir = tempfile::tempdir().unwrap();
    let tier = DiskTier::open(DiskConfig {
        initial_slots: 16,
        ..small(dir.path())
    })
    .unwrap();
    for i in 0..5000 {
        tier.store_blocking(&key(i), &i.to_le_bytes()).unwrap();
    }
    let stats = tier.stats();
    assert!(stats.rehashes >= 3, "{stats:?}");
    assert!(stats.index_slots >= 5000 * 10 / 7, "{stats:?}");
    let keys: Vec<OffloadKey> = (0..6000).map(key).collect();
    let found = tier.contains_many(&keys).unwrap();
    assert!(found[..5000].iter().all(|&f| f));
    assert!(found[5000..].iter().all(|&f| !f));
}

#[test]
fn filling_past_capacity_evicts_oldest_segments_and_stays_exact() {
    let dir = tempfile::tempdir().unwrap();
    let config = small(dir.path()); // 4 MiB capacity, 64 KiB segments
    let tier = DiskTier::open(config.clone()).unwrap();
    let n = 4000u64; // about 2000 bytes each: 8 MB, twice the capacity
    for i in 0..n {
        tier.store_blocking(&key(i), &vec![i as u8; 2000]).unwrap();
        assert!(
            tier.bytes_used() <= config.capacity_bytes,
            "over capacity at {i}"
        );
    }
    let stats = tier.stats();
    assert!(
        stats.evicted_segments > 0 && stats.evicted_keys > 0,
        "{stats:?}"
    );
    let keys: Vec<OffloadKey> = (0..n).map(key).collect();
    let found = tier.contains_many(&keys).unwrap();
    // FIFO: what is left is a suffix of the writes, and every hit loads.
    let first = found.iter().position(|&f| f).unwrap();
    assert!(
        found[first..].iter().all(|&f| f),
        "evicted keys are the oldest ones"
    );
    assert_eq!(tier.len(), n - first as u64);
    for i in first as u64..n {
        assert_eq!(
            tier.load_blocking(&key(i)).unwrap(),
            Some(vec![i as u8; 2000])
        );
    }
    for i in 0..first as u64 {
        assert_eq!(tier.load_blocking(&key(i)).unwrap(), None);
    }
}

#[test]
fn a_second_writer_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let _first = DiskTier::open(small(dir.path())).unwrap();
    match DiskTier::open(small(dir.path())) {
        Err(DiskError::Locked { path }) => assert!(path.ends_with("LOCK")),
        other => panic!("expected Locked, got {other:?}"),
    }
}

#[test]
fn bad_input_gets_typed_errors_and_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let tier = DiskTier::open(small(dir.path())).unwrap();
    tier.store_blocking(&key(1), b"kept").unwrap();
    let short = OffloadKey::new(&[1; 35]);
    assert!(matches!(
        tier.store_blocking(&short, b"x"),
        Err(DiskError::WrongKeySize {
            expected: 36,
            got: 35
        })
    ));
    assert!(matches!(
        tier.load_blocking(&short),
        Err(DiskError::WrongKeySize { .. })
    ));
    let huge = vec![0u8; 65 << 10];
    assert!(matches!(
        tier.store_blocking(&key(2), &huge),
        Err(DiskError::PayloadTooLarge { .. })
    ));
    let err = tier.contains_many(&[key(1), short.clone()]).unwrap_err();
    assert!(err.to_string().contains("35"), "{err}");
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let tier_err = rt
        .block_on(tier.batch_lookup(&[short], &ReqContext::new("r")))
        .unwrap_err();
    assert_eq!(tier_err.kind(), TierErrorKind::InvalidInput);
    assert_eq!(
        tier.load_blocking(&key(1)).unwrap().as_deref(),
        Some(&b"kept"[..])
    );
    assert_eq!(tier.len(), 1);

    for bad in [
        DiskConfig {
            key_len: 0,
            ..small(dir.path())
        },
        DiskConfig {
            capacity_bytes: 1000,
            ..small(dir.path())
        },
        DiskConfig {
            segment_bytes: 10,
            ..small(dir.path())
        },
        DiskConfig::new(""),
    ] {
        assert!(matches!(
            DiskTier::open(bad),
            Err(DiskError::InvalidConfig { .. })
        ));
    }
}

#[test]
fn an_index_of_another_key_length_or_version_is_refused_untouched() {
    let dir = tempfile::tempdir().unwrap();
    {
        let tier = DiskTier::open(small(dir.path())).unwrap();
        tier.store_blocking(&key(1), b"x").unwrap();
    }
    let err = DiskTier::open(DiskConfig {
        key_len: 32,
        ..small(dir.path())
    })
    .unwrap_err();
    assert!(
        matches!(
            err,
            DiskError::KeyLenMismatch {
                found: 36,
                configured: 32,
                ..
            }
        ),
        "{err}"
    );

    let index = dir.path().join("index.kvx");
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(&index)
        .unwrap();
    file.write_all_at(&99u32.to_le_bytes(), 8).unwrap();
    let before = std::fs::read(&index).unwrap();
    let err = DiskTier::open(small(dir.path())).unwrap_err();
    assert!(
        matches!(
            err,
            DiskError::IndexVersion {
                found: 99,
                supported: 2,
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(std::fs::read(&index).unwrap(), before, "left untouched");
}

#[test]
fn a_lost_index_is_rebuilt_from_the_segments_with_removals() {
    let dir = tempfile::tempdir().unwrap();
    {
        let tier = DiskTier::open(small(dir.path())).unwrap();
        for i in 0..300 {
            tier.store_blocking(&key(i), &payload(i, 0, 900)).unwrap();
        }
        tier.store_blocking(&key(10), &payload(10, 9, 900)).unwrap(); // a later version wins
        tier.remove_blocking(&key(20)).unwrap(); // a removal is remembered
    }
    std::fs::remove_file(dir.path().join("index.kvx")).unwrap();
    let tier = DiskTier::open(small(dir.path())).unwrap();
    assert!(tier.stats().rebuilt_index);
    assert_eq!(tier.len(), 299);
    assert_eq!(
        tier.load_blocking(&key(10)).unwrap(),
        Some(payload(10, 9, 900))
    );
    assert_eq!(tier.load_blocking(&key(20)).unwrap(), None);
    assert_eq!(
        tier.load_blocking(&key(299)).unwrap(),
        Some(payload(299, 0, 900))
    );
}

#[test]
fn a_corrupt_index_is_an_error_when_rebuilding_is_off() {
    let dir = tempfile::tempdir().unwrap();
    drop(DiskTier::open(small(dir.path())).unwrap());
    let index = dir.path().join("index.kvx");
    let file = OpenOptions::new().write(true).open(&index).unwrap();
    file.write_all_at(&[0xff; 4], 20).unwrap(); // inside the checksummed header
    let config = DiskConfig {
        rebuild_corrupt_index: false,
        ..small(dir.path())
    };
    match DiskTier::open(config) {
        Err(DiskError::CorruptIndex { reason, .. }) => {
            assert!(reason.to_string().contains("checksum"), "{reason}")
        }
        other => panic!("expected CorruptIndex, got {other:?}"),
    }
    // With rebuilding on (the default) it opens.
    assert!(
        DiskTier::open(small(dir.path()))
            .unwrap()
            .stats()
            .rebuilt_index
    );
}

#[test]
fn a_corrupt_payload_turns_into_a_counted_miss_and_is_removed() {
    let dir = tempfile::tempdir().unwrap();
    let tier = DiskTier::open(small(dir.path())).unwrap();
    tier.store_blocking(&key(1), &[42u8; 1000]).unwrap();
    tier.store_blocking(&key(2), &[43u8; 1000]).unwrap();
    // Flip a byte in key 1's payload (first record of the active segment).
    let segment = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "kvs"))
        .max()
        .unwrap();
    let file = OpenOptions::new().write(true).open(&segment).unwrap();
    file.write_all_at(&[0], (common::payload_at(0, 36) + 500) as u64)
        .unwrap();
    assert!(
        tier.contains_many(&[key(1)]).unwrap()[0],
        "the index cannot know yet"
    );
    assert_eq!(tier.load_blocking(&key(1)).unwrap(), None);
    assert_eq!(tier.stats().corrupt_loads, 1);
    assert!(
        !tier.contains_many(&[key(1)]).unwrap()[0],
        "the entry is removed"
    );
    assert_eq!(tier.load_blocking(&key(2)).unwrap(), Some(vec![43u8; 1000]));
}

#[test]
fn fsync_always_round_trips_across_segment_rolls() {
    let dir = tempfile::tempdir().unwrap();
    let config = DiskConfig {
        fsync: FsyncPolicy::Always,
        ..small(dir.path())
    };
    {
        let tier = DiskTier::open(config.clone()).unwrap();
        for i in 0..100 {
            tier.store_blocking(&key(i), &payload(i, 2, 2000)).unwrap();
        }
        assert!(tier.stats().segments > 1);
    }
    let tier = DiskTier::open(config).unwrap();
    for i in 0..100 {
        assert_eq!(
            tier.load_blocking(&key(i)).unwrap(),
            Some(payload(i, 2, 2000))
        );
    }
}

/// The batched forms (through the trait and the blocking API): a later
/// block of a repeated key wins, absent keys load as `None`, a repeated
/// removal removes once, and a reopen from the records alone (the index
/// deleted) agrees: every record a batch wrote is in the segments.
#[tokio::test]
async fn batched_store_load_remove_round_trip_and_survive_a_rebuild() {
    use kvtier_core::BlockStore;
    let dir = tempfile::tempdir().unwrap();
    let config = DiskConfig {
        fsync: FsyncPolicy::Always,
        ..small(dir.path())
    };
    {
        let tier = DiskTier::open(config.clone()).unwrap();
        let mut blocks: Vec<(OffloadKey, Vec<u8>)> =
            (0..50).map(|i| (key(i), payload(i, 0, 700))).collect();
        blocks.push((key(7), b"later".to_vec()));
        tier.store_many(&blocks).await.unwrap();
        assert_eq!(tier.stats().stores, 51);
        assert_eq!(tier.len(), 50);
        let keys: Vec<OffloadKey> = (0..55).map(key).collect();
        let loaded = tier.load_many(&keys).await.unwrap();
        for (i, got) in loaded.iter().enumerate() {
            let want = match i as u64 {
                7 => Some(b"later".to_vec()),
                i if i < 50 => Some(payload(i, 0, 700)),
                _ => None,
            };
            assert_eq!(*got, want, "key {i}");
        }
        let removed = tier
            .remove_many_blocking(&[key(3), key(3), key(60), key(9)])
            .unwrap();
        assert_eq!(removed, [true, false, false, true]);
        tier.remove_many(&[key(10), key(61)]).await.unwrap();
        assert_eq!(tier.len(), 47);
        // A refused key refuses the whole batch.
        let bad = vec![
            (key(100), b"x".to_vec()),
            (OffloadKey::new(b"short"), b"y".to_vec()),
        ];
        assert!(tier.store_many_blocking(&bad).is_err());
        assert_eq!(tier.load_blocking(&key(100)).unwrap(), None);
        tier.close().unwrap();
    }
    std::fs::remove_file(dir.path().join("index.kvx")).unwrap();
    let tier = DiskTier::open(config).unwrap();
    assert!(tier.stats().rebuilt_index);
    assert_eq!(tier.len(), 47);
    for i in 0..55 {
        let want = match i {
            3 | 9 | 10 => None,
            7 => Some(b"later".to_vec()),
            i if i < 50 => Some(payload(i, 0, 700)),
            _ => None,
        };
        assert_eq!(tier.load_blocking(&key(i)).unwrap(), want, "key {i}");
    }
}

/// One batch larger than the index grows it once, to its final size,
/// before anything is written; one larger than the capacity evicts its own
/// first blocks, and the count of live keys stays exact.
#[test]
fn a_large_batch_grows_the_index_once_and_may_evict_its_own_first_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let tier = DiskTier::open(DiskConfig {
        initial_slots: 16,
        ..small(dir.path())
    })
    .unwrap();
    let blocks: Vec<(OffloadKey, Vec<u8>)> = (0..5000)
        .map(|i| (key(i), i.to_le_bytes().to_vec()))
        .collect();
    tier.store_many_blocking(&blocks).unwrap();
    assert_eq!(tier.stats().rehashes, 1, "{:?}", tier.stats());
    let keys: Vec<OffloadKey> = (0..5000).map(key).collect();
    assert!(tier.contains_many(&keys).unwrap().iter().all(|&f| f));

    // 4 MiB of capacity, 64 KiB segments: 8 MiB in one batch evicts its start.
    let big: Vec<(OffloadKey, Vec<u8>)> = (10_000..10_256)
        .map(|i| (key(i), vec![i as u8; 32 << 10]))
        .collect();
    tier.store_many_blocking(&big).unwrap();
    let stats = tier.stats();
    assert!(stats.evicted_segments > 0, "{stats:?}");
    let big_keys: Vec<OffloadKey> = (10_000..10_256).map(key).collect();
    let found = tier.contains_many(&big_keys).unwrap();
    assert!(
        !found[0] && found[255],
        "the first blocks went, the last stayed"
    );
    let all: Vec<OffloadKey> = keys.iter().chain(&big_keys).cloned().collect();
    let live = tier
        .contains_many(&all)
        .unwrap()
        .iter()
        .filter(|&&f| f)
        .count() as u64;
    assert_eq!(tier.len(), live, "{stats:?}");
    for (i, k) in big_keys.iter().enumerate() {
        let want = found[i].then(|| vec![(10_000 + i) as u8; 32 << 10]);
        assert_eq!(tier.load_blocking(k).unwrap(), want);
    }
}
