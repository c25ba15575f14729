//! The read path: a load finds its key's location in the index, then reads
//! the record (its payload into the caller's region for a batch: straight
//! in, or on CPUs with AVX-512 and `VPCLMULQDQ` through a 512 KiB buffer per
//! loading thread with the check folded into the copy) and checks it. A
//! record that fails a check turns its key into a miss.

use std::fs::File;
use std::io::IoSliceMut;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use kvtier_core::{BlockOutcome, LengthMismatch, OffloadKey};

use crate::error::{DiskError, FormatError};
use crate::format::{self, Location, MAX_GAP, RECORD_HEADER_SIZE};
use crate::{DiskTier, copycrc, lock, segment_name, vectored};

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
        let locations = self.locations(keys.iter());
        keys.iter()
            .zip(locations)
            .map(|(key, location)| match location {
                Some(location) => self.read_record(key, &location),
                None => Ok(None),
            })
            .collect()
    }

    /// Loads each key's payload into its region, answering per key (the
    /// synchronous form of
    /// [`BlockStore::load_batch`](kvtier_core::BlockStore::load_batch)).
    /// Every location is found under one index lock; each record is then
    /// read, its head into a buffer kept for the batch and its payload into
    /// the region (piece by piece, checksummed as it goes: see
    /// `read_piecewise`), and checked (a record that fails its checks is a
    /// miss, as in
    /// [`load_blocking`](Self::load_blocking)). A payload whose length is
    /// not the region's fails with
    /// [`TierErrorKind::LengthMismatch`](kvtier_core::TierErrorKind::LengthMismatch)
    /// and leaves the region untouched.
    pub fn load_batch_blocking(
        &self,
        regions: &mut [(&OffloadKey, &mut [u8])],
    ) -> Vec<BlockOutcome> {
        let locations = self.locations(regions.iter().map(|(key, _)| *key));
        let mut head = vec![0u8; RECORD_HEADER_SIZE + self.config.key_len + MAX_GAP];
        regions
            .iter_mut()
            .zip(locations)
            .map(|((key, region), location)| {
                if let Err(err) = self.check_key(key) {
                    return BlockOutcome::failed(err.into());
                }
                let Some(location) = location else {
                    return BlockOutcome::Absent;
                };
                if location.payload_len as usize != region.len() {
                    return BlockOutcome::failed(LengthMismatch::error(
                        location.payload_len as usize,
                        region.len(),
                    ));
                }
                match self.read_record_into(key, &location, &mut head, region) {
                    Ok(true) => BlockOutcome::Done,
                    Ok(false) => BlockOutcome::Absent,
                    Err(err) => BlockOutcome::failed(err.into()),
                }
            })
            .collect()
    }

    /// Where each key's record lives (`None` for a key not stored, or of
    /// the wrong length), found under one index lock.
    pub(crate) fn locations<'k>(
        &self,
        keys: impl Iterator<Item = &'k OffloadKey>,
    ) -> Vec<Option<Location>> {
        let live = self.live();
        let key_len = self.config.key_len;
        let index = self.read_index();
        keys.map(|key| {
            (key.len() == key_len)
                .then(|| index.find(key.as_bytes(), live).map(|(_, at)| at))
                .flatten()
        })
        .collect()
    }

    /// Reads and checks the record the index says `key` has at `location`,
    /// into a new buffer.
    fn read_record(
        &self,
        key: &OffloadKey,
        location: &Location,
    ) -> Result<Option<Vec<u8>>, DiskError> {
        let mut head = vec![0u8; RECORD_HEADER_SIZE + self.config.key_len + MAX_GAP];
        let mut payload = vec![0u8; location.payload_len as usize];
        Ok(self
            .read_record_into(key, location, &mut head, &mut payload)?
            .then_some(payload))
    }

    /// Reads the record the index says `key` has at `location`: its head
    /// and gap into `head` (`RECORD_HEADER_SIZE + key_len + MAX_GAP` bytes,
    /// the gap's share of it scratch) and its payload
    /// into `payload` (exactly `location.payload_len` bytes), then checks
    /// both. `Ok(false)` when the record fails a check (the key is then a
    /// miss; `payload` holds what was read).
    fn read_record_into(
        &self,
        key: &OffloadKey,
        location: &Location,
        head: &mut [u8],
        payload: &mut [u8],
    ) -> Result<bool, DiskError> {
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
                return Ok(false);
            }
            self.failed_load(key, location, &path, "segment file missing");
            return Ok(false);
        };
        let gap = location.gap as usize;
        let head_len = RECORD_HEADER_SIZE + self.config.key_len;
        if gap > MAX_GAP
            || head.len() < head_len + gap
            || location.record_len as usize
                != format::record_size(self.config.key_len, gap, location.payload_len as usize)
            || payload.len() != location.payload_len as usize
        {
            self.failed_load(key, location, &path, "impossible record length");
            return Ok(false);
        }
        let head = &mut head[..head_len + gap];
        let checked = match read_piecewise(&file, head, payload, location) {
            Ok(()) => match format::parse_record_header(head) {
                Ok((header, stored_key))
                    if stored_key == key.as_bytes()
                        && header.kind == format::KIND_PUT
                        && header.payload_len == location.payload_len
                        && header.payload_crc == location.payload_crc
                        && header.gap == location.gap =>
                {
                    Ok(())
                }
                Ok(_) => Err("record does not match its index entry".to_owned()),
                Err(e) => Err(e.to_string()),
            },
            Err(e) if e.kind() == std::io::ErrorKind::InvalidData => {
                Err(FormatError::Checksum { what: "payload" }.to_string())
            }
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
            Ok(()) => {
                self.counters.loads.fetch_add(1, Ordering::Relaxed);
                Ok(true)
            }
            Err(reason) => {
                self.failed_load(key, location, &path, &reason);
                Ok(false)
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

/// Bytes of payload read per call on CPUs without the fused copy: each
/// piece is checksummed right after it is read, while it is still in the
/// core's cache, instead of in a second pass over the whole payload.
const READ_PIECE: usize = 256 << 10;

/// Bytes of payload read per call on CPUs with the fused copy
/// ([`copycrc::fused`]): each piece goes into a buffer of this size, which
/// stays in the core's L2 cache, and from there to the region with the crc
/// folded into the copy. Measured on a 2-vCPU AMD EPYC (Zen 4) VM, 2 MiB
/// payloads from the page cache, against `pread` straight into the region
/// (2026-12-07): reading into the region and checksumming each 256 KiB
/// piece after it reached 0.77-0.78x; this path 0.85x with 64 KiB, 0.89-0.90x
/// with 128 KiB, 0.89-0.91x with 256 KiB, 0.89-0.92x with 512 KiB and 0.88x
/// with 1 MiB pieces. The kernel's copy into a cached buffer ran at 30 GB/s
/// and the fused copy out of it at 32 GB/s, against 17 GB/s for the kernel's
/// copy into memory.
const BOUNCE_BYTES: usize = 512 << 10;

thread_local! {
    /// Each loading thread's read buffer for the fused path (allocated on
    /// its first load, `BOUNCE_BYTES` plus a page, kept: a new buffer per
    /// load would fault its pages in each time).
    static BOUNCE: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Reads a record's head and gap into `head` and its payload into
/// `payload`, the head with the first piece in one `preadv`, the rest piece
/// by piece, checksumming each piece as it arrives (through a cached buffer
/// with the crc fused into the copy where the CPU allows it, see
/// [`BOUNCE_BYTES`], else straight into `payload`). An error of kind
/// [`InvalidData`](std::io::ErrorKind::InvalidData) when the payload's
/// checksum is not `location.payload_crc`; [`UnexpectedEof`] when the file
/// ends first.
///
/// [`UnexpectedEof`]: std::io::ErrorKind::UnexpectedEof
fn read_piecewise(
    file: &File,
    head: &mut [u8],
    payload: &mut [u8],
    location: &Location,
) -> std::io::Result<()> {
    let crc = if copycrc::fused() {
        BOUNCE.with_borrow_mut(|buffer| {
            read_through(file, head, payload, location.offset, bounce(buffer))
        })?
    } else {
        read_direct(file, head, payload, location.offset)?
    };
    if crc == location.payload_crc {
        Ok(())
    } else {
        Err(std::io::ErrorKind::InvalidData.into())
    }
}

/// The page-aligned `BOUNCE_BYTES` of `buffer`, allocated (with a page
/// to align in) on first use.
fn bounce(buffer: &mut Vec<u8>) -> &mut [u8] {
    if buffer.is_empty() {
        *buffer = vec![0u8; BOUNCE_BYTES + 4096];
    }
    let start = buffer.as_ptr().align_offset(4096);
    &mut buffer[start..start + BOUNCE_BYTES]
}

/// [`read_piecewise`]'s reads straight into `payload`, each piece
/// checksummed after it is read; the payload's crc32.
fn read_direct(
    file: &File,
    head: &mut [u8],
    payload: &mut [u8],
    offset: u64,
) -> std::io::Result<u32> {
    let (first, rest) = payload.split_at_mut(payload.len().min(READ_PIECE));
    let mut at = offset + (head.len() + first.len()) as u64;
    vectored::read_exact_at(
        file,
        &mut [IoSliceMut::new(head), IoSliceMut::new(first)],
        offset,
    )?;
    let mut crc = crc32fast::Hasher::new();
    crc.update(first);
    for piece in rest.chunks_mut(READ_PIECE) {
        file.read_exact_at(piece, at)?;
        crc.update(piece);
        at += piece.len() as u64;
    }
    Ok(crc.finalize())
}

/// [`read_piecewise`]'s reads through `bounce`, each piece copied to
/// `payload` with its crc folded in; the payload's crc32.
fn read_through(
    file: &File,
    head: &mut [u8],
    payload: &mut [u8],
    offset: u64,
    bounce: &mut [u8],
) -> std::io::Result<u32> {
    let first = payload.len().min(bounce.len());
    vectored::read_exact_at(
        file,
        &mut [IoSliceMut::new(head), IoSliceMut::new(&mut bounce[..first])],
        offset,
    )?;
    let mut crc = copycrc::copy_crc(0, &bounce[..first], &mut payload[..first]);
    let mut at = offset + (head.len() + first) as u64;
    for piece in payload[first..].chunks_mut(bounce.len()) {
        let read = &mut bounce[..piece.len()];
        file.read_exact_at(read, at)?;
        crc = copycrc::copy_crc(crc, read, piece);
        at += piece.len() as u64;
    }
    Ok(crc)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file holding a 40-byte head, then `payload`, at offset 100.
    fn record(payload: &[u8]) -> (tempfile::NamedTempFile, u64) {
        let file = tempfile::NamedTempFile::new().unwrap();
        let mut bytes = vec![0xAAu8; 100 + 40];
        bytes.extend_from_slice(payload);
        bytes.extend_from_slice(&[0x55; 300]);
        std::fs::write(file.path(), &bytes).unwrap();
        (file, 100)
    }

    fn payload(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 131 + i / 4099) as u8).collect()
    }

    /// Both read paths (direct, and through the cached buffer, whatever
    /// the CPU: `copy_crc` falls back to a plain copy) give the payload
    /// and its crc, at lengths below, at and across their piece sizes,
    /// into regions of every alignment within a cache line.
    #[test]
    fn both_paths_read_the_payload_and_its_crc() {
        let mut buffer = Vec::new();
        let bounce = bounce(&mut buffer);
        for len in [0, 1, 4097, READ_PIECE + 1, BOUNCE_BYTES, (2 << 20) + 77] {
            let want = payload(len);
            let (file, offset) = record(&want);
            let file = File::open(file.path()).unwrap();
            for align in [0usize, 1, 63] {
                let mut region = vec![0u8; len + 128];
                let at = region.as_ptr().align_offset(64) + align;
                let region = &mut region[at..at + len];
                let mut head = [0u8; 40];
                assert_eq!(
                    read_through(&file, &mut head, region, offset, bounce).unwrap(),
                    crc32fast::hash(&want),
                    "len {len}"
                );
                assert!(*region == want[..] && head == [0xAA; 40]);
                region.fill(0);
                assert_eq!(
                    read_direct(&file, &mut head, region, offset).unwrap(),
                    crc32fast::hash(&want)
                );
                assert!(*region == want[..]);
            }
        }
    }

    /// A payload with one byte changed, anywhere, fails its check on this
    /// CPU's path; one that runs past the end of the file is
    /// `UnexpectedEof`.
    #[test]
    fn a_changed_byte_or_a_short_file_is_caught() {
        let len = (2 << 20) + 77;
        let want = payload(len);
        let location = |offset| Location {
            segment: 0,
            offset,
            record_len: 0,
            payload_len: len as u32,
            payload_crc: crc32fast::hash(&want),
            gap: 0,
        };
        for at in [0, 4095, BOUNCE_BYTES - 1, BOUNCE_BYTES, len - 1] {
            let mut bad = want.clone();
            bad[at] ^= 1;
            let (file, offset) = record(&bad);
            let file = File::open(file.path()).unwrap();
            let mut region = vec![0u8; len];
            let err =
                read_piecewise(&file, &mut [0u8; 40], &mut region, &location(offset)).unwrap_err();
            assert_eq!(err.kind(), std::io::ErrorKind::InvalidData, "byte {at}");
        }
        let (file, offset) = record(&want);
        let file = File::open(file.path()).unwrap();
        let mut region = vec![0u8; len];
        read_piecewise(&file, &mut [0u8; 40], &mut region, &location(offset)).unwrap();
        assert!(region == want);
        let err = read_piecewise(&file, &mut [0u8; 40], &mut region, &location(offset + 400))
            .unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::UnexpectedEof);
    }
}
