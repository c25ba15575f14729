//! Stores, loads and removes of the native tiers, without the GIL.

use std::future::Future;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;

use kvtier_core::{BlockStore, OffloadKey};
use kvtier_disk::DiskTier;
use kvtier_redis::RedisTier;
use kvtier_s3::{S3Config, S3Tier};

use crate::{KvtierError, TierError};

/// The tier a native manager wraps, for the calls that bypass lookups.
pub(crate) enum Native {
    /// A Python `batch_lookup`: no store / load.
    None,
    Redis(Arc<RedisTier>),
    S3(Arc<S3Tier>),
    Disk(Arc<DiskTier>),
}

/// The upper bound of one store / load / remove, over the tiers' own
/// timeouts: the caller never hangs.
const CALL_LIMIT: Duration = Duration::from_secs(60);

/// The runtime of store / load / remove and of S3 set-up: two threads,
/// started on first use and kept for the life of the process.
fn runtime() -> PyResult<&'static tokio::runtime::Runtime> {
    static RUNTIME: OnceLock<Result<tokio::runtime::Runtime, String>> = OnceLock::new();
    RUNTIME
        .get_or_init(|| {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .thread_name("kvtier-py-io")
                .enable_all()
                .build()
                .map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(|e| KvtierError::new_err(format!("could not start the I/O runtime: {e}")))
}

/// Runs `fut` to completion without the GIL, within [`CALL_LIMIT`].
fn block_on<T: Send, E: std::fmt::Display + Send>(
    py: Python<'_>,
    what: &str,
    fut: impl Future<Output = Result<T, E>> + Send,
) -> PyResult<T> {
    let rt = runtime()?;
    let outcome =
        py.allow_threads(|| rt.block_on(async { tokio::time::timeout(CALL_LIMIT, fut).await }));
    match outcome {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(e)) => Err(TierError::new_err(format!("{what} failed: {e}"))),
        Err(_) => Err(TierError::new_err(format!(
            "{what} did not finish within {} s",
            CALL_LIMIT.as_secs()
        ))),
    }
}

pub(crate) fn config_err(e: impl std::fmt::Display) -> PyErr {
    PyValueError::new_err(e.to_string())
}

pub(crate) fn new_s3(py: Python<'_>, config: S3Config) -> PyResult<S3Tier> {
    config.validate().map_err(config_err)?;
    block_on(py, "configuring the S3 tier", S3Tier::new(config))
}

pub(crate) fn store(
    py: Python<'_>,
    native: &Native,
    key: &OffloadKey,
    data: Vec<u8>,
) -> PyResult<()> {
    match native {
        Native::Redis(t) => block_on(py, "redis store", BlockStore::store(t.as_ref(), key, &data)),
        Native::S3(t) => block_on(py, "s3 store", BlockStore::store(&**t, key, &data)),
        Native::Disk(t) => py
            .allow_threads(|| t.store_blocking(key, &data))
            .map_err(|e| TierError::new_err(format!("disk store failed: {e}"))),
        Native::None => Ok(()),
    }
}

pub(crate) fn load(py: Python<'_>, native: &Native, key: &OffloadKey) -> PyResult<Option<Vec<u8>>> {
    match native {
        Native::Redis(t) => block_on(py, "redis load", BlockStore::load(t.as_ref(), key)),
        Native::S3(t) => block_on(py, "s3 load", BlockStore::load(&**t, key)),
        Native::Disk(t) => py
            .allow_threads(|| t.load_blocking(key))
            .map_err(|e| TierError::new_err(format!("disk load failed: {e}"))),
        Native::None => Ok(None),
    }
}

pub(crate) fn remove(py: Python<'_>, native: &Native, key: &OffloadKey) -> PyResult<()> {
    match native {
        Native::Redis(t) => block_on(py, "redis remove", BlockStore::remove(t.as_ref(), key)),
        Native::S3(t) => block_on(py, "s3 remove", BlockStore::remove(&**t, key)),
        Native::Disk(t) => py
            .allow_threads(|| t.remove_blocking(key))
            .map(drop)
            .map_err(|e| TierError::new_err(format!("disk remove failed: {e}"))),
        Native::None => Ok(()),
    }
}
