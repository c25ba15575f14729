//! A local-disk kvtier tier: a memory-mapped index over append-only segment
//! files. It survives restarts and never reports a phantom hit.
//!
//! - **Lookups read only the index.** It is a memory-mapped hash table of
//!   fixed-size slots, each holding the full key, the payload's location and
//!   checksum, and a checksum of the slot itself. Keys are compared in
//!   full, so a lookup never says "present" for a key that was not stored.
//! - **Payloads go to append-only segments.** Each record describes itself
//!   (key, length, checksums), so a lost or corrupt index is rebuilt from
//!   the segments. Each payload starts at a multiple of 64 bytes in its
//!   segment, so copies between the page cache and a caller's rows run
//!   aligned (the format is versioned: this build reads and upgrades the
//!   directories of earlier builds, `tests/format_v1.rs`).
//! - **Bounded.** Past `capacity_bytes`, whole oldest segments are evicted
//!   (FIFO by write time). Their slots stop counting at once and are then
//!   cleared. The index rehashes into a new file (atomic rename) past a 70 %
//!   load factor.
//! - **Lookups never wait for a rehash or an eviction.** One writer lock
//!   orders every change; a rehash builds the grown index, and an eviction
//!   finds its segment's slots, under the index's read lock while lookups
//!   and loads go on, and only the swap (or each chunk of 4,096 slot
//!   clears) takes the write lock, for a moment.
//! - **One interface.** [`BlockStore`] stores, loads and removes (batched
//!   forms take the locks once and fsync once per batch); the same
//!   operations run synchronously as `store_blocking`, `load_blocking`,
//!   `remove_blocking` and their `_many_` forms, for threads outside any
//!   runtime. Tenants each get their own tier and directory.
//! - **Crash consistency.** A key is published in the index only after its
//!   payload is written (and fsynced under [`FsyncPolicy::Always`]). A torn
//!   slot fails its checksum and reads as absent. A torn record at the end
//!   of a segment is ignored by a rebuild. A load checks the record. On a
//!   failure (a damaged record, one past the end of its file, a missing
//!   segment file) the key turns into a miss, its entry is removed, and the
//!   failure is counted.
//! - **Damage never serves older bytes.** A rebuild leaves a key whose
//!   newest record is damaged absent, and drops every key it cannot order
//!   against an unreadable record or a missing segment (logged and counted
//!   in [`DiskStats`]).
//! - **A full disk is an error.** The index's blocks are reserved before
//!   they are mapped, so a full filesystem is [`DiskError::DiskFull`], not a
//!   SIGBUS; a store that fails publishes nothing.
//! - **Reopen.** After a clean [`close`](DiskTier::close), reopening reads
//!   the header and lists the segment files; no key is visited. After an
//!   unclean shutdown, open recounts the live slots in one pass over the
//!   index, reading no payload.
//! - **One writer.** A lock file keeps a second process (or a second
//!   `DiskTier` in this one) from opening the same directory. No other
//!   program may write into the directory. A process forked from the one
//!   that opened the tier may look up and load, but its stores, removals
//!   and `close` fail with [`DiskError::Forked`]: the files are the
//!   parent's, and an append of the child's would be overwritten by the
//!   parent's next one.
//!
//! ```
//! use kvtier_core::{OffloadKey, ReqContext, Tier};
//! use kvtier_disk::{DiskConfig, DiskTier};
//!
//! let dir = tempfile::tempdir()?;
//! let tier = DiskTier::open(DiskConfig::new(dir.path()))?;
//! let key = OffloadKey::from_block_hash(&[1; 32], 0);
//! tier.store_blocking(&key, b"kv block bytes")?;
//! assert_eq!(tier.load_blocking(&key)?.as_deref(), Some(&b"kv block bytes"[..]));
//! assert_eq!(tier.contains_many(&[key.clone(), OffloadKey::from_block_hash(&[2; 32], 0)])?, [true, false]);
//! tier.close()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![deny(missing_docs)]
#![warn(clippy::unwrap_used)]

