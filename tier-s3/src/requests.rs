//! [`Requests`]: the S3 requests of a tier (HEAD, PUT, GET, DELETE, the
//! bucket check), their shared limits and counters, and the batched forms.
//! Everything here runs on the tier's I/O runtime: [`S3Tier`](crate::S3Tier)
//! hands each call over as one task.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use aws_sdk_s3::config::http::HttpResponse;
use aws_sdk_s3::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_s3::primitives::ByteStream;
use futures_util::StreamExt;
use futures_util::stream::{FuturesOrdered, FuturesUnordered};
use kvtier_core::OffloadKey;
use tokio::sync::{Semaphore, mpsc};

use crate::error::{self, ErrorContext, ResponseClass, classify_response};
use crate::logs::SdkLogs;
use crate::{S3Config, S3TierError};

pub(crate) type Result<T, E = S3TierError> = std::result::Result<T, E>;

/// Request counters of an [`S3Tier`](crate::S3Tier).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct S3Stats {
    /// Requests in flight now.
    pub in_flight: usize,
    /// Most requests ever in flight at once.
    pub max_in_flight: usize,
    /// Requests sent (HEAD, PUT, GET, DELETE, and the bucket check).
    pub requests: usize,
}

/// What sends a tier's requests: the SDK client, the limits shared by
/// every call, the bucket check and the counters.
pub(crate) struct Requests {
    client: aws_sdk_s3::Client,
    pub(crate) config: S3Config,
    /// Where it connects, as errors and `Debug` show it.
    pub(crate) endpoint: String,
    limit: Arc<Semaphore>,
    /// Writes (PUT, DELETE) have a limit of their own, so that bulk stores
    /// never make lookups queue behind them.
    write_limit: Arc<Semaphore>,
    /// When the bucket was last seen to exist: `None` before the first
    /// check passes and after one finds the bucket missing.
    bucket_seen: Mutex<Option<Instant>>,
    /// One bucket check at a time; concurrent lookups wait for its answer.
    bucket_check: tokio::sync::Mutex<()>,
    /// What the SDK may log (see [`logs`](crate::logs)).
    pub(crate) logs: SdkLogs,
    config_error_logged: AtomicBool,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    requests: AtomicUsize,
}

/// Counts a request in flight for as long as it lives.
struct InFlight<'a>(&'a Requests);

impl<'a> InFlight<'a> {
    fn new(tier: &'a Requests) -> Self {
        let now = tier.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        tier.max_in_flight.fetch_max(now, Ordering::SeqCst);
        tier.requests.fetch_add(1, Ordering::Relaxed);
        Self(tier)
    }
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// The class of an SDK error's response, if it was an error response.
fn response_class<E: ProvideErrorMetadata>(
    err: &SdkError<E, HttpResponse>,
) -> Option<ResponseClass> {
    match err {
        SdkError::ServiceError(service) => Some(classify_response(
            service.raw().status().as_u16(),
            service.err().code().unwrap_or(""),
        )),
        _ => None,
    }
}

impl Requests {
    /// The requests of `client`, for `config` (already validated), run
    /// under `logs`.
    pub(crate) fn new(
        config: S3Config,
        endpoint: String,
        client: aws_sdk_s3::Client,
        logs: SdkLogs,
    ) -> Self {
        Self {
            client,
            limit: Arc::new(Semaphore::new(config.max_concurrent_requests)),
            write_limit: Arc::new(Semaphore::new(config.max_concurrent_requests)),
            endpoint,
            config,
            bucket_seen: Mutex::new(None),
            bucket_check: tokio::sync::Mutex::new(()),
            logs,
            config_error_logged: AtomicBool::new(false),
            in_flight: AtomicUsize::new(0),
            max_in_flight: AtomicUsize::new(0),
            requests: AtomicUsize::new(0),
        }
    }

    /// Request counters.
    pub(crate) fn stats(&self) -> S3Stats {
        S3Stats {
            in_flight: self.in_flight.load(Ordering::SeqCst),
            max_in_flight: self.max_in_flight.load(Ordering::SeqCst),
            requests: self.requests.load(Ordering::Relaxed),
        }
    }

    /// The object name of `key`: prefix plus lower-case hex.
    pub(crate) fn object_name(&self, key: &OffloadKey) -> String {
        format!("{}{}", self.config.prefix, key.to_hex())
    }

    fn error_context(&self) -> ErrorContext<'_> {
        ErrorContext {
            bucket: &self.config.bucket,
            endpoint: &self.endpoint,
        }
    }

