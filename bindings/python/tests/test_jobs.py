"""The data path: submit_store / submit_load / poll_jobs / drain_jobs on the
native managers, against the real servers (disk, Redis single, TLS and
cluster, S3)."""

from __future__ import annotations

import gc
import os
import random
import threading
import time

import pytest

import kvtier
from conftest import GUARD, ReqContext, key
# `native`: the same fixture as test_native's, every native manager in turn.
from test_native import disk, native, redis_single  # noqa: F401

MiB = 1 << 20


def rows_view(nrows: int, row_bytes: int, fill: bytes | None = None) -> memoryview:
    """A writable 2-D memoryview of `nrows` rows over a bytearray."""
    buf = bytearray(fill) if fill is not None else bytearray(nrows * row_bytes)
    return memoryview(buf).cast("B", (nrows, row_bytes))


def row(view: memoryview, i: int, count: int = 1) -> bytes:
    """Rows `i .. i + count` of a view made by `rows_view`, as bytes."""
    rb = view.shape[1]
    return bytes(view.obj[i * rb:(i + count) * rb])


def set_row(view: memoryview, i: int, data: bytes) -> None:
    rb = view.shape[1]
    view.obj[i * rb:(i + 1) * rb] = data


def wait_results(m, ids, guard: float = 30.0) -> dict:
    """Polls until every job of `ids` has reported; returns id -> JobResult."""
    want = set(ids)
    got = {}
    start = time.monotonic()
    while not want <= got.keys():
        for r in m.poll_jobs():
            got[r.job_id] = r
        if time.monotonic() - start > guard:
            raise AssertionError(f"jobs {sorted(want - got.keys())} never reported")
        time.sleep(0.001)
    return got


@pytest.mark.parametrize("row_bytes", [2 * MiB, 4099])
def test_round_trip_is_byte_for_byte_and_marks_keys_present(native, row_bytes):
    n = 4
    ctx = ReqContext("r")
    keys = [key(1000 + i) for i in range(n)]
    for k in keys:  # tracked, so the marks are visible
        assert native.lookup(k, ctx) is None
    payload = os.urandom(n * row_bytes)
    src = rows_view(n, row_bytes, payload)
    job = native.submit_store(keys, src, list(range(n)))
    (res,) = wait_results(native, [job]).values()
    assert res.ok, res.error
    assert res.kind == "store"
    assert res.successful_keys == keys
    assert res.bytes == n * row_bytes
    assert res.seconds >= 0 and res.error is None
    # Marked present when poll_jobs returned: a hit with no probe.
    assert [native.lookup(k, ctx) for k in keys] == [True] * n

    # Back into other rows of a larger view, in another order.
    dst = rows_view(n + 2, row_bytes)
    rows = [5, 0, 3, 2]
    job = native.submit_load(keys, dst, rows)
    (res,) = wait_results(native, [job]).values()
    assert res.ok, res.error
    assert res.bytes == n * row_bytes
    for i, r in enumerate(rows):
        assert row(dst, r) == payload[i * row_bytes:(i + 1) * row_bytes], f"key {i}"
    assert row(dst, 1) == bytes(row_bytes), "an untouched row stays zero"
    assert row(dst, 4) == bytes(row_bytes)


def test_a_partial_load_reports_exactly_the_keys_that_succeeded(native):
    row_bytes = 64 * 1024 + 3
    n = 6
    ctx = ReqContext("r")
    keys = [key(2000 + i) for i in range(n)]
    src = rows_view(n, row_bytes, os.urandom(n * row_bytes))
    job = native.submit_store(keys, src, list(range(n)))
    assert wait_results(native, [job])[job].ok
    gone = [keys[1], keys[4]]
    for k in gone:  # behind the job's back
        native.remove(k)
    for k in keys:
        native.lookup(k, ctx)
    dst = rows_view(n, row_bytes)
    job = native.submit_load(keys, dst, list(range(n)))
    res = wait_results(native, [job])[job]
    assert not res.ok
    assert res.successful_keys == [k for k in keys if k not in gone]
    assert res.bytes == (n - 2) * row_bytes
    assert res.error
    for i in (0, 2, 3, 5):
        assert row(dst, i) == row(src, i)
    for i in (1, 4):
        assert row(dst, i) == bytes(row_bytes), "an absent key's row is untouched"
    # A load that found a key absent marks it a miss before poll_jobs returns.
    assert [native.lookup(k, ctx) for k in gone] == [False, False]


