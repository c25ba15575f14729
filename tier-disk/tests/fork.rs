//! A disk tier and processes forked while it is open (Python's
//! multiprocessing, or any `Command` between its fork and its exec): the
//! directory's lock belongs to the process that opened the tier.
//!
//! A forked child of a multi-threaded process may only call async-signal-safe
//! functions until it execs, unless no other thread can hold a lock the child
//! needs: the tests here run one at a time (`SERIAL`), in a binary of their
//! own, and each child ends with `_exit`.

mod common;

use std::sync::Mutex;
use std::time::{Duration, Instant};

use common::{key, small};
use kvtier_disk::{DiskError, DiskTier};

static SERIAL: Mutex<()> = Mutex::new(());

/// A forked child, killed and reaped when dropped (a failing assertion
/// included).
struct Child(libc::pid_t);

impl Child {
    /// Forks; the child runs `body`, then `_exit(0)`.
    fn fork(body: impl FnOnce()) -> Self {
        // SAFETY: the child runs `body` and `_exit`s without returning into
        // the test harness; see the module's note on what `body` may do.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            body();
            // SAFETY: ends the child at once, running no destructor and no
            // atexit handler of the parent's.
            unsafe { libc::_exit(0) };
        }
        assert!(pid > 0, "fork failed");
        Self(pid)
    }

    /// Waits up to `within` for the child to exit; whether it did.
    fn exited_within(&self, within: Duration) -> bool {
        let start = Instant::now();
        while start.elapsed() < within {
            let mut status = 0;
            // SAFETY: a plain syscall on our own child's pid.
            let reaped = unsafe { libc::waitpid(self.0, &mut status, libc::WNOHANG) };
            if reaped == self.0 {
                return true;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        false
    }

    /// Waits up to `within` for the child to exit; its exit status, if it
    /// exited normally.
    fn exit_status_within(&self, within: Duration) -> Option<i32> {
        let start = Instant::now();
        while start.elapsed() < within {
            let mut status = 0;
            // SAFETY: a plain syscall on our own child's pid.
            let reaped = unsafe { libc::waitpid(self.0, &mut status, libc::WNOHANG) };
            if reaped == self.0 {
                return libc::WIFEXITED(status).then(|| libc::WEXITSTATUS(status));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        None
    }
}

impl Drop for Child {
    fn drop(&mut self) {
        // SAFETY: plain syscalls on our own child's pid (harmless if it has
        // already been reaped: kill and waitpid then fail with ESRCH/ECHILD).
        unsafe {
            libc::kill(self.0, libc::SIGKILL);
            libc::waitpid(self.0, std::ptr::null_mut(), 0);
        }
    }
}

/// Closing the tier frees the directory at once, even while a forked child
/// still holds a copy of the lock file's descriptor: before, the lock lived
/// as long as that copy, and the next open got `Locked` (CI saw it when
/// another test spawned `mount` at that moment).
#[test]
fn a_closed_tier_frees_its_directory_while_a_forked_child_lives() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let tier = DiskTier::open(small(dir.path())).unwrap();
    tier.store_blocking(&key(1), b"kept").unwrap();
    let child = Child::fork(|| {
        loop {
            // SAFETY: async-signal-safe; the parent kills this process.
            unsafe { libc::pause() };
        }
    });
    drop(tier);
    let reopened = DiskTier::open(small(dir.path()));
    drop(child);
    let reopened = reopened.expect("the directory is free once the tier is dropped");
    assert_eq!(
        reopened.load_blocking(&key(1)).unwrap(),
        Some(b"kept".to_vec())
    );
}

/// A child that drops its copy of the tier leaves the parent's lock (and
/// files) alone: before, its drop unlocked the shared open file description,
/// and a second writer could open the directory under the parent.
#[test]
fn a_tier_dropped_in_a_forked_child_keeps_the_parents_lock() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let mut tier = DiskTier::open(small(dir.path())).unwrap();
    tier.store_blocking(&key(1), b"kept").unwrap();
    // The child drops its own copy of the tier (its memory is a copy of
    // ours); this process never uses the pointer.
    let inherited: *mut DiskTier = &mut tier;
    // SAFETY: in the child, `inherited` points to a live tier that nothing
    // else there uses again: the child `_exit`s right after.
    let child = Child::fork(move || unsafe { std::ptr::drop_in_place(inherited) });
    assert!(
        child.exited_within(Duration::from_secs(10)),
        "the child did not finish dropping its tier within 10 s"
    );
    drop(child);
    match DiskTier::open(small(dir.path())) {
        Err(DiskError::Locked { .. }) => {}
        Err(other) => panic!("expected Locked, got {other}"),
        Ok(_) => panic!("a second writer opened the directory under the parent"),
    }
    tier.store_blocking(&key(2), b"more").unwrap();
    assert_eq!(tier.load_blocking(&key(2)).unwrap(), Some(b"more".to_vec()));
}

/// A forked child's stores are refused with a typed error, never
/// acknowledged and then lost: the child's appends went to the parent's
/// segment at offsets the parent did not know were taken, and the parent's
/// next stores overwrote them (every child key then loaded `None`).
#[test]
fn a_forked_childs_stores_fail_rather_than_vanish() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dir = tempfile::tempdir().unwrap();
    let tier = DiskTier::open(small(dir.path())).unwrap();
    tier.store_blocking(&key(0), b"before the fork").unwrap();
    let tier_ref = &tier;
    // The child reports through its exit status: 0 when every store was
    // refused with `Forked` (and a read still worked), else the number of
    // the first broken rule.
    let child = Child::fork(move || {
        let mut status = 0;
        for i in 1000..1050 {
            match tier_ref.store_blocking(&key(i), b"from the child") {
                Err(DiskError::Forked { .. }) => {}
                Ok(()) => {
                    status = 1;
                    break;
                }
                Err(_) => {
                    status = 2;
                    break;
                }
            }
        }
        if status == 0
            && !matches!(
                tier_ref.remove_blocking(&key(0)),
                Err(DiskError::Forked { .. })
            )
        {
            status = 3;
        }
        if status == 0 && !matches!(tier_ref.close(), Err(DiskError::Forked { .. })) {
            status = 4;
        }
        if status == 0
            && tier_ref.load_blocking(&key(0)).ok().flatten().as_deref()
                != Some(&b"before the fork"[..])
        {
            status = 5;
        }
        // SAFETY: ends the child with its verdict, running no destructor.
        unsafe { libc::_exit(status) };
    });
    let status = child.exit_status_within(Duration::from_secs(10));
    drop(child);
    for i in 2000..2050 {
        tier.store_blocking(&key(i), b"from the parent").unwrap();
    }
    // Whatever the child was told, nothing it was told is stored is lost.
    let child_keys: Vec<_> = (1000..1050).map(key).collect();
    let found = tier.contains_many(&child_keys).unwrap();
    for (i, k) in child_keys.iter().enumerate() {
        if found[i] {
            assert_eq!(
                tier.load_blocking(k).unwrap().as_deref(),
                Some(&b"from the child"[..])
            );
        }
    }
    assert_eq!(
        status,
        Some(0),
        "the child's stores were not refused with DiskError::Forked (exit status 1: acknowledged)"
    );
    for i in 2000..2050 {
        assert_eq!(
            tier.load_blocking(&key(i)).unwrap().as_deref(),
            Some(&b"from the parent"[..])
        );
    }
    assert_eq!(
        tier.load_blocking(&key(0)).unwrap().as_deref(),
        Some(&b"before the fork"[..])
    );
    drop(tier);
    let reopened = DiskTier::open(small(dir.path())).unwrap();
    assert_eq!(
        reopened.load_blocking(&key(0)).unwrap().as_deref(),
        Some(&b"before the fork"[..])
    );
}
