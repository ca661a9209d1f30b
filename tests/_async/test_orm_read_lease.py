"""A session bound to a read lease (C13): every write path is refused before any I/O; the
claim becomes a check at the transaction's start and at its commit, which never raises
the fence; ``AsyncUnitOfWork(mode="read")`` and ``fenced(..., mode="read")`` run read-only
units of work, side by side."""

from __future__ import annotations

import secrets
from typing import Any

import pytest
from sqlalchemy import Integer, event, insert, select, text, update
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.ext.asyncio.session import AsyncSession, async_sessionmaker
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from fence import ConfigurationError, LeaseMode, ReadLeaseError, UnfencedWriteError
from fence._async.memory import AsyncMemoryLockManager
from fence.adapters.orm import (
    AsyncUnitOfWork,
    StaleTokenError,
    bind,
    binding,
    fence_column,
    fence_register_table,
)
from fence.adapters.sql import AsyncFenceRegister
from tests._acompat import join, spawn


class Env:
    """An ``Account`` model (fenced), an ``Audit`` model (no fence) and a register."""

    def __init__(self) -> None:
        suffix = secrets.token_hex(4)

        class Base(DeclarativeBase):
            pass

        class Account(Base):
            __tablename__ = f"read_account_{suffix}"
            id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
            balance: Mapped[int] = mapped_column(Integer)
            fence: Mapped[int] = fence_column()

        class Audit(Base):
            __tablename__ = f"read_audit_{suffix}"
            id: Mapped[int] = mapped_column(Integer, primary_key=True)
            note: Mapped[int] = mapped_column(Integer)

        self.base = Base
        self.Account: Any = Account
        self.Audit: Any = Audit
        self.register = fence_register_table(Base.metadata, f"read_register_{suffix}")


@pytest.fixture
async def env(engine: AsyncEngine) -> Env:
    found = Env()
    async with engine.begin() as conn:
        md = found.base.metadata
        await conn.run_sync(md.create_all)  # unasync: md.create_all(conn)
        seed = found.Account.__table__.insert().values(id=1, balance=10, fence=0)
        await conn.execute(seed.execution_options(unfenced=True))  # a fixture row, no token
    return found


def count_statements(engine: AsyncEngine) -> list[str]:
    """Every statement the engine sends from now on."""
    sent: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        sent.append(statement)

    target = engine.sync_engine  # unasync: target = engine
    event.listen(target, "before_cursor_execute", record)
    return sent


async def register_fence(engine: AsyncEngine, env: Env, scope: str) -> int | None:
    async with engine.connect() as conn:
        return await AsyncFenceRegister(conn, env.register).fence(scope)


async def test_every_write_path_of_a_read_bound_session_is_refused_before_io(
    engine: AsyncEngine, env: Env
) -> None:
    table = env.Account.__table__
    manager = AsyncMemoryLockManager(ttl=10)
    async with manager, manager.read_lock("account:1") as lease, AsyncSession(engine) as session:
        found = bind(session, lease, register=env.register)
        assert found.read_only
        account = await session.get(env.Account, 1)  # the check runs, then the read
        assert account.balance == 10
        sent = count_statements(engine)
        writes: list[tuple[str, Any]] = [
            ("update", update(table).where(table.c.id == 1).values(balance=1)),
            ("orm update", update(env.Account).where(env.Account.id == 1).values(balance=1)),
            ("insert", insert(table).values(id=2, balance=1)),
            ("raw", text(f"UPDATE {table.name} SET balance = 1")),
            ("unfenced table", insert(env.Audit.__table__).values(note=1)),
        ]
        for what, statement in writes:
            with pytest.raises(ReadLeaseError) as info:
                await session.execute(statement)
            assert info.value.token == lease.token, what
            assert isinstance(info.value, UnfencedWriteError)
        conn = await session.connection()
        with pytest.raises(ReadLeaseError):
            await conn.execute(update(table).values(balance=2))
        account.balance = 11
        with pytest.raises(ReadLeaseError):
            await session.flush()
        session.add(env.Audit(note=5))
        with pytest.raises(ReadLeaseError):
            await session.flush()
        assert sent == []  # nothing was sent for any of them
        await session.rollback()
    async with engine.connect() as conn:
        assert (await conn.execute(select(table.c.balance))).scalar_one() == 10


