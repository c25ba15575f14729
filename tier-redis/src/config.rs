//! Redis tier configuration.

use std::fmt;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::RedisTierError;
use crate::names::KeyLayout;

/// Where and how a [`RedisTier`](crate::RedisTier) talks to Redis.
///
/// One `url` selects a single server; `cluster_urls` (seed nodes) select
/// Redis Cluster. URLs follow redis-rs: `redis://[user:password@]host:port/db`,
/// `rediss://` for TLS (the certificate is checked against the webpki roots,
/// or against `tls_ca_cert` for a private CA; `#insecure` is refused),
/// `redis+unix:///path/to/socket?db=0&user=u&pass=p` for a Unix socket.
/// `Debug`, errors and logs never show a password.
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
    /// Prefix of every Redis key; the block key's bytes follow it (after a
    /// hash tag with the tagged [`key_layout`](Self::key_layout)). Default
    /// `"kvtier:"`.
    pub key_prefix: String,
    /// How a block's key becomes its Redis name ([`KeyLayout`]): `"plain"`
    /// (prefix, then the key's bytes) or `"tagged"` (prefix, a hash tag of
    /// four characters from the key's CRC16, then its bytes). `None` (the default): tagged
    /// on a cluster, whose servers then hash four bytes per command into a
    /// slot instead of the whole name, unless the prefix holds a `{` (its
    /// own hash tag decides the slot); plain on a single server, which
    /// hashes no slot. Names are what a block is found by: tiers sharing
    /// stored blocks need the same prefix and layout, and a cluster's blocks
    /// stored as plain names (the only layout before this field) are found
    /// with `Some(KeyLayout::Plain)`.
    pub key_layout: Option<KeyLayout>,
    /// Time to live of every block the tier stores (through
    /// [`BlockStore`](kvtier_core::BlockStore) and
    /// [`store_nx`](crate::RedisTier::store_nx)), in milliseconds, sent as
    /// `SET ... PX`: after it the block is gone, and lookups answer miss.
    /// `None` (the default) keeps blocks until removed or evicted by the
    /// server's `maxmemory-policy`. `Some(0)` is invalid (Redis refuses
    /// `PX 0`).
    pub ttl_ms: Option<u64>,
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
    /// Send lookups' EXISTS pipelines pre-packed over one plain-TCP
    /// connection of the tier's own per server (shared by every lookup in
    /// flight; a pipeline's response timeout counts its wait behind the
    /// others), reading the integer replies directly, instead of through
    /// redis-rs (which builds and parses a value per command). Any
    /// error reply or connection trouble falls back to redis-rs, which
    /// decides the outcome; a reply that breaks the protocol is an error on
    /// both paths alike. TLS always uses redis-rs. Default true.
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
            key_layout: None,
            ttl_ms: None,
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

    /// The layout of the names: [`key_layout`](Self::key_layout), or its
    /// default for this topology and prefix.
    pub fn layout(&self) -> KeyLayout {
        self.key_layout
            .unwrap_or(if self.is_cluster() && !self.key_prefix.contains('{') {
                KeyLayout::Tagged
            } else {
                KeyLayout::Plain
            })
    }

    /// Whether this configures a Redis Cluster.
    pub fn is_cluster(&self) -> bool {
        !self.cluster_urls.is_empty()
    }

    /// Checks the fields, and that every URL is one redis-rs can use.
    ///
    /// # Errors
    /// [`RedisTierError::InvalidConfig`] naming the field; for a URL, the
    /// URL (credentials masked), what is wrong and the schemes accepted. A
    /// `rediss://…#insecure` URL is refused: trust a private CA with
    /// `tls_ca_cert` instead.
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
        if self.key_layout == Some(KeyLayout::Tagged) && self.key_prefix.contains('{') {
            return bad(
                "key_prefix",
                "must hold no '{' with key_layout = \"tagged\" (the prefix's own hash tag \
                 would decide every key's slot): remove it, or use key_layout = \"plain\"",
            );
        }
        if self.pipeline_chunk == 0 {
            return bad("pipeline_chunk", "must be at least 1");
        }
        if self.ttl_ms == Some(0) {
            return bad(
                "ttl_ms",
                "must be at least 1 (or unset, to keep blocks until removed)",
            );
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
        if self.is_cluster() {
            for url in &self.cluster_urls {
                check_url("cluster_urls", url)?;
            }
        } else {
            check_url("url", &self.url)?;
        }
        Ok(())
    }
}

