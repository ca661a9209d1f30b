"""The ORM session hook on SQLite, PostgreSQL and MariaDB, with ``AsyncSession`` (this source) and
``Session`` (the generated twin): fenced flushes, the re-read race, tombstones, criteria
writes, claims, the drop-in for ``version_id_col`` and the lease check before commit.

The interleaving tests bind with ``claim=False``: with the claim, the first holder's
transaction holds the register row, and the second holder's claim waits for it on
PostgreSQL (that is the point of the claim, tested on its own below), which a single
task cannot interleave.
"""

from __future__ import annotations

import pickle
import secrets
from dataclasses import dataclass
from typing import Any

import pytest
from sqlalchemy import BigInteger, Integer, Table, delete, insert, select, update
from sqlalchemy.ext.asyncio import AsyncEngine
from sqlalchemy.ext.asyncio.session import AsyncSession
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.orm.exc import StaleDataError

from fence import (
    ConfigurationError,
    LeaseLostError,
    ManualClock,
    Reason,
    TokenRequiredError,
)
from fence import StaleTokenError as FenceStaleTokenError
from fence._async.memory import AsyncMemoryLockManager
from fence.adapters.orm import (
    StaleTokenError,
    bind,
    fence_column,
    fence_register_table,
    fenced_version,
    tombstone_column,
    unbind,
)


@dataclass
class Models:
    """Mapped classes on tables with names of their own (the PostgreSQL cluster is shared)."""

    Item: Any  # fence_column + tombstone_column
    Plain: Any  # fence_column, no tombstone
    Versioned: Any  # plain version_id_col, the app writes its token as the version
    Dropin: Any  # fenced_version(): the one-line switch from version_id_col
    register: Table
    base: Any


def make_models() -> Models:
    suffix = secrets.token_hex(4)

    class Base(DeclarativeBase):
        pass

    class Item(Base):
        __tablename__ = f"orm_item_{suffix}"
        id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
        v: Mapped[int] = mapped_column(Integer, default=0)
        fence: Mapped[int] = fence_column()
        deleted: Mapped[bool] = tombstone_column()

    class Plain(Base):
        __tablename__ = f"orm_plain_{suffix}"
        id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
        v: Mapped[int] = mapped_column(Integer, default=0)
        fence: Mapped[int] = fence_column()

    class Versioned(Base):
        __tablename__ = f"orm_versioned_{suffix}"
        id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
        v: Mapped[int] = mapped_column(Integer, default=0)
        version: Mapped[int] = mapped_column(BigInteger, nullable=False)
        __mapper_args__ = {"version_id_col": version, "version_id_generator": False}  # noqa: RUF012

    class Dropin(Base):
        __tablename__ = f"orm_dropin_{suffix}"
        id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
        v: Mapped[int] = mapped_column(Integer, default=0)
        fence: Mapped[int] = mapped_column(BigInteger, nullable=False)
        __mapper_args__ = fenced_version(fence)

    register = fence_register_table(Base.metadata, f"orm_register_{suffix}")
    return Models(Item, Plain, Versioned, Dropin, register, Base)


@pytest.fixture
async def models(engine: AsyncEngine) -> Models:
    m = make_models()
    async with engine.begin() as conn:
        md = m.base.metadata
        await conn.run_sync(md.create_all)  # unasync: md.create_all(conn)
    return m


def session_of(engine: AsyncEngine) -> AsyncSession:
    return AsyncSession(engine, expire_on_commit=False)


async def seed(engine: AsyncEngine, m: Models, token: int = 1) -> None:
    async with session_of(engine) as s:
        bind(s, token=token, scope="seed", register=m.register)
        s.add_all([m.Item(id=1, v=1), m.Item(id=2, v=2), m.Plain(id=1, v=1), m.Dropin(id=1, v=1)])
        await s.commit()


async def row(engine: AsyncEngine, table: Table, key: int = 1) -> tuple[Any, ...]:
    async with engine.connect() as conn:
        found = (await conn.execute(select(table).where(table.c.id == key))).first()
        return tuple(found) if found is not None else ()


# -- the session hook ------------------------------------------------------------------


