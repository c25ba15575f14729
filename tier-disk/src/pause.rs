//! A test-only hook that pauses a rehash or an eviction mid-way, so that a
//! test can prove lookups and loads do not wait behind them.

use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

use kvtier_core::{OffloadKey, ReqContext, Tier};

use crate::{DiskConfig, DiskTier, FsyncPolicy, format, lock};

/// Where a writer pauses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pause {
    /// A rehash has built the new index; the old one is still the one read.
    Rehash,
    /// An eviction has retired a segment; its slots are not yet all cleared.
    Evict,
}

type Hook = Arc<dyn Fn(Pause) + Send + Sync>;

/// The hook a test installs ([`DiskTier::pause_at`]); none by default.
#[derive(Default)]
pub(crate) struct PauseHook(Mutex<Option<Hook>>);

impl std::fmt::Debug for PauseHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PauseHook")
    }
}

impl PauseHook {
    /// Runs the hook, if any, for `point`.
    pub(crate) fn at(&self, point: Pause) {
        let hook = lock(&self.0).clone();
        if let Some(hook) = hook {
            hook(point);
        }
    }
}

impl DiskTier {
    fn pause_at(&self, hook: impl Fn(Pause) + Send + Sync + 'static) {
        *lock(&self.pause.0) = Some(Arc::new(hook));
    }
}

/// Generous: only a lookup stuck behind the paused writer takes this long.
const STUCK: Duration = Duration::from_secs(20);

fn key(i: u64) -> OffloadKey {
    let mut bytes = [0u8; 36];
    bytes[..8].copy_from_slice(&i.to_be_bytes());
    bytes[8..16].copy_from_slice(&i.wrapping_mul(0x9E37_79B9_7F4A_7C15).to_le_bytes());
    OffloadKey::new(&bytes)
}

fn keys(n: u64) -> Vec<OffloadKey> {
    (0..n).map(key).collect()
}

fn batch_lookup(tier: &DiskTier, keys: &[OffloadKey]) -> Vec<bool> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .expect("runtime");
    rt.block_on(tier.batch_lookup(keys, &ReqContext::new("pause")))
        .expect("lookup")
}

/// A paused writer, and the channels to wait for it and to let it go.
struct Paused {
    reached: mpsc::Receiver<()>,
    resume: mpsc::Sender<()>,
}

fn pause_on(tier: &DiskTier, point: Pause) -> Paused {
    let (reached_tx, reached) = mpsc::channel();
    let (resume, resume_rx) = mpsc::channel::<()>();
    let resume_rx = Mutex::new(resume_rx);
    tier.pause_at(move |at| {
        if at == point {
            let _ = reached_tx.send(());
            let _ = lock(&resume_rx).recv();
        }
    });
    Paused { reached, resume }
}

/// Looks up `probe` and loads `load` on another thread while the writer is
/// paused; the answer must come back before the writer is let go.
fn answer_while_paused(
    tier: &Arc<DiskTier>,
    paused: &Paused,
    probe: Vec<OffloadKey>,
    load: OffloadKey,
) -> (Vec<bool>, Option<Vec<u8>>) {
    paused
        .reached
        .recv_timeout(STUCK)
        .expect("the writer never reached its pause point");
    let (tx, rx) = mpsc::channel();
    let reader = Arc::clone(tier);
    let handle = std::thread::spawn(move || {
        let found = batch_lookup(&reader, &probe);
        let loaded = reader.load_blocking(&load).expect("load");
        let _ = tx.send((found, loaded));
    });
    let answer = rx.recv_timeout(STUCK);
    // Let the writer go either way, so a failing test ends instead of hanging.
    let _ = paused.resume.send(());
    let answer = answer.expect("a lookup or load waited behind the paused writer");
    handle.join().expect("reader thread");
    answer
}

