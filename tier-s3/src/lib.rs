//! An S3 kvtier tier: bounded concurrent HEAD lookups and store / load /
//! remove over any S3-compatible store (AWS S3, MinIO, Ceph, Garage, s3s).
//!
//! - **Names.** A block's object name is `prefix` plus the lower-case hex of its
//!   key: URL-safe, with no surprises from encodings.
//! - **Lookups.** One HEAD per key. The tier caps the reads in flight with one
//!   limit (`max_concurrent_requests`) shared by every batch, not one per batch. A
//!   404 is a miss. Writes have a limit of their own, so bulk stores never delay
//!   lookups.
//! - **Errors.** 403, a missing bucket or rejected credentials are a typed
//!   configuration error, logged once and not retried in a loop (the lookup
//!   manager backs off). Throttling, 5xx and timeouts go through the SDK's
//!   standard retry (configured, not hand-written), then are a counted error.
//! - **Build.** The SDK is built without `sigv4a`; HTTPS (rustls) stays on.
//!
//! The client is made by [`S3Tier::new`], which reads credentials from the
//! configuration or from the standard AWS chain (environment, profile,
//! container, instance metadata).
//!
//! ```
//! use lookup_core::OffloadKey;
//! use tier_s3::{S3Config, S3Tier};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # // Runs against the S3 server of `scripts/services.sh` (credentials from
//! # // the AWS environment variables it writes); skipped loudly without it,
//! # // a failure when services are required (CI).
//! # let (Ok(endpoint), Ok(bucket)) =
//! #     (std::env::var("KVTIER_S3_ENDPOINT"), std::env::var("KVTIER_S3_BUCKET"))
//! # else {
//! #     assert!(std::env::var_os("KVTIER_REQUIRE_SERVICES").is_none(), "KVTIER_S3_ENDPOINT / KVTIER_S3_BUCKET not set");
//! #     eprintln!("SKIPPED tier-s3 doc example: KVTIER_S3_ENDPOINT / KVTIER_S3_BUCKET not set");
//! #     return Ok(());
//! # };
//! # tokio::runtime::Runtime::new()?.block_on(async {
//! // endpoint: e.g. "http://127.0.0.1:9000" for a local MinIO or s3s-fs
//! let tier = S3Tier::new(S3Config {
//!     endpoint: Some(endpoint),
//!     force_path_style: true,
//!     prefix: "doc-example/".into(),
//!     ..S3Config::new(bucket)
//! })
//! .await?;
//! let key = OffloadKey::from_block_hash(&[1; 32], 0);
//! tier.store(&key, b"kv bytes".to_vec()).await?;
//! assert_eq!(tier.exists_many(&[key.clone()]).await?, [true]);
//! # Ok::<_, Box<dyn std::error::Error>>(()) })
//! # }
//! ```

#![deny(missing_docs)]
#![warn(clippy::unwrap_used)]

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use aws_config::BehaviorVersion;
use aws_sdk_s3::config::retry::RetryConfig;
use aws_sdk_s3::config::timeout::TimeoutConfig;
use aws_sdk_s3::config::{Credentials, Region};
use aws_sdk_s3::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_s3::primitives::ByteStream;
use futures_util::StreamExt;
use lookup_core::{
    AsyncLookupManager, ManagerConfig, ManagerError, OffloadKey, ReqContext, Tier, TierError,
    TierErrorKind,
};
use serde::{Deserialize, Serialize};
use tokio::sync::{OnceCell, Semaphore};

/// Where and how an [`S3Tier`] stores blocks.
///
/// ```toml
/// bucket = "kv-cache"
/// prefix = "kvtier/"
/// region = "us-east-1"
/// endpoint = "http://127.0.0.1:9000"   # omit for AWS S3
/// force_path_style = true              # MinIO, Ceph, Garage, s3s
/// max_concurrent_requests = 64
/// ```
///
/// `Debug` never shows the secret key or session token.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct S3Config {
    /// The bucket. Required.
    pub bucket: String,
    /// Prefix of every object name. Default `"kvtier/"`.
    pub prefix: String,
    /// Region; default from the AWS chain, else `us-east-1`.
    pub region: Option<String>,
    /// Endpoint URL of an S3-compatible server; default AWS S3.
    pub endpoint: Option<String>,
    /// Path-style addressing (`endpoint/bucket/key`), for most non-AWS servers. Default false.
    pub force_path_style: bool,
    /// Access key id; with `secret_access_key`, overrides the AWS chain.
    pub access_key_id: Option<String>,
    /// Secret access key.
    pub secret_access_key: Option<String>,
    /// Session token of temporary credentials.
    pub session_token: Option<String>,
    /// Reads (HEAD, GET) in flight at once, across all batches of this tier;
    /// writes (PUT, DELETE) have a separate limit of the same size, so that
    /// bulk stores never delay lookups. Default 64.
    pub max_concurrent_requests: usize,
    /// Timeout of one attempt of one request, in milliseconds. Default 2000.
    pub request_timeout_ms: u64,
    /// Connect timeout, in milliseconds. Default 1000.
    pub connect_timeout_ms: u64,
    /// Attempts per request under the SDK's standard retry mode (1 = no retry). Default 3.
    pub max_attempts: u32,
}

