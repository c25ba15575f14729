"""The vLLM venv works: vLLM 0.34.0's own tiering stack moves blocks.

vLLM's ``SecondaryTierFactory`` builds its file-system tier (``fs``) from a
``secondary_tiers`` entry, and its ``TieringOffloadingManager`` cascades a
store to it on ``complete_store``; after ``reset_cache`` empties the primary
tier, a lookup answers ``HIT_PENDING`` while the block is promoted back, then
``HIT`` with the stored bytes. No kvtier code is involved: this is the
baseline the ``kvtier.vllm`` tiers are tested against.
"""

from __future__ import annotations

from vllm_harness import (
    build_manager,
    end_step,
    lookup_all,
    make_spec,
    require_vllm,
    step_until,
)

require_vllm()

import numpy as np  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager  # noqa: E402

NUM_KEYS = 6


def key(i: int) -> bytes:
    """An OffloadKey: a 32-byte block hash, then group 0."""
    return make_offload_key(i.to_bytes(32, "big"), 0)


def test_fs_tier_cascades_on_complete_store_then_promotes_byte_equal(tmp_path):
    spec = make_spec(
        [{"type": "fs", "root_dir": str(tmp_path), "n_read_threads": 2, "n_write_threads": 2}]
    )
    manager, region = build_manager(spec)
    try:
        (fs_tier,) = manager.secondary_tiers
        assert isinstance(fs_tier, FileSystemTierManager)
        keys = [key(i) for i in range(NUM_KEYS)]
        rng = np.random.default_rng(27)

        # A request stores its blocks in the primary tier (the worker's copy
        # from GPU is the write into the rows); complete_store cascades them.
        writer = ReqContext(req_id="writer")
        with manager.lock:
            manager.on_new_request(writer)
            out = manager.prepare_store(keys, writer)
            assert out is not None and list(out.keys_to_store) == keys
            rows = [int(c) for c in out.store_spec.chunk_ids]
            region.array[rows] = rng.integers(0, 256, size=(len(rows), spec.kv_bytes_per_chunk), dtype=np.uint8)
            stored = {k: region.array[r].tobytes() for k, r in zip(keys, rows)}
            manager.complete_store(keys, writer)
            assert manager.has_pending_work(), "complete_store submitted no cascade"
            manager.on_request_finished(writer)
        step_until(manager, lambda: not manager.has_pending_work(), "the cascade to fs")
        for k in keys:
            with open(fs_tier.file_mapper.get_file_name(k), "rb") as f:
                assert f.read() == stored[k]

        # Empty the primary tier and its memory: the bytes can only come from fs.
        with manager.lock:
            manager.reset_cache()
            manager.on_reset_flushed()
        region.array[:] = 0

        reader = ReqContext(req_id="reader")
        absent = key(1000)
        with manager.lock:
            manager.on_new_request(reader)
        seen: dict[bytes, list] = {k: [] for k in keys + [absent]}

        def resolved() -> bool:
            for k, verdict in zip(keys + [absent], lookup_all(manager, keys + [absent], reader)):
                seen[k].append(verdict)
            return all(seen[k][-1] is LookupResult.HIT for k in keys) and seen[absent][-1] is LookupResult.MISS

        step_until(manager, resolved, "the promotion from fs")
        for k in keys:
            assert LookupResult.HIT_PENDING in seen[k], f"{k!r} was never promoted: {seen[k]}"
        assert LookupResult.HIT not in seen[absent]

        with manager.lock:
            load = manager.prepare_load(keys, reader)
        for k, row in zip(keys, load.chunk_ids):
            assert region.array[int(row)].tobytes() == stored[k]
        with manager.lock:
            manager.complete_load(keys, reader)
            manager.on_request_finished(reader)
        end_step(manager)
    finally:
        manager.shutdown()
