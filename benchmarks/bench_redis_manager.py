#!/usr/bin/env python3
"""The lock managers against redis-py's ``Lock``, python-redis-lock and pottery's ``Redlock``.

    python benchmarks/bench_redis_manager.py [--quick] [--repeats 7]

Starts its own throwaway ``redis-server`` on loopback and measures, in one run:

1. **Uncontended acquire+release pairs per second** (one process, one resource per
   library), interleaved in batches: the in-memory manager, the Redis manager (plain and
   FIFO), redis-py ``Lock``, python-redis-lock and pottery ``Redlock`` on the same single
   node. The baseline is redis-py ``Lock``.
2. **Contended hand-off**: four processes loop on one lock (hold it 0.2 ms, then 0.2 ms of
   work outside it). A hand-off is the lock passing to a *different* process; its latency
   runs from the moment the previous holder starts its release to the moment the next one
   has the lock. Reported: hand-offs per second, hand-off latency p50/p99, the time a
   caller spends waiting inside ``acquire`` (p99) and how evenly the lock went round
   (acquisitions of the busiest worker over the idlest's), for the Redis manager (plain and
   FIFO), python-redis-lock (the baseline: it also wakes waiters with ``BLPOP``) and redis-py
   ``Lock`` with its default ``sleep=0.1`` polling. The same four worker processes run every
   library in turn, in a rotating order per repetition.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import statistics
import time
from itertools import pairwise
from typing import Any

import _harness
import redis
import redis_lock
from _harness import Context, Row
from pottery import Redlock

from fence import MemoryLockManager
from fence._sync.redis import RedisLockManager

GROUP_PAIRS = "managers"
GROUP_HANDOFF = "handoff"

#: Libraries in the contended run; the first is the baseline.
HANDOFF_KINDS = ("python-redis-lock", "iofence Redis", "iofence Redis FIFO", "redis-py Lock")

#: Time inside the lock and outside it, per iteration of a contending worker.
HOLD = 0.0002
OUTSIDE = 0.0002


# -- uncontended ----------------------------------------------------------------------------


def pair_rates(ctx: Context) -> tuple[dict[str, list[float]], dict[str, dict[str, float]]]:
    """Acquire+release pairs per second of each library, per repetition; and Redis's own
    microseconds per pair, by command, of redis-py ``Lock``, ours and python-redis-lock."""
    url = ctx.servers.redis.url
    client = redis.Redis.from_url(url)
    memory = MemoryLockManager(ttl=30)
    manager = RedisLockManager(url, ttl=30)
    fifo = RedisLockManager(url, ttl=30, fifo=True)
    redlock = Redlock(key="bench:pottery", masters={client}, auto_release_time=30)
    try:

        def ours_memory() -> None:
            memory.acquire("bench:memory", timeout=0).release()

        def ours_redis() -> None:
            manager.acquire("bench:iofence", timeout=0).release()

        def ours_fifo() -> None:
            fifo.acquire("bench:iofence-fifo", timeout=0).release()

        def redis_py() -> None:
            lock = client.lock("bench:redis-py", timeout=30)
            lock.acquire(blocking=False)
            lock.release()

        def python_redis_lock() -> None:
            lock = redis_lock.Lock(client, "bench:python-redis-lock", expire=30)
            lock.acquire(blocking=False)
            lock.release()

        def pottery() -> None:
            if not redlock.acquire(blocking=False):
                raise RuntimeError("pottery Redlock did not take an uncontended lock")
            redlock.release()

        rates = _harness.interleaved(
            {
                "redis-py Lock": redis_py,
                "iofence Redis": ours_redis,
                "iofence Redis FIFO": ours_fifo,
                "iofence memory": ours_memory,
                "python-redis-lock": python_redis_lock,
                "pottery Redlock (1 node)": pottery,
            },
            calls=ctx.n(1000, 60),
            batch=20,
            repeats=ctx.repeats,
            warmup=ctx.n(100, 10),
        )
        calls = ctx.n(2000, 100) // 3
        server = {
            name: _harness.redis_server_usec(client, fn, calls)
            for name, fn in (
                ("redis-py Lock", redis_py),
                ("iofence Redis", ours_redis),
                ("python-redis-lock", python_redis_lock),
            )
        }
        return rates, server
    finally:
        memory.close()
        manager.close()
        fifo.close()
        client.close()


# -- contended hand-off ---------------------------------------------------------------------


def _contend(kind: str, url: str, seconds: float, start_at: float) -> list[tuple[int, int, int]]:
    """Loop on one lock until ``seconds`` pass; return (asked, acquired, releasing) in ns."""
    name = f"bench:handoff:{kind}"
    held: list[tuple[int, int, int]] = []
    manager: RedisLockManager | None = None
    client: redis.Redis | None = None
    if kind.startswith("iofence"):
        manager = RedisLockManager(url, ttl=10, fifo=kind.endswith("FIFO"))
        manager.acquire(f"{name}:warm:{os.getpid()}", timeout=0).release()  # connect, load scripts
    else:
        client = redis.Redis.from_url(url)
        client.ping()
    clock = time.monotonic_ns
    try:
        while time.monotonic() < start_at:
            time.sleep(0.001)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            asked = clock()
            if manager is not None:
                lease = manager.acquire(name, timeout=10)
                got = clock()
                time.sleep(HOLD)
                releasing = clock()
                lease.release()
            else:
                assert client is not None
                lock: Any
                if kind == "redis-py Lock":
                    lock = client.lock(name, timeout=10)  # default sleep=0.1
                    lock.acquire(blocking=True, blocking_timeout=10)
                else:
                    lock = redis_lock.Lock(client, name, expire=10)
                    lock.acquire(blocking=True, timeout=10)
                got = clock()
                time.sleep(HOLD)
                releasing = clock()
                lock.release()
            held.append((asked, got, releasing))
            time.sleep(OUTSIDE)
    finally:
        if manager is not None:
            manager.close()
        if client is not None:
            client.close()
    return held


def handoff_stats(results: list[tuple[int, list[tuple[int, int, int]]]], seconds: float) -> dict:
    """Hand-offs per second, hand-off latency and acquire wait (ms) from the workers' logs."""
    events = sorted(
        (got, releasing, asked, pid) for pid, held in results for asked, got, releasing in held
    )
    latencies = [(nxt[0] - cur[1]) / 1e6 for cur, nxt in pairwise(events) if nxt[3] != cur[3]]
    waits = [(got - asked) / 1e6 for got, _, asked, _ in events]
    shares = [len(held) for _, held in results]
    return {
        "spread": max(shares) / max(min(shares), 1),
        "shares": shares,
        "acquisitions": len(events),
        "handoffs": len(latencies),
        "handoffs_per_s": len(latencies) / seconds,
        "p50_ms": _harness.percentile(latencies, 0.5),
        "p99_ms": _harness.percentile(latencies, 0.99),
        "wait_p50_ms": _harness.percentile(waits, 0.5),
        "wait_p99_ms": _harness.percentile(waits, 0.99),
    }


