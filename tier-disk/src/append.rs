//! Appending a batch of records: each record's head is encoded into one
//! buffer for the batch, and the records that share a segment go to it in
//! one vectored write straight from the caller's payloads (no copy of a
//! payload into a record buffer). What each key ended as is an
//! [`Appended`].

use std::io::IoSlice;

use kvtier_core::{BlockOutcome, OffloadKey, TierError};

use crate::error::DiskError;
use crate::format::{self, GAP_ZEROS, Location, RECORD_HEADER_SIZE, RECORD_PADDING};
use crate::{DiskTier, Writer, segment_name, vectored};

/// What a batch store did with each key: stored, or failed with one of
/// `errors` (a failure that stops the batch is shared by every key after it).
#[derive(Debug)]
pub(crate) struct Appended {
    /// Per key, in order: `None` stored, `Some(i)` failed with `errors[i]`.
    failed: Vec<Option<usize>>,
    errors: Vec<DiskError>,
}

impl Appended {
    /// Every key stored, until told otherwise.
    pub(crate) fn new(keys: usize) -> Self {
        Self {
            failed: vec![None; keys],
            errors: Vec::new(),
        }
    }

    /// Key `i` failed with `err`.
    pub(crate) fn fail(&mut self, i: usize, err: DiskError) {
        self.failed[i] = Some(self.errors.len());
        self.errors.push(err);
    }

    /// Every key of `keys` failed with `err`.
    pub(crate) fn fail_all(&mut self, keys: impl IntoIterator<Item = usize>, err: DiskError) {
        let at = self.errors.len();
        self.errors.push(err);
        for i in keys {
            self.failed[i] = Some(at);
        }
    }

    /// The first error by key position, if any (the batch's error for the
    /// all-or-nothing forms).
    pub(crate) fn first_error(mut self) -> Option<DiskError> {
        let at = self.failed.iter().flatten().next().copied()?;
        Some(self.errors.swap_remove(at))
    }

    /// One outcome per key; an error shared by several keys is converted once.
    pub(crate) fn into_outcomes(self) -> Vec<BlockOutcome> {
        let shared: Vec<_> = self
            .errors
            .into_iter()
            .map(|err| std::sync::Arc::new(TierError::from(err)))
            .collect();
        self.failed
            .into_iter()
            .map(|failed| match failed.and_then(|at| shared.get(at)) {
                Some(err) => BlockOutcome::Failed(std::sync::Arc::clone(err)),
                None => BlockOutcome::Done,
            })
            .collect()
    }
}

/// A record placed in the active segment: the batch position of its block
/// and where it lives.
pub(crate) struct Placed {
    pub(crate) block: usize,
    pub(crate) location: Location,
}

impl DiskTier {
    /// Appends the records of `blocks[i]` for each `i` of `todo`, in order,
    /// rolling to a new segment and evicting the oldest as needed, with one
    /// vectored write per run of records sharing a segment. Returns the
    /// records written, in order; on an error, those written before it and
    /// the error (the records after it are not written, or not counted).
    pub(crate) fn append_blocks(
        &self,
        writer: &mut Writer,
        blocks: &[(&OffloadKey, &[u8])],
        todo: &[usize],
    ) -> (Vec<Placed>, Option<DiskError>) {
        let head_len = RECORD_HEADER_SIZE + self.config.key_len;
        // Record `j` of `todo` has its head at `heads[j * head_len..]`.
        let mut heads = vec![0u8; head_len * todo.len()];
        let mut placed: Vec<Placed> = Vec::with_capacity(todo.len());
        // `placed[run..]` are counted in the active segment from
        // `run_offset` on, but not written yet.
        let mut run = 0;
        let mut run_offset = writer.active_len;
        let mut failure = None;
        for (j, &i) in todo.iter().enumerate() {
            let (key, payload) = blocks[i];
            let key_len = self.config.key_len;
            let size_at = |offset| {
                let gap = format::payload_gap(offset, key_len);
                (gap, format::record_size(key_len, gap, payload.len()))
            };
            let (mut gap, mut record_len) = size_at(writer.active_len);
            if writer.active_len > 0
                && writer.active_len + record_len as u64 > self.config.segment_bytes
            {
                let pending = &heads[run * head_len..j * head_len];
                if let Err(err) =
                    self.write_run(writer, &placed[run..], pending, blocks, run_offset)
                {
                    placed.truncate(run);
                    return (placed, Some(err));
                }
                run = j;
                if let Err(err) = self.roll(writer) {
                    return (placed, Some(err));
                }
                run_offset = 0;
                (gap, record_len) = size_at(0);
            }
            let len = record_len as u64;
            while writer.total_bytes + len > self.config.capacity_bytes && writer.segments.len() > 1
            {
                if let Err(err) = self.evict_oldest(writer) {
                    failure = Some(err);
                    break;
                }
            }
            if failure.is_some() {
                break;
            }
            let payload_crc = crc32fast::hash(payload);
            format::encode_record_head(
                &mut heads[j * head_len..(j + 1) * head_len],
                format::KIND_PUT,
                key.as_bytes(),
                gap as u32,
                payload.len() as u32,
                payload_crc,
            );
            placed.push(Placed {
                block: i,
                location: Location {
                    segment: writer.active_id,
                    offset: writer.active_len,
                    payload_len: payload.len() as u32,
                    payload_crc,
                    record_len: record_len as u32,
                    gap: gap as u32,
                },
            });
            writer.active_len += len;
            writer.total_bytes += len;
            if let Some(bytes) = writer.segments.get_mut(&writer.active_id) {
                *bytes = writer.active_len;
            }
        }
        let pending = &heads[run * head_len..placed.len() * head_len];
        if let Err(err) = self.write_run(writer, &placed[run..], pending, blocks, run_offset) {
            placed.truncate(run);
            return (placed, Some(err));
        }
        (placed, failure)
    }

    /// Writes the records of `run` (counted in the active segment from
    /// `run_offset` on, their heads in `heads`, one after the other) in one
    /// vectored write. On an error the segment's length goes back to
    /// `run_offset`: the records are not there.
    fn write_run(
        &self,
        writer: &mut Writer,
        run: &[Placed],
        heads: &[u8],
        blocks: &[(&OffloadKey, &[u8])],
        run_offset: u64,
    ) -> Result<(), DiskError> {
        if run.is_empty() {
            return Ok(());
        }
        let head_len = RECORD_HEADER_SIZE + self.config.key_len;
        let mut slices = Vec::with_capacity(4 * run.len());
        for (record, head) in run.iter().zip(heads.chunks_exact(head_len)) {
            let payload = blocks[record.block].1;
            let gap = record.location.gap as usize;
            let padding = record.location.record_len as usize - head_len - gap - payload.len();
            slices.push(IoSlice::new(head));
            if gap > 0 {
                slices.push(IoSlice::new(&GAP_ZEROS[..gap]));
            }
            slices.push(IoSlice::new(payload));
            if padding > 0 {
                slices.push(IoSlice::new(&RECORD_PADDING[..padding]));
            }
        }
        let written = vectored::write_all_at(&writer.active, &mut slices, run_offset);
        written.map_err(|e| {
            let run_bytes = writer.active_len - run_offset;
            writer.active_len = run_offset;
            writer.total_bytes -= run_bytes;
            if let Some(bytes) = writer.segments.get_mut(&writer.active_id) {
                *bytes = run_offset;
            }
            DiskError::io(
                "write segment",
                self.dir.join(segment_name(writer.active_id)),
                e,
            )
        })
    }
}
