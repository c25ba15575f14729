//! Fixed-size runs of the ledger's operations, for instruction counts under
//! `valgrind --tool=callgrind` (repeatable on a noisy machine, unlike time).
//! Each operation runs inside a function named `measured_<op>`:
//!
//! ```text
//! cargo bench -p kvtier-core --bench ledger_ops --no-run
//! valgrind --tool=callgrind --toggle-collect='*measured_*' target/release/deps/ledger_ops-* w1
//! ```
//!
//! `w1`: 1M lookups of 100k resolved keys; `w1map`: the same lookups in a
//! bare `HashMap` with the manager's prehashed hasher (to compare `w1`
//! with); `w2`: 50 steps of 64 requests ×
//! 32 keys (half shared by 4 requests), each step looking up every key
//! without a verdict, then flushing, answering and cleaning up finished
//! requests; `base`: the same steps through `kvbench w2`'s minimal step
//! loop (a bare `HashMap`), the instruction count to compare `w2` with;
//! `w3`: `kvbench w3`'s scheduler side without a tier, 96 one-request
//! steps of 1,024 new keys (half present) looked up and flushed at once
//! under the default limits (8 steps in flight: most calls wait for a
//! slot), each call answered in order as it starts, then every key checked
//! and each request cleaned up, ten times.
//! Prints the number of operations, to divide the count by.
//!
//! The manager's own w1 loop (its checks for results and shutdown included)
//! is `kvbench w1`'s `time_manager`: count it with
//! `--toggle-collect='*time_manager*' target/release/kvbench w1 --quick`
//! (500k lookups). It is not here: a second caller of `Ledger::lookup` in
//! this binary changes what the compiler inlines into `measured_w1`.

mod common;

use std::collections::{HashMap, VecDeque};
use std::hint::black_box;
use std::time::{Duration, Instant};

use kvtier_core::ledger::{CallOutcome, LazyNow, Ledger, LookupVerdict};
use kvtier_core::{ManagerConfig, OffloadKey, ReqContext};

use common::{flush_and_answer, key, ledger, resolved, step_keys};

#[inline(never)]
fn measured_w1(l: &mut Ledger, keys: &[OffloadKey], order: &[u32], ctx: &ReqContext) -> usize {
    let mut hits = 0;
    let mut now = LazyNow::new();
    for &i in order {
        if l.lookup(black_box(&keys[i as usize]), ctx, &mut now) == Ok(LookupVerdict::Hit) {
            hits += 1;
        }
    }
    hits
}

/// `measured_w1`'s loop over a bare `HashMap` of the same keys with the
/// manager's prehashed hasher: the instruction count to compare `w1` with.
#[inline(never)]
fn measured_w1_map(
    map: &HashMap<OffloadKey, bool, kvtier_core::BuildPrehashed>,
    keys: &[OffloadKey],
    order: &[u32],
) -> usize {
    let mut hits = 0;
    for &i in order {
        if map
            .get(black_box(&keys[i as usize]))
            .copied()
            .unwrap_or(false)
        {
            hits += 1;
        }
    }
    hits
}

/// One w2 step: the cohort flushed the step before (its keys answered:
/// `w2_answered`), then the new one (`w2_new`), then `w2_flush`; each is a
/// function of its own, so `callgrind_annotate --inclusive=yes` gives each
/// phase's count.
#[inline(never)]
fn measured_w2_step(l: &mut Ledger, cohorts: &mut [Cohort], now: Instant) -> usize {
    let mut lazy = LazyNow::at(now);
    let mut resolved = 0;
    let n = cohorts.len();
    for (i, c) in cohorts.iter_mut().enumerate() {
        resolved += if i + 1 == n {
            w2_new(l, c, &mut lazy)
        } else {
            w2_answered(l, c, &mut lazy)
        };
    }
    w2_flush(l, now);
    resolved
}

#[inline(never)]
fn w2_flush(l: &mut Ledger, now: Instant) {
    flush_and_answer(l, now)
}

#[inline(never)]
fn w2_new(l: &mut Ledger, c: &mut Cohort, lazy: &mut LazyNow) -> usize {
    w2_lookups(l, c, lazy)
}

#[inline(never)]
fn w2_answered(l: &mut Ledger, c: &mut Cohort, lazy: &mut LazyNow) -> usize {
    // `black_box`: two identical functions would be merged into one.
    w2_lookups(l, c, lazy) + black_box(0)
}

