//! The process around the interpreter: its exit, and `fork`. kvtier's
//! threads leave the interpreter alone once it has begun to exit, and a
//! manager made before a `fork` refuses to work in the child.
//!
//! **Exit.** Before CPython 3.14, a thread that takes the GIL back while the
//! interpreter finalizes is ended with `pthread_exit`, whose unwinding
//! aborts the process when it crosses Rust frames (a `catch_unwind`, a
//! panic guard). kvtier meets that in two places:
//!
//! - A Python thread that released the GIL inside kvtier ([`allow_threads`]).
//!   An `atexit` hook ([`at_exit`]) marks the exit. From then on, such a
//!   thread parks instead of taking the GIL back (unless it is the thread
//!   that exits) and ends with the process. The hook releases the GIL for a
//!   moment and waits for threads that passed the mark's check before it was
//!   set, so that none is still on its way back into the GIL when
//!   finalization starts.
//! - A kvtier thread running Python code: a Python tier's `batch_lookup`, on
//!   the worker's blocking pool. [`PyCall`] makes those calls through
//!   `C-unwind` declarations of the interpreter's functions and parks the
//!   thread if one of them unwinds, as PyO3 does for `PyGILState_Ensure`.
//!   (A kvtier thread that asks for the GIL after the exit began is parked
//!   by PyO3 itself.)
//!
//! **Fork.** `os.register_at_fork` counts forks in the child
//! ([`fork_generation`]). A manager records the count it was made at and,
//! in a child, raises `kvtier.ForkError` before it touches any of its
//! state: its runtime's threads do not exist there, and its connections,
//! files, locks and the event queue of its sockets are shared with the
//! parent. Dropped in the child, a manager leaks that state rather than
//! close or deregister anything the parent still uses.

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::thread::ThreadId;
use std::time::{Duration, Instant};

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyCFunction, PyDict, PyString, PyTuple};

/// Set by [`at_exit`]: the interpreter is exiting.
static EXITING: AtomicBool = AtomicBool::new(false);

/// The thread that runs the `atexit` hooks, and then finalizes.
static EXITING_THREAD: OnceLock<ThreadId> = OnceLock::new();

/// Threads between [`allow_threads`]'s check of [`EXITING`] and their
/// return into the GIL.
static RETURNING: AtomicUsize = AtomicUsize::new(0);

/// How long [`at_exit`] waits for [`RETURNING`] threads: they need only the
/// GIL, which it has released.
const RETURN_WAIT: Duration = Duration::from_secs(1);

/// Forks this process descends from since the module was imported.
static FORKS: AtomicU64 = AtomicU64::new(0);

/// Registers the exit hook and the fork counter (once, at import).
pub(crate) fn install(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    let hook = PyCFunction::new_closure(py, Some(c"_kvtier_at_exit"), None, |args, _| {
        at_exit(args.py());
    })?;
    py.import("atexit")?.call_method1("register", (hook,))?;
    let forked = PyCFunction::new_closure(py, Some(c"_kvtier_after_fork"), None, |_, _| {
        FORKS.fetch_add(1, Ordering::SeqCst);
    })?;
    let kwargs = PyDict::new(py);
    kwargs.set_item("after_in_child", forked)?;
    py.import("os")?
        .call_method("register_at_fork", (), Some(&kwargs))?;
    Ok(())
}

/// The number of forks this process descends from: a manager made at
/// another count belongs to an ancestor process.
#[inline(always)]
pub(crate) fn fork_generation() -> u64 {
    FORKS.load(Ordering::Relaxed)
}

/// The `atexit` hook: marks the exit, then lets threads that are on their
/// way back into the GIL get there (see the module docs).
fn at_exit(py: Python<'_>) {
    let _ = EXITING_THREAD.set(std::thread::current().id());
    EXITING.store(true, Ordering::SeqCst);
    py.allow_threads(|| {
        let start = Instant::now();
        while RETURNING.load(Ordering::SeqCst) > 0 && start.elapsed() < RETURN_WAIT {
            std::thread::yield_now();
        }
    });
}

/// Whether the interpreter has begun to exit (the `atexit` hook ran).
pub(crate) fn is_exiting() -> bool {
    EXITING.load(Ordering::SeqCst)
}

/// Whether the interpreter has begun to exit, seen from a thread that is
/// not the one exiting.
fn exiting_elsewhere() -> bool {
    EXITING.load(Ordering::SeqCst) && EXITING_THREAD.get() != Some(&std::thread::current().id())
}

/// Parks this thread for good: the process is exiting, and the thread
/// must not touch the interpreter again.
fn park_forever() -> ! {
    loop {
        std::thread::park();
    }
}

