//! An S3 kvtier tier: bounded concurrent HEAD lookups and store / load /
//! remove over any S3-compatible store (AWS S3, MinIO, Ceph, Garage, s3s).
//!
//! - **Names.** A block's object name is `prefix` plus the lower-case hex of its
//!   key: URL-safe, with no surprises from encodings.
//! - **Lookups.** One HEAD per key. The tier caps the reads in flight with one
//!   limit (`max_concurrent_requests`) shared by every batch, not one per batch. A
//!   404 is a miss. Writes have a limit of their own, so bulk stores never delay
//!   lookups.
//! - **Errors.** 403, a missing bucket, rejected credentials or none found
//!   are a typed configuration error, logged once and not retried in a loop
//!   (the lookup manager backs off). A HEAD cannot tell a missing key from a
//!   missing bucket, so a lookup with misses checks the bucket again (at most
//!   every `bucket_recheck_ms`): a bucket deleted while the tier runs is an
//!   error, not a silent miss. Throttling, 5xx and timeouts go through the
//!   SDK's standard retry (configured, not hand-written), then are a counted
//!   error; a refused connection is not retried and says "connection refused".
//! - **Configuration** is checked by [`S3Tier::new`]: anything the SDK would
//!   panic on (a control character in the region or a credential, timeouts
//!   that overflow) and an endpoint that is not an http(s) URL are
//!   [`S3TierError::InvalidConfig`], and so is an endpoint that holds
//!   credentials (`user:password@`): they go in `access_key_id` /
//!   `secret_access_key`. [`S3Tier::check`] contacts the server at
//!   start-up, to fail fast.
//! - **Secrets.** No `Debug` output, error or log line shows a secret:
//!   endpoints are shown masked ([`kvtier_core::redact_url`]), and the
//!   SDK's requests run under the program's log subscriber less the
//!   SDK's TRACE dumps of whole requests (targets `aws_sigv4` and
//!   `aws_smithy_runtime::client::orchestrator`), which print the session
//!   token; every other SDK line, at every level, is logged.
//! - **Runtime.** Every request runs on a runtime the tier starts and owns
//!   ([`S3Tier::new`]: a [`Spawner::dedicated`](kvtier_core::Spawner::dedicated)
//!   of `io_threads` threads) or the [`Spawner`](kvtier_core::Spawner) the
//!   caller hands in ([`S3Tier::with_spawner`]), which the tier keeps alive;
//!   never on the caller's: the SDK's connection pool keeps each
//!   connection's task on the runtime that opened it, and a store from a
//!   short-lived runtime would otherwise leave connections behind that
//!   later lookups wait on.
//! - **One interface.** Blocks are stored, loaded and removed through
//!   [`BlockStore`](kvtier_core::BlockStore) (batched forms run concurrent
//!   requests; `load_batch` streams each body into its region, and answers
//!   each key on its own); lookups are [`Tier::batch_lookup`](kvtier_core::Tier), or
//!   [`S3Tier::exists_many`] for the typed error.
//! - **Build.** The SDK is built without `sigv4a`; HTTPS (rustls) stays on.
//!
//! Files: `config.rs` ([`S3Config`] and its validation), `error.rs`
//! ([`S3TierError`] and the classification of S3 errors, a pure function of
//! status and error code), `client.rs` (the SDK client), `endpoint.rs` (the SDK's
//! endpoint resolver, its answers kept), `logs.rs` (what the SDK may
//! log), `requests.rs` (the S3 requests, their limits and the bucket
//! check), `batch.rs` (the in-place batch forms), `tier.rs` ([`S3Tier`]: each call one task on the I/O runtime).
//!
//! The client is made by [`S3Tier::new`], which reads credentials from the
//! configuration or from the standard AWS chain (environment, profile,
//! container, instance metadata).
//!
//! ```
//! use kvtier_core::{BlockStore, OffloadKey};
//! use kvtier_s3::{S3Config, S3Tier};
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # // Runs against the S3 server of `scripts/services.sh` (credentials from
//! # // the AWS environment variables it writes); skipped loudly without it,
//! # // a failure when services are required (CI).
//! # let (Ok(endpoint), Ok(bucket)) =
//! #     (std::env::var("KVTIER_S3_ENDPOINT"), std::env::var("KVTIER_S3_BUCKET"))
//! # else {
//! #     assert!(std::env::var_os("KVTIER_REQUIRE_SERVICES").is_none(), "KVTIER_S3_ENDPOINT / KVTIER_S3_BUCKET not set");
//! #     eprintln!("SKIPPED tier-s3 doc example: KVTIER_S3_ENDPOINT / KVTIER_S3_BUCKET not set");
//! #     return Ok(());
//! # };
//! # tokio::runtime::Runtime::new()?.block_on(async {
//! // endpoint: e.g. "http://127.0.0.1:9000" for a local MinIO or s3s-fs
//! let tier = S3Tier::new(S3Config {
//!     endpoint: Some(endpoint),
//!     force_path_style: true,
//!     prefix: "doc-example/".into(),
//!     ..S3Config::new(bucket)
//! })
//! .await?;
//! let key = OffloadKey::from_block_hash(&[1; 32], 0);
//! tier.store(&key, b"kv bytes").await?;
//! assert_eq!(tier.exists_many(&[key.clone()]).await?, [true]);
//! # Ok::<_, Box<dyn std::error::Error>>(()) })
//! # }
//! ```

#![deny(missing_docs)]
#![warn(clippy::unwrap_used)]

mod batch;
mod client;
mod config;
mod endpoint;
mod error;
mod logs;
mod requests;
mod tier;

pub use config::S3Config;
pub use error::S3TierError;
pub use requests::S3Stats;
pub use tier::S3Tier;
