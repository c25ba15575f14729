//! The background worker: an actor task that runs one manager's tier calls.
//!
//! It runs on the manager's [`Spawner`] (a runtime of its own or the
//! caller's; many managers may share one), receives [`TierCall`]s over a
//! channel, runs each as its own task under the call's deadline, and
//! publishes each outcome as soon as it is known (per request group, not per
//! step). At most `max_calls_in_flight` calls run at once: a call handed
//! over while all slots are taken waits for one (within its deadline), and
//! starts the moment a slot frees, without a round trip through the
//! scheduler. It stops when told to (draining for a grace period first),
//! aborts its calls when its inbox closes (the manager dropped), and signals
//! a [`Latch`] when it ends, however it ends. A call dropped by its runtime
//! shutting down still publishes an outcome (a counted error), so no key
//! waits for its deadline.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tokio::runtime::Handle;
use tokio::sync::{Notify, Semaphore, mpsc};
use tokio::task::JoinSet;
use tracing::Instrument;

use crate::config::ManagerConfig;
use crate::error::{TierError, TierErrorKind};
use crate::key::OffloadKey;
use crate::ledger::{CallId, CallOutcome, TierCall};
use crate::runtime::{Latch, SetOnDrop, Spawner};
use crate::task::AbortOnDrop;
use crate::tier::Tier;

/// A hook called whenever a result is published: on a thread of the
/// worker's runtime or, for calls cut short by that runtime shutting down,
/// on the thread shutting it down.
pub type WakeHook = Arc<dyn Fn() + Send + Sync + 'static>;

tokio::task_local! {
    /// The id of the tier call a task runs (see [`current_call`]).
    static CURRENT_CALL: u64;
}

/// The id of the tier call the current task works for, unique among one
/// manager's calls: the same number inside that call's
/// [`Tier::batch_lookup`] future and inside the [`WakeHook`] run when its
/// outcome is published (whether the tier answered, failed or timed out,
/// even before it was called). `None` anywhere else, such as on the
/// blocking thread of a [`SyncTier`](crate::SyncTier).
///
/// A tier and a wake hook can use it together to tell *which* call an
/// outcome belongs to (say, to wait for the publication of one answer).
#[must_use]
pub fn current_call() -> Option<u64> {
    CURRENT_CALL.try_with(|id| *id).ok()
}

pub(crate) enum Command {
    /// The calls one flush started, in one message: one wake-up per step.
    Calls(Vec<TierCall>),
    /// Stop taking calls, give running ones `grace` to answer, abort the rest.
    Shutdown { grace: Duration },
    /// Abort every running call now (the manager is being dropped).
    Abort,
}

/// One finished tier call, on its way back to the scheduler thread.
pub(crate) struct Finished {
    pub(crate) id: CallId,
    pub(crate) outcome: CallOutcome,
    pub(crate) elapsed: Duration,
    /// When the outcome was handed back (the call ended `elapsed` before).
    pub(crate) ended: Instant,
    /// The call's key list, emptied, for the ledger to reuse (empty and
    /// unallocated when the call did not give it back: a timeout, a panic).
    pub(crate) keys: Vec<OffloadKey>,
}

/// How results reach the scheduler: a channel, a flag the hot path can read
/// for the price of one atomic load, and wake-ups for async schedulers.
#[derive(Clone)]
pub(crate) struct Publisher {
    out: crossbeam_channel::Sender<Finished>,
    ready: Arc<AtomicBool>,
    notify: Arc<Notify>,
    hook: Option<WakeHook>,
}

impl Publisher {
    fn publish(&self, finished: Finished) {
        // Send first, then raise the flag: a reader that clears the flag
        // before draining can never miss a result.
        if self.out.send(finished).is_err() {
            return; // the manager is gone
        }
        self.ready.store(true, Ordering::Release);
        self.notify.notify_one();
        if let Some(hook) = &self.hook {
            hook();
        }
    }
}

