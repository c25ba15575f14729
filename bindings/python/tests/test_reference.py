"""The reference manager's behaviours, on a subclassed in-memory tier."""

from __future__ import annotations

import threading
import time

import pytest

import kvtier
from conftest import GUARD, InMemoryLookupManager, ReqContext, key, resolve, wait_for


@pytest.fixture
def manager():
    m = InMemoryLookupManager(existing_keys=[key(1), key(2)])
    yield m
    m.shutdown()


def test_new_key_is_none_then_present_true_absent_false(manager, ctx):
    assert manager.lookup(key(1), ctx) is None
    assert manager.lookup(key(3), ctx) is None
    manager.flush()
    assert resolve(manager, key(1), ctx) is True
    assert resolve(manager, key(3), ctx) is False


def test_several_keys_in_one_step_are_one_call(manager, ctx):
    for i in range(1, 5):
        assert manager.lookup(key(i), ctx) is None
    manager.flush()
    verdicts = [resolve(manager, key(i), ctx) for i in range(1, 5)]
    assert verdicts == [True, True, False, False]
    assert len(manager.calls) == 1
    assert manager.calls[0][0] == [key(i) for i in range(1, 5)]


def test_cleanup_keeps_keys_other_requests_hold(manager):
    a, b = ReqContext("a"), ReqContext("b")
    manager.lookup(key(1), a)
    manager.lookup(key(1), b)
    assert resolve(manager, key(1), a) is True
    manager.cleanup("a")
    assert manager.lookup(key(1), b) is True
    manager.flush()
    assert len(manager.calls) == 1, "b's key was kept, not probed again"


def test_a_repeated_lookup_does_not_probe_twice(manager, ctx):
    manager.lookup(key(1), ctx)
    manager.lookup(key(1), ctx)
    manager.flush()
    assert resolve(manager, key(1), ctx) is True
    manager.lookup(key(1), ctx)
    manager.flush()
    manager.drain_results()
    assert [keys for keys, _ in manager.calls] == [[key(1)]]


def test_mark_miss_wins_over_a_cached_true(manager, ctx):
    assert resolve(manager, key(1), ctx) is True
    manager.mark_miss([key(1)])
    assert manager.lookup(key(1), ctx) is False


