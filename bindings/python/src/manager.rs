//! `_Manager`: the one native class behind `kvtier.AsyncLookupManager` and
//! the native Redis / S3 / disk managers.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::Duration;

use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyTuple, PyWeakrefReference};

use kvtier_core::{
    AsyncLookupManager, BlockStore, DynLookupManager, INLINE_KEY_CAPACITY, LookupError,
    LookupVerdict, ManagerConfig, ManagerStats, OffloadKey, PrefixVerdict, ReqContext,
    ShutdownReport,
};
use kvtier_disk::{DiskConfig, DiskTier};
use kvtier_redis::{RedisConfig, RedisTier};
use kvtier_s3::{S3Config, S3Tier};

use crate::convert;
use crate::native::{self, Native};
use crate::pytier::{PyCalls, PyTier, PyTierTask};
use crate::{KvtierError, ShutDownError};

/// How long a lookup waits for a returned `batch_lookup`'s answers to be
/// published (microseconds in practice; bounded for a stopped worker).
const PUBLISH_WAIT: Duration = Duration::from_millis(200);

/// The manager and the request contexts seen, behind one lock.
pub(crate) struct Core {
    pub(crate) manager: AnyManager,
    /// `req_context` objects by identity, with their contexts: a scheduler
    /// passes the same object for a request step after step, so an identity
    /// check saves reading `req_id` (a Python attribute) on each call. The
    /// object is held, so its address cannot be reused while it is here;
    /// `cleanup(req_id)` removes it. A context's `req_id` must not change.
    contexts: HashMap<usize, (Py<PyAny>, ReqContext), BuildHasherDefault<AddressHasher>>,
    /// The `req_context` object of the last fast-path call, and its
    /// context (a copy of its entry in `contexts`): a scheduler asks for
    /// one request's keys in a row. Dropped with the entry (`cleanup`).
    last_context: Option<(usize, ReqContext)>,
    /// Keys built from `bytes` objects, by object address.
    keys: KeyMemo,
}

/// Keys built from `bytes` objects, by object identity.
///
/// A scheduler asks for a request's keys step after step, mostly with the
/// same `bytes` objects; building a key hashes its bytes, which costs more
/// than the rest of a resolved lookup's binding. The memo holds a reference
/// to each object it keys (so its address cannot be reused while it is
/// here, and `bytes` is immutable): a hit is a few address comparisons in
/// a [`MEMO_WAYS`]-way set-associative table of [`MEMO_SETS`] sets, and the
/// key's bytes are not read. Only exact `bytes` objects of at most
/// [`INLINE_KEY_CAPACITY`] bytes are kept (their release runs no Python
/// code, and they are small). A caller that passes new objects each time
/// gains nothing from it: when a window of [`MEMO_WINDOW`] insertions saw
/// fewer hits than half that, the memo empties and the next
/// [`MEMO_BYPASS`] keys it does not have are built without being kept.
/// Used with the GIL held only (the lookups' fast path).
#[derive(Default)]
pub(crate) struct KeyMemo {
    /// `MEMO_WAYS * MEMO_SETS` entries once used, set after set (the
    /// latest insertion first).
    slots: Vec<MemoSlot>,
    /// The key of the last key not kept (see `insert`).
    scratch: Option<OffloadKey>,
    /// Keys asked for since the window started (counted per call).
    asked: usize,
    /// Insertions since the window started.
    inserted: usize,
    /// Keys left that are built without being kept.
    bypass: usize,
}

/// One entry of the memo: an object it holds and its key.
struct MemoSlot {
    obj: Option<Py<PyAny>>,
    key: OffloadKey,
}

/// Sets of the key memo: 8,192 entries of 56 bytes (about 460 KB,
/// allocated on first use), holding at most that many small `bytes`
/// objects. Four ways: 2,048 keys of a step then rarely crowd a set.
const MEMO_SETS: usize = 2048;

/// Entries per set of the key memo.
const MEMO_WAYS: usize = 4;

/// Insertions per window of the memo's hit rate.
const MEMO_WINDOW: usize = MEMO_WAYS * MEMO_SETS;

/// When a window saw fewer hits than half its insertions' count, the next
/// this many keys the memo does not have are built without being kept.
const MEMO_BYPASS: usize = 16 * MEMO_WINDOW;

