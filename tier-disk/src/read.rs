//! The read path: a load finds its key's location in the index, then reads
//! and checks the record. A record that fails a check turns its key into a
//! miss.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use kvtier_core::OffloadKey;

use crate::error::DiskError;
use crate::format::{self, Location};
use crate::{DiskTier, lock, segment_name};

impl DiskTier {
    /// Loads the payload of `key` on the calling thread, or `None` if it is
    /// not stored (the synchronous form of
    /// [`BlockStore::load`](kvtier_core::BlockStore::load)). A record that
    /// fails its checks (checksum, length, key, kind), lies beyond the end
    /// of its segment or whose segment file is missing is a miss: its entry
    /// is removed and `corrupt_loads` counts it.
    ///
    /// # Errors
    /// [`DiskError::WrongKeySize`]; [`DiskError::Io`] when the segment
    /// cannot be opened or read. That failed load too removes the entry and
    /// counts in `corrupt_loads`, so the key is not a hit again.
    pub fn load_blocking(&self, key: &OffloadKey) -> Result<Option<Vec<u8>>, DiskError> {
        self.check_key(key)?;
        let live = self.live();
        let location = self.read_index().find(key.as_bytes(), live);
        match location {
            Some((_, location)) => self.read_record(key, &location),
            None => Ok(None),
        }
    }

    /// The payload of each key, in order, finding every location under one
    /// index lock; as [`load_blocking`](Self::load_blocking) for each key.
    ///
    /// # Errors
    /// [`DiskError::WrongKeySize`] if any key has the wrong length (nothing
    /// is loaded then); the first [`DiskError::Io`].
    pub fn load_many_blocking(
        &self,
        keys: &[OffloadKey],
    ) -> Result<Vec<Option<Vec<u8>>>, DiskError> {
        for key in keys {
            self.check_key(key)?;
        }
        let live = self.live();
        let locations: Vec<Option<Location>> = {
            let index = self.read_index();
            keys.iter()
                .map(|key| index.find(key.as_bytes(), live).map(|(_, at)| at))
                .collect()
        };
        keys.iter()
            .zip(locations)
            .map(|(key, location)| match location {
                Some(location) => self.read_record(key, &location),
                None => Ok(None),
            })
            .collect()
    }

    /// Reads and checks the record the index says `key` has at `location`.
    fn read_record(
        &self,
        key: &OffloadKey,
        location: &Location,
    ) -> Result<Option<Vec<u8>>, DiskError> {
        let path = self.dir.join(segment_name(location.segment));
        let file = match self.segment_reader(location.segment) {
            Ok(file) => file,
            Err(err) => {
                self.failed_load(key, location, &path, &err.to_string());
                return Err(err);
            }
        };
        let Some(file) = file else {
            if !self.live().contains(location.segment) {
                // Evicted between the lookup and now: a plain miss.
                return Ok(None);
            }
            self.failed_load(key, location, &path, "segment file missing");
            return Ok(None);
        };
        if location.record_len as usize
            != format::record_size(self.config.key_len, location.payload_len as usize)
        {
            self.failed_load(key, location, &path, "impossible record length");
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
                self.failed_load(key, location, &path, &err.to_string());
                return Err(err);
            }
        };
        match checked {
            Ok(payload) => {
                self.counters.loads.fetch_add(1, Ordering::Relaxed);
                Ok(Some(payload))
            }
            Err(reason) => {
                self.failed_load(key, location, &path, &reason);
                Ok(None)
            }
        }
    }

    /// A load that found no valid record: the key turns into a miss, its
    /// entry is removed (unless a newer store replaced it) and it is counted.
    fn failed_load(&self, key: &OffloadKey, location: &Location, path: &Path, reason: &str) {
        tracing::warn!(segment = %path.display(), offset = location.offset, %reason, "corrupt record; removing its key");
        self.counters.corrupt_loads.fetch_add(1, Ordering::Relaxed);
        if self.dir_lock.check_owner().is_err() {
            // A forked child reads the parent's index but never changes it.
            return;
        }
        // Index changes are the writer's: wait for it (a rehash in
        // progress, at worst; this is the rare path).
        let _writer = lock(&self.writer);
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
}
