"""The native managers against the real test services: store, lookup, load."""

from __future__ import annotations

import os
import socket
import time
import uuid
from collections import Counter

import pytest

import kvtier
from conftest import GUARD, ReqContext, key, require_env, resolve, wait_for


def unique_prefix() -> str:
    return f"kvtier-py-{uuid.uuid4().hex[:12]}:"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_single():
    (url,) = require_env("KVTIER_REDIS_URL")
    return kvtier.RedisLookupManager(url=url, key_prefix=unique_prefix())


def redis_cluster():
    (urls,) = require_env("KVTIER_REDIS_CLUSTER_URLS")
    return kvtier.RedisLookupManager(cluster_urls=urls.split(","), key_prefix=unique_prefix())


def redis_tls():
    url, ca = require_env("KVTIER_REDIS_TLS_URL", "KVTIER_REDIS_TLS_CA")
    return kvtier.RedisLookupManager(url=url, tls_ca_cert=ca, key_prefix=unique_prefix())


def s3():
    endpoint, bucket = require_env("KVTIER_S3_ENDPOINT", "KVTIER_S3_BUCKET")
    return kvtier.S3LookupManager(
        bucket=bucket, endpoint=endpoint, force_path_style=True, prefix=unique_prefix().replace(":", "/")
    )


def disk(tmp_path):
    return kvtier.DiskLookupManager(path=str(tmp_path / "tier"), fsync="never")


@pytest.fixture(params=["redis", "redis_cluster", "redis_tls", "s3", "disk"])
def native(request, tmp_path):
    build = {
        "redis": redis_single,
        "redis_cluster": redis_cluster,
        "redis_tls": redis_tls,
        "s3": s3,
        "disk": lambda: disk(tmp_path),
    }[request.param]
    m = build()
    yield m
    m.shutdown()


def test_store_then_lookup_then_load(native):
    ctx = ReqContext("r")
    stored = [key(i) for i in range(5)]
    for i, k in enumerate(stored):
        native.store(k, b"block-%d" % i)
    absent = key(100)
    assert native.load(absent) is None
    assert native.lookup_many(stored + [absent], ctx) == [None] * 6
    native.flush()
    for k in stored:
        assert resolve(native, k, ctx) is True
    assert resolve(native, absent, ctx) is False
    assert native.lookup_prefix(stored + [absent] + stored, ctx) == 5
    for i, k in enumerate(stored):
        assert native.load(k) == b"block-%d" % i
    native.remove(stored[0])
    assert native.load(stored[0]) is None
    stats = native.stats()
    assert (stats["hits"], stats["misses"], stats["errors"]) == (5, 1, 0), stats
    native.cleanup("r")


def test_store_load_reject_bad_keys_and_data(native):
    with pytest.raises(TypeError):
        native.store("not bytes", b"x")
    with pytest.raises(TypeError):
        native.store(key(1), "not bytes")
    with pytest.raises(TypeError):
        native.load(bytearray(key(1)))


def test_store_and_load_after_shutdown_raise(tmp_path):
    m = disk(tmp_path)
    m.store(key(1), b"x")
    m.shutdown()
    with pytest.raises(kvtier.ShutDownError):
        m.load(key(1))
    with pytest.raises(kvtier.ShutDownError):
        m.store(key(1), b"x")
    with pytest.raises(kvtier.ShutDownError):
        m.lookup(key(1), ReqContext("r"))


def test_an_unreachable_redis_is_a_typed_error_and_a_counted_error_in_lookups():
    url = f"redis://127.0.0.1:{free_port()}/"
    m = kvtier.RedisLookupManager(url=url, connect_timeout_ms=200, response_timeout_ms=200,
                                  call_timeout_ms=1000, check=False)
    ctx = ReqContext("r")
    try:
        start = time.monotonic()
        with pytest.raises(kvtier.TierError):
            m.store(key(1), b"x")
        with pytest.raises(kvtier.TierError):
            m.load(key(1))
        assert time.monotonic() - start < GUARD
        assert resolve(m, key(1), ctx) is False
        stats = m.stats()
        assert stats["errors"] + stats["timeouts"] == 1 and stats["misses"] == 0, stats
    finally:
        m.shutdown()


def test_rejected_redis_credentials_are_a_typed_error():
    (url,) = require_env("KVTIER_REDIS_URL")
    m = kvtier.RedisLookupManager(url=url, username="nobody", password="wrong",
                                  key_prefix=unique_prefix(), check=False)
    try:
        with pytest.raises(kvtier.TierError):
            m.store(key(1), b"x")
        assert resolve(m, key(1), ReqContext("r")) is False
        assert m.stats()["errors"] + m.stats()["timeouts"] == 1
    finally:
        m.shutdown()


