//! `kvtier.TierStack`: several managers, one prefix question. Its members
//! are the managers' own state, shared with their Python objects.

use std::sync::{Arc, Mutex, PoisonError};

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyList;

use kvtier_core::{
    DynLookupManager, LookupError, LookupVerdict, ManagerStats, OffloadKey, PrefixVerdict,
    ReqContext, ShutdownReport, StackPolicy, StackVerdict, TierStack,
};

use crate::convert;
use crate::errors;
use crate::lifecycle::Owner;
use crate::manager::{Inner, PyManager, stats_dict};

/// A manager shared between its Python object and a stack.
struct Member(Arc<Inner>);

impl DynLookupManager for Member {
    fn tier_name(&self) -> &str {
        &self.0.tier_name
    }
    fn lookup(&mut self, key: &OffloadKey, ctx: &ReqContext) -> Result<LookupVerdict, LookupError> {
        self.0.lock().backend.lookup(key, ctx)
    }
    fn lookup_prefix(
        &mut self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
    ) -> Result<PrefixVerdict, LookupError> {
        self.0.lock().backend.lookup_prefix(keys, ctx)
    }
    fn flush(&mut self) {
        self.0.lock().backend.flush();
    }
    fn drain_results(&mut self) {
        self.0.lock().backend.drain_results();
    }
    fn mark_miss(&mut self, keys: &[OffloadKey]) {
        self.0.lock().backend.mark_miss(keys);
    }
    fn mark_present(&mut self, keys: &[OffloadKey]) {
        self.0.lock().backend.mark_present(keys);
    }
    fn cleanup(&mut self, req_id: &str) {
        self.0.lock().backend.cleanup(req_id);
    }
    fn stats(&self) -> ManagerStats {
        self.0.lock().backend.stats()
    }
    fn is_idle(&self) -> bool {
        self.0.lock().backend.is_idle()
    }
    fn shutdown(&mut self) -> ShutdownReport {
        self.0.lock().backend.shutdown()
    }
}

/// Several kvtier managers in priority order (fastest first).
#[pyclass(frozen, module = "kvtier._kvtier", name = "TierStack")]
pub(crate) struct PyTierStack {
    stack: Mutex<TierStack>,
    members: Vec<Arc<Inner>>,
    /// The process that made it (see [`crate::lifecycle`]).
    owner: Owner,
}

impl PyTierStack {
    /// Runs `f` on the stack without the GIL. The members' own locks may
    /// be held by a thread waiting on the worker (a member's `shutdown`),
    /// and the worker may need the GIL to finish a Python `batch_lookup`:
    /// blocking on a member with the GIL held would stall the interpreter.
    /// Nothing `f` does needs the GIL (members call the Rust managers).
    /// `ForkError` in a child forked after the stack was made.
    fn with_stack<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut TierStack) -> R + Send,
    ) -> PyResult<R> {
        self.owner.check("TierStack")?;
        Ok(crate::lifecycle::allow_threads(py, || {
            f(&mut self.stack.lock().unwrap_or_else(PoisonError::into_inner))
        }))
    }
}

#[pymethods]
impl PyTierStack {
    /// `managers`: kvtier managers, fastest first. `policy`:
    /// "prefer_earlier_tiers" (default) or "first_resolved_hit".
    #[new]
    #[pyo3(signature = (managers, policy = "prefer_earlier_tiers"))]
    fn new(managers: &Bound<'_, PyAny>, policy: &str) -> PyResult<Self> {
        let policy = match policy {
            "prefer_earlier_tiers" => StackPolicy::PreferEarlierTiers,
            "first_resolved_hit" => StackPolicy::FirstResolvedHit,
            other => {
                return Err(PyValueError::new_err(format!(
                    "unknown policy `{other}`: expected prefer_earlier_tiers or first_resolved_hit"
                )));
            }
        };
        let mut stack = TierStack::new(policy);
        let mut members = Vec::new();
        for item in managers.try_iter()? {
            let item = item?;
            let manager = item.downcast::<PyManager>().map_err(|_| {
                PyTypeError::new_err(format!(
                    "TierStack takes kvtier managers, not {}",
                    convert::type_name(&item)
                ))
            })?;
            let inner = Arc::clone(manager.get().inner()?);
            members.push(Arc::clone(&inner));
            stack.push(Box::new(Member(inner)));
        }
        if members.is_empty() {
            return Err(PyValueError::new_err(
                "a TierStack needs at least one manager",
            ));
        }
        Ok(Self {
            stack: Mutex::new(stack),
            members,
            owner: Owner::here(),
        })
    }

    /// Per leading block, the index of the tier to load it from; `None`
    /// while a block before the first one missing everywhere is pending.
    fn lookup_prefix(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        req_context: &Bound<'_, PyAny>,
    ) -> PyResult<Option<Vec<usize>>> {
        self.owner.check("TierStack")?;
        let keys = convert::keys(keys)?;
        let ctx = ReqContext::new(convert::req_id(req_context)?);
        let verdict = self
            .with_stack(py, |s| s.lookup_prefix(&keys, &ctx))?
            .map_err(errors::lookup_error)?;
        Ok(match verdict {
            StackVerdict::Pending => None,
            StackVerdict::Ready { locations } => Some(locations),
        })
    }

    /// Flushes every tier.
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        self.with_stack(py, TierStack::flush)
    }

    /// Applies waiting results in every tier.
    fn drain_results(&self, py: Python<'_>) -> PyResult<()> {
        self.with_stack(py, TierStack::drain_results)
    }

    /// Marks `keys` missing in tier `index` after a failed load from it.
    fn mark_miss(&self, py: Python<'_>, index: usize, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        self.owner.check("TierStack")?;
        let keys = convert::keys(keys)?;
        self.with_stack(py, |s| s.mark_miss(index, &keys))
    }

    /// Marks `keys` present in tier `index` after a store to it finished.
    fn mark_present(&self, py: Python<'_>, index: usize, keys: &Bound<'_, PyAny>) -> PyResult<()> {
        self.owner.check("TierStack")?;
        let keys = convert::keys(keys)?;
        self.with_stack(py, |s| s.mark_present(index, &keys))
    }

    /// Releases `req_id` in every tier.
    fn cleanup(&self, py: Python<'_>, req_id: String) -> PyResult<()> {
        self.with_stack(py, |s| s.cleanup(&req_id))
    }

    /// Each tier's stats, in order.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let stats = self.with_stack(py, |s| s.stats())?;
        let list = PyList::empty(py);
        for s in &stats {
            list.append(stats_dict(py, s)?)?;
        }
        Ok(list)
    }

    /// The tiers' names, in order.
    fn tier_names(&self) -> Vec<String> {
        self.members.iter().map(|m| m.tier_name.clone()).collect()
    }

    /// Shuts every tier down (each within its own timeout). In a child
    /// forked after the stack was made, does nothing.
    fn shutdown(&self, py: Python<'_>) {
        if !self.owner.is_here() {
            return;
        }
        for member in &self.members {
            crate::manager::shutdown(py, member);
        }
    }

    fn __len__(&self) -> usize {
        self.members.len()
    }
}
