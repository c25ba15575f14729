//! `_Manager`: the one native class behind `kvtier.AsyncLookupManager` and
//! the native Redis / S3 / disk managers; its construction, its methods,
//! and the state it owns ([`Inner`]).

use std::mem::ManuallyDrop;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple, PyWeakrefReference};

use kvtier_core::{
    AsyncLookupManager, BlockStore, DynBlockStore, DynLookupManager, ManagerConfig, ManagerStats,
    OffloadKey, ShutdownReport,
};
use kvtier_disk::DiskConfig;
use kvtier_redis::RedisConfig;
use kvtier_s3::S3Config;

use crate::backend::Backend;
use crate::contexts::{Contexts, FirstObjects};
use crate::convert;
use crate::errors::{self, KvtierError, ShutDownError};
use crate::lifecycle::Owner;
use crate::memo::KeyMemo;
use crate::native::{self, Blocks, BlocksSlot};
use crate::pytier::{PyCalls, PyTier, PyTierTask};

/// What the manager's lock guards: the lookup manager, the contexts seen
/// and the key memo.
pub(crate) struct Core {
    pub(crate) backend: Backend,
    pub(crate) contexts: Contexts,
    pub(crate) memo: KeyMemo,
}

/// Everything a manager object owns once initialised.
///
/// In a child forked after it was made, none of it is touched, not even
/// dropped (see [`crate::lifecycle`]): the fields that own threads,
/// connections or files are `ManuallyDrop` and leak there.
pub(crate) struct Inner {
    pub(crate) core: ManuallyDrop<Mutex<Core>>,
    pub(crate) tier_name: String,
    /// A Python tier's calls (released at shutdown).
    py_calls: ManuallyDrop<Option<Arc<PyCalls>>>,
    /// A native tier's stores, loads and removes.
    blocks: ManuallyDrop<BlocksSlot>,
    shut_down: AtomicBool,
    /// A native tier's transfer jobs (`submit_store`, ...; see `jobs.rs`).
    pub(crate) jobs: ManuallyDrop<crate::jobs::Jobs>,
    /// The process that made it.
    pub(crate) owner: Owner,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if !self.owner.is_here() {
            return; // leaked: the parent's
        }
        if !self.shut_down.load(Ordering::Acquire) {
            Python::with_gil(|py| {
                shutdown(py, self);
            });
        }
        // SAFETY: dropped once, here, and not used afterwards.
        unsafe {
            ManuallyDrop::drop(&mut self.core);
            ManuallyDrop::drop(&mut self.py_calls);
            ManuallyDrop::drop(&mut self.blocks);
            ManuallyDrop::drop(&mut self.jobs);
        }
    }
}

impl Inner {
    fn new(
        backend: Backend,
        first: Option<Arc<FirstObjects>>,
        py_calls: Option<Arc<PyCalls>>,
        blocks: Option<Blocks>,
    ) -> Self {
        Self {
            tier_name: backend.tier_name().to_owned(),
            core: ManuallyDrop::new(Mutex::new(Core {
                backend,
                contexts: Contexts::new(first),
                memo: KeyMemo::default(),
            })),
            py_calls: ManuallyDrop::new(py_calls),
            blocks: ManuallyDrop::new(BlocksSlot::new(blocks)),
            shut_down: AtomicBool::new(false),
            jobs: ManuallyDrop::new(crate::jobs::Jobs::default()),
            owner: Owner::here(),
        }
    }

