//! An S3 kvtier tier: bounded concurrent HEAD lookups and store / load /
//! remove over any S3-compatible store (AWS S3, MinIO, Ceph, Garage, s3s).
//!
//! - **Names.** A block's object name is `prefix` plus the lower-case hex of its
//!   key: URL-safe, with no surprises from encodings.
//! - **Lookups.** One HEAD per key. The tier caps the reads in flight with one
//!   limit (`max_concurrent_requests`) shared by every batch, not one per batch. A
//!   404 is a miss. Writes have a limit of their own, so bulk stores never delay
//!   lookups.
//! - **Errors.** 403, a missing bucket, rejected credentials or none found
//!   are a typed configuration error, logged once and not retried in a loop
//!   (the lookup manager backs off). A HEAD cannot tell a missing key from a
//!   missing bucket, so a lookup with misses checks the bucket again (at most
//!   every `bucket_recheck_ms`): a bucket deleted while the tier runs is an
//!   error, not a silent miss. Throttling, 5xx and timeouts go through the
//!   SDK's standard retry (configured, not hand-written), then are a counted
//!   error; a refused connection is not retried and says "connection refused".
//! - **Configuration** is checked by [`S3Tier::new`]: anything the SDK would
//!   panic on (a control character in the region or a credential, timeouts
//!   that overflow) and an endpoint that is not an http(s) URL are
//!   [`S3TierError::InvalidConfig`]. [`S3Tier::check`] contacts the server
//!   at start-up, to fail fast. No `Debug` output or error shows a secret,
//!   including the password of an endpoint URL.
//! - **Build.** The SDK is built without `sigv4a`; HTTPS (rustls) stays on.
//!
//! The client is made by [`S3Tier::new`], which reads credentials from the
//! configuration or from the standard AWS chain (environment, profile,
//! container, instance metadata).
//!
//! ```
//! use kvtier_core::OffloadKey;
//! use kvtier_s3::{S3Config, S3Tier};
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

