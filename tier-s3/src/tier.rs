//! [`S3Tier`]: lookups, stores, loads and removes as S3 requests, each run
//! on the tier's I/O runtime under a shared concurrency limit.
//!
//! aws-sdk's hyper pool spawns each connection's task on the runtime of the
//! request that opened the connection, and hands the pooled connection to
//! later requests from any runtime. A connection opened from a runtime that
//! the caller stops driving (a `block_on` that returned on a current-thread
//! runtime) then freezes every request sent on it until its attempt times
//! out. So every SDK request of a tier runs as a task on the tier's
//! [`Spawner`]: one the tier starts, or one the caller hands in; the tier
//! keeps a clone, so that runtime lives as long as the tier does.

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use aws_sdk_s3::config::http::HttpResponse;
use aws_sdk_s3::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_s3::primitives::ByteStream;
use futures_util::StreamExt;
use kvtier_core::{BlockStore, ManagerConfig, OffloadKey, ReqContext, Spawner, Tier, TierError};
use tokio::sync::Semaphore;

use crate::config::redact_endpoint;
use crate::error::{self, ErrorContext, ResponseClass, classify_response};
use crate::logs::SdkLogs;
use crate::{S3Config, S3TierError, client};

/// Request counters of an [`S3Tier`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct S3Stats {
    /// Requests in flight now.
    pub in_flight: usize,
    /// Most requests ever in flight at once.
    pub max_in_flight: usize,
    /// Requests sent (HEAD, PUT, GET, DELETE, and the bucket check).
    pub requests: usize,
}

/// An S3 tier; see the crate documentation.
pub struct S3Tier {
    client: aws_sdk_s3::Client,
    /// Where every request runs (see the module docs); a clone, which keeps
    /// a dedicated runtime alive as long as the tier.
    io: Spawner,
    config: S3Config,
    endpoint: String,
    limit: Arc<Semaphore>,
    /// Writes (PUT, DELETE) have a limit of their own, so that bulk stores
    /// never make lookups queue behind them.
    write_limit: Arc<Semaphore>,
    /// When the bucket was last seen to exist: `None` before the first
    /// check passes and after one finds the bucket missing.
    bucket_seen: Mutex<Option<Instant>>,
    /// One bucket check at a time; concurrent lookups wait for its answer.
    bucket_check: tokio::sync::Mutex<()>,
    /// What the SDK may log (see [`logs`](crate::logs)).
    logs: Arc<SdkLogs>,
    config_error_logged: AtomicBool,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    requests: AtomicUsize,
}

impl fmt::Debug for S3Tier {
    /// Shows no secret: the endpoint's password is `***`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("S3Tier")
            .field("endpoint", &self.endpoint)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

/// Counts a request in flight for as long as it lives.
struct InFlight<'a>(&'a S3Tier);

impl<'a> InFlight<'a> {
    fn new(tier: &'a S3Tier) -> Self {
        let now = tier.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        tier.max_in_flight.fetch_max(now, Ordering::SeqCst);
        tier.requests.fetch_add(1, Ordering::Relaxed);
        Self(tier)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

type Result<T, E = S3TierError> = std::result::Result<T, E>;

/// The class of an SDK error's response, if it was an error response.
fn response_class<E: ProvideErrorMetadata>(
    err: &SdkError<E, HttpResponse>,
) -> Option<ResponseClass> {
    match err {
        SdkError::ServiceError(service) => Some(classify_response(
            service.raw().status().as_u16(),
            service.err().code().unwrap_or(""),
        )),
        _ => None,
    }
}

impl S3Tier {
    /// Builds the client (credentials from `config` or the AWS chain) and
    /// starts the runtime its requests run on (`io_threads` threads, shut
    /// down without blocking when the tier drops). Does not contact the
    /// server; the bucket is checked by the first request, or at once by
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
        let logs = Arc::new(SdkLogs::default());
        let sdk_logs = Arc::clone(&logs);
        let client = io
            .spawn(async move { sdk_logs.scope(client::build(&building)).await })
            .await
            .map_err(|e| runtime_failed(&config, &endpoint, "building the client", &e))??;
        Ok(Self {
            client,
            io,
            limit: Arc::new(Semaphore::new(config.max_concurrent_requests)),
            write_limit: Arc::new(Semaphore::new(config.max_concurrent_requests)),
            endpoint,
            config,
            bucket_seen: Mutex::new(None),
            bucket_check: tokio::sync::Mutex::new(()),
            logs,
            config_error_logged: AtomicBool::new(false),
            in_flight: AtomicUsize::new(0),
            max_in_flight: AtomicUsize::new(0),
            requests: AtomicUsize::new(0),
        })
    }

    /// The configuration.
    pub fn config(&self) -> &S3Config {
        &self.config
    }

    /// Request counters.
    pub fn stats(&self) -> S3Stats {
        S3Stats {
            in_flight: self.in_flight.load(Ordering::SeqCst),
            max_in_flight: self.max_in_flight.load(Ordering::SeqCst),
            requests: self.requests.load(Ordering::Relaxed),
        }
    }

    /// The object name of `key`: prefix plus lower-case hex.
    pub fn object_name(&self, key: &OffloadKey) -> String {
        format!("{}{}", self.config.prefix, key.to_hex())
    }

    fn error_context(&self) -> ErrorContext<'_> {
        ErrorContext {
            bucket: &self.config.bucket,
            endpoint: &self.endpoint,
        }
    }

