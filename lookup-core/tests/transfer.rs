//! The transfer queue over in-memory stores (`testkit::MemStore`, async and
//! blocking, and `FaultTier`'s provided batch forms): round trips, per-key
//! reports, deadlines, bounds, drains that cut no copy, bounded shutdowns,
//! concurrent submitters and refused jobs.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvtier_core::testkit::{self, Fixture, MemStore, block_of, unique_keys};
use kvtier_core::{
    BlockOutcome, HostBuffer, HostMemory, JobId, JobReport, OffloadKey, Region, Spawner,
    SubmitError, TierErrorKind, TransferConfig, TransferQueue,
};

const ROW: usize = 4096;

fn memory(rows: usize) -> Arc<HostMemory> {
    Arc::new(HostMemory::zeroed(rows * ROW).unwrap())
}

fn bytes_of(memory: &mut Arc<HostMemory>) -> &mut [u8] {
    Arc::get_mut(memory)
        .expect("no job holds the memory any more")
        .as_mut_slice()
}

fn rows(range: std::ops::Range<usize>) -> Vec<Region> {
    Region::rows(range, ROW).unwrap()
}

/// Polls until `n` reports arrived (panics after 20 s), sorted by job id.
fn reports(queue: &TransferQueue, n: usize) -> Vec<JobReport> {
    let start = Instant::now();
    let mut got = Vec::new();
    while got.len() < n {
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "{} of {n} reports after 20 s",
            got.len()
        );
        queue.wait_for_reports(Duration::from_millis(50));
        got.extend(queue.poll());
    }
    got.sort_by_key(|r| r.id);
    got
}

fn queue(store: MemStore, config: TransferConfig) -> (Arc<MemStore>, TransferQueue) {
    let store = Arc::new(store);
    let queue = TransferQueue::new(Arc::clone(&store), config).unwrap();
    (store, queue)
}

fn kinds(report: &JobReport) -> Vec<Option<TierErrorKind>> {
    report
        .outcomes
        .iter()
        .map(|o| o.error().map(|e| e.kind()))
        .collect()
}

#[test]
fn mem_store_passes_the_conformance_suite() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(testkit::run_all(
        &Fixture::new(Arc::new(MemStore::new())).with_name("mem"),
    ));
    rt.block_on(testkit::run_all(
        &Fixture::new(Arc::new(MemStore::new().blocking())).with_name("mem-blocking"),
    ));
}

/// Stores rows, loads them into other rows, byte for byte, through an
/// async store, a blocking one and a store with the provided batch forms;
/// in chunks smaller than the job.
#[test]
fn stores_and_loads_round_trip() {
    let config = TransferConfig {
        chunk_bytes: 3 * ROW as u64,
        ..TransferConfig::default()
    };
    let fault = Arc::new(testkit::FaultTier::new(testkit::FaultConfig::default()));
    let queues = [
        ("async", queue(MemStore::new(), config.clone()).1),
        (
            "blocking",
            queue(MemStore::new().blocking(), config.clone()).1,
        ),
        (
            "provided",
            TransferQueue::new(fault, config.clone()).unwrap(),
        ),
    ];
    for (name, queue) in queues {
        let keys = unique_keys(10, 36);
        let mut mem = memory(20);
        for (i, key) in keys.iter().enumerate() {
            bytes_of(&mut mem)[i * ROW..(i + 1) * ROW].copy_from_slice(&block_of(key, ROW));
        }
        let store = queue
            .submit_store(keys.clone(), mem.clone(), rows(0..10))
            .unwrap();
        let done = reports(&queue, 1);
        assert_eq!(done[0].id, store);
        assert!(done[0].ok(), "{name}: {:?}", done[0]);
        assert_eq!(done[0].bytes, 10 * ROW as u64);
        assert_eq!(done[0].successful_keys().count(), 10);
        let load = queue
            .submit_load(keys.clone(), mem.clone(), rows(10..20))
            .unwrap();
        let done = reports(&queue, 1);
        assert_eq!(done[0].id, load);
        assert!(done[0].ok(), "{name}: {:?}", done[0]);
        let bytes = bytes_of(&mut mem);
        assert!(
            bytes[..10 * ROW] == bytes[10 * ROW..],
            "{name}: loaded rows differ from the stored ones"
        );
        assert!(queue.drain(Some(Duration::from_secs(5))).idle);
    }
}

