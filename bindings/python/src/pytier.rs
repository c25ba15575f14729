//! A tier whose `batch_lookup` is a Python method of the manager object,
//! called on the worker runtime's blocking pool (through
//! [`PyCall`](crate::lifecycle::PyCall): see the interpreter's exit there).
//!
//! A lookup made right after `batch_lookup` returned sees its answers,
//! though the lookup never waits: the thread that ran `batch_lookup` keeps
//! the GIL until the worker has published them (a hand-over between two
//! threads that need no GIL, bounded by [`PUBLISH_LIMIT`]), and the
//! scheduler's lookup needs the GIL to run at all.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyList, PyTuple, PyWeakrefReference};
use tokio::sync::oneshot;

use kvtier_core::{OffloadKey, ReqContext, Tier, TierError, TierErrorKind};

use crate::contexts::FirstObjects;
use crate::errors;
use crate::lifecycle::PyCall;

/// How long the thread that ran `batch_lookup` keeps the GIL waiting for
/// the publication of its answers (microseconds in practice; bounded for a
/// worker that is stopping or starved).
const PUBLISH_LIMIT: Duration = Duration::from_millis(200);

/// Where one tier call stands between its `batch_lookup` and the
/// publication of its outcome, which may come first: a call that timed out
/// is published while its Python code still runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CallState {
    /// `batch_lookup` is running (or about to).
    Running,
    /// Its answers were handed to the worker; their publication is awaited.
    Handed,
    /// The outcome was published while `batch_lookup` still ran.
    Published,
}

/// The calls whose `batch_lookup` started and whose accounting is not
/// over, by call id ([`kvtier_core::current_call`]); shared by the Python
/// thread and the wake hook.
#[derive(Debug, Default)]
pub(crate) struct PyCalls {
    states: Mutex<CallStates>,
    published: Condvar,
    /// A `BaseException` that is not an `Exception` (`KeyboardInterrupt`,
    /// `SystemExit`), raised by `batch_lookup` or its answer: raised again,
    /// unchanged, by the scheduler's next call of the manager.
    raised: Mutex<Option<PyErr>>,
    /// Whether `raised` holds one (read by every lookup).
    has_raised: AtomicBool,
}

#[derive(Debug, Default)]
struct CallStates {
    calls: HashMap<u64, CallState>,
    /// Set by `close`: nothing waits for a publication any more.
    closed: bool,
}

impl PyCalls {
    fn states(&self) -> MutexGuard<'_, CallStates> {
        self.states.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Call `id`'s `batch_lookup` is about to run.
    fn started(&self, id: u64) {
        self.states().calls.insert(id, CallState::Running);
    }

