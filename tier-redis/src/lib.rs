//! A Redis kvtier tier: pipelined EXISTS lookups, store / load / remove, on
//! a single server or a Redis Cluster.
//!
//! - **One pipeline per chunk, not one round trip per key.** A batch is
//!   split into pipelines of `pipeline_chunk` EXISTS commands, with up to
//!   `max_chunks_in_flight` of them in flight at once over one multiplexed
//!   connection. Answers are put back in key order.
//! - **Redis Cluster.** Keys are grouped by the master that owns their slot,
//!   from a cached `CLUSTER SLOTS` map, and each group is one pipeline per
//!   chunk routed to that master; groups run in parallel. When a group's
//!   pipeline fails (MOVED during resharding, a node down), the slot map is
//!   dropped and that group's keys are asked one command at a time, with the
//!   client library following MOVED / ASK.
//! - **Lean pipelines.** Over plain TCP, lookup pipelines are written
//!   pre-packed on connections of the tier's own and the integer replies
//!   are read straight into booleans (redis-rs builds and parses a value per
//!   command: nearly half the client's CPU per key). Any error reply
//!   (MOVED, NOAUTH...) or connection trouble hands the chunk to redis-rs,
//!   which decides the outcome; TLS always uses redis-rs. `lean_pipelines =
//!   false` turns it off; [`RedisTier::pipeline_stats`] counts both paths.
//! - **Replies are checked, the same way on both paths.** Each EXISTS must
//!   answer `0` or `1`, and each pipeline ends with an end marker (`TYPE`
//!   of its first key) whose reply must come last, so a missing or an extra
//!   reply is seen. Anything else is [`RedisTierError::UnexpectedReply`],
//!   never a hit or a miss. A reply line the lean path reads may be at most
//!   4 KiB long, and every call returns within its response timeout.
//! - **Outages.** The connection reconnects by itself. Connect and response
//!   timeouts are short, so a lookup during an outage fails fast, with a
//!   typed error (timeout, unavailable, auth, cluster down) that the lookup
//!   manager counts as an error, not a miss.
//! - **Credentials** never appear in errors, logs or `Debug` output.
//! - **Any runtime.** Connections are made and driven on a one-thread I/O
//!   runtime the tier starts with itself (and stops, without waiting, when
//!   dropped), or on a [`Spawner`] the caller passes
//!   ([`RedisTier::with_spawner`]), so stores from a short-lived runtime
//!   never leave the lookup manager's worker on a connection whose driver is
//!   gone. Callers may use the tier from any tokio runtime.
//! - **One store interface.** Blocks are stored, loaded and removed through
//!   [`BlockStore`]: `SET` (with `PX` when [`RedisConfig::ttl_ms`] is set),
//!   `GET` and `DEL`, and the batched forms in one pipeline per chunk (per
//!   master on a cluster; `MGET` on a single server). Redis-only extras: [`RedisTier::store_nx`],
//!   [`RedisTier::exists_many`], [`RedisTier::ping`].
//!
//! To keep tenants apart, give each tenant its own tier instance with its
//! own [`key_prefix`](RedisConfig::key_prefix) (or salt the block hashes
//! per tenant): a tier sees only the names under its prefix.
//!
//! ```
//! use std::sync::Arc;
//! use std::time::Duration;
//! use kvtier_core::{BlockStore, LookupVerdict, ManagerConfig, OffloadKey, ReqContext};
//! use kvtier_redis::{RedisConfig, RedisTier};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # // Runs against the server of `scripts/services.sh`; skipped loudly
//! # // without it, a failure when services are required (CI).
//! # let Ok(url) = std::env::var("KVTIER_REDIS_URL") else {
//! #     assert!(std::env::var_os("KVTIER_REQUIRE_SERVICES").is_none(), "KVTIER_REDIS_URL not set");
//! #     eprintln!("SKIPPED tier-redis doc example: KVTIER_REDIS_URL not set");
//! #     return Ok(());
//! # };
//! // url: e.g. "redis://127.0.0.1:6379/"
//! let tier = Arc::new(RedisTier::new(RedisConfig {
//!     key_prefix: "doc-example:".into(),
//!     ..RedisConfig::from_url(&url)
//! })?);
//! let key = OffloadKey::from_block_hash(&[7; 32], 0);
//! let rt = tokio::runtime::Runtime::new()?;
//! rt.block_on(tier.store(&key, b"kv bytes"))?;
//! assert_eq!(rt.block_on(tier.load(&key))?.as_deref(), Some(&b"kv bytes"[..]));
//!
//! // The scheduler's side: answers at once, never waits for Redis.
//! let mut manager = tier.manager(ManagerConfig::default())?;
//! let req = ReqContext::new("request-1");
//! assert_eq!(manager.lookup(&key, &req)?, LookupVerdict::Pending);
//! manager.flush(); // once per scheduler step
//! // ...a later step:
//! while manager.lookup(&key, &req)? == LookupVerdict::Pending {
//!     std::thread::sleep(Duration::from_millis(1));
//! }
//! assert_eq!(manager.lookup(&key, &req)?, LookupVerdict::Hit);
//! manager.cleanup("request-1");
//! rt.block_on(tier.remove(&key))?;
//! # Ok(()) }
//! ```

