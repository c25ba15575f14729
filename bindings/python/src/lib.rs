//! Python bindings of kvtier: `import kvtier`.
//!
//! The native module `kvtier._kvtier` holds one manager class, `_Manager`,
//! which the Python package subclasses as `AsyncLookupManager` (a tier
//! written in Python, by overriding `batch_lookup`) and as the native
//! `RedisLookupManager`, `S3LookupManager` and `DiskLookupManager`, whose
//! lookups never take the GIL; plus `TierStack` and the exceptions.

mod convert;
mod fast;
mod manager;
mod native;
mod pytier;
mod stack;

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

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

#[pymodule]
fn _kvtier(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    manager::IMMORTAL_SINGLETONS.store(
        py.version_info() >= (3, 12),
        std::sync::atomic::Ordering::Relaxed,
    );
    m.add_class::<manager::PyManager>()?;
    fast::install(py, &py.get_type::<manager::PyManager>())?;
    m.add_class::<stack::PyTierStack>()?;
    m.add("KvtierError", py.get_type::<KvtierError>())?;
    m.add("TierError", py.get_type::<TierError>())?;
    m.add("ShutDownError", py.get_type::<ShutDownError>())?;
    Ok(())
}
