#!/usr/bin/env python3
"""Fenced UPDATE vs the same plain UPDATE on PostgreSQL, for psycopg and SQLAlchemy Core;
and the cost of the database's judge (C14) alone, measured in the server.

    python benchmarks/bench_sql_guard.py [--quick] [--repeats 7]

Starts its own throwaway PostgreSQL cluster (``tests.servers.PostgresServer``) on loopback,
then for each adapter times single-row UPDATEs, each statement its own transaction
(autocommit), interleaving the variants in batches of 20 so that all of them see the same
machine. Each repetition gives one throughput ratio ``fenced / plain``; the median is
reported (1.0 = no cost; the target is at least 0.95).

Every variant does one round trip per UPDATE. The fenced one adds ``fence <= :t`` to the
WHERE clause and ``fence = set_config('iofence.token', :t, true)`` to the SET list (the
token handed to the judge), and proves the write by the row count (the default, as
``RowGuard(conn, table)`` builds it) or, with ``returning=True``, by ``RETURNING *``,
which also hands back the row. The fenced table carries the database's judge (its
triggers); the plain variants write a twin table without them, as an application without
iofence would. The guard's Python work (token validation, the checks of key and values,
the event check) is included. Baselines:

- ``plain``: the same UPDATE without the fence, as most code sends it;
- ``plain RETURNING *``: the same, handing the row back as the fenced default does (for
  psycopg; it separates the cost of the fence from the cost of returning the row);
- for Core, a plain ``update()`` built on every call, as most code writes it, and one built
  once with bind parameters, as the guard does.

The judge alone (``judge``): a PL/pgSQL loop of one-row ``UPDATE`` statements (in one
transaction, and committing after each), and one ``UPDATE`` of many rows, in the server (no
client, no network), on a table with the triggers and on its twin without, the token set
either way; the difference per row is what the trigger costs.
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

from fence.adapters._pg_statements import JUDGED
from fence.adapters.ddl import trigger_ddl
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
        # The same guard on the twin without triggers, its check marked as done: what the
        # judge costs a guard's write, apart from everything else.
        unjudged = PgRowGuard(conn, "bench_pg_plain")
        JUDGED.setdefault(conn, set()).add((unjudged.statements.judged.qualified, "rows", "fence"))
        token = 1
        nxt = _cycle()

        def plain() -> None:
            i = nxt()
            conn.execute("UPDATE bench_pg_plain SET v = %s WHERE id = %s", (i, i % ROWS))

        def plain_returning() -> None:
            i = nxt()
            with conn.cursor(row_factory=dict_row) as cur:
                cur.execute(
                    "UPDATE bench_pg_plain SET v = %s WHERE id = %s RETURNING *", (i, i % ROWS)
                )
                cur.fetchall()

        def fenced_returning() -> None:
            i = nxt()
            returning.update(i % ROWS, token, {"v": i})

        def fenced_rowcount() -> None:
            i = nxt()
            counting.update(i % ROWS, token, {"v": i})

        def fenced_unjudged() -> None:
            i = nxt()
            unjudged.update(i % ROWS, token, {"v": i})

        rates = _interleave(
            ctx,
            {
                "plain UPDATE": plain,
                "plain UPDATE RETURNING *": plain_returning,
                "fenced, returning=True": fenced_returning,
                "fenced (default: row count)": fenced_rowcount,
                "fenced, a table without the judge": fenced_unjudged,
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
    rows += _harness.rate_rows(
        GROUP,
        rates,
        "fenced, a table without the judge",
        ["fenced (default: row count)"],
        unit="updates/s",
        prefix="psycopg: ",
        notes={
            "fenced (default: row count)": "the judge's share: the same guard on a twin table "
            "without triggers",
        },
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
    # The plain twin writes a table without the judge, through a Table that says its fence
    # column is not one, so the gate passes it as any unfenced table.
    twin = Table(
        "bench_core_plain",
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


def bench_judge(ctx: Context) -> list[Row]:
    """The judge alone, in the server: the same UPDATEs on a table with the triggers and on
    its twin without; one rate per table and repetition, interleaved."""
    count = ctx.n(4000, 400)
    loop = (
        "DO $$ BEGIN PERFORM set_config('iofence.token', '1', true); "
        "FOR i IN 1..{count} LOOP UPDATE {table} SET v = i, fence = 1 "
        "WHERE id = i % {rows} AND fence <= 1; END LOOP; END $$"
    )
    # As a guard writes: one UPDATE per transaction. PL/pgSQL sets up a function's state once
    # per transaction, so the first firing in a transaction costs more than the next ones.
    alone = (
        "DO $$ BEGIN FOR i IN 1..{count} LOOP PERFORM set_config('iofence.token', '1', true); "
        "UPDATE {table} SET v = i, fence = 1 WHERE id = i % {rows} AND fence <= 1; COMMIT; "
        "END LOOP; END $$"
    )
    many = (
        "SELECT set_config('iofence.token', '1', true); "
        "UPDATE {table} SET v = v + 1, fence = 1 WHERE fence <= 1"
    )
    with psycopg.connect(ctx.servers.postgres.conninfo, autocommit=True) as conn:

        def run(statement: str) -> Callable[[], None]:
            def once() -> None:
                with conn.transaction():
                    conn.execute(statement.encode())

            return once

        def run_alone(statement: str) -> Callable[[], None]:
            def once() -> None:
                conn.execute(statement.encode())  # autocommit: the DO block commits

            return once

        rows_many = ctx.n(20, 5)
        variants = {
            "one-row UPDATEs, no triggers": run(
                loop.format(count=count, table="bench_judge_plain", rows=ROWS)
            ),
            "one-row UPDATEs, with the judge": run(
                loop.format(count=count, table="bench_judge", rows=ROWS)
            ),
        }
        alone_variants = {
            "one-row UPDATEs, a transaction each, no triggers": run_alone(
                alone.format(count=count, table="bench_judge_plain", rows=ROWS)
            ),
            "one-row UPDATEs, a transaction each, with the judge": run_alone(
                alone.format(count=count, table="bench_judge", rows=ROWS)
            ),
        }
        rates = _harness.interleaved(
            variants, calls=ctx.n(10, 2), repeats=ctx.repeats, warmup=1, per_call=count
        )
        alone_rates = _harness.interleaved(
            alone_variants, calls=ctx.n(10, 2), repeats=ctx.repeats, warmup=1, per_call=count
        )
        many_rates = _harness.interleaved(
            {
                "an UPDATE of every row, no triggers": run(many.format(table="bench_judge_plain")),
                "an UPDATE of every row, with the judge": run(many.format(table="bench_judge")),
            },
            calls=rows_many,
            repeats=ctx.repeats,
            warmup=2,
            per_call=ROWS,
        )
    rows = _harness.rate_rows(
        GROUP,
        rates,
        "one-row UPDATEs, no triggers",
        unit="rows/s",
        prefix="judge, in the server: ",
        notes={
            "one-row UPDATEs, with the judge": "a PL/pgSQL loop of one-row UPDATEs (no client): "
            "the trigger's cost per statement",
        },
    )
    rows += _harness.rate_rows(
        GROUP,
        alone_rates,
        "one-row UPDATEs, a transaction each, no triggers",
        unit="rows/s",
        prefix="judge, in the server: ",
        notes={
            "one-row UPDATEs, a transaction each, with the judge": "the same loop committing "
            "after each UPDATE, as a guard writes: the trigger's cost per transaction",
        },
    )
    rows += _harness.rate_rows(
        GROUP,
        many_rates,
        "an UPDATE of every row, no triggers",
        unit="rows/s",
        prefix="judge, in the server: ",
        notes={
            "an UPDATE of every row, with the judge": f"one UPDATE of {ROWS} rows: the "
            "trigger's cost per row",
        },
    )
    return rows


def create_tables(
    conninfo: str,
    names: tuple[str, ...] = ("bench_pg", "bench_core", "bench_judge"),
    plain: tuple[str, ...] = ("bench_pg_plain", "bench_core_plain", "bench_judge_plain"),
) -> None:
    """(Re)create the benchmark tables with :data:`ROWS` rows each: ``names`` with the
    database's judge (its triggers), ``plain`` without."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        for name in (*names, *plain):
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
            if name in names:
                with conn.transaction():
                    for statement in trigger_ddl(name):
                        conn.execute(statement.encode())


def collect(ctx: Context) -> list[Row]:
    """Both adapters and the judge alone; see the module docstring."""
    create_tables(ctx.servers.postgres.conninfo)
    return [*bench_psycopg(ctx), *bench_core(ctx), *bench_judge(ctx)]


if __name__ == "__main__":
    raise SystemExit(_harness.standalone(collect, __doc__))
