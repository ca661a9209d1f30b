#!/usr/bin/env python3
"""Acquire + release on the SQL lock manager, against raw SQL and redis-py ``Lock``, in one run.

    python benchmarks/bench_sql_manager.py [--quick] [--repeats 7]

Starts a throwaway PostgreSQL cluster and redis-server on loopback (``tests.servers``), then
times sequential acquire+release pairs on one resource (no contention: this measures the
cost of the calls, not of waiting), interleaved in batches:

- ``SQLLockManager`` and ``AsyncSQLLockManager`` on PostgreSQL (psycopg 3, SQLAlchemy 2);
- ``SQLLockManager`` on a SQLite file, built from its URL (which turns on WAL);
- the floor: two raw single-row UPDATEs through a SQLAlchemy engine with the settings the
  manager gives its own engine (autocommit, no reset on return), since an acquire and a
  release are one statement each; and the same through bare psycopg;
- redis-py ``Lock`` (the baseline of the managers table).

Everything runs in one asyncio loop so that the async manager interleaves with the rest; the
sync variants are plain blocking calls inside it.
"""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path

import _harness
import psycopg
import redis
from _harness import Context, Row
from sqlalchemy import create_engine, text

from fence._async.sql import AsyncSQLLockManager
from fence._sync.sql import SQLLockManager

GROUP = "sql-manager"


async def _rates(ctx: Context, tmp: Path) -> dict[str, list[float]]:
    pg = ctx.servers.postgres
    manager = SQLLockManager(pg.url, ttl=30)
    manager.create_table()
    amanager = AsyncSQLLockManager(pg.url, ttl=30)
    sqlite = SQLLockManager(f"sqlite:///{tmp / 'locks.db'}", ttl=30, create_table=True)
    engine = create_engine(pg.url, isolation_level="AUTOCOMMIT", pool_reset_on_return=None)
    bare = psycopg.connect(pg.conninfo, autocommit=True)
    client = redis.Redis.from_url(ctx.servers.redis.url)
    try:
        with engine.connect() as conn:
            conn.execute(
                text("CREATE TABLE IF NOT EXISTS bench_raw (id int PRIMARY KEY, owner text)")
            )
            conn.execute(text("INSERT INTO bench_raw VALUES (1, NULL) ON CONFLICT DO NOTHING"))
        update = text("UPDATE bench_raw SET owner = :owner WHERE id = 1")

        async def ours_pg() -> None:
            manager.acquire("bench").release()

        async def ours_pg_async() -> None:
            lease = await amanager.acquire("bench-async")
            await lease.release()

        async def ours_sqlite() -> None:
            sqlite.acquire("bench").release()

        async def raw_sqlalchemy() -> None:
            with engine.connect() as conn:
                conn.execute(update, {"owner": "x"})
            with engine.connect() as conn:
                conn.execute(update, {"owner": None})

        async def raw_psycopg() -> None:
            bare.execute("UPDATE bench_raw SET owner = %s WHERE id = 1", ("x",))
            bare.execute("UPDATE bench_raw SET owner = %s WHERE id = 1", (None,))

        async def redis_py() -> None:
            lock = client.lock("bench:redis-py-sql", timeout=30)
            lock.acquire(blocking=False)
            lock.release()

        return await _harness.ainterleaved(
            {
                "raw 2x UPDATE (SQLAlchemy)": raw_sqlalchemy,
                "iofence SQL (PostgreSQL)": ours_pg,
                "iofence SQL async (PostgreSQL)": ours_pg_async,
                "raw 2x UPDATE (psycopg)": raw_psycopg,
                "iofence SQL (SQLite file by URL)": ours_sqlite,
                "redis-py Lock": redis_py,
            },
            calls=ctx.n(400, 30),
            batch=10,
            repeats=ctx.repeats,
            warmup=ctx.n(50, 5),
        )
    finally:
        manager.close()
        await amanager.close()
        sqlite.close()
        engine.dispose()
        bare.close()
        client.close()


def collect(ctx: Context) -> list[Row]:
    """The SQL manager against its floor and against redis-py ``Lock``."""
    with tempfile.TemporaryDirectory() as tmp:
        rates = asyncio.run(_rates(ctx, Path(tmp)))
    floor = "raw 2x UPDATE (SQLAlchemy)"
    rows = _harness.rate_rows(
        GROUP,
        rates,
        floor,
        ["iofence SQL (PostgreSQL)", "iofence SQL async (PostgreSQL)", "raw 2x UPDATE (psycopg)"],
        unit="pairs/s",
        notes={
            "iofence SQL (PostgreSQL)": "an acquire and a release are one statement each; the "
            "floor is two plain UPDATEs through the same kind of engine",
        },
    )
    rows += _harness.rate_rows(
        GROUP,
        rates,
        "redis-py Lock",
        ["iofence SQL (PostgreSQL)", "iofence SQL (SQLite file by URL)"],
        unit="pairs/s",
        targets={"iofence SQL (SQLite file by URL)": 1.0},
    )
    return rows


if __name__ == "__main__":
    raise SystemExit(_harness.standalone(collect, __doc__))
