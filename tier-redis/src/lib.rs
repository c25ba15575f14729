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
//!
//! Connections are made by the first call, on that call's tokio runtime;
//! usually that is the lookup manager's worker.
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
//! rt.block_on(tier.store(&key, b"kv bytes", None))?;
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

mod config;
mod error;
mod lean;
pub mod slot;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use futures_util::future::join_all;
use kvtier_core::{BlockStore, ManagerConfig, OffloadKey, ReqContext, Tier, TierError};
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClient;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, SingleNodeRoutingInfo, SlotAddr};
use redis::{Client, IntoConnectionInfo, Pipeline, Value};
use tokio::sync::OnceCell;

pub use config::RedisConfig;
pub use error::RedisTierError;

/// Slot ranges and the master owning each, from `CLUSTER SLOTS`.
#[derive(Debug)]
struct SlotMap {
    /// (first slot, last slot, master index), sorted by first slot.
    ranges: Vec<(u16, u16, usize)>,
    /// Host and port of each master, and its lean-path connections.
    masters: Vec<(String, u16, Option<lean::LeanPool>)>,
}

/// How lookup pipelines went: through the lean path, or back to redis-rs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PipelineStats {
    /// Pipelines answered by the lean path.
    pub lean: u64,
    /// Lean attempts that gave up (error reply, connection trouble), after
    /// which redis-rs answered.
    pub fallbacks: u64,
}

impl SlotMap {
    fn owner(&self, slot: u16) -> Option<usize> {
        let idx = self.ranges.partition_point(|&(start, _, _)| start <= slot);
        let (start, end, master) = *self.ranges.get(idx.checked_sub(1)?)?;
        (start <= slot && slot <= end).then_some(master)
    }
}

enum Backend {
    Single {
        client: Client,
        conn: OnceCell<ConnectionManager>,
        lean: Option<Box<lean::LeanPool>>,
    },
    Cluster {
        client: Box<ClusterClient>,
        conn: OnceCell<ClusterConnection>,
        slots: RwLock<Option<Arc<SlotMap>>>,
        /// The seed's settings for masters' lean connections (host and
        /// port replaced), if the lean path is on and the seed is plain TCP.
        lean: Option<lean::Endpoint>,
    },
}

