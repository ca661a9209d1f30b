"""Registers the SQLAlchemy Core row guard with the guard conformance suite.

``sql-sqlite``, ``sql-postgres`` and ``sql-mariadb``: every scope is a row of a fresh table
``(k PK, v, fence, deleted)``, every harness call is its own transaction
(``engine.begin()``), and batches are :meth:`RowGuard.upsert_many`. Every table carries
the database's judge (C14), MariaDB's too.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any

import pytest
from sqlalchemy import BigInteger, Column, MetaData, String, Table, create_engine, select
from sqlalchemy.ext.asyncio import create_async_engine

from fence.adapters.sql import (
    AsyncRowGuard,
    RowGuard,
    fence_column,
    tombstone_column,
)
from tests.registry import GuardHarnessFactory, register_guard_harness

FEATURES = frozenset({"batch", "registering_read"})


def make_table(name: str | None = None) -> Table:
    """A fresh table of int values with a fence and a tombstone flag."""
    return Table(
        name or f"guard_{secrets.token_hex(4)}",
        MetaData(),
        Column("k", String(64), primary_key=True),
        Column("v", BigInteger, nullable=True),
        fence_column(),
        tombstone_column(),
    )


def _value(row: Any) -> int | None:
    return None if row is None else row.v


class SqlHarness:
    """The sync row guard behind the harness interface of ``fence.testing.guards``."""

    features = FEATURES

    def __init__(self, url: str) -> None:
        self.engine = create_engine(url)
        self.table = make_table()
        with self.engine.begin() as conn:
            self.table.create(conn)

    def _guard(self, conn: Any) -> RowGuard:
        return RowGuard(conn, self.table)

    def claim(self, scope: str, token: int) -> int:
        with self.engine.begin() as conn:
            return self._guard(conn).claim(scope, token)

    def fence(self, scope: str) -> int | None:
        with self.engine.begin() as conn:
            return self._guard(conn).fence(scope)

    def create(self, scope: str, token: int, value: int) -> None:
        with self.engine.begin() as conn:
            self._guard(conn).upsert(token, {"k": scope, "v": value})

    def update(self, scope: str, token: int, value: int) -> None:
        with self.engine.begin() as conn:
            self._guard(conn).update(scope, token, {"v": value})

    def delete(self, scope: str, token: int) -> None:
        with self.engine.begin() as conn:
            self._guard(conn).delete(scope, token)

    def read(self, scope: str) -> int | None:
        t = self.table
        with self.engine.begin() as conn:
            return conn.execute(select(t.c.v).where(t.c.k == scope, ~t.c.deleted)).scalar()

    def read_for_update(self, scope: str, token: int) -> int | None:
        with self.engine.begin() as conn:
            return _value(self._guard(conn).read_for_update(scope, token))

    def batch(self, token: int, values: Mapping[str, int]) -> None:
        with self.engine.begin() as conn:
            self._guard(conn).upsert_many(token, [{"k": k, "v": v} for k, v in values.items()])

    def close(self) -> None:
        with self.engine.begin() as conn:
            self.table.drop(conn)
        self.engine.dispose()


class AsyncSqlHarness:
    """The asyncio row guard behind the harness interface of ``fence.testing.guards``."""

    features = FEATURES

    def __init__(self, url: str) -> None:
        self.engine = create_async_engine(url)
        self.table = make_table()
        self.created = False

    async def _begin(self) -> Any:
        if not self.created:
            async with self.engine.begin() as conn:
                await conn.run_sync(self.table.create)
            self.created = True
        return self.engine.begin()

    async def claim(self, scope: str, token: int) -> int:
        async with await self._begin() as conn:
            return await AsyncRowGuard(conn, self.table).claim(scope, token)

    async def fence(self, scope: str) -> int | None:
        async with await self._begin() as conn:
            return await AsyncRowGuard(conn, self.table).fence(scope)

    async def create(self, scope: str, token: int, value: int) -> None:
        async with await self._begin() as conn:
            await AsyncRowGuard(conn, self.table).upsert(token, {"k": scope, "v": value})

    async def update(self, scope: str, token: int, value: int) -> None:
        async with await self._begin() as conn:
            await AsyncRowGuard(conn, self.table).update(scope, token, {"v": value})

    async def delete(self, scope: str, token: int) -> None:
        async with await self._begin() as conn:
            await AsyncRowGuard(conn, self.table).delete(scope, token)

    async def read(self, scope: str) -> int | None:
        t = self.table
        async with await self._begin() as conn:
            result = await conn.execute(select(t.c.v).where(t.c.k == scope, ~t.c.deleted))
            return result.scalar()

    async def read_for_update(self, scope: str, token: int) -> int | None:
        async with await self._begin() as conn:
            return _value(await AsyncRowGuard(conn, self.table).read_for_update(scope, token))

    async def batch(self, token: int, values: Mapping[str, int]) -> None:
        rows = [{"k": k, "v": v} for k, v in values.items()]
        async with await self._begin() as conn:
            await AsyncRowGuard(conn, self.table).upsert_many(token, rows)

    async def close(self) -> None:
        if self.created:
            async with self.engine.begin() as conn:
                await conn.run_sync(self.table.drop)
        await self.engine.dispose()


def _sqlite(request: pytest.FixtureRequest, is_async: bool) -> Any:
    path = request.getfixturevalue("tmp_path") / "guard.db"
    if is_async:
        return AsyncSqlHarness(f"sqlite+aiosqlite:///{path}")
    return SqlHarness(f"sqlite:///{path}")


def _postgres(request: pytest.FixtureRequest, is_async: bool) -> Any:
    url = request.getfixturevalue("postgres_url")
    return AsyncSqlHarness(url) if is_async else SqlHarness(url)


def _mariadb(request: pytest.FixtureRequest, is_async: bool) -> Any:
    url = request.getfixturevalue("mariadb_url")
    if is_async:
        return AsyncSqlHarness(url.replace("+pymysql", "+aiomysql"))
    return SqlHarness(url)


register_guard_harness(GuardHarnessFactory(name="sql-sqlite", make=_sqlite, features=FEATURES))
register_guard_harness(
    GuardHarnessFactory(
        name="sql-postgres", make=_postgres, marks=(pytest.mark.postgres,), features=FEATURES
    )
)
register_guard_harness(
    GuardHarnessFactory(
        name="sql-mariadb", make=_mariadb, marks=(pytest.mark.mariadb,), features=FEATURES
    )
)
