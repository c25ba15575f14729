"""Beyond the reference: lookup_many, lookup_prefix, TierStack, stats, config."""

from __future__ import annotations

import threading
import time

import pytest

import kvtier
from conftest import GUARD, InMemoryLookupManager, ReqContext, key, require_env, resolve, wait_for
from test_native import unique_prefix


def settle(m, keys, ctx):
    """Looks `keys` up until every one has an answer."""
    m.lookup_many(keys, ctx)
    m.flush()
    wait_for(lambda: None not in m.lookup_many(keys, ctx), "every key to resolve")


def test_lookup_many_answers_each_key_like_lookup(ctx):
    m = InMemoryLookupManager(existing_keys=[key(0), key(2)])
    try:
        keys = [key(i) for i in range(4)]
        assert m.lookup_many(keys, ctx) == [None] * 4
        assert m.lookup_many((k for k in keys), ctx) == [None] * 4  # any iterable
        settle(m, keys, ctx)
        assert m.lookup_many(keys, ctx) == [True, False, True, False]
        assert [m.lookup(k, ctx) for k in keys] == [True, False, True, False]
        assert m.lookup_many([], ctx) == []
        with pytest.raises(TypeError):
            m.lookup_many(key(0), ctx)  # one bytes value, not a list
    finally:
        m.shutdown()


def test_lookup_many_of_a_long_list_answers_each_key_like_lookup(ctx):
    # 64 keys or more take the batched path (keys built in chunks of 256,
    # looked up with prefetching): the answers must be lookup's, in order,
    # across chunk boundaries, with keys resolved, absent and new mixed.
    n = 1000
    m = InMemoryLookupManager(existing_keys=[key(i) for i in range(0, n, 3)])
    try:
        keys = [key(i) for i in range(n)]
        settle(m, keys[:700], ctx)
        want = [m.lookup(k, ctx) for k in keys]
        assert want[:700] == [i % 3 == 0 for i in range(700)]
        assert want[700:] == [None] * 300
        import random
        order = keys[:]
        random.Random(1).shuffle(order)
        assert m.lookup_many(keys, ctx) == want
        assert m.lookup_many(order, ctx) == [m.lookup(k, ctx) for k in order]
        assert m.lookup_many(tuple(keys[:64]), ctx) == want[:64]
    finally:
        m.shutdown()


class SubBytes(bytes):
    pass


def test_keys_built_while_the_memo_stands_aside_answer_like_lookup(ctx):
    """Fresh objects call after call make the key memo stand aside;
    lookup_many then builds each key straight into its batch. Inline keys
    of many lengths, long keys (shared bytes), subclass instances and bad
    lengths answer as lookup answers them."""
    inline = [bytes([i % 251]) * (1 + i % 38) + i.to_bytes(4, "big") for i in range(600)]
    inline = [k[-38:] if len(k) > 38 else k for k in inline]
    long = [i.to_bytes(8, "big") * 6 for i in range(100)]  # 48 bytes
    keys = inline + long
    m = InMemoryLookupManager(existing_keys=keys[::3])
    try:
        settle(m, keys, ctx)
        # 40 x 700 fresh objects, each asked once: the memo's hit rate is
        # nil, so it stands aside.
        for _ in range(40):
            m.lookup_many([bytes(bytearray(k)) for k in keys], ctx)
        import random
        order = [bytes(bytearray(k)) if i % 5 else SubBytes(k) for i, k in enumerate(keys)]
        random.Random(7).shuffle(order)
        want = [m.lookup(k, ctx) for k in order]
        assert want == [k in set(keys[::3]) for k in order]
        assert m.lookup_many(order, ctx) == want
        for bad in (b"", b"x" * 65):
            with pytest.raises(ValueError):
                m.lookup_many([bytes(bytearray(k)) for k in keys[:100]] + [bad], ctx)
    finally:
        m.shutdown()


def test_the_same_key_answers_alike_through_any_object(ctx):
    """kvtier remembers keys by object: fresh, reused, subclassed and
    copied objects, and more objects than it remembers, answer alike."""
    m = InMemoryLookupManager(existing_keys=[key(i) for i in range(0, 20_000, 2)])
    try:
        keys = [key(i) for i in range(20_000)]  # more than the memo keeps
        expected = [i % 2 == 0 for i in range(20_000)]
        settle(m, keys, ctx)
        for _ in range(2):
            assert m.lookup_many(keys, ctx) == expected
            assert m.lookup_many([bytes(bytearray(k)) for k in keys], ctx) == expected
            assert m.lookup_many([SubBytes(k) for k in keys[:100]], ctx) == expected[:100]
            assert [m.lookup(k, ctx) for k in keys[:100]] == expected[:100]
            assert [m.lookup(bytes(bytearray(k)), ctx) for k in keys[:100]] == expected[:100]
            assert [m.lookup(SubBytes(k), ctx) for k in keys[:100]] == expected[:100]
            assert m.lookup_prefix([SubBytes(keys[0]), keys[1]], ctx) == 1
        with pytest.raises(ValueError):
            m.lookup(b"x" * 65, ctx)
        assert m.lookup(key(0), ctx) is True
    finally:
        m.shutdown()


