//! Fixed-size runs of the ledger's operations, for instruction counts under
//! `valgrind --tool=callgrind` (repeatable on a noisy machine, unlike time).
//! Each operation runs inside a function named `measured_<op>`:
//!
//! ```text
//! cargo bench -p kvtier-core --bench ledger_ops --no-run
//! valgrind --tool=callgrind --toggle-collect='*measured_*' target/release/deps/ledger_ops-* w1
//! ```
//!
//! `w1`: 1M lookups of 100k resolved keys; `w2`: 50 steps of 64 requests ×
//! 32 keys (half shared by 4 requests), each step looking up every key
//! without a verdict, then flushing, answering and cleaning up finished
//! requests. Prints the number of operations, to divide the count by.

mod common;

use std::hint::black_box;
use std::time::Instant;

use kvtier_core::ledger::{LazyNow, Ledger, LookupVerdict};
use kvtier_core::{OffloadKey, ReqContext};

use common::{flush_and_answer, ledger, resolved, step_keys};

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

#[inline(never)]
fn measured_w2_step(l: &mut Ledger, cohorts: &mut [Cohort], now: Instant) -> usize {
    let mut lazy = LazyNow::at(now);
    let mut resolved = 0;
    for (ctx, keys, done) in cohorts.iter_mut().flatten() {
        for (k, d) in keys.iter().zip(done.iter_mut()) {
            if *d {
                continue;
            }
            if l.lookup(k, ctx, &mut lazy) != Ok(LookupVerdict::Pending) {
                *d = true;
                resolved += 1;
            }
        }
    }
    flush_and_answer(l, now);
    resolved
}

type Cohort = Vec<(ReqContext, Vec<OffloadKey>, Vec<bool>)>;

fn main() {
    let which = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .unwrap_or_else(|| "w1".to_owned());
    match which.as_str() {
        "w1" => {
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
            let hits = measured_w1(&mut l, &keys, &order, &ctx);
            println!("w1: {} lookups, {hits} hits", order.len());
        }
        "w2" => {
            let mut l = ledger(1 << 20);
            let mut lookups = 0usize;
            let mut active: Vec<Cohort> = Vec::new();
            for step in 0..52u64 {
                if step < 50 {
                    active.push(
                        step_keys(step, 64, 32)
                            .into_iter()
                            .map(|(c, k)| {
                                let n = k.len();
                                (c, k, vec![false; n])
                            })
                            .collect(),
                    );
                }
                let now = Instant::now();
                lookups += active
                    .iter()
                    .flatten()
                    .map(|(_, _, d)| d.iter().filter(|d| !**d).count())
                    .sum::<usize>();
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
        other => {
            eprintln!("ledger_ops: unknown operation {other} (w1, w2)");
            std::process::exit(2);
        }
    }
}
