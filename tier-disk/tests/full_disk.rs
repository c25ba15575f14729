//! A full disk (issue 11, item 1): storing until a small real filesystem is
//! full ends in `DiskFull`, never in SIGBUS, and every acknowledged store
//! survives a reopen on the full filesystem.
//!
//! The filesystem is a tmpfs, or an ext4 image on a loop device, mounted by
//! the test (root only). Where mounting is not allowed (or `mkfs.ext4` is
//! missing) the test says `SKIPPED:` and returns.

mod common;

use std::path::PathBuf;
use std::process::Command;

use common::{key, pairs, payload};
use kvtier_disk::{DiskConfig, DiskError, DiskTier, FsyncPolicy};

/// A small filesystem mounted on a fresh directory; unmounted on drop.
struct Mount {
    path: PathBuf,
    _dir: tempfile::TempDir,
}

fn run(cmd: &mut Command) -> Result<(), String> {
    match cmd.output() {
        Ok(out) if out.status.success() => Ok(()),
        Ok(out) => Err(String::from_utf8_lossy(&out.stderr).trim().to_owned()),
        Err(err) => Err(err.to_string()),
    }
}

impl Mount {
    fn tmpfs(size: &str) -> Option<Self> {
        let dir = tempfile::tempdir().ok()?;
        let path = dir.path().join("mnt");
        std::fs::create_dir(&path).ok()?;
        let mounted = run(Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&path));
        Self::mounted(mounted, "a tmpfs", path, dir)
    }

    fn ext4(mib: u64) -> Option<Self> {
        let dir = tempfile::tempdir().ok()?;
        let image = dir.path().join("fs.img");
        std::fs::File::create(&image)
            .and_then(|f| f.set_len(mib << 20))
            .ok()?;
        let path = dir.path().join("mnt");
        std::fs::create_dir(&path).ok()?;
        let mounted =
            run(Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&image)).and_then(|()| {
                run(Command::new("mount")
                    .args(["-t", "ext4", "-o", "loop"])
                    .arg(&image)
                    .arg(&path))
            });
        Self::mounted(mounted, "an ext4 loop image", path, dir)
    }

    fn mounted(
        result: Result<(), String>,
        what: &str,
        path: PathBuf,
        dir: tempfile::TempDir,
    ) -> Option<Self> {
        match result {
            Ok(()) => Some(Self { path, _dir: dir }),
            Err(err) => {
                eprintln!(
                    "SKIPPED: cannot mount {what} here ({err}); this full-disk test did not run"
                );
                None
            }
        }
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.path).status();
    }
}

/// Stores payloads of up to `max` bytes until the filesystem is full, then
/// ever smaller ones down to a single byte, so that the last free block is
/// used up; returns the largest payload size of each acknowledged key
/// (keys `0..n`).
fn fill_until_full(config: &DiskConfig, max: usize) -> Vec<usize> {
    let tier = DiskTier::open(config.clone()).unwrap();
    let mut acked: Vec<usize> = Vec::new();
    let mut size = max;
    loop {
        let i = acked.len() as u64;
        match tier.store_blocking(&key(i), &payload(i, 0, size)) {
            Ok(()) => acked.push(size),
            Err(DiskError::DiskFull { .. }) if size == 1 => break,
            Err(DiskError::DiskFull { .. }) => size = (size / 8).max(1),
            Err(other) => panic!("expected DiskFull, got {other}"),
        }
        assert!(acked.len() < 200_000, "the filesystem never filled");
    }
    assert!(acked.len() > 10, "only {} stores fit", acked.len());
    // Full: stores keep failing cleanly and publish nothing.
    let extra = key(1_000_000);
    assert!(matches!(
        tier.store_blocking(&extra, &vec![7u8; max]),
        Err(DiskError::DiskFull { .. })
    ));
    assert!(!tier.contains_many(&[extra]).unwrap()[0]);
    check(&tier, &acked);
    acked
}

fn check(tier: &DiskTier, acked: &[usize]) {
    for (i, &size) in (0..).zip(acked) {
        assert_eq!(
            tier.load_blocking(&key(i)).unwrap(),
            Some(payload(i, 0, size)),
            "key {i}"
        );
    }
}

/// Fills, then reopens on the still-full filesystem: everything
/// acknowledged is there, and a removal does not crash.
fn fill_and_reopen(config: &DiskConfig, max: usize) {
    let acked = fill_until_full(config, max);
    let tier = DiskTier::open(config.clone()).unwrap();
    check(&tier, &acked);
    // Removing frees nothing (segments are append-only) but must not crash.
    match tier.remove_blocking(&key(0)) {
        Ok(_) | Err(DiskError::DiskFull { .. }) => {}
        Err(other) => panic!("remove on a full disk: {other}"),
    }
}

#[test]
fn a_full_tmpfs_gives_disk_full_and_keeps_every_acknowledged_store() {
    let Some(fs) = Mount::tmpfs("8m") else {
        return;
    };
    // The default configuration: 65,536 initial slots, a 5 MiB index.
    fill_and_reopen(&DiskConfig::new(&fs.path), 8000);
}

