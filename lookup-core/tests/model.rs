//! Model-based property test of the lookup state machine.
//!
//! Random interleavings of lookup, lookup_prefix, flush, call starts, answer
//! delivery in any order (correct, failed, short, late after the deadline),
//! deadline expiry, cleanup, mark_miss, mark_present and changes of the tier's truth drive
//! the real [`Ledger`] and a deliberately naive model side by side. After
//! every step:
//! - every verdict equals the model's: the tier's truth when the probe was
//!   answered, a miss after mark_miss, a hit after mark_present (whatever
//!   a probe started before it answers later), a miss during a failure's
//!   back-off;
//! - no key is sent twice for one probe (enqueue once);
//! - the number of tracked keys agrees.
//!
//! At the end every request is cleaned up and every call answered: the
//! ledger must then be empty.
//!
//! The tenant case runs the same machine with tenants that share block
//! hashes but not blocks: each salts its keys (vLLM's `cache_salt`), the
//! tier's truth differs per tenant, and a request only asks for its own
//! tenant's keys. On top of the model's checks, no tenant may ever get a hit
//! for a block only another tenant holds.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use kvtier_core::ledger::{CallId, CallOutcome, LazyNow, Ledger, TierCall};
use kvtier_core::{
    LookupVerdict, ManagerConfig, OffloadKey, PrefixVerdict, ReqContext, TierError, TierErrorKind,
};
use proptest::prelude::*;

const KEYS: u8 = 6;
const REQS: u8 = 3;
/// Tenant case: request `r` belongs to tenant `r % TENANTS`, and key id `k`
/// is block `k % BLOCKS` of tenant `k / BLOCKS`.
const TENANTS: u8 = 2;
const BLOCKS: u8 = KEYS / TENANTS;
const TIMEOUT_MS: u64 = 100;
const BACKOFF_MS: u64 = 50;

#[derive(Debug, Clone)]
enum Op {
    Lookup { req: u8, key: u8 },
    Prefix { req: u8, start: u8, len: u8 },
    Flush,
    StartCalls,
    // `Ledger::flush_and_start`, what the manager does at each step (or, in
    // a harness with `fused == false`, `flush` then `next_call` until none:
    // the two must agree).
    FlushAndStart,
    Deliver { pick: usize, how: Answer },
    Advance { ms: u64 },
    Cleanup { req: u8 },
    MarkMiss { key: u8 },
    MarkPresent { key: u8 },
    SetTruth { key: u8, present: bool },
}

#[derive(Debug, Clone, Copy)]
enum Answer {
    Correct,
    Failed,
    Short,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        6 => (0..REQS, 0..KEYS).prop_map(|(req, key)| Op::Lookup { req, key }),
        3 => (0..REQS, 0..KEYS, 1..=KEYS).prop_map(|(req, start, len)| Op::Prefix { req, start, len }),
        3 => Just(Op::Flush),
        3 => Just(Op::StartCalls),
        3 => Just(Op::FlushAndStart),
        5 => (any::<usize>(), prop_oneof![6 => Just(Answer::Correct), 1 => Just(Answer::Failed), 1 => Just(Answer::Short)])
            .prop_map(|(pick, how)| Op::Deliver { pick, how }),
        2 => (0..=2 * TIMEOUT_MS).prop_map(|ms| Op::Advance { ms }),
        2 => (0..REQS).prop_map(|req| Op::Cleanup { req }),
        1 => (0..KEYS).prop_map(|key| Op::MarkMiss { key }),
        1 => (0..KEYS).prop_map(|key| Op::MarkPresent { key }),
        2 => (0..KEYS, any::<bool>()).prop_map(|(key, present)| Op::SetTruth { key, present }),
    ]
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum MPhase {
    /// Not yet answered; `call` says whether a call carries it.
    Waiting,
    Present,
    Absent,
    Forced,
    Failed {
        retry_at: Instant,
    },
}

