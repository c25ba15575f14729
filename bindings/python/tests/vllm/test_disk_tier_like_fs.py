"""kvtier.vllm.DiskTier against the behaviours vLLM 0.34.0 checks of its own
file-system tier.

Each test names the test of vLLM's ``tests/v1/kv_offload/tiering/test_fs_tier.py``
it mirrors. Only behaviours of the public ``SecondaryTierManager`` contract
are mirrored (what the tier answers and reports, and the bytes in the
primary tier's rows), written here for kvtier; vLLM's test code is not
copied, and tests of the fs tier's own internals (its thread pool, its C
helpers, its file layout, O_DIRECT, xattr checksums) have no counterpart.
Where the fs tier corrupts a block file, these tests lose the block behind
the tier's back instead (kvtier's disk tier keeps its blocks in segments of
its own).
"""

from __future__ import annotations

import time

import pytest

from vllm_harness import GUARD, NumpyRegion, make_spec, require_vllm

require_vllm()

import numpy as np  # noqa: E402  (after the skip: the plain venv has no numpy)
from kvtier_tiers import key, remove_behind_its_back, require_job_api  # noqa: E402

require_job_api()
from vllm.v1.kv_offload.base import Locality, LookupResult, Medium, ReqContext, ScheduleEndContext  # noqa: E402
from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: E402
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory  # noqa: E402

import kvtier.vllm  # noqa: E402

NUM_ROWS = 8
ROW_BYTES = 64 * 1024
CTX = ReqContext(req_id="test")


class Tier:
    """A DiskTier made by vLLM's factory over a numpy region of its own."""

    def __init__(self, tmp_path, *, spec_args=None, **config) -> None:
        spec = make_spec([], num_chunks=NUM_ROWS, block_bytes=ROW_BYTES, **(spec_args or {}))
        self.region = NumpyRegion(NUM_ROWS, ROW_BYTES)
        entry = {"type": "DiskTier", "module_path": "kvtier.vllm", "path": str(tmp_path / "disk"), "fsync": "never"}
        entry.update(config)
        self.tier = SecondaryTierFactory.create_secondary_tier(entry, self.region.create_kv_memoryview(), spec)
        self.next_job = 0

    def job(self, keys, rows=None, promotion=False) -> TransferJob:
        self.next_job += 1
        rows = list(range(len(keys))) if rows is None else rows
        return TransferJob(
            job_id=self.next_job,
            keys=list(keys),
            chunk_ids=np.array(rows, dtype=np.int64),
            is_promotion=promotion,
            req_context=CTX,
        )

    def store(self, keys, rows=None):
        job = self.job(keys, rows)
        self.tier.submit_store(job)
        return job

    def load(self, keys, rows=None):
        job = self.job(keys, rows, promotion=True)
        self.tier.submit_load(job)
        return job

    def drain(self) -> list:
        self.tier.drain_jobs()
        return list(self.tier.get_finished_jobs())

    def lookup_and_wait(self, keys, ctx=CTX) -> list:
        """Looks ``keys`` up, ends the step, and looks up again until answered."""
        for k in keys:
            self.tier.lookup(k, ctx)
        self.tier.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        start = time.monotonic()
        while True:
            verdicts = [self.tier.lookup(k, ctx) for k in keys]
            if LookupResult.RETRY not in verdicts or time.monotonic() - start > GUARD:
                return verdicts
            time.sleep(0.001)

    def fill(self, rows, seed=0) -> dict[int, bytes]:
        rng = np.random.default_rng(seed)
        for r in rows:
            self.region.array[r] = rng.integers(0, 256, size=ROW_BYTES, dtype=np.uint8)
        return {r: self.region.array[r].tobytes() for r in rows}

    def shutdown(self) -> None:
        self.tier.shutdown()


@pytest.fixture
def disk(tmp_path):
    tier = Tier(tmp_path)
    yield tier
    tier.shutdown()


