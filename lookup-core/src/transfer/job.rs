//! A transfer job as submitted ([`TransferJob`]), as checked and queued
//! (`Job`), and as reported ([`JobReport`]).

use std::fmt;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::buffer::{HostBuffer, Region};
use crate::key::OffloadKey;
use crate::store::{BlockOutcome, SharedTierError};

/// A job's number, unique within its queue, in submission order from 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct JobId(pub u64);

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Which way a job copies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum JobKind {
    /// From the buffer's regions into the tier.
    Store,
    /// From the tier into the buffer's regions.
    Load,
}

/// A store or load of blocks between a host buffer's regions and the
/// tier, one region per key, to submit to a
/// [`TransferQueue`](super::TransferQueue).
#[derive(Clone)]
pub struct TransferJob {
    pub(super) kind: JobKind,
    pub(super) keys: Vec<OffloadKey>,
    pub(super) buffer: Arc<dyn HostBuffer>,
    pub(super) regions: Vec<Region>,
    pub(super) timeout: Option<Duration>,
}

impl TransferJob {
    /// Stores `buffer[regions[i]]` under `keys[i]`, for each `i`.
    pub fn store(keys: Vec<OffloadKey>, buffer: Arc<dyn HostBuffer>, regions: Vec<Region>) -> Self {
        Self {
            kind: JobKind::Store,
            keys,
            buffer,
            regions,
            timeout: None,
        }
    }

    /// Loads the block of `keys[i]` into `buffer[regions[i]]`, for each
    /// `i`; each region must be exactly as long as the stored block.
    pub fn load(keys: Vec<OffloadKey>, buffer: Arc<dyn HostBuffer>, regions: Vec<Region>) -> Self {
        Self {
            kind: JobKind::Load,
            ..Self::store(keys, buffer, regions)
        }
    }

    /// Gives the job `timeout` from submission to finish, instead of the
    /// queue's [`job_timeout_ms`](super::TransferConfig::job_timeout_ms).
    #[must_use]
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Which way it copies.
    pub fn kind(&self) -> JobKind {
        self.kind
    }
}

impl fmt::Debug for TransferJob {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TransferJob")
            .field("kind", &self.kind)
            .field("keys", &self.keys.len())
            .field("buffer_len", &self.buffer.len())
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// Why a job was refused at submission (nothing of it runs).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SubmitError {
    /// Not one region per key.
    #[error("{keys} keys but {regions} regions: a job needs one region per key")]
    RegionCount {
        /// Keys of the job.
        keys: usize,
        /// Regions of the job.
        regions: usize,
    },
    /// A region reaches past the end of the buffer.
    #[error(
        "region {index} ({offset}..+{len}) reaches past the end of the buffer of {buffer_len} bytes"
    )]
    OutOfBounds {
        /// The region's position in the job.
        index: usize,
        /// Its first byte.
        offset: usize,
        /// Its length.
        len: usize,
        /// The buffer's length.
        buffer_len: usize,
    },
    /// A load into a buffer that is not writable.
    #[error("a load needs a writable buffer; this one is read-only")]
    ReadOnlyBuffer,
    /// Two regions of one load overlap: two blocks would be written into
    /// the same bytes.
    #[error("regions {first} and {second} of the load overlap")]
    Overlap {
        /// The first region's position.
        first: usize,
        /// The second region's position.
        second: usize,
    },
    /// A region overlaps memory that a queued or running job of the same
    /// queue writes (or, for a load, reads or writes).
    #[error(
        "region {index} overlaps a region of another job still queued or running (a load's regions may overlap no other job's, a store's no load's)"
    )]
    Busy {
        /// The region's position in the job.
        index: usize,
    },
    /// A load's region is not the length of the block stored under its
    /// key, as the store knows it without I/O
    /// ([`BlockStore::known_len`](crate::BlockStore::known_len)): the load
    /// would fail for that key.
    #[error(
        "region {index} is {region} bytes but the block stored under its key is {stored}: a load needs a region of the block's length"
    )]
    LengthMismatch {
        /// The region's position in the job.
        index: usize,
        /// The stored block's length.
        stored: usize,
        /// The region's length.
        region: usize,
    },
    /// The queue is shut down.
    #[error("the transfer queue is shut down")]
    ShutDown,
}