#[derive(Debug)]
struct MKey {
    refs: HashSet<u8>,
    phase: MPhase,
    call: Option<CallId>,
    /// When the flush that queued this probe happened (None: not flushed yet).
    flushed_at: Option<Instant>,
    /// Re-probing after a failure: answers miss until the probe lands.
    revalidating: bool,
}

/// The naive model: per key, who refers to it and what it answers.
#[derive(Debug, Default)]
struct Model {
    keys: HashMap<u8, MKey>,
}

impl Model {
    fn lookup(&mut self, req: u8, key: u8, now: Instant) -> LookupVerdict {
        let entry = self.keys.entry(key).or_insert_with(|| MKey {
            refs: HashSet::new(),
            phase: MPhase::Waiting,
            call: None,
            flushed_at: None,
            revalidating: false,
        });
        entry.refs.insert(req);
        match entry.phase {
            MPhase::Waiting if entry.revalidating => LookupVerdict::Miss,
            MPhase::Waiting => LookupVerdict::Pending,
            MPhase::Present => LookupVerdict::Hit,
            MPhase::Absent | MPhase::Forced => LookupVerdict::Miss,
            MPhase::Failed { retry_at } if now < retry_at => LookupVerdict::Miss,
            MPhase::Failed { .. } => {
                entry.phase = MPhase::Waiting;
                entry.call = None;
                entry.flushed_at = None;
                entry.revalidating = true;
                LookupVerdict::Miss
            }
        }
    }

    fn prefix(&mut self, req: u8, keys: &[u8], now: Instant) -> PrefixVerdict {
        let (mut hits, mut pending) = (0, false);
        for &k in keys {
            match self.lookup(req, k, now) {
                LookupVerdict::Hit => hits += 1,
                LookupVerdict::Miss => break,
                LookupVerdict::Pending => pending = true,
            }
        }
        if pending {
            PrefixVerdict::Pending
        } else {
            PrefixVerdict::Ready(hits)
        }
    }

    /// Applies `phase` to `key` if `call` is still its probe.
    fn resolve(&mut self, key: u8, call: CallId, phase: MPhase) {
        let Some(entry) = self.keys.get_mut(&key) else {
            return;
        };
        if entry.call != Some(call) || entry.phase != MPhase::Waiting {
            return;
        }
        entry.call = None;
        if entry.refs.is_empty() {
            self.keys.remove(&key);
        } else {
            entry.phase = phase;
            entry.revalidating = false;
        }
    }

    fn cleanup(&mut self, req: u8) {
        self.keys.retain(|_, entry| {
            entry.refs.remove(&req);
            let in_flight = entry.phase == MPhase::Waiting && entry.call.is_some();
            !entry.refs.is_empty() || in_flight
        });
    }
}

struct Harness {
    ledger: Ledger,
    model: Model,
    truth: [bool; KEYS as usize],
    now: Instant,
    /// Calls started and not yet delivered (an expired call stays, to be delivered late).
    calls: Vec<TierCall>,
    /// Call id → its keys, as model ids.
    call_keys: HashMap<CallId, Vec<u8>>,
    expired: HashSet<CallId>,
    ctxs: Vec<ReqContext>,
    keys: Vec<OffloadKey>,
    /// Key bytes → key id.
    ids: HashMap<OffloadKey, u8>,
    /// Tenant case: requests ask only for their tenant's keys, and whether
    /// each key was ever present in the tier.
    tenants: bool,
    ever_present: [bool; KEYS as usize],
    /// Whether `FlushAndStart` calls `flush_and_start` (else `flush`, then
    /// `next_call` until none).
    fused: bool,
}

/// The key of `block` for `tenant`: the tenant's salt goes into the block
/// hash (here its first byte, standing for vLLM's salted hash chain), so the
/// same prompt gives different keys per tenant.
fn salted(tenant: u8, block: u8) -> OffloadKey {
    let mut hash = [block; 32];
    hash[0] = 0xa0 + tenant;
    OffloadKey::from_block_hash(&hash, 0)
}

