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
//! All of it runs on the tier's [`Io`] runtime (see [`crate::io`]).

use std::sync::Arc;
use std::time::Duration;

use kvtier_core::OffloadKey;
use redis::aio::{ConnectionLike, ConnectionManager, ConnectionManagerConfig};
use redis::{Client, Cmd, FromRedisValue, Pipeline, RedisResult, Value};
use tokio::sync::OnceCell;

use crate::cluster::Cluster;
use crate::io::Io;
use crate::lean::LeanPool;
use crate::route::{ConnError, Placed, Shard, Target};

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

    /// The runtime its connections are made and driven on.
    pub(crate) fn spawner(&self) -> &kvtier_core::Spawner {
        self.io.spawner()
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
                keys: (0..keys.len()).map(Placed::single).collect(),
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
        let values = self.pipeline_replies(target, pipe, replies).await?;
        match Value::Array(values).extract_error()? {
            Value::Array(values) => Ok(values),
            // extract_error keeps the shape it was given.
            other => Ok(vec![other]),
        }
    }

    /// Sends `pipe` (of `replies` commands) to `target`; its replies as
    /// they came, an error reply to one command
    /// ([`Value::ServerError`]) kept in its place for the caller to answer
    /// per command.
    pub(crate) async fn pipeline_replies(
        &self,
        target: &Target,
        pipe: Pipeline,
        replies: usize,
    ) -> RedisResult<Vec<Value>> {
        match &self.backend {
            Backend::Single(single) => {
                let mut conn = single.connection(&self.io).await?;
                self.io
                    .run(async move { conn.req_packed_commands(&pipe, 0, replies).await })
                    .await
            }
            Backend::Cluster(cluster) => {
                cluster
                    .pipeline(&self.io, target.route.unwrap_or(0), pipe, replies)
                    .await
            }
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
