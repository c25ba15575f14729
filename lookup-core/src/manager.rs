//! [`AsyncLookupManager`]: the scheduler's non-blocking view of one tier,
//! its ledger driven from the scheduler thread and its calls run by a worker.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::sync::Notify;

use crate::config::ManagerConfig;
use crate::error::{LookupError, ManagerError, TierError, TierErrorKind};
use crate::key::{OffloadKey, ReqContext};
use crate::ledger::{CallOutcome, LazyNow, Ledger, LookupVerdict, PrefixVerdict, TierCall};
use crate::metrics::{LedgerView, TierMetrics};
use crate::runtime::Spawner;
use crate::stats::ManagerStats;
use crate::tier::Tier;
use crate::worker::{self, Finished, WakeHook, WorkerHandle};

/// Answers "does this block exist in the tier?" without ever blocking the
/// scheduler thread.
///
/// Owned by the scheduler (every method takes `&mut self`, so the reference
/// design's "ownership instead of locks" is checked by the compiler). Tier
/// calls run on a background worker, a task on the manager's [`Spawner`]:
/// a runtime of its own ([`new`](Self::new)) or one shared with other
/// managers or owned by the caller ([`with_spawner`](Self::with_spawner)).
/// Their results are applied here, on the scheduler thread, whenever any
/// are waiting.
///
/// A step looks like this:
///
/// 1. `lookup` / `lookup_prefix` for each waiting request: answers from state
///    ([`Hit`](LookupVerdict::Hit), [`Miss`](LookupVerdict::Miss) or
///    [`Pending`](LookupVerdict::Pending)) and remembers new keys;
/// 2. `flush` once, at the end of scheduling: hands the new keys to the
///    worker, one tier call per request;
/// 3. `cleanup(req_id)` when a request finishes; `mark_miss` when a load of a
///    block reported present fails; `mark_present` when a store finishes.
///
/// See [`Ledger`] for the state machine and its guarantees.
///
/// # Shutdown
///
/// [`shutdown`](Self::shutdown) (blocking, for a synchronous scheduler) and
/// [`shutdown_async`](Self::shutdown_async) (awaiting, for one on a
/// runtime) are idempotent and return within `shutdown_timeout_ms` even if a
/// tier call hangs. After shutdown, `lookup` and `lookup_prefix` return
/// [`LookupError::ShutDown`], `flush` does nothing, `cleanup`,
/// `mark_miss` and `mark_present` still update state, and `stats` still answers.
///
/// Dropping the manager never blocks, inside a runtime or not: it tells the
/// worker to abort its running calls and returns without waiting (a call
/// that ignores cancellation ends on its own). Shut down first to give
/// running calls their grace period. Either way its [metrics](crate::metrics)
/// end final: its gauges at 0, every call it started counted as finished.
pub struct AsyncLookupManager<T: Tier> {
    ledger: Ledger,
    tier: Arc<T>,
    worker: WorkerHandle,
    /// Keeps the worker's runtime alive (a dedicated one stops when its last
    /// clone drops); released at shutdown.
    spawner: Option<Spawner>,
    results: crossbeam_channel::Receiver<Finished>,
    ready: Arc<std::sync::atomic::AtomicBool>,
    notify: Arc<Notify>,
    shutdown_timeout: Duration,
    shutdown: Option<ShutdownReport>,
    metrics: TierMetrics,
    /// The `manager` label of its metrics.
    id: u64,
}

/// What [`AsyncLookupManager::shutdown`] or
/// [`shutdown_async`](AsyncLookupManager::shutdown_async) did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShutdownReport {
    /// Whether the worker stopped within the shutdown timeout.
    pub worker_stopped: bool,
    /// Tier calls cut off while running (started on the tier, not
    /// answered within the grace period); their keys resolved as errors.
    pub abandoned_calls: usize,
    /// Tier calls handed to the worker that had not started (waiting for a
    /// free call slot); their keys resolved as errors too.
    pub unstarted_calls: usize,
    /// How long shutdown took.
    pub elapsed: Duration,
}

/// Waits for results, for a scheduler that runs on an async runtime.
///
/// Obtained from [`AsyncLookupManager::notifier`]. A result published while
/// nobody waits is remembered, so a wake-up is never lost.
#[derive(Debug, Clone)]
pub struct ResultsNotifier(Arc<Notify>);

