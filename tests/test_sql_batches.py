"""Batches of any size on every SQL guard: 100,000 rows of 8 columns, all or nothing (C6).

``upsert_many``, ``update_many`` and ``FenceRegister.claim_many`` once failed past a size:
at 501 rows on SQLite (its limit on compound SELECTs), with "stack depth limit exceeded" at
10,000 rows on PostgreSQL through Core, and past 65,535 bind parameters on Core and psycopg.
These tests drive the three guards (Core on SQLite, Core on PostgreSQL, psycopg) through one
table of 100,000 rows and 8 data columns of different types: every batch is accepted and
read back, or refused whole, with every rejected row listed and nothing written.

The rows are read back whole, so a value that changed type or precision on its way through
an array shows. Each test prints what its batches took (``pytest -rP``); nothing is timed.
"""

from __future__ import annotations

import datetime
import secrets
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from decimal import Decimal
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb
from sqlalchemy import (
    ARRAY,
    CHAR,
    BigInteger,
    Boolean,
    Column,
    Date,
    DateTime,
    Engine,
    Float,
    Integer,
    Interval,
    LargeBinary,
    MetaData,
    Numeric,
    String,
    Table,
    Uuid,
    create_engine,
    func,
    select,
)
from sqlalchemy import event as sqlalchemy_event
from sqlalchemy.dialects import postgresql
from sqlalchemy.ext.asyncio import create_async_engine

from fence import BackendError, ConfigurationError, Reason, StaleTokenError
from fence.adapters import psycopg as pg_guard
from fence.adapters import sql as core_guard

N = 100_000
DATA = ("c_int", "c_big", "c_str", "c_num", "c_float", "c_bool", "c_day", "c_at")
#: The row whose fence a newer holder raises, and a key that has no row.
STALE_KEY, MISSING_KEY = 77_777, N + 7
EPOCH = datetime.datetime(2020, 1, 1)


def row(i: int, gen: int) -> dict[str, Any]:
    """Row ``i`` as written by generation ``gen`` of the test: 8 columns, 8 types."""
    return {
        "id": i,
        "c_int": i + gen,
        "c_big": i * 2**33 + gen,
        "c_str": f"row {i} gen {gen}",
        "c_num": Decimal(i) / 100 + gen,
        "c_float": i + 0.5 + gen,
        "c_bool": (i + gen) % 2 == 0,
        "c_day": EPOCH.date() + datetime.timedelta(days=(i + gen) % 3000),
        "c_at": EPOCH + datetime.timedelta(seconds=i, microseconds=gen),
    }


def as_tuple(values: Mapping[str, Any], fence: int) -> tuple[Any, ...]:
    """A row as :meth:`Target.rows` reads it back."""
    return (values["id"], *(values[c] for c in DATA), fence)


class Target:
    """One guard on one database, every call its own transaction."""

    name: str

    def upsert_many(self, token: int, rows: Sequence[Mapping[str, Any]]) -> None:
        raise NotImplementedError

    def update_many(self, token: int, items: Mapping[int, Mapping[str, Any]]) -> None:
        raise NotImplementedError

    def claim(self, key: int, token: int) -> None:
        raise NotImplementedError

    def claim_many(self, scopes: Sequence[str], token: int) -> None:
        raise NotImplementedError

    def claim_scope(self, scope: str, token: int) -> None:
        raise NotImplementedError

    def rows(self) -> list[tuple[Any, ...]]:
        """Every row, ``(id, *DATA, fence)``, in key order."""
        raise NotImplementedError

    def fence_counts(self) -> dict[int, int]:
        """How many rows hold each fence: every fenced write sets the fence to its token,
        so a batch refused with token ``t`` must leave no new row at ``t``."""
        raise NotImplementedError

    def fences(self) -> dict[str, int]:
        """Every scope of the register with its fence."""
        raise NotImplementedError


def _table(name: str) -> Table:
    return Table(
        name,
        MetaData(),
        Column("id", Integer, primary_key=True, autoincrement=False),
        Column("c_int", Integer),
        Column("c_big", BigInteger),
        Column("c_str", String(40)),
        Column("c_num", Numeric(12, 2)),
        Column("c_float", Float),
        Column("c_bool", Boolean),
        Column("c_day", Date),
        Column("c_at", DateTime),
        core_guard.fence_column(),
        core_guard.tombstone_column(),
    )


