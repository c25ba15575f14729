//! The queue's shared state: jobs queued (loads first), running and
//! finished, the bytes in flight, the memory claimed, and the admission
//! rule that starts queued jobs within the bounds.

use std::collections::{BTreeMap, VecDeque};
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use super::busy::Busy;
use super::job::{Job, JobId, JobKind, JobReport, SubmitError, TransferJob, check};
use super::run::JobRun;
use super::{DrainReport, TransferConfig, TransferStatus};
use crate::error::{TierError, TierErrorKind};
use crate::runtime::{Latch, Spawner};
use crate::store::DynBlockStore;
use crate::worker::WakeHook;

/// What the queue handle and every job's run share.
pub(super) struct Shared {
    pub(super) store: Arc<dyn DynBlockStore>,
    /// Whether the store's futures block their thread: jobs then run on
    /// the runtime's blocking threads.
    pub(super) blocking: bool,
    pub(super) config: TransferConfig,
    pub(super) spawner: Spawner,
    state: Mutex<State>,
    /// Signalled whenever a job ends (or is cancelled).
    changed: Condvar,
    hook: Mutex<Option<WakeHook>>,
    /// Set by a shutdown or a drop: running jobs stop at their next chunk.
    pub(super) stop: AtomicBool,
    /// Set when running jobs must drop their tier calls mid-way (a
    /// shutdown's grace is over, or the queue dropped).
    pub(super) abort: Latch,
}

#[derive(Default)]
struct State {
    next_id: u64,
    /// Loads start before stores: a promotion waits for no cascade.
    loads: VecDeque<Job>,
    stores: VecDeque<Job>,
    /// Running jobs and their bytes.
    running: BTreeMap<JobId, u64>,
    bytes_in_flight: u64,
    finished: Vec<JobReport>,
    busy: Busy,
    /// Drains in progress: while any runs, no job starts.
    draining: usize,
    closed: bool,
    /// A job could not be started (the runtime is gone): queued jobs then
    /// fail instead of starting.
    runtime_gone: bool,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The far end of a deadline that overflows `Instant`.
const NEVER: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

impl State {
    fn release(&mut self, kind: JobKind, claimed: &[Range<usize>]) {
        match kind {
            JobKind::Load => self.busy.release_written(claimed),
            JobKind::Store => self.busy.release_read(claimed),
        }
    }

    /// Ends a job that never started: every key fails with `err`.
    fn end_unstarted(&mut self, job: Job, err: &Arc<TierError>) {
        let kind = job.kind;
        let (report, claimed) = job.unstarted_report(Arc::clone(err));
        self.release(kind, &claimed);
        self.finished.push(report);
    }

    /// Cancels every queued job; whether any was.
    fn cancel_queued(&mut self, why: &str) -> usize {
        let jobs: Vec<Job> = self.loads.drain(..).chain(self.stores.drain(..)).collect();
        let n = jobs.len();
        for job in jobs {
            let err = Arc::new(TierError::new(
                TierErrorKind::Cancelled,
                format!("job {} was cancelled by {why} before it started", job.id),
            ));
            self.end_unstarted(job, &err);
        }
        n
    }