/// Issue 12 item 3: a rehash builds the new index off the lock; lookups and
/// loads made meanwhile answer from the old index, exactly, and those made
/// after the swap answer from the new one, exactly (also after a reopen).
#[test]
fn a_lookup_completes_while_a_rehash_is_in_progress() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = DiskConfig {
        initial_slots: 64,
        fsync: FsyncPolicy::Never,
        ..DiskConfig::new(dir.path())
    };
    let tier = Arc::new(DiskTier::open(config.clone()).expect("open"));
    let mut n = 0;
    while !tier.read_index().needs_rehash_before(1) {
        tier.store_blocking(&key(n), &n.to_le_bytes())
            .expect("store");
        n += 1;
    }
    assert_eq!(tier.stats().rehashes, 0);
    let paused = pause_on(&tier, Pause::Rehash);
    let writer = Arc::clone(&tier);
    let store = std::thread::spawn(move || writer.store_blocking(&key(n), b"grows the index"));

    let (found, loaded) = answer_while_paused(&tier, &paused, keys(n + 5), key(3));
    let mut expected = vec![true; n as usize];
    expected.extend([false; 5]); // key n included: its store has not returned
    assert_eq!(found, expected, "lookups during the rehash");
    assert_eq!(loaded.as_deref(), Some(&3u64.to_le_bytes()[..]));

    store.join().expect("store thread").expect("store");
    assert_eq!(tier.stats().rehashes, 1);
    assert!(tier.stats().index_slots > 64);
    expected[n as usize] = true;
    assert_eq!(
        batch_lookup(&tier, &keys(n + 5)),
        expected,
        "after the swap"
    );
    for i in 0..n {
        assert_eq!(
            tier.load_blocking(&key(i)).expect("load"),
            Some(i.to_le_bytes().to_vec())
        );
    }
    assert_eq!(
        tier.load_blocking(&key(n)).expect("load").as_deref(),
        Some(&b"grows the index"[..])
    );
    // The swapped-in index is the one on disk.
    drop(tier);
    let tier = DiskTier::open(config).expect("reopen");
    assert!(!tier.stats().rebuilt_index);
    assert_eq!(
        batch_lookup(&tier, &keys(n + 5)),
        expected,
        "after a reopen"
    );
}

/// An eviction clears its segment's slots off the lock: lookups made
/// meanwhile already miss the evicted keys and still find the others.
#[test]
fn a_lookup_completes_while_an_eviction_clears_its_slots() {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = DiskConfig {
        segment_bytes: 4096,
        capacity_bytes: 8192,
        fsync: FsyncPolicy::Never,
        ..DiskConfig::new(dir.path())
    };
    let tier = Arc::new(DiskTier::open(config).expect("open"));
    let payload = vec![7u8; 1000];
    // The largest a record of this payload takes, whatever its gap.
    let record = format::record_size(36, format::PAYLOAD_ALIGN - 1, payload.len()) as u64;
    let mut n = 0;
    while lock(&tier.writer).total_bytes + record <= 8192 {
        tier.store_blocking(&key(n), &payload).expect("store");
        n += 1;
    }
    let oldest = *lock(&tier.writer)
        .segments
        .keys()
        .next()
        .expect("a segment");
    let live = tier.live();
    let in_oldest: Vec<bool> = (0..n)
        .map(|i| {
            let (_, at) = tier
                .read_index()
                .find(key(i).as_bytes(), live)
                .expect("stored");
            at.segment == oldest
        })
        .collect();
    assert!(in_oldest.iter().any(|&o| o) && !in_oldest.iter().all(|&o| o));
    let survivor = (0..n)
        .find(|&i| !in_oldest[i as usize])
        .expect("a survivor");
    assert_eq!(tier.stats().evicted_segments, 0);

    let paused = pause_on(&tier, Pause::Evict);
    let writer = Arc::clone(&tier);
    let last = vec![8u8; payload.len()]; // one more record of this size evicts
    let store = std::thread::spawn(move || writer.store_blocking(&key(n), &last));
    let (found, loaded) = answer_while_paused(&tier, &paused, keys(n + 1), key(survivor));
    let mut expected: Vec<bool> = in_oldest.iter().map(|&o| !o).collect();
    expected.push(false);
    assert_eq!(found, expected, "lookups during the eviction");
    assert_eq!(loaded, Some(payload.clone()));

    store.join().expect("store thread").expect("store");
    assert_eq!(tier.stats().evicted_segments, 1);
    expected[n as usize] = true;
    assert_eq!(
        batch_lookup(&tier, &keys(n + 1)),
        expected,
        "after the eviction"
    );
    assert_eq!(tier.len(), expected.iter().filter(|&&f| f).count() as u64);
}
