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

Every class takes keyword arguments only (``AsyncLookupManager`` also its
``tier_type`` first), listed with their types and defaults in its
docstring: ``help(kvtier.RedisLookupManager)``. An unknown keyword is a
``TypeError``, as for any Python function; a value out of its range a
``ValueError`` naming the field and the range. The native managers check
their tier when they are made (``check=True``) and raise the ``TierError``
subclass of what failed; ``check=False`` starts one while its server is
down (lookups then answer ``False`` and count errors until it is back).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any, Literal

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
    __version__,
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
    "__version__",
]


_MANAGER_KEYWORDS = """
    Manager keywords (``ManagerConfig``), the same for every manager:

    tier_name: str | None = None      name in stats, logs and metrics (None: the tier's type)
    max_key_len: int = 64             longest key accepted, in bytes (a disk tier: its key_len)
    min_key_len: int = 1              shortest key accepted, in bytes (a disk tier: its key_len)
    call_timeout_ms: int = 1000       deadline of one tier call; its keys then answer False (1 to 100 years)
    failure_backoff_ms: int = 500     how long a failed key answers False before it is probed again
    max_calls_in_flight: int = 32     tier calls running at once (as many more may wait for a slot)
    max_steps_in_flight: int = 8      flushed steps with calls still running or waiting
    max_queued_keys: int = 65536      keys flushed but not yet sent; beyond it new keys stay pending
    max_keys_per_call: int = 4096     largest tier call; a bigger group is split
    shutdown_timeout_ms: int = 1000   how long shutdown() waits for running calls and the worker
    worker_threads: int = 1           threads of the manager's runtime (1 to 1024)
"""


def _with_manager_keywords(cls: type) -> type:
    """Appends the manager keywords to ``cls``'s docstring."""
    cls.__doc__ = (cls.__doc__ or "").rstrip() + "\n" + _MANAGER_KEYWORDS
    return cls


