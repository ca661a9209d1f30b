"""Regression tests: the paths by which a stale or unbound write reached a fenced table.

Each test is one case found by trying the session hook as an adversary would; each write
must now be fenced or refused before any I/O (C9). ``tests/test_write_paths_sql.py``
covers every path for every caller; these pin the exact reproductions.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import (
    BigInteger,
    Column,
    Engine,
    ForeignKey,
    Integer,
    MetaData,
    String,
    Table,
    create_engine,
    delete,
    event,
    exists,
    insert,
    select,
    text,
    union,
    update,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from fence import (
    ConfigurationError,
    StaleTokenError,
    TokenRequiredError,
    UnfencedWriteError,
)
from fence._sync.memory import MemoryLockManager
from fence.adapters._sql_gate import writing_ctes
from fence.adapters.orm import (
    FENCE_INFO,
    UnitOfWork,
    bind,
    fence_column,
    fence_of,
    fence_register_table,
    tombstone_column,
)
from fence.adapters.sql import RowGuard


class Env:
    """A database with a joined-inheritance pair, a typed model and an unfenced model."""

    def __init__(self, engine: Engine) -> None:
        suffix = secrets.token_hex(3)

        class Base(DeclarativeBase):
            pass

        class Animal(Base):
            __tablename__ = f"fc_animal_{suffix}"
            id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
            kind: Mapped[str] = mapped_column(String(20))
            name: Mapped[str] = mapped_column(String(20), default="")
            fence: Mapped[int] = fence_column()
            deleted: Mapped[bool] = tombstone_column()
            __mapper_args__ = {"polymorphic_on": "kind", "polymorphic_identity": "animal"}  # noqa: RUF012

        class Dog(Animal):
            __tablename__ = f"fc_dog_{suffix}"
            id: Mapped[int] = mapped_column(ForeignKey(Animal.id), primary_key=True)
            bark: Mapped[str] = mapped_column(String(20), default="")
            __mapper_args__ = {"polymorphic_identity": "dog"}  # noqa: RUF012

        class Typed(Base):  # the obvious typed rewrite of fence_column()
            __tablename__ = f"fc_typed_{suffix}"
            id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
            v: Mapped[int] = mapped_column(Integer, default=0)
            fence: Mapped[int] = mapped_column(BigInteger, default=0)

        class Audit(Base):  # no fence column
            __tablename__ = f"fc_audit_{suffix}"
            id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
            msg: Mapped[str] = mapped_column(String(40), default="")

        self.Animal, self.Dog, self.Typed, self.Audit = Animal, Dog, Typed, Audit
        self.register = fence_register_table(Base.metadata, f"fc_register_{suffix}")
        self.engine = engine
        Base.metadata.create_all(engine)
        with Session(engine) as s:
            bind(s, token=10, scope="seed", register=self.register)
            s.add_all([Dog(id=1, name="rex", bark="woof"), Typed(id=1, v=1)])
            s.commit()

    def dog(self) -> tuple[Any, ...]:
        with self.engine.connect() as conn:
            animal = self.Animal.__table__
            dog = self.Dog.__table__
            row = conn.execute(
                select(animal.c.fence, animal.c.name, dog.c.bark).join_from(animal, dog)
            ).one()
            return tuple(row)


@pytest.fixture(
    params=[
        "sqlite",
        pytest.param("postgres", marks=pytest.mark.postgres),
        pytest.param("mariadb", marks=pytest.mark.mariadb),
    ]
)
def env(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Env]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'fc.db'}"
    else:
        url = request.getfixturevalue(f"{request.param}_url")
    engine = create_engine(url)
    yield Env(engine)
    engine.dispose()


# -- 1. joined-table inheritance --------------------------------------------------------


def test_joined_subclass_only_flush_with_an_equal_in_memory_fence_is_refused(env: Env) -> None:
    """The stale holder's fence attribute already equals its token: no base UPDATE would
    run, and the subclass UPDATE carried no fence check."""
    with Session(env.engine) as stale:
        bind(stale, token=10, claim=False)
        dog = stale.get(env.Dog, 1)
        assert dog is not None
        assert dog.fence == 10  # its own earlier write
        with Session(env.engine) as newer:  # the lease moved on; the newer holder writes
            bind(newer, token=20, claim=False)
            found = newer.get(env.Dog, 1)
            assert found is not None
            found.name = "max"
            newer.commit()
        dog.bark = "stale"  # a subclass column only
        with pytest.raises(StaleTokenError):
            stale.commit()
    assert env.dog() == (20, "max", "woof")


def test_joined_orm_update_is_fenced(env: Env) -> None:
    stmt = update(env.Dog).where(env.Dog.id == 1).values(bark="bulk")
    with Session(env.engine) as s, pytest.raises(TokenRequiredError):
        s.execute(stmt)
    with Session(env.engine) as s:
        bind(s, token=5, claim=False)
        with pytest.raises(StaleTokenError):
            s.execute(stmt)
    assert env.dog() == (10, "rex", "woof")
    with Session(env.engine) as s:
        bind(s, token=20, claim=False)
        s.execute(stmt)
        s.commit()
    assert env.dog() == (20, "rex", "bulk")


# -- 3. Core and text() on a session -------------------------------------------------------


def test_core_update_on_the_session_connection_is_fenced(env: Env) -> None:
    typed = env.Typed.__table__
    stmt = update(typed).where(typed.c.id == 1).values(v=2)
    with Session(env.engine) as s, pytest.raises(TokenRequiredError):
        s.connection().execute(stmt)
    with Session(env.engine) as s:
        bind(s, token=5, claim=False)
        with pytest.raises(StaleTokenError):
            s.connection().execute(stmt)
    with Session(env.engine) as s:
        bind(s, token=20, claim=False)
        s.connection().execute(stmt)
        s.commit()
    with env.engine.connect() as conn:
        # The current holder's write raised the fence: it used to stay at 0 (C4).
        assert tuple(conn.execute(select(typed.c.v, typed.c.fence)).one()) == (2, 20)


@pytest.mark.parametrize("via", ["session", "connection", "driver"])
def test_raw_sql_writes_are_refused(env: Env, via: str) -> None:
    name = env.Typed.__table__.name
    sql = f"UPDATE {name} SET v = 99"

    def run(s: Session) -> None:
        if via == "session":
            s.execute(text(sql))
        elif via == "connection":
            s.connection().execute(text(sql))
        else:
            s.connection().exec_driver_sql(sql)

    with Session(env.engine) as s, pytest.raises(TokenRequiredError):
        run(s)
    for token in (5, 20):
        with Session(env.engine) as s:
            bind(s, token=token, claim=False)
            with pytest.raises(UnfencedWriteError, match="raw SQL"):
                run(s)
    with Session(env.engine) as s:  # reads pass
        bind(s, token=20, claim=False)
        assert s.execute(text(f"SELECT v FROM {name}")).scalar() == 1
    with Session(env.engine) as s:  # the documented opt-out
        s.execute(text(sql).execution_options(unfenced=True))
        s.commit()
    with env.engine.connect() as conn:
        assert conn.execute(text(f"SELECT v FROM {name}")).scalar() == 99


# -- 4. typed models and one fence rule ------------------------------------------------------


def test_an_unmarked_column_named_fence_is_adopted_by_the_hook_and_the_guard(env: Env) -> None:
    typed = env.Typed.__table__
    assert fence_of(typed) is typed.c.fence
    with Session(env.engine) as s:
        s.add(env.Typed(id=2, v=2))
        with pytest.raises(TokenRequiredError):
            s.commit()  # an unbound insert used to be accepted
    with env.engine.begin() as conn:
        assert RowGuard(conn, typed).statements.fence is typed.c.fence


def test_a_column_named_fence_can_say_it_is_not_one() -> None:
    table = Table(
        "fencing_jobs",
        MetaData(),
        Column("id", Integer, primary_key=True),
        Column("fence", String(20), info={FENCE_INFO: False}),  # a garden fence
    )
    assert fence_of(table) is None


def test_two_marked_fences_are_refused_where_the_table_is_defined() -> None:
    with pytest.raises(ConfigurationError, match="2 columns"):
        Table(
            "two",
            MetaData(),
            Column("id", Integer, primary_key=True),
            Column("a", BigInteger, info={FENCE_INFO: True}),
            Column("b", BigInteger, info={FENCE_INFO: True}),
        )


# -- 5. a bound session writing a model without a fence ----------------------------------------


def test_a_bound_session_refuses_a_model_without_a_fence(env: Env) -> None:
    with Session(env.engine) as s:
        bind(s, token=20, claim=False)
        s.add(env.Audit(id=1, msg="x"))
        with pytest.raises(UnfencedWriteError, match="unfenced="):
            s.commit()
    with Session(env.engine) as s:
        bind(s, token=20, claim=False, unfenced=[env.Audit])
        s.add(env.Audit(id=1, msg="x"))
        s.commit()
    with pytest.raises(ConfigurationError, match="it is fenced"):
        bind(Session(env.engine), token=20, claim=False, unfenced=[env.Typed])


def test_the_unit_of_work_passes_unfenced_on(env: Env) -> None:
    with MemoryLockManager(ttl=5) as manager:
        uow = UnitOfWork(
            manager,
            lambda: Session(env.engine),
            register=env.register,
            unfenced=[env.Audit],
        )
        with uow("typed:1") as s:
            s.add(env.Audit(id=7, msg="ok"))
            found = s.get(env.Typed, 1)
            assert found is not None
            found.v = 5
    with env.engine.connect() as conn:
        assert conn.execute(select(env.Audit.__table__.c.msg)).scalar() == "ok"


# -- 6. a data-modifying CTE riding on a fenced statement -------------------------------------


def _cte_writes(env: Env, what: str) -> Any:
    """A CTE that overwrites a row a newer holder fenced, writes a table the binding does
    not name as unfenced, or lowers a register row."""
    if what == "a newer row":
        typed = env.Typed.__table__
        stmt = update(typed).where(typed.c.id == 1).values(v=66, fence=1).returning(typed.c.id)
    elif what == "an unnamed table":
        audit = env.Audit.__table__
        stmt = insert(audit).values(id=9, msg="cte").returning(audit.c.id)
    else:
        reg = env.register
        stmt = update(reg).values(fence=0).returning(reg.c.scope)
    return stmt.cte("w")


@pytest.mark.parametrize("what", ["a newer row", "an unnamed table", "the register"])
@pytest.mark.parametrize("via", ["orm", "core"])
def test_a_data_modifying_cte_on_a_fenced_statement_is_refused(
    env: Env, what: str, via: str
) -> None:
    """``update(Model)...add_cte(update(other)...cte())`` in a bound session ran the CTE
    unfenced: the hook fenced the statement's own table and sent the rest as it was."""
    typed = env.Typed.__table__
    with Session(env.engine) as s:  # a newer holder writes the row the CTE overwrites
        bind(s, token=20, claim=False)
        s.execute(update(typed).where(typed.c.id == 1).values(v=2))
        s.commit()
    before = _state(env)
    animal = env.Animal.__table__
    with Session(env.engine) as s:
        bind(s, token=30, scope="w", register=env.register)
        if via == "orm":
            stmt = update(env.Animal).where(env.Animal.id == 1).values(name="x")
        else:
            stmt = update(animal).where(animal.c.id == 1).values(name="x")
        with pytest.raises(UnfencedWriteError, match="CTE"):
            s.execute(stmt.add_cte(_cte_writes(env, what)))
        s.rollback()
    assert _state(env) == before