    /// Runs `f` on the core; waits for the lock without the GIL.
    #[inline]
    pub(crate) fn with_core<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut Core) -> R + Send,
    ) -> R {
        if let Ok(mut core) = self.core.try_lock() {
            return f(&mut core);
        }
        crate::lifecycle::allow_threads(py, || f(&mut self.lock()))
    }

    /// Locks the core (poisoning is ignored: the state stays consistent).
    pub(crate) fn lock(&self) -> MutexGuard<'_, Core> {
        self.core.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The native stores, loads and removes; `ShutDownError` after shutdown.
    fn blocks(&self) -> PyResult<Blocks> {
        if self.py_calls.is_some() {
            return Err(PyTypeError::new_err(
                "store, load and remove need a native manager (Redis, S3 or disk)",
            ));
        }
        match self.blocks.get() {
            Some(blocks) if !self.shut_down.load(Ordering::Acquire) => Ok(blocks),
            _ => Err(self.shut_down_error()),
        }
    }

    /// What a transfer queue runs on: the native tier's store and runtime.
    pub(crate) fn queue_source(&self) -> PyResult<crate::jobs::QueueSource> {
        if self.py_calls.is_some() {
            return Err(PyTypeError::new_err(
                "submit_store, submit_load, poll_jobs and drain_jobs need a native manager (Redis, S3 or disk)",
            ));
        }
        Ok(self.blocks()?.queue_source())
    }

    /// Raises, unchanged, a `KeyboardInterrupt` or `SystemExit` (any
    /// `BaseException` that is not an `Exception`) that a Python tier's
    /// `batch_lookup` raised on the worker since the last call.
    #[inline(always)]
    pub(crate) fn reraise(&self) -> PyResult<()> {
        if let Some(calls) = &*self.py_calls
            && let Some(err) = calls.take_raised()
        {
            return Err(err);
        }
        Ok(())
    }

    fn shut_down_error(&self) -> PyErr {
        ShutDownError::new_err(format!(
            "the lookup manager for tier '{}' is shut down",
            self.tier_name
        ))
    }
}

/// Stops the worker within `shutdown_timeout_ms`, then lets go of a native
/// tier (a disk tier's directory lock, connections, the runtime). Idempotent.
pub(crate) fn shutdown(py: Python<'_>, inner: &Inner) -> ShutdownReport {
    inner.shut_down.store(true, Ordering::Release);
    if let Some(calls) = &*inner.py_calls {
        calls.close();
    }
    let blocks = inner.blocks.take();
    let jobs_timeout = blocks.as_ref().map(|b| b.shutdown_timeout());
    // Without the GIL: a Python batch_lookup still running may need it to
    // finish within the grace period.
    let report = crate::lifecycle::allow_threads(py, || {
        // Transfer jobs first: queued ones cancelled, running ones stopped
        // at their next chunk, within the shutdown timeout.
        inner.jobs.shutdown(jobs_timeout.unwrap_or_default());
        let mut core = inner.lock();
        let report = core.backend.shutdown();
        core.backend.close_tier();
        report
    });
    drop(blocks);
    report
}

/// Configuration of a manager over a Python `batch_lookup`: only the
/// manager's own fields.
#[derive(Debug, Default, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct NoTierFields {}

/// The native base of every kvtier manager class; use the subclasses in
/// the `kvtier` package.
#[pyclass(
    subclass,
    frozen,
    weakref,
    module = "kvtier._kvtier",
    name = "_Manager"
)]
pub(crate) struct PyManager {
    inner: OnceLock<Arc<Inner>>,
}

impl PyManager {
    /// What the manager owns; `ForkError` in a child forked since it was
    /// made (checked before anything of it is touched).
    #[inline]
    pub(crate) fn inner(&self) -> PyResult<&Arc<Inner>> {
        let inner = self.any_inner()?;
        inner.owner.check("manager")?;
        Ok(inner)
    }

    /// What the manager owns, in whichever process.
    #[inline]
    fn any_inner(&self) -> PyResult<&Arc<Inner>> {
        self.inner.get().ok_or_else(|| {
            PyRuntimeError::new_err(
                "the manager is not initialised: a subclass's __init__ must call super().__init__(tier_type=...)",
            )
        })
    }

    fn install(&self, inner: Inner) -> PyResult<()> {
        self.inner
            .set(Arc::new(inner))
            .map_err(|_| PyRuntimeError::new_err("the manager is already initialised"))
    }
}

