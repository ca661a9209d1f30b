"""The asyncio psycopg guards (``psycopg.AsyncConnection``) on the session's PostgreSQL.

The rules are proven on the sync twins in ``test_psycopg_guard.py`` (both are generated
from one source) and by the conformance suite; these tests drive every asyncio entry point
once, including the savepoint, the register and the closed-connection path.
"""

from __future__ import annotations

import secrets
from typing import Any

import psycopg
import pytest
from psycopg import sql

from fence import BackendError, InvalidTokenError, Reason, StaleTokenError
from fence.adapters.psycopg import (
    REGISTER_TABLE_DDL,
    AsyncFenceRegister,
    AsyncRowGuard,
    install_triggers_async,
)
from tests.servers import PostgresServer

pytestmark = pytest.mark.postgres


async def _setup(conninfo: str) -> tuple[str, str]:
    table, register = f"items_{secrets.token_hex(4)}", f"register_{secrets.token_hex(4)}"
    async with await psycopg.AsyncConnection.connect(conninfo, autocommit=True) as c:
        await c.execute(
            sql.SQL(
                "CREATE TABLE {} (id INT PRIMARY KEY, v INT, fence BIGINT NOT NULL DEFAULT 0, "
                "deleted BOOLEAN NOT NULL DEFAULT FALSE)"
            ).format(sql.Identifier(table))
        )
        await c.execute(
            sql.SQL("INSERT INTO {} VALUES (1, 1), (2, 2)").format(sql.Identifier(table))
        )
        await c.execute(REGISTER_TABLE_DDL.format(table=register))  # type: ignore[arg-type]
        await install_triggers_async(c, table, tombstone="deleted")  # the judge (C14)
        await install_triggers_async(c, register, register=True)
    return table, register


async def test_every_async_operation(postgres_server: PostgresServer) -> None:
    table, register = await _setup(postgres_server.conninfo)
    async with await psycopg.AsyncConnection.connect(postgres_server.conninfo) as conn:
        guard = AsyncRowGuard(conn, table, tombstone="deleted", returning=True)
        assert (await guard.update(1, 5, {"v": 10}))["fence"] == 5
        with pytest.raises(StaleTokenError) as caught:
            await guard.update(1, 4, {"v": 0})
        assert (caught.value.reason, caught.value.fence) == (Reason.STALE, 5)
        assert (await guard.upsert(6, {"id": 3, "v": 30}))["v"] == 30
        assert await guard.claim(2, 6) == 6
        assert (await guard.read_for_update(2, 7) or {}).get("v") == 2
        await guard.delete(3, 7)
        assert await guard.fence(3) == 7
        await guard.update_many(7, {1: {"v": 11}, 2: {"v": 22}})
        with pytest.raises(StaleTokenError) as caught:
            await guard.upsert_many(6, [{"id": 1, "v": 0}, {"id": 4, "v": 0}])
        assert [e.scope for e in caught.value.rejected] == [f"{table}(1)"]
        await guard.upsert_many(8, [{"id": 1, "v": 111}, {"id": 4, "v": 444}])

        reg = AsyncFenceRegister(conn, register)
        assert await reg.claim("order:1", 5) == 5
        query = sql.SQL("SELECT v FROM {} WHERE id = %s").format(sql.Identifier(table))
        rows = await reg.read("order:1", 5, query, (2,))
        assert rows == [{"v": 22}]
        with pytest.raises(StaleTokenError):
            await reg.claim_many(["order:1", "x"], 4)
        await reg.claim_many(["order:1", "x"], 6)
        assert [await reg.fence("order:1"), await reg.fence("x")] == [6, 6]
        await conn.commit()
        cur = await conn.execute(
            sql.SQL("SELECT id, v, fence FROM {} ORDER BY id").format(sql.Identifier(table))
        )
        result: list[Any] = await cur.fetchall()
    assert result == [(1, 111, 8), (2, 22, 7), (3, 30, 7), (4, 444, 8)]


async def test_async_closed_connection_and_bad_tokens(postgres_server: PostgresServer) -> None:
    table, register = await _setup(postgres_server.conninfo)
    conn = await psycopg.AsyncConnection.connect(postgres_server.conninfo)
    guard, reg = AsyncRowGuard(conn, table), AsyncFenceRegister(conn, register)
    await conn.close()
    with pytest.raises(InvalidTokenError):
        await guard.update(1, True, {"v": 1})
    with pytest.raises(BackendError, match="closed") as caught:
        await guard.update(1, 5, {"v": 1})
    assert caught.value.code == "CONNECTION"
    with pytest.raises(BackendError, match="closed"):
        await reg.claim_many(["a", "b"], 5)
