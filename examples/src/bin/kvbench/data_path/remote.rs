//! The Redis and S3 rows of data-path: the tier behind the transfer queue,
//! next to its raw client at the same concurrency.
//!
//! - **Redis** (single node, `KVTIER_REDIS_URL`): the raw side is redis-rs
//!   itself, one multiplexed connection, `concurrency` pipelines at once,
//!   each the `SET`s (or `GET`s) of one job's blocks, under a prefix of its
//!   own; a `GET`'s payload is copied into its row, as the tier does (the
//!   rows are checked after each load).
//! - **S3** (`KVTIER_S3_ENDPOINT`, `KVTIER_S3_BUCKET`): the raw side is an
//!   aws-sdk-s3 client, [`S3_REQUESTS`] PUTs (or GETs) in flight, the
//!   tier's `max_concurrent_requests` the same; a PUT body is a copy of the
//!   row (the SDK wants an owned body, the tier copies too), a GET body is
//!   collected and copied into the row.

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use aws_sdk_s3::primitives::ByteStream;
use futures_util::StreamExt;
use futures_util::future::join_all;
use kvtier_core::{DynBlockStore, OffloadKey};
use kvtier_redis::{RedisConfig, RedisTier};
use kvtier_s3::{S3Config, S3Tier};
use serde_json::{Value, json};

use super::{Blocks, DataPathTier, JOB_BYTES};
use crate::Failure;

/// Requests in flight on the S3 rows, both sides.
pub(super) const S3_REQUESTS: usize = 16;

/// Jobs in flight on the Redis and S3 rows (the raw side's workers).
const JOBS: usize = 4;

/// A current-thread runtime for the raw client.
fn runtime() -> Result<tokio::runtime::Runtime, Failure> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?)
}

/// Rows `wave` of `blocks`, split into jobs of [`JOB_BYTES`]: for each, its
/// first row and its bytes.
fn jobs<'a>(bytes: &'a mut [u8], block: usize, wave: &Range<usize>) -> Vec<(usize, &'a mut [u8])> {
    let per_job = (JOB_BYTES / block).max(1);
    bytes
        .get_mut(wave.start * block..wave.end * block)
        .map(|b| {
            b.chunks_mut(per_job * block)
                .enumerate()
                .map(|(j, rows)| (wave.start + j * per_job, rows))
                .collect()
        })
        .unwrap_or_default()
}

pub(super) struct Redis {
    url: String,
    rt: tokio::runtime::Runtime,
    conn: redis::aio::MultiplexedConnection,
    tier: Option<Arc<RedisTier>>,
    prefix: String,
    raw_prefix: String,
    keys: Vec<OffloadKey>,
}

impl Redis {
    pub(super) fn new() -> Result<Self, Failure> {
        let url = std::env::var("KVTIER_REDIS_URL").map_err(|_| {
            "data-path's Redis rows need KVTIER_REDIS_URL: run `scripts/services.sh start` and `source .services/env`"
        })?;
        let rt = runtime()?;
        let client = redis::Client::open(url.as_str())?;
        let conn = rt.block_on(client.get_multiplexed_async_connection())?;
        Ok(Self {
            url,
            rt,
            conn,
            tier: None,
            prefix: String::new(),
            raw_prefix: String::new(),
            keys: Vec::new(),
        })
    }

    fn name(prefix: &str, key: &OffloadKey) -> Vec<u8> {
        let mut name = prefix.as_bytes().to_vec();
        name.extend_from_slice(key.as_bytes());
        name
    }