impl Harness {
    /// The tenant case: salted keys, tenant 0 holding every block and
    /// tenant 1 none until the tier's truth changes.
    fn with_tenants() -> Self {
        let mut h = Self::new();
        h.keys = (0..KEYS).map(|k| salted(k / BLOCKS, k % BLOCKS)).collect();
        h.ids = h.keys.iter().cloned().zip(0..).collect();
        h.tenants = true;
        for k in 0..BLOCKS {
            h.truth[usize::from(k)] = true;
            h.ever_present[usize::from(k)] = true;
        }
        h
    }

    /// The key id request `req` asks for when told `key`: in the tenant
    /// case, that block of the request's own tenant.
    fn key_for(&self, req: u8, key: u8) -> u8 {
        if self.tenants {
            (req % TENANTS) * BLOCKS + key % BLOCKS
        } else {
            key
        }
    }

    fn key_id(&self, key: &OffloadKey) -> u8 {
        self.ids.get(key).copied().unwrap_or(u8::MAX)
    }

    /// A hit for a key whose tier never held it was another tenant's.
    fn check_tenant_hit(&self, req: u8, key: u8) -> Result<(), TestCaseError> {
        prop_assert!(
            self.ever_present[usize::from(key)],
            "request {} of tenant {} got a hit for block {}, which only another tenant holds",
            req,
            req % TENANTS,
            key % BLOCKS
        );
        Ok(())
    }

    fn new() -> Self {
        Self::with_limits(2, 2)
    }

    /// A harness whose ledger starts at most `calls` calls of at most
    /// `steps` flushes at once.
    fn with_limits(calls: usize, steps: usize) -> Self {
        let cfg = ManagerConfig {
            call_timeout_ms: TIMEOUT_MS,
            failure_backoff_ms: BACKOFF_MS,
            max_calls_in_flight: calls,
            max_steps_in_flight: steps,
            max_keys_per_call: 3, // checked in start_calls
            max_queued_keys: 10_000,
            ..ManagerConfig::named("model")
        };
        Self {
            ledger: Ledger::new(&cfg, Instant::now()),
            model: Model::default(),
            truth: [false; KEYS as usize],
            now: Instant::now(),
            calls: Vec::new(),
            call_keys: HashMap::new(),
            expired: HashSet::new(),
            ctxs: (0..REQS)
                .map(|r| ReqContext::new(format!("req-{r}")))
                .collect(),
            keys: (0..KEYS).map(|k| OffloadKey::new(&[k; 36])).collect(),
            ids: (0..KEYS).map(|k| (OffloadKey::new(&[k; 36]), k)).collect(),
            tenants: false,
            ever_present: [false; KEYS as usize],
            fused: true,
        }
    }

    /// The model's side of a flush: waiting keys not in a call are flushed.
    fn model_flush(&mut self) {
        for entry in self.model.keys.values_mut() {
            if entry.phase == MPhase::Waiting && entry.call.is_none() && entry.flushed_at.is_none()
            {
                entry.flushed_at = Some(self.now);
            }
        }
    }

    fn start_calls(&mut self) -> Result<(), TestCaseError> {
        let mut calls = Vec::new();
        while let Some(call) = self.ledger.next_call(self.now) {
            calls.push(call);
        }
        self.take_calls(calls)
    }