#![deny(missing_docs)]
#![warn(clippy::unwrap_used)]

mod cluster;
mod config;
mod connection;
mod error;
mod lean;
mod slot;

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use futures_util::future::join_all;
use kvtier_core::{BlockStore, ManagerConfig, OffloadKey, ReqContext, Spawner, Tier, TierError};
use redis::{Client, IntoConnectionInfo, Pipeline, Value};

use crate::cluster::Cluster;
use crate::connection::{ConnError, Connection, Io, Single, Target};
pub use config::RedisConfig;
pub use error::RedisTierError;
pub use slot::key_slot;

/// How lookup pipelines went: through the lean path, or back to redis-rs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PipelineStats {
    /// Pipelines answered by the lean path.
    pub lean: u64,
    /// Lean attempts that gave up (error reply, connection trouble), after
    /// which redis-rs answered.
    pub fallbacks: u64,
}

/// A Redis tier; see the crate documentation.
pub struct RedisTier {
    config: RedisConfig,
    endpoint: String,
    conn: Connection,
    epoch: Instant,
    lean_pipelines: AtomicU64,
    lean_fallbacks: AtomicU64,
    /// Milliseconds since `epoch` before which the lean path is not tried
    /// (set after connection trouble, so an outage does not cost twice).
    lean_paused_until: AtomicU64,
}

impl std::fmt::Debug for RedisTier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisTier")
            .field("endpoint", &self.endpoint)
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

