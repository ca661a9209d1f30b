"""What the session hook fences: tables with a fence column and the classes mapped on them.

A table is fenced when it has a fence column (:func:`fence_of`); a mapped class is fenced
when one of its tables is, and its other tables (joined inheritance) are tied to the fence
row by their key. Both are found once and remembered. The typed column declarations
(:func:`fence_column`, :func:`tombstone_column`) are here too.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    ColumnElement,
    Table,
    false,
    literal,
    select,
    text,
    true,
    tuple_,
)
from sqlalchemy.orm import MappedColumn, Mapper, mapped_column

from fence._errors import ConfigurationError

from .. import _sql_gate as gate
from .._sql_gate import Kind
from .._sql_statements import (
    FENCE_INFO,
    OPTIONAL_INFO,
    TOMBSTONE_INFO,
    RowStatements,
    row_statements,
)

__all__ = [
    "Dependent",
    "MapperInfo",
    "TableInfo",
    "fence_column",
    "mapper_constructed",
    "mapper_info",
    "mapper_of",
    "owner_of",
    "table_info",
    "tables_of",
    "tombstone_column",
]


@dataclass(eq=False)
class TableInfo:
    """A table with a fence column, and the statements the hook runs on it."""

    statements: RowStatements
    optional: bool
    rewrites: weakref.WeakKeyDictionary[Any, Any] = field(default_factory=weakref.WeakKeyDictionary)

    @property
    def table(self) -> Table:
        return self.statements.table

    @property
    def fence(self) -> Column[Any]:
        return self.statements.fence

    @property
    def tombstone(self) -> Column[Any] | None:
        return self.statements.tombstone

    def live(self) -> ColumnElement[bool]:
        return self.tombstone == false() if self.tombstone is not None else true()

    def keys_in(self, keys: Any) -> ColumnElement[bool]:
        """The fence table's key is one of ``keys`` (a select of key columns)."""
        key = self.statements.key
        return key[0].in_(keys) if len(key) == 1 else tuple_(*key).in_(keys)


@dataclass(eq=False)
class Dependent:
    """A table of a fenced class other than the one holding the fence (joined inheritance).

    Attributes:
        table: the table.
        link: pairs of (fence-table key column, this table's column of equal value).
        rewrites: its rewritten flush statements.
    """

    table: Table
    link: tuple[tuple[Column[Any], Column[Any]], ...]
    rewrites: weakref.WeakKeyDictionary[Any, Any] = field(default_factory=weakref.WeakKeyDictionary)

    def exists(self, fenced: TableInfo, *where: ColumnElement[bool]) -> ColumnElement[bool]:
        """``EXISTS`` a fence row of this table's row where ``where`` holds.

        The fence table is always the subquery's own FROM, also when the statement
        around it joins that table already (an ``UPDATE ... FROM``).
        """
        link = (f == d for f, d in self.link)
        query = select(literal(1)).select_from(fenced.table).where(*link, *where)
        return query.correlate_except(fenced.table).exists()


@dataclass(eq=False)
class MapperInfo:
    table: TableInfo  # the table that holds the fence
    attr: str  # the mapped attribute of the fence column
    required: bool  # no token -> TokenRequiredError (else plain optimistic concurrency)
    dependents: dict[Table, Dependent]  # the class's other tables


_TABLES: weakref.WeakKeyDictionary[Table, TableInfo | None] = weakref.WeakKeyDictionary()
_MAPPERS: weakref.WeakKeyDictionary[Mapper[Any], MapperInfo | None] = weakref.WeakKeyDictionary()


def table_info(table: Any) -> TableInfo | None:
    """The fencing of ``table``: ``None`` unless it has a fence column (:func:`fence_of`)."""
    try:
        return _TABLES[table]
    except KeyError:
        pass
    except TypeError:  # not weak-referenceable: not a Table
        return None
    guarded = gate.classify(table)
    info = None
    if guarded is not None and guarded.kind is Kind.FENCED:
        statements = row_statements(table, None, None, None)
        info = TableInfo(statements, optional=bool(statements.fence.info.get(OPTIONAL_INFO)))
    _TABLES[table] = info
    return info


def tables_of(mapper: Mapper[Any]) -> list[Table]:
    return [t for t in mapper.tables if isinstance(t, Table)]


