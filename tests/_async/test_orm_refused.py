"""A refused transaction stays refused, with ``AsyncSession`` (this source) and ``Session``
(the generated twin), on SQLite, PostgreSQL and MariaDB.

Once the claim refuses a stale holder, a fenced write of a bound session is refused, or
the lease is found lost at commit, every later statement of the transaction (through the
session or on its connection) and its commit raise ``TransactionRefusedError`` until it is
rolled back; the rollback ends it, and the next transaction claims again. Each test
catches the first error, as optimistic-concurrency retry code catches a
``StaleDataError``, and tries to carry on.
"""

from __future__ import annotations

import pickle
import secrets
from dataclasses import dataclass
from typing import Any

import pytest
from sqlalchemy import Integer, String, Table, insert, select, text, update
from sqlalchemy.exc import PendingRollbackError
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from sqlalchemy.ext.asyncio.session import AsyncSession
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from fence import (
    EventBus,
    FenceError,
    LeaseLostError,
    ManualClock,
    TransactionRefusedError,
)
from fence._async.memory import AsyncMemoryLockManager
from fence.adapters._orm.claim import _STATE_KEY
from fence.adapters.orm import (
    StaleTokenError,
    bind,
    fence_column,
    fence_register_table,
    tombstone_column,
    unbind,
)
from fence.adapters.sql import AsyncFenceRegister, AsyncRowGuard
from fence.testing import EventRecorder


@dataclass
class Models:
    """A fenced ``Item``, an unfenced ``Log`` and a register, on tables of their own."""

    Item: Any
    Log: Any
    register: Table
    base: Any


def make_models() -> Models:
    suffix = secrets.token_hex(4)

    class Base(DeclarativeBase):
        pass

    class Item(Base):
        __tablename__ = f"ref_item_{suffix}"
        id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
        v: Mapped[int] = mapped_column(Integer, default=0)
        fence: Mapped[int] = fence_column()
        deleted: Mapped[bool] = tombstone_column()

    class Log(Base):
        __tablename__ = f"ref_log_{suffix}"
        id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
        msg: Mapped[str] = mapped_column(String(20), default="")

    register = fence_register_table(Base.metadata, f"ref_register_{suffix}")
    return Models(Item, Log, register, Base)


@pytest.fixture
async def models(engine: AsyncEngine) -> Models:
    """Items 1 and 2 and the scope ``item:1`` at fence 11, one log row."""
    m = make_models()
    async with engine.begin() as conn:
        md = m.base.metadata
        await conn.run_sync(md.create_all)  # unasync: md.create_all(conn)
    async with session_of(engine) as s:
        bind(s, token=11, scope="item:1", register=m.register, unfenced=[m.Log])
        s.add_all([m.Item(id=1, v=1), m.Item(id=2, v=2), m.Log(id=1, msg="seed")])
        await s.commit()
    return m


def session_of(engine: AsyncEngine) -> AsyncSession:
    return AsyncSession(engine, expire_on_commit=False)


async def snapshot(engine: AsyncEngine, m: Models) -> list[list[tuple[Any, ...]]]:
    async with engine.connect() as conn:
        found = []
        for table in (m.Item.__table__, m.Log.__table__, m.register):
            rows = await conn.execute(select(table).order_by(*table.primary_key.columns))
            found.append([tuple(r) for r in rows])
        return found


def refused_after(caught: pytest.ExceptionInfo[TransactionRefusedError], first: Any) -> None:
    """The error names the first refusal and says to roll back."""
    err = caught.value
    assert type(err) is TransactionRefusedError
    assert err.first is first
    assert "session.rollback()" in str(err)
    assert str(first) in str(err)


async def carry_on(s: AsyncSession, conn: AsyncConnection, m: Models, first: Any) -> None:
    """Every way to go on in a refused transaction raises, and nothing leaves."""
    log = m.Log.__table__
    with pytest.raises(TransactionRefusedError) as caught:
        await s.execute(select(m.Item))  # a read
    refused_after(caught, first)
    with pytest.raises(TransactionRefusedError) as caught:
        await s.get(m.Item, 2)  # not in the identity map: a SELECT
    refused_after(caught, first)
    with pytest.raises(TransactionRefusedError) as caught:
        await s.execute(update(m.Item).where(m.Item.id == 2).values(v=0))
    refused_after(caught, first)
    with pytest.raises(TransactionRefusedError) as caught:
        await conn.execute(insert(log).values(id=6, msg="stale"))  # a table named unfenced
    refused_after(caught, first)
    with pytest.raises(TransactionRefusedError) as caught:
        await conn.execute(text(f"INSERT INTO {log.name} (id, msg) VALUES (7, 'stale')"))
    refused_after(caught, first)
    with pytest.raises(TransactionRefusedError) as caught:
        await conn.exec_driver_sql(f"INSERT INTO {log.name} (id, msg) VALUES (8, 'stale')")
    refused_after(caught, first)
    opted_out = insert(log).values(id=9, msg="stale").execution_options(unfenced=True)
    with pytest.raises(TransactionRefusedError) as caught:
        await conn.execute(opted_out)  # the opt-out does not reopen a refused transaction
    refused_after(caught, first)
    guard = AsyncRowGuard(conn, m.Item.__table__)  # the guards let the error through
    with pytest.raises(TransactionRefusedError) as caught:
        await guard.update((2,), 99, {"v": 0})
    refused_after(caught, first)
    with pytest.raises(TransactionRefusedError) as caught:
        await AsyncFenceRegister(conn, m.register).claim("item:2", 99)
    refused_after(caught, first)
    s.add(m.Log(id=5, msg="stale"))
    with pytest.raises(TransactionRefusedError) as caught:
        await s.flush()
    refused_after(caught, first)
    for _ in range(2):
        with pytest.raises(TransactionRefusedError) as caught:
            await s.commit()
        refused_after(caught, first)


