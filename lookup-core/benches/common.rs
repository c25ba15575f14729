//! Shared set-up of the ledger benchmarks: keys, a ledger whose keys are
//! resolved, and one scheduler step driven without threads.

#![allow(dead_code)]

use std::time::{Duration, Instant};

use kvtier_core::ledger::{CallOutcome, LazyNow, Ledger};
use kvtier_core::{ManagerConfig, OffloadKey, ReqContext};

/// A 36-byte key (vLLM's layout size) unique to `id`.
pub fn key(id: u64) -> OffloadKey {
    let mut bytes = [0u8; 36];
    let mut x = id ^ 0x9e37_79b9_7f4a_7c15;
    for chunk in bytes.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let word = x.to_le_bytes();
        chunk.copy_from_slice(&word[..chunk.len()]);
    }
    bytes[..8].copy_from_slice(&id.to_be_bytes());
    OffloadKey::new(&bytes)
}

pub fn ledger(max_queued: usize) -> Ledger {
    Ledger::new(
        &ManagerConfig {
            max_queued_keys: max_queued,
            max_calls_in_flight: 1 << 20,
            max_steps_in_flight: 1 << 20,
            ..ManagerConfig::named("bench")
        },
        Instant::now(),
    )
}

/// Flushes and answers every call, half the keys present, then expires
/// what is past its deadline, as the manager does after applying answers
/// (`AsyncLookupManager::flush` and every drain); each call's key list is
/// given back for reuse, as the manager's worker does.
pub fn flush_and_answer(ledger: &mut Ledger, now: Instant) {
    let mut calls = Vec::new();
    ledger.flush_and_start(now, &mut calls);
    for call in calls {
        let found = (0..call.keys.len()).map(|i| i % 2 == 0).collect();
        ledger.complete(call.id, CallOutcome::Answered(found), Duration::ZERO, now);
        ledger.reuse_keys(call.keys);
    }
    ledger.expire(now);
}

/// A ledger with `n` resolved keys, all referred to by request `ctx`.
pub fn resolved(n: u64, ctx: &ReqContext) -> (Ledger, Vec<OffloadKey>) {
    let keys: Vec<OffloadKey> = (0..n).map(key).collect();
    let mut l = ledger(2 * n as usize);
    let now = Instant::now();
    let mut lazy = LazyNow::at(now);
    for k in &keys {
        l.lookup(k, ctx, &mut lazy).expect("valid key");
    }
    flush_and_answer(&mut l, now);
    (l, keys)
}

/// A fresh ledger in which every request of `step` has looked up its keys
/// (new keys, not yet flushed).
pub fn looked_up(step: &[(ReqContext, Vec<OffloadKey>)]) -> Ledger {
    let mut l = ledger(1 << 20);
    let mut now = LazyNow::new();
    for (ctx, keys) in step {
        for k in keys {
            l.lookup(k, ctx, &mut now).ok();
        }
    }
    l
}

/// The w2 step shape: `requests` requests of `per_request` keys, half of
/// each request's keys shared by groups of 4 requests.
pub fn step_keys(
    step: u64,
    requests: usize,
    per_request: usize,
) -> Vec<(ReqContext, Vec<OffloadKey>)> {
    let base = step << 32;
    (0..requests)
        .map(|r| {
            let shared = (r / 4) as u64;
            let mut keys: Vec<OffloadKey> = (0..per_request as u64 / 2)
                .map(|i| key(base | (shared << 16) | i))
                .collect();
            keys.extend(
                (0..per_request as u64 / 2).map(|i| key(base | (1 << 31) | ((r as u64) << 16) | i)),
            );
            (ReqContext::new(format!("s{step}-r{r}")), keys)
        })
        .collect()
}
