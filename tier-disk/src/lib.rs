//! A local-disk kvtier tier: a memory-mapped index over append-only segment
//! files. It survives restarts and never reports a phantom hit.
//!
//! - **Lookups read only the index.** It is a memory-mapped hash table of
//!   fixed-size slots, each holding the full key, the payload's location and
//!   checksum, and a checksum of the slot itself. Keys are compared in
//!   full, so a lookup never says "present" for a key that was not stored.
//! - **Payloads go to append-only segments.** Each record describes itself
//!   (key, length, checksums), so a lost or corrupt index is rebuilt from
//!   the segments.
//! - **Bounded.** Past `capacity_bytes`, whole oldest segments are evicted
//!   (FIFO by write time). Their slots stop counting at once and are then
//!   cleared. The index rehashes into a new file (atomic rename) past a 70 %
//!   load factor.
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
//!   program may write into the directory.
//!
//! ```
//! use kvtier_core::{OffloadKey, ReqContext, Tier};
//! use kvtier_disk::{DiskConfig, DiskTier};
//!
//! let dir = tempfile::tempdir()?;
//! let tier = DiskTier::open(DiskConfig::new(dir.path()))?;
//! let key = OffloadKey::from_block_hash(&[1; 32], 0);
//! tier.store(&key, b"kv block bytes")?;
//! assert_eq!(tier.load(&key)?.as_deref(), Some(&b"kv block bytes"[..]));
//! assert_eq!(tier.contains_many(&[key.clone(), OffloadKey::from_block_hash(&[2; 32], 0)])?, [true, false]);
//! tier.close()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![deny(missing_docs)]
#![warn(clippy::unwrap_used)]

mod config;
mod error;
pub mod format;
mod index;

use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use kvtier_core::{BlockStore, ManagerConfig, OffloadKey, ReqContext, Tier, TierError};
use serde::Serialize;

pub use config::{DiskConfig, FsyncPolicy};
pub use error::{DiskError, FormatError};