def _config(arguments: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of an ``__init__`` (its ``locals()``) for the
    native side: without ``self`` and ``check``, and without ``None`` (the
    field's own default: unset)."""
    return {
        name: value
        for name, value in arguments.items()
        if name not in ("self", "check", "__class__") and value is not None
    }


@_with_manager_keywords
class AsyncLookupManager(_Manager):
    """A lookup manager over a tier written in Python.

    Subclass it, override ``batch_lookup``, and call
    ``super().__init__(tier_type, ...)`` from your ``__init__``, with any
    of the manager keywords below.

    ``batch_lookup`` runs on kvtier's worker (holding the GIL only while it
    runs). An exception, a wrong number of answers, a non-bool answer or an
    iterable that raises half-way is a counted error: its keys answer
    ``False`` and are probed again after ``failure_backoff_ms``.

    tier_type: str                    the tier's type, kept as the attribute ``tier_type``
    """

    def __init__(
        self,
        tier_type: str,
        *,
        tier_name: str | None = None,
        max_key_len: int = 64,
        min_key_len: int = 1,
        call_timeout_ms: int = 1000,
        failure_backoff_ms: int = 500,
        max_calls_in_flight: int = 32,
        max_steps_in_flight: int = 8,
        max_queued_keys: int = 65536,
        max_keys_per_call: int = 4096,
        shutdown_timeout_ms: int = 1000,
        worker_threads: int = 1,
    ) -> None:
        config = _config(locals())
        del config["tier_type"]
        self._init_python_tier(tier_type, config)
        self.tier_type = tier_type

    def batch_lookup(self, keys: list[bytes], req_context: Any) -> Iterable[bool]:
        """Whether each key exists in the tier; one bool per key, in order."""
        raise NotImplementedError(
            f"{type(self).__name__} must override batch_lookup(keys, req_context)"
        )


class _NativeManager(_Manager):
    """A manager over a native tier: lookups, and blocks stored, loaded
    and removed directly."""

    def store(self, key: bytes, data: bytes) -> None:
        """Stores ``data`` as the block of ``key``, replacing any; waits
        without the GIL. Raises the ``TierError`` subclass of a failure, a
        ``ValueError`` for a key the lookups would refuse (empty, longer
        than ``max_key_len``, not ``key_len`` bytes for a disk tier)."""
        self._store(key, data)

    def load(self, key: bytes) -> bytes | None:
        """The block of ``key``, or ``None`` if the tier has none; waits
        without the GIL. Errors as ``store``."""
        return self._load(key)

    def remove(self, key: bytes) -> None:
        """Removes the block of ``key`` (nothing if there is none); waits
        without the GIL. Errors as ``store``."""
        self._remove(key)


@_with_manager_keywords
class RedisLookupManager(_NativeManager):
    """Lookups in Redis (a server or a Redis Cluster), store / load / remove.

    Redis keywords (the Redis tier's TOML fields); ``url`` or
    ``cluster_urls`` is required:

    url: str | None = None                a server: redis://[user:password@]host:port/db, rediss:// (TLS), redis+unix://
    cluster_urls: Sequence[str] = ()      seed nodes of a Redis Cluster (then url is not used)
    username: str | None = None           user name, overriding the URL's
    password: str | None = None           password, overriding the URL's (never shown in errors or logs)
    tls_ca_cert: str | PathLike | None = None   PEM file of a private CA for rediss:// (None: the webpki roots)
    key_prefix: str = "kvtier:"           prefix of every Redis key; the block key's bytes follow it (after the tag, tagged)
    key_layout: "plain" | "tagged" | None = None   "plain": prefix + key; "tagged": prefix + {4 characters of the key's CRC16} + key (a cluster hashes 4 bytes per command); None: tagged on a cluster (plain if key_prefix holds a "{"), plain on one server
    ttl_ms: int | None = None             time to live of stored blocks (SET ... PX); None keeps them
    pipeline_chunk: int = 512             EXISTS commands per pipeline
    max_chunks_in_flight: int = 8         pipelines of one batch in flight at once
    connect_timeout_ms: int = 500         connect timeout
    response_timeout_ms: int = 1000       response timeout of one command or pipeline
    reconnect_retries: int = 1            reconnections after a dropped connection before a command fails
    lean_pipelines: bool = True           send lookups' pipelines pre-packed on plain TCP (TLS: always redis-rs)
    check: bool = True                    PING now and raise the TierError subclass of a failure (False: start anyway)
    """

    def __init__(
        self,
        *,
        url: str | None = None,
        cluster_urls: Sequence[str] = (),
        username: str | None = None,
        password: str | None = None,
        tls_ca_cert: str | os.PathLike[str] | None = None,
        key_prefix: str = "kvtier:",
        key_layout: Literal["plain", "tagged"] | None = None,
        ttl_ms: int | None = None,
        pipeline_chunk: int = 512,
        max_chunks_in_flight: int = 8,
        connect_timeout_ms: int = 500,
        response_timeout_ms: int = 1000,
        reconnect_retries: int = 1,
        lean_pipelines: bool = True,
        check: bool = True,
        tier_name: str | None = None,
        max_key_len: int = 64,
        min_key_len: int = 1,
        call_timeout_ms: int = 1000,
        failure_backoff_ms: int = 500,
        max_calls_in_flight: int = 32,
        max_steps_in_flight: int = 8,
        max_queued_keys: int = 65536,
        max_keys_per_call: int = 4096,
        shutdown_timeout_ms: int = 1000,
        worker_threads: int = 1,
    ) -> None:
        self._init_native("redis", _config(locals()), check)
        self.tier_type = "redis"


@_with_manager_keywords
class S3LookupManager(_NativeManager):
    """Lookups in an S3 bucket, store / load / remove.

    S3 keywords (the S3 tier's TOML fields); ``bucket`` is required:

    bucket: str                           the bucket (it must exist)
    prefix: str = "kvtier/"               prefix of every object name; the key in lower-case hex follows it
    region: str | None = None             region (None: from the AWS chain, else us-east-1)
    endpoint: str | None = None           an S3-compatible server, http(s)://host:port (None: AWS)
    force_path_style: bool = False        path-style requests (most S3-compatible servers)
    access_key_id: str | None = None      access key id; with secret_access_key, overrides the AWS chain
    secret_access_key: str | None = None  secret access key (never shown in errors or logs)
    session_token: str | None = None      session token of temporary credentials
    max_concurrent_requests: int = 64     reads in flight at once (writes have as many of their own)
    request_timeout_ms: int = 2000        timeout of one attempt of one request
    connect_timeout_ms: int = 1000        connect timeout
    max_attempts: int = 3                 attempts per request (1: no retry)
    credentials_from_aws_chain: bool = True   look for missing credentials in the AWS chain
    bucket_recheck_ms: int = 1000         a miss re-checks the bucket if not seen for this long
    io_threads: int = 1                   at least this many runtime threads (1 to 256)
    check: bool = True                    HeadBucket now and raise the TierError subclass of a failure (False: start anyway)
    """

    def __init__(
        self,
        *,
        bucket: str,
        prefix: str = "kvtier/",
        region: str | None = None,
        endpoint: str | None = None,
        force_path_style: bool = False,
        access_key_id: str | None = None,
        secret_access_key: str | None = None,
        session_token: str | None = None,
        max_concurrent_requests: int = 64,
        request_timeout_ms: int = 2000,
        connect_timeout_ms: int = 1000,
        max_attempts: int = 3,
        credentials_from_aws_chain: bool = True,
        bucket_recheck_ms: int = 1000,
        io_threads: int = 1,
        check: bool = True,
        tier_name: str | None = None,
        max_key_len: int = 64,
        min_key_len: int = 1,
        call_timeout_ms: int = 1000,
        failure_backoff_ms: int = 500,
        max_calls_in_flight: int = 32,
        max_steps_in_flight: int = 8,
        max_queued_keys: int = 65536,
        max_keys_per_call: int = 4096,
        shutdown_timeout_ms: int = 1000,
        worker_threads: int = 1,
    ) -> None:
        self._init_native("s3", _config(locals()), check)
        self.tier_type = "s3"


@_with_manager_keywords
class DiskLookupManager(_NativeManager):
    """Lookups in a local disk tier, store / load / remove.

    Disk keywords (the disk tier's TOML fields); ``path`` is required:

    path: str | PathLike                  the directory (created if missing; locked while the manager runs)
    key_len: int = 36                     length of every key, in bytes (1 to 1024); other lengths raise ValueError
    capacity_bytes: int = 1073741824      most bytes of segments kept (at least twice segment_bytes)
    segment_bytes: int = 67108864         size at which a segment is closed (4 KiB to 4 GiB)
    initial_slots: int = 65536            slots of a new index (1 to 2**40)
    fsync: "always" | "never" = "always"  "always": a store survives a power loss; "never": a crash of the process
    rebuild_corrupt_index: bool = True    rebuild a missing or corrupt index from the segments
    check: bool = True                    write a file in the directory now (False: only open and lock it)
    """

    def __init__(
        self,
        *,
        path: str | os.PathLike[str],
        key_len: int = 36,
        capacity_bytes: int = 1073741824,
        segment_bytes: int = 67108864,
        initial_slots: int = 65536,
        fsync: Literal["always", "never"] = "always",
        rebuild_corrupt_index: bool = True,
        check: bool = True,
        tier_name: str | None = None,
        max_key_len: int = 64,
        min_key_len: int = 1,
        call_timeout_ms: int = 1000,
        failure_backoff_ms: int = 500,
        max_calls_in_flight: int = 32,
        max_steps_in_flight: int = 8,
        max_queued_keys: int = 65536,
        max_keys_per_call: int = 4096,
        shutdown_timeout_ms: int = 1000,
        worker_threads: int = 1,
    ) -> None:
        self._init_native("disk", _config(locals()), check)
        self.tier_type = "disk"
