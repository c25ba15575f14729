//! The tier conformance suite: one set of tests, run by every tier crate.
//!
//! Each check is a plain `async fn` taking a [`Fixture`], which wraps the
//! store under test; every write goes through [`BlockStore`], the in-place
//! batch forms included ([`batch_forms`]). Checks panic (with a
//! message naming the tier and the broken rule) when the tier breaks the
//! [`Tier`] contract, as tests do. Keys are unique per process and call, so
//! the suite can run against a shared server that keeps data between runs.
//!
//! ```text
//! #[tokio::test]
//! async fn conformance() {
//!     let store = Arc::new(MyStore::open().await.unwrap());
//!     kvtier_core::testkit::run_all(&Fixture::new(store)).await;
//! }
//! ```
//!
//! [`FaultTier`] is a tier that injects latency and faults, for tests of
//! code built on the manager; [`MemStore`] a block store whose copies can
//! be slowed, failed, hung or made to panic, for tests of code that moves
//! blocks (the [`TransferQueue`](crate::TransferQueue)).

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::{
    AsyncLookupManager, BlockStore, LookupVerdict, ManagerConfig, OffloadKey, PrefixVerdict,
    ReqContext, Tier, TierError,
};

mod batch;
mod fault;
mod mem_store;
pub use batch::{
    CANARY, batch_absent_keys, batch_duplicates, batch_empty, batch_forms, batch_round_trip,
    batch_wrong_length_regions, block_of, load_regions, store_pairs,
};
pub use fault::{CallRecord, FaultConfig, FaultOutcome, FaultTier, RequestFault};
pub use mem_store::MemStore;

/// A store under test, as the conformance checks see it: the store, the key
/// length it accepts and a name for messages.
///
/// Every check goes through [`BlockStore`] itself, the way the engine uses a
/// tier: it stores blocks with [`BlockStore::store_many`], reads them back,
/// removes them, and asks [`Tier::batch_lookup`] and a real
/// [`AsyncLookupManager`] which exist.
#[derive(Debug)]
pub struct Fixture<S> {
    store: Arc<S>,
    key_len: usize,
    name: String,
}

impl<S: BlockStore> Fixture<S> {
    /// A fixture for `store`, with 36-byte keys (vLLM's) and the store's type
    /// name in messages.
    pub fn new(store: Arc<S>) -> Self {
        Self {
            store,
            key_len: 36,
            name: std::any::type_name::<S>().to_owned(),
        }
    }

    /// Uses keys of `len` bytes (at least 16).
    #[must_use]
    pub fn with_key_len(mut self, len: usize) -> Self {
        self.key_len = len;
        self
    }

    /// Names the store in messages.
    #[must_use]
    pub fn with_name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// The store under test.
    pub fn tier(&self) -> Arc<S> {
        Arc::clone(&self.store)
    }

    /// The key length the store accepts.
    pub fn key_len(&self) -> usize {
        self.key_len
    }

    /// The name used in messages.
    pub fn name(&self) -> String {
        self.name.clone()
    }

    /// Makes `keys` exist: stores [`block_for`] each key.
    ///
    /// # Errors
    /// The store's error.
    pub async fn insert(&self, keys: &[OffloadKey]) -> Result<(), TierError> {
        let blocks: Vec<(OffloadKey, Vec<u8>)> =
            keys.iter().map(|k| (k.clone(), block_for(k))).collect();
        self.store.store_many(&blocks).await
    }

    /// Makes `keys` absent.
    ///
    /// # Errors
    /// The store's error.
    pub async fn remove(&self, keys: &[OffloadKey]) -> Result<(), TierError> {
        self.store.remove_many(keys).await
    }
}

