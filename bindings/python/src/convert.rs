//! Conversions between Python values and kvtier's: keys, request contexts,
//! keyword configurations, stats.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::{Map, Value};

use kvtier_core::OffloadKey;

use crate::errors;

/// Whether `obj` is `bytes` (or a subclass). The exact type is compared
/// by address first: a subclass check is a call under the limited API.
///
/// # Safety
/// `obj` is a valid object and the GIL is held.
#[inline(always)]
pub(crate) unsafe fn is_bytes(obj: *mut ffi::PyObject) -> bool {
    // SAFETY: see the function's contract.
    unsafe {
        ffi::Py_TYPE(obj) == std::ptr::addr_of_mut!(ffi::PyBytes_Type)
            || ffi::PyBytes_Check(obj) != 0
    }
}

/// The bytes of a key object, borrowed: `bytes` (or a subclass) only,
/// `None` for anything else. One call reads both the buffer and the length.
///
/// # Safety
/// `obj` is a valid object and the GIL is held. The slice lives as long as
/// the object does (`bytes` is immutable): the caller keeps `obj` alive,
/// and does not release the GIL, while it uses the slice, unless `obj` is
/// owned by something that outlives the use.
#[inline]
pub(crate) unsafe fn key_bytes<'a>(obj: *mut ffi::PyObject) -> Option<&'a [u8]> {
    // SAFETY: see the function's contract.
    unsafe {
        if !is_bytes(obj) {
            return None;
        }
        let mut data: *mut std::ffi::c_char = std::ptr::null_mut();
        let mut len: ffi::Py_ssize_t = 0;
        // Cannot fail for a bytes object when the length is asked for.
        if ffi::PyBytes_AsStringAndSize(obj, &mut data, &mut len) != 0 || data.is_null() {
            ffi::PyErr_Clear();
            return None;
        }
        Some(std::slice::from_raw_parts(
            data.cast::<u8>(),
            usize::try_from(len).unwrap_or(0),
        ))
    }
}

/// The `TypeError` of a key that is not `bytes`.
#[cold]
pub(crate) fn not_bytes(obj: &Bound<'_, PyAny>) -> PyErr {
    PyTypeError::new_err(format!("a key must be bytes, not {}", type_name(obj)))
}

/// A key from a Python object: `bytes` only (`TypeError` otherwise). The
/// length is checked by the manager (`ValueError`).
#[inline]
pub(crate) fn key(obj: &Bound<'_, PyAny>) -> PyResult<OffloadKey> {
    // SAFETY: `obj` is alive and the GIL held while the slice is read.
    match unsafe { key_bytes(obj.as_ptr()) } {
        Some(bytes) => Ok(OffloadKey::new(bytes)),
        None => Err(not_bytes(obj)),
    }
}

/// A key object known to be `bytes`, borrowed (see [`with_key_objects`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct KeyObj(*mut ffi::PyObject);

impl KeyObj {
    /// A key object from an object known to be `bytes` (or a subclass).
    #[inline(always)]
    pub(crate) fn new_unchecked(obj: *mut ffi::PyObject) -> Self {
        Self(obj)
    }

    /// The object.
    #[inline(always)]
    pub(crate) fn as_ptr(self) -> *mut ffi::PyObject {
        self.0
    }

    /// Its bytes.
    ///
    /// # Safety
    /// As for [`key_bytes`]: the GIL is held and the object alive while
    /// the slice is used.
    #[inline]
    pub(crate) unsafe fn bytes<'a>(self) -> &'a [u8] {
        // SAFETY: forwarded; the object is `bytes` (checked when made).
        unsafe { key_bytes(self.0) }.unwrap_or_default()
    }

    /// Its key.
    ///
    /// # Safety
    /// The GIL is held and the object alive.
    #[inline]
    pub(crate) unsafe fn key(self) -> OffloadKey {
        // SAFETY: forwarded.
        OffloadKey::new(unsafe { self.bytes() })
    }
}

/// How many key objects [`with_key_objects`] keeps on the stack.
const INLINE_KEYS: usize = 64;