impl ResultsNotifier {
    /// Completes when a tier call has finished since the last wake-up.
    ///
    /// # Cancellation safety
    /// Cancel-safe: dropping the future loses no wake-up.
    pub async fn notified(&self) {
        self.0.notified().await;
    }
}

impl<T: Tier> AsyncLookupManager<T> {
    /// Starts a manager for `tier`, with a runtime of its own: a
    /// [`Spawner::dedicated`] named `kvtier-lookup-<tier_name>` with
    /// `worker_threads` threads, stopped when the manager shuts down or
    /// drops. To share one runtime between managers, or use the caller's,
    /// see [`with_spawner`](Self::with_spawner).
    ///
    /// # Errors
    /// [`ManagerError::InvalidConfig`] for a field out of range;
    /// [`ManagerError::Spawn`] if the worker cannot start.
    pub fn new(tier: T, config: ManagerConfig) -> Result<Self, ManagerError> {
        Self::build(Arc::new(tier), config, None, None)
    }

    /// Like [`new`](Self::new), for a tier the caller keeps a handle on.
    ///
    /// # Errors
    /// As for [`new`](Self::new).
    pub fn from_arc(tier: Arc<T>, config: ManagerConfig) -> Result<Self, ManagerError> {
        Self::build(tier, config, None, None)
    }

    /// Like [`from_arc`](Self::from_arc), calling `hook` on a thread of the
    /// worker's runtime each time a result is published (keep it short: set
    /// a flag, wake an event loop).
    ///
    /// # Errors
    /// As for [`new`](Self::new).
    pub fn with_wake_hook(
        tier: Arc<T>,
        config: ManagerConfig,
        hook: impl Fn() + Send + Sync + 'static,
    ) -> Result<Self, ManagerError> {
        Self::build(tier, config, None, Some(Arc::new(hook) as WakeHook))
    }

    /// Starts a manager whose worker runs on `spawner`: the caller's runtime
    /// ([`Spawner::from_handle`]) or a dedicated one shared by several
    /// managers. No thread is started; `worker_threads` is ignored. The
    /// manager keeps a clone of the spawner until it shuts down.
    ///
    /// Per-manager limits stay per manager: `max_calls_in_flight`,
    /// deadlines, and results published to this manager only.
    ///
    /// # Errors
    /// [`ManagerError::InvalidConfig`] for a field out of range.
    pub fn with_spawner(
        tier: Arc<T>,
        config: ManagerConfig,
        spawner: &Spawner,
    ) -> Result<Self, ManagerError> {
        Self::build(tier, config, Some(spawner), None)
    }

    /// [`with_spawner`](Self::with_spawner) with a wake hook, as in
    /// [`with_wake_hook`](Self::with_wake_hook).
    ///
    /// # Errors
    /// As for [`with_spawner`](Self::with_spawner).
    pub fn with_spawner_and_wake_hook(
        tier: Arc<T>,
        config: ManagerConfig,
        spawner: &Spawner,
        hook: impl Fn() + Send + Sync + 'static,
    ) -> Result<Self, ManagerError> {
        Self::build(
            tier,
            config,
            Some(spawner),
            Some(Arc::new(hook) as WakeHook),
        )
    }

    fn build(
        tier: Arc<T>,
        config: ManagerConfig,
        spawner: Option<&Spawner>,
        hook: Option<WakeHook>,
    ) -> Result<Self, ManagerError> {
        config.validate()?;
        let spawner = match spawner {
            Some(spawner) => spawner.clone(),
            // The name was validated (no NUL), as was `worker_threads`.
            None => Spawner::start(
                format!("kvtier-lookup-{}", config.tier_name),
                config.worker_threads,
            )
            .map_err(|source| ManagerError::Spawn {
                tier: config.tier_name.clone(),
                source,
            })?,
        };
        let links = worker::spawn(Arc::clone(&tier), &config, hook, &spawner);
        // The worker runs `max_calls_in_flight` calls at once and holds as
        // many more waiting for a slot: a call ending is followed at once by
        // the next, instead of by the scheduler's next drain.
        let ledger = Ledger::new(&config, Instant::now())
            .with_max_outstanding_calls(config.max_calls_in_flight.saturating_mul(2));
        let id = crate::metrics::next_manager_id();
        Ok(Self {
            metrics: TierMetrics::new(&config.tier_name, id),
            id,
            ledger,
            tier,
            worker: links.handle,
            spawner: Some(spawner),
            results: links.results,
            ready: links.ready,
            notify: links.notify,
            shutdown_timeout: config.shutdown_timeout(),
            shutdown: None,
        })
    }

