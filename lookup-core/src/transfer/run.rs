//! Running one job: its keys in chunks of at most `chunk_bytes`, each one
//! batch call of the tier over slices of the job's buffer (the one place
//! the buffer's memory is borrowed), the deadline and a stop checked
//! between chunks; then the report, once nothing touches the buffer.

use std::future::Future;
use std::ops::Range;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::task::Poll;
use std::time::Instant;

use super::buffer::{HostBuffer, Region};
use super::job::{Job, JobKind, JobReport};
use super::state::Shared;
use crate::error::{TierError, TierErrorKind};
use crate::key::OffloadKey;
use crate::store::{BlockOutcome, DynBlockStore};

/// A job being run. Whatever ends it (its last chunk, a panic, its task
/// dropped by a runtime shutting down, or never being started at all), it
/// reports exactly once, after the tier call has been dropped and the
/// buffer let go of.
pub(super) struct JobRun {
    shared: Arc<Shared>,
    job: Job,
    /// Per key: `None` until its chunk has answered.
    outcomes: Vec<Option<BlockOutcome>>,
    started: Option<Instant>,
    reported: bool,
}

/// Why the keys not yet copied will not be.
enum Stop {
    Deadline,
    Cancelled,
}

impl JobRun {
    pub(super) fn new(shared: Arc<Shared>, job: Job) -> Self {
        let outcomes = vec![None; job.keys.len()];
        Self {
            shared,
            job,
            outcomes,
            started: None,
            reported: false,
        }
    }

    /// The job's keys in order, cut into runs of at most `chunk_bytes`
    /// bytes (at least one key each).
    fn chunks(&self) -> Vec<Range<usize>> {
        let limit = self.shared.config.chunk_bytes;
        let mut chunks = Vec::new();
        let mut from = 0;
        let mut bytes = 0u64;
        for (i, region) in self.job.regions.iter().enumerate() {
            let len = region.len as u64;
            if i > from && bytes.saturating_add(len) > limit {
                chunks.push(from..i);
                from = i;
                bytes = 0;
            }
            bytes = bytes.saturating_add(len);
        }
        if from < self.job.regions.len() {
            chunks.push(from..self.job.regions.len());
        }
        chunks
    }

    fn should_stop(&self) -> Option<Stop> {
        if self.shared.stop.load(std::sync::atomic::Ordering::Acquire) {
            Some(Stop::Cancelled)
        } else if Instant::now() >= self.job.deadline {
            Some(Stop::Deadline)
        } else {
            None
        }
    }

    fn stop_error(&self, stop: &Stop) -> TierError {
        match stop {
            Stop::Deadline => TierError::new(
                TierErrorKind::Timeout,
                format!(
                    "job {} passed its deadline before this key was copied",
                    self.job.id
                ),
            ),
            Stop::Cancelled => TierError::new(
                TierErrorKind::Cancelled,
                format!(
                    "job {} was stopped by a shutdown before this key was copied",
                    self.job.id
                ),
            ),
        }
    }

    /// Records a chunk's answer (or its failure) for its keys.
    fn record(&mut self, chunk: Range<usize>, answer: Result<Vec<BlockOutcome>, TierError>) {
        let n = chunk.len();
        let outcomes = match answer {
            Ok(outcomes) if outcomes.len() == n => outcomes,
            Ok(outcomes) => BlockOutcome::all_failed(
                n,
                TierError::new(
                    TierErrorKind::WrongResultCount,
                    format!("the tier answered {} outcomes for {n} keys", outcomes.len()),
                ),
            ),
            Err(err) => BlockOutcome::all_failed(n, err),
        };
        if let Some(slots) = self.outcomes.get_mut(chunk) {
            for (slot, outcome) in slots.iter_mut().zip(outcomes) {
                *slot = Some(outcome);
            }
        }
    }

    /// Fails every key without an outcome yet.
    fn fail_rest(&mut self, err: TierError) {
        let err = Arc::new(err);
        for slot in self.outcomes.iter_mut().filter(|o| o.is_none()) {
            *slot = Some(BlockOutcome::Failed(Arc::clone(&err)));
        }
    }

