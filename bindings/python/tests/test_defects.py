"""The reference's seven defects (lookup-core's tests "Defect 1".."Defect 7"),
shown fixed from Python."""

from __future__ import annotations

import threading
import time

from conftest import GUARD, InMemoryLookupManager, ReqContext, key, resolve, wait_for


def test_defect_1_a_wrong_length_answer_resolves_every_key_and_leaks_nothing(ctx):
    class Short(InMemoryLookupManager):
        def batch_lookup(self, keys, req_context):
            return [True] * (len(keys) - 1)

    m = Short(existing_keys=[key(i) for i in range(4)])
    try:
        for i in range(4):
            m.lookup(key(i), ctx)
        m.flush()
        assert [resolve(m, key(i), ctx) for i in range(4)] == [False] * 4
        stats = m.stats()
        assert (stats["errors"], stats["hits"], stats["misses"]) == (4, 0, 0)
        assert "for 4 keys" in stats["first_error"]
        m.cleanup("req-0")
        stats = m.stats()
        assert (stats["tracked_keys"], stats["tracked_requests"]) == (0, 0), "no state leaked"
    finally:
        m.shutdown()


def test_defect_2_an_exception_in_batch_lookup_does_not_stop_the_worker(ctx):
    class Raises(InMemoryLookupManager):
        fail = True

        def batch_lookup(self, keys, req_context):
            if self.fail:
                raise ValueError("boom")
            return super().batch_lookup(keys, req_context)

    m = Raises(existing_keys=[key(1), key(2)])
    try:
        assert resolve(m, key(1), ctx) is False
        assert m.stats()["errors"] == 1
        m.fail = False
        assert resolve(m, key(2), ctx) is True
    finally:
        m.shutdown()


def test_defect_3_results_are_seen_without_another_flush(ctx):
    class Slowish(InMemoryLookupManager):
        def batch_lookup(self, keys, req_context):
            time.sleep(0.005)
            return super().batch_lookup(keys, req_context)

    m = Slowish(existing_keys=[key(1)])
    try:
        m.lookup(key(1), ctx)
        m.flush()
        start = time.monotonic()
        verdict = m.lookup(key(1), ctx)
        while verdict is None:  # no flush, no drain_results in between
            assert time.monotonic() - start < GUARD
            time.sleep(0.001)
            verdict = m.lookup(key(1), ctx)
        assert verdict is True
    finally:
        m.shutdown()


def test_defect_4_a_failure_is_a_counted_error_and_is_retried_after_backoff(ctx):
    class Flaky(InMemoryLookupManager):
        fail = True

        def batch_lookup(self, keys, req_context):
            if self.fail:
                raise ConnectionError("injected outage")
            return super().batch_lookup(keys, req_context)

    m = Flaky(existing_keys=[key(1)], failure_backoff_ms=50)
    try:
        assert resolve(m, key(1), ctx) is False
        stats = m.stats()
        assert (stats["errors"], stats["misses"]) == (1, 0), stats
        assert "injected outage" in stats["first_error"]
        m.fail = False
        time.sleep(0.06)  # past the back-off
        assert m.lookup(key(1), ctx) is False, "still a miss meanwhile, never pending again"
        m.flush()
        wait_for(lambda: m.lookup(key(1), ctx) is True, "the re-probe")
        assert len(m.calls) == 1  # the failed call raised before logging
    finally:
        m.shutdown()


def test_defect_5_mark_miss_on_an_in_flight_key_wins_over_the_late_answer(ctx):
    entered, release = threading.Event(), threading.Event()

    class Gated(InMemoryLookupManager):
        def batch_lookup(self, keys, req_context):
            entered.set()
            release.wait(GUARD)
            return super().batch_lookup(keys, req_context)

    m = Gated(existing_keys=[key(1)])
    try:
        m.lookup(key(1), ctx)
        m.flush()
        assert entered.wait(GUARD)
        m.mark_miss([key(1)])  # the reference asserts here
        release.set()
        wait_for(lambda: (m.drain_results(), m.stats()["stale_results_dropped"] == 1)[1],
                 "the late answer to be dropped")
        assert m.lookup(key(1), ctx) is False
    finally:
        release.set()
        m.shutdown()


def test_defect_6_one_slow_request_does_not_hold_back_the_others(ctx):
    release = threading.Event()

    class SlowForOne(InMemoryLookupManager):
        def batch_lookup(self, keys, req_context):
            if req_context.req_id == "slow":
                release.wait(GUARD)
            return super().batch_lookup(keys, req_context)

    m = SlowForOne(existing_keys=[key(1), key(2)], call_timeout_ms=10_000)
    slow, fast = ReqContext("slow"), ReqContext("fast")
    try:
        m.lookup(key(1), slow)
        m.lookup(key(2), fast)
        m.flush()
        assert resolve(m, key(2), fast) is True
        assert m.lookup(key(1), slow) is None, "the slow request is still running"
    finally:
        release.set()
        m.shutdown()


def test_defect_7_the_backlog_is_bounded_and_coalesces_behind_a_slow_tier(ctx):
    class Slow(InMemoryLookupManager):
        def batch_lookup(self, keys, req_context):
            time.sleep(0.1)
            return super().batch_lookup(keys, req_context)

    m = Slow(max_calls_in_flight=1, max_queued_keys=100, call_timeout_ms=10_000)
    try:
        for step in range(20):
            for i in range(step * 10, step * 10 + 10):
                m.lookup(key(i), ctx)
            m.flush()
        stats = m.stats()
        assert stats["queued_keys"] <= 100, stats
        assert stats["deferred"] >= 80, stats
        wait_for(lambda: (m.drain_results(),
                          m.stats()["queued_keys"] == 0 and m.stats()["in_flight_keys"] == 0)[1],
                 "the backlog to clear")
        assert len(m.calls) <= 3, len(m.calls)
        assert m.lookup(key(199), ctx) is None  # a deferred key is tracked now
        m.flush()
        assert resolve(m, key(199), ctx) is False
    finally:
        m.shutdown()
