"""The unit of work around a session (``AsyncUnitOfWork`` here, ``UnitOfWork`` generated):
acquire, bind, claim, run, commit, release; and what happens when the lease is lost.
"""

from __future__ import annotations

import asyncio  # unasync: import time
import inspect
import secrets
from typing import Any

import pytest
from sqlalchemy import Integer, select, update
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.ext.asyncio.session import AsyncSession, async_sessionmaker
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from fence import ConfigurationError, LeaseLostError, TransactionRefusedError
from fence._async.memory import AsyncMemoryLockManager
from fence.adapters.orm import (
    AsyncUnitOfWork,
    StaleTokenError,
    binding,
    fence_column,
    fence_register_table,
)
from fence.adapters.sql import AsyncFenceRegister


class Env:
    """An ``Account`` model and a register on tables of their own."""

    def __init__(self) -> None:
        suffix = secrets.token_hex(4)

        class Base(DeclarativeBase):
            pass

        class Account(Base):
            __tablename__ = f"uow_account_{suffix}"
            id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
            balance: Mapped[int] = mapped_column(Integer)
            fence: Mapped[int] = fence_column()

        self.base = Base
        self.Account: Any = Account
        self.register = fence_register_table(Base.metadata, f"uow_register_{suffix}")


@pytest.fixture
async def env(engine: AsyncEngine) -> Env:
    found = Env()
    async with engine.begin() as conn:
        md = found.base.metadata
        await conn.run_sync(md.create_all)  # unasync: md.create_all(conn)
        seed = found.Account.__table__.insert().values(id=1, balance=0, fence=0)
        await conn.execute(seed.execution_options(unfenced=True))  # a fixture row, no token
    return found


async def balance(engine: AsyncEngine, env: Env) -> tuple[int, int]:
    async with engine.connect() as conn:
        table = env.Account.__table__
        found = (await conn.execute(select(table.c.balance, table.c.fence))).one()
        return int(found[0]), int(found[1])


async def test_the_unit_of_work_commits_under_the_lease(engine: AsyncEngine, env: Env) -> None:
    async with AsyncMemoryLockManager(ttl=5) as manager:
        uow = AsyncUnitOfWork(manager, async_sessionmaker(engine), register=env.register)
        async with uow("account:1") as session:
            found = binding(session)
            assert found is not None
            assert found.scope == "account:1"
            token = found.token
            (await session.get(env.Account, 1)).balance += 5
        assert await balance(engine, env) == (5, token)
        assert await manager.inspect("account:1") is None  # released

        @uow.fenced("account:{account_id}")
        async def deposit(account_id: int, amount: int, *, session: AsyncSession) -> int:
            (await session.get(env.Account, account_id)).balance += amount
            found = binding(session)
            assert found is not None
            assert found.scope == f"account:{account_id}"
            return found.token

        second = await deposit(1, amount=7)
        assert second > token
        assert await balance(engine, env) == (12, second)


async def test_a_unit_of_work_may_take_the_session_first(engine: AsyncEngine, env: Env) -> None:
    async with AsyncMemoryLockManager(ttl=5) as manager:
        uow = AsyncUnitOfWork(manager, async_sessionmaker(engine), register=env.register)

        @uow.fenced("account:{account_id}")
        async def deposit(session: AsyncSession, account_id: int, amount: int = 1) -> int:
            (await session.get(env.Account, account_id)).balance += amount
            found = binding(session)
            assert found is not None
            assert found.scope == f"account:{account_id}"
            return found.token

        # The caller's signature leaves the session out, as type checkers see it.
        assert list(inspect.signature(deposit).parameters) == ["account_id", "amount"]
        first = await deposit(1, 3)
        second = await deposit(account_id=1)
        assert second > first
        assert await balance(engine, env) == (4, second)