use std::error::Error as StdError;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use aws_config::BehaviorVersion;
use aws_credential_types::provider::error::CredentialsError;
use aws_credential_types::provider::{ProvideCredentials, SharedCredentialsProvider, future};
use aws_sdk_s3::config::interceptors::InterceptorContext;
use aws_sdk_s3::config::retry::{ClassifyRetry, RetryAction, RetryConfig};
use aws_sdk_s3::config::timeout::TimeoutConfig;
use aws_sdk_s3::config::{Credentials, Region};
use aws_sdk_s3::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_s3::primitives::ByteStream;
use futures_util::StreamExt;
use kvtier_core::{
    BlockStore, ManagerConfig, OffloadKey, ReqContext, Tier, TierError, TierErrorKind, one_line,
};
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;

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
    /// Attempts per request under the SDK's standard retry mode (1 = no
    /// retry). Default 3. A refused connection is never retried: nothing
    /// listens there, and the lookup manager backs off by itself.
    pub max_attempts: u32,
    /// Whether credentials missing from this configuration are looked for in
    /// the standard AWS chain (environment, profile files, web identity,
    /// container and instance metadata). Default true; false uses only
    /// `access_key_id` / `secret_access_key`, and without them every request
    /// fails with a "no credentials" configuration error.
    pub credentials_from_aws_chain: bool,
    /// A HEAD cannot tell a missing key from a missing bucket, so a lookup
    /// that finds a key missing checks the bucket again (HeadBucket) unless
    /// it was seen within this many milliseconds: a bucket deleted while the
    /// tier runs turns lookups into configuration errors, not silent misses.
    /// 0 checks after every batch with a miss. Default 1000.
    pub bucket_recheck_ms: u64,
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
            credentials_from_aws_chain: true,
            bucket_recheck_ms: 1000,
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
        // These go into request headers (the bucket also into the URL); the
        // SDK's signer panics on a header value with a control character.
        for (field, value) in [
            ("bucket", Some(&self.bucket)),
            ("region", self.region.as_ref()),
            ("access_key_id", self.access_key_id.as_ref()),
            ("session_token", self.session_token.as_ref()),
        ] {
            if value.is_some_and(|v| v.chars().any(char::is_control)) {
                return bad(
                    field,
                    "must not contain a control character (newline, NUL, ...)",
                );
            }
        }
        if self.region.as_ref().is_some_and(String::is_empty) {
            return bad("region", "must not be empty when given");
        }
        if let Some(endpoint) = &self.endpoint
            && let Err(why) = check_endpoint(endpoint)
        {
            return Err(S3TierError::InvalidConfig {
                field: "endpoint",
                reason: format!(
                    "is a bad endpoint: {}: {why} (accepted: an http:// or https:// URL with a host, e.g. http://127.0.0.1:9000)",
                    redact_endpoint(endpoint)
                ),
            });
        }
        // Requests wait on tokio semaphores of this many permits.
        if self.max_concurrent_requests > Semaphore::MAX_PERMITS {
            return Err(S3TierError::InvalidConfig {
                field: "max_concurrent_requests",
                reason: format!("must be at most {}", Semaphore::MAX_PERMITS),
            });
        }
        if self.operation_timeout_ms().is_none() {
            return Err(S3TierError::InvalidConfig {
                field: "request_timeout_ms",
                reason: format!(
                    "times max_attempts, plus connect_timeout_ms, must be at most {MAX_DURATION_MS} ms (100 years)"
                ),
            });
        }
        if self.bucket_recheck_ms > MAX_DURATION_MS {
            return Err(S3TierError::InvalidConfig {
                field: "bucket_recheck_ms",
                reason: format!("must be at most {MAX_DURATION_MS} ms (100 years)"),
            });
        }
        Ok(())
    }

    /// The deadline of a whole request, retries included:
    /// `request_timeout_ms × max_attempts + connect_timeout_ms`, if it is
    /// at most [`MAX_DURATION_MS`].
    fn operation_timeout_ms(&self) -> Option<u64> {
        self.request_timeout_ms
            .checked_mul(u64::from(self.max_attempts))?
            .checked_add(self.connect_timeout_ms)
            .filter(|&ms| ms <= MAX_DURATION_MS)
    }
}

impl fmt::Debug for S3Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("S3Config")
            .field("bucket", &self.bucket)
            .field("prefix", &self.prefix)
            .field("region", &self.region)
            .field("endpoint", &self.endpoint.as_deref().map(redact_endpoint))
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
            .field(
                "credentials_from_aws_chain",
                &self.credentials_from_aws_chain,
            )
            .field("bucket_recheck_ms", &self.bucket_recheck_ms)
            .finish()
    }
}

/// Longest duration a `*_ms` field may add up to (the lookup manager's limit).
const MAX_DURATION_MS: u64 = ManagerConfig::MAX_DURATION_MS;

/// Whether `endpoint` is a URL the SDK can use: the two parsers it uses
/// accept it, the scheme is http or https, it names a host and has no query.
fn check_endpoint(endpoint: &str) -> Result<(), String> {
    let parsed = url::Url::parse(endpoint).map_err(|e| e.to_string())?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err(format!(
            "the scheme must be http or https, not {}",
            parsed.scheme()
        ));
    }
    if parsed.host_str().is_none_or(str::is_empty) {
        return Err("no host".to_owned());
    }
    if parsed.query().is_some() || parsed.fragment().is_some() {
        return Err("must not have a query or fragment".to_owned());
    }
    endpoint
        .parse::<http::Uri>()
        .map_err(|e| format!("not a valid URI: {e}"))?;
    Ok(())
}

/// The password in an endpoint's userinfo (`scheme://user:password@host`),
/// if any: the part between the first `:` and the last `@` of what follows
/// the scheme. Generous on purpose: it also finds it in endpoints that do
/// not parse.
fn endpoint_password(endpoint: &str) -> Option<(usize, usize)> {
    let start = endpoint.find("://").map_or(0, |i| i + 3);
    let at = start + endpoint[start..].rfind('@')?;
    let colon = start + endpoint[start..at].find(':')?;
    (colon + 1 < at).then_some((colon + 1, at))
}

