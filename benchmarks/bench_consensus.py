#!/usr/bin/env python3
"""The etcd and ZooKeeper managers against the Redis manager, in one run.

    python benchmarks/bench_consensus.py [--quick] [--repeats 7]

Starts a throwaway redis-server, a 3-member etcd cluster and a 3-server ZooKeeper ensemble
on loopback (``tests.servers``) and measures, interleaved:

1. **Uncontended acquire+release pairs per second** (one process, one resource each): the
   etcd manager (sync and asyncio), the ZooKeeper manager, against ``RedisLockManager``.
   An etcd acquire is a lease grant and one transaction, a release one lease revoke: three
   raft commits, each fsynced by a majority. A ZooKeeper acquire is one read and one
   multi-operation, a release one delete.
2. **Contended hand-off**: four processes loop on one lock (hold it 0.2 ms, then 0.2 ms
   outside it), as in ``bench_redis_manager``: hand-offs per second and the hand-off
   latency (previous holder starts its release -> next holder has the lock), p50 and p99,
   against the Redis manager. A waiter is woken by the watch on its predecessor and takes
   the lock with one request (etcd: a keepalive; ZooKeeper: a write).

The baseline is the Redis manager, not redis-py: these rows say what a consensus-backed
token costs next to the single-node one.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import statistics
import time
from typing import Any

import _harness
from _harness import Context, Row
from bench_redis_manager import HOLD, OUTSIDE, _gather, handoff_stats

from fence._async.etcd import AsyncEtcdLockManager
from fence._sync.etcd import EtcdLockManager
from fence._sync.redis import RedisLockManager
from fence._sync.zookeeper import ZooKeeperLockManager

GROUP_PAIRS = "consensus"
GROUP_HANDOFF = "consensus-handoff"
BASELINE = "iofence Redis"

#: Kinds in the contended run; the first is the baseline.
HANDOFF_KINDS = (BASELINE, "iofence etcd", "iofence ZooKeeper")


def _manager(kind: str, urls: dict[str, str], ttl: float) -> Any:
    if kind == BASELINE:
        return RedisLockManager(urls["redis"], ttl=ttl)
    if kind == "iofence etcd":
        return EtcdLockManager(urls["etcd"] + "/bench/", ttl=ttl)
    return ZooKeeperLockManager(urls["zookeeper"] + "/bench", ttl=ttl)


def _urls(ctx: Context) -> dict[str, str]:
    return {
        "redis": ctx.servers.redis.url,
        "etcd": ctx.servers.etcd.url,
        "zookeeper": ctx.servers.zookeeper.url,
    }


# -- uncontended ----------------------------------------------------------------------------


def pair_rates(ctx: Context) -> dict[str, list[float]]:
    """Acquire+release pairs per second of each manager, per repetition."""
    urls = _urls(ctx)
    redis_manager = _manager(BASELINE, urls, 30)
    etcd = _manager("iofence etcd", urls, 30)
    zookeeper = _manager("iofence ZooKeeper", urls, 30)
    loop = asyncio.new_event_loop()
    aetcd = AsyncEtcdLockManager(urls["etcd"] + "/bench-async/", ttl=30)
    try:

        def ours_redis() -> None:
            redis_manager.acquire("bench:redis", timeout=0).release()

        def ours_etcd() -> None:
            etcd.acquire("bench:etcd", timeout=0).release()

        def ours_etcd_async() -> None:
            async def pair() -> None:
                lease = await aetcd.acquire("bench:etcd", timeout=0)
                await lease.release()

            loop.run_until_complete(pair())

        def ours_zookeeper() -> None:
            zookeeper.acquire("bench:zookeeper", timeout=0).release()

        return _harness.interleaved(
            {
                BASELINE: ours_redis,
                "iofence etcd": ours_etcd,
                "iofence etcd (asyncio)": ours_etcd_async,
                "iofence ZooKeeper": ours_zookeeper,
            },
            calls=ctx.n(300, 20),
            batch=10,
            repeats=ctx.repeats,
            warmup=ctx.n(30, 3),
        )
    finally:
        redis_manager.close()
        etcd.close()
        zookeeper.close()
        loop.run_until_complete(aetcd.close())
        loop.close()


# -- contended hand-off ---------------------------------------------------------------------


def _contend(
    kind: str, urls: dict[str, str], seconds: float, start_at: float
) -> list[tuple[int, int, int]]:
    """Loop on one lock until ``seconds`` pass; return (asked, acquired, releasing) in ns."""
    name = "bench:consensus-handoff"
    manager = _manager(kind, urls, 10)
    held: list[tuple[int, int, int]] = []
    clock = time.monotonic_ns
    try:
        manager.acquire(f"{name}:warm:{os.getpid()}", timeout=0).release()  # connect first
        while time.monotonic() < start_at:
            time.sleep(0.001)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            asked = clock()
            lease = manager.acquire(name, timeout=10)
            got = clock()
            time.sleep(HOLD)
            releasing = clock()
            lease.release()
            held.append((asked, got, releasing))
            time.sleep(OUTSIDE)
    finally:
        manager.close()
    return held


def handoffs(ctx: Context, procs: int = 4) -> dict[str, list[dict[str, Any]]]:
    """Run every kind ``ctx.repeats`` times (at most 5) with the same worker processes."""
    urls = _urls(ctx)
    seconds = ctx.n(2.0, 0.75)
    mp = multiprocessing.get_context("spawn")
    results = mp.Queue()
    commands = [mp.Queue() for _ in range(procs)]
    workers = [
        mp.Process(target=_harness.contend_worker, args=(box, results), daemon=True)
        for box in commands
    ]
    for worker in workers:
        worker.start()
    stats: dict[str, list[dict[str, Any]]] = {kind: [] for kind in HANDOFF_KINDS}
    try:
        repeats = max(1, min(ctx.repeats, ctx.n(5, 1)))
        for rep in range(repeats):
            shift = rep % len(HANDOFF_KINDS)
            for kind in HANDOFF_KINDS[shift:] + HANDOFF_KINDS[:shift]:
                start_at = time.monotonic() + 1.5  # every worker connected before the start
                for box in commands:
                    box.put((_contend, kind, urls, seconds, start_at))
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


def handoff_rows(stats: dict[str, list[dict[str, Any]]]) -> list[Row]:
    """Rate, p50 and p99 rows of each consensus manager against the Redis manager."""
    base = stats[BASELINE]
    rows = []
    for kind in HANDOFF_KINDS[1:]:
        mine = stats[kind]
        for metric, unit, label, higher in (
            ("handoffs_per_s", "hand-offs/s", "hand-offs per second", True),
            ("p50_ms", "ms", "hand-off latency p50", False),
            ("p99_ms", "ms", "hand-off latency p99", False),
        ):
            pairs = [(m[metric], b[metric]) for m, b in zip(mine, base, strict=True)]
            ratios = [m / b if higher else b / m for m, b in pairs if m > 0 and b > 0]
            rows.append(
                Row(
                    group=GROUP_HANDOFF,
                    name=f"{kind}: {label}",
                    baseline=BASELINE,
                    ratio=statistics.median(ratios) if ratios else float("nan"),
                    unit=unit,
                    value=statistics.median(m for m, _ in pairs),
                    baseline_value=statistics.median(b for _, b in pairs),
                    repetitions=len(ratios),
                    extra={"ratios": [round(r, 4) for r in ratios]},
                )
            )
    return rows


def collect(ctx: Context) -> list[Row]:
    """Uncontended pairs and contended hand-offs; see the module docstring."""
    with _harness.timer(ctx, "consensus: uncontended acquire+release"):
        rates = pair_rates(ctx)
    rows = _harness.rate_rows(
        GROUP_PAIRS,
        rates,
        BASELINE,
        unit="pairs/s",
        notes={
            "iofence etcd": "a lease grant and a transaction to acquire, a lease revoke to "
            "release: three raft commits on a 3-member cluster",
            "iofence ZooKeeper": "a read and a multi-operation to acquire, a delete to "
            "release, on a 3-server ensemble",
        },
    )
    with _harness.timer(ctx, "consensus: contended hand-off (4 processes)"):
        rows += handoff_rows(handoffs(ctx))
    return rows


if __name__ == "__main__":
    raise SystemExit(_harness.standalone(collect, __doc__))