/// How a job ended, as [`TransferQueue::poll`](super::TransferQueue::poll)
/// returns it: published only once the job's I/O has stopped touching its
/// buffer (and the queue has let go of the buffer).
#[derive(Debug, Clone)]
pub struct JobReport {
    /// The job.
    pub id: JobId,
    /// Store or load.
    pub kind: JobKind,
    /// The job's keys, in submission order.
    pub keys: Vec<OffloadKey>,
    /// One outcome per key: [`Done`](BlockOutcome::Done) stored or loaded;
    /// [`Absent`](BlockOutcome::Absent) (loads) not in the tier, its region
    /// untouched; [`Failed`](BlockOutcome::Failed) otherwise: the tier's
    /// error, or kind [`Timeout`](crate::TierErrorKind::Timeout) past the
    /// job's deadline, or [`Cancelled`](crate::TierErrorKind::Cancelled)
    /// by a drain or a shutdown before the key's copy started.
    pub outcomes: Vec<BlockOutcome>,
    /// Bytes of the keys `Done`.
    pub bytes: u64,
    /// From the start of the job's first copy to the end of its last
    /// (zero if it never started).
    pub transfer_time: Duration,
    /// From submission to the start of the first copy (or to the end, if
    /// it never started).
    pub queued_time: Duration,
}

impl JobReport {
    /// Whether every key is `Done`.
    pub fn ok(&self) -> bool {
        self.outcomes.iter().all(BlockOutcome::is_done)
    }

    /// The keys `Done`, in order.
    pub fn successful_keys(&self) -> impl Iterator<Item = &OffloadKey> {
        self.keys
            .iter()
            .zip(&self.outcomes)
            .filter(|(_, o)| o.is_done())
            .map(|(k, _)| k)
    }

    /// The keys not `Done` (absent or failed), in order: the ones an engine
    /// marks as misses after a load.
    pub fn unsuccessful_keys(&self) -> impl Iterator<Item = &OffloadKey> {
        self.keys
            .iter()
            .zip(&self.outcomes)
            .filter(|(_, o)| !o.is_done())
            .map(|(k, _)| k)
    }

    /// The error of the first key that failed, by position.
    pub fn first_error(&self) -> Option<&SharedTierError> {
        self.outcomes.iter().find_map(BlockOutcome::error)
    }
}

/// A checked job, queued or running: everything the queue needs to run it
/// and to release its claims.
pub(super) struct Job {
    pub(super) id: JobId,
    pub(super) kind: JobKind,
    pub(super) keys: Vec<OffloadKey>,
    /// `None` once the job has let go of it.
    pub(super) buffer: Option<Arc<dyn HostBuffer>>,
    pub(super) regions: Vec<Region>,
    /// The regions as address ranges, as claimed in the queue's `Busy`.
    pub(super) claimed: Vec<Range<usize>>,
    pub(super) bytes: u64,
    pub(super) submitted: Instant,
    pub(super) deadline: Instant,
}

impl Job {
    /// The report of a job that never started: every key `Failed` with `err`.
    pub(super) fn unstarted_report(
        mut self,
        err: SharedTierError,
    ) -> (JobReport, Vec<Range<usize>>) {
        drop(self.buffer.take());
        let outcomes = vec![BlockOutcome::Failed(err); self.keys.len()];
        let report = JobReport {
            id: self.id,
            kind: self.kind,
            keys: std::mem::take(&mut self.keys),
            outcomes,
            bytes: 0,
            transfer_time: Duration::ZERO,
            queued_time: self.submitted.elapsed(),
        };
        (report, std::mem::take(&mut self.claimed))
    }
}

/// Checks `job` against its buffer: one region per key, each in bounds,
/// a writable buffer and disjoint regions for a load. Returns the regions
/// as address ranges and the job's bytes.
pub(super) fn check(job: &TransferJob) -> Result<(Vec<Range<usize>>, u64), SubmitError> {
    if job.keys.len() != job.regions.len() {
        return Err(SubmitError::RegionCount {
            keys: job.keys.len(),
            regions: job.regions.len(),
        });
    }
    let buffer_len = job.buffer.len();
    let base = job.buffer.as_ptr() as usize;
    let mut ranges = Vec::with_capacity(job.regions.len());
    let mut bytes = 0u64;
    for (index, region) in job.regions.iter().enumerate() {
        let out = SubmitError::OutOfBounds {
            index,
            offset: region.offset,
            len: region.len,
            buffer_len,
        };
        let end = region
            .end()
            .filter(|&end| end <= buffer_len)
            .ok_or(out.clone())?;
        let start = base.checked_add(region.offset).ok_or(out.clone())?;
        let end = base.checked_add(end).ok_or(out)?;
        ranges.push(start..end);
        bytes = bytes.saturating_add(region.len as u64);
    }
    if job.kind == JobKind::Load {
        if !job.buffer.is_writable() {
            return Err(SubmitError::ReadOnlyBuffer);
        }
        if let Some((first, second)) = super::busy::overlapping_pair(&ranges) {
            return Err(SubmitError::Overlap { first, second });
        }
    }
    Ok((ranges, bytes))
}
