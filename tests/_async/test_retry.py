"""The retry policy (``AsyncRetryPolicy`` here, ``RetryPolicy`` generated) over a real
manager, guard and unit of work: each attempt runs under a new lease with a newer token.

The pauses are played on a manual clock: a holder "pauses" past its lease when the test
advances the clock, and a newer holder takes over for real.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Integer, select
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.ext.asyncio.session import AsyncSession, async_sessionmaker
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from fence import (
    AsyncMemoryLockManager,
    AsyncRetryPolicy,
    BackendError,
    EventBus,
    EventKind,
    LeaseExpiredError,
    LeaseLostError,
    ManualClock,
    Reason,
    StaleTokenError,
    TokenRequiredError,
)
from fence.adapters.orm import AsyncUnitOfWork, binding, fence_column, fence_register_table
from fence.testing import EventRecorder, MemoryGuard
from tests._acompat import join, spawn

SQLITE = "sqlite+aiosqlite"  # unasync: SQLITE = "sqlite"


def no_wait(retry: int) -> float:
    return 0.0


async def test_a_stale_write_runs_again_under_a_new_lease() -> None:
    clock = ManualClock()
    bus = EventBus()
    manager = AsyncMemoryLockManager(clock=clock, events=bus)
    store = MemoryGuard(events=bus)
    tokens: list[int] = []

    async def newer_holder() -> int:
        async with manager.lock("order:42", ttl=10) as lease:
            store.write("order:42", lease.token, "cancelled")
            return lease.token

    @AsyncRetryPolicy(attempts=3, backoff=no_wait, events=bus)
    async def pay(order: str, status: str) -> int:
        async with manager.lock(order, ttl=10) as lease:
            tokens.append(lease.token)
            if len(tokens) == 1:  # the first holder pauses past its lease ...
                clock.advance(11)
                tokens.append(await join(await spawn(newer_holder)))  # ... B takes over
            store.write(order, lease.token, status)  # the first run's write is refused
            return lease.token

    with EventRecorder(bus) as events:
        token = await pay("order:42", "paid")
    first, newer, second = tokens
    assert first < newer < second == token
    assert store.read("order:42") == "paid"
    assert store.fence("order:42") == second
    rejected = events.of(EventKind.WRITE_REJECTED)
    assert [(e.token, e.detail["reason"]) for e in rejected] == [(first, Reason.STALE)]
    (retry,) = events.of(EventKind.RETRYING)
    assert (retry.scope, retry.token, retry.detail) == (
        "order:42",
        first,
        {"attempt": 1, "error": "StaleTokenError"},
    )
    await manager.close()


async def test_an_expired_lease_runs_again_in_a_loop_of_attempts() -> None:
    clock = ManualClock()
    manager = AsyncMemoryLockManager(clock=clock)
    store = MemoryGuard()
    runs: list[int] = []
    async for attempt in AsyncRetryPolicy(attempts=3, backoff=no_wait):
        async with attempt, manager.lock("job:nightly", ttl=10) as lease:
            runs.append(attempt.number)
            if attempt.number == 1:
                clock.advance(9.95)  # the step took too long: less than 1 s left
            lease.check(min_remaining=1.0)
            store.write("job:nightly", lease.token, f"run {attempt.number}")
    assert runs == [1, 2]
    assert store.read("job:nightly") == "run 2"
    await manager.close()


async def test_a_retryable_backend_error_runs_again() -> None:
    manager = AsyncMemoryLockManager()
    manager.backend.fail()  # the first acquire meets a backend that is down

    def backend_comes_back(retry: int) -> float:
        manager.backend.fail(None)
        return 0.0

    runs = 0
    async for attempt in AsyncRetryPolicy(attempts=3, backoff=backend_comes_back):
        async with attempt, manager.lock("r") as lease:
            runs += 1
            assert lease.token > 0
    assert (attempt.number, runs) == (2, 1)
    await manager.close()


@pytest.mark.parametrize(
    "error",
    [
        TokenRequiredError("a write without a token"),
        StaleTokenError("order:42", 5, 5, Reason.MISSING),
        BackendError("bad reply", code="BACKEND"),
        ZeroDivisionError("a bug"),
    ],
    ids=repr,
)
async def test_other_errors_leave_after_one_run(error: Exception) -> None:
    manager = AsyncMemoryLockManager()
    runs = 0

    @AsyncRetryPolicy(attempts=5, backoff=no_wait)
    async def work() -> None:
        nonlocal runs
        async with manager.lock("r"):
            runs += 1
            raise error

    with pytest.raises(type(error)) as raised:
        await work()
    assert raised.value is error
    assert runs == 1
    assert await manager.inspect("r") is None  # the lease was released on the way out
    await manager.close()


async def test_the_last_attempts_error_leaves_unchanged() -> None:
    bus = EventBus()
    manager = AsyncMemoryLockManager()
    delays = [0.001, 0.002]
    errors: list[StaleTokenError] = []

    @AsyncRetryPolicy(attempts=3, backoff=lambda n: delays[n], events=bus)
    async def always_stale() -> None:
        async with manager.lock("r") as lease:
            errors.append(StaleTokenError("r", lease.token, lease.token + 1))
            raise errors[-1]

    with EventRecorder(bus) as events, pytest.raises(StaleTokenError) as raised:
        await always_stale()
    assert len(errors) == 3
    assert raised.value is errors[-1]
    retries = events.of(EventKind.RETRYING)
    assert [e.detail["attempt"] for e in retries] == [1, 2]
    assert [e.duration for e in retries] == delays
    assert [e.token for e in retries] == [errors[0].token, errors[1].token]
    await manager.close()


async def test_the_timeout_stops_retries_on_the_policys_clock() -> None:
    clock = ManualClock()
    manager = AsyncMemoryLockManager(clock=clock)
    runs = 0
    policy = AsyncRetryPolicy(attempts=10, timeout=25, backoff=no_wait, clock=clock)

    async def outlive_the_lease() -> None:
        nonlocal runs
        async for attempt in policy:
            async with attempt, manager.lock("r", ttl=5) as lease:
                runs += 1
                clock.advance(10)  # each run outlives its lease
                lease.check()

    with pytest.raises(LeaseExpiredError):
        await outlive_the_lease()
    assert runs == 3  # at 10 s and 20 s a retry fits in 25 s; at 30 s none does
    await manager.close()


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[AsyncEngine]:
    eng = create_async_engine(f"{SQLITE}:///{tmp_path / 'retry.db'}")
    yield eng
    await eng.dispose()


class Base(DeclarativeBase):
    pass


class Account(Base):
    __tablename__ = "retry_accounts"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    balance: Mapped[int] = mapped_column(Integer)
    fence: Mapped[int] = fence_column()


REGISTER = fence_register_table(Base.metadata, "retry_register")


async def test_a_unit_of_work_whose_commit_finds_the_lease_lost_runs_again(
    engine: AsyncEngine,
) -> None:
    async with engine.begin() as conn:
        await conn.run_sync(Base.metadata.create_all)  # unasync: Base.metadata.create_all(conn)
    clock = ManualClock()
    manager = AsyncMemoryLockManager(clock=clock, ttl=10)
    uow = AsyncUnitOfWork(manager, async_sessionmaker(engine), register=REGISTER)
    async with uow("account:7") as session:
        session.add(Account(id=7, balance=0))
    runs: list[int] = []

    @AsyncRetryPolicy(attempts=3, backoff=no_wait)
    @uow.fenced("account:{account_id}")
    async def deposit(account_id: int, amount: int, *, session: AsyncSession) -> None:
        found = binding(session)
        assert found is not None
        runs.append(found.token)
        (await session.get_one(Account, account_id)).balance += amount
        if len(runs) == 1:
            clock.advance(11)  # paused past the lease: commit refuses, nothing is written

    with EventRecorder() as events:
        await deposit(7, 100)
    async with engine.connect() as conn:
        row = (await conn.execute(select(Account.balance, Account.fence))).one()
    assert tuple(row) == (100, runs[1])  # deposited once, by the second run
    assert runs[0] < runs[1]
    (retry,) = events.of(EventKind.RETRYING)
    assert retry.detail["error"] == LeaseLostError.__name__
    await manager.close()


async def test_the_decorated_function_keeps_its_name_and_signature() -> None:
    policy = AsyncRetryPolicy()

    async def pay(order_id: int, *, note: str = "") -> str:
        """Pay an order."""
        return note

    wrapped: Any = policy(pay)
    assert wrapped.__name__ == "pay"
    assert wrapped.__doc__ == "Pay an order."
    assert wrapped.__wrapped__ is pay
    assert await wrapped(1, note="x") == "x"
