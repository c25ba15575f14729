"""kvtier's disk, Redis and S3 tiers as vLLM secondary tiers.

vLLM (0.34.0 and its ``TieringOffloadingSpec``) loads them by configuration
alone, with no change to vLLM::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 8000000000,
        "secondary_tiers": [{"type": "DiskTier", "module_path": "kvtier.vllm",
                             "path": "/mnt/nvme/kv", "capacity_bytes": 500000000000}]}}'

``DiskTier``, ``RedisTier`` and ``S3Tier`` subclass vLLM's
``SecondaryTierManager``. Each takes its tier's fields (as
``kvtier.DiskLookupManager`` / ``RedisLookupManager`` / ``S3LookupManager``
do), ``ManagerConfig``'s fields, and vLLM's ``locality`` and
``enable_kv_events``, as keywords of its ``secondary_tiers`` entry.

- Lookups go through kvtier's native manager: no GIL, no blocking; each
  answer is published as soon as its tier call returns.
  ``on_schedule_end`` flushes, ``on_request_finished`` cleans up.
- Stores (cascades) and loads (promotions) are jobs of kvtier's data path:
  the bytes move between the primary tier's rows and the tier in Rust,
  without the GIL. A finished store marks its keys present; a load that
  finds a key absent or fails marks it a miss, so a request never loops on
  a stale hit. ``successful_keys`` of a failed promotion is exact.
- Blocks are namespaced by what makes them compatible (see
  :func:`namespace_fields`): two deployments sharing a directory, a Redis
  or a bucket never read each other's blocks, whatever their prefixes.

Only ``import kvtier.vllm`` imports vLLM; ``import kvtier`` does not.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
    OffloadingSpec,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector
from vllm.v1.kv_offload.tiering.base import (
    TIER_LABEL,
    JobResult,
    SecondaryTierManager,
    TransferJob,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

import kvtier

__all__ = [
    "DiskTier",
    "RedisTier",
    "S3Tier",
    "namespace_fields",
    "namespace_id",
]

#: Bumped when what a namespace holds, or how blocks are laid out under it,
#: changes: blocks written under another format are never read.
NAMESPACE_FORMAT = "kvtier-vllm/1"

_SAFE = re.compile(r"[^A-Za-z0-9._-]")
# The disk tier's segment files (tier-disk: seg-<id, 16 hex digits>.kvs).
_SEGMENT = re.compile(r"seg-([0-9a-f]{16})\.kvs")



def namespace_fields(offloading_spec: OffloadingSpec, row_bytes: int) -> dict[str, Any]:
    """What makes two deployments' blocks interchangeable, from vLLM's
    normalised offloading configuration (``offloading_spec.config``).

    The same fields vLLM's own file-system tier digests (its ``FileMapper``):
    the model, the KV dtype, tokens per block hash, blocks per chunk, the KV
    cache groups (tokens per block and layer names), the parallel sizes
    (tensor, pipeline, prefill- and decode-context) and this rank, collapsed
    to 1 and rank 0 when vLLM declares the bytes parallelism-agnostic (as
    the fs tier does), the replicated and canonical layouts; plus the KV
    cache layout's name, the worker's KV bytes per block and the row size
    of the primary tier (a block stored at another size could not be
    loaded), and :data:`NAMESPACE_FORMAT`. The data-parallel index is not
    in it: replicas of one model share their blocks, as with the fs tier.
    """
    config = offloading_spec.config
    parallel = config.parallel
    agnostic = bool(parallel.is_parallelism_agnostic or config.replicated_layout)
    blocks_per_chunk = getattr(offloading_spec, "blocks_per_chunk", None)
    if not isinstance(blocks_per_chunk, int):
        blocks_per_chunk = config.cache.blocks_per_chunk
    return {
        "format": NAMESPACE_FORMAT,
        "inference_engine": "vllm",
        "model_name": config.model.name,
        "dtype": str(config.model.dtype),
        "tokens_per_hash": config.cache.tokens_per_hash,
        "blocks_per_chunk": blocks_per_chunk,
        "kv_cache_groups": [
            {"tokens_per_block": group.tokens_per_block, "layer_names": list(group.layer_names)}
            for group in config.groups
        ],
        "tp_size": 1 if agnostic else parallel.tp_size,
        "pp_size": 1 if agnostic else parallel.pp_size,
        "pcp_size": 1 if agnostic else parallel.pcp_size,
        "dcp_size": 1 if agnostic else parallel.dcp_size,
        "rank": 0 if agnostic else parallel.rank,
        "parallel_agnostic": agnostic,
        "replicated_layout": bool(config.replicated_layout),
        "canonical_layout": bool(config.canonical_layout),
        "kv_cache_layout": config.kv_cache_layout,
        "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
        "row_bytes": row_bytes,
    }


def namespace_id(fields: Mapping[str, Any]) -> str:
    """The namespace's name: the model name made safe for a path, a Redis
    key and an object name (``[A-Za-z0-9._-]``, at most 64 characters), an
    underscore, and the first 16 hex digits of the SHA-256 of ``fields``
    as canonical JSON (sorted keys, no spaces)."""
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:16]
    model = _SAFE.sub("_", str(fields.get("model_name", "model")))[:64] or "model"
    return f"{model}_{digest}"


class _Metric:
    """Names of the metrics the tiers report through ``get_stats``, each
    labelled by ``tier`` (the tier's ``tier_name``, by default its type)."""

    STORED_BYTES = "vllm:kv_offload_kvtier_stored_bytes"
    STORED_BLOCKS = "vllm:kv_offload_kvtier_stored_blocks"
    LOADED_BYTES = "vllm:kv_offload_kvtier_loaded_bytes"
    LOADED_BLOCKS = "vllm:kv_offload_kvtier_loaded_blocks"
    FAILED_STORE_BLOCKS = "vllm:kv_offload_kvtier_failed_store_blocks"
    FAILED_LOAD_BLOCKS = "vllm:kv_offload_kvtier_failed_load_blocks"
    LOOKUPS = "vllm:kv_offload_kvtier_lookups"
    HITS = "vllm:kv_offload_kvtier_hits"
    MISSES = "vllm:kv_offload_kvtier_misses"
    LOOKUP_ERRORS = "vllm:kv_offload_kvtier_lookup_errors"
    TIME_TO_VERDICT_P50 = "vllm:kv_offload_kvtier_time_to_verdict_p50_seconds"
    TIME_TO_VERDICT_P99 = "vllm:kv_offload_kvtier_time_to_verdict_p99_seconds"
    CAPACITY_USED_BYTES = "vllm:kv_offload_kvtier_capacity_used_bytes"  # disk
    CAPACITY_BYTES = "vllm:kv_offload_kvtier_capacity_bytes"
    EVICTED_SEGMENTS = "vllm:kv_offload_kvtier_evicted_segments"


_COUNTERS = {
    _Metric.STORED_BYTES: "Bytes stored into the kvtier tier (cascades that succeeded).",
    _Metric.STORED_BLOCKS: "Blocks stored into the kvtier tier.",
    _Metric.LOADED_BYTES: "Bytes loaded from the kvtier tier into the primary tier.",
    _Metric.LOADED_BLOCKS: "Blocks loaded from the kvtier tier into the primary tier.",
    _Metric.FAILED_STORE_BLOCKS: "Blocks whose store into the kvtier tier failed.",
    _Metric.FAILED_LOAD_BLOCKS: "Blocks whose load from the kvtier tier failed or found them absent.",
    _Metric.LOOKUPS: "Keys looked up in the kvtier tier.",
    _Metric.HITS: "Keys the kvtier tier answered present.",
    _Metric.MISSES: "Keys the kvtier tier answered absent.",
    _Metric.LOOKUP_ERRORS: "Keys whose kvtier lookup failed or timed out (answered miss).",
}
_GAUGES = {
    _Metric.TIME_TO_VERDICT_P50: "Median time from a key's first lookup to its answer, in seconds.",
    _Metric.TIME_TO_VERDICT_P99: "99th percentile of the time from a key's first lookup to its answer, in seconds.",
}
_DISK_COUNTERS = {
    _Metric.EVICTED_SEGMENTS: "Segments the kvtier disk tier evicted (oldest first) to stay within capacity_bytes.",
}
_DISK_GAUGES = {
    _Metric.CAPACITY_USED_BYTES: "Bytes of segment files the kvtier disk tier holds (at most capacity_bytes).",
    _Metric.CAPACITY_BYTES: "The kvtier disk tier's capacity_bytes.",
}


@dataclass
class _Pending:
    """A vLLM job in kvtier's hands."""

    job: TransferJob
    keys: list[bytes]


class _KvtierTier(SecondaryTierManager):
    """What the three tiers share: the vLLM contract over a native manager."""

    _manager_cls: ClassVar[type]

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        *,
        locality: str | None = None,
        enable_kv_events: bool = False,
        **config: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(locality) if locality is not None else None
        self.events: list[OffloadingEvent] | None = None
        if enable_kv_events and offloading_spec.kv_events_config.enable_kv_cache_events:
            self.events = []
        self.namespace_fields = namespace_fields(offloading_spec, self.block_size_bytes)
        self.namespace = namespace_id(self.namespace_fields)
        config.setdefault("tier_name", tier_type)
        self._view = primary_kv_view
        self.manager = self._open(self._namespaced(dict(config)))
        # kvtier job id -> the vLLM job it carries.
        self._jobs: dict[int, _Pending] = {}
        # Results of jobs that ended at submission (empty, or refused), reported at the next poll.
        self._ended_at_submit: list[JobResult] = []
        self._stats_lock = threading.Lock()
        self._counts: dict[str, int] = dict.fromkeys(_COUNTERS, 0)
        self._last_manager_stats: dict[str, Any] = {}

    # -- What each tier says -------------------------------------------------

    def _namespaced(self, config: dict[str, Any]) -> dict[str, Any]:
        """The native manager's keywords, with the namespace applied."""
        raise NotImplementedError

    def _open(self, config: dict[str, Any]) -> Any:
        return self._manager_cls(**config)

    # -- Lookups -------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self.manager.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self.manager.flush()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self.manager.cleanup(req_context.req_id)

    # -- Jobs ----------------------------------------------------------------

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, self.manager.submit_store)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, self.manager.submit_load)

    def _submit(self, job: TransferJob, submit: Any) -> None:
        keys = [bytes(k) for k in job.keys]
        if not keys:
            self._ended_at_submit.append(
                JobResult(job_id=job.job_id, success=True, transfer_time=0.0, transfer_bytes=0)
            )
            return
        try:
            kvtier_id = submit(keys, self._view, job.chunk_ids)
        except Exception:  # noqa: BLE001 - reported as the job's failure
            # Nothing was queued, so nothing touches the rows: vLLM frees
            # them at once. A load marks its keys a miss, so the scheduler
            # does not promote them again from a stale hit.
            if job.is_promotion:
                self.manager.mark_miss(keys)
            self._ended_at_submit.append(JobResult(job_id=job.job_id, success=False))
            self._count_failed(job.is_promotion, len(keys))
            return
        self._jobs[kvtier_id] = _Pending(job=job, keys=keys)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = self._ended_at_submit
        self._ended_at_submit = []
        if self._jobs:
            for report in self.manager.poll_jobs():
                pending = self._jobs.pop(report.job_id, None)
                if pending is not None:
                    results.append(self._result(pending, report))
        return results

    def _result(self, pending: _Pending, report: Any) -> JobResult:
        """vLLM's result of a finished kvtier job. kvtier reports a job only
        once it no longer touches the rows (its copies are over, however it
        ended), so ``deferred_release`` is never needed: the rows of a failed
        promotion go back to vLLM at once."""
        job = pending.job
        succeeded = list(report.successful_keys)
        moved = int(report.bytes)
        if job.is_promotion:
            self._count(_Metric.LOADED_BLOCKS, len(succeeded))
            self._count(_Metric.LOADED_BYTES, moved)
        else:
            self._count(_Metric.STORED_BLOCKS, len(succeeded))
            self._count(_Metric.STORED_BYTES, moved)
        if not report.ok:
            self._count_failed(job.is_promotion, len(pending.keys) - len(succeeded))
        if not job.is_promotion and report.ok and self.events is not None:
            self.events.append(
                OffloadingEvent(
                    keys=list(job.keys),
                    medium=self.medium,
                    removed=False,
                    locality=self.locality,
                    req_context=job.req_context,
                )
            )
        successful_keys = None
        if job.is_promotion and not report.ok and succeeded:
            successful_keys = tuple(succeeded)
        return JobResult(
            job_id=job.job_id,
            success=bool(report.ok),
            successful_keys=successful_keys,
            transfer_time=float(report.seconds),
            transfer_bytes=moved,
        )

    def has_pending_work(self) -> bool:
        return bool(self._jobs) or bool(self._ended_at_submit)

    def drain_jobs(self) -> None:
        """Waits until no job of this tier touches the primary tier's rows.

        Queued jobs are cancelled (they report failure), running ones end;
        a copy is never cut in half. Every result is then available from
        ``get_finished_jobs``."""
        self.manager.drain_jobs(None)

    def take_events(self) -> Iterable[OffloadingEvent]:
        if self.events:
            events, self.events = self.events, []
            return events
        return ()

    def shutdown(self) -> None:
        self.manager.shutdown()

    # -- Metrics ---------------------------------------------------------------

    def _count(self, name: str, value: int) -> None:
        with self._stats_lock:
            self._counts[name] += value

    def _count_failed(self, is_promotion: bool, blocks: int) -> None:
        name = _Metric.FAILED_LOAD_BLOCKS if is_promotion else _Metric.FAILED_STORE_BLOCKS
        self._count(name, blocks)

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        labels = (TIER_LABEL,)
        metrics: dict[str, OffloadingMetricMetadata] = {
            name: OffloadingCounterMetadata(documentation=doc, labelnames=labels)
            for name, doc in _COUNTERS.items()
        }
        metrics.update(
            {
                name: OffloadingGaugeMetadata(documentation=doc, labelnames=labels)
                for name, doc in _GAUGES.items()
            }
        )
        return metrics

    def get_stats(self) -> OffloadingConnectorStats | None:
        labels = (self.manager.tier_name,)
        stats = OffloadingConnectorStats()
        now = self.manager.stats()
        last, self._last_manager_stats = self._last_manager_stats, now
        with self._stats_lock:
            counts, self._counts = self._counts, dict.fromkeys(_COUNTERS, 0)
        for native, metric in (
            ("lookups", _Metric.LOOKUPS),
            ("hits", _Metric.HITS),
            ("misses", _Metric.MISSES),
        ):
            counts[metric] = int(now.get(native, 0)) - int(last.get(native, 0))
        counts[_Metric.LOOKUP_ERRORS] = sum(
            int(now.get(k, 0)) - int(last.get(k, 0)) for k in ("errors", "timeouts")
        )
        for name, value in counts.items():
            if value:
                stats.increase_counter(name, value, labels)
        if now.get("lookups", 0) != last.get("lookups", 0):
            stats.set_gauge(_Metric.TIME_TO_VERDICT_P50, now.get("time_to_verdict_p50_us", 0) / 1e6, labels)
            stats.set_gauge(_Metric.TIME_TO_VERDICT_P99, now.get("time_to_verdict_p99_us", 0) / 1e6, labels)
        return None if stats.is_empty() else stats


