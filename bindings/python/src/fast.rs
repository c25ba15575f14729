//! METH_FASTCALL entry points of the three lookup methods, on CPython >= 3.10.
//!
//! Why this module exists: PyO3 builds the methods of an `abi3-py39` module
//! as METH_VARARGS | METH_KEYWORDS, so every call packs its arguments into a
//! new tuple that PyO3 then unpacks; for `lookup`, whose own work is a few
//! tens of nanoseconds, that is most of the cost. METH_FASTCALL (arguments
//! as an array) is in the stable ABI from CPython 3.10, and PyO3 generates
//! it for modules whose ABI floor is 3.10. Until kvtier's floor moves there
//! (then delete this module), [`install`] replaces `lookup`, `lookup_many`
//! and `lookup_prefix` on `_Manager`, when the running interpreter is 3.10
//! or newer, by method descriptors of the same names whose functions take
//! the arguments as an array. On 3.9 the PyO3 methods stay.
//!
//! Hand-built are the descriptor, the reading of the two arguments (with
//! PyO3's error messages) and [`call`], which runs the same code as the PyO3
//! method ([`Inner::lookup`] and friends) and turns a panic into a
//! `RuntimeError`. PyO3's own trampoline would count the GIL in a
//! thread-local, which a shared library reaches through `__tls_get_addr`:
//! measured with callgrind, about 70 instructions more per call, a fifth of
//! a resolved `lookup`. So PyO3 does not count the GIL as held inside these
//! calls: the code they run drops Python objects as `Bound` (released at
//! once), never as `Py` (which PyO3 would then defer).
//!
//! [`Inner::lookup`]: crate::manager::Inner::lookup

use std::ffi::{CStr, c_int};
use std::panic::{AssertUnwindSafe, catch_unwind};

use pyo3::exceptions::{PyRuntimeError, PyTypeError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyString, PyTuple, PyType};

use crate::manager::PyManager;

/// `METH_FASTCALL` (0x0080): in the limited API from 3.10; pyo3-ffi hides it
/// for an `abi3-py39` build, so its value is spelled out.
const METH_FASTCALL: c_int = 0x0080;

/// A METH_FASTCALL | METH_KEYWORDS function (`PyCFunctionFastWithKeywords`).
type FastWithKeywords = unsafe extern "C" fn(
    *mut ffi::PyObject,
    *const *mut ffi::PyObject,
    ffi::Py_ssize_t,
    *mut ffi::PyObject,
) -> *mut ffi::PyObject;

/// One method: its name, parameter names, docstring with text signature,
/// and C function.
struct Method {
    name: &'static CStr,
    params: [&'static str; 2],
    doc: &'static CStr,
    func: FastWithKeywords,
}

const METHODS: [Method; 3] = [
    Method {
        name: c"lookup",
        params: ["key", "req_context"],
        doc: c"lookup($self, key, req_context)\n--\n\n`True` (present), `False` (absent) or `None` (pending: retry next step).",
        func: lookup,
    },
    Method {
        name: c"lookup_many",
        params: ["keys", "req_context"],
        doc: c"lookup_many($self, keys, req_context)\n--\n\nOne answer per key, as `lookup` would give.",
        func: lookup_many,
    },
    Method {
        name: c"lookup_prefix",
        params: ["keys", "req_context"],
        doc: c"lookup_prefix($self, keys, req_context)\n--\n\nHow many leading keys exist, or `None` while one before the first\nmiss is pending.",
        func: lookup_prefix,
    },
];

/// Installs the METH_FASTCALL methods on `ty` (the `_Manager` class) when
/// the interpreter is CPython 3.10 or newer; does nothing otherwise.
pub(crate) fn install(py: Python<'_>, ty: &Bound<'_, PyType>) -> PyResult<()> {
    if py.version_info() < (3, 10) {
        return Ok(());
    }
    for method in &METHODS {
        // The interpreter keeps a pointer to the definition for as long as
        // the descriptor lives: leaked, once per import of the module.
        let def: &'static mut ffi::PyMethodDef = Box::leak(Box::new(ffi::PyMethodDef {
            ml_name: method.name.as_ptr(),
            ml_meth: ffi::PyMethodDefPointer {
                // SAFETY: the interpreter calls `ml_meth` with the signature
                // its flags name (METH_FASTCALL | METH_KEYWORDS), as C
                // extensions cast it; this is how that cast is spelled.
                PyCFunction: unsafe {
                    std::mem::transmute::<FastWithKeywords, ffi::PyCFunction>(method.func)
                },
            },
            ml_flags: METH_FASTCALL | ffi::METH_KEYWORDS,
            ml_doc: method.doc.as_ptr(),
        }));
        // SAFETY: `ty` is a type object and `def` lives forever.
        let descr = unsafe {
            Bound::from_owned_ptr_or_err(py, ffi::PyDescr_NewMethod(ty.as_type_ptr(), def))?
        };
        ty.setattr(method.name.to_str()?, descr)?;
    }
    Ok(())
}

