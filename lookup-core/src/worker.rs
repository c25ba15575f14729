//! The background worker: an actor on its own thread that runs tier calls.
//!
//! It owns a tokio runtime, receives [`TierCall`]s over a channel, runs each
//! as its own task under the call's deadline, and publishes each outcome as
//! soon as it is known (per request group, not per step). At most
//! `max_calls_in_flight` calls run at once: a call handed over while all
//! slots are taken waits for one (within its deadline), and starts the
//! moment a slot frees, without a round trip through the scheduler. It stops
//! when told to or when its inbox closes, and never waits for a hung call
//! longer than its grace period: the runtime is torn down in the background.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::{Notify, Semaphore, mpsc};
use tokio::task::JoinSet;
use tracing::Instrument;

use crate::config::ManagerConfig;
use crate::error::{ManagerError, TierError, TierErrorKind};
use crate::ledger::{CallId, CallOutcome, TierCall};
use crate::tier::Tier;

/// A hook called on the worker thread whenever a result is published.
pub type WakeHook = Arc<dyn Fn() + Send + Sync + 'static>;

pub(crate) enum Command {
    Call(TierCall),
    Shutdown { grace: Duration },
}

/// One finished tier call, on its way back to the scheduler thread.
pub(crate) struct Finished {
    pub(crate) id: CallId,
    pub(crate) outcome: CallOutcome,
    pub(crate) elapsed: Duration,
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

/// The scheduler side's handle on the worker.
pub(crate) struct WorkerHandle {
    inbox: mpsc::UnboundedSender<Command>,
    done: crossbeam_channel::Receiver<()>,
    thread: Option<JoinHandle<()>>,
}

/// Channels the manager keeps.
pub(crate) struct WorkerLinks {
    pub(crate) handle: WorkerHandle,
    pub(crate) results: crossbeam_channel::Receiver<Finished>,
    pub(crate) ready: Arc<AtomicBool>,
    pub(crate) notify: Arc<Notify>,
}

pub(crate) fn spawn<T: Tier>(
    tier: Arc<T>,
    cfg: &ManagerConfig,
    hook: Option<WakeHook>,
) -> Result<WorkerLinks, ManagerError> {
    let spawn_err = |source| ManagerError::Spawn {
        tier: cfg.tier_name.clone(),
        source,
    };
    let runtime = if cfg.worker_threads <= 1 {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
    } else {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(cfg.worker_threads)
            .thread_name(format!("kvtier-{}-rt", cfg.tier_name))
            .enable_all()
            .build()
    }
    .map_err(spawn_err)?;

    let (inbox, rx) = mpsc::unbounded_channel();
    let (out, results) = crossbeam_channel::unbounded();
    let (done_tx, done) = crossbeam_channel::bounded(1);
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
    let thread = std::thread::Builder::new()
        .name(format!("kvtier-lookup-{}", cfg.tier_name))
        .spawn(move || {
            runtime.block_on(run(tier, rx, publisher, tier_name, slots));
            // Never wait here for a call that ignores cancellation (a
            // blocking task, a hung syscall): drop the runtime in the background.
            runtime.shutdown_background();
            let _ = done_tx.send(());
        })
        .map_err(spawn_err)?;
    Ok(WorkerLinks {
        handle: WorkerHandle {
            inbox,
            done,
            thread: Some(thread),
        },
        results,
        ready,
        notify,
    })
}

async fn run<T: Tier>(
    tier: Arc<T>,
    mut inbox: mpsc::UnboundedReceiver<Command>,
    publisher: Publisher,
    tier_name: Arc<str>,
    slots: Arc<Semaphore>,
) {
    let mut calls = JoinSet::new();
    loop {
        tokio::select! {
            command = inbox.recv() => match command {
                Some(Command::Call(call)) => {
                    calls.spawn(run_call(
                        Arc::clone(&tier),
                        call,
                        publisher.clone(),
                        Arc::clone(&tier_name),
                        Arc::clone(&slots),
                    ));
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
                    calls.abort_all();
                    return;
                }
                None => {
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
    publisher: Publisher,
    tier_name: Arc<str>,
    slots: Arc<Semaphore>,
) {
    // A free call slot first, within the call's deadline; the slot is held
    // until the outcome is published.
    let arrived = Instant::now();
    let _slot = match tokio::time::timeout_at(call.deadline.into(), slots.acquire_owned()).await {
        Ok(Ok(permit)) => permit,
        Ok(Err(_)) => return, // the semaphore is never closed
        Err(_) => {
            publisher.publish(Finished {
                id: call.id,
                outcome: CallOutcome::TimedOut,
                elapsed: arrived.elapsed(),
            });
            return;
        }
    };
    let started = Instant::now();
    let span = tracing::debug_span!(
        "tier_call",
        tier = %tier_name,
        call = call.id.0,
        keys = call.keys.len(),
        outcome = tracing::field::Empty,
        elapsed_us = tracing::field::Empty,
    );
    let keys = Arc::clone(&call.keys);
    let ctx = call.ctx.clone();
    // A task of its own, so a panic in the tier is caught as a JoinError and
    // a timeout can abort it.
    let mut task =
        tokio::spawn(async move { tier.batch_lookup(&keys, &ctx).await }.instrument(span.clone()));
    let outcome = match tokio::time::timeout_at(call.deadline.into(), &mut task).await {
        Ok(Ok(Ok(found))) => CallOutcome::Answered(found),
        Ok(Ok(Err(err))) => CallOutcome::Failed(err),
        Ok(Err(join)) if join.is_panic() => CallOutcome::Failed(TierError::new(
            TierErrorKind::Panicked,
            format!("batch_lookup panicked for {} keys", call.keys.len()),
        )),
        Ok(Err(_)) => CallOutcome::Failed(TierError::new(
            TierErrorKind::Other,
            "batch_lookup task was cancelled",
        )),
        Err(_) => {
            task.abort();
            CallOutcome::TimedOut
        }
    };
    let elapsed = started.elapsed();
    let label = match &outcome {
        CallOutcome::Answered(found) if found.len() == call.keys.len() => "answered",
        CallOutcome::Answered(_) => "wrong_result_count",
        CallOutcome::Failed(err) => err.kind().as_str(),
        CallOutcome::TimedOut => "deadline",
    };
    span.record("outcome", label);
    span.record("elapsed_us", elapsed.as_micros() as u64);
    publisher.publish(Finished {
        id: call.id,
        outcome,
        elapsed,
    });
}

impl WorkerHandle {
    /// Hands a call to the worker; returns its id back if the worker is gone.
    pub(crate) fn send(&self, call: TierCall) -> Result<(), CallId> {
        let id = call.id;
        self.inbox.send(Command::Call(call)).map_err(|_| id)
    }

    /// Asks the worker to stop and waits for it at most `timeout`. Returns
    /// whether it stopped in time; if not, its thread is left to finish alone.
    pub(crate) fn stop(&mut self, timeout: Duration) -> bool {
        let _ = self.inbox.send(Command::Shutdown { grace: timeout / 2 });
        let stopped = self.done.recv_timeout(timeout).is_ok();
        // Once it has signalled done, joining returns at once; otherwise
        // dropping the handle detaches the thread.
        if let Some(thread) = self.thread.take()
            && stopped
        {
            let _ = thread.join();
        }
        stopped
    }
}
