#!/usr/bin/env python3
"""The quorum lock manager against the single-node Redis manager and pottery's Redlock.

    python benchmarks/bench_quorum.py [--quick] [--repeats 7]

Starts three throwaway ``redis-server`` nodes on loopback and measures, in one run,
uncontended acquire+release pairs per second (one process, one resource), interleaved in
batches:

- ``iofence quorum``: :class:`fence.QuorumLockManager` (sync) over the three nodes: an
  acquire is two parallel rounds (lock, token commit), a release one;
- ``iofence quorum async``: :class:`fence.AsyncQuorumLockManager`, same rounds on asyncio;
- ``iofence single node``: :class:`fence.RedisLockManager` on the first node: one round trip
  each way, no fault tolerance;
- ``pottery Redlock (3 nodes)``: ``pottery.Redlock`` over the same three nodes: one parallel
  round each way, no fencing token (the baseline).

Round trips per acquire+release: single node 1+1; quorum 2+1, each sent to every node in
parallel; pottery 1+1.
"""

from __future__ import annotations

import asyncio

import _harness
import redis
from _harness import Context, Row
from pottery import Redlock

from fence._async.quorum import AsyncQuorumLockManager
from fence._sync.quorum import QuorumLockManager
from fence._sync.redis import RedisLockManager

GROUP = "quorum"


async def _rates(ctx: Context) -> dict[str, list[float]]:
    urls = [node.url for node in ctx.servers.redis_nodes(3)]
    quorum = QuorumLockManager(urls, ttl=30)
    aquorum = AsyncQuorumLockManager(urls, ttl=30)
    single = RedisLockManager(urls[0], ttl=30)
    masters = [redis.Redis.from_url(url) for url in urls]
    redlock = Redlock(key="bench:pottery-3", masters=masters, auto_release_time=30)
    try:

        async def ours_quorum() -> None:
            quorum.acquire("bench:quorum", timeout=0).release()

        async def ours_quorum_async() -> None:
            lease = await aquorum.acquire("bench:quorum-async", timeout=0)
            await lease.release()

        async def ours_single() -> None:
            single.acquire("bench:single", timeout=0).release()

        async def pottery() -> None:
            if not redlock.acquire(blocking=False):
                raise RuntimeError("pottery Redlock did not take an uncontended lock")
            redlock.release()

        return await _harness.ainterleaved(
            {
                "pottery Redlock (3 nodes)": pottery,
                "iofence quorum (3 nodes)": ours_quorum,
                "iofence quorum async (3 nodes)": ours_quorum_async,
                "iofence single node": ours_single,
            },
            calls=ctx.n(400, 30),
            batch=10,
            repeats=ctx.repeats,
            warmup=ctx.n(50, 5),
        )
    finally:
        quorum.close()
        await aquorum.close()
        single.close()
        for master in masters:
            master.close()


def collect(ctx: Context) -> list[Row]:
    """Quorum, single node and pottery; see the module docstring."""
    rates = asyncio.run(_rates(ctx))
    return _harness.rate_rows(
        GROUP,
        rates,
        "pottery Redlock (3 nodes)",
        unit="pairs/s",
        notes={
            "iofence quorum (3 nodes)": "two parallel rounds per acquire (lock, then token "
            "commit) against pottery's one, which issues no token",
        },
    )


if __name__ == "__main__":
    raise SystemExit(_harness.standalone(collect, __doc__))