    /// The tier, for stores and loads that bypass the lookup path.
    pub fn tier(&self) -> &Arc<T> {
        &self.tier
    }

    /// The configured `shutdown_timeout_ms`, which bounds
    /// [`shutdown`](Self::shutdown).
    pub fn shutdown_timeout(&self) -> Duration {
        self.shutdown_timeout
    }

    /// The spawner the worker runs on; `None` after shutdown.
    pub fn spawner(&self) -> Option<&Spawner> {
        self.spawner.as_ref()
    }

    /// The tier's name from the configuration.
    pub fn tier_name(&self) -> &str {
        self.ledger.tier_name()
    }

    /// The number that tells this manager's [metrics](crate::metrics) from
    /// those of other managers with the same tier name: the value of their
    /// `manager` label, unique in the process, in creation order from 1.
    pub fn manager_id(&self) -> u64 {
        self.id
    }

    /// Answers whether `key` exists in the tier, for request `ctx`.
    ///
    /// Never blocks: returns [`Pending`](LookupVerdict::Pending) for a key
    /// without an answer yet (new keys are submitted by the next
    /// [`flush`](Self::flush)). Results that arrived since the last call are
    /// applied first; checking for them costs one atomic load.
    ///
    /// # Errors
    /// [`LookupError::InvalidKey`] for an empty key, or one shorter than
    /// `min_key_len` or longer than `max_key_len`;
    /// [`LookupError::ShutDown`] after [`shutdown`](Self::shutdown).
    #[inline]
    pub fn lookup(
        &mut self,
        key: &OffloadKey,
        ctx: &ReqContext,
    ) -> Result<LookupVerdict, LookupError> {
        self.before_lookup()?;
        self.ledger.lookup(key, ctx, &mut LazyNow::new())
    }

    /// [`lookup`](Self::lookup) of each of `keys` in order, each answer
    /// handed to `answer` with its index: one call for a request's keys.
    /// Of a long list, the memory the lookups of the next keys read is
    /// prefetched while one key is looked up, which on keys spread over a
    /// large table (more than the cache holds) saves most of the time
    /// their lookups would spend waiting for memory one after the other.
    ///
    /// # Errors
    /// As for [`lookup`](Self::lookup); the first error stops the loop,
    /// the keys before it were looked up (and answered).
    #[inline]
    pub fn lookup_each(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
        answer: impl FnMut(usize, LookupVerdict),
    ) -> Result<(), LookupError> {
        self.before_lookup()?;
        self.ledger
            .lookup_each(keys, ctx, &mut LazyNow::new(), answer)
    }

    /// How many leading `keys` exist: vLLM's scan, where a resolved miss ends
    /// the scan and an unresolved key before it makes the answer pending.
    /// Every unresolved key up to the first known miss is submitted with the
    /// next flush, so a prompt resolves in one round trip.
    ///
    /// # Errors
    /// As for [`lookup`](Self::lookup).
    pub fn lookup_prefix(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
    ) -> Result<PrefixVerdict, LookupError> {
        self.before_lookup()?;
        self.ledger.lookup_prefix(keys, ctx, &mut LazyNow::new())
    }

    /// One load on the common path: the flag is raised when results wait,
    /// and stays raised once the manager is shut down.
    #[inline]
    fn before_lookup(&mut self) -> Result<(), LookupError> {
        if self.ready.load(Ordering::Acquire) {
            return self.results_or_shut_down();
        }
        Ok(())
    }

    #[cold]
    #[inline(never)]
    fn results_or_shut_down(&mut self) -> Result<(), LookupError> {
        if self.shutdown.is_some() {
            return Err(LookupError::ShutDown {
                tier: self.ledger.tier_name().to_owned(),
            });
        }
        self.drain_results();
        Ok(())
    }

    /// Hands the keys looked up since the last flush to the worker, one tier
    /// call per request, within the configured limits; the rest wait for
    /// room without blocking. Call once per scheduler step. Also applies
    /// waiting results and expires calls past their deadline.
    pub fn flush(&mut self) {
        if self.shutdown.is_some() {
            return;
        }
        let now = Instant::now();
        self.apply_results(now);
        let mut calls = Vec::new();
        self.ledger.flush_and_start(now, &mut calls);
        self.send_calls(calls, now);
        self.publish_metrics(now, false);
    }