impl Default for S3Config {
    fn default() -> Self {
        Self {
            bucket: String::new(),
            prefix: "kvtier/".to_owned(),
            region: None,
            endpoint: None,
            force_path_style: false,
            access_key_id: None,
            secret_access_key: None,
            session_token: None,
            max_concurrent_requests: 64,
            request_timeout_ms: 2000,
            connect_timeout_ms: 1000,
            max_attempts: 3,
        }
    }
}

impl S3Config {
    /// The defaults for `bucket`.
    pub fn new(bucket: impl Into<String>) -> Self {
        Self {
            bucket: bucket.into(),
            ..Self::default()
        }
    }

    /// Checks the fields.
    ///
    /// # Errors
    /// [`S3TierError::InvalidConfig`] naming the field.
    pub fn validate(&self) -> Result<(), S3TierError> {
        let bad = |field, reason: &str| {
            Err(S3TierError::InvalidConfig {
                field,
                reason: reason.to_owned(),
            })
        };
        if self.bucket.is_empty() {
            return bad("bucket", "must name a bucket");
        }
        if self.max_concurrent_requests == 0 {
            return bad("max_concurrent_requests", "must be at least 1");
        }
        if self.max_attempts == 0 {
            return bad("max_attempts", "must be at least 1");
        }
        if self.request_timeout_ms == 0 || self.connect_timeout_ms == 0 {
            return bad(
                "request_timeout_ms / connect_timeout_ms",
                "must be at least 1",
            );
        }
        if self.access_key_id.is_some() != self.secret_access_key.is_some() {
            return bad(
                "access_key_id / secret_access_key",
                "must be given together",
            );
        }
        Ok(())
    }
}

impl fmt::Debug for S3Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("S3Config")
            .field("bucket", &self.bucket)
            .field("prefix", &self.prefix)
            .field("region", &self.region)
            .field("endpoint", &self.endpoint)
            .field("force_path_style", &self.force_path_style)
            .field("access_key_id", &self.access_key_id)
            .field(
                "secret_access_key",
                &self.secret_access_key.as_ref().map(|_| "***"),
            )
            .field("session_token", &self.session_token.as_ref().map(|_| "***"))
            .field("max_concurrent_requests", &self.max_concurrent_requests)
            .field("request_timeout_ms", &self.request_timeout_ms)
            .field("connect_timeout_ms", &self.connect_timeout_ms)
            .field("max_attempts", &self.max_attempts)
            .finish()
    }
}

/// An error of the S3 tier; messages name the bucket and endpoint.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum S3TierError {
    /// A configuration field is missing or out of range.
    #[error("invalid S3 tier configuration: {field} {reason}")]
    InvalidConfig {
        /// The field.
        field: &'static str,
        /// What is wrong.
        reason: String,
    },
    /// Access denied, bad credentials or a missing bucket: retrying will not help.
    #[error("s3://{bucket} at {endpoint}: {reason} (during {op}; HTTP {status})")]
    Configuration {
        /// The bucket.
        bucket: String,
        /// The endpoint.
        endpoint: String,
        /// What was being done.
        op: &'static str,
        /// HTTP status.
        status: u16,
        /// What the server said.
        reason: String,
    },
    /// Throttled (503 SlowDown, 429) after the SDK's retries.
    #[error("s3://{bucket} at {endpoint}: throttled during {op}")]
    Throttled {
        /// The bucket.
        bucket: String,
        /// The endpoint.
        endpoint: String,
        /// What was being done.
        op: &'static str,
    },
    /// No answer in time (connect or request timeout) after the SDK's retries.
    #[error("s3://{bucket} at {endpoint}: timed out during {op}")]
    Timeout {
        /// The bucket.
        bucket: String,
        /// The endpoint.
        endpoint: String,
        /// What was being done.
        op: &'static str,
    },
    /// The server could not be reached, or failed (5xx) after the SDK's retries.
    #[error("s3://{bucket} at {endpoint}: unavailable during {op}: {detail}")]
    Unavailable {
        /// The bucket.
        bucket: String,
        /// The endpoint.
        endpoint: String,
        /// What was being done.
        op: &'static str,
        /// What happened.
        detail: String,
    },
    /// Any other failure.
    #[error("s3://{bucket} at {endpoint}: {op} failed: {detail}")]
    Other {
        /// The bucket.
        bucket: String,
        /// The endpoint.
        endpoint: String,
        /// What was being done.
        op: &'static str,
        /// What happened.
        detail: String,
    },
}