class DiskTier(_KvtierTier):
    """kvtier's disk tier: append-only segments under a memory-mapped index,
    bounded by ``capacity_bytes`` (whole oldest segments evicted), found
    again at once after a restart.

    Keywords: ``path`` (required): the blocks go in the directory
    ``path/<namespace>``, and a description of the namespace in
    ``path/<namespace>.json``; ``capacity_bytes`` (default 1 GiB),
    ``segment_bytes``, ``key_len`` (default 36: vLLM's 32-byte sha256 block
    hash and the 4-byte group index; 20 with a 16-byte hash such as
    ``xxhash``), ``initial_slots``, ``fsync`` (``"always"`` / ``"never"``),
    ``rebuild_corrupt_index``; ``ManagerConfig``'s fields; ``locality``,
    ``enable_kv_events``. One vLLM process at a time uses a namespace's
    directory (a lock file keeps a second one out).
    """

    medium: ClassVar[Medium] = Medium.STORAGE
    _manager_cls = kvtier.DiskLookupManager
    #: ``get_stats`` scans the directory's segment files at most this often (seconds).
    stats_scan_interval_s: float = 1.0

    def __init__(self, *args: Any, path: str | os.PathLike[str], **config: Any) -> None:
        self.root = os.fspath(path)
        self.capacity_bytes = int(config.get("capacity_bytes", 1 << 30))
        self._disk_scanned_at = float("-inf")
        self._used_bytes: int | None = None
        self._first_segment: int | None = None
        self._evicted_segments = 0
        super().__init__(*args, **config)

    def _namespaced(self, config: dict[str, Any]) -> dict[str, Any]:
        self.directory = os.path.join(self.root, self.namespace)
        os.makedirs(self.directory, exist_ok=True)
        description = self.directory + ".json"
        if not os.path.exists(description):
            tmp = f"{description}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(self.namespace_fields, f, indent=2, sort_keys=True)
            os.replace(tmp, description)
        config["path"] = self.directory
        return config

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        metrics = super().build_metric_definitions(extra_config)
        labels = (TIER_LABEL,)
        for name, doc in _DISK_GAUGES.items():
            metrics[name] = OffloadingGaugeMetadata(documentation=doc, labelnames=labels)
        for name, doc in _DISK_COUNTERS.items():
            metrics[name] = OffloadingCounterMetadata(documentation=doc, labelnames=labels)
        return metrics

    def get_stats(self) -> OffloadingConnectorStats | None:
        stats = super().get_stats() or OffloadingConnectorStats()
        labels = (self.manager.tier_name,)
        now = time.monotonic()
        if now - self._disk_scanned_at >= self.stats_scan_interval_s:
            self._disk_scanned_at = now
            self._scan_segments()
        if self._used_bytes is not None:
            stats.set_gauge(_Metric.CAPACITY_USED_BYTES, self._used_bytes, labels)
        if self._evicted_segments:
            stats.increase_counter(_Metric.EVICTED_SEGMENTS, self._evicted_segments, labels)
            self._evicted_segments = 0
        stats.set_gauge(_Metric.CAPACITY_BYTES, self.capacity_bytes, labels)
        return stats

    def _scan_segments(self) -> None:
        """Bytes of the segment files, and the segments evicted since the
        last scan: segments are numbered in order and evicted oldest first,
        so the live ones are a range whose start moves up by one per
        eviction."""
        used, first = 0, None
        try:
            for entry in os.scandir(self.directory):
                match = _SEGMENT.fullmatch(entry.name)
                if match is None:
                    continue
                used += entry.stat().st_size
                seg = int(match.group(1), 16)
                first = seg if first is None else min(first, seg)
        except OSError:
            self._used_bytes = None
            return
        self._used_bytes = used
        if first is not None:
            if self._first_segment is not None and first > self._first_segment:
                self._evicted_segments += first - self._first_segment
            self._first_segment = first