type Result<T, E = RedisTierError> = std::result::Result<T, E>;

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
    /// A caller's runtime must outlive the tier's use: once it shuts down,
    /// every call fails as [`RedisTierError::Unavailable`]. A caller's
    /// current-thread runtime must be driven (see [`Spawner`]) or calls
    /// wait until their timeout.
    ///
    /// # Errors
    /// [`RedisTierError::InvalidConfig`] for a bad field, URL or CA file.
    pub fn with_spawner(config: RedisConfig, spawner: &Spawner) -> Result<Self> {
        config.validate()?;
        // rustls needs a process-wide crypto provider; install ring unless
        // the application installed one already (then this is a no-op).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let invalid =
            |field: &'static str, e: &dyn std::fmt::Display| RedisTierError::InvalidConfig {
                field,
                reason: e.to_string(),
            };
        let root_cert = config
            .tls_ca_cert
            .as_deref()
            .map(config::read_ca_pem)
            .transpose()?;
        let connect_timeout = Duration::from_millis(config.connect_timeout_ms);
        let response_timeout = Duration::from_millis(config.response_timeout_ms);
        let io = Io::new(spawner.clone());
        let (endpoint, conn) = if config.is_cluster() {
            let mut builder =
                redis::cluster::ClusterClientBuilder::new(config.cluster_urls.clone())
                    .connection_timeout(connect_timeout)
                    .response_timeout(response_timeout)
                    .retries(config.reconnect_retries as u32);
            if let Some(user) = &config.username {
                builder = builder.username(user);
            }
            if let Some(password) = &config.password {
                builder = builder.password(password);
            }
            if let Some(root) = root_cert {
                builder = builder.certs(redis::TlsCertificates {
                    client_tls: None,
                    root_cert: Some(root),
                });
            }
            let client = builder.build().map_err(|e| {
                invalid(
                    "cluster_urls",
                    &format!("{e} (seeds {:?})", redacted_list(&config.cluster_urls)),
                )
            })?;
            let endpoint = format!(
                "redis cluster [{}]",
                redacted_list(&config.cluster_urls).join(", ")
            );
            let lean = config
                .cluster_urls
                .first()
                .and_then(|seed| lean_endpoint(seed, &config));
            let cluster = Cluster::new(client, lean, config.key_prefix.as_bytes());
            (endpoint, Connection::cluster(cluster, io))
        } else {
            let mut info =
                config.url.as_str().into_connection_info().map_err(|e| {
                    invalid("url", &format!("{:?}: {e}", config::redact(&config.url)))
                })?;
            let mut redis_settings = info.redis_settings().clone();
            if let Some(user) = &config.username {
                redis_settings = redis_settings.set_username(user);
            }
            if let Some(password) = &config.password {
                redis_settings = redis_settings.set_password(password);
            }
            info = info.set_redis_settings(redis_settings);
            let client = match root_cert {
                Some(root) => Client::build_with_tls(
                    info,
                    redis::TlsCertificates {
                        client_tls: None,
                        root_cert: Some(root),
                    },
                ),
                None => Client::open(info),
            }
            .map_err(|e| invalid("url", &format!("{:?}: {e}", config::redact(&config.url))))?;
            let lean = lean_endpoint(&config.url, &config)
                .map(|endpoint| Arc::new(lean::LeanPool::new(endpoint, io.spawner().clone())));
            let single = Single::new(
                client,
                connect_timeout,
                response_timeout,
                config.reconnect_retries,
                lean,
            );
            (
                format!("redis {}", config::redact(&config.url)),
                Connection::single(single, io),
            )
        };
        Ok(Self {
            config,
            endpoint,
            conn,
            epoch: Instant::now(),
            lean_pipelines: AtomicU64::new(0),
            lean_fallbacks: AtomicU64::new(0),
            lean_paused_until: AtomicU64::new(0),
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

    /// How lookup pipelines went so far (see `lean_pipelines` in [`RedisConfig`]).
    pub fn pipeline_stats(&self) -> PipelineStats {
        PipelineStats {
            lean: self.lean_pipelines.load(Ordering::Relaxed),
            fallbacks: self.lean_fallbacks.load(Ordering::Relaxed),
        }
    }

    /// Whether each key exists, in order: EXISTS pipelines (see the crate
    /// documentation). [`Tier::batch_lookup`] answers with this.
    ///
    /// # Errors
    /// A [`RedisTierError`] classified as timeout, unavailable, auth, cluster down or other.
    pub async fn exists_many(&self, keys: &[OffloadKey]) -> Result<Vec<bool>> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<&OffloadKey> = keys.iter().collect();
        let keys = &keys[..];
        self.bounded(
            "EXISTS",
            self.per_shard(
                "EXISTS pipeline",
                keys,
                |target, chunk| async move {
                    let chunk_keys = chunk.iter().map(|&(pos, _)| keys[pos]);
                    if let Some(found) = self
                        .try_lean(target.lean.as_deref(), chunk_keys.clone())
                        .await?
                    {
                        return Ok(found);
                    }
                    let pipe = self.exists_pipeline(chunk_keys);
                    let values = self
                        .conn
                        .pipeline(&target, pipe, chunk.len() + 1)
                        .await
                        .map_err(|e| self.err("EXISTS pipeline", e))?;
                    self.exists_answers(values, chunk.len())
                },
                |pos| async move {
                    let n: i64 = self
                        .query("EXISTS", self.key_cmd("EXISTS", keys[pos]))
                        .await?;
                    lean::exists_answer(n)
                        .ok_or_else(|| self.unexpected("EXISTS", &format!("answer {n}")))
                },
            ),
        )
        .await
    }

    /// Stores `payload` under `key` only if the key is absent, with the
    /// configured [`ttl_ms`](RedisConfig::ttl_ms); returns whether it was
    /// stored (`SET NX`).
    ///
    /// # Errors
    /// A classified [`RedisTierError`].
    pub async fn store_nx(&self, key: &OffloadKey, payload: &[u8]) -> Result<bool> {
        let mut cmd = self.set_cmd(key, payload);
        cmd.arg("NX");
        let reply: Option<String> = self.bounded("SET NX", self.query("SET NX", cmd)).await?;
        Ok(reply.is_some())
    }

    /// Answers PING: checks connectivity and credentials.
    ///
    /// # Errors
    /// A classified [`RedisTierError`].
    pub async fn ping(&self) -> Result<()> {
        let _: String = self
            .bounded("PING", self.query("PING", redis::cmd("PING")))
            .await?;
        Ok(())
    }

    /// One chunk through the lean path; `Ok(None)` means "ask redis-rs".
    ///
    /// # Errors
    /// [`RedisTierError::UnexpectedReply`] when the server broke the
    /// protocol: redis-rs's answer would be an error too (its replies are
    /// checked with the same rule), so it is not asked.
    async fn try_lean<'a>(
        &self,
        pool: Option<&lean::LeanPool>,
        keys: impl ExactSizeIterator<Item = &'a OffloadKey>,
    ) -> Result<Option<Vec<bool>>> {
        let Some(pool) = pool else {
            return Ok(None);
        };
        let now_ms = || u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
        if now_ms() < self.lean_paused_until.load(Ordering::Relaxed) {
            return Ok(None);
        }
        match pool.exists(self.config.key_prefix.as_bytes(), keys).await {
            Ok(found) => {
                self.lean_pipelines.fetch_add(1, Ordering::Relaxed);
                Ok(Some(found))
            }
            Err(e) if e.is_protocol_violation() => Err(RedisTierError::UnexpectedReply {
                endpoint: self.endpoint.clone(),
                op: "EXISTS pipeline",
                detail: e.to_string(),
            }),
            Err(e) => {
                self.lean_fallbacks.fetch_add(1, Ordering::Relaxed);
                // A moved slot is redis-rs's to follow; anything else (an
                // outage, a refused handshake) pauses the lean path for a
                // second, so a failing server is not asked twice per chunk.
                let moved = matches!(&e, lean::LeanError::Server(m) if m.starts_with("MOVED") || m.starts_with("ASK"));
                if !moved {
                    self.lean_paused_until
                        .store(now_ms().saturating_add(1000), Ordering::Relaxed);
                }
                tracing::debug!(endpoint = %self.endpoint, error = %e, "lean EXISTS pipeline gave up; asking redis-rs");
                Ok(None)
            }
        }
    }

    /// Runs `chunk` on every chunk of `pipeline_chunk` keys of every shard
    /// (shards in parallel, up to `max_chunks_in_flight` chunks of a shard
    /// at once) and puts the answers back in key order.
    ///
    /// When a chunk of a cluster shard fails (MOVED during resharding, a
    /// master down), the slot map is dropped and that shard's keys are
    /// asked one command at a time with `one`, the cluster client following
    /// MOVED / ASK. A reply of the wrong shape is never asked again.
    async fn per_shard<T, C, CF, O, OF>(
        &self,
        op: &'static str,
        keys: &[&OffloadKey],
        chunk: C,
        one: O,
    ) -> Result<Vec<T>>
    where
        T: Send,
        C: Fn(Target, Vec<(usize, u16)>) -> CF + Sync,
        CF: Future<Output = Result<Vec<T>>> + Send,
        O: Fn(usize) -> OF + Sync,
        OF: Future<Output = Result<T>> + Send,
    {
        let shards = self
            .conn
            .shards(keys)
            .await
            .map_err(|e| self.conn_err(op, e))?;
        let (chunk, one) = (&chunk, &one);
        let runs = shards.iter().map(|shard| async move {
            // Collected first: no lazy iterator is held across an await
            // (the future must be Send).
            let chunks: Vec<_> = shard
                .keys
                .chunks(self.config.pipeline_chunk)
                .map(|c| chunk(shard.target.clone(), c.to_vec()))
                .collect();
            let mut answers =
                futures_util::stream::iter(chunks).buffered(self.config.max_chunks_in_flight);
            let mut found = Vec::with_capacity(shard.keys.len());
            let mut failed = None;
            while let Some(answer) = answers.next().await {
                match answer {
                    Ok(values) => found.extend(values),
                    Err(e @ RedisTierError::UnexpectedReply { .. }) => return Err(e),
                    Err(e) => {
                        failed = Some(e);
                        break;
                    }
                }
            }
            drop(answers);
            let Some(first_error) = failed else {
                return Ok(found);
            };
            if !shard.target.follows_redirects() {
                return Err(first_error);
            }
            tracing::debug!(endpoint = %self.endpoint, error = %first_error, keys = shard.keys.len(), op, "cluster pipeline failed; asking key by key");
            self.conn.forget_routes();
            let singles: Vec<_> = shard.keys.iter().map(|&(pos, _)| one(pos)).collect();
            let mut answers =
                futures_util::stream::iter(singles).buffered(self.config.pipeline_chunk);
            let mut found = Vec::with_capacity(shard.keys.len());
            while let Some(answer) = answers.next().await {
                found.push(answer?);
            }
            Ok(found)
        });
        let answers = join_all(runs).await;
        let mut ordered: Vec<Option<T>> =
            std::iter::repeat_with(|| None).take(keys.len()).collect();
        for (shard, answer) in shards.iter().zip(answers) {
            let answer = answer?;
            if answer.len() != shard.keys.len() {
                return Err(self.unexpected(
                    op,
                    &format!("{} answers for {} keys", answer.len(), shard.keys.len()),
                ));
            }
            for (&(pos, _), value) in shard.keys.iter().zip(answer) {
                if let Some(slot) = ordered.get_mut(pos) {
                    *slot = Some(value);
                }
            }
        }
        ordered
            .into_iter()
            .collect::<Option<Vec<T>>>()
            .ok_or_else(|| self.unexpected(op, "a key without an answer"))
    }

    fn err(&self, op: &'static str, e: redis::RedisError) -> RedisTierError {
        RedisTierError::classify(&self.endpoint, op, e)
    }

    fn conn_err(&self, op: &'static str, e: ConnError) -> RedisTierError {
        match e {
            ConnError::Client(e) => self.err(op, e),
            ConnError::Reply(detail) => self.unexpected(op, &detail),
        }
    }

    fn unexpected(&self, op: &'static str, detail: &str) -> RedisTierError {
        RedisTierError::UnexpectedReply {
            endpoint: self.endpoint.clone(),
            op,
            detail: detail.to_owned(),
        }
    }

    /// One command, routed by its key on a cluster.
    async fn query<T: redis::FromRedisValue + Send + 'static>(
        &self,
        op: &'static str,
        cmd: redis::Cmd,
    ) -> Result<T> {
        self.conn.query(cmd).await.map_err(|e| self.err(op, e))
    }

    fn full_key(&self, key: &OffloadKey) -> Vec<u8> {
        let mut k = Vec::with_capacity(self.config.key_prefix.len() + key.len());
        self.write_full_key(&mut k, key);
        k
    }

    /// Writes prefix + key into `buf` (cleared first): one buffer reused for
    /// a whole batch instead of an allocation per key.
    fn write_full_key(&self, buf: &mut Vec<u8>, key: &OffloadKey) {
        buf.clear();
        buf.extend_from_slice(self.config.key_prefix.as_bytes());
        buf.extend_from_slice(key.as_bytes());
    }

    /// `name <prefix><key>`.
    fn key_cmd(&self, name: &str, key: &OffloadKey) -> redis::Cmd {
        let mut cmd = redis::cmd(name);
        cmd.arg(self.full_key(key));
        cmd
    }

    /// `SET <prefix><key> <payload>`, with `PX` when a TTL is configured.
    fn set_cmd(&self, key: &OffloadKey, payload: &[u8]) -> redis::Cmd {
        let mut cmd = self.key_cmd("SET", key);
        cmd.arg(payload);
        if let Some(ttl) = self.config.ttl_ms {
            cmd.arg("PX").arg(ttl);
        }
        cmd
    }

    /// One EXISTS per key, in order, each command sized up front, then the
    /// end marker `TYPE <first name>` (as on the lean path; see
    /// [`exists_answers`]).
    fn exists_pipeline<'a>(&self, keys: impl ExactSizeIterator<Item = &'a OffloadKey>) -> Pipeline {
        let mut pipe = Pipeline::with_capacity(keys.len() + 1);
        let mut name = Vec::with_capacity(self.config.key_prefix.len() + 64);
        let mut first = None;
        for key in keys {
            first.get_or_insert(key);
            self.write_full_key(&mut name, key);
            let mut cmd = redis::Cmd::with_capacity(2, "EXISTS".len() + name.len());
            cmd.arg("EXISTS").arg(name.as_slice());
            pipe.add_command(cmd);
        }
        if let Some(first) = first {
            pipe.cmd("TYPE").arg(self.full_key(first));
        }
        pipe
    }

    /// [`exists_answers`] as a tier error.
    fn exists_answers(&self, values: Vec<Value>, keys: usize) -> Result<Vec<bool>> {
        exists_answers(values, keys).map_err(|detail| self.unexpected("EXISTS pipeline", &detail))
    }

    /// Bounds a whole operation by the response timeout (plus the connect
    /// timeout), whatever the client's retries do.
    async fn bounded<T>(
        &self,
        op: &'static str,
        fut: impl Future<Output = Result<T>>,
    ) -> Result<T> {
        let limit =
            Duration::from_millis(self.config.response_timeout_ms + self.config.connect_timeout_ms);
        match tokio::time::timeout(limit, fut).await {
            Ok(result) => result,
            Err(_) => Err(RedisTierError::Timeout {
                endpoint: self.endpoint.clone(),
                op,
                source: redis::RedisError::from(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "kvtier deadline",
                )),
            }),
        }
    }

    /// Sends a pipeline of one command per key of `chunk` (built by
    /// `command`), and checks that every key got a reply.
    async fn key_pipeline(
        &self,
        op: &'static str,
        target: &Target,
        chunk: &[(usize, u16)],
        mut command: impl FnMut(&mut Pipeline, usize),
    ) -> Result<Vec<Value>> {
        let mut pipe = Pipeline::with_capacity(chunk.len());
        for &(pos, _) in chunk {
            command(&mut pipe, pos);
        }
        let values = self
            .conn
            .pipeline(target, pipe, chunk.len())
            .await
            .map_err(|e| self.err(op, e))?;
        if values.len() != chunk.len() {
            return Err(self.unexpected(
                op,
                &format!("{} replies to {} commands", values.len(), chunk.len()),
            ));
        }
        Ok(values)
    }
}