/// `endpoint` with the password of its userinfo replaced by `***`, for
/// `Debug`, logs and errors.
fn redact_endpoint(endpoint: &str) -> String {
    match endpoint_password(endpoint) {
        Some((from, to)) => format!("{}***{}", &endpoint[..from], &endpoint[to..]),
        None => endpoint.to_owned(),
    }
}

/// ", HTTP {status}" for an error that had an HTTP exchange.
fn http_status(status: u16) -> String {
    if status == 0 {
        String::new()
    } else {
        format!("; HTTP {status}")
    }
}

/// Where the AWS chain looks for credentials, for the "no credentials" error.
const CREDENTIAL_SOURCES: &str = "the configuration (access_key_id / secret_access_key), \
     env AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, the profile files ~/.aws/credentials and \
     ~/.aws/config (AWS_PROFILE), web identity (AWS_WEB_IDENTITY_TOKEN_FILE), the ECS container \
     endpoint and EC2 instance metadata";

/// The credentials provider when the configuration has none and
/// `credentials_from_aws_chain` is off.
#[derive(Debug)]
struct NoCredentials;

impl ProvideCredentials for NoCredentials {
    fn provide_credentials<'a>(&'a self) -> future::ProvideCredentials<'a>
    where
        Self: 'a,
    {
        future::ProvideCredentials::ready(Err(CredentialsError::not_loaded(
            "none in the configuration, and credentials_from_aws_chain is false",
        )))
    }
}

/// The AWS chain's credentials, refused if the SDK's signer would panic on
/// them (a control character in a value that goes into a header).
#[derive(Debug)]
struct CheckedCredentials(SharedCredentialsProvider);

impl ProvideCredentials for CheckedCredentials {
    fn provide_credentials<'a>(&'a self) -> future::ProvideCredentials<'a>
    where
        Self: 'a,
    {
        future::ProvideCredentials::new(async move {
            let credentials = self.0.provide_credentials().await?;
            let bad = |v: &str| v.chars().any(char::is_control);
            if bad(credentials.access_key_id()) || credentials.session_token().is_some_and(bad) {
                return Err(CredentialsError::invalid_configuration(
                    "the AWS chain gave an access key id or session token with a control character",
                ));
            }
            Ok(credentials)
        })
    }
}

/// Every error in `err`'s source chain, `err` first.
fn error_chain<'a>(
    err: &'a (dyn StdError + 'static),
) -> impl Iterator<Item = &'a (dyn StdError + 'static)> {
    std::iter::successors(Some(err), |&e| e.source())
}

/// Whether the chain holds a refused TCP connection.
fn is_connection_refused(err: &(dyn StdError + 'static)) -> bool {
    error_chain(err).any(|e| {
        e.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionRefused)
    })
}

/// Forbids the SDK's retries of a refused connection: nothing listens at
/// the endpoint, and waiting out backoffs would turn a clear "connection
/// refused" into a timeout (the lookup manager backs off by itself).
#[derive(Debug)]
struct NoRetryWhenRefused;

impl ClassifyRetry for NoRetryWhenRefused {
    fn classify_retry(&self, ctx: &InterceptorContext) -> RetryAction {
        match ctx.output_or_error() {
            Some(Err(err))
                if err
                    .as_connector_error()
                    .is_some_and(|c| is_connection_refused(c)) =>
            {
                RetryAction::RetryForbidden
            }
            _ => RetryAction::NoActionIndicated,
        }
    }

    fn name(&self) -> &'static str {
        "kvtier: no retry when refused"
    }
}

