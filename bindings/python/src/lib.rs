//! Python bindings of kvtier: `import kvtier`.
//!
//! The native module `kvtier._kvtier` holds one manager class, `_Manager`,
//! which the Python package subclasses as `AsyncLookupManager` (a tier
//! written in Python, by overriding `batch_lookup`) and as the native
//! `RedisLookupManager`, `S3LookupManager` and `DiskLookupManager`, whose
//! lookups never take the GIL; plus `TierStack` and the exceptions.
//!
//! One file per concern: `manager` (the class and what it owns),
//! `lookups` (the lookup paths), `backend` (the lookup manager by tier
//! type), `contexts` and `memo` (what the lookups remember), `native`
//! (the native tiers and their stores), `pytier` (a tier in Python),
//! `stack`, `errors`, `convert`, `fields` (the keywords' ranges and
//! defaults), `fast` (METH_FASTCALL), `lifecycle` (the interpreter's
//! exit), and the data path: `jobs` (`submit_store`, `submit_load`,
//! `poll_jobs`, `drain_jobs`) over `pybuffer` (the caller's buffer, held
//! by a job).

mod backend;
mod contexts;
mod convert;
mod errors;
mod fast;
mod fields;
mod jobs;
mod lifecycle;
mod lookups;
mod manager;
mod memo;
mod native;
mod pybuffer;
mod pytier;
mod stack;

use pyo3::prelude::*;

#[pymodule]
fn _kvtier(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<manager::PyManager>()?;
    fast::install(py, &py.get_type::<manager::PyManager>())?;
    m.add_class::<stack::PyTierStack>()?;
    m.add_class::<jobs::JobResult>()?;
    errors::register(m)?;
    lifecycle::install(m)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_function(wrap_pyfunction!(fields::defaults, m)?)?;
    m.add_function(wrap_pyfunction!(fields::ranges, m)?)?;
    Ok(())
}
