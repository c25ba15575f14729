"""kvtier.vllm's DiskTier, RedisTier and S3Tier in vLLM 0.34.0's own stack.

Each test builds vLLM's ``TieringOffloadingManager`` over its
``CPUPrimaryTierOffloadingManager`` (on a numpy-backed region), with a
kvtier tier made by vLLM's ``SecondaryTierFactory`` from a
``secondary_tiers`` entry (``"module_path": "kvtier.vllm"``), and drives it
as vLLM's scheduler does. Every tier runs against its real server: the disk
tier, Redis single node, Redis Cluster and S3 (s3s-fs).
"""

from __future__ import annotations

import os
import time

import pytest

from vllm_harness import GUARD, require_vllm

require_vllm()

from kvtier_tiers import TIERS, Deployment, key, remove_behind_its_back, require_job_api, tier_config  # noqa: E402

require_job_api()
from vllm.v1.kv_offload.base import LookupResult  # noqa: E402
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager  # noqa: E402

import kvtier.vllm  # noqa: E402

NUM_KEYS = 6


@pytest.fixture(params=TIERS)
def kind(request):
    return request.param


def test_the_factory_builds_each_tier_as_a_secondary_tier(kind, tmp_path):
    classes = {"disk": kvtier.vllm.DiskTier, "redis": kvtier.vllm.RedisTier,
               "redis_cluster": kvtier.vllm.RedisTier, "s3": kvtier.vllm.S3Tier}
    d = Deployment(tier_config(kind, tmp_path, call_timeout_ms=2000))
    try:
        assert type(d.tier) is classes[kind]
        assert isinstance(d.tier, SecondaryTierManager)
        assert d.tier.tier_type == tier_config(kind, tmp_path)["type"]
        assert d.tier.manager.tier_name == d.tier.tier_type
    finally:
        d.shutdown()


def test_store_cascades_on_complete_store(kind, tmp_path):
    d = Deployment(tier_config(kind, tmp_path))
    try:
        keys = [key(i) for i in range(NUM_KEYS)]
        stored = d.store(keys)
        store_results = [r for r in d.results]
        assert store_results and all(r.success for r in store_results)
        assert sum(r.transfer_bytes for r in store_results) == NUM_KEYS * d.row_bytes
        # The bytes are in the tier, under this deployment's namespace.
        for k in keys:
            assert d.tier.manager.load(k) == stored[k]
    finally:
        d.shutdown()


def test_reset_cache_then_hit_pending_then_hit_with_equal_rows_and_miss(kind, tmp_path):
    d = Deployment(tier_config(kind, tmp_path))
    try:
        keys = [key(i) for i in range(NUM_KEYS)]
        absent = [key(1000), key(1001)]
        stored = d.store(keys)
        d.reset()

        ctx = d.request()
        seen = d.resolve(keys + absent, ctx)
        for k in keys:
            assert seen[k][-1] is LookupResult.HIT
            assert LookupResult.HIT_PENDING in seen[k], f"never promoted: {seen[k]}"
        for k in absent:
            assert set(seen[k]) <= {LookupResult.RETRY, LookupResult.MISS}, seen[k]
            assert seen[k][-1] is LookupResult.MISS
        assert d.read(keys, ctx) == stored
        # Each key was promoted once.
        assert sorted(k for load in d.loads for k in load) == sorted(keys)
        d.finish(ctx)
    finally:
        d.shutdown()


def test_reset_cache_with_jobs_in_flight_drains_them(kind, tmp_path):
    d = Deployment(tier_config(kind, tmp_path))
    try:
        keys = [key(i) for i in range(NUM_KEYS)]
        ctx = d.request()
        with d.manager.lock:
            out = d.manager.prepare_store(keys, ctx)
            d.manager.complete_store(keys, ctx)  # cascades in flight
            d.manager.reset_cache()  # drains them (vLLM asserts no job is left)
            d.manager.on_reset_flushed()
            assert not d.tier.has_pending_work()
        assert out is not None
        assert len(d.results) == 1  # the cascade reported, success or cancelled
        d.finish(ctx)
    finally:
        d.shutdown()