impl KeyMemo {
    /// The first of the slots of `ptr`'s set.
    #[inline(always)]
    fn set_of(ptr: *mut ffi::PyObject) -> usize {
        // Object addresses are 16-byte aligned; a multiplicative hash
        // spreads them, its top bits index the set.
        let h = ((ptr as usize as u64) >> 4).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        MEMO_WAYS * (h >> (64 - MEMO_SETS.trailing_zeros())) as usize
    }

    /// The key of the `bytes` object `obj`.
    ///
    /// # Safety
    /// The GIL is held and `obj` is alive.
    #[inline]
    pub(crate) unsafe fn key(&mut self, obj: convert::KeyObj) -> &OffloadKey {
        let ptr = obj.as_ptr();
        if !self.slots.is_empty() {
            let at = Self::slot_with(&self.slots, ptr);
            if at != usize::MAX {
                return &self.slots[at].key;
            }
        }
        // SAFETY: forwarded.
        unsafe { self.insert(obj) }
    }

    /// The index of the slot holding `ptr`, or `usize::MAX`.
    #[inline(always)]
    fn slot_with(slots: &[MemoSlot], ptr: *mut ffi::PyObject) -> usize {
        let set = Self::set_of(ptr);
        let ways = &slots[set..set + MEMO_WAYS];
        for (way, slot) in ways.iter().enumerate() {
            if slot.obj.as_ref().is_some_and(|o| o.as_ptr() == ptr) {
                return set + way;
            }
        }
        usize::MAX
    }

    /// `key` for an object not in the memo.
    ///
    /// # Safety
    /// As for `key`.
    #[inline(never)]
    unsafe fn insert(&mut self, obj: convert::KeyObj) -> &OffloadKey {
        let ptr = obj.as_ptr();
        // SAFETY: the GIL is held and `obj` alive (the contract).
        let key = unsafe { obj.key() };
        // SAFETY: as above.
        if self.bypass > 0
            || unsafe { ffi::Py_TYPE(ptr) } != std::ptr::addr_of_mut!(ffi::PyBytes_Type)
            || key.len() > INLINE_KEY_CAPACITY
        {
            // A subclass's instance (its release could run Python code),
            // or a long key (likely invalid, and the memo keeps objects
            // small), or the memo stands aside: not kept; the scratch slot
            // holds its key for this use.
            self.bypass = self.bypass.saturating_sub(1);
            return self.scratch.insert(key);
        }
        if self.inserted >= MEMO_WINDOW {
            // Every key asked for was a hit or an insertion (or one of
            // the few keys not kept).
            let hits = self.asked.saturating_sub(self.inserted);
            self.asked = 0;
            self.inserted = 0;
            if hits < MEMO_WINDOW / 2 {
                self.bypass = MEMO_BYPASS;
                self.release();
                return self.scratch.insert(key);
            }
        }
        if self.slots.is_empty() {
            let empty = OffloadKey::new(&[]);
            self.slots = (0..MEMO_WAYS * MEMO_SETS)
                .map(|_| MemoSlot {
                    obj: None,
                    key: empty.clone(),
                })
                .collect();
        }
        self.inserted += 1;
        // SAFETY: the GIL is held and `ptr` is alive: a new reference,
        // owned by the memo.
        let held = unsafe {
            ffi::Py_IncRef(ptr);
            Py::from_owned_ptr(Python::assume_gil_acquired(), ptr)
        };
        // The new key goes first; the others move down one way, and the
        // last one leaves.
        let set = Self::set_of(ptr);
        let ways = &mut self.slots[set..set + MEMO_WAYS];
        ways.rotate_right(1);
        let leaving = std::mem::replace(
            &mut ways[0],
            MemoSlot {
                obj: Some(held),
                key,
            },
        );
        Self::drop_slot(leaving);
        &self.slots[set].key
    }

    /// Releases a slot's object now (the GIL is held: see `key`).
    #[inline]
    fn drop_slot(slot: MemoSlot) {
        if let Some(obj) = slot.obj {
            // SAFETY: the GIL is held; an exact `bytes` object's release
            // runs no Python code. (A plain drop would defer it: the
            // METH_FASTCALL entry points do not count the GIL in PyO3's
            // books.)
            unsafe { ffi::Py_DecRef(obj.into_ptr()) };
        }
    }