async def test_a_refused_claim_refuses_every_later_statement_and_the_commit(
    engine: AsyncEngine, models: Models
) -> None:
    m = models
    before = await snapshot(engine, m)
    async with session_of(engine) as s:
        bind(s, token=10, scope="item:1", register=m.register, unfenced=[m.Log])
        with pytest.raises(StaleTokenError) as first:
            await s.get(m.Item, 1)  # the claim runs first, and is refused
        conn = await s.connection()
        await carry_on(s, conn, m, first.value)
        unbind(s)  # without the binding: still refused
        with pytest.raises(TransactionRefusedError):
            await s.commit()
        await s.rollback()
    assert await snapshot(engine, m) == before


async def test_after_the_rollback_the_next_transaction_claims_again(
    engine: AsyncEngine, models: Models
) -> None:
    m = models
    async with session_of(engine) as s:
        bind(s, token=10, scope="item:1", register=m.register)
        with pytest.raises(StaleTokenError):
            await s.get(m.Item, 1)
        await s.rollback()
        with pytest.raises(StaleTokenError):  # claimed again, and refused again
            await s.execute(select(m.Item))
        await s.rollback()
        unbind(s)
        bind(s, token=12, scope="item:1", register=m.register)
        (await s.get(m.Item, 1)).v = 12
        await s.commit()
    assert (await snapshot(engine, m))[0][0] == (1, 12, 12, False)


async def test_a_lease_revoked_elsewhere_leaves_the_holder_refused(
    engine: AsyncEngine, models: Models
) -> None:
    """The lease is revoked and the revoking token claimed from another connection (a
    process of its own); the holder's session is refused at its claim, and stays so."""
    m = models
    async with AsyncMemoryLockManager(ttl=30) as manager:
        lease = await manager.acquire("item:1")
        revoked = await manager.revoke("item:1")
        async with engine.begin() as other:
            await AsyncFenceRegister(other, m.register).claim("item:1", revoked)
        before = await snapshot(engine, m)
        async with session_of(engine) as s:
            bind(s, lease, register=m.register, unfenced=[m.Log])
            with pytest.raises(StaleTokenError) as first:
                await s.execute(select(m.Item))
            assert first.value.fence == revoked
            conn = await s.connection()
            await carry_on(s, conn, m, first.value)
            await s.rollback()
        assert await snapshot(engine, m) == before


async def test_a_refused_criteria_write_refuses_the_rest(
    engine: AsyncEngine, models: Models
) -> None:
    """Without the claim: an ORM ``update()``, then a Core one on the session's connection,
    each refused by the rows' fences (a newer holder wrote them)."""
    m = models
    before = await snapshot(engine, m)
    item = m.Item.__table__
    for core in (False, True):
        async with session_of(engine) as s:
            bind(s, token=10, claim=False, unfenced=[m.Log])
            conn = await s.connection()
            core_update = update(item).where(item.c.id == 1).values(v=0)
            orm_update = update(m.Item).where(m.Item.id == 1).values(v=0)
            with pytest.raises(StaleTokenError) as first:
                await (conn if core else s).execute(core_update if core else orm_update)
            await carry_on(s, conn, m, first.value)
            await s.rollback()
            (await s.get(m.Item, 2)).v = 2  # the next transaction works
            await s.commit()
    assert await snapshot(engine, m) == before


async def test_a_refused_flush_in_a_savepoint_refuses_the_rest(
    engine: AsyncEngine, models: Models
) -> None:
    """SQLAlchemy rolls a failed flush back to its savepoint, and the transaction goes on;
    the session hook still refuses it."""
    m = models
    before = await snapshot(engine, m)
    async with session_of(engine) as s:
        bind(s, token=10, claim=False, unfenced=[m.Log])
        conn = await s.connection()
        savepoint = await s.begin_nested()
        (await s.get(m.Item, 1)).v = 10  # its fence is 11
        with pytest.raises(StaleTokenError) as first:
            await savepoint.commit()  # the flush is refused
        await savepoint.rollback()  # back to the savepoint: the transaction goes on
        await carry_on(s, conn, m, first.value)
        await s.rollback()
    assert await snapshot(engine, m) == before


