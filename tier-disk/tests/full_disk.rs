//! A full disk (issue 11, item 1): storing until a small real filesystem is
//! full ends in `DiskFull`, never in SIGBUS, and every acknowledged store
//! survives a reopen on the full filesystem.
//!
//! The filesystem is a tmpfs mounted by the test (root only). Where mounting
//! is not allowed the test says `SKIPPED:` and returns.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{key, payload};
use tier_disk::{DiskConfig, DiskError, DiskTier};

/// A tmpfs of `size` mounted on a fresh directory; unmounted on drop.
struct Tmpfs {
    path: PathBuf,
    _dir: tempfile::TempDir,
}

impl Tmpfs {
    fn mount(size: &str) -> Option<Self> {
        let dir = tempfile::tempdir().ok()?;
        let path = dir.path().join("mnt");
        std::fs::create_dir(&path).ok()?;
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&path)
            .status();
        match status {
            Ok(s) if s.success() => Some(Self { path, _dir: dir }),
            other => {
                eprintln!(
                    "SKIPPED: cannot mount a tmpfs here ({other:?}); the full-disk test did not run"
                );
                None
            }
        }
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.path).status();
    }
}

fn fill_until_full(path: &Path) -> u64 {
    // The default configuration: 65,536 initial slots, a 5 MiB index.
    let tier = DiskTier::open(DiskConfig::new(path)).unwrap();
    let mut acked = 0;
    loop {
        match tier.store(&key(acked), &payload(acked, 0, 8000)) {
            Ok(()) => acked += 1,
            Err(DiskError::DiskFull { .. }) => break,
            Err(other) => panic!("expected DiskFull, got {other}"),
        }
        assert!(acked < 100_000, "the filesystem never filled");
    }
    assert!(acked > 10, "only {acked} stores fit");
    // Full: stores keep failing cleanly and publish nothing.
    let extra = key(1_000_000);
    assert!(matches!(
        tier.store(&extra, &[7u8; 8000]),
        Err(DiskError::DiskFull { .. })
    ));
    assert!(!tier.contains_many(&[extra]).unwrap()[0]);
    for i in 0..acked {
        assert_eq!(tier.load(&key(i)).unwrap(), Some(payload(i, 0, 8000)));
    }
    acked
}

#[test]
fn a_full_tmpfs_gives_disk_full_and_keeps_every_acknowledged_store() {
    let Some(fs) = Tmpfs::mount("8m") else {
        return;
    };
    let acked = fill_until_full(&fs.path);
    // Reopen on the still-full filesystem: everything acknowledged is there.
    let tier = DiskTier::open(DiskConfig::new(&fs.path)).unwrap();
    for i in 0..acked {
        assert_eq!(
            tier.load(&key(i)).unwrap(),
            Some(payload(i, 0, 8000)),
            "key {i}"
        );
    }
    // Removing frees nothing (segments are append-only) but must not crash.
    match tier.remove(&key(0)) {
        Ok(_) | Err(DiskError::DiskFull { .. }) => {}
        Err(other) => panic!("remove on a full disk: {other}"),
    }
}

#[test]
fn an_index_that_does_not_fit_is_disk_full_at_open() {
    let Some(fs) = Tmpfs::mount("1m") else {
        return;
    };
    // 65,536 slots of 80 bytes do not fit in 1 MiB.
    match DiskTier::open(DiskConfig::new(&fs.path)) {
        Err(DiskError::DiskFull { .. }) => {}
        Err(other) => panic!("expected DiskFull, got {other}"),
        Ok(tier) => {
            // Without a reservation the open "succeeds"; the first store
            // into an unallocated page of the map would then die of SIGBUS.
            let stored = tier.store(&key(1), b"x");
            panic!("opened with an index larger than the filesystem; store: {stored:?}");
        }
    }
}