    /// Call `id`'s `batch_lookup` returned: hands its answers to the worker
    /// with `deliver`, then waits (the caller holding the GIL) until they
    /// are published, unless the call's outcome was published already (it
    /// timed out) or `deliver` finds nobody waiting for them.
    fn returned(&self, id: Option<u64>, deliver: impl FnOnce() -> bool) {
        let Some(id) = id else {
            deliver();
            return;
        };
        let mut states = self.states();
        if states.calls.get(&id) == Some(&CallState::Published) {
            states.calls.remove(&id);
            return;
        }
        if !deliver() {
            states.calls.remove(&id);
            return;
        }
        states.calls.insert(id, CallState::Handed);
        let deadline = Instant::now() + PUBLISH_LIMIT;
        while !states.closed && states.calls.get(&id) == Some(&CallState::Handed) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            states = self
                .published
                .wait_timeout(states, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        states.calls.remove(&id);
    }

    /// The wake hook: the outcome of the current call was just published.
    pub(crate) fn on_published(&self) {
        // Outside a call's task (a call cut short by its runtime shutting
        // down) there is no id, and no Python call to account for.
        let Some(id) = kvtier_core::current_call() else {
            return;
        };
        let mut states = self.states();
        match states.calls.get(&id) {
            Some(CallState::Running) => {
                states.calls.insert(id, CallState::Published);
            }
            Some(CallState::Handed) => {
                states.calls.remove(&id);
                self.published.notify_all();
            }
            // Never started (timed out waiting for a slot), or done.
            Some(CallState::Published) | None => {}
        }
    }

    /// Keeps `err` for the scheduler's next call (the first one wins).
    fn keep_raised(&self, err: PyErr) {
        let mut raised = self.raised.lock().unwrap_or_else(PoisonError::into_inner);
        if raised.is_none() {
            *raised = Some(err);
            self.has_raised.store(true, Ordering::Release);
        }
    }

    /// The exception a `batch_lookup` raised that the scheduler's call must
    /// raise, if any.
    #[inline(always)]
    pub(crate) fn take_raised(&self) -> Option<PyErr> {
        if !self.has_raised.load(Ordering::Acquire) {
            return None;
        }
        self.has_raised.store(false, Ordering::Release);
        self.raised
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take()
    }

    /// The manager shut down: no publication is awaited any more.
    pub(crate) fn close(&self) {
        self.states().closed = true;
        self.published.notify_all();
    }
}

/// Calls `owner.batch_lookup(keys, req_context)` on the worker's blocking
/// pool. The owner is held weakly: the manager object owns the worker, not
/// the other way round.
#[derive(Debug)]
pub(crate) struct PyTier {
    owner: Py<PyWeakrefReference>,
    calls: Arc<PyCalls>,
    contexts: Arc<FirstObjects>,
}

impl PyTier {
    pub(crate) fn new(
        owner: Py<PyWeakrefReference>,
        calls: Arc<PyCalls>,
        contexts: Arc<FirstObjects>,
    ) -> Self {
        Self {
            owner,
            calls,
            contexts,
        }
    }
}

fn error(kind: TierErrorKind, message: String) -> TierError {
    TierError::new(kind, message)
}

/// A `batch_lookup` that raised `err`: the call's error. A `BaseException`
/// that is not an `Exception` is also kept for the scheduler (see
/// [`PyCalls::take_raised`]).
fn raised(
    py: Python<'_>,
    calls: &PyCalls,
    err: PyErr,
    describe: impl FnOnce(&PyErr) -> TierError,
) -> TierError {
    let tier_error = describe(&err);
    if errors::is_base_only(py, &err) {
        calls.keep_raised(err);
    }
    tier_error
}

/// Reads `answer` as exactly `expected` bools; stops reading one item past.
fn answers(
    py: Python<'_>,
    calls: &PyCalls,
    answer: &Bound<'_, PyAny>,
    expected: usize,
) -> Result<Vec<bool>, TierError> {
    let python = PyCall::new(py);
    let iter = python.iter(answer).map_err(|e| {
        raised(py, calls, e, |e| {
            error(
                TierErrorKind::InvalidInput,
                format!("batch_lookup returned a non-iterable: {e}"),
            )
        })
    })?;
    let mut found = Vec::with_capacity(expected);
    for index in 0.. {
        let item = match python.next(&iter) {
            Ok(Some(item)) => item,
            Ok(None) => break,
            Err(e) => {
                return Err(raised(py, calls, e, |e| {
                    error(
                        TierErrorKind::Other,
                        format!("batch_lookup's answer raised after {index} items: {e}"),
                    )
                }));
            }
        };
        if index >= expected {
            return Err(error(
                TierErrorKind::WrongResultCount,
                format!("batch_lookup answered more than {expected} items for {expected} keys"),
            ));
        }
        match item.downcast::<PyBool>() {
            Ok(b) => found.push(b.is_true()),
            Err(_) => {
                return Err(error(
                    TierErrorKind::InvalidInput,
                    format!(
                        "batch_lookup answered a {} at index {index}; answers must be bool",
                        crate::convert::type_name(&item)
                    ),
                ));
            }
        }
    }
    if found.len() != expected {
        return Err(error(
            TierErrorKind::WrongResultCount,
            format!(
                "batch_lookup answered {} items for {expected} keys",
                found.len()
            ),
        ));
    }
    Ok(found)
}

/// [`PyTier`] as a [`Tier`]: runs the Python call on the runtime's
/// blocking pool, knowing which tier call it serves (the wake hook then
/// tells that call's publication apart from the others').
#[derive(Debug)]
pub(crate) struct PyTierTask(pub(crate) Arc<PyTier>);

impl Tier for PyTierTask {
    async fn batch_lookup(
        &self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
    ) -> Result<Vec<bool>, TierError> {
        let call = kvtier_core::current_call();
        if let Some(id) = call {
            self.0.calls.started(id);
        }
        let tier = Arc::clone(&self.0);
        let keys = keys.to_vec();
        let ctx = ctx.clone();
        // The answer comes back through `answer` while the Python thread
        // still holds the GIL (see the module docs); the task's own result
        // only says whether it panicked.
        let (answer, answered) = oneshot::channel();
        let task = tokio::task::spawn_blocking(move || tier.call(&keys, &ctx, call, answer));
        if let Ok(found) = answered.await {
            return found;
        }
        match task.await {
            Err(join) if join.is_panic() => Err(error(
                TierErrorKind::Panicked,
                "the Python batch_lookup call panicked".to_owned(),
            )),
            _ => Err(error(
                TierErrorKind::Other,
                "the Python batch_lookup call was cancelled".to_owned(),
            )),
        }
    }
}

impl PyTier {
    /// Calls `batch_lookup` (on a blocking thread) and sends its answer;
    /// `call` is the tier call's id, if known.
    fn call(
        &self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
        call: Option<u64>,
        answer: oneshot::Sender<Result<Vec<bool>, TierError>>,
    ) {
        Python::with_gil(|py| {
            let found = self.ask(py, keys, ctx);
            self.calls
                .returned(call, move || answer.send(found).is_ok());
        });
    }

