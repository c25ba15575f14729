//! The request contexts a manager has seen: each `req_context` object by
//! identity with its [`ReqContext`], so a known object costs no `req_id`
//! read, and the first object of each request, which a Python tier's
//! `batch_lookup` receives.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use pyo3::prelude::*;

use kvtier_core::ReqContext;

/// Past this many objects, the identity map starts afresh.
const MAX_OBJECTS: usize = 16_384;

/// The contexts of one manager; used under its core's lock.
///
/// A scheduler passes the same object for a request step after step, so an
/// identity check saves reading `req_id` (a Python attribute) on each call.
/// The map holds each object, so its address cannot be reused while it is
/// there; `cleanup(req_id)` removes it. A context's `req_id` must not
/// change after its first use.
pub(crate) struct Contexts {
    by_object: HashMap<usize, (Py<PyAny>, ReqContext), BuildHasherDefault<AddressHasher>>,
    /// The object of the last call and its context (a copy of its entry):
    /// a scheduler asks for one request's keys in a row.
    last: Option<(usize, ReqContext)>,
    /// The first object of each request, for a Python tier.
    first: Option<Arc<FirstObjects>>,
}

impl Contexts {
    /// The contexts of a manager; `first` for a Python tier, which is
    /// handed each request's first object.
    pub(crate) fn new(first: Option<Arc<FirstObjects>>) -> Self {
        Self {
            by_object: HashMap::default(),
            last: None,
            first,
        }
    }

    /// The context of object `address`, if it was seen before.
    #[inline(always)]
    pub(crate) fn known(&mut self, address: usize) -> Option<&ReqContext> {
        if let Some((last, _)) = &self.last
            && *last == address
        {
            return self.last.as_ref().map(|(_, ctx)| ctx);
        }
        let (_, ctx) = self.by_object.get(&address)?;
        Some(&self.last.insert((address, ctx.clone())).1)
    }

    /// Remembers an object (at `address`; `obj` and `again` are two
    /// references to it, taken with the GIL) as a context of `ctx`'s
    /// request. Objects it lets go are pushed onto `released`, for the
    /// caller to drop with the GIL once the lock is released (a finalizer
    /// may run Python code).
    pub(crate) fn remember(
        &mut self,
        address: usize,
        [obj, again]: [Py<PyAny>; 2],
        ctx: &ReqContext,
        released: &mut Vec<Py<PyAny>>,
    ) {
        self.last = None;
        if self.by_object.len() >= MAX_OBJECTS {
            released.extend(self.by_object.drain().map(|(_, (obj, _))| obj));
        }
        match &self.first {
            Some(first) => released.extend(first.remember(ctx, again)),
            None => released.push(again),
        }
        if let Some((old, _)) = self.by_object.insert(address, (obj, ctx.clone())) {
            released.push(old);
        }
    }

    /// Forgets request `req_id`'s objects; the caller drops them once the
    /// lock is released.
    pub(crate) fn forget(&mut self, req_id: &str) -> Vec<Py<PyAny>> {
        self.last = None;
        let mut released: Vec<Py<PyAny>> = self
            .by_object
            .extract_if(|_, (_, ctx)| ctx.req_id() == req_id)
            .map(|(_, (obj, _))| obj)
            .collect();
        if let Some(first) = &self.first {
            released.extend(first.forget(req_id));
        }
        released
    }
}

/// The first `req_context` object of each request, by request id: what a
/// Python tier's `batch_lookup` receives. Shared with the tier, which reads
/// it on the worker's thread under this lock only (never the core's).
#[derive(Debug, Default)]
pub(crate) struct FirstObjects(Mutex<HashMap<Arc<str>, Py<PyAny>>>);

impl FirstObjects {
    fn map(&self) -> MutexGuard<'_, HashMap<Arc<str>, Py<PyAny>>> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Keeps `obj` if it is its request's first; hands it back otherwise.
    fn remember(&self, ctx: &ReqContext, obj: Py<PyAny>) -> Option<Py<PyAny>> {
        let mut map = self.map();
        if map.contains_key(ctx.req_id()) {
            return Some(obj);
        }
        map.insert(Arc::from(ctx.req_id()), obj);
        None
    }

    fn forget(&self, req_id: &str) -> Option<Py<PyAny>> {
        self.map().remove(req_id)
    }

    /// Request `req_id`'s first object, if it is still remembered.
    pub(crate) fn get(&self, py: Python<'_>, req_id: &str) -> Option<Py<PyAny>> {
        self.map().get(req_id).map(|obj| obj.clone_ref(py))
    }
}

/// Hashes an object address (already unique; mixes the aligned low bits away).
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