/// Every key of a cohort without a verdict, looked up once.
#[inline(always)]
fn w2_lookups(l: &mut Ledger, c: &mut Cohort, lazy: &mut LazyNow) -> usize {
    let mut resolved = 0;
    for (ctx, keys, done) in c.iter_mut() {
        for (k, d) in keys.iter().zip(done.iter_mut()) {
            if *d {
                continue;
            }
            if l.lookup(k, ctx, lazy) != Ok(LookupVerdict::Pending) {
                *d = true;
                resolved += 1;
            }
        }
    }
    resolved
}

type Cohort = Vec<(ReqContext, Vec<OffloadKey>, Vec<bool>)>;

/// Step `step`'s cohort (64 requests × 32 keys), nothing answered yet.
fn cohort(step: u64) -> Cohort {
    step_keys(step, 64, 32)
        .into_iter()
        .map(|(c, k)| {
            let n = k.len();
            (c, k, vec![false; n])
        })
        .collect()
}

/// The lookups a step will make: every key without an answer.
fn unanswered(active: &[Cohort]) -> usize {
    active
        .iter()
        .flatten()
        .map(|(_, _, d)| d.iter().filter(|d| !**d).count())
        .sum()
}

/// The minimal step loop of `kvbench w2`'s baseline, on the same steps as
/// `measured_w2_step`: a new key is a get-or-insert into a `HashMap` plus a
/// push onto its request's batch, a resolved key one `get`, an answer one
/// `get_mut`, and a flush moves each request's `Vec`. Its phases are
/// functions of their own, as `measured_w2_step`'s: `base_answers`,
/// `base_answered` (the cohort flushed the step before) and `base_new`.
#[inline(never)]
fn measured_base_step(
    state: &mut BaseMap,
    cohorts: &mut [Cohort],
    answers: &mut Vec<(Vec<OffloadKey>, Vec<bool>)>,
) -> Vec<Vec<OffloadKey>> {
    base_answers(state, answers);
    let mut batch = Vec::new();
    let n = cohorts.len();
    for (i, c) in cohorts.iter_mut().enumerate() {
        if i + 1 == n {
            base_new(state, c, &mut batch);
        } else {
            base_answered(state, c, &mut batch);
        }
    }
    batch
}

type BaseMap = HashMap<OffloadKey, u8, kvtier_core::BuildPrehashed>;

#[inline(never)]
fn base_answers(state: &mut BaseMap, answers: &mut Vec<(Vec<OffloadKey>, Vec<bool>)>) {
    for (keys, found) in answers.drain(..) {
        for (key, present) in keys.iter().zip(found) {
            if let Some(s) = state.get_mut(key) {
                *s = 1 + u8::from(!present);
            }
        }
    }
}

#[inline(never)]
fn base_new(state: &mut BaseMap, c: &mut Cohort, batch: &mut Vec<Vec<OffloadKey>>) {
    base_lookups(state, c, batch);
}

#[inline(never)]
fn base_answered(state: &mut BaseMap, c: &mut Cohort, batch: &mut Vec<Vec<OffloadKey>>) {
    // `black_box`: two identical functions would be merged into one.
    base_lookups(state, c, black_box(batch));
}

#[inline(always)]
fn base_lookups(state: &mut BaseMap, c: &mut Cohort, batch: &mut Vec<Vec<OffloadKey>>) {
    const PENDING: u8 = 0;
    for (_, keys, done) in c.iter_mut() {
        let mut new_keys = Vec::new();
        for (k, d) in keys.iter().zip(done.iter_mut()) {
            if *d {
                continue;
            }
            match state.get(black_box(k)) {
                Some(&PENDING) => {}
                Some(_) => *d = true,
                None => {
                    state.insert(k.clone(), PENDING);
                    new_keys.push(k.clone());
                }
            }
        }
        if !new_keys.is_empty() {
            batch.push(new_keys);
        }
    }
}