/// A Redis tier; see the crate documentation.
pub struct RedisTier {
    config: RedisConfig,
    endpoint: String,
    backend: Backend,
    epoch: Instant,
    /// Slots of this tier's names (prefix + key).
    slots: slot::PrefixedSlots,
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
    /// Builds the tier from `config`, without connecting yet.
    ///
    /// # Errors
    /// [`RedisTierError::InvalidConfig`] for a bad field, URL or CA file.
    pub fn new(config: RedisConfig) -> Result<Self> {
        config.validate()?;
        // rustls needs a process-wide crypto provider; install ring unless
        // the application installed one already (then this is a no-op).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let invalid =
            |field: &'static str, e: &dyn std::fmt::Display| RedisTierError::InvalidConfig {
                field,
                reason: e.to_string(),
            };
        let root_cert = match &config.tls_ca_cert {
            Some(path) => Some(
                std::fs::read(path)
                    .map_err(|e| invalid("tls_ca_cert", &format!("{}: {e}", path.display())))?,
            ),
            None => None,
        };
        let connect_timeout = Duration::from_millis(config.connect_timeout_ms);
        let response_timeout = Duration::from_millis(config.response_timeout_ms);
        let (endpoint, backend) = if config.is_cluster() {
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
            (
                endpoint,
                Backend::Cluster {
                    client: Box::new(client),
                    conn: OnceCell::new(),
                    slots: RwLock::new(None),
                    lean: config
                        .cluster_urls
                        .first()
                        .and_then(|seed| lean_endpoint(seed, &config)),
                },
            )
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
            (
                format!("redis {}", config::redact(&config.url)),
                Backend::Single {
                    client,
                    conn: OnceCell::new(),
                    lean: lean_endpoint(&config.url, &config)
                        .map(|endpoint| Box::new(lean::LeanPool::new(endpoint))),
                },
            )
        };
        Ok(Self {
            slots: slot::PrefixedSlots::new(config.key_prefix.as_bytes()),
            config,
            endpoint,
            backend,
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

    /// How lookup pipelines went so far (see `lean_pipelines` in [`RedisConfig`]).
    pub fn pipeline_stats(&self) -> PipelineStats {
        PipelineStats {
            lean: self.lean_pipelines.load(Ordering::Relaxed),
            fallbacks: self.lean_fallbacks.load(Ordering::Relaxed),
        }
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

    /// Where it connects, without credentials.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    fn err(&self, op: &'static str, e: redis::RedisError) -> RedisTierError {
        RedisTierError::classify(&self.endpoint, op, e)
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
        exists_answers(values, keys).map_err(|detail| RedisTierError::UnexpectedReply {
            endpoint: self.endpoint.clone(),
            op: "EXISTS pipeline",
            detail,
        })
    }

    async fn single(&self) -> Result<ConnectionManager> {
        let Backend::Single { client, conn, .. } = &self.backend else {
            unreachable_backend()
        };
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(Duration::from_millis(self.config.connect_timeout_ms)))
            .set_response_timeout(Some(Duration::from_millis(self.config.response_timeout_ms)))
            .set_number_of_retries(self.config.reconnect_retries)
            .set_max_delay(Duration::from_millis(self.config.connect_timeout_ms));
        conn.get_or_try_init(|| async {
            ConnectionManager::new_with_config(client.clone(), config)
                .await
                .map_err(|e| self.err("connect", e))
        })
        .await
        .cloned()
    }

    async fn cluster(&self) -> Result<ClusterConnection> {
        let Backend::Cluster { client, conn, .. } = &self.backend else {
            unreachable_backend()
        };
        conn.get_or_try_init(|| async {
            client
                .get_async_connection()
                .await
                .map_err(|e| self.err("connect", e))
        })
        .await
        .cloned()
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

    /// Whether each key exists, in order.
    ///
    /// # Errors
    /// A [`RedisTierError`] classified as timeout, unavailable, auth, cluster down or other.
    pub async fn exists_many(&self, keys: &[OffloadKey]) -> Result<Vec<bool>> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        self.bounded("EXISTS", async {
            match &self.backend {
                Backend::Single { .. } => self.exists_single(keys).await,
                Backend::Cluster { .. } => self.exists_cluster(keys).await,
            }
        })
        .await
    }

    async fn exists_single(&self, keys: &[OffloadKey]) -> Result<Vec<bool>> {
        let Backend::Single { lean, .. } = &self.backend else {
            unreachable_backend()
        };
        let conn = self.single().await?;
        // Collected first: no lazy iterator is held across an await (the
        // future must be Send).
        let chunks: Vec<_> = keys
            .chunks(self.config.pipeline_chunk)
            .map(|chunk| {
                let mut conn = conn.clone();
                async move {
                    if let Some(found) = self.try_lean(lean.as_deref(), chunk.iter()).await? {
                        return Ok(found);
                    }
                    let pipe = self.exists_pipeline(chunk.iter());
                    let values = pipe
                        .query_async::<Vec<Value>>(&mut conn)
                        .await
                        .map_err(|e| self.err("EXISTS pipeline", e))?;
                    self.exists_answers(values, chunk.len())
                }
            })
            .collect();
        let mut found = Vec::with_capacity(keys.len());
        let mut answers =
            futures_util::stream::iter(chunks).buffered(self.config.max_chunks_in_flight);
        while let Some(answer) = answers.next().await {
            found.extend(answer?);
        }
        self.check_len(found, keys.len())
    }

    fn unexpected(&self, op: &'static str, detail: &str) -> RedisTierError {
        RedisTierError::UnexpectedReply {
            endpoint: self.endpoint.clone(),
            op,
            detail: detail.to_owned(),
        }
    }

    fn check_len(&self, found: Vec<bool>, expected: usize) -> Result<Vec<bool>> {
        if found.len() != expected {
            return Err(RedisTierError::UnexpectedReply {
                endpoint: self.endpoint.clone(),
                op: "EXISTS pipeline",
                detail: format!("{} answers for {expected} keys", found.len()),
            });
        }
        Ok(found)
    }

    async fn slot_map(&self, conn: &ClusterConnection) -> Result<Arc<SlotMap>> {
        let Backend::Cluster { slots, lean, .. } = &self.backend else {
            unreachable_backend()
        };
        if let Some(map) = slots
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .as_ref()
        {
            return Ok(Arc::clone(map));
        }
        let mut conn = conn.clone();
        let reply: Value = redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query_async(&mut conn)
            .await
            .map_err(|e| self.err("CLUSTER SLOTS", e))?;
        let mut map =
            parse_cluster_slots(reply).ok_or_else(|| RedisTierError::UnexpectedReply {
                endpoint: self.endpoint.clone(),
                op: "CLUSTER SLOTS",
                detail: "not a slot map".to_owned(),
            })?;
        if let Some(template) = lean {
            for (host, port, pool) in &mut map.masters {
                *pool = Some(lean::LeanPool::new(lean::Endpoint {
                    // An empty host means "the address you reached me at".
                    host: if host.is_empty() {
                        template.host.clone()
                    } else {
                        host.clone()
                    },
                    port: *port,
                    db: 0,
                    ..template.clone()
                }));
            }
        }
        let map = Arc::new(map);
        *slots.write().unwrap_or_else(PoisonError::into_inner) = Some(Arc::clone(&map));
        Ok(map)
    }

    fn forget_slot_map(&self) {
        if let Backend::Cluster { slots, .. } = &self.backend {
            *slots.write().unwrap_or_else(PoisonError::into_inner) = None;
        }
    }

    async fn exists_cluster(&self, keys: &[OffloadKey]) -> Result<Vec<bool>> {
        let conn = self.cluster().await?;
        let map = self.slot_map(&conn).await?;
        let groups = self.group_by_master(&map, keys.iter());
        let mut found = vec![false; keys.len()];
        let calls: Vec<_> = groups
            .iter()
            .enumerate()
            .filter(|(_, g)| !g.is_empty())
            .map(|(master, group)| {
                let pool = map.masters.get(master).and_then(|m| m.2.as_ref());
                self.exists_cluster_group(&conn, pool, keys, group)
            })
            .collect();
        let group_answers = join_all(calls).await;
        for (group, answer) in groups.iter().filter(|g| !g.is_empty()).zip(group_answers) {
            for (&(pos, _), present) in group.iter().zip(answer?) {
                found[pos] = present;
            }
        }
        Ok(found)
    }

    /// Positions of `keys`, with their slots, grouped by the master owning
    /// the slot; the last group holds keys of slots without a known owner.
    fn group_by_master<'a>(
        &self,
        map: &SlotMap,
        keys: impl Iterator<Item = &'a OffloadKey>,
    ) -> Vec<Vec<(usize, u16)>> {
        let mut groups: Vec<Vec<(usize, u16)>> = vec![Vec::new(); map.masters.len() + 1];
        for (pos, key) in keys.enumerate() {
            let slot = self.slots.slot(key.as_bytes());
            groups[map.owner(slot).unwrap_or(map.masters.len())].push((pos, slot));
        }
        groups
    }