def test_a_load_into_rows_of_the_wrong_length_raises_at_submit_on_disk(tmp_path):
    # The disk tier knows each stored block's length from its index: a row
    # shorter (or longer) than the stored block is refused at submit, and
    # nothing of the job runs.
    m = disk(tmp_path)
    try:
        keys = [key(1), key(2)]
        job = m.submit_store(keys, rows_view(2, 100), [0, 1])
        assert wait_results(m, [job])[job].ok
        for row_bytes in (50, 99, 101):
            dst = rows_view(2, row_bytes, b"\xee" * (2 * row_bytes))
            with pytest.raises(
                kvtier.TierInvalidInputError,
                match=f"region 0 is {row_bytes} bytes but the block stored under its key is 100",
            ):
                m.submit_load(keys, dst, [0, 1])
            assert bytes(dst.obj) == b"\xee" * (2 * row_bytes)
        assert m.poll_jobs() == []
        # A key not stored passes the check (its load answers absent).
        dst = rows_view(2, 100)
        job = m.submit_load([key(1), key(3)], dst, [0, 1])
        res = wait_results(m, [job])[job]
        assert res.successful_keys == [key(1)]
    finally:
        m.shutdown()


@pytest.mark.parametrize("native", ["redis", "s3"], indirect=True)
def test_a_load_of_the_wrong_length_fails_that_key_only(native):
    # A remote tier would need a round trip to know a block's length, so
    # the mismatch is found when the job runs: that key fails, its row
    # untouched, and the others load.
    m = native
    keys = [key(1), key(2)]
    job = m.submit_store(keys, rows_view(2, 100), [0, 1])
    assert wait_results(m, [job])[job].ok
    job = m.submit_store([key(3)], rows_view(1, 50), [0])
    assert wait_results(m, [job])[job].ok
    dst = rows_view(3, 100, b"\xee" * 300)
    job = m.submit_load([key(1), key(3), key(2)], dst, [0, 1, 2])
    res = wait_results(m, [job])[job]
    assert res.successful_keys == [key(1), key(2)]
    assert "length" in res.error
    assert row(dst, 1) == b"\xee" * 100, "nothing written into a mismatched row"


def test_numpy_views_and_row_arrays(tmp_path):
    np = pytest.importorskip("numpy")
    m = disk(tmp_path)
    try:
        # A 3-D array: its first dimension indexes blocks.
        src = np.random.default_rng(1).integers(0, 255, (8, 16, 256), dtype=np.uint8)
        keys = [key(i) for i in range(4)]
        job = m.submit_store(keys, src, np.array([7, 1, 2, 3], dtype=np.int64))
        assert wait_results(m, [job])[job].ok
        dst = np.zeros((4, 16 * 256), dtype=np.uint8)
        job = m.submit_load(keys, dst, np.arange(4, dtype=np.int32))
        assert wait_results(m, [job])[job].ok
        assert (dst[0] == src[7].reshape(-1)).all()
        assert (dst[1:] == src[1:4].reshape(3, -1)).all()
        with pytest.raises(ValueError, match="read-only"):
            ro = dst.copy()
            ro.flags.writeable = False
            m.submit_load(keys, ro, [0, 1, 2, 3])
        with pytest.raises(ValueError, match="contiguous"):
            m.submit_store(keys, src[:, ::2], [0, 1, 2, 3])
    finally:
        m.shutdown()