/// `py.allow_threads(f)`, except that once the interpreter has begun to
/// exit, a thread other than the exiting one parks instead of taking the
/// GIL back (see the module docs). Every wait of kvtier without the GIL
/// goes through here.
pub(crate) fn allow_threads<T, F>(py: Python<'_>, f: F) -> T
where
    F: Send + FnOnce() -> T,
    T: Send,
{
    let out = py.allow_threads(|| {
        let out = f();
        RETURNING.fetch_add(1, Ordering::SeqCst);
        if exiting_elsewhere() {
            RETURNING.fetch_sub(1, Ordering::SeqCst);
            park_forever();
        }
        out
    });
    RETURNING.fetch_sub(1, Ordering::SeqCst);
    out
}

/// The process that made a manager or stack.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Owner {
    generation: u64,
    pid: u32,
}

impl Owner {
    /// This process.
    pub(crate) fn here() -> Self {
        Self {
            generation: fork_generation(),
            pid: std::process::id(),
        }
    }

    /// Whether this is still that process (not a child forked since).
    #[inline(always)]
    pub(crate) fn is_here(&self) -> bool {
        self.generation == fork_generation()
    }

    /// `kvtier.ForkError` in a child forked since: `what` is the object.
    #[inline(always)]
    pub(crate) fn check(&self, what: &str) -> PyResult<()> {
        if self.is_here() {
            return Ok(());
        }
        Err(crate::errors::fork_error(what, self.pid))
    }
}

/// The interpreter's entry points that run Python code, declared `C-unwind`
/// so that the `pthread_exit` of a thread the interpreter ends unwinds into
/// [`PyCall`]'s guard instead of aborting the process.
mod unwinding {
    use pyo3::ffi::PyObject;

    unsafe extern "C-unwind" {
        pub(super) fn PyObject_Call(
            callable: *mut PyObject,
            args: *mut PyObject,
            kwargs: *mut PyObject,
        ) -> *mut PyObject;
        pub(super) fn PyObject_GetAttr(obj: *mut PyObject, name: *mut PyObject) -> *mut PyObject;
        pub(super) fn PyObject_GetIter(obj: *mut PyObject) -> *mut PyObject;
        pub(super) fn PyIter_Next(iter: *mut PyObject) -> *mut PyObject;
    }
}

/// Parks the thread when dropped: armed around a call into the interpreter,
/// it is dropped only by an unwind out of it.
struct ParkOnUnwind;

impl Drop for ParkOnUnwind {
    fn drop(&mut self) {
        park_forever();
    }
}

/// Calls into Python from a kvtier thread (not a Python thread): a call
/// the interpreter ends because its exit began parks the thread, which then
/// ends with the process.
#[derive(Clone, Copy)]
pub(crate) struct PyCall<'py>(Python<'py>);

impl<'py> PyCall<'py> {
    /// Calls made holding the GIL of `py`.
    pub(crate) fn new(py: Python<'py>) -> Self {
        Self(py)
    }

    /// A new reference returned by the interpreter, or its exception.
    fn owned(self, ptr: *mut ffi::PyObject) -> PyResult<Bound<'py, PyAny>> {
        // SAFETY: `ptr` is a new reference, or null with an exception set.
        unsafe { Bound::from_owned_ptr_or_err(self.0, ptr) }
    }

    /// `obj.name`.
    pub(crate) fn getattr(
        self,
        obj: &Bound<'py, PyAny>,
        name: &Bound<'py, PyString>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let guard = ParkOnUnwind;
        // SAFETY: the GIL is held and both objects are alive.
        let out = unsafe { unwinding::PyObject_GetAttr(obj.as_ptr(), name.as_ptr()) };
        std::mem::forget(guard);
        self.owned(out)
    }

    /// `callable(*args)`.
    pub(crate) fn call(
        self,
        callable: &Bound<'py, PyAny>,
        args: &Bound<'py, PyTuple>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let guard = ParkOnUnwind;
        // SAFETY: the GIL is held and both objects are alive.
        let out = unsafe {
            unwinding::PyObject_Call(callable.as_ptr(), args.as_ptr(), std::ptr::null_mut())
        };
        std::mem::forget(guard);
        self.owned(out)
    }

    /// `iter(obj)`.
    pub(crate) fn iter(self, obj: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
        let guard = ParkOnUnwind;
        // SAFETY: the GIL is held and `obj` is alive.
        let out = unsafe { unwinding::PyObject_GetIter(obj.as_ptr()) };
        std::mem::forget(guard);
        self.owned(out)
    }

    /// `next(iterator)`, `None` at its end.
    pub(crate) fn next(self, iterator: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let guard = ParkOnUnwind;
        // SAFETY: the GIL is held and `iterator` is an iterator (from `iter`).
        let out = unsafe { unwinding::PyIter_Next(iterator.as_ptr()) };
        std::mem::forget(guard);
        if out.is_null() {
            return match PyErr::take(self.0) {
                Some(err) => Err(err),
                None => Ok(None),
            };
        }
        self.owned(out).map(Some)
    }
}