mod append;
mod config;
mod copycrc;
mod error;
mod evict;
mod format;
mod index;
#[cfg(test)]
mod pause;
mod read;
mod rebuild;
mod vectored;
mod write;

use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use kvtier_core::{
    BlockOutcome, BlockStore, ManagerConfig, OffloadKey, ReqContext, Tier, TierError,
};
use serde::Serialize;

pub use config::{DiskConfig, FsyncPolicy};
pub use error::{DiskError, FormatError};
pub use format::MAX_KEY_LEN;

use index::{Index, LiveSegments, OpenFailure, sync_dir};
use rebuild::{RebuildReport, rebuild};

const INDEX_FILE: &str = "index.kvx";
const INDEX_TMP: &str = "index.kvx.tmp";
const LOCK_FILE: &str = "LOCK";
/// The largest segment id opened or created. Ids start at 1 and grow by one
/// per segment, so only a crafted or foreign file comes near it.
const MAX_SEGMENT_ID: u64 = 1 << 62;

fn segment_name(id: u64) -> String {
    format!("seg-{id:016x}.kvs")
}

fn parse_segment_name(name: &str) -> Option<u64> {
    let hex = name.strip_prefix("seg-")?.strip_suffix(".kvs")?;
    if hex.len() != 16 {
        return None;
    }
    u64::from_str_radix(hex, 16).ok()
}

/// Counters of a [`DiskTier`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct DiskStats {
    /// Live keys.
    pub keys: u64,
    /// Bytes of segment files.
    pub bytes_used: u64,
    /// Segment files.
    pub segments: u64,
    /// Index slots.
    pub index_slots: u64,
    /// Stores acknowledged.
    pub stores: u64,
    /// Loads that found their key.
    pub loads: u64,
    /// Loads whose record failed a check (checksum, length, key), was
    /// missing or could not be read: the entry is removed (a miss from then on).
    pub corrupt_loads: u64,
    /// Segments evicted for capacity.
    pub evicted_segments: u64,
    /// Keys dropped with evicted segments.
    pub evicted_keys: u64,
    /// Index rehashes.
    pub rehashes: u64,
    /// Whether this open rebuilt the index from the segments.
    pub rebuilt_index: bool,
    /// Whether this open found the index closed uncleanly and recounted it.
    pub recounted_index: bool,
    /// Damage the rebuild at this open found: records whose payload fails
    /// its checksum (their key is left absent), unreadable record headers
    /// (the rest of that segment is discarded) and segments missing from
    /// the middle of the sequence. 0 when the index was not rebuilt.
    pub rebuild_damaged: u64,
    /// Keys the rebuild at this open dropped because a damaged or missing
    /// region after their record might have replaced or removed them.
    pub rebuild_dropped_keys: u64,
    /// Keys dropped at this open because their segment file is missing from
    /// the middle of the sequence.
    pub missing_segment_keys: u64,
}

#[derive(Debug, Default)]
struct Counters {
    stores: AtomicU64,
    loads: AtomicU64,
    corrupt_loads: AtomicU64,
    evicted_segments: AtomicU64,
    evicted_keys: AtomicU64,
    rehashes: AtomicU64,
}

/// The segment being appended to, and the sizes of all segments.
#[derive(Debug)]
struct Writer {
    active_id: u64,
    active: File,
    active_len: u64,
    /// Segment id → bytes, oldest first; includes the active one.
    segments: BTreeMap<u64, u64>,
    total_bytes: u64,
}