    /// Applies every result that has arrived, expires calls past their
    /// deadline, and starts waiting calls if there is room. `lookup` does
    /// this by itself when results are waiting; call it to make timeouts
    /// visible between flushes.
    pub fn drain_results(&mut self) {
        let now = Instant::now();
        self.apply_results(now);
        if self.shutdown.is_none() {
            self.start_calls(now);
        }
        self.publish_metrics(now, false);
    }

    /// The calls running on the tier and those waiting at the worker for a
    /// call slot: of the ledger's outstanding calls, those the worker
    /// counts in each state.
    fn calls_now(&self) -> (usize, usize) {
        let outstanding = self.ledger.outstanding_calls();
        let running = self.worker.running_calls().min(outstanding);
        let waiting = self.worker.waiting_calls().min(outstanding - running);
        (running, waiting)
    }

    /// Publishes the ledger's counters and gauges, with the calls counted
    /// as the worker sees them; `all`: the histograms too, in full.
    fn publish_metrics(&mut self, now: Instant, all: bool) {
        let (running, waiting) = self.calls_now();
        let view = LedgerView {
            calls_in_flight: running,
            calls_waiting: waiting,
            ..self.ledger.metrics_view()
        };
        if all {
            self.metrics.publish_all(&view, now);
        } else {
            self.metrics.publish(&view, now);
        }
    }

    fn apply_results(&mut self, now: Instant) {
        if self.shutdown.is_none() {
            self.ready.store(false, Ordering::Release);
        }
        while let Ok(finished) = self.results.try_recv() {
            self.ledger.complete_ended(
                finished.id,
                finished.outcome,
                finished.elapsed,
                finished.ended,
                now,
            );
            self.ledger.reuse_keys(finished.keys);
        }
        self.ledger.expire(now);
    }

    fn start_calls(&mut self, now: Instant) {
        let mut calls = Vec::new();
        while let Some(call) = self.ledger.next_call(now) {
            calls.push(call);
        }
        self.send_calls(calls, now);
    }

    /// Hands started calls to the worker in one message.
    fn send_calls(&mut self, calls: Vec<TierCall>, now: Instant) {
        if calls.is_empty() {
            return;
        }
        for call in &calls {
            self.metrics.call_started(call.keys.len());
        }
        if let Err(calls) = self.worker.send(calls) {
            // The worker is gone: never leave keys pending forever.
            for call in calls {
                self.ledger.complete(
                    call.id,
                    CallOutcome::Failed(TierError::new(
                        TierErrorKind::Unavailable,
                        "the lookup worker has stopped",
                    )),
                    Duration::ZERO,
                    now,
                );
            }
        }
    }