async def test_stale_flush_is_rejected_after_a_newer_holder_committed(
    engine: AsyncEngine, models: Models
) -> None:
    await seed(engine, models)
    table = models.Item.__table__
    async with session_of(engine) as a, session_of(engine) as b:
        bind(a, token=10, claim=False)
        bind(b, token=11, claim=False)
        item_a = await a.get(models.Item, 1)
        item_b = await b.get(models.Item, 1)
        item_b.v = 11
        await b.commit()
        item_a.v = 10
        with pytest.raises(StaleTokenError) as caught:
            await a.commit()
        err = caught.value
        assert isinstance(err, StaleDataError)
        assert isinstance(err, FenceStaleTokenError)
        assert err.mapper is models.Item.__mapper__
        assert (err.key, err.token, err.fence, err.reason) == ((1,), 10, 11, Reason.STALE)
        assert err.scope == f"{table.name}(1)"
        await a.rollback()
        assert await a.get(models.Item, 2) is not None  # the session is usable again
    assert await row(engine, table) == (1, 11, 11, False)


async def fresh_snapshot(session: AsyncSession) -> None:
    """End a transaction that only read, where it reads a snapshot (MariaDB's REPEATABLE
    READ), so that its next read sees what was committed since, as on PostgreSQL (READ
    COMMITTED) and SQLite (one writer)."""
    if session.bind.dialect.name == "mariadb":
        await session.rollback()


async def test_reread_race_moves_an_equality_version_backwards(
    engine: AsyncEngine, models: Models
) -> None:
    """The regression that plain ``version_id_col`` allows and the fence refuses.

    A (token 10) pauses; B (token 11) writes; A wakes, re-reads the row (version 11) and
    writes with the version it read: the equality check passes and the version goes back
    from 11 to 10.
    """
    V = models.Versioned
    async with session_of(engine) as s:
        s.add(V(id=1, v=0, version=1))
        await s.commit()
    async with session_of(engine) as a, session_of(engine) as b:
        stale = await a.get(V, 1)
        newer = await b.get(V, 1)
        newer.v, newer.version = 11, 11
        await b.commit()
        await fresh_snapshot(a)
        await a.refresh(stale)  # A re-reads after the newer write
        assert stale.version == 11
        stale.v, stale.version = 10, 10  # and writes with its own token
        await a.commit()
    assert await row(engine, V.__table__) == (1, 10, 10)  # the stale write won


async def test_reread_race_is_refused_by_the_fence(engine: AsyncEngine, models: Models) -> None:
    await seed(engine, models)
    for model in (models.Item, models.Dropin):
        async with session_of(engine) as a, session_of(engine) as b:
            bind(a, token=10, claim=False)
            bind(b, token=11, claim=False)
            stale = await a.get(model, 1)
            newer = await b.get(model, 1)
            newer.v = 11
            await b.commit()
            await fresh_snapshot(a)
            await a.refresh(stale)  # A re-reads after the newer write: fence 11
            assert stale.fence == 11
            stale.v = 10
            with pytest.raises(StaleTokenError) as caught:
                await a.flush()
            assert (caught.value.token, caught.value.fence) == (10, 11)
            await a.rollback()
        assert (await row(engine, model.__table__))[1:3] == (11, 11)  # never backwards


async def test_write_without_a_token_is_refused(engine: AsyncEngine, models: Models) -> None:
    await seed(engine, models)
    async with session_of(engine) as s:
        (await s.get(models.Item, 1)).v = 5
        with pytest.raises(TokenRequiredError) as caught:
            await s.flush()
        assert caught.value.scope == models.Item.__table__.name
        await s.rollback()
        s.add(models.Plain(id=9, v=9))
        with pytest.raises(TokenRequiredError):
            await s.flush()
        await s.rollback()
        with pytest.raises(TokenRequiredError):
            await s.execute(update(models.Item).values(v=0))
    bound = session_of(engine)
    bind(bound, token=5, claim=False)
    assert unbind(bound) is not None
    async with bound:
        await bound.delete(await bound.get(models.Item, 2))
        with pytest.raises(TokenRequiredError):
            await bound.flush()
    assert (await row(engine, models.Item.__table__))[1] == 1


async def test_equal_token_writes_again_and_fence_follows(
    engine: AsyncEngine, models: Models
) -> None:
    await seed(engine, models, token=5)
    async with session_of(engine) as s:
        bind(s, token=7, claim=False)
        item = await s.get(models.Item, 1)
        for value in (2, 3):  # a holder writes more than once with its token
            item.v = value
            await s.flush()
        assert item.fence == 7
        await s.commit()
    assert await row(engine, models.Item.__table__) == (1, 3, 7, False)


