//! A tier whose `batch_lookup` is a Python method of the manager object.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyList, PyWeakrefReference};

use kvtier_core::{OffloadKey, ReqContext, SyncTier, TierError, TierErrorKind};

/// What the scheduler side and the worker share about Python calls.
#[derive(Debug, Default)]
pub(crate) struct PyCalls {
    /// `batch_lookup` calls that returned (counted while the GIL is still held).
    returned: AtomicU64,
    /// Results the worker published (counted by the manager's wake hook).
    published: AtomicU64,
    /// The `req_context` object each request first passed, by request id.
    contexts: Mutex<HashMap<Arc<str>, Py<PyAny>>>,
}

impl PyCalls {
    pub(crate) fn on_published(&self) {
        self.published.fetch_add(1, Ordering::AcqRel);
    }

    /// Waits (without the GIL) until every `batch_lookup` that has returned
    /// has had its answers published, at most `limit`: a lookup made right
    /// after a `batch_lookup` returned sees its answers.
    #[inline]
    pub(crate) fn wait_published(&self, py: Python<'_>, limit: Duration) {
        if self.returned.load(Ordering::Acquire) <= self.published.load(Ordering::Acquire) {
            return;
        }
        py.allow_threads(|| {
            let started = Instant::now();
            while self.returned.load(Ordering::Acquire) > self.published.load(Ordering::Acquire)
                && started.elapsed() < limit
            {
                std::thread::yield_now();
            }
        });
    }

    /// Remembers the first context object of `req_id`.
    pub(crate) fn remember(&self, req_id: &Arc<str>, ctx: &Bound<'_, PyAny>) {
        let mut map = self.contexts.lock().unwrap_or_else(PoisonError::into_inner);
        if !map.contains_key(req_id) {
            map.insert(Arc::clone(req_id), ctx.clone().unbind());
        }
    }

    /// Forgets `req_id`'s context object; the caller drops it after the lock.
    pub(crate) fn forget(&self, req_id: &str) -> Option<Py<PyAny>> {
        self.contexts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(req_id)
    }

    fn context(&self, py: Python<'_>, req_id: &str) -> Option<Py<PyAny>> {
        self.contexts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(req_id)
            .map(|obj| obj.clone_ref(py))
    }
}

/// Calls `owner.batch_lookup(keys, req_context)` on the worker's blocking
/// pool. The owner is held weakly: the manager object owns the worker, not
/// the other way round.
#[derive(Debug)]
pub(crate) struct PyTier {
    owner: Py<PyWeakrefReference>,
    calls: Arc<PyCalls>,
}

impl PyTier {
    pub(crate) fn new(owner: Py<PyWeakrefReference>, calls: Arc<PyCalls>) -> Self {
        Self { owner, calls }
    }
}

fn error(kind: TierErrorKind, message: String) -> TierError {
    TierError::new(kind, message)
}

/// Reads `answer` as exactly `expected` bools; stops reading one item past.
fn answers(answer: &Bound<'_, PyAny>, expected: usize) -> Result<Vec<bool>, TierError> {
    let iter = answer.try_iter().map_err(|e| {
        error(
            TierErrorKind::InvalidInput,
            format!("batch_lookup returned a non-iterable: {e}"),
        )
    })?;
    let mut found = Vec::with_capacity(expected);
    for (index, item) in iter.enumerate() {
        let item = item.map_err(|e| {
            error(
                TierErrorKind::Other,
                format!("batch_lookup's answer raised after {index} items: {e}"),
            )
        })?;
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

impl SyncTier for PyTier {
    fn batch_lookup_blocking(
        &self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
    ) -> Result<Vec<bool>, TierError> {
        Python::with_gil(|py| {
            let result = (|| {
                let Some(owner) = self.owner.bind(py).upgrade() else {
                    return Err(error(
                        TierErrorKind::Unavailable,
                        "the manager object no longer exists".to_owned(),
                    ));
                };
                let ctx_obj = match self.calls.context(py, ctx.req_id()) {
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
                let answer = owner
                    .call_method1(pyo3::intern!(py, "batch_lookup"), (list, ctx_obj))
                    .map_err(|e| {
                        error(
                            TierErrorKind::Other,
                            format!("batch_lookup raised {e} for {} keys", keys.len()),
                        )
                    })?;
                answers(&answer, keys.len())
            })();
            // Counted while the GIL is held: a scheduler thread that runs
            // next waits for the publication (see `wait_published`).
            self.calls.returned.fetch_add(1, Ordering::AcqRel);
            result
        })
    }
}

/// A stand-in context for a request cleaned up before its call ran.
fn fallback_context<'py>(py: Python<'py>, req_id: &str) -> PyResult<Bound<'py, PyAny>> {
    let types = py.import("types")?;
    let kwargs = pyo3::types::PyDict::new(py);
    kwargs.set_item("req_id", req_id)?;
    types.getattr("SimpleNamespace")?.call((), Some(&kwargs))
}