def _gather(results: Any, workers: list[Any], deadline: float) -> list[Any]:
    """One report per worker; fail at once if a worker died instead of waiting it out."""
    got: list[Any] = []
    while len(got) < len(workers):
        try:
            got.append(results.get(timeout=0.5))
        except queue.Empty:
            dead = [w.exitcode for w in workers if not w.is_alive()]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(
                    f"hand-off workers did not report (exit codes of dead ones: {dead})"
                ) from None
    return got


def handoffs(ctx: Context, procs: int = 4) -> dict[str, list[dict]]:
    """Run every kind ``ctx.repeats`` times with the same ``procs`` worker processes."""
    url = ctx.servers.redis.url
    seconds = ctx.n(1.5, 0.75)
    mp = multiprocessing.get_context("spawn")
    results = mp.Queue()
    commands = [mp.Queue() for _ in range(procs)]
    workers = [
        mp.Process(target=_harness.contend_worker, args=(box, results), daemon=True)
        for box in commands
    ]
    for worker in workers:
        worker.start()
    stats: dict[str, list[dict]] = {kind: [] for kind in HANDOFF_KINDS}
    try:
        repeats = max(1, min(ctx.repeats, ctx.n(5, 1)))
        for rep in range(repeats):
            shift = rep % len(HANDOFF_KINDS)
            for kind in HANDOFF_KINDS[shift:] + HANDOFF_KINDS[:shift]:
                start_at = time.monotonic() + 0.5  # every worker connected before the start
                for box in commands:
                    box.put((_contend, kind, url, seconds, start_at))
                got = _gather(results, workers, deadline=time.monotonic() + seconds + 60)
                failed = [held for _, held in got if isinstance(held, str)]
                if failed:
                    raise RuntimeError(f"a {kind} worker failed: {failed[0]}")
                stats[kind].append(handoff_stats(got, seconds))
    finally:
        for box in commands:
            box.put(None)
        for worker in workers:
            worker.join(10)
            if worker.is_alive():
                worker.kill()
    return stats