/// A local-disk tier; see the crate documentation.
#[derive(Debug)]
pub struct DiskTier {
    config: DiskConfig,
    dir: PathBuf,
    /// Read by lookups and loads. Its write lock is taken only by a holder
    /// of `writer`, and only for moments (a slot write, a chunk of an
    /// eviction's clearing, the swap after a rehash): a writer builds a
    /// grown index or finds an evicted segment's slots under the read lock,
    /// so lookups never wait behind that work.
    index: RwLock<Index>,
    /// Serialises every change to the segments and the index.
    writer: Mutex<Writer>,
    /// Live segment ids, readable without the writer lock.
    oldest: AtomicU64,
    newest: AtomicU64,
    readers: Mutex<HashMap<u64, Arc<File>>>,
    counters: Counters,
    rebuilt_index: bool,
    recounted_index: bool,
    rebuild: RebuildReport,
    #[cfg(test)]
    pause: pause::PauseHook,
    missing_segment_keys: u64,
    /// Last, so it is released after everything else has closed.
    dir_lock: DirLock,
}

/// The directory's writer lock. Dropping it unlocks explicitly: closing the
/// descriptor alone would leave the lock held by any copy of it, which a
/// process forked meanwhile (Python's multiprocessing, or a `Command`
/// between its fork and its exec) keeps, and the next open would be
/// refused with [`DiskError::Locked`].
///
/// The lock belongs to the process that took it: `flock(LOCK_UN)` acts on
/// the open file description that a forked child shares, so a child that
/// drops its copy of the tier must not unlock (nor close) the parent's.
#[derive(Debug)]
struct DirLock {
    file: File,
    owner: u32,
}

impl DirLock {
    fn new(file: File) -> Self {
        Self {
            file,
            owner: std::process::id(),
        }
    }

    /// Whether this process took the lock (not a child forked since).
    fn held_here(&self) -> bool {
        std::process::id() == self.owner
    }

    /// `Ok` in the process that took the lock, [`DiskError::Forked`] in a
    /// child forked since: every change to the files checks this first.
    fn check_owner(&self) -> Result<(), DiskError> {
        let pid = std::process::id();
        if pid == self.owner {
            Ok(())
        } else {
            Err(DiskError::Forked {
                owner: self.owner,
                pid,
            })
        }
    }
}