#[test]
fn a_full_ext4_gives_disk_full_and_keeps_every_acknowledged_store() {
    let Some(fs) = Mount::ext4(16) else {
        return;
    };
    // fsync = never keeps the test quick on a loop device; a write on a
    // full ext4 fails with ENOSPC at write time either way (delayed
    // allocation reserves the blocks then).
    let config = DiskConfig {
        fsync: FsyncPolicy::Never,
        ..DiskConfig::new(&fs.path)
    };
    fill_and_reopen(&config, 60_000);
}

#[test]
fn an_index_growing_on_a_full_disk_publishes_nothing_it_cannot_keep() {
    let Some(fs) = Mount::tmpfs("2m") else {
        return;
    };
    // A small index that rehashes (into a new, larger file) as it fills.
    let config = DiskConfig {
        initial_slots: 16,
        ..DiskConfig::new(&fs.path)
    };
    fill_and_reopen(&config, 300);
}

#[test]
fn an_index_that_does_not_fit_is_disk_full_at_open() {
    let Some(fs) = Mount::tmpfs("1m") else {
        return;
    };
    // 65,536 slots of 80 bytes do not fit in 1 MiB.
    match DiskTier::open(DiskConfig::new(&fs.path)) {
        Err(DiskError::DiskFull { .. }) => {}
        Err(other) => panic!("expected DiskFull, got {other}"),
        Ok(tier) => {
            // Without a reservation the open "succeeds"; the first store
            // into an unallocated page of the map would then die of SIGBUS.
            let stored = tier.store_blocking(&key(1), b"x");
            panic!("opened with an index larger than the filesystem; store: {stored:?}");
        }
    }
}

/// A store that fails because the index cannot grow (the filesystem is
/// full) leaves no record behind: after the index is lost and rebuilt from
/// the segments, the keys whose stores failed are still absent. (The index
/// grows before the record is appended; before, the record was appended
/// first and a rebuild served the failed store.)
#[test]
fn a_store_refused_for_a_full_disk_is_not_served_after_a_rebuild() {
    let Some(fs) = Mount::tmpfs("2m") else {
        return;
    };
    let config = DiskConfig {
        initial_slots: 16,
        ..DiskConfig::new(&fs.path)
    };
    let acked = fill_until_full(&config, 300);
    std::fs::remove_file(fs.path.join("index.kvx")).unwrap();
    // Room for the rebuild (which holds two index files while it grows).
    run(Command::new("mount")
        .args(["-o", "remount,size=8m"])
        .arg(&fs.path))
    .unwrap();
    let tier = DiskTier::open(config).unwrap();
    assert!(tier.stats().rebuilt_index);
    let refused = [key(acked.len() as u64), key(1_000_000)];
    assert_eq!(
        tier.contains_many(&refused).unwrap(),
        [false, false],
        "a refused store came back with the rebuild"
    );
    check(&tier, &acked);
}

/// A batch that fills the disk part way answers per key: the blocks before
/// the failure are stored (and survive a reopen), the failing one and
/// every one after it fail as `Unavailable` (a full disk), and none of
/// those is published.
#[test]
fn a_batch_that_fills_the_disk_keeps_its_stored_blocks_and_fails_the_rest() {
    use kvtier_core::{BlockOutcome, OffloadKey, TierErrorKind};
    let Some(fs) = Mount::tmpfs("8m") else {
        return;
    };
    let config = DiskConfig {
        initial_slots: 1024,
        segment_bytes: 1 << 20,
        capacity_bytes: 64 << 20,
        ..DiskConfig::new(&fs.path)
    };
    let tier = DiskTier::open(config.clone()).unwrap();
    let keys: Vec<OffloadKey> = (0..200).map(key).collect();
    let blocks: Vec<Vec<u8>> = (0..200).map(|i| vec![i as u8; 100_000]).collect();
    let batch = pairs(&keys, &blocks);
    let outcomes = tier.store_batch_blocking(&batch);
    let stored = outcomes.iter().take_while(|o| o.is_done()).count();
    assert!(
        stored > 10 && stored < 200,
        "8 MiB take some of 20 MB: {stored} stored"
    );
    for (i, outcome) in outcomes.iter().enumerate().skip(stored) {
        match outcome {
            BlockOutcome::Failed(err) => {
                assert_eq!(err.kind(), TierErrorKind::Unavailable, "{err}")
            }
            other => panic!("block {i} after the disk filled: {other:?}"),
        }
    }
    let present = tier.contains_many(&keys).unwrap();
    assert_eq!(present.iter().filter(|&&p| p).count(), stored);
    assert!(present[..stored].iter().all(|&p| p));
    drop(tier);
    let tier = DiskTier::open(config).unwrap();
    for i in 0..stored {
        assert_eq!(
            tier.load_blocking(&keys[i]).unwrap().as_ref(),
            Some(&blocks[i]),
            "key {i}"
        );
    }
    assert!(!tier.contains_many(&keys[stored..]).unwrap().contains(&true));
}
