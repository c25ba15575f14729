//! A tier that injects faults, for tests; see [`FaultTier`]. `kvtier-mock`
//! re-exports it (as `MockTier`) for examples and benchmarks.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError, RwLock};
use std::time::{Duration, Instant};

use crate::{BlockStore, ManagerConfig, OffloadKey, ReqContext, Tier, TierError, TierErrorKind};
use serde::{Deserialize, Serialize};

/// Each present key and its block (empty for keys made present by [`FaultTier::insert`]).
type KeySet = HashMap<OffloadKey, Vec<u8>, foldhash::fast::RandomState>;

/// Fault and latency injection of a [`FaultTier`]. Probabilities are per call,
/// from 0.0 to 1.0, and are tried in the order hang, fail, panic, wrong length.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FaultConfig {
    /// Seed of every random decision. Default 0.
    pub seed: u64,
    /// Fixed latency of each call, in microseconds. Default 0 (answer at once).
    /// The wait is a tokio timer, whose resolution is one millisecond: a
    /// non-zero latency below that takes about a millisecond.
    pub latency_us: u64,
    /// Extra latency drawn uniformly from 0 to this, in microseconds. Default 0.
    pub jitter_us: u64,
    /// Probability that a call fails with a transient error. Default 0.
    pub failure_probability: f64,
    /// Probability that a call hangs. Default 0.
    pub hang_probability: f64,
    /// How long a hung call hangs before answering, in milliseconds; `None`
    /// hangs forever. Default `None`.
    pub hang_ms: Option<u64>,
    /// Probability that a call panics. Default 0.
    pub panic_probability: f64,
    /// Probability that a call answers one result too few. Default 0.
    pub wrong_length_probability: f64,
    /// Whether to record every call (keys and answers). Default true; turn
    /// off for long benchmarks.
    pub record_calls: bool,
}

impl Default for FaultConfig {
    fn default() -> Self {
        Self {
            seed: 0,
            latency_us: 0,
            jitter_us: 0,
            failure_probability: 0.0,
            hang_probability: 0.0,
            hang_ms: None,
            panic_probability: 0.0,
            wrong_length_probability: 0.0,
            record_calls: true,
        }
    }
}

impl FaultConfig {
    /// The default with a fixed latency.
    pub fn with_latency(latency: Duration) -> Self {
        Self {
            latency_us: u64::try_from(latency.as_micros()).unwrap_or(u64::MAX),
            ..Self::default()
        }
    }
}

/// A fault applied to every call of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestFault {
    /// Add this much latency.
    Delay(Duration),
    /// Fail with a transient error.
    Fail,
    /// Never answer.
    Hang,
}

/// How a recorded call ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FaultOutcome {
    /// Answered with these results (the truth when the call answered).
    Answered(Vec<bool>),
    /// Answered one result too few; the full truth is kept here.
    WrongLength(Vec<bool>),
    /// Failed with an injected error.
    Failed,
    /// Hung (and, for a finite hang, then answered: see `Answered`).
    Hung,
    /// Panicked.
    Panicked,
    /// Still running, or dropped (cancelled) before it ended.
    Unfinished,
}

/// One `batch_lookup` call as the mock saw it.
#[derive(Debug, Clone)]
pub struct CallRecord {
    /// Call number, from 0, in the order calls started.
    pub index: u64,
    /// The request it was made for.
    pub req_id: String,
    /// The keys asked.
    pub keys: Vec<OffloadKey>,
    /// How it ended.
    pub outcome: FaultOutcome,
    /// When it started.
    pub started: Instant,
    /// When it answered, failed or panicked.
    pub finished: Option<Instant>,
}

