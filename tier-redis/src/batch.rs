//! The in-place batch forms of [`BlockStore`](kvtier_core::BlockStore) for
//! [`RedisTier`]: `store_batch` as pipelined `SET`s, `load_batch` as
//! pipelined `GET`s, one [`BlockOutcome`] per key.
//!
//! A batch is split by server ([`Shard`]s: one on a single server, one per
//! master on a cluster), each shard into chunks of at most
//! `pipeline_chunk` keys and [`CHUNK_BYTES`] of blocks, each chunk one
//! pipeline; shards run in parallel, up to `max_chunks_in_flight` chunks of
//! a shard at once. Each reply answers its own key: an error reply fails
//! that key only, a chunk whose pipeline failed (a connection lost, a
//! timeout) fails its keys only, and on a cluster those keys are asked
//! again one command each, the client following MOVED / ASK (not after a
//! timeout: a silent server fails its keys within one timeout). Each
//! pipeline, and each command asked again, is bounded by the response
//! timeout plus the connect timeout from when it starts, so a batch of any
//! size can finish while a silent server fails only its own keys.
//!
//! What redis-rs costs here: it parses each `GET` reply into a
//! `Value::BulkString(Vec<u8>)` (it has no way to read a bulk reply into a
//! buffer the caller gives), so a load allocates one `Vec` per block and
//! copies it into the region once, after the chunk's replies are in; the
//! `Vec` is dropped right after. A `SET` copies the block into the
//! command's arguments, and the pipeline packs the commands into one
//! buffer: the raw client's own cost, which the `kvbench data-path` Redis
//! baseline pays too.

use std::sync::Arc;

use futures_util::StreamExt;
use futures_util::future::join_all;
use kvtier_core::{BlockOutcome, LengthMismatch, OffloadKey, SharedTierError, TierError};
use redis::{Pipeline, Value};

use crate::error::RedisTierError;
use crate::route::{Placed, Shard, Target};
use crate::tier::RedisTier;

/// The most block bytes one pipeline carries (one block more when a single
/// block is larger): a chunk of 2 MiB blocks is four `SET`s or `GET`s, so
/// several pipelines are in flight and no reply is held much longer than
/// its copy takes.
pub(crate) const CHUNK_BYTES: usize = 8 << 20;

/// One key's reply: the value, or the error shared by the keys it failed.
pub(crate) type Reply = Result<Value, SharedTierError>;

/// A chunk of a shard: the first index in the shard of its keys, and the
/// keys.
type Chunk = (usize, Vec<Placed>);

impl RedisTier {
    /// `SET` of each block, under its name (prefix and layout) and with the
    /// configured TTL.
    pub(crate) async fn store_blocks(&self, blocks: &[(&OffloadKey, &[u8])]) -> Vec<BlockOutcome> {
        let keys: Vec<&OffloadKey> = blocks.iter().map(|&(key, _)| key).collect();
        let lens: Vec<usize> = blocks.iter().map(|(_, block)| block.len()).collect();
        self.per_key(
            "SET pipeline",
            &keys,
            &lens,
            |pos| {
                let (key, block) = blocks[pos];
                self.set_cmd(key, block)
            },
            |_| {
                |_: usize, reply: Reply| match reply {
                    Ok(_) => BlockOutcome::Done,
                    Err(err) => BlockOutcome::Failed(err),
                }
            },
        )
        .await
    }

    /// `GET` of each key, each payload copied into its region when its
    /// length is the region's.
    pub(crate) async fn load_blocks(
        &self,
        regions: &mut [(&OffloadKey, &mut [u8])],
    ) -> Vec<BlockOutcome> {
        let keys: Vec<&OffloadKey> = regions.iter().map(|(key, _)| *key).collect();
        let lens: Vec<usize> = regions.iter().map(|(_, region)| region.len()).collect();
        // Each shard's sink takes the regions of its own keys: disjoint
        // borrows, filled as the shard's replies come in.
        let mut slots: Vec<Option<&mut [u8]>> = regions
            .iter_mut()
            .map(|(_, region)| Some(&mut **region))
            .collect();
        self.per_key(
            "GET pipeline",
            &keys,
            &lens,
            |pos| self.key_cmd("GET", keys[pos]),
            |shard: &Shard| {
                let mut mine: Vec<Option<&mut [u8]>> = shard
                    .keys
                    .iter()
                    .map(|k| slots.get_mut(k.pos).and_then(Option::take))
                    .collect();
                move |i: usize, reply: Reply| {
                    let region = mine.get_mut(i).and_then(Option::take);
                    self.fill(region, reply)
                }
            },
        )
        .await
    }