    /// Runs the job on a runtime task: each chunk's call is dropped at the
    /// deadline or when the queue aborts.
    pub(super) async fn run_async(mut self) {
        let started = Instant::now();
        self.started = Some(started);
        let deadline = tokio::time::Instant::from_std(self.job.deadline);
        for chunk in self.chunks() {
            if let Some(stop) = self.should_stop() {
                let err = self.stop_error(&stop);
                self.fail_rest(err);
                break;
            }
            let answer = {
                let call = catch_unwind(copy_chunk(
                    self.shared.store.as_ref(),
                    &self.job,
                    chunk.clone(),
                ));
                tokio::select! {
                    biased;
                    answer = call => answer,
                    () = tokio::time::sleep_until(deadline) => Err(self.stop_error(&Stop::Deadline)),
                    () = self.shared.abort.wait() => Err(TierError::new(
                        TierErrorKind::Cancelled,
                        format!("job {}: its copy was dropped by a shutdown", self.job.id),
                    )),
                }
            };
            self.record(chunk, answer);
        }
        self.report(true);
    }

    /// Runs the job on a blocking thread, each chunk's call driven by
    /// `handle`; the deadline and a stop are checked between chunks (a
    /// blocking copy cannot be cut).
    pub(super) fn run_blocking(mut self, handle: &tokio::runtime::Handle) {
        self.started = Some(Instant::now());
        for chunk in self.chunks() {
            if let Some(stop) = self.should_stop() {
                let err = self.stop_error(&stop);
                self.fail_rest(err);
                break;
            }
            let answer = handle.block_on(catch_unwind(copy_chunk(
                self.shared.store.as_ref(),
                &self.job,
                chunk.clone(),
            )));
            self.record(chunk, answer);
        }
        self.report(true);
    }

    /// Publishes the report: every key without an outcome fails, the
    /// buffer is let go of first.
    fn report(&mut self, ran: bool) {
        if self.reported {
            return;
        }
        self.reported = true;
        if self.outcomes.iter().any(Option::is_none) {
            let err = if ran {
                TierError::new(
                    TierErrorKind::Unavailable,
                    format!(
                        "job {}: its task ended early (its runtime shut down)",
                        self.job.id
                    ),
                )
            } else {
                TierError::new(
                    TierErrorKind::Unavailable,
                    format!(
                        "job {}: the runtime is shut down; it never started",
                        self.job.id
                    ),
                )
            };
            self.fail_rest(err);
        }
        // Nothing borrows the buffer any more: the chunk calls are dropped.
        drop(self.job.buffer.take());
        let outcomes: Vec<BlockOutcome> = self.outcomes.drain(..).flatten().collect();
        let bytes = outcomes
            .iter()
            .zip(&self.job.regions)
            .filter(|(o, _)| o.is_done())
            .map(|(_, r)| r.len as u64)
            .sum();
        let now = Instant::now();
        let started = self.started.unwrap_or(now);
        let report = JobReport {
            id: self.job.id,
            kind: self.job.kind,
            keys: std::mem::take(&mut self.job.keys),
            outcomes,
            bytes,
            transfer_time: now.saturating_duration_since(started),
            queued_time: started.saturating_duration_since(self.job.submitted),
        };
        tracing::debug!(
            job = report.id.0,
            kind = ?report.kind,
            keys = report.keys.len(),
            bytes = report.bytes,
            ok = report.ok(),
            seconds = report.transfer_time.as_secs_f64(),
            "transfer job ended"
        );
        let claimed = std::mem::take(&mut self.job.claimed);
        self.shared.finish(report, &claimed, ran);
    }
}

impl Drop for JobRun {
    fn drop(&mut self) {
        let ran = self.started.is_some();
        self.report(ran);
    }
}

