//! The write path: stores and removals append records to the active
//! segment (rolling to a new one, evicting the oldest as needed; see
//! [`append`](crate::append) for a batch of stores), then publish them in
//! the index. The index grows first when the new keys would
//! pass its load factor.
//!
//! Everything here runs under the writer lock. The index's write lock is
//! taken only to publish (one slot write per key) and to swap in a grown
//! index; the grown index is built under the read lock, while lookups and
//! loads go on reading the old one.

use std::os::unix::fs::FileExt;
use std::sync::atomic::Ordering;

use kvtier_core::{BlockOutcome, OffloadKey};

use crate::append::Appended;
use crate::config::FsyncPolicy;
use crate::error::DiskError;
use crate::format::{self, Location};
use crate::index::sync_dir;
use crate::{
    DiskTier, INDEX_FILE, INDEX_TMP, MAX_SEGMENT_ID, Writer, create_segment, lock, segment_name,
};

impl DiskTier {
    /// Stores `payload` under `key`, replacing any earlier payload, on the
    /// calling thread (the synchronous form of
    /// [`BlockStore::store`](kvtier_core::BlockStore::store), for threads
    /// outside any runtime). The key becomes visible once the payload is
    /// durable to the configured level.
    ///
    /// # Errors
    /// [`DiskError::WrongKeySize`], [`DiskError::PayloadTooLarge`],
    /// [`DiskError::DiskFull`] or [`DiskError::Io`]; [`DiskError::Forked`]
    /// in a process forked from the one that opened the tier. On error
    /// nothing is published.
    pub fn store_blocking(&self, key: &OffloadKey, payload: &[u8]) -> Result<(), DiskError> {
        self.check_block(key, payload)?;
        self.append_batch(&[(key, payload)])
            .first_error()
            .map_or(Ok(()), Err)
    }

    /// Stores every `(key, payload)`, in order (a later payload of the same
    /// key wins), under one writer lock, publishing them under one index
    /// lock and, under [`FsyncPolicy::Always`], with one fsync of the
    /// segment for the batch.
    ///
    /// # Errors
    /// As [`store_blocking`](Self::store_blocking). A refused key or payload
    /// (wrong size, too large) refuses the whole batch before anything is
    /// written. A full disk or an I/O error part way publishes the blocks
    /// written before it (durable to the policy), and nothing after.
    pub fn store_many_blocking(&self, blocks: &[(OffloadKey, Vec<u8>)]) -> Result<(), DiskError> {
        let blocks: Vec<(&OffloadKey, &[u8])> = blocks
            .iter()
            .map(|(key, payload)| (key, payload.as_slice()))
            .collect();
        for (key, payload) in &blocks {
            self.check_block(key, payload)?;
        }
        self.append_batch(&blocks).first_error().map_or(Ok(()), Err)
    }

    /// Stores every `(key, payload)` borrowed from the caller, answering per
    /// key (the synchronous form of
    /// [`BlockStore::store_batch`](kvtier_core::BlockStore::store_batch)):
    /// the payloads go to the active segment in one vectored write per
    /// segment, straight from `blocks`, and are published as
    /// [`store_many_blocking`](Self::store_many_blocking) does. A refused
    /// key or payload fails alone; a failure part way fails that block and
    /// every block after it, and publishes those before it.
    pub fn store_batch_blocking(&self, blocks: &[(&OffloadKey, &[u8])]) -> Vec<BlockOutcome> {
        self.append_batch(blocks).into_outcomes()
    }

    /// Refuses a key of the wrong size or a payload no segment can take.
    fn check_block(&self, key: &OffloadKey, payload: &[u8]) -> Result<(), DiskError> {
        self.check_key(key)?;
        if payload.len() > self.config.max_payload() {
            return Err(DiskError::PayloadTooLarge {
                len: payload.len(),
                max: self.config.max_payload(),
            });
        }
        Ok(())
    }

