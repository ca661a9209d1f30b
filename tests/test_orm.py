"""The ORM session hook beyond the shared sync/async tests: the legacy bulk paths (C9),
Core statements left alone, events, the claim's lock on PostgreSQL (C8), savepoints.
"""

from __future__ import annotations

import secrets
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, Integer, create_engine, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from fence import EventBus, EventKind, Reason, TokenRequiredError
from fence.adapters.orm import (
    StaleTokenError,
    bind,
    fence_column,
    fence_register_table,
    fenced_version,
    tombstone_column,
)
from fence.adapters.sql import RowGuard
from fence.testing import EventRecorder

DIALECTS = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
]


@pytest.fixture(params=DIALECTS)
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'orm.db'}"
    else:
        url = request.getfixturevalue("postgres_url")
    eng = create_engine(url)
    yield eng
    eng.dispose()


class Env:
    def __init__(self, engine: Engine) -> None:
        suffix = secrets.token_hex(4)

        class Base(DeclarativeBase):
            pass

        class Item(Base):
            __tablename__ = f"ormx_item_{suffix}"
            id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
            v: Mapped[int] = mapped_column(Integer, default=0)
            fence: Mapped[int] = fence_column()
            deleted: Mapped[bool] = tombstone_column()

        class Dropin(Base):
            __tablename__ = f"ormx_dropin_{suffix}"
            id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
            v: Mapped[int] = mapped_column(Integer, default=0)
            fence: Mapped[int] = mapped_column(nullable=False)
            __mapper_args__ = fenced_version(fence)

        self.Item: Any = Item
        self.Dropin: Any = Dropin
        self.register = fence_register_table(Base.metadata, f"ormx_register_{suffix}")
        Base.metadata.create_all(engine)
        with Session(engine) as s:
            bind(s, token=1, scope="seed", register=self.register)
            s.add_all([Item(id=1, v=1), Item(id=2, v=2)])
            s.commit()


@pytest.fixture
def env(engine: Engine) -> Env:
    return Env(engine)


def test_legacy_bulk_paths_are_refused(engine: Engine, env: Env) -> None:
    Item = env.Item
    for bound in (True, False):
        with Session(engine) as s:
            if bound:
                bind(s, token=5, claim=False)
            with pytest.raises(TokenRequiredError, match="bulk paths bypass"):
                s.bulk_save_objects([Item(id=3, v=3)])
            s.rollback()
            with pytest.raises(TokenRequiredError, match="bulk"):
                s.bulk_insert_mappings(Item, [{"id": 4, "v": 4}])
            s.rollback()
            with pytest.raises(TokenRequiredError, match="bulk"):
                s.bulk_update_mappings(Item, [{"id": 1, "v": 100}])
            s.rollback()
    with engine.connect() as conn:
        rows = conn.execute(select(Item.__table__.c.id, Item.__table__.c.v)).all()
        assert sorted(tuple(r) for r in rows) == [(1, 1), (2, 2)]
    with Session(engine) as s:  # a drop-in model without a lease: plain SQLAlchemy
        s.bulk_insert_mappings(env.Dropin, [{"id": 7, "v": 7, "fence": 1}])
        s.commit()
        assert s.get(env.Dropin, 7).v == 7


def test_core_writes_need_a_token_and_the_row_guard_is_left_alone(engine: Engine, env: Env) -> None:
    table = env.Item.__table__
    with engine.begin() as conn:
        with pytest.raises(TokenRequiredError):  # Core, outside any session: no token
            conn.execute(table.insert().values(id=9, v=9))
        conn.execute(table.insert().values(id=9, v=9).execution_options(unfenced=True))
        guard = RowGuard(conn, table)
        guard.update(9, 50, {"v": 10})
        with pytest.raises(StaleTokenError.__mro__[1]):  # fence.StaleTokenError
            guard.update(9, 49, {"v": 11})
    with Session(engine) as s:
        bind(s, token=51, claim=False)
        s.get(env.Item, 9).v = 12
        s.commit()
    with engine.connect() as conn:
        assert tuple(conn.execute(select(table).where(table.c.id == 9)).one()) == (9, 12, 51, False)


def test_flushes_report_events(engine: Engine, env: Env) -> None:
    bus = EventBus()
    recorder = EventRecorder(bus)
    with Session(engine) as s:
        bind(s, token=5, claim=False, events=bus)
        s.get(env.Item, 1).v = 10
        s.commit()
    with Session(engine) as s:
        bind(s, token=4, claim=False, events=bus)
        s.get(env.Item, 1).v = 11
        with pytest.raises(StaleTokenError):
            s.commit()
    kinds = [(e.kind, e.source, e.token) for e in recorder.events]
    assert kinds == [(EventKind.WRITE_ACCEPTED, "orm", 5), (EventKind.WRITE_REJECTED, "orm", 4)]
    rejected = recorder.events[-1]
    assert rejected.detail["reason"] == str(Reason.STALE)
    assert rejected.detail["fence"] == 5


def test_a_flush_inside_a_savepoint_is_fenced(engine: Engine, env: Env) -> None:
    with Session(engine) as s:
        bind(s, token=5, claim=False)
        with s.begin_nested():
            s.get(env.Item, 1).v = 10

        def stale_savepoint() -> None:
            with s.begin_nested():
                bind(s, token=3, claim=False)  # swap the token inside the transaction
                s.get(env.Item, 2).v = 20
                s.get(env.Item, 1).v = 30
                s.flush()

        with pytest.raises(StaleTokenError):
            stale_savepoint()
        bind(s, token=5, claim=False)
        s.commit()  # the first savepoint's write; the rolled-back one left nothing
    with engine.connect() as conn:
        table = env.Item.__table__
        rows = conn.execute(select(table.c.id, table.c.v, table.c.fence).order_by("id")).all()
        assert [tuple(r) for r in rows] == [(1, 10, 5), (2, 2, 1)]


@pytest.mark.postgres
def test_the_claim_holds_a_newer_holder_until_the_older_commits(postgres_url: str) -> None:
    """C8 on PostgreSQL: the register row stays locked until the claiming transaction ends.

    A (token 10) claimed and read; B (token 11) binds and reads: its claim waits for A.
    A writes and commits; then B's claim passes and B reads A's write, not the row before it.
    """
    engine = create_engine(postgres_url)
    try:
        env = Env(engine)
        a = Session(engine)
        bind(a, token=10, scope="item:1", register=env.register)
        a.get(env.Item, 1).v = 100  # the claim ran first, and holds the register row
        a.flush()
        seen: list[int] = []
        errors: list[BaseException] = []

        def newer() -> None:
            try:
                with Session(engine) as b:
                    bind(b, token=11, scope="item:1", register=env.register)
                    seen.append(b.get(env.Item, 1).v)
                    b.commit()
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        thread = threading.Thread(target=newer)
        thread.start()
        thread.join(0.3)
        assert thread.is_alive()  # B waits for A's transaction on the register row
        assert seen == []
        a.commit()
        a.close()
        thread.join(10)
        assert not errors
        assert seen == [100]
    finally:
        engine.dispose()
