//! [`TransferQueue`]: stores and loads of blocks between host memory and a
//! [`BlockStore`], submitted without blocking, run in the background within
//! bounds, and reported per key when polled.
//!
//! # How it works
//!
//! - **Jobs own a handle on the memory, not a borrow.** A job names keys,
//!   a [`HostBuffer`] (held as `Arc<dyn HostBuffer>`) and one [`Region`]
//!   of it per key. [`submit`](TransferQueue::submit) checks the job at
//!   once (one region per key, each in bounds, a writable buffer and
//!   disjoint regions for a load, no overlap with a region another queued
//!   or running job of this queue writes; see [`SubmitError`]), queues it
//!   and returns its [`JobId`]. It never blocks and never waits for I/O.
//! - **Bounded.** Jobs start in order, loads before stores (a promotion
//!   waits for no cascade), while at most
//!   [`max_jobs_in_flight`](TransferConfig::max_jobs_in_flight) jobs and
//!   [`max_bytes_in_flight`](TransferConfig::max_bytes_in_flight) bytes run;
//!   a job larger than the byte bound runs alone. The rest wait queued.
//! - **A job runs in chunks** of at most
//!   [`chunk_bytes`](TransferConfig::chunk_bytes): each chunk is one call of
//!   [`BlockStore::store_batch`] or [`BlockStore::load_batch`] over slices
//!   of the buffer, built in one commented place (`run.rs`). A store whose
//!   futures block their thread
//!   ([`io_blocks_thread`](BlockStore::io_blocks_thread): the disk tier)
//!   runs on the runtime's blocking threads, others as tasks.
//! - **Deadlines.** Each job has one, from submission
//!   ([`job_timeout_ms`](TransferConfig::job_timeout_ms), or
//!   [`TransferJob::with_timeout`]). It is checked before each chunk; an
//!   async tier call still running at the deadline is dropped (its keys
//!   fail as [`Timeout`](crate::TierErrorKind::Timeout); a load's region
//!   then holds unspecified bytes). A blocking call cannot be cut: it is
//!   bounded by one chunk.
//! - **Reports come after the I/O.** A job's [`JobReport`] (per-key
//!   outcomes, the keys that succeeded, bytes, seconds, first error) is
//!   published only once its tier calls are dropped and it has let go of
//!   the buffer, however it ended (its last chunk, a panic in the tier,
//!   its runtime shutting down). So a report in hand means the job no
//!   longer touches the memory, and a buffer's `Arc` is unique again once
//!   every job on it has reported ([`HostMemory`] relies on that).
//! - **Drain** ([`drain`](TransferQueue::drain)) cancels every queued job
//!   (each reports [`Cancelled`](crate::TierErrorKind::Cancelled) for all
//!   its keys) and waits until no job runs: a job that has started runs to
//!   its end or its deadline, so no copy is ever cut in half by a drain.
//!   When it returns idle, nothing touches any job's memory.
//! - **Shutdown** ([`shutdown`](TransferQueue::shutdown)) refuses new jobs,
//!   cancels queued ones, stops running ones at their next chunk, and after
//!   half its timeout drops async tier calls mid-way; it returns within its
//!   timeout. Dropping the queue does the same without waiting.
//!
//! # What cannot be bounded
//!
//! A blocking copy stuck in a system call (a hung network filesystem)
//! cannot be interrupted. Its job keeps running and keeps its buffer alive
//! (the memory is never freed under it); a drain or shutdown that times out
//! says so in its [`DrainReport`] (`idle: false`, the job ids in
//! `still_running`), and the job's report arrives whenever the call
//! returns. That is the case vLLM's `JobResult.deferred_release` exists
//! for: a caller may fail such a load at once and release its rows only
//! when its report arrives.
//!
//! # Example
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//! use kvtier_core::testkit::{FaultConfig, FaultTier};
//! use kvtier_core::{HostMemory, OffloadKey, Region, TransferConfig, TransferQueue};
//!
//! let store = Arc::new(FaultTier::new(FaultConfig::default()));
//! let queue = TransferQueue::new(store, TransferConfig::default())?;
//! let rows = Arc::new(HostMemory::zeroed(4 * 1024)?); // 4 rows of 1 KiB
//! let keys: Vec<OffloadKey> = (0..2u8).map(|i| OffloadKey::new(&[i; 36])).collect();
//!
//! let store_job = queue.submit_store(keys.clone(), rows.clone(), Region::rows([0, 1], 1024).unwrap())?;
//! queue.drain(None);
//! let load_job = queue.submit_load(keys, rows.clone(), Region::rows([2, 3], 1024).unwrap())?;
//! queue.drain(None);
//! let reports = queue.poll();
//! assert_eq!(reports.len(), 2);
//! assert!(reports.iter().all(|r| r.ok() && r.bytes == 2048));
//! # let _ = (store_job, load_job);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod buffer;
mod busy;
mod job;
mod run;
mod state;

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use buffer::{HostAllocError, HostBuffer, HostMemory, Region};
pub use job::{JobId, JobKind, JobReport, SubmitError, TransferJob};

