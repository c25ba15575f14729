//! `DiskTier::contains_many` on 1,024-key batches over a 1M-key index (the
//! kvbench w5 workload, one operation at a time), next to an in-memory
//! `HashSet` of the same keys in the same run.
//!
//! `cargo bench -p kvtier-disk --bench batch_lookup`; `KVTIER_BENCH_KEYS`
//! changes the index size.

mod common;

use std::collections::HashSet;
use std::hint::black_box;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use kvtier_core::OffloadKey;

fn batch_lookup(c: &mut Criterion) {
    let n = common::key_count(1_000_000);
    let dir = tempfile::tempdir().expect("bench directory");
    let tier = common::filled_tier(dir.path(), n);
    let batches = common::batches(n, 256);
    let set: HashSet<OffloadKey> = (0..n).map(common::key).collect();

    let mut group = c.benchmark_group(format!("batch_lookup_1024_of_{n}"));
    group.throughput(Throughput::Elements(common::BATCH as u64));
    let mut next = batches.iter().cycle();
    group.bench_function("disk_contains_many", |b| {
        b.iter(|| {
            let batch = next.next().expect("cycle never ends");
            black_box(
                tier.contains_many(black_box(batch))
                    .expect("right key size"),
            )
        });
    });
    let mut next = batches.iter().cycle();
    group.bench_function("hashset_contains", |b| {
        b.iter(|| {
            let batch = next.next().expect("cycle never ends");
            black_box(
                black_box(batch)
                    .iter()
                    .map(|k| set.contains(k))
                    .collect::<Vec<bool>>(),
            )
        });
    });
    group.finish();
}

criterion_group!(benches, batch_lookup);
criterion_main!(benches);
