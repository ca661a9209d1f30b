#!/usr/bin/env python3
"""What importing the SQL adapters costs a statement that has nothing to do with fencing.

    python benchmarks/bench_sql_gate.py [--quick] [--repeats 7]

The gate (``fence.adapters._sql_gate``) and the judge (``fence.adapters._judge``) listen
on every :class:`~sqlalchemy.Engine` from the moment ``fence.adapters.sql`` is imported.
This times a plain Core ``SELECT`` and ``UPDATE`` by primary key, and a ``text()``
``SELECT``, on an in-memory SQLite table without a fence column, through two engines of the
same process, interleaved: one as every engine is after the import, and one on which
SQLAlchemy sees no listener (its engine and dialect marked as having no events, as they
are in a process that never imported the adapters). The ratio is the throughput with the
listeners over the throughput without them (1.0 = no cost).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import _harness
from _harness import Context, Row
from sqlalchemy import Column, Engine, Integer, MetaData, Table, bindparam, select, text, update
from sqlalchemy import create_engine as _create_engine

import fence.adapters.sql  # noqa: F401 - the import under test installs the listeners

GROUP = "sql-gate"


def _engine(listened: bool) -> tuple[Engine, Table]:
    engine = _create_engine("sqlite://")
    if not listened:
        # What SQLAlchemy checks before it calls any engine or dialect listener.
        engine._has_events = False  # type: ignore[misc]
        engine.dialect._has_events = False
    table = Table(
        "plain",
        MetaData(),
        Column("id", Integer, primary_key=True, autoincrement=False),
        Column("v", Integer),
    )
    table.metadata.create_all(engine)
    with engine.begin() as conn:
        conn.execute(table.insert(), [{"id": i, "v": 0} for i in range(10)])
    return engine, table


def collect(ctx: Context) -> list[Row]:
    """Plain statements with and without the listeners; see the module docstring."""
    variants: dict[str, Callable[[], Any]] = {}
    engines = []
    for label, listened in (("no listener", False), ("adapters imported", True)):
        engine, table = _engine(listened)
        engines.append(engine)
        conn = engine.connect()
        read = select(table.c.v).where(table.c.id == bindparam("k"))
        write = update(table).where(table.c.id == bindparam("k")).values(v=bindparam("x"))
        raw = text("SELECT v FROM plain WHERE id = 3")
        variants[f"SELECT, {label}"] = lambda c=conn, s=read: c.execute(s, {"k": 3}).scalar()
        variants[f"UPDATE, {label}"] = lambda c=conn, s=write: c.execute(s, {"k": 3, "x": 1})
        variants[f"text() SELECT, {label}"] = lambda c=conn, s=raw: c.execute(s).scalar()
    calls = ctx.n(20000, 500)
    try:
        rates = _harness.interleaved(
            variants, calls=calls, batch=100, repeats=ctx.repeats, warmup=200
        )
    finally:
        for engine in engines:
            engine.dispose()
    rows: list[Row] = []
    for what in ("SELECT", "UPDATE", "text() SELECT"):
        rows += _harness.rate_rows(
            GROUP,
            rates,
            f"{what}, no listener",
            [f"{what}, adapters imported"],
            unit="statements/s",
            prefix="SQLite, no fence column: ",
        )
    return rows


if __name__ == "__main__":
    raise SystemExit(_harness.standalone(collect, __doc__))
