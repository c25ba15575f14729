//! Corruption: truncate, flip bytes in, and zero the index and the segments,
//! then reopen. Opening gives a typed error or a working tier (rebuilt if
//! need be); never a panic, never a hit for a key that was not stored, and
//! never a payload other than the one stored.

mod common;

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use common::{key, payload, small};
use kvtier_core::OffloadKey;
use kvtier_disk::{DiskConfig, DiskTier};

const KEYS: u64 = 400;

fn populate(dir: &Path) {
    let tier = DiskTier::open(small(dir)).unwrap();
    for i in 0..KEYS {
        tier.store_blocking(&key(i), &payload(i, 0, 1500)).unwrap();
    }
    tier.close().unwrap();
}

fn files(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "kvs" || e == "kvx"))
        .collect();
    files.sort();
    files
}

/// Whatever the damage: open, and if it opens, every answer is right or a miss.
fn check(dir: &Path, what: &str) {
    let tier = match DiskTier::open(small(dir)) {
        Ok(tier) => tier,
        Err(err) => {
            // A typed error with a message that says what.
            assert!(!err.to_string().is_empty(), "{what}");
            return;
        }
    };
    let keys: Vec<OffloadKey> = (0..KEYS + 100).map(key).collect();
    let found = tier.contains_many(&keys).unwrap();
    for (i, present) in (0..KEYS + 100).zip(found) {
        if i >= KEYS {
            assert!(!present, "{what}: hit for never-stored key {i}");
        }
        if let Some(bytes) = tier.load_blocking(&key(i)).unwrap() {
            assert_eq!(
                bytes,
                payload(i, 0, 1500),
                "{what}: wrong payload for key {i}"
            );
        }
    }
    // Stores still work after whatever happened.
    tier.store_blocking(&key(KEYS + 1000), b"after").unwrap();
    assert_eq!(
        tier.load_blocking(&key(KEYS + 1000)).unwrap().as_deref(),
        Some(&b"after"[..]),
        "{what}"
    );
}

struct Rng(u64);
impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
}

#[test]
fn truncated_files_never_panic_or_lie() {
    let mut rng = Rng(11);
    for round in 0..12 {
        let dir = tempfile::tempdir().unwrap();
        populate(dir.path());
        let all = files(dir.path());
        let victim = &all[rng.below(all.len() as u64) as usize];
        let len = std::fs::metadata(victim).unwrap().len();
        let cut = rng.below(len);
        OpenOptions::new()
            .write(true)
            .open(victim)
            .unwrap()
            .set_len(cut)
            .unwrap();
        check(
            dir.path(),
            &format!("round {round}: {} truncated to {cut}", victim.display()),
        );
    }
}

#[test]
fn flipped_bytes_never_panic_or_lie() {
    let mut rng = Rng(23);
    for round in 0..24 {
        let dir = tempfile::tempdir().unwrap();
        populate(dir.path());
        let all = files(dir.path());
        for _ in 0..1 + rng.below(8) {
            let victim = &all[rng.below(all.len() as u64) as usize];
            let len = std::fs::metadata(victim).unwrap().len();
            if len == 0 {
                continue;
            }
            let at = rng.below(len);
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .open(victim)
                .unwrap();
            let mut byte = [0u8];
            file.read_exact_at(&mut byte, at).unwrap();
            file.write_all_at(&[byte[0] ^ (1 << rng.below(8))], at)
                .unwrap();
        }
        check(dir.path(), &format!("round {round}: flipped bytes"));
    }
}

#[test]
fn zeroed_index_or_segments_never_panic_or_lie() {
    for target in ["kvx", "kvs"] {
        let dir = tempfile::tempdir().unwrap();
        populate(dir.path());
        for file in files(dir.path())
            .iter()
            .filter(|p| p.extension().is_some_and(|e| e == target))
        {
            let len = std::fs::metadata(file).unwrap().len();
            std::fs::write(file, vec![0u8; len as usize]).unwrap();
        }
        check(dir.path(), &format!("zeroed every .{target}"));
    }
}

#[test]
fn a_zeroed_index_is_rebuilt_with_everything() {
    let dir = tempfile::tempdir().unwrap();
    populate(dir.path());
    let index = dir.path().join("index.kvx");
    let len = std::fs::metadata(&index).unwrap().len();
    std::fs::write(&index, vec![0u8; len as usize]).unwrap();
    let tier = DiskTier::open(small(dir.path())).unwrap();
    assert!(tier.stats().rebuilt_index);
    assert_eq!(tier.len(), KEYS);
    for i in 0..KEYS {
        assert_eq!(
            tier.load_blocking(&key(i)).unwrap(),
            Some(payload(i, 0, 1500))
        );
    }
}

#[test]
fn garbage_files_in_place_of_the_index_are_handled() {
    for garbage in [&b""[..], b"KVTIERIX", &[0xffu8; 5000][..]] {
        let dir = tempfile::tempdir().unwrap();
        populate(dir.path());
        std::fs::write(dir.path().join("index.kvx"), garbage).unwrap();
        check(
            dir.path(),
            &format!("index replaced by {} bytes", garbage.len()),
        );
        let off = DiskConfig {
            rebuild_corrupt_index: false,
            ..small(dir.path())
        };
        drop(off);
    }
}
