#!/usr/bin/env python3
"""Fenced batches (``upsert_many``, ``update_many``) vs the same plain batch, per guard.

    python benchmarks/bench_sql_batch.py [--quick] [--repeats 7]

Starts its own throwaway PostgreSQL cluster (``tests.servers.PostgresServer``) on loopback;
SQLite runs in memory. For each guard (psycopg, Core on PostgreSQL, Core on SQLite) and
each batch size it times one batch per transaction, interleaving the variants so that all
of them see the same machine. Each repetition gives one throughput ratio ``fenced / plain``;
the median is reported (1.0 = no cost).

The rows are rewritten in place (the same keys every batch, token 1, so every fenced batch
is accepted). Baselines, written as most code writes them:

- ``plain upsert``: one multi-row ``INSERT ... ON CONFLICT (id) DO UPDATE``;
- ``plain update``: the single-row ``UPDATE`` sent with ``executemany``.

The fenced variants check every fence before they write (C6) and prove the count. The
psycopg rows include one with a new guard per batch: such a guard first reads the column
types from the catalogue (one more round trip), which a guard kept across batches reads once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import _harness
import psycopg
from _harness import Context, Row
from psycopg import sql
from sqlalchemy import (
    BigInteger,
    Column,
    Engine,
    Integer,
    MetaData,
    Table,
    bindparam,
    create_engine,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite

from fence.adapters.ddl import trigger_ddl
from fence.adapters.psycopg import RowGuard as PgRowGuard
from fence.adapters.sql import FENCE_INFO, RowGuard, fence_column

GROUP = "sql-batch"
SIZES = (10, 500)
TABLE = "bench_batch"
#: The plain batches' twin of :data:`TABLE`, without the database's judge (its triggers).
PLAIN_TABLE = "bench_batch_plain"


def _interleave(
    ctx: Context, size: int, variants: dict[str, Callable[[], None]]
) -> dict[str, list[float]]:
    calls = max(2, ctx.n(10000, 200) // size)
    return _harness.interleaved(
        variants,
        calls=calls,
        batch=max(1, calls // 10),
        repeats=ctx.repeats,
        warmup=max(2, calls // 10),
        per_call=size,
    )


def _rows(rates: dict[str, list[float]], prefix: str, size: int, names: list[str]) -> list[Row]:
    out = []
    for base, fenced in zip(names[::2], names[1::2], strict=True):
        out += _harness.rate_rows(
            GROUP, rates, base, [fenced], unit="rows/s", prefix=f"{prefix}{size} rows: "
        )
    return out


def bench_psycopg(ctx: Context) -> list[Row]:
    """psycopg 3: plain multi-row statements vs :meth:`RowGuard.upsert_many`/``update_many``."""
    rows: list[Row] = []
    with psycopg.connect(ctx.servers.postgres.conninfo) as conn:
        guard = PgRowGuard(conn, TABLE)
        upsert = sql.SQL(
            "INSERT INTO {} (id, v) VALUES {} ON CONFLICT (id) DO UPDATE SET v = excluded.v"
        )
        plain_update = sql.SQL("UPDATE {} SET v = %s WHERE id = %s").format(
            sql.Identifier(PLAIN_TABLE)
        )
        for size in SIZES:
            keys = range(size)
            query = upsert.format(
                sql.Identifier(PLAIN_TABLE), sql.SQL(", ").join([sql.SQL("(%s, %s)")] * size)
            )

            def plain_upsert(query: Any = query, keys: range = keys) -> None:
                conn.execute(query, [v for k in keys for v in (k, k)])
                conn.commit()

            def fenced_upsert(keys: range = keys) -> None:
                guard.upsert_many(1, [{"id": k, "v": k} for k in keys])
                conn.commit()

            def fenced_upsert_new_guard(keys: range = keys) -> None:
                PgRowGuard(conn, TABLE).upsert_many(1, [{"id": k, "v": k} for k in keys])
                conn.commit()

            def plain_many(keys: range = keys) -> None:
                with conn.cursor() as cur:
                    cur.executemany(plain_update, [(k, k) for k in keys])
                conn.commit()

            def fenced_update(keys: range = keys) -> None:
                guard.update_many(1, {k: {"v": k} for k in keys})
                conn.commit()

            variants = {
                "plain upsert": plain_upsert,
                "fenced upsert_many": fenced_upsert,
                "plain update (executemany)": plain_many,
                "fenced update_many": fenced_update,
            }
            if size == SIZES[0]:
                variants["fenced upsert_many, new guard per batch"] = fenced_upsert_new_guard
            rates = _interleave(ctx, size, variants)
            names = list(variants)[:4]
            rows += _rows(rates, "psycopg ", size, names)
            if size == SIZES[0]:
                rows += _harness.rate_rows(
                    GROUP,
                    rates,
                    "plain upsert",
                    ["fenced upsert_many, new guard per batch"],
                    unit="rows/s",
                    prefix=f"psycopg {size} rows: ",
                )
    return rows


def _core(ctx: Context, engine: Engine, label: str, dialect: Any) -> list[Row]:
    table = Table(
        TABLE,
        MetaData(),
        Column("id", Integer, primary_key=True, autoincrement=False),
        Column("v", Integer),
        fence_column(),
    )
    # The plain twin writes a table without the judge, through a Table that says its fence
    # column is not one, so the gate passes it as any unfenced table.
    twin = Table(
        PLAIN_TABLE,
        MetaData(),
        Column("id", Integer, primary_key=True, autoincrement=False),
        Column("v", Integer),
        Column("fence", BigInteger, info={FENCE_INFO: False}),
    )
    rows: list[Row] = []
    with engine.connect() as conn:
        guard = RowGuard(conn, table)
        plain_update = update(twin).where(twin.c.id == bindparam("k")).values(v=bindparam("x"))
        for size in SIZES:
            keys = range(size)

            def plain_upsert(keys: range = keys) -> None:
                ins = dialect.insert(twin).values([{"id": k, "v": k} for k in keys])
                conn.execute(
                    ins.on_conflict_do_update(index_elements=["id"], set_={"v": ins.excluded.v})
                )
                conn.commit()

            def fenced_upsert(keys: range = keys) -> None:
                guard.upsert_many(1, [{"id": k, "v": k} for k in keys])
                conn.commit()

            def plain_many(keys: range = keys) -> None:
                conn.execute(plain_update, [{"k": k, "x": k} for k in keys])
                conn.commit()

            def fenced_update(keys: range = keys) -> None:
                guard.update_many(1, {k: {"v": k} for k in keys})
                conn.commit()

            variants = {
                "plain upsert": plain_upsert,
                "fenced upsert_many": fenced_upsert,
                "plain update (executemany)": plain_many,
                "fenced update_many": fenced_update,
            }
            rates = _interleave(ctx, size, variants)
            rows += _rows(rates, label, size, list(variants))
    return rows


def bench_core_postgres(ctx: Context) -> list[Row]:
    """SQLAlchemy Core on PostgreSQL (psycopg 3 driver)."""
    engine = create_engine(ctx.servers.postgres.url)
    try:
        return _core(ctx, engine, "Core PostgreSQL ", postgresql)
    finally:
        engine.dispose()


def bench_core_sqlite(ctx: Context) -> list[Row]:
    """SQLAlchemy Core on an in-memory SQLite database."""
    engine = create_engine("sqlite://")
    try:
        with engine.begin() as plain:
            conn = plain.execution_options(unfenced=True)  # the set-up, before any holder
            for name in (TABLE, PLAIN_TABLE):
                conn.exec_driver_sql(
                    f"CREATE TABLE {name} (id INTEGER PRIMARY KEY, v INTEGER, "
                    "fence BIGINT NOT NULL DEFAULT 0)"
                )
                seed = f"INSERT INTO {name} (id, v) VALUES (?, 0)"  # noqa: S608 - our own names
                conn.exec_driver_sql(seed, [(k,) for k in range(max(SIZES))])
            for statement in trigger_ddl(TABLE, dialect="sqlite"):
                conn.exec_driver_sql(statement)
        return _core(ctx, engine, "Core SQLite ", sqlite)
    finally:
        engine.dispose()


def create_table(conninfo: str) -> None:
    """(Re)create the PostgreSQL benchmark tables with the largest batch's rows: the fenced
    one with the database's judge, its plain twin without."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        for name in (TABLE, PLAIN_TABLE):
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
                (max(SIZES) - 1,),
            )
        with conn.transaction():
            for statement in trigger_ddl(TABLE):
                conn.execute(statement.encode())


def collect(ctx: Context) -> list[Row]:
    """Every guard; see the module docstring."""
    create_table(ctx.servers.postgres.conninfo)
    return [*bench_psycopg(ctx), *bench_core_postgres(ctx), *bench_core_sqlite(ctx)]


if __name__ == "__main__":
    raise SystemExit(_harness.standalone(collect, __doc__))
