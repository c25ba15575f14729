//! Fuzzing a whole tier directory (issue 11, item 6): build a small valid
//! directory from random stores, replacements, removals and reopens, write
//! arbitrary bytes into its index and segments (sometimes deleting the index
//! so it is rebuilt, sometimes deleting a segment), then open, look up and
//! load every key.
//!
//! Asserted, whatever the bytes:
//! - nothing panics; opening either works or gives a typed error;
//! - a key never stored is never a hit;
//! - a load returns the last bytes stored for its key, or nothing; never
//!   older bytes, never the bytes of a removed key;
//! - a hit whose load fails turns into a miss and is counted.
//!
//! A flipped payload byte found by a load is expected: that load answers a
//! miss, removes the entry and counts it. The budget is fixed
//! (`CASES` cases, each a few milliseconds), whatever `PROPTEST_CASES` says;
//! `KVTIER_DISK_FUZZ_CASES` asks for a longer run.

mod common;

use std::collections::HashMap;
use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use common::{COUNTERS_AT, key};
use kvtier_disk::{DiskConfig, DiskTier, FsyncPolicy};
use proptest::prelude::*;

const CASES: u32 = 512;

fn cases() -> u32 {
    std::env::var("KVTIER_DISK_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(CASES)
}
const KEYS: u64 = 6;

#[derive(Debug, Clone)]
enum Op {
    Store(u64, Vec<u8>),
    Remove(u64),
    Reopen,
}

#[derive(Debug, Clone)]
enum Target {
    Index,
    Segment(usize),
    /// Not bytes: a segment file other than the newest is deleted. (With
    /// the newest deleted and the index lost too, nothing is left that
    /// says it existed: the README states that limit.)
    DeletedSegment(usize),
}

#[derive(Debug, Clone)]
enum At {
    Anywhere(u64),
    /// The unchecksummed counters of the index header.
    Counters(u64),
    /// The checksummed part of the index header.
    Header(u64),
}

#[derive(Debug, Clone)]
struct Damage {
    target: Target,
    at: At,
    bytes: Vec<u8>,
}

fn config(dir: &Path) -> DiskConfig {
    DiskConfig {
        segment_bytes: 4096,
        capacity_bytes: 1 << 20, // no eviction
        initial_slots: 16,
        fsync: FsyncPolicy::Never,
        ..DiskConfig::new(dir)
    }
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..KEYS, proptest::collection::vec(any::<u8>(), 0..400)).prop_map(|(k, p)| Op::Store(k, p)),
        2 => (0..KEYS).prop_map(Op::Remove),
        1 => Just(Op::Reopen),
    ]
}

fn damage() -> impl Strategy<Value = Damage> {
    let target = prop_oneof![
        4 => Just(Target::Index),
        12 => any::<usize>().prop_map(Target::Segment),
        1 => any::<usize>().prop_map(Target::DeletedSegment),
    ];
    let at = prop_oneof![
        4 => any::<u64>().prop_map(At::Anywhere),
        1 => (0u64..32).prop_map(At::Counters),
        1 => (0u64..64).prop_map(At::Header),
    ];
    let bytes = prop_oneof![
        3 => proptest::collection::vec(any::<u8>(), 1..4),
        1 => proptest::collection::vec(any::<u8>(), 1..80),
        1 => proptest::collection::vec(prop_oneof![Just(0u8), Just(0xff)], 1..16),
    ];
    (target, at, bytes).prop_map(|(target, at, bytes)| Damage { target, at, bytes })
}

fn segments(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "kvs"))
        .collect();
    files.sort();
    files
}