use index::{Index, LiveSegments, OpenFailure, sync_dir};

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
    _lock: File,
    index: RwLock<Index>,
    writer: Mutex<Writer>,
    /// Live segment ids, readable without the writer lock.
    oldest: AtomicU64,
    newest: AtomicU64,
    readers: Mutex<HashMap<u64, Arc<File>>>,
    counters: Counters,
    rebuilt_index: bool,
    recounted_index: bool,
    rebuild: RebuildReport,
    missing_segment_keys: u64,
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
            _lock: lock_file,
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

    /// Stores `payload` under `key`, replacing any earlier payload. The key
    /// becomes visible once the payload is durable to the configured level.
    ///
    /// # Errors
    /// [`DiskError::WrongKeySize`], [`DiskError::PayloadTooLarge`],
    /// [`DiskError::DiskFull`] or [`DiskError::Io`]; on error nothing is published.
    pub fn store(&self, key: &OffloadKey, payload: &[u8]) -> Result<(), DiskError> {
        self.check_key(key)?;
        if payload.len() > self.config.max_payload() {
            return Err(DiskError::PayloadTooLarge {
                len: payload.len(),
                max: self.config.max_payload(),
            });
        }
        let record = format::encode_record(format::KIND_PUT, key.as_bytes(), payload);
        let mut writer = lock(&self.writer);
        let (segment, offset) = self.append(&mut writer, &record)?;
        let location = format::Location {
            segment,
            offset,
            payload_len: payload.len() as u32,
            payload_crc: crc32fast::hash(payload),
            record_len: record.len() as u32,
        };
        let live = self.live();
        let slot = {
            let mut index = self.write_index();
            // Grow first: a rehash that fails (a full disk) leaves the key
            // unpublished, as the error says.
            if index.needs_rehash_before_insert() {
                self.rehash(&mut index, live)?;
            }
            index.insert(key.as_bytes(), &location, live).0
        };
        if self.config.fsync == FsyncPolicy::Always {
            let flushed = self.read_index().flush_slot(slot);
            if let Err(err) = flushed {
                // Not durable as promised: unpublish it (a miss, never older bytes).
                self.write_index()
                    .remove_if_at(key.as_bytes(), &location, self.live());
                return Err(err);
            }
        }
        drop(writer);
        self.counters.stores.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Appends a record to the active segment (rolling and evicting as
    /// needed); returns its segment and offset once durable to the policy.
    fn append(&self, writer: &mut Writer, record: &[u8]) -> Result<(u64, u64), DiskError> {
        let len = record.len() as u64;
        if writer.active_len > 0 && writer.active_len + len > self.config.segment_bytes {
            self.roll(writer)?;
        }
        while writer.total_bytes + len > self.config.capacity_bytes && writer.segments.len() > 1 {
            self.evict_oldest(writer)?;
        }
        let offset = writer.active_len;
        let path = self.dir.join(segment_name(writer.active_id));
        writer
            .active
            .write_all_at(record, offset)
            .map_err(|e| DiskError::io("write segment", &path, e))?;
        if self.config.fsync == FsyncPolicy::Always {
            writer
                .active
                .sync_data()
                .map_err(|e| DiskError::io("sync segment", &path, e))?;
        }
        writer.active_len += len;
        writer.total_bytes += len;
        if let Some(bytes) = writer.segments.get_mut(&writer.active_id) {
            *bytes = writer.active_len;
        }
        Ok((writer.active_id, offset))
    }

    fn roll(&self, writer: &mut Writer) -> Result<(), DiskError> {
        let old = self.dir.join(segment_name(writer.active_id));
        writer
            .active
            .sync_all()
            .map_err(|e| DiskError::io("sync segment", &old, e))?;
        let id = writer
            .active_id
            .checked_add(1)
            .filter(|&id| id <= MAX_SEGMENT_ID)
            .ok_or_else(|| DiskError::SegmentIdOutOfRange {
                path: old.clone(),
                id: writer.active_id,
                max: MAX_SEGMENT_ID,
            })?;
        let (file, _) = create_segment(&self.dir, id)?;
        sync_dir(&self.dir)?;
        writer.active = file;
        writer.active_id = id;
        writer.active_len = 0;
        writer.segments.insert(id, 0);
        self.newest.store(id, Ordering::Release);
        Ok(())
    }

    fn evict_oldest(&self, writer: &mut Writer) -> Result<(), DiskError> {
        let Some((&id, &bytes)) = writer.segments.iter().next() else {
            return Ok(());
        };
        if id == writer.active_id {
            return Ok(());
        }
        // Slots of the segment stop counting at once; then the file goes,
        // then its slots are cleared (a crash in between leaves slots that
        // point below the oldest segment: they read as absent).
        self.oldest.store(id + 1, Ordering::Release);
        writer.segments.remove(&id);
        writer.total_bytes -= bytes;
        lock(&self.readers).remove(&id);
        let path = self.dir.join(segment_name(id));
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(DiskError::io("remove segment", &path, e)),
        }
        let cleared = self.write_index().clear_segment(id);
        self.counters
            .evicted_segments
            .fetch_add(1, Ordering::Relaxed);
        self.counters
            .evicted_keys
            .fetch_add(cleared, Ordering::Relaxed);
        tracing::debug!(segment = id, keys = cleared, "evicted segment");
        Ok(())
    }

    fn rehash(&self, index: &mut Index, live: LiveSegments) -> Result<(), DiskError> {
        let next = index.rehash(&self.dir.join(INDEX_TMP), live)?;
        tracing::debug!(
            from = index.slot_count(),
            to = next.slot_count(),
            keys = next.len(),
            "index rehashed"
        );
        *index = next;
        index.set_clean(false)?;
        self.counters.rehashes.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Loads the payload of `key`, or `None` if it is not stored. A record
    /// that fails its checks (checksum, length, key, kind), lies beyond the
    /// end of its segment or whose segment file is missing is a miss: its
    /// entry is removed and `corrupt_loads` counts it.
    ///
    /// # Errors
    /// [`DiskError::WrongKeySize`]; [`DiskError::Io`] when the segment
    /// cannot be opened or read. That failed load too removes the entry and
    /// counts in `corrupt_loads`, so the key is not a hit again.
    pub fn load(&self, key: &OffloadKey) -> Result<Option<Vec<u8>>, DiskError> {
        self.check_key(key)?;
        let live = self.live();
        let Some((_, location)) = self.read_index().find(key.as_bytes(), live) else {
            return Ok(None);
        };
        let path = self.dir.join(segment_name(location.segment));
        let file = match self.segment_reader(location.segment) {
            Ok(file) => file,
            Err(err) => {
                self.failed_load(key, &location, &path, &err.to_string());
                return Err(err);
            }
        };
        let Some(file) = file else {
            if !self.live().contains(location.segment) {
                // Evicted between the lookup and now: a plain miss.
                return Ok(None);
            }
            self.failed_load(key, &location, &path, "segment file missing");
            return Ok(None);
        };
        if location.record_len as usize
            != format::record_size(self.config.key_len, location.payload_len as usize)
        {
            self.failed_load(key, &location, &path, "impossible record length");
            return Ok(None);
        }
        let mut buf = vec![0u8; location.record_len as usize];
        let checked = match file.read_exact_at(&mut buf, location.offset) {
            Ok(()) => match format::parse_record(&buf) {
                Ok((header, stored_key, payload))
                    if stored_key == key.as_bytes()
                        && header.kind == format::KIND_PUT
                        && header.payload_crc == location.payload_crc
                        && payload.len() == location.payload_len as usize =>
                {
                    Ok(payload.to_vec())
                }
                Ok(_) => Err("record does not match its index entry".to_owned()),
                Err(e) => Err(e.to_string()),
            },
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                Err("record beyond the end of its segment".to_owned())
            }
            Err(e) => {
                let err = DiskError::io("read segment", &path, e);
                self.failed_load(key, &location, &path, &err.to_string());
                return Err(err);
            }
        };
        match checked {
            Ok(payload) => {
                self.counters.loads.fetch_add(1, Ordering::Relaxed);
                Ok(Some(payload))
            }
            Err(reason) => {
                self.failed_load(key, &location, &path, &reason);
                Ok(None)
            }
        }
    }

    /// A load that found no valid record: the key turns into a miss, its
    /// entry is removed (unless a newer store replaced it) and it is counted.
    fn failed_load(
        &self,
        key: &OffloadKey,
        location: &format::Location,
        path: &Path,
        reason: &str,
    ) {
        tracing::warn!(segment = %path.display(), offset = location.offset, %reason, "corrupt record; removing its key");
        self.counters.corrupt_loads.fetch_add(1, Ordering::Relaxed);
        self.write_index()
            .remove_if_at(key.as_bytes(), location, self.live());
    }

    fn segment_reader(&self, id: u64) -> Result<Option<Arc<File>>, DiskError> {
        if let Some(file) = lock(&self.readers).get(&id) {
            return Ok(Some(Arc::clone(file)));
        }
        let path = self.dir.join(segment_name(id));
        match File::open(&path) {
            Ok(file) => {
                let file = Arc::new(file);
                if self.live().contains(id) {
                    lock(&self.readers).insert(id, Arc::clone(&file));
                }
                Ok(Some(file))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(DiskError::io("open segment", &path, e)),
        }
    }

    /// Removes `key`; returns whether it was stored. The removal is logged
    /// in the segment so that a rebuilt index does not bring it back.
    ///
    /// # Errors
    /// [`DiskError::WrongKeySize`], [`DiskError::DiskFull`] or [`DiskError::Io`].
    pub fn remove(&self, key: &OffloadKey) -> Result<bool, DiskError> {
        self.check_key(key)?;
        if self
            .read_index()
            .find(key.as_bytes(), self.live())
            .is_none()
        {
            return Ok(false);
        }
        let record = format::encode_record(format::KIND_REMOVE, key.as_bytes(), &[]);
        let mut writer = lock(&self.writer);
        self.append(&mut writer, &record)?;
        let removed = self
            .write_index()
            .remove(key.as_bytes(), self.live())
            .is_some();
        Ok(removed)
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
        let writer = lock(&self.writer);
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
    /// [`DiskError::Io`] naming the file.
    pub fn close(&self) -> Result<(), DiskError> {
        self.sync()?;
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
        if let Err(err) = self.close() {
            tracing::warn!(path = %self.dir.display(), error = %err, "closing the disk tier failed; the next open will recount");
        }
    }
}

/// The disk tier's writes are local file appends under a lock (micro- to
/// milliseconds, longer when a store evicts or grows the index): the futures
/// do that work when first polled, on the caller's thread.
impl BlockStore for DiskTier {
    async fn store(&self, key: &OffloadKey, block: &[u8]) -> Result<(), TierError> {
        DiskTier::store(self, key, block).map_err(TierError::from)
    }

    async fn load(&self, key: &OffloadKey) -> Result<Option<Vec<u8>>, TierError> {
        DiskTier::load(self, key).map_err(TierError::from)
    }

    async fn remove(&self, key: &OffloadKey) -> Result<(), TierError> {
        DiskTier::remove(self, key)
            .map(drop)
            .map_err(TierError::from)
    }

    /// Named `disk` unless `config` names it; accepts the tier's key length.
    fn manager_config(&self, config: ManagerConfig) -> ManagerConfig {
        let mut config = config.or_named("disk");
        config.max_key_len = config.max_key_len.max(self.config.key_len);
        config
    }
}

impl Tier for DiskTier {
    /// Answers from the memory-mapped index without reading payloads; the
    /// index lock is held for the batch (microseconds) and waits only for a
    /// slot write, an eviction's slot clearing or a rehash.
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

/// What a rebuild found damaged, and what it dropped because of it.
#[derive(Debug, Default, Clone, Copy)]
struct RebuildReport {
    damaged: u64,
    dropped_keys: u64,
}

/// Builds a new index from the records of every segment, oldest first: a
/// later record of a key wins and a remove record removes it.
///
/// Damage never makes a key load bytes that a later store replaced or a
/// removal removed:
/// - A record whose header (and so its key and extent) is intact but whose
///   payload fails its checksum is the key's newest record, unreadable: the
///   key is left absent, and the scan goes on after the record.
/// - A segment cut short (fewer bytes left than a record header and key, or
///   a record running past the end of the file) ends there: that is the
///   torn tail of a crash, a record that was never acknowledged.
/// - An unreadable record header anywhere else leaves the rest of that
///   segment unordered: it may have replaced or removed any key indexed so
///   far. The rest of the segment is discarded and so is every key indexed
///   so far; later segments (all newer) are kept. A segment missing from the
///   middle of the sequence is handled the same way. Each is logged and
///   counted in the report.
fn rebuild(
    dir: &Path,
    config: &DiskConfig,
    segments: &BTreeMap<u64, u64>,
    live: LiveSegments,
) -> Result<(Index, RebuildReport), DiskError> {
    let tmp = dir.join(INDEX_TMP);
    let mut index = Index::create(&tmp, config.key_len, config.initial_slots)?;
    let mut report = RebuildReport::default();
    let mut previous: Option<u64> = None;
    for &id in segments.keys() {
        let path = dir.join(segment_name(id));
        if previous.is_some_and(|p| p + 1 != id) {
            let dropped = index.len();
            tracing::warn!(
                segment = %path.display(),
                keys = dropped,
                "segments missing before this one; every key of older segments is dropped"
            );
            report.damaged += 1;
            report.dropped_keys += dropped;
            drop(index);
            index = Index::create(&tmp, config.key_len, config.initial_slots)?;
        }
        previous = Some(id);
        let bytes = std::fs::read(&path).map_err(|e| DiskError::io("read segment", &path, e))?;
        let mut offset = 0usize;
        while offset < bytes.len() {
            let rest = &bytes[offset..];
            let (header, key) = match format::parse_record_header(rest) {
                Ok(parsed) => parsed,
                // A torn tail.
                Err(_) if rest.len() < format::RECORD_HEADER_SIZE + config.key_len => break,
                Err(reason) => {
                    let dropped = index.len();
                    tracing::warn!(
                        segment = %path.display(),
                        offset,
                        %reason,
                        discarded_bytes = rest.len(),
                        keys = dropped,
                        "unreadable record: the rest of its segment is discarded, and every key indexed before it (the record may have replaced or removed any of them)"
                    );
                    report.damaged += 1;
                    report.dropped_keys += dropped;
                    drop(index);
                    index = Index::create(&tmp, config.key_len, config.initial_slots)?;
                    break;
                }
            };
            let len = header.record_len();
            let Some(record) = rest.get(..len) else {
                break; // a torn tail: the record runs past the end of the file
            };
            if key.len() == config.key_len {
                match format::parse_record(record) {
                    Ok((h, _, payload)) if h.kind == format::KIND_PUT => {
                        let location = format::Location {
                            segment: id,
                            offset: offset as u64,
                            payload_len: payload.len() as u32,
                            payload_crc: h.payload_crc,
                            record_len: len as u32,
                        };
                        index.insert(key, &location, live);
                    }
                    Ok(_) => {
                        index.remove(key, live);
                    }
                    Err(reason) => {
                        tracing::warn!(
                            segment = %path.display(),
                            offset,
                            %reason,
                            "damaged record payload: its key is left absent"
                        );
                        report.damaged += 1;
                        index.remove(key, live);
                    }
                }
            }
            if index.needs_rehash() {
                // The grown index is renamed over the one being built (at `tmp`).
                index = index.rehash(&dir.join("index.kvx.grow"), live)?;
            }
            offset += len;
        }
    }
    index.finish_replace(&dir.join(INDEX_FILE))?;
    Ok((index, report))
}