use crate::error::ManagerError;
use crate::key::OffloadKey;
use crate::runtime::Spawner;
use crate::store::{BlockStore, DynBlockStore};
use state::Shared;

/// Bounds of a [`TransferQueue`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TransferConfig {
    /// Most bytes of running jobs (a job larger than this runs alone).
    /// Default 256 MiB.
    pub max_bytes_in_flight: u64,
    /// Most jobs running at once. Default 4.
    pub max_jobs_in_flight: usize,
    /// Most bytes of one tier call: a job runs in chunks of this size, and
    /// its deadline and a shutdown are checked between chunks. Default
    /// 32 MiB.
    pub chunk_bytes: u64,
    /// Time from submission by which a job must end, in milliseconds,
    /// unless the job sets its own. Default 30,000.
    pub job_timeout_ms: u64,
}

impl Default for TransferConfig {
    fn default() -> Self {
        Self {
            max_bytes_in_flight: 256 << 20,
            max_jobs_in_flight: 4,
            chunk_bytes: 32 << 20,
            job_timeout_ms: 30_000,
        }
    }
}

impl TransferConfig {
    /// The most jobs that may run at once.
    pub const MAX_JOBS_IN_FLIGHT: usize = 1024;

    /// Checks every field.
    ///
    /// # Errors
    /// [`ManagerError::InvalidConfig`] naming the first field out of range.
    pub fn validate(&self) -> Result<(), ManagerError> {
        let bad = |field, reason: &str| {
            Err(ManagerError::InvalidConfig {
                field,
                reason: reason.to_owned(),
            })
        };
        if self.max_bytes_in_flight == 0 {
            return bad("max_bytes_in_flight", "must be at least 1");
        }
        if self.max_jobs_in_flight == 0 || self.max_jobs_in_flight > Self::MAX_JOBS_IN_FLIGHT {
            return bad("max_jobs_in_flight", "must be 1 to 1024");
        }
        if self.chunk_bytes == 0 {
            return bad("chunk_bytes", "must be at least 1");
        }
        if self.job_timeout_ms == 0 {
            return bad("job_timeout_ms", "must be at least 1");
        }
        Ok(())
    }
}

/// What a [`TransferQueue::drain`] or [`TransferQueue::shutdown`] left.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DrainReport {
    /// Whether no job runs any more: nothing touches any job's memory.
    pub idle: bool,
    /// Jobs still running when it returned (their reports come later).
    pub still_running: Vec<JobId>,
    /// Queued jobs it cancelled (each reported, every key `Cancelled`).
    pub cancelled: usize,
}

/// A snapshot of a [`TransferQueue`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TransferStatus {
    /// Jobs waiting to start.
    pub queued_jobs: usize,
    /// Jobs running.
    pub running_jobs: usize,
    /// Bytes of the running jobs.
    pub bytes_in_flight: u64,
    /// Reports waiting for [`TransferQueue::poll`].
    pub reports_waiting: usize,
}

impl TransferStatus {
    /// Whether a job is queued or running.
    pub fn has_pending_jobs(&self) -> bool {
        self.queued_jobs + self.running_jobs > 0
    }
}

/// Stores and loads of blocks between host memory and one store, in the
/// background; see the [module documentation](self).
///
/// Every method takes `&self`: share the queue between threads (an `Arc`)
/// to submit from several at once.
pub struct TransferQueue {
    shared: Arc<Shared>,
}

impl TransferQueue {
    /// A queue over `store` on a runtime of its own (one thread named
    /// `kvtier-transfer`, plus the runtime's blocking threads for a store
    /// whose I/O blocks).
    ///
    /// # Errors
    /// [`ManagerError::InvalidConfig`] for a configuration out of range;
    /// [`ManagerError::Spawn`] if the runtime cannot start.
    pub fn new<S: BlockStore>(store: Arc<S>, config: TransferConfig) -> Result<Self, ManagerError> {
        config.validate()?;
        let spawner = Spawner::dedicated("kvtier-transfer", 1)?;
        Self::from_dyn(store as Arc<dyn DynBlockStore>, config, &spawner)
    }