/// The scheduler's side of one `kvbench w3` pass (see the module
/// documentation); returns the hits.
#[inline(never)]
fn measured_w3(l: &mut Ledger, steps: &[(ReqContext, Vec<OffloadKey>)]) -> usize {
    let now = Instant::now();
    let mut lazy = LazyNow::at(now);
    let mut running = VecDeque::new();
    let mut calls = Vec::new();
    for (ctx, keys) in steps {
        for k in keys {
            l.lookup(black_box(k), ctx, &mut lazy).ok();
        }
        l.flush_and_start(now, &mut calls);
        running.extend(calls.drain(..));
    }
    // The tier answers the calls in the order they started; each answer
    // frees a slot for a waiting call, as the manager's drain does.
    while let Some(call) = running.pop_front() {
        let found = (0..call.keys.len()).map(|i| i % 2 == 0).collect();
        let elapsed = Duration::from_micros(700);
        l.complete_ended(call.id, CallOutcome::Answered(found), elapsed, now, now);
        l.reuse_keys(call.keys);
        while let Some(next) = l.next_call(now) {
            running.push_back(next);
        }
    }
    let mut hits = 0;
    for (ctx, keys) in steps {
        for k in keys {
            if l.lookup(k, ctx, &mut lazy) == Ok(LookupVerdict::Hit) {
                hits += 1;
            }
        }
        l.cleanup(ctx.req_id());
    }
    hits
}

fn main() {
    let which = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .unwrap_or_else(|| "w1".to_owned());
    match which.as_str() {
        "w1" | "w1map" => {
            let ctx = ReqContext::new("w1");
            let (mut l, keys) = resolved(100_000, &ctx);
            let mut x = 42u64;
            let order: Vec<u32> = (0..1_000_000)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x % keys.len() as u64) as u32
                })
                .collect();
            let hits = if which == "w1" {
                measured_w1(&mut l, &keys, &order, &ctx)
            } else {
                let map: HashMap<OffloadKey, bool, kvtier_core::BuildPrehashed> = keys
                    .iter()
                    .map(|k| {
                        (
                            k.clone(),
                            l.lookup(k, &ctx, &mut LazyNow::new()) == Ok(LookupVerdict::Hit),
                        )
                    })
                    .collect();
                measured_w1_map(&map, &keys, &order)
            };
            println!("{which}: {} lookups, {hits} hits", order.len());
        }
        "w3" => {
            let mut l = Ledger::new(
                &ManagerConfig {
                    max_queued_keys: 1 << 20,
                    ..ManagerConfig::named("bench")
                },
                Instant::now(),
            );
            let (mut lookups, mut hits) = (0usize, 0usize);
            for pass in 0..10u64 {
                let steps: Vec<(ReqContext, Vec<OffloadKey>)> = (0..96u64)
                    .map(|s| {
                        let first = (pass * 96 + s) * 1024;
                        let keys = (first..first + 1024).map(key).collect();
                        (ReqContext::new(format!("w3-{pass}-{s}")), keys)
                    })
                    .collect();
                hits += measured_w3(&mut l, &steps);
                lookups += 96 * 1024;
            }
            println!("w3: {lookups} keys, {hits} hits");
        }
        "w2" => {
            let mut l = ledger(1 << 20);
            let mut lookups = 0usize;
            let mut active: Vec<Cohort> = Vec::new();
            for step in 0..52u64 {
                if step < 50 {
                    active.push(cohort(step));
                }
                let now = Instant::now();
                lookups += unanswered(&active);
                black_box(measured_w2_step(&mut l, &mut active, now));
                active.retain(|cohort| {
                    let done = cohort.iter().all(|(_, _, d)| d.iter().all(|d| *d));
                    if done {
                        for (ctx, _, _) in cohort {
                            l.cleanup(ctx.req_id());
                        }
                    }
                    !done
                });
            }
            assert!(l.is_empty(), "state left after cleanup");
            println!("w2: 50 cohorts, {lookups} lookups");
        }
        "base" => {
            let mut state = HashMap::default();
            let mut answers = Vec::new();
            let mut lookups = 0usize;
            let mut active: Vec<Cohort> = Vec::new();
            for step in 0..52u64 {
                if step < 50 {
                    active.push(cohort(step));
                }
                lookups += unanswered(&active);
                let flushed = measured_base_step(&mut state, &mut active, &mut answers);
                // The tier's side, outside the count: half the keys present.
                for keys in flushed {
                    let found = (0..keys.len()).map(|i| i % 2 == 0).collect();
                    answers.push((keys, found));
                }
                active.retain(|cohort| {
                    let done = cohort.iter().all(|(_, _, d)| d.iter().all(|d| *d));
                    if done {
                        for (_, keys, _) in cohort {
                            for k in keys {
                                state.remove(k);
                            }
                        }
                    }
                    !done
                });
            }
            assert!(state.is_empty(), "state left after cleanup");
            println!("base: 50 cohorts, {lookups} lookups");
        }
        other => {
            eprintln!("ledger_ops: unknown operation {other} (w1, w1map, w2, base)");
            std::process::exit(2);
        }
    }
}
