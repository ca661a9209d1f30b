"""Registers the psycopg row guard with the guard conformance suite.

``psycopg``: every scope is a row of a fresh PostgreSQL table ``(k PK, v, fence,
deleted)``; every harness call is its own ``conn.transaction()`` block on an autocommit
connection, and batches are :meth:`RowGuard.upsert_many`.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any

import psycopg
import pytest
from psycopg import sql

from fence.adapters.psycopg import (
    AsyncRowGuard,
    RowGuard,
    install_triggers,
    install_triggers_async,
)
from tests.registry import GuardHarnessFactory, register_guard_harness

FEATURES = frozenset({"batch", "registering_read"})

TABLE_DDL = (
    "CREATE TABLE {} (k TEXT PRIMARY KEY, v BIGINT, "
    "fence BIGINT NOT NULL DEFAULT 0, deleted BOOLEAN NOT NULL DEFAULT FALSE)"
)


def create_table(name: str) -> sql.Composed:
    """The DDL of a harness table."""
    return sql.SQL(TABLE_DDL).format(sql.Identifier(name))


def _value(row: Any) -> int | None:
    return None if row is None else row["v"]


class PsycopgHarness:
    """The sync psycopg guard behind the harness interface of ``fence.testing.guards``."""

    features = FEATURES

    def __init__(self, conninfo: str) -> None:
        self.table = f"guard_{secrets.token_hex(4)}"
        self.conn = psycopg.connect(conninfo, autocommit=True)
        self.conn.execute(create_table(self.table))
        install_triggers(self.conn, self.table, tombstone="deleted")
        self.guard = RowGuard(self.conn, self.table, key="k", tombstone="deleted")

    def claim(self, scope: str, token: int) -> int:
        with self.conn.transaction():
            return self.guard.claim(scope, token)

    def fence(self, scope: str) -> int | None:
        return self.guard.fence(scope)

    def create(self, scope: str, token: int, value: int) -> None:
        with self.conn.transaction():
            self.guard.upsert(token, {"k": scope, "v": value})

    def update(self, scope: str, token: int, value: int) -> None:
        with self.conn.transaction():
            self.guard.update(scope, token, {"v": value})

    def delete(self, scope: str, token: int) -> None:
        with self.conn.transaction():
            self.guard.delete(scope, token)

    def read(self, scope: str) -> int | None:
        query = sql.SQL("SELECT v FROM {} WHERE k = %s AND NOT deleted").format(
            sql.Identifier(self.table)
        )
        row = self.conn.execute(query, (scope,)).fetchone()
        return None if row is None else row[0]

    def read_for_update(self, scope: str, token: int) -> int | None:
        with self.conn.transaction():
            return _value(self.guard.read_for_update(scope, token))

    def batch(self, token: int, values: Mapping[str, int]) -> None:
        with self.conn.transaction():
            self.guard.upsert_many(token, [{"k": k, "v": v} for k, v in values.items()])

    def close(self) -> None:
        self.conn.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(self.table)))
        self.conn.close()


class AsyncPsycopgHarness:
    """The asyncio psycopg guard behind the harness interface of ``fence.testing.guards``."""

    features = FEATURES

    def __init__(self, conninfo: str) -> None:
        self.conninfo = conninfo
        self.table = f"guard_{secrets.token_hex(4)}"
        self._conn: psycopg.AsyncConnection[Any] | None = None

    async def _guard(self) -> AsyncRowGuard:
        if self._conn is None:
            self._conn = await psycopg.AsyncConnection.connect(self.conninfo, autocommit=True)
            await self._conn.execute(create_table(self.table))
            await install_triggers_async(self._conn, self.table, tombstone="deleted")
        return AsyncRowGuard(self._conn, self.table, key="k", tombstone="deleted")

    @property
    def conn(self) -> psycopg.AsyncConnection[Any]:
        assert self._conn is not None
        return self._conn

    async def claim(self, scope: str, token: int) -> int:
        guard = await self._guard()
        async with self.conn.transaction():
            return await guard.claim(scope, token)

    async def fence(self, scope: str) -> int | None:
        return await (await self._guard()).fence(scope)

    async def create(self, scope: str, token: int, value: int) -> None:
        guard = await self._guard()
        async with self.conn.transaction():
            await guard.upsert(token, {"k": scope, "v": value})

    async def update(self, scope: str, token: int, value: int) -> None:
        guard = await self._guard()
        async with self.conn.transaction():
            await guard.update(scope, token, {"v": value})

    async def delete(self, scope: str, token: int) -> None:
        guard = await self._guard()
        async with self.conn.transaction():
            await guard.delete(scope, token)

    async def read(self, scope: str) -> int | None:
        await self._guard()
        query = sql.SQL("SELECT v FROM {} WHERE k = %s AND NOT deleted").format(
            sql.Identifier(self.table)
        )
        cur = await self.conn.execute(query, (scope,))
        row = await cur.fetchone()
        return None if row is None else row[0]

    async def read_for_update(self, scope: str, token: int) -> int | None:
        guard = await self._guard()
        async with self.conn.transaction():
            return _value(await guard.read_for_update(scope, token))

    async def batch(self, token: int, values: Mapping[str, int]) -> None:
        guard = await self._guard()
        async with self.conn.transaction():
            await guard.upsert_many(token, [{"k": k, "v": v} for k, v in values.items()])

    async def close(self) -> None:
        if self._conn is not None:
            await self._conn.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(self.table)))
            await self._conn.close()


def _make(request: pytest.FixtureRequest, is_async: bool) -> Any:
    conninfo = request.getfixturevalue("postgres_server").conninfo
    return AsyncPsycopgHarness(conninfo) if is_async else PsycopgHarness(conninfo)


register_guard_harness(
    GuardHarnessFactory(
        name="psycopg", make=_make, marks=(pytest.mark.postgres,), features=FEATURES
    )
)
