//! kvtier's Python exceptions, and the mapping of kvtier's errors to them:
//! each [`TierErrorKind`] has a subclass of `kvtier.TierError`, so a caller
//! catches what it can act on (retry later, fix the configuration, fix the
//! call) without reading messages.

use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyDict, PyString, PyTuple, PyType};
use pyo3::{PyTypeInfo, create_exception};

use kvtier_core::{LookupError, ManagerError, TierError as CoreTierError, TierErrorKind};

create_exception!(
    kvtier,
    KvtierError,
    PyException,
    "Base class of kvtier's own exceptions."
);
create_exception!(
    kvtier,
    TierError,
    KvtierError,
    "A store, load or remove failed. Its subclass says why; `kind` holds the \
     kind's name (\"unavailable\", \"timeout\", \"config\", ...)."
);
create_exception!(
    kvtier,
    ShutDownError,
    KvtierError,
    "The manager was shut down: it answers no more lookups, stores or loads."
);

create_exception!(
    kvtier,
    ForkError,
    KvtierError,
    "The manager was made in another process, before a fork: it belongs to \
     that process. Make managers in the process that uses them."
);

/// A subclass of `kvtier.TierError` for one or more error kinds.
struct Subclass {
    name: &'static str,
    /// A built-in exception it also derives from, so `except TimeoutError`
    /// (say) catches it too.
    builtin: Option<fn(Python<'_>) -> Bound<'_, PyType>>,
    doc: &'static str,
}

/// The subclasses, in the order of [`subclass_of`]'s indices.
const SUBCLASSES: [Subclass; 7] = [
    Subclass {
        name: "TierConnectionError",
        builtin: Some(|py| py.get_type::<pyo3::exceptions::PyConnectionError>()),
        doc: "The tier could not be reached, or dropped the connection (kind \
              \"unavailable\"). Transient: the same call may succeed later.",
    },
    Subclass {
        name: "TierTimeoutError",
        builtin: Some(|py| py.get_type::<pyo3::exceptions::PyTimeoutError>()),
        doc: "The tier did not answer in time (kind \"timeout\"). Transient.",
    },
    Subclass {
        name: "TierThrottledError",
        builtin: None,
        doc: "The tier asked the client to slow down (kind \"throttled\"). Transient.",
    },
    Subclass {
        name: "TierConfigError",
        builtin: None,
        doc: "Rejected credentials, a denied permission, a missing bucket, or \
              another fault of the configuration (kind \"config\"): retrying \
              will not help.",
    },
    Subclass {
        name: "TierInvalidInputError",
        builtin: Some(|py| py.get_type::<PyValueError>()),
        doc: "The tier cannot accept the argument, such as a block too big for \
              a disk tier's segment (kind \"invalid_input\"). Also a ValueError.",
    },
    Subclass {
        name: "TierDataError",
        builtin: None,
        doc: "Stored data failed a checksum or could not be parsed (kind \"corrupt\").",
    },
    Subclass {
        name: "TierPermissionError",
        builtin: Some(|py| py.get_type::<pyo3::exceptions::PyPermissionError>()),
        doc: "The tier accepted the credentials but denies this operation, such as \
              a Redis ACL without EXISTS or GET (kind \"permission_denied\"). \
              Retrying will not help. Also a PermissionError.",
    },
];

/// The index in [`SUBCLASSES`] of `kind`'s class; `None` for the kinds
/// that are `TierError` itself (a panic, anything else, and kinds added to
/// the core later).
fn subclass_of(kind: TierErrorKind) -> Option<usize> {
    match kind {
        TierErrorKind::Unavailable => Some(0),
        TierErrorKind::Timeout => Some(1),
        TierErrorKind::Throttled => Some(2),
        TierErrorKind::Config => Some(3),
        TierErrorKind::InvalidInput => Some(4),
        TierErrorKind::Corrupt => Some(5),
        TierErrorKind::PermissionDenied => Some(6),
        // A block stored at another length than the caller's region: the
        // call's input does not fit the data.
        TierErrorKind::LengthMismatch => Some(4),
        _ => None,
    }
}

/// The subclasses' type objects, made when the module is imported.
static TYPES: GILOnceCell<Vec<Py<PyType>>> = GILOnceCell::new();

/// The subclass `index` of [`SUBCLASSES`].
fn subclass(py: Python<'_>, index: usize) -> PyResult<Bound<'_, PyType>> {
    let types = TYPES.get_or_try_init(py, || {
        SUBCLASSES
            .iter()
            .map(|class| make_subclass(py, class))
            .collect::<PyResult<Vec<_>>>()
    })?;
    types
        .get(index)
        .map(|ty| ty.bind(py).clone())
        .ok_or_else(|| KvtierError::new_err("kvtier: unknown exception class (a bug)"))
}

/// `class <name>(TierError[, builtin]): "<doc>"`, in module `kvtier`.
fn make_subclass(py: Python<'_>, class: &Subclass) -> PyResult<Py<PyType>> {
    let mut bases = vec![TierError::type_object(py).into_any()];
    if let Some(builtin) = class.builtin {
        bases.push(builtin(py).into_any());
    }
    let namespace = PyDict::new(py);
    namespace.set_item("__doc__", class.doc)?;
    namespace.set_item("__module__", "kvtier")?;
    let ty = py
        .get_type::<PyType>()
        .call1((class.name, PyTuple::new(py, bases)?, namespace))?;
    Ok(ty.downcast_into::<PyType>()?.unbind())
}

/// Adds the exception classes to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("KvtierError", py.get_type::<KvtierError>())?;
    m.add("TierError", py.get_type::<TierError>())?;
    m.add("ShutDownError", py.get_type::<ShutDownError>())?;
    m.add("ForkError", py.get_type::<ForkError>())?;
    for (index, class) in SUBCLASSES.iter().enumerate() {
        m.add(class.name, subclass(py, index)?)?;
    }
    Ok(())
}

/// A failed store, load or remove as the `TierError` subclass of its kind,
/// with `kind` set; `what` says what was being done.
pub(crate) fn tier_error(py: Python<'_>, what: &str, e: &CoreTierError) -> PyErr {
    let message = format!("{what} failed: {}", kvtier_core::one_line(e));
    let err = match subclass_of(e.kind()).map(|index| subclass(py, index)) {
        Some(Ok(ty)) => PyErr::from_type(ty, message),
        Some(Err(bug)) => return bug,
        None => TierError::new_err(message),
    };
    let kind = PyString::new(py, e.kind().as_str());
    // An attribute on a new exception object cannot fail; if it did, the
    // exception is still the right class.
    let _ = err.value(py).setattr("kind", kind);
    err
}

/// The error of a manager (or stack) used in a process forked after it
/// was made.
pub(crate) fn fork_error(what: &str, made_in: u32) -> PyErr {
    ForkError::new_err(format!(
        "this {what} was made in process {made_in}, before a fork; process {} \
         cannot use it: make a new one in this process",
        std::process::id()
    ))
}

/// A [`LookupError`] (bad key, shut down) as a Python exception.
pub(crate) fn lookup_error(e: LookupError) -> PyErr {
    match e {
        LookupError::ShutDown { .. } => ShutDownError::new_err(e.to_string()),
        LookupError::InvalidKey { .. } => PyValueError::new_err(e.to_string()),
        other => KvtierError::new_err(other.to_string()),
    }
}

/// A [`ManagerError`] at construction: `ValueError` for a field out of
/// range, `KvtierError` otherwise.
pub(crate) fn build_error(e: ManagerError) -> PyErr {
    match e {
        ManagerError::InvalidConfig { .. } => PyValueError::new_err(e.to_string()),
        other => KvtierError::new_err(other.to_string()),
    }
}

/// `err` replaced by `replace(err)`, unless it is a `BaseException` that is
/// not an `Exception` (`KeyboardInterrupt`, `SystemExit`, `GeneratorExit`):
/// kvtier lets those through unchanged wherever it calls into Python.
pub(crate) fn unless_base(
    py: Python<'_>,
    err: PyErr,
    replace: impl FnOnce(PyErr) -> PyErr,
) -> PyErr {
    if is_base_only(py, &err) {
        err
    } else {
        replace(err)
    }
}

/// Whether `err` is a `BaseException` that is not an `Exception`.
pub(crate) fn is_base_only(py: Python<'_>, err: &PyErr) -> bool {
    !err.is_instance_of::<PyException>(py)
}

/// A tier's configuration refused at construction: `ValueError`.
pub(crate) fn config_error(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(e.to_string())
}