/// A job where some keys fail (injected failures, a key removed behind the
/// store's back, a region of the wrong length) reports exactly the keys
/// that succeeded; a batch failing as a whole fails every key with one
/// shared error.
#[test]
fn partial_failure_reports_exactly_the_keys_that_succeeded() {
    for blocking in [false, true] {
        let store = if blocking {
            MemStore::new().blocking()
        } else {
            MemStore::new()
        };
        let (store, queue) = queue(store, TransferConfig::default());
        let keys = unique_keys(8, 36);
        let mem = memory(16);
        store.fail_key(&keys[3]);
        queue
            .submit_store(keys.clone(), mem.clone(), rows(0..8))
            .unwrap();
        let stored = reports(&queue, 1).remove(0);
        assert!(!stored.ok());
        let expected: Vec<&OffloadKey> = keys
            .iter()
            .enumerate()
            .filter(|&(i, _)| i != 3)
            .map(|(_, k)| k)
            .collect();
        assert_eq!(stored.successful_keys().collect::<Vec<_>>(), expected);
        assert_eq!(
            stored.first_error().map(|e| e.kind()),
            Some(TierErrorKind::Unavailable)
        );
        assert_eq!(stored.bytes, 7 * ROW as u64);

        store.forget(&keys[5]);
        store.fail_key(&keys[6]);
        let mut regions = rows(8..16);
        regions[7].len -= 1; // a region one byte short of its block
        queue
            .submit_load(keys.clone(), mem.clone(), regions)
            .unwrap();
        let loaded = reports(&queue, 1).remove(0);
        let successful: Vec<usize> = (0..8).filter(|&i| loaded.outcomes[i].is_done()).collect();
        assert_eq!(
            successful,
            [0, 1, 2, 4],
            "blocking: {blocking}: {:?}",
            loaded.outcomes
        );
        assert_eq!(
            loaded.outcomes[3].error().map(|e| e.kind()),
            Some(TierErrorKind::Unavailable),
            "its failure is still injected"
        );
        assert!(
            matches!(loaded.outcomes[5], BlockOutcome::Absent),
            "removed behind its back"
        );
        assert_eq!(
            loaded.outcomes[6].error().map(|e| e.kind()),
            Some(TierErrorKind::Unavailable)
        );
        assert_eq!(
            loaded.outcomes[7].error().map(|e| e.kind()),
            Some(TierErrorKind::LengthMismatch)
        );
        assert_eq!(loaded.unsuccessful_keys().count(), 4);

        store.set_down(true);
        queue
            .submit_load(keys.clone(), mem.clone(), rows(8..16))
            .unwrap();
        let down = reports(&queue, 1).remove(0);
        assert_eq!(down.successful_keys().count(), 0);
        let first = down.first_error().expect("failed").clone();
        assert!(
            down.outcomes
                .iter()
                .all(|o| o.error().is_some_and(|e| Arc::ptr_eq(e, &first))),
            "a batch failing as a whole shares one error"
        );
    }
}

/// An async copy still running at the job's deadline is dropped: the keys
/// before it are reported done, it and those after it timed out.
#[test]
fn a_hung_async_copy_ends_at_the_deadline() {
    let config = TransferConfig {
        chunk_bytes: ROW as u64, // one key per chunk
        job_timeout_ms: 300,
        ..TransferConfig::default()
    };
    let (store, queue) = queue(MemStore::new(), config);
    let keys = unique_keys(5, 36);
    store.hang_key(&keys[2]);
    let started = Instant::now();
    queue
        .submit_store(keys.clone(), memory(5), rows(0..5))
        .unwrap();
    let report = reports(&queue, 1).remove(0);
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert_eq!(
        kinds(&report),
        [
            None,
            None,
            Some(TierErrorKind::Timeout),
            Some(TierErrorKind::Timeout),
            Some(TierErrorKind::Timeout)
        ]
    );
    assert_eq!(store.copies_running(), 0);
}