def test_bad_input_raises_at_submit(tmp_path):
    m = disk(tmp_path)
    try:
        keys = [key(1), key(2)]
        view = rows_view(4, 128)
        ro = memoryview(bytes(512)).cast("B", (4, 128))
        with pytest.raises(kvtier.TierInvalidInputError, match="read-only"):
            m.submit_load(keys, ro, [0, 1])
        m.submit_store(keys, ro, [0, 1])  # a store reads only
        with pytest.raises(kvtier.TierInvalidInputError, match="out of range"):
            m.submit_store(keys, view, [0, 4])
        with pytest.raises(ValueError, match="out of range"):
            m.submit_load(keys, view, [-1, 0])
        with pytest.raises(ValueError, match="2 keys but 3 rows"):
            m.submit_store(keys, view, [0, 1, 2])
        with pytest.raises(ValueError, match="contiguous"):
            m.submit_store(keys, memoryview(bytearray(512))[::2], [0, 1])
        with pytest.raises(ValueError, match="overlap"):
            m.submit_load(keys, view, [1, 1])
        with pytest.raises(ValueError, match="integers"):
            m.submit_store(keys, view, [0, 1.5])
        with pytest.raises(TypeError):
            m.submit_store(keys, object(), [0, 1])
        with pytest.raises(TypeError):
            m.submit_store(["not bytes", key(2)], view, [0, 1])
        with pytest.raises(ValueError, match="empty"):
            m.submit_store([b"", key(2)], view, [0, 1])
    finally:
        m.shutdown()
    with pytest.raises(kvtier.ShutDownError):
        m.submit_store([key(1)], rows_view(1, 8), [0])


def test_a_python_tier_has_no_data_path():
    from conftest import InMemoryLookupManager

    m = InMemoryLookupManager()
    try:
        with pytest.raises(TypeError, match="native manager"):
            m.submit_store([key(1)], rows_view(1, 8), [0])
    finally:
        m.shutdown()


def test_the_buffer_may_be_dropped_right_after_submit(tmp_path):
    m = disk(tmp_path)
    try:
        row_bytes, n = 1 * MiB, 16
        payload = os.urandom(n * row_bytes)
        keys = [key(i) for i in range(n)]
        buf = bytearray(payload)
        job = m.submit_store(keys, memoryview(buf).cast("B", (n, row_bytes)), list(range(n)))
        del buf
        gc.collect()
        # Something else takes the freed memory, if it were freed.
        junk = [bytearray(b"\x55" * row_bytes) for _ in range(n)]
        assert wait_results(m, [job])[job].ok
        # A load into a buffer dropped at once writes into memory the job holds.
        buf = bytearray(n * row_bytes)
        job = m.submit_load(keys, memoryview(buf).cast("B", (n, row_bytes)), list(range(n)))
        del buf
        gc.collect()
        junk += [bytearray(b"\xaa" * row_bytes) for _ in range(n)]
        assert wait_results(m, [job])[job].ok
        assert all(j == b"\x55" * row_bytes for j in junk[:n])
        assert all(j == b"\xaa" * row_bytes for j in junk[n:])
        dst = rows_view(n, row_bytes)
        job = m.submit_load(keys, dst, list(range(n)))
        assert wait_results(m, [job])[job].ok
        assert dst.tobytes() == payload
    finally:
        m.shutdown()


def test_a_released_export_frees_the_buffer_for_resizing(tmp_path):
    m = disk(tmp_path)
    try:
        buf = bytearray(4 * 64)
        job = m.submit_store([key(1)], memoryview(buf).cast("B", (4, 64)), [2])
        wait_results(m, [job])
        buf.extend(b"x")  # BufferError while an export is held
    finally:
        m.shutdown()