def _store_reset_and_lose(d: Deployment, keys: list[bytes], lost: list[bytes]):
    """Stores ``keys``, resets the primary tier, has a request find them all
    (the tier answers hit and vLLM allocates rows for their promotion), then
    removes ``lost`` behind the tier's back before the promotion's load
    runs. Returns the request, the stored bytes and the verdicts seen after."""
    stored = d.store(keys)
    d.reset()
    ctx = d.request()
    # Until the tier answers hit for every key and vLLM allocates its row
    # (kvtier answers one request's keys of a step together).
    seen_first: dict[bytes, list] = {k: [] for k in keys}
    start = time.monotonic()
    while True:
        verdicts = d.lookups(keys, ctx)
        for k, v in zip(keys, verdicts):
            seen_first[k].append(v)
        if all(v is LookupResult.HIT_PENDING for v in verdicts):
            break
        assert time.monotonic() - start < GUARD, seen_first
        # A result drained partway through a pass (the lookup of a later key
        # drains it) leaves the earlier keys for the next pass, which needs
        # no step; a step now would submit the promotion of the keys already
        # answered before the test removes any (seen once in CI on S3).
        if not any(v is LookupResult.HIT_PENDING for v in verdicts):
            d.step()
        time.sleep(0.001)
    assert not d.loads, "the promotion was submitted before the end of the step"
    remove_behind_its_back(d.tier, lost)
    seen = d.resolve(keys, ctx)  # the step's end submits the promotion
    return ctx, stored, seen


def test_a_block_removed_behind_the_tiers_back_ends_as_a_miss_without_livelock(kind, tmp_path):
    d = Deployment(tier_config(kind, tmp_path))
    try:
        keys = [key(i) for i in range(4)]
        lost = [keys[2]]
        ctx, stored, seen = _store_reset_and_lose(d, keys, lost)
        assert seen[keys[2]][-1] is LookupResult.MISS
        # Pending while its one promotion runs, a miss at the step its failure
        # is reported (no probe again, no second promotion), and it stays one.
        assert set(seen[keys[2]][:-1]) <= {LookupResult.HIT_PENDING}, seen[keys[2]]
        for _ in range(5):
            d.step()
            assert d.lookups([keys[2]], ctx) == [LookupResult.MISS]
        assert sum(load.count(keys[2]) for load in d.loads) == 1, d.loads
        kept = [k for k in keys if k not in lost]
        assert all(seen[k][-1] is LookupResult.HIT for k in kept)
        assert d.read(kept, ctx) == {k: stored[k] for k in kept}
        d.finish(ctx)
    finally:
        d.shutdown()


def test_a_partly_failed_promotion_reports_exactly_its_successful_keys(kind, tmp_path):
    d = Deployment(tier_config(kind, tmp_path))
    try:
        keys = [key(i) for i in range(5)]
        lost = [keys[1], keys[4]]
        before = len(d.results)
        ctx, stored, seen = _store_reset_and_lose(d, keys, lost)
        (load,) = d.loads
        assert sorted(load) == sorted(keys)
        promotions = [r for r in d.results[before:] if r.job_id not in {x.job_id for x in d.results[:before]}]
        failed = [r for r in promotions if not r.success]
        assert len(failed) == 1, promotions
        assert sorted(failed[0].successful_keys) == sorted(k for k in keys if k not in lost)
        assert failed[0].deferred_release is None
        for k in lost:
            assert seen[k][-1] is LookupResult.MISS
        kept = [k for k in keys if k not in lost]
        assert d.read(kept, ctx) == {k: stored[k] for k in kept}
        d.finish(ctx)
    finally:
        d.shutdown()


def _segment_bytes(directory: str) -> int:
    return sum(e.stat().st_size for e in os.scandir(directory) if e.name.endswith(".kvs"))