    /// `concurrency` pipelines at once, one per job of the wave.
    fn raw(&mut self, blocks: &mut Blocks, wave: Range<usize>, load: bool) -> Result<f64, Failure> {
        let block = blocks.block;
        let keys = blocks.keys.clone();
        let bytes = Blocks::bytes(&mut blocks.memory)?;
        let jobs = jobs(bytes, block, &wave);
        let (conn, prefix) = (&self.conn, &self.raw_prefix);
        let started = Instant::now();
        self.rt.block_on(async {
            let runs = jobs.into_iter().map(|(first, rows)| {
                let mut conn = conn.clone();
                let keys = &keys;
                async move {
                    let mut pipe = redis::pipe();
                    for (j, row) in rows.chunks(block).enumerate() {
                        let name = Self::name(prefix, &keys[first + j]);
                        if load {
                            pipe.cmd("GET").arg(name);
                        } else {
                            pipe.cmd("SET").arg(name).arg(row).ignore();
                        }
                    }
                    if load {
                        let got: Vec<Vec<u8>> = pipe.query_async(&mut conn).await?;
                        for (row, payload) in rows.chunks_mut(block).zip(got) {
                            if payload.len() != row.len() {
                                return Err(Failure::from("a raw GET of another length"));
                            }
                            row.copy_from_slice(&payload);
                        }
                    } else {
                        let () = pipe.query_async(&mut conn).await?;
                    }
                    Ok::<(), Failure>(())
                }
            });
            for done in join_all(runs).await {
                done?;
            }
            Ok::<(), Failure>(())
        })?;
        Ok(started.elapsed().as_secs_f64())
    }
}

impl DataPathTier for Redis {
    fn name(&self) -> &'static str {
        "redis"
    }

    fn total_bytes(&self, quick: bool) -> usize {
        if quick { 64 << 20 } else { 256 << 20 }
    }

    fn params(&self) -> Value {
        json!({ "server": "single", "raw": "redis-rs pipeline per job, one multiplexed connection" })
    }

    fn concurrency(&self) -> usize {
        JOBS
    }

    fn open(
        &mut self,
        round: usize,
        keys: &[OffloadKey],
    ) -> Result<Arc<dyn DynBlockStore>, Failure> {
        self.prefix = format!("kvbench-w6:{}:{round}:", std::process::id());
        self.raw_prefix = format!("kvbench-w6-raw:{}:{round}:", std::process::id());
        self.keys = keys.to_vec();
        let tier = Arc::new(RedisTier::new(RedisConfig {
            key_prefix: self.prefix.clone(),
            ..RedisConfig::from_url(self.url.clone())
        })?);
        self.tier = Some(Arc::clone(&tier));
        Ok(tier)
    }

    fn close(&mut self) -> Result<(), Failure> {
        let tier = self.tier.take();
        let mut pipe = redis::pipe();
        for key in &self.keys {
            // The tier's own names (prefix and layout), and the raw loop's.
            let stored = tier
                .as_ref()
                .map_or_else(|| Self::name(&self.prefix, key), |tier| tier.key_name(key));
            pipe.cmd("UNLINK")
                .arg(stored)
                .arg(Self::name(&self.raw_prefix, key))
                .ignore();
        }
        let mut conn = self.conn.clone();
        let () = self.rt.block_on(pipe.query_async(&mut conn))?;
        Ok(())
    }

    fn baseline(
        &mut self,
        blocks: &mut Blocks,
        wave: Range<usize>,
        _threads: usize,
        load: bool,
    ) -> Result<f64, Failure> {
        self.raw(blocks, wave, load)
    }
}

pub(super) struct S3 {
    config: S3Config,
    rt: tokio::runtime::Runtime,
    client: aws_sdk_s3::Client,
    tier: Option<Arc<S3Tier>>,
    raw_prefix: String,
    keys: Vec<OffloadKey>,
}

impl S3 {
    pub(super) fn new() -> Result<Self, Failure> {
        let (Ok(endpoint), Ok(bucket)) = (
            std::env::var("KVTIER_S3_ENDPOINT"),
            std::env::var("KVTIER_S3_BUCKET"),
        ) else {
            return Err("data-path's S3 rows need KVTIER_S3_ENDPOINT and KVTIER_S3_BUCKET: run `scripts/services.sh start` and `source .services/env`".into());
        };
        let rt = runtime()?;
        let client = rt.block_on(async {
            let shared = aws_config::defaults(aws_config::BehaviorVersion::latest())
                .load()
                .await;
            let conf = aws_sdk_s3::config::Builder::from(&shared)
                .force_path_style(true)
                .endpoint_url(&endpoint);
            aws_sdk_s3::Client::from_conf(conf.build())
        });
        Ok(Self {
            config: S3Config {
                endpoint: Some(endpoint),
                force_path_style: true,
                max_concurrent_requests: S3_REQUESTS,
                ..S3Config::new(bucket)
            },
            rt,
            client,
            tier: None,
            raw_prefix: String::new(),
            keys: Vec::new(),
        })
    }

