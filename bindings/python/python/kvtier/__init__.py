"""kvtier: non-blocking KV-cache block lookups for LLM schedulers.

``AsyncLookupManager`` has the scheduler-side API of vLLM's manager of the
same name: subclass it and override ``batch_lookup``. ``RedisLookupManager``,
``S3LookupManager`` and ``DiskLookupManager`` are native tiers whose lookups
never take the GIL. See README.md in ``bindings/python``.

A failed ``store``, ``load`` or ``remove`` raises a subclass of ``TierError``
that says why: ``TierConnectionError`` (also a ``ConnectionError``),
``TierTimeoutError`` (also a ``TimeoutError``) and ``TierThrottledError`` may
succeed later; ``TierConfigError`` (credentials, a missing bucket) and
``TierPermissionError`` (also a ``PermissionError``: an operation the
server denies this user) will not; ``TierInvalidInputError`` (also a ``ValueError``) rejects
the argument; ``TierDataError`` is stored data that failed its checks. The
exception's ``kind`` is the kind's name.

After ``shutdown()``, ``lookup``, ``lookup_many``, ``lookup_prefix``,
``store``, ``load`` and ``remove`` raise ``ShutDownError``; ``flush`` and
``drain_results`` do nothing; ``cleanup``, ``mark_miss`` and ``stats`` still
work. ``shutdown()`` is idempotent and returns within ``shutdown_timeout_ms``.

A manager belongs to the process that made it: in a child forked after it
was made, its methods raise ``ForkError`` at once (``shutdown()`` does
nothing) and the parent is not disturbed. Make managers after forking.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ._kvtier import (
    ForkError,
    JobResult,
    KvtierError,
    ShutDownError,
    TierConfigError,
    TierConnectionError,
    TierDataError,
    TierError,
    TierInvalidInputError,
    TierPermissionError,
    TierStack,
    TierThrottledError,
    TierTimeoutError,
    _Manager,
)

__all__ = [
    "AsyncLookupManager",
    "DiskLookupManager",
    "ForkError",
    "JobResult",
    "KvtierError",
    "RedisLookupManager",
    "S3LookupManager",
    "ShutDownError",
    "TierConfigError",
    "TierConnectionError",
    "TierDataError",
    "TierError",
    "TierInvalidInputError",
    "TierPermissionError",
    "TierStack",
    "TierThrottledError",
    "TierTimeoutError",
]


class AsyncLookupManager(_Manager):
    """A lookup manager over a tier written in Python.

    Subclass it, override ``batch_lookup``, and call
    ``super().__init__(tier_type=...)`` from your ``__init__``. Keyword
    arguments are ``ManagerConfig`` fields (``call_timeout_ms``,
    ``max_key_len``, ``shutdown_timeout_ms``, ...).

    ``batch_lookup`` runs on kvtier's worker (holding the GIL only while it
    runs). An exception, a wrong number of answers, a non-bool answer or an
    iterable that raises half-way is a counted error: its keys answer
    ``False`` and are probed again after ``failure_backoff_ms``.
    """

    def __init__(self, tier_type: str, **config: Any) -> None:
        self._init_python_tier(tier_type, config)
        self.tier_type = tier_type

    def batch_lookup(self, keys: list[bytes], req_context: Any) -> Iterable[bool]:
        """Whether each key exists in the tier; one bool per key, in order."""
        raise NotImplementedError(
            f"{type(self).__name__} must override batch_lookup(keys, req_context)"
        )


class RedisLookupManager(_Manager):
    """Lookups in Redis (``url=`` or ``cluster_urls=``), store / load / remove.

    Keyword arguments: the Redis tier's TOML fields (``url``,
    ``cluster_urls``, ``username``, ``password``, ``tls_ca_cert``,
    ``key_prefix``, ...) and ``ManagerConfig``'s fields.
    """

    def __init__(self, **config: Any) -> None:
        self._init_native("redis", config)
        self.tier_type = "redis"

    store = _Manager._store
    load = _Manager._load
    remove = _Manager._remove


class S3LookupManager(_Manager):
    """Lookups in an S3 bucket (``bucket=``, ``endpoint=``, ...), store / load / remove."""

    def __init__(self, **config: Any) -> None:
        self._init_native("s3", config)
        self.tier_type = "s3"

    store = _Manager._store
    load = _Manager._load
    remove = _Manager._remove


class DiskLookupManager(_Manager):
    """Lookups in a local disk tier (``path=``, ``key_len=``, ...), store / load / remove."""

    def __init__(self, **config: Any) -> None:
        self._init_native("disk", config)
        self.tier_type = "disk"

    store = _Manager._store
    load = _Manager._load
    remove = _Manager._remove