    /// One master's keys: pipelines routed to the master owning the group's
    /// first slot; on failure, one command per key through the client's own
    /// routing (which follows MOVED / ASK).
    async fn exists_cluster_group(
        &self,
        conn: &ClusterConnection,
        lean: Option<&lean::LeanPool>,
        keys: &[OffloadKey],
        group: &[(usize, u16)],
    ) -> Result<Vec<bool>> {
        let chunks: Vec<_> = group
            .chunks(self.config.pipeline_chunk)
            .map(|chunk| {
                let mut conn = conn.clone();
                async move {
                    let chunk_keys = chunk.iter().map(|&(pos, _)| &keys[pos]);
                    if let Some(found) = self.try_lean(lean, chunk_keys.clone()).await? {
                        return Ok(found);
                    }
                    let route = SingleNodeRoutingInfo::SpecificNode(Route::new(
                        chunk[0].1,
                        SlotAddr::Master,
                    ));
                    let pipe = self.exists_pipeline(chunk_keys);
                    // An error reply (MOVED...) is the client's error, to
                    // be asked again key by key; a broken reply is not.
                    let values = conn
                        .route_pipeline(pipe, 0, chunk.len() + 1, route)
                        .await
                        .and_then(|values| Value::Array(values).extract_error())
                        .map_err(|e| self.err("EXISTS pipeline", e))?;
                    let Value::Array(values) = values else {
                        return Err(self.unexpected("EXISTS pipeline", "not an array"));
                    };
                    self.exists_answers(values, chunk.len())
                }
            })
            .collect();
        let mut answers =
            futures_util::stream::iter(chunks).buffered(self.config.max_chunks_in_flight);
        let mut found = Vec::with_capacity(group.len());
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
        let Some(first_error) = failed else {
            return self.check_len(found, group.len());
        };
        tracing::debug!(endpoint = %self.endpoint, error = %first_error, keys = group.len(), "cluster pipeline failed; asking key by key");
        self.forget_slot_map();
        let singles: Vec<_> = group
            .iter()
            .map(|&(pos, _)| {
                let mut conn = conn.clone();
                let cmd = redis::cmd("EXISTS").arg(self.full_key(&keys[pos])).clone();
                async move { cmd.query_async::<i64>(&mut conn).await }
            })
            .collect();
        let mut found = Vec::with_capacity(group.len());
        let mut answers = futures_util::stream::iter(singles).buffered(self.config.pipeline_chunk);
        while let Some(answer) = answers.next().await {
            let n = answer.map_err(|e| self.err("EXISTS", e))?;
            found.push(
                lean::exists_answer(n)
                    .ok_or_else(|| self.unexpected("EXISTS", &format!("answer {n}")))?,
            );
        }
        Ok(found)
    }