/// A native tier's store, for the calls that bypass lookups.
/// `config` is the manager's, before the tier adjusted it.
fn blocks<S: BlockStore>(
    kind: &'static str,
    manager: &AsyncLookupManager<S>,
    spawner: &kvtier_core::Spawner,
    config: ManagerConfig,
) -> Blocks {
    let config = manager.tier().manager_config(config);
    let store: Arc<dyn DynBlockStore> = Arc::clone(manager.tier()) as Arc<dyn DynBlockStore>;
    Blocks::new(kind, store, spawner.clone(), &config)
        .with_shutdown_timeout(manager.shutdown_timeout())
}

#[pymethods]
impl PyManager {
    #[new]
    #[pyo3(signature = (*_args, **_kwargs))]
    fn py_new(_args: &Bound<'_, PyTuple>, _kwargs: Option<&Bound<'_, PyDict>>) -> Self {
        Self {
            inner: OnceLock::new(),
        }
    }

    /// Starts a manager whose tier is this object's `batch_lookup`.
    #[pyo3(signature = (tier_type, config))]
    fn _init_python_tier(
        slf: &Bound<'_, Self>,
        tier_type: &Bound<'_, PyAny>,
        config: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<()> {
        let tier_type: String = tier_type
            .extract()
            .map_err(|_| PyTypeError::new_err("tier_type must be a str"))?;
        let (cfg, NoTierFields {}) =
            convert::split_config::<ManagerConfig, NoTierFields>(&tier_type, config)?;
        let cfg = cfg.or_named(&tier_type);
        let weak = PyWeakrefReference::new(slf.as_any())?.unbind();
        let calls = Arc::new(PyCalls::default());
        let first = Arc::new(FirstObjects::default());
        let tier = PyTier::new(weak, Arc::clone(&calls), Arc::clone(&first));
        let hook_calls = Arc::clone(&calls);
        let manager = AsyncLookupManager::with_wake_hook(
            Arc::new(PyTierTask(Arc::new(tier))),
            cfg,
            move || {
                hook_calls.on_published();
            },
        )
        .map_err(errors::build_error)?;
        slf.get().install(Inner::new(
            Backend::Python(manager),
            Some(first),
            Some(calls),
            None,
        ))
    }

    /// Starts a native manager: `kind` is "redis", "s3" or "disk". The
    /// manager and its tier run on one runtime. With `check`, the tier is
    /// checked first (PING, HeadBucket, a file written in the directory).
    #[pyo3(signature = (kind, config, check=true))]
    fn _init_native(
        slf: &Bound<'_, Self>,
        kind: &str,
        config: Option<&Bound<'_, PyDict>>,
        check: bool,
    ) -> PyResult<()> {
        let py = slf.py();
        let (backend, blocks) = match kind {
            "redis" => {
                let (cfg, tcfg) =
                    convert::split_config::<ManagerConfig, RedisConfig>(kind, config)?;
                // RedisConfig's default URL (127.0.0.1:6379) is for a
                // configuration file; from Python the server is named.
                let named = |field| config.is_some_and(|c| c.contains(field).unwrap_or(false));
                if !named("url") && tcfg.cluster_urls.is_empty() {
                    return Err(PyValueError::new_err(
                        "RedisLookupManager needs url= (a single server, e.g. \"redis://127.0.0.1:6379/\") \
                         or cluster_urls= (seed nodes of a Redis Cluster)",
                    ));
                }
                let cfg = cfg.or_named(kind);
                cfg.validate().map_err(errors::build_error)?;
                let spawner = native::spawner(&cfg, cfg.worker_threads)?;
                let tier = Arc::new(native::redis(py, tcfg, &spawner, check)?);
                let m = tier
                    .manager_on(cfg.clone(), &spawner)
                    .map_err(errors::build_error)?;
                let blocks = blocks("redis", &m, &spawner, cfg);
                (Backend::Redis(m), blocks)
            }
            "s3" => {
                let (cfg, tcfg) = convert::split_config::<ManagerConfig, S3Config>(kind, config)?;
                let cfg = cfg.or_named(kind);
                cfg.validate().map_err(errors::build_error)?;
                let threads = cfg.worker_threads.max(tcfg.io_threads);
                let spawner = native::spawner(&cfg, threads)?;
                let tier = Arc::new(native::s3(py, tcfg, &spawner, check)?);
                let m = tier
                    .manager_on(cfg.clone(), &spawner)
                    .map_err(errors::build_error)?;
                let blocks = blocks("s3", &m, &spawner, cfg);
                (Backend::S3(m), blocks)
            }
            "disk" => {
                let (cfg, tcfg) = convert::split_config::<ManagerConfig, DiskConfig>(kind, config)?;
                let cfg = cfg.or_named(kind);
                cfg.validate().map_err(errors::build_error)?;
                let spawner = native::spawner(&cfg, cfg.worker_threads)?;
                let tier = Arc::new(native::disk(py, tcfg, check)?);
                let m = tier
                    .manager_on(cfg.clone(), &spawner)
                    .map_err(errors::build_error)?;
                let blocks = blocks("disk", &m, &spawner, cfg);
                (Backend::Disk(m), blocks)
            }
            other => {
                return Err(PyValueError::new_err(format!(
                    "unknown native tier `{other}`: expected redis, s3 or disk"
                )));
            }
        };
        slf.get()
            .install(Inner::new(backend, None, None, Some(blocks)))
    }

    /// The manager's name in stats, logs and metrics: `tier_name=` if
    /// given, else the tier's type. (The type itself is the Python
    /// attribute `tier_type`, set by each class's `__init__`.)
    #[getter]
    fn tier_name(&self) -> PyResult<String> {
        Ok(self.any_inner()?.tier_name.clone())
    }

    /// `True` (present), `False` (absent) or `None` (pending: retry next step).
    fn lookup<'py>(
        &self,
        py: Python<'py>,
        key: &Bound<'py, PyAny>,
        req_context: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.inner()?.lookup(py, key, req_context)
    }