/// An error of the S3 tier; messages name the bucket and endpoint.
#[derive(Debug, Clone, thiserror::Error)]
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
    /// Access denied, bad or no credentials, or a missing bucket: retrying
    /// will not help.
    #[error("s3://{bucket} at {endpoint}: {reason} (during {op}{})", http_status(*.status))]
    Configuration {
        /// The bucket.
        bucket: String,
        /// The endpoint.
        endpoint: String,
        /// What was being done.
        op: &'static str,
        /// HTTP status; 0 when there was no HTTP exchange (no credentials found).
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
    /// When the bucket was last seen to exist: `None` before the first
    /// check passes and after one finds the bucket missing.
    bucket_seen: Mutex<Option<Instant>>,
    /// One bucket check at a time; concurrent lookups wait for its answer.
    bucket_check: tokio::sync::Mutex<()>,
    /// The password of the endpoint URL, scrubbed from SDK error texts.
    endpoint_secret: Option<String>,
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

impl S3Tier {
    /// Builds the client (credentials from `config` or the AWS chain).
    /// Does not contact the server; the bucket is checked by the first
    /// request, or at once by [`check`](Self::check).
    ///
    /// # Errors
    /// [`S3TierError::InvalidConfig`] for a field out of range, an endpoint
    /// that is not an http(s) URL, or a region (from `config` or the AWS
    /// chain) or credential with a control character.
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
        } else if !config.credentials_from_aws_chain {
            loader = loader.credentials_provider(NoCredentials);
        }
        if let Some(region) = &config.region {
            loader = loader.region(Region::new(region.clone()));
        }
        let shared = loader.load().await;
        if let Some(region) = shared.region()
            && region.as_ref().chars().any(char::is_control)
        {
            return Err(S3TierError::InvalidConfig {
                field: "region",
                reason: "from the AWS chain (AWS_REGION or the profile) has a control character"
                    .to_owned(),
            });
        }
        let operation_timeout = config.operation_timeout_ms().unwrap_or(MAX_DURATION_MS);
        let timeouts = TimeoutConfig::builder()
            .connect_timeout(Duration::from_millis(config.connect_timeout_ms))
            .operation_attempt_timeout(Duration::from_millis(config.request_timeout_ms))
            .operation_timeout(Duration::from_millis(operation_timeout))
            .build();
        let mut builder = aws_sdk_s3::config::Builder::from(&shared)
            .force_path_style(config.force_path_style)
            .timeout_config(timeouts)
            .retry_config(RetryConfig::standard().with_max_attempts(config.max_attempts))
            .retry_classifier(NoRetryWhenRefused);
        if let Some(chain) = shared.credentials_provider()
            && config.access_key_id.is_none()
            && config.credentials_from_aws_chain
        {
            builder = builder.credentials_provider(CheckedCredentials(chain));
        }
        if shared.region().is_none() {
            builder = builder.region(Region::new("us-east-1"));
        }
        if let Some(endpoint) = &config.endpoint {
            builder = builder.endpoint_url(endpoint);
        }
        let endpoint = config
            .endpoint
            .as_deref()
            .map_or_else(|| "aws-s3".to_owned(), redact_endpoint);
        let endpoint_secret = config
            .endpoint
            .as_deref()
            .and_then(|e| endpoint_password(e).map(|(from, to)| e[from..to].to_owned()));
        Ok(Self {
            client: aws_sdk_s3::Client::from_conf(builder.build()),
            limit: Arc::new(Semaphore::new(config.max_concurrent_requests)),
            write_limit: Arc::new(Semaphore::new(config.max_concurrent_requests)),
            endpoint,
            config,
            bucket_seen: Mutex::new(None),
            bucket_check: tokio::sync::Mutex::new(()),
            endpoint_secret,
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

    /// `text` with the endpoint's password, if any, replaced by `***`.
    fn scrub(&self, text: String) -> String {
        match &self.endpoint_secret {
            Some(secret) if text.contains(secret.as_str()) => text.replace(secret.as_str(), "***"),
            _ => text,
        }
    }

    /// Classifies an SDK error at the boundary.
    fn classify<E>(
        &self,
        op: &'static str,
        err: &SdkError<E, aws_sdk_s3::config::http::HttpResponse>,
    ) -> S3TierError
    where
        E: ProvideErrorMetadata + StdError + 'static,
    {
        let bucket = self.config.bucket.clone();
        let endpoint = self.endpoint.clone();
        let whole: &(dyn StdError + 'static) = err;
        let credentials = error_chain(whole).find_map(|e| e.downcast_ref::<CredentialsError>());
        let classified = match (err, credentials) {
            (_, Some(CredentialsError::CredentialsNotLoaded(_))) => S3TierError::Configuration {
                bucket,
                endpoint,
                op,
                status: 0,
                reason: format!(
                    "no credentials found; looked in {CREDENTIAL_SOURCES} ({})",
                    self.scrub(one_line(whole))
                ),
            },
            (_, Some(CredentialsError::InvalidConfiguration(_))) => S3TierError::Configuration {
                bucket,
                endpoint,
                op,
                status: 0,
                reason: format!("bad credentials: {}", self.scrub(one_line(whole))),
            },
            (_, Some(CredentialsError::ProviderTimedOut(_))) => S3TierError::Timeout {
                bucket,
                endpoint,
                op,
            },
            (_, Some(_)) => S3TierError::Unavailable {
                bucket,
                endpoint,
                op,
                detail: format!(
                    "the credentials provider failed: {}",
                    self.scrub(one_line(whole))
                ),
            },
            (SdkError::TimeoutError(_), None) => S3TierError::Timeout {
                bucket,
                endpoint,
                op,
            },
            (SdkError::DispatchFailure(_), None) if is_connection_refused(whole) => {
                S3TierError::Unavailable {
                    bucket,
                    endpoint,
                    op,
                    detail: "connection refused".to_owned(),
                }
            }
            (SdkError::DispatchFailure(failure), None) if failure.is_timeout() => {
                S3TierError::Timeout {
                    bucket,
                    endpoint,
                    op,
                }
            }
            (SdkError::DispatchFailure(_), None) => S3TierError::Unavailable {
                bucket,
                endpoint,
                op,
                detail: self.scrub(one_line(whole)),
            },
            (SdkError::ServiceError(service), None) => {
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
                    | (301, _) => {
                        if code == "NoSuchBucket" {
                            self.bucket_gone();
                        }
                        S3TierError::Configuration {
                            bucket,
                            endpoint,
                            op,
                            status,
                            reason: if code.is_empty() {
                                format!("HTTP {status}: access denied or wrong credentials")
                            } else {
                                format!("{code}: {message}")
                            },
                        }
                    }
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
            (SdkError::ResponseError(_), None) => S3TierError::Unavailable {
                bucket,
                endpoint,
                op,
                detail: format!("unreadable response: {}", self.scrub(one_line(whole))),
            },
            (_, None) => S3TierError::Other {
                bucket,
                endpoint,
                op,
                detail: self.scrub(one_line(whole)),
            },
        };
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
        let _slot = self.slot(&self.limit, "HeadBucket").await?;
        let asked = Instant::now();
        match self
            .client
            .head_bucket()
            .bucket(&self.config.bucket)
            .send()
            .await
        {
            Ok(_) => {
                *self.bucket_seen() = Some(asked);
                Ok(())
            }
            Err(SdkError::ServiceError(service)) if service.raw().status().as_u16() == 404 => {
                self.bucket_gone();
                let err = S3TierError::Configuration {
                    bucket: self.config.bucket.clone(),
                    endpoint: self.endpoint.clone(),
                    op: "HeadBucket",
                    status: 404,
                    reason: "NoSuchBucket: the bucket does not exist".to_owned(),
                };
                self.log_if_configuration(&err);
                Err(err)
            }
            Err(e) => Err(self.classify("HeadBucket", &e)),
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
                if (service.err().is_not_found() || service.raw().status().as_u16() == 404)
                    && service.err().code() != Some("NoSuchBucket") =>
            {
                Ok(false)
            }
            Err(e) => Err(self.classify("HeadObject", &e)),
        }
    }

    /// Whether each key exists, in order: one HEAD per key, at most
    /// `max_concurrent_requests` in flight across every batch of the tier.
    /// A miss is answered only if the bucket was seen within
    /// `bucket_recheck_ms` before the HEADs (else it is checked again).
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
                if (service.err().is_no_such_key() || service.raw().status().as_u16() == 404)
                    && service.err().code() != Some("NoSuchBucket") =>
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

/// Blocks are objects named by [`S3Tier::object_name`]: stored with
/// PutObject, loaded with GetObject, removed with DeleteObject; the batched
/// forms run up to `max_concurrent_requests` requests at once.
impl BlockStore for S3Tier {
    async fn store(&self, key: &OffloadKey, block: &[u8]) -> Result<(), TierError> {
        Ok(S3Tier::store(self, key, block.to_vec()).await?)
    }

    async fn load(&self, key: &OffloadKey) -> Result<Option<Vec<u8>>, TierError> {
        Ok(S3Tier::load(self, key).await?)
    }

    async fn remove(&self, key: &OffloadKey) -> Result<(), TierError> {
        Ok(S3Tier::remove(self, key).await?)
    }

    async fn store_many(&self, blocks: &[(OffloadKey, Vec<u8>)]) -> Result<(), TierError> {
        Ok(S3Tier::store_many(self, blocks.to_vec()).await?)
    }

    async fn load_many(&self, keys: &[OffloadKey]) -> Result<Vec<Option<Vec<u8>>>, TierError> {
        let loads: Vec<_> = keys
            .iter()
            .map(|key| async move { S3Tier::load(self, key).await })
            .collect();
        let loaded: Vec<Result<Option<Vec<u8>>>> = futures_util::stream::iter(loads)
            .buffered(self.config.max_concurrent_requests)
            .collect()
            .await;
        Ok(loaded.into_iter().collect::<Result<Vec<_>>>()?)
    }

    async fn remove_many(&self, keys: &[OffloadKey]) -> Result<(), TierError> {
        let removes: Vec<_> = keys
            .iter()
            .map(|key| async move { S3Tier::remove(self, key).await })
            .collect();
        let removed: Vec<Result<()>> = futures_util::stream::iter(removes)
            .buffer_unordered(self.config.max_concurrent_requests)
            .collect()
            .await;
        Ok(removed.into_iter().collect::<Result<()>>()?)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_passwords_are_redacted_even_in_endpoints_that_do_not_parse() {
        for (raw, shown) in [
            ("http://127.0.0.1:9000", "http://127.0.0.1:9000"),
            ("http://user@host:9000/", "http://user@host:9000/"),
            ("http://user:pw@host:9000/", "http://user:***@host:9000/"),
            ("https://u:p@ss:w/rd@host", "https://u:***@host"),
            ("ftp://u:secret@", "ftp://u:***@"),
            ("u:secret@host", "u:***@host"),
        ] {
            assert_eq!(redact_endpoint(raw), shown, "{raw}");
        }
    }

    #[test]
    fn endpoints_are_checked_like_the_sdk_does() {
        for good in [
            "http://127.0.0.1:9000",
            "https://s3.example.com",
            "http://[::1]:9000/",
            "http://u:p@minio:9000",
        ] {
            assert_eq!(check_endpoint(good), Ok(()), "{good}");
        }
        for bad in [
            "",
            "minio:9000",
            "s3.example.com",
            "file:///tmp/x",
            "http://",
            "http://a b",
            "http://h/#frag",
        ] {
            assert!(check_endpoint(bad).is_err(), "{bad}");
        }
    }

    #[tokio::test]
    async fn chain_credentials_with_a_control_character_are_refused_before_signing() {
        for (id, token) in [("AK\nID", None), ("AKID", Some("to\0ken".to_owned()))] {
            let chain = SharedCredentialsProvider::new(Credentials::new(id, "s", token, None, "t"));
            let err = CheckedCredentials(chain)
                .provide_credentials()
                .await
                .unwrap_err();
            assert!(
                matches!(err, CredentialsError::InvalidConfiguration(_)),
                "{err:?}"
            );
        }
        let chain = SharedCredentialsProvider::new(Credentials::new("AKID", "s", None, None, "t"));
        assert!(
            CheckedCredentials(chain)
                .provide_credentials()
                .await
                .is_ok()
        );
    }
}
