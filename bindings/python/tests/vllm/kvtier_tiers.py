"""kvtier's vLLM tiers (``kvtier.vllm``) in vLLM's own tiering stack.

``TIERS`` names the configurations the tests run against (the disk tier,
Redis single node, Redis Cluster, S3), each over the real servers named by
``KVTIER_*`` / ``AWS_*`` (``scripts/services.sh``). ``Deployment`` is one
vLLM scheduler's offloading manager over one of them, built by
``vllm_harness.build_manager`` (vLLM's factory and tiering manager), with
the steps a scheduler takes: store blocks, reset the primary tier, look
keys up until they resolve, read the promoted rows.
"""

from __future__ import annotations

import os
import secrets
from typing import Any, Callable

import numpy as np
import pytest

import kvtier
from conftest import require_env
from vllm_harness import GUARD, build_manager, end_step, lookup_all, make_spec

TIERS = ["disk", "redis", "redis_cluster", "s3"]


def require_job_api() -> None:
    """Skips the calling module while the native managers lack the job API
    of issue 26 (``submit_store`` / ``submit_load`` / ``poll_jobs`` /
    ``drain_jobs``), which kvtier.vllm moves blocks with."""
    if not hasattr(kvtier.DiskLookupManager, "submit_store"):
        pytest.skip(
            "kvtier's native managers have no job API (submit_store, poll_jobs, ...) yet",
            allow_module_level=True,
        )


def tier_config(kind: str, tmp_path: Any, **extra: Any) -> dict[str, Any]:
    """A ``secondary_tiers`` entry for a kvtier tier of ``kind``, in a
    directory, key prefix or object prefix of this test's own."""
    run = secrets.token_hex(4)
    if kind == "disk":
        config = {"type": "DiskTier", "path": str(tmp_path / "disk"), "fsync": "never"}
    elif kind == "redis":
        (url,) = require_env("KVTIER_REDIS_URL")
        config = {"type": "RedisTier", "url": url, "key_prefix": f"kvtier-vllm-test:{run}:"}
    elif kind == "redis_cluster":
        (urls,) = require_env("KVTIER_REDIS_CLUSTER_URLS")
        config = {
            "type": "RedisTier",
            "cluster_urls": urls.split(","),
            "key_prefix": f"kvtier-vllm-test:{run}:",
        }
    elif kind == "s3":
        endpoint, bucket, access, secret = require_env(
            "KVTIER_S3_ENDPOINT", "KVTIER_S3_BUCKET", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"
        )
        config = {
            "type": "S3Tier",
            "bucket": bucket,
            "endpoint": endpoint,
            "region": os.environ.get("AWS_REGION", "us-east-1"),
            "force_path_style": True,
            "access_key_id": access,
            "secret_access_key": secret,
            "prefix": f"kvtier-vllm-test/{run}/",
        }
    else:
        raise ValueError(kind)
    config["module_path"] = "kvtier.vllm"
    config.update(extra)
    return config


def key(i: int) -> bytes:
    """An OffloadKey: a 32-byte block hash (sha256's size), then group 0."""
    from vllm.v1.kv_offload.base import make_offload_key

    return make_offload_key(i.to_bytes(32, "big"), 0)