    /// Notes that a call asks for `n` keys (once per call: the hit rate
    /// decides whether the memo is worth keeping objects for).
    #[inline(always)]
    pub(crate) fn count(&mut self, n: usize) {
        self.asked = self.asked.wrapping_add(n);
    }

    /// Releases every object and the table (the GIL is held: see `key`).
    #[cold]
    fn release(&mut self) {
        for slot in std::mem::take(&mut self.slots) {
            Self::drop_slot(slot);
        }
    }
}

/// The manager of each kind of tier, by its concrete type: a lookup loop
/// (see [`each_manager!`]) then calls the manager's own `lookup`, which the
/// compiler inlines into it, instead of one virtual call per key.
pub(crate) enum AnyManager {
    Py(AsyncLookupManager<PyTierTask>),
    Redis(AsyncLookupManager<RedisTier>),
    S3(AsyncLookupManager<S3Tier>),
    Disk(AsyncLookupManager<DiskTier>),
}

/// Runs `$body` with `$m` bound to the concrete manager inside `$any`.
macro_rules! each_manager {
    ($any:expr, $m:ident => $body:expr) => {
        match $any {
            AnyManager::Py($m) => $body,
            AnyManager::Redis($m) => $body,
            AnyManager::S3($m) => $body,
            AnyManager::Disk($m) => $body,
        }
    };
}

impl DynLookupManager for AnyManager {
    fn tier_name(&self) -> &str {
        each_manager!(self, m => m.tier_name())
    }
    fn lookup(&mut self, key: &OffloadKey, ctx: &ReqContext) -> Result<LookupVerdict, LookupError> {
        each_manager!(self, m => m.lookup(key, ctx))
    }
    fn lookup_prefix(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
    ) -> Result<PrefixVerdict, LookupError> {
        each_manager!(self, m => m.lookup_prefix(keys, ctx))
    }
    fn flush(&mut self) {
        each_manager!(self, m => m.flush());
    }
    fn drain_results(&mut self) {
        each_manager!(self, m => m.drain_results());
    }
    fn mark_miss(&mut self, keys: &[OffloadKey]) {
        each_manager!(self, m => m.mark_miss(keys));
    }
    fn cleanup(&mut self, req_id: &str) {
        each_manager!(self, m => m.cleanup(req_id));
    }
    fn stats(&self) -> ManagerStats {
        each_manager!(self, m => m.stats())
    }
    fn is_idle(&self) -> bool {
        each_manager!(self, m => m.is_idle())
    }
    fn shutdown(&mut self) -> ShutdownReport {
        each_manager!(self, m => m.shutdown())
    }
    fn shutdown_async(&mut self) -> kvtier_core::BoxFuture<'_, ShutdownReport> {
        each_manager!(self, m => DynLookupManager::shutdown_async(m))
    }
}

/// Bounds the context cache: past this many live objects it starts afresh.
const MAX_CACHED_CONTEXTS: usize = 16_384;

/// Hashes an object address (already unique; mix the low bits away).
#[derive(Default)]
pub(crate) struct AddressHasher(u64);

impl Hasher for AddressHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8 | u64::from(b)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        }
    }
    fn write_usize(&mut self, n: usize) {
        self.0 = (n as u64 >> 4).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    }
}

impl Core {
    fn new(manager: AnyManager) -> Self {
        Self {
            manager,
            contexts: HashMap::default(),
            last_context: None,
            keys: KeyMemo::default(),
        }
    }
}

/// Everything a manager object owns once initialised.
pub(crate) struct Inner {
    core: Mutex<Core>,
    pub(crate) tier_name: String,
    py_calls: Option<Arc<PyCalls>>,
    pub(crate) native: Native,
    shut_down: AtomicBool,
}

impl Drop for Inner {
    fn drop(&mut self) {
        if !self.shut_down.load(Ordering::Acquire) {
            Python::with_gil(|py| {
                shutdown(py, self);
            });
        }
    }
}