/// A blocking store is checked between chunks: the chunk running at the
/// deadline finishes, the rest time out.
#[test]
fn a_slow_blocking_job_stops_between_chunks_at_its_deadline() {
    let config = TransferConfig {
        chunk_bytes: ROW as u64,
        ..TransferConfig::default()
    };
    let (_store, queue) = queue(
        MemStore::new()
            .blocking()
            .with_steps(1, Duration::from_millis(100)),
        config,
    );
    let keys = unique_keys(10, 36);
    let job = kvtier_core::TransferJob::store(keys, memory(10), rows(0..10))
        .with_timeout(Duration::from_millis(250));
    queue.submit(job).unwrap();
    let report = reports(&queue, 1).remove(0);
    let done = report.successful_keys().count();
    assert!((1..10).contains(&done), "{done} keys done");
    assert!(
        kinds(&report)[done..]
            .iter()
            .all(|&k| k == Some(TierErrorKind::Timeout))
    );
}

/// No more than `max_bytes_in_flight` bytes (nor `max_jobs_in_flight`
/// jobs) run at once; the rest wait queued and all finish.
#[test]
fn bytes_and_jobs_in_flight_are_bounded() {
    let config = TransferConfig {
        max_bytes_in_flight: 3 * ROW as u64,
        max_jobs_in_flight: 2,
        ..TransferConfig::default()
    };
    let (store, queue) = queue(
        MemStore::new().with_steps(2, Duration::from_millis(5)),
        config,
    );
    let mem = memory(12);
    for i in 0..6 {
        let keys = unique_keys(2, 36);
        queue
            .submit_store(keys, mem.clone(), rows(2 * i..2 * i + 2))
            .unwrap();
        let status = queue.status();
        assert!(status.bytes_in_flight <= 3 * ROW as u64, "{status:?}");
        assert!(
            status.running_jobs <= 1,
            "two jobs of 2 rows exceed 3 rows: {status:?}"
        );
    }
    // One 2-row job fits at a time under a 3-row bound.
    let done = reports(&queue, 6);
    assert!(done.iter().all(JobReport::ok));
    assert!(
        store.max_copies_running() <= 1,
        "{}",
        store.max_copies_running()
    );

    // A job larger than the bound runs alone once nothing else runs.
    let big = unique_keys(6, 36);
    queue.submit_store(big, mem.clone(), rows(0..6)).unwrap();
    assert!(reports(&queue, 1)[0].ok());
}

/// Loads, copied in 8 steps each, into rows between canary rows; a drain
/// right after submitting lets running jobs finish (every region is either
/// its whole block or untouched: none cut in half), cancels queued ones,
/// and once it returns nothing writes into the memory any more.
#[test]
fn a_drain_cuts_no_copy_and_nothing_touches_memory_after_it() {
    const CANARY: u8 = 0xA5;
    for blocking in [false, true] {
        let store = MemStore::new().with_steps(8, Duration::from_millis(2));
        let store = if blocking { store.blocking() } else { store };
        let config = TransferConfig {
            max_jobs_in_flight: 2,
            chunk_bytes: 2 * ROW as u64,
            ..TransferConfig::default()
        };
        let (store, queue) = queue(store, config);
        let jobs = 6;
        let keys: Vec<Vec<OffloadKey>> = (0..jobs).map(|_| unique_keys(4, 36)).collect();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let blocks: Vec<(&OffloadKey, Vec<u8>)> = keys
            .iter()
            .flatten()
            .map(|k| (k, block_of(k, ROW)))
            .collect();
        let batch: Vec<(&OffloadKey, &[u8])> =
            blocks.iter().map(|(k, b)| (*k, b.as_slice())).collect();
        let stored = rt.block_on(kvtier_core::BlockStore::store_batch(store.as_ref(), &batch));
        assert!(stored.iter().all(BlockOutcome::is_done));
        // Job j loads rows 10j+1..10j+5; every other row is a canary.
        let mut mem = memory(10 * jobs);
        bytes_of(&mut mem).fill(CANARY);
        let ids: Vec<JobId> = keys
            .iter()
            .enumerate()
            .map(|(j, k)| {
                queue
                    .submit_load(k.clone(), mem.clone(), rows(10 * j + 1..10 * j + 5))
                    .unwrap()
            })
            .collect();
        let drained = queue.drain(Some(Duration::from_secs(20)));
        assert!(drained.idle, "blocking {blocking}: {drained:?}");
        assert!(
            drained.cancelled >= 1,
            "some jobs were still queued: {drained:?}"
        );
        assert_eq!(store.copies_running(), 0);
        // The queue let go of the memory: this `Arc` is the only one left.
        let snapshot = bytes_of(&mut mem).to_vec();
        let done = queue.poll();
        assert_eq!(done.len(), jobs, "every job reported after the drain");
        for report in &done {
            let j = ids.iter().position(|&id| id == report.id).unwrap();
            for (i, outcome) in report.outcomes.iter().enumerate() {
                let row = &snapshot[(10 * j + 1 + i) * ROW..(10 * j + 2 + i) * ROW];
                match outcome {
                    BlockOutcome::Done => assert!(row == block_of(&keys[j][i], ROW).as_slice()),
                    BlockOutcome::Failed(err) => {
                        assert_eq!(err.kind(), TierErrorKind::Cancelled, "{err}");
                        assert!(
                            row.iter().all(|&b| b == CANARY),
                            "a cancelled key's row was touched"
                        );
                    }
                    BlockOutcome::Absent => panic!("every key was stored"),
                }
            }
            let rows_done = report.successful_keys().count();
            assert!(
                rows_done == 0 || rows_done == 4,
                "a drain never stops a started job: {rows_done}"
            );
        }
        for j in 0..jobs {
            for row in [10 * j, 10 * j + 5, 10 * j + 9] {
                assert!(
                    snapshot[row * ROW..(row + 1) * ROW]
                        .iter()
                        .all(|&b| b == CANARY),
                    "canary row {row} was written"
                );
            }
        }
        std::thread::sleep(Duration::from_millis(100));
        assert!(
            bytes_of(&mut mem) == snapshot.as_slice(),
            "memory changed after the drain returned"
        );
    }
}