/// The manager and the two arguments of a call, positional or by keyword,
/// checked as PyO3 checks them (same messages).
///
/// # Safety
/// The GIL is held; `slf` is a `_Manager` (the method descriptor checked
/// it); `args` holds `nargs` positional arguments followed by one value per
/// name in `kwnames` (a tuple of str, or null), as METH_FASTCALL |
/// METH_KEYWORDS passes them, all alive for the call.
#[inline(always)]
unsafe fn arguments<'a, 'py>(
    py: Python<'py>,
    method: &Method,
    slf: &'a Borrowed<'_, 'py, PyAny>,
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
) -> PyResult<(&'a PyManager, [Borrowed<'py, 'py, PyAny>; 2])> {
    // SAFETY: see the function's contract; the class is frozen, so a shared
    // reference to its Rust value is always allowed.
    let manager = unsafe { slf.downcast_unchecked::<PyManager>() }.get();
    if kwnames.is_null() && nargs == 2 {
        // The usual call: two positional arguments, read in place.
        // SAFETY: `args` holds two arguments.
        let params = unsafe {
            [
                Borrowed::from_ptr(py, *args),
                Borrowed::from_ptr(py, *args.add(1)),
            ]
        };
        return Ok((manager, params));
    }
    // SAFETY: forwarded.
    let params = unsafe { named_arguments(py, method, args, nargs, kwnames) }?;
    Ok((manager, params))
}

/// [`arguments`] for any other arrangement: keywords, or a wrong count.
///
/// # Safety
/// As for [`arguments`].
#[inline(never)]
unsafe fn named_arguments<'py>(
    py: Python<'py>,
    method: &Method,
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
) -> PyResult<[Borrowed<'py, 'py, PyAny>; 2]> {
    let nargs = usize::try_from(nargs).unwrap_or(0);
    // SAFETY: see the function's contract.
    let at = |i: usize| unsafe { Borrowed::from_ptr(py, *args.add(i)) };
    let name = method.name.to_str().unwrap_or("method");
    if nargs > 2 {
        return Err(PyTypeError::new_err(format!(
            "{name}() takes 2 positional arguments but {nargs} were given"
        )));
    }
    let mut found: [Option<Borrowed<'py, 'py, PyAny>>; 2] = [None, None];
    for (i, slot) in found.iter_mut().enumerate().take(nargs) {
        *slot = Some(at(i));
    }
    if !kwnames.is_null() {
        // SAFETY: a non-null `kwnames` is a tuple (the function's contract).
        let names = unsafe { Borrowed::from_ptr(py, kwnames) };
        // SAFETY: as above.
        let names = unsafe { names.downcast_unchecked::<PyTuple>() };
        for (j, kw) in names.iter().enumerate() {
            let kw = kw.downcast::<PyString>()?.to_cow()?;
            let Some(index) = method.params.iter().position(|p| *p == kw) else {
                return Err(PyTypeError::new_err(format!(
                    "{name}() got an unexpected keyword argument '{kw}'"
                )));
            };
            if found[index].is_some() {
                return Err(PyTypeError::new_err(format!(
                    "{name}() got multiple values for argument '{kw}'"
                )));
            }
            found[index] = Some(at(nargs + j));
        }
    }
    match found {
        [Some(a), Some(b)] => Ok([a, b]),
        _ => {
            let missing: Vec<String> = method
                .params
                .iter()
                .zip(&found)
                .filter(|(_, f)| f.is_none())
                .map(|(p, _)| format!("'{p}'"))
                .collect();
            Err(PyTypeError::new_err(format!(
                "{name}() missing {} required positional argument{}: {}",
                missing.len(),
                if missing.len() == 1 { "" } else { "s" },
                missing.join(" and ")
            )))
        }
    }
}