impl Inner {
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
        py.allow_threads(|| f(&mut self.lock()))
    }

    /// Locks the core (poisoning is ignored: the state stays consistent).
    pub(crate) fn lock(&self) -> MutexGuard<'_, Core> {
        self.core.lock().unwrap_or_else(PoisonError::into_inner)
    }

    #[inline]
    fn before_lookup(&self, py: Python<'_>) {
        if let Some(calls) = &self.py_calls
            && !self.shut_down.load(Ordering::Acquire)
        {
            calls.wait_published(py, PUBLISH_WAIT);
        }
    }

    /// Runs `f` with the manager, the context of `ctx` and the key memo
    /// when `ctx` is an object seen before (compared by identity: no
    /// attribute read) and the core's lock is free: the whole call then
    /// holds the GIL, and `f` may use Python objects. Otherwise hands `f`
    /// back untouched; the caller then goes through
    /// [`with_new_ctx`](Self::with_new_ctx).
    #[inline]
    fn try_known_ctx<R, F>(&self, ctx: &Bound<'_, PyAny>, f: F) -> Result<R, F>
    where
        F: FnOnce(&mut AnyManager, &ReqContext, &mut KeyMemo) -> R,
    {
        let ptr = ctx.as_ptr() as usize;
        if let Ok(mut guard) = self.core.try_lock() {
            let core = &mut *guard;
            if let Some((last, rc)) = &core.last_context
                && *last == ptr
            {
                return Ok(f(&mut core.manager, rc, &mut core.keys));
            }
            if let Some((_, rc)) = core.contexts.get(&ptr) {
                let rc = &core.last_context.insert((ptr, rc.clone())).1;
                return Ok(f(&mut core.manager, rc, &mut core.keys));
            }
        }
        Err(f)
    }

    /// The slow half of [`try_known_ctx`](Self::try_known_ctx): reads
    /// `req_id`, remembers the object, and waits for the lock without the
    /// GIL. The caller has copied its keys out (the GIL may be released).
    #[inline(never)]
    fn with_new_ctx<R: Send>(
        &self,
        py: Python<'_>,
        ctx: &Bound<'_, PyAny>,
        f: impl FnOnce(&mut dyn DynLookupManager, &ReqContext) -> R + Send,
    ) -> PyResult<R> {
        let ptr = ctx.as_ptr() as usize;
        let req_id: Arc<str> = Arc::from(convert::req_id(ctx)?);
        if let Some(calls) = &self.py_calls {
            calls.remember(&req_id, ctx);
        }
        let rc = ReqContext::new(req_id);
        let keep = ctx.clone().unbind();
        let (result, replaced) = self.with_core(py, move |core| {
            let mut replaced: Vec<Py<PyAny>> = Vec::new();
            core.last_context = None;
            if core.contexts.len() >= MAX_CACHED_CONTEXTS {
                replaced.extend(core.contexts.drain().map(|(_, (obj, _))| obj));
            }
            if let Some((obj, _)) = core.contexts.insert(ptr, (keep, rc.clone())) {
                replaced.push(obj);
            }
            (f(&mut core.manager, &rc), replaced)
        });
        // Released after the lock (a finalizer may run Python code), with a
        // direct decref: the METH_FASTCALL entry points do not count the
        // GIL in PyO3's books, where a plain drop would defer it.
        for obj in replaced {
            drop(obj.into_bound(py));
        }
        Ok(result)
    }
}

pub(crate) fn lookup_err(e: LookupError) -> PyErr {
    match e {
        LookupError::ShutDown { .. } => ShutDownError::new_err(e.to_string()),
        LookupError::InvalidKey { .. } => PyValueError::new_err(e.to_string()),
        other => KvtierError::new_err(other.to_string()),
    }
}

/// The singleton `True`, `False` or `None` of a verdict, borrowed.
#[inline(always)]
fn verdict_ptr(v: LookupVerdict) -> *mut ffi::PyObject {
    // SAFETY: the addresses of the interpreter's singletons.
    unsafe {
        match v {
            LookupVerdict::Hit => ffi::Py_True(),
            LookupVerdict::Miss => ffi::Py_False(),
            LookupVerdict::Pending => ffi::Py_None(),
        }
    }
}

/// Whether the interpreter's `True`, `False` and `None` are immortal
/// (CPython 3.12 and newer, PEP 683): their reference counts are then never
/// touched. Set when the module is imported.
pub(crate) static IMMORTAL_SINGLETONS: AtomicBool = AtomicBool::new(false);