/// The promise of one outcome per call: publishes it once, or, if dropped
/// unsent while the worker was not stopping on purpose (the runtime shut
/// down under it), publishes a counted error instead.
struct Reply {
    publisher: Publisher,
    id: CallId,
    arrived: Instant,
    stopping: Arc<AtomicBool>,
    sent: bool,
}

impl Reply {
    fn send(mut self, outcome: CallOutcome, elapsed: Duration, keys: Vec<OffloadKey>) {
        self.sent = true;
        self.publisher.publish(Finished {
            id: self.id,
            outcome,
            elapsed,
            ended: Instant::now(),
            keys,
        });
    }
}

impl Drop for Reply {
    fn drop(&mut self) {
        // On shutdown or drop of the manager, running calls are aborted on
        // purpose: the manager counts them itself.
        if self.sent || self.stopping.load(Ordering::Acquire) {
            return;
        }
        self.publisher.publish(Finished {
            id: self.id,
            outcome: CallOutcome::Failed(TierError::new(
                TierErrorKind::Unavailable,
                "the lookup worker's task ended before the call answered \
                 (its runtime shut down, or has no time driver)",
            )),
            elapsed: self.arrived.elapsed(),
            ended: Instant::now(),
            keys: Vec::new(),
        });
    }
}

/// How many of the calls handed to the worker wait for a call slot and
/// how many run, shared with the manager for its stats and gauges.
#[derive(Debug)]
pub(crate) struct CallCounts {
    waiting: AtomicUsize,
    running: AtomicUsize,
    /// The calls running when a shutdown abandoned them; `usize::MAX`
    /// until then.
    abandoned: AtomicUsize,
}

impl CallCounts {
    fn new() -> Self {
        Self {
            waiting: AtomicUsize::new(0),
            running: AtomicUsize::new(0),
            abandoned: AtomicUsize::new(usize::MAX),
        }
    }
}

/// Counts one call in [`CallCounts::waiting`] until it starts (then in
/// `running`, see [`Started`]) or ends without starting.
struct Waiting(Arc<CallCounts>);

impl Waiting {
    fn new(counts: &Arc<CallCounts>) -> Self {
        counts.waiting.fetch_add(1, Ordering::Relaxed);
        Self(Arc::clone(counts))
    }

