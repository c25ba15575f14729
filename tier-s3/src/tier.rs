//! [`S3Tier`]: the tier's face. Each call (a lookup batch, a store, a
//! batched load...) runs as one task on the tier's I/O runtime, where its
//! S3 requests ([`Requests`]) run in place under the shared limits.
//!
//! aws-sdk's hyper pool spawns each connection's task on the runtime of the
//! request that opened the connection, and hands the pooled connection to
//! later requests from any runtime. A connection opened from a runtime that
//! the caller stops driving (a `block_on` that returned on a current-thread
//! runtime) then freezes every request sent on it until its attempt times
//! out. So every SDK request of a tier runs on the tier's [`Spawner`]: one
//! the tier starts, or one the caller hands in; the tier keeps a clone, so
//! that runtime lives as long as the tier does. A whole call crosses over
//! at once, not each request: a lookup of 256 keys is one hop between
//! runtimes, not 256, and its requests and their connections run on the
//! same runtime.

use std::fmt;
use std::future::Future;
use std::sync::Arc;

use kvtier_core::{
    BlockOutcome, BlockStore, ManagerConfig, OffloadKey, ReqContext, Spawner, Tier, TierError,
};

use crate::config::redact_endpoint;
use crate::logs::SdkLogs;
use crate::requests::{Requests, Result, S3Stats};
use crate::{S3Config, S3TierError, client};

/// An S3 tier; see the crate documentation.
pub struct S3Tier {
    pub(crate) requests: Arc<Requests>,
    /// Where every call runs (see the module docs); a clone, which keeps a
    /// dedicated runtime alive as long as the tier.
    pub(crate) io: Spawner,
}

impl fmt::Debug for S3Tier {
    /// Shows no secret: the endpoint is masked.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("S3Tier")
            .field("endpoint", &self.requests.endpoint)
            .field("config", &self.requests.config)
            .finish_non_exhaustive()
    }
}

impl S3Tier {
    /// Builds the client (credentials from `config` or the AWS chain) and
    /// starts the runtime its requests run on (a
    /// [`Spawner::dedicated`] of `io_threads` threads, shut down without
    /// blocking when the tier drops). Does not contact the server; the
    /// bucket is checked by the first request, or at once by
    /// [`check`](Self::check).
    ///
    /// Requests run on that runtime whatever runtime calls the tier, so a
    /// store from a short-lived runtime never leaves a connection behind
    /// that later lookups would wait on.
    ///
    /// # Errors
    /// [`S3TierError::InvalidConfig`] for a field out of range, an endpoint
    /// that is not an http(s) URL, or a region (from `config` or the AWS
    /// chain) or credential with a control character;
    /// [`S3TierError::Other`] if the runtime's threads cannot start.
    pub async fn new(config: S3Config) -> Result<Self> {
        config.validate()?;
        let io = Spawner::dedicated("kvtier-s3-io", config.io_threads).map_err(|e| {
            S3TierError::Other {
                bucket: config.bucket.clone(),
                endpoint: endpoint_shown(&config),
                op: "starting the I/O runtime",
                detail: e.to_string(),
            }
        })?;
        Self::build(config, io).await
    }

    /// As [`new`](Self::new), but the requests run on `spawner`'s runtime
    /// instead of one of the tier's own (`io_threads` is ignored): the one
    /// the lookup managers share (one runtime for a whole stack and its S3
    /// I/O), or the caller's ([`Spawner::from_handle`]). The same
    /// constructor, with the same argument, as
    /// `RedisTier::with_spawner`.
    ///
    /// The tier keeps a clone of `spawner`: a dedicated runtime
    /// ([`Spawner::dedicated`]) runs as long as the tier, whether or not the
    /// caller keeps its own clone. A caller's runtime
    /// ([`Spawner::from_handle`]) is the caller's to keep: once it shuts
    /// down, requests fail with [`S3TierError::Unavailable`].
    ///
    /// # Errors
    /// As [`new`](Self::new).
    pub async fn with_spawner(config: S3Config, spawner: &Spawner) -> Result<Self> {
        config.validate()?;
        Self::build(config, spawner.clone()).await
    }