async def test_delete_leaves_a_tombstone_a_stale_writer_cannot_revive(
    engine: AsyncEngine, models: Models
) -> None:
    await seed(engine, models)
    table = models.Item.__table__
    async with session_of(engine) as b:
        bind(b, token=11, claim=False)
        await b.delete(await b.get(models.Item, 1))
        await b.commit()
        assert await b.get(models.Item, 1) is None  # hidden from the ORM
        shown = await b.execute(select(models.Item).execution_options(include_tombstones=True))
        assert {i.id for i in shown.scalars()} == {1, 2}
    assert await row(engine, table) == (1, 1, 11, True)
    async with session_of(engine) as a:
        bind(a, token=10, claim=False)
        a.add(models.Item(id=1, v=666))
        with pytest.raises(StaleTokenError) as caught:
            await a.commit()
        assert (caught.value.key, caught.value.fence) == ((1,), 11)
    assert await row(engine, table) == (1, 1, 11, True)
    async with session_of(engine) as c:
        bind(c, token=12, claim=False)
        c.add(models.Item(id=1, v=12))  # a current token brings the row back
        await c.commit()
    assert await row(engine, table) == (1, 12, 12, False)


async def test_insert_over_a_newer_row_is_refused(engine: AsyncEngine, models: Models) -> None:
    await seed(engine, models, token=20)
    async with session_of(engine) as s:
        bind(s, token=19, claim=False)
        s.add_all([models.Item(id=3, v=3), models.Item(id=2, v=0)])
        with pytest.raises(StaleTokenError) as caught:
            await s.commit()
        assert [(e.scope.endswith("(2)"), e.fence) for e in caught.value.rejected] == [(True, 20)]
    assert await row(engine, models.Item.__table__, 3) == ()  # all or nothing
    assert (await row(engine, models.Item.__table__, 2))[1:3] == (2, 20)


async def test_hard_delete_needs_a_tombstone_or_a_claim(
    engine: AsyncEngine, models: Models
) -> None:
    await seed(engine, models, token=5)
    async with session_of(engine) as s:
        bind(s, token=6, claim=False)
        await s.delete(await s.get(models.Plain, 1))
        with pytest.raises(ConfigurationError, match="tombstone"):
            await s.flush()
    async with session_of(engine) as s:
        bind(s, token=4, scope="plain:1", register=models.register)
        await s.delete(await s.get(models.Plain, 1))
        with pytest.raises(StaleTokenError) as caught:
            await s.flush()
        assert caught.value.fence == 5
    async with session_of(engine) as s:
        bind(s, token=6, scope="plain:1", register=models.register)
        await s.delete(await s.get(models.Plain, 1))
        await s.commit()
    assert await row(engine, models.Plain.__table__) == ()


async def test_criteria_update_and_delete_are_fenced_all_or_nothing(
    engine: AsyncEngine, models: Models
) -> None:
    await seed(engine, models, token=5)
    Item = models.Item
    async with session_of(engine) as s:
        bind(s, token=8, claim=False)
        (await s.get(Item, 2)).v = 20
        await s.commit()  # item 2 now has fence 8
    async with session_of(engine) as s:
        bind(s, token=6, claim=False)
        stmt = update(Item).where(Item.id.in_([1, 2])).values(v=Item.v + 100)
        with pytest.raises(StaleTokenError) as caught:
            await s.execute(stmt)
        assert [(e.key, e.fence, e.reason) for e in caught.value.rejected or (caught.value,)] == [
            ((2,), 8, Reason.STALE)
        ]
        await s.rollback()
        with pytest.raises(StaleTokenError):
            await s.execute(delete(Item).where(Item.id > 0))
        await s.rollback()
        with pytest.raises(ConfigurationError, match="evaluate"):
            await s.execute(stmt, execution_options={"synchronize_session": "evaluate"})
    assert (await row(engine, Item.__table__, 1))[1:3] == (1, 5)  # nothing was written
    async with session_of(engine) as s:
        bind(s, token=9, claim=False)
        result = await s.execute(update(Item).where(Item.id.in_([1, 2])).values(v=Item.v + 1))
        assert result.rowcount == 2  # type: ignore[attr-defined]
        nothing = await s.execute(update(Item).where(Item.id == 99).values(v=0))
        assert nothing.rowcount == 0  # type: ignore[attr-defined]
        await s.execute(delete(Item).where(Item.id == 1))
        await s.commit()
    assert await row(engine, Item.__table__, 1) == (1, 2, 9, True)
    assert await row(engine, Item.__table__, 2) == (2, 21, 9, False)


