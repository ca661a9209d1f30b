#!/usr/bin/env python3
"""Acquire + release on the SQL lock manager, against raw SQL and Redis, in one run.

Starts a throwaway PostgreSQL cluster and redis-server on loopback (tests.servers), then
times sequential acquire+release pairs on one resource (no contention: this measures the
cost of the calls, not of waiting):

- SQLLockManager and AsyncSQLLockManager on PostgreSQL (psycopg 3, SQLAlchemy 2);
- SQLLockManager on a SQLite file;
- the floor: two raw single-row UPDATEs through the same SQLAlchemy engine in autocommit
  (an acquire and a release are one statement each), and the same through bare psycopg;
- RedisLockManager, and raw redis-py ``SET NX PX`` + a Lua compare-and-delete.

    python benchmarks/bench_sql_manager.py [--rounds 2000]

Ratios are taken within this run; absolute numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402
import redis  # noqa: E402
from sqlalchemy import create_engine, event, text  # noqa: E402

from fence._async.sql import AsyncSQLLockManager  # noqa: E402
from fence._sync.sql import SQLLockManager  # noqa: E402
from tests.servers import PostgresServer, RedisServer  # noqa: E402

_UNLOCK = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


#: Each measurement runs this many times and keeps the best: the machine may be shared.
REPEATS = 3


def timed(fn: Callable[[], None], rounds: int) -> float:
    """Microseconds per call of ``fn``: best of :data:`REPEATS` runs, after a warm-up."""
    for _ in range(min(200, rounds // 5)):
        fn()
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        for _ in range(rounds):
            fn()
        best = min(best, time.perf_counter() - start)
    return best / rounds * 1e6


async def timed_async(fn: Callable[[], Awaitable[None]], rounds: int) -> float:
    """The asyncio twin of :func:`timed`."""
    for _ in range(min(200, rounds // 5)):
        await fn()
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        for _ in range(rounds):
            await fn()
        best = min(best, time.perf_counter() - start)
    return best / rounds * 1e6


def bench_postgres(server: PostgresServer, rounds: int) -> dict[str, float]:
    results: dict[str, float] = {}
    manager = SQLLockManager(server.url, ttl=30)
    manager.create_table()

    def pair() -> None:
        manager.acquire("bench").release()

    results["SQLLockManager, PostgreSQL"] = timed(pair, rounds)
    manager.close()

    async def run_async() -> float:
        amanager = AsyncSQLLockManager(server.url, ttl=30)

        async def apair() -> None:
            lease = await amanager.acquire("bench-async")
            await lease.release()

        try:
            return await timed_async(apair, rounds)
        finally:
            await amanager.close()

    results["AsyncSQLLockManager, PostgreSQL"] = asyncio.run(run_async())

    # The same engine settings the manager uses for an engine it creates.
    engine = create_engine(server.url, isolation_level="AUTOCOMMIT", pool_reset_on_return=None)
    with engine.connect() as conn:
        conn.execute(text("CREATE TABLE IF NOT EXISTS bench_raw (id int PRIMARY KEY, owner text)"))
        conn.execute(text("INSERT INTO bench_raw VALUES (1, NULL) ON CONFLICT DO NOTHING"))
    update = text("UPDATE bench_raw SET owner = :owner WHERE id = 1")

    def raw_pair() -> None:
        with engine.connect() as conn:
            conn.execute(update, {"owner": "x"})
        with engine.connect() as conn:
            conn.execute(update, {"owner": None})

    results["raw 2x UPDATE, SQLAlchemy engine"] = timed(raw_pair, rounds)
    engine.dispose()

    with psycopg.connect(server.conninfo, autocommit=True) as conn:

        def bare_pair() -> None:
            conn.execute("UPDATE bench_raw SET owner = %s WHERE id = 1", ("x",))
            conn.execute("UPDATE bench_raw SET owner = %s WHERE id = 1", (None,))

        results["raw 2x UPDATE, bare psycopg"] = timed(bare_pair, rounds)
    return results


def bench_sqlite(rounds: int) -> dict[str, float]:
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, wal in (("rollback journal", False), ("WAL, synchronous=NORMAL", True)):
            engine = create_engine(
                f"sqlite:///{tmp}/locks-{int(wal)}.db",
                isolation_level="AUTOCOMMIT",
                pool_reset_on_return=None,
            )
            if wal:

                @event.listens_for(engine, "connect")
                def pragmas(dbapi_connection: Any, record: Any) -> None:
                    dbapi_connection.execute("PRAGMA journal_mode=WAL")
                    dbapi_connection.execute("PRAGMA synchronous=NORMAL")

            manager = SQLLockManager(engine, ttl=30, create_table=True, autocommit=True)

            def pair(manager: SQLLockManager = manager) -> None:
                manager.acquire("bench").release()

            try:
                results[f"SQLLockManager, SQLite {label}"] = timed(pair, rounds)
            finally:
                manager.close()
                engine.dispose()
    return results


def bench_redis(server: RedisServer, rounds: int) -> dict[str, float]:
    results: dict[str, float] = {}
    try:
        from fence._sync.redis import RedisLockManager
    except ImportError:  # pragma: no cover - the Redis manager is optional here
        RedisLockManager = None  # type: ignore[assignment,misc]
    if RedisLockManager is not None:
        manager: Any = RedisLockManager(server.url, ttl=30)

        def pair() -> None:
            manager.acquire("bench").release()

        results["RedisLockManager"] = timed(pair, rounds)
        manager.close()

    client = redis.Redis.from_url(server.url)
    unlock = client.register_script(_UNLOCK)

    def raw_pair() -> None:
        secret = secrets.token_hex(8)
        client.set("raw:bench", secret, nx=True, px=30_000)
        unlock(keys=["raw:bench"], args=[secret])

    results["raw redis-py SET NX PX + Lua DEL"] = timed(raw_pair, rounds)
    client.close()
    return results


def main() -> int:
    """Run every measurement and print one table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2000, help="acquire+release pairs each")
    args = parser.parse_args()
    rounds = max(50, args.rounds)

    pg = PostgresServer().start()
    rs = RedisServer().start()
    try:
        results = {}
        results.update(bench_postgres(pg, rounds))
        results.update(bench_sqlite(rounds))
        results.update(bench_redis(rs, rounds))
    finally:
        rs.stop()
        pg.destroy()

    floor = results["raw 2x UPDATE, SQLAlchemy engine"]
    print(f"acquire + release, {rounds} sequential pairs each, loopback, one run\n")
    print(f"{'what':<48} {'us/pair':>9} {'pairs/s':>9} {'vs raw 2x UPDATE (SA)':>22}")
    for name, micros in results.items():
        print(f"{name:<48} {micros:>9.0f} {1e6 / micros:>9.0f} {micros / floor:>21.2f}x")
    if "RedisLockManager" in results:
        ratio = results["SQLLockManager, PostgreSQL"] / results["RedisLockManager"]
        print(f"\nSQLLockManager (PostgreSQL) / RedisLockManager: {ratio:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
