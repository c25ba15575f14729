//! [`Spawner`]: the tokio runtime a manager's worker runs on, either one the
//! spawner starts (and stops when its last clone drops) or the caller's.

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::Duration;

use tokio::runtime::{Handle, Runtime, RuntimeFlavor};
use tokio::sync::{Notify, oneshot};

use crate::config::ManagerConfig;
use crate::error::ManagerError;
use crate::task::AbortOnDrop;

/// Where lookup workers run: a cheap, cloneable handle on a tokio runtime.
///
/// - [`Spawner::dedicated`] starts a runtime of its own, on threads named
///   after the spawner. It stops, in the background and without ever
///   blocking, when the last clone drops: a manager or stack keeps a clone
///   while it runs.
/// - [`Spawner::from_handle`] (or [`Spawner::current`]) runs the workers on
///   the caller's runtime: no thread is started.
///
/// Every manager built on one spawner shares its runtime, so a
/// [`TierStack`](crate::TierStack) of three tiers on
/// `Spawner::dedicated("kvtier-stack", 1)` runs one OS thread, not three.
/// Each manager keeps its own limits (call slots, deadlines, results
/// channel).
///
/// # The caller's runtime
///
/// - It needs tokio's time driver (`enable_time`, or `enable_all` as
///   `#[tokio::main]` and `Runtime::new` do): deadlines are tokio timers.
///   Without it, each tier call fails and its keys resolve as counted
///   errors. A tier that does I/O needs the I/O driver too.
/// - A **current-thread** runtime runs the worker only while something
///   drives it: a scheduler that awaits between steps (on
///   [`ResultsNotifier::notified`](crate::ResultsNotifier::notified), a
///   sleep, or anything else) inside `block_on`, or another thread blocked
///   in `block_on`. A scheduler that never yields to it leaves the calls
///   idle until their deadline, when their keys resolve as counted
///   timeouts (nothing stays pending forever). For a synchronous scheduler
///   thread, use a dedicated spawner or a multi-thread runtime.
/// - If the runtime shuts down while managers still use it, their running
///   calls and every later call resolve as counted errors
///   ([`Unavailable`](crate::TierErrorKind::Unavailable)); nothing panics.
///
/// ```
/// use std::sync::Arc;
/// use kvtier_core::{AsyncLookupManager, ManagerConfig, OffloadKey, ReqContext, Spawner, Tier, TierError};
///
/// struct Nothing;
/// impl Tier for Nothing {
///     async fn batch_lookup(&self, keys: &[OffloadKey], _: &ReqContext) -> Result<Vec<bool>, TierError> {
///         Ok(vec![false; keys.len()])
///     }
/// }
///
/// let runtime = tokio::runtime::Runtime::new()?;
/// let spawner = Spawner::from_handle(runtime.handle().clone());
/// let mut manager = AsyncLookupManager::with_spawner(Arc::new(Nothing), ManagerConfig::named("none"), &spawner)?;
/// let report = runtime.block_on(manager.shutdown_async());
/// assert!(report.worker_stopped);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct Spawner {
    inner: Arc<Inner>,
}

struct Inner {
    handle: Handle,
    owned: Owned,
}

enum Owned {
    /// The caller's runtime: nothing to stop.
    Caller,
    /// A current-thread runtime driven by a thread of its own until this
    /// sender drops; the thread then shuts it down in the background.
    Driven {
        _stop: oneshot::Sender<()>,
        name: String,
    },
    /// A multi-thread runtime, shut down in the background on drop.
    Pool { _runtime: Background, name: String },
}

/// A runtime that is shut down without waiting, wherever it is dropped
/// (inside another runtime too, where a plain drop would panic).
struct Background(Option<Runtime>);

impl Drop for Background {
    fn drop(&mut self) {
        if let Some(runtime) = self.0.take() {
            runtime.shutdown_background();
        }
    }
}

impl Spawner {
    /// Starts a runtime of its own: `worker_threads == 1` is a current-thread
    /// runtime on one thread named `name`; more is a multi-thread runtime of
    /// that many workers, each named `name`. Threads of its blocking pool
    /// (used by [`Blocking`](crate::Blocking) tiers) carry the name too.
    /// Linux shows the first 15 bytes of a thread's name.
    ///
    /// The runtime is shut down in the background when the last clone of
    /// the spawner drops; dropping never blocks, and a call that ignores
    /// cancellation is left to end on its own.
    ///
    /// # Errors
    /// [`ManagerError::InvalidConfig`] for `worker_threads` outside 1 to
    /// [`ManagerConfig::MAX_WORKER_THREADS`] or a name with a NUL
    /// character; [`ManagerError::Spawn`] if the OS refuses the thread or
    /// the runtime.
    pub fn dedicated(name: impl Into<String>, worker_threads: usize) -> Result<Self, ManagerError> {
        let name = name.into();
        if worker_threads == 0 || worker_threads > ManagerConfig::MAX_WORKER_THREADS {
            return Err(ManagerError::InvalidConfig {
                field: "worker_threads",
                reason: format!(
                    "must be 1 to {}, not {worker_threads}",
                    ManagerConfig::MAX_WORKER_THREADS
                ),
            });
        }
        if name.contains('\0') {
            return Err(ManagerError::InvalidConfig {
                field: "spawner name",
                reason: "must not contain a NUL character".to_owned(),
            });
        }
        Self::start(name.clone(), worker_threads)
            .map_err(|source| ManagerError::Spawn { tier: name, source })
    }