/// A shutdown with a hung async copy in flight returns within its timeout:
/// the copy is dropped, the job reports, nothing runs any more.
#[test]
fn shutdown_with_a_hung_async_job_returns_within_its_timeout() {
    let config = TransferConfig {
        max_jobs_in_flight: 1,
        chunk_bytes: ROW as u64,
        ..TransferConfig::default()
    };
    let (store, queue) = queue(MemStore::new(), config);
    let keys = unique_keys(3, 36);
    store.hang_key(&keys[1]);
    let mut mem = memory(3);
    queue
        .submit_store(keys.clone(), mem.clone(), rows(0..3))
        .unwrap();
    queue
        .submit_store(unique_keys(1, 36), mem.clone(), rows(0..1))
        .unwrap();
    while store.batches() == 0 {
        std::thread::sleep(Duration::from_millis(1));
    }
    let started = Instant::now();
    let report = queue.shutdown(Duration::from_millis(400));
    let took = started.elapsed();
    assert!(took < Duration::from_secs(3), "shutdown took {took:?}");
    assert!(report.idle, "{report:?}");
    assert_eq!(report.cancelled, 1, "the queued job");
    let done = queue.poll();
    assert_eq!(done.len(), 2);
    let queued = done.iter().find(|r| r.keys.len() == 1).unwrap();
    assert_eq!(kinds(queued), [Some(TierErrorKind::Cancelled)]);
    let hung = done.iter().find(|r| r.keys.len() == 3).unwrap();
    assert_eq!(
        kinds(hung),
        [
            None,
            Some(TierErrorKind::Cancelled),
            Some(TierErrorKind::Cancelled)
        ]
    );
    assert!(matches!(
        queue.submit_store(keys, mem.clone(), rows(0..3)),
        Err(SubmitError::ShutDown)
    ));
    assert!(Arc::get_mut(&mut mem).is_some());
}

/// A blocking copy that cannot be interrupted: the shutdown returns at its
/// timeout and says which job still runs; that job keeps its buffer alive
/// and reports when its copy ends.
#[test]
fn shutdown_reports_a_stuck_blocking_job_and_it_reports_later() {
    let store = MemStore::new()
        .blocking()
        .with_blocking_hang(Duration::from_millis(800));
    let (store, queue) = queue(store, TransferConfig::default());
    let keys = unique_keys(2, 36);
    store.hang_key(&keys[0]);
    let mut mem = memory(2);
    let id = queue.submit_store(keys, mem.clone(), rows(0..2)).unwrap();
    while store.batches() == 0 {
        std::thread::sleep(Duration::from_millis(1));
    }
    let report = queue.shutdown(Duration::from_millis(200));
    assert!(!report.idle);
    assert_eq!(report.still_running, [id]);
    assert!(
        Arc::get_mut(&mut mem).is_none(),
        "the stuck job still holds the memory"
    );
    let done = reports(&queue, 1).remove(0);
    assert_eq!(done.id, id);
    // Its chunk ran to its end; nothing after a stop was started.
    assert_eq!(kinds(&done), [None, None]);
    assert!(
        Arc::get_mut(&mut mem).is_some(),
        "the job let go of the memory before reporting"
    );
}