def test_rejected_s3_credentials_are_a_typed_error():
    endpoint, bucket = require_env("KVTIER_S3_ENDPOINT", "KVTIER_S3_BUCKET")
    m = kvtier.S3LookupManager(bucket=bucket, endpoint=endpoint, force_path_style=True,
                               access_key_id="nobody", secret_access_key="wrong-secret",
                               max_attempts=1, prefix=unique_prefix().replace(":", "/"),
                               check=False)
    try:
        with pytest.raises(kvtier.TierError):
            m.store(key(1), b"x")
        with pytest.raises(kvtier.TierError):
            m.load(key(1))
        assert resolve(m, key(1), ReqContext("r")) is False
        assert m.stats()["errors"] == 1
    finally:
        m.shutdown()


def test_the_native_managers_are_seen_by_redis_py():
    """A block stored through kvtier is the Redis key `prefix + key`."""
    (url,) = require_env("KVTIER_REDIS_URL")
    import redis

    prefix = unique_prefix()
    m = kvtier.RedisLookupManager(url=url, key_prefix=prefix)
    client = redis.Redis.from_url(url)
    try:
        m.store(key(7), b"payload")
        assert client.get(prefix.encode() + key(7)) == b"payload"
        client.set(prefix.encode() + key(8), b"from-redis-py")
        assert resolve(m, key(8), ReqContext("r")) is True
        assert m.load(key(8)) == b"from-redis-py"
    finally:
        client.delete(prefix.encode() + key(7), prefix.encode() + key(8))
        m.shutdown()


@pytest.mark.parametrize("topology", ["server", "cluster"])
def test_key_layout_names_blocks_as_documented(topology):
    """`key_layout`: "plain" names a block `prefix + key`, "tagged" `prefix +
    {4 characters of the key's crc16} + key` (redis-py finds each there);
    the default is tagged on a cluster, plain on one server; anything else
    is a ValueError naming the field."""
    import binascii

    import redis

    if topology == "server":
        (url,) = require_env("KVTIER_REDIS_URL")
        where = {"url": url}
        client = redis.Redis.from_url(url)
    else:
        (urls,) = require_env("KVTIER_REDIS_CLUSTER_URLS")
        where = {"cluster_urls": urls.split(",")}
        host, port = urls.split(",")[0].removeprefix("redis://").rstrip("/").split(":")
        client = redis.cluster.RedisCluster(host=host, port=int(port))
    prefix = unique_prefix().encode()
    k = key(9) + b"{x}"
    crc = binascii.crc_hqx(k, 0)
    tag = bytes(0x40 | (crc >> s) & 15 for s in (12, 8, 4, 0))
    names = {
        "plain": prefix + k,
        "tagged": prefix + b"{" + tag + b"}" + k,
    }
    default = "tagged" if topology == "cluster" else "plain"
    try:
        for layout in ("plain", "tagged", None):
            m = kvtier.RedisLookupManager(key_prefix=prefix.decode(), key_layout=layout, **where)
            try:
                m.store(k, b"payload")
                name = names[layout or default]
                assert client.get(name) == b"payload", (layout, name)
                other = names["plain" if (layout or default) == "tagged" else "tagged"]
                assert client.get(other) is None
                # The lookups ask for the same name.
                assert resolve(m, k, ReqContext(f"r-{layout}")) is True
                client.delete(name)
            finally:
                m.shutdown()
        with pytest.raises(ValueError, match="key_layout"):
            kvtier.RedisLookupManager(key_layout="hashed", **where)
        with pytest.raises(ValueError, match="key_prefix"):
            kvtier.RedisLookupManager(key_prefix="kv{a}:", key_layout="tagged", **where)
    finally:
        client.delete(*names.values())
        client.close()


def test_an_unreachable_s3_is_a_typed_error_and_a_counted_error_in_lookups():
    endpoint = f"http://127.0.0.1:{free_port()}"
    m = kvtier.S3LookupManager(bucket="kvtier-nowhere", endpoint=endpoint, force_path_style=True,
                               access_key_id="a", secret_access_key="b", max_attempts=1,
                               connect_timeout_ms=200, request_timeout_ms=300, check=False)
    try:
        start = time.monotonic()
        with pytest.raises(kvtier.TierError):
            m.store(key(1), b"x")
        with pytest.raises(kvtier.TierError):
            m.load(key(1))
        assert time.monotonic() - start < GUARD
        assert resolve(m, key(1), ReqContext("r")) is False
        stats = m.stats()
        assert stats["errors"] + stats["timeouts"] == 1 and stats["misses"] == 0, stats
    finally:
        m.shutdown()