    /// Starts queued jobs, loads first, in order, while they fit: at most
    /// `max_jobs_in_flight` jobs and `max_bytes_in_flight` bytes, except
    /// that a job larger than the byte bound starts when nothing runs. A
    /// job whose deadline has passed ends as timed out instead. Returns
    /// the jobs to start and how many ended here.
    fn admit(&mut self, config: &TransferConfig) -> (Vec<Job>, usize) {
        let mut start = Vec::new();
        let mut ended = 0;
        if self.runtime_gone {
            let err = Arc::new(TierError::new(
                TierErrorKind::Unavailable,
                "the transfer queue's runtime is shut down; the job never started",
            ));
            let jobs: Vec<Job> = self.loads.drain(..).chain(self.stores.drain(..)).collect();
            ended = jobs.len();
            for job in jobs {
                self.end_unstarted(job, &err);
            }
            return (start, ended);
        }
        if self.draining > 0 || self.closed {
            return (start, ended);
        }
        let now = Instant::now();
        loop {
            let queue = if self.loads.is_empty() {
                &mut self.stores
            } else {
                &mut self.loads
            };
            let Some(next) = queue.front() else {
                break;
            };
            if next.deadline <= now {
                if let Some(job) = queue.pop_front() {
                    let err = Arc::new(TierError::new(
                        TierErrorKind::Timeout,
                        format!("job {} passed its deadline while queued", job.id),
                    ));
                    self.end_unstarted(job, &err);
                    ended += 1;
                }
                continue;
            }
            let fits = self.running.is_empty()
                || (self.running.len() < config.max_jobs_in_flight
                    && self.bytes_in_flight.saturating_add(next.bytes)
                        <= config.max_bytes_in_flight);
            if !fits {
                break;
            }
            let Some(job) = queue.pop_front() else {
                break;
            };
            self.running.insert(job.id, job.bytes);
            self.bytes_in_flight = self.bytes_in_flight.saturating_add(job.bytes);
            start.push(job);
        }
        (start, ended)
    }
}

impl Shared {
    pub(super) fn new(
        store: Arc<dyn DynBlockStore>,
        config: TransferConfig,
        spawner: Spawner,
    ) -> Self {
        Self {
            blocking: store.io_blocks_thread_dyn(),
            store,
            config,
            spawner,
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            hook: Mutex::new(None),
            stop: AtomicBool::new(false),
            abort: Latch::default(),
        }
    }

    pub(super) fn set_hook(&self, hook: Option<WakeHook>) {
        *self.hook.lock().unwrap_or_else(PoisonError::into_inner) = hook;
    }

    /// Wakes whoever waits: the condition variable, then the hook (outside
    /// every lock of the queue).
    fn published(&self) {
        self.changed.notify_all();
        let hook = self
            .hook
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if let Some(hook) = hook {
            hook();
        }
    }

    pub(super) fn submit(self: &Arc<Self>, job: TransferJob) -> Result<JobId, SubmitError> {
        let (claimed, bytes) = check(&job)?;
        if lock(&self.state).closed {
            // Said before the length check below, which may wait on the
            // store's own lock: no other lock is held meanwhile.
            return Err(SubmitError::ShutDown);
        }
        if job.kind == JobKind::Load {
            for (index, (key, region)) in job.keys.iter().zip(&job.regions).enumerate() {
                match self.store.known_len_dyn(key) {
                    Some(stored) if stored != region.len => {
                        return Err(SubmitError::LengthMismatch {
                            index,
                            stored,
                            region: region.len,
                        });
                    }
                    _ => {}
                }
            }
        }
        let submitted = Instant::now();
        let timeout = job
            .timeout
            .unwrap_or(Duration::from_millis(self.config.job_timeout_ms));
        let deadline = submitted
            .checked_add(timeout)
            .or_else(|| submitted.checked_add(NEVER))
            .unwrap_or(submitted);
        let mut state = lock(&self.state);
        if state.closed {
            return Err(SubmitError::ShutDown);
        }
        let conflict = match job.kind {
            JobKind::Load => state.busy.write_conflict(&claimed),
            JobKind::Store => state.busy.read_conflict(&claimed),
        };
        if let Some(index) = conflict {
            return Err(SubmitError::Busy { index });
        }
        match job.kind {
            JobKind::Load => state.busy.claim_written(&claimed),
            JobKind::Store => state.busy.claim_read(&claimed),
        }
        state.next_id += 1;
        let id = JobId(state.next_id);
        let queued = Job {
            id,
            kind: job.kind,
            keys: job.keys,
            buffer: Some(job.buffer),
            regions: job.regions,
            claimed,
            bytes,
            submitted,
            deadline,
        };
        match queued.kind {
            JobKind::Load => state.loads.push_back(queued),
            JobKind::Store => state.stores.push_back(queued),
        }
        let (start, ended) = state.admit(&self.config);
        drop(state);
        if ended > 0 {
            self.published();
        }
        self.start(start);
        Ok(id)
    }

