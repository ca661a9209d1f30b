#!/usr/bin/env python3
"""Fenced UPDATE vs the same plain UPDATE on PostgreSQL, for psycopg and SQLAlchemy Core.

    python benchmarks/bench_sql_guard.py [--quick] [--repeats 7]

Starts its own throwaway PostgreSQL cluster (``tests.servers.PostgresServer``) on loopback,
then for each adapter times single-row UPDATEs, each statement its own transaction
(autocommit), interleaving the variants in batches of 20 so that all of them see the same
machine. Each repetition gives one throughput ratio ``fenced / plain``; the median is
reported (1.0 = no cost; the target is at least 0.95).

Every variant does one round trip per UPDATE. The fenced one adds ``fence <= :t`` to the
WHERE clause and ``fence = :t`` to the SET list, and proves the write by the row count
(the default, as ``RowGuard(conn, table)`` builds it) or, with ``returning=True``, by
``RETURNING *``, which also hands back the row. The guard's Python work (token
validation, the checks of key and values, the event check) is included. Baselines:

- ``plain``: the same UPDATE without the fence, as most code sends it;
- ``plain RETURNING *``: the same, handing the row back as the fenced default does (for
  psycopg; it separates the cost of the fence from the cost of returning the row);
- for Core, a plain ``update()`` built on every call, as most code writes it, and one built
  once with bind parameters, as the guard does.
"""

from __future__ import annotations

from collections.abc import Callable

import _harness
import psycopg
from _harness import Context, Row
from psycopg import sql
from psycopg.rows import dict_row
from sqlalchemy import (
    BigInteger,
    Column,
    Integer,
    MetaData,
    Table,
    bindparam,
    create_engine,
    update,
)

from fence.adapters.psycopg import RowGuard as PgRowGuard
from fence.adapters.sql import FENCE_INFO, RowGuard, fence_column

GROUP = "sql-guard"
ROWS = 100


def _cycle() -> Callable[[], int]:
    """0, 1, 2, ...: a fresh row id and value per call."""
    state = [0]

    def step() -> int:
        state[0] += 1
        return state[0]

    return step


def _interleave(ctx: Context, variants: dict[str, Callable[[], None]]) -> dict[str, list[float]]:
    return _harness.interleaved(
        variants,
        calls=ctx.n(1000, 60),
        batch=20,
        repeats=ctx.repeats,
        warmup=ctx.n(100, 10),
    )


def bench_psycopg(ctx: Context) -> list[Row]:
    """psycopg 3: ``conn.execute(UPDATE ...)`` vs :meth:`RowGuard.update`."""
    with psycopg.connect(ctx.servers.postgres.conninfo, autocommit=True) as conn:
        counting = PgRowGuard(conn, "bench_pg")  # the default: the row count
        returning = PgRowGuard(conn, "bench_pg", returning=True)
        token = 1
        nxt = _cycle()

        def plain() -> None:
            i = nxt()
            conn.execute("UPDATE bench_pg SET v = %s WHERE id = %s", (i, i % ROWS))

        def plain_returning() -> None:
            i = nxt()
            with conn.cursor(row_factory=dict_row) as cur:
                cur.execute("UPDATE bench_pg SET v = %s WHERE id = %s RETURNING *", (i, i % ROWS))
                cur.fetchall()

        def fenced_returning() -> None:
            i = nxt()
            returning.update(i % ROWS, token, {"v": i})

        def fenced_rowcount() -> None:
            i = nxt()
            counting.update(i % ROWS, token, {"v": i})

        rates = _interleave(
            ctx,
            {
                "plain UPDATE": plain,
                "plain UPDATE RETURNING *": plain_returning,
                "fenced, returning=True": fenced_returning,
                "fenced (default: row count)": fenced_rowcount,
            },
        )
    rows = _harness.rate_rows(
        GROUP,
        rates,
        "plain UPDATE",
        ["fenced (default: row count)", "fenced, returning=True", "plain UPDATE RETURNING *"],
        unit="updates/s",
        prefix="psycopg: ",
        targets={"fenced (default: row count)": 0.95},
    )
    rows += _harness.rate_rows(
        GROUP,
        rates,
        "plain UPDATE RETURNING *",
        ["fenced, returning=True"],
        unit="updates/s",
        prefix="psycopg: ",
        targets={"fenced, returning=True": 0.95},
    )
    return rows