    /// The batch store: checks each block, appends those that pass, makes
    /// them durable as the policy asks, then publishes them.
    fn append_batch(&self, blocks: &[(&OffloadKey, &[u8])]) -> Appended {
        let mut appended = Appended::new(blocks.len());
        let mut todo = Vec::with_capacity(blocks.len());
        for (i, (key, payload)) in blocks.iter().enumerate() {
            match self.check_block(key, payload) {
                Ok(()) => todo.push(i),
                Err(err) => appended.fail(i, err),
            }
        }
        if todo.is_empty() {
            return appended;
        }
        if let Err(err) = self.dir_lock.check_owner() {
            appended.fail_all(todo, err);
            return appended;
        }
        let mut writer = lock(&self.writer);
        // Grow first: a rehash that fails (a full disk) has appended no
        // record, so nothing is published and a rebuild finds nothing either.
        if let Err(err) = self.grow_for(&writer, todo.len() as u64) {
            appended.fail_all(todo, err);
            return appended;
        }
        let (placed, failure) = self.append_blocks(&mut writer, blocks, &todo);
        if let Some(err) = failure {
            appended.fail_all(todo[placed.len()..].iter().copied(), err);
        }
        if placed.is_empty() {
            return appended;
        }
        let written: Vec<(&OffloadKey, Location)> = placed
            .iter()
            .map(|p| (blocks[p.block].0, p.location))
            .collect();
        if let Err(err) = self.sync_active(&writer) {
            appended.fail_all(placed.iter().map(|p| p.block), err);
            return appended;
        }
        let slots = self.publish(&written);
        if self.config.fsync == FsyncPolicy::Always {
            let flushed = {
                let index = self.read_index();
                slots.iter().try_for_each(|&slot| index.flush_slot(slot))
            };
            if let Err(err) = flushed {
                self.unpublish(&mut writer, &written);
                appended.fail_all(placed.iter().map(|p| p.block), err);
                return appended;
            }
        }
        drop(writer);
        self.counters
            .stores
            .fetch_add(written.len() as u64, Ordering::Relaxed);
        appended
    }

    /// Inserts the written records into the index under one write lock;
    /// returns their slots. A record whose segment this very batch evicted
    /// is left out (it would read as absent, and its slot would never be
    /// cleared).
    fn publish(&self, written: &[(&OffloadKey, Location)]) -> Vec<u64> {
        let live = self.live();
        let mut index = self.write_index();
        written
            .iter()
            .filter(|(_, location)| live.contains(location.segment))
            .map(|(key, location)| index.insert(key.as_bytes(), location, live).0)
            .collect()
    }

    /// A published store that is not durable as promised (its slot could
    /// not be flushed): its keys turn into misses, never older bytes, and a
    /// remove record is appended for each (best effort) so that a rebuilt
    /// index does not bring them back either.
    fn unpublish(&self, writer: &mut Writer, written: &[(&OffloadKey, Location)]) {
        let live = self.live();
        {
            let mut index = self.write_index();
            for (key, location) in written {
                index.remove_if_at(key.as_bytes(), location, live);
            }
        }
        for (key, _) in written {
            let record = format::encode_record(format::KIND_REMOVE, key.as_bytes(), 0, &[]);
            if let Err(err) = self.append(writer, &record) {
                tracing::warn!(error = %err, "could not log the removal of a store that failed; a rebuilt index may serve it");
                return;
            }
        }
        if let Err(err) = self.sync_active(writer) {
            tracing::warn!(error = %err, "could not sync the removal of a store that failed");
        }
    }

    /// Removes `key` on the calling thread; returns whether it was stored.
    /// The removal is logged in the segment so that a rebuilt index does not
    /// bring it back.
    ///
    /// # Errors
    /// [`DiskError::WrongKeySize`], [`DiskError::DiskFull`] or
    /// [`DiskError::Io`]; [`DiskError::Forked`] in a forked child.
    pub fn remove_blocking(&self, key: &OffloadKey) -> Result<bool, DiskError> {
        Ok(self.remove_batch(&[key])?.contains(&true))
    }

    /// Removes every key under one writer lock and one index lock; returns
    /// whether each was stored (a key repeated in `keys` is removed by its
    /// first occurrence).
    ///
    /// # Errors
    /// As [`remove_blocking`](Self::remove_blocking). A full disk or an I/O
    /// error part way removes the keys whose removal was logged before it.
    pub fn remove_many_blocking(&self, keys: &[OffloadKey]) -> Result<Vec<bool>, DiskError> {
        let keys: Vec<&OffloadKey> = keys.iter().collect();
        self.remove_batch(&keys)
    }

