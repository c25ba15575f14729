//! [`MemStore`]: an in-memory [`BlockStore`] whose batch copies can be
//! slowed down, cut into steps, failed per key or as a whole, hung or made
//! to panic, as async or blocking I/O: for tests of the transfer queue.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{PoisonError, RwLock};
use std::time::Duration;

use crate::{BlockOutcome, BlockStore, OffloadKey, ReqContext, Tier, TierError, TierErrorKind};

/// An in-memory block store for tests of code that moves blocks.
///
/// Its batch forms copy each block in [`with_steps`](Self::with_steps)
/// pieces with a pause between them, so a copy cut in half (a future
/// dropped mid-way) leaves a region partly written, which a test can see.
/// Keys can fail ([`fail_key`](Self::fail_key)), hang
/// ([`hang_key`](Self::hang_key)) or panic ([`panic_key`](Self::panic_key));
/// [`set_down`](Self::set_down) fails every batch as a whole. A
/// [`blocking`](Self::blocking) store pauses with `thread::sleep` and says
/// its I/O blocks the thread, as a local disk does.
#[derive(Debug, Default)]
pub struct MemStore {
    blocks: RwLock<HashMap<OffloadKey, Vec<u8>>>,
    failing: RwLock<HashSet<OffloadKey>>,
    hanging: RwLock<HashSet<OffloadKey>>,
    panicking: RwLock<HashSet<OffloadKey>>,
    down: AtomicBool,
    blocking: bool,
    steps: usize,
    step_pause: Duration,
    /// How long a hung key's copy lasts in a blocking store (an async one
    /// hangs forever).
    blocking_hang: Duration,
    copies_running: AtomicUsize,
    max_copies_running: AtomicUsize,
    batches: AtomicU64,
    keys_copied: AtomicU64,
}

/// Counts a copy running for as long as it lives.
struct Running<'a>(&'a MemStore);

impl<'a> Running<'a> {
    fn new(store: &'a MemStore) -> Self {
        let now = store.copies_running.fetch_add(1, Ordering::SeqCst) + 1;
        store.max_copies_running.fetch_max(now, Ordering::SeqCst);
        Self(store)
    }
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.copies_running.fetch_sub(1, Ordering::SeqCst);
    }
}

impl MemStore {
    /// An empty store with async I/O, copies in one step, no pause.
    pub fn new() -> Self {
        Self {
            steps: 1,
            blocking_hang: Duration::from_secs(3600),
            ..Self::default()
        }
    }

    /// Makes its I/O block the thread (`thread::sleep` pauses;
    /// [`BlockStore::io_blocks_thread`] answers `true`).
    #[must_use]
    pub fn blocking(mut self) -> Self {
        self.blocking = true;
        self
    }

    /// Copies each block in `steps` pieces, pausing `pause` before each.
    #[must_use]
    pub fn with_steps(mut self, steps: usize, pause: Duration) -> Self {
        self.steps = steps.max(1);
        self.step_pause = pause;
        self
    }

    /// How long a hung key's copy lasts in a blocking store. Default 1 h.
    #[must_use]
    pub fn with_blocking_hang(mut self, hang: Duration) -> Self {
        self.blocking_hang = hang;
        self
    }

    /// Makes every later store or load of `key` fail (`Unavailable`).
    pub fn fail_key(&self, key: &OffloadKey) {
        write(&self.failing).insert(key.clone());
    }

    /// Makes every later copy of `key` hang (see
    /// [`with_blocking_hang`](Self::with_blocking_hang)).
    pub fn hang_key(&self, key: &OffloadKey) {
        write(&self.hanging).insert(key.clone());
    }

    /// Makes every later copy of `key` panic.
    pub fn panic_key(&self, key: &OffloadKey) {
        write(&self.panicking).insert(key.clone());
    }

    /// Fails every later batch as a whole (a server down), or stops doing so.
    pub fn set_down(&self, down: bool) {
        self.down.store(down, Ordering::SeqCst);
    }

    /// Removes `key` behind the caller's back.
    pub fn forget(&self, key: &OffloadKey) {
        write(&self.blocks).remove(key);
    }

    /// The block stored under `key`.
    pub fn block(&self, key: &OffloadKey) -> Option<Vec<u8>> {
        read(&self.blocks).get(key).cloned()
    }

    /// Block copies running now.
    pub fn copies_running(&self) -> usize {
        self.copies_running.load(Ordering::SeqCst)
    }

    /// Most block copies ever running at once.
    pub fn max_copies_running(&self) -> usize {
        self.max_copies_running.load(Ordering::SeqCst)
    }

    /// Batch calls started.
    pub fn batches(&self) -> u64 {
        self.batches.load(Ordering::SeqCst)
    }

    /// Block copies finished.
    pub fn keys_copied(&self) -> u64 {
        self.keys_copied.load(Ordering::SeqCst)
    }

