//! Redis tier configuration.

use std::fmt;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::error::RedisTierError;

/// Where and how a [`RedisTier`](crate::RedisTier) talks to Redis.
///
/// One `url` selects a single server; `cluster_urls` (seed nodes) select
/// Redis Cluster. URLs follow redis-rs: `redis://[user:password@]host:port/db`,
/// `rediss://` for TLS (`rediss://host:port/#insecure` skips certificate
/// checks). `Debug` never shows a password.
///
/// ```toml
/// url = "redis://127.0.0.1:6379/0"
/// key_prefix = "kvtier:"
/// pipeline_chunk = 512
/// ```
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RedisConfig {
    /// URL of a single server. Default `redis://127.0.0.1:6379/`.
    pub url: String,
    /// Seed nodes of a Redis Cluster; when not empty, `url` is ignored.
    pub cluster_urls: Vec<String>,
    /// User name, overriding the URL's.
    pub username: Option<String>,
    /// Password, overriding the URL's.
    pub password: Option<String>,
    /// PEM file of the CA that signs the server's TLS certificate (for
    /// `rediss://` with a private CA). Default: the webpki roots.
    pub tls_ca_cert: Option<PathBuf>,
    /// Prefix of every Redis key; the block key's bytes follow it. Default `"kvtier:"`.
    pub key_prefix: String,
    /// EXISTS commands per pipeline. Default 512.
    pub pipeline_chunk: usize,
    /// Pipelines of one batch in flight at once. Default 8.
    pub max_chunks_in_flight: usize,
    /// Connect timeout, in milliseconds. Default 500.
    pub connect_timeout_ms: u64,
    /// Response timeout of one command or pipeline, in milliseconds. Default 1000.
    pub response_timeout_ms: u64,
    /// Reconnection attempts after a dropped connection before a command
    /// fails. Default 1 (fail fast; the lookup manager probes again later).
    pub reconnect_retries: usize,
    /// Send lookups' EXISTS pipelines pre-packed over plain-TCP connections
    /// of the tier's own, reading the integer replies directly, instead of
    /// through redis-rs (which builds and parses a value per command). Any
    /// error reply or connection trouble falls back to redis-rs, which
    /// decides the outcome. TLS always uses redis-rs. Default true.
    pub lean_pipelines: bool,
}

impl Default for RedisConfig {
    fn default() -> Self {
        Self {
            url: "redis://127.0.0.1:6379/".to_owned(),
            cluster_urls: Vec::new(),
            username: None,
            password: None,
            tls_ca_cert: None,
            key_prefix: "kvtier:".to_owned(),
            pipeline_chunk: 512,
            max_chunks_in_flight: 8,
            connect_timeout_ms: 500,
            response_timeout_ms: 1000,
            reconnect_retries: 1,
            lean_pipelines: true,
        }
    }
}

impl RedisConfig {
    /// A single-server configuration from a URL.
    pub fn from_url(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            ..Self::default()
        }
    }

    /// A Redis Cluster configuration from seed node URLs.
    pub fn cluster(urls: impl IntoIterator<Item = impl Into<String>>) -> Self {
        Self {
            cluster_urls: urls.into_iter().map(Into::into).collect(),
            ..Self::default()
        }
    }

    /// Whether this configures a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        !self.cluster_urls.is_empty()
    }

    /// Checks the fields.
    ///
    /// # Errors
    /// [`RedisTierError::InvalidConfig`] naming the field.
    pub fn validate(&self) -> Result<(), RedisTierError> {
        let bad = |field, reason: &str| {
            Err(RedisTierError::InvalidConfig {
                field,
                reason: reason.to_owned(),
            })
        };
        if !self.is_cluster() && self.url.is_empty() {
            return bad("url", "must name a server (or set cluster_urls)");
        }
        if self.pipeline_chunk == 0 {
            return bad("pipeline_chunk", "must be at least 1");
        }
        if self.max_chunks_in_flight == 0 {
            return bad("max_chunks_in_flight", "must be at least 1");
        }
        if self.connect_timeout_ms == 0 || self.response_timeout_ms == 0 {
            return bad(
                "connect_timeout_ms / response_timeout_ms",
                "must be at least 1",
            );
        }
        Ok(())
    }
}

/// `url` with any password replaced by `***`.
pub(crate) fn redact(url: &str) -> String {
    let Some(scheme_end) = url.find("://") else {
        return url.to_owned();
    };
    let rest = &url[scheme_end + 3..];
    let authority_end = rest.find('/').unwrap_or(rest.len());
    let authority = &rest[..authority_end];
    match authority.rfind('@') {
        Some(at) => {
            let userinfo = &authority[..at];
            let user = userinfo.split(':').next().unwrap_or("");
            let masked = if userinfo.contains(':') {
                format!("{user}:***")
            } else {
                "***".to_owned()
            };
            format!("{}{}@{}", &url[..scheme_end + 3], masked, &rest[at + 1..])
        }
        None => url.to_owned(),
    }
}

impl fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RedisConfig")
            .field("url", &redact(&self.url))
            .field(
                "cluster_urls",
                &self
                    .cluster_urls
                    .iter()
                    .map(|u| redact(u))
                    .collect::<Vec<_>>(),
            )
            .field("username", &self.username)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("tls_ca_cert", &self.tls_ca_cert)
            .field("key_prefix", &self.key_prefix)
            .field("pipeline_chunk", &self.pipeline_chunk)
            .field("max_chunks_in_flight", &self.max_chunks_in_flight)
            .field("connect_timeout_ms", &self.connect_timeout_ms)
            .field("response_timeout_ms", &self.response_timeout_ms)
            .field("reconnect_retries", &self.reconnect_retries)
            .field("lean_pipelines", &self.lean_pipelines)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_never_show() {
        assert_eq!(redact("redis://u:secret@h:1/0"), "redis://u:***@h:1/0");
        assert_eq!(redact("rediss://secret@h:1"), "rediss://***@h:1");
        assert_eq!(redact("redis://h:1/0"), "redis://h:1/0");
        let cfg = RedisConfig {
            password: Some("hunter2".into()),
            cluster_urls: vec!["redis://a:hunter3@x:1".into()],
            ..RedisConfig::from_url("redis://u:hunter1@h:1/")
        };
        let debug = format!("{cfg:?}");
        assert!(!debug.contains("hunter"), "{debug}");
    }
}
