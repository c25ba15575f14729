//! [`S3Config`]: where and how an [`S3Tier`](crate::S3Tier) stores blocks,
//! and its validation (anything the SDK would panic on is refused here).

use std::fmt;

use kvtier_core::ManagerConfig;
use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;

use crate::S3TierError;

/// Where and how an [`S3Tier`](crate::S3Tier) stores blocks.
///
/// ```toml
/// bucket = "kv-cache"
/// prefix = "kvtier/"
/// region = "us-east-1"
/// endpoint = "http://127.0.0.1:9000"   # omit for AWS S3
/// force_path_style = true              # MinIO, Ceph, Garage, s3s
/// max_concurrent_requests = 64
/// io_threads = 1
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
    /// Endpoint URL of an S3-compatible server; default AWS S3. An http or
    /// https URL with a host, without credentials (`user:password@` is
    /// refused: they go in `access_key_id` / `secret_access_key`), query or
    /// fragment.
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
    /// Worker threads of the runtime that [`S3Tier::new`](crate::S3Tier::new)
    /// starts for the tier's requests (ignored by
    /// [`S3Tier::with_spawner`](crate::S3Tier::with_spawner)). Default 1: a
    /// call's requests and their connections then run on one thread, with
    /// no hand-over between threads per request; more threads help only
    /// when signing and parsing outrun one core.
    pub io_threads: usize,
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
            io_threads: 1,
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
        if !(1..=MAX_IO_THREADS).contains(&self.io_threads) {
            return Err(S3TierError::InvalidConfig {
                field: "io_threads",
                reason: format!("must be from 1 to {MAX_IO_THREADS}"),
            });
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
    pub(crate) fn operation_timeout_ms(&self) -> Option<u64> {
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
            .field("io_threads", &self.io_threads)
            .finish()
    }
}

/// Most threads an S3 tier's own runtime may start.
const MAX_IO_THREADS: usize = 256;

/// Longest duration a `*_ms` field may add up to (the lookup manager's limit).
pub(crate) const MAX_DURATION_MS: u64 = ManagerConfig::MAX_DURATION_MS;

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
    // The SDK would log them (hyper's connection pool at DEBUG names each
    // connection by its authority) and never use them.
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return Err(
            "must not hold credentials (user:password@): requests are signed with \
             access_key_id / secret_access_key (and session_token), or with credentials \
             from the AWS chain"
                .to_owned(),
        );
    }
    endpoint
        .parse::<http::Uri>()
        .map_err(|e| format!("not a valid URI: {e}"))?;
    Ok(())
}

/// `endpoint` as `Debug`, logs and errors show it:
/// [`kvtier_core::redact_url`], which masks its userinfo, query and
/// fragment, even in an endpoint that does not parse.
pub(crate) fn redact_endpoint(endpoint: &str) -> String {
    kvtier_core::redact_url(endpoint, &[])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_checked_like_the_sdk_does() {
        for good in [
            "http://127.0.0.1:9000",
            "https://s3.example.com",
            "http://[::1]:9000/",
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
            "http://u:p@minio:9000",
            "http://user@minio:9000",
            "https://:p@s3.example.com",
        ] {
            assert!(check_endpoint(bad).is_err(), "{bad}");
        }
    }
}