class CoreTarget(Target):
    """The SQLAlchemy Core guard."""

    def __init__(self, name: str, engine: Engine) -> None:
        self.name = name
        self.engine = engine
        self.table = _table(f"batch_{secrets.token_hex(4)}")
        self.register = core_guard.fence_register_table(MetaData(), f"reg_{secrets.token_hex(4)}")
        with engine.begin() as conn:
            self.table.create(conn)
            self.register.create(conn)

    def upsert_many(self, token: int, rows: Sequence[Mapping[str, Any]]) -> None:
        with self.engine.begin() as conn:
            core_guard.RowGuard(conn, self.table).upsert_many(token, rows)

    def update_many(self, token: int, items: Mapping[int, Mapping[str, Any]]) -> None:
        with self.engine.begin() as conn:
            core_guard.RowGuard(conn, self.table).update_many(token, items)

    def claim(self, key: int, token: int) -> None:
        with self.engine.begin() as conn:
            core_guard.RowGuard(conn, self.table).claim(key, token)

    def claim_many(self, scopes: Sequence[str], token: int) -> None:
        with self.engine.begin() as conn:
            core_guard.FenceRegister(conn, self.register).claim_many(scopes, token)

    def claim_scope(self, scope: str, token: int) -> None:
        with self.engine.begin() as conn:
            core_guard.FenceRegister(conn, self.register).claim(scope, token)

    def rows(self) -> list[tuple[Any, ...]]:
        t = self.table
        with self.engine.begin() as conn:
            query = select(t.c.id, *(t.c[c] for c in DATA), t.c.fence).order_by(t.c.id)
            return [tuple(r) for r in conn.execute(query)]

    def fence_counts(self) -> dict[int, int]:
        t = self.table
        with self.engine.begin() as conn:
            query = select(t.c.fence, func.count()).group_by(t.c.fence)
            return dict(tuple(r) for r in conn.execute(query))

    def fences(self) -> dict[str, int]:
        with self.engine.begin() as conn:
            return dict(tuple(r) for r in conn.execute(select(self.register)))


PSYCOPG_DDL = (
    "CREATE TABLE {} (id INT PRIMARY KEY, c_int INT, c_big BIGINT, c_str VARCHAR(40), "
    "c_num NUMERIC(12, 2), c_float DOUBLE PRECISION, c_bool BOOLEAN, c_day DATE, "
    "c_at TIMESTAMP, fence BIGINT NOT NULL DEFAULT 0, deleted BOOLEAN NOT NULL DEFAULT FALSE)"
)


