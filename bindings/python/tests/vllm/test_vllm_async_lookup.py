"""vLLM 0.34.0's own ``AsyncLookupManager`` tests, run against
``kvtier.AsyncLookupManager``.

The tests are vLLM's file ``tests/v1/kv_offload/tiering/test_async_lookup.py``
(after vLLM PR #49328, with ``mark_present``), taken at test time from the
vLLM 0.34.0 source distribution on the package index by
``fetch-vllm-tests.sh`` (nothing of it is in this repository). Before the
file is imported, vLLM's ``AsyncLookupManager`` is replaced in its module by
``KvtierAsyncLookupManager`` below, so every test subclass builds on kvtier.

``KvtierAsyncLookupManager`` is ``kvtier.AsyncLookupManager`` plus one
test-harness hook: vLLM's test subclass waits on an event that vLLM's own
base class sets when it posts results to its private ``_pending_results``
queue, which kvtier does not have. The hook sets that event right after the
subclass's ``batch_lookup`` returns. kvtier's worker keeps the GIL from
there until the answers are published, so a test woken by the event sees
them (the same order vLLM's test relies on).

Sixteen of vLLM's 23 tests assert vLLM's private state (``_lookup_state``,
``LookupPhase``, ``_pending_results``, ``_lookup_queue``, ``_lookup_batch``,
``_req_keys``, ``_thread``), or inject results into its private queue, or
read verdicts after ``shutdown()`` (kvtier raises ``ShutDownError`` then).
They are skipped here, each with its reason; the behaviours they check that
the public contract can see are covered by kvtier's own tests
(``tests/test_reference.py``: mark_present in flight, before the flush, of
an orphan; mark_miss; cleanup; stale answers).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm_harness import require_vllm

require_vllm()

import kvtier  # noqa: E402
import vllm.v1.kv_offload.tiering.async_lookup as vllm_async_lookup  # noqa: E402

HERE = Path(__file__).resolve().parent
VLLM_TESTS = Path(os.environ.get("KVTIER_VLLM_TESTS_DIR", HERE.parent.parent / ".vllm-tests"))
TEST_FILE = VLLM_TESTS / "tests" / "v1" / "kv_offload" / "tiering" / "test_async_lookup.py"

PRIVATE = "asserts or drives vLLM's private state"
SKIPPED = {
    "test_iterator_failure_returns_misses_and_preserves_progress":
        "reads verdicts after shutdown(); kvtier raises ShutDownError then "
        "(the failure-to-miss rule itself: tests/test_reference.py, test_defects.py)",
    "test_found_key_returns_true": PRIVATE + " (_lookup_state, LookupPhase)",
    "test_publishes_completed_group_before_next_group_finishes": PRIVATE + " (_pending_results)",
    "test_lazy_results_publish_only_after_group_is_consumed": PRIVATE + " (_pending_results)",
    "test_cleanup_removes_entries": PRIVATE + " (_lookup_state)",
    "test_cleanup_preserves_shared_entries": PRIVATE + " (_lookup_state)",
    "test_cleanup_reuses_in_flight_probe": PRIVATE + " (_lookup_state, _pending_results)",
    "test_unclaimed_probe_reclaimed_without_lookup": PRIVATE + " (_lookup_state, _req_keys)",
    "test_stale_result_ignored_after_cleanup_and_key_reuse": PRIVATE + " (injects into _pending_results)",
    "test_flush_no_queue_post_when_empty": PRIVATE + " (_lookup_queue)",
    "test_repeated_lookup_same_key_no_duplicate_batch": PRIVATE + " (_lookup_batch)",
    "test_cleanup_unknown_req_id_is_noop": PRIVATE + " (_lookup_state)",
    "test_shutdown_unblocks_worker": PRIVATE + " (_thread)",
    "test_mark_miss_flips_cached_verdict_without_reprobing": PRIVATE + " (_lookup_batch, _lookup_queue, _req_keys)",
    "test_mark_miss_skips_newer_unresolved_probe":
        PRIVATE + " (LookupPhase); and kvtier's mark_miss forces a miss in every phase, "
        "where vLLM 0.34 leaves a newer unresolved probe alone",
    "test_enqueue_once_invariant_enforced": PRIVATE + " (injects into _pending_results)",
    "test_store_drops_orphaned_in_flight_state": PRIVATE + " (_lookup_state); kvtier: "
        "tests/test_reference.py::test_mark_present_forgets_a_key_only_kept_for_its_probe",
    "test_mark_present_handles_mixed_phases": PRIVATE + " (_lookup_state, LookupPhase); kvtier: "
        "tests/test_reference.py::test_mark_present_supersedes_a_probe_in_flight and "
        "::test_mark_present_before_the_flush_sends_no_probe",
}


class KvtierAsyncLookupManager(kvtier.AsyncLookupManager):
    """kvtier's manager, with the results-ready hook of vLLM's test subclass."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        user = cls.__dict__.get("batch_lookup")
        if user is None:
            return

        def batch_lookup(self, keys, req_context, _user=user):
            try:
                return list(_user(self, keys, req_context))
            finally:
                ready = getattr(getattr(self, "_pending_results", None), "ready", None)
                if ready is not None:
                    ready.set()

        cls.batch_lookup = batch_lookup


def _load_vllm_tests():
    if not TEST_FILE.is_file():
        fetch = HERE / "fetch-vllm-tests.sh"
        done = subprocess.run(["bash", str(fetch), str(VLLM_TESTS)], capture_output=True, text=True)
        if done.returncode != 0 or not TEST_FILE.is_file():
            pytest.fail(f"could not fetch vLLM's tests: {done.stderr[-2000:]}", pytrace=False)
    vllm_async_lookup.AsyncLookupManager = KvtierAsyncLookupManager
    spec = importlib.util.spec_from_file_location("vllm_test_async_lookup", TEST_FILE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


_vllm = _load_vllm_tests()


class TestVllmAsyncLookupManager(_vllm.TestAsyncLookupManager):
    """vLLM's ``TestAsyncLookupManager``, its subclasses built on kvtier."""


for _name in dir(TestVllmAsyncLookupManager):
    if _name in SKIPPED:
        _test = getattr(TestVllmAsyncLookupManager, _name)
        setattr(
            TestVllmAsyncLookupManager,
            _name,
            pytest.mark.skip(reason=SKIPPED[_name])(_test),
        )


def test_the_substitution_is_in_place():
    """Every manager of vLLM's tests is kvtier's."""
    assert issubclass(_vllm.InMemoryLookupManager, kvtier.AsyncLookupManager)
    assert _vllm.AsyncLookupManager is KvtierAsyncLookupManager
    names = {n for n in dir(_vllm.TestAsyncLookupManager) if n.startswith("test_")}
    assert set(SKIPPED) <= names, "a skipped test is no longer in vLLM's file"