impl S3TierError {
    /// The lookup-core classification.
    pub fn tier_kind(&self) -> TierErrorKind {
        match self {
            Self::InvalidConfig { .. } | Self::Configuration { .. } => TierErrorKind::Config,
            Self::Throttled { .. } => TierErrorKind::Throttled,
            Self::Timeout { .. } => TierErrorKind::Timeout,
            Self::Unavailable { .. } => TierErrorKind::Unavailable,
            Self::Other { .. } => TierErrorKind::Other,
        }
    }
}

impl From<S3TierError> for TierError {
    fn from(err: S3TierError) -> Self {
        TierError::new(err.tier_kind(), err.to_string()).with_source(err)
    }
}

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
    config: S3Config,
    endpoint: String,
    limit: Arc<Semaphore>,
    /// Writes (PUT, DELETE) have a limit of their own, so that bulk stores
    /// never make lookups queue behind them.
    write_limit: Arc<Semaphore>,
    bucket_checked: OnceCell<()>,
    config_error_logged: AtomicBool,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    requests: AtomicUsize,
}

impl fmt::Debug for S3Tier {
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

impl S3Tier {
    /// Builds the client (credentials from `config` or the AWS chain).
    /// Does not contact the server; the bucket is checked by the first request.
    ///
    /// # Errors
    /// [`S3TierError::InvalidConfig`].
    pub async fn new(config: S3Config) -> Result<Self> {
        config.validate()?;
        let mut loader = aws_config::defaults(BehaviorVersion::latest());
        if let (Some(id), Some(secret)) = (&config.access_key_id, &config.secret_access_key) {
            loader = loader.credentials_provider(Credentials::new(
                id,
                secret,
                config.session_token.clone(),
                None,
                "kvtier-config",
            ));
        }
        if let Some(region) = &config.region {
            loader = loader.region(Region::new(region.clone()));
        }
        let shared = loader.load().await;
        let timeouts = TimeoutConfig::builder()
            .connect_timeout(Duration::from_millis(config.connect_timeout_ms))
            .operation_attempt_timeout(Duration::from_millis(config.request_timeout_ms))
            .operation_timeout(Duration::from_millis(
                config.request_timeout_ms * u64::from(config.max_attempts)
                    + config.connect_timeout_ms,
            ))
            .build();
        let mut builder = aws_sdk_s3::config::Builder::from(&shared)
            .force_path_style(config.force_path_style)
            .timeout_config(timeouts)
            .retry_config(RetryConfig::standard().with_max_attempts(config.max_attempts));
        if shared.region().is_none() {
            builder = builder.region(Region::new("us-east-1"));
        }
        if let Some(endpoint) = &config.endpoint {
            builder = builder.endpoint_url(endpoint);
        }
        let endpoint = config
            .endpoint
            .clone()
            .unwrap_or_else(|| "aws-s3".to_owned());
        Ok(Self {
            client: aws_sdk_s3::Client::from_conf(builder.build()),
            limit: Arc::new(Semaphore::new(config.max_concurrent_requests)),
            write_limit: Arc::new(Semaphore::new(config.max_concurrent_requests)),
            endpoint,
            config,
            bucket_checked: OnceCell::new(),
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

    /// Starts an [`AsyncLookupManager`] over this tier (named "s3" unless `config` names it).
    ///
    /// # Errors
    /// As [`AsyncLookupManager::new`].
    pub fn manager(
        self: &Arc<Self>,
        mut config: ManagerConfig,
    ) -> Result<AsyncLookupManager<Arc<Self>>, ManagerError> {
        config = config.or_named("s3");
        AsyncLookupManager::from_arc(Arc::new(Arc::clone(self)), config)
    }

    /// The object name of `key`: prefix plus lower-case hex.
    pub fn object_name(&self, key: &OffloadKey) -> String {
        format!("{}{}", self.config.prefix, key.to_hex())
    }

    /// Classifies an SDK error at the boundary.
    fn classify<E>(
        &self,
        op: &'static str,
        err: &SdkError<E, aws_sdk_s3::config::http::HttpResponse>,
    ) -> S3TierError
    where
        E: ProvideErrorMetadata + std::error::Error,
    {
        let bucket = self.config.bucket.clone();
        let endpoint = self.endpoint.clone();
        let classified = match err {
            SdkError::TimeoutError(_) => S3TierError::Timeout {
                bucket,
                endpoint,
                op,
            },
            SdkError::DispatchFailure(failure) if failure.is_timeout() => S3TierError::Timeout {
                bucket,
                endpoint,
                op,
            },
            SdkError::DispatchFailure(failure) => S3TierError::Unavailable {
                bucket,
                endpoint,
                op,
                detail: failure
                    .as_connector_error()
                    .map_or_else(|| "dispatch failure".to_owned(), |c| format!("{c}")),
            },
            SdkError::ServiceError(service) => {
                let status = service.raw().status().as_u16();
                let code = service.err().code().unwrap_or("");
                let message = service.err().message().unwrap_or("");
                match (status, code) {
                    (403, _)
                    | (
                        _,
                        "AccessDenied"
                        | "InvalidAccessKeyId"
                        | "SignatureDoesNotMatch"
                        | "NoSuchBucket",
                    )
                    | (301, _) => S3TierError::Configuration {
                        bucket,
                        endpoint,
                        op,
                        status,
                        reason: if code.is_empty() {
                            format!("HTTP {status}: access denied or wrong credentials")
                        } else {
                            format!("{code}: {message}")
                        },
                    },
                    (429 | 503, _) | (_, "SlowDown" | "Throttling" | "ThrottlingException") => {
                        S3TierError::Throttled {
                            bucket,
                            endpoint,
                            op,
                        }
                    }
                    (500..=599, _) => S3TierError::Unavailable {
                        bucket,
                        endpoint,
                        op,
                        detail: format!("HTTP {status} {code} {message}"),
                    },
                    _ => S3TierError::Other {
                        bucket,
                        endpoint,
                        op,
                        detail: format!("HTTP {status} {code} {message}"),
                    },
                }
            }
            SdkError::ResponseError(_) => S3TierError::Unavailable {
                bucket,
                endpoint,
                op,
                detail: "unreadable response".to_owned(),
            },
            other => S3TierError::Other {
                bucket,
                endpoint,
                op,
                detail: format!("{other}"),
            },
        };
        if matches!(classified, S3TierError::Configuration { .. })
            && !self.config_error_logged.swap(true, Ordering::Relaxed)
        {
            tracing::error!(error = %classified, "S3 tier misconfigured; lookups answer miss until it is fixed");
        }
        classified
    }

    /// Checks once that the bucket exists and the credentials work (a HEAD
    /// on an object cannot tell a missing bucket from a missing key).
    async fn check_bucket(&self) -> Result<()> {
        self.bucket_checked
            .get_or_try_init(|| async {
                let _slot = self.slot(&self.limit, "HeadBucket").await?;
                match self
                    .client
                    .head_bucket()
                    .bucket(&self.config.bucket)
                    .send()
                    .await
                {
                    Ok(_) => Ok(()),
                    Err(SdkError::ServiceError(service))
                        if service.raw().status().as_u16() == 404 =>
                    {
                        let err = S3TierError::Configuration {
                            bucket: self.config.bucket.clone(),
                            endpoint: self.endpoint.clone(),
                            op: "HeadBucket",
                            status: 404,
                            reason: "NoSuchBucket: the bucket does not exist".to_owned(),
                        };
                        if !self.config_error_logged.swap(true, Ordering::Relaxed) {
                            tracing::error!(error = %err, "S3 tier misconfigured");
                        }
                        Err(err)
                    }
                    Err(e) => Err(self.classify("HeadBucket", &e)),
                }
            })
            .await
            .map(|_| ())
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
        let _slot = self.slot(&self.limit, "HeadObject").await?;
        match self
            .client
            .head_object()
            .bucket(&self.config.bucket)
            .key(self.object_name(key))
            .send()
            .await
        {
            Ok(_) => Ok(true),
            Err(SdkError::ServiceError(service))
                if service.err().is_not_found() || service.raw().status().as_u16() == 404 =>
            {
                Ok(false)
            }
            Err(e) => Err(self.classify("HeadObject", &e)),
        }
    }

    /// Whether each key exists, in order: one HEAD per key, at most
    /// `max_concurrent_requests` in flight across every batch of the tier.
    ///
    /// # Errors
    /// The first classified [`S3TierError`]; remaining requests are dropped.
    pub async fn exists_many(&self, keys: &[OffloadKey]) -> Result<Vec<bool>> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        self.check_bucket().await?;
        let heads: Vec<_> = keys.iter().map(|k| self.head(k)).collect();
        // `buffered` keeps the order; the semaphore sets the real concurrency.
        let mut answers =
            futures_util::stream::iter(heads).buffered(self.config.max_concurrent_requests);
        let mut found = Vec::with_capacity(keys.len());
        while let Some(answer) = answers.next().await {
            found.push(answer?);
        }
        Ok(found)
    }

    /// Creates the bucket if it does not exist (CreateBucket), for set-up
    /// scripts and tests; the tier itself never creates buckets.
    ///
    /// # Errors
    /// A classified [`S3TierError`].
    pub async fn create_bucket_if_missing(&self) -> Result<()> {
        let _slot = self.slot(&self.limit, "CreateBucket").await?;
        match self
            .client
            .create_bucket()
            .bucket(&self.config.bucket)
            .send()
            .await
        {
            Ok(_) => Ok(()),
            Err(SdkError::ServiceError(service))
                if matches!(
                    service.err().code(),
                    Some("BucketAlreadyOwnedByYou" | "BucketAlreadyExists")
                ) || service.raw().status().as_u16() == 409 =>
            {
                Ok(())
            }
            Err(e) => Err(self.classify("CreateBucket", &e)),
        }
    }

    /// Stores `payload` under `key` (PutObject).
    ///
    /// # Errors
    /// A classified [`S3TierError`].
    pub async fn store(&self, key: &OffloadKey, payload: Vec<u8>) -> Result<()> {
        self.check_bucket().await?;
        let _slot = self.slot(&self.write_limit, "PutObject").await?;
        self.client
            .put_object()
            .bucket(&self.config.bucket)
            .key(self.object_name(key))
            .body(ByteStream::from(payload))
            .send()
            .await
            .map_err(|e| self.classify("PutObject", &e))?;
        Ok(())
    }

    /// Stores many blocks, `max_concurrent_requests` at a time.
    ///
    /// # Errors
    /// The first classified [`S3TierError`]; some blocks may be stored.
    pub async fn store_many(&self, blocks: Vec<(OffloadKey, Vec<u8>)>) -> Result<()> {
        let puts: Vec<_> = blocks
            .into_iter()
            .map(|(k, p)| async move { self.store(&k, p).await })
            .collect();
        let results: Vec<Result<()>> = futures_util::stream::iter(puts)
            .buffer_unordered(self.config.max_concurrent_requests)
            .collect()
            .await;
        results.into_iter().collect()
    }

    /// The payload of `key` (GetObject), or `None` if absent.
    ///
    /// # Errors
    /// A classified [`S3TierError`].
    pub async fn load(&self, key: &OffloadKey) -> Result<Option<Vec<u8>>> {
        self.check_bucket().await?;
        let _slot = self.slot(&self.limit, "GetObject").await?;
        let object = match self
            .client
            .get_object()
            .bucket(&self.config.bucket)
            .key(self.object_name(key))
            .send()
            .await
        {
            Ok(object) => object,
            Err(SdkError::ServiceError(service))
                if service.err().is_no_such_key() || service.raw().status().as_u16() == 404 =>
            {
                return Ok(None);
            }
            Err(e) => return Err(self.classify("GetObject", &e)),
        };
        let bytes = object
            .body
            .collect()
            .await
            .map_err(|e| S3TierError::Unavailable {
                bucket: self.config.bucket.clone(),
                endpoint: self.endpoint.clone(),
                op: "GetObject body",
                detail: e.to_string(),
            })?;
        Ok(Some(bytes.into_bytes().to_vec()))
    }

    /// Removes `key` (DeleteObject; removing an absent key is not an error).
    ///
    /// # Errors
    /// A classified [`S3TierError`].
    pub async fn remove(&self, key: &OffloadKey) -> Result<()> {
        self.check_bucket().await?;
        let _slot = self.slot(&self.write_limit, "DeleteObject").await?;
        self.client
            .delete_object()
            .bucket(&self.config.bucket)
            .key(self.object_name(key))
            .send()
            .await
            .map_err(|e| self.classify("DeleteObject", &e))?;
        Ok(())
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