/// Runs `f` with every key object of `obj` (a list, a tuple or any
/// iterable of `bytes`), borrowed, and what `prepare` made for their count;
/// `TypeError` before `f` runs if one is not `bytes`.
///
/// The items of a list are borrowed, so nothing may run Python code while
/// `f` uses them: a finalizer could remove them from the list and free
/// them. So `prepare` (which may allocate, and so run the garbage
/// collector and its finalizers) runs before the items are read, and `f`
/// must neither release the GIL, nor allocate a Python object, nor run
/// Python code while it uses the objects (copy them into [`OffloadKey`]s
/// first).
#[inline]
pub(crate) fn with_key_objects<P, R>(
    obj: &Bound<'_, PyAny>,
    mut prepare: impl FnMut(usize) -> PyResult<P>,
    f: impl FnOnce(&[KeyObj], P) -> R,
) -> PyResult<R> {
    let py = obj.py();
    let ptr = obj.as_ptr();
    // SAFETY: `ptr` is a live object; type checks only (the exact types
    // by address: a subclass check is a call under the limited API).
    let (is_list, is_tuple) = unsafe {
        let ty = ffi::Py_TYPE(ptr);
        let is_list = ty == std::ptr::addr_of_mut!(ffi::PyList_Type) || ffi::PyList_Check(ptr) != 0;
        let is_tuple = !is_list
            && (ty == std::ptr::addr_of_mut!(ffi::PyTuple_Type) || ffi::PyTuple_Check(ptr) != 0);
        (is_list, is_tuple)
    };
    if is_list || is_tuple {
        // The length field of a list or tuple (the interpreter's own
        // `PyList_GET_SIZE`), read without a call.
        // SAFETY: `ptr` is a list or a tuple (this call holds it).
        let size = || unsafe { ffi::Py_SIZE(ptr) };
        let mut len = size();
        let mut prepared = prepare(usize::try_from(len).map_err(|_| PyErr::fetch(py))?)?;
        // `prepare` may have run a finalizer that resized the list.
        let mut tries = 0;
        while size() != len {
            tries += 1;
            if tries == 3 {
                // It keeps doing so: read our own copy instead.
                // SAFETY: `ptr` is a list; a new tuple, or null with an error.
                let copy = unsafe { Bound::from_owned_ptr_or_err(py, ffi::PySequence_Tuple(ptr))? };
                return with_key_objects(&copy, prepare, f);
            }
            len = size();
            prepared = prepare(usize::try_from(len).map_err(|_| PyErr::fetch(py))?)?;
        }
        let len = usize::try_from(len).map_err(|_| PyErr::fetch(py))?;
        // Up to `INLINE_KEYS` objects on the stack: no allocation for a
        // request's usual keys.
        let mut inline = [KeyObj(std::ptr::null_mut()); INLINE_KEYS];
        let mut heap = Vec::new();
        let objects: &mut [KeyObj] = if len <= INLINE_KEYS {
            &mut inline[..len]
        } else {
            heap.resize(len, KeyObj(std::ptr::null_mut()));
            &mut heap
        };
        for (index, slot) in objects.iter_mut().enumerate() {
            // Borrowed items (no reference count traffic per key): from
            // here to the end of `f` no Python code runs, so the sequence
            // cannot change; a failed check returns at once.
            // SAFETY: `ptr` is a list or tuple and `index` is within its length.
            let item = unsafe {
                if is_list {
                    ffi::PyList_GetItem(ptr, index as ffi::Py_ssize_t)
                } else {
                    ffi::PyTuple_GetItem(ptr, index as ffi::Py_ssize_t)
                }
            };
            if item.is_null() {
                return Err(PyErr::fetch(py));
            }
            // SAFETY: a non-null item of a sequence we hold is a valid
            // object; it outlives `f` (see above).
            if !unsafe { is_bytes(item) } {
                // SAFETY: as above.
                return Err(not_bytes(&*unsafe { Borrowed::from_ptr(py, item) }));
            }
            *slot = KeyObj(item);
        }
        return Ok(f(objects, prepared));
    }
    if obj.is_instance_of::<PyBytes>() || obj.is_instance_of::<PyString>() {
        return Err(PyTypeError::new_err(
            "keys must be a list of bytes, not a single bytes or str value",
        ));
    }
    let iter = obj.try_iter().map_err(|e| {
        errors::unless_base(py, e, |_| {
            PyTypeError::new_err(format!(
                "keys must be an iterable of bytes, not {}",
                type_name(obj)
            ))
        })
    })?;
    // Owned items: iterating runs Python code. `f` runs once the iteration
    // is over, with the items held here.
    let mut items = Vec::new();
    for item in iter {
        let item = item?;
        // SAFETY: `item` is alive; type check only.
        if !unsafe { is_bytes(item.as_ptr()) } {
            return Err(not_bytes(&item));
        }
        items.push(item);
    }
    let prepared = prepare(items.len())?;
    let objects: Vec<KeyObj> = items.iter().map(|item| KeyObj(item.as_ptr())).collect();
    Ok(f(&objects, prepared))
}

