#!/usr/bin/env python3
"""Benchmark the quorum lock manager against the single-node Redis manager and pottery's
Redlock.

Starts three throwaway ``redis-server`` nodes on loopback and measures, in one run,
uncontended acquire+release pairs per second (one process, one resource) for:

- ``iofence quorum``: :class:`fence.QuorumLockManager` (sync) over the three nodes: an
  acquire is two parallel rounds (lock, token commit), a release one;
- ``iofence quorum async``: :class:`fence.AsyncQuorumLockManager`, same rounds on asyncio;
- ``iofence single``: :class:`fence.RedisLockManager` on the first node: one round trip
  each way, no fault tolerance;
- ``pottery Redlock``: ``pottery.Redlock`` over the same three nodes: one parallel round
  each way, no fencing token.

Rounds are interleaved; the report gives each kind's best round and the ratios.

    python benchmarks/bench_quorum.py [--pairs 1000] [--rounds 5]

Needs ``redis-server`` on PATH and ``pip install pottery`` (dependency group ``bench``).
Numbers depend on the machine; only the ratios within one run mean anything.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import redis  # noqa: E402
from pottery import Redlock  # noqa: E402

from fence._async.quorum import AsyncQuorumLockManager  # noqa: E402
from fence._sync.quorum import QuorumLockManager  # noqa: E402
from fence._sync.redis import RedisLockManager  # noqa: E402
from tests.servers import RedisServer  # noqa: E402

KINDS = ("iofence quorum", "iofence quorum async", "iofence single", "pottery Redlock")


def _quorum(urls: list[str], pairs: int) -> float:
    manager = QuorumLockManager(urls, ttl=30)
    try:
        start = time.perf_counter()
        for _ in range(pairs):
            lease = manager.acquire("bench:quorum", timeout=0)
            lease.release()
        return pairs / (time.perf_counter() - start)
    finally:
        manager.close()


async def _quorum_async(urls: list[str], pairs: int) -> float:
    manager = AsyncQuorumLockManager(urls, ttl=30)
    try:
        start = time.perf_counter()
        for _ in range(pairs):
            lease = await manager.acquire("bench:quorum-async", timeout=0)
            await lease.release()
        return pairs / (time.perf_counter() - start)
    finally:
        await manager.close()


def _single(url: str, pairs: int) -> float:
    manager = RedisLockManager(url, ttl=30)
    try:
        start = time.perf_counter()
        for _ in range(pairs):
            lease = manager.acquire("bench:single", timeout=0)
            lease.release()
        return pairs / (time.perf_counter() - start)
    finally:
        manager.close()


def _pottery(urls: list[str], pairs: int) -> float:
    masters = [redis.Redis.from_url(url) for url in urls]
    try:
        lock = Redlock(key="bench:pottery", masters=masters, auto_release_time=30)
        start = time.perf_counter()
        for _ in range(pairs):
            if not lock.acquire(blocking=False):
                raise RuntimeError("pottery Redlock did not acquire an uncontended lock")
            lock.release()
        return pairs / (time.perf_counter() - start)
    finally:
        for master in masters:
            master.close()


def pairs_per_second(kind: str, urls: list[str], pairs: int) -> float:
    """Acquire+release pairs per second for one kind, one process, one resource."""
    if kind == "iofence quorum":
        return _quorum(urls, pairs)
    if kind == "iofence quorum async":
        return asyncio.run(_quorum_async(urls, pairs))
    if kind == "iofence single":
        return _single(urls[0], pairs)
    return _pottery(urls, pairs)


def main() -> int:
    """Run the benchmark and print a report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=1000, help="pairs per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds per kind")
    args = parser.parse_args()

    servers: list[RedisServer] = []
    try:
        for _ in range(3):
            servers.append(RedisServer().start())
        urls = [server.url for server in servers]
        for kind in KINDS:  # warm up connections and script caches
            pairs_per_second(kind, urls, 100)
        rates: dict[str, list[float]] = {kind: [] for kind in KINDS}
        for _ in range(args.rounds):
            for kind in KINDS:
                rates[kind].append(pairs_per_second(kind, urls, args.pairs))
        best = {kind: max(values) for kind, values in rates.items()}
        client = redis.Redis.from_url(urls[0])
        version = client.info()["redis_version"]
        client.close()
        print(f"redis-server {version}, 3 nodes on 127.0.0.1 ({', '.join(urls)})")
        print(f"\nUncontended acquire+release, best of {args.rounds} x {args.pairs} pairs:")
        for kind in KINDS:
            rate = best[kind]
            print(f"  {kind:<22} {rate:>8.0f} pairs/s  {1e6 / rate:>7.0f} us/pair")
        quorum = best["iofence quorum"]
        print(f"  ratio quorum / single-node manager    = {quorum / best['iofence single']:.2f}")
        print(f"  ratio quorum / pottery Redlock        = {quorum / best['pottery Redlock']:.2f}")
        print(
            "  ratio quorum async / pottery Redlock  = "
            f"{best['iofence quorum async'] / best['pottery Redlock']:.2f}"
        )
        print(
            "\nRound trips per acquire+release: single-node 1+1; quorum 2+1 (lock, token "
            "commit; release), each sent to every node in parallel; pottery 1+1 (no token)."
        )
    finally:
        for server in servers:
            server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
