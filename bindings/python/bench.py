#!/usr/bin/env python3
"""kvtier from Python against vLLM's own Python AsyncLookupManager.

Prints one JSON line per workload, like kvbench; every figure of a line is
measured in the same process and run. Build the extension optimised first,
in a venv that has vLLM (bindings/python/vllm-env.sh makes one):

    source .services/env                                # Redis for py_busy_redis
    KVTIER_PY_VLLM=1 KVTIER_PY_RELEASE=1 bindings/python/test.sh tests/vllm -q
    bindings/python/.venv-vllm/bin/python bindings/python/bench.py

The reference is vLLM's ``vllm.v1.kv_offload.tiering.async_lookup``,
imported from the installed vLLM. Without vLLM, bench.py prints kvtier's
figures alone (no ``baseline_*`` or ``speedup`` fields) and says on stderr
that the comparison needs vLLM.

Workloads:
  py_lookup        ns per lookup() of a resolved key (in-memory subclass, both)
  py_lookup_many   ns per key through lookup_many vs the reference's lookup()
  py_random        50,000 random resolved keys (half present) looked up in a
                   random order, one request: ns per key of lookup() and of
                   one lookup_many call, against the reference's lookup() and
                   a same-run floor, `[k in s for k in keys]` over a set;
                   its `split`: the cost of only reaching each key object in
                   that order (`len(k)`), and lookup() of the same keys in
                   the order they were made (both sides)
  py_step_loop     scheduler us per step: 64 requests x 32 resolved keys
                   (kvtier: lookup_many per request; reference: lookup per key)
  py_busy_redis    20 requests x 256 Redis keys flushed, 100 ms of pure-Python
                   scheduler work, one step: share of keys answered
                   (kvtier.RedisLookupManager vs the reference over a redis-py
                   pipeline)
  py_busy_disk     the same over a disk tier (kvtier.DiskLookupManager vs the
                   reference checking one file per key with os.path.exists)
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import kvtier

REFERENCE = "vllm.v1.kv_offload.tiering.async_lookup"


@dataclass
class ReqContext:
    req_id: str
    kv_transfer_params: dict | None = None


def key(i: int) -> bytes:
    return i.to_bytes(32, "big") + (0).to_bytes(4, "big")


def import_reference():
    """vLLM's async_lookup module, or None (with a line on stderr saying
    so) when vLLM is not installed here."""
    try:
        return importlib.import_module(REFERENCE)
    except ImportError as e:
        print(f"bench.py: no vLLM here ({e}): kvtier's figures alone; the comparison with "
              f"vLLM's AsyncLookupManager needs vLLM installed (bindings/python/vllm-env.sh)",
              file=sys.stderr, flush=True)
        return None


def emit(line: dict) -> None:
    print(json.dumps(line), flush=True)


def r3(x: float) -> float:
    return round(x, 3)


def settle(m, requests, native: bool) -> None:
    """Looks every key up until each has an answer."""
    for ctx, keys in requests:
        for k in keys:
            m.lookup(k, ctx)
    m.flush()
    deadline = time.monotonic() + 10
    while True:
        if all(m.lookup(k, ctx) is not None for ctx, keys in requests for k in keys):
            return
        if time.monotonic() > deadline:
            raise RuntimeError("keys never resolved")
        time.sleep(0.001)
        if not native:
            m.flush()


def make_memory_managers(ref_mod, present):
    """kvtier's in-memory manager and the reference's (None without vLLM)."""
    class KvtierMemory(kvtier.AsyncLookupManager):
        def __init__(self, existing_keys):
            super().__init__(tier_type="memory")
            self.existing_keys = set(existing_keys)

        def batch_lookup(self, keys, req_context):
            return [k in self.existing_keys for k in keys]

    if ref_mod is None:
        return KvtierMemory(present), None

    class ReferenceMemory(ref_mod.AsyncLookupManager):
        def __init__(self, existing_keys):
            super().__init__(tier_type="memory")
            self.existing_keys = set(existing_keys)

        def batch_lookup(self, keys, req_context):
            return [k in self.existing_keys for k in keys]

    return KvtierMemory(present), ReferenceMemory(present)


def with_baseline(line: dict, ours: float, ref: float | None, field: str, speedup) -> dict:
    """`line` with the baseline's figure and the ratio, when there is one."""
    if ref is not None:
        line[field] = r3(ref)
        line["speedup"] = r3(speedup(ours, ref))
    return line