    /// What one `GET` reply does to its region.
    fn fill(&self, region: Option<&mut [u8]>, reply: Reply) -> BlockOutcome {
        let Some(region) = region else {
            return BlockOutcome::failed(
                self.unexpected("GET pipeline", "a key answered twice")
                    .into(),
            );
        };
        match reply {
            Ok(Value::Nil) => BlockOutcome::Absent,
            Ok(Value::BulkString(block)) if block.len() == region.len() => {
                region.copy_from_slice(&block);
                BlockOutcome::Done
            }
            Ok(Value::BulkString(block)) => {
                BlockOutcome::failed(LengthMismatch::error(block.len(), region.len()))
            }
            Ok(_) => BlockOutcome::failed(
                self.unexpected(
                    "GET pipeline",
                    "a GET answer that is neither a payload nor nil",
                )
                .into(),
            ),
            Err(err) => BlockOutcome::Failed(err),
        }
    }

    /// Runs `command(pos)` for every key of the batch, one pipeline per
    /// chunk of each shard (see the module docs), and answers each key
    /// with what the sink of its shard makes of its reply. `sink(shard)`
    /// is called once per shard, before any command is sent; the sink gets
    /// the key's index in its shard and the reply, in the shard's order.
    async fn per_key<C, M, S>(
        &self,
        op: &'static str,
        keys: &[&OffloadKey],
        lens: &[usize],
        command: C,
        mut sink: M,
    ) -> Vec<BlockOutcome>
    where
        C: Fn(usize) -> redis::Cmd + Sync,
        M: FnMut(&Shard) -> S,
        S: FnMut(usize, Reply) -> BlockOutcome + Send,
    {
        let n = keys.len();
        if n == 0 {
            return Vec::new();
        }
        let shards = match self
            .bounded(op, async { Ok(self.conn.shards(keys).await) })
            .await
        {
            Ok(Ok(shards)) => shards,
            Ok(Err(e)) => return BlockOutcome::all_failed(n, self.conn_err(op, e).into()),
            Err(e) => return BlockOutcome::all_failed(n, e.into()),
        };
        let command = &command;
        let runs: Vec<_> = shards
            .iter()
            .map(|shard| {
                let sink = sink(shard);
                self.run_shard(op, shard, lens, command, sink)
            })
            .collect();
        let mut outcomes: Vec<Option<BlockOutcome>> = vec![None; n];
        for answered in join_all(runs).await {
            for (pos, outcome) in answered {
                if let Some(slot) = outcomes.get_mut(pos) {
                    *slot = Some(outcome);
                }
            }
        }
        outcomes
            .into_iter()
            .map(|outcome| {
                outcome.unwrap_or_else(|| {
                    BlockOutcome::failed(self.unexpected(op, "a key without an answer").into())
                })
            })
            .collect()
    }