/// Adds `n` references to a verdict singleton at once: what `n` calls of
/// `Py_INCREF` would do (the limited API's `Py_INCREF` is a call).
///
/// # Safety
/// The GIL is held and `obj` is one of `verdict_ptr`'s singletons.
#[inline(always)]
unsafe fn add_refs(obj: *mut ffi::PyObject, n: usize) {
    if n == 0 || IMMORTAL_SINGLETONS.load(Ordering::Relaxed) {
        return;
    }
    // Before 3.12 the count is the object's first word, a Py_ssize_t (the
    // header of an abi3 module increments it in place, as here).
    // SAFETY: see the function's contract; the GIL serialises the update.
    unsafe {
        let count = std::ptr::addr_of_mut!((*obj).ob_refcnt).cast::<ffi::Py_ssize_t>();
        *count += n as ffi::Py_ssize_t;
    }
}

/// The singleton `True`, `False` or `None` of a verdict.
#[inline]
fn verdict(py: Python<'_>, v: LookupVerdict) -> Bound<'_, PyAny> {
    let obj = verdict_ptr(v);
    // SAFETY: a singleton lives forever; the reference added is owned.
    unsafe {
        add_refs(obj, 1);
        Bound::from_owned_ptr(py, obj)
    }
}

/// A new list of verdicts being filled: its items are set without
/// touching the singletons' counts one by one; the references owed are
/// added in one go when it is finished or dropped half-filled.
struct VerdictList<'py> {
    list: Bound<'py, PyList>,
    /// References owed to `True`, `False` and `None`.
    owed: [usize; 3],
}

impl<'py> VerdictList<'py> {
    /// A list of `len` items, all unset (null) until `set` fills them; a
    /// list dropped half-filled is fine (null items are skipped).
    #[inline]
    fn new(py: Python<'py>, len: usize) -> PyResult<Self> {
        // SAFETY: PyList_New returns a new reference or null with an error set.
        let list = unsafe {
            Bound::from_owned_ptr_or_err(py, ffi::PyList_New(len as ffi::Py_ssize_t))?
                .downcast_into_unchecked::<PyList>()
        };
        Ok(Self { list, owed: [0; 3] })
    }

    /// Sets item `index` (within the length, set once) to `v`.
    #[inline(always)]
    fn set(&mut self, index: usize, v: LookupVerdict) {
        let slot = match v {
            LookupVerdict::Hit => 0,
            LookupVerdict::Miss => 1,
            LookupVerdict::Pending => 2,
        };
        self.owed[slot] += 1;
        // SAFETY: the list was made by `new` and `index` is in range
        // (PyList_SetItem cannot fail then); the reference it steals is
        // added by `pay` before anything can release one (no Python code
        // runs meanwhile).
        unsafe {
            ffi::PyList_SetItem(self.list.as_ptr(), index as ffi::Py_ssize_t, verdict_ptr(v));
        }
    }

    /// Adds the references owed.
    #[inline]
    fn pay(&mut self) {
        let owed = std::mem::take(&mut self.owed);
        for (v, n) in [
            LookupVerdict::Hit,
            LookupVerdict::Miss,
            LookupVerdict::Pending,
        ]
        .into_iter()
        .zip(owed)
        {
            // SAFETY: the GIL is held (a `Bound` is alive) and the object
            // is a verdict singleton.
            unsafe { add_refs(verdict_ptr(v), n) };
        }
    }

    /// The filled list.
    #[inline]
    fn finish(self) -> Bound<'py, PyList> {
        let mut this = std::mem::ManuallyDrop::new(self);
        this.pay();
        // SAFETY: `this` is never dropped; the list moves out once.
        unsafe { std::ptr::read(&this.list) }
    }
}

