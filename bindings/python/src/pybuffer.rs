//! A Python buffer (`memoryview`, numpy array, `bytearray`, ...) held as a
//! transfer job's [`HostBuffer`]: the caller's rows, copied in place by
//! kvtier's threads without the GIL.
//!
//! The job keeps the exporter's `Py_buffer` until it ends, so the memory
//! cannot be freed or moved under a copy even if the caller drops every
//! reference to the object right after submitting. Releasing a `Py_buffer`
//! needs the GIL, which kvtier's threads never take: a job that ends hands
//! its buffer to a list that the next call of a manager's job methods
//! releases, on the caller's thread, holding the GIL. Once the interpreter
//! has begun to exit, nothing is released: the buffers leak with the
//! process rather than touch a finalizing interpreter.
//!
//! The buffer protocol's C functions are part of the stable ABI from
//! CPython 3.11 only, and PyO3 hides them below that under `abi3-py39`;
//! they exist, with this layout, in every CPython since 3.3, so they are
//! declared here.

use std::ffi::{c_char, c_int, c_void};
use std::sync::{Mutex, PoisonError};

use pyo3::ffi::{self, Py_ssize_t};
use pyo3::prelude::*;

use kvtier_core::HostBuffer;

/// CPython's `Py_buffer` (`Include/pybuffer.h`, unchanged since 3.3).
#[repr(C)]
struct RawBuffer {
    buf: *mut c_void,
    obj: *mut ffi::PyObject,
    len: Py_ssize_t,
    itemsize: Py_ssize_t,
    readonly: c_int,
    ndim: c_int,
    format: *mut c_char,
    shape: *mut Py_ssize_t,
    strides: *mut Py_ssize_t,
    suboffsets: *mut Py_ssize_t,
    internal: *mut c_void,
}

impl RawBuffer {
    /// A buffer that holds nothing (what `PyObject_GetBuffer` fills in, and
    /// what a released one is replaced with).
    fn empty() -> Self {
        Self {
            buf: std::ptr::null_mut(),
            obj: std::ptr::null_mut(),
            len: 0,
            itemsize: 0,
            readonly: 0,
            ndim: 0,
            format: std::ptr::null_mut(),
            shape: std::ptr::null_mut(),
            strides: std::ptr::null_mut(),
            suboffsets: std::ptr::null_mut(),
            internal: std::ptr::null_mut(),
        }
    }
}

/// `PyBUF_STRIDES`: shape and strides, any contiguity, read-only allowed
/// (the flags are checked here, to raise kvtier's own errors).
const PYBUF_STRIDES: c_int = 0x0010 | 0x0008;

unsafe extern "C" {
    fn PyObject_GetBuffer(obj: *mut ffi::PyObject, view: *mut RawBuffer, flags: c_int) -> c_int;
    fn PyBuffer_Release(view: *mut RawBuffer);
    fn PyBuffer_IsContiguous(view: *const RawBuffer, order: c_char) -> c_int;
}

/// Why a Python object cannot be a job's buffer.
#[derive(Debug)]
pub(crate) enum BufferProblem {
    /// It does not export a buffer (the exception Python raised).
    NotABuffer(PyErr),
    /// Its bytes are not one C-contiguous run.
    NotContiguous,
    /// A load needs to write into it.
    ReadOnly,
    /// It has no dimension, or rows of zero bytes.
    NoRows,
}

/// A Python object's exported buffer, held until the value drops.
pub(crate) struct PyRows {
    /// Boxed: the exporter may keep pointers into the struct (`shape`).
    view: Box<RawBuffer>,
    rows: usize,
    row_bytes: usize,
}

// SAFETY: the exported memory has no thread affinity; the `Py_buffer`
// itself is only read (its `buf`, `len`) off the GIL, and released on a
// thread holding the GIL (see `Drop`).
unsafe impl Send for PyRows {}
// SAFETY: shared access reads immutable fields only.
unsafe impl Sync for PyRows {}

