#!/usr/bin/env python3
"""Benchmark the Redis lock manager against redis-py's ``Lock`` and python-redis-lock.

Starts its own throwaway ``redis-server`` on loopback and measures, in one run:

1. Uncontended acquire+release pairs per second (one process, one resource), for the
   fencing manager, redis-py ``Lock`` and python-redis-lock, in interleaved rounds; the
   report gives each library's best round and the ratios.
2. Contended hand-off latency: four processes loop on one lock for a fixed time. A hand-off
   is the lock passing to a *different* process; its latency runs from the moment the
   previous holder starts its release to the moment the next holder has the lease. Reported
   as p50/p99. For the fencing manager with and without FIFO, and for python-redis-lock
   (which also wakes waiters with BLPOP). redis-py's ``Lock`` polls (``sleep=0.1`` by
   default), so its hand-off is measured with ``sleep=0.001``.

    python benchmarks/bench_redis_manager.py [--pairs 2000] [--rounds 5] [--seconds 2]

Needs ``redis-server`` on PATH and ``pip install python-redis-lock`` (dependency group
``bench``). Numbers depend on the machine; only the ratios within one run mean anything.
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import redis  # noqa: E402
import redis_lock  # noqa: E402

from fence._sync.redis import RedisLockManager  # noqa: E402
from tests.servers import RedisServer  # noqa: E402

KINDS = ("iofence", "redis-py Lock", "python-redis-lock")


# -- uncontended --------------------------------------------------------------------------


def pairs_per_second(kind: str, url: str, pairs: int) -> float:
    """Acquire+release pairs per second for one library, one process, one resource."""
    name = f"bench:{kind}"
    if kind == "iofence":
        manager = RedisLockManager(url, ttl=30)
        try:
            start = time.perf_counter()
            for _ in range(pairs):
                lease = manager.acquire(name, timeout=0)
                lease.release()
            return pairs / (time.perf_counter() - start)
        finally:
            manager.close()
    client = redis.Redis.from_url(url)
    try:
        if kind == "redis-py Lock":
            start = time.perf_counter()
            for _ in range(pairs):
                lock = client.lock(name, timeout=30)
                lock.acquire(blocking=False)
                lock.release()
        else:
            start = time.perf_counter()
            for _ in range(pairs):
                lock = redis_lock.Lock(client, name, expire=30)
                lock.acquire(blocking=False)
                lock.release()
        return pairs / (time.perf_counter() - start)
    finally:
        client.close()


# -- contended hand-off -------------------------------------------------------------------


def _worker(kind: str, url: str, seconds: float, start_at: float, queue: Any) -> None:
    """Loop on one lock until ``seconds`` pass; report (acquired_ns, releasing_ns) pairs."""
    name = "bench:handoff"
    held: list[tuple[int, int]] = []
    manager: RedisLockManager | None = None
    client: redis.Redis | None = None
    if kind.startswith("iofence"):
        manager = RedisLockManager(url, ttl=10, fifo=kind.endswith("fifo"))
    else:
        client = redis.Redis.from_url(url)
    while time.monotonic() < start_at:
        time.sleep(0.001)
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            if manager is not None:
                lease = manager.acquire(name, timeout=10)
                got = time.monotonic_ns()
                time.sleep(0.0002)  # a short critical section
                releasing = time.monotonic_ns()
                lease.release()
            else:
                assert client is not None
                if kind == "redis-py Lock":
                    lock: Any = client.lock(name, timeout=10, sleep=0.001)
                    lock.acquire(blocking=True, blocking_timeout=10)
                else:
                    lock = redis_lock.Lock(client, name, expire=10)
                    lock.acquire(blocking=True, timeout=10)
                got = time.monotonic_ns()
                time.sleep(0.0002)
                releasing = time.monotonic_ns()
                lock.release()
            held.append((got, releasing))
            time.sleep(0)  # let the others in
    finally:
        if manager is not None:
            manager.close()
        if client is not None:
            client.close()
    queue.put((os.getpid(), held))


def handoff_latency(kind: str, url: str, seconds: float, procs: int = 4) -> dict[str, float]:
    """Hand-off latencies (ms) between different processes contending for one lock."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    start_at = time.monotonic() + 1.5  # every process connected before the start
    workers = [
        ctx.Process(target=_worker, args=(kind, url, seconds, start_at, queue))
        for _ in range(procs)
    ]
    for worker in workers:
        worker.start()
    results = [queue.get(timeout=seconds + 60) for _ in workers]
    for worker in workers:
        worker.join(30)
    events = sorted((got, releasing, pid) for pid, held in results for got, releasing in held)
    latencies = [
        (nxt[0] - cur[1]) / 1e6 for cur, nxt in itertools.pairwise(events) if nxt[2] != cur[2]
    ]
    if not latencies:
        return {"handoffs": 0, "p50": float("nan"), "p99": float("nan"), "acquisitions": 0}
    latencies.sort()
    return {
        "acquisitions": len(events),
        "handoffs": len(latencies),
        "p50": statistics.median(latencies),
        "p99": latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
    }


def main() -> int:
    """Run both benchmarks and print a report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=2000, help="pairs per uncontended round")
    parser.add_argument("--rounds", type=int, default=5, help="uncontended rounds per library")
    parser.add_argument("--seconds", type=float, default=2.0, help="contended run per library")
    args = parser.parse_args()

    server = RedisServer().start()
    try:
        url = server.url
        for kind in KINDS:  # warm up connections and script caches
            pairs_per_second(kind, url, 200)
        rates: dict[str, list[float]] = {kind: [] for kind in KINDS}
        for _ in range(args.rounds):
            for kind in KINDS:
                rates[kind].append(pairs_per_second(kind, url, args.pairs))
        best = {kind: max(values) for kind, values in rates.items()}
        print(f"redis-server {redis.Redis.from_url(url).info()['redis_version']} on {url}")
        print(f"\nUncontended acquire+release, best of {args.rounds} x {args.pairs} pairs:")
        for kind in KINDS:
            print(f"  {kind:<20} {best[kind]:>9.0f} pairs/s")
        ours = best["iofence"]
        ratio_redis = ours / best["redis-py Lock"]
        ratio_prl = ours / best["python-redis-lock"]
        print(f"  ratio iofence / redis-py Lock      = {ratio_redis:.2f}")
        print(f"  ratio iofence / python-redis-lock  = {ratio_prl:.2f}")

        print(f"\nContended hand-off between 4 processes, {args.seconds:.1f} s each:")
        handoffs = {}
        for kind in ("iofence", "iofence fifo", "python-redis-lock", "redis-py Lock"):
            stats = handoff_latency(kind, url, args.seconds)
            handoffs[kind] = stats
            print(
                f"  {kind:<20} p50 {stats['p50']:6.3f} ms  p99 {stats['p99']:7.3f} ms  "
                f"({stats['handoffs']} hand-offs, {stats['acquisitions']} acquisitions)"
            )

        print("\nTargets:")
        print(f"  uncontended at least as fast as redis-py Lock: {ratio_redis >= 1.0}")
        print(f"  hand-off p50 under 1 ms: {handoffs['iofence']['p50'] < 1.0}")
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