    /// Classifies an SDK error at the boundary ([`error::from_sdk`]), and
    /// forgets the bucket if the server says it is gone.
    fn classify<E>(&self, op: &'static str, err: &SdkError<E, HttpResponse>) -> S3TierError
    where
        E: ProvideErrorMetadata + std::error::Error + 'static,
    {
        if response_class(err) == Some(ResponseClass::NoSuchBucket) {
            self.bucket_gone();
        }
        let classified = error::from_sdk(&self.error_context(), op, err);
        self.log_if_configuration(&classified);
        classified
    }

    /// Logs the first configuration error (once per tier: the lookup
    /// manager backs off and retries, and would repeat it).
    fn log_if_configuration(&self, err: &S3TierError) {
        if matches!(err, S3TierError::Configuration { .. })
            && !self.config_error_logged.swap(true, Ordering::Relaxed)
        {
            tracing::error!(error = %err, "S3 tier misconfigured; lookups answer miss until it is fixed");
        }
    }

    fn bucket_seen(&self) -> std::sync::MutexGuard<'_, Option<Instant>> {
        self.bucket_seen
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Forgets that the bucket was seen: the next request checks it first.
    fn bucket_gone(&self) {
        *self.bucket_seen() = None;
    }

    /// [`S3Tier::check`](crate::S3Tier::check).
    pub(crate) async fn check(&self) -> Result<()> {
        let _one = self.bucket_check.lock().await;
        self.head_bucket().await
    }

    /// Checks the bucket unless it was seen at or after `since` (`None`:
    /// seen at all), one check at a time.
    async fn ensure_bucket(&self, since: Option<Instant>) -> Result<()> {
        let fresh = |seen: Option<Instant>| seen.is_some_and(|at| since.is_none_or(|s| at >= s));
        if fresh(*self.bucket_seen()) {
            return Ok(());
        }
        let _one = self.bucket_check.lock().await;
        // Another lookup may have checked while this one waited.
        if fresh(*self.bucket_seen()) {
            return Ok(());
        }
        self.head_bucket().await
    }

    /// One HeadBucket (a HEAD on an object cannot tell a missing bucket
    /// from a missing key); remembers when the bucket was seen.
    async fn head_bucket(&self) -> Result<()> {
        const OP: &str = "HeadBucket";
        let _slot = self.slot(&self.limit, OP).await?;
        let asked = Instant::now();
        let request = self.client.head_bucket().bucket(&self.config.bucket);
        match request.send().await {
            Ok(_) => {
                *self.bucket_seen() = Some(asked);
                Ok(())
            }
            // A HEAD has no body: its 404 has no code to tell.
            Err(e) if response_class(&e) == Some(ResponseClass::NotFound) => {
                self.bucket_gone();
                let err = self.error_context().response_error(
                    OP,
                    ResponseClass::NoSuchBucket,
                    404,
                    "NoSuchBucket",
                    "",
                );
                self.log_if_configuration(&err);
                Err(err)
            }
            Err(e) => Err(self.classify(OP, &e)),
        }
    }

    /// Checks the bucket before the tier's first request, and after it is
    /// found missing.
    async fn check_bucket(&self) -> Result<()> {
        self.ensure_bucket(None).await
    }

    /// A request slot: a permit from `limit` and a count in flight, both
    /// released when the slot is dropped: the count first (a tuple drops in
    /// order), so the next holder of the permit never finds it still
    /// counted and `max_in_flight` never reads one over the limit.
    async fn slot<'a>(
        &'a self,
        limit: &'a Semaphore,
        op: &'static str,
    ) -> Result<(InFlight<'a>, tokio::sync::SemaphorePermit<'a>)> {
        let permit = limit.acquire().await.map_err(|_| self.closed(op))?;
        Ok((InFlight::new(self), permit))
    }

    fn closed(&self, op: &'static str) -> S3TierError {
        S3TierError::Other {
            bucket: self.config.bucket.clone(),
            endpoint: self.endpoint.clone(),
            op,
            detail: "request limiter closed".to_owned(),
        }
    }

    async fn head(&self, key: &OffloadKey) -> Result<bool> {
        const OP: &str = "HeadObject";
        let _slot = self.slot(&self.limit, OP).await?;
        let request = self
            .client
            .head_object()
            .bucket(&self.config.bucket)
            .key(self.object_name(key));
        match request.send().await {
            Ok(_) => Ok(true),
            Err(e) if response_class(&e) == Some(ResponseClass::NotFound) => Ok(false),
            Err(e) => Err(self.classify(OP, &e)),
        }
    }