    fn ask(
        &self,
        py: Python<'_>,
        keys: &[OffloadKey],
        ctx: &ReqContext,
    ) -> Result<Vec<bool>, TierError> {
        let Some(owner) = self.owner.bind(py).upgrade() else {
            return Err(error(
                TierErrorKind::Unavailable,
                "the manager object no longer exists".to_owned(),
            ));
        };
        let ctx_obj = match self.contexts.get(py, ctx.req_id()) {
            Some(obj) => obj.into_bound(py),
            None => fallback_context(py, ctx.req_id()).map_err(|e| {
                error(
                    TierErrorKind::Other,
                    format!("could not build a req_context: {e}"),
                )
            })?,
        };
        let list = PyList::new(py, keys.iter().map(|k| PyBytes::new(py, k.as_bytes())))
            .map_err(|e| error(TierErrorKind::Other, e.to_string()))?;
        // Through `PyCall`: Python code on a kvtier thread (see `lifecycle`).
        let python = PyCall::new(py);
        let args = PyTuple::new(py, [list.into_any(), ctx_obj])
            .map_err(|e| error(TierErrorKind::Other, e.to_string()))?;
        let answer = python
            .getattr(owner.as_any(), pyo3::intern!(py, "batch_lookup"))
            .and_then(|method| python.call(&method, &args))
            .map_err(|e| {
                raised(py, &self.calls, e, |e| {
                    error(
                        TierErrorKind::Other,
                        format!("batch_lookup raised {e} for {} keys", keys.len()),
                    )
                })
            })?;
        answers(py, &self.calls, &answer, keys.len())
    }
}

/// A stand-in context for a request cleaned up before its call ran.
fn fallback_context<'py>(py: Python<'py>, req_id: &str) -> PyResult<Bound<'py, PyAny>> {
    let types = py.import("types")?;
    let kwargs = pyo3::types::PyDict::new(py);
    kwargs.set_item("req_id", req_id)?;
    types.getattr("SimpleNamespace")?.call((), Some(&kwargs))
}