impl Drop for VerdictList<'_> {
    fn drop(&mut self) {
        // Before the list (a field) releases its items.
        self.pay();
    }
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
    #[inline]
    pub(crate) fn inner(&self) -> PyResult<&Arc<Inner>> {
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

fn manager_config(mut cfg: ManagerConfig, name: &str) -> ManagerConfig {
    cfg = cfg.or_named(name);
    cfg
}

fn build_err(e: kvtier_core::ManagerError) -> PyErr {
    match e {
        kvtier_core::ManagerError::InvalidConfig { .. } => PyValueError::new_err(e.to_string()),
        other => KvtierError::new_err(other.to_string()),
    }
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
        let cfg = manager_config(cfg, &tier_type);
        let weak = PyWeakrefReference::new(slf.as_any())?.unbind();
        let calls = Arc::new(PyCalls::default());
        let tier = Arc::new(PyTierTask(Arc::new(PyTier::new(weak, Arc::clone(&calls)))));
        let hook_calls = Arc::clone(&calls);
        let tier_name = cfg.tier_name.clone();
        let manager = AsyncLookupManager::with_wake_hook(tier, cfg, move || {
            hook_calls.on_published();
        })
        .map_err(build_err)?;
        slf.get().install(Inner {
            core: Mutex::new(Core::new(AnyManager::Py(manager))),
            tier_name,
            py_calls: Some(calls),
            native: Native::None,
            shut_down: AtomicBool::new(false),
        })
    }

    /// Starts a native manager: `kind` is "redis", "s3" or "disk".
    #[pyo3(signature = (kind, config))]
    fn _init_native(
        slf: &Bound<'_, Self>,
        kind: &str,
        config: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<()> {
        let py = slf.py();
        let (manager, native, tier_name): (AnyManager, Native, String) = match kind {
            "redis" => {
                let (cfg, tcfg) =
                    convert::split_config::<ManagerConfig, RedisConfig>(kind, config)?;
                let tier = Arc::new(RedisTier::new(tcfg).map_err(native::config_err)?);
                let m = tier.manager(cfg).map_err(build_err)?;
                let name = m.tier_name().to_owned();
                (AnyManager::Redis(m), Native::Redis(tier), name)
            }
            "s3" => {
                let (cfg, tcfg) = convert::split_config::<ManagerConfig, S3Config>(kind, config)?;
                let tier = Arc::new(native::new_s3(py, tcfg)?);
                let m = tier.manager(cfg).map_err(build_err)?;
                let name = m.tier_name().to_owned();
                (AnyManager::S3(m), Native::S3(tier), name)
            }
            "disk" => {
                let (cfg, tcfg) = convert::split_config::<ManagerConfig, DiskConfig>(kind, config)?;
                let tier = Arc::new(
                    py.allow_threads(|| DiskTier::open(tcfg))
                        .map_err(native::config_err)?,
                );
                let m = tier.manager(cfg).map_err(build_err)?;
                let name = m.tier_name().to_owned();
                (AnyManager::Disk(m), Native::Disk(tier), name)
            }
            other => {
                return Err(PyValueError::new_err(format!(
                    "unknown native tier `{other}`: expected redis, s3 or disk"
                )));
            }
        };
        slf.get().install(Inner {
            core: Mutex::new(Core::new(manager)),
            tier_name,
            py_calls: None,
            native,
            shut_down: AtomicBool::new(false),
        })
    }

    /// The tier's name.
    #[getter]
    fn tier_type(&self) -> PyResult<String> {
        Ok(self.inner()?.tier_name.clone())
    }

    /// `True` (present), `False` (absent) or `None` (pending: retry next step).
    fn lookup<'py>(
        &self,
        py: Python<'py>,
        key: &Bound<'py, PyAny>,
        req_context: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.lookup_impl(py, key, req_context)
    }

    /// One answer per key, as `lookup` would give.
    fn lookup_many<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        req_context: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        self.lookup_many_impl(py, keys, req_context)
    }

    /// How many leading keys exist, or `None` while one before the first
    /// miss is pending.
    fn lookup_prefix(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        req_context: &Bound<'_, PyAny>,
    ) -> PyResult<Option<usize>> {
        self.lookup_prefix_impl(py, keys, req_context)
    }

    /// Hands this step's new keys to the worker (once per step).
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        let inner = self.inner()?;
        inner.with_core(py, |core| core.manager.flush());
        Ok(())
    }

    /// Applies results that have arrived.
    fn drain_results(&self, py: Python<'_>) -> PyResult<()> {
        let inner = self.inner()?;
        inner.before_lookup(py);
        inner.with_core(py, |core| core.manager.drain_results());
        Ok(())
    }

    /// Forces `keys` to answer `False` after a failed load.
    fn mark_miss(&self, py: Python<'_>, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        let inner = self.inner()?;
        let keys = convert::keys(keys)?;
        inner.with_core(py, |core| core.manager.mark_miss(&keys));
        Ok(())
    }

    /// Releases request `req_id`; an unknown id is a no-op.
    fn cleanup(&self, py: Python<'_>, req_id: &Bound<'_, PyAny>) -> PyResult<()> {
        let inner = self.inner()?;
        let req_id: String = req_id
            .extract()
            .map_err(|_| PyTypeError::new_err("req_id must be a str"))?;
        let dropped: Vec<Py<PyAny>> = inner.with_core(py, |core| {
            core.manager.cleanup(&req_id);
            core.last_context = None;
            core.contexts
                .extract_if(|_, (_, ctx)| ctx.req_id() == req_id)
                .map(|(_, (obj, _))| obj)
                .collect()
        });
        drop(dropped);
        if let Some(calls) = &inner.py_calls {
            drop(calls.forget(&req_id));
        }
        Ok(())
    }

    /// Counters and time-to-verdict percentiles, as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let inner = self.inner()?;
        let stats = inner.with_core(py, |core| core.manager.stats());
        stats_dict(py, &stats)
    }

    /// Stops the worker, within `shutdown_timeout_ms` whatever the tier does.
    /// Idempotent. Afterwards `lookup`, `lookup_many`, `lookup_prefix`,
    /// `store`, `load` and `remove` raise `kvtier.ShutDownError`; `flush` and
    /// `drain_results` do nothing; `cleanup`, `mark_miss` and `stats` work.
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        let inner = self.inner()?;
        shutdown(py, inner);
        Ok(())
    }

    /// Whether `shutdown` has run.
    fn is_shut_down(&self) -> PyResult<bool> {
        Ok(self.inner()?.shut_down.load(Ordering::Acquire))
    }

    fn _store(
        &self,
        py: Python<'_>,
        key: &Bound<'_, PyAny>,
        data: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let inner = self.inner()?;
        let key = native_key(inner, key)?;
        let data = data
            .downcast::<PyBytes>()
            .map_err(|_| PyTypeError::new_err("data must be bytes"))?
            .as_bytes()
            .to_vec();
        self.check_open(py, inner)?;
        native::store(py, &inner.native, &key, data)
    }

    fn _load<'py>(
        &self,
        py: Python<'py>,
        key: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let inner = self.inner()?;
        let key = native_key(inner, key)?;
        self.check_open(py, inner)?;
        Ok(native::load(py, &inner.native, &key)?.map(|data| PyBytes::new(py, &data)))
    }

    fn _remove(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<()> {
        let inner = self.inner()?;
        let key = native_key(inner, key)?;
        self.check_open(py, inner)?;
        native::remove(py, &inner.native, &key)
    }

    fn __repr__(&self) -> String {
        match self.inner.get() {
            Some(inner) => format!("<kvtier manager {:?}>", inner.tier_name),
            None => "<kvtier manager (not initialised)>".to_owned(),
        }
    }
}