def test_a_disk_tier_stays_within_capacity_while_storing_four_times_as_much(tmp_path):
    block = 64 * 1024
    capacity = 32 * block  # the newest round of 16 blocks fits, with room for the open segment
    config = tier_config("disk", tmp_path, capacity_bytes=capacity, segment_bytes=capacity // 8)
    d = Deployment(config, num_chunks=16, block_bytes=block)
    d.tier.stats_scan_interval_s = 0.0
    label = f":{(d.tier.tier_type,)}"
    try:
        with d.manager.lock:
            d.manager.get_stats()  # the metrics' first look at the directory
        rounds = 4 * capacity // (16 * block)  # 16 blocks a round, four times the capacity
        first, last = None, None
        for r in range(rounds):
            keys = [key(1000 * r + i) for i in range(16)]
            stored = d.store(keys)
            assert _segment_bytes(d.tier.directory) <= capacity
            first = first or keys
            last = (keys, stored)
        with d.manager.lock:
            values = d.manager.get_stats().reduce()
        assert values["vllm:kv_offload_kvtier_evicted_segments" + label] > 0
        assert 0 < values["vllm:kv_offload_kvtier_capacity_used_bytes" + label] <= capacity
        assert values["vllm:kv_offload_kvtier_capacity_bytes" + label] == capacity
        d.reset()
        ctx = d.request()
        # The oldest blocks were evicted: misses, never a hit that then fails.
        seen = d.resolve(first, ctx)
        assert all(seen[k][-1] is LookupResult.MISS for k in first)
        assert all(LookupResult.HIT_PENDING not in seen[k] for k in first)
        # The newest are there, byte for byte.
        keys, stored = last
        seen = d.resolve(keys, ctx)
        assert all(seen[k][-1] is LookupResult.HIT for k in keys)
        assert d.read(keys, ctx) == stored
        d.finish(ctx)
    finally:
        d.shutdown()


def test_a_disk_tier_reopened_after_shutdown_answers_hit_with_equal_bytes(tmp_path):
    config = tier_config("disk", tmp_path)
    keys = [key(i) for i in range(NUM_KEYS)]
    d = Deployment(config)
    try:
        stored = d.store(keys)
    finally:
        d.shutdown()
    again = Deployment(config)
    try:
        assert again.tier.directory == d.tier.directory
        ctx = again.request()
        seen = again.resolve(keys, ctx)
        assert all(seen[k][-1] is LookupResult.HIT for k in keys)
        assert again.read(keys, ctx) == stored
        again.finish(ctx)
    finally:
        again.shutdown()


def test_two_deployments_with_different_models_never_see_each_others_blocks(kind, tmp_path):
    config = tier_config(kind, tmp_path)  # one directory, Redis prefix or bucket prefix
    keys = [key(i) for i in range(NUM_KEYS)]
    a = Deployment(config, model="org/model-a")
    try:
        stored = a.store(keys)
    finally:
        a.shutdown()
    for other in ({"model": "org/model-b"}, {"dtype": "bfloat16"}, {"tp_size": 2}):
        b = Deployment(config, **other)
        try:
            assert b.tier.namespace != a.tier.namespace
            ctx = b.request()
            seen = b.resolve(keys, ctx)
            assert all(seen[k][-1] is LookupResult.MISS for k in keys), other
            b.finish(ctx)
        finally:
            b.shutdown()
    a = Deployment(config, model="org/model-a")
    try:
        ctx = a.request()
        seen = a.resolve(keys, ctx)
        assert all(seen[k][-1] is LookupResult.HIT for k in keys)
        assert a.read(keys, ctx) == stored
        a.finish(ctx)
    finally:
        a.shutdown()


def test_metrics_count_stores_loads_and_lookups(tmp_path):
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    config = tier_config("disk", tmp_path)
    d = Deployment(config)
    try:
        keys = [key(i) for i in range(NUM_KEYS)]
        d.store(keys)
        d.reset()
        ctx = d.request()
        d.resolve(keys, ctx)
        d.finish(ctx)
        with d.manager.lock:
            stats = d.manager.get_stats()
        values = stats.reduce()
        label = ("DiskTier",)
        assert values[f"vllm:kv_offload_kvtier_stored_blocks:{label}"] == NUM_KEYS
        assert values[f"vllm:kv_offload_kvtier_stored_bytes:{label}"] == NUM_KEYS * d.row_bytes
        assert values[f"vllm:kv_offload_kvtier_loaded_blocks:{label}"] == NUM_KEYS
        assert values[f"vllm:kv_offload_kvtier_hits:{label}"] == NUM_KEYS
        assert values[f"vllm:kv_offload_kvtier_capacity_bytes:{label}"] == 1 << 30
        assert values[f"vllm:kv_offload_kvtier_capacity_used_bytes:{label}"] >= NUM_KEYS * d.row_bytes
        # Every metric reported is declared, as vLLM's Prometheus side needs.
        defined = TieringOffloadingSpec.build_metric_definitions(dict(d.spec.extra_config))
        for name in stats.data["data"]:
            assert name in defined, name
    finally:
        d.shutdown()
