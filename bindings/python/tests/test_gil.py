"""The GIL: native lookups complete while Python code runs."""

from __future__ import annotations

import threading
import time

import pytest

from conftest import ReqContext, key, require_env
from test_native import unique_prefix

import kvtier

REQUESTS, KEYS = 20, 256


def busy(seconds: float) -> int:
    """Pure Python for `seconds`: holds the GIL except at switch intervals."""
    end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < end:
        n += 1
    return n


@pytest.fixture
def loaded_redis():
    (url,) = require_env("KVTIER_REDIS_URL")
    import redis

    prefix = unique_prefix()
    client = redis.Redis.from_url(url)
    names = []
    pipe = client.pipeline(transaction=False)
    for r in range(REQUESTS):
        for i in range(KEYS):
            if i % 2 == 0:  # half present, half absent
                name = prefix.encode() + key(r * KEYS + i)
                names.append(name)
                pipe.set(name, b"x")
    pipe.execute()
    m = kvtier.RedisLookupManager(url=url, key_prefix=prefix)
    yield m
    m.shutdown()
    client.delete(*names)


def flush_step(m):
    requests = [(ReqContext(f"r{r}"), [key(r * KEYS + i) for i in range(KEYS)]) for r in range(REQUESTS)]
    for ctx, keys in requests:
        assert m.lookup_many(keys, ctx) == [None] * KEYS
    m.flush()
    return requests


def answered(m, requests):
    n = 0
    for ctx, keys in requests:
        verdicts = m.lookup_many(keys, ctx)
        n += sum(v is not None for v in verdicts)
        assert [v for v in verdicts if v is not None] == [
            i % 2 == 0 for i, v in enumerate(verdicts) if v is not None
        ]
    return n


def test_keys_are_answered_at_the_first_step_after_a_busy_scheduler(loaded_redis):
    requests = flush_step(loaded_redis)
    busy(0.1)  # the scheduler thread runs pure Python: no lookup, no drain
    n = answered(loaded_redis, requests)
    assert n >= 0.99 * REQUESTS * KEYS, f"{n} of {REQUESTS * KEYS} answered"


def test_keys_are_answered_while_another_python_thread_is_busy(loaded_redis):
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            busy(0.01)

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        requests = flush_step(loaded_redis)
        time.sleep(0.1)  # the spinner holds the GIL most of this time
        n = answered(loaded_redis, requests)
    finally:
        stop.set()
        spinner.join()
    assert n >= 0.99 * REQUESTS * KEYS, f"{n} of {REQUESTS * KEYS} answered"