@pytest.mark.parametrize("kind", ["disk", "redis"])
def test_two_threads_submitting_at_once(tmp_path, kind):
    m = disk(tmp_path) if kind == "disk" else redis_single()
    try:
        row_bytes, n, jobs_each = 32 * 1024 + 1, 8, 6
        results: dict[int, list[int]] = {0: [], 1: []}
        views = {}

        def submit(t: int) -> None:
            view = rows_view(n * jobs_each, row_bytes, os.urandom(n * jobs_each * row_bytes))
            views[t] = view
            for j in range(jobs_each):
                keys = [key(10_000 * (t + 1) + j * n + i) for i in range(n)]
                rows = list(range(j * n, (j + 1) * n))
                results[t].append(m.submit_store(keys, view, rows))

        threads = [threading.Thread(target=submit, args=(t,)) for t in (0, 1)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(GUARD)
        ids = results[0] + results[1]
        assert len(set(ids)) == 2 * jobs_each
        got = wait_results(m, ids)
        assert all(r.ok for r in got.values()), [r.error for r in got.values()]
        for t in (0, 1):
            keys = [key(10_000 * (t + 1) + i) for i in range(n * jobs_each)]
            dst = rows_view(n * jobs_each, row_bytes)
            job = m.submit_load(keys, dst, list(range(n * jobs_each)))
            assert wait_results(m, [job])[job].ok
            assert dst.tobytes() == views[t].tobytes()
    finally:
        m.shutdown()


def test_shutdown_with_jobs_in_flight_returns_within_its_timeout(tmp_path):
    m = kvtier.DiskLookupManager(path=str(tmp_path / "tier"), fsync="never", shutdown_timeout_ms=2000)
    row_bytes, n = 2 * MiB, 32
    view = rows_view(n, row_bytes)
    ids = [m.submit_store([key(100 * j + i) for i in range(n)], view, list(range(n))) for j in range(8)]
    start = time.monotonic()
    m.shutdown()
    elapsed = time.monotonic() - start
    assert elapsed < 2.0 + 1.0, f"shutdown took {elapsed:.2f} s"
    # Every job reports, after shutdown too; those still queued were cancelled.
    got = wait_results(m, ids)
    assert sorted(got) == sorted(ids)
    assert any(not r.ok for r in got.values())


def test_drain_cancels_queued_jobs_and_nothing_writes_afterwards(tmp_path):
    m = disk(tmp_path)
    try:
        row_bytes, n = 1 * MiB, 8
        keys = [key(i) for i in range(n)]
        src = rows_view(n, row_bytes, os.urandom(n * row_bytes))
        job = m.submit_store(keys, src, list(range(n)))
        assert wait_results(m, [job])[job].ok
        # Many loads into disjoint rows of one view, and a canary row last.
        jobs = 24
        canary = bytes(random.Random(7).randbytes(row_bytes))
        dst = rows_view(jobs * n + 1, row_bytes)
        set_row(dst, jobs * n, canary)
        ids = [m.submit_load(keys, dst, list(range(j * n, (j + 1) * n))) for j in range(jobs)]
        assert m.drain_jobs(timeout=30.0) is True
        snapshot = dst.tobytes()
        time.sleep(0.3)
        assert dst.tobytes() == snapshot, "memory written after drain_jobs returned"
        assert row(dst, jobs * n) == canary
        got = {r.job_id: r for r in m.poll_jobs()}
        assert sorted(got) == sorted(ids), "every job has its result after the drain"
        for j, job in enumerate(ids):
            r = got[job]
            rows = row(dst, j * n, n)
            if r.ok:
                assert rows == src.tobytes(), "a finished job is whole"
            else:
                assert "cancel" in r.error.lower()
                assert r.successful_keys == [] and rows == bytes(n * row_bytes), "no copy cut in half"
        assert any(not r.ok for r in got.values()), "some jobs were still queued"
    finally:
        m.shutdown()


def test_drain_jobs_with_nothing_submitted_and_bad_timeouts(tmp_path):
    m = disk(tmp_path)
    try:
        assert m.drain_jobs() is True
        assert m.drain_jobs(0) is True
        assert m.poll_jobs() == []
        with pytest.raises(ValueError):
            m.drain_jobs(-1.0)
    finally:
        m.shutdown()