class RedisTier(_KvtierTier):
    """kvtier's Redis tier: one server (``url``) or a cluster
    (``cluster_urls``), TLS with ``rediss://`` (``tls_ca_cert`` for a
    private CA).

    Keywords: the Redis tier's fields (``url``, ``cluster_urls``,
    ``username``, ``password``, ``tls_ca_cert``, ``key_prefix``,
    ``key_layout``, ``ttl_ms``, ...) and ``ManagerConfig``'s; ``locality``,
    ``enable_kv_events``. A block's Redis key is ``key_prefix`` (default
    ``"kvtier:"``), the namespace, a colon, then (with ``key_layout``
    ``"tagged"``, the default on a cluster) a hash tag of four characters
    in braces, then the block key's bytes.
    """

    medium: ClassVar[Medium | None] = None
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED
    _manager_cls = kvtier.RedisLookupManager

    def _namespaced(self, config: dict[str, Any]) -> dict[str, Any]:
        config["key_prefix"] = f"{config.get('key_prefix', 'kvtier:')}{self.namespace}:"
        return config


class S3Tier(_KvtierTier):
    """kvtier's S3 tier, over AWS S3 or an S3-compatible server.

    Keywords: the S3 tier's fields (``bucket`` (required), ``endpoint``,
    ``region``, ``prefix``, ``access_key_id``, ``secret_access_key``,
    ``force_path_style``, ...) and ``ManagerConfig``'s; ``locality``,
    ``enable_kv_events``. A block's object name is ``prefix`` (default
    ``"kvtier/"``), the namespace, a slash, then the block key in
    lower-case hex.
    """

    medium: ClassVar[Medium] = Medium.STORAGE
    cache_hit_source: ClassVar[CacheHitSource] = CacheHitSource.EXTERNAL_UNSPECIFIED
    _manager_cls = kvtier.S3LookupManager

    def _namespaced(self, config: dict[str, Any]) -> dict[str, Any]:
        config["prefix"] = f"{config.get('prefix', 'kvtier/')}{self.namespace}/"
        return config