/// Runs `body` for a METH_FASTCALL call of `method`: returns its object, or
/// sets its error (a panic becomes a `RuntimeError`) and returns null.
///
/// # Safety
/// Called by the interpreter, holding the GIL, with the arguments of
/// [`arguments`]'s contract.
#[inline(always)]
unsafe fn call(
    method: &Method,
    slf: *mut ffi::PyObject,
    args: *const *mut ffi::PyObject,
    nargs: ffi::Py_ssize_t,
    kwnames: *mut ffi::PyObject,
    body: impl for<'py> FnOnce(
        Python<'py>,
        &PyManager,
        [Borrowed<'py, 'py, PyAny>; 2],
    ) -> PyResult<Bound<'py, PyAny>>,
) -> *mut ffi::PyObject {
    // SAFETY: the interpreter holds the GIL for the whole call, and nothing
    // derived from `py` outlives it.
    let py = unsafe { Python::assume_gil_acquired() };
    let outcome = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: forwarded from the interpreter's call.
        let slf = unsafe { Borrowed::from_ptr(py, slf) };
        // SAFETY: as above.
        let (manager, params) = unsafe { arguments(py, method, &slf, args, nargs, kwnames) }?;
        body(py, manager, params)
    }));
    match outcome {
        Ok(Ok(obj)) => obj.into_ptr(),
        Ok(Err(err)) => {
            err.restore(py);
            std::ptr::null_mut()
        }
        Err(_) => {
            PyRuntimeError::new_err(format!(
                "kvtier: {}() panicked (a bug in kvtier)",
                method.name.to_str().unwrap_or("method")
            ))
            .restore(py);
            std::ptr::null_mut()
        }
    }
}

/// Defines a METH_FASTCALL function of `METHODS[$index]`.
macro_rules! fast_method {
    ($name:ident, $index:expr, |$py:ident, $m:ident, $a:ident, $b:ident| $body:expr) => {
        unsafe extern "C" fn $name(
            slf: *mut ffi::PyObject,
            args: *const *mut ffi::PyObject,
            nargs: ffi::Py_ssize_t,
            kwnames: *mut ffi::PyObject,
        ) -> *mut ffi::PyObject {
            // SAFETY: called by the interpreter as a METH_FASTCALL |
            // METH_KEYWORDS method of `_Manager`.
            unsafe {
                call(
                    &METHODS[$index],
                    slf,
                    args,
                    nargs,
                    kwnames,
                    |$py, $m, [$a, $b]| $body,
                )
            }
        }
    };
}

fast_method!(lookup, 0, |py, m, key, ctx| m
    .inner()?
    .lookup(py, &key, &ctx));
fast_method!(lookup_many, 1, |py, m, keys, ctx| m
    .inner()?
    .lookup_many(py, &keys, &ctx)
    .map(Bound::into_any));
fast_method!(lookup_prefix, 2, |py, m, keys, ctx| Ok(m
    .inner()?
    .lookup_prefix(py, &keys, &ctx)?
    .into_pyobject(py)?
    .into_any()));
