//! The command and pipeline core of [`RedisTier`]: names and commands of
//! keys, one command, pipelines per chunk of each shard (asked again key by
//! key on a cluster when one fails), the deadline of a whole operation, and
//! errors named with the endpoint.

use std::future::Future;
use std::time::Duration;

use futures_util::StreamExt;
use futures_util::future::join_all;
use kvtier_core::OffloadKey;
use redis::{Pipeline, Value};

use crate::error::{RedisTierError, Result};
use crate::reply;
use crate::route::{ConnError, Placed, Target};
use crate::tier::RedisTier;

impl RedisTier {
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

    /// Runs `chunk` on every chunk of `pipeline_chunk` keys of every shard
    /// (shards in parallel, up to `max_chunks_in_flight` chunks of a shard
    /// at once) and puts the answers back in key order.
    ///
    /// When a chunk of a cluster shard fails (MOVED during resharding, a
    /// master down), the slot map is dropped and that shard's keys are
    /// asked one command at a time with `one`, the cluster client following
    /// MOVED / ASK. A reply of the wrong shape is never asked again.
    pub(crate) async fn per_shard<T, C, CF, O, OF>(
        &self,
        op: &'static str,
        keys: &[&OffloadKey],
        chunk: C,
        one: O,
    ) -> Result<Vec<T>>
    where
        T: Send,
        C: Fn(Target, Vec<Placed>) -> CF + Sync,
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
            let singles: Vec<_> = shard.keys.iter().map(|k| one(k.pos)).collect();
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
            for (k, value) in shard.keys.iter().zip(answer) {
                if let Some(slot) = ordered.get_mut(k.pos) {
                    *slot = Some(value);
                }
            }
        }
        ordered
            .into_iter()
            .collect::<Option<Vec<T>>>()
            .ok_or_else(|| self.unexpected(op, "a key without an answer"))
    }

    /// Sends a pipeline of one command per key of `chunk` (built by
    /// `command`), and checks that every key got a reply.
    pub(crate) async fn key_pipeline(
        &self,
        op: &'static str,
        target: &Target,
        chunk: &[Placed],
        mut command: impl FnMut(&mut Pipeline, usize),
    ) -> Result<Vec<Value>> {
        let mut pipe = Pipeline::with_capacity(chunk.len());
        for k in chunk {
            command(&mut pipe, k.pos);
        }
        let values = self
            .conn
            .pipeline(target, pipe, chunk.len())
            .await
            .map_err(|e| self.err(op, e))?;
        reply::one_per_command(values, chunk.len()).map_err(|detail| self.unexpected(op, &detail))
    }

    /// One command, routed by its key on a cluster.
    pub(crate) async fn query<T: redis::FromRedisValue + Send + 'static>(
        &self,
        op: &'static str,
        cmd: redis::Cmd,
    ) -> Result<T> {
        self.conn.query(cmd).await.map_err(|e| self.err(op, e))
    }

    /// Bounds a whole operation by the response timeout (plus the connect
    /// timeout) from its first poll, whatever the client's retries do.
    pub(crate) async fn bounded<T>(
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

    /// The name of `key` (see [`Names`](crate::names::Names)).
    pub(crate) fn full_key(&self, key: &OffloadKey) -> Vec<u8> {
        self.names.name(key.as_bytes())
    }

    /// Writes the name of `key` into `buf` (cleared first): one buffer
    /// reused for a whole batch instead of an allocation per key.
    pub(crate) fn write_full_key(&self, buf: &mut Vec<u8>, key: &OffloadKey) {
        buf.clear();
        self.names.write(buf, key.as_bytes());
    }

    /// `name <key's name>`.
    pub(crate) fn key_cmd(&self, name: &str, key: &OffloadKey) -> redis::Cmd {
        let mut cmd = redis::cmd(name);
        cmd.arg(self.full_key(key));
        cmd
    }

    /// A client error, classified and named with the endpoint.
    pub(crate) fn err(&self, op: &'static str, e: redis::RedisError) -> RedisTierError {
        RedisTierError::classify(&self.endpoint, op, e)
    }

    pub(crate) fn conn_err(&self, op: &'static str, e: ConnError) -> RedisTierError {
        match e {
            ConnError::Client(e) => self.err(op, e),
            ConnError::Reply(detail) => self.unexpected(op, &detail),
        }
    }

    /// A reply of the wrong shape.
    pub(crate) fn unexpected(&self, op: &'static str, detail: &str) -> RedisTierError {
        RedisTierError::UnexpectedReply {
            endpoint: self.endpoint.clone(),
            op,
            detail: detail.to_owned(),
        }
    }
}