    /// Checks calls just started against the model and keeps them.
    fn take_calls(&mut self, calls: Vec<TierCall>) -> Result<(), TestCaseError> {
        for call in calls {
            let ids: Vec<u8> = call.keys.iter().map(|k| self.key_id(k)).collect();
            prop_assert!(
                !ids.is_empty() && ids.len() <= 3,
                "a call of {} keys (max_keys_per_call is 3)",
                ids.len()
            );
            for &k in &ids {
                let Some(entry) = self.model.keys.get_mut(&k) else {
                    return Err(TestCaseError::fail(format!(
                        "sent a key nobody tracks: {k}"
                    )));
                };
                prop_assert_eq!(entry.phase, MPhase::Waiting, "sent a resolved key {}", k);
                prop_assert!(entry.call.is_none(), "key {} sent twice for one probe", k);
                entry.call = Some(call.id);
            }
            prop_assert_eq!(call.deadline, self.now + Duration::from_millis(TIMEOUT_MS));
            self.call_keys.insert(call.id, ids);
            self.calls.push(call);
        }
        Ok(())
    }

    fn deliver(&mut self, pick: usize, how: Answer) {
        if self.calls.is_empty() {
            return;
        }
        let call = self.calls.remove(pick % self.calls.len());
        let ids = self.call_keys.remove(&call.id).unwrap_or_default();
        let truth: Vec<bool> = ids.iter().map(|&k| self.truth[usize::from(k)]).collect();
        let outcome = match how {
            Answer::Correct => CallOutcome::Answered(truth.clone()),
            Answer::Short => CallOutcome::Answered(truth[..truth.len() - 1].to_vec()),
            Answer::Failed => {
                CallOutcome::Failed(TierError::new(TierErrorKind::Unavailable, "injected"))
            }
        };
        self.ledger
            .complete(call.id, outcome, Duration::from_micros(10), self.now);
        if self.expired.remove(&call.id) {
            return; // a late answer: the model already resolved it as a timeout
        }
        let retry_at = self.now + Duration::from_millis(BACKOFF_MS);
        for (&k, &present) in ids.iter().zip(&truth) {
            let phase = match how {
                Answer::Correct if present => MPhase::Present,
                Answer::Correct => MPhase::Absent,
                _ => MPhase::Failed { retry_at },
            };
            self.model.resolve(k, call.id, phase);
        }
    }

    fn advance(&mut self, ms: u64) {
        self.now += Duration::from_millis(ms);
        self.ledger.expire(self.now);
        let retry_at = self.now + Duration::from_millis(BACKOFF_MS);
        for call in &self.calls {
            if call.deadline <= self.now && self.expired.insert(call.id) {
                for &k in &self.call_keys[&call.id] {
                    self.model.resolve(k, call.id, MPhase::Failed { retry_at });
                }
            }
        }
        // Flushed keys still waiting for a call a whole timeout later.
        let timeout = Duration::from_millis(TIMEOUT_MS);
        for entry in self.model.keys.values_mut() {
            if entry.phase == MPhase::Waiting
                && entry.call.is_none()
                && entry.flushed_at.is_some_and(|t| t + timeout <= self.now)
            {
                entry.phase = MPhase::Failed { retry_at };
                entry.flushed_at = None;
                entry.revalidating = false;
            }
        }
    }