def timed(fns, rounds: int) -> list[list[float]]:
    """Times each of `fns` `rounds` times, interleaved round by round, so a
    change of load on a shared machine weighs on every side alike."""
    out = [[] for _ in fns]
    for _ in range(rounds):
        for fn, times in zip(fns, out):
            t0 = time.perf_counter_ns()
            fn()
            times.append(time.perf_counter_ns() - t0)
    return out


def bench_lookup(ref_mod, rounds: int) -> None:
    n_keys, reps = 32, 2000
    keys = [key(i) for i in range(n_keys)]
    ours, ref = make_memory_managers(ref_mod, keys[::2])
    ctx = ReqContext("r0")
    settle(ours, [(ctx, keys)], True)
    if ref is not None:
        settle(ref, [(ctx, keys)], False)

    def loop(m):
        lookup = m.lookup
        for _ in range(reps):
            for k in keys:
                lookup(k, ctx)

    def many(m):
        lm = m.lookup_many
        for _ in range(reps):
            lm(keys, ctx)

    calls = reps * n_keys
    fns = [lambda: loop(ours), lambda: many(ours)]
    if ref is not None:
        fns.append(lambda: loop(ref))
    times = timed(fns, rounds)
    ns_ours, ns_many = (statistics.median(t) / calls for t in times[:2])
    ns_ref = statistics.median(times[2]) / calls if ref is not None else None
    ours.shutdown()
    if ref is not None:
        ref.shutdown()
    emit(with_baseline({
        "workload": "py_lookup", "tier": "python-memory",
        "params": {"keys": n_keys, "lookups": calls, "key_len": 36, "rounds": rounds,
                   "baseline": "vLLM's AsyncLookupManager.lookup, same in-memory subclass"},
        "ns_per_lookup": r3(ns_ours),
    }, ns_ours, ns_ref, "baseline_ns_per_lookup", lambda o, r: r / o))
    emit(with_baseline({
        "workload": "py_lookup_many", "tier": "python-memory",
        "params": {"keys_per_call": n_keys, "calls": reps, "key_len": 36, "rounds": rounds,
                   "baseline": "vLLM's lookup() per key"},
        "ns_per_key": r3(ns_many),
    }, ns_many, ns_ref, "baseline_ns_per_key", lambda o, r: r / o))


def bench_random(ref_mod, rounds: int, n_keys: int = 50_000) -> None:
    """What a scheduler sees: many distinct resolved keys, spread out, in no
    particular order (not the same few keys again)."""
    import random

    rng = random.Random(28)
    keys = [rng.randbytes(32) + (0).to_bytes(4, "big") for _ in range(n_keys)]
    present = set(keys[::2])
    ours, ref = make_memory_managers(ref_mod, present)
    ctx = ReqContext("r0")
    settle(ours, [(ctx, keys)], True)
    settle(ref, [(ctx, keys)], False)
    order = keys[:]
    rng.shuffle(order)
    floor_set = set(present)

    def loop(m, seq=order):
        lookup = m.lookup
        for k in seq:
            lookup(k, ctx)

    def many():
        ours.lookup_many(order, ctx)

    def floor():
        s = floor_set
        [k in s for k in order]

    def touch():
        # Only reaching each key object in this order (the loop takes a
        # reference to it, a store into its first line): the part of a
        # random lookup that no table layout can save.
        f = len
        for k in order:
            f(k)

    # The answers agree before anything is timed.
    expect = [k in floor_set for k in order]
    if ours.lookup_many(order, ctx) != expect or [ours.lookup(k, ctx) for k in order] != expect:
        raise RuntimeError("py_random: kvtier's answers differ from the set's")
    if [ref.lookup(k, ctx) for k in order] != expect:
        raise RuntimeError("py_random: the reference's answers differ from the set's")
    # Besides the timed sides, where the time goes: the same lookups in
    # the order the keys were made (their objects and the tables' entries
    # then follow each other in memory), and `touch`.
    times = timed([lambda: loop(ours), lambda: loop(ref), many, floor, touch,
                   lambda: loop(ours, keys), lambda: loop(ref, keys)], rounds)
    ns_ours, ns_ref, ns_many, ns_floor, ns_touch, ns_ours_seq, ns_ref_seq = (
        statistics.median(t) / n_keys for t in times)
    ours.shutdown()
    ref.shutdown()
    params = {"keys": n_keys, "present": len(present), "key_len": 36, "rounds": rounds,
              "order": "random", "requests": 1,
              "baseline": "reference AsyncLookupManager.lookup per key, same in-memory subclass",
              "floor": "[k in s for k in keys] over a Python set"}
    emit({
        "workload": "py_random_lookup", "tier": "python-memory", "params": params,
        "ns_per_lookup": r3(ns_ours), "baseline_ns_per_lookup": r3(ns_ref),
        "floor_ns_per_key": r3(ns_floor),
        "speedup": r3(ns_ref / ns_ours), "ratio_vs_floor": r3(ns_ours / ns_floor),
        "split": {"touch_ns_per_key": r3(ns_touch),
                  "in_order_ns_per_lookup": r3(ns_ours_seq),
                  "in_order_baseline_ns_per_lookup": r3(ns_ref_seq)},
    })
    emit({
        "workload": "py_random_lookup_many", "tier": "python-memory",
        "params": {**params, "keys_per_call": n_keys},
        "ns_per_key": r3(ns_many), "baseline_ns_per_key": r3(ns_ref),
        "floor_ns_per_key": r3(ns_floor),
        "speedup": r3(ns_ref / ns_many), "ratio_vs_floor": r3(ns_many / ns_floor),
    })


