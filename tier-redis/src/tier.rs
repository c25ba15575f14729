//! [`RedisTier`]: its state, and its constructors, which build the client
//! of a single server or of a Redis Cluster from a [`RedisConfig`].

use std::sync::Arc;
use std::time::Duration;

use kvtier_core::{OffloadKey, Spawner};
use redis::cluster::ClusterClientBuilder;
use redis::{Client, IntoConnectionInfo, TlsCertificates};

use crate::cluster::Cluster;
use crate::config::{self, RedisConfig};
use crate::connection::{Connection, Single};
use crate::error::{RedisTierError, Result};
use crate::io::Io;
use crate::lean::{self, LeanGate, LeanPool};
use crate::names::{KeyLayout, Names};

/// A Redis tier; see the crate documentation.
///
/// Its operations are written in the modules of what they do: `pipeline.rs`
/// (commands, pipelines, shards and deadlines), `lookup.rs` (EXISTS),
/// `store.rs` (SET / GET / DEL).
pub struct RedisTier {
    pub(crate) config: RedisConfig,
    /// Where it connects, credentials masked: every error names it.
    pub(crate) endpoint: String,
    pub(crate) conn: Connection,
    pub(crate) lean: LeanGate,
    /// The names of its keys (prefix and layout).
    pub(crate) names: Names,
}