async def test_the_check_never_raises_the_fence_and_refuses_a_stale_reader(
    engine: AsyncEngine, env: Env
) -> None:
    """Readers share the fence: their checks leave it where it is. A reader whose lease a
    newer writer's claim overtook is refused at its first read, and one overtaken during
    its transaction at its commit."""
    async with AsyncMemoryLockManager(ttl=10) as manager:
        uow = AsyncUnitOfWork(manager, async_sessionmaker(engine), register=env.register)
        async with uow("account:1") as session:  # a writer claims: the fence is its token
            (await session.get(env.Account, 1)).balance += 1
            written = binding(session).token  # type: ignore[union-attr]
        async with manager.read_lock("account:1") as lease:
            for _ in range(2):
                async with AsyncSession(engine) as session:
                    bind(session, lease, register=env.register)
                    assert (await session.get(env.Account, 1)).balance == 11
                    await session.commit()
            assert await register_fence(engine, env, "account:1") == written

        stale = await manager.acquire("account:1", mode="read")
        await stale.release()
        async with uow("account:1") as session:  # a newer writer
            (await session.get(env.Account, 1)).balance += 1
        async with AsyncSession(engine) as session:
            bind(session, token=stale.token, scope="account:1", mode="read", register=env.register)
            with pytest.raises(StaleTokenError) as info:
                await session.get(env.Account, 1)
            assert info.value.token == stale.token
            assert info.value.fence is not None
            assert info.value.fence > stale.token

        late = await manager.acquire("account:1", mode="read")
        await late.release()
        async with AsyncSession(engine) as session:
            bind(session, token=late.token, scope="account:1", mode="read", register=env.register)
            assert (await session.get(env.Account, 1)).balance == 12
            async with uow("account:1") as writer:  # overtakes the reader mid-transaction
                (await writer.get(env.Account, 1)).balance += 1
            with pytest.raises(StaleTokenError):
                await session.commit()


async def test_read_units_of_work_share_the_lock_and_refuse_writes(
    engine: AsyncEngine, env: Env
) -> None:
    async with AsyncMemoryLockManager(ttl=10) as manager:
        readers = AsyncUnitOfWork(
            manager, async_sessionmaker(engine), register=env.register, mode="read"
        )
        async with readers("account:1") as first:
            found = binding(first)
            assert found is not None
            assert found.read_only
            assert found.lease is not None
            assert found.lease.mode is LeaseMode.READ

            async def second_reader() -> int:
                async with readers("account:1", mode="read") as session:
                    return int((await session.get(env.Account, 1)).balance)

            assert await join(await spawn(second_reader)) == 10  # beside the first
            assert (await first.get(env.Account, 1)).balance == 10

        @readers.fenced("account:{account_id}")
        async def steal(account_id: int, *, session: AsyncSession) -> None:
            (await session.get(env.Account, account_id)).balance = 0

        with pytest.raises(ReadLeaseError):
            await steal(1)

        writers = AsyncUnitOfWork(manager, async_sessionmaker(engine), register=env.register)

        @writers.fenced("account:{account_id}", mode="read")
        async def peek(account_id: int, *, session: AsyncSession) -> int:
            return int((await session.get(env.Account, account_id)).balance)

        assert await peek(1) == 10
        assert await manager.inspect("account:1") is None
    async with engine.connect() as conn:
        table = env.Account.__table__
        assert (await conn.execute(select(table.c.balance))).scalar_one() == 10


async def test_a_read_lease_cannot_bind_for_writes_but_a_write_lease_can_bind_for_reads(
    engine: AsyncEngine, env: Env
) -> None:
    async with AsyncMemoryLockManager(ttl=10) as manager:
        lease = await manager.acquire("account:1", mode="read")
        session = AsyncSession(engine)
        with pytest.raises(ConfigurationError, match="never writes"):
            bind(session, lease, mode="write", register=env.register)
        await session.close()
        await lease.release()
        async with manager.write_lock("account:1") as lease, AsyncSession(engine) as session:
            found = bind(session, lease, mode="read", register=env.register)
            assert found.read_only
            (await session.get(env.Account, 1)).balance += 1
            with pytest.raises(ReadLeaseError):
                await session.flush()
    assert await register_fence(engine, env, "account:1") is None  # nothing claimed