    fn apply(&mut self, op: &Op) -> Result<(), TestCaseError> {
        match *op {
            Op::Lookup { req, key } => {
                let key = self.key_for(req, key);
                let got = self.ledger.lookup(
                    &self.keys[usize::from(key)],
                    &self.ctxs[usize::from(req)],
                    &mut LazyNow::at(self.now),
                );
                let want = self.model.lookup(req, key, self.now);
                prop_assert_eq!(&got, &Ok(want), "lookup req {} key {}", req, key);
                if got == Ok(LookupVerdict::Hit) {
                    self.check_tenant_hit(req, key)?;
                }
            }
            Op::Prefix { req, start, len } => {
                let ids: Vec<u8> = if self.tenants {
                    let first = start % BLOCKS;
                    (first..(first + len).min(BLOCKS))
                        .map(|b| self.key_for(req, b))
                        .collect()
                } else {
                    (start..(start + len).min(KEYS)).collect()
                };
                let keys: Vec<OffloadKey> = ids
                    .iter()
                    .map(|&k| self.keys[usize::from(k)].clone())
                    .collect();
                let got = self.ledger.lookup_prefix(
                    &keys,
                    &self.ctxs[usize::from(req)],
                    &mut LazyNow::at(self.now),
                );
                let want = self.model.prefix(req, &ids, self.now);
                prop_assert_eq!(&got, &Ok(want), "prefix req {} keys {:?}", req, ids);
                if let Ok(PrefixVerdict::Ready(hits)) = got {
                    for &k in &ids[..hits] {
                        self.check_tenant_hit(req, k)?;
                    }
                }
            }
            Op::Flush => {
                self.ledger.flush(self.now);
                self.model_flush();
            }
            Op::StartCalls => self.start_calls()?,
            Op::FlushAndStart if self.fused => {
                let mut calls = Vec::new();
                self.ledger.flush_and_start(self.now, &mut calls);
                self.model_flush();
                self.take_calls(calls)?;
            }
            Op::FlushAndStart => {
                self.ledger.flush(self.now);
                self.model_flush();
                self.start_calls()?;
            }
            Op::Deliver { pick, how } => self.deliver(pick, how),
            Op::Advance { ms } => self.advance(ms),
            Op::Cleanup { req } => {
                self.ledger.cleanup(self.ctxs[usize::from(req)].req_id());
                self.model.cleanup(req);
            }
            Op::MarkMiss { key } => {
                self.ledger.mark_miss([&self.keys[usize::from(key)]]);
                if let Some(entry) = self.model.keys.get_mut(&key) {
                    if entry.refs.is_empty() {
                        self.model.keys.remove(&key);
                    } else {
                        entry.phase = MPhase::Forced;
                    }
                }
            }
            Op::MarkPresent { key } => {
                self.ledger.mark_present([&self.keys[usize::from(key)]]);
                // A finished store supersedes every probe started before
                // it: hit at once, and no answer of those probes lands.
                let present = self.model.keys.get(&key).map(|e| e.phase) == Some(MPhase::Present);
                if let Some(entry) = self.model.keys.get_mut(&key)
                    && !present
                {
                    if entry.refs.is_empty() {
                        self.model.keys.remove(&key);
                    } else {
                        entry.phase = MPhase::Present;
                        entry.call = None;
                        entry.flushed_at = None;
                        entry.revalidating = false;
                    }
                }
                // The store put the block in the tier.
                self.truth[usize::from(key)] = true;
                self.ever_present[usize::from(key)] = true;
            }
            Op::SetTruth { key, present } => {
                self.truth[usize::from(key)] = present;
                self.ever_present[usize::from(key)] |= present;
            }
        }
        prop_assert_eq!(
            self.ledger.stats().tracked_keys,
            self.model.keys.len(),
            "tracked keys after {:?}",
            op
        );
        Ok(())
    }
}

/// A call as handed out: id, keys, request, deadline.
type HandedOut = (CallId, Vec<OffloadKey>, String, Instant);

/// What a harness's ledger has handed out and counted so far, to compare
/// two harnesses: its calls (id, keys, request, deadline) and its stats.
fn handed_out(h: &Harness) -> (Vec<HandedOut>, String) {
    let calls = h
        .calls
        .iter()
        .map(|c| (c.id, c.keys.to_vec(), c.ctx.req_id().to_owned(), c.deadline))
        .collect();
    (calls, format!("{:?}", h.ledger.stats()))
}

/// Runs `ops`, then winds down: every request finishes, every call is
/// answered, and the ledger must be empty.
fn run(mut h: Harness, ops: &[Op]) -> Result<(), TestCaseError> {
    for op in ops {
        h.apply(op)?;
    }
    for req in 0..REQS {
        h.apply(&Op::Cleanup { req })?;
    }
    for _ in 0..64 {
        h.apply(&Op::Flush)?;
        h.apply(&Op::StartCalls)?;
        if h.calls.is_empty() {
            break;
        }
        h.apply(&Op::Deliver {
            pick: 0,
            how: Answer::Correct,
        })?;
    }
    prop_assert!(h.calls.is_empty());
    prop_assert!(h.ledger.is_empty(), "state left: {:?}", h.ledger.stats());
    prop_assert!(h.model.keys.is_empty());
    Ok(())
}