def bench_step_loop(ref_mod, rounds: int) -> None:
    n_req, n_keys, steps = 64, 32, 50
    requests = [(ReqContext(f"r{r}"), [key(r * n_keys + i) for i in range(n_keys)])
                for r in range(n_req)]
    present = [k for _, keys in requests for k in keys[: n_keys // 2]]
    ours, ref = make_memory_managers(ref_mod, present)
    settle(ours, requests, True)
    if ref is not None:
        settle(ref, requests, False)

    def ours_steps():
        for _ in range(steps):
            for ctx, keys in requests:
                ours.lookup_many(keys, ctx)
            ours.flush()

    def ref_steps():
        for _ in range(steps):
            for ctx, keys in requests:
                for k in keys:
                    ref.lookup(k, ctx)
            ref.flush()

    times = timed([ours_steps] + ([ref_steps] if ref is not None else []), rounds)
    us_ours = statistics.median(times[0]) / steps / 1000
    us_ref = statistics.median(times[1]) / steps / 1000 if ref is not None else None
    ours.shutdown()
    if ref is not None:
        ref.shutdown()
    emit(with_baseline({
        "workload": "py_step_loop", "tier": "python-memory",
        "params": {"requests_per_step": n_req, "keys_per_request": n_keys, "steps": steps,
                   "rounds": rounds, "resolved": True,
                   "ours": "lookup_many per request + flush",
                   "baseline": "vLLM's lookup per key + flush"},
        "scheduler_us_per_step": r3(us_ours),
    }, us_ours, us_ref, "baseline_scheduler_us_per_step", lambda o, r: r / o))


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    n = 0
    while time.perf_counter() < end:
        n += 1


N_REQ, N_KEYS, BUSY_S = 20, 256, 0.1


def busy_trial(make_ours, make_ref, seed: int):
    """One trial each: flush, 100 ms busy, one step; the shares answered."""
    shares = []
    for make in (make_ours, make_ref):
        if make is None:
            shares.append(None)
            continue
        m = make()
        requests = [(ReqContext(f"t{seed}-r{r}"), [key(seed * 1_000_000 + r * N_KEYS + i)
                                                     for i in range(N_KEYS)])
                    for r in range(N_REQ)]
        for ctx, keys in requests:
            for k in keys:
                m.lookup(k, ctx)
        m.flush()
        busy(BUSY_S)
        answered = sum(m.lookup(k, ctx) is not None for ctx, keys in requests for k in keys)
        m.shutdown()
        shares.append(answered / (N_REQ * N_KEYS))
    return shares


def busy_line(workload, tier, trials_ours, trials_ref, baseline):
    line = {
        "workload": workload, "tier": tier,
        "params": {"requests": N_REQ, "keys_per_request": N_KEYS, "busy_ms": BUSY_S * 1000,
                   "trials": len(trials_ours), "baseline": baseline},
        "answered_share_median": r3(statistics.median(trials_ours)),
        "answered_share_min": r3(min(trials_ours)),
        "answered_share_trials": [r3(x) for x in trials_ours],
    }
    if None not in trials_ref:
        line["baseline_answered_share_median"] = r3(statistics.median(trials_ref))
        line["baseline_answered_share_max"] = r3(max(trials_ref))
        line["baseline_answered_share_trials"] = [r3(x) for x in trials_ref]
    emit(line)


def bench_busy_redis(ref_mod, trials: int) -> None:
    url = os.environ.get("KVTIER_REDIS_URL")
    if not url:
        print("py_busy_redis: KVTIER_REDIS_URL unset; skipped", file=sys.stderr)
        return
    import redis

    prefix = f"kvtier-pybench-{uuid.uuid4().hex[:8]}:"
    client = redis.Redis.from_url(url)
    names = [prefix.encode() + key(s * 1_000_000 + j)
             for s in range(trials) for j in range(0, N_REQ * N_KEYS, 2)]
    for i in range(0, len(names), 4096):
        pipe = client.pipeline(transaction=False)
        for n in names[i:i + 4096]:
            pipe.set(n, b"x")
        pipe.execute()

    ReferenceRedis = None
    if ref_mod is not None:
        class ReferenceRedis(ref_mod.AsyncLookupManager):
            def __init__(self):
                super().__init__(tier_type="redis")
                self.client = redis.Redis.from_url(url)

            def batch_lookup(self, keys, req_context):
                pipe = self.client.pipeline(transaction=False)
                for k in keys:
                    pipe.exists(prefix.encode() + k)
                return [bool(n) for n in pipe.execute()]

    ours_t, ref_t = [], []
    for s in range(trials):
        o, r = busy_trial(lambda: kvtier.RedisLookupManager(url=url, key_prefix=prefix),
                          ReferenceRedis, s)
        ours_t.append(o)
        ref_t.append(r)
    for i in range(0, len(names), 4096):
        client.delete(*names[i:i + 4096])
    busy_line("py_busy_redis", "redis", ours_t, ref_t,
              "reference over a redis-py pipeline of EXISTS per request")


def bench_busy_disk(ref_mod, trials: int) -> None:
    root = Path(tempfile.mkdtemp(prefix="kvtier-pybench-disk-"))
    files = root / "files"
    files.mkdir()
    ours_dir = root / "kvtier"
    seeded = kvtier.DiskLookupManager(path=str(ours_dir), fsync="never")
    for s in range(trials):
        for j in range(0, N_REQ * N_KEYS, 2):
            k = key(s * 1_000_000 + j)
            seeded.store(k, b"x")
            (files / k.hex()).write_bytes(b"x")
    seeded.shutdown()
    del seeded

    ReferenceFiles = None
    if ref_mod is not None:
        class ReferenceFiles(ref_mod.AsyncLookupManager):
            def __init__(self):
                super().__init__(tier_type="files")

            def batch_lookup(self, keys, req_context):
                return [os.path.exists(files / k.hex()) for k in keys]

    ours_t, ref_t = [], []
    for s in range(trials):
        o, r = busy_trial(lambda: kvtier.DiskLookupManager(path=str(ours_dir), fsync="never"),
                          ReferenceFiles, s)
        ours_t.append(o)
        ref_t.append(r)
    busy_line("py_busy_disk", "disk", ours_t, ref_t,
              "reference checking one file per key with os.path.exists")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("workloads", nargs="*",
                    default=["py_lookup", "py_random", "py_step_loop", "py_busy_redis",
                             "py_busy_disk"])
    args = ap.parse_args()
    ref_mod = import_reference()
    for w in args.workloads:
        if w in ("py_lookup", "py_lookup_many"):
            bench_lookup(ref_mod, args.rounds)
        elif w in ("py_random", "py_random_lookup", "py_random_lookup_many"):
            bench_random(ref_mod, args.rounds)
        elif w == "py_step_loop":
            bench_step_loop(ref_mod, args.rounds)
        elif w == "py_busy_redis":
            bench_busy_redis(ref_mod, args.trials)
        elif w == "py_busy_disk":
            bench_busy_disk(ref_mod, args.trials)
        else:
            sys.exit(f"bench.py: unknown workload {w}")


if __name__ == "__main__":
    main()
