//! The memory-mapped index: an open-addressing hash table of fixed-size,
//! self-checking slots (see [`format`](crate::format)).
//!
//! Linear probing from `stable_hash(key)`. A removed key leaves a tombstone
//! so probe chains stay intact; a slot whose checksum fails (a torn write)
//! or whose segment was evicted counts as a tombstone. Lookups compare the
//! full key, so the index never reports a key that was not stored.

use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use memmap2::MmapMut;

use crate::error::{DiskError, FormatError};
use crate::format::{
    self, Counters, HEADER_SIZE, IndexHeader, Location, Slot, TAG_EMPTY, TAG_LIVE,
};

/// Which segments hold live data: `oldest..=newest`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LiveSegments {
    pub(crate) oldest: u64,
    pub(crate) newest: u64,
}

impl LiveSegments {
    pub(crate) fn contains(&self, segment: u64) -> bool {
        self.oldest <= segment && segment <= self.newest
    }
}

/// The most slots an index may have (2^40: 80 TiB of slots for 36-byte keys).
pub(crate) const MAX_SLOTS: u64 = 1 << 40;

/// Why an existing index could not be opened.
#[derive(Debug)]
pub(crate) enum OpenFailure {
    /// Unreadable bytes: rebuild from the segments if allowed.
    Corrupt(FormatError),
    /// Another error (I/O, version, key length): report it.
    Fatal(DiskError),
}

#[derive(Debug)]
pub(crate) struct Index {
    path: PathBuf,
    file: File,
    map: MmapMut,
    header: IndexHeader,
    key_len: usize,
    slot_size: usize,
    mask: u64,
    counters: Counters,
}

impl Index {
    /// Creates a new, empty index file at `path` (replacing any file there).
    ///
    /// Every block of the file is reserved before it is mapped: a full
    /// filesystem is [`DiskError::DiskFull`] here (and the file is removed),
    /// never a SIGBUS on a later slot write.
    pub(crate) fn create(path: &Path, key_len: usize, slots: u64) -> Result<Self, DiskError> {
        let slot_count = slots
            .max(16)
            .checked_next_power_of_two()
            .filter(|&n| n <= MAX_SLOTS)
            .ok_or_else(|| DiskError::InvalidConfig {
                field: "initial_slots",
                reason: format!("an index of {slots} slots is more than 2^40"),
            })?;
        let header = IndexHeader {
            version: format::INDEX_VERSION,
            key_len: key_len as u32,
            slot_count,
            created_unix: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        };
        let size = header.file_size().ok_or_else(|| DiskError::InvalidConfig {
            field: "initial_slots",
            reason: "index would be larger than 2^64 bytes".to_owned(),
        })?;
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .map_err(|e| DiskError::io("create index", path, e))?;
        if let Err(err) = reserve(&file, size, path, Unsupported::WriteZeros) {
            drop(file);
            let _ = std::fs::remove_file(path);
            return Err(err);
        }
        let mut map = map_file(&file, path)?;
        header.encode(&mut map[..HEADER_SIZE]);
        let counters = Counters::default();
        counters.encode(&mut map[..HEADER_SIZE]);
        map.flush()
            .map_err(|e| DiskError::io("flush index", path, e))?;
        Ok(Self::assemble(path, file, map, header, counters))
    }