impl PyRows {
    /// Exports `obj`'s buffer: C-contiguous, at least one dimension, rows
    /// (its first dimension) of at least one byte; writable if `writable`.
    pub(crate) fn export(obj: &Bound<'_, PyAny>, writable: bool) -> Result<Self, BufferProblem> {
        let mut view = Box::new(RawBuffer::empty());
        // SAFETY: the GIL is held (`obj` is bound), `view` is writable
        // memory of the struct's layout; on success it must be released.
        let rc = unsafe { PyObject_GetBuffer(obj.as_ptr(), &mut *view, PYBUF_STRIDES) };
        if rc != 0 {
            let err = PyErr::take(obj.py()).unwrap_or_else(|| {
                pyo3::exceptions::PyTypeError::new_err("the object exports no buffer")
            });
            return Err(BufferProblem::NotABuffer(err));
        }
        // From here on, dropping `held` releases the export.
        let mut held = Self {
            view,
            rows: 0,
            row_bytes: 0,
        };
        // SAFETY: a buffer just exported, with the GIL held.
        let contiguous = unsafe { PyBuffer_IsContiguous(&*held.view, b'C' as c_char) } != 0;
        if !contiguous || !held.view.suboffsets.is_null() {
            held.release_now();
            return Err(BufferProblem::NotContiguous);
        }
        if writable && held.view.readonly != 0 {
            held.release_now();
            return Err(BufferProblem::ReadOnly);
        }
        let len = usize::try_from(held.view.len).unwrap_or(0);
        let rows = if held.view.ndim >= 1 && !held.view.shape.is_null() {
            // SAFETY: `shape` holds `ndim` entries for a PyBUF_ND request.
            usize::try_from(unsafe { *held.view.shape }).unwrap_or(0)
        } else {
            0
        };
        if rows == 0 || len == 0 || len % rows != 0 {
            held.release_now();
            return Err(BufferProblem::NoRows);
        }
        held.rows = rows;
        held.row_bytes = len / rows;
        Ok(held)
    }

    /// The number of rows (the first dimension).
    pub(crate) fn rows(&self) -> usize {
        self.rows
    }

    /// The bytes of one row.
    pub(crate) fn row_bytes(&self) -> usize {
        self.row_bytes
    }

    /// Releases the export at once (the GIL is held: only called while
    /// exporting), leaving nothing for `Drop`.
    fn release_now(&mut self) {
        if !self.view.obj.is_null() || !self.view.buf.is_null() {
            // SAFETY: exported, not yet released, GIL held by the caller.
            unsafe { PyBuffer_Release(&mut *self.view) };
            self.view.obj = std::ptr::null_mut();
            self.view.buf = std::ptr::null_mut();
        }
    }
}

// SAFETY: (1) `buf` and `len` never change, and the exporter keeps the
// memory allocated and in place while the export is held (the buffer
// protocol's promise: e.g. a `bytearray` refuses to resize, numpy to
// resize or free an array with exports); the export is held until this
// value drops. (2) It is writable only when the exporter said so, and the
// memory belongs to a Python object, never to a Rust reference. (3) The
// caller of a submit promises not to touch a job's rows while it runs
// (documented on the Python methods).
unsafe impl HostBuffer for PyRows {
    fn as_ptr(&self) -> *const u8 {
        self.view.buf as *const u8
    }
    fn len(&self) -> usize {
        usize::try_from(self.view.len).unwrap_or(0)
    }
    fn is_writable(&self) -> bool {
        self.view.readonly == 0
    }
}

/// An export whose job has ended, waiting for a thread with the GIL.
struct Finished(Box<RawBuffer>);

// SAFETY: moved between threads only to be released by one holding the GIL.
unsafe impl Send for Finished {}

/// Exports let go of by their jobs, not yet released.
static FINISHED: Mutex<Vec<Finished>> = Mutex::new(Vec::new());

impl Drop for PyRows {
    /// Hands the export over to [`release_finished`]: the thread that
    /// drops it (a kvtier thread when a job ends) may not take the GIL.
    fn drop(&mut self) {
        if self.view.obj.is_null() && self.view.buf.is_null() {
            return;
        }
        let view = std::mem::replace(&mut self.view, Box::new(RawBuffer::empty()));
        FINISHED
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(Finished(view));
    }
}

/// Releases the exports of every job that has ended, on this thread,
/// which holds the GIL; does nothing once the interpreter exits (they
/// leak with the process).
pub(crate) fn release_finished(_py: Python<'_>) {
    if crate::lifecycle::is_exiting() {
        return;
    }
    let finished = std::mem::take(&mut *FINISHED.lock().unwrap_or_else(PoisonError::into_inner));
    for Finished(mut view) in finished {
        // SAFETY: exported, released once (taken out of the list), GIL held.
        unsafe { PyBuffer_Release(&mut *view) };
    }
}
