"""Shared helpers of the kvtier Python tests."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import pytest

import kvtier

GUARD = 5.0  # seconds: a generous bound for anything that should take milliseconds


@dataclass
class ReqContext:
    """vLLM's ReqContext, as is."""

    req_id: str
    kv_transfer_params: dict | None = None


def key(i: int) -> bytes:
    """A 36-byte key, vLLM's layout: a 32-byte hash and a group index."""
    return i.to_bytes(32, "big") + (0).to_bytes(4, "big")


class InMemoryLookupManager(kvtier.AsyncLookupManager):
    """vLLM's test tier: a set of present keys, with a call log."""

    def __init__(self, existing_keys=(), **config: Any) -> None:
        config.setdefault("tier_type", "memory")
        tier_type = config.pop("tier_type")
        super().__init__(tier_type=tier_type, **config)
        self.existing_keys = set(existing_keys)
        self.calls: list[tuple[list[bytes], Any]] = []
        self.lock = threading.Lock()

    def batch_lookup(self, keys, req_context):
        with self.lock:
            self.calls.append((list(keys), req_context))
        return [k in self.existing_keys for k in keys]


def wait_for(pred: Callable[[], bool], what: str, guard: float = GUARD) -> None:
    start = time.monotonic()
    while not pred():
        if time.monotonic() - start > guard:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.001)


def resolve(manager, k: bytes, ctx, guard: float = GUARD):
    """Looks `k` up until it has an answer (flushing once if it is new)."""
    start = time.monotonic()
    verdict = manager.lookup(k, ctx)
    manager.flush()
    while verdict is None:
        if time.monotonic() - start > guard:
            raise AssertionError(f"{k!r} never resolved")
        time.sleep(0.001)
        verdict = manager.lookup(k, ctx)
    return verdict


def require_env(*names: str) -> list[str]:
    """The values of `names`; skips, or fails under KVTIER_REQUIRE_SERVICES=1."""
    missing = [n for n in names if not os.environ.get(n)]
    if missing:
        message = f"test services not configured: {', '.join(missing)} unset"
        if os.environ.get("KVTIER_REQUIRE_SERVICES") == "1":
            pytest.fail(message + " (KVTIER_REQUIRE_SERVICES=1)")
        pytest.skip(message)
    return [os.environ[n] for n in names]


@pytest.fixture
def ctx() -> ReqContext:
    return ReqContext("req-0")