    fn remove_batch(&self, keys: &[&OffloadKey]) -> Result<Vec<bool>, DiskError> {
        for key in keys {
            self.check_key(key)?;
        }
        self.dir_lock.check_owner()?;
        let present = || {
            let live = self.live();
            let index = self.read_index();
            keys.iter()
                .map(|key| index.find(key.as_bytes(), live).is_some())
                .collect::<Vec<bool>>()
        };
        // Absent keys need no record (and no wait for the writer lock).
        if !present().contains(&true) {
            return Ok(vec![false; keys.len()]);
        }
        let mut writer = lock(&self.writer);
        let mut logged = Vec::new();
        let mut failure = None;
        for (i, is_present) in present().into_iter().enumerate() {
            if !is_present {
                continue;
            }
            let record = format::encode_record(format::KIND_REMOVE, keys[i].as_bytes(), 0, &[]);
            match self.append(&mut writer, &record) {
                Ok(_) => logged.push(i),
                Err(err) => {
                    failure = Some(err);
                    break;
                }
            }
        }
        let mut removed = vec![false; keys.len()];
        if !logged.is_empty() {
            self.sync_active(&writer)?;
            let live = self.live();
            let mut index = self.write_index();
            for i in logged {
                removed[i] = index.remove(keys[i].as_bytes(), live).is_some();
            }
        }
        failure.map_or(Ok(removed), Err)
    }

    /// Appends a record to the active segment (rolling and evicting as
    /// needed); returns its segment and offset. Durable only after
    /// [`sync_active`](Self::sync_active) (or a roll).
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
        writer.active_len += len;
        writer.total_bytes += len;
        if let Some(bytes) = writer.segments.get_mut(&writer.active_id) {
            *bytes = writer.active_len;
        }
        Ok((writer.active_id, offset))
    }

    /// Makes the appended records durable as the policy asks: fsyncs the
    /// active segment under [`FsyncPolicy::Always`] (a roll synced the
    /// segments before it).
    fn sync_active(&self, writer: &Writer) -> Result<(), DiskError> {
        if self.config.fsync != FsyncPolicy::Always {
            return Ok(());
        }
        writer.active.sync_data().map_err(|e| {
            DiskError::io(
                "sync segment",
                self.dir.join(segment_name(writer.active_id)),
                e,
            )
        })
    }

    /// Closes the active segment and starts the next. Under
    /// [`FsyncPolicy::Always`] the closed segment is synced first (its
    /// stores were acknowledged as durable); under `Never` it is left to
    /// the operating system, as every store of that policy is.
    pub(crate) fn roll(&self, writer: &mut Writer) -> Result<(), DiskError> {
        let old = self.dir.join(segment_name(writer.active_id));
        if self.config.fsync == FsyncPolicy::Always {
            writer
                .active
                .sync_all()
                .map_err(|e| DiskError::io("sync segment", &old, e))?;
        }
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

    /// Grows the index if `extra` more keys would pass its load factor.
    ///
    /// The grown index is built from the current one under the read lock
    /// (lookups and loads go on; the writer lock, held by the caller, keeps
    /// every slot as it is meanwhile), flushed and renamed into place, and
    /// only then swapped in under a momentary write lock. A crash at any
    /// point leaves one complete index file, the old or the new one, which
    /// is recounted at the next open.
    fn grow_for(&self, _writer: &Writer, extra: u64) -> Result<(), DiskError> {
        let live = self.live();
        let mut next = {
            let index = self.read_index();
            if !index.needs_rehash_before(extra) {
                return Ok(());
            }
            index.grown(&self.dir.join(INDEX_TMP), live, extra)?
        };
        next.rename_to(&self.dir.join(INDEX_FILE))?;
        #[cfg(test)]
        self.pause.at(crate::pause::Pause::Rehash);
        let (from, to, keys) = (
            self.read_index().slot_count(),
            next.slot_count(),
            next.len(),
        );
        // The old index is unmapped after the lock is released.
        let old = std::mem::replace(&mut *self.write_index(), next);
        drop(old);
        self.counters.rehashes.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(from, to, keys, "index rehashed");
        // From the rename on, the file in use is the one on disk; the
        // directory sync makes the rename durable.
        sync_dir(&self.dir)
    }
}