class Gated(InMemoryLookupManager):
    """batch_lookup waits for `release` (reference defect 5's late answer)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.entered = threading.Event()
        self.release = threading.Event()

    def batch_lookup(self, keys, req_context):
        self.entered.set()
        assert self.release.wait(GUARD)
        return super().batch_lookup(keys, req_context)


def test_mark_miss_wins_over_a_late_true(ctx):
    m = Gated(existing_keys=[key(1)])
    try:
        m.lookup(key(1), ctx)
        m.flush()
        assert m.entered.wait(GUARD)
        m.mark_miss([key(1)])  # in flight: must not raise
        m.release.set()
        wait_for(lambda: (m.drain_results(), m.stats()["stale_results_dropped"] == 1)[1],
                 "the late answer to be dropped")
        assert m.lookup(key(1), ctx) is False
        assert m.stats()["hits"] == 0
    finally:
        m.release.set()
        m.shutdown()


def test_mark_present_supersedes_a_probe_in_flight(ctx):
    """vLLM 0.34's mark_present: a finished store answers True at once, and
    the probe started before it (answering absent) cannot undo it."""
    m = Gated(existing_keys=[])
    try:
        assert m.lookup(key(1), ctx) is None
        m.flush()
        assert m.entered.wait(GUARD)
        m.mark_present([key(1)])
        assert m.lookup(key(1), ctx) is True
        m.release.set()
        wait_for(lambda: (m.drain_results(), m.stats()["stale_results_dropped"] == 1)[1],
                 "the late answer to be dropped")
        assert m.lookup(key(1), ctx) is True
        assert m.stats()["misses"] == 0
    finally:
        m.release.set()
        m.shutdown()


def test_mark_present_before_the_flush_sends_no_probe(manager, ctx):
    assert manager.lookup(key(7), ctx) is None
    manager.mark_present([key(7), key(8)])  # key(8): untracked, skipped
    assert manager.lookup(key(7), ctx) is True
    manager.flush()
    manager.drain_results()
    assert manager.calls == []
    assert manager.stats()["tracked_keys"] == 1
    # After a forced miss, a store makes it a hit again.
    manager.mark_miss([key(7)])
    assert manager.lookup(key(7), ctx) is False
    manager.mark_present([key(7)])
    assert manager.lookup(key(7), ctx) is True


def test_mark_present_forgets_a_key_only_kept_for_its_probe():
    m = Gated(existing_keys=[])
    try:
        m.lookup(key(1), ReqContext("a"))
        m.flush()
        assert m.entered.wait(GUARD)
        m.cleanup("a")
        assert m.stats()["tracked_keys"] == 1
        m.mark_present([key(1)])
        assert m.stats()["tracked_keys"] == 0
        m.release.set()
        wait_for(lambda: (m.drain_results(), m.stats()["stale_results_dropped"] == 1)[1],
                 "the late answer to be dropped")
        assert m.stats()["tracked_keys"] == 0
    finally:
        m.release.set()
        m.shutdown()


def test_cleanup_of_an_unknown_request_is_a_no_op(manager, ctx):
    assert resolve(manager, key(1), ctx) is True
    manager.cleanup("never-seen")
    assert manager.lookup(key(1), ctx) is True
    assert manager.stats()["tracked_requests"] == 1


def test_shutdown_stops_the_worker(ctx):
    m = InMemoryLookupManager(existing_keys=[key(1)])
    assert resolve(m, key(1), ctx) is True
    m.lookup(key(2), ctx)
    m.shutdown()
    m.shutdown()  # idempotent
    assert m.is_shut_down()
    m.flush()  # does nothing
    time.sleep(0.05)
    assert len(m.calls) == 1, "no call after shutdown"
    with pytest.raises(kvtier.ShutDownError):
        m.lookup(key(1), ctx)
    with pytest.raises(kvtier.ShutDownError):
        m.lookup_many([key(1)], ctx)
    # Documented: cleanup, mark_miss, mark_present and stats still work.
    m.mark_miss([key(1)])
    m.mark_present([key(1)])
    m.cleanup("req-0")
    assert m.stats()["tracked_requests"] == 0


def test_the_first_requests_context_object_reaches_batch_lookup(manager):
    first = ReqContext("a", kv_transfer_params={"x": 1})
    manager.lookup(key(1), first)
    manager.lookup(key(2), ReqContext("a"))  # an equal id, another object
    manager.flush()
    wait_for(lambda: manager.calls, "the call")
    assert manager.calls[0][1] is first


def test_subclass_attributes_set_after_init_are_visible(ctx):
    m = InMemoryLookupManager(existing_keys=[key(9)], call_timeout_ms=2000)
    try:
        assert resolve(m, key(9), ctx) is True
    finally:
        m.shutdown()


def test_an_answer_is_seen_by_the_lookup_right_after_batch_lookup_returns(ctx):
    class Signals(InMemoryLookupManager):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.done = threading.Event()

        def batch_lookup(self, keys, req_context):
            answer = super().batch_lookup(keys, req_context)
            self.done.set()
            return answer

    for i in range(20):
        m = Signals(existing_keys=[key(1)])
        try:
            assert m.lookup(key(1), ctx) is None
            m.flush()
            assert m.done.wait(GUARD)
            assert m.lookup(key(1), ctx) is True, f"trial {i}"
        finally:
            m.shutdown()


def test_calls_that_time_out_leave_the_publication_wait_exact(ctx):
    """Calls that time out, queued for a slot or while batch_lookup runs,
    publish an outcome without a matching return (or return after it); the
    lookup right after a later batch_lookup returns must still see its answer
    (review finding: counters of returns vs publications drifted)."""

    class Gated(InMemoryLookupManager):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.gate = threading.Event()
            self.gated = True
            self.done = threading.Event()
            self.running = 0

        def batch_lookup(self, keys, req_context):
            with self.lock:
                self.running += 1
            if self.gated:
                self.gate.wait(GUARD)
            answer = super().batch_lookup(keys, req_context)
            with self.lock:
                self.running -= 1
            self.done.set()
            return answer

    m = Gated(existing_keys=[key(i) for i in range(100, 200)],
              max_calls_in_flight=1, call_timeout_ms=300)
    try:
        # Calls stuck past their deadline hold the only slot; the others
        # time out waiting for it, never reaching batch_lookup.
        for r in range(4):
            assert m.lookup(key(r), ReqContext(f"stuck-{r}")) is None
        m.flush()
        wait_for(lambda: all(m.lookup(key(r), ReqContext(f"stuck-{r}")) is False
                             for r in range(4)), "the timed-out calls to be published")
        m.gated = False
        m.gate.set()  # stuck calls return after their outcome was published
        wait_for(lambda: m.running == 0, "the stuck calls to return")
        assert len(m.calls) < 4, "some calls timed out before batch_lookup"
        for i in range(100, 120):
            m.done.clear()
            assert m.lookup(key(i), ctx) is None
            m.flush()
            assert m.done.wait(GUARD)
            assert m.lookup(key(i), ctx) is True, f"trial {i}"
    finally:
        m.shutdown()