    /// Opens an existing index built for keys of `key_len` bytes.
    pub(crate) fn open(path: &Path, key_len: usize) -> Result<Self, OpenFailure> {
        let fatal = |op, e| OpenFailure::Fatal(DiskError::io(op, path, e));
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| fatal("open index", e))?;
        let len = file.metadata().map_err(|e| fatal("stat index", e))?.len();
        if len < HEADER_SIZE as u64 {
            return Err(OpenFailure::Corrupt(FormatError::Truncated {
                need: HEADER_SIZE,
                got: len as usize,
            }));
        }
        // Reserve every block before mapping (a sparse file, e.g. one written
        // by an older build, would otherwise fault on a full filesystem).
        // Only a file whose size matches its header is reserved.
        let mut head = [0u8; HEADER_SIZE];
        std::os::unix::fs::FileExt::read_exact_at(&file, &mut head, 0)
            .map_err(|e| fatal("read index header", e))?;
        if let Ok(h) = IndexHeader::parse(&head)
            && h.file_size() == Some(len)
        {
            reserve(&file, len, path, Unsupported::Skip).map_err(OpenFailure::Fatal)?;
        }
        let map = map_file(&file, path).map_err(OpenFailure::Fatal)?;
        let header = match IndexHeader::parse(&map[..HEADER_SIZE]) {
            Ok(h) => h,
            Err(FormatError::Version { found, supported }) => {
                return Err(OpenFailure::Fatal(DiskError::IndexVersion {
                    path: path.to_owned(),
                    found,
                    supported,
                }));
            }
            Err(e) => return Err(OpenFailure::Corrupt(e)),
        };
        if header.key_len as usize != key_len {
            return Err(OpenFailure::Fatal(DiskError::KeyLenMismatch {
                path: path.to_owned(),
                found: header.key_len as usize,
                configured: key_len,
            }));
        }
        if header.file_size() != Some(len) {
            return Err(OpenFailure::Corrupt(FormatError::Truncated {
                need: header.file_size().unwrap_or(u64::MAX) as usize,
                got: len as usize,
            }));
        }
        let mut map = map;
        let mut header = header;
        if header.version < format::INDEX_VERSION {
            // Slots of an older version are valid as they are (see the
            // format's versions); the header says the new one from now on,
            // before this build appends a record an older build would
            // misread.
            tracing::info!(
                path = %path.display(),
                from = header.version,
                to = format::INDEX_VERSION,
                "upgrading the index format"
            );
            header.version = format::INDEX_VERSION;
            header.encode(&mut map[..HEADER_SIZE]);
            map.flush_range(0, HEADER_SIZE)
                .map_err(|e| fatal("upgrade index header", e))?;
        }
        let mut counters = Counters::parse(&map[..HEADER_SIZE]).map_err(OpenFailure::Corrupt)?;
        // The counters carry no checksum: bound them, and recount (as after
        // an unclean shutdown) when they cannot be right.
        if counters.len > counters.used || counters.used > header.slot_count {
            tracing::warn!(
                path = %path.display(),
                len = counters.len,
                used = counters.used,
                slots = header.slot_count,
                "index counters out of range; recounting"
            );
            counters.clean = 0;
        }
        Ok(Self::assemble(path, file, map, header, counters))
    }

    fn assemble(
        path: &Path,
        file: File,
        map: MmapMut,
        header: IndexHeader,
        counters: Counters,
    ) -> Self {
        Self {
            path: path.to_owned(),
            file,
            map,
            header,
            key_len: header.key_len as usize,
            slot_size: header.slot_size(),
            mask: header.slot_count - 1,
            counters,
        }
    }

    pub(crate) fn len(&self) -> u64 {
        self.counters.len
    }

    pub(crate) fn slot_count(&self) -> u64 {
        self.header.slot_count
    }

    pub(crate) fn was_clean(&self) -> bool {
        self.counters.clean == 1
    }

    fn slot_range(&self, idx: u64) -> std::ops::Range<usize> {
        let start = HEADER_SIZE + idx as usize * self.slot_size;
        start..start + self.slot_size
    }

    fn slot(&self, idx: u64) -> &[u8] {
        &self.map[self.slot_range(idx)]
    }

    fn write_counters(&mut self) {
        let counters = self.counters;
        counters.encode(&mut self.map[..HEADER_SIZE]);
    }

    /// Finds `key`: the slot index and the payload's location.
    pub(crate) fn find(&self, key: &[u8], live: LiveSegments) -> Option<(u64, Location)> {
        self.find_from(format::stable_hash(key), key, live)
    }

    /// Whether each key is live, in order: [`find`](Self::find) for every
    /// key, with the memory accesses of many keys overlapped.
    ///
    /// A batch knows all its keys up front, so it hashes them all first and
    /// then probes key `i` while the first slot of key `i + PREFETCH_AHEAD`
    /// is being fetched (group prefetching, as hash joins do): each slot is
    /// a random access into a mapping of many megabytes, and the misses of
    /// neighbouring keys now overlap instead of queueing. The answers are
    /// exactly those of `find` (full key compare, checksum, live segment).
    pub(crate) fn contains_many<K>(
        &self,
        keys: &[K],
        bytes: impl Fn(&K) -> &[u8],
        live: LiveSegments,
    ) -> Vec<bool> {
        let starts: Vec<u64> = keys.iter().map(|k| format::stable_hash(bytes(k))).collect();
        for &start in starts.iter().take(PREFETCH_AHEAD) {
            self.prefetch_slot(start);
        }
        keys.iter()
            .zip(&starts)
            .enumerate()
            .map(|(i, (key, &start))| {
                if let Some(&ahead) = starts.get(i + PREFETCH_AHEAD) {
                    self.prefetch_slot(ahead);
                }
                self.find_from(start, bytes(key), live).is_some()
            })
            .collect()
    }

    /// Asks the CPU to start loading the slot that a probe from `hash`
    /// reads first (both cache lines it spans); never faults, changes nothing.
    #[inline]
    fn prefetch_slot(&self, hash: u64) {
        let range = self.slot_range(hash & self.mask);
        if let Some(slot) = self.map.get(range) {
            prefetch(slot.as_ptr());
            prefetch(slot[slot.len() - 1..].as_ptr());
        }
    }

    /// [`find`](Self::find) for a key whose `stable_hash` is `start`.
    #[inline]
    fn find_from(&self, start: u64, key: &[u8], live: LiveSegments) -> Option<(u64, Location)> {
        // The first 8 key bytes, compared as one word, reject most slots of
        // a probe chain before the full compare (keys are hashes: they
        // differ early). Shorter keys skip straight to the full compare.
        let head = key.first_chunk::<8>().map(|h| u64::from_ne_bytes(*h));
        for i in 0..self.header.slot_count {
            let idx = start.wrapping_add(i) & self.mask;
            let bytes = self.slot(idx);
            let (tag, slot_key) = format::slot_tag_and_key(bytes, self.key_len)?;
            match tag {
                TAG_EMPTY => return None,
                TAG_LIVE
                    if head == slot_key.first_chunk::<8>().map(|h| u64::from_ne_bytes(*h))
                        && slot_key == key =>
                {
                    if let Slot::Live { location, .. } = format::parse_slot(bytes, self.key_len)
                        && live.contains(location.segment)
                    {
                        return Some((idx, location));
                    }
                }
                _ => {}
            }
        }
        None
    }

    /// Inserts or replaces `key`; returns the location it replaced.
    pub(crate) fn insert(
        &mut self,
        key: &[u8],
        location: &Location,
        live: LiveSegments,
    ) -> (u64, Option<Location>) {
        let start = format::stable_hash(key);
        let mut reusable: Option<u64> = None;
        let mut target = None;
        for i in 0..self.header.slot_count {
            let idx = start.wrapping_add(i) & self.mask;
            let bytes = self.slot(idx);
            match format::parse_slot(bytes, self.key_len) {
                Slot::Empty => {
                    target = Some((reusable.unwrap_or(idx), reusable.is_none(), None));
                    break;
                }
                Slot::Live {
                    key: k,
                    location: old,
                } if live.contains(old.segment) => {
                    if k == key {
                        target = Some((idx, false, Some(old)));
                        break;
                    }
                }
                // Tombstones, torn slots and slots of evicted segments.
                _ => {
                    reusable.get_or_insert(idx);
                }
            }
        }
        // A full table without an empty slot still has a reusable one: the
        // load factor keeps it from filling, but never index out of range.
        let (idx, was_empty, old) =
            target.unwrap_or((reusable.unwrap_or(start & self.mask), false, None));
        let range = self.slot_range(idx);
        format::encode_live_slot(&mut self.map[range], key, location);
        if was_empty {
            self.counters.used = self.counters.used.saturating_add(1);
        }
        if old.is_none() {
            self.counters.len = self.counters.len.saturating_add(1);
        }
        self.write_counters();
        (idx, old)
    }

    /// Removes `key`; returns its location.
    pub(crate) fn remove(&mut self, key: &[u8], live: LiveSegments) -> Option<Location> {
        let (idx, location) = self.find(key, live)?;
        let range = self.slot_range(idx);
        format::encode_tombstone(&mut self.map[range]);
        self.counters.len = self.counters.len.saturating_sub(1);
        self.write_counters();
        Some(location)
    }

    /// Removes `key` only if it still points at `location` (a load that found
    /// a corrupt record must not remove a newer store of the same key).
    pub(crate) fn remove_if_at(
        &mut self,
        key: &[u8],
        location: &Location,
        live: LiveSegments,
    ) -> bool {
        match self.find(key, live) {
            Some((_, current)) if current == *location => self.remove(key, live).is_some(),
            _ => false,
        }
    }

    /// Whether the table is too full (tombstones included) to probe well.
    pub(crate) fn needs_rehash(&self) -> bool {
        u128::from(self.counters.used) * 10 > u128::from(self.header.slot_count) * 7
    }

    /// Whether `extra` more used slots would make [`needs_rehash`](Self::needs_rehash)
    /// true: a store grows the index before it appends, so that a failed
    /// rehash leaves nothing written.
    pub(crate) fn needs_rehash_before(&self, extra: u64) -> bool {
        (u128::from(self.counters.used) + u128::from(extra)) * 10
            > u128::from(self.header.slot_count) * 7
    }

    /// Every live key and its location.
    pub(crate) fn live_entries(
        &self,
        live: LiveSegments,
    ) -> impl Iterator<Item = (&[u8], Location)> {
        (0..self.header.slot_count).filter_map(move |idx| {
            match format::parse_slot(self.slot(idx), self.key_len) {
                Slot::Live { key, location } if live.contains(location.segment) => {
                    Some((key, location))
                }
                _ => None,
            }
        })
    }

    /// A new index at `tmp` holding every live entry, with room for `extra`
    /// more keys, then renamed over this one's path (atomic replacement).
    pub(crate) fn rehash(
        &self,
        tmp: &Path,
        live: LiveSegments,
        extra: u64,
    ) -> Result<Self, DiskError> {
        let mut next = self.grown(tmp, live, extra)?;
        next.finish_replace(&self.path)?;
        Ok(next)
    }

    /// A new index at `tmp` holding every live entry, with room for `extra`
    /// more keys, flushed; not renamed (see [`rename_to`](Self::rename_to)).
    /// Reads this index only: it may be built under a read lock.
    pub(crate) fn grown(
        &self,
        tmp: &Path,
        live: LiveSegments,
        extra: u64,
    ) -> Result<Self, DiskError> {
        // Room for twice the keys (a load factor of 25 to 50 % after the
        // rehash), never shrinking below 64 Ki slots.
        let slots = self
            .counters
            .len
            .saturating_add(extra)
            .max(1)
            .saturating_mul(2)
            .max(self.header.slot_count.min(1 << 16));
        let mut next = Self::create(tmp, self.key_len, slots)?;
        for (key, location) in self.live_entries(live) {
            next.insert(key, &location, live);
        }
        next.map
            .flush()
            .map_err(|e| DiskError::io("flush index", &next.path, e))?;
        Ok(next)
    }

    /// Flushes this (temporary) index, renames it to `path` and syncs the directory.
    pub(crate) fn finish_replace(&mut self, path: &Path) -> Result<(), DiskError> {
        self.map
            .flush()
            .map_err(|e| DiskError::io("flush index", &self.path, e))?;
        self.rename_to(path)?;
        if let Some(dir) = path.parent() {
            sync_dir(dir)?;
        }
        Ok(())
    }

    /// Renames this index's file to `path` (the caller syncs the directory).
    pub(crate) fn rename_to(&mut self, path: &Path) -> Result<(), DiskError> {
        std::fs::rename(&self.path, path).map_err(|e| DiskError::io("rename index", path, e))?;
        self.path = path.to_owned();
        Ok(())
    }

    /// Recounts `len` and `used` and turns slots of evicted segments into
    /// tombstones: one pass over the slots, no payload read. Used after an
    /// unclean shutdown, whose counters may lag.
    pub(crate) fn recount(&mut self, live: LiveSegments) {
        let (mut len, mut used) = (0, 0);
        for idx in 0..self.header.slot_count {
            let range = self.slot_range(idx);
            match format::parse_slot(&self.map[range.clone()], self.key_len) {
                Slot::Empty => continue,
                Slot::Live { location, .. } if live.contains(location.segment) => len += 1,
                _ => format::encode_tombstone(&mut self.map[range]),
            }
            used += 1;
        }
        self.counters.len = len;
        self.counters.used = used;
        self.write_counters();
    }

    /// The slots in `range` that are live slots of `segment` (whether or
    /// not the segment is still live).
    pub(crate) fn live_slots_of(&self, range: std::ops::Range<u64>, segment: u64) -> Vec<u64> {
        range
            .filter(|&idx| {
                matches!(
                    format::parse_slot(self.slot(idx), self.key_len),
                    Slot::Live { location, .. } if location.segment == segment
                )
            })
            .collect()
    }

    /// Turns each of `slots` that is still a live slot of `segment` into a
    /// tombstone; returns how many.
    pub(crate) fn tombstone_slots(&mut self, slots: &[u64], segment: u64) -> u64 {
        let mut cleared = 0;
        for &idx in slots {
            if idx >= self.header.slot_count {
                continue;
            }
            let range = self.slot_range(idx);
            if let Slot::Live { location, .. } =
                format::parse_slot(&self.map[range.clone()], self.key_len)
                && location.segment == segment
            {
                format::encode_tombstone(&mut self.map[range]);
                cleared += 1;
            }
        }
        self.counters.len = self.counters.len.saturating_sub(cleared);
        self.write_counters();
        cleared
    }

    /// Turns every live slot whose segment satisfies `gone` into a
    /// tombstone; returns how many. One pass over the slots.
    pub(crate) fn clear_where(&mut self, gone: impl Fn(u64) -> bool) -> u64 {
        let mut cleared = 0;
        for idx in 0..self.header.slot_count {
            let range = self.slot_range(idx);
            if let Slot::Live { location, .. } =
                format::parse_slot(&self.map[range.clone()], self.key_len)
                && gone(location.segment)
            {
                format::encode_tombstone(&mut self.map[range]);
                cleared += 1;
            }
        }
        self.counters.len = self.counters.len.saturating_sub(cleared);
        self.write_counters();
        cleared
    }

    /// Flushes one slot's bytes to disk.
    pub(crate) fn flush_slot(&self, idx: u64) -> Result<(), DiskError> {
        let range = self.slot_range(idx);
        self.map
            .flush_range(range.start, range.len())
            .map_err(|e| DiskError::io("flush index slot", &self.path, e))
    }

    /// Marks the file clean or dirty and flushes everything.
    pub(crate) fn set_clean(&mut self, clean: bool) -> Result<(), DiskError> {
        if !clean {
            // Dirty first, durably, before any slot changes.
            self.counters.clean = 0;
            self.write_counters();
            return self
                .map
                .flush_range(0, HEADER_SIZE)
                .map_err(|e| DiskError::io("flush index header", &self.path, e));
        }
        self.map
            .flush()
            .map_err(|e| DiskError::io("flush index", &self.path, e))?;
        self.counters.clean = 1;
        self.write_counters();
        self.map
            .flush_range(0, HEADER_SIZE)
            .map_err(|e| DiskError::io("flush index header", &self.path, e))
    }

    /// Flushes every dirty page.
    pub(crate) fn flush(&self) -> Result<(), DiskError> {
        self.map
            .flush()
            .map_err(|e| DiskError::io("flush index", &self.path, e))?;
        self.file
            .sync_all()
            .map_err(|e| DiskError::io("sync index", &self.path, e))
    }
}