def _shapes() -> dict[str, tuple[Any, int]]:
    """Statements with CTEs hanging in each place SQLAlchemy allows, and how many of them
    write."""
    md = MetaData()
    a = Table("a", md, Column("id", Integer, primary_key=True), Column("v", Integer))
    b = Table("b", md, Column("id", Integer, primary_key=True), Column("v", Integer))
    w = update(b).values(v=1).returning(b.c.id).cte("w")
    reads = select(b.c.id).cte("r")
    textual = text("UPDATE b SET v = 1 RETURNING id").columns(b.c.id).cte("t")
    textual_read = text("SELECT id FROM b").columns(b.c.id).cte("tr")
    nesting = update(b).values(v=2).returning(b.c.id).cte("n", nesting=True)
    return {
        "add_cte": (update(a).values(v=2).add_cte(w), 1),
        "add_cte(nest_here=True)": (delete(a).add_cte(w, nest_here=True), 1),
        "WHERE subquery": (update(a).where(a.c.id.in_(select(w.c.id))).values(v=2), 1),
        "values()": (update(a).values(v=select(w.c.id).scalar_subquery()), 1),
        "RETURNING": (update(a).values(v=2).returning(select(w.c.id).scalar_subquery()), 1),
        "insert().from_select()": (insert(a).from_select(["id"], select(w.c.id)), 1),
        "union": (union(select(a.c.id), select(w.c.id)), 1),
        "exists": (select(exists(select(w.c.id))), 1),
        "a CTE inside a CTE": (select(select(w.c.id).cte("outer")), 1),
        "nesting, in a subquery": (select(select(nesting.c.id).subquery()), 1),
        "textual": (select(textual), 1),
        "two": (update(a).values(v=2).add_cte(w).where(a.c.id.in_(select(nesting.c.id))), 2),
        "a read CTE": (update(a).values(v=2).add_cte(reads), 0),
        "a textual read": (select(textual_read), 0),
    }