def test_lookup_of_an_empty_tier_misses(disk):
    """Mirrors test_lookup_empty_tier."""
    assert disk.lookup_and_wait([key(1), key(2)]) == [LookupResult.MISS] * 2


def test_a_store_succeeds_and_its_key_then_hits(disk):
    """Mirrors test_store_creates_file_and_lookup_succeeds."""
    disk.store([key(1)], [0])
    (result,) = disk.drain()
    assert result.success and result.transfer_bytes == ROW_BYTES
    assert disk.lookup_and_wait([key(1)]) == [LookupResult.HIT]


def test_store_then_load_round_trip_keeps_the_blocks(disk):
    """Mirrors test_store_then_load_roundtrip."""
    disk.store([key(1), key(2)], [0, 1])
    assert all(r.success for r in disk.drain())
    assert disk.lookup_and_wait([key(1), key(2)]) == [LookupResult.HIT] * 2
    disk.load([key(1), key(2)], [2, 3])
    assert all(r.success for r in disk.drain())
    # Blocks stay in the tier after a load.
    fresh = ReqContext(req_id="after-load")
    assert disk.lookup_and_wait([key(1), key(2)], fresh) == [LookupResult.HIT] * 2


def test_construction_fails_at_once_on_a_path_it_cannot_create(tmp_path):
    """Mirrors test_invalid_path_raises_at_construction."""
    with pytest.raises(OSError):
        Tier(tmp_path, path="/dev/null/invalid_path")


@pytest.mark.parametrize("locality", ["local", ""])
def test_an_invalid_locality_fails_at_construction(tmp_path, locality):
    """Mirrors test_invalid_locality_raises_at_construction."""
    with pytest.raises(ValueError, match="Locality"):
        Tier(tmp_path, locality=locality)


def test_the_factory_forwards_locality(tmp_path):
    """Mirrors test_factory_forwards_locality_to_fs_tier."""
    tier = Tier(tmp_path, locality="LOCAL")
    try:
        assert isinstance(tier.tier, kvtier.vllm.DiskTier)
        assert tier.tier.locality is Locality.LOCAL
    finally:
        tier.shutdown()


def test_loading_a_block_never_stored_fails_the_job(disk):
    """Mirrors test_failed_load_missing_file."""
    disk.load([key(99)], [0])
    (result,) = disk.drain()
    assert not result.success and result.successful_keys is None


def test_jobs_are_reported_independently(disk):
    """Mirrors test_multiple_jobs_tracked_independently."""
    a, b = disk.store([key(1)], [0]), disk.store([key(2)], [1])
    assert {r.job_id for r in disk.drain()} == {a.job_id, b.job_id}
    assert disk.lookup_and_wait([key(1), key(2)]) == [LookupResult.HIT] * 2


def test_a_load_with_one_block_missing_fails_as_one_job(disk):
    """Mirrors test_multi_block_job_partial_failure."""
    disk.store([key(10), key(11)], [0, 1])
    assert all(r.success for r in disk.drain())
    job = disk.load([key(10), key(11), key(99)], [0, 1, 2])
    (result,) = disk.drain()
    assert result.job_id == job.job_id and not result.success
    assert sorted(result.successful_keys) == sorted([key(10), key(11)])


def test_shutdown_with_jobs_queued_returns(tmp_path):
    """Mirrors test_shutdown_discards_pending_tasks."""
    tier = Tier(tmp_path)
    for i in range(10):
        tier.store([key(i)], [i % 4])
    start = time.monotonic()
    tier.shutdown()
    assert time.monotonic() - start < GUARD


@pytest.mark.parametrize("batch_size", [0, 1, 2, 5])
def test_stored_bytes_load_back_exactly_into_other_rows(disk, batch_size):
    """Mirrors test_store_load_data_integrity (the empty batch included)."""
    keys = [key(i) for i in range(batch_size)]
    stored = disk.fill(range(batch_size), seed=batch_size)
    disk.store(keys, list(range(batch_size)))
    (result,) = disk.drain()
    assert result.success
    disk.region.array[:] = 0
    targets = list(range(NUM_ROWS - batch_size, NUM_ROWS))
    disk.load(keys, targets)
    (result,) = disk.drain()
    assert result.success
    for i, row in enumerate(targets):
        assert disk.region.array[row].tobytes() == stored[i]