/// Keys from a list, a tuple or any iterable of `bytes`.
pub(crate) fn keys(obj: &Bound<'_, PyAny>) -> PyResult<Vec<OffloadKey>> {
    // SAFETY: the objects are alive and the GIL held during `f`.
    with_key_objects(
        obj,
        |_| Ok(()),
        |objects, ()| objects.iter().map(|k| unsafe { k.key() }).collect(),
    )
}

/// The request id of a `req_context`: any object with a `req_id: str`.
pub(crate) fn req_id(ctx: &Bound<'_, PyAny>) -> PyResult<String> {
    let py = ctx.py();
    let value = ctx.getattr(pyo3::intern!(py, "req_id")).map_err(|e| {
        errors::unless_base(py, e, |_| {
            PyTypeError::new_err(format!(
                "req_context must have a req_id attribute (str); got {}",
                type_name(ctx)
            ))
        })
    })?;
    match value.downcast::<PyString>() {
        Ok(s) => Ok(s.to_cow()?.into_owned()),
        Err(_) => Err(PyTypeError::new_err(format!(
            "req_context.req_id must be a str, not {}",
            type_name(&value)
        ))),
    }
}

pub(crate) fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".to_owned())
}

/// A Python value of a keyword configuration as JSON.
fn to_json(field: &str, obj: &Bound<'_, PyAny>) -> PyResult<Value> {
    if obj.is_none() {
        return Ok(Value::Null);
    }
    if let Ok(b) = obj.downcast::<PyBool>() {
        return Ok(Value::Bool(b.is_true()));
    }
    if obj.is_instance_of::<PyInt>() {
        if let Ok(v) = obj.extract::<u64>() {
            return Ok(Value::from(v));
        }
        if let Ok(v) = obj.extract::<i64>() {
            return Ok(Value::from(v));
        }
        return Err(PyValueError::new_err(format!(
            "configuration field `{field}`: integer out of range"
        )));
    }
    if let Ok(f) = obj.downcast::<PyFloat>() {
        return Ok(serde_json::Number::from_f64(f.value())
            .map(Value::Number)
            .unwrap_or(Value::Null));
    }
    if let Ok(s) = obj.downcast::<PyString>() {
        return Ok(Value::String(s.to_cow()?.into_owned()));
    }
    if obj.is_instance_of::<PyList>() || obj.is_instance_of::<PyTuple>() {
        let mut items = Vec::new();
        for item in obj.try_iter()? {
            items.push(to_json(field, &item?)?);
        }
        return Ok(Value::Array(items));
    }
    // os.PathLike (pathlib.Path) becomes its string form.
    match obj.call_method0("__fspath__") {
        Ok(path) => {
            if let Ok(s) = path.downcast::<PyString>() {
                return Ok(Value::String(s.to_cow()?.into_owned()));
            }
        }
        Err(e) if errors::is_base_only(obj.py(), &e) => return Err(e),
        Err(_) => {}
    }
    Err(PyValueError::new_err(format!(
        "configuration field `{field}`: unsupported value of type {}",
        type_name(obj)
    )))
}