    /// Stores `payload` under `key`, with an optional time to live.
    ///
    /// # Errors
    /// A classified [`RedisTierError`].
    pub async fn store(
        &self,
        key: &OffloadKey,
        payload: &[u8],
        ttl: Option<Duration>,
    ) -> Result<()> {
        let mut cmd = redis::cmd("SET");
        cmd.arg(self.full_key(key)).arg(payload);
        if let Some(ttl) = ttl {
            cmd.arg("PX").arg(ttl.as_millis().max(1) as u64);
        }
        let _: Value = self.query("SET", &cmd).await?;
        Ok(())
    }

    /// Stores `payload` under `key` only if the key is absent; returns
    /// whether it was stored.
    ///
    /// # Errors
    /// A classified [`RedisTierError`].
    pub async fn store_nx(
        &self,
        key: &OffloadKey,
        payload: &[u8],
        ttl: Option<Duration>,
    ) -> Result<bool> {
        let mut cmd = redis::cmd("SET");
        cmd.arg(self.full_key(key)).arg(payload).arg("NX");
        if let Some(ttl) = ttl {
            cmd.arg("PX").arg(ttl.as_millis().max(1) as u64);
        }
        let reply: Option<String> = self.query("SET NX", &cmd).await?;
        Ok(reply.is_some())
    }

