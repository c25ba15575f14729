//! Criterion micro-benchmarks of the ledger's operations, one at a time:
//! lookup of a new key, lookup of a resolved key, flush of a 2,048-key step
//! (starting its calls in the same pass, as the manager does, and through
//! the queue), complete of a step's calls, cleanup of a request.
//!
//! ```text
//! cargo bench -p kvtier-core --bench ledger
//! ```

mod common;

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BatchSize, Criterion, criterion_group, criterion_main};
use kvtier_core::ReqContext;
use kvtier_core::ledger::{CallOutcome, LazyNow};

use common::{flush_and_answer, key, ledger, looked_up, resolved, step_keys};

fn lookup_resolved(c: &mut Criterion) {
    let ctx = ReqContext::new("bench");
    let (mut l, keys) = resolved(100_000, &ctx);
    let mut i = 0usize;
    c.bench_function("lookup_resolved", |b| {
        b.iter(|| {
            // A stride that visits every key in a scattered order.
            i = (i + 7_919) % keys.len();
            black_box(l.lookup(black_box(&keys[i]), &ctx, &mut LazyNow::new()))
        })
    });
}

fn lookup_new(c: &mut Criterion) {
    let ctx = ReqContext::new("bench");
    let keys: Vec<_> = (0..2_048).map(key).collect();
    c.bench_function("lookup_new_2048", |b| {
        b.iter_batched_ref(
            || ledger(1 << 20),
            |l| {
                let mut now = LazyNow::new();
                for k in &keys {
                    black_box(l.lookup(k, &ctx, &mut now)).ok();
                }
            },
            BatchSize::LargeInput,
        )
    });
}

fn flush_step(c: &mut Criterion) {
    let step = step_keys(0, 64, 32);
    // What the manager runs at each step: the calls start in the flush's
    // pass, each taking its run's key list as it is.
    c.bench_function("flush_and_start_2048", |b| {
        b.iter_batched_ref(
            || (looked_up(&step), Vec::with_capacity(64)),
            |(l, calls)| {
                l.flush_and_start(Instant::now(), calls);
                black_box(calls);
            },
            BatchSize::LargeInput,
        )
    });
    // A flush that queues every key, then the calls started from the queue.
    c.bench_function("flush_2048", |b| {
        b.iter_batched_ref(
            || looked_up(&step),
            |l| {
                let now = Instant::now();
                l.flush(now);
                while let Some(call) = l.next_call(now) {
                    black_box(call);
                }
            },
            BatchSize::LargeInput,
        )
    });
}

fn complete_step(c: &mut Criterion) {
    let step = step_keys(0, 64, 32);
    c.bench_function("complete_2048", |b| {
        b.iter_batched_ref(
            || {
                let mut l = looked_up(&step);
                let mut calls = Vec::new();
                l.flush_and_start(Instant::now(), &mut calls);
                (l, calls)
            },
            |(l, calls)| {
                let now = Instant::now();
                for call in calls.drain(..) {
                    let found = vec![true; call.keys.len()];
                    l.complete(call.id, CallOutcome::Answered(found), Duration::ZERO, now);
                }
            },
            BatchSize::LargeInput,
        )
    });
}

fn cleanup_step(c: &mut Criterion) {
    let step = step_keys(0, 64, 32);
    c.bench_function("cleanup_64x32", |b| {
        b.iter_batched_ref(
            || {
                let mut l = looked_up(&step);
                flush_and_answer(&mut l, Instant::now());
                l
            },
            |l| {
                for (ctx, _) in &step {
                    l.cleanup(ctx.req_id());
                }
            },
            BatchSize::LargeInput,
        )
    });
}

criterion_group!(
    benches,
    lookup_resolved,
    lookup_new,
    flush_step,
    complete_step,
    cleanup_step
);
criterion_main!(benches);
