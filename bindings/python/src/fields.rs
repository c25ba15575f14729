//! The managers' keyword fields as Python sees them: the range of each
//! numeric one, checked before the configuration is parsed so that a value
//! out of range (`call_timeout_ms=-1`) is a `ValueError` naming the field
//! and its range; and the defaults, which the tests hold the Python
//! signatures (`kvtier/__init__.py`, `__init__.pyi`) to.
//!
//! The ranges are those the configurations' `validate()` enforce, plus the
//! bounds of each field's Rust type; a rule between two fields
//! (`capacity_bytes` at least twice `segment_bytes`) is left to `validate()`.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use serde_json::{Map, Value};

use kvtier_core::ManagerConfig;
use kvtier_disk::DiskConfig;
use kvtier_redis::RedisConfig;
use kvtier_s3::S3Config;

use crate::convert;

/// The largest `usize` and `u32`, as the field's range says them.
const USIZE: u64 = usize::MAX as u64;
const U32: u64 = u32::MAX as u64;
const MS: u64 = ManagerConfig::MAX_DURATION_MS;

/// `ManagerConfig`'s numeric fields: (name, min, max).
const MANAGER: &[(&str, u64, u64)] = &[
    ("max_key_len", 1, USIZE),
    ("min_key_len", 1, USIZE),
    ("call_timeout_ms", 1, MS),
    ("failure_backoff_ms", 0, MS),
    (
        "max_calls_in_flight",
        1,
        ManagerConfig::MAX_CALLS_IN_FLIGHT as u64,
    ),
    ("max_steps_in_flight", 1, USIZE),
    ("max_queued_keys", 1, USIZE),
    ("max_keys_per_call", 1, USIZE),
    ("shutdown_timeout_ms", 0, MS),
    (
        "worker_threads",
        1,
        ManagerConfig::MAX_WORKER_THREADS as u64,
    ),
];

const REDIS: &[(&str, u64, u64)] = &[
    ("ttl_ms", 1, u64::MAX),
    ("pipeline_chunk", 1, USIZE),
    ("max_chunks_in_flight", 1, USIZE),
    ("connect_timeout_ms", 1, u64::MAX),
    ("response_timeout_ms", 1, u64::MAX),
    ("reconnect_retries", 0, USIZE),
];

const S3: &[(&str, u64, u64)] = &[
    (
        "max_concurrent_requests",
        1,
        tokio::sync::Semaphore::MAX_PERMITS as u64,
    ),
    ("request_timeout_ms", 1, MS),
    ("connect_timeout_ms", 1, MS),
    ("max_attempts", 1, U32),
    ("bucket_recheck_ms", 0, MS),
    // S3Config::validate: at most 256 threads.
    ("io_threads", 1, 256),
];

const DISK: &[(&str, u64, u64)] = &[
    ("key_len", 1, kvtier_disk::MAX_KEY_LEN as u64),
    ("capacity_bytes", 2 * 4096, u64::MAX),
    ("segment_bytes", 4096, U32),
    ("initial_slots", 1, 1 << 40),
];

/// The range of numeric field `name` of a `kind` manager ("redis", "s3",
/// "disk", or a Python tier's type), if it is one.
fn range(kind: &str, name: &str) -> Option<(u64, u64)> {
    let tier = match kind {
        "redis" => REDIS,
        "s3" => S3,
        "disk" => DISK,
        _ => &[],
    };
    MANAGER
        .iter()
        .chain(tier)
        .find(|(field, _, _)| *field == name)
        .map(|&(_, min, max)| (min, max))
}

/// Checks an integer `value` of field `name` against its range: a
/// `ValueError` naming the field, the range and the value (a number is
/// never a secret). Anything else is left to the configuration's parser.
pub(crate) fn check_range(kind: &str, name: &str, value: &Bound<'_, PyAny>) -> PyResult<()> {
    let Some((min, max)) = range(kind, name) else {
        return Ok(());
    };
    if !value.is_instance_of::<pyo3::types::PyInt>()
        || value.is_instance_of::<pyo3::types::PyBool>()
    {
        return Ok(());
    }
    match value.extract::<u64>() {
        Ok(v) if (min..=max).contains(&v) => Ok(()),
        _ => Err(PyValueError::new_err(format!(
            "configuration field `{name}`: must be an integer from {min} to {max}, not {}",
            value
                .str()
                .map_or_else(|_| "?".to_owned(), |s| s.to_string())
        ))),
    }
}

/// `ManagerConfig`'s defaults, then the `kind` tier's ("redis", "s3",
/// "disk"; none for "python"), as one dict: what the Python signatures'
/// defaults must be.
#[pyfunction]
#[pyo3(name = "_defaults")]
pub(crate) fn defaults<'py>(py: Python<'py>, kind: &str) -> PyResult<Bound<'py, PyAny>> {
    let tier = match kind {
        "redis" => serde_json::to_value(RedisConfig::default()),
        "s3" => serde_json::to_value(S3Config::default()),
        "disk" => serde_json::to_value(DiskConfig::default()),
        "python" => Ok(Value::Object(Map::new())),
        other => {
            return Err(PyValueError::new_err(format!(
                "unknown tier `{other}`: expected redis, s3, disk or python"
            )));
        }
    };
    let mut all = match serde_json::to_value(ManagerConfig::default()) {
        Ok(Value::Object(map)) => map,
        _ => Map::new(),
    };
    if let Ok(Value::Object(map)) = tier {
        all.extend(map);
    }
    convert::from_json(py, &Value::Object(all))
}

/// The ranges above, as a dict of field to `(min, max)`, for the tests.
#[pyfunction]
#[pyo3(name = "_ranges")]
pub(crate) fn ranges<'py>(
    py: Python<'py>,
    kind: &str,
) -> PyResult<Bound<'py, pyo3::types::PyDict>> {
    let dict = pyo3::types::PyDict::new(py);
    for (field, _, _) in MANAGER.iter().chain(REDIS).chain(S3).chain(DISK) {
        if let Some(bounds) = range(kind, field) {
            dict.set_item(field, bounds)?;
        }
    }
    Ok(dict)
}
