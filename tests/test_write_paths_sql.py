"""The write-path catalogue for SQLAlchemy: every path to a fenced table, fenced or refused (C9).

One row per path a user (or a typo) can take to fenced storage through SQLAlchemy: the
flush (insert, update, delete, upsert, merge, cascades, relationship changes), the bulk
methods, ORM-enabled ``insert`` / ``update`` / ``delete`` with and without a parameter
list, Core through ``session.execute`` and ``session.connection()``, ``text()``,
``exec_driver_sql``, data-modifying CTEs (riding on each kind of statement, wherever they
hang), each inheritance form, composite keys, schema-qualified tables and a fence column
adopted by its name.

Each row runs three times, against the same seeded rows (every fence at 10):

- an **unbound** session: refused (``TokenRequiredError``), nothing written; or, for the
  rows marked so, a plain write of storage that is not fenced;
- a **stale** holder (token 5, without the claim, so the path itself must refuse):
  refused with a ``FenceError``, nothing written;
- the **current** holder (token 20, with the claim): *fenced* (the write lands and every
  row it touched ends at fence 20, through its own fence column or the fence row of its
  class, or through the register claim for a hard delete) or *refused* before any I/O with
  nothing written.

A new path is one new row in ``PATHS``.

Every path that exists on SQLite runs on MariaDB too, with the same verdicts.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path as FsPath
from typing import Any

import pytest
from sqlalchemy import (
    BigInteger,
    Engine,
    ForeignKey,
    Integer,
    MetaData,
    String,
    Table,
    column,
    create_engine,
    delete,
    exists,
    insert,
    literal,
    literal_column,
    select,
    text,
    union,
    update,
)
from sqlalchemy.orm import (
    DeclarativeBase,
    Mapped,
    Session,
    mapped_column,
    relationship,
)
from sqlalchemy.orm.exc import StaleDataError

from fence import FenceError, TokenRequiredError
from fence.adapters.orm import (
    bind,
    fence_column,
    fence_register_table,
    fenced_version,
    tombstone_column,
)

CURRENT, STALE, SEED = 20, 5, 10


@dataclass
class Models:
    """The mapped classes of one database, with table names of their own."""

    base: Any
    register: Table
    classes: dict[str, Any] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        try:
            return self.classes[name]
        except KeyError:
            raise AttributeError(name) from None


def make_models(schema: str | None) -> Models:
    suffix = secrets.token_hex(3)

    class Base(DeclarativeBase):
        pass

    def n(name: str) -> str:
        return f"wp_{name}_{suffix}"

    class Acct(Base):
        __tablename__ = n("acct")
        id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
        v: Mapped[int] = mapped_column(Integer, default=0)
        fence: Mapped[int] = fence_column()
        deleted: Mapped[bool] = tombstone_column()

    class Plain(Base):  # no tombstone: hard deletes need the register claim
        __tablename__ = n("plain")
        id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
        v: Mapped[int] = mapped_column(Integer, default=0)
        fence: Mapped[int] = fence_column()

    class Animal(Base):  # joined inheritance, the fence in the base table
        __tablename__ = n("animal")
        id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
        kind: Mapped[str] = mapped_column(String(20))
        name: Mapped[str] = mapped_column(String(20), default="")
        fence: Mapped[int] = fence_column()
        deleted: Mapped[bool] = tombstone_column()
        __mapper_args__ = {"polymorphic_on": "kind", "polymorphic_identity": "animal"}  # noqa: RUF012

    class Dog(Animal):
        __tablename__ = n("dog")
        id: Mapped[int] = mapped_column(ForeignKey(Animal.id), primary_key=True)
        bark: Mapped[str] = mapped_column(String(20), default="")
        __mapper_args__ = {"polymorphic_identity": "dog"}  # noqa: RUF012

    class Vehicle(Base):  # single-table inheritance
        __tablename__ = n("vehicle")
        id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
        kind: Mapped[str] = mapped_column(String(20))
        v: Mapped[int] = mapped_column(Integer, default=0)
        fence: Mapped[int] = fence_column()
        deleted: Mapped[bool] = tombstone_column()
        __mapper_args__ = {"polymorphic_on": "kind", "polymorphic_identity": "vehicle"}  # noqa: RUF012

    class Car(Vehicle):
        __mapper_args__ = {"polymorphic_identity": "car"}  # noqa: RUF012

    class Shape(Base):  # concrete inheritance: each class its own table and fence
        __tablename__ = n("shape")
        id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
        name: Mapped[str] = mapped_column(String(20), default="")
        fence: Mapped[int] = fence_column()
        deleted: Mapped[bool] = tombstone_column()

    class Circle(Shape):
        __tablename__ = n("circle")
        id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
        name: Mapped[str] = mapped_column(String(20), default="")
        r: Mapped[int] = mapped_column(Integer, default=0)
        fence: Mapped[int] = fence_column()
        deleted: Mapped[bool] = tombstone_column()
        __mapper_args__ = {"concrete": True}  # noqa: RUF012

    class Line(Base):  # a composite primary key
        __tablename__ = n("line")
        order_id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
        line_no: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
        qty: Mapped[int] = mapped_column(Integer, default=0)
        fence: Mapped[int] = fence_column()
        deleted: Mapped[bool] = tombstone_column()

    class Note(Base):  # the obvious typed column, unmarked: adopted as the fence by its name
        __tablename__ = n("note")
        id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
        body: Mapped[str] = mapped_column(String(20), default="")
        fence: Mapped[int] = mapped_column(BigInteger, default=0)

    class Log(Base):  # no fence at all
        __tablename__ = n("log")
        id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
        msg: Mapped[str] = mapped_column(String(20), default="")

    class Parent(Base):  # a cascade delete to fenced children
        __tablename__ = n("parent")
        id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
        fence: Mapped[int] = fence_column()
        deleted: Mapped[bool] = tombstone_column()
        children: Mapped[list[Child]] = relationship(cascade="all, delete-orphan")

    class Child(Base):
        __tablename__ = n("child")
        id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
        parent_id: Mapped[int | None] = mapped_column(ForeignKey(Parent.id))
        fence: Mapped[int] = fence_column()
        deleted: Mapped[bool] = tombstone_column()

    class Holder(Base):  # a relationship change that nulls a fenced child's key
        __tablename__ = n("holder")
        id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
        fence: Mapped[int] = fence_column()
        items: Mapped[list[Item]] = relationship()

    class Item(Base):
        __tablename__ = n("item")
        id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
        holder_id: Mapped[int | None] = mapped_column(ForeignKey(Holder.id))
        fence: Mapped[int] = fence_column()

    class Doc(Base):  # the version_id_col drop-in
        __tablename__ = n("doc")
        id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
        body: Mapped[str] = mapped_column(String(20), default="")
        fence: Mapped[int] = mapped_column(BigInteger, nullable=False)
        __mapper_args__ = fenced_version(fence)

    classes: dict[str, Any] = {
        "Acct": Acct, "Plain": Plain, "Animal": Animal, "Dog": Dog, "Vehicle": Vehicle,
        "Car": Car, "Shape": Shape, "Circle": Circle, "Line": Line, "Note": Note, "Log": Log,
        "Parent": Parent, "Child": Child, "Holder": Holder, "Item": Item, "Doc": Doc,
    }  # fmt: skip
    if schema is not None:

        class Sch(Base):  # a schema-qualified table
            __tablename__ = n("sch")
            __table_args__ = {"schema": schema}  # noqa: RUF012
            id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
            v: Mapped[int] = mapped_column(Integer, default=0)
            fence: Mapped[int] = fence_column()
            deleted: Mapped[bool] = tombstone_column()

        classes["Sch"] = Sch
    register = fence_register_table(Base.metadata, n("register"))
    return Models(Base, register, classes)


def seed_rows(m: Models) -> list[Any]:
    rows = [
        m.Acct(id=1, v=1), m.Acct(id=2, v=2), m.Plain(id=1, v=1),
        m.Dog(id=1, name="rex", bark="woof"), m.Car(id=1, v=1), m.Shape(id=1, name="s"),
        m.Circle(id=1, name="c", r=1), m.Line(order_id=1, line_no=1, qty=1),
        m.Line(order_id=1, line_no=2, qty=2), m.Note(id=1, body="n"), m.Log(id=1, msg="m"),
        m.Parent(id=1, children=[m.Child(id=1), m.Child(id=2)]),
        m.Holder(id=1, items=[m.Item(id=1)]), m.Doc(id=1, body="d"),
    ]  # fmt: skip
    if "Sch" in m.classes:
        rows.append(m.Sch(id=1, v=1))
    return rows


# -- the database of one dialect, reset before each row --------------------------------


@dataclass
class Db:
    engine: Engine
    models: Models
    dialect: str

    def reset(self) -> None:
        md: MetaData = self.models.base.metadata
        with self.engine.begin() as conn:
            for table in reversed(md.sorted_tables):
                conn.execute(delete(table).execution_options(unfenced=True))
        with Session(self.engine) as s:
            m = self.models
            bind(s, token=SEED, scope="seed", register=m.register, unfenced=[m.Log])
            s.add_all(seed_rows(self.models))
            s.commit()

    def snapshot(self) -> dict[str, dict[tuple[Any, ...], dict[str, Any]]]:
        out: dict[str, dict[tuple[Any, ...], dict[str, Any]]] = {}
        md: MetaData = self.models.base.metadata
        with self.engine.connect() as conn:
            for table in md.sorted_tables:
                keys = [c.name for c in table.primary_key.columns]
                rows = {}
                for row in conn.execute(select(table)).mappings():
                    rows[tuple(row[k] for k in keys)] = dict(row)
                out[table.fullname] = rows
        return out


def _open(url: str, models: Models, dialect: str) -> Iterator[Db]:
    engine = create_engine(url)
    with engine.begin() as conn:
        if dialect == "postgres":
            conn.execute(text("CREATE SCHEMA IF NOT EXISTS wp_schema"))
        models.base.metadata.create_all(conn)
    yield Db(engine, models, dialect)
    with engine.begin() as conn:
        models.base.metadata.drop_all(conn)
    engine.dispose()


@pytest.fixture(scope="module")
def sqlite_db(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Db]:
    path: FsPath = tmp_path_factory.mktemp("paths") / "paths.db"
    yield from _open(f"sqlite:///{path}", make_models(None), "sqlite")


@pytest.fixture(scope="module")
def postgres_db(postgres_server: Any) -> Iterator[Db]:
    yield from _open(postgres_server.url, make_models("wp_schema"), "postgres")


@pytest.fixture(scope="module")
def mariadb_db(mariadb_server: Any) -> Iterator[Db]:
    import pymysql

    name = f"wp_{secrets.token_hex(4)}"
    admin = pymysql.connect(
        host="127.0.0.1",
        port=mariadb_server.port,
        user=mariadb_server.USER,
        password=mariadb_server.PASSWORD,
        autocommit=True,
    )
    try:
        with admin.cursor() as cursor:
            cursor.execute(f"CREATE DATABASE {name}")
        yield from _open(mariadb_server.url(name), make_models(None), "mariadb")
        with admin.cursor() as cursor:
            cursor.execute(f"DROP DATABASE {name}")
    finally:
        admin.close()


# -- the catalogue ------------------------------------------------------------------------

Run = Callable[[Session, Models], Any]


@dataclass(frozen=True)
class WritePath:
    """One path to fenced storage and what each caller must see.

    Attributes:
        name: the path.
        run: performs the write in the session (committed by the test).
        current: ``"fenced"`` or ``"refused"`` for the current holder.
        stale: ``"refused"``, or ``"fenced"`` for a row nobody fenced yet (a new key): the
            stale token is then the newest the row has seen, and its write lands at it.
        unbound: ``"refused"``, or ``"plain"`` for storage that is not fenced.
        dialects: where the path exists.
        bind_args: more keyword arguments of ``bind()``.
    """

    name: str
    run: Run
    current: str = "fenced"
    stale: str = "refused"
    unbound: str = "refused"
    dialects: tuple[str, ...] = ("sqlite", "postgres")
    bind_args: dict[str, Any] = field(default_factory=dict)


def _get(s: Session, cls: Any, key: Any) -> Any:
    found = s.get(cls, key)
    assert found is not None
    return found


def _set(s: Session, cls: Any, key: Any, **values: Any) -> None:
    obj = _get(s, cls, key)
    for name, value in values.items():
        setattr(obj, name, value)


def _clear(holder: Any) -> Any:
    holder.items.clear()
    return holder  # kept alive by the caller until commit


def _table(m: Models, name: str) -> Table:
    table: Table = m.classes[name].__table__
    return table


def _core_on_engine(s: Session, m: Models) -> None:
    # A Core write on a connection of its own, outside any session: it never has a token.
    acct = _table(m, "Acct")
    with s.get_bind().connect() as conn:  # type: ignore[union-attr]
        conn.execute(update(acct).where(acct.c.id == 1).values(v=9))
        conn.commit()


def _select_with_cte(s: Session, m: Models) -> None:
    acct = _table(m, "Acct")
    cte = update(acct).where(acct.c.id == 1).values(v=9).returning(acct.c.id).cte()
    s.execute(select(cte))


def _tname(m: Models, name: str) -> str:
    return _table(m, name).fullname


# -- data-modifying CTEs riding on statements ---------------------------------------------
# Each CTE writes one row (or the register) and returns the keys it wrote. A CTE cannot be
# fenced (its rows are not counted), so each path is refused, whatever the statement it
# hangs on; on SQLite, which runs no data-modifying CTE, before it errs.


def _writer(m: Models, name: str, nesting: bool = False) -> Any:
    """A data-modifying CTE: ``Plain`` row 1 or ``Acct`` row 2 written down to fence 1,
    the register's rows lowered to 0, or the log rewritten. Its values are literals, so
    that their names cannot meet those of the statement it rides on."""
    one, sixty_six, zero = literal_column("1"), literal_column("66"), literal_column("0")
    if name == "register":
        reg = m.register
        return update(reg).values(fence=zero).returning(reg.c.scope).cte("w", nesting=nesting)
    table = _table(m, name)
    if name == "Log":
        stmt = update(table).values(msg=literal_column("'cte'"))
    elif name == "Acct":
        stmt = update(table).where(table.c.id == 2).values(v=sixty_six, fence=one)
    else:
        stmt = update(table).where(table.c.id == 1).values(v=sixty_six, fence=one)
    return stmt.returning(table.c.id).cte("w", nesting=nesting)


def _orm_update(m: Models) -> Any:
    return update(m.Acct).where(m.Acct.id == 1).values(v=9)


def _core_update(m: Models) -> Any:
    acct = _table(m, "Acct")
    return update(acct).where(acct.c.id == 1).values(v=9)


def _keys_of(cte: Any) -> Any:
    """The keys a CTE returns, as a subquery; the writes of ``register`` are no keys."""
    column = cte.c.scope if "scope" in cte.c else cte.c.id
    return select(literal_column("0")).where(column.is_not(None))


CTE_SHAPES: dict[str, Callable[[Session, Models], Any]] = {
    "ORM update().add_cte() on another fenced table": lambda s, m: s.execute(
        _orm_update(m).add_cte(_writer(m, "Plain"))
    ),
    "ORM update().add_cte() on its own table": lambda s, m: s.execute(
        _orm_update(m).add_cte(_writer(m, "Acct"))
    ),
    "ORM update().add_cte() lowering the register": lambda s, m: s.execute(
        _orm_update(m).add_cte(_writer(m, "register"))
    ),
    "ORM update().add_cte() on a table without a fence": lambda s, m: s.execute(
        _orm_update(m).add_cte(_writer(m, "Log"))
    ),
    "ORM update().add_cte(nest_here=True)": lambda s, m: s.execute(
        _orm_update(m).add_cte(_writer(m, "Plain"), nest_here=True)
    ),
    "ORM delete().add_cte()": lambda s, m: s.execute(
        delete(m.Acct).where(m.Acct.id == 1).add_cte(_writer(m, "Plain"))
    ),
    "ORM update(), the CTE in a WHERE subquery": lambda s, m: s.execute(
        update(m.Acct).where(m.Acct.id.in_(select(_writer(m, "Plain").c.id))).values(v=9)
    ),
    "ORM update(), the CTE in values()": lambda s, m: s.execute(
        update(m.Acct)
        .where(m.Acct.id == 1)
        .values(v=select(_writer(m, "Plain").c.id).scalar_subquery())
    ),
    "ORM update(), the CTE in a UNION in WHERE": lambda s, m: s.execute(
        update(m.Acct)
        .where(m.Acct.id.in_(union(select(literal(1)), select(_writer(m, "Plain").c.id))))
        .values(v=9)
    ),
    "ORM update(), the CTE in EXISTS": lambda s, m: s.execute(
        _orm_update(m).where(exists(_keys_of(_writer(m, "register"))))
    ),
    "ORM update(), the CTE inside a CTE": lambda s, m: s.execute(
        _orm_update(m).add_cte(select(_writer(m, "Plain").c.id).cte("outer"))
    ),
    "ORM update(), a nesting CTE in a subquery": lambda s, m: s.execute(
        update(m.Acct)
        .where(m.Acct.id.in_(select(_writer(m, "Plain", nesting=True).c.id).subquery().select()))
        .values(v=9)
    ),
    "joined: ORM update().add_cte()": lambda s, m: s.execute(
        update(m.Dog).where(m.Dog.id == 1).values(bark="q").add_cte(_writer(m, "Plain"))
    ),
    "Core update().add_cte() on its own table via session.connection()": lambda s, m: (
        s.connection().execute(_core_update(m).add_cte(_writer(m, "Acct")))
    ),
    "Core update().add_cte() on another fenced table via session.connection()": lambda s, m: (
        s.connection().execute(_core_update(m).add_cte(_writer(m, "Plain")))
    ),
    "Core delete().add_cte() lowering the register via session.execute": lambda s, m: s.execute(
        delete(_table(m, "Acct")).where(_table(m, "Acct").c.id == 2).add_cte(_writer(m, "register"))
    ),
    "legacy Query.update(), the CTE in filter()": lambda s, m: (
        s.query(m.Acct)
        .filter(m.Acct.id.in_(select(_writer(m, "Plain").c.id)))
        .update({"v": 9}, synchronize_session=False)
    ),
    "ORM select(Cls).add_cte()": lambda s, m: s.execute(
        select(m.Acct).add_cte(_writer(m, "Acct"))
    ).all(),
    "SELECT with a CTE lowering the register": lambda s, m: s.execute(
        select(_writer(m, "register"))
    ),
    "a UNION with a data-modifying CTE": lambda s, m: s.execute(
        union(select(literal(1)), select(_writer(m, "Acct").c.id))
    ),
    "SELECT EXISTS of a data-modifying CTE": lambda s, m: s.execute(
        select(exists(select(_writer(m, "Plain").c.id)))
    ),
    "SELECT from a textual data-modifying CTE": lambda s, m: s.execute(
        select(
            text(f"UPDATE {_tname(m, 'Plain')} SET v = 66, fence = 1 RETURNING id")
            .columns(column("id"))
            .cte("w")
        )
    ),
}


def _insert_from_cte(s: Session, m: Models) -> None:
    # Into a table the session may write, from a SELECT on a CTE that writes a fenced one.
    log = _table(m, "Log")
    cte = _writer(m, "Plain")
    s.execute(insert(log).from_select(["id", "msg"], select(cte.c.id + 100, literal("x"))))


def _cte_on_engine(s: Session, m: Models) -> None:
    # On a connection of its own: a table without a fence, and a CTE lowering the register.
    log = _table(m, "Log")
    with s.get_bind().connect() as conn:  # type: ignore[union-attr]
        conn.execute(update(log).values(msg="x").add_cte(_writer(m, "register")))
        conn.commit()


PATHS: list[WritePath] = [
    # the flush
    WritePath("flush insert", lambda s, m: s.add(m.Acct(id=3, v=3)), stale="fenced"),
    WritePath("flush update", lambda s, m: _set(s, m.Acct, 1, v=99)),
    WritePath("flush delete, tombstone", lambda s, m: s.delete(_get(s, m.Acct, 1))),
    WritePath("flush delete, register claim", lambda s, m: s.delete(_get(s, m.Plain, 1))),
    WritePath("flush insert of an existing key", lambda s, m: s.add(m.Acct(id=2, v=7))),
    WritePath("merge", lambda s, m: s.merge(m.Acct(id=1, v=42))),
    WritePath("cascade delete", lambda s, m: s.delete(_get(s, m.Parent, 1))),
    WritePath("relationship change", lambda s, m: _clear(_get(s, m.Holder, 1))),
    # the bulk methods
    WritePath(
        "bulk_save_objects",
        lambda s, m: s.bulk_save_objects([m.Acct(id=4, v=4)]),
        current="refused",
    ),
    WritePath(
        "bulk_insert_mappings",
        lambda s, m: s.bulk_insert_mappings(m.Acct, [{"id": 4, "v": 4}]),
        current="refused",
    ),
    WritePath(
        "bulk_update_mappings",
        lambda s, m: s.bulk_update_mappings(m.Acct, [{"id": 1, "v": 4}]),
        current="refused",
    ),
    # ORM-enabled statements
    WritePath(
        "ORM insert().values()",
        lambda s, m: s.execute(insert(m.Acct).values(id=5, v=5)),
        current="refused",
    ),
    WritePath(
        "ORM insert() with rows",
        lambda s, m: s.execute(insert(m.Acct), [{"id": 5, "v": 5}]),
        current="refused",
    ),
    WritePath(
        "ORM update().where()",
        lambda s, m: s.execute(update(m.Acct).where(m.Acct.id == 1).values(v=9)),
    ),
    WritePath(
        "ORM update() with rows",
        lambda s, m: s.execute(update(m.Acct), [{"id": 1, "v": 9}]),
        current="refused",
    ),
    WritePath(
        "ORM delete().where()",
        lambda s, m: s.execute(delete(m.Acct).where(m.Acct.id == 1)),
    ),
    # Core statements
    WritePath(
        "Core update() via session.execute",
        lambda s, m: s.execute(
            update(_table(m, "Acct")).where(_table(m, "Acct").c.id == 1).values(v=9)
        ),
    ),
    WritePath(
        "Core update() via session.connection()",
        lambda s, m: s.connection().execute(
            update(_table(m, "Acct")).where(_table(m, "Acct").c.id == 1).values(v=9)
        ),
    ),
    WritePath(
        "Core delete() via session.connection()",
        lambda s, m: s.connection().execute(
            delete(_table(m, "Acct")).where(_table(m, "Acct").c.id == 2)
        ),
    ),
    WritePath(
        "Core insert() via session.connection()",
        lambda s, m: s.connection().execute(insert(_table(m, "Acct")).values(id=6, v=6)),
        current="refused",
    ),
    WritePath(
        "Core update() with rows via session.connection()",
        lambda s, m: s.connection().execute(
            update(_table(m, "Acct")).where(_table(m, "Acct").c.id == 1),
            [{"v": 1}, {"v": 2}],
        ),
        current="refused",
    ),
    WritePath("Core update() on a connection of its own", _core_on_engine, current="refused"),
    # raw SQL
    WritePath(
        "text() via session.execute",
        lambda s, m: s.execute(text(f"UPDATE {_tname(m, 'Acct')} SET v = 9 WHERE id = 1")),
        current="refused",
    ),
    WritePath(
        "text() via session.connection()",
        lambda s, m: s.connection().execute(text(f"DELETE FROM {_tname(m, 'Acct')}")),
        current="refused",
    ),
    WritePath(
        "exec_driver_sql",
        lambda s, m: s.connection().exec_driver_sql(f"UPDATE {_tname(m, 'Acct')} SET v = 9"),
        current="refused",
    ),
    WritePath(
        "SELECT with a data-modifying CTE",
        _select_with_cte,
        current="refused",
        dialects=("postgres",),
    ),
    # data-modifying CTEs riding on statements
    *(WritePath(name, run, current="refused") for name, run in CTE_SHAPES.items()),
    WritePath(
        "ORM insert().from_select() of a model without a fence, from a CTE on a fenced table",
        _insert_from_cte,
        current="refused",
        bind_args={"unfenced": ["Log"]},
    ),
    WritePath(
        "Core update() with a CTE lowering the register, on a connection of its own",
        _cte_on_engine,
        current="refused",
    ),
    # inheritance
    WritePath(
        "joined: flush insert",
        lambda s, m: s.add(m.Dog(id=2, name="b", bark="x")),
        stale="fenced",
    ),
    WritePath("joined: flush update, subclass column", lambda s, m: _set(s, m.Dog, 1, bark="y")),
    WritePath("joined: flush update, base column", lambda s, m: _set(s, m.Dog, 1, name="z")),
    WritePath("joined: flush delete", lambda s, m: s.delete(_get(s, m.Dog, 1))),
    WritePath(
        "joined: ORM update()",
        lambda s, m: s.execute(update(m.Dog).where(m.Dog.id == 1).values(bark="q")),
    ),
    WritePath(
        "joined: ORM update() by a base column",
        lambda s, m: s.execute(
            # SQLAlchemy needs the join spelled out for a criterion on the base table.
            update(m.Dog).where(m.Dog.name == "rex", m.Animal.id == m.Dog.id).values(bark="q")
        ),
    ),
    WritePath("joined: ORM delete()", lambda s, m: s.execute(delete(m.Dog).where(m.Dog.id == 1))),
    WritePath(
        "joined: Core update() of the subclass table",
        lambda s, m: s.connection().execute(update(_table(m, "Dog")).values(bark="c")),
        current="refused",
    ),
    WritePath(
        "joined: text() on the subclass table",
        lambda s, m: s.execute(text(f"UPDATE {_tname(m, 'Dog')} SET bark = 'raw'")),
        current="refused",
    ),
    WritePath("single-table: flush update", lambda s, m: _set(s, m.Car, 1, v=5)),
    WritePath(
        "single-table: ORM update()",
        lambda s, m: s.execute(update(m.Car).where(m.Car.id == 1).values(v=6)),
    ),
    WritePath("concrete: flush update", lambda s, m: _set(s, m.Circle, 1, r=5)),
    WritePath(
        "concrete: ORM update()",
        lambda s, m: s.execute(update(m.Circle).where(m.Circle.id == 1).values(r=6)),
    ),
    # keys, schemas, column declarations
    WritePath("composite key: flush update", lambda s, m: _set(s, m.Line, (1, 2), qty=5)),
    WritePath("composite key: flush delete", lambda s, m: s.delete(_get(s, m.Line, (1, 1)))),
    WritePath(
        "composite key: ORM update()",
        lambda s, m: s.execute(update(m.Line).where(m.Line.order_id == 1).values(qty=7)),
    ),
    WritePath(
        "schema-qualified: flush update",
        lambda s, m: _set(s, m.Sch, 1, v=5),
        dialects=("postgres",),
    ),
    WritePath(
        "schema-qualified: ORM update()",
        lambda s, m: s.execute(update(m.Sch).where(m.Sch.id == 1).values(v=6)),
        dialects=("postgres",),
    ),
    WritePath(
        "schema-qualified: text()",
        lambda s, m: s.execute(text(f"UPDATE {_tname(m, 'Sch')} SET v = 7")),
        current="refused",
        dialects=("postgres",),
    ),
    WritePath(
        "adopted fence column: flush insert",
        lambda s, m: s.add(m.Note(id=2, body="x")),
        stale="fenced",
    ),
    WritePath("adopted fence column: flush update", lambda s, m: _set(s, m.Note, 1, body="y")),
    WritePath("drop-in: flush update", lambda s, m: _set(s, m.Doc, 1, body="e"), unbound="plain"),
    # storage without a fence, and the register
    WritePath(
        "model without a fence",
        lambda s, m: s.add(m.Log(id=2, msg="x")),
        current="refused",
        unbound="plain",
    ),
    WritePath(
        "model without a fence, named unfenced",
        lambda s, m: s.add(m.Log(id=2, msg="x")),
        current="plain",
        unbound="plain",
        bind_args={"unfenced": ["Log"]},
    ),
    WritePath(
        "text() on a table without a fence",
        lambda s, m: s.execute(text(f"UPDATE {_tname(m, 'Log')} SET msg = 'raw'")),
        current="refused",
        unbound="plain",
    ),
    WritePath(
        "register: Core update()",
        lambda s, m: s.connection().execute(update(m.register).values(fence=0)),
        current="refused",
    ),
    WritePath(
        "register: text()",
        lambda s, m: s.execute(text(f"DELETE FROM {m.register.name}")),
        current="refused",
    ),
]


# -- the verdicts ----------------------------------------------------------------------


def _attempt(db: Db, path: WritePath, caller: str) -> BaseException | None:
    with Session(db.engine) as s:
        if caller == "current":
            args = dict(path.bind_args)
            if "unfenced" in args:
                args["unfenced"] = [db.models.classes[n] for n in args["unfenced"]]
            bind(s, token=CURRENT, scope="w", register=db.models.register, **args)
        elif caller == "stale":
            bind(s, token=STALE, claim=False)
        try:
            kept = path.run(s, db.models)
            s.commit()
            del kept
        except (FenceError, StaleDataError) as err:
            s.rollback()
            return err
    return None


Snapshot = dict[str, dict[tuple[Any, ...], dict[str, Any]]]


def _assert_fenced(db: Db, before: Snapshot, after: Snapshot, token: int) -> None:
    """Every row the write touched ends at ``token``, through the fence that covers it."""
    m = db.models
    changed = 0
    for table in m.base.metadata.sorted_tables:
        name = table.fullname
        old, new = before[name], after[name]
        touched = {k for k in old.keys() | new.keys() if old.get(k) != new.get(k)}
        if not touched:
            continue
        if table is m.register:
            assert touched == {("w",)}, (name, touched)
            assert new[("w",)]["fence"] == token
            continue
        changed += len(touched)
        for key in touched:
            row = new.get(key)
            if "fence" in table.c:
                if row is None:  # a hard delete: only under the register claim
                    assert "deleted" not in table.c, f"{name}{key} vanished: no tombstone kept"
                    assert after[m.register.fullname][("w",)]["fence"] == token
                else:
                    assert row["fence"] == token, f"{name}{key} written at fence {row['fence']}"
            else:  # another table of a fenced class: its fence row
                fence_row = after[_tname(m, "Animal")].get(key)
                assert fence_row is not None, (name, key)
                assert fence_row["fence"] == token, (name, key)
    assert changed, "nothing was written"


CASES = [
    pytest.param(path, dialect, id=f"{dialect}-{path.name}")
    for path in PATHS
    for dialect in (*path.dialects, *(("mariadb",) if "sqlite" in path.dialects else ()))
]


@pytest.mark.parametrize("caller", ["unbound", "stale", "current"])
@pytest.mark.parametrize(
    ("path", "dialect"),
    [
        pytest.param(
            p.values[0],
            p.values[1],
            id=p.id,
            marks=[getattr(pytest.mark, p.values[1])] if p.values[1] != "sqlite" else [],
        )
        for p in CASES
    ],
)
def test_every_write_path_is_fenced_or_refused(
    request: pytest.FixtureRequest, path: WritePath, dialect: str, caller: str
) -> None:
    found: Db = request.getfixturevalue(f"{dialect}_db")
    found.reset()
    before = found.snapshot()
    err = _attempt(found, path, caller)
    after = found.snapshot()
    expected = {"unbound": path.unbound, "stale": path.stale, "current": path.current}[caller]
    token = STALE if caller == "stale" else CURRENT
    if expected == "refused":
        assert err is not None, f"{path.name} ({caller}): accepted, expected a refusal"
        if caller == "unbound":
            assert isinstance(err, TokenRequiredError), repr(err)
        assert after == before, f"{path.name} ({caller}): refused but something was written"
    elif expected == "plain":
        assert err is None, f"{path.name} ({caller}): {err!r}"
        assert after != before
    else:
        assert err is None, f"{path.name} ({caller}): {err!r}"
        _assert_fenced(found, before, after, token)