/// Each URL with its credentials masked.
fn redacted_list(urls: &[String]) -> Vec<String> {
    urls.iter().map(|u| config::redact(u)).collect()
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

/// The answers of an EXISTS pipeline of `keys` commands and its end marker,
/// read with the lean path's rule: each answer `0` or `1`
/// ([`lean::exists_answer`]), then the marker's simple string, last.
fn exists_answers(mut values: Vec<Value>, keys: usize) -> Result<Vec<bool>, String> {
    if values.len() != keys + 1 {
        return Err(format!(
            "{} replies to {keys} EXISTS and an end marker",
            values.len()
        ));
    }
    match values.pop() {
        // Any simple string, as the lean path takes it (`+OK` is `Okay`).
        Some(Value::SimpleString(_) | Value::Okay) => {}
        _ => return Err("replies out of step: the end marker's reply is not last".to_owned()),
    }
    values
        .into_iter()
        .map(|value| match value {
            Value::Int(n) => lean::exists_answer(n)
                .ok_or_else(|| format!("an EXISTS answer other than 0 or 1: {n}")),
            _ => Err("an EXISTS answer that is not an integer".to_owned()),
        })
        .collect()
}

/// A `GET` reply: the payload, or `None` for an absent key.
fn payload(value: Value) -> Result<Option<Vec<u8>>, String> {
    match value {
        Value::Nil => Ok(None),
        Value::BulkString(bytes) => Ok(Some(bytes)),
        _ => Err("a GET answer that is neither a payload nor nil".to_owned()),
    }
}

/// Blocks are stored with `SET` (with `PX` when the configuration sets
/// [`ttl_ms`](RedisConfig::ttl_ms)), loaded with `GET` and removed with
/// `DEL`. The batched forms send one pipeline per chunk of
/// [`pipeline_chunk`](RedisConfig::pipeline_chunk) keys (`MGET` on a single
/// server), on a cluster per master with the masters in parallel; a chunk
/// whose pipeline fails on a cluster, as during resharding, is done again
/// key by key, following MOVED. Every call is bounded by the response
/// timeout plus the connect timeout.
impl BlockStore for RedisTier {
    async fn store(&self, key: &OffloadKey, block: &[u8]) -> Result<(), TierError> {
        let _: Value = self
            .bounded("SET", self.query("SET", self.set_cmd(key, block)))
            .await?;
        Ok(())
    }

    async fn load(&self, key: &OffloadKey) -> Result<Option<Vec<u8>>, TierError> {
        let value: Value = self
            .bounded("GET", self.query("GET", self.key_cmd("GET", key)))
            .await?;
        Ok(payload(value).map_err(|detail| self.unexpected("GET", &detail))?)
    }

    async fn remove(&self, key: &OffloadKey) -> Result<(), TierError> {
        let _: i64 = self
            .bounded("DEL", self.query("DEL", self.key_cmd("DEL", key)))
            .await?;
        Ok(())
    }

    async fn store_many(&self, blocks: &[(OffloadKey, Vec<u8>)]) -> Result<(), TierError> {
        if blocks.is_empty() {
            return Ok(());
        }
        let keys: Vec<&OffloadKey> = blocks.iter().map(|(key, _)| key).collect();
        self.bounded(
            "SET pipeline",
            self.per_shard(
                "SET pipeline",
                &keys,
                |target, chunk| async move {
                    self.key_pipeline("SET pipeline", &target, &chunk, |pipe, pos| {
                        let (key, block) = &blocks[pos];
                        pipe.add_command(self.set_cmd(key, block));
                    })
                    .await
                    .map(|values| vec![(); values.len()])
                },
                |pos| async move {
                    let (key, block) = &blocks[pos];
                    let _: Value = self.query("SET", self.set_cmd(key, block)).await?;
                    Ok(())
                },
            ),
        )
        .await?;
        Ok(())
    }

    async fn load_many(&self, keys: &[OffloadKey]) -> Result<Vec<Option<Vec<u8>>>, TierError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let keys: Vec<&OffloadKey> = keys.iter().collect();
        let keys = &keys[..];
        let payloads = |values: Vec<Value>| -> Result<Vec<Option<Vec<u8>>>> {
            values
                .into_iter()
                .map(payload)
                .collect::<Result<_, _>>()
                .map_err(|detail| self.unexpected("GET pipeline", &detail))
        };
        Ok(self
            .bounded(
                "GET pipeline",
                self.per_shard(
                    "GET pipeline",
                    keys,
                    |target, chunk| async move {
                        if !target.spans_slots() {
                            let values = self
                                .key_pipeline("GET pipeline", &target, &chunk, |pipe, pos| {
                                    pipe.add_command(self.key_cmd("GET", keys[pos]));
                                })
                                .await?;
                            return payloads(values);
                        }
                        // A single server: one MGET per chunk.
                        let mut mget = redis::cmd("MGET");
                        for &(pos, _) in &chunk {
                            mget.arg(self.full_key(keys[pos]));
                        }
                        let mut pipe = Pipeline::with_capacity(1);
                        pipe.add_command(mget);
                        let values = self
                            .conn
                            .pipeline(&target, pipe, 1)
                            .await
                            .map_err(|e| self.err("MGET", e))?;
                        match values.into_iter().next() {
                            Some(Value::Array(values)) if values.len() == chunk.len() => {
                                payloads(values)
                            }
                            _ => Err(self.unexpected("MGET", "not one answer per key")),
                        }
                    },
                    |pos| async move {
                        let value: Value =
                            self.query("GET", self.key_cmd("GET", keys[pos])).await?;
                        payload(value).map_err(|detail| self.unexpected("GET", &detail))
                    },
                ),
            )
            .await?)
    }

    async fn remove_many(&self, keys: &[OffloadKey]) -> Result<(), TierError> {
        if keys.is_empty() {
            return Ok(());
        }
        let keys: Vec<&OffloadKey> = keys.iter().collect();
        let keys = &keys[..];
        self.bounded(
            "DEL pipeline",
            self.per_shard(
                "DEL pipeline",
                keys,
                |target, chunk| async move {
                    self.key_pipeline("DEL pipeline", &target, &chunk, |pipe, pos| {
                        pipe.add_command(self.key_cmd("DEL", keys[pos]));
                    })
                    .await
                    .map(|values| vec![(); values.len()])
                },
                |pos| async move {
                    let _: i64 = self.query("DEL", self.key_cmd("DEL", keys[pos])).await?;
                    Ok(())
                },
            ),
        )
        .await?;
        Ok(())
    }

    /// Named `redis` unless `config` names it.
    fn manager_config(&self, config: ManagerConfig) -> ManagerConfig {
        config.or_named("redis")
    }
}

impl Tier for RedisTier {
    async fn batch_lookup(
        &self,
        keys: &[OffloadKey],
        _ctx: &ReqContext,
    ) -> Result<Vec<bool>, TierError> {
        self.exists_many(keys).await.map_err(TierError::from)
    }
}