    /// Stores many blocks: one pipeline per chunk, on a cluster one per chunk
    /// of each master's keys, masters in parallel (a chunk whose pipeline
    /// fails, as during resharding, is stored key by key, following MOVED).
    ///
    /// # Errors
    /// A classified [`RedisTierError`]; some blocks may be stored.
    pub async fn store_many(
        &self,
        blocks: &[(OffloadKey, Vec<u8>)],
        ttl: Option<Duration>,
    ) -> Result<()> {
        match &self.backend {
            Backend::Single { .. } => {
                let conn = self.bounded("connect", self.single()).await?;
                for chunk in blocks.chunks(self.config.pipeline_chunk) {
                    let pipe = self.set_pipeline(chunk.iter(), ttl);
                    let mut conn = conn.clone();
                    self.bounded("SET pipeline", async {
                        pipe.query_async::<()>(&mut conn)
                            .await
                            .map_err(|e| self.err("SET pipeline", e))
                    })
                    .await?;
                }
                Ok(())
            }
            Backend::Cluster { .. } => {
                let (conn, map) = self
                    .bounded("CLUSTER SLOTS", async {
                        let conn = self.cluster().await?;
                        let map = self.slot_map(&conn).await?;
                        Ok((conn, map))
                    })
                    .await?;
                let groups = self.group_by_master(&map, blocks.iter().map(|(key, _)| key));
                let stores: Vec<_> = groups
                    .iter()
                    .filter(|g| !g.is_empty())
                    .map(|group| self.store_cluster_group(&conn, blocks, group, ttl))
                    .collect();
                join_all(stores).await.into_iter().collect()
            }
        }
    }

