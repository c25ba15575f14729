//! The in-place batch forms of [`BlockStore`](kvtier_core::BlockStore) for
//! [`S3Tier`]: one PutObject or GetObject per key, at most
//! `max_concurrent_requests` at once (and within the tier's shared limits),
//! one [`BlockOutcome`] per key.
//!
//! - **Stores.** The SDK sends a body it owns (`ByteStream` is `'static`),
//!   so each block is copied once from the caller's slice, when its request
//!   starts: at most `max_concurrent_requests` copies exist at once. A key
//!   given twice in a batch is put once, with its last block (two PUTs of
//!   one name at once may land in either order).
//! - **Loads.** The request runs on the tier's I/O runtime (see `tier.rs`
//!   for why); the body's chunks come back over a small channel as the
//!   connection reads them and are copied straight into the region, at
//!   their offset: no body-sized buffer. The object's `Content-Length` is
//!   checked against the region's length before any byte is written, so a
//!   [`LengthMismatch`] leaves the region as it was. A body that ends short
//!   or runs long (a server breaking its own length) fails the key, its
//!   region's bytes then unspecified; nothing is written past the region.

use std::collections::HashMap;
use std::sync::Arc;

use futures_util::StreamExt;
use kvtier_core::{BlockOutcome, BlockStore, LengthMismatch, OffloadKey};
use tokio::sync::mpsc;

use crate::S3TierError;
use crate::requests::{Fetched, Result};
use crate::tier::{S3Tier, runtime_failed};

/// Body chunks that may wait between the connection and the copy.
const CHUNKS_QUEUED: usize = 16;

impl S3Tier {
    /// PutObject of each block, concurrently; one outcome per key.
    pub(crate) async fn store_blocks(&self, blocks: &[(&OffloadKey, &[u8])]) -> Vec<BlockOutcome> {
        // A key given twice is put once, with its last block: two PUTs of
        // one name at once may land in either order (and some servers mix
        // them up). Its earlier positions answer as its last.
        let mut last: HashMap<&OffloadKey, usize> = HashMap::with_capacity(blocks.len());
        for (i, &(key, _)) in blocks.iter().enumerate() {
            last.insert(key, i);
        }
        // Collected first (no lazy iterator held across an await: the
        // future must be Send); each block is copied when its request
        // starts, not here.
        let puts: Vec<_> = blocks
            .iter()
            .enumerate()
            .filter(|&(i, &(key, _))| last.get(key) == Some(&i))
            .map(|(i, &(key, block))| async move {
                let outcome = match self.store(key, block).await {
                    Ok(()) => BlockOutcome::Done,
                    Err(err) => BlockOutcome::failed(err),
                };
                (i, outcome)
            })
            .collect();
        let mut outcomes = self.each(puts, blocks.len()).await;
        for (i, &(key, _)) in blocks.iter().enumerate() {
            if let Some(&at) = last.get(key)
                && at != i
                && let Some(outcome) = outcomes.get(at).cloned()
            {
                outcomes[i] = outcome;
            }
        }
        outcomes
    }

    /// GetObject of each key, concurrently, each body streamed into its
    /// region; one outcome per key.
    pub(crate) async fn load_blocks(
        &self,
        regions: &mut [(&OffloadKey, &mut [u8])],
    ) -> Vec<BlockOutcome> {
        let n = regions.len();
        let gets: Vec<_> = regions
            .iter_mut()
            .enumerate()
            .map(|(i, (key, region))| async move { (i, self.load_into(key, region).await) })
            .collect();
        self.each(gets, n).await
    }

    /// Runs `requests`, at most `max_concurrent_requests` at once, and puts
    /// their outcomes in order.
    async fn each<F>(&self, requests: Vec<F>, n: usize) -> Vec<BlockOutcome>
    where
        F: Future<Output = (usize, BlockOutcome)>,
    {
        let mut outcomes: Vec<Option<BlockOutcome>> = vec![None; n];
        let mut running = futures_util::stream::iter(requests)
            .buffer_unordered(self.requests.config.max_concurrent_requests.max(1));
        while let Some((i, outcome)) = running.next().await {
            if let Some(slot) = outcomes.get_mut(i) {
                *slot = Some(outcome);
            }
        }
        outcomes
            .into_iter()
            .map(|o| {
                o.unwrap_or_else(|| {
                    BlockOutcome::failed(self.broken("a key without an answer").into())
                })
            })
            .collect()
    }

    /// One GetObject into `region`.
    async fn load_into(&self, key: &OffloadKey, region: &mut [u8]) -> BlockOutcome {
        let (tx, mut rx) = mpsc::channel::<Result<Fetched>>(CHUNKS_QUEUED);
        let requests = Arc::clone(&self.requests);
        let key = key.clone();
        // Aborted when dropped: a load dropped part way stops its request.
        let task = self.io.spawn(async move {
            let fetch = requests.get_streamed(&key, &tx);
            requests.logs.scope(fetch).await;
        });
        let first = rx.recv().await;
        let len = match first {
            Some(Ok(Fetched::Missing)) => return BlockOutcome::Absent,
            Some(Ok(Fetched::Found(len))) => len,
            Some(Ok(Fetched::Chunk(_))) => {
                return BlockOutcome::failed(self.broken("a body before its object").into());
            }
            Some(Err(e)) => return BlockOutcome::failed(e.into()),
            None => {
                // The task ended without a word: the runtime shut down, or
                // the request panicked.
                let err = match task.await {
                    Err(e) => runtime_failed(
                        &self.requests.config,
                        &self.requests.endpoint,
                        "GetObject",
                        &e,
                    ),
                    Ok(()) => self.broken("GetObject ended without an answer"),
                };
                return BlockOutcome::failed(err.into());
            }
        };
        if let Some(stored) = len
            && usize::try_from(stored).ok() != Some(region.len())
        {
            let stored = usize::try_from(stored).unwrap_or(usize::MAX);
            return BlockOutcome::failed(LengthMismatch::error(stored, region.len()));
        }
        let mut at = 0;
        while let Some(message) = rx.recv().await {
            match message {
                Ok(Fetched::Chunk(chunk)) => {
                    let Some(target) = region.get_mut(at..at + chunk.len()) else {
                        return BlockOutcome::failed(match len {
                            Some(_) => self.broken("a body longer than its Content-Length").into(),
                            None => LengthMismatch::error(at + chunk.len(), region.len()),
                        });
                    };
                    target.copy_from_slice(&chunk);
                    at += chunk.len();
                }
                Ok(_) => return BlockOutcome::failed(self.broken("a second answer").into()),
                Err(e) => return BlockOutcome::failed(e.into()),
            }
        }
        if at != region.len() {
            return BlockOutcome::failed(match len {
                Some(_) => self.body_cut(at).into(),
                None => LengthMismatch::error(at, region.len()),
            });
        }
        BlockOutcome::Done
    }

    fn broken(&self, detail: &str) -> S3TierError {
        S3TierError::Other {
            bucket: self.requests.config.bucket.clone(),
            endpoint: self.requests.endpoint.clone(),
            op: "GetObject",
            detail: detail.to_owned(),
        }
    }

    fn body_cut(&self, at: usize) -> S3TierError {
        S3TierError::Unavailable {
            bucket: self.requests.config.bucket.clone(),
            endpoint: self.requests.endpoint.clone(),
            op: "GetObject body",
            detail: format!("the body ended after {at} bytes, short of its Content-Length"),
        }
    }
}