    /// The call got its slot: it runs now.
    fn start(self) -> Started {
        self.0.running.fetch_add(1, Ordering::Relaxed);
        Started(Arc::clone(&self.0))
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        self.0.waiting.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Counts one call in [`CallCounts::running`] until its outcome is known
/// (dropped before the outcome is published) or its task is dropped.
struct Started(Arc<CallCounts>);

impl Drop for Started {
    fn drop(&mut self) {
        self.0.running.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The scheduler side's handle on the worker.
pub(crate) struct WorkerHandle {
    inbox: mpsc::UnboundedSender<Command>,
    stopped: Arc<Latch>,
    counts: Arc<CallCounts>,
}

/// Channels the manager keeps.
pub(crate) struct WorkerLinks {
    pub(crate) handle: WorkerHandle,
    pub(crate) results: crossbeam_channel::Receiver<Finished>,
    pub(crate) ready: Arc<AtomicBool>,
    pub(crate) notify: Arc<Notify>,
}

/// Starts `tier`'s worker task on `spawner`.
pub(crate) fn spawn<T: Tier>(
    tier: Arc<T>,
    cfg: &ManagerConfig,
    hook: Option<WakeHook>,
    spawner: &Spawner,
) -> WorkerLinks {
    let (inbox, rx) = mpsc::unbounded_channel();
    let (out, results) = crossbeam_channel::unbounded();
    let ready = Arc::new(AtomicBool::new(false));
    let notify = Arc::new(Notify::new());
    let publisher = Publisher {
        out,
        ready: Arc::clone(&ready),
        notify: Arc::clone(&notify),
        hook,
    };
    let tier_name: Arc<str> = Arc::from(cfg.tier_name.as_str());
    let slots = Arc::new(Semaphore::new(cfg.max_calls_in_flight.max(1)));
    let stopped = Arc::new(Latch::default());
    let counts = Arc::new(CallCounts::new());
    let task_counts = Arc::clone(&counts);
    // Moved into the task: set when the task ends, or when the runtime drops
    // it, polled or not.
    let on_exit = SetOnDrop(Arc::clone(&stopped));
    spawner.spawn_detached(async move {
        let _on_exit = on_exit;
        run(tier, rx, publisher, tier_name, slots, task_counts).await;
    });
    WorkerLinks {
        handle: WorkerHandle {
            inbox,
            stopped,
            counts,
        },
        results,
        ready,
        notify,
    }
}

async fn run<T: Tier>(
    tier: Arc<T>,
    mut inbox: mpsc::UnboundedReceiver<Command>,
    publisher: Publisher,
    tier_name: Arc<str>,
    slots: Arc<Semaphore>,
    counts: Arc<CallCounts>,
) {
    let stopping = Arc::new(AtomicBool::new(false));
    let mut calls = JoinSet::new();
    loop {
        tokio::select! {
            command = inbox.recv() => match command {
                Some(Command::Calls(batch)) => {
                    for call in batch {
                        let reply = Reply {
                            publisher: publisher.clone(),
                            id: call.id,
                            arrived: Instant::now(),
                            stopping: Arc::clone(&stopping),
                            sent: false,
                        };
                        let id = call.id.0;
                        let waiting = Waiting::new(&counts);
                        calls.spawn(CURRENT_CALL.scope(id, run_call(
                            Arc::clone(&tier),
                            call,
                            Arc::clone(&tier_name),
                            Arc::clone(&slots),
                            reply,
                            waiting,
                        )));
                    }
                }
                Some(Command::Shutdown { grace }) => {
                    let drained = tokio::time::timeout(grace, async {
                        while calls.join_next().await.is_some() {}
                    })
                    .await;
                    if drained.is_err() {
                        tracing::warn!(
                            tier = %tier_name,
                            abandoned = calls.len(),
                            "shutdown grace expired with tier calls still running; abandoning them"
                        );
                    }
                    stopping.store(true, Ordering::Release);
                    let running = counts.running.load(Ordering::Relaxed);
                    counts.abandoned.store(running, Ordering::Relaxed);
                    calls.abort_all();
                    return;
                }
                Some(Command::Abort) | None => {
                    stopping.store(true, Ordering::Release);
                    calls.abort_all();
                    return;
                }
            },
            Some(_) = calls.join_next(), if !calls.is_empty() => {}
        }
    }
}

async fn run_call<T: Tier>(
    tier: Arc<T>,
    call: TierCall,
    tier_name: Arc<str>,
    slots: Arc<Semaphore>,
    reply: Reply,
    waiting: Waiting,
) {
    // A free call slot first, within the call's deadline; the slot is held
    // until the outcome is published.
    let arrived = reply.arrived;
    let _slot = match tokio::time::timeout_at(call.deadline.into(), slots.acquire_owned()).await {
        Ok(Ok(permit)) => permit,
        // The semaphore is never closed; if it were, the reply's drop
        // publishes an error.
        Ok(Err(_)) => return,
        Err(_) => {
            drop(waiting);
            reply.send(CallOutcome::TimedOut, arrived.elapsed(), Vec::new());
            return;
        }
    };
    let started = waiting.start();
    let started_at = Instant::now();
    let n_keys = call.keys.len();
    let span = tracing::debug_span!(
        "tier_call",
        tier = %tier_name,
        req_id = %call.ctx.req_id(),
        call = call.id.0,
        keys = n_keys,
        outcome = tracing::field::Empty,
        elapsed_us = tracing::field::Empty,
    );
    let keys = call.keys;
    let ctx = call.ctx;
    // A task of its own, so a panic in the tier is caught as a JoinError and
    // a timeout (or this task's abort) cancels it. The key list comes back,
    // emptied here, for the ledger to reuse.
    let task = AbortOnDrop::new(tokio::spawn(
        CURRENT_CALL.scope(
            call.id.0,
            async move {
                let found = tier.batch_lookup(&keys, &ctx).await;
                let mut keys = keys;
                keys.clear();
                (found, keys)
            }
            .instrument(span.clone()),
        ),
    ));
    let mut keys = Vec::new();
    let outcome = match tokio::time::timeout_at(call.deadline.into(), task).await {
        Ok(Ok((found, emptied))) => {
            keys = emptied;
            match found {
                Ok(found) => CallOutcome::Answered(found),
                Err(err) => CallOutcome::Failed(err),
            }
        }
        Ok(Err(join)) if join.is_panic() => CallOutcome::Failed(TierError::new(
            TierErrorKind::Panicked,
            format!("batch_lookup panicked for {n_keys} keys"),
        )),
        Ok(Err(_)) => CallOutcome::Failed(TierError::new(
            TierErrorKind::Other,
            "batch_lookup task was cancelled",
        )),
        // Dropping the timed-out future aborted the task.
        Err(_) => CallOutcome::TimedOut,
    };
    let elapsed = started_at.elapsed();
    let label = match &outcome {
        CallOutcome::Answered(found) if found.len() == n_keys => "answered",
        CallOutcome::Answered(_) => "wrong_result_count",
        CallOutcome::Failed(err) => err.kind().as_str(),
        CallOutcome::TimedOut => "deadline",
    };
    span.record("outcome", label);
    span.record("elapsed_us", elapsed.as_micros() as u64);
    drop(started);
    reply.send(outcome, elapsed, keys);
}

impl WorkerHandle {
    /// Hands calls to the worker in one message; gives them back if the
    /// worker is gone.
    pub(crate) fn send(&self, calls: Vec<TierCall>) -> Result<(), Vec<TierCall>> {
        match self.inbox.send(Command::Calls(calls)) {
            Ok(()) => Ok(()),
            Err(mpsc::error::SendError(Command::Calls(calls))) => Err(calls),
            Err(_) => Err(Vec::new()),
        }
    }

    /// Asks the worker to stop, giving running calls half of `timeout`.
    fn ask_to_stop(&self, timeout: Duration) {
        // An error means the worker has already ended.
        let _ = self.inbox.send(Command::Shutdown { grace: timeout / 2 });
    }

    /// Asks the worker to stop and blocks this thread for it at most
    /// `timeout`. Returns whether it stopped in time.
    pub(crate) fn stop(&self, timeout: Duration) -> bool {
        self.ask_to_stop(timeout);
        self.stopped.wait_timeout(timeout)
    }

    /// [`stop`](Self::stop), awaiting instead of blocking. The bound is a
    /// timer of the runtime polling this future or, when it is polled
    /// outside tokio, of `fallback` (the worker's own runtime).
    pub(crate) async fn stop_async(&self, timeout: Duration, fallback: &Handle) -> bool {
        self.ask_to_stop(timeout);
        if self.stopped.is_set() {
            return true;
        }
        let timer = Handle::try_current().unwrap_or_else(|_| fallback.clone());
        let expired = {
            let _context = timer.enter();
            tokio::time::sleep(timeout)
        };
        tokio::select! {
            biased;
            () = self.stopped.wait() => true,
            () = expired => self.stopped.is_set(),
        }
    }

    /// Tells the worker to abort every call, without waiting.
    pub(crate) fn abort(&self) {
        let _ = self.inbox.send(Command::Abort);
    }

    /// Calls holding one of the worker's call slots now: started on the
    /// tier, outcome not yet known.
    pub(crate) fn running_calls(&self) -> usize {
        self.counts.running.load(Ordering::Relaxed)
    }

    /// Calls the worker has received and not yet started: each waits for a
    /// free call slot.
    pub(crate) fn waiting_calls(&self) -> usize {
        self.counts.waiting.load(Ordering::Relaxed)
    }

    /// The calls that were running when the worker stopped (after the
    /// grace period, abandoning them); if it has not stopped, the calls
    /// running now.
    pub(crate) fn abandoned_running_calls(&self) -> usize {
        match self.counts.abandoned.load(Ordering::Relaxed) {
            usize::MAX => self.running_calls(),
            running => running,
        }
    }
}