def test_a_row_out_of_bounds_fails_the_job(disk):
    """Mirrors test_out_of_bounds_block_id_smoke."""
    disk.store([key(1)], [NUM_ROWS])
    (result,) = disk.drain()
    assert not result.success
    disk.load([key(1)], [NUM_ROWS])
    (result,) = disk.drain()
    assert not result.success


def test_a_failed_load_turns_the_cached_hit_into_a_miss_without_a_probe(disk):
    """Mirrors test_failed_load_corrects_verdict_and_removes_corrupt_file
    (the failed-load livelock, vLLM #49176)."""
    disk.store([key(1)], [0])
    assert all(r.success for r in disk.drain())
    ctx = ReqContext(req_id="livelock-req")
    assert disk.lookup_and_wait([key(1)], ctx) == [LookupResult.HIT]
    # A successful promotion leaves the verdict alone.
    disk.load([key(1)], [0])
    assert all(r.success for r in disk.drain())
    assert disk.tier.lookup(key(1), ctx) is LookupResult.HIT

    remove_behind_its_back(disk.tier, [key(1)])
    disk.load([key(1)], [0])
    (result,) = disk.drain()
    assert not result.success
    # The same request now misses at once, from the manager's state.
    assert disk.tier.lookup(key(1), ctx) is LookupResult.MISS
    # A fresh request probes the tier again, and misses too.
    fresh = ReqContext(req_id="fresh-after-failure")
    assert disk.lookup_and_wait([key(1)], fresh) == [LookupResult.MISS]


def test_a_partly_failed_load_keeps_the_blocks_that_loaded(disk):
    """Mirrors test_batched_partial_load_failure_keeps_loaded_blocks."""
    keys = [key(1), key(2), key(3)]
    stored = disk.fill([0, 1, 2], seed=3)
    disk.store(keys, [0, 1, 2])
    assert all(r.success for r in disk.drain())
    ctx = ReqContext(req_id="batch-req")
    assert disk.lookup_and_wait(keys, ctx) == [LookupResult.HIT] * 3
    remove_behind_its_back(disk.tier, [key(3)])
    disk.region.array[:] = 0
    disk.load(keys, [4, 5, 6])
    (result,) = disk.drain()
    assert not result.success
    assert sorted(result.successful_keys) == sorted([key(1), key(2)])
    assert disk.region.array[4].tobytes() == stored[0]
    assert disk.region.array[5].tobytes() == stored[1]
    # Only the failed block is a miss, for the same request, with no probe.
    assert [disk.tier.lookup(k, ctx) for k in keys] == [LookupResult.HIT, LookupResult.HIT, LookupResult.MISS]
    disk.tier.on_request_finished(ctx)
    fresh = ReqContext(req_id="fresh-batch-req")
    assert disk.lookup_and_wait(keys, fresh) == [LookupResult.HIT, LookupResult.HIT, LookupResult.MISS]


def test_a_load_whose_first_block_fails_reports_no_successful_keys(disk):
    """Mirrors test_batched_load_first_block_fails_marks_whole_batch, where
    the fs tier stops at its first bad block: kvtier loads every block it
    can, so here every block of the batch is lost."""
    keys = [key(1), key(2), key(3)]
    disk.store(keys, [0, 1, 2])
    assert all(r.success for r in disk.drain())
    ctx = ReqContext(req_id="batch-first-fail")
    assert disk.lookup_and_wait(keys, ctx) == [LookupResult.HIT] * 3
    remove_behind_its_back(disk.tier, keys)
    disk.load(keys, [0, 1, 2])
    (result,) = disk.drain()
    assert not result.success and result.successful_keys is None
    assert [disk.tier.lookup(k, ctx) for k in keys] == [LookupResult.MISS] * 3


