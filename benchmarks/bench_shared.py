#!/usr/bin/env python3
"""Shared locks (C13): 16 readers and one writer on one resource, against the same workload
under an exclusive lock, on Redis and on PostgreSQL, in one run.

    python benchmarks/bench_shared.py [--quick] [--repeats 7]

One asyncio loop and one manager per backend (``AsyncRedisLockManager`` from a URL,
``AsyncSQLLockManager`` on PostgreSQL with ``LISTEN``). A burst is 17 tasks on one
resource, each doing a few lock, work (an ``asyncio.sleep`` of 2 ms, the time a holder
spends on the protected data; on PostgreSQL also 20 ms) and release cycles:

- **shared**: 16 tasks take read leases (``read_lock``), one takes write leases
  (``write_lock``): readers overlap, the writer keeps new readers out while it waits;
- **exclusive**: the same 17 tasks, every one with the exclusive lock (``lock``).

The rate is lock cycles per second over the burst; bursts of the two workloads alternate
(``_harness.ainterleaved``), and the row is the median ratio shared / exclusive. The
writer's own rate is reported beside it: its rate as one of 17 exclusive holders is the
baseline.

On PostgreSQL every acquire and release of a reader is a statement on the resource's row,
as an exclusive one is, so sharing pays only when the work under the lock is long against
a statement: hence the second work length there.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

import _harness
from _harness import Context, Row

from fence._async.redis import AsyncRedisLockManager
from fence._async.sql import AsyncSQLLockManager

GROUP = "shared"
READERS = 16


def _workload(
    manager: Any, resource: str, cycles: int, shared: bool, work: float, writer_times: list[float]
) -> Callable[[], Awaitable[None]]:
    """One burst: 16 readers (or exclusive holders) and one writer, ``cycles`` each."""

    async def reader() -> None:
        for _ in range(cycles):
            if shared:
                async with manager.read_lock(resource, timeout=60):
                    await asyncio.sleep(work)
            else:
                async with manager.lock(resource, timeout=60):
                    await asyncio.sleep(work)

    async def writer() -> None:
        start = time.perf_counter()
        for _ in range(cycles):
            async with manager.write_lock(resource, timeout=60):
                await asyncio.sleep(work)
        writer_times.append(time.perf_counter() - start)

    async def burst() -> None:
        await asyncio.gather(*(reader() for _ in range(READERS)), writer())

    return burst


#: (label, backend, seconds of work under the lock)
CASES = (("Redis", "redis", 0.002), ("PostgreSQL", "postgres", 0.002))
LONG = (("PostgreSQL, 20 ms work", "postgres", 0.02),)


async def _rates(ctx: Context) -> dict[str, tuple[float, dict[str, list[float]]]]:
    cycles = 2
    bursts = ctx.n(4, 1)
    per_burst = (READERS + 1) * cycles
    managers = {
        "redis": AsyncRedisLockManager(ctx.servers.redis.url, ttl=30),
        "postgres": AsyncSQLLockManager(ctx.servers.postgres.url, ttl=30, create_table=True),
    }
    out: dict[str, tuple[float, dict[str, list[float]]]] = {}
    try:
        for label, backend, work in CASES + (LONG if not ctx.quick else ()):
            manager = managers[backend]
            suffix = secrets.token_hex(3)
            writer_shared: list[float] = []
            writer_exclusive: list[float] = []
            shared = _workload(manager, f"rw-{suffix}", cycles, True, work, writer_shared)
            exclusive = _workload(manager, f"x-{suffix}", cycles, False, work, writer_exclusive)
            rates = await _harness.ainterleaved(
                {"shared": shared, "exclusive": exclusive},
                calls=bursts,
                batch=1,
                repeats=ctx.repeats,
                warmup=1,
                per_call=per_burst,
            )
            # The writer's rate per repetition: over the bursts of that repetition (the
            # warm-up burst dropped).
            rates["writer (shared)"] = _per_repetition(writer_shared[1:], bursts, cycles)
            rates["writer (exclusive)"] = _per_repetition(writer_exclusive[1:], bursts, cycles)
            out[label] = (work, rates)
    finally:
        for manager in managers.values():
            await manager.close()
    return out


def _per_repetition(times: list[float], bursts: int, cycles: int) -> list[float]:
    return [
        cycles * len(chunk) / sum(chunk)
        for chunk in (times[i : i + bursts] for i in range(0, len(times), bursts))
        if chunk
    ]


def collect(ctx: Context) -> list[Row]:
    """16 readers + 1 writer under shared locks vs the same under an exclusive lock."""
    found = _harness.run_async(_rates(ctx))
    rows: list[Row] = []
    for label, (work, rates) in found.items():
        shared = f"{label}: 16 readers + 1 writer, shared locks"
        exclusive = f"{label}: the same 17 tasks, one exclusive lock"
        writer = f"{label}: the writer, shared locks"
        writer_base = f"{label}: the writer, one of 17 exclusive holders"
        rows += _harness.rate_rows(
            GROUP,
            {shared: rates["shared"], exclusive: rates["exclusive"]},
            exclusive,
            [shared],
            unit="cycles/s",
            notes={shared: f"every holder works {work * 1000:g} ms under the lock"},
        )
        rows += _harness.rate_rows(
            GROUP,
            {writer: rates["writer (shared)"], writer_base: rates["writer (exclusive)"]},
            writer_base,
            [writer],
            unit="cycles/s",
            notes={writer: "it waits out the reader batch ahead of it, and keeps new readers out"},
        )
    return rows


if __name__ == "__main__":
    raise SystemExit(_harness.standalone(collect, __doc__))