/// An in-memory [`Tier`] with injected latency and faults, for the tests and
/// benchmarks of the manager and of code built on it.
///
/// [`FaultTier`] holds a set of keys and answers `batch_lookup` from it, after
/// an injected latency (fixed plus seeded jitter). It can fail, hang, panic
/// or answer the wrong number of results with configured probabilities, and
/// slow down, fail or hang chosen requests. Every decision comes from a seeded
/// generator indexed by the call number, so a run is reproducible. Every call
/// is recorded, with the answer it gave (the truth at probe time), for
/// assertions. It lives here, not in a tier crate, so the core's own tests
/// need no tier crate; `kvtier-mock` is the configurable tier for examples
/// and benchmarks of whole programs.
///
/// ```
/// use kvtier_core::testkit::{FaultConfig, FaultTier};
/// use kvtier_core::{AsyncLookupManager, LookupVerdict, ManagerConfig, OffloadKey, ReqContext};
/// use std::sync::Arc;
///
/// let tier = Arc::new(FaultTier::new(FaultConfig::default()));
/// let key = OffloadKey::new(&[1; 36]);
/// tier.insert([key.clone()]);
///
/// let mut manager = AsyncLookupManager::from_arc(Arc::clone(&tier), ManagerConfig::named("faulty"))?;
/// let ctx = ReqContext::new("r1");
/// assert_eq!(manager.lookup(&key, &ctx)?, LookupVerdict::Pending);
/// manager.flush();
/// while manager.lookup(&key, &ctx)? == LookupVerdict::Pending {
///     std::thread::sleep(std::time::Duration::from_millis(1));
/// }
/// assert_eq!(manager.lookup(&key, &ctx)?, LookupVerdict::Hit);
/// assert_eq!(tier.calls().len(), 1);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Default)]
pub struct FaultTier {
    config: RwLock<FaultConfig>,
    keys: RwLock<KeySet>,
    request_faults: Mutex<HashMap<String, RequestFault>>,
    calls: Mutex<Vec<CallRecord>>,
    next_call: AtomicU64,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic injected by the mock itself must not poison its bookkeeping.
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// SplitMix64: a tiny, well-mixed generator; enough for fault injection.
#[derive(Debug, Clone)]
struct SplitMix(u64);

impl SplitMix {
    fn for_call(seed: u64, index: u64) -> Self {
        Self(seed ^ index.wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Counts a call in flight for as long as it lives (also when dropped).
struct InFlight<'a>(&'a FaultTier);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

impl FaultTier {
    /// An empty tier.
    pub fn new(config: FaultConfig) -> Self {
        Self {
            config: RwLock::new(config),
            ..Self::default()
        }
    }

    /// Replaces the fault and latency configuration; running calls keep theirs.
    pub fn set_config(&self, config: FaultConfig) {
        *self.config.write().unwrap_or_else(PoisonError::into_inner) = config;
    }

    /// The current configuration.
    pub fn config(&self) -> FaultConfig {
        self.config
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Makes `keys` present, each with an empty block (a shortcut for tests
    /// and benchmarks; [`BlockStore`] stores real blocks).
    pub fn insert(&self, keys: impl IntoIterator<Item = OffloadKey>) {
        self.keys
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .extend(keys.into_iter().map(|k| (k, Vec::new())));
    }

    /// Makes `keys` absent (the synchronous twin of [`BlockStore::remove_many`]).
    pub fn remove_keys<'a>(&self, keys: impl IntoIterator<Item = &'a OffloadKey>) {
        let mut set = self.keys.write().unwrap_or_else(PoisonError::into_inner);
        for key in keys {
            set.remove(key);
        }
    }

    /// Whether `key` is present now.
    pub fn contains(&self, key: &OffloadKey) -> bool {
        self.keys
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .contains_key(key)
    }

    /// Number of present keys.
    pub fn len(&self) -> usize {
        self.keys
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    /// Whether no key is present.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Applies `fault` to every later call made for request `req_id`.
    pub fn set_request_fault(&self, req_id: impl Into<String>, fault: RequestFault) {
        lock(&self.request_faults).insert(req_id.into(), fault);
    }

    /// Removes every request fault.
    pub fn clear_request_faults(&self) {
        lock(&self.request_faults).clear();
    }

    /// Every call recorded so far, in start order (empty if recording is off).
    pub fn calls(&self) -> Vec<CallRecord> {
        lock(&self.calls).clone()
    }

    /// Number of calls started.
    pub fn call_count(&self) -> u64 {
        self.next_call.load(Ordering::SeqCst)
    }

    /// Calls running now.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }

    /// Most calls ever running at once.
    pub fn max_in_flight(&self) -> usize {
        self.max_in_flight.load(Ordering::SeqCst)
    }

    fn truth(&self, keys: &[OffloadKey]) -> Vec<bool> {
        let set = self.keys.read().unwrap_or_else(PoisonError::into_inner);
        keys.iter().map(|k| set.contains_key(k)).collect()
    }

    fn finish(&self, index: u64, record: bool, outcome: FaultOutcome) {
        if !record {
            return;
        }
        let mut calls = lock(&self.calls);
        if let Some(call) = calls.iter_mut().rev().find(|c| c.index == index) {
            call.outcome = outcome;
            call.finished = Some(Instant::now());
        }
    }
}

impl Tier for FaultTier {
    async fn batch_lookup(
        &self,
        keys: &[OffloadKey],
        ctx: &ReqContext,
    ) -> Result<Vec<bool>, TierError> {
        let index = self.next_call.fetch_add(1, Ordering::SeqCst);
        let now_running = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_in_flight.fetch_max(now_running, Ordering::SeqCst);
        let _guard = InFlight(self);

        let config = self.config();
        let fault = lock(&self.request_faults).get(ctx.req_id()).copied();
        let record = config.record_calls;
        if record {
            lock(&self.calls).push(CallRecord {
                index,
                req_id: ctx.req_id().to_owned(),
                keys: keys.to_vec(),
                outcome: FaultOutcome::Unfinished,
                started: Instant::now(),
                finished: None,
            });
        }

        let mut rng = SplitMix::for_call(config.seed, index);
        let jitter = if config.jitter_us > 0 {
            rng.next_u64() % (config.jitter_us + 1)
        } else {
            0
        };
        let mut latency = Duration::from_micros(config.latency_us.saturating_add(jitter));
        match fault {
            Some(RequestFault::Delay(extra)) => latency += extra,
            Some(RequestFault::Hang) => {
                self.finish(index, record, FaultOutcome::Hung);
                std::future::pending::<()>().await;
            }
            Some(RequestFault::Fail) => {
                self.finish(index, record, FaultOutcome::Failed);
                return Err(TierError::new(
                    TierErrorKind::Unavailable,
                    format!("mock: injected failure for request {}", ctx.req_id()),
                ));
            }
            None => {}
        }
        if !latency.is_zero() {
            tokio::time::sleep(latency).await;
        }

        if rng.next_f64() < config.hang_probability {
            match config.hang_ms {
                None => {
                    self.finish(index, record, FaultOutcome::Hung);
                    std::future::pending::<()>().await;
                }
                Some(ms) => tokio::time::sleep(Duration::from_millis(ms)).await,
            }
        }
        if rng.next_f64() < config.failure_probability {
            self.finish(index, record, FaultOutcome::Failed);
            return Err(TierError::new(
                TierErrorKind::Unavailable,
                format!("mock: injected failure for {} keys", keys.len()),
            ));
        }
        if rng.next_f64() < config.panic_probability {
            self.finish(index, record, FaultOutcome::Panicked);
            panic!("mock: injected panic in call {index}");
        }
        let found = self.truth(keys);
        if !found.is_empty() && rng.next_f64() < config.wrong_length_probability {
            self.finish(index, record, FaultOutcome::WrongLength(found.clone()));
            let mut short = found;
            short.pop();
            return Ok(short);
        }
        self.finish(index, record, FaultOutcome::Answered(found.clone()));
        Ok(found)
    }
}

/// Stores, loads and removes in memory, at once: the injected latency and
/// faults apply to lookups only.
impl BlockStore for FaultTier {
    async fn store(&self, key: &OffloadKey, block: &[u8]) -> Result<(), TierError> {
        self.keys
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(key.clone(), block.to_vec());
        Ok(())
    }

    async fn load(&self, key: &OffloadKey) -> Result<Option<Vec<u8>>, TierError> {
        Ok(self
            .keys
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .get(key)
            .cloned())
    }

    async fn remove(&self, key: &OffloadKey) -> Result<(), TierError> {
        self.remove_keys([key]);
        Ok(())
    }

    async fn store_many(&self, blocks: &[(OffloadKey, Vec<u8>)]) -> Result<(), TierError> {
        self.keys
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .extend(blocks.iter().cloned());
        Ok(())
    }

    fn manager_config(&self, config: ManagerConfig) -> ManagerConfig {
        config.or_named("mock")
    }
}