def test_a_transient_load_failure_keeps_the_block(disk):
    """Mirrors test_transient_load_failure_leaves_file: a load that fails
    for another reason than the block's absence (here a row the primary
    tier does not have) leaves the block stored; a fresh request finds it
    and loads it."""
    stored = disk.fill([0], seed=5)
    disk.store([key(1)], [0])
    assert all(r.success for r in disk.drain())
    disk.load([key(1)], [NUM_ROWS + 3])
    (result,) = disk.drain()
    assert not result.success
    fresh = ReqContext(req_id="after-transient")
    assert disk.lookup_and_wait([key(1)], fresh) == [LookupResult.HIT]
    disk.region.array[:] = 0
    disk.load([key(1)], [1])
    assert all(r.success for r in disk.drain())
    assert disk.region.array[1].tobytes() == stored[0]


def test_a_successful_store_emits_one_stored_event(tmp_path):
    """Mirrors test_successful_store_emits_stored_event and
    test_load_job_emits_no_event."""
    tier = Tier(tmp_path, spec_args={"enable_kv_cache_events": True}, enable_kv_events=True, locality="LOCAL")
    try:
        tier.store([key(1), key(2)], [0, 1])
        assert all(r.success for r in tier.drain())
        (event,) = list(tier.tier.take_events())
        assert event.keys == [key(1), key(2)]
        assert event.medium == Medium.STORAGE and event.locality is Locality.LOCAL and not event.removed
        assert list(tier.tier.take_events()) == []
        tier.load([key(1)], [3])
        assert all(r.success for r in tier.drain())
        assert list(tier.tier.take_events()) == []
    finally:
        tier.shutdown()


def test_events_need_the_tier_and_the_global_flag(tmp_path):
    """Mirrors test_events_disabled_by_default and
    test_events_require_global_kv_events_flag."""
    for spec_args, config in (({"enable_kv_cache_events": True}, {}), ({}, {"enable_kv_events": True})):
        tier = Tier(tmp_path, spec_args=spec_args, **config)
        try:
            tier.store([key(1)], [0])
            assert all(r.success for r in tier.drain())
            assert list(tier.tier.take_events()) == []
        finally:
            tier.shutdown()


def test_a_replicated_tp2_writer_and_tp4_reader_share_blocks(tmp_path):
    """Mirrors test_fs_tier_cross_tp_round_trip: with a replicated layout
    the namespace is the same whatever the tensor-parallel size and rank."""
    writer = Tier(tmp_path, spec_args={"tp_size": 2, "rank": 0, "replicated_layout": True})
    try:
        stored = writer.fill([0], seed=7)
        writer.store([key(7)], [0])
        assert all(r.success for r in writer.drain())
        namespace = writer.tier.namespace
    finally:
        writer.shutdown()
    reader = Tier(tmp_path, spec_args={"tp_size": 4, "rank": 3, "replicated_layout": True})
    try:
        assert reader.tier.namespace == namespace
        assert reader.lookup_and_wait([key(7)]) == [LookupResult.HIT]
        reader.load([key(7)], [1])
        assert all(r.success for r in reader.drain())
        assert reader.region.array[1].tobytes() == stored[0]
    finally:
        reader.shutdown()


def test_a_tp2_rank_without_a_shared_layout_has_its_own_namespace(tmp_path):
    """The other side of test_fs_tier_cross_tp_round_trip: without a
    parallelism-agnostic layout, the parallel sizes and the rank are part
    of the namespace."""
    a = Tier(tmp_path, spec_args={"tp_size": 2, "rank": 0})
    try:
        ns = a.tier.namespace
    finally:
        a.shutdown()
    b = Tier(tmp_path, spec_args={"tp_size": 2, "rank": 1})
    try:
        assert b.tier.namespace != ns
    finally:
        b.shutdown()