/// The field names of a serde struct with defaults.
fn field_names<T: Serialize + Default>() -> Vec<String> {
    match serde_json::to_value(T::default()) {
        Ok(Value::Object(map)) => map.keys().cloned().collect(),
        _ => Vec::new(),
    }
}

/// Splits keyword arguments into a manager configuration and a tier
/// configuration, naming any unknown or ill-typed field in a `ValueError`.
pub(crate) fn split_config<M, T>(
    tier_label: &str,
    kwargs: Option<&Bound<'_, PyDict>>,
) -> PyResult<(M, T)>
where
    M: Serialize + DeserializeOwned + Default,
    T: Serialize + DeserializeOwned + Default,
{
    let manager_fields = field_names::<M>();
    let tier_fields = field_names::<T>();
    let mut manager = Map::new();
    let mut tier = Map::new();
    if let Some(kwargs) = kwargs {
        for (name, value) in kwargs.iter() {
            let name: String = name.extract()?;
            crate::fields::check_range(tier_label, &name, &value)?;
            let json = to_json(&name, &value)?;
            let is_manager = manager_fields.contains(&name);
            if !is_manager && !tier_fields.contains(&name) {
                let mut known: Vec<&str> = manager_fields
                    .iter()
                    .chain(tier_fields.iter())
                    .map(String::as_str)
                    .collect();
                known.sort_unstable();
                return Err(PyValueError::new_err(format!(
                    "unknown configuration field `{name}` for the {tier_label} manager; known fields: {}",
                    known.join(", ")
                )));
            }
            // Deserialize the field alone first, so an ill-typed value is
            // reported with its field's name.
            let mut alone = Map::new();
            alone.insert(name.clone(), json.clone());
            let checked = if is_manager {
                serde_json::from_value::<M>(Value::Object(alone)).map(drop)
            } else {
                serde_json::from_value::<T>(Value::Object(alone)).map(drop)
            };
            if let Err(e) = checked {
                return Err(field_error(&name, &e, &type_name(&value)));
            }
            let target = if is_manager { &mut manager } else { &mut tier };
            target.insert(name, json);
        }
    }
    let m = serde_json::from_value::<M>(Value::Object(manager))
        .map_err(|e| PyValueError::new_err(format!("invalid configuration: {e}")))?;
    let t = serde_json::from_value::<T>(Value::Object(tier))
        .map_err(|e| PyValueError::new_err(format!("invalid configuration: {e}")))?;
    Ok((m, t))
}

/// An ill-typed or out-of-range field, named with what it expects and the
/// Python type it got. serde's own message quotes the value, and a value
/// may be a secret (a password, or a URL holding one, passed where a list
/// or another type was expected), so only its "expected ..." part is kept.
fn field_error(name: &str, e: &serde_json::Error, got: &str) -> PyErr {
    let text = e.to_string();
    let expected = text
        .find("expected ")
        .map_or("is not a valid value for this field", |at| {
            text[at..].split(" at line ").next().unwrap_or(&text[at..])
        });
    PyValueError::new_err(format!(
        "configuration field `{name}`: {expected} (got a value of type {got})"
    ))
}

/// A JSON value as a Python object (for stats).
pub(crate) fn from_json<'py>(py: Python<'py>, value: &Value) -> PyResult<Bound<'py, PyAny>> {
    Ok(match value {
        Value::Null => py.None().into_bound(py),
        Value::Bool(b) => PyBool::new(py, *b).to_owned().into_any(),
        Value::Number(n) => {
            if let Some(u) = n.as_u64() {
                u.into_pyobject(py)?.into_any()
            } else if let Some(i) = n.as_i64() {
                i.into_pyobject(py)?.into_any()
            } else {
                n.as_f64().unwrap_or(f64::NAN).into_pyobject(py)?.into_any()
            }
        }
        Value::String(s) => PyString::new(py, s).into_any(),
        Value::Array(items) => {
            let list = PyList::empty(py);
            for item in items {
                list.append(from_json(py, item)?)?;
            }
            list.into_any()
        }
        Value::Object(map) => {
            let dict = PyDict::new(py);
            for (k, v) in map {
                dict.set_item(k, from_json(py, v)?)?;
            }
            dict.into_any()
        }
    })
}