/// Four threads submit 50 stores each at once, then 50 loads each at
/// once: every job is reported once, under its own id, and every row loads
/// back byte for byte.
#[test]
fn concurrent_submitters() {
    let (_store, queue) = queue(MemStore::new(), TransferConfig::default());
    let queue = Arc::new(queue);
    let mut mem = memory(400);
    for (i, byte) in bytes_of(&mut mem)[..200 * ROW].iter_mut().enumerate() {
        *byte = (i / ROW) as u8 ^ (i % 251) as u8;
    }
    let keys = Arc::new(unique_keys(200, 36));
    let mut all_ids = Vec::new();
    for load in [false, true] {
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let (queue, mem, keys) = (Arc::clone(&queue), mem.clone(), Arc::clone(&keys));
                std::thread::spawn(move || {
                    (t * 50..(t + 1) * 50)
                        .map(|row| {
                            let key = vec![keys[row].clone()];
                            if load {
                                queue.submit_load(key, mem.clone(), rows(200 + row..201 + row))
                            } else {
                                queue.submit_store(key, mem.clone(), rows(row..row + 1))
                            }
                            .unwrap()
                        })
                        .collect::<Vec<JobId>>()
                })
            })
            .collect();
        let mut ids: Vec<JobId> = threads
            .into_iter()
            .flat_map(|t| t.join().unwrap())
            .collect();
        let done = reports(&queue, 200);
        ids.sort();
        assert_eq!(done.iter().map(|r| r.id).collect::<Vec<_>>(), ids);
        assert!(done.iter().all(JobReport::ok));
        all_ids.extend(ids);
    }
    all_ids.dedup();
    assert_eq!(all_ids.len(), 400, "ids are unique");
    let bytes = bytes_of(&mut mem);
    assert!(
        bytes[..200 * ROW] == bytes[200 * ROW..],
        "loaded rows differ"
    );
}

/// Malformed or conflicting jobs are refused at submission, with the
/// reason; nothing of them runs.
#[test]
fn refused_jobs_say_why() {
    let (store, queue) = queue(
        MemStore::new().with_steps(1, Duration::from_millis(200)),
        TransferConfig::default(),
    );
    let mem = memory(8);
    let keys = unique_keys(2, 36);
    let err = queue
        .submit_store(keys.clone(), mem.clone(), rows(0..1))
        .unwrap_err();
    assert_eq!(
        err,
        SubmitError::RegionCount {
            keys: 2,
            regions: 1
        }
    );
    let err = queue
        .submit_store(
            keys.clone(),
            mem.clone(),
            vec![Region::new(0, ROW), Region::new(7 * ROW + 1, ROW)],
        )
        .unwrap_err();
    assert!(
        matches!(err, SubmitError::OutOfBounds { index: 1, .. }),
        "{err}"
    );
    let err = queue
        .submit_store(
            keys.clone(),
            mem.clone(),
            vec![Region::new(0, ROW), Region::new(usize::MAX, 2)],
        )
        .unwrap_err();
    assert!(
        matches!(err, SubmitError::OutOfBounds { index: 1, .. }),
        "{err}"
    );
    let read_only: Arc<dyn HostBuffer> = Arc::new(vec![0u8; 2 * ROW]);
    let err = queue
        .submit_load(keys.clone(), read_only.clone(), rows(0..2))
        .unwrap_err();
    assert_eq!(err, SubmitError::ReadOnlyBuffer);
    let err = queue
        .submit_load(
            keys.clone(),
            mem.clone(),
            vec![Region::new(0, ROW), Region::new(ROW - 1, ROW)],
        )
        .unwrap_err();
    assert_eq!(
        err,
        SubmitError::Overlap {
            first: 0,
            second: 1
        }
    );
    // A store of a read-only buffer is fine, and overlapping store regions too.
    queue
        .submit_store(
            keys.clone(),
            read_only,
            vec![Region::new(0, ROW), Region::new(1, ROW)],
        )
        .unwrap();
    // Rows 2..4 are being read by a store: no load may write them.
    queue
        .submit_store(keys.clone(), mem.clone(), rows(2..4))
        .unwrap();
    let err = queue
        .submit_load(keys.clone(), mem.clone(), rows(3..5))
        .unwrap_err();
    assert_eq!(err, SubmitError::Busy { index: 0 });
    // A load into rows 5..7 (hung until its deadline) excludes stores from
    // them, and other loads.
    let hung = unique_keys(2, 36);
    store.hang_key(&hung[0]);
    let load = kvtier_core::TransferJob::load(hung, mem.clone(), rows(5..7))
        .with_timeout(Duration::from_millis(500));
    queue.submit(load).unwrap();
    let err = queue
        .submit_store(
            keys.clone(),
            mem.clone(),
            vec![Region::new(0, ROW), Region::new(6 * ROW, 1)],
        )
        .unwrap_err();
    assert_eq!(err, SubmitError::Busy { index: 1 });
    assert_eq!(
        store.keys_copied(),
        0,
        "nothing refused ran; the accepted jobs are slow"
    );
    assert!(queue.drain(Some(Duration::from_secs(10))).idle);
    // Once those jobs have ended, their rows are free again.
    queue.submit_load(keys, mem.clone(), rows(2..4)).unwrap();
    assert!(queue.drain(Some(Duration::from_secs(10))).idle);
}