/// Probe generations are 56 bits: a harness whose ledger starts this close
/// below 2^56 crosses their wrap-around within a run.
const NEAR_WRAP: u64 = (1 << 56) - 4;

proptest! {
    #![proptest_config(ProptestConfig { max_shrink_iters: 4096, ..ProptestConfig::default() })]

    /// Also with generations that wrap around mid-run: flushes, answers,
    /// cleanups and expiries straddle the wrap.
    #[test]
    fn ledger_matches_the_model(
        ops in proptest::collection::vec(op(), 1..120),
        near_wrap in any::<bool>(),
    ) {
        let mut h = Harness::new();
        if near_wrap {
            h.ledger.start_generations_at(NEAR_WRAP);
        }
        run(h, &ops)?;
    }

    /// `flush_and_start` hands out the same calls (ids, keys, requests,
    /// deadlines) and leaves the same counts as `flush` followed by
    /// `next_call` until none, whatever came before: backlogs, limits,
    /// splits, keys cleaned up or forced to miss, failures.
    #[test]
    fn flush_and_start_is_flush_then_next_call(
        ops in proptest::collection::vec(op(), 1..120),
        (calls, steps) in prop_oneof![Just((2, 2)), Just((1, 1)), Just((3, 1)), Just((1, 3)), Just((8, 8))],
    ) {
        let mut stepwise = Harness::with_limits(calls, steps);
        let mut fused = Harness::with_limits(calls, steps);
        stepwise.fused = false;
        stepwise.ledger.start_generations_at(NEAR_WRAP);
        fused.ledger.start_generations_at(NEAR_WRAP);
        // One clock for both, read after both ledgers were made (a time
        // before a ledger's epoch counts as the epoch): deadlines and
        // times to verdict compare exactly.
        stepwise.now = fused.now;
        for op in &ops {
            fused.apply(op)?;
            stepwise.apply(op)?;
            prop_assert_eq!(handed_out(&fused), handed_out(&stepwise), "after {:?}", op);
        }
    }

    /// Tenants with salted keys over one ledger and a tier whose truth
    /// differs per tenant: every verdict is the asking tenant's own.
    #[test]
    fn tenants_with_salted_keys_get_only_their_own_verdicts(
        ops in proptest::collection::vec(op(), 1..120),
    ) {
        run(Harness::with_tenants(), &ops)?;
    }

    /// Once every key of every request has been flushed and answered, every
    /// request sees a verdict: nothing stays pending forever.
    #[test]
    fn every_flushed_key_gets_a_verdict(
        asks in proptest::collection::vec((0..REQS, 0..KEYS), 1..40),
        answers in proptest::collection::vec(prop_oneof![Just(Answer::Correct), Just(Answer::Failed), Just(Answer::Short)], 64),
    ) {
        let mut h = Harness::new();
        for &(req, key) in &asks {
            h.apply(&Op::Lookup { req, key })?;
        }
        let mut i = 0;
        loop {
            h.apply(&Op::Flush)?;
            h.apply(&Op::StartCalls)?;
            if h.calls.is_empty() {
                break;
            }
            h.apply(&Op::Deliver { pick: i, how: answers[i % answers.len()] })?;
            i += 1;
        }
        for &(req, key) in &asks {
            let v = h.ledger.lookup(&h.keys[usize::from(key)], &h.ctxs[usize::from(req)], &mut LazyNow::at(h.now));
            prop_assert_ne!(v, Ok(LookupVerdict::Pending));
        }
    }
}