async def test_bulk_insert_through_execute_is_refused(engine: AsyncEngine, models: Models) -> None:
    async with session_of(engine) as s:
        bind(s, token=5, claim=False)
        with pytest.raises(TokenRequiredError, match="bulk"):
            await s.execute(insert(models.Item), [{"id": 7, "v": 7}])
        with pytest.raises(TokenRequiredError, match="bulk"):
            await s.execute(update(models.Item), [{"id": 1, "v": 7}])


# -- the claim (C8) --------------------------------------------------------------------


async def test_claim_shuts_out_a_stale_holder_before_its_first_read(
    engine: AsyncEngine, models: Models
) -> None:
    await seed(engine, models)
    async with session_of(engine) as b:
        bind(b, token=11, scope="item:1", register=models.register)
        (await b.get(models.Item, 1)).v = 11
        await b.commit()
    async with session_of(engine) as a:
        bind(a, token=10, scope="item:1", register=models.register)
        with pytest.raises(StaleTokenError) as caught:
            await a.get(models.Item, 1)  # the claim runs before this read
        assert (caught.value.scope, caught.value.fence, caught.value.mapper) == ("item:1", 11, None)
        await a.rollback()
        unbind(a)
        bind(a, token=12, scope="item:1", register=models.register)
        assert (await a.get(models.Item, 1)).v == 11
        await a.commit()
    async with engine.connect() as conn:
        fences = (await conn.execute(select(models.register))).all()
        assert [tuple(r) for r in fences if r[0] == "item:1"] == [("item:1", 12)]


async def test_bind_after_the_first_read_is_refused(engine: AsyncEngine, models: Models) -> None:
    await seed(engine, models)
    async with session_of(engine) as s:
        await s.get(models.Item, 1)
        with pytest.raises(ConfigurationError, match="first statement"):
            bind(s, token=5, scope="x", register=models.register)
        with pytest.raises(ConfigurationError, match="scope"):
            bind(AsyncSession(engine), token=5)


# -- the drop-in for version_id_col ------------------------------------------------------


async def test_dropin_without_a_lease_keeps_optimistic_concurrency(
    engine: AsyncEngine, models: Models
) -> None:
    D = models.Dropin
    async with session_of(engine) as s:
        s.add(D(id=5, v=0))
        await s.commit()
        obj = await s.get(D, 5)
        assert obj.fence == 1  # the version starts at 1 and counts up
        obj.v = 1
        await s.commit()
        assert obj.fence == 2
    async with session_of(engine) as a, session_of(engine) as b:
        mine, theirs = await a.get(D, 5), await b.get(D, 5)
        theirs.v = 2
        await b.commit()
        mine.v = 3
        with pytest.raises(StaleDataError) as caught:
            await a.commit()
        assert not isinstance(caught.value, FenceStaleTokenError)  # plain equality check
    async with session_of(engine) as s:
        bind(s, token=1000, claim=False)
        (await s.get(D, 5)).v = 4
        await s.commit()
    assert await row(engine, D.__table__, 5) == (5, 4, 1000)


# -- the lease ---------------------------------------------------------------------------


async def test_commit_checks_the_lease(engine: AsyncEngine, models: Models) -> None:
    await seed(engine, models)
    clock = ManualClock()
    async with AsyncMemoryLockManager(clock=clock, ttl=5) as manager:
        lease = await manager.acquire("item:1")
        async with session_of(engine) as s:
            bind(s, lease, register=models.register)
            (await s.get(models.Item, 1)).v = 99
            clock.advance(10)
            with pytest.raises(LeaseLostError):
                await s.commit()
            await s.rollback()
    assert (await row(engine, models.Item.__table__))[1] == 1


def test_errors_pickle_without_the_mapper() -> None:
    err = StaleTokenError("t(1)", 4, 5, Reason.STALE, mapper=None, key=(1,))
    err.mapper = object()  # type: ignore[assignment]
    back = pickle.loads(pickle.dumps(err))
    assert (back.scope, back.token, back.fence, back.key, back.mapper) == ("t(1)", 4, 5, (1,), None)
    assert str(back) == str(err)
    assert isinstance(back, StaleDataError)
    assert type(back).__module__ == "fence.adapters.orm"