    /// One answer per key, as `lookup` would give.
    fn lookup_many<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        req_context: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        self.inner()?.lookup_many(py, keys, req_context)
    }

    /// How many leading keys exist, or `None` while one before the first
    /// miss is pending.
    fn lookup_prefix(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        req_context: &Bound<'_, PyAny>,
    ) -> PyResult<Option<usize>> {
        self.inner()?.lookup_prefix(py, keys, req_context)
    }

    /// Hands this step's new keys to the worker (once per step).
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        let inner = self.inner()?;
        inner.reraise()?;
        inner.with_core(py, |core| core.backend.flush());
        Ok(())
    }

    /// Applies results that have arrived.
    fn drain_results(&self, py: Python<'_>) -> PyResult<()> {
        let inner = self.inner()?;
        inner.reraise()?;
        inner.with_core(py, |core| core.backend.drain_results());
        Ok(())
    }

    /// Forces `keys` to answer `False` after a failed load.
    fn mark_miss(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        let inner = self.inner()?;
        let keys = convert::keys(keys)?;
        inner.with_core(py, |core| core.backend.mark_miss(&keys));
        Ok(())
    }

    /// Records that `keys` were stored: each answers `True` at once, and a
    /// probe in flight cannot turn it back (vLLM 0.34's `mark_present`).
    fn mark_present(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        let inner = self.inner()?;
        let keys = convert::keys(keys)?;
        inner.with_core(py, |core| core.backend.mark_present(&keys));
        Ok(())
    }

    /// Releases request `req_id`; an unknown id is a no-op.
    fn cleanup(&self, py: Python<'_>, req_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let inner = self.inner()?;
        let req_id: String = req_id
            .extract()
            .map_err(|_| PyTypeError::new_err("req_id must be a str"))?;
        let released = inner.with_core(py, |core| {
            core.backend.cleanup(&req_id);
            core.contexts.forget(&req_id)
        });
        for obj in released {
            drop(obj.into_bound(py));
        }
        Ok(())
    }

    /// Counters and time-to-verdict percentiles, as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let stats = self.inner()?.with_core(py, |core| core.backend.stats());
        stats_dict(py, &stats)
    }

    /// Stops the worker, within `shutdown_timeout_ms` whatever the tier does,
    /// and lets go of a native tier (a disk tier's directory lock, Redis and
    /// S3 connections, the runtime). Idempotent. Afterwards `lookup`,
    /// `lookup_many`, `lookup_prefix`, `store`, `load` and `remove` raise
    /// `kvtier.ShutDownError`; `flush` and `drain_results` do nothing;
    /// `cleanup`, `mark_miss` and `stats` work.
    ///
    /// In a child forked after the manager was made, does nothing: the
    /// manager belongs to the parent.
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        let inner = self.any_inner()?;
        if inner.owner.is_here() {
            shutdown(py, inner);
        }
        Ok(())
    }

    /// Whether `shutdown` has run.
    fn is_shut_down(&self) -> PyResult<bool> {
        Ok(self.any_inner()?.shut_down.load(Ordering::Acquire))
    }

    fn _store(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        data: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let inner = self.inner()?;
        let key = native_key(key)?;
        let data = data
            .downcast::<PyBytes>()
            .map_err(|_| PyTypeError::new_err("data must be bytes"))?
            .as_bytes()
            .to_vec();
        inner.blocks()?.store(py, &key, &data)
    }

    fn _load<'py>(
        &self,
        py: Python<'py>,
        key: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let inner = self.inner()?;
        let key = native_key(key)?;
        Ok(inner
            .blocks()?
            .load(py, &key)?
            .map(|data| PyBytes::new(py, &data)))
    }

    fn _remove(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<()> {
        let inner = self.inner()?;
        let key = native_key(key)?;
        inner.blocks()?.remove(py, &key)
    }

    /// Queues a store of `view[rows[i]]` under `keys[i]`; returns its job id
    /// at once. See `jobs.rs`.
    fn submit_store(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        view: &Bound<'_, PyAny>,
        rows: &Bound<'_, PyAny>,
    ) -> PyResult<u64> {
        self.inner()?
            .submit_job(py, kvtier_core::JobKind::Store, keys, view, rows)
    }

    /// Queues a load of `keys[i]` into `view[rows[i]]`; returns its job id.
    fn submit_load(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        view: &Bound<'_, PyAny>,
        rows: &Bound<'_, PyAny>,
    ) -> PyResult<u64> {
        self.inner()?
            .submit_job(py, kvtier_core::JobKind::Load, keys, view, rows)
    }

    /// The jobs that ended since the last call, as `JobResult`s.
    fn poll_jobs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        self.inner()?.poll_jobs(py)
    }

    /// Cancels queued jobs and waits until none runs (or `timeout` s).
    #[pyo3(signature = (timeout = None))]
    fn drain_jobs(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<bool> {
        self.inner()?.drain_jobs(py, timeout)
    }

    fn __repr__(&self) -> String {
        match self.inner.get() {
            Some(inner) => format!("<kvtier manager {:?}>", inner.tier_name),
            None => "<kvtier manager (not initialised)>".to_owned(),
        }
    }
}

/// The key of a store, load or remove: `bytes`, not empty.
fn native_key(key: &Bound<'_, PyAny>) -> PyResult<OffloadKey> {
    let key = convert::key(key)?;
    if key.is_empty() {
        return Err(PyValueError::new_err("a key must not be empty"));
    }
    Ok(key)
}

pub(crate) fn stats_dict<'py>(
    py: Python<'py>,
    stats: &ManagerStats,
) -> PyResult<Bound<'py, PyAny>> {
    let mut value = serde_json::to_value(stats)
        .map_err(|e| KvtierError::new_err(format!("could not convert stats: {e}")))?;
    if let serde_json::Value::Object(map) = &mut value {
        let ttv = stats.time_to_verdict;
        map.insert("time_to_verdict_p50_us".into(), ttv.p50_us.into());
        map.insert("time_to_verdict_p99_us".into(), ttv.p99_us.into());
    }
    convert::from_json(py, &value)
}