/// How many keys ahead of its probe [`Index::contains_many`] prefetches:
/// about as many misses as a core keeps in flight.
const PREFETCH_AHEAD: usize = 16;

/// A hint to load the cache line holding `p` (no-op where unsupported).
#[inline(always)]
fn prefetch(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    {
        use core::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        // SAFETY: a prefetch is a hint: it reads nothing into the program,
        // never faults, and `p` points into the live mapping anyway.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

fn map_file(file: &File, path: &Path) -> Result<MmapMut, DiskError> {
    // SAFETY: the mapping is only sound while no one else changes the file.
    // The directory's lock file (held for the DiskTier's whole life) keeps
    // other kvtier writers out; other programs must not write into a tier's
    // directory, which the crate documentation states.
    unsafe { MmapMut::map_mut(file) }.map_err(|e| DiskError::io("map index", path, e))
}

/// Allocates every block of `file` up to `size` bytes (extending it), so
/// that writes through a shared mapping never find an unallocated page.
/// What [`reserve`] does on a filesystem without `fallocate` (a C library
/// that does not emulate it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unsupported {
    /// Write the (new, empty) file out with zeros: same effect.
    WriteZeros,
    /// Leave an existing file as it is (it was written out when created).
    Skip,
}

fn reserve(file: &File, size: u64, path: &Path, unsupported: Unsupported) -> Result<(), DiskError> {
    let len = libc::off_t::try_from(size).map_err(|_| DiskError::InvalidConfig {
        field: "initial_slots",
        reason: format!("an index of {size} bytes is too large for this platform"),
    })?;
    // SAFETY: a valid, open descriptor (borrowed from `file` for the call).
    let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len) };
    match rc {
        0 => Ok(()),
        // posix_fallocate returns the error number (it does not set errno).
        libc::ENOSPC | libc::EDQUOT => Err(DiskError::DiskFull {
            path: path.to_owned(),
        }),
        libc::EOPNOTSUPP | libc::EINVAL if unsupported == Unsupported::Skip => Ok(()),
        libc::EOPNOTSUPP | libc::EINVAL => write_zeros(file, size, path),
        errno => Err(DiskError::io(
            "reserve index blocks",
            path,
            std::io::Error::from_raw_os_error(errno),
        )),
    }
}

