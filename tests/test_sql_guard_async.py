"""The asyncio Core guards (``AsyncConnection``) on aiosqlite and psycopg's async driver.

The rules are proven on the sync twins in ``test_sql_guard.py`` (both are generated from
one source) and by the conformance suite; these tests drive every asyncio entry point once,
including the savepoint, the register and the closed-connection path.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy import Column, Integer, MetaData, Table, select
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from fence import BackendError, InvalidTokenError, Reason, StaleTokenError
from fence.adapters.sql import (
    AsyncFenceRegister,
    AsyncRowGuard,
    fence_column,
    fence_register_table,
    tombstone_column,
)

DIALECTS = [
    pytest.param("sqlite", id="aiosqlite"),
    pytest.param("postgres", id="psycopg-async", marks=pytest.mark.postgres),
]


@pytest.fixture(params=DIALECTS)
async def engine(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[AsyncEngine]:
    """An async engine on a file SQLite database or the session's PostgreSQL cluster."""
    if request.param == "sqlite":
        url = f"sqlite+aiosqlite:///{tmp_path / 'guard.db'}"
    else:
        url = request.getfixturevalue("postgres_url")
    eng = create_async_engine(url)
    yield eng
    await eng.dispose()


@pytest.fixture
async def tables(engine: AsyncEngine) -> tuple[Table, Table]:
    """A fresh ``items(id, v, fence, deleted)`` with rows 1 and 2, and a fence register."""
    md = MetaData()
    items = Table(
        f"items_{secrets.token_hex(4)}",
        md,
        Column("id", Integer, primary_key=True, autoincrement=False),
        Column("v", Integer),
        fence_column(),
        tombstone_column(),
    )
    register = fence_register_table(md, f"register_{secrets.token_hex(4)}")
    async with engine.begin() as conn:
        await conn.run_sync(md.create_all)
        seed = items.insert().execution_options(unfenced=True)  # fixture rows, no token
        await conn.execute(seed, [{"id": 1, "v": 1}, {"id": 2, "v": 2}])
    return items, register


async def test_every_async_row_operation(engine: AsyncEngine, tables: tuple[Table, Table]) -> None:
    items, _ = tables
    async with engine.begin() as conn:
        guard = AsyncRowGuard(conn, items, returning=True)
        row = await guard.update(1, 5, {"v": 10})
        assert row is not None
        assert (row.v, row.fence) == (10, 5)
        with pytest.raises(StaleTokenError) as caught:
            await guard.update(1, 4, {"v": 0})
        assert (caught.value.reason, caught.value.fence) == (Reason.STALE, 5)
        assert (await guard.upsert(6, {"id": 3, "v": 30})) is not None
        assert await guard.claim(2, 6) == 6
        read = await guard.read_for_update(2, 7)
        assert read is not None
        assert read.v == 2
        await guard.delete(3, 7)
        assert await guard.fence(3) == 7
        await guard.update_many(7, {1: {"v": 11}, 2: {"v": 22}})
        with pytest.raises(StaleTokenError) as caught:
            await guard.upsert_many(6, [{"id": 1, "v": 0}, {"id": 4, "v": 0}])
        assert [e.scope for e in caught.value.rejected] == [f"{items.name}(1)"]
        await guard.upsert_many(8, [{"id": 1, "v": 111}, {"id": 4, "v": 444}])
        result = await conn.execute(select(items.c.id, items.c.v, items.c.fence).order_by("id"))
        assert result.all() == [(1, 111, 8), (2, 22, 7), (3, 30, 7), (4, 444, 8)]


async def test_async_register(engine: AsyncEngine, tables: tuple[Table, Table]) -> None:
    items, reg_table = tables
    async with engine.begin() as conn:
        register = AsyncFenceRegister(conn, reg_table)
        assert await register.claim("order:1", 5) == 5
        result = await register.read("order:1", 5, select(items.c.v).where(items.c.id == 1))
        assert result.scalar() == 1
        await register.claim("b", 9)
        with pytest.raises(StaleTokenError) as caught:
            await register.claim_many(["order:1", "b", "c"], 6)
        assert [(e.scope, e.fence) for e in caught.value.rejected] == [("b", 9)]
        assert [await register.fence(s) for s in ("order:1", "b", "c")] == [5, 9, None]
        await register.claim_many(["order:1", "b", "c"], 9)
        assert await register.fence("c") == 9


async def test_async_closed_connection_and_bad_tokens(
    engine: AsyncEngine, tables: tuple[Table, Table]
) -> None:
    items, reg_table = tables
    conn = await engine.connect()
    guard, register = AsyncRowGuard(conn, items), AsyncFenceRegister(conn, reg_table)
    await conn.close()
    with pytest.raises(InvalidTokenError):
        await guard.update(1, 0, {"v": 1})
    with pytest.raises(BackendError, match="closed") as caught:
        await guard.update(1, 5, {"v": 1})
    assert caught.value.code == "CONNECTION"
    with pytest.raises(BackendError, match="closed"):
        await guard.upsert_many(5, [{"id": 1, "v": 1}])
    with pytest.raises(BackendError, match="closed"):
        await register.claim("a", 5)