/// The URL schemes redis-rs accepts, for error messages.
pub(crate) const ACCEPTED_SCHEMES: &str = "redis://, rediss:// (TLS), valkey://, valkeys:// (TLS), \
     redis+unix://, valkey+unix://, unix://";

/// Query parameters whose values are shown by [`redact`]; every other
/// value is masked (`user`, `pass` and any parameter redis-rs may read a
/// credential from).
const SHOWN_QUERY_PARAMS: [&str; 2] = ["db", "protocol"];

/// `url` as it may be shown in logs, errors and `Debug`:
/// [`kvtier_core::redact_url`], which masks every place a credential can
/// hide (redis-rs reads a password from the userinfo of `redis://`,
/// `rediss://`, `valkey://` and `valkeys://` URLs, and a user and password
/// from the query of the `unix` forms), with `db` and `protocol` shown.
pub(crate) fn redact(raw: &str) -> String {
    kvtier_core::redact_url(raw, &SHOWN_QUERY_PARAMS)
}

/// Checks that `raw` is a URL redis-rs can use, with an error that names
/// the URL (redacted), what is wrong, and the schemes accepted.
pub(crate) fn check_url(field: &'static str, raw: &str) -> Result<(), RedisTierError> {
    let bad = |what: String| {
        Err(RedisTierError::InvalidConfig {
            field,
            reason: format!(
                "{:?}: {what}; accepted URLs: {ACCEPTED_SCHEMES}",
                redact(raw)
            ),
        })
    };
    let url = match url::Url::parse(raw) {
        Ok(url) => url,
        Err(e) => return bad(format!("not a URL ({e})")),
    };
    let known = [
        "redis",
        "rediss",
        "valkey",
        "valkeys",
        "redis+unix",
        "valkey+unix",
        "unix",
    ];
    if !known.contains(&url.scheme()) {
        // Named only if the masked URL shows it: in `user:password` the
        // "scheme" is the user name.
        return bad(if redact(raw).starts_with(&format!("{}:", url.scheme())) {
            format!("scheme {:?} is not a Redis scheme", url.scheme())
        } else {
            "not a Redis URL".to_owned()
        });
    }
    let tls = matches!(url.scheme(), "rediss" | "valkeys");
    if tls && url.fragment() == Some("insecure") {
        return Err(RedisTierError::InvalidConfig {
            field,
            reason: format!(
                "{:?}: `#insecure` (TLS without certificate checks) is not supported; \
                 to trust a private CA, set tls_ca_cert to the PEM file of that CA",
                redact(raw)
            ),
        });
    }
    if let Err(e) = redis::IntoConnectionInfo::into_connection_info(raw) {
        return bad(match e.detail() {
            Some(detail) => format!("{} ({detail})", e_description(&e)),
            None => e_description(&e),
        });
    }
    Ok(())
}

/// The client's description of a URL error, without its kind's debug name.
fn e_description(e: &redis::RedisError) -> String {
    let shown = e.to_string();
    // "Redis URL did not parse- InvalidClientConfig" and the like.
    match shown.split_once("- ") {
        Some((what, _)) => what.trim().to_owned(),
        None => shown,
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
            .field("key_layout", &self.key_layout)
            .field("ttl_ms", &self.ttl_ms)
            .field("pipeline_chunk", &self.pipeline_chunk)
            .field("max_chunks_in_flight", &self.max_chunks_in_flight)
            .field("connect_timeout_ms", &self.connect_timeout_ms)
            .field("response_timeout_ms", &self.response_timeout_ms)
            .field("reconnect_retries", &self.reconnect_retries)
            .field("lean_pipelines", &self.lean_pipelines)
            .finish()
    }
}

