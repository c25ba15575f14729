import os
from collections.abc import Iterable, Sequence
from typing import Any, Literal, Protocol

__all__ = [
    "AsyncLookupManager",
    "DiskLookupManager",
    "ForkError",
    "KvtierError",
    "RedisLookupManager",
    "S3LookupManager",
    "ShutDownError",
    "TierConfigError",
    "TierConnectionError",
    "TierDataError",
    "TierPermissionError",
    "TierError",
    "TierInvalidInputError",
    "TierStack",
    "TierThrottledError",
    "TierTimeoutError",
    "__version__",
]

__version__: str
"""The package's version (the workspace's Cargo version)."""

class _HasReqId(Protocol):
    @property
    def req_id(self) -> str: ...

class KvtierError(Exception): ...
class ShutDownError(KvtierError): ...
class ForkError(KvtierError): ...

class TierError(KvtierError):
    kind: str
    """The error kind's name: "unavailable", "timeout", "throttled", "config",
    "permission_denied", "invalid_input", "corrupt", "wrong_result_count",
    "length_mismatch", "cancelled", "panicked" or "other"."""

class TierConnectionError(TierError, ConnectionError): ...
class TierTimeoutError(TierError, TimeoutError): ...
class TierThrottledError(TierError): ...
class TierConfigError(TierError): ...
class TierInvalidInputError(TierError, ValueError): ...
class TierDataError(TierError): ...
class TierPermissionError(TierError, PermissionError): ...

class _Manager:
    tier_type: str
    """The tier's type: the `tier_type` given to `AsyncLookupManager`, or
    "redis", "s3", "disk". A plain attribute (a factory may set it)."""
    @property
    def tier_name(self) -> str:
        """The manager's name in stats, logs and metrics: `tier_name=` if
        given, else the tier's type."""
    def lookup(self, key: bytes, req_context: _HasReqId) -> bool | None: ...
    def lookup_many(self, keys: Iterable[bytes], req_context: _HasReqId) -> list[bool | None]: ...
    def lookup_prefix(self, keys: Iterable[bytes], req_context: _HasReqId) -> int | None: ...
    def flush(self) -> None: ...
    def drain_results(self) -> None: ...
    def mark_miss(self, keys: Iterable[bytes]) -> None: ...
    def mark_present(self, keys: Iterable[bytes]) -> None:
        """Records that `keys` were stored: each answers `True` at once,
        and a probe in flight cannot turn it back (vLLM 0.34)."""
    def cleanup(self, req_id: str) -> None: ...
    def stats(self) -> dict[str, Any]: ...
    def shutdown(self) -> None: ...
    def is_shut_down(self) -> bool: ...

class AsyncLookupManager(_Manager):
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
    ) -> None: ...
    def batch_lookup(self, keys: list[bytes], req_context: Any) -> Iterable[bool]: ...

class JobResult:
    """How a job of `submit_store` / `submit_load` ended (from `poll_jobs`)."""
    job_id: int
    kind: str
    """`"store"` or `"load"`."""
    ok: bool
    """Whether every key was stored or loaded."""
    successful_keys: list[bytes]
    """The keys stored or loaded, in submission order."""
    bytes: int
    """Bytes of the successful keys."""
    seconds: float
    """From the job's first copy to its last."""
    error: str | None
    """Why the first failed key failed; for a load whose only trouble was
    absent keys, how many were absent; `None` when `ok`."""

class _NativeManager(_Manager):
    def store(self, key: bytes, data: bytes) -> None: ...
    def load(self, key: bytes) -> bytes | None: ...
    def remove(self, key: bytes) -> None: ...
    def submit_store(self, keys: Sequence[bytes], view: Any, rows: Sequence[int] | Any) -> int:
        """Stores row `rows[i]` of `view` under `keys[i]`, in the background;
        returns the job id at once. `view`: any C-contiguous buffer whose first
        dimension indexes blocks (a 2-D memoryview, a numpy array); `rows`:
        ints or a numpy integer array, one per key. The buffer is held until
        the job ends; do not write its rows meanwhile. Raises
        `TierInvalidInputError` (a `ValueError`) for a row out of range, a
        wrong number of rows or a non-contiguous view."""
    def submit_load(self, keys: Sequence[bytes], view: Any, rows: Sequence[int] | Any) -> int:
        """Loads each key's block into row `rows[i]` of `view` (writable; a
        read-only view raises `TierInvalidInputError`); the stored block must
        be exactly one row long: the disk tier raises `TierInvalidInputError`
        at submit for a row of another length (it knows each block's length);
        on Redis and S3 that key fails when the job runs. Do not read or
        write its rows until the job's result is polled."""
    def poll_jobs(self) -> list[JobResult]:
        """The jobs that ended since the last call. A store's successful keys
        are marked present, and a load's absent or failed keys missing,
        before it returns."""
    def drain_jobs(self, timeout: float | None = None) -> bool:
        """Cancels queued jobs (they report failure) and waits until no job
        runs or `timeout` seconds pass; whether none runs. A running copy is
        never cut; once it returns `True` nothing touches the buffers."""

class RedisLookupManager(_NativeManager):
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
    ) -> None: ...

class S3LookupManager(_NativeManager):
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
    ) -> None: ...

class DiskLookupManager(_NativeManager):
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
    ) -> None: ...

class TierStack:
    def __init__(self, managers: Sequence[_Manager], policy: str = "prefer_earlier_tiers") -> None: ...
    def lookup_prefix(self, keys: Iterable[bytes], req_context: _HasReqId) -> list[int] | None: ...
    def flush(self) -> None: ...
    def drain_results(self) -> None: ...
    def mark_miss(self, index: int, keys: Iterable[bytes]) -> None: ...
    def mark_present(self, index: int, keys: Iterable[bytes]) -> None: ...
    def cleanup(self, req_id: str) -> None: ...
    def stats(self) -> list[dict[str, Any]]: ...
    def tier_names(self) -> list[str]: ...
    def shutdown(self) -> None: ...
    def __len__(self) -> int: ...
