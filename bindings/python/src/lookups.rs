//! The lookup paths of a manager object: `lookup`, `lookup_many` and
//! `lookup_prefix`, shared by the PyO3 methods and the METH_FASTCALL ones
//! ([`crate::fast`]).
//!
//! With a `req_context` object seen before and a free lock, a call runs in
//! one pass under the core's lock, holding the GIL: each key comes from the
//! memo (or is built) and is looked up; `lookup_many`'s answers are then
//! made into a list with as few calls into the interpreter as it can.
//! Otherwise the keys are copied out, `req_id` is read, and the lock is
//! waited for without the GIL.

use std::sync::Arc;

use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyList};

use kvtier_core::{
    AsyncLookupManager, DynLookupManager, LookupError, LookupVerdict, OffloadKey, PrefixVerdict,
    ReqContext, Tier,
};

use crate::backend::{Backend, each_backend};
use crate::convert::{self, KeyObj};
use crate::errors;
use crate::manager::{Core, Inner};
use crate::memo::KeyMemo;

impl Inner {
    /// `True` (present), `False` (absent) or `None` (pending).
    #[inline(always)]
    pub(crate) fn lookup<'py>(
        &self,
        py: Python<'py>,
        key: &Bound<'py, PyAny>,
        req_context: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        // SAFETY: `key` is alive (held by the caller for the whole call).
        if !unsafe { convert::is_bytes(key.as_ptr()) } {
            return Err(convert::not_bytes(key));
        }
        self.reraise()?;
        // The fast path of `try_known_ctx`, written out: one lookup's share
        // of a closure call is worth saving.
        if let Ok(mut guard) = self.core.try_lock() {
            let Core {
                backend,
                contexts,
                memo,
            } = &mut *guard;
            if let Some(ctx) = contexts.known(req_context.as_ptr() as usize) {
                memo.count(1);
                // SAFETY: the GIL is held and `key` is alive.
                let key = unsafe { memo.key(py, KeyObj::new_unchecked(key.as_ptr())) };
                // Through `Backend`'s one `lookup`: the concrete managers'
                // `lookup` then has one more caller only, `lookup_each`,
                // which keeps it inlined there.
                let v = backend.lookup(key, ctx).map_err(errors::lookup_error)?;
                return Ok(verdict(py, v));
            }
        }
        let key = convert::key(key)?;
        let v = self
            .with_new_ctx(py, req_context, move |m, ctx| m.lookup(&key, ctx))?
            .map_err(errors::lookup_error)?;
        Ok(verdict(py, v))
    }

    /// One answer per key, as `lookup` would give.
    #[inline]
    pub(crate) fn lookup_many<'py>(
        &self,
        py: Python<'py>,
        keys: &Bound<'py, PyAny>,
        req_context: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        self.reraise()?;
        // The verdicts go into a Rust buffer while the keys are borrowed:
        // nothing in the closure releases the GIL, allocates a Python
        // object or runs Python code. The list is made after.
        let fast = convert::with_key_objects(
            keys,
            |len| Ok(vec![LookupVerdict::Pending; len]),
            |objects, mut verdicts| {
                let done = self
                    .try_known_ctx(req_context, |backend, ctx, memo| {
                        memo.count(objects.len());
                        // SAFETY: the GIL is held (fast path) and the keys'
                        // objects are alive (see `with_key_objects`).
                        each_backend!(backend, m => unsafe {
                            lookup_each(py, m, ctx, memo, objects, &mut verdicts)
                        })
                    })
                    .map_err(drop);
                match done {
                    Ok(Ok(())) => Ok(Ok(verdicts)),
                    Ok(Err(e)) => Ok(Err(errors::lookup_error(e))),
                    // Copied out before the slow path may release the GIL.
                    // SAFETY: the objects are alive and the GIL held.
                    Err(_) => Err(objects
                        .iter()
                        .map(|k| unsafe { k.key() })
                        .collect::<Vec<_>>()),
                }
            },
        )?;
        let verdicts = match fast {
            Ok(done) => done?,
            Err(keys) => self
                .with_new_ctx(py, req_context, move |m, ctx| {
                    let mut out = Vec::with_capacity(keys.len());
                    for key in &keys {
                        out.push(m.lookup(key, ctx)?);
                    }
                    Ok(out)
                })?
                .map_err(errors::lookup_error)?,
        };
        verdict_list(py, &verdicts)
    }

    /// How many leading keys exist, or `None` while one before the first
    /// miss is pending.
    #[inline]
    pub(crate) fn lookup_prefix(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyAny>,
        req_context: &Bound<'_, PyAny>,
    ) -> PyResult<Option<usize>> {
        self.reraise()?;
        // Nothing in this closure releases the GIL, allocates a Python
        // object or runs Python code.
        let fast = convert::with_key_objects(
            keys,
            |_| Ok(()),
            |objects, ()| {
                let done = self.try_known_ctx(req_context, |m, ctx, memo| {
                    memo.count(objects.len());
                    let keys: Vec<OffloadKey> = objects
                        .iter()
                        // SAFETY: as in `lookup_many`.
                        .map(|&k| unsafe { memo.key(py, k) }.clone())
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
            },
        )?;
        let v = match fast {
            Ok(v) => v,
            Err(keys) => {
                self.with_new_ctx(py, req_context, move |m, ctx| m.lookup_prefix(&keys, ctx))?
            }
        }
        .map_err(errors::lookup_error)?;
        Ok(match v {
            PrefixVerdict::Ready(n) => Some(n),
            PrefixVerdict::Pending => None,
        })
    }

    /// Runs `f` with the backend, the context of `ctx` and the key memo
    /// when `ctx` is an object seen before (compared by identity: no
    /// attribute read) and the core's lock is free: the whole call then
    /// holds the GIL, and `f` may use Python objects. Otherwise hands `f`
    /// back untouched; the caller then goes through
    /// [`with_new_ctx`](Self::with_new_ctx).
    #[inline]
    fn try_known_ctx<R, F>(&self, ctx: &Bound<'_, PyAny>, f: F) -> Result<R, F>
    where
        F: FnOnce(&mut Backend, &ReqContext, &mut KeyMemo) -> R,
    {
        if let Ok(mut guard) = self.core.try_lock() {
            let Core {
                backend,
                contexts,
                memo,
            } = &mut *guard;
            if let Some(rc) = contexts.known(ctx.as_ptr() as usize) {
                return Ok(f(backend, rc, memo));
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
        let address = ctx.as_ptr() as usize;
        let rc = ReqContext::new(Arc::<str>::from(convert::req_id(ctx)?));
        let held = [ctx.clone().unbind(), ctx.clone().unbind()];
        let (result, released) = self.with_core(py, move |core| {
            let mut released = Vec::new();
            core.contexts.remember(address, held, &rc, &mut released);
            (f(&mut core.backend, &rc), released)
        });
        // Released with the GIL, after the lock (a finalizer may run Python
        // code), as `Bound`s: released at once even in a METH_FASTCALL
        // entry point, where PyO3 does not count the GIL as held.
        for obj in released {
            drop(obj.into_bound(py));
        }
        Ok(result)
    }
}

/// From this many keys on, `lookup_many` builds the keys of a chunk first
/// and looks them up together (see [`lookup_each`]).
const BATCH_MIN_KEYS: usize = 64;

/// Keys built, then looked up, at a time on the batched path.
const BATCH_KEYS: usize = 256;

/// How many key objects ahead of the one whose key is being built the
/// batched path starts loading an object's memory.
const OBJECTS_AHEAD: usize = 8;

/// Starts loading the first two cache lines of a key object: its header
/// and, for a key of up to 32 bytes past the header's end, its bytes.
#[inline(always)]
fn prefetch_object(obj: KeyObj) {
    #[cfg(target_arch = "x86_64")]
    {
        let p = obj.as_ptr().cast::<i8>();
        // SAFETY: SSE is part of every x86_64 target; a prefetch never
        // faults, whatever the address.
        unsafe {
            use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
            _mm_prefetch::<_MM_HINT_T0>(p);
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(64));
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = obj;
}

/// Looks each of `objects` up in `m`, its answer into `verdicts` (as
/// long). One concrete manager per instance: the loop calls that manager's
/// own `lookup`, inlined here.
///
/// A long list goes in chunks: the chunk's keys are built first (the
/// objects' reads, independent of each other, overlap), then looked up
/// through [`AsyncLookupManager::lookup_each`], which prefetches the
/// table's memory a few keys ahead: on many keys spread over a large
/// table, the cache misses overlap instead of following each other.
///
/// # Safety
/// The GIL is held and the objects are alive.
#[inline(never)]
unsafe fn lookup_each<T: Tier>(
    py: Python<'_>,
    m: &mut AsyncLookupManager<T>,
    ctx: &ReqContext,
    memo: &mut KeyMemo,
    objects: &[KeyObj],
    verdicts: &mut [LookupVerdict],
) -> Result<(), LookupError> {
    if objects.len() < BATCH_MIN_KEYS {
        for (&obj, out) in objects.iter().zip(verdicts.iter_mut()) {
            // SAFETY: forwarded.
            *out = m.lookup(unsafe { memo.key(py, obj) }, ctx)?;
        }
        return Ok(());
    }
    let mut keys = memo.take_batch();
    let mut done = Ok(());
    for &obj in objects.iter().take(OBJECTS_AHEAD) {
        prefetch_object(obj);
    }
    for (n, chunk) in objects.chunks(BATCH_KEYS).enumerate() {
        keys.clear();
        keys.reserve(chunk.len());
        let base = n * BATCH_KEYS;
        for (i, &obj) in chunk.iter().enumerate() {
            // The objects are spread over the heap: each one's lines start
            // loading some keys before its key is built.
            if let Some(&ahead) = objects.get(base + i + OBJECTS_AHEAD) {
                prefetch_object(ahead);
            }
            // SAFETY: forwarded.
            unsafe { memo.push_key(py, obj, &mut keys) };
        }
        let out = &mut verdicts[base..base + chunk.len()];
        done = m.lookup_each(&keys, ctx, |i, v| out[i] = v);
        if done.is_err() {
            break;
        }
    }
    memo.put_batch(keys);
    done
}

/// The singleton `True`, `False` or `None` of a verdict, as a new reference.
#[inline(always)]
fn verdict(py: Python<'_>, v: LookupVerdict) -> Bound<'_, PyAny> {
    match v {
        LookupVerdict::Hit => PyBool::new(py, true).to_owned().into_any(),
        LookupVerdict::Miss => PyBool::new(py, false).to_owned().into_any(),
        LookupVerdict::Pending => py.None().into_bound(py),
    }
}

/// The list of `verdicts`' `True` / `False` / `None`.
///
/// With the stable ABI every reference count and list store is a function
/// call into the interpreter. So the list starts as `[v] * len` for the
/// most common verdict `v` (CPython fills it and counts the references in
/// one call), and only the other items are stored one by one: on keys that
/// mostly answer alike, about one call per key less.
fn verdict_list<'py>(py: Python<'py>, verdicts: &[LookupVerdict]) -> PyResult<Bound<'py, PyList>> {
    let len = ffi::Py_ssize_t::try_from(verdicts.len())
        .map_err(|_| pyo3::exceptions::PyOverflowError::new_err("too many keys"))?;
    let at = |v: LookupVerdict| match v {
        LookupVerdict::Hit => 0,
        LookupVerdict::Miss => 1,
        LookupVerdict::Pending => 2,
    };
    let mut counts = [0usize; 3];
    for &v in verdicts {
        counts[at(v)] += 1;
    }
    let fill = [
        LookupVerdict::Hit,
        LookupVerdict::Miss,
        LookupVerdict::Pending,
    ]
    .into_iter()
    .max_by_key(|&v| counts[at(v)])
    .unwrap_or(LookupVerdict::Pending);
    let one = PyList::new(py, [verdict(py, fill)])?;
    // SAFETY: `one` is a list; PySequence_Repeat returns a new reference
    // (a new list of `len` items, each `one`'s) or null with an error set.
    let list = unsafe {
        Bound::from_owned_ptr_or_err(py, ffi::PySequence_Repeat(one.as_ptr(), len))?
            .downcast_into::<PyList>()?
    };
    for (index, &v) in verdicts.iter().enumerate() {
        if v != fill {
            // SAFETY: `index` is within the new list's length; the item is
            // replaced (the old one released) and the new reference stolen.
            unsafe {
                ffi::PyList_SetItem(
                    list.as_ptr(),
                    index as ffi::Py_ssize_t,
                    verdict(py, v).into_ptr(),
                );
            }
        }
    }
    Ok(list)
}