def mapper_info(mapper: Mapper[Any]) -> MapperInfo | None:
    """The fencing of a mapped class: ``None`` unless one of its tables is fenced.

    Raises:
        ConfigurationError: two of its tables hold a fence, or a table of the class cannot
            be linked to the fence row (no column of equal value).
    """
    try:
        return _MAPPERS[mapper]
    except KeyError:
        pass
    fenced = [t for t in tables_of(mapper) if table_info(t) is not None]
    info = None
    if len(fenced) > 1:
        raise ConfigurationError(
            f"{mapper.class_.__name__} has fence columns in {len(fenced)} tables "
            f"({', '.join(t.name for t in fenced)}); a row has one fence: keep it in the "
            "base table"
        )
    if fenced:
        tinfo = table_info(fenced[0])
        assert tinfo is not None
        prop = mapper.get_property_by_column(tinfo.fence)
        dependents = {}
        for table in tables_of(mapper):
            if table is not tinfo.table:
                dependents[table] = _dependent(mapper, tinfo, table)
        info = MapperInfo(tinfo, prop.key, not tinfo.optional, dependents)
    _MAPPERS[mapper] = info
    return info


def _dependent(mapper: Mapper[Any], tinfo: TableInfo, table: Table) -> Dependent:
    link = []
    for key_col in tinfo.statements.key:
        prop = mapper.get_property_by_column(key_col)
        same = [c for c in getattr(prop, "columns", ()) if getattr(c, "table", None) is table]
        if not same:
            raise ConfigurationError(
                f"{mapper.class_.__name__}: table {table.name} has no column mapped with "
                f"{tinfo.table.name}.{key_col.name}, so its rows cannot be tied to their fence"
            )
        link.append((key_col, same[0]))
    gate.mark_dependent(table, mapper.class_.__name__)
    return Dependent(table, tuple(link))


def mapper_constructed(mapper: Mapper[Any], class_: type) -> None:
    # Tell the gate about the other tables of a fenced class as soon as it is mapped, so
    # raw SQL on them is refused before the class is first used.
    tables = tables_of(mapper)
    if len(tables) > 1 and any(table_info(t) is not None for t in tables):
        for table in tables:
            if table_info(table) is None:
                gate.mark_dependent(table, class_.__name__)


def owner_of(table: Table) -> tuple[TableInfo, Dependent] | None:
    """The fence of a dependent table: from the fenced class it belongs to."""
    for mapper in list(_MAPPERS):
        info = _MAPPERS.get(mapper)
        if info is not None and table in info.dependents:
            return info.table, info.dependents[table]
    return None


def mapper_of(info: TableInfo) -> Mapper[Any] | None:
    """The mapped class whose fence is in ``info``'s table (for the errors it raises)."""
    for mapper, found in list(_MAPPERS.items()):
        if found is not None and found.table is info:
            return mapper
    return None


# -- declaring the columns, typed -------------------------------------------------------


def fence_column(name: str | None = None, **kwargs: Any) -> MappedColumn[int]:
    """The fence column of a mapped class: ``BIGINT NOT NULL DEFAULT 0`` (C4, C9).

    The typed twin of :func:`fence.adapters.sql.fence_column`, for SQLAlchemy 2's
    annotated declarative style; it passes ``mypy --strict``::

        class Account(Base):
            __tablename__ = "accounts"
            id: Mapped[int] = mapped_column(primary_key=True)
            balance: Mapped[int]
            fence: Mapped[int] = fence_column()

    A column named ``fence`` is a fence even unmarked (:func:`fence_of`); this marks it
    under any name. The plain DDL, for migrations, is
    ``ALTER TABLE t ADD COLUMN fence BIGINT NOT NULL DEFAULT 0``.

    Args:
        name: the column name in the database (default: the attribute's name).
        kwargs: passed on to :func:`~sqlalchemy.orm.mapped_column` (``comment=...``).
    """
    kwargs["info"] = {**kwargs.get("info", {}), FENCE_INFO: True}
    kwargs.update(nullable=False, default=0, server_default=text("0"))
    if name is None:
        return mapped_column(BigInteger, **kwargs)
    return mapped_column(name, BigInteger, **kwargs)


def tombstone_column(name: str | None = None, **kwargs: Any) -> MappedColumn[bool]:
    """A soft-delete flag of a mapped class: ``BOOLEAN NOT NULL DEFAULT FALSE`` (C7).

    The typed twin of :func:`fence.adapters.sql.tombstone_column`::

        deleted: Mapped[bool] = tombstone_column()

    With it a fenced delete keeps the row, and its fence, as a tombstone; ORM queries
    skip tombstones (see :data:`INCLUDE_TOMBSTONES`).

    Args:
        name: the column name in the database (default: the attribute's name).
        kwargs: passed on to :func:`~sqlalchemy.orm.mapped_column`.
    """
    kwargs["info"] = {**kwargs.get("info", {}), TOMBSTONE_INFO: True}
    kwargs.update(nullable=False, default=False, server_default=false())
    if name is None:
        return mapped_column(Boolean, **kwargs)
    return mapped_column(name, Boolean, **kwargs)
