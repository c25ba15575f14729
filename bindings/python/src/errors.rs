//! kvtier's Python exceptions, and the mapping of kvtier's errors (a tier's,
//! a lookup's, a manager's construction) to them.

use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;

use kvtier_core::{LookupError, ManagerError, TierError as CoreTierError};

create_exception!(
    _kvtier,
    KvtierError,
    PyException,
    "Base class of kvtier's own exceptions."
);
create_exception!(
    _kvtier,
    TierError,
    KvtierError,
    "A store, load or remove failed: the tier is unreachable, rejected the credentials, or failed."
);
create_exception!(
    _kvtier,
    ShutDownError,
    KvtierError,
    "The manager was shut down: it answers no more lookups, stores or loads."
);

/// Adds the exception classes to the module.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("KvtierError", py.get_type::<KvtierError>())?;
    m.add("TierError", py.get_type::<TierError>())?;
    m.add("ShutDownError", py.get_type::<ShutDownError>())?;
    Ok(())
}

/// A failed store, load or remove as a `TierError`; `what` says what was
/// being done.
pub(crate) fn tier_error(_py: Python<'_>, what: &str, e: &CoreTierError) -> PyErr {
    TierError::new_err(format!("{what} failed: {}", kvtier_core::one_line(e)))
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

/// A tier's configuration refused at construction: `ValueError`.
pub(crate) fn config_error(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(e.to_string())
}