    /// Starts the runtime of a name already checked.
    pub(crate) fn start(name: String, worker_threads: usize) -> std::io::Result<Self> {
        if worker_threads > 1 {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(worker_threads)
                .thread_name(name.clone())
                .enable_all()
                .build()?;
            return Ok(Self::owned(
                runtime.handle().clone(),
                Owned::Pool {
                    _runtime: Background(Some(runtime)),
                    name,
                },
            ));
        }
        let runtime = tokio::runtime::Builder::new_current_thread()
            .thread_name(name.clone())
            .enable_all()
            .build()?;
        let handle = runtime.handle().clone();
        let runtime = Background(Some(runtime));
        let (stop, stopped) = oneshot::channel::<()>();
        // If the thread cannot start, the closure drops here and `Background`
        // shuts the runtime down without blocking.
        std::thread::Builder::new()
            .name(name.clone())
            .spawn(move || {
                if let Some(rt) = &runtime.0 {
                    // Runs every task spawned on the runtime until the last
                    // spawner clone drops `stop`.
                    let _ = rt.block_on(stopped);
                }
                drop(runtime);
            })?;
        Ok(Self::owned(handle, Owned::Driven { _stop: stop, name }))
    }

    fn owned(handle: Handle, owned: Owned) -> Self {
        Self {
            inner: Arc::new(Inner { handle, owned }),
        }
    }

    /// Runs workers on the caller's runtime (see the type's docs for what a
    /// current-thread runtime needs). Never starts a thread; dropping the
    /// spawner leaves the runtime alone.
    pub fn from_handle(handle: Handle) -> Self {
        Self::owned(handle, Owned::Caller)
    }

    /// [`from_handle`](Self::from_handle) with the runtime this thread is in.
    ///
    /// # Errors
    /// [`ManagerError::NoRuntime`] outside a tokio runtime.
    pub fn current() -> Result<Self, ManagerError> {
        Handle::try_current()
            .map(Self::from_handle)
            .map_err(|source| ManagerError::NoRuntime { source })
    }

    /// The runtime's handle, for a tier's own tasks.
    pub fn handle(&self) -> &Handle {
        &self.inner.handle
    }

    /// Whether the spawner started its runtime (rather than borrowing the caller's).
    pub fn is_dedicated(&self) -> bool {
        !matches!(self.inner.owned, Owned::Caller)
    }

    /// Runs `future` as a task on the runtime; the task is aborted when the
    /// returned handle drops, and awaiting the handle (from any runtime)
    /// gives its output. A tier runs its I/O this way on the spawner it
    /// keeps, so a cancelled call cancels its requests.
    ///
    /// On a runtime that has shut down (a caller's, see
    /// [`from_handle`](Self::from_handle)), the future is dropped unpolled
    /// and the handle answers a cancelled [`JoinError`](tokio::task::JoinError).
    pub fn spawn<T: Send + 'static>(
        &self,
        future: impl Future<Output = T> + Send + 'static,
    ) -> AbortOnDrop<T> {
        AbortOnDrop::new(self.inner.handle.spawn(future))
    }

    /// Runs `future` on the runtime, detached. On a runtime that has shut
    /// down, the future is dropped at once, unpolled.
    pub(crate) fn spawn_detached(&self, future: impl Future<Output = ()> + Send + 'static) {
        drop(self.inner.handle.spawn(future));
    }
}

impl fmt::Debug for Spawner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("Spawner");
        match &self.inner.owned {
            Owned::Caller => d.field("runtime", &"caller"),
            Owned::Driven { name, .. } => d.field("runtime", &"dedicated").field("name", name),
            Owned::Pool { name, .. } => d.field("runtime", &"dedicated").field("name", name),
        };
        let flavor = match self.inner.handle.runtime_flavor() {
            RuntimeFlavor::CurrentThread => "current_thread",
            RuntimeFlavor::MultiThread => "multi_thread",
            _ => "other",
        };
        d.field("flavor", &flavor).finish()
    }
}

/// A one-way flag that threads can wait for with a timeout and tasks can
/// await: how the worker says it has stopped.
#[derive(Default)]
pub(crate) struct Latch {
    set: Mutex<bool>,
    flag: AtomicBool,
    changed: Condvar,
    notify: Notify,
}

impl Latch {
    pub(crate) fn set(&self) {
        *self.set.lock().unwrap_or_else(PoisonError::into_inner) = true;
        self.flag.store(true, Ordering::Release);
        self.changed.notify_all();
        self.notify.notify_waiters();
    }

    pub(crate) fn is_set(&self) -> bool {
        self.flag.load(Ordering::Acquire)
    }

    /// Blocks the thread until set or `timeout`; returns whether it is set.
    pub(crate) fn wait_timeout(&self, timeout: Duration) -> bool {
        let guard = self.set.lock().unwrap_or_else(PoisonError::into_inner);
        let (guard, _) = self
            .changed
            .wait_timeout_while(guard, timeout, |set| !*set)
            .unwrap_or_else(PoisonError::into_inner);
        *guard
    }

    /// Completes once set.
    pub(crate) async fn wait(&self) {
        loop {
            let notified = self.notify.notified();
            let mut notified = std::pin::pin!(notified);
            // Registered before the check, so a `set` in between wakes it.
            notified.as_mut().enable();
            if self.is_set() {
                return;
            }
            notified.await;
        }
    }
}

/// Sets its latch when dropped: when the worker's task ends, however it ends
/// (returned, or dropped unpolled or mid-way by a runtime shutting down).
pub(crate) struct SetOnDrop(pub(crate) Arc<Latch>);

impl Drop for SetOnDrop {
    fn drop(&mut self) {
        self.0.set();
    }
}
