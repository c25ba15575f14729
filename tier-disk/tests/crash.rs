//! Kill-and-reopen: a child process stores (and removes) keys in a loop and
//! is killed with SIGKILL at a random point, many times over the same
//! directory. After each kill the parent reopens the tier and checks:
//! - every acknowledged store is present and loads its exact payload;
//! - every acknowledged removal is absent;
//! - no key that was never written is reported, and every key the index
//!   reports loads with a valid checksum (no phantom hit).
//!
//! The child is this test binary run again with `crash_child` selected and
//! the directory in an environment variable (foyer's "no phantom value" test
//! is the model).

mod common;

use std::collections::{BTreeSet, HashSet};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{key, payload};
use kvtier_core::OffloadKey;
use kvtier_disk::{DiskConfig, DiskTier, FsyncPolicy};

const DIR_VAR: &str = "KVTIER_CRASH_DIR";
const START_VAR: &str = "KVTIER_CRASH_START";
const FSYNC_VAR: &str = "KVTIER_CRASH_FSYNC";
const MAX_PAYLOAD: usize = 3000;

fn config(dir: &str, fsync: FsyncPolicy) -> DiskConfig {
    DiskConfig {
        segment_bytes: 256 << 10,
        capacity_bytes: 1 << 30, // no eviction: every acknowledged store must stay
        initial_slots: 64,       // rehashes happen under the knife too
        fsync,
        ..DiskConfig::new(dir)
    }
}

/// The child's body; a no-op unless run by `kill_and_reopen`.
#[test]
fn crash_child() {
    let Ok(dir) = std::env::var(DIR_VAR) else {
        return;
    };
    let start: u64 = std::env::var(START_VAR).unwrap().parse().unwrap();
    let fsync = if std::env::var(FSYNC_VAR).as_deref() == Ok("always") {
        FsyncPolicy::Always
    } else {
        FsyncPolicy::Never
    };
    let tier = DiskTier::open(config(&dir, fsync)).unwrap();
    let mut out = std::io::stdout().lock();
    for i in start..start + 200_000 {
        tier.store_blocking(&key(i), &payload(i, 0, MAX_PAYLOAD))
            .unwrap();
        std::io::Write::write_all(&mut out, format!("ACK {i}\n").as_bytes()).unwrap();
        if i % 7 == 3 {
            tier.remove_blocking(&key(i - 2)).unwrap();
            std::io::Write::write_all(&mut out, format!("DEL {}\n", i - 2).as_bytes()).unwrap();
        }
        std::io::Write::flush(&mut out).unwrap();
    }
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[test]
fn kill_and_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let dir_str = dir.path().to_str().unwrap().to_owned();
    let exe = std::env::current_exe().unwrap();
    let mut rng = Rng(0x5eed_cafe);
    let mut acked: BTreeSet<u64> = BTreeSet::new();
    let mut deleted: HashSet<u64> = HashSet::new();
    let rounds = 16;
    let mut recounts = 0;
    for round in 0..rounds {
        let start = round * 1_000_000;
        let fsync = if round % 2 == 0 { "never" } else { "always" };
        let mut child = Command::new(&exe)
            .args(["--exact", "crash_child", "--nocapture", "--test-threads=1"])
            .env(DIR_VAR, &dir_str)
            .env(START_VAR, start.to_string())
            .env(FSYNC_VAR, fsync)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel::<String>();
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        // Wait for the child's first acknowledged store (on a loaded
        // machine it may take a while to start), so that the kill always
        // lands on an open tier; then let it write for 20 to 200 ms more
        // and kill it mid-flight.
        let mut lines = Vec::new();
        let waiting = Instant::now();
        while !lines.iter().any(|l: &String| l.contains("ACK ")) {
            match rx.recv_timeout(Duration::from_secs(30)) {
                Ok(line) => lines.push(line),
                Err(e) => panic!(
                    "round {round}: no store acknowledged after {:?}: {e}",
                    waiting.elapsed()
                ),
            }
        }
        std::thread::sleep(Duration::from_millis(20 + rng.next() % 180));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        reader.join().unwrap();
        lines.extend(rx.try_iter());
        for line in &lines {
            // libtest prints "test crash_child ... " without a newline, so
            // the first marker can share a line with it.
            let line = line
                .rfind("ACK ")
                .or_else(|| line.rfind("DEL "))
                .map_or("", |at| &line[at..]);
            if let Some(i) = line.strip_prefix("ACK ") {
                let i: u64 = i.parse().unwrap();
                acked.insert(i);
                deleted.remove(&i);
            } else if let Some(i) = line.strip_prefix("DEL ") {
                let i: u64 = i.parse().unwrap();
                acked.remove(&i);
                deleted.insert(i);
            }
        }

        let started = Instant::now();
        let tier = DiskTier::open(config(&dir_str, FsyncPolicy::Never)).unwrap();
        let reopen = started.elapsed();
        if tier.stats().recounted_index {
            recounts += 1;
        }
        // At the kill, at most one operation was in flight: the store of
        // `last + 1`, or the removal of `last - 2` (its DEL line unwritten).
        let last_acked = acked.range(start..).next_back().copied();
        let in_flight_removal = last_acked
            .filter(|i| i % 7 == 3)
            .map(|i| i - 2)
            .filter(|k| acked.contains(k));
        let in_flight_store = last_acked.map_or(start, |i| i + 1);
        for &i in &acked {
            let loaded = tier.load_blocking(&key(i)).unwrap();
            if Some(i) == in_flight_removal && loaded.is_none() {
                continue;
            }
            assert_eq!(
                loaded,
                Some(payload(i, 0, MAX_PAYLOAD)),
                "round {round}: acknowledged key {i} lost"
            );
        }
        if let Some(k) = in_flight_removal
            && tier.load_blocking(&key(k)).unwrap().is_none()
        {
            acked.remove(&k);
            deleted.insert(k);
        }
        for &i in &deleted {
            assert_eq!(
                tier.load_blocking(&key(i)).unwrap(),
                None,
                "round {round}: removed key {i} is back"
            );
        }
        // Everything the child may have touched, plus keys it never wrote:
        // nothing is reported that does not load its exact payload, and
        // nothing past the in-flight store is reported at all.
        let end = in_flight_store + 50;
        let candidates: Vec<OffloadKey> = (start..end).map(key).collect();
        let found = tier.contains_many(&candidates).unwrap();
        for (i, present) in (start..end).zip(found) {
            if present {
                assert!(
                    i <= in_flight_store,
                    "round {round}: phantom hit for never-written key {i}"
                );
                assert_eq!(
                    tier.load_blocking(&key(i)).unwrap(),
                    Some(payload(i, 0, MAX_PAYLOAD)),
                    "round {round}: key {i} reported but does not load"
                );
                if i == in_flight_store {
                    acked.insert(i); // the unacknowledged store landed
                }
            }
        }
        assert_eq!(tier.stats().corrupt_loads, 0);
        assert_eq!(
            tier.len(),
            acked.len() as u64,
            "round {round}: live keys after recount"
        );
        eprintln!(
            "round {round}: {} lines, {} keys live, reopen {reopen:?}",
            lines.len(),
            tier.len()
        );
        // Each child starts from a clean close; each reopen above follows a
        // kill, so it takes the unclean path (recount) every round.
        tier.close().unwrap();
    }
    assert!(!acked.is_empty());
    assert_eq!(
        recounts, rounds,
        "every reopen after a kill recounts the index"
    );
}