/// Looks up `keys` through `manager` for a fresh request `req` until every
/// key has a verdict (flushing between rounds), then cleans the request up.
///
/// # Panics
/// When some key is still pending after `within`: the manager's deadlines
/// did not hold.
pub fn verdicts<T: Tier>(
    manager: &mut AsyncLookupManager<T>,
    keys: &[OffloadKey],
    req: &str,
    within: Duration,
) -> Vec<LookupVerdict> {
    let ctx = ReqContext::new(req);
    let start = Instant::now();
    loop {
        let found: Result<Vec<LookupVerdict>, _> =
            keys.iter().map(|k| manager.lookup(k, &ctx)).collect();
        let found = match found {
            Ok(found) => found,
            Err(err) => panic!("{req}: lookup failed: {err}"),
        };
        if found.iter().all(|&v| v != LookupVerdict::Pending) {
            manager.cleanup(req);
            return found;
        }
        assert!(
            start.elapsed() < within,
            "{req}: no verdict within {within:?}: the deadline did not hold"
        );
        manager.flush();
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The block the suite stores under `key`: derived from the key, so a load
/// that returns another key's block is caught.
pub fn block_for(key: &OffloadKey) -> Vec<u8> {
    let mut block = b"kvtier-conformance:".to_vec();
    block.extend_from_slice(key.as_bytes());
    block
}

/// The threads of this process named `name`, as Linux shows them (a
/// thread's first 15 bytes, from `/proc/self/task/*/comm`); 0 where `/proc`
/// cannot be read. Tests of which runtime a worker runs on count them.
pub fn threads_named(name: &str) -> usize {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .filter_map(Result::ok)
        .filter(|task| {
            std::fs::read_to_string(task.path().join("comm"))
                .is_ok_and(|comm| comm.trim_end() == name)
        })
        .count()
}

static NEXT_KEY: AtomicU64 = AtomicU64::new(0);

/// `n` keys of `len` bytes (at least 16), never produced before by this
/// process or, with overwhelming likelihood, by another run.
pub fn unique_keys(n: usize, len: usize) -> Vec<OffloadKey> {
    let run = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
        ^ (u64::from(std::process::id()) << 32);
    let first = NEXT_KEY.fetch_add(n as u64, Ordering::Relaxed);
    (0..n as u64)
        .map(|i| {
            let mut bytes = vec![0u8; len.max(16)];
            bytes[..8].copy_from_slice(&run.to_be_bytes());
            bytes[8..16].copy_from_slice(&(first + i).to_be_bytes());
            OffloadKey::new(&bytes)
        })
        .collect()
}

fn ctx(name: &str) -> ReqContext {
    ReqContext::new(format!("conformance-{name}"))
}

async fn ask<S: BlockStore>(fixture: &Fixture<S>, keys: &[OffloadKey], what: &str) -> Vec<bool> {
    let tier = fixture.tier();
    match tier.batch_lookup(keys, &ctx(what)).await {
        Ok(found) => {
            assert_eq!(
                found.len(),
                keys.len(),
                "{}: {what}: batch_lookup must answer one bool per key",
                fixture.name()
            );
            found
        }
        Err(err) => panic!("{}: {what}: batch_lookup failed: {err}", fixture.name()),
    }
}

async fn insert<S: BlockStore>(fixture: &Fixture<S>, keys: &[OffloadKey]) {
    if let Err(err) = fixture.insert(keys).await {
        panic!(
            "{}: inserting {} keys failed: {err}",
            fixture.name(),
            keys.len()
        );
    }
}

/// An empty batch answers an empty vector.
pub async fn empty_batch<S: BlockStore>(fixture: &Fixture<S>) {
    assert!(ask(fixture, &[], "empty batch").await.is_empty());
}

/// Keys never stored answer `false` (not an error).
pub async fn absent_keys_are_misses<S: BlockStore>(fixture: &Fixture<S>) {
    let keys = unique_keys(16, fixture.key_len());
    let found = ask(fixture, &keys, "absent keys").await;
    assert!(
        found.iter().all(|&f| !f),
        "{}: keys never stored must answer false",
        fixture.name()
    );
}

/// Answers follow the order of the keys, present and absent interleaved.
pub async fn answers_follow_key_order<S: BlockStore>(fixture: &Fixture<S>) {
    let keys = unique_keys(32, fixture.key_len());
    let present: Vec<OffloadKey> = keys.iter().step_by(3).cloned().collect();
    insert(fixture, &present).await;
    let found = ask(fixture, &keys, "key order").await;
    let expected: Vec<bool> = (0..keys.len()).map(|i| i % 3 == 0).collect();
    assert_eq!(
        found,
        expected,
        "{}: answers must follow key order",
        fixture.name()
    );
}

/// A key repeated in one batch is answered at every position.
pub async fn duplicates_are_answered_each_time<S: BlockStore>(fixture: &Fixture<S>) {
    let keys = unique_keys(2, fixture.key_len());
    insert(fixture, &keys[..1]).await;
    let batch = [
        keys[0].clone(),
        keys[1].clone(),
        keys[0].clone(),
        keys[1].clone(),
    ];
    let found = ask(fixture, &batch, "duplicates").await;
    assert_eq!(
        found,
        [true, false, true, false],
        "{}: duplicates",
        fixture.name()
    );
}

/// A removed key answers `false` again.
pub async fn removed_keys_are_misses<S: BlockStore>(fixture: &Fixture<S>) {
    let keys = unique_keys(4, fixture.key_len());
    insert(fixture, &keys).await;
    assert!(
        ask(fixture, &keys, "before removal")
            .await
            .iter()
            .all(|&f| f)
    );
    if let Err(err) = fixture.remove(&keys[..2]).await {
        panic!("{}: removing keys failed: {err}", fixture.name());
    }
    let found = ask(fixture, &keys, "after removal").await;
    assert_eq!(
        found,
        [false, false, true, true],
        "{}: removal",
        fixture.name()
    );
}

/// A batch of `n` keys, one in three present, is answered exactly.
pub async fn large_batch<S: BlockStore>(fixture: &Fixture<S>, n: usize) {
    let keys = unique_keys(n, fixture.key_len());
    let present: Vec<OffloadKey> = keys.iter().step_by(3).cloned().collect();
    insert(fixture, &present).await;
    let found = ask(fixture, &keys, "large batch").await;
    let wrong = found
        .iter()
        .enumerate()
        .filter(|&(i, &f)| f != (i % 3 == 0))
        .count();
    assert_eq!(
        wrong,
        0,
        "{}: {wrong} wrong answers in a batch of {n}",
        fixture.name()
    );
}

/// Several batches at once are each answered exactly.
pub async fn concurrent_batches<S: BlockStore>(fixture: &Fixture<S>) {
    let keys = unique_keys(8 * 16, fixture.key_len());
    let present: Vec<OffloadKey> = keys.iter().step_by(2).cloned().collect();
    insert(fixture, &present).await;
    let tier = fixture.tier();
    let mut calls = Vec::new();
    for (i, chunk) in keys.chunks(16).enumerate() {
        let tier = Arc::clone(&tier);
        let chunk = chunk.to_vec();
        let ctx = ctx(&format!("concurrent-{i}"));
        calls.push(async move { tier.batch_lookup(&chunk, &ctx).await });
    }
    // Run them together on the caller's runtime.
    let results = join_all(calls).await;
    for (i, result) in results.into_iter().enumerate() {
        let found = match result {
            Ok(found) => found,
            Err(err) => panic!("{}: concurrent batch {i} failed: {err}", fixture.name()),
        };
        let expected: Vec<bool> = (0..16).map(|j| (i * 16 + j) % 2 == 0).collect();
        assert_eq!(found, expected, "{}: concurrent batch {i}", fixture.name());
    }
}

async fn join_all<Fut: Future>(futures: Vec<Fut>) -> Vec<Fut::Output> {
    let mut futures: Vec<_> = futures.into_iter().map(Box::pin).collect();
    let mut outputs: Vec<Option<Fut::Output>> = futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut all_done = true;
        for (fut, out) in futures.iter_mut().zip(outputs.iter_mut()) {
            if out.is_none() {
                match fut.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => *out = Some(v),
                    std::task::Poll::Pending => all_done = false,
                }
            }
        }
        if all_done {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await;
    outputs.into_iter().flatten().collect()
}

/// The tier behind a real [`AsyncLookupManager`]: prompts sharing a prefix,
/// resolved through `lookup_prefix` and `flush`, match the truth, and the
/// manager is idle once every request is cleaned up.
pub async fn through_manager<S: BlockStore>(fixture: &Fixture<S>) {
    let len = fixture.key_len();
    let shared = unique_keys(8, len);
    insert(fixture, &shared[..6]).await;
    let mut prompts = Vec::new();
    for i in 0..4 {
        let mut prompt = shared.clone();
        let own = unique_keys(4, len);
        if i % 2 == 0 {
            insert(fixture, &own).await;
        }
        prompt.splice(6..6, own);
        prompts.push(prompt);
    }
    // shared[0..6] present, then 4 own keys (present for even requests), then
    // shared[6..8] absent: even requests see 10 hits, odd ones 6.
    let mut config = ManagerConfig::named("conformance");
    config.max_key_len = len.max(1);
    config.call_timeout_ms = 10_000;
    let mut manager = match fixture.store.manager(config) {
        Ok(m) => m,
        Err(err) => panic!("{}: starting a manager failed: {err}", fixture.name()),
    };
    let contexts: Vec<ReqContext> = (0..prompts.len())
        .map(|i| ctx(&format!("req-{i}")))
        .collect();
    let mut answers = vec![None; prompts.len()];
    let started = Instant::now();
    while answers.iter().any(Option::is_none) {
        for (i, prompt) in prompts.iter().enumerate() {
            if answers[i].is_some() {
                continue;
            }
            match manager.lookup_prefix(prompt, &contexts[i]) {
                Ok(PrefixVerdict::Ready(n)) => answers[i] = Some(n),
                Ok(PrefixVerdict::Pending) => {}
                Err(err) => panic!("{}: lookup_prefix failed: {err}", fixture.name()),
            }
        }
        manager.flush();
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{}: manager did not resolve prompts within 30 s",
            fixture.name()
        );
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let answers: Vec<usize> = answers.into_iter().flatten().collect();
    assert_eq!(
        answers,
        [10, 6, 10, 6],
        "{}: prefix answers",
        fixture.name()
    );
    let stats = manager.stats();
    assert_eq!(
        stats.errors + stats.timeouts,
        0,
        "{}: {stats:?}",
        fixture.name()
    );
    for c in &contexts {
        manager.cleanup(c.req_id());
    }
    manager.drain_results();
    assert!(
        manager.is_idle(),
        "{}: state left after cleanup",
        fixture.name()
    );
    let report = manager.shutdown();
    assert!(
        report.worker_stopped,
        "{}: worker did not stop",
        fixture.name()
    );
}

/// What was stored is what loads: each key's own block, `None` for a key
/// never stored; a second store replaces the block.
pub async fn stored_blocks_load_back<S: BlockStore>(fixture: &Fixture<S>) {
    let name = fixture.name();
    let keys = unique_keys(3, fixture.key_len());
    insert(fixture, &keys[..2]).await;
    for (i, key) in keys.iter().enumerate() {
        let loaded = match fixture.store.load(key).await {
            Ok(loaded) => loaded,
            Err(err) => panic!("{name}: load of key {i} failed: {err}"),
        };
        let expected = (i < 2).then(|| block_for(key));
        assert_eq!(loaded, expected, "{name}: load of key {i}");
    }
    let replacement = b"a replacement block".to_vec();
    if let Err(err) = fixture.store.store(&keys[0], &replacement).await {
        panic!("{name}: storing over a key failed: {err}");
    }
    match fixture.store.load(&keys[0]).await {
        Ok(loaded) => assert_eq!(
            loaded.as_deref(),
            Some(&replacement[..]),
            "{name}: a second store must replace the block"
        ),
        Err(err) => panic!("{name}: load after replace failed: {err}"),
    }
}

/// `load_many` answers per position, absent keys as `None`.
pub async fn load_many_follows_key_order<S: BlockStore>(fixture: &Fixture<S>) {
    let name = fixture.name();
    let keys = unique_keys(12, fixture.key_len());
    let present: Vec<OffloadKey> = keys.iter().step_by(3).cloned().collect();
    insert(fixture, &present).await;
    let loaded = match fixture.store.load_many(&keys).await {
        Ok(loaded) => loaded,
        Err(err) => panic!("{name}: load_many failed: {err}"),
    };
    let expected: Vec<Option<Vec<u8>>> = keys
        .iter()
        .enumerate()
        .map(|(i, k)| (i % 3 == 0).then(|| block_for(k)))
        .collect();
    assert_eq!(loaded, expected, "{name}: load_many");
}

/// Removing an absent key succeeds, and a removed key loads as `None`.
pub async fn removal_is_idempotent<S: BlockStore>(fixture: &Fixture<S>) {
    let name = fixture.name();
    let keys = unique_keys(2, fixture.key_len());
    if let Err(err) = fixture.store.remove(&keys[0]).await {
        panic!("{name}: removing an absent key must succeed: {err}");
    }
    insert(fixture, &keys).await;
    for _ in 0..2 {
        if let Err(err) = fixture.store.remove(&keys[1]).await {
            panic!("{name}: remove failed: {err}");
        }
    }
    match fixture.store.load_many(&keys).await {
        Ok(loaded) => assert_eq!(
            loaded,
            [Some(block_for(&keys[0])), None],
            "{name}: a removed key must load as None"
        ),
        Err(err) => panic!("{name}: load_many after remove failed: {err}"),
    }
}

/// Every check above, in turn.
pub async fn run_all<S: BlockStore>(fixture: &Fixture<S>) {
    empty_batch(fixture).await;
    absent_keys_are_misses(fixture).await;
    answers_follow_key_order(fixture).await;
    duplicates_are_answered_each_time(fixture).await;
    removed_keys_are_misses(fixture).await;
    large_batch(fixture, 2_000).await;
    concurrent_batches(fixture).await;
    stored_blocks_load_back(fixture).await;
    load_many_follows_key_order(fixture).await;
    removal_is_idempotent(fixture).await;
    batch_forms(fixture).await;
    through_manager(fixture).await;
}