    async fn build(config: S3Config, io: Spawner) -> Result<Self> {
        let endpoint = endpoint_shown(&config);
        // On the I/O runtime too: the AWS chain's providers may open
        // connections of their own.
        let building = config.clone();
        let (client, logs) = io
            .spawn(async move {
                let logs = SdkLogs::default();
                (logs.scope(client::build(&building)).await, logs)
            })
            .await
            .map_err(|e| runtime_failed(&config, &endpoint, "building the client", &e))?;
        Ok(Self {
            requests: Arc::new(Requests::new(config, endpoint, client?, logs)),
            io,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &S3Config {
        &self.requests.config
    }

    /// Request counters.
    pub fn stats(&self) -> S3Stats {
        self.requests.stats()
    }

    /// The object name of `key`: prefix plus lower-case hex.
    pub fn object_name(&self, key: &OffloadKey) -> String {
        self.requests.object_name(key)
    }

    /// Runs the call `work` makes as one task on the I/O runtime, under
    /// the SDK's log filter ([`logs`](crate::logs)); dropping the returned
    /// future aborts the task and its requests.
    async fn on_io<T, F>(
        &self,
        op: &'static str,
        work: impl FnOnce(Arc<Requests>) -> F,
    ) -> Result<T>
    where
        T: Send + 'static,
        F: Future<Output = Result<T>> + Send + 'static,
    {
        let requests = Arc::clone(&self.requests);
        let call = work(Arc::clone(&requests));
        match self
            .io
            .spawn(async move { requests.logs.scope(call).await })
            .await
        {
            Ok(outcome) => outcome,
            Err(e) => Err(runtime_failed(
                &self.requests.config,
                &self.requests.endpoint,
                op,
                &e,
            )),
        }
    }

    /// Checks now that the bucket exists and the credentials work
    /// (HeadBucket), for a program to fail fast at start-up with a typed
    /// error. Lookups check by themselves too: before the first one, and
    /// again (at most every `bucket_recheck_ms`) when one finds a key missing.
    ///
    /// # Errors
    /// [`S3TierError::Configuration`] for a missing bucket, rejected or no
    /// credentials; [`S3TierError::Unavailable`] (detail "connection
    /// refused" when nothing listens), [`S3TierError::Timeout`] and the
    /// other classified errors when the server cannot answer.
    ///
    /// # Cancellation safety
    /// Cancel-safe: dropping the future only abandons the request.
    pub async fn check(&self) -> Result<()> {
        self.on_io("HeadBucket", |r| async move { r.check().await })
            .await
    }

    /// Whether each key exists, in order: one HEAD per key, at most
    /// `max_concurrent_requests` in flight across every batch of the tier.
    /// A miss is answered only if the bucket was seen within
    /// `bucket_recheck_ms` before the HEADs (else it is checked again).
    /// [`Tier::batch_lookup`] answers with this.
    ///
    /// # Errors
    /// The first classified [`S3TierError`]; remaining requests are dropped.
    /// A bucket deleted while the tier runs is [`S3TierError::Configuration`].
    pub async fn exists_many(&self, keys: &[OffloadKey]) -> Result<Vec<bool>> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let keys = keys.to_vec();
        self.on_io("HeadObject", |r| async move { r.exists_many(&keys).await })
            .await
    }

    /// Creates the bucket if it does not exist (CreateBucket), for set-up
    /// scripts and tests; the tier itself never creates buckets.
    ///
    /// # Errors
    /// A classified [`S3TierError`].
    pub async fn create_bucket_if_missing(&self) -> Result<()> {
        self.on_io("CreateBucket", |r| async move {
            r.create_bucket_if_missing().await
        })
        .await
    }
}

/// The endpoint as errors and `Debug` show it, masked.
fn endpoint_shown(config: &S3Config) -> String {
    config
        .endpoint
        .as_deref()
        .map_or_else(|| "aws-s3".to_owned(), redact_endpoint)
}

/// A call that did not finish on the I/O runtime: the runtime (the
/// caller's, for [`S3Tier::with_spawner`]) shut down, or the call panicked.
pub(crate) fn runtime_failed(
    config: &S3Config,
    endpoint: &str,
    op: &'static str,
    err: &tokio::task::JoinError,
) -> S3TierError {
    let bucket = config.bucket.clone();
    let endpoint = endpoint.to_owned();
    if err.is_panic() {
        S3TierError::Other {
            bucket,
            endpoint,
            op,
            detail: "the request panicked".to_owned(),
        }
    } else {
        S3TierError::Unavailable {
            bucket,
            endpoint,
            op,
            detail: "the runtime of the tier's requests has shut down".to_owned(),
        }
    }
}

/// The one way to store, load and remove blocks: objects named by
/// [`S3Tier::object_name`], stored with PutObject, loaded with GetObject,
/// removed with DeleteObject. The batched forms run their requests
/// concurrently, at most `max_concurrent_requests` at once (the tier's
/// shared limits hold across batches too), and stop at the first error.
///
/// Errors are [`TierError`]s whose [`source`](std::error::Error::source) is
/// the [`S3TierError`].
impl BlockStore for S3Tier {
    async fn store(&self, key: &OffloadKey, block: &[u8]) -> Result<(), TierError> {
        let (key, block) = (key.clone(), block.to_vec());
        Ok(self
            .on_io("PutObject", |r| async move { r.put(&key, block).await })
            .await?)
    }

    async fn load(&self, key: &OffloadKey) -> Result<Option<Vec<u8>>, TierError> {
        let key = key.clone();
        Ok(self
            .on_io("GetObject", |r| async move { r.get(&key).await })
            .await?)
    }

    async fn remove(&self, key: &OffloadKey) -> Result<(), TierError> {
        let key = key.clone();
        Ok(self
            .on_io("DeleteObject", |r| async move { r.delete(&key).await })
            .await?)
    }

    async fn store_many(&self, blocks: &[(OffloadKey, Vec<u8>)]) -> Result<(), TierError> {
        let blocks = blocks.to_vec();
        Ok(self
            .on_io("PutObject", |r| async move { r.store_many(blocks).await })
            .await?)
    }

    async fn load_many(&self, keys: &[OffloadKey]) -> Result<Vec<Option<Vec<u8>>>, TierError> {
        let keys = keys.to_vec();
        Ok(self
            .on_io("GetObject", |r| async move { r.load_many(&keys).await })
            .await?)
    }

    async fn remove_many(&self, keys: &[OffloadKey]) -> Result<(), TierError> {
        let keys = keys.to_vec();
        Ok(self
            .on_io(
                "DeleteObject",
                |r| async move { r.remove_many(&keys).await },
            )
            .await?)
    }

    /// One PutObject per block, at most `max_concurrent_requests` at once,
    /// one outcome per key; see the crate docs.
    async fn store_batch(&self, blocks: &[(&OffloadKey, &[u8])]) -> Vec<BlockOutcome> {
        self.store_blocks(blocks).await
    }

    /// One GetObject per key, at most `max_concurrent_requests` at once,
    /// each body streamed into its region; see the crate docs.
    async fn load_batch(&self, regions: &mut [(&OffloadKey, &mut [u8])]) -> Vec<BlockOutcome> {
        self.load_blocks(regions).await
    }

    /// Named `s3` unless `config` names it.
    fn manager_config(&self, config: ManagerConfig) -> ManagerConfig {
        config.or_named("s3")
    }
}

impl Tier for S3Tier {
    async fn batch_lookup(
        &self,
        keys: &[OffloadKey],
        _ctx: &ReqContext,
    ) -> Result<Vec<bool>, TierError> {
        self.exists_many(keys).await.map_err(TierError::from)
    }
}
