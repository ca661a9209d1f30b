#!/usr/bin/env python3
"""Fenced UPDATE vs the same plain UPDATE on PostgreSQL, for psycopg and SQLAlchemy Core.

Starts its own throwaway PostgreSQL cluster (``tests.servers.PostgresServer``) on loopback,
then for each adapter times single-row UPDATEs, each statement its own transaction
(autocommit), interleaving plain and fenced batches of 100 so that all of them see the same
machine. Reports the median time per UPDATE and the throughput ratio ``plain / fenced``
(1.0 = no cost; the target is at least 0.9).

    python benchmarks/bench_sql_guard.py [--ops 2000] [--rounds 7]

Every variant does one round trip per UPDATE. The fenced one adds ``fence <= :t`` to the
WHERE clause and ``fence = :t`` to the SET list, and proves the write either by
``RETURNING *`` (the default, which also hands back the row) or by the row count
(``returning=False``). The guard's Python work (token validation, the checks of key and
values, the event check) is included. For Core there are two baselines: a plain
``update()`` built on every call, as most code writes it, and one built once with bind
parameters, as the guard does.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psycopg
from psycopg import sql
from sqlalchemy import Column, Integer, MetaData, Table, bindparam, create_engine, update

from fence.adapters.psycopg import RowGuard as PgRowGuard
from fence.adapters.sql import RowGuard, fence_column
from tests.servers import PostgresServer

ROWS = 100


def timed(fn: Callable[[int], None], ops: int) -> float:
    """Seconds per call of ``fn(i)`` over ``ops`` calls."""
    start = time.perf_counter()
    for i in range(ops):
        fn(i)
    return (time.perf_counter() - start) / ops


def compare(
    name: str, variants: dict[str, Callable[[int], None]], ops: int, rounds: int
) -> list[dict[str, Any]]:
    """Time every variant in short interleaved batches; medians and ratios to ``plain``.

    Each round is cut into batches of 100 calls, and every batch runs each variant in a
    rotating order, so load from elsewhere on the machine falls on all of them alike.
    """
    for fn in variants.values():  # warm up: prepared statements, caches
        timed(fn, 200)
    batch = 100
    samples: dict[str, list[float]] = {k: [] for k in variants}
    order = list(variants)
    for n in range(rounds * max(1, ops // batch)):
        shift = n % len(order)
        for key in order[shift:] + order[:shift]:
            samples[key].append(timed(variants[key], batch))
    medians = {key: statistics.median(values) for key, values in samples.items()}
    out = []
    for base in (k for k in variants if k.startswith("plain")):
        for key in (k for k in variants if not k.startswith("plain")):
            out.append(
                {
                    "name": f"{name} {key}",
                    "base": base,
                    "plain_us": medians[base] * 1e6,
                    "fenced_us": medians[key] * 1e6,
                    "ratio": medians[base] / medians[key],
                }
            )
    return out


def bench_psycopg(conninfo: str, ops: int, rounds: int) -> list[dict[str, Any]]:
    """psycopg 3: ``conn.execute(UPDATE ...)`` vs :meth:`RowGuard.update`."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        returning = PgRowGuard(conn, "bench_pg")
        counting = PgRowGuard(conn, "bench_pg", returning=False)
        token = 1

        def plain(i: int) -> None:
            conn.execute("UPDATE bench_pg SET v = %s WHERE id = %s", (i, i % ROWS))

        def fenced_returning(i: int) -> None:
            returning.update(i % ROWS, token, {"v": i})

        def fenced_rowcount(i: int) -> None:
            counting.update(i % ROWS, token, {"v": i})

        variants = {
            "plain": plain,
            "RETURNING *": fenced_returning,
            "row count": fenced_rowcount,
        }
        return compare("psycopg", variants, ops, rounds)


def bench_core(url: str, ops: int, rounds: int) -> list[dict[str, Any]]:
    """SQLAlchemy Core: ``conn.execute(update(...))`` vs :meth:`RowGuard.update`."""
    table = Table(
        "bench_core",
        MetaData(),
        Column("id", Integer, primary_key=True),
        Column("v", Integer),
        fence_column(),
    )
    engine = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            token = 1

            def plain(i: int) -> None:
                conn.execute(update(table).where(table.c.id == i % ROWS).values(v=i))

            # The guard builds each statement shape once; so may a careful plain caller.
            cached = (
                update(table).where(table.c.id == bindparam("key")).values(v=bindparam("value"))
            )

            def plain_cached(i: int) -> None:
                conn.execute(cached, {"key": i % ROWS, "value": i})

            def fenced_returning(i: int) -> None:
                RowGuard(conn, table).update(i % ROWS, token, {"v": i})

            def fenced_rowcount(i: int) -> None:
                RowGuard(conn, table, returning=False).update(i % ROWS, token, {"v": i})

            variants = {
                "plain": plain,
                "plain (statement built once)": plain_cached,
                "RETURNING *": fenced_returning,
                "row count": fenced_rowcount,
            }
            return compare("core", variants, ops, rounds)
    finally:
        engine.dispose()


def main() -> int:
    """Run both comparisons and print a table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=2000, help="UPDATEs per round")
    parser.add_argument("--rounds", type=int, default=7, help="rounds of each (median)")
    args = parser.parse_args()

    server = PostgresServer().start()
    try:
        with psycopg.connect(server.conninfo, autocommit=True) as conn:
            for name in ("bench_pg", "bench_core"):
                table = sql.Identifier(name)
                conn.execute(
                    sql.SQL(
                        "CREATE TABLE {} (id INT PRIMARY KEY, v INT, "
                        "fence BIGINT NOT NULL DEFAULT 0)"
                    ).format(table)
                )
                conn.execute(
                    sql.SQL(
                        "INSERT INTO {} (id, v) SELECT g, 0 FROM generate_series(0, %s) g"
                    ).format(table),
                    (ROWS - 1,),
                )
        results = [
            *bench_psycopg(server.conninfo, args.ops, args.rounds),
            *bench_core(server.url, args.ops, args.rounds),
        ]
    finally:
        server.destroy()

    print(f"single-row UPDATE, autocommit, {args.rounds} rounds x {args.ops} ops, median")
    print(f"{'fenced variant':<20} {'vs plain':<29} {'plain us':>9} {'fenced us':>10} {'ratio':>6}")
    for r in results:
        print(
            f"{r['name']:<20} {r['base']:<29} {r['plain_us']:>9.1f} {r['fenced_us']:>10.1f} "
            f"{r['ratio']:>6.2f}"
        )
    print("ratio = plain time / fenced time (throughput of fenced relative to plain)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
