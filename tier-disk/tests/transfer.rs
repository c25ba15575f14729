//! The core's transfer queue over the disk tier (whose I/O blocks, so jobs
//! run on the runtime's blocking threads): round trips of 2 MiB blocks,
//! exact reports when a segment is removed behind the tier's back, and a
//! drain while jobs run.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::key;
use kvtier_core::testkit::block_of;
use kvtier_core::{
    BlockOutcome, HostMemory, JobReport, OffloadKey, Region, TierErrorKind, TransferConfig,
    TransferQueue,
};
use kvtier_disk::{DiskConfig, DiskTier, FsyncPolicy};

const BLOCK: usize = 2 << 20;

fn open(dir: &std::path::Path, fsync: FsyncPolicy) -> Arc<DiskTier> {
    Arc::new(
        DiskTier::open(DiskConfig {
            fsync,
            segment_bytes: 8 << 20, // three 2 MiB records per segment
            capacity_bytes: 1 << 30,
            ..DiskConfig::new(dir)
        })
        .unwrap(),
    )
}

fn reports(queue: &TransferQueue, n: usize) -> Vec<JobReport> {
    let start = Instant::now();
    let mut got = Vec::new();
    while got.len() < n {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "{} of {n} reports",
            got.len()
        );
        queue.wait_for_reports(Duration::from_millis(50));
        got.extend(queue.poll());
    }
    got.sort_by_key(|r| r.id);
    got
}

/// Fills rows `0..n` of `memory` with each key's block.
fn fill(memory: &mut Arc<HostMemory>, keys: &[OffloadKey]) {
    let bytes = Arc::get_mut(memory).unwrap().as_mut_slice();
    for (i, k) in keys.iter().enumerate() {
        bytes[i * BLOCK..(i + 1) * BLOCK].copy_from_slice(&block_of(k, BLOCK));
    }
}

/// A queue over a fresh tier in `dir` with blocks `0..n` stored from the
/// first `n` rows of a memory of `rows` rows: the tier, the queue, the
/// keys and the memory.
fn stored(
    dir: &std::path::Path,
    n: usize,
    rows: usize,
) -> (
    Arc<DiskTier>,
    TransferQueue,
    Vec<OffloadKey>,
    Arc<HostMemory>,
) {
    let tier = open(dir, FsyncPolicy::Never);
    let queue = TransferQueue::new(Arc::clone(&tier), TransferConfig::default()).unwrap();
    let keys: Vec<OffloadKey> = (0..n as u64).map(key).collect();
    let mut memory = Arc::new(HostMemory::zeroed(rows * BLOCK).unwrap());
    fill(&mut memory, &keys);
    queue
        .submit_store(
            keys.clone(),
            memory.clone(),
            Region::rows(0..n, BLOCK).unwrap(),
        )
        .unwrap();
    assert!(reports(&queue, 1)[0].ok());
    (tier, queue, keys, memory)
}

#[test]
fn blocks_of_2_mib_round_trip_through_the_queue() {
    for fsync in [FsyncPolicy::Never, FsyncPolicy::Always] {
        let dir = tempfile::tempdir().unwrap();
        let tier = open(dir.path(), fsync);
        let queue = TransferQueue::new(Arc::clone(&tier), TransferConfig::default()).unwrap();
        let keys: Vec<OffloadKey> = (0..16).map(key).collect();
        let mut memory = Arc::new(HostMemory::zeroed(32 * BLOCK).unwrap());
        fill(&mut memory, &keys);
        // Two jobs of eight blocks each, stored, then loaded into rows 16..32.
        for half in 0..2 {
            let rows = Region::rows(half * 8..half * 8 + 8, BLOCK).unwrap();
            queue
                .submit_store(keys[half * 8..half * 8 + 8].to_vec(), memory.clone(), rows)
                .unwrap();
        }
        assert!(reports(&queue, 2).iter().all(JobReport::ok));
        let rows = Region::rows(16..32, BLOCK).unwrap();
        queue
            .submit_load(keys.clone(), memory.clone(), rows)
            .unwrap();
        let loaded = reports(&queue, 1).remove(0);
        assert!(loaded.ok(), "{loaded:?}");
        assert_eq!(loaded.bytes, 16 * BLOCK as u64);
        let bytes = Arc::get_mut(&mut memory).unwrap().as_mut_slice();
        assert!(
            bytes[..16 * BLOCK] == bytes[16 * BLOCK..],
            "{fsync:?}: loaded blocks differ"
        );
        assert_eq!(tier.stats().stores, 16);
    }
}