impl Drop for DirLock {
    fn drop(&mut self) {
        if self.held_here() {
            // flock(LOCK_UN) acts on the shared open file description, so
            // it frees the lock whatever copies of the descriptor live on.
            let _ = self.file.unlock();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl DiskTier {
    /// Opens (or creates) the tier in `config.path`.
    ///
    /// # Errors
    /// [`DiskError::InvalidConfig`], [`DiskError::Locked`] when another
    /// writer has the directory, [`DiskError::IndexVersion`] /
    /// [`DiskError::KeyLenMismatch`] for an index this configuration cannot
    /// use, [`DiskError::CorruptIndex`] for a corrupt index when rebuilding
    /// is off, and [`DiskError::Io`] / [`DiskError::DiskFull`] naming the
    /// file and operation.
    pub fn open(config: DiskConfig) -> Result<Self, DiskError> {
        config.validate()?;
        let dir = config.path.clone();
        std::fs::create_dir_all(&dir).map_err(|e| DiskError::io("create directory", &dir, e))?;
        let lock_path = dir.join(LOCK_FILE);
        let lock_file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&lock_path)
            .map_err(|e| DiskError::io("open lock file", &lock_path, e))?;
        match lock_file.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(DiskError::Locked { path: lock_path });
            }
            Err(std::fs::TryLockError::Error(e)) => {
                return Err(DiskError::io("lock", &lock_path, e));
            }
        }
        // From here on, every return (an error included) unlocks.
        let lock = DirLock::new(lock_file);

        let mut segments = list_segments(&dir)?;
        if let Some((&id, _)) = segments.range(MAX_SEGMENT_ID + 1..).next() {
            return Err(DiskError::SegmentIdOutOfRange {
                path: dir.join(segment_name(id)),
                id,
                max: MAX_SEGMENT_ID,
            });
        }
        let index_path = dir.join(INDEX_FILE);
        let _ = std::fs::remove_file(dir.join(INDEX_TMP));
        let next_id = segments.keys().next_back().map_or(1, |id| id + 1);
        let live = LiveSegments {
            oldest: segments.keys().next().copied().unwrap_or(next_id),
            newest: next_id,
        };

        let (mut index, rebuilt, recounted) = match Index::open(&index_path, config.key_len) {
            Ok(mut index) => {
                let recount = !index.was_clean();
                if recount {
                    tracing::warn!(path = %index_path.display(), "index was not closed cleanly; recounting its slots");
                    index.recount(live);
                }
                (index, None, recount)
            }
            Err(OpenFailure::Fatal(DiskError::Io { source, .. }))
                if source.kind() == std::io::ErrorKind::NotFound =>
            {
                if segments.is_empty() {
                    (
                        Index::create(&index_path, config.key_len, config.initial_slots)?,
                        None,
                        false,
                    )
                } else if config.rebuild_corrupt_index {
                    tracing::warn!(path = %index_path.display(), "index missing; rebuilding it from the segments");
                    let (index, report) = rebuild(&dir, &config, &segments, live)?;
                    (index, Some(report), false)
                } else {
                    return Err(DiskError::CorruptIndex {
                        path: index_path,
                        reason: FormatError::Truncated {
                            need: format::HEADER_SIZE,
                            got: 0,
                        },
                    });
                }
            }
            Err(OpenFailure::Fatal(err)) => return Err(err),
            Err(OpenFailure::Corrupt(reason)) => {
                if !config.rebuild_corrupt_index {
                    return Err(DiskError::CorruptIndex {
                        path: index_path,
                        reason,
                    });
                }
                tracing::warn!(path = %index_path.display(), %reason, "index corrupt; rebuilding it from the segments");
                let (index, report) = rebuild(&dir, &config, &segments, live)?;
                (index, Some(report), false)
            }
        };

        // A segment missing from the middle (deleted by someone): its keys
        // would be hits whose loads fail. Drop them now, in one pass.
        let mut missing_segment_keys = 0;
        if (segments.len() as u64) < next_id - live.oldest {
            missing_segment_keys = index.clear_where(|seg| {
                seg >= live.oldest && seg < next_id && !segments.contains_key(&seg)
            });
            tracing::warn!(
                path = %dir.display(),
                keys = missing_segment_keys,
                "segment files missing from the middle of the sequence; their keys are dropped"
            );
        }

        // Always append to a fresh segment: the tail of the last one may be torn.
        let (active, active_path) = create_segment(&dir, next_id)?;
        segments.insert(next_id, 0);
        sync_dir(&dir)?;
        index.set_clean(false)?;
        let total_bytes = segments.values().sum();
        let tier = Self {
            dir,
            dir_lock: lock,
            index: RwLock::new(index),
            writer: Mutex::new(Writer {
                active_id: next_id,
                active,
                active_len: 0,
                segments,
                total_bytes,
            }),
            oldest: AtomicU64::new(live.oldest),
            newest: AtomicU64::new(next_id),
            readers: Mutex::new(HashMap::new()),
            counters: Counters::default(),
            rebuilt_index: rebuilt.is_some(),
            recounted_index: recounted,
            rebuild: rebuilt.unwrap_or_default(),
            missing_segment_keys,
            #[cfg(test)]
            pause: pause::PauseHook::default(),
            config,
        };
        tracing::debug!(path = %active_path.display(), keys = tier.len(), "disk tier open");
        Ok(tier)
    }

    /// The configuration it was opened with.
    pub fn config(&self) -> &DiskConfig {
        &self.config
    }

    fn live(&self) -> LiveSegments {
        LiveSegments {
            oldest: self.oldest.load(Ordering::Acquire),
            newest: self.newest.load(Ordering::Acquire),
        }
    }