async def test_an_error_rolls_back_and_releases(engine: AsyncEngine, env: Env) -> None:
    async with AsyncMemoryLockManager(ttl=5) as manager:
        uow = AsyncUnitOfWork(manager, async_sessionmaker(engine), register=env.register)

        async def failing() -> None:
            async with uow("account:1") as session:
                (await session.get(env.Account, 1)).balance += 5
                await session.flush()
                _ = 1 / 0

        with pytest.raises(ZeroDivisionError):
            await failing()
        assert await balance(engine, env) == (0, 0)
        assert await manager.inspect("account:1") is None


async def test_a_stale_unit_of_work_is_refused_at_the_claim(engine: AsyncEngine, env: Env) -> None:
    async with AsyncMemoryLockManager(ttl=5) as manager:
        uow = AsyncUnitOfWork(manager, async_sessionmaker(engine), register=env.register)
        async with uow("account:1"):
            pass
        # A newer holder, elsewhere, claimed the scope with a token above every one issued.
        async with engine.begin() as conn:
            await AsyncFenceRegister(conn, env.register).claim("account:1", 2**53 - 1)
        ran = []

        async def stale() -> None:
            async with uow("account:1"):
                ran.append(True)

        with pytest.raises(StaleTokenError) as caught:
            await stale()
        assert not ran  # refused before the block's first read
        assert caught.value.scope == "account:1"


async def test_a_block_that_swallows_a_refusal_commits_nothing(
    engine: AsyncEngine, env: Env
) -> None:
    """The block catches a refused write, as retry code catches a ``StaleDataError``, and
    carries on: the unit of work's commit is refused, nothing is written, and the lease is
    released."""
    table = env.Account.__table__
    newest = 2**53 - 1
    async with engine.begin() as conn:  # the row was fenced by a newer holder
        bump = update(table).values(fence=newest).execution_options(unfenced=True)
        await conn.execute(bump)
    async with AsyncMemoryLockManager(ttl=5) as manager:
        uow = AsyncUnitOfWork(manager, async_sessionmaker(engine), register=env.register)

        async def swallowing() -> None:
            async with uow("account:1") as session:
                try:
                    await session.execute(
                        update(env.Account).where(env.Account.id == 1).values(balance=5)
                    )
                except StaleTokenError:
                    pass
                session.add(env.Account(id=2, balance=7))  # a new row: a fenced upsert

        with pytest.raises(TransactionRefusedError) as caught:
            await swallowing()
        assert isinstance(caught.value.first, StaleTokenError)
        assert await manager.inspect("account:1") is None
    async with engine.connect() as conn:
        rows = (await conn.execute(select(table.c.id, table.c.balance, table.c.fence))).all()
    assert [tuple(r) for r in rows] == [(1, 0, newest)]


async def test_a_lost_lease_stops_the_work_before_commit(engine: AsyncEngine, env: Env) -> None:
    async with AsyncMemoryLockManager(ttl=0.3) as manager:
        uow = AsyncUnitOfWork(manager, async_sessionmaker(engine), register=env.register)
        reached_end = []

        async def slow() -> None:
            async with uow("account:1") as session:
                (await session.get(env.Account, 1)).balance += 5
                await session.flush()
                await asyncio.sleep(1.0)  # unasync: time.sleep(0.5)
                reached_end.append(True)

        with pytest.raises(LeaseLostError):
            await slow()
        assert await balance(engine, env) == (0, 0)  # nothing committed
        # asyncio cancels the work when the lease is lost; a thread checks before commit.
        assert reached_end == []  # unasync: assert reached_end == [True]


def test_a_template_must_name_arguments_of_the_function() -> None:
    uow = AsyncUnitOfWork(AsyncMemoryLockManager(), async_sessionmaker())
    with pytest.raises(ConfigurationError, match="order_id"):

        @uow.fenced("order:{order_id}")
        async def pay(account_id: int, *, session: AsyncSession) -> None:
            pass

    with pytest.raises(ConfigurationError, match="session"):

        @uow.fenced("order:{order_id}")
        async def refund(order_id: int) -> None:
            pass