    /// Runs each job on the spawner's runtime: on its blocking threads for
    /// a store whose futures block. A job the runtime refuses ends (its
    /// run's drop reports it) and marks the runtime gone.
    fn start(self: &Arc<Self>, jobs: Vec<Job>) {
        for job in jobs {
            let run = JobRun::new(Arc::clone(self), job);
            if self.blocking {
                let handle = self.spawner.handle().clone();
                drop(
                    self.spawner
                        .handle()
                        .spawn_blocking(move || run.run_blocking(&handle)),
                );
            } else {
                self.spawner.spawn_detached(run.run_async());
            }
        }
    }

    /// A running job ended (its run has let go of the buffer): publishes
    /// its report, releases its claims and bytes, and starts what now fits.
    pub(super) fn finish(self: &Arc<Self>, report: JobReport, claimed: &[Range<usize>], ran: bool) {
        let mut state = lock(&self.state);
        if let Some(bytes) = state.running.remove(&report.id) {
            state.bytes_in_flight = state.bytes_in_flight.saturating_sub(bytes);
        }
        state.release(report.kind, claimed);
        state.finished.push(report);
        if !ran {
            state.runtime_gone = true;
        }
        let (start, _) = state.admit(&self.config);
        drop(state);
        self.published();
        self.start(start);
    }

    pub(super) fn poll(&self) -> Vec<JobReport> {
        std::mem::take(&mut lock(&self.state).finished)
    }

    pub(super) fn wait_for_reports(&self, timeout: Duration) -> bool {
        let state = lock(&self.state);
        let (state, _) = self
            .changed
            .wait_timeout_while(state, timeout, |s| s.finished.is_empty())
            .unwrap_or_else(PoisonError::into_inner);
        !state.finished.is_empty()
    }

    pub(super) fn status(&self) -> TransferStatus {
        let state = lock(&self.state);
        TransferStatus {
            queued_jobs: state.loads.len() + state.stores.len(),
            running_jobs: state.running.len(),
            bytes_in_flight: state.bytes_in_flight,
            reports_waiting: state.finished.len(),
        }
    }

    /// Cancels queued jobs (and any submitted meanwhile) and waits up to
    /// `timeout` (forever for `None`) until no job runs.
    pub(super) fn drain(&self, timeout: Option<Duration>, why: &str) -> DrainReport {
        let until = timeout.and_then(|t| Instant::now().checked_add(t));
        let mut state = lock(&self.state);
        state.draining += 1;
        let mut cancelled = 0;
        loop {
            cancelled += state.cancel_queued(why);
            if state.running.is_empty() {
                break;
            }
            let wait = match until {
                Some(until) => match until.checked_duration_since(Instant::now()) {
                    Some(left) if !left.is_zero() => left,
                    _ => break,
                },
                None => NEVER,
            };
            state = self
                .changed
                .wait_timeout(state, wait)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        state.draining -= 1;
        let report = DrainReport {
            idle: state.running.is_empty(),
            still_running: state.running.keys().copied().collect(),
            cancelled,
        };
        drop(state);
        if cancelled > 0 {
            self.published();
        }
        report
    }

    /// Refuses new jobs, cancels queued ones, stops running ones at their
    /// next chunk; after half of `timeout`, drops the tier calls still
    /// running; returns once no job runs or `timeout` has passed.
    pub(super) fn shutdown(&self, timeout: Duration) -> DrainReport {
        self.close();
        let first = self.drain(Some(timeout / 2), "a shutdown");
        if first.idle {
            return first;
        }
        self.abort.set();
        let mut last = self.drain(Some(timeout - timeout / 2), "a shutdown");
        last.cancelled += first.cancelled;
        last
    }

    /// Refuses new jobs and tells running ones to stop at their next chunk.
    pub(super) fn close(&self) {
        lock(&self.state).closed = true;
        self.stop.store(true, Ordering::Release);
    }

    /// What a queue handle's drop does: close, cancel what is queued, and
    /// drop running tier calls, without waiting.
    pub(super) fn abandon(&self) {
        self.close();
        self.abort.set();
        let cancelled = lock(&self.state).cancel_queued("the queue's drop");
        if cancelled > 0 {
            self.published();
        }
    }
}