    async fn pause(&self, len: Duration) {
        if len.is_zero() {
            return;
        }
        if self.blocking {
            std::thread::sleep(len);
        } else {
            tokio::time::sleep(len).await;
        }
    }

    /// Applies the key's injected fault, if any, before its copy.
    async fn fault(&self, key: &OffloadKey) -> Result<(), TierError> {
        if read(&self.panicking).contains(key) {
            panic!("MemStore: injected panic");
        }
        if read(&self.hanging).contains(key) {
            if self.blocking {
                std::thread::sleep(self.blocking_hang);
            } else {
                std::future::pending::<()>().await;
            }
        }
        if read(&self.failing).contains(key) {
            return Err(TierError::new(
                TierErrorKind::Unavailable,
                "MemStore: injected failure",
            ));
        }
        Ok(())
    }

    fn down_error(&self) -> Option<TierError> {
        self.down
            .load(Ordering::SeqCst)
            .then(|| TierError::new(TierErrorKind::Unavailable, "MemStore: down"))
    }

    fn pieces(&self, len: usize) -> impl Iterator<Item = std::ops::Range<usize>> + use<> {
        let step = len.div_ceil(self.steps).max(1);
        (0..len)
            .step_by(step)
            .map(move |at| at..(at + step).min(len))
    }
}

fn read<T>(lock: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    lock.read().unwrap_or_else(PoisonError::into_inner)
}

fn write<T>(lock: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    lock.write().unwrap_or_else(PoisonError::into_inner)
}

impl Tier for MemStore {
    async fn batch_lookup(
        &self,
        keys: &[OffloadKey],
        _ctx: &ReqContext,
    ) -> Result<Vec<bool>, TierError> {
        let blocks = read(&self.blocks);
        Ok(keys.iter().map(|k| blocks.contains_key(k)).collect())
    }
}

impl BlockStore for MemStore {
    async fn store(&self, key: &OffloadKey, block: &[u8]) -> Result<(), TierError> {
        match self.store_batch(&[(key, block)]).await.pop() {
            Some(BlockOutcome::Failed(err)) => Err(TierError::new(err.kind(), err.to_string())),
            _ => Ok(()),
        }
    }

    async fn load(&self, key: &OffloadKey) -> Result<Option<Vec<u8>>, TierError> {
        if let Some(err) = self.down_error() {
            return Err(err);
        }
        self.fault(key).await?;
        Ok(self.block(key))
    }

    async fn remove(&self, key: &OffloadKey) -> Result<(), TierError> {
        self.forget(key);
        Ok(())
    }

    async fn store_batch(&self, blocks: &[(&OffloadKey, &[u8])]) -> Vec<BlockOutcome> {
        self.batches.fetch_add(1, Ordering::SeqCst);
        if let Some(err) = self.down_error() {
            return BlockOutcome::all_failed(blocks.len(), err);
        }
        let mut outcomes = Vec::with_capacity(blocks.len());
        for &(key, block) in blocks {
            if let Err(err) = self.fault(key).await {
                outcomes.push(BlockOutcome::failed(err));
                continue;
            }
            let _running = Running::new(self);
            let mut copy = Vec::with_capacity(block.len());
            for piece in self.pieces(block.len()) {
                self.pause(self.step_pause).await;
                copy.extend_from_slice(&block[piece]);
            }
            if block.is_empty() {
                self.pause(self.step_pause).await;
            }
            write(&self.blocks).insert(key.clone(), copy);
            self.keys_copied.fetch_add(1, Ordering::SeqCst);
            outcomes.push(BlockOutcome::Done);
        }
        outcomes
    }

    async fn load_batch(&self, regions: &mut [(&OffloadKey, &mut [u8])]) -> Vec<BlockOutcome> {
        self.batches.fetch_add(1, Ordering::SeqCst);
        if let Some(err) = self.down_error() {
            return BlockOutcome::all_failed(regions.len(), err);
        }
        let mut outcomes = Vec::with_capacity(regions.len());
        for (key, region) in regions.iter_mut() {
            if let Err(err) = self.fault(key).await {
                outcomes.push(BlockOutcome::failed(err));
                continue;
            }
            let Some(block) = self.block(key) else {
                outcomes.push(BlockOutcome::Absent);
                continue;
            };
            if block.len() != region.len() {
                outcomes.push(BlockOutcome::failed(crate::LengthMismatch::error(
                    block.len(),
                    region.len(),
                )));
                continue;
            }
            let _running = Running::new(self);
            for piece in self.pieces(block.len()) {
                self.pause(self.step_pause).await;
                region[piece.clone()].copy_from_slice(&block[piece]);
            }
            self.keys_copied.fetch_add(1, Ordering::SeqCst);
            outcomes.push(BlockOutcome::Done);
        }
        outcomes
    }

    fn io_blocks_thread(&self) -> bool {
        self.blocking
    }
}