def bench_core(ctx: Context) -> list[Row]:
    """SQLAlchemy Core: ``conn.execute(update(...))`` vs :meth:`RowGuard.update`."""
    table = Table(
        "bench_core",
        MetaData(),
        Column("id", Integer, primary_key=True),
        Column("v", Integer),
        fence_column(),
    )
    # The plain twin writes the same rows through a Table that says its fence column is
    # not one, so the gate passes it as any unfenced table (no opt-out to merge per call).
    twin = Table(
        "bench_core",
        MetaData(),
        Column("id", Integer, primary_key=True),
        Column("v", Integer),
        Column("fence", BigInteger, info={FENCE_INFO: False}),
    )
    engine = create_engine(ctx.servers.postgres.url, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as conn:
            token = 1
            nxt = _cycle()
            counting = RowGuard(conn, table)  # the default: the row count
            returning = RowGuard(conn, table, returning=True)

            def plain() -> None:
                i = nxt()
                conn.execute(update(twin).where(twin.c.id == i % ROWS).values(v=i))

            # The guard builds each statement shape once; so may a careful plain caller.
            cached = update(twin).where(twin.c.id == bindparam("key")).values(v=bindparam("value"))

            def plain_cached() -> None:
                i = nxt()
                conn.execute(cached, {"key": i % ROWS, "value": i})

            cached_returning = cached.returning(*twin.c)

            def plain_cached_returning() -> None:
                i = nxt()
                conn.execute(cached_returning, {"key": i % ROWS, "value": i}).all()

            def fenced_returning() -> None:
                i = nxt()
                returning.update(i % ROWS, token, {"v": i})

            def fenced_rowcount() -> None:
                i = nxt()
                counting.update(i % ROWS, token, {"v": i})

            rates = _interleave(
                ctx,
                {
                    "plain update()": plain,
                    "plain update(), built once": plain_cached,
                    "plain update().returning(), built once": plain_cached_returning,
                    "fenced, returning=True": fenced_returning,
                    "fenced (default: row count)": fenced_rowcount,
                },
            )
    finally:
        engine.dispose()
    rows = _harness.rate_rows(
        GROUP,
        rates,
        "plain update()",
        ["fenced (default: row count)", "fenced, returning=True"],
        unit="updates/s",
        prefix="Core: ",
    )
    # Like for like: the guard too builds each statement shape once.
    for fenced, base in (
        ("fenced (default: row count)", "plain update(), built once"),
        ("fenced, returning=True", "plain update().returning(), built once"),
    ):
        rows += _harness.rate_rows(
            GROUP,
            rates,
            base,
            [fenced],
            unit="updates/s",
            prefix="Core: ",
            targets={fenced: 0.95},
        )
    return rows


def create_tables(conninfo: str, names: tuple[str, ...] = ("bench_pg", "bench_core")) -> None:
    """(Re)create the benchmark tables with :data:`ROWS` rows each."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        for name in names:
            table = sql.Identifier(name)
            conn.execute(sql.SQL("DROP TABLE IF EXISTS {}").format(table))
            conn.execute(
                sql.SQL(
                    "CREATE TABLE {} (id INT PRIMARY KEY, v INT, fence BIGINT NOT NULL DEFAULT 0)"
                ).format(table)
            )
            conn.execute(
                sql.SQL("INSERT INTO {} (id, v) SELECT g, 0 FROM generate_series(0, %s) g").format(
                    table
                ),
                (ROWS - 1,),
            )


def collect(ctx: Context) -> list[Row]:
    """Both adapters; see the module docstring."""
    create_tables(ctx.servers.postgres.conninfo)
    return [*bench_psycopg(ctx), *bench_core(ctx)]


if __name__ == "__main__":
    raise SystemExit(_harness.standalone(collect, __doc__))
