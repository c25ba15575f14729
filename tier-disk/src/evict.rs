//! Eviction: past `capacity_bytes`, the oldest segment goes, as a whole.
//!
//! The segment stops counting at once (the oldest live segment id moves
//! past it, so lookups miss its keys from then on), then its file is
//! removed, then its slots are cleared. A crash in between leaves slots that
//! point below the oldest segment: they read as absent, and the recount at
//! the next open turns them into tombstones.

use std::sync::atomic::Ordering;

use crate::error::DiskError;
use crate::{DiskTier, Writer, lock, segment_name};

/// Slots one step of an eviction's clearing looks at: the index's write
/// lock is held for at most this many slot writes at a time.
const CLEAR_CHUNK: u64 = 4096;

impl DiskTier {
    pub(crate) fn evict_oldest(&self, writer: &mut Writer) -> Result<(), DiskError> {
        let Some((&id, &bytes)) = writer.segments.iter().next() else {
            return Ok(());
        };
        if id == writer.active_id {
            return Ok(());
        }
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
        let cleared = self.clear_segment_slots(writer, id);
        self.counters
            .evicted_segments
            .fetch_add(1, Ordering::Relaxed);
        self.counters
            .evicted_keys
            .fetch_add(cleared, Ordering::Relaxed);
        tracing::debug!(segment = id, keys = cleared, "evicted segment");
        Ok(())
    }

    /// Turns every slot of the evicted `segment` into a tombstone, a chunk
    /// at a time: each chunk's slots are found under the read lock, then
    /// cleared under a momentary write lock. Lookups already miss the
    /// segment's keys, cleared or not; the writer lock (held by the caller)
    /// keeps every other slot as it is meanwhile. Returns how many.
    fn clear_segment_slots(&self, _writer: &Writer, segment: u64) -> u64 {
        let slot_count = self.read_index().slot_count();
        let mut cleared = 0;
        let mut start = 0;
        while start < slot_count {
            let end = start.saturating_add(CLEAR_CHUNK).min(slot_count);
            let found = self.read_index().live_slots_of(start..end, segment);
            #[cfg(test)]
            if start == 0 {
                self.pause.at(crate::pause::Pause::Evict);
            }
            if !found.is_empty() {
                cleared += self.write_index().tombstone_slots(&found, segment);
            }
            start = end;
        }
        cleared
    }
}
