"""Bad input gets a clear Python exception and loses nothing."""

from __future__ import annotations

import threading
import time

import pytest

import kvtier
from conftest import GUARD, InMemoryLookupManager, ReqContext, key, resolve, wait_for


@pytest.fixture
def manager():
    m = InMemoryLookupManager(existing_keys=[key(1)])
    yield m
    m.shutdown()


@pytest.mark.parametrize("bad", ["abc", bytearray(b"abc"), 7, None, memoryview(b"abc")])
def test_a_key_that_is_not_bytes_is_a_type_error(manager, ctx, bad):
    with pytest.raises(TypeError, match="bytes"):
        manager.lookup(bad, ctx)
    with pytest.raises(TypeError, match="bytes"):
        manager.lookup_many([key(1), bad], ctx)
    with pytest.raises(TypeError, match="bytes"):
        manager.lookup_prefix([bad], ctx)
    with pytest.raises(TypeError):
        manager.mark_miss([bad])
    assert manager.stats()["lookups"] == 0, "nothing was registered"


def test_a_key_too_long_or_empty_is_a_value_error(manager, ctx):
    with pytest.raises(ValueError, match="65 bytes"):
        manager.lookup(b"x" * 65, ctx)
    with pytest.raises(ValueError):
        manager.lookup(b"", ctx)
    m = InMemoryLookupManager(max_key_len=8)
    try:
        with pytest.raises(ValueError, match="1 to 8 bytes"):
            m.lookup(b"123456789", ctx)
        assert m.lookup(b"12345678", ctx) is None
    finally:
        m.shutdown()
    # The manager is intact.
    assert resolve(manager, key(1), ctx) is True


class NoReqId:
    pass


class IntReqId:
    req_id = 5


def test_a_context_without_a_str_req_id_is_a_type_error(manager, ctx):
    with pytest.raises(TypeError, match="req_id"):
        manager.lookup(key(1), NoReqId())
    with pytest.raises(TypeError, match="req_id"):
        manager.lookup(key(1), IntReqId())
    with pytest.raises(TypeError, match="req_id"):
        manager.lookup_many([key(1)], None)
    assert manager.stats()["lookups"] == 0
    assert resolve(manager, key(1), ctx) is True


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({"call_timeout_ms": "soon"}, "call_timeout_ms"),
        ({"max_calls_in_flight": -1}, "max_calls_in_flight"),
        ({"max_calls_in_flight": 0}, "max_calls_in_flight"),
        ({"shutdown_timeout_ms": 1.5}, "shutdown_timeout_ms"),
    ],
)
def test_a_bad_configuration_is_a_value_error_naming_the_field(config, field):
    with pytest.raises(ValueError, match=field):
        InMemoryLookupManager(**config)
    with pytest.raises(ValueError, match=field):
        kvtier.DiskLookupManager(path="/nonexistent-kvtier", **config)


def test_an_unknown_keyword_is_a_type_error_naming_it(tmp_path):
    # The keywords are explicit parameters: Python itself refuses another.
    with pytest.raises(TypeError, match="no_such_field"):
        InMemoryLookupManager(no_such_field=1)
    with pytest.raises(TypeError, match="no_such_field"):
        kvtier.DiskLookupManager(path=str(tmp_path), no_such_field=1)


def test_native_configuration_fields_are_checked_by_name(tmp_path):
    with pytest.raises(ValueError, match="key_len"):
        kvtier.DiskLookupManager(path=str(tmp_path), key_len="long")
    with pytest.raises(ValueError, match="url"):
        kvtier.RedisLookupManager(url=5)
    with pytest.raises(TypeError, match="buckets"):
        kvtier.S3LookupManager(buckets="x")
    with pytest.raises(TypeError, match="bucket"):
        kvtier.S3LookupManager()  # no bucket
    with pytest.raises(ValueError, match="bucket"):
        kvtier.S3LookupManager(bucket="")


def test_an_ill_typed_secret_is_not_echoed_in_the_error(tmp_path):
    # A URL with a password where a list was expected, a password where a
    # string was expected: the error names the field and the type, never
    # the value.
    with pytest.raises(ValueError, match="cluster_urls") as err:
        kvtier.RedisLookupManager(cluster_urls="redis://:hunter2secret@127.0.0.1:1")
    assert "hunter2secret" not in str(err.value)
    assert "str" in str(err.value)
    with pytest.raises(ValueError, match="password") as err:
        kvtier.RedisLookupManager(url="redis://127.0.0.1:1/", password=31415926)
    assert "31415926" not in str(err.value)
    with pytest.raises(ValueError, match="secret_access_key") as err:
        kvtier.S3LookupManager(bucket="b", secret_access_key=["s3cr3t-value"])
    assert "s3cr3t-value" not in str(err.value)