fn apply(dir: &Path, damage: &Damage) {
    let path = match damage.target {
        Target::Index => dir.join("index.kvx"),
        Target::Segment(i) => {
            let all = segments(dir);
            if all.is_empty() {
                return;
            }
            all[i % all.len()].clone()
        }
        Target::DeletedSegment(i) => {
            let all = segments(dir);
            if all.len() > 1 {
                std::fs::remove_file(&all[i % (all.len() - 1)]).unwrap();
            }
            return;
        }
    };
    let Ok(file) = OpenOptions::new().write(true).open(&path) else {
        return; // the index was deleted
    };
    let len = file.metadata().unwrap().len();
    let at = match damage.at {
        At::Anywhere(at) => at % len.max(1),
        At::Counters(at) if damage.target_is_index() => COUNTERS_AT as u64 + at,
        At::Header(at) if damage.target_is_index() => at,
        At::Counters(at) | At::Header(at) => at % len.max(1),
    };
    // Overwrite within the file: the length stays (truncation has its own test).
    let end = (at + damage.bytes.len() as u64).min(len);
    if end > at {
        file.write_all_at(&damage.bytes[..(end - at) as usize], at)
            .unwrap();
    }
}

impl Damage {
    fn target_is_index(&self) -> bool {
        matches!(self.target, Target::Index)
    }
}

/// A scratch directory, in memory where possible: each case syncs several
/// files, and the budget is for checking, not for waiting on a disk.
fn scratch() -> tempfile::TempDir {
    let shm = Path::new("/dev/shm");
    if shm.is_dir()
        && let Ok(dir) = tempfile::tempdir_in(shm)
    {
        return dir;
    }
    tempfile::tempdir().unwrap()
}

fn run(ops: &[Op], damages: &[Damage], delete_index: bool) -> Result<(), TestCaseError> {
    let dir = scratch();
    // None: removed (or never stored).
    let mut model: HashMap<u64, Option<Vec<u8>>> = HashMap::new();
    {
        let mut tier = DiskTier::open(config(dir.path())).unwrap();
        for op in ops {
            match op {
                Op::Store(k, p) => {
                    tier.store_blocking(&key(*k), p).unwrap();
                    model.insert(*k, Some(p.clone()));
                }
                Op::Remove(k) => {
                    tier.remove_blocking(&key(*k)).unwrap();
                    model.insert(*k, None);
                }
                Op::Reopen => {
                    tier.close().unwrap();
                    drop(tier);
                    tier = DiskTier::open(config(dir.path())).unwrap();
                }
            }
        }
        tier.close().unwrap();
    }
    if delete_index {
        std::fs::remove_file(dir.path().join("index.kvx")).unwrap();
    }
    for damage in damages {
        apply(dir.path(), damage);
    }

    let tier = match DiskTier::open(config(dir.path())) {
        Ok(tier) => tier,
        Err(err) => {
            prop_assert!(!err.to_string().is_empty());
            return Ok(());
        }
    };
    for k in 0..KEYS + 2 {
        let key = key(k);
        let expected = model.get(&k).cloned().flatten();
        let hit = tier.contains_many(std::slice::from_ref(&key)).unwrap()[0];
        if k >= KEYS {
            prop_assert!(!hit, "never-stored key {} is a hit", k);
        }
        let corrupt_before = tier.stats().corrupt_loads;
        let loaded = tier.load_blocking(&key).unwrap();
        if let Some(bytes) = &loaded {
            prop_assert!(hit, "key {} loads but was no hit", k);
            prop_assert_eq!(
                Some(bytes),
                expected.as_ref(),
                "key {} loads bytes other than the last stored ({})",
                k,
                if expected.is_some() {
                    "older bytes"
                } else {
                    "a removed key"
                }
            );
        } else if hit {
            prop_assert!(
                !tier.contains_many(std::slice::from_ref(&key)).unwrap()[0],
                "key {} stays a hit after its failed load",
                k
            );
            prop_assert_eq!(
                tier.stats().corrupt_loads,
                corrupt_before + 1,
                "key {}: a failed load is not counted",
                k
            );
        }
    }
    // The tier still takes stores.
    if tier.store_blocking(&key(KEYS + 10), b"after").is_ok() {
        let after = tier.load_blocking(&key(KEYS + 10)).unwrap();
        prop_assert_eq!(after.as_deref(), Some(&b"after"[..]));
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(cases()))]

    #[test]
    fn arbitrary_bytes_in_a_tier_directory_never_panic_or_serve_stale_bytes(
        ops in proptest::collection::vec(op(), 1..40),
        damages in proptest::collection::vec(damage(), 1..6),
        delete_index in proptest::bool::weighted(0.3),
    ) {
        run(&ops, &damages, delete_index)?;
    }
}
