//! Lookups: [`RedisTier::exists_many`] and [`Tier`], one EXISTS pipeline
//! per chunk, through the lean path when it is on and open, else redis-rs.

use kvtier_core::{OffloadKey, ReqContext, Tier, TierError};
use redis::{Pipeline, Value};

use crate::error::{RedisTierError, Result};
use crate::lean::{LeanError, LeanPool};
use crate::reply;
use crate::tier::RedisTier;

/// How lookup pipelines went: through the lean path, or back to redis-rs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PipelineStats {
    /// Pipelines answered by the lean path.
    pub lean: u64,
    /// Lean attempts that gave up (error reply, connection trouble), after
    /// which redis-rs answered.
    pub fallbacks: u64,
}

impl RedisTier {
    /// How lookup pipelines went so far (see `lean_pipelines` in
    /// [`RedisConfig`](crate::RedisConfig)).
    pub fn pipeline_stats(&self) -> PipelineStats {
        let (lean, fallbacks) = self.lean.counts();
        PipelineStats { lean, fallbacks }
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
                    if let Some(found) = self
                        .try_lean(
                            target.lean.as_deref(),
                            chunk.iter().map(|k| (keys[k.pos], k.tag)),
                        )
                        .await?
                    {
                        return Ok(found);
                    }
                    let pipe = self.exists_pipeline(chunk.iter().map(|k| keys[k.pos]));
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
                    reply::exists_answer(n)
                        .ok_or_else(|| self.unexpected("EXISTS", &format!("answer {n}")))
                },
            ),
        )
        .await
    }

    /// One chunk through the lean path; `Ok(None)` means "ask redis-rs".
    ///
    /// # Errors
    /// [`RedisTierError::UnexpectedReply`] when the server broke the
    /// protocol: redis-rs's answer would be an error too (its replies are
    /// checked with the same rule), so it is not asked.
    /// [`RedisTierError::Timeout`] when the server did not answer within
    /// the response timeout (or accept within the connect timeout): asking
    /// redis-rs would make the caller wait as long again, past the
    /// response timeout the call promises.
    async fn try_lean<'a>(
        &self,
        pool: Option<&LeanPool>,
        keys: impl ExactSizeIterator<Item = (&'a OffloadKey, Option<u16>)>,
    ) -> Result<Option<Vec<bool>>> {
        let Some(pool) = pool else {
            return Ok(None);
        };
        if !self.lean.is_open() {
            return Ok(None);
        }
        match pool.exists(&self.names, keys).await {
            Ok(found) => {
                self.lean.answered();
                Ok(Some(found))
            }
            Err(e) if e.is_protocol_violation() => Err(RedisTierError::UnexpectedReply {
                endpoint: self.endpoint.clone(),
                op: "EXISTS pipeline",
                detail: e.to_string(),
            }),
            Err(LeanError::Timeout) => Err(RedisTierError::Timeout {
                endpoint: self.endpoint.clone(),
                op: "EXISTS pipeline",
                source: redis::RedisError::from(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "no reply within the response timeout",
                )),
            }),
            Err(e) => {
                self.lean.fell_back(&e);
                tracing::debug!(endpoint = %self.endpoint, error = %e, "lean EXISTS pipeline gave up; asking redis-rs");
                Ok(None)
            }
        }
    }

    /// One EXISTS per key, in order, each command sized up front, then the
    /// end marker `TYPE <first name>` (as on the lean path; see
    /// [`reply::exists_answers`]).
    fn exists_pipeline<'a>(&self, keys: impl ExactSizeIterator<Item = &'a OffloadKey>) -> Pipeline {
        let mut pipe = Pipeline::with_capacity(keys.len() + 1);
        let mut name = Vec::with_capacity(self.names.len(64));
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

    /// [`reply::exists_answers`] as a tier error.
    fn exists_answers(&self, values: Vec<Value>, keys: usize) -> Result<Vec<bool>> {
        reply::exists_answers(values, keys)
            .map_err(|detail| self.unexpected("EXISTS pipeline", &detail))
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