/// A segment removed behind the tier's back: the load reports exactly the
/// keys of the other segments as successful, the removed ones `Absent`
/// with their rows untouched.
#[test]
fn a_load_reports_exactly_the_keys_that_survived() {
    let dir = tempfile::tempdir().unwrap();
    let (_tier, queue, keys, mut memory) = stored(dir.path(), 9, 18);
    // Segment 1 holds the first three records.
    std::fs::remove_file(dir.path().join("seg-0000000000000001.kvs")).unwrap();
    queue
        .submit_load(
            keys.clone(),
            memory.clone(),
            Region::rows(9..18, BLOCK).unwrap(),
        )
        .unwrap();
    let loaded = reports(&queue, 1).remove(0);
    assert_eq!(
        loaded.successful_keys().cloned().collect::<Vec<_>>(),
        keys[3..].to_vec()
    );
    assert!(
        loaded.outcomes[..3]
            .iter()
            .all(|o| matches!(o, BlockOutcome::Absent))
    );
    let bytes = Arc::get_mut(&mut memory).unwrap().as_mut_slice();
    assert!(
        bytes[9 * BLOCK..12 * BLOCK].iter().all(|&b| b == 0),
        "absent rows untouched"
    );
    assert!(bytes[3 * BLOCK..9 * BLOCK] == bytes[12 * BLOCK..]);
}

/// A load whose region is not the stored block's length (shorter or
/// longer) is refused at submission, naming the region: the disk tier knows
/// each block's length from its index. Nothing of the job runs (the other
/// rows stay as they were); keys not stored pass the check and load as
/// absent.
#[test]
fn a_load_into_a_row_of_the_wrong_length_is_refused_at_submit() {
    let dir = tempfile::tempdir().unwrap();
    let (_tier, queue, keys, mut memory) = stored(dir.path(), 3, 6);
    for len in [BLOCK - 1, BLOCK / 2, BLOCK + 1] {
        let regions = vec![Region::new(3 * BLOCK, BLOCK), Region::new(4 * BLOCK, len)];
        let refused = queue
            .submit_load(keys[..2].to_vec(), memory.clone(), regions)
            .unwrap_err();
        assert_eq!(
            refused,
            kvtier_core::SubmitError::LengthMismatch {
                index: 1,
                stored: BLOCK,
                region: len
            }
        );
    }
    assert!(queue.poll().is_empty(), "a refused job reports nothing");
    let never_stored = key(99);
    queue
        .submit_load(
            vec![keys[0].clone(), never_stored],
            memory.clone(),
            vec![Region::new(3 * BLOCK, BLOCK), Region::new(4 * BLOCK, 100)],
        )
        .unwrap();
    let loaded = reports(&queue, 1).remove(0);
    assert!(loaded.outcomes[0].is_done());
    assert!(matches!(loaded.outcomes[1], BlockOutcome::Absent));
    let bytes = Arc::get_mut(&mut memory).unwrap().as_mut_slice();
    assert!(bytes[..BLOCK] == bytes[3 * BLOCK..4 * BLOCK]);
    assert!(
        bytes[4 * BLOCK..].iter().all(|&b| b == 0),
        "rows of refused jobs untouched"
    );
}

/// A drain while store jobs run: the running ones finish whole (every key
/// they report stored loads back), the queued ones are cancelled (their
/// keys never stored), and the memory is free once it returns.
#[test]
fn a_drain_while_disk_jobs_run_cancels_only_queued_jobs() {
    let dir = tempfile::tempdir().unwrap();
    let tier = open(dir.path(), FsyncPolicy::Always);
    let config = TransferConfig {
        max_jobs_in_flight: 1,
        chunk_bytes: BLOCK as u64,
        ..TransferConfig::default()
    };
    let queue = TransferQueue::new(Arc::clone(&tier), config).unwrap();
    let keys: Vec<OffloadKey> = (0..24).map(key).collect();
    let mut memory = Arc::new(HostMemory::zeroed(24 * BLOCK).unwrap());
    fill(&mut memory, &keys);
    for job in 0..6 {
        let rows = Region::rows(job * 4..job * 4 + 4, BLOCK).unwrap();
        queue
            .submit_store(keys[job * 4..job * 4 + 4].to_vec(), memory.clone(), rows)
            .unwrap();
    }
    let drained = queue.drain(Some(Duration::from_secs(60)));
    assert!(drained.idle && drained.cancelled >= 1, "{drained:?}");
    assert!(
        Arc::get_mut(&mut memory).is_some(),
        "no job holds the memory"
    );
    let done = queue.poll();
    assert_eq!(done.len(), 6);
    for report in &done {
        let stored = report.successful_keys().count();
        assert!(
            stored == 0 || stored == 4,
            "a started job runs whole: {report:?}"
        );
        if stored == 0 {
            assert!(report.outcomes.iter().all(|o| {
                o.error()
                    .is_some_and(|e| e.kind() == TierErrorKind::Cancelled)
            }));
        }
        let present = tier.contains_many(&report.keys).unwrap();
        assert_eq!(present, vec![stored == 4; 4], "job {}", report.id);
    }
}
