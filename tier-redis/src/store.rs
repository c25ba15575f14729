//! Stores: [`BlockStore`] for [`RedisTier`] (`SET`, `GET` / `MGET`,
//! `DEL`, one pipeline per chunk of each shard) and `SET NX`.

use std::sync::Arc;

use kvtier_core::{
    AsyncLookupManager, BlockOutcome, BlockStore, ManagerConfig, ManagerError, OffloadKey,
    TierError,
};
use redis::{Pipeline, Value};

use crate::error::Result;
use crate::reply;
use crate::route::Placed;
use crate::tier::RedisTier;

impl RedisTier {
    /// Stores `payload` under `key` only if the key is absent, with the
    /// configured [`ttl_ms`](crate::RedisConfig::ttl_ms); returns whether it was
    /// stored (`SET NX`).
    ///
    /// # Errors
    /// A classified [`RedisTierError`](crate::RedisTierError).
    pub async fn store_nx(&self, key: &OffloadKey, payload: &[u8]) -> Result<bool> {
        let mut cmd = self.set_cmd(key, payload);
        cmd.arg("NX");
        let reply: Option<String> = self.bounded("SET NX", self.query("SET NX", cmd)).await?;
        Ok(reply.is_some())
    }

    /// `SET <key's name> <payload>`, with `PX` when a TTL is configured.
    pub(crate) fn set_cmd(&self, key: &OffloadKey, payload: &[u8]) -> redis::Cmd {
        let mut cmd = self.key_cmd("SET", key);
        cmd.arg(payload);
        if let Some(ttl) = self.config.ttl_ms {
            cmd.arg("PX").arg(ttl);
        }
        cmd
    }
}

/// Blocks are stored with `SET` (with `PX` when the configuration sets
/// [`ttl_ms`](crate::RedisConfig::ttl_ms)), loaded with `GET` and removed with
/// `DEL`. The batched forms send one pipeline per chunk of
/// [`pipeline_chunk`](crate::RedisConfig::pipeline_chunk) keys (`MGET` on a single
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
        Ok(reply::payload(value).map_err(|detail| self.unexpected("GET", &detail))?)
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
                .map(reply::payload)
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
                        for &Placed { pos, .. } in &chunk {
                            mget.arg(self.full_key(keys[pos]));
                        }
                        let mut pipe = Pipeline::with_capacity(1);
                        pipe.add_command(mget);
                        let values = self
                            .conn
                            .pipeline(&target, pipe, 1)
                            .await
                            .map_err(|e| self.err("MGET", e))?;
                        let values = reply::mget_values(values, chunk.len())
                            .map_err(|detail| self.unexpected("MGET", &detail))?;
                        payloads(values)
                    },
                    |pos| async move {
                        let value: Value =
                            self.query("GET", self.key_cmd("GET", keys[pos])).await?;
                        reply::payload(value).map_err(|detail| self.unexpected("GET", &detail))
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

    /// Pipelined `SET`s, one outcome per key; see the crate docs.
    async fn store_batch(&self, blocks: &[(&OffloadKey, &[u8])]) -> Vec<BlockOutcome> {
        self.store_blocks(blocks).await
    }

    /// Pipelined `GET`s, each payload copied into its region; see the
    /// crate docs.
    async fn load_batch(&self, regions: &mut [(&OffloadKey, &mut [u8])]) -> Vec<BlockOutcome> {
        self.load_blocks(regions).await
    }

    /// Named `redis` unless `config` names it.
    fn manager_config(&self, config: ManagerConfig) -> ManagerConfig {
        config.or_named("redis")
    }

    /// Starts a lookup manager whose worker runs on the tier's own runtime
    /// when the tier has a dedicated one ([`RedisTier::new`]: its one I/O
    /// thread; or [`RedisTier::with_spawner`] with a
    /// [`Spawner::dedicated`](kvtier_core::Spawner::dedicated)) and `config`
    /// asks for the default single worker thread: a pipeline's replies then
    /// reach the call waiting for them without a hand-over between threads,
    /// and no thread is started for the manager. Otherwise, with a caller's
    /// runtime ([`Spawner::from_handle`](kvtier_core::Spawner::from_handle)),
    /// which the tier cannot know is driven, or with `worker_threads` above 1,
    /// the manager starts a runtime of its own, as [`AsyncLookupManager::new`]
    /// does; `AsyncLookupManager::from_arc(tier, tier.manager_config(config))`
    /// always does.
    ///
    /// Measured with `kvbench w3` on a 3-master cluster sharing 2 cores
    /// with the client (2026-12-08, five alternating pairs): the client's
    /// CPU per key 0.12 to 0.16 µs against 0.14 to 0.17 with a thread each,
    /// and 0.76 to 0.86 of the matched redis-benchmark against 0.72 to 0.83.
    ///
    /// # Errors
    /// As [`AsyncLookupManager::with_spawner`] on the tier's runtime, as
    /// [`AsyncLookupManager::from_arc`] on a runtime of its own.
    fn manager(
        self: &Arc<Self>,
        config: ManagerConfig,
    ) -> std::result::Result<AsyncLookupManager<Self>, ManagerError> {
        let config = self.manager_config(config);
        if self.spawner().is_dedicated() && config.worker_threads <= 1 {
            AsyncLookupManager::with_spawner(Arc::clone(self), config, self.spawner())
        } else {
            AsyncLookupManager::from_arc(Arc::clone(self), config)
        }
    }
}