/// Writes `size` zero bytes from the start of `file`.
fn write_zeros(file: &File, size: u64, path: &Path) -> Result<(), DiskError> {
    use std::os::unix::fs::FileExt;
    let chunk = vec![0u8; 1 << 20];
    let mut at = 0u64;
    while at < size {
        let n = (size - at).min(chunk.len() as u64) as usize;
        file.write_all_at(&chunk[..n], at)
            .map_err(|e| DiskError::io("write out index", path, e))?;
        at += n as u64;
    }
    Ok(())
}

/// fsyncs a directory so that created, renamed and deleted names are durable.
pub(crate) fn sync_dir(dir: &Path) -> Result<(), DiskError> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| DiskError::io("sync directory", dir, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn location(segment: u64) -> Location {
        Location {
            segment,
            offset: 0,
            payload_len: 1,
            payload_crc: 0,
            record_len: 48,
            gap: 0,
        }
    }

    /// Keys 0..1000 differ in their first 8 bytes; keys from 1000 on share
    /// them and differ only in their last 4 (the full compare decides).
    fn key(id: u32) -> [u8; 36] {
        let mut k = [0xA5u8; 36];
        if id < 1000 {
            k[..4].copy_from_slice(&id.to_le_bytes());
        }
        k[32..].copy_from_slice(&id.wrapping_mul(0x9E37_79B9).to_le_bytes());
        k
    }

    /// The batch answers exactly what one `find` per key answers (and what
    /// a model of the table says), on a
    /// nearly full table (long probe chains that wrap around the end) with
    /// tombstones, torn slots, keys of an evicted segment and repeated keys.
    #[test]
    fn contains_many_answers_as_find_does() {
        let dir = tempfile::tempdir().unwrap();
        let mut index = Index::create(&dir.path().join("index"), 36, 64).unwrap();
        let live = LiveSegments {
            oldest: 1,
            newest: 3,
        };
        let stored: Vec<u32> = (0..22).chain(1000..1022).collect();
        for &id in &stored {
            index.insert(&key(id), &location(1 + u64::from(id % 3)), live);
        }
        for &id in stored.iter().step_by(5) {
            index.remove(&key(id), live);
        }
        // Tear one live slot: its checksum no longer matches.
        let (torn, _) = index.find(&key(1), live).unwrap();
        let range = index.slot_range(torn);
        index.map[range.start + 20] ^= 0xFF;
        // Evict segment 1.
        let live = LiveSegments {
            oldest: 2,
            newest: 3,
        };
        let ids: Vec<u32> = (0..50)
            .chain(1000..1050)
            .chain([7, 7, 2, 1, 1001])
            .collect();
        // The model: stored, not removed, not torn, not in segment 1.
        let model: Vec<bool> = ids
            .iter()
            .map(|id| {
                let at = stored.iter().position(|s| s == id);
                at.is_some_and(|at| at % 5 != 0) && *id != 1 && id % 3 != 0
            })
            .collect();
        let keys: Vec<[u8; 36]> = ids.iter().copied().map(key).collect();
        let one_by_one: Vec<bool> = keys.iter().map(|k| index.find(k, live).is_some()).collect();
        assert_eq!(index.contains_many(&keys, |k| k, live), model);
        assert_eq!(one_by_one, model);
        assert!(model.iter().filter(|&&f| f).count() > 10);
        assert!(index.contains_many(&[], |k: &[u8; 36]| k, live).is_empty());
    }

    /// Keys shorter than the 8-byte first-word compare.
    #[test]
    fn contains_many_with_short_keys() {
        let dir = tempfile::tempdir().unwrap();
        let mut index = Index::create(&dir.path().join("index"), 3, 16).unwrap();
        let live = LiveSegments {
            oldest: 1,
            newest: 1,
        };
        for k in [[1u8, 2, 3], [1, 2, 4], [9, 9, 9]] {
            index.insert(&k, &location(1), live);
        }
        let keys = [[1u8, 2, 3], [1, 2, 5], [9, 9, 9], [0, 0, 0]];
        assert_eq!(
            index.contains_many(&keys, |k| k, live),
            [true, false, true, false]
        );
    }
}