    /// A queue over `store` on `spawner`'s runtime (see [`Spawner`]).
    ///
    /// # Errors
    /// [`ManagerError::InvalidConfig`] for a configuration out of range.
    pub fn with_spawner<S: BlockStore>(
        store: Arc<S>,
        config: TransferConfig,
        spawner: &Spawner,
    ) -> Result<Self, ManagerError> {
        Self::from_dyn(store as Arc<dyn DynBlockStore>, config, spawner)
    }

    /// A queue over a store held as a [`DynBlockStore`].
    ///
    /// # Errors
    /// [`ManagerError::InvalidConfig`] for a configuration out of range.
    pub fn from_dyn(
        store: Arc<dyn DynBlockStore>,
        config: TransferConfig,
        spawner: &Spawner,
    ) -> Result<Self, ManagerError> {
        config.validate()?;
        Ok(Self {
            shared: Arc::new(Shared::new(store, config, spawner.clone())),
        })
    }

    /// Queues `job`; it starts at once if it fits the bounds. Never blocks.
    ///
    /// # Errors
    /// A [`SubmitError`] when the job is malformed or conflicts with
    /// another; nothing of it runs then.
    pub fn submit(&self, job: TransferJob) -> Result<JobId, SubmitError> {
        self.shared.submit(job)
    }

    /// Queues a store of `buffer[regions[i]]` under `keys[i]`, for each `i`.
    ///
    /// # Errors
    /// As [`submit`](Self::submit).
    pub fn submit_store(
        &self,
        keys: Vec<OffloadKey>,
        buffer: Arc<dyn HostBuffer>,
        regions: Vec<Region>,
    ) -> Result<JobId, SubmitError> {
        self.submit(TransferJob::store(keys, buffer, regions))
    }

    /// Queues a load of each key's block into `buffer[regions[i]]`.
    ///
    /// # Errors
    /// As [`submit`](Self::submit).
    pub fn submit_load(
        &self,
        keys: Vec<OffloadKey>,
        buffer: Arc<dyn HostBuffer>,
        regions: Vec<Region>,
    ) -> Result<JobId, SubmitError> {
        self.submit(TransferJob::load(keys, buffer, regions))
    }

    /// The reports of the jobs that ended since the last call, in the
    /// order they ended. Never blocks (beyond a short lock).
    pub fn poll(&self) -> Vec<JobReport> {
        self.shared.poll()
    }

    /// Blocks until a report waits to be polled, or `timeout`; whether one does.
    pub fn wait_for_reports(&self, timeout: Duration) -> bool {
        self.shared.wait_for_reports(timeout)
    }

    /// Calls `hook` each time reports are published (a job ended or was
    /// cancelled), on the thread that published them, outside the queue's
    /// locks: for a caller that sleeps on a file descriptor or a condition
    /// variable. Keep it short; it must not call back into the queue's
    /// `drain` or `shutdown`. Replaces any earlier hook.
    pub fn set_wake_hook(&self, hook: impl Fn() + Send + Sync + 'static) {
        self.shared.set_hook(Some(Arc::new(hook)));
    }

    /// Removes the wake hook.
    pub fn clear_wake_hook(&self) {
        self.shared.set_hook(None);
    }

    /// Jobs queued and running, bytes in flight, reports waiting.
    pub fn status(&self) -> TransferStatus {
        self.shared.status()
    }

    /// Cancels every queued job (they report `Cancelled`), then blocks
    /// until no job runs, or `timeout` (`None`: no limit). Jobs that have
    /// started run to their end or their deadline, never cut mid-copy.
    /// Jobs submitted while it waits are cancelled too. Reports stay
    /// available from [`poll`](Self::poll).
    ///
    /// Call it from a thread outside the queue's runtime (a drain inside a
    /// task of a current-thread runtime that also runs the jobs would wait
    /// for itself until its timeout).
    pub fn drain(&self, timeout: Option<Duration>) -> DrainReport {
        self.shared.drain(timeout, "a drain")
    }

    /// Refuses new jobs ([`SubmitError::ShutDown`]), cancels queued ones,
    /// stops running ones at their next chunk, drops async tier calls still
    /// running after half of `timeout`, and returns within `timeout`.
    /// Idempotent.
    pub fn shutdown(&self, timeout: Duration) -> DrainReport {
        self.shared.shutdown(timeout)
    }

    /// The bounds it was built with.
    pub fn config(&self) -> &TransferConfig {
        &self.shared.config
    }
}

impl Drop for TransferQueue {
    /// Cancels queued jobs and stops running ones as a shutdown does,
    /// without waiting; each running job keeps its buffer until it ends.
    fn drop(&mut self) {
        self.shared.abandon();
    }
}

impl std::fmt::Debug for TransferQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferQueue")
            .field("config", &self.shared.config)
            .field("status", &self.status())
            .finish_non_exhaustive()
    }
}
