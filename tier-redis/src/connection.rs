//! One connection type over a single server or a Redis Cluster, driven on
//! an I/O runtime the tier owns.
//!
//! The tier's operations never ask which backend they talk to (as OpenDAL's
//! Redis service wraps both in one connection): they split a batch into
//! [`Shard`]s, the keys one server holds, send one pipeline per chunk of a
//! shard with [`Connection::pipeline`], and single commands with
//! [`Connection::query`], which a cluster client routes by key. Cluster
//! specifics (the slot map, shards by master) live in [`crate::cluster`].
//!
//! # Runtime
//!
//! redis-rs drives each connection from a task spawned on the runtime that
//! made it, and its `ConnectionManager` reconnects from the runtime of the
//! call that saw the connection drop; the lean path's sockets are
//! registered with the reactor of the runtime that opened them. A tier first
//! used from a short-lived runtime (a store from a request handler's
//! `block_on`) would keep its connections there after that runtime is gone,
//! and the lookup manager's worker would be left on a connection whose
//! driver is dead: every lookup an error. So every connection is made on
//! [`Io`]: a one-thread runtime the tier starts with itself and stops,
//! without waiting, when it drops, or a runtime the caller passes in (a
//! [`Spawner`], which may be the one its lookup managers share). Callers on
//! any runtime use those connections through channels and wakers. Commands on the single server's
//! `ConnectionManager` run on [`Io`] too, so its reconnections do; a
//! cluster connection reconnects inside its own driver task, already there.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use kvtier_core::Spawner;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::{Client, Cmd, FromRedisValue, Pipeline, RedisError, RedisResult, Value};
use tokio::sync::OnceCell;

use crate::cluster::Cluster;
use crate::lean::LeanPool;
use kvtier_core::OffloadKey;

/// The runtime every connection is made and driven on: by default one
/// the tier starts (a [`Spawner::dedicated`] thread, stopped without
/// blocking when the tier drops), or the caller's ([`RedisTier::with_spawner`](crate::RedisTier::with_spawner)).
pub(crate) struct Io {
    spawner: Spawner,
}

impl Io {
    /// On `spawner`'s runtime.
    pub(crate) fn new(spawner: Spawner) -> Self {
        Self { spawner }
    }

    /// Runs `fut` on the I/O runtime; dropping the returned future aborts
    /// it. If that runtime has shut down (a caller's runtime dropped
    /// before the tier), the call fails as a dropped connection.
    pub(crate) async fn run<T: Send + 'static>(
        &self,
        fut: impl Future<Output = RedisResult<T>> + Send + 'static,
    ) -> RedisResult<T> {
        match self.spawner.spawn(fut).await {
            Ok(result) => result,
            Err(e) => Err(RedisError::from(std::io::Error::new(
                std::io::ErrorKind::BrokenPipe,
                format!("the tier's I/O runtime ended the task: {e}"),
            ))),
        }
    }

    /// The spawner itself, for the lean path's connections.
    pub(crate) fn spawner(&self) -> &Spawner {
        &self.spawner
    }
}

/// Why a connection-level call failed; the tier names the operation.
#[derive(Debug)]
pub(crate) enum ConnError {
    /// The client's error (from the server or the connection).
    Client(RedisError),
    /// A reply of the wrong shape.
    Reply(String),
}

impl From<RedisError> for ConnError {
    fn from(e: RedisError) -> Self {
        Self::Client(e)
    }
}

/// The keys of one batch that one server holds.
#[derive(Debug)]
pub(crate) struct Shard {
    /// Positions of the keys in the batch, with their slots (0 on a single
    /// server).
    pub(crate) keys: Vec<(usize, u16)>,
    /// Where they go.
    pub(crate) target: Target,
}

/// The server of a [`Shard`]: where its pipelines go.
#[derive(Debug, Clone)]
pub(crate) struct Target {
    /// The lean path's connections to this server, if it is on.
    pub(crate) lean: Option<Arc<LeanPool>>,
    /// On a cluster, the slot whose master gets the pipelines; a key whose
    /// slot moved answers MOVED, and the shard is then asked again key by
    /// key. `None` on a single server, which holds every slot.
    pub(crate) route: Option<u16>,
}

impl Target {
    /// Whether a failed pipeline is asked again one command per key, with
    /// the cluster client following MOVED / ASK.
    pub(crate) fn follows_redirects(&self) -> bool {
        self.route.is_some()
    }