    /// One shard's keys: its chunks' pipelines, then, on a cluster, the
    /// keys of failed chunks and error replies one command each. Answers
    /// `(position, outcome)` for every key of the shard.
    async fn run_shard<C, S>(
        &self,
        op: &'static str,
        shard: &Shard,
        lens: &[usize],
        command: &C,
        mut sink: S,
    ) -> Vec<(usize, BlockOutcome)>
    where
        C: Fn(usize) -> redis::Cmd + Sync,
        S: FnMut(usize, Reply) -> BlockOutcome + Send,
    {
        let target = &shard.target;
        let chunks = self.chunks(shard, lens);
        let pipelines: Vec<_> = chunks
            .into_iter()
            .map(|(first, chunk)| async move {
                let mut pipe = Pipeline::with_capacity(chunk.len());
                for k in &chunk {
                    pipe.add_command(command(k.pos));
                }
                let replies = self.pipeline_in_time(op, target, pipe, chunk.len()).await;
                (first, chunk, replies)
            })
            .collect();
        let mut answers =
            futures_util::stream::iter(pipelines).buffered(self.config.max_chunks_in_flight);
        let mut answered = Vec::with_capacity(shard.keys.len());
        // Keys asked again one command each (cluster only): index in the
        // shard, position in the batch.
        let mut again: Vec<(usize, usize)> = Vec::new();
        // A silent server (a timeout) is not asked again: its keys fail
        // within one timeout, not one per key.
        let asks_again = |e: &RedisTierError| {
            target.follows_redirects()
                && !matches!(
                    e,
                    RedisTierError::UnexpectedReply { .. } | RedisTierError::Timeout { .. }
                )
        };
        while let Some((first, chunk, replies)) = answers.next().await {
            match replies {
                Ok(values) => {
                    for (i, (&Placed { pos, .. }, value)) in chunk.iter().zip(values).enumerate() {
                        let reply = match value.extract_error() {
                            Ok(value) => Ok(value),
                            Err(e) => {
                                let e = self.err(op, e);
                                if asks_again(&e) {
                                    again.push((first + i, pos));
                                    continue;
                                }
                                Err(Arc::new(TierError::from(e)))
                            }
                        };
                        answered.push((pos, sink(first + i, reply)));
                    }
                }
                Err(e) if asks_again(&e) => {
                    again.extend(
                        chunk
                            .iter()
                            .enumerate()
                            .map(|(i, &Placed { pos, .. })| (first + i, pos)),
                    );
                }
                Err(e) => {
                    let e: SharedTierError = Arc::new(e.into());
                    for (i, &Placed { pos, .. }) in chunk.iter().enumerate() {
                        answered.push((pos, sink(first + i, Err(Arc::clone(&e)))));
                    }
                }
            }
        }
        drop(answers);
        if again.is_empty() {
            return answered;
        }
        tracing::debug!(endpoint = %self.endpoint, keys = again.len(), op, "cluster pipeline failed; asking key by key");
        self.conn.forget_routes();
        // Collected first: no lazy iterator is held across an await (the
        // future must be Send).
        let singles: Vec<_> = again
            .into_iter()
            .map(|(i, pos)| async move {
                let reply = self
                    .bounded(op, self.query::<Value>(op, command(pos)))
                    .await
                    .map_err(|e| Arc::new(TierError::from(e)));
                (i, pos, reply)
            })
            .collect();
        let mut answers =
            futures_util::stream::iter(singles).buffered(self.config.max_chunks_in_flight);
        while let Some((i, pos, reply)) = answers.next().await {
            answered.push((pos, sink(i, reply)));
        }
        answered
    }

    /// The shard's keys in chunks of at most `pipeline_chunk` keys and
    /// [`CHUNK_BYTES`] bytes (a larger block alone).
    fn chunks(&self, shard: &Shard, lens: &[usize]) -> Vec<Chunk> {
        let mut chunks: Vec<Chunk> = Vec::new();
        let mut bytes = 0;
        for (i, &key) in shard.keys.iter().enumerate() {
            let len = lens.get(key.pos).copied().unwrap_or(0);
            match chunks.last_mut() {
                Some((_, chunk))
                    if chunk.len() < self.config.pipeline_chunk && bytes + len <= CHUNK_BYTES =>
                {
                    chunk.push(key);
                    bytes += len;
                }
                _ => {
                    chunks.push((i, vec![key]));
                    bytes = len;
                }
            }
        }
        chunks
    }

    /// One pipeline to `target`, its replies one per command, bounded by
    /// the response timeout plus the connect timeout from now.
    async fn pipeline_in_time(
        &self,
        op: &'static str,
        target: &Target,
        pipe: Pipeline,
        replies: usize,
    ) -> Result<Vec<Value>, RedisTierError> {
        let values = self
            .bounded(op, async {
                self.conn
                    .pipeline_replies(target, pipe, replies)
                    .await
                    .map_err(|e| self.err(op, e))
            })
            .await?;
        crate::reply::one_per_command(values, replies)
            .map_err(|detail| self.unexpected(op, &detail))
    }
}