class PsycopgTarget(Target):
    """The psycopg guard, on a connection in the default (transaction) mode."""

    name = "psycopg"

    def __init__(self, conninfo: str) -> None:
        self.conn = psycopg.connect(conninfo)
        self.table = f"batch_{secrets.token_hex(4)}"
        self.register = f"reg_{secrets.token_hex(4)}"
        self.conn.execute(sql.SQL(PSYCOPG_DDL).format(sql.Identifier(self.table)))
        self.conn.execute(pg_guard.REGISTER_TABLE_DDL.format(table=self.register))
        pg_guard.install_triggers(self.conn, self.table, tombstone="deleted")
        pg_guard.install_triggers(self.conn, self.register, register=True)
        self.conn.commit()
        self.guard = pg_guard.RowGuard(self.conn, self.table, tombstone="deleted")

    def _commit(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except BaseException:
            self.conn.rollback()
            raise
        self.conn.commit()

    def upsert_many(self, token: int, rows: Sequence[Mapping[str, Any]]) -> None:
        self._commit(self.guard.upsert_many, token, rows)

    def update_many(self, token: int, items: Mapping[int, Mapping[str, Any]]) -> None:
        self._commit(self.guard.update_many, token, items)

    def claim(self, key: int, token: int) -> None:
        self._commit(self.guard.claim, key, token)

    def claim_many(self, scopes: Sequence[str], token: int) -> None:
        self._commit(pg_guard.FenceRegister(self.conn, self.register).claim_many, scopes, token)

    def claim_scope(self, scope: str, token: int) -> None:
        self._commit(pg_guard.FenceRegister(self.conn, self.register).claim, scope, token)

    def rows(self) -> list[tuple[Any, ...]]:
        query = sql.SQL("SELECT id, {}, fence FROM {} ORDER BY id").format(
            sql.SQL(", ").join(map(sql.Identifier, DATA)), sql.Identifier(self.table)
        )
        rows = [tuple(r) for r in self.conn.execute(query)]
        self.conn.rollback()
        return rows

    def fence_counts(self) -> dict[int, int]:
        query = sql.SQL("SELECT fence, count(*) FROM {} GROUP BY fence").format(
            sql.Identifier(self.table)
        )
        found: dict[Any, Any] = dict(self.conn.execute(query).fetchall())
        self.conn.rollback()
        return found

    def fences(self) -> dict[str, int]:
        query = sql.SQL("SELECT scope, fence FROM {}").format(sql.Identifier(self.register))
        found: dict[Any, Any] = dict(self.conn.execute(query).fetchall())
        self.conn.rollback()
        return found


TARGETS = [
    pytest.param("core-sqlite", id="core-sqlite"),
    pytest.param("core-postgres", id="core-postgres", marks=pytest.mark.postgres),
    pytest.param("psycopg", id="psycopg", marks=pytest.mark.postgres),
]


@pytest.fixture(params=TARGETS)
def target(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Target]:
    """One guard, its empty table and its register."""
    if request.param == "core-sqlite":
        path = tmp_path / "batches.db"
        engine = create_engine(f"sqlite:///{path}")
        yield CoreTarget("core-sqlite", engine)
        engine.dispose()
    elif request.param == "core-postgres":
        engine = create_engine(request.getfixturevalue("postgres_server").url)
        yield CoreTarget("core-postgres", engine)
        engine.dispose()
    else:
        found = PsycopgTarget(request.getfixturevalue("postgres_server").conninfo)
        yield found
        found.conn.close()


def _timed(target: Target, what: str, fn: Any, *args: Any) -> None:
    started = time.perf_counter()
    try:
        fn(*args)
    finally:
        # The cost of a batch this size, in the test log (-rP); never asserted.
        print(f"{target.name}: {what} {time.perf_counter() - started:.2f} s")


def test_100k_rows_of_8_columns_all_or_nothing(target: Target) -> None:
    table = _table_name(target)
    old = [row(i, 0) for i in range(N)]
    _timed(target, "upsert_many of 100,000 new rows", target.upsert_many, 5, old)
    assert target.rows() == [as_tuple(r, 5) for r in old]

    # One stale row: a newer holder raised its fence. The batch is refused whole.
    target.claim(STALE_KEY, 9)
    before = {5: N - 1, 9: 1}
    assert target.fence_counts() == before
    new = [row(i, 2) for i in range(N)]
    with pytest.raises(StaleTokenError) as caught:
        _timed(target, "refused upsert_many", target.upsert_many, 6, new)
    err = caught.value
    assert [(e.scope, e.reason, e.fence) for e in err.rejected] == [
        (f"{table}({STALE_KEY})", Reason.STALE, 9)
    ]
    assert (err.reason, err.fence, err.token) == (Reason.STALE, 9, 6)
    assert target.fence_counts() == before  # no row at fence 6: nothing written

    # One missing row: the update is refused whole.
    items = {i: _data(new[i]) for i in range(N) if i != 7}
    items[MISSING_KEY] = _data(row(MISSING_KEY, 2))
    with pytest.raises(StaleTokenError) as caught:
        _timed(target, "refused update_many", target.update_many, 9, items)
    assert [(e.scope, e.reason, e.fence) for e in caught.value.rejected] == [
        (f"{table}({MISSING_KEY})", Reason.MISSING, None)
    ]
    assert target.fence_counts() == before  # no new row at fence 9: nothing written

    # Accepted, with mixed columns: even rows set all 8, odd rows 2; the rest keep theirs.
    items = {
        i: _data(new[i]) if i % 2 == 0 else {"c_int": new[i]["c_int"], "c_str": new[i]["c_str"]}
        for i in range(N)
    }
    _timed(target, "update_many of 100,000 rows", target.update_many, 9, items)
    assert target.rows() == [as_tuple({**old[i], **items[i]}, 9) for i in range(N)]


def test_100k_scopes_claimed_all_or_nothing(target: Target) -> None:
    scopes = [f"order:{i}" for i in range(N)]
    _timed(target, "claim_many of 100,000 scopes", target.claim_many, scopes, 5)
    target.claim_scope("order:4242", 8)
    with pytest.raises(StaleTokenError) as caught:
        target.claim_many(scopes, 7)
    assert [(e.scope, e.fence) for e in caught.value.rejected] == [("order:4242", 8)]
    fences = target.fences()
    assert len(fences) == N
    assert {f for s, f in fences.items() if s != "order:4242"} == {5}


def _data(values: Mapping[str, Any]) -> dict[str, Any]:
    return {c: values[c] for c in DATA}


def _table_name(target: Target) -> str:
    if isinstance(target, CoreTarget):
        return target.table.name
    assert isinstance(target, PsycopgTarget)
    return target.table


# -- asyncio ------------------------------------------------------------------------------

ASYNC_N = 10_000  # 90,000 bind parameters in the old shape: past every old limit

ASYNC_TARGETS = [
    pytest.param("aiosqlite", id="aiosqlite"),
    pytest.param("core-postgres", id="core-psycopg-async", marks=pytest.mark.postgres),
    pytest.param("psycopg", id="psycopg-async", marks=pytest.mark.postgres),
]


@pytest.mark.parametrize("kind", ASYNC_TARGETS)
async def test_async_batches_past_the_old_limits(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """The asyncio twins run the same (generated) code; once each, at 10,000 rows."""
    old = [row(i, 0) for i in range(ASYNC_N)]
    new = {i: _data(row(i, 2)) for i in range(ASYNC_N)}
    if kind == "psycopg":
        conn = await psycopg.AsyncConnection.connect(
            request.getfixturevalue("postgres_server").conninfo
        )
        name = f"batch_{secrets.token_hex(4)}"
        await conn.execute(sql.SQL(PSYCOPG_DDL).format(sql.Identifier(name)))
        await pg_guard.install_triggers_async(conn, name, tombstone="deleted")
        guard = pg_guard.AsyncRowGuard(conn, name, tombstone="deleted")
        try:
            await guard.upsert_many(5, old)
            await guard.claim(STALE_KEY % ASYNC_N, 9)
            with pytest.raises(StaleTokenError) as caught:
                await guard.upsert_many(6, [row(i, 1) for i in range(ASYNC_N)])
            assert [e.scope for e in caught.value.rejected] == [f"{name}({STALE_KEY % ASYNC_N})"]
            with pytest.raises(StaleTokenError) as caught:
                await guard.update_many(9, {**new, MISSING_KEY: {"c_int": 1}})
            assert [e.reason for e in caught.value.rejected] == [Reason.MISSING]
            await guard.update_many(9, new)
            cur = await conn.execute(
                sql.SQL("SELECT id, {}, fence FROM {} ORDER BY id").format(
                    sql.SQL(", ").join(map(sql.Identifier, DATA)), sql.Identifier(name)
                )
            )
            got = [tuple(r) for r in await cur.fetchall()]
        finally:
            await conn.rollback()
            await conn.close()
    else:
        if kind == "aiosqlite":
            url = f"sqlite+aiosqlite:///{tmp_path / 'batches.db'}"
        else:
            url = request.getfixturevalue("postgres_server").url
        engine = create_async_engine(url)
        table = _table(f"batch_{secrets.token_hex(4)}")
        try:
            async with engine.begin() as conn:
                await conn.run_sync(table.metadata.create_all)
                guard_ = core_guard.AsyncRowGuard(conn, table)
                await guard_.upsert_many(5, old)
                await guard_.claim(STALE_KEY % ASYNC_N, 9)
                with pytest.raises(StaleTokenError) as caught:
                    await guard_.upsert_many(6, [row(i, 1) for i in range(ASYNC_N)])
                assert [e.scope for e in caught.value.rejected] == [
                    f"{table.name}({STALE_KEY % ASYNC_N})"
                ]
                with pytest.raises(StaleTokenError) as caught:
                    await guard_.update_many(9, {**new, MISSING_KEY: {"c_int": 1}})
                assert [e.reason for e in caught.value.rejected] == [Reason.MISSING]
                await guard_.update_many(9, new)
                t = table
                result = await conn.execute(
                    select(t.c.id, *(t.c[c] for c in DATA), t.c.fence).order_by(t.c.id)
                )
                got = [tuple(r) for r in result]
        finally:
            await engine.dispose()
    assert got == [as_tuple({"id": i, **new[i]}, 9) for i in range(ASYNC_N)]


# -- what arrays cannot carry: the row path on PostgreSQL ---------------------------------

ROW_PATH_N = 25_000  # 75,000 bind parameters in the old shape


def _tagged(i: int, gen: int) -> dict[str, Any]:
    # An array column (an unnest would flatten it), ragged and sometimes NULL.
    return {"id": i, "tags": None if i % 7 == 0 else list(range(i % 4 + gen)), "v": i + gen + 0.5}


@pytest.mark.postgres
@pytest.mark.parametrize("kind", ["core", "psycopg"])
def test_array_columns_take_the_row_path_at_any_size(kind: str, postgres_server: Any) -> None:
    name = f"tagged_{secrets.token_hex(4)}"
    with psycopg.connect(postgres_server.conninfo, autocommit=True) as c:
        c.execute(
            sql.SQL(
                "CREATE TABLE {} (id INT PRIMARY KEY, tags INT[], v DOUBLE PRECISION, "
                "fence BIGINT NOT NULL DEFAULT 0, deleted BOOLEAN NOT NULL DEFAULT FALSE)"
            ).format(sql.Identifier(name))
        )
        pg_guard.install_triggers(c, name, tombstone="deleted")
    table = Table(
        name,
        MetaData(),
        Column("id", Integer, primary_key=True, autoincrement=False),
        Column("tags", ARRAY(Integer)),
        Column("v", Float),
        core_guard.fence_column(),
        core_guard.tombstone_column(),
    )
    engine = create_engine(postgres_server.url)
    conn = psycopg.connect(postgres_server.conninfo)

    def run(method: str, *args: Any) -> None:
        if kind == "core":
            with engine.begin() as c:
                getattr(core_guard.RowGuard(c, table), method)(*args)
        else:
            try:
                getattr(pg_guard.RowGuard(conn, name, tombstone="deleted"), method)(*args)
            finally:
                conn.commit()

    def read() -> list[tuple[Any, ...]]:
        query = sql.SQL("SELECT id, tags, v, fence FROM {} ORDER BY id").format(
            sql.Identifier(name)
        )
        try:
            return [tuple(r) for r in conn.execute(query)]
        finally:
            conn.rollback()

    try:
        old = [_tagged(i, 0) for i in range(ROW_PATH_N)]
        run("upsert_many", 5, old)
        assert read() == [(r["id"], r["tags"], r["v"], 5) for r in old]
        run("claim", 1234, 9)
        with pytest.raises(StaleTokenError) as caught:
            run("upsert_many", 6, [_tagged(i, 1) for i in range(ROW_PATH_N)])
        assert [(e.scope, e.fence) for e in caught.value.rejected] == [(f"{name}(1234)", 9)]
        with pytest.raises(StaleTokenError) as caught:
            run("update_many", 9, {0: {"v": 1.0}, ROW_PATH_N + 1: {"v": 1.0}})
        assert [e.reason for e in caught.value.rejected] == [Reason.MISSING]
        expected = [(r["id"], r["tags"], r["v"], 9 if r["id"] == 1234 else 5) for r in old]
        assert read() == expected
        new = {i: {"tags": [i]} if i % 2 else {"v": -1.0} for i in range(ROW_PATH_N)}
        run("update_many", 9, new)
        assert read() == [
            (i, new[i].get("tags", old[i]["tags"]), new[i].get("v", old[i]["v"]), 9)
            for i in range(ROW_PATH_N)
        ]
    finally:
        conn.close()
        engine.dispose()


# -- column types round-trip --------------------------------------------------------------

TYPES_DDL = (
    "CREATE TABLE {} (id INT PRIMARY KEY, u UUID, j JSONB, b BYTEA, ts TIMESTAMPTZ, "
    "ch CHAR(3), vc VARCHAR(5), n NUMERIC(6, 2), iv INTERVAL, e {}, "
    "fence BIGINT NOT NULL DEFAULT 0)"
)
UTC = datetime.UTC


def _typed(i: int) -> dict[str, Any]:
    return {
        "id": i,
        "u": uuid.UUID(int=i + 1),
        "j": {"i": i, "list": [1, "two", None], "nested": {"ok": i % 2 == 0}},
        "b": bytes([i, 0, 255, 92, 39]),  # a zero byte, a backslash and a quote
        "ts": datetime.datetime(2024, 2, 29, 23, 59, 59, 999999, tzinfo=UTC),
        "ch": "ab" if i else None,  # CHAR(3) pads: read back as "ab "
        "vc": "quote'",  # 6 characters: too long for VARCHAR(5)
        "n": Decimal("1234.5"),
        "iv": datetime.timedelta(days=i, microseconds=1),
        "e": ["sad", "ok", "happy"][i % 3],
    }


@pytest.mark.postgres
@pytest.mark.parametrize("kind", ["core", "psycopg"])
def test_column_types_round_trip(kind: str, postgres_server: Any) -> None:
    """Each array is cast to its column's own type, without a length: values come back as
    a single-row write stores them, and a value too long for its column fails as it does
    there (a cast to ``VARCHAR(5)[]`` would cut it silently)."""
    name, mood = f"typed_{secrets.token_hex(4)}", f"mood_{secrets.token_hex(4)}"
    with psycopg.connect(postgres_server.conninfo, autocommit=True) as c:
        c.execute(
            sql.SQL("CREATE TYPE {} AS ENUM ('sad', 'ok', 'happy')").format(sql.Identifier(mood))
        )
        c.execute(sql.SQL(TYPES_DDL).format(sql.Identifier(name), sql.Identifier(mood)))
        pg_guard.install_triggers(c, name)
    table = Table(
        name,
        MetaData(),
        Column("id", Integer, primary_key=True, autoincrement=False),
        Column("u", Uuid),
        Column("j", postgresql.JSONB),
        Column("b", LargeBinary),
        Column("ts", DateTime(timezone=True)),
        Column("ch", CHAR(3)),
        Column("vc", String(5)),
        Column("n", Numeric(6, 2)),
        Column("iv", Interval),
        Column("e", postgresql.ENUM("sad", "ok", "happy", name=mood, create_type=False)),
        core_guard.fence_column(),
    )
    engine = create_engine(postgres_server.url)
    conn = psycopg.connect(postgres_server.conninfo)

    def adapt(values: Mapping[str, Any]) -> dict[str, Any]:
        return {k: Jsonb(v) if k == "j" and kind == "psycopg" else v for k, v in values.items()}

    def run(method: str, token: int, batch: Any) -> None:
        if kind == "core":
            with engine.begin() as c:
                getattr(core_guard.RowGuard(c, table), method)(token, batch)
        else:
            try:
                getattr(pg_guard.RowGuard(conn, name), method)(token, batch)
            finally:
                conn.commit()

    def read() -> list[dict[str, Any]]:
        query = sql.SQL("SELECT * FROM {} ORDER BY id").format(sql.Identifier(name))
        try:
            with conn.cursor(row_factory=dict_row) as cur:
                return cur.execute(query).fetchall()
        finally:
            conn.rollback()

    def stored(values: Mapping[str, Any], fence: int) -> dict[str, Any]:
        ch = values["ch"]
        return {**values, "ch": None if ch is None else ch.ljust(3), "fence": fence}

    try:
        rows = [{**_typed(i), "vc": "ok"} for i in range(3)]
        with pytest.raises(BackendError, match="too long"):
            run("upsert_many", 5, [adapt(_typed(i)) for i in range(3)])
        assert read() == []
        run("upsert_many", 5, [adapt(r) for r in rows])
        assert read() == [stored(r, 5) for r in rows]
        with pytest.raises(BackendError, match="too long"):
            run("update_many", 6, {0: {"ch": "abcd"}, 1: {"n": Decimal(1)}})
        assert read() == [stored(r, 5) for r in rows]
        changes = {0: {"j": None, "ch": "xyz", "e": "happy"}, 1: {"u": None}, 2: {"b": b""}}
        run("update_many", 6, {k: adapt(v) for k, v in changes.items()})
        assert read() == [stored({**r, **changes[r["id"]]}, 6) for r in rows]
    finally:
        conn.close()
        engine.dispose()


@pytest.mark.parametrize("kind", ["core-sqlite", "core-postgres", "psycopg"])
def test_values_of_mixed_python_types(kind: str, request: pytest.FixtureRequest) -> None:
    """A column whose values mix Python types (``1`` and ``2.5``) cannot be one array for
    psycopg; the batch takes the row path and stores each value as a single write would."""
    if kind != "core-sqlite":
        request.applymarker(pytest.mark.postgres)
    target = _small_target(kind, request)
    rows = [{**row(i, 0), "c_float": i if i % 2 else i + 0.5, "c_num": i} for i in range(20)]
    target.upsert_many(5, rows)
    got = target.rows()
    assert [(r[0], r[5], r[4]) for r in got] == [
        (i, float(r["c_float"]), Decimal(i)) for i, r in enumerate(rows)
    ]
    target.update_many(6, {i: {"c_float": 1 if i % 2 else 1.5} for i in range(20)})
    assert [r[5] for r in target.rows()] == [1.5 if i % 2 == 0 else 1.0 for i in range(20)]


def _small_target(kind: str, request: pytest.FixtureRequest) -> Target:
    if kind == "core-sqlite":
        engine = create_engine(f"sqlite:///{request.getfixturevalue('tmp_path') / 'small.db'}")
        request.addfinalizer(engine.dispose)
        return CoreTarget(kind, engine)
    server = request.getfixturevalue("postgres_server")
    if kind == "core-postgres":
        engine = create_engine(server.url)
        request.addfinalizer(engine.dispose)
        return CoreTarget(kind, engine)
    found = PsycopgTarget(server.conninfo)
    request.addfinalizer(found.conn.close)
    return found


# -- the caller's transaction and bad input -----------------------------------------------


@pytest.mark.parametrize("kind", ["core-sqlite", "core-postgres", "psycopg"])
@pytest.mark.parametrize("first", ["upsert_many", "update_many", "claim_many"])
def test_batches_stay_inside_the_callers_transaction(
    kind: str, first: str, request: pytest.FixtureRequest
) -> None:
    """A batch that is the first statement of the caller's transaction is undone by the
    caller's rollback. On SQLite the batch's savepoint would otherwise begin a transaction
    of its own, which releasing the savepoint would commit."""
    if kind != "core-sqlite":
        request.applymarker(pytest.mark.postgres)
    target = _small_target(kind, request)
    rows = [row(i, 0) for i in range(600)]
    target.upsert_many(4, rows[:2])

    def batches(guard: Any, register: Any) -> None:
        ops = {
            "upsert_many": lambda: guard.upsert_many(5, rows),
            "update_many": lambda: guard.update_many(5, {1: {"c_int": 1}}),
            "claim_many": lambda: register.claim_many(["a", "b"], 5),
        }
        ops.pop(first)()
        for op in ops.values():
            op()

    if isinstance(target, CoreTarget):
        with target.engine.connect() as conn:
            conn.begin()
            batches(
                core_guard.RowGuard(conn, target.table),
                core_guard.FenceRegister(conn, target.register),
            )
            conn.rollback()
    else:
        assert isinstance(target, PsycopgTarget)
        batches(target.guard, pg_guard.FenceRegister(target.conn, target.register))
        target.conn.rollback()
    assert target.fence_counts() == {4: 2}
    assert target.fences() == {}


@pytest.mark.parametrize("kind", ["core-sqlite", "core-postgres", "psycopg"])
def test_bad_batches_are_refused_before_any_io(kind: str, request: pytest.FixtureRequest) -> None:
    """Rows with different columns and keys given twice raise ``ConfigurationError`` before
    any statement is sent (the connection is closed: any I/O would be a ``BackendError``)."""
    if kind != "core-sqlite":
        request.applymarker(pytest.mark.postgres)
    target = _small_target(kind, request)
    guard: Any
    if isinstance(target, CoreTarget):
        conn = target.engine.connect()
        guard = core_guard.RowGuard(conn, target.table)
    else:
        assert isinstance(target, PsycopgTarget)
        conn = psycopg.connect(request.getfixturevalue("postgres_server").conninfo)
        guard = pg_guard.RowGuard(conn, target.table, tombstone="deleted")
    conn.close()
    bad = {
        "same columns": lambda: guard.upsert_many(5, [{"id": 1, "c_int": 1}, {"id": 2}]),
        "twice": lambda: guard.upsert_many(5, [{"id": 1, "c_int": 1}, {"id": 1, "c_int": 2}]),
        "twice ": lambda: guard.update_many(5, {1: {"c_int": 1}, (1,): {"c_int": 2}}),
    }
    if isinstance(target, CoreTarget):  # psycopg learns the columns from the database
        bad["no columns"] = lambda: guard.upsert_many(5, [{"id": 1, "nope": 1}])
    for match, call in bad.items():
        with pytest.raises(ConfigurationError, match=match.strip()):
            call()


@pytest.mark.postgres
def test_psycopg_refuses_unknown_columns_before_writing(postgres_server: Any) -> None:
    """psycopg knows only column names: the guard reads the table's columns (one catalogue
    read, the first time) and refuses a column the table lacks before the batch is sent."""
    target = PsycopgTarget(postgres_server.conninfo)
    try:
        with pytest.raises(ConfigurationError, match="no columns \\['nope'\\]"):
            target.upsert_many(5, [{"id": 1, "nope": 1}])
        with pytest.raises(ConfigurationError, match="no columns \\['nope'\\]"):
            target.update_many(5, {1: {"nope": 1}})
        assert target.fence_counts() == {}
        missing = pg_guard.RowGuard(target.conn, target.table, tombstone="gone")
        with pytest.raises(ConfigurationError, match="gone"):
            missing.upsert_many(5, [{"id": 1, "c_int": 1}])
        target.conn.rollback()
    finally:
        target.conn.close()


@pytest.mark.postgres
def test_psycopg_batches_follow_a_column_type_change(postgres_server: Any) -> None:
    """The column types are read once per connection. A batch checks in its own statement
    that they still hold: after ``ALTER TABLE ... TYPE`` the guard reads them again and
    writes with the new type (a cast to the old ``INT`` would round 1.25 to 1, silently)."""
    name = f"altered_{secrets.token_hex(4)}"
    with psycopg.connect(postgres_server.conninfo) as conn:
        conn.execute(
            sql.SQL("CREATE TABLE {} (id INT PRIMARY KEY, v INT, fence BIGINT NOT NULL)").format(
                sql.Identifier(name)
            )
        )
        pg_guard.install_triggers(conn, name)
        pg_guard.RowGuard(conn, name).upsert_many(5, [{"id": 1, "v": 1}, {"id": 2, "v": 2}])
        conn.execute(
            sql.SQL("ALTER TABLE {} ALTER COLUMN v TYPE NUMERIC(10, 2)").format(
                sql.Identifier(name)
            )
        )
        guard = pg_guard.RowGuard(conn, name)
        guard.upsert_many(6, [{"id": 1, "v": Decimal("1.25")}, {"id": 3, "v": Decimal("3.5")}])
        guard.update_many(7, {2: {"v": Decimal("2.75")}})
        query = sql.SQL("SELECT id, v, fence FROM {} ORDER BY id").format(sql.Identifier(name))
        assert conn.execute(query).fetchall() == [
            (1, Decimal("1.25"), 6),
            (2, Decimal("2.75"), 7),
            (3, Decimal("3.50"), 6),
        ]
        with pytest.raises(StaleTokenError) as caught:  # a real verdict still comes through
            guard.upsert_many(5, [{"id": 1, "v": Decimal(0)}, {"id": 4, "v": Decimal(0)}])
        assert [(e.scope, e.fence) for e in caught.value.rejected] == [(f"{name}(1)", 6)]
        conn.rollback()


def test_sqlite_autocommit_batch_is_a_transaction_of_its_own(tmp_path: Path) -> None:
    """With no transaction around it (SQLAlchemy's ``AUTOCOMMIT``), a batch on SQLite is
    still all or nothing: its savepoint is then the transaction."""
    engine = create_engine(f"sqlite:///{tmp_path / 'auto.db'}", isolation_level="AUTOCOMMIT")
    try:
        target = CoreTarget("core-sqlite", engine)
        target.upsert_many(5, [row(i, 0) for i in range(600)])
        target.claim(599, 9)
        with pytest.raises(StaleTokenError) as caught:
            target.upsert_many(6, [row(i, 1) for i in range(600)])
        assert [e.scope for e in caught.value.rejected] == [f"{target.table.name}(599)"]
        with pytest.raises(StaleTokenError):
            target.update_many(9, {0: {"c_int": 1}, 600: {"c_int": 1}})
        assert target.fence_counts() == {5: 599, 9: 1}
        assert target.rows() == [as_tuple(row(i, 0), 9 if i == 599 else 5) for i in range(600)]
    finally:
        engine.dispose()


# -- SQLite: update_many in one statement -------------------------------------------------


def _sqlite_pair(tmp_path: Path) -> tuple[Engine, Table]:
    table = Table(
        "pairs",
        MetaData(),
        Column("a", Integer, primary_key=True, autoincrement=False),
        Column("b", String(8), primary_key=True),
        Column("n", Integer),
        Column("s", String(20)),
        Column("raw", LargeBinary),
        core_guard.fence_column(),
        core_guard.tombstone_column(),
    )
    engine = create_engine(f"sqlite:///{tmp_path / 'pairs.db'}")
    table.metadata.create_all(engine)
    return engine, table


def test_sqlite_update_many_is_one_statement_all_or_nothing(tmp_path: Path) -> None:
    """On SQLite ``update_many`` sends one ``UPDATE ... FROM json_each(...)``: a composite
    key, a column only some rows set, a stale, a missing and a deleted row refuse the whole
    batch, and an accepted batch writes every row as the row path would."""
    engine, table = _sqlite_pair(tmp_path)
    sent: list[str] = []
    try:
        with engine.connect() as conn:
            guard = core_guard.RowGuard(conn, table)
            guard.upsert_many(5, [{"a": i, "b": "x", "n": i, "s": "s"} for i in range(6)])
            guard.claim((5, "x"), 9)
            guard.delete((4, "x"), 5)
            conn.commit()

            def record(*args: Any) -> None:
                sent.append(args[2])

            sqlalchemy_event.listen(conn, "before_cursor_execute", record)
            guard.update_many(
                6, {(i, "x"): {"n": 10 + i} if i % 2 else {"s": "t"} for i in range(4)}
            )
            assert len(sent) == 1
            assert "json_each" in sent[0]
            conn.commit()
            got = conn.execute(select(table.c.a, table.c.n, table.c.s, table.c.fence)).all()
            assert got[:4] == [(0, 0, "t", 6), (1, 11, "s", 6), (2, 2, "t", 6), (3, 13, "s", 6)]
            for bad, reason in (((5, "x"), Reason.STALE), ((9, "x"), Reason.MISSING)):
                with pytest.raises(StaleTokenError) as caught:
                    guard.update_many(7, {(0, "x"): {"n": 99}, bad: {"n": 99}})
                assert [e.reason for e in caught.value.rejected] == [reason]
            with pytest.raises(StaleTokenError):
                guard.update_many(7, {(0, "x"): {"n": 99}, (4, "x"): {"n": 99}})
            assert conn.execute(select(table.c.n).where(table.c.a == 0)).scalar() == 0
            assert sorted(f for (f,) in conn.execute(select(table.c.fence))) == [5, 6, 6, 6, 6, 9]
    finally:
        engine.dispose()


def test_sqlite_update_many_takes_the_row_path_for_what_json_cannot_carry(
    tmp_path: Path,
) -> None:
    """Bytes, a ``bool`` or an integer past 64 bits do not travel in JSON as the driver
    binds them: such a batch goes row by row, and is written the same."""
    engine, table = _sqlite_pair(tmp_path)
    try:
        with engine.connect() as conn:
            guard = core_guard.RowGuard(conn, table)
            guard.upsert_many(5, [{"a": i, "b": "x", "n": i} for i in range(3)])
            guard.update_many(6, {(i, "x"): {"raw": bytes([i]), "n": True} for i in range(3)})
            got = conn.execute(select(table.c.raw, table.c.n, table.c.fence)).all()
            assert got == [(bytes([i]), 1, 6) for i in range(3)]
            with pytest.raises(OverflowError):  # as the row path has always refused it
                guard.update_many(7, {(0, "x"): {"n": 2**64}, (1, "x"): {"n": 1}})
            conn.rollback()
    finally:
        engine.dispose()


def test_sqlite_update_many_writes_every_text_as_the_row_path_does(tmp_path: Path) -> None:
    """Text that SQLite's JSON functions would read differently from a bound value (a NUL,
    which ``json_extract`` cuts the text at; a lone surrogate, which it would store as bytes
    no decoder reads back) is written as the row path writes it, or refused as the row path
    refuses it, with nothing written; other text goes by the JSON path unchanged."""
    engine, table = _sqlite_pair(tmp_path)
    texts = ["a\x00b", "\x00", "😀 é \u2028", 'quote " back \\ slash']
    try:
        with engine.connect() as conn:
            guard = core_guard.RowGuard(conn, table)
            guard.upsert_many(5, [{"a": i, "b": "x\x00y", "n": i} for i in range(len(texts))])
            guard.update_many(6, {(i, "x\x00y"): {"s": s} for i, s in enumerate(texts)})
            conn.commit()
            got = conn.execute(select(table.c.s, table.c.fence).order_by(table.c.a)).all()
            assert got == [(s, 6) for s in texts]
            with pytest.raises(UnicodeEncodeError):  # as the driver refuses it on a row
                guard.update_many(7, {(0, "x\x00y"): {"s": "\ud800"}, (1, "x\x00y"): {"s": "t"}})
            conn.rollback()
            got = conn.execute(select(table.c.s, table.c.fence).order_by(table.c.a)).all()
            assert got == [(s, 6) for s in texts]
    finally:
        engine.dispose()