@pytest.mark.parametrize("shape", list(_shapes()))
def test_the_gate_finds_the_writing_ctes_of_a_statement_wherever_they_hang(shape: str) -> None:
    stmt, writing = _shapes()[shape]
    assert len(writing_ctes(stmt)) == writing


def test_a_cte_on_a_joined_subclass_update_is_refused_before_any_io(env: Env) -> None:
    """The statement of a joined subclass runs as two (the fence rows first): the CTE is
    refused before the first one, so a commit afterwards has nothing to keep."""
    with Session(env.engine) as s:
        bind(s, token=30, claim=False)
        stmt = update(env.Dog).where(env.Dog.id == 1).values(bark="cte")
        with pytest.raises(UnfencedWriteError, match="CTE"):
            s.execute(stmt.add_cte(_cte_writes(env, "the register")))
        s.commit()
    assert env.dog() == (10, "rex", "woof")


@pytest.mark.postgres
def test_a_cte_writing_a_table_named_unfenced_rides_along(postgres_url: str) -> None:
    """As a statement of its own would: the binding names the table as unfenced (on
    PostgreSQL; SQLite runs no data-modifying CTE)."""
    engine = create_engine(postgres_url)
    try:
        env = Env(engine)
        audit = env.Audit.__table__
        with Session(engine) as s:
            bind(s, token=30, scope="w", register=env.register, unfenced=[env.Audit])
            cte = insert(audit).values(id=9, msg="cte").returning(audit.c.id).cte("w")
            s.execute(update(env.Typed).where(env.Typed.id == 1).values(v=3).add_cte(cte))
            s.commit()
        with engine.connect() as conn:
            assert conn.execute(select(audit.c.msg)).scalar_one() == "cte"
            typed = env.Typed.__table__
            assert tuple(conn.execute(select(typed.c.v, typed.c.fence)).one()) == (3, 30)
    finally:
        engine.dispose()


