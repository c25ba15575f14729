#!/usr/bin/env python3
"""The data path from Python: kvtier's job API against a same-run Python
I/O loop over the same rows. One JSON line per workload.

    KVTIER_PY_RELEASE=1 bindings/python/test.sh -q tests/test_jobs.py   # an optimised build
    bindings/python/.venv/bin/python bindings/python/bench_data.py [--dir DIR] [--rounds 3]

Workloads:
  py_data_disk  256 blocks of 2 MiB (512 MiB) stored from the rows of one
                buffer and loaded back into them: kvtier.DiskLookupManager's
                submit_store / submit_load (one job each, waited for with
                drain_jobs) vs a Python loop of os.pwrite / os.preadv into
                one new file per block in the same directory (open, pwrite
                or preadv, close), new files each round as the tier gets new
                keys each round. Neither fsyncs (the disk tier at
                fsync="never"); both read back what the page cache holds.
                GB/s are medians over the rounds, ratio = kvtier / baseline.
                The tier gets capacity_bytes=8 GiB: no eviction in the run.
  py_data_gil   the calling thread's pure-Python speed (a counting loop)
                while a 256 MiB store job runs, against the same loop with no
                job: the copies do not hold the GIL. Median of the trials.
                Control: the same loop while another thread hashes the same
                256 MiB in C without the GIL (hashlib.sha256): the share of
                the speed that sharing the CPUs alone takes.

The reference (vLLM's async_lookup.py) has no data path: nothing to compare.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time

import kvtier

MiB = 1 << 20


def key(i: int) -> bytes:
    return i.to_bytes(32, "big") + (0).to_bytes(4, "big")


def emit(line: dict) -> None:
    print(json.dumps(line), flush=True)


def r3(x: float) -> float:
    return float(f"{x:.3g}")


def wait(m, job: int) -> None:
    """Waits for `job` (the only one running: drain_jobs cancels none) and
    checks its result."""
    m.drain_jobs()
    results = {r.job_id: r for r in m.poll_jobs()}
    res = results[job]
    if not res.ok:
        raise RuntimeError(f"job {job} failed: {res.error}")


def kvtier_round(m, view, n: int, first_key: int) -> tuple[float, float]:
    keys = [key(first_key + i) for i in range(n)]
    rows = list(range(n))
    t0 = time.perf_counter()
    wait(m, m.submit_store(keys, view, rows))
    t1 = time.perf_counter()
    wait(m, m.submit_load(keys, view, rows))
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def baseline_round(directory: str, view, n: int, rnd: int) -> tuple[float, float]:
    # The same rows, as 1-D slices of the same memory (a 2-D memoryview
    # cannot be indexed by row).
    flat = view.cast("B")
    size = len(flat) // n
    rows = [flat[i * size:(i + 1) * size] for i in range(n)]
    # New files each round, as the tier stores new keys each round: files
    # truncated and rewritten would let the kernel drop the previous
    # round's dirty pages unwritten, which the tier, keeping its blocks,
    # cannot do (measured: 0.44 GB/s rewriting, 0.08 writing new files).
    paths = [os.path.join(directory, f"block-{rnd}-{i:05d}") for i in range(n)]
    t0 = time.perf_counter()
    for i, path in enumerate(paths):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.pwrite(fd, rows[i], 0)
        finally:
            os.close(fd)
    t1 = time.perf_counter()
    for i, path in enumerate(paths):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.preadv(fd, [rows[i]], 0)
        finally:
            os.close(fd)
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def bench_disk(root: str, rounds: int, blocks: int, block_bytes: int) -> None:
    view = memoryview(bytearray(os.urandom(MiB)) * (blocks * block_bytes // MiB)).cast(
        "B", (blocks, block_bytes)
    )
    total = blocks * block_bytes
    tier_dir = os.path.join(root, "tier")
    raw_dir = os.path.join(root, "raw")
    os.makedirs(raw_dir)
    m = kvtier.DiskLookupManager(path=tier_dir, fsync="never", capacity_bytes=8 << 30)
    ours: list[tuple[float, float]] = []
    base: list[tuple[float, float]] = []
    try:
        for r in range(rounds):
            # Alternate which goes first: neither always meets a warmer cache.
            if r % 2 == 0:
                ours.append(kvtier_round(m, view, blocks, r * blocks))
                base.append(baseline_round(raw_dir, view, blocks, r))
            else:
                base.append(baseline_round(raw_dir, view, blocks, r))
                ours.append(kvtier_round(m, view, blocks, r * blocks))
    finally:
        m.shutdown()

    def gbps(times: list[float]) -> float:
        return total / statistics.median(times) / 1e9

    store, load = gbps([t[0] for t in ours]), gbps([t[1] for t in ours])
    bstore, bload = gbps([t[0] for t in base]), gbps([t[1] for t in base])
    emit(
        {
            "workload": "py_data_disk",
            "params": {"tier": "disk", "block_bytes": block_bytes, "blocks": blocks, "rounds": rounds},
            "store_gb_per_s": r3(store),
            "load_gb_per_s": r3(load),
            "baseline_store_gb_per_s": r3(bstore),
            "baseline_load_gb_per_s": r3(bload),
            "store_ratio": r3(store / bstore),
            "load_ratio": r3(load / bload),
            "baseline": "python os.pwrite / os.preadv, one new file per block per round, same directory",
        }
    )


def count_for(m, seconds: float | None, job: int | None) -> float:
    """Pure-Python iterations per second: for `seconds`, or until `job` reports."""
    n = 0
    t0 = time.perf_counter()
    while True:
        for _ in range(20_000):
            n += 1
        done = [r for r in m.poll_jobs() if r.job_id == job] if job is not None else []
        elapsed = time.perf_counter() - t0
        if done:
            if not done[0].ok:
                raise RuntimeError(done[0].error)
            return n / elapsed
        if seconds is not None and elapsed >= seconds:
            return n / elapsed


def count_during_thread(seconds: float, work) -> float:
    """Pure-Python iterations per second while `work` runs in a thread."""
    import threading

    th = threading.Thread(target=work)
    n = 0
    t0 = time.perf_counter()
    th.start()
    while th.is_alive():
        for _ in range(20_000):
            n += 1
    return n / (time.perf_counter() - t0)


def bench_gil(root: str, trials: int, block_bytes: int) -> None:
    blocks = 256 * MiB // block_bytes
    view = memoryview(bytearray(os.urandom(MiB)) * (blocks * block_bytes // MiB)).cast(
        "B", (blocks, block_bytes)
    )
    m = kvtier.DiskLookupManager(path=os.path.join(root, "gil"), fsync="never", capacity_bytes=8 << 30)
    idle, busy, store_s, control = [], [], [], []
    import hashlib

    data = view.cast("B")
    try:
        for t in range(trials):
            keys = [key(1_000_000 + t * blocks + i) for i in range(blocks)]
            t0 = time.perf_counter()
            job = m.submit_store(keys, view, list(range(blocks)))
            busy.append(count_for(m, None, job))
            store_s.append(time.perf_counter() - t0)
            idle.append(count_for(m, store_s[-1], None))
            # Control: another thread busy in C without the GIL (sha256 of
            # the same 256 MiB): what sharing the CPUs alone costs.
            control.append(count_during_thread(0, lambda: hashlib.sha256(data).digest()) / idle[-1])
    finally:
        m.shutdown()
    ratio = statistics.median(b / i for b, i in zip(busy, idle))
    emit(
        {
            "workload": "py_data_gil",
            "params": {"tier": "disk", "block_bytes": block_bytes, "store_bytes": blocks * block_bytes, "trials": trials},
            "python_iters_per_s_idle": r3(statistics.median(idle)),
            "python_iters_per_s_during_store": r3(statistics.median(busy)),
            "python_speed_ratio": r3(ratio),
            "control_ratio_c_thread_without_gil": r3(statistics.median(control)),
            "store_seconds": r3(statistics.median(store_s)),
        }
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="where the disk tier and the baseline files go (default: a temporary directory)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--block-bytes", type=int, default=2 * MiB)
    ap.add_argument("--only", choices=["disk", "gil"], default=None)
    args = ap.parse_args()
    root = tempfile.mkdtemp(prefix="kvtier-bench-data-", dir=args.dir)
    try:
        if args.only in (None, "disk"):
            bench_disk(root, args.rounds, args.blocks, args.block_bytes)
        if args.only in (None, "gil"):
            bench_gil(root, max(args.rounds, 5), args.block_bytes)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