    /// [`S3Tier::exists_many`](crate::S3Tier::exists_many): one HEAD per
    /// key, the tier's limit shared with every other call; a miss only
    /// with the bucket seen within `bucket_recheck_ms` before the HEADs.
    pub(crate) async fn exists_many(&self, keys: &[OffloadKey]) -> Result<Vec<bool>> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        self.check_bucket().await?;
        let started = Instant::now();
        let found = in_order(
            keys.iter().map(|k| self.head(k)),
            self.config.max_concurrent_requests,
        )
        .await?;
        if found.contains(&false) {
            let recheck = Duration::from_millis(self.config.bucket_recheck_ms);
            self.ensure_bucket(started.checked_sub(recheck)).await?;
        }
        Ok(found)
    }

    /// [`S3Tier::create_bucket_if_missing`](crate::S3Tier::create_bucket_if_missing).
    pub(crate) async fn create_bucket_if_missing(&self) -> Result<()> {
        const OP: &str = "CreateBucket";
        let _slot = self.slot(&self.limit, OP).await?;
        let request = self.client.create_bucket().bucket(&self.config.bucket);
        match request.send().await {
            Ok(_) => Ok(()),
            Err(SdkError::ServiceError(service))
                if matches!(
                    service.err().code(),
                    Some("BucketAlreadyOwnedByYou" | "BucketAlreadyExists")
                ) || service.raw().status().as_u16() == 409 =>
            {
                Ok(())
            }
            Err(e) => Err(self.classify(OP, &e)),
        }
    }

    /// PutObject.
    pub(crate) async fn put(&self, key: &OffloadKey, block: Vec<u8>) -> Result<()> {
        const OP: &str = "PutObject";
        self.check_bucket().await?;
        let _slot = self.slot(&self.write_limit, OP).await?;
        let request = self
            .client
            .put_object()
            .bucket(&self.config.bucket)
            .key(self.object_name(key))
            .body(ByteStream::from(block));
        match request.send().await {
            Ok(_) => Ok(()),
            Err(e) => Err(self.classify(OP, &e)),
        }
    }

    /// GetObject, body included; `None` for a missing object.
    pub(crate) async fn get(&self, key: &OffloadKey) -> Result<Option<Vec<u8>>> {
        let Some((_slot, object)) = self.get_object(key).await? else {
            return Ok(None);
        };
        let body = object
            .body
            .collect()
            .await
            .map_err(|e| self.body_error(e))?;
        Ok(Some(body.into_bytes().to_vec()))
    }

    /// GetObject's response, holding its concurrency slot (until the body
    /// has been read: the caller keeps the slot as long as the response);
    /// `None` for a missing object.
    async fn get_object(
        &self,
        key: &OffloadKey,
    ) -> Result<
        Option<(
            (InFlight<'_>, tokio::sync::SemaphorePermit<'_>),
            aws_sdk_s3::operation::get_object::GetObjectOutput,
        )>,
    > {
        const OP: &str = "GetObject";
        self.check_bucket().await?;
        let slot = self.slot(&self.limit, OP).await?;
        let request = self
            .client
            .get_object()
            .bucket(&self.config.bucket)
            .key(self.object_name(key));
        match request.send().await {
            Ok(object) => Ok(Some((slot, object))),
            Err(e) if response_class(&e) == Some(ResponseClass::NotFound) => Ok(None),
            Err(e) => Err(self.classify(OP, &e)),
        }
    }

    /// A GetObject body that broke off while it was read.
    fn body_error(&self, e: impl std::fmt::Display) -> S3TierError {
        S3TierError::Unavailable {
            bucket: self.config.bucket.clone(),
            endpoint: self.endpoint.clone(),
            op: "GetObject body",
            detail: e.to_string(),
        }
    }

    /// GetObject, its body sent to `out` as it arrives, on the tier's I/O
    /// runtime, bounded by `request_timeout_ms` as a whole: first
    /// [`Fetched::Missing`] or [`Fetched::Found`], then the body's chunks;
    /// an error ends it. Stops as soon as `out`'s reader is gone.
    pub(crate) async fn get_streamed(&self, key: &OffloadKey, out: &mpsc::Sender<Result<Fetched>>) {
        let limit = Duration::from_millis(self.config.request_timeout_ms);
        let failed = match tokio::time::timeout(limit, self.get_chunks(key, out)).await {
            Ok(Ok(())) => return,
            Ok(Err(e)) => e,
            Err(_) => S3TierError::Timeout {
                bucket: self.config.bucket.clone(),
                endpoint: self.endpoint.clone(),
                op: "GetObject body",
            },
        };
        let _ = out.send(Err(failed)).await;
    }

    async fn get_chunks(
        &self,
        key: &OffloadKey,
        out: &mpsc::Sender<Result<Fetched>>,
    ) -> Result<()> {
        let Some((_slot, mut object)) = self.get_object(key).await? else {
            let _ = out.send(Ok(Fetched::Missing)).await;
            return Ok(());
        };
        let len = object.content_length().and_then(|n| u64::try_from(n).ok());
        if out.send(Ok(Fetched::Found(len))).await.is_err() {
            return Ok(());
        }
        while let Some(chunk) = object.body.next().await {
            let chunk = chunk.map_err(|e| self.body_error(e))?;
            if out.send(Ok(Fetched::Chunk(chunk))).await.is_err() {
                return Ok(());
            }
        }
        Ok(())
    }

    /// DeleteObject; a missing object is not an error (some servers answer
    /// 404 where AWS answers 204).
    pub(crate) async fn delete(&self, key: &OffloadKey) -> Result<()> {
        const OP: &str = "DeleteObject";
        self.check_bucket().await?;
        let _slot = self.slot(&self.write_limit, OP).await?;
        let request = self
            .client
            .delete_object()
            .bucket(&self.config.bucket)
            .key(self.object_name(key));
        match request.send().await {
            Ok(_) => Ok(()),
            Err(e) if response_class(&e) == Some(ResponseClass::NotFound) => Ok(()),
            Err(e) => Err(self.classify(OP, &e)),
        }
    }

    /// PutObject of every block, at most `max_concurrent_requests` at
    /// once; stops at the first error.
    pub(crate) async fn store_many(&self, blocks: Vec<(OffloadKey, Vec<u8>)>) -> Result<()> {
        let puts = blocks
            .into_iter()
            .map(|(key, block)| async move { self.put(&key, block).await });
        all_of(puts, self.config.max_concurrent_requests).await
    }

    /// GetObject of every key, in order; stops at the first error.
    pub(crate) async fn load_many(&self, keys: &[OffloadKey]) -> Result<Vec<Option<Vec<u8>>>> {
        in_order(
            keys.iter().map(|key| self.get(key)),
            self.config.max_concurrent_requests,
        )
        .await
    }

    /// DeleteObject of every key, at most `max_concurrent_requests` at
    /// once; stops at the first error.
    pub(crate) async fn remove_many(&self, keys: &[OffloadKey]) -> Result<()> {
        in_order(
            keys.iter().map(|key| self.delete(key)),
            self.config.max_concurrent_requests,
        )
        .await?;
        Ok(())
    }
}