/// A panic in the tier fails its chunk's keys; the job still reports and
/// the queue keeps working.
#[test]
fn a_panicking_tier_fails_its_chunk() {
    let config = TransferConfig {
        chunk_bytes: ROW as u64,
        ..TransferConfig::default()
    };
    for blocking in [false, true] {
        let store = if blocking {
            MemStore::new().blocking()
        } else {
            MemStore::new()
        };
        let (store, queue) = queue(store, config.clone());
        let keys = unique_keys(3, 36);
        store.panic_key(&keys[1]);
        queue.submit_store(keys, memory(3), rows(0..3)).unwrap();
        let report = reports(&queue, 1).remove(0);
        assert_eq!(
            kinds(&report),
            [None, Some(TierErrorKind::Panicked), None],
            "blocking {blocking}"
        );
        queue
            .submit_store(unique_keys(1, 36), memory(1), rows(0..1))
            .unwrap();
        assert!(reports(&queue, 1)[0].ok());
    }
}

/// The wake hook runs for each published report.
#[test]
fn the_wake_hook_runs_when_reports_are_published() {
    let (_store, queue) = queue(MemStore::new(), TransferConfig::default());
    let woken = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let counter = Arc::clone(&woken);
    queue.set_wake_hook(move || {
        counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    });
    for _ in 0..3 {
        queue
            .submit_store(unique_keys(1, 36), memory(1), rows(0..1))
            .unwrap();
    }
    assert_eq!(reports(&queue, 3).len(), 3);
    // The hook runs right after a report is published (a poll may see the
    // report first).
    let start = Instant::now();
    while woken.load(std::sync::atomic::Ordering::SeqCst) < 3 {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the hook did not run for every report"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Jobs on a caller's runtime that shuts down: each reports a failure
/// (none hangs, none is lost), and the memory is let go of.
#[test]
fn a_runtime_shutting_down_under_the_queue_fails_its_jobs() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let spawner = Spawner::from_handle(rt.handle().clone());
    let store = Arc::new(MemStore::new().with_steps(4, Duration::from_millis(50)));
    let queue = TransferQueue::with_spawner(store, TransferConfig::default(), &spawner).unwrap();
    let mut mem = memory(8);
    for i in 0..4 {
        queue
            .submit_store(unique_keys(2, 36), mem.clone(), rows(2 * i..2 * i + 2))
            .unwrap();
    }
    drop(rt);
    let done = reports(&queue, 4);
    assert!(done.iter().all(|r| !r.ok()));
    assert!(queue.drain(Some(Duration::from_secs(5))).idle);
    assert!(Arc::get_mut(&mut mem).is_some());
}
