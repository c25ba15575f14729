"""vLLM 0.34.0's own tiering stack, assembled for kvtier's tests.

``require_vllm()`` first: it skips the calling module when vLLM 0.34.0 is not
installed (the plain suite's venv), or fails it under
``KVTIER_REQUIRE_VLLM=1`` (the vLLM run of ``bindings/python/test.sh``).
Build the venv with ``bindings/python/vllm-env.sh``.

``build_manager`` assembles what ``TieringOffloadingSpec.get_manager()``
does, from vLLM's real spec, tier factory, CPU primary tier and tiering
manager; only the shared-memory region under the primary tier is replaced,
by ``NumpyRegion`` (vLLM's own tier tests replace it too).
"""

from __future__ import annotations

import importlib.metadata
import mmap
import os
import time
from typing import Any, Callable, Iterable

import pytest

VLLM_VERSION = "0.34.0"
GUARD = 10.0  # seconds: a bound for what should take milliseconds


def require_vllm() -> None:
    """Skips the calling module without vLLM 0.34.0; fails it when required."""
    try:
        found = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        found = None
    if found == VLLM_VERSION:
        return
    message = (
        f"vLLM {VLLM_VERSION} is not installed in this venv (found: {found}); "
        "build it with bindings/python/vllm-env.sh, or run "
        "KVTIER_PY_VLLM=1 bindings/python/test.sh"
    )
    if os.environ.get("KVTIER_REQUIRE_VLLM") == "1":
        pytest.fail(message + " (KVTIER_REQUIRE_VLLM=1)", pytrace=False)
    pytest.skip(message, allow_module_level=True)


class NumpyRegion:
    """The primary tier's host region: page-aligned anonymous memory, one
    row per chunk, seen as a numpy array. Stands in for vLLM's
    ``SharedOffloadRegion`` (a /dev/shm mapping viewed through torch),
    offering the two methods ``CPUPrimaryTierOffloadingManager`` calls."""

    def __init__(self, num_chunks: int, row_bytes: int) -> None:
        import numpy as np

        self._mmap = mmap.mmap(-1, num_chunks * row_bytes)
        self.array = np.frombuffer(self._mmap, dtype=np.uint8).reshape(num_chunks, row_bytes)

    def create_kv_memoryview(self) -> memoryview:
        return memoryview(self.array)

    def cleanup(self) -> None:
        self.array = None  # the mapping is unmapped when the last view goes


def make_spec(
    secondary_tiers: list[dict[str, Any]],
    *,
    num_chunks: int = 16,
    block_bytes: int = 64 * 1024,
    model: str = "kvtier-test/model",
    dtype: str = "float16",
    extra_config: dict[str, Any] | None = None,
    tp_size: int = 1,
    rank: int = 0,
    replicated_layout: bool = False,
    is_parallelism_agnostic: bool = False,
    enable_kv_cache_events: bool = False,
) -> Any:
    """vLLM's ``TieringOffloadingSpec`` for one worker holding ``num_chunks``
    chunks of ``block_bytes`` (a multiple of the page size). ``tp_size``,
    ``rank``, ``replicated_layout`` and ``is_parallelism_agnostic`` describe
    the parallel layout the spec reports (the region stays one worker's)."""
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    extra = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": num_chunks * block_bytes,
        "secondary_tiers": secondary_tiers,
    }
    extra.update(extra_config or {})
    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(16, ("model.layers.0.attn",), 0),),
        worker_kv_bytes_per_block=block_bytes,
        enable_kv_cache_events=enable_kv_cache_events,
        extra_config=extra,
        engine_id="kvtier-test",
        model=OffloadingModelConfig(name=model, dtype=dtype, max_model_len=4096),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=rank,
            world_size=tp_size,
            tp_size=tp_size,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=is_parallelism_agnostic,
        ),
        replicated_layout=replicated_layout,
    )
    spec = TieringOffloadingSpec(config)
    if tp_size == 1 or replicated_layout:  # else a chunk holds every worker's bytes
        assert spec.num_chunks == num_chunks and spec.kv_bytes_per_chunk == block_bytes
    return spec


def build_manager(spec: Any) -> tuple[Any, NumpyRegion]:
    """``spec.get_manager()`` over a ``NumpyRegion``: the primary tier, each
    configured secondary tier through vLLM's ``SecondaryTierFactory``, and
    the ``TieringOffloadingManager`` over them."""
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    from vllm.v1.kv_offload.tiering.manager import (
        CPUPrimaryTierOffloadingManager,
        TieringOffloadingManager,
    )

    region = NumpyRegion(spec.num_chunks, spec.kv_bytes_per_chunk)
    primary = CPUPrimaryTierOffloadingManager(
        num_chunks=spec.num_chunks,
        mmap_region=region,
        cache_policy=spec.eviction_policy,
        info=spec.cpu_info,
    )
    view = primary.get_kv_memoryview()
    tiers = [
        SecondaryTierFactory.create_secondary_tier(config, view, spec)
        for config in spec.secondary_tier_configs
    ]
    manager = TieringOffloadingManager(
        primary_tier=primary,
        secondary_tiers=tiers,
        tier_poll_interval_s=spec.tier_poll_interval_s,
    )
    return manager, region


def end_step(manager: Any) -> None:
    """The scheduler's last manager call of a step."""
    from vllm.v1.kv_offload.base import ScheduleEndContext

    with manager.lock:
        manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))


def step_until(manager: Any, done: Callable[[], bool], what: str) -> int:
    """Ends steps until ``done()``; returns how many it took."""
    start = time.monotonic()
    steps = 0
    while not done():
        if time.monotonic() - start > GUARD:
            raise AssertionError(f"{what}: not done after {steps} steps")
        end_step(manager)
        steps += 1
        time.sleep(0.001)
    return steps


def lookup_all(manager: Any, keys: Iterable[bytes], ctx: Any) -> list[Any]:
    """One step's lookups of ``keys``, in order, under the manager's lock."""
    with manager.lock:
        return [manager.lookup(k, ctx) for k in keys]
