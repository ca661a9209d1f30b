#!/usr/bin/env python3
"""Many waiters on one Redis lock in one process: 10,000 asyncio tasks, 1,000 threads.

    python benchmarks/bench_waiters.py [--quick] [--repeats 3]

One manager (``max_connections=3``, so at most four connections with its pub/sub
listener) holds a lock while N waiters queue for it; then the holder releases and every
waiter takes the lock in turn and releases it at once. Measured, per run:

- **wake-up latency**: from the moment one holder starts its release to the moment the
  next holder has its lease (p50, p99), against the same measurement with 10 waiters in
  the same run (ratio = 10 waiters / N waiters, so 1.0 means no slower with N);
- **hand-offs per second** over the whole queue, against 10 waiters likewise;
- **connections**: the most the manager had open at once (``CLIENT LIST``), against
  the limit of 4 (ratio = 4 / used: 1 or more is within it).

Every waiter must get the lock: a waiter that fails makes the run fail.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time

import _harness
import redis
from _harness import Context, Row

from fence._async.redis import AsyncRedisLockManager
from fence._sync.redis import RedisLockManager

GROUP = "waiters"

#: Connections a manager may use: its pool of three and the pub/sub listener.
LIMIT = 4
SMALL = 10


class _Peak:
    """Samples the server's client count in a thread; keeps the highest."""

    def __init__(self, url: str) -> None:
        self._client = redis.Redis.from_url(url)
        self.base = len(self._client.client_list())
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, len(self._client.client_list()) - self.base)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, len(self._client.client_list()) - self.base)
        self._client.close()
        return self.peak


def _stats(events: list[tuple[int, int]], first_release: int, seconds: float) -> dict:
    """Wake-up latencies (ms) from (acquired, releasing) pairs in acquisition order."""
    events.sort()
    latencies = []
    previous = first_release
    for got, releasing in events:
        latencies.append((got - previous) / 1e6)
        previous = releasing
    return {
        "waiters": len(events),
        "p50_ms": _harness.percentile(latencies, 0.5),
        "p99_ms": _harness.percentile(latencies, 0.99),
        "handoffs_per_s": len(events) / seconds,
    }


async def _asyncio_run(url: str, waiters: int, resource: str) -> dict:
    manager = AsyncRedisLockManager(url, ttl=60, max_connections=3, check_config=False)
    peak = _Peak(url)
    clock = time.monotonic_ns
    events: list[tuple[int, int]] = []
    try:
        holder = await manager.acquire(resource)

        async def wait() -> None:
            lease = await manager.acquire(resource, timeout=600)
            got = releasing = clock()
            await lease.release()
            events.append((got, releasing))

        tasks = [asyncio.create_task(wait()) for _ in range(waiters)]
        while manager.driver.board.waiting(resource) < waiters:
            failed = [t for t in tasks if t.done()]
            if failed:
                await failed[0]  # raises the waiter's error
            await asyncio.sleep(0.02)
        start = time.perf_counter()
        first = clock()
        await holder.release()
        await asyncio.gather(*tasks)
        seconds = time.perf_counter() - start
    finally:
        await manager.close()
        used = peak.stop()
    return _stats(events, first, seconds) | {"connections": used}


def _threads_run(url: str, waiters: int, resource: str) -> dict:
    manager = RedisLockManager(url, ttl=60, max_connections=3, check_config=False)
    peak = _Peak(url)
    clock = time.monotonic_ns
    events: list[tuple[int, int]] = []
    errors: list[BaseException] = []
    try:
        holder = manager.acquire(resource)

        def wait() -> None:
            try:
                lease = manager.acquire(resource, timeout=600)
                got = releasing = clock()
                lease.release()
                events.append((got, releasing))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=wait, daemon=True) for _ in range(waiters)]
        for thread in threads:
            thread.start()
        while manager.driver.board.waiting(resource) < waiters and not errors:
            time.sleep(0.02)
        start = time.perf_counter()
        first = clock()
        holder.release()
        for thread in threads:
            thread.join()
        seconds = time.perf_counter() - start
    finally:
        manager.close()
        used = peak.stop()
    if errors:
        raise RuntimeError(f"{len(errors)} of {waiters} threads failed: {errors[0]!r}")
    return _stats(events, first, seconds) | {"connections": used}


def _rows(kind: str, big: int, runs: list[tuple[dict, dict]]) -> list[Row]:
    rows = []
    label = f"{big:,} {kind} waiters"
    for metric, unit, what, higher in (
        ("p50_ms", "ms", "wake-up latency p50", False),
        ("p99_ms", "ms", "wake-up latency p99", False),
        ("handoffs_per_s", "hand-offs/s", "hand-offs per second", True),
    ):
        pairs = [(b[metric], s[metric]) for b, s in runs]
        ratios = [m / s if higher else s / m for m, s in pairs if m > 0 and s > 0]
        rows.append(
            Row(
                group=GROUP,
                name=f"{label}: {what}",
                baseline=f"{SMALL} {kind} waiters",
                ratio=statistics.median(ratios),
                unit=unit,
                value=statistics.median(m for m, _ in pairs),
                baseline_value=statistics.median(s for _, s in pairs),
                repetitions=len(ratios),
                extra={"ratios": [round(r, 4) for r in ratios]},
            )
        )
    used = max(b["connections"] for b, _ in runs)
    rows.append(
        Row(
            group=GROUP,
            name=f"{label}: connections used",
            baseline=f"the limit of {LIMIT}",
            ratio=LIMIT / max(used, 1),
            unit="connections",
            value=used,
            baseline_value=LIMIT,
            target=1.0,
            repetitions=len(runs),
            note="ratio = limit / most connections open at once (pool of 3 + pub/sub)",
        )
    )
    return rows


def collect(ctx: Context) -> list[Row]:
    """Wake-ups of 10,000 asyncio waiters and 1,000 threads; see the module docstring."""
    url = ctx.servers.redis.url
    repeats = max(1, min(ctx.repeats, ctx.n(3, 1)))
    tasks, threads = ctx.n(10_000, 300), ctx.n(1_000, 50)
    rows: list[Row] = []
    with _harness.timer(ctx, f"{tasks} asyncio waiters"):
        runs: list[tuple[dict, dict]] = []
        for rep in range(repeats):
            big = asyncio.run(_asyncio_run(url, tasks, f"bench:waiters:a{rep}"))
            small = asyncio.run(_asyncio_run(url, SMALL, f"bench:waiters:as{rep}"))
            runs.append((big, small))
        rows += _rows("asyncio", tasks, runs)
    with _harness.timer(ctx, f"{threads} thread waiters"):
        runs = []
        for rep in range(repeats):
            big = _threads_run(url, threads, f"bench:waiters:t{rep}")
            small = _threads_run(url, SMALL, f"bench:waiters:ts{rep}")
            runs.append((big, small))
        rows += _rows("thread", threads, runs)
    return rows


if __name__ == "__main__":
    raise SystemExit(_harness.standalone(collect, __doc__))
