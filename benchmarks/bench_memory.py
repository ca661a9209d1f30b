#!/usr/bin/env python3
"""Memory after many acquire/release cycles: does it stay flat?

    python benchmarks/bench_memory.py [--quick]

Each manager runs in a fresh interpreter: it does 1,000 acquire+release cycles on one
resource, then keeps going to the full count. After the first 1,000 and at the end it
collects garbage and records the resident set size (``/proc/self/statm``) and the number of
memory blocks Python has allocated (``sys.getallocatedblocks()``). The row's ratio is
``RSS at the end / RSS after 1,000``: 1.0 is flat.

- the in-memory manager: 100,000 cycles;
- the Redis manager: 30,000 cycles (each is two round trips; 100,000 would take about half a
  minute on its own), on the suite's redis-server.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
from pathlib import Path

import _harness
from _harness import Context, Row

GROUP = "memory"
FIRST = 1000


def _rss() -> int:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE")


def child(kind: str, total: int, url: str) -> dict[str, float]:
    """Run in the fresh interpreter: the cycles and the two measurements."""
    from fence import MemoryLockManager
    from fence._sync.redis import RedisLockManager

    manager = MemoryLockManager(ttl=30) if kind == "memory" else RedisLockManager(url, ttl=30)
    try:
        for _ in range(FIRST):
            manager.acquire("bench:memory").release()
        gc.collect()
        first_rss, first_blocks = _rss(), sys.getallocatedblocks()
        for _ in range(total - FIRST):
            manager.acquire("bench:memory").release()
        gc.collect()
        last_rss, last_blocks = _rss(), sys.getallocatedblocks()
    finally:
        manager.close()
    return {
        "cycles": total,
        "rss_first_mib": first_rss / 2**20,
        "rss_last_mib": last_rss / 2**20,
        "blocks_first": first_blocks,
        "blocks_last": last_blocks,
    }


def measure(kind: str, total: int, url: str) -> dict[str, float]:
    """Run :func:`child` in a fresh interpreter and return its figures."""
    out = subprocess.run(
        [sys.executable, __file__, "--child", kind, str(total), url],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def collect(ctx: Context) -> list[Row]:
    """RSS growth of the memory and Redis managers; see the module docstring."""
    rows = []
    for kind, label, total in (
        ("memory", "memory manager", ctx.n(100_000, 3_000)),
        ("redis", "Redis manager", ctx.n(30_000, 2_000)),
    ):
        url = ctx.servers.redis.url if kind == "redis" else ""
        with _harness.timer(ctx, f"memory: {label}, {total} cycles"):
            got = measure(kind, total, url)
        rows.append(
            Row(
                group=GROUP,
                name=f"{label}: RSS after {total:,} cycles",
                baseline=f"RSS after {FIRST:,} cycles",
                ratio=got["rss_last_mib"] / got["rss_first_mib"],
                unit="MiB",
                value=got["rss_last_mib"],
                baseline_value=got["rss_first_mib"],
                better="lower",
                target=1.05,
                extra={
                    **got,
                    "allocated_blocks_growth": got["blocks_last"] - got["blocks_first"],
                },
                note=f"allocated blocks {got['blocks_first']:,} -> {got['blocks_last']:,} "
                "(sys.getallocatedblocks, after gc.collect())",
            )
        )
    return rows


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(child(sys.argv[2], int(sys.argv[3]), sys.argv[4])))
        raise SystemExit(0)
    raise SystemExit(_harness.standalone(collect, __doc__))