def test_answers_keep_the_reference_counts_of_true_false_none(ctx):
    """lookup and lookup_many return the singletons with their references
    counted, also for a list dropped half-filled by an invalid key."""
    import gc
    import sys
    import types

    m = InMemoryLookupManager(existing_keys=[key(0)])
    try:
        keys = [key(0), key(1), key(2)]
        # A long list (the batched path) whose list starts as [True] * len
        # and gets its False and None stored over it.
        long_keys = [key(0)] * 100 + [key(1), key(2)] * 10
        for k in keys[:2]:
            resolve(m, k, ctx)
        gc.collect()
        before = [sys.getrefcount(x) for x in (True, False, None)]
        held = []
        for i in range(1000):
            held.append(m.lookup_many(keys, ctx))
            held.append(m.lookup_many(long_keys, ctx))
            held.append(m.lookup(keys[i % 3], ctx))
            with pytest.raises(ValueError):
                m.lookup_many([key(0), key(1), b"x" * 65], ctx)
            # A new context (the slow path), holding no None of its own.
            m.lookup_many(keys, types.SimpleNamespace(req_id=f"new-{i}"))
            m.cleanup(f"new-{i}")
        assert held[0] == [True, False, None]
        assert held[1] == [True] * 100 + [False, None] * 10
        del held
        gc.collect()
        after = [sys.getrefcount(x) for x in (True, False, None)]
        assert after[:2] == before[:2]
        # None is also held, a few times, by whatever the worker thread was
        # doing; a leak or a lost reference per answer would be >= 1000.
        assert abs(after[2] - before[2]) < 100
    finally:
        m.shutdown()


def test_lookup_prefix_counts_leading_hits_or_is_pending(ctx):
    m = InMemoryLookupManager(existing_keys=[key(0), key(1), key(3)])
    try:
        keys = [key(i) for i in range(5)]
        assert m.lookup_prefix(keys, ctx) is None
        m.flush()
        wait_for(lambda: m.lookup_prefix(keys, ctx) is not None, "the prefix")
        assert m.lookup_prefix(keys, ctx) == 2
        assert m.lookup_prefix([], ctx) == 0
    finally:
        m.shutdown()


def test_stats_report_counters_and_time_to_verdict(ctx):
    m = InMemoryLookupManager(existing_keys=[key(0)])
    try:
        settle(m, [key(0), key(1)], ctx)
        s = m.stats()
        for field in ("lookups", "hits", "misses", "errors", "timeouts", "deferred",
                      "time_to_verdict_p50_us", "time_to_verdict_p99_us"):
            assert field in s, field
        assert (s["hits"], s["misses"], s["errors"], s["timeouts"], s["deferred"]) == (1, 1, 0, 0, 0)
        assert s["lookups"] >= 4
        assert s["tier"] == "memory"
        assert s["time_to_verdict"]["count"] == 2
        assert 0 < s["time_to_verdict_p50_us"] <= s["time_to_verdict_p99_us"]
    finally:
        m.shutdown()


def test_manager_config_keywords_are_applied(ctx):
    m = InMemoryLookupManager(tier_type="mem2", tier_name="named", max_key_len=4)
    try:
        assert m.tier_name == "named"
        assert m.tier_type == "mem2"
        with pytest.raises(ValueError):
            m.lookup(b"12345", ctx)
    finally:
        m.shutdown()


def test_tier_type_is_the_type_and_a_factory_may_set_it(tmp_path):
    """vLLM's tier factories set `tier_type` on the tiers they build."""
    m = InMemoryLookupManager(tier_type="memory")
    d = kvtier.DiskLookupManager(path=str(tmp_path / "d"), tier_name="local")
    try:
        assert (m.tier_type, m.tier_name) == ("memory", "memory")
        assert (d.tier_type, d.tier_name) == ("disk", "local")
        m.tier_type = "cpu"
        assert m.tier_type == "cpu" and m.tier_name == "memory"
        assert m.stats()["tier"] == "memory"
    finally:
        m.shutdown()
        d.shutdown()