    fn read_index(&self) -> RwLockReadGuard<'_, Index> {
        self.index.read().unwrap_or_else(PoisonError::into_inner)
    }

    fn write_index(&self) -> RwLockWriteGuard<'_, Index> {
        self.index.write().unwrap_or_else(PoisonError::into_inner)
    }

    fn check_key(&self, key: &OffloadKey) -> Result<(), DiskError> {
        if key.len() != self.config.key_len {
            return Err(DiskError::WrongKeySize {
                expected: self.config.key_len,
                got: key.len(),
            });
        }
        Ok(())
    }

    /// Whether each key is stored, from the index alone.
    ///
    /// # Errors
    /// [`DiskError::WrongKeySize`] if any key has the wrong length (nothing is answered then).
    pub fn contains_many(&self, keys: &[OffloadKey]) -> Result<Vec<bool>, DiskError> {
        for key in keys {
            self.check_key(key)?;
        }
        let live = self.live();
        Ok(self
            .read_index()
            .contains_many(keys, OffloadKey::as_bytes, live))
    }

    /// Live keys.
    pub fn len(&self) -> u64 {
        self.read_index().len()
    }

    /// Whether no key is stored.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of segment files (the quantity `capacity_bytes` bounds).
    pub fn bytes_used(&self) -> u64 {
        lock(&self.writer).total_bytes
    }

    /// Makes everything stored so far durable: the active segment and the index.
    ///
    /// # Errors
    /// [`DiskError::Io`] naming the file.
    pub fn sync(&self) -> Result<(), DiskError> {
        self.sync_locked(&lock(&self.writer))
    }

    fn sync_locked(&self, writer: &Writer) -> Result<(), DiskError> {
        let path = self.dir.join(segment_name(writer.active_id));
        writer
            .active
            .sync_all()
            .map_err(|e| DiskError::io("sync segment", &path, e))?;
        self.read_index().flush()
    }

    /// Syncs everything and marks the index clean, so the next open does not
    /// recount it. Dropping the tier does this too, ignoring errors.
    ///
    /// # Errors
    /// [`DiskError::Io`] naming the file; [`DiskError::Forked`] in a process
    /// forked from the one that opened the tier.
    pub fn close(&self) -> Result<(), DiskError> {
        self.dir_lock.check_owner()?;
        let writer = lock(&self.writer);
        self.sync_locked(&writer)?;
        self.write_index().set_clean(true)
    }

    /// Counters and sizes.
    pub fn stats(&self) -> DiskStats {
        let (bytes_used, segments) = {
            let w = lock(&self.writer);
            (w.total_bytes, w.segments.len() as u64)
        };
        let index = self.read_index();
        let c = &self.counters;
        DiskStats {
            keys: index.len(),
            bytes_used,
            segments,
            index_slots: index.slot_count(),
            stores: c.stores.load(Ordering::Relaxed),
            loads: c.loads.load(Ordering::Relaxed),
            corrupt_loads: c.corrupt_loads.load(Ordering::Relaxed),
            evicted_segments: c.evicted_segments.load(Ordering::Relaxed),
            evicted_keys: c.evicted_keys.load(Ordering::Relaxed),
            rehashes: c.rehashes.load(Ordering::Relaxed),
            rebuilt_index: self.rebuilt_index,
            recounted_index: self.recounted_index,
            rebuild_damaged: self.rebuild.damaged,
            rebuild_dropped_keys: self.rebuild.dropped_keys,
            missing_segment_keys: self.missing_segment_keys,
        }
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }
}

impl Drop for DiskTier {
    fn drop(&mut self) {
        // In a process forked from the one that opened the tier, the files
        // and their lock are the parent's: leave them as they are.
        if !self.dir_lock.held_here() {
            return;
        }
        if let Err(err) = self.close() {
            tracing::warn!(path = %self.dir.display(), error = %err, "closing the disk tier failed; the next open will recount");
        }
    }
}

/// The disk tier's writes are local file appends under a lock (micro- to
/// milliseconds, longer when a store evicts or grows the index; lookups do
/// not wait for that): the futures do that work when first polled, on the
/// caller's thread. The batched forms take the writer lock and the index
/// lock once per batch, and fsync once per batch under
/// [`FsyncPolicy::Always`]. The in-place forms write each segment's share
/// of a batch with one `pwritev` from the caller's blocks and read each
/// payload into its region piece by piece, checking its crc32 as it goes
/// (on CPUs with AVX-512 and `VPCLMULQDQ` through a buffer that stays in
/// cache, with the check folded into the copy to the region).
impl BlockStore for DiskTier {
    async fn store(&self, key: &OffloadKey, block: &[u8]) -> Result<(), TierError> {
        self.store_blocking(key, block).map_err(TierError::from)
    }

