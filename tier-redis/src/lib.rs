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
//!   pre-packed on one connection of the tier's own per server (pipelines
//!   from every lookup in flight queue on it, their replies read back in
//!   order) and the integer replies are read straight into booleans
//!   (redis-rs builds and parses a value per command: nearly half the
//!   client's CPU per key). Any error reply (MOVED, NOAUTH...) or
//!   connection trouble hands the chunk to redis-rs,
//!   which decides the outcome; TLS always uses redis-rs. `lean_pipelines =
//!   false` turns it off; [`RedisTier::pipeline_stats`] counts both paths.
//! - **Replies are checked, the same way on both paths.** Each EXISTS must
//!   answer `0` or `1`, and each pipeline ends with an end marker (`TYPE`
//!   of its first key) whose reply must come last, so a missing or an extra
//!   reply is seen. Anything else is [`RedisTierError::UnexpectedReply`],
//!   never a hit or a miss. A reply line the lean path reads may be at most
//!   4 KiB long.
//! - **Deadlines.** Every call returns within its connect timeout plus its
//!   response timeout, whatever the server does. A lookup on the lean path
//!   against a server that accepts connections but never answers fails as
//!   [`RedisTierError::Timeout`] after the response timeout (redis-rs is
//!   not asked again: the server is there, but silent).
//! - **Outages.** The connection reconnects by itself. Connect and response
//!   timeouts are short, so a lookup during an outage fails fast, with a
//!   typed error (timeout, unavailable, auth, cluster down) that the lookup
//!   manager counts as an error, not a miss.
//! - **Credentials** never appear in errors, logs or `Debug` output.
//! - **Any runtime.** Connections are made and driven on a one-thread I/O
//!   runtime the tier starts with itself (and stops, without waiting, when
//!   dropped), or on a [`Spawner`](kvtier_core::Spawner) the caller passes
//!   ([`RedisTier::with_spawner`]), which the tier keeps alive, so stores from a short-lived runtime
//!   never leave the lookup manager's worker on a connection whose driver is
//!   gone. Callers may use the tier from any tokio runtime. A manager from
//!   `tier.manager(...)` (one worker thread, the default) runs its worker on
//!   that runtime when it is the tier's own or a dedicated one: with
//!   `RedisTier::new`, one thread for the lookups and their connections.
//! - **One store interface.** Blocks are stored, loaded and removed through
//!   [`BlockStore`](kvtier_core::BlockStore): `SET` (with `PX` when [`RedisConfig::ttl_ms`] is set),
//!   `GET` and `DEL`, and the batched forms in one pipeline per chunk (per
//!   master on a cluster; `MGET` on a single server). The in-place batch
//!   forms (`store_batch`, `load_batch`) pipeline `SET` / `GET` per master
//!   in chunks of at most 8 MiB, copy each `GET` payload into its region,
//!   and answer each key on its own: an error reply, a failed chunk or a
//!   master down fails only its keys. Redis-only extras: [`RedisTier::store_nx`],
//!   [`RedisTier::exists_many`], [`RedisTier::ping`].
//!
//! Files: `config.rs` ([`RedisConfig`], its URL checks), `error.rs`
//! ([`RedisTierError`], classified with the client's predicates),
//! `tier.rs` ([`RedisTier`] and its constructors), `pipeline.rs` (commands,
//! pipelines per shard, deadlines), `lookup.rs` (EXISTS), `store.rs` (SET,
//! GET, DEL), `batch.rs` (the in-place batch forms, one outcome per key), `reply.rs` (what replies mean, pure functions), `io.rs` (the
//! runtime connections run on), `connection.rs` (one connection type over
//! a server or a cluster), `cluster.rs` (the slot map), `route.rs` (shards
//! and their targets), `lean.rs` (the lean EXISTS path), `slot.rs` (key
//! slots).
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

mod batch;
mod cluster;
mod config;
mod connection;
mod error;
mod io;
mod lean;
mod lookup;
mod names;
mod pipeline;
mod reply;
mod route;
mod slot;
mod store;
mod tier;

pub use config::RedisConfig;
pub use error::RedisTierError;
pub use lookup::PipelineStats;
pub use names::KeyLayout;
pub use slot::key_slot;
pub use tier::RedisTier;