def test_a_tier_stack_says_which_tier_holds_each_leading_block(ctx):
    near = InMemoryLookupManager(tier_type="near", existing_keys=[key(0), key(1)])
    far = InMemoryLookupManager(tier_type="far", existing_keys=[key(0), key(2), key(3)])
    stack = kvtier.TierStack([near, far])
    try:
        keys = [key(i) for i in range(5)]
        assert stack.tier_names() == ["near", "far"]
        assert len(stack) == 2
        assert stack.lookup_prefix(keys, ctx) is None
        stack.flush()
        wait_for(lambda: stack.lookup_prefix(keys, ctx) is not None, "the stack's answer")
        assert stack.lookup_prefix(keys, ctx) == [0, 0, 1, 1]
        stack.mark_miss(0, [key(1)])  # a failed load from "near"
        assert stack.lookup_prefix(keys, ctx) in (None, [0])
        assert [s["tier"] for s in stack.stats()] == ["near", "far"]
        stack.cleanup("req-0")
        assert all(s["tracked_requests"] == 0 for s in stack.stats())
        with pytest.raises(TypeError):
            stack.lookup_prefix(keys, object())
    finally:
        stack.shutdown()
    with pytest.raises(kvtier.ShutDownError):
        near.lookup(key(0), ctx)


def test_a_tier_stack_of_native_disk_and_redis(tmp_path, ctx):
    (url,) = require_env("KVTIER_REDIS_URL")
    disk = kvtier.DiskLookupManager(path=str(tmp_path / "d"), fsync="never")
    redis = kvtier.RedisLookupManager(url=url, key_prefix=unique_prefix())
    stack = kvtier.TierStack([disk, redis], policy="prefer_earlier_tiers")
    try:
        disk.store(key(0), b"a")
        redis.store(key(0), b"a")
        redis.store(key(1), b"b")
        keys = [key(0), key(1), key(2)]
        assert stack.lookup_prefix(keys, ctx) is None
        stack.flush()
        wait_for(lambda: stack.lookup_prefix(keys, ctx) is not None, "the stack's answer")
        assert stack.lookup_prefix(keys, ctx) == [0, 1]
        redis.remove(key(0))
        redis.remove(key(1))
    finally:
        stack.shutdown()


def test_tier_stack_rejects_what_is_not_a_manager():
    with pytest.raises(TypeError):
        kvtier.TierStack([object()])
    with pytest.raises(ValueError):
        kvtier.TierStack([])
    m = InMemoryLookupManager()
    try:
        with pytest.raises(ValueError, match="policy"):
            kvtier.TierStack([m], policy="fastest")
    finally:
        m.shutdown()


def test_a_stack_lookup_never_holds_the_gil_while_a_member_shuts_down(ctx):
    # Thread B shuts a member down: it waits (without the GIL) for the
    # worker, whose Python batch_lookup needs the GIL to finish its busy
    # loop. Meanwhile the scheduler thread keeps asking the stack. If a
    # stack lookup blocked on the member with the GIL held, batch_lookup
    # could not finish and shutdown would run into its 4 s timeout.
    entered = threading.Event()

    class Busy(InMemoryLookupManager):
        def batch_lookup(self, keys, req_context):
            entered.set()
            end = time.monotonic() + 0.4
            n = 0
            while time.monotonic() < end:  # pure Python: needs the GIL
                n += 1
            return [True] * len(keys)

    busy = Busy(shutdown_timeout_ms=4000, call_timeout_ms=60_000)
    other = InMemoryLookupManager(existing_keys=[key(1)])
    stack = kvtier.TierStack([busy, other])
    try:
        assert stack.lookup_prefix([key(1)], ctx) is None
        stack.flush()
        assert entered.wait(GUARD)
        took = []

        def shut_down():
            start = time.monotonic()
            busy.shutdown()
            took.append(time.monotonic() - start)

        b = threading.Thread(target=shut_down)
        b.start()
        deadline = time.monotonic() + GUARD
        while b.is_alive() and time.monotonic() < deadline:
            try:
                stack.lookup_prefix([key(1)], ctx)
            except kvtier.ShutDownError:
                break  # the member finished shutting down
        b.join(GUARD)
        assert took, "shutdown did not return"
        assert took[0] < 1.5, f"shutdown took {took[0]:.2f} s: the stack held the GIL"
        assert busy.stats()["errors"] == 0, "the busy call was abandoned"
    finally:
        stack.shutdown()