/// Reads the PEM file of a private CA (`tls_ca_cert`) and checks that it
/// holds at least one certificate, so that a wrong file is refused when
/// the tier is built rather than failing every handshake as `UnknownIssuer`.
pub(crate) fn read_ca_pem(path: &Path) -> Result<Vec<u8>, RedisTierError> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject as _;
    let invalid = |reason: String| RedisTierError::InvalidConfig {
        field: "tls_ca_cert",
        reason: format!("{}: {reason}", path.display()),
    };
    let pem = std::fs::read(path).map_err(|e| invalid(e.to_string()))?;
    let mut certificates = 0;
    for cert in CertificateDer::pem_slice_iter(&pem) {
        cert.map_err(|e| invalid(format!("not a PEM certificate file: {e}")))?;
        certificates += 1;
    }
    if certificates == 0 {
        return Err(invalid(
            "holds no PEM certificate (-----BEGIN CERTIFICATE-----)".to_owned(),
        ));
    }
    Ok(pem)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_ca_file_without_a_certificate_is_refused() {
        let dir = std::env::temp_dir().join(format!("kvtier-redis-ca-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let garbage = dir.join("garbage.pem");
        std::fs::write(&garbage, "garbage\n").expect("write");
        let err = read_ca_pem(&garbage).expect_err("no certificate in it");
        assert!(
            err.to_string().contains("tls_ca_cert")
                && err.to_string().contains("no PEM certificate"),
            "{err}"
        );
        let missing = read_ca_pem(&dir.join("missing.pem")).expect_err("no such file");
        assert!(missing.to_string().contains("missing.pem"), "{missing}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    use super::*;

    #[test]
    fn the_layout_defaults_to_tagged_on_a_cluster_only() {
        let single = RedisConfig::default();
        assert_eq!(single.layout(), KeyLayout::Plain);
        let cluster = RedisConfig::cluster(["redis://127.0.0.1:1"]);
        assert_eq!(cluster.layout(), KeyLayout::Tagged);
        // A prefix with its own hash tag: that tag decides the slot.
        let own_tag = RedisConfig {
            key_prefix: "kvtier:{shard}:".into(),
            ..cluster.clone()
        };
        assert_eq!(own_tag.layout(), KeyLayout::Plain);
        own_tag
            .validate()
            .expect("the default layout takes any prefix");
        let asked = RedisConfig {
            key_layout: Some(KeyLayout::Tagged),
            ..own_tag
        };
        let err = asked.validate().expect_err("a tag after the prefix's own");
        assert!(
            matches!(
                err,
                RedisTierError::InvalidConfig {
                    field: "key_prefix",
                    ..
                }
            ) && err.to_string().contains("key_layout"),
            "{err}"
        );
        let plain = RedisConfig {
            key_layout: Some(KeyLayout::Plain),
            ..cluster
        };
        assert_eq!(plain.layout(), KeyLayout::Plain);
        // Written in a configuration file as a lowercase word.
        let parsed: RedisConfig =
            serde_json::from_str(r#"{"key_layout": "tagged"}"#).expect("parses");
        assert_eq!(parsed.key_layout, Some(KeyLayout::Tagged));
        assert!(serde_json::from_str::<RedisConfig>(r#"{"key_layout": "hashed"}"#).is_err());
    }

    #[test]
    fn passwords_never_show() {
        assert_eq!(redact("redis://u:secret@h:1/0"), "redis://***@h:1/0");
        assert_eq!(
            redact("redis+unix:///r.sock?db=3&pass=pw&protocol=resp3"),
            "redis+unix:///r.sock?db=3&pass=***&protocol=resp3"
        );
        let cfg = RedisConfig {
            password: Some("hunter2".into()),
            cluster_urls: vec!["redis://a:hunter3@x:1".into()],
            ..RedisConfig::from_url("redis://u:hunter1@h:1/")
        };
        let debug = format!("{cfg:?}");
        assert!(!debug.contains("hunter"), "{debug}");
    }
}