def test_a_subclass_that_forgets_super_init_gets_a_clear_error(ctx):
    class Forgetful(kvtier.AsyncLookupManager):
        def __init__(self):
            pass

        def batch_lookup(self, keys, req_context):
            return [True] * len(keys)

    with pytest.raises(RuntimeError, match="super"):
        Forgetful().lookup(key(1), ctx)


@pytest.mark.parametrize(
    "answer",
    [
        "raise",
        "short",
        "long",
        "non_bool",
        "lazy_raises",
        "none",
    ],
)
def test_a_bad_batch_lookup_is_a_counted_error_and_the_worker_lives_on(ctx, answer):
    class Bad(InMemoryLookupManager):
        broken = True

        def batch_lookup(self, keys, req_context):
            if not self.broken:
                return super().batch_lookup(keys, req_context)
            if answer == "raise":
                raise RuntimeError("tier exploded")
            if answer == "short":
                return [True] * (len(keys) - 1)
            if answer == "long":
                return [True] * (len(keys) + 1)
            if answer == "non_bool":
                return [1] * len(keys)
            if answer == "none":
                return None

            def lazy():
                yield True
                raise OSError("disk vanished half-way")

            return lazy()

    m = Bad(existing_keys=[key(1), key(2), key(3)], failure_backoff_ms=10)
    try:
        m.lookup(key(1), ctx)
        m.lookup(key(2), ctx)
        m.flush()
        assert resolve(m, key(1), ctx) is False
        assert resolve(m, key(2), ctx) is False
        stats = m.stats()
        assert (stats["errors"], stats["hits"], stats["misses"]) == (2, 0, 0), stats
        assert stats["first_error"], stats
        # The worker lives on: a new key resolves.
        m.broken = False
        assert resolve(m, key(3), ctx) is True
    finally:
        m.shutdown()


def test_the_base_class_without_batch_lookup_is_a_counted_error(ctx):
    m = kvtier.AsyncLookupManager(tier_type="bare")
    try:
        assert resolve(m, key(1), ctx) is False
        assert "NotImplementedError" in m.stats()["first_error"]
    finally:
        m.shutdown()


def test_two_threads_calling_one_manager_at_once_do_not_crash():
    m = InMemoryLookupManager(existing_keys=[key(i) for i in range(0, 200, 2)])
    errors = []

    def scheduler(name):
        try:
            for step in range(200):
                ctx = ReqContext(f"{name}-{step % 7}")
                m.lookup_many([key(i) for i in range(step % 50, step % 50 + 8)], ctx)
                m.lookup(key(step), ctx)
                m.lookup_prefix([key(0), key(2)], ctx)
                m.flush()
                if step % 5 == 0:
                    m.cleanup(f"{name}-{(step + 3) % 7}")
                    m.mark_miss([key(step)])
                m.stats()
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=scheduler, args=(f"t{i}",)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(GUARD * 4)
    m.shutdown()
    assert not errors, errors
    assert all(not t.is_alive() for t in threads)


def test_shutdown_returns_within_its_timeout_when_batch_lookup_never_returns(ctx):
    stuck = threading.Event()
    entered = threading.Event()

    class Hung(InMemoryLookupManager):
        def batch_lookup(self, keys, req_context):
            entered.set()
            stuck.wait(60)  # "never" within the test
            return [True] * len(keys)

    m = Hung(shutdown_timeout_ms=300, call_timeout_ms=60_000)
    try:
        m.lookup(key(1), ctx)
        m.flush()
        assert entered.wait(GUARD)
        start = time.monotonic()
        m.shutdown()
        elapsed = time.monotonic() - start
        assert elapsed < 0.3 + 1.5, f"shutdown took {elapsed:.3f} s"
        # The abandoned call's key resolved as an error, not a hit.
        assert m.stats()["errors"] == 1
    finally:
        stuck.set()


def test_a_busy_python_batch_lookup_does_not_stop_shutdown(ctx):
    entered = threading.Event()
    stop = threading.Event()

    class Spinning(InMemoryLookupManager):
        def batch_lookup(self, keys, req_context):
            entered.set()
            while not stop.is_set():  # pure Python, holds the GIL in turns
                pass
            return [True] * len(keys)

    m = Spinning(shutdown_timeout_ms=200, call_timeout_ms=60_000)
    try:
        m.lookup(key(1), ctx)
        m.flush()
        assert entered.wait(GUARD)
        start = time.monotonic()
        m.shutdown()
        assert time.monotonic() - start < 0.2 + 1.5
    finally:
        stop.set()


def test_a_call_past_its_deadline_is_a_counted_timeout(ctx):
    release = threading.Event()

    class Slow(InMemoryLookupManager):
        def batch_lookup(self, keys, req_context):
            release.wait(GUARD)
            return [True] * len(keys)

    m = Slow(call_timeout_ms=50, failure_backoff_ms=60_000)
    try:
        assert resolve(m, key(1), ctx) is False
        stats = m.stats()
        assert (stats["timeouts"], stats["errors"], stats["misses"]) == (1, 0, 0), stats
    finally:
        release.set()
        m.shutdown()
