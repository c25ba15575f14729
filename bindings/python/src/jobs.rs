//! The block data path of the native managers: `submit_store`,
//! `submit_load`, `poll_jobs` and `drain_jobs`, over the core's
//! [`TransferQueue`] and the caller's buffer ([`PyRows`]).
//!
//! A manager's queue is made at its first submit, on the manager's runtime
//! and over its tier's [`BlockStore`](kvtier_core::BlockStore) batch forms;
//! its copies run on kvtier's threads without the GIL and without a
//! `bytes` object per block. Each job holds the caller's `Py_buffer` until
//! it ends (see [`crate::pybuffer`]).
//!
//! `poll_jobs` applies each finished job to the lookup state before it
//! returns it: a store's successful keys are marked present, a load's keys
//! that were absent or failed are marked missing.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};

use kvtier_core::{
    DynBlockStore, HostBuffer, JobKind, JobReport, OffloadKey, Region, Spawner, SubmitError,
    TierError, TierErrorKind, TransferConfig, TransferQueue,
};

use kvtier_core::DynLookupManager;

use crate::errors::{self, ShutDownError};
use crate::manager::Inner;
use crate::pybuffer::{BufferProblem, PyRows, release_finished};

/// What a manager needs to make its queue: its tier's store and runtime.
#[derive(Clone)]
pub(crate) struct QueueSource {
    pub(crate) store: Arc<dyn DynBlockStore>,
    pub(crate) spawner: Spawner,
    /// The key lengths the manager's lookups accept (the same rule here).
    pub(crate) key_lens: (usize, usize),
}

/// A native manager's transfer queue, made at the first submit.
#[derive(Default)]
pub(crate) struct Jobs {
    queue: Mutex<Option<Arc<TransferQueue>>>,
    /// Set by shutdown: no queue is made any more.
    closed: Mutex<bool>,
}

impl Jobs {
    /// The queue, made from `source` the first time.
    fn queue(&self, source: impl FnOnce() -> Option<QueueSource>) -> Option<Arc<TransferQueue>> {
        let mut slot = self.queue.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(queue) = &*slot {
            return Some(Arc::clone(queue));
        }
        if *self.closed.lock().unwrap_or_else(PoisonError::into_inner) {
            return None;
        }
        let source = source()?;
        let queue =
            TransferQueue::from_dyn(source.store, TransferConfig::default(), &source.spawner)
                .ok()?;
        let queue = Arc::new(queue);
        *slot = Some(Arc::clone(&queue));
        Some(queue)
    }

    /// The queue if one was made.
    fn existing(&self) -> Option<Arc<TransferQueue>> {
        self.queue
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Shuts the queue down within `timeout` (no GIL needed: the caller
    /// has released it): queued jobs are cancelled, running ones stopped
    /// at their next chunk. Their reports stay for `poll_jobs`.
    pub(crate) fn shutdown(&self, timeout: Duration) {
        *self.closed.lock().unwrap_or_else(PoisonError::into_inner) = true;
        if let Some(queue) = self.existing() {
            queue.shutdown(timeout);
        }
    }
}

/// How a finished job went, as `poll_jobs` returns it.
#[pyclass(frozen, get_all, module = "kvtier._kvtier", name = "JobResult")]
pub(crate) struct JobResult {
    /// The id `submit_store` / `submit_load` returned.
    job_id: u64,
    /// `"store"` or `"load"`.
    kind: &'static str,
    /// Whether every key was stored or loaded.
    ok: bool,
    /// The keys stored or loaded, in submission order.
    successful_keys: Py<PyList>,
    /// Bytes of the successful keys.
    bytes: u64,
    /// From the job's first copy to its last.
    seconds: f64,
    /// Why the first key that failed did (`None` when `ok`, or when the
    /// only trouble was keys absent from the tier).
    error: Option<String>,
}

#[pymethods]
impl JobResult {
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "JobResult(job_id={}, kind={:?}, ok={}, successful_keys=<{} keys>, bytes={}, seconds={:.6}, error={:?})",
            self.job_id,
            self.kind,
            self.ok,
            self.successful_keys.bind(py).len(),
            self.bytes,
            self.seconds,
            self.error,
        )
    }
}

impl JobResult {
    fn from_report(py: Python<'_>, report: &JobReport) -> PyResult<Self> {
        let keys = PyList::empty(py);
        for key in report.successful_keys() {
            keys.append(PyBytes::new(py, key.as_bytes()))?;
        }
        let ok = report.ok();
        let error = if ok {
            None
        } else {
            Some(match report.first_error() {
                Some(err) => kvtier_core::one_line(&**err),
                None => {
                    let absent = report.unsuccessful_keys().count();
                    format!(
                        "{absent} of {} keys absent from the tier",
                        report.keys.len()
                    )
                }
            })
        };
        Ok(Self {
            job_id: report.id.0,
            kind: match report.kind {
                JobKind::Store => "store",
                JobKind::Load => "load",
            },
            ok,
            successful_keys: keys.unbind(),
            bytes: report.bytes,
            seconds: report.transfer_time.as_secs_f64(),
            error,
        })
    }
}

/// A bad argument of a submit: `kvtier.TierInvalidInputError` (a `ValueError`).
fn invalid(py: Python<'_>, what: &str, message: String) -> PyErr {
    errors::tier_error(
        py,
        what,
        &TierError::new(TierErrorKind::InvalidInput, message),
    )
}

/// Row numbers from a list, a tuple, a numpy integer array or any
/// iterable of integers.
fn row_numbers(py: Python<'_>, what: &str, rows: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    let mut out = Vec::with_capacity(rows.len().unwrap_or(0));
    for item in rows
        .try_iter()
        .map_err(|_| PyTypeError::new_err("rows must be a sequence of ints"))?
    {
        let item = item?;
        let row: i64 = item.extract().map_err(|_| {
            invalid(
                py,
                what,
                format!(
                    "rows must be integers, not {}",
                    crate::convert::type_name(&item)
                ),
            )
        })?;
        out.push(row);
    }
    Ok(out)
}