def handoff_rows(stats: dict[str, list[dict]]) -> list[Row]:
    """Rate, p50 and p99 rows of every kind against python-redis-lock."""
    base_kind = HANDOFF_KINDS[0]
    base = stats[base_kind]
    rows = []
    for kind in HANDOFF_KINDS[1:]:
        mine = stats[kind]
        for metric, unit, label, higher, target in (
            (
                "handoffs_per_s",
                "hand-offs/s",
                "hand-offs per second",
                True,
                1.0 if kind == "iofence Redis" else None,
            ),
            (
                "p50_ms",
                "ms",
                "hand-off latency p50",
                False,
                1.0 if kind == "iofence Redis" else None,
            ),
            ("p99_ms", "ms", "hand-off latency p99", False, None),
            ("wait_p99_ms", "ms", "wait in acquire p99", False, None),
        ):
            pairs = [(m[metric], b[metric]) for m, b in zip(mine, base, strict=True)]
            # Times: baseline / variant, so that above 1 means faster hand-offs.
            ratios = [m / b if higher else b / m for m, b in pairs if m > 0 and b > 0]
            rows.append(
                Row(
                    group=GROUP_HANDOFF,
                    name=f"{kind}: {label}",
                    baseline=base_kind,
                    ratio=statistics.median(ratios) if ratios else float("nan"),
                    unit=unit,
                    value=statistics.median(m for m, _ in pairs),
                    baseline_value=statistics.median(b for _, b in pairs),
                    target=target,
                    repetitions=len(ratios),
                    extra={"ratios": [round(r, 4) for r in ratios]}
                    | ({"variant": mine, "baseline": base} if metric == "handoffs_per_s" else {}),
                )
            )
    for kind in HANDOFF_KINDS:
        spreads = [m["spread"] for m in stats[kind]]
        rows.append(
            Row(
                group=GROUP_HANDOFF,
                name=f"{kind}: acquisitions, busiest / idlest worker",
                baseline="equal shares",
                ratio=statistics.median(spreads),
                better="lower",
                unit="x",
                value=statistics.median(spreads),
                baseline_value=1.0,
                target=1.10 if kind == "iofence Redis FIFO" else None,
                repetitions=len(spreads),
                extra={"shares": [m["shares"] for m in stats[kind]]},
            )
        )
    return rows


def collect(ctx: Context) -> list[Row]:
    """Uncontended pairs and contended hand-offs; see the module docstring."""
    with _harness.timer(ctx, "uncontended acquire+release"):
        rates, server = pair_rates(ctx)
    rows = _harness.rate_rows(
        GROUP_PAIRS,
        rates,
        "redis-py Lock",
        unit="pairs/s",
        targets={"iofence Redis": 1.0},
        notes={
            "iofence memory": "in-process, no I/O: shows the cost of the manager's own code",
        },
    )
    rows[0].extra["server_usec_per_pair"] = server
    with _harness.timer(ctx, "contended hand-off (4 processes)"):
        rows += handoff_rows(handoffs(ctx))
    return rows


if __name__ == "__main__":
    raise SystemExit(_harness.standalone(collect, __doc__))