    /// One SET per block, in order, with the TTL if any.
    fn set_pipeline<'a>(
        &self,
        blocks: impl ExactSizeIterator<Item = &'a (OffloadKey, Vec<u8>)>,
        ttl: Option<Duration>,
    ) -> Pipeline {
        let mut pipe = Pipeline::with_capacity(blocks.len());
        for (key, payload) in blocks {
            let cmd = pipe
                .cmd("SET")
                .arg(self.full_key(key))
                .arg(payload.as_slice());
            if let Some(ttl) = ttl {
                cmd.arg("PX").arg(ttl.as_millis().max(1) as u64);
            }
        }
        pipe
    }

    /// One master's blocks, a routed SET pipeline per chunk.
    async fn store_cluster_group(
        &self,
        conn: &ClusterConnection,
        blocks: &[(OffloadKey, Vec<u8>)],
        group: &[(usize, u16)],
        ttl: Option<Duration>,
    ) -> Result<()> {
        for chunk in group.chunks(self.config.pipeline_chunk) {
            let pipe = self.set_pipeline(chunk.iter().map(|&(pos, _)| &blocks[pos]), ttl);
            let route =
                SingleNodeRoutingInfo::SpecificNode(Route::new(chunk[0].1, SlotAddr::Master));
            let mut c = conn.clone();
            let stored = self
                .bounded("SET pipeline", async {
                    c.route_pipeline(pipe, 0, chunk.len(), route)
                        .await
                        .map_err(|e| self.err("SET pipeline", e))
                })
                .await;
            if let Err(e) = stored {
                tracing::debug!(endpoint = %self.endpoint, error = %e, keys = chunk.len(), "cluster SET pipeline failed; storing key by key");
                self.forget_slot_map();
                let stores: Vec<_> = chunk
                    .iter()
                    .map(|&(pos, _)| self.store(&blocks[pos].0, &blocks[pos].1, ttl))
                    .collect();
                let results = futures_util::stream::iter(stores)
                    .buffer_unordered(self.config.pipeline_chunk)
                    .collect::<Vec<_>>()
                    .await;
                results.into_iter().collect::<Result<()>>()?;
            }
        }
        Ok(())
    }

    /// The payload of `key`, or `None` if absent.
    ///
    /// # Errors
    /// A classified [`RedisTierError`].
    pub async fn load(&self, key: &OffloadKey) -> Result<Option<Vec<u8>>> {
        self.query("GET", redis::cmd("GET").arg(self.full_key(key)))
            .await
    }

    /// Removes `key`; returns whether it existed.
    ///
    /// # Errors
    /// A classified [`RedisTierError`].
    pub async fn remove(&self, key: &OffloadKey) -> Result<bool> {
        let n: i64 = self
            .query("DEL", redis::cmd("DEL").arg(self.full_key(key)))
            .await?;
        Ok(n > 0)
    }

    /// Removes many keys; returns how many existed.
    ///
    /// # Errors
    /// A classified [`RedisTierError`].
    pub async fn remove_many(&self, keys: &[OffloadKey]) -> Result<u64> {
        let mut removed = 0;
        for key in keys {
            removed += u64::from(self.remove(key).await?);
        }
        Ok(removed)
    }

    /// Answers PING: checks connectivity and credentials.
    ///
    /// # Errors
    /// A classified [`RedisTierError`].
    pub async fn ping(&self) -> Result<()> {
        let _: String = self.query("PING", &redis::cmd("PING")).await?;
        Ok(())
    }

    async fn query<T: redis::FromRedisValue>(
        &self,
        op: &'static str,
        cmd: &redis::Cmd,
    ) -> Result<T> {
        self.bounded(op, async {
            match &self.backend {
                Backend::Single { .. } => {
                    let mut conn = self.single().await?;
                    cmd.query_async(&mut conn)
                        .await
                        .map_err(|e| self.err(op, e))
                }
                Backend::Cluster { .. } => {
                    let mut conn = self.cluster().await?;
                    cmd.query_async(&mut conn)
                        .await
                        .map_err(|e| self.err(op, e))
                }
            }
        })
        .await
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

/// Parses a `CLUSTER SLOTS` reply: `[[start, end, [host, port, id], replicas...], ...]`.
fn parse_cluster_slots(reply: Value) -> Option<SlotMap> {
    let Value::Array(entries) = reply else {
        return None;
    };
    let mut masters: Vec<(String, u16, Option<lean::LeanPool>)> = Vec::new();
    let mut ranges = Vec::new();
    for entry in entries {
        let Value::Array(fields) = entry else {
            return None;
        };
        let mut fields = fields.into_iter();
        let start = redis::from_redis_value::<i64>(fields.next()?).ok()?;
        let end = redis::from_redis_value::<i64>(fields.next()?).ok()?;
        let Value::Array(master) = fields.next()? else {
            return None;
        };
        let mut master = master.into_iter();
        let host = redis::from_redis_value::<String>(master.next()?).ok()?;
        let port = u16::try_from(redis::from_redis_value::<i64>(master.next()?).ok()?).ok()?;
        let idx = match masters.iter().position(|m| m.0 == host && m.1 == port) {
            Some(i) => i,
            None => {
                masters.push((host, port, None));
                masters.len() - 1
            }
        };
        ranges.push((u16::try_from(start).ok()?, u16::try_from(end).ok()?, idx));
    }
    ranges.sort_unstable();
    Some(SlotMap { ranges, masters })
}

#[cold]
fn unreachable_backend() -> ! {
    unreachable!("backend checked by the caller")
}

/// Blocks are stored with `SET` (with `PX` when the configuration sets
/// [`ttl_ms`](RedisConfig::ttl_ms)), loaded with `GET` and removed with
/// `DEL`; `store_many` pipelines, per master on a cluster.
impl BlockStore for RedisTier {
    async fn store(&self, key: &OffloadKey, block: &[u8]) -> Result<(), TierError> {
        Ok(RedisTier::store(self, key, block, self.ttl()).await?)
    }

    async fn load(&self, key: &OffloadKey) -> Result<Option<Vec<u8>>, TierError> {
        Ok(RedisTier::load(self, key).await?)
    }

    async fn remove(&self, key: &OffloadKey) -> Result<(), TierError> {
        RedisTier::remove(self, key).await?;
        Ok(())
    }

    async fn store_many(&self, blocks: &[(OffloadKey, Vec<u8>)]) -> Result<(), TierError> {
        Ok(RedisTier::store_many(self, blocks, self.ttl()).await?)
    }

    async fn remove_many(&self, keys: &[OffloadKey]) -> Result<(), TierError> {
        RedisTier::remove_many(self, keys).await?;
        Ok(())
    }

    /// Named `redis` unless `config` names it.
    fn manager_config(&self, config: ManagerConfig) -> ManagerConfig {
        config.or_named("redis")
    }
}

impl RedisTier {
    fn ttl(&self) -> Option<Duration> {
        self.config.ttl_ms.map(Duration::from_millis)
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