    /// Whether one multi-key command (MGET) may span the shard's keys: a
    /// single server holds every slot, a cluster master answers CROSSSLOT.
    pub(crate) fn spans_slots(&self) -> bool {
        self.route.is_none()
    }
}

/// A single server or a Redis Cluster, behind one set of operations.
pub(crate) struct Connection {
    backend: Backend,
    io: Io,
}

enum Backend {
    Single(Box<Single>),
    Cluster(Box<Cluster>),
}

/// A single server: one multiplexed, reconnecting connection, and the lean
/// path's own.
pub(crate) struct Single {
    client: Client,
    config: ConnectionManagerConfig,
    conn: OnceCell<ConnectionManager>,
    lean: Option<Arc<LeanPool>>,
}

impl Single {
    pub(crate) fn new(
        client: Client,
        connect_timeout: Duration,
        response_timeout: Duration,
        reconnect_retries: usize,
        lean: Option<Arc<LeanPool>>,
    ) -> Self {
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(connect_timeout))
            .set_response_timeout(Some(response_timeout))
            .set_number_of_retries(reconnect_retries)
            .set_max_delay(connect_timeout);
        Self {
            client,
            config,
            conn: OnceCell::new(),
            lean,
        }
    }

    async fn connection(&self, io: &Io) -> RedisResult<ConnectionManager> {
        self.conn
            .get_or_try_init(|| {
                let client = self.client.clone();
                let config = self.config.clone();
                io.run(ConnectionManager::new_with_config(client, config))
            })
            .await
            .cloned()
    }
}

impl Connection {
    /// A single server.
    pub(crate) fn single(single: Single, io: Io) -> Self {
        Self {
            backend: Backend::Single(Box::new(single)),
            io,
        }
    }

    /// A Redis Cluster.
    pub(crate) fn cluster(cluster: Cluster, io: Io) -> Self {
        Self {
            backend: Backend::Cluster(Box::new(cluster)),
            io,
        }
    }

    /// `keys` split by the server that holds them; on a cluster, from the
    /// cached slot map (fetched with `CLUSTER SLOTS` when there is none).
    pub(crate) async fn shards(&self, keys: &[&OffloadKey]) -> Result<Vec<Shard>, ConnError> {
        match &self.backend {
            Backend::Single(single) => Ok(vec![Shard {
                keys: (0..keys.len()).map(|pos| (pos, 0)).collect(),
                target: Target {
                    lean: single.lean.clone(),
                    route: None,
                },
            }]),
            Backend::Cluster(cluster) => cluster.shards(&self.io, keys).await,
        }
    }

    /// Sends `pipe` (of `replies` commands) to `target`; an error reply in
    /// it is an error.
    pub(crate) async fn pipeline(
        &self,
        target: &Target,
        pipe: Pipeline,
        replies: usize,
    ) -> RedisResult<Vec<Value>> {
        let values = match &self.backend {
            Backend::Single(single) => {
                let mut conn = single.connection(&self.io).await?;
                self.io
                    .run(async move { conn.req_packed_commands(&pipe, 0, replies).await })
                    .await?
            }
            Backend::Cluster(cluster) => {
                cluster
                    .pipeline(&self.io, target.route.unwrap_or(0), pipe, replies)
                    .await?
            }
        };
        match Value::Array(values).extract_error()? {
            Value::Array(values) => Ok(values),
            // extract_error keeps the shape it was given.
            other => Ok(vec![other]),
        }
    }

    /// One command, routed by its key on a cluster.
    pub(crate) async fn query<T: FromRedisValue + Send + 'static>(
        &self,
        cmd: Cmd,
    ) -> RedisResult<T> {
        match &self.backend {
            Backend::Single(single) => {
                let mut conn = single.connection(&self.io).await?;
                self.io
                    .run(async move { cmd.query_async(&mut conn).await })
                    .await
            }
            Backend::Cluster(cluster) => {
                let mut conn = cluster.connection(&self.io).await?;
                cmd.query_async(&mut conn).await
            }
        }
    }

    /// Forgets cached routes (the cluster's slot map), after a pipeline
    /// failed as during resharding.
    pub(crate) fn forget_routes(&self) {
        if let Backend::Cluster(cluster) = &self.backend {
            cluster.forget();
        }
    }
}