    /// [`S3_REQUESTS`] requests in flight over the wave's blocks.
    fn raw(&mut self, blocks: &mut Blocks, wave: Range<usize>, load: bool) -> Result<f64, Failure> {
        let block = blocks.block;
        let keys = blocks.keys.clone();
        let bytes = Blocks::bytes(&mut blocks.memory)?
            .get_mut(wave.start * block..wave.end * block)
            .ok_or("a wave past the last block")?;
        let (client, bucket, prefix) = (&self.client, &self.config.bucket, &self.raw_prefix);
        let started = Instant::now();
        self.rt.block_on(async {
            let requests = bytes.chunks_mut(block).enumerate().map(|(j, row)| {
                let name = format!("{prefix}{}", keys[wave.start + j].to_hex());
                async move {
                    if load {
                        let object = client.get_object().bucket(bucket).key(name).send().await?;
                        let body = object.body.collect().await?.into_bytes();
                        if body.len() != row.len() {
                            return Err(Failure::from("a raw GET of another length"));
                        }
                        row.copy_from_slice(&body);
                    } else {
                        client
                            .put_object()
                            .bucket(bucket)
                            .key(name)
                            .body(ByteStream::from(row.to_vec()))
                            .send()
                            .await?;
                    }
                    Ok::<(), Failure>(())
                }
            });
            let mut running = futures_util::stream::iter(requests).buffer_unordered(S3_REQUESTS);
            while let Some(done) = running.next().await {
                done?;
            }
            Ok::<(), Failure>(())
        })?;
        Ok(started.elapsed().as_secs_f64())
    }
}

impl DataPathTier for S3 {
    fn name(&self) -> &'static str {
        "s3"
    }

    fn total_bytes(&self, quick: bool) -> usize {
        if quick { 64 << 20 } else { 256 << 20 }
    }

    fn params(&self) -> Value {
        json!({ "server": "s3s-fs", "requests_in_flight": S3_REQUESTS })
    }

    fn concurrency(&self) -> usize {
        JOBS
    }

    fn open(
        &mut self,
        round: usize,
        keys: &[OffloadKey],
    ) -> Result<Arc<dyn DynBlockStore>, Failure> {
        let run = format!("{}-{round}", std::process::id());
        self.raw_prefix = format!("kvbench-w6-raw-{run}/");
        self.keys = keys.to_vec();
        let config = S3Config {
            prefix: format!("kvbench-w6-{run}/"),
            ..self.config.clone()
        };
        let tier = Arc::new(self.rt.block_on(S3Tier::new(config))?);
        self.tier = Some(Arc::clone(&tier));
        Ok(tier)
    }

    fn close(&mut self) -> Result<(), Failure> {
        if let Some(tier) = self.tier.take() {
            self.rt
                .block_on(kvtier_core::BlockStore::remove_many(&*tier, &self.keys))?;
        }
        let (client, bucket, prefix) = (&self.client, &self.config.bucket, &self.raw_prefix);
        self.rt.block_on(async {
            let deletes = self.keys.iter().map(|key| async move {
                client
                    .delete_object()
                    .bucket(bucket)
                    .key(format!("{prefix}{}", key.to_hex()))
                    .send()
                    .await
                    .map(|_| ())
            });
            let mut running = futures_util::stream::iter(deletes).buffer_unordered(S3_REQUESTS);
            while let Some(done) = running.next().await {
                done?;
            }
            Ok::<(), Failure>(())
        })?;
        Ok(())
    }

    fn baseline(
        &mut self,
        blocks: &mut Blocks,
        wave: Range<usize>,
        _threads: usize,
        load: bool,
    ) -> Result<f64, Failure> {
        self.raw(blocks, wave, load)
    }
}