def kvtier_threads() -> Counter:
    """The names of this process's threads that kvtier started."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass  # the thread ended meanwhile
    return Counter(n for n in names if n.startswith("kvtier"))


@pytest.mark.parametrize("kind", ["redis", "s3"])
def test_a_native_manager_and_its_tier_share_one_runtime_which_shutdown_stops(kind):
    """The manager's lookups, its tier's connections and its stores run on
    one runtime, named after the manager (Linux shows 15 characters)."""
    before = kvtier_threads()
    if kind == "redis":
        (url,) = require_env("KVTIER_REDIS_URL")
        m = kvtier.RedisLookupManager(url=url, key_prefix=unique_prefix(), tier_name="x")
    else:
        endpoint, bucket = require_env("KVTIER_S3_ENDPOINT", "KVTIER_S3_BUCKET")
        m = kvtier.S3LookupManager(bucket=bucket, endpoint=endpoint, force_path_style=True,
                                   prefix=unique_prefix().replace(":", "/"), tier_name="x")
    try:
        m.store(key(1), b"x")
        assert resolve(m, key(1), ReqContext("r")) is True
        assert m.load(key(1)) == b"x"
        m.remove(key(1))
        started = kvtier_threads() - before
        assert set(started) == {"kvtier-lookup-x"}, started
    finally:
        m.shutdown()
    wait_for(lambda: "kvtier-lookup-x" not in kvtier_threads() - before,
             "the runtime's threads to stop after shutdown")


def test_shutdown_unlocks_the_disk_directory(tmp_path):
    m = disk(tmp_path)
    m.store(key(1), b"kept")
    m.shutdown()
    again = disk(tmp_path)  # the same directory, in the same process
    try:
        assert again.load(key(1)) == b"kept"
    finally:
        again.shutdown()
    del m


ERROR_CLASSES = {
    # class name: (kind, built-in exception it also is, if any)
    "TierConnectionError": ("unavailable", ConnectionError),
    "TierTimeoutError": ("timeout", TimeoutError),
    "TierThrottledError": ("throttled", None),
    "TierConfigError": ("config", None),
    "TierInvalidInputError": ("invalid_input", ValueError),
    "TierDataError": ("corrupt", None),
    "TierPermissionError": ("permission_denied", PermissionError),
}


def test_each_error_kind_has_a_tier_error_subclass_exported_by_kvtier():
    for name, (_, builtin) in ERROR_CLASSES.items():
        cls = getattr(kvtier, name)
        assert name in kvtier.__all__
        assert issubclass(cls, kvtier.TierError) and issubclass(cls, kvtier.KvtierError)
        assert cls.__module__ == "kvtier" and cls.__doc__
        if builtin is not None:
            assert issubclass(cls, builtin)


def expect_tier_error(call, cls_name):
    cls = getattr(kvtier, cls_name)
    with pytest.raises(cls) as err:
        call()
    assert err.value.kind == ERROR_CLASSES[cls_name][0]
    return err.value


def test_a_failed_store_raises_the_subclass_of_its_kind(tmp_path):
    (url,) = require_env("KVTIER_REDIS_URL")
    endpoint, bucket = require_env("KVTIER_S3_ENDPOINT", "KVTIER_S3_BUCKET")
    unreachable = kvtier.RedisLookupManager(url=f"redis://127.0.0.1:{free_port()}/",
                                            connect_timeout_ms=200, response_timeout_ms=200,
                                            check=False)
    refused = kvtier.RedisLookupManager(url=url, username="nobody", password="wrong", check=False)
    no_bucket = kvtier.S3LookupManager(bucket="kvtier-no-such-bucket", endpoint=endpoint,
                                       force_path_style=True, max_attempts=1, check=False)
    local = kvtier.DiskLookupManager(path=tmp_path / "small", fsync="never", segment_bytes=4096,
                                     capacity_bytes=8192)
    try:
        e = expect_tier_error(lambda: unreachable.store(key(1), b"x"), "TierConnectionError")
        assert isinstance(e, ConnectionError) and "redis store" in str(e)
        expect_tier_error(lambda: refused.load(key(1)), "TierConfigError")
        expect_tier_error(lambda: no_bucket.store(key(1), b"x"), "TierConfigError")
        # A block too big for a segment: the tier refuses the input.
        e = expect_tier_error(lambda: local.store(key(1), bytes(8192)), "TierInvalidInputError")
        assert isinstance(e, ValueError)
    finally:
        for m in (unreachable, refused, no_bucket, local):
            m.shutdown()


def test_a_redis_user_denied_a_command_gets_a_permission_error():
    (url,) = require_env("KVTIER_REDIS_URL")
    import redis

    admin = redis.Redis.from_url(url)
    user = f"kvtier-noperm-{os.getpid()}"
    # Allowed to connect and to do everything but GET and EXISTS.
    admin.execute_command("ACL", "SETUSER", user, "on", ">noperm-pass", "~*", "+@all", "-get", "-exists")
    m = kvtier.RedisLookupManager(url=url, username=user, password="noperm-pass",
                                  key_prefix=unique_prefix())
    try:
        e = expect_tier_error(lambda: m.load(key(1)), "TierPermissionError")
        assert isinstance(e, PermissionError) and "noperm-pass" not in str(e)
    finally:
        m.shutdown()
        admin.execute_command("ACL", "DELUSER", user)