/// One batch call of the tier over keys `chunk` of `job`, on slices of
/// its buffer.
async fn copy_chunk(
    store: &dyn DynBlockStore,
    job: &Job,
    chunk: Range<usize>,
) -> Vec<BlockOutcome> {
    let (Some(buffer), Some(keys), Some(regions)) = (
        job.buffer.as_deref(),
        job.keys.get(chunk.clone()),
        job.regions.get(chunk.clone()),
    ) else {
        return BlockOutcome::all_failed(
            chunk.len(),
            TierError::new(TierErrorKind::Other, "a job ran without its buffer"),
        );
    };
    match job.kind {
        JobKind::Store => {
            // SAFETY: the regions lie inside the buffer (checked at submit),
            // which `job` keeps alive and in place while it is borrowed here
            // (HostBuffer contract, rule 1). No load job of this queue
            // writes into them (its claim is checked against every load's),
            // nor does anyone else (rule 3): shared slices are sound.
            let blocks = unsafe { slices(keys, regions, buffer) };
            store.store_batch_dyn(&blocks).await
        }
        JobKind::Load => {
            // SAFETY: as for a store, the regions are inside the live
            // buffer. The buffer is writable (checked at submit; rule 2).
            // The regions of this job are disjoint (checked at submit) and
            // overlap no region of any other job of the queue (its claim),
            // and nothing else touches them (rule 3). This is the chunk's
            // only call, and chunks run one after the other: each mutable
            // slice is the only access to its bytes while it lives.
            let mut targets = unsafe { slices_mut(keys, regions, buffer) };
            store.load_batch_dyn(&mut targets).await
        }
    }
}

/// Each key with its region of `buffer`, as a shared slice.
///
/// # Safety
/// Every region lies inside the buffer, and no byte of them is written
/// while the slices live.
unsafe fn slices<'a>(
    keys: &'a [OffloadKey],
    regions: &[Region],
    buffer: &'a dyn HostBuffer,
) -> Vec<(&'a OffloadKey, &'a [u8])> {
    let base = buffer.as_ptr();
    keys.iter()
        .zip(regions)
        .map(|(key, region)| {
            if region.len == 0 {
                return (key, &[][..]);
            }
            // SAFETY: in bounds and unwritten, as the caller promises.
            (key, unsafe {
                std::slice::from_raw_parts(base.add(region.offset), region.len)
            })
        })
        .collect()
}

/// Each key with its region of `buffer`, as a mutable slice.
///
/// # Safety
/// The buffer is writable, every region lies inside it, the regions are
/// disjoint, and nothing else reads or writes their bytes while the slices
/// live.
// The mutable slices come from a shared handle on purpose: the buffer is
// memory the queue shares with its owner, and the exclusivity the borrow
// checker cannot see is the caller's promise above.
#[allow(clippy::mut_from_ref)]
unsafe fn slices_mut<'a>(
    keys: &'a [OffloadKey],
    regions: &[Region],
    buffer: &'a dyn HostBuffer,
) -> Vec<(&'a OffloadKey, &'a mut [u8])> {
    let base = buffer.as_ptr().cast_mut();
    keys.iter()
        .zip(regions)
        .map(|(key, region)| {
            if region.len == 0 {
                return (key, &mut [][..]);
            }
            // SAFETY: in bounds, writable and exclusive, as the caller
            // promises.
            (key, unsafe {
                std::slice::from_raw_parts_mut(base.add(region.offset), region.len)
            })
        })
        .collect()
}

/// Runs `future`, turning a panic in its poll into an error for its keys.
async fn catch_unwind<T>(future: impl Future<Output = T>) -> Result<T, TierError> {
    let mut future = std::pin::pin!(future);
    std::future::poll_fn(move |cx| {
        match std::panic::catch_unwind(AssertUnwindSafe(|| future.as_mut().poll(cx))) {
            Ok(Poll::Ready(value)) => Poll::Ready(Ok(value)),
            Ok(Poll::Pending) => Poll::Pending,
            Err(_) => Poll::Ready(Err(TierError::new(
                TierErrorKind::Panicked,
                "the tier panicked in a batch store or load",
            ))),
        }
    })
    .await
}