    /// Runs one request on the I/O runtime; cancelled with the returned future.
    async fn send<T: Send + 'static>(
        &self,
        op: &'static str,
        request: impl Future<Output = T> + Send + 'static,
    ) -> Result<T> {
        let logs = Arc::clone(&self.logs);
        self.io
            .spawn(async move { logs.scope(request).await })
            .await
            .map_err(|e| runtime_failed(&self.config, &self.endpoint, op, &e))
    }

    /// Classifies an SDK error at the boundary ([`error::from_sdk`]), and
    /// forgets the bucket if the server says it is gone.
    fn classify<E>(&self, op: &'static str, err: &SdkError<E, HttpResponse>) -> S3TierError
    where
        E: ProvideErrorMetadata + std::error::Error + 'static,
    {
        if response_class(err) == Some(ResponseClass::NoSuchBucket) {
            self.bucket_gone();
        }
        let classified = error::from_sdk(&self.error_context(), op, err);
        self.log_if_configuration(&classified);
        classified
    }

    /// Logs the first configuration error (once per tier: the lookup
    /// manager backs off and retries, and would repeat it).
    fn log_if_configuration(&self, err: &S3TierError) {
        if matches!(err, S3TierError::Configuration { .. })
            && !self.config_error_logged.swap(true, Ordering::Relaxed)
        {
            tracing::error!(error = %err, "S3 tier misconfigured; lookups answer miss until it is fixed");
        }
    }

    fn bucket_seen(&self) -> std::sync::MutexGuard<'_, Option<Instant>> {
        self.bucket_seen
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Forgets that the bucket was seen: the next request checks it first.
    fn bucket_gone(&self) {
        *self.bucket_seen() = None;
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
        let _one = self.bucket_check.lock().await;
        self.head_bucket().await
    }

    /// Checks the bucket unless it was seen at or after `since` (`None`:
    /// seen at all), one check at a time.
    async fn ensure_bucket(&self, since: Option<Instant>) -> Result<()> {
        let fresh = |seen: Option<Instant>| seen.is_some_and(|at| since.is_none_or(|s| at >= s));
        if fresh(*self.bucket_seen()) {
            return Ok(());
        }
        let _one = self.bucket_check.lock().await;
        // Another lookup may have checked while this one waited.
        if fresh(*self.bucket_seen()) {
            return Ok(());
        }
        self.head_bucket().await
    }

    /// One HeadBucket (a HEAD on an object cannot tell a missing bucket
    /// from a missing key); remembers when the bucket was seen.
    async fn head_bucket(&self) -> Result<()> {
        const OP: &str = "HeadBucket";
        let _slot = self.slot(&self.limit, OP).await?;
        let asked = Instant::now();
        let request = self.client.head_bucket().bucket(&self.config.bucket);
        match self.send(OP, request.send()).await? {
            Ok(_) => {
                *self.bucket_seen() = Some(asked);
                Ok(())
            }
            // A HEAD has no body: its 404 has no code to tell.
            Err(e) if response_class(&e) == Some(ResponseClass::NotFound) => {
                self.bucket_gone();
                let err = self.error_context().response_error(
                    OP,
                    ResponseClass::NoSuchBucket,
                    404,
                    "NoSuchBucket",
                    "",
                );
                self.log_if_configuration(&err);
                Err(err)
            }
            Err(e) => Err(self.classify(OP, &e)),
        }
    }

    /// Checks the bucket before the tier's first request, and after it is
    /// found missing.
    async fn check_bucket(&self) -> Result<()> {
        self.ensure_bucket(None).await
    }

    /// A request slot: a permit from `limit` and a count in flight, both
    /// released when the slot is dropped: the count first (a tuple drops in
    /// order), so the next holder of the permit never finds it still
    /// counted and `max_in_flight` never reads one over the limit.
    async fn slot<'a>(
        &'a self,
        limit: &'a Semaphore,
        op: &'static str,
    ) -> Result<(InFlight<'a>, tokio::sync::SemaphorePermit<'a>)> {
        let permit = limit.acquire().await.map_err(|_| self.closed(op))?;
        Ok((InFlight::new(self), permit))
    }

    fn closed(&self, op: &'static str) -> S3TierError {
        S3TierError::Other {
            bucket: self.config.bucket.clone(),
            endpoint: self.endpoint.clone(),
            op,
            detail: "request limiter closed".to_owned(),
        }
    }

    async fn head(&self, key: &OffloadKey) -> Result<bool> {
        const OP: &str = "HeadObject";
        let _slot = self.slot(&self.limit, OP).await?;
        let request = self
            .client
            .head_object()
            .bucket(&self.config.bucket)
            .key(self.object_name(key));
        match self.send(OP, request.send()).await? {
            Ok(_) => Ok(true),
            Err(e) if response_class(&e) == Some(ResponseClass::NotFound) => Ok(false),
            Err(e) => Err(self.classify(OP, &e)),
        }
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
        self.check_bucket().await?;
        let started = Instant::now();
        // Collected first: a lazy `map` here makes the future not `Send`
        // (a higher-ranked closure lifetime the compiler cannot prove).
        let heads: Vec<_> = keys.iter().map(|k| self.head(k)).collect();
        // `buffered` keeps the order; the semaphore sets the real concurrency.
        let mut answers =
            futures_util::stream::iter(heads).buffered(self.config.max_concurrent_requests);
        let mut found = Vec::with_capacity(keys.len());
        while let Some(answer) = answers.next().await {
            found.push(answer?);
        }
        if found.contains(&false) {
            let recheck = Duration::from_millis(self.config.bucket_recheck_ms);
            self.ensure_bucket(started.checked_sub(recheck)).await?;
        }
        Ok(found)
    }

    /// Creates the bucket if it does not exist (CreateBucket), for set-up
    /// scripts and tests; the tier itself never creates buckets.
    ///
    /// # Errors
    /// A classified [`S3TierError`].
    pub async fn create_bucket_if_missing(&self) -> Result<()> {
        const OP: &str = "CreateBucket";
        let _slot = self.slot(&self.limit, OP).await?;
        let request = self.client.create_bucket().bucket(&self.config.bucket);
        match self.send(OP, request.send()).await? {
            Ok(_) => Ok(()),
            Err(SdkError::ServiceError(service))
                if matches!(
                    service.err().code(),
                    Some("BucketAlreadyOwnedByYou" | "BucketAlreadyExists")
                ) || service.raw().status().as_u16() == 409 =>
            {
                Ok(())
            }
            Err(e) => Err(self.classify(OP, &e)),
        }
    }

    /// PutObject.
    async fn put(&self, key: &OffloadKey, block: Vec<u8>) -> Result<()> {
        const OP: &str = "PutObject";
        self.check_bucket().await?;
        let _slot = self.slot(&self.write_limit, OP).await?;
        let request = self
            .client
            .put_object()
            .bucket(&self.config.bucket)
            .key(self.object_name(key))
            .body(ByteStream::from(block));
        match self.send(OP, request.send()).await? {
            Ok(_) => Ok(()),
            Err(e) => Err(self.classify(OP, &e)),
        }
    }

    /// GetObject, body included; `None` for a missing object.
    async fn get(&self, key: &OffloadKey) -> Result<Option<Vec<u8>>> {
        const OP: &str = "GetObject";
        self.check_bucket().await?;
        let _slot = self.slot(&self.limit, OP).await?;
        let request = self
            .client
            .get_object()
            .bucket(&self.config.bucket)
            .key(self.object_name(key));
        let fetched = self
            .send(OP, async move {
                match request.send().await {
                    Ok(object) => Ok(object.body.collect().await.map(|b| b.into_bytes().to_vec())),
                    Err(e) => Err(e),
                }
            })
            .await?;
        match fetched {
            Ok(Ok(bytes)) => Ok(Some(bytes)),
            Ok(Err(body)) => Err(S3TierError::Unavailable {
                bucket: self.config.bucket.clone(),
                endpoint: self.endpoint.clone(),
                op: "GetObject body",
                detail: body.to_string(),
            }),
            Err(e) if response_class(&e) == Some(ResponseClass::NotFound) => Ok(None),
            Err(e) => Err(self.classify(OP, &e)),
        }
    }

    /// DeleteObject; a missing object is not an error (some servers answer
    /// 404 where AWS answers 204).
    async fn delete(&self, key: &OffloadKey) -> Result<()> {
        const OP: &str = "DeleteObject";
        self.check_bucket().await?;
        let _slot = self.slot(&self.write_limit, OP).await?;
        let request = self
            .client
            .delete_object()
            .bucket(&self.config.bucket)
            .key(self.object_name(key));
        match self.send(OP, request.send()).await? {
            Ok(_) => Ok(()),
            Err(e) if response_class(&e) == Some(ResponseClass::NotFound) => Ok(()),
            Err(e) => Err(self.classify(OP, &e)),
        }
    }
}

