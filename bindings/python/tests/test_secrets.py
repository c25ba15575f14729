"""No secret in a configuration error, a repr or a stats error (issue 25.6).

Malformed Redis URLs (a missing host, three slashes, a bare password, a
forgotten @host), in ``url`` and in ``cluster_urls``, and S3 endpoints that
hold credentials: each is a ``ValueError`` that names the field and what
is accepted, and shows the URL masked (a string without a scheme only by
its length). Uses only the public Python API.
"""

from __future__ import annotations

import socket
import time

import pytest

import kvtier

from conftest import GUARD, ReqContext, key

SECRET = "Sup3rSecretPassw0rd"


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _assert_hidden(*texts: str) -> None:
    for text in texts:
        assert SECRET not in text, text


BAD_REDIS_URLS = [
    (f"redis:/u:{SECRET}@127.0.0.1:1", "redis:/***@127.0.0.1:1"),
    (f"redis:///u:{SECRET}@127.0.0.1:1", "redis:///***@127.0.0.1:1"),
    (SECRET, f"<hidden: {len(SECRET)} characters>"),
    (f"alice:{SECRET}", f"<hidden: {len('alice:' + SECRET)} characters>"),
    (f"redis://alice:{SECRET}", "redis://alice:***"),
]


@pytest.mark.parametrize(("url", "shown"), BAD_REDIS_URLS)
def test_a_malformed_redis_url_is_a_value_error_without_its_secret(url, shown):
    with pytest.raises(ValueError) as err:
        kvtier.RedisLookupManager(url=url)
    message = str(err.value)
    _assert_hidden(message, repr(err.value))
    assert "url" in message, message
    assert shown in message, message
    assert "redis://" in message and "rediss://" in message, message


@pytest.mark.parametrize(("url", "shown"), BAD_REDIS_URLS)
def test_a_malformed_cluster_url_is_a_value_error_without_its_secret(url, shown):
    with pytest.raises(ValueError) as err:
        kvtier.RedisLookupManager(cluster_urls=["redis://127.0.0.1:7000/", url])
    message = str(err.value)
    _assert_hidden(message, repr(err.value))
    assert "cluster_urls" in message, message
    assert shown in message, message


@pytest.mark.parametrize(
    "endpoint",
    [
        f"http://kvtier:{SECRET}@127.0.0.1:1",
        f"https://:{SECRET}@s3.example.com",
        f"http:/kvtier:{SECRET}@127.0.0.1:1",
        SECRET,
    ],
)
def test_an_s3_endpoint_with_a_secret_is_a_value_error_without_it(endpoint):
    with pytest.raises(ValueError) as err:
        kvtier.S3LookupManager(bucket="b", endpoint=endpoint)
    message = str(err.value)
    _assert_hidden(message, repr(err.value))
    assert "endpoint" in message, message


def test_a_working_manager_shows_no_password_in_its_repr_or_its_errors():
    """A URL with a password that parses: the manager builds; its repr,
    and the error its failed lookups leave in stats, never show it."""
    port = _closed_port()
    # Checked when made: the error of the check does not show it either.
    with pytest.raises(kvtier.TierConnectionError) as err:
        kvtier.RedisLookupManager(url=f"redis://alice:{SECRET}@127.0.0.1:{port}/",
                                  connect_timeout_ms=200, response_timeout_ms=200)
    _assert_hidden(str(err.value), repr(err.value))
    manager = kvtier.RedisLookupManager(
        url=f"redis://alice:{SECRET}@127.0.0.1:{port}/",
        connect_timeout_ms=200,
        response_timeout_ms=200,
        check=False,
    )
    try:
        _assert_hidden(repr(manager), str(manager))
        ctx = ReqContext("secrets")
        manager.lookup(key(1), ctx)
        manager.flush()
        start = time.monotonic()
        while manager.stats().get("errors", 0) == 0:
            assert time.monotonic() - start < GUARD, manager.stats()
            manager.lookup(key(1), ctx)
            time.sleep(0.01)
        stats = manager.stats()
        _assert_hidden(repr(stats), str(stats.get("first_error")))
        assert "127.0.0.1" in str(stats.get("first_error")), stats
    finally:
        manager.shutdown()