class Deployment:
    """One vLLM scheduler's ``TieringOffloadingManager`` over a kvtier tier."""

    def __init__(self, tier: dict[str, Any], **spec_args: Any) -> None:
        from vllm.v1.kv_offload.tiering.base import SecondaryTierManager

        self.spec = make_spec([tier], **spec_args)
        self.manager, self.region = build_manager(self.spec)
        (self.tier,) = self.manager.secondary_tiers
        assert isinstance(self.tier, SecondaryTierManager)
        self.rng = np.random.default_rng(27)
        self.requests = 0
        self.results: list[Any] = []  # every JobResult the tier reported
        self.loads: list[list[bytes]] = []  # keys of every submit_load
        get_finished, submit_load = self.tier.get_finished_jobs, self.tier.submit_load

        def recording_get_finished() -> list[Any]:
            results = list(get_finished())
            self.results.extend(results)
            return results

        def recording_submit_load(job: Any) -> None:
            self.loads.append(list(job.keys))
            submit_load(job)

        self.tier.get_finished_jobs = recording_get_finished
        self.tier.submit_load = recording_submit_load

    @property
    def row_bytes(self) -> int:
        return self.spec.kv_bytes_per_chunk

    def request(self) -> Any:
        from vllm.v1.kv_offload.base import ReqContext

        self.requests += 1
        ctx = ReqContext(req_id=f"req-{self.requests}")
        with self.manager.lock:
            self.manager.on_new_request(ctx)
        return ctx

    def finish(self, ctx: Any) -> None:
        with self.manager.lock:
            self.manager.on_request_finished(ctx)

    def step(self) -> None:
        end_step(self.manager)

    def steps_until(self, done: Callable[[], bool], what: str) -> int:
        import time

        start, steps = time.monotonic(), 0
        while not done():
            if time.monotonic() - start > GUARD:
                raise AssertionError(f"{what}: not done after {steps} steps")
            self.step()
            steps += 1
            time.sleep(0.001)
        return steps

    def store(self, keys: list[bytes]) -> dict[bytes, bytes]:
        """A request writes ``keys``' blocks into the primary tier (random
        bytes) and completes the store: vLLM cascades them to the tier.
        Returns each key's bytes once the cascade has finished."""
        ctx = self.request()
        with self.manager.lock:
            out = self.manager.prepare_store(keys, ctx)
            assert out is not None and list(out.keys_to_store) == list(keys)
            rows = [int(c) for c in out.store_spec.chunk_ids]
            self.region.array[rows] = self.rng.integers(
                0, 256, size=(len(rows), self.row_bytes), dtype=np.uint8
            )
            stored = {k: self.region.array[r].tobytes() for k, r in zip(keys, rows)}
            self.manager.complete_store(keys, ctx)
            assert self.manager.has_pending_work(), "complete_store submitted no cascade"
        self.finish(ctx)
        self.steps_until(lambda: not self.manager.has_pending_work(), "the cascade")
        return stored

    def reset(self) -> None:
        """Empties the primary tier and zeroes its memory: blocks can then
        only come from the secondary tier."""
        with self.manager.lock:
            self.manager.reset_cache()
            self.manager.on_reset_flushed()
        self.region.array[:] = 0

    def lookups(self, keys: list[bytes], ctx: Any) -> list[Any]:
        return lookup_all(self.manager, keys, ctx)

    def resolve(self, keys: list[bytes], ctx: Any, *, on_step: Callable[[], None] | None = None) -> dict[bytes, list[Any]]:
        """Looks ``keys`` up once per step until each answers HIT or MISS;
        returns every verdict each key got."""
        from vllm.v1.kv_offload.base import LookupResult

        seen: dict[bytes, list[Any]] = {k: [] for k in keys}
        final = (LookupResult.HIT, LookupResult.MISS)

        def done() -> bool:
            for k, verdict in zip(keys, self.lookups(keys, ctx)):
                seen[k].append(verdict)
            if on_step is not None:
                on_step()
            return all(seen[k][-1] in final for k in keys)

        self.steps_until(done, "the lookups")
        return seen

    def read(self, keys: list[bytes], ctx: Any) -> dict[bytes, bytes]:
        """The rows of ``keys`` (all HIT) as vLLM hands them to the GPU."""
        with self.manager.lock:
            load = self.manager.prepare_load(keys, ctx)
            rows = {k: self.region.array[int(r)].tobytes() for k, r in zip(keys, load.chunk_ids)}
            self.manager.complete_load(keys, ctx)
        return rows

    def shutdown(self) -> None:
        self.manager.shutdown()


def remove_behind_its_back(tier: Any, keys: list[bytes]) -> None:
    """Removes blocks from the tier's storage without telling its lookups
    (a block evicted by another process, a Redis TTL, an S3 lifecycle rule)."""
    manager = tier.manager
    assert isinstance(manager, (kvtier.DiskLookupManager, kvtier.RedisLookupManager, kvtier.S3LookupManager))
    for k in keys:
        manager.remove(k)