    /// Forces `keys` to miss after a failed load, so the scheduler stops
    /// re-issuing it; a probe answer arriving later cannot undo this. Keys
    /// without state are skipped.
    pub fn mark_miss<'a>(&mut self, keys: impl IntoIterator<Item = &'a OffloadKey>) {
        self.ledger.mark_miss(keys);
    }

    /// Records that `keys` were stored in the tier (a store job finished):
    /// each answers [`Hit`](LookupVerdict::Hit) at once, superseding any
    /// probe in flight, whose late answer is dropped (vLLM 0.34's
    /// `mark_present`). Keys without state are skipped. See
    /// [`Ledger::mark_present`].
    pub fn mark_present<'a>(&mut self, keys: impl IntoIterator<Item = &'a OffloadKey>) {
        self.ledger.mark_present(keys);
    }

    /// Releases request `req_id`'s references. Keys nobody references are
    /// forgotten, except those in a running tier call: they stay until its
    /// answer lands, so another request can share the probe.
    pub fn cleanup(&mut self, req_id: &str) {
        self.ledger.cleanup(req_id);
    }

    /// Counters and latency histograms.
    pub fn stats(&self) -> ManagerStats {
        let (calls_in_flight, calls_waiting) = self.calls_now();
        ManagerStats {
            calls_in_flight,
            calls_waiting,
            ..self.ledger.stats()
        }
    }

    /// Whether no key, request or call is tracked (after every request was
    /// cleaned up and every answer applied).
    pub fn is_idle(&self) -> bool {
        self.ledger.is_empty()
    }

    /// Whether keys wait for a flush or a call slot, or tier calls run: a
    /// cheap check for "everything asked so far has its answer".
    pub fn has_pending_calls(&self) -> bool {
        self.ledger.has_pending_calls()
    }

    /// The earliest deadline of a running tier call: a scheduler that sleeps
    /// can wake then to see the timeout.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.ledger.next_deadline()
    }

    /// A handle an async scheduler can await for new results.
    pub fn notifier(&self) -> ResultsNotifier {
        ResultsNotifier(Arc::clone(&self.notify))
    }

    /// Stops the worker: running calls get half the shutdown timeout to
    /// answer, then are abandoned, and calls waiting for a call slot are
    /// dropped (the keys of both resolve as errors); results that arrived
    /// are applied. Blocks this thread, and returns within
    /// `shutdown_timeout_ms` plus scheduling noise, whatever the tier does.
    /// Idempotent: later calls return the first report.
    ///
    /// For a synchronous scheduler. On an async runtime use
    /// [`shutdown_async`](Self::shutdown_async): blocking a thread of the
    /// runtime the worker runs on (always so on a current-thread runtime)
    /// keeps the worker from stopping, and this waits the whole timeout,
    /// reporting `worker_stopped: false`.
    pub fn shutdown(&mut self) -> ShutdownReport {
        if let Some(report) = self.shutdown {
            return report;
        }
        let started = Instant::now();
        let worker_stopped = self.worker.stop(self.shutdown_timeout);
        self.finish_shutdown(started, worker_stopped)
    }

    /// [`shutdown`](Self::shutdown) that awaits instead of blocking, with the
    /// same bound and report. The bound is a timer of the tokio runtime
    /// polling the future (it needs the time driver, as any runtime built
    /// with `enable_all`), or, polled outside tokio, of the worker's runtime.
    ///
    /// # Cancellation safety
    /// Dropped before it completes, it has told the worker to stop but not
    /// marked the manager shut down; calling it (or `shutdown`) again
    /// finishes the job.
    pub async fn shutdown_async(&mut self) -> ShutdownReport {
        if let Some(report) = self.shutdown {
            return report;
        }
        let started = Instant::now();
        let worker_stopped = match &self.spawner {
            Some(spawner) => {
                self.worker
                    .stop_async(self.shutdown_timeout, spawner.handle())
                    .await
            }
            // Only shutdown releases the spawner, and it returned above.
            None => self.worker.stop(Duration::ZERO),
        };
        self.finish_shutdown(started, worker_stopped)
    }

    fn finish_shutdown(&mut self, started: Instant, worker_stopped: bool) -> ShutdownReport {
        // A dedicated runtime stops in the background once no manager holds it.
        self.spawner = None;
        let now = Instant::now();
        self.apply_results(now);
        let outstanding = self.ledger.outstanding_calls();
        let abandoned_calls = self.worker.abandoned_running_calls().min(outstanding);
        self.ledger.abandon_running(now);
        self.publish_metrics(now, true);
        if !worker_stopped {
            tracing::warn!(
                tier = %self.ledger.tier_name(),
                timeout_ms = self.shutdown_timeout.as_millis() as u64,
                "lookup worker did not stop within the shutdown timeout; detached it"
            );
        }
        let report = ShutdownReport {
            worker_stopped,
            abandoned_calls,
            unstarted_calls: outstanding - abandoned_calls,
            elapsed: started.elapsed(),
        };
        self.shutdown = Some(report);
        // Raised for good (apply_results leaves it raised once shut down): every lookup
        // takes the slow path, which refuses it.
        self.ready.store(true, Ordering::Release);
        report
    }

    /// Whether [`shutdown`](Self::shutdown) has run.
    pub fn is_shut_down(&self) -> bool {
        self.shutdown.is_some()
    }
}

impl<T: Tier> Drop for AsyncLookupManager<T> {
    /// Never blocks: tells the worker to abort its calls and returns. A
    /// dedicated runtime stops in the background once its last user is gone.
    fn drop(&mut self) {
        let now = Instant::now();
        if self.shutdown.is_none() {
            self.worker.abort();
            // Its calls are abandoned: every call started counts as
            // finished, its keys as errors.
            self.apply_results(now);
            self.ledger.abandon_running(now);
        }
        // The last counts, so an exporter sees every lookup answered, then
        // the gauges at 0: the manager tracks nothing and runs no call.
        self.publish_metrics(now, true);
        self.metrics.retire();
    }
}

impl<T: Tier> std::fmt::Debug for AsyncLookupManager<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AsyncLookupManager")
            .field("tier", &self.ledger.tier_name())
            .field("shut_down", &self.shutdown.is_some())
            .finish_non_exhaustive()
    }
}