async def test_a_refused_flush_refuses_the_sessions_connection(
    engine: AsyncEngine, models: Models
) -> None:
    """Outside a savepoint SQLAlchemy rolls the transaction back itself and refuses the
    session's calls with its ``PendingRollbackError`` (which names the fence's error); a
    connection the code took from the session before is refused by the hook."""
    m = models
    before = await snapshot(engine, m)
    log = m.Log.__table__
    async with session_of(engine) as s:
        bind(s, token=10, claim=False, unfenced=[m.Log])
        conn = await s.connection()
        (await s.get(m.Item, 1)).v = 10
        with pytest.raises(StaleTokenError) as first:
            await s.flush()
        with pytest.raises(TransactionRefusedError) as caught:
            await conn.execute(insert(log).values(id=6, msg="stale"))
        refused_after(caught, first.value)
        with pytest.raises(PendingRollbackError, match="token 10"):
            await s.commit()
        await s.rollback()
    assert await snapshot(engine, m) == before


async def test_a_lease_lost_at_commit_stays_refused(engine: AsyncEngine, models: Models) -> None:
    m = models
    before = await snapshot(engine, m)
    clock = ManualClock()
    async with AsyncMemoryLockManager(clock=clock, ttl=5) as manager:
        lease = await manager.acquire("item:1")
        async with session_of(engine) as s:
            bind(s, lease, register=m.register, unfenced=[m.Log])
            (await s.get(m.Item, 1)).v = 99
            clock.advance(10)
            with pytest.raises(LeaseLostError) as first:
                await s.commit()
            unbind(s)  # no binding, so no lease to check: still refused
            with pytest.raises(TransactionRefusedError) as caught:
                await s.commit()
            refused_after(caught, first.value)
            conn = await s.connection()
            await carry_on(s, conn, m, first.value)
            await s.rollback()
    after = await snapshot(engine, m)
    assert after[:2] == before[:2]


async def test_a_refused_read_check_refuses_the_rest(engine: AsyncEngine, models: Models) -> None:
    """A session bound to a read lease older than the last writer is refused at its check."""
    m = models
    async with session_of(engine) as s:
        bind(s, token=10, scope="item:1", register=m.register, mode="read")
        with pytest.raises(StaleTokenError) as first:
            await s.get(m.Item, 1)
        with pytest.raises(TransactionRefusedError) as caught:
            await s.execute(select(m.Item))
        refused_after(caught, first.value)
        with pytest.raises(TransactionRefusedError):
            await s.commit()
        await s.rollback()


async def test_a_write_refused_before_any_io_does_not_refuse_the_transaction(
    engine: AsyncEngine, models: Models
) -> None:
    """An ``UnfencedWriteError`` (here: raw SQL on a fenced table) is refused before the
    statement leaves; it says nothing about the token, and the transaction goes on."""
    m = models
    item = m.Item.__table__.name
    async with session_of(engine) as s:
        bind(s, token=12, scope="item:1", register=m.register)
        with pytest.raises(FenceError) as caught:
            await s.execute(text(f"UPDATE {item} SET v = 0"))
        assert not isinstance(caught.value, TransactionRefusedError)
        (await s.get(m.Item, 1)).v = 12
        await s.commit()
    assert (await snapshot(engine, m))[0][0] == (1, 12, 12, False)


def test_the_error_pickles_with_the_first_one() -> None:
    first = StaleTokenError("item:1", 10, 11, mapper=None)
    first.mapper = object()  # type: ignore[assignment]
    err = TransactionRefusedError("refused", first=first)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is TransactionRefusedError
    assert type(back).__module__ == "fence"
    assert isinstance(back, FenceError)
    assert str(back) == str(err)
    assert isinstance(back.first, StaleTokenError)
    assert (back.first.token, back.first.fence, back.first.mapper) == (10, 11, None)


async def test_a_refused_transaction_claims_nothing_more(
    engine: AsyncEngine, models: Models
) -> None:
    """Refused at its commit before it had a connection (its lease was lost), the
    transaction's first statement opens one: nothing is claimed on it."""
    m = models
    clock = ManualClock()
    events = EventBus()
    recorder = EventRecorder(events)
    async with AsyncMemoryLockManager(clock=clock, ttl=5) as manager:
        lease = await manager.acquire("item:1")
        async with session_of(engine) as s:
            bind(s, lease, register=m.register, events=events)
            clock.advance(10)
            with pytest.raises(LeaseLostError):
                await s.commit()
            with pytest.raises(TransactionRefusedError):
                await s.execute(select(m.Item))
            conn = (await s.connection()).sync_connection  # unasync: conn = s.connection()
            assert conn is not None
            state = conn.connection.info.get(_STATE_KEY)
            assert state is None or state.found is None  # no claim in flight (psycopg)
            await s.rollback()
    assert recorder.events == []  # no claim judged (SQLite)