/// What [`Requests::get_streamed`] sends, in order.
#[derive(Debug)]
pub(crate) enum Fetched {
    /// No such object (nothing follows).
    Missing,
    /// The object, with its length when the server gave one; its body's
    /// chunks follow.
    Found(Option<u64>),
    /// The next chunk of the body.
    Chunk(bytes::Bytes),
}

/// Runs the futures of `requests`, at most `limit` at once, and collects
/// their answers in order; stops at the first error (the requests still
/// running are dropped). Each future is made when a place frees, not all
/// up front: a request's future holds the SDK's, several KiB, and a batch
/// made at once would allocate and copy all of them.
async fn in_order<T, F>(mut requests: impl Iterator<Item = F>, limit: usize) -> Result<Vec<T>>
where
    F: Future<Output = Result<T>>,
{
    let mut running = FuturesOrdered::new();
    let mut answers = Vec::with_capacity(requests.size_hint().0);
    loop {
        while running.len() < limit.max(1) {
            match requests.next() {
                Some(request) => running.push_back(request),
                None => break,
            }
        }
        match running.next().await {
            Some(answer) => answers.push(answer?),
            None => return Ok(answers),
        }
    }
}

/// [`in_order`] for requests without an answer: each place is refilled as
/// soon as any request ends.
async fn all_of<F>(mut requests: impl Iterator<Item = F>, limit: usize) -> Result<()>
where
    F: Future<Output = Result<()>>,
{
    let mut running = FuturesUnordered::new();
    loop {
        while running.len() < limit.max(1) {
            match requests.next() {
                Some(request) => running.push(request),
                None => break,
            }
        }
        match running.next().await {
            Some(outcome) => outcome?,
            None => return Ok(()),
        }
    }
}