def _state(env: Env) -> list[list[tuple[Any, ...]]]:
    with env.engine.connect() as conn:
        tables = (env.Typed.__table__, env.Audit.__table__, env.register, env.Animal.__table__)
        return [
            [tuple(r) for r in conn.execute(select(t).order_by(*t.primary_key))] for t in tables
        ]


# -- an unknown flush statement ---------------------------------------------------------------


def test_a_flush_statement_of_an_unknown_shape_is_refused(env: Env) -> None:
    typed = env.Typed.__table__

    def sneak(mapper: Any, connection: Any, target: Any) -> None:
        # Runs inside the flush: a statement the hook did not build and cannot judge.
        connection.execute(update(typed).values(v=0))

    event.listen(env.Typed, "before_update", sneak)
    try:
        with Session(env.engine) as s:
            bind(s, token=20, claim=False)
            found = s.get(env.Typed, 1)
            assert found is not None
            found.v = 3
            with pytest.raises(UnfencedWriteError, match="does not recognise"):
                s.commit()
    finally:
        event.remove(env.Typed, "before_update", sneak)
    with env.engine.connect() as conn:
        assert conn.execute(select(typed.c.v)).scalar() == 1


# -- row counts SQLite reports late ------------------------------------------------------------


def test_a_fenced_insert_with_returning_on_sqlite_is_judged_by_its_rows(tmp_path: Path) -> None:
    """An integer primary key makes SQLAlchemy send ``INSERT ... RETURNING``; sqlite3 counts
    those rows only as they are fetched, after the hook judged the statement."""

    class Base(DeclarativeBase):
        pass

    class Counter(Base):
        __tablename__ = "counters"
        id: Mapped[int] = mapped_column(primary_key=True)  # autoincrement: RETURNING id
        n: Mapped[int]
        fence: Mapped[int] = fence_column()
        deleted: Mapped[bool] = tombstone_column()

    fence_register_table(Base.metadata)
    engine = create_engine(f"sqlite:///{tmp_path / 'late.db'}")
    Base.metadata.create_all(engine)
    for token, n in ((5, 1), (5, 2), (6, 3)):  # a new row, the same holder again, a newer one
        with Session(engine) as s:
            bind(s, token=token, scope="c")
            s.add(Counter(id=1, n=n))
            s.commit()
    with Session(engine) as s:
        bind(s, token=5, claim=False)  # the stale holder's upsert is still refused
        s.add(Counter(id=1, n=99))
        with pytest.raises(StaleTokenError):
            s.commit()
    with Session(engine) as s:
        bind(s, token=7, scope="c")
        s.add(Counter(n=4))  # a key the database picks
        s.commit()
    with engine.connect() as conn:
        rows = conn.execute(text("SELECT id, n, fence FROM counters ORDER BY id")).all()
    assert [tuple(r) for r in rows] == [(1, 3, 6), (2, 4, 7)]
    engine.dispose()