impl std::fmt::Debug for RedisTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisTier")
            .field("endpoint", &self.endpoint)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl RedisTier {
    /// Builds the tier from `config` and starts its I/O runtime (one
    /// thread, `kvtier-redis-io`), without connecting yet.
    ///
    /// # Errors
    /// [`RedisTierError::InvalidConfig`] for a bad field, URL or CA file;
    /// [`RedisTierError::Runtime`] when the I/O thread cannot start.
    pub fn new(config: RedisConfig) -> Result<Self> {
        config.validate()?;
        let spawner = Spawner::dedicated("kvtier-redis-io", 1)
            .map_err(|source| RedisTierError::Runtime { source })?;
        Self::with_spawner(config, &spawner)
    }

    /// Builds the tier from `config`, its connections made and driven on
    /// `spawner`'s runtime instead of one of its own: the one the lookup
    /// managers share (one thread for a whole stack and its Redis I/O), or
    /// the caller's ([`Spawner::from_handle`]).
    ///
    /// The tier keeps a clone of `spawner`: a dedicated runtime
    /// ([`Spawner::dedicated`]) runs as long as the tier, whether or not the
    /// caller keeps its own clone. A caller's runtime is the caller's to
    /// keep: once it shuts down, every call fails as
    /// [`RedisTierError::Unavailable`]. A caller's current-thread runtime
    /// must be driven (see [`Spawner`]) or calls wait until their timeout.
    ///
    /// # Errors
    /// [`RedisTierError::InvalidConfig`] for a bad field, URL or CA file.
    pub fn with_spawner(config: RedisConfig, spawner: &Spawner) -> Result<Self> {
        config.validate()?;
        // rustls needs a process-wide crypto provider; install ring unless
        // the application installed one already (then this is a no-op).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let root_cert = config
            .tls_ca_cert
            .as_deref()
            .map(config::read_ca_pem)
            .transpose()?;
        let io = Io::new(spawner.clone());
        let names = Names::new(config.key_prefix.as_bytes(), config.layout());
        if config.key_layout.is_none() && names.layout() == KeyLayout::Tagged {
            // The default changed for clusters: say so once per tier, where
            // an operator looking for blocks stored before will look.
            tracing::info!(
                prefix = %config.key_prefix,
                "redis cluster tier: key names are tagged (key_prefix + {{tttt}} + key, the \
                 default on a cluster); blocks stored under plain names (before key_layout \
                 existed) are found with key_layout = \"plain\""
            );
        }
        let (endpoint, conn) = if config.is_cluster() {
            cluster(&config, &names, root_cert, io)?
        } else {
            single(&config, root_cert, io)?
        };
        Ok(Self {
            config,
            endpoint,
            conn,
            lean: LeanGate::new(),
            names,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &RedisConfig {
        &self.config
    }

    /// Where it connects, without credentials.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    /// The layout of its names: [`RedisConfig::key_layout`], or the
    /// default it resolved to ([`RedisConfig::layout`]).
    pub fn key_layout(&self) -> KeyLayout {
        self.names.layout()
    }

    /// The runtime the tier's connections are made and driven on: the one
    /// it started ([`new`](Self::new)) or the one it was given
    /// ([`with_spawner`](Self::with_spawner)).
    pub fn spawner(&self) -> &Spawner {
        self.conn.spawner()
    }

    /// The Redis name `key` is stored under (prefix and layout applied), as
    /// `redis-cli` would be given it.
    pub fn key_name(&self, key: &OffloadKey) -> Vec<u8> {
        self.names.name(key.as_bytes())
    }
}

fn invalid(field: &'static str, reason: String) -> RedisTierError {
    RedisTierError::InvalidConfig { field, reason }
}

/// The CA of `root_cert`, for the client's TLS connections.
fn tls(root_cert: Vec<u8>) -> TlsCertificates {
    TlsCertificates {
        client_tls: None,
        root_cert: Some(root_cert),
    }
}

/// The endpoint and connection of a Redis Cluster: a client of the seeds,
/// the configured credentials over theirs, and the lean path's settings
/// taken from the first seed.
fn cluster(
    config: &RedisConfig,
    names: &Names,
    root_cert: Option<Vec<u8>>,
    io: Io,
) -> Result<(String, Connection)> {
    let mut builder = ClusterClientBuilder::new(config.cluster_urls.clone())
        .connection_timeout(Duration::from_millis(config.connect_timeout_ms))
        .response_timeout(Duration::from_millis(config.response_timeout_ms))
        .retries(config.reconnect_retries as u32);
    if let Some(user) = &config.username {
        builder = builder.username(user);
    }
    if let Some(password) = &config.password {
        builder = builder.password(password);
    }
    if let Some(root) = root_cert {
        builder = builder.certs(tls(root));
    }
    let seeds = config
        .cluster_urls
        .iter()
        .map(|u| config::redact(u))
        .collect::<Vec<_>>();
    let client = builder
        .build()
        .map_err(|e| invalid("cluster_urls", format!("{e} (seeds {seeds:?})")))?;
    let lean = config
        .cluster_urls
        .first()
        .and_then(|seed| lean_endpoint(seed, config));
    let cluster = Cluster::new(client, lean, names.clone());
    let endpoint = format!("redis cluster [{}]", seeds.join(", "));
    Ok((endpoint, Connection::cluster(cluster, io)))
}

/// The endpoint and connection of a single server: its URL's settings with
/// the configured user and password over them, and the lean path's pool.
fn single(
    config: &RedisConfig,
    root_cert: Option<Vec<u8>>,
    io: Io,
) -> Result<(String, Connection)> {
    let url_error =
        |e: redis::RedisError| invalid("url", format!("{:?}: {e}", config::redact(&config.url)));
    let mut info = config
        .url
        .as_str()
        .into_connection_info()
        .map_err(url_error)?;
    let mut redis_settings = info.redis_settings().clone();
    if let Some(user) = &config.username {
        redis_settings = redis_settings.set_username(user);
    }
    if let Some(password) = &config.password {
        redis_settings = redis_settings.set_password(password);
    }
    info = info.set_redis_settings(redis_settings);
    let client = match root_cert {
        Some(root) => Client::build_with_tls(info, tls(root)),
        None => Client::open(info),
    }
    .map_err(url_error)?;
    let lean = lean_endpoint(&config.url, config)
        .map(|endpoint| Arc::new(LeanPool::new(endpoint, io.spawner().clone())));
    let single = Single::new(
        client,
        Duration::from_millis(config.connect_timeout_ms),
        Duration::from_millis(config.response_timeout_ms),
        config.reconnect_retries,
        lean,
    );
    let endpoint = format!("redis {}", config::redact(&config.url));
    Ok((endpoint, Connection::single(single, io)))
}

/// The lean path's settings for `url`: plain TCP only, with the configured
/// user and password over the URL's; `None` when the lean path is off.
fn lean_endpoint(url: &str, config: &RedisConfig) -> Option<lean::Endpoint> {
    if !config.lean_pipelines {
        return None;
    }
    let info = url.into_connection_info().ok()?;
    let redis::ConnectionAddr::Tcp(host, port) = info.addr() else {
        return None;
    };
    let settings = info.redis_settings();
    Some(lean::Endpoint {
        host: host.clone(),
        port: *port,
        username: config
            .username
            .clone()
            .or_else(|| settings.username().map(str::to_owned)),
        password: config
            .password
            .clone()
            .or_else(|| settings.password().map(str::to_owned)),
        db: settings.db(),
        connect_timeout: Duration::from_millis(config.connect_timeout_ms),
        response_timeout: Duration::from_millis(config.response_timeout_ms),
    })
}