/// The endpoint as errors and `Debug` show it: the password is `***`.
fn endpoint_shown(config: &S3Config) -> String {
    config
        .endpoint
        .as_deref()
        .map_or_else(|| "aws-s3".to_owned(), redact_endpoint)
}

/// A request that did not finish on the I/O runtime: the runtime (the
/// caller's, for [`S3Tier::with_spawner`]) shut down, or the request panicked.
fn runtime_failed(
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
        Ok(self.put(key, block.to_vec()).await?)
    }

    async fn load(&self, key: &OffloadKey) -> Result<Option<Vec<u8>>, TierError> {
        Ok(self.get(key).await?)
    }

    async fn remove(&self, key: &OffloadKey) -> Result<(), TierError> {
        Ok(self.delete(key).await?)
    }

    async fn store_many(&self, blocks: &[(OffloadKey, Vec<u8>)]) -> Result<(), TierError> {
        // Collected first, as in `exists_many`.
        let puts: Vec<_> = blocks
            .iter()
            .map(|(key, block)| self.put(key, block.clone()))
            .collect();
        let mut stored =
            futures_util::stream::iter(puts).buffer_unordered(self.config.max_concurrent_requests);
        while let Some(outcome) = stored.next().await {
            outcome?;
        }
        Ok(())
    }

    async fn load_many(&self, keys: &[OffloadKey]) -> Result<Vec<Option<Vec<u8>>>, TierError> {
        let gets: Vec<_> = keys.iter().map(|key| self.get(key)).collect();
        let mut loaded =
            futures_util::stream::iter(gets).buffered(self.config.max_concurrent_requests);
        let mut blocks = Vec::with_capacity(keys.len());
        while let Some(block) = loaded.next().await {
            blocks.push(block?);
        }
        Ok(blocks)
    }

    async fn remove_many(&self, keys: &[OffloadKey]) -> Result<(), TierError> {
        let deletes: Vec<_> = keys.iter().map(|key| self.delete(key)).collect();
        let mut removed = futures_util::stream::iter(deletes)
            .buffer_unordered(self.config.max_concurrent_requests);
        while let Some(outcome) = removed.next().await {
            outcome?;
        }
        Ok(())
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