    async fn load(&self, key: &OffloadKey) -> Result<Option<Vec<u8>>, TierError> {
        self.load_blocking(key).map_err(TierError::from)
    }

    async fn remove(&self, key: &OffloadKey) -> Result<(), TierError> {
        self.remove_blocking(key).map(drop).map_err(TierError::from)
    }

    async fn store_many(&self, blocks: &[(OffloadKey, Vec<u8>)]) -> Result<(), TierError> {
        self.store_many_blocking(blocks).map_err(TierError::from)
    }

    async fn load_many(&self, keys: &[OffloadKey]) -> Result<Vec<Option<Vec<u8>>>, TierError> {
        self.load_many_blocking(keys).map_err(TierError::from)
    }

    async fn remove_many(&self, keys: &[OffloadKey]) -> Result<(), TierError> {
        self.remove_many_blocking(keys)
            .map(drop)
            .map_err(TierError::from)
    }

    async fn store_batch(&self, blocks: &[(&OffloadKey, &[u8])]) -> Vec<BlockOutcome> {
        self.store_batch_blocking(blocks)
    }

    async fn load_batch(&self, regions: &mut [(&OffloadKey, &mut [u8])]) -> Vec<BlockOutcome> {
        self.load_batch_blocking(regions)
    }

    /// `true`: reads and writes are local file I/O on the polling thread.
    fn io_blocks_thread(&self) -> bool {
        true
    }

    /// The payload length in the key's index entry (the memory-mapped
    /// index, under its read lock; no segment is read).
    fn known_len(&self, key: &OffloadKey) -> Option<usize> {
        self.locations(std::iter::once(key))
            .pop()
            .flatten()
            .map(|location| location.payload_len as usize)
    }

    /// Named `disk` unless `config` names it; accepts keys of the tier's
    /// `key_len` only.
    fn manager_config(&self, config: ManagerConfig) -> ManagerConfig {
        // Every key is `key_len` bytes: one of another length is refused
        // at the lookup, as it is by `store`.
        let mut config = config.or_named("disk");
        config.min_key_len = self.config.key_len;
        config.max_key_len = self.config.key_len;
        config
    }
}

impl Tier for DiskTier {
    /// Answers from the memory-mapped index without reading payloads; the
    /// index's read lock is held for the batch (microseconds) and waits at
    /// most for a momentary write: a slot write, one chunk of an eviction's
    /// clearing, or the swap to a grown index (never for the rehash itself).
    async fn batch_lookup(
        &self,
        keys: &[OffloadKey],
        _ctx: &ReqContext,
    ) -> Result<Vec<bool>, TierError> {
        self.contains_many(keys).map_err(TierError::from)
    }
}

fn create_segment(dir: &Path, id: u64) -> Result<(File, PathBuf), DiskError> {
    let path = dir.join(segment_name(id));
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .map_err(|e| DiskError::io("create segment", &path, e))?;
    Ok((file, path))
}

/// Segment id → size of every segment file in `dir`.
fn list_segments(dir: &Path) -> Result<BTreeMap<u64, u64>, DiskError> {
    let mut segments = BTreeMap::new();
    let entries = std::fs::read_dir(dir).map_err(|e| DiskError::io("list directory", dir, e))?;
    for entry in entries {
        let entry = entry.map_err(|e| DiskError::io("list directory", dir, e))?;
        let Some(id) = entry.file_name().to_str().and_then(parse_segment_name) else {
            continue;
        };
        let len = entry
            .metadata()
            .map_err(|e| DiskError::io("stat segment", entry.path(), e))?
            .len();
        segments.insert(id, len);
    }
    Ok(segments)
}