impl PyManager {
    /// `lookup`, shared by the PyO3 method and the METH_FASTCALL one
    /// (see [`crate::fast`]).
    #[inline]
    pub(crate) fn lookup_impl<'py>(
        &self,
        py: Python<'py>,
        key: &Bound<'py, PyAny>,
        req_context: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let inner = self.inner()?;
        // SAFETY: `key` is alive (held by the caller for the whole call).
        if !unsafe { convert::is_bytes(key.as_ptr()) } {
            return Err(convert::not_bytes(key));
        }
        inner.before_lookup(py);
        let v = match inner.try_known_ctx(req_context, |m, ctx, memo| {
            memo.count(1);
            // SAFETY: the GIL is held (fast path) and `key` is alive.
            let key = unsafe { memo.key(convert::KeyObj::new_unchecked(key.as_ptr())) };
            m.lookup(key, ctx)
        }) {
            Ok(v) => v,
            Err(_) => {
                let key = convert::key(key)?;
                inner.with_new_ctx(py, req_context, move |m, ctx| m.lookup(&key, ctx))?
            }
        }
        .map_err(lookup_err)?;
        Ok(verdict(py, v))
    }

    /// `lookup_many`, shared like [`lookup_impl`](Self::lookup_impl).
    ///
    /// With a known context and a free lock, one pass under the lock takes
    /// each key from the memo (or builds it), looks it up, and stores the
    /// singleton answer straight into a list made at its final length.
    #[inline]
    pub(crate) fn lookup_many_impl<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        req_context: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let inner = self.inner()?;
        // Before the keys are borrowed: it may release the GIL.
        inner.before_lookup(py);
        // Nothing in this closure releases the GIL or runs Python code.
        let fast = convert::with_key_objects(keys, |objects| {
            let mut list = match VerdictList::new(py, objects.len()) {
                Ok(list) => list,
                Err(e) => return Ok(Err(e)),
            };
            let done = inner
                .try_known_ctx(req_context, |any, ctx, memo| {
                    memo.count(objects.len());
                    each_manager!(any, m => {
                        for (index, &obj) in objects.iter().enumerate() {
                            // SAFETY: the GIL is held (fast path) and the
                            // key's object is alive (see `with_key_objects`).
                            let v = m.lookup(unsafe { memo.key(obj) }, ctx)?;
                            list.set(index, v);
                        }
                    });
                    Ok(())
                })
                .map_err(drop);
            match done {
                Ok(Ok(())) => Ok(Ok(list.finish())),
                Ok(Err(e)) => Ok(Err(lookup_err(e))),
                // Copied out before the slow path may release the GIL.
                // SAFETY: the objects are alive and the GIL held.
                Err(_) => Err(objects
                    .iter()
                    .map(|k| unsafe { k.key() })
                    .collect::<Vec<_>>()),
            }
        })?;
        let keys = match fast {
            Ok(done) => return done,
            Err(keys) => keys,
        };
        let verdicts = inner
            .with_new_ctx(py, req_context, move |m, ctx| {
                let mut out = Vec::with_capacity(keys.len());
                for key in &keys {
                    out.push(m.lookup(key, ctx)?);
                }
                Ok(out)
            })?
            .map_err(lookup_err)?;
        let mut list = VerdictList::new(py, verdicts.len())?;
        for (index, v) in verdicts.into_iter().enumerate() {
            list.set(index, v);
        }
        Ok(list.finish())
    }

    /// `lookup_prefix`, shared like [`lookup_impl`](Self::lookup_impl).
    #[inline]
    pub(crate) fn lookup_prefix_impl<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        req_context: &Bound<'py, PyAny>,
    ) -> PyResult<Option<usize>> {
        let inner = self.inner()?;
        // Before the keys are borrowed: it may release the GIL.
        inner.before_lookup(py);
        // Nothing in this closure releases the GIL or runs Python code.
        let fast = convert::with_key_objects(keys, |objects| {
            let done = inner.try_known_ctx(req_context, |m, ctx, memo| {
                memo.count(objects.len());
                let keys: Vec<OffloadKey> = objects
                    .iter()
                    // SAFETY: as in `lookup_many_impl`.
                    .map(|&k| unsafe { memo.key(k) }.clone())
                    .collect();
                m.lookup_prefix(&keys, ctx)
            });
            // SAFETY: the objects are alive and the GIL held.
            done.map_err(|_| {
                objects
                    .iter()
                    .map(|k| unsafe { k.key() })
                    .collect::<Vec<_>>()
            })
        })?;
        let v = match fast {
            Ok(v) => v,
            Err(keys) => {
                inner.with_new_ctx(py, req_context, move |m, ctx| m.lookup_prefix(&keys, ctx))?
            }
        }
        .map_err(lookup_err)?;
        Ok(match v {
            PrefixVerdict::Ready(n) => Some(n),
            PrefixVerdict::Pending => None,
        })
    }

    fn check_open(&self, _py: Python<'_>, inner: &Inner) -> PyResult<()> {
        if inner.shut_down.load(Ordering::Acquire) {
            return Err(ShutDownError::new_err(format!(
                "the lookup manager for tier '{}' is shut down",
                inner.tier_name
            )));
        }
        Ok(())
    }
}

fn native_key(inner: &Inner, key: &Bound<'_, PyAny>) -> PyResult<OffloadKey> {
    let key = convert::key(key)?;
    if key.is_empty() {
        return Err(PyValueError::new_err("a key must not be empty"));
    }
    if matches!(inner.native, Native::None) {
        return Err(PyTypeError::new_err(
            "store, load and remove need a native manager (Redis, S3 or disk)",
        ));
    }
    Ok(key)
}

pub(crate) fn shutdown(py: Python<'_>, inner: &Inner) -> ShutdownReport {
    // Without the GIL: a Python batch_lookup still running may need it to
    // finish within the grace period.
    inner.shut_down.store(true, Ordering::Release);
    py.allow_threads(|| inner.lock().manager.shutdown())
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