impl Inner {
    /// `submit_store` / `submit_load`: checks the arguments and queues the
    /// job; never waits for I/O.
    pub(crate) fn submit_job(
        &self,
        py: Python<'_>,
        kind: JobKind,
        keys: &Bound<'_, PyAny>,
        view: &Bound<'_, PyAny>,
        rows: &Bound<'_, PyAny>,
    ) -> PyResult<u64> {
        release_finished(py);
        let what = match kind {
            JobKind::Store => "submit_store",
            JobKind::Load => "submit_load",
        };
        let source = self.queue_source()?;
        let keys: Vec<OffloadKey> = crate::convert::keys(keys)?;
        if let Some(i) = keys.iter().position(OffloadKey::is_empty) {
            return Err(invalid(py, what, format!("key {i} is empty")));
        }
        let (min, max) = source.key_lens;
        if let Some(key) = keys.iter().find(|k| !(min..=max).contains(&k.len())) {
            return Err(errors::lookup_error(kvtier_core::LookupError::InvalidKey {
                len: key.len(),
                min,
                max,
            }));
        }
        let rows = row_numbers(py, what, rows)?;
        if rows.len() != keys.len() {
            return Err(invalid(
                py,
                what,
                format!(
                    "{} keys but {} rows: one row per key",
                    keys.len(),
                    rows.len()
                ),
            ));
        }
        let buffer =
            PyRows::export(view, kind == JobKind::Load).map_err(|problem| match problem {
                BufferProblem::NotABuffer(err) => PyTypeError::new_err(format!(
                    "view must be a C-contiguous buffer (memoryview, numpy array, bytearray): {err}"
                )),
                BufferProblem::NotContiguous => invalid(
                    py,
                    what,
                    "view must be C-contiguous (one row per block, rows one after another)"
                        .to_owned(),
                ),
                BufferProblem::ReadOnly => invalid(
                    py,
                    what,
                    "a load needs a writable view; this one is read-only".to_owned(),
                ),
                BufferProblem::NoRows => invalid(
                    py,
                    what,
                    "view must have at least one row of at least one byte".to_owned(),
                ),
            })?;
        let (nrows, row_bytes) = (buffer.rows(), buffer.row_bytes());
        let mut regions = Vec::with_capacity(rows.len());
        for (i, &row) in rows.iter().enumerate() {
            let region = usize::try_from(row)
                .ok()
                .filter(|&r| r < nrows)
                .and_then(|r| Region::row(r, row_bytes));
            match region {
                Some(region) => regions.push(region),
                None => {
                    drop(buffer);
                    release_finished(py);
                    return Err(invalid(
                        py,
                        what,
                        format!(
                            "row {row} (position {i}) is out of range: the view has {nrows} rows"
                        ),
                    ));
                }
            }
        }
        let Some(queue) = self.jobs.queue(|| Some(source)) else {
            drop(buffer);
            release_finished(py);
            return Err(self.jobs_shut_down());
        };
        let buffer: Arc<dyn HostBuffer> = Arc::new(buffer);
        let submitted = match kind {
            JobKind::Store => queue.submit_store(keys, buffer, regions),
            JobKind::Load => queue.submit_load(keys, buffer, regions),
        };
        match submitted {
            Ok(id) => Ok(id.0),
            Err(err) => {
                // The job's buffer was dropped by the refusal.
                release_finished(py);
                Err(match err {
                    SubmitError::ShutDown => self.jobs_shut_down(),
                    other => invalid(py, what, other.to_string()),
                })
            }
        }
    }

    /// `poll_jobs`: the jobs that ended since the last call, each applied
    /// to the lookup state first (stores mark present, failed loads miss).
    pub(crate) fn poll_jobs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let reports = match self.jobs.existing() {
            Some(queue) => queue.poll(),
            None => Vec::new(),
        };
        // Every polled job has let go of its buffer.
        release_finished(py);
        let out = PyList::empty(py);
        if reports.is_empty() {
            return Ok(out);
        }
        let (mut present, mut missing) = (Vec::new(), Vec::new());
        for report in &reports {
            match report.kind {
                JobKind::Store => present.extend(report.successful_keys().cloned()),
                JobKind::Load => missing.extend(report.unsuccessful_keys().cloned()),
            }
        }
        self.with_core(py, |core| {
            core.backend.mark_present(&present);
            core.backend.mark_miss(&missing);
        });
        for report in &reports {
            out.append(Py::new(py, JobResult::from_report(py, report)?)?)?;
        }
        Ok(out)
    }

    /// `drain_jobs`: cancels queued jobs and waits, without the GIL, until
    /// none runs or `timeout` passes; whether none runs.
    pub(crate) fn drain_jobs(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        let timeout = match timeout {
            None => None,
            Some(s) if s.is_finite() && s >= 0.0 => Some(Duration::from_secs_f64(s)),
            Some(s) => {
                return Err(pyo3::exceptions::PyValueError::new_err(format!(
                    "timeout must be None or a number of seconds >= 0, not {s}"
                )));
            }
        };
        let idle = match self.jobs.existing() {
            Some(queue) => crate::lifecycle::allow_threads(py, move || queue.drain(timeout).idle),
            None => true,
        };
        release_finished(py);
        Ok(idle)
    }

    fn jobs_shut_down(&self) -> PyErr {
        ShutDownError::new_err(format!(
            "the lookup manager for tier '{}' is shut down",
            self.tier_name
        ))
    }
}
