"""SQLAlchemy Core statements of the SQL guard, built once for sync and async. No I/O.

Every statement here keeps the acceptance rule (C4) inside the database: the write happens
only where ``fence <= :token`` holds, and sets ``fence = :token`` in the same statement.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    ColumnElement,
    Insert,
    MetaData,
    Select,
    String,
    Table,
    Update,
    and_,
    bindparam,
    case,
    false,
    func,
    or_,
    select,
    text,
    true,
    tuple_,
    union_all,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite

from fence._errors import ConfigurationError

from ._sql_common import (
    DEFAULT_FENCE_COLUMN,
    DEFAULT_REGISTER_TABLE,
    DEFAULT_TOMBSTONE_COLUMN,
    key_values,
    row_scope,
)

__all__ = [
    "DEFAULT_REGISTER",
    "FENCE_INFO",
    "OPTIONAL_INFO",
    "REGISTER_INFO",
    "TOMBSTONE_INFO",
    "RegisterStatements",
    "RowStatements",
    "fence_column",
    "fence_of",
    "fence_register_table",
    "register_statements",
    "row_statements",
    "tombstone_column",
]

#: ``Column.info`` key that marks the fence column made by :func:`fence_column`. ``True``
#: marks a fence; ``False`` says that a column named ``fence`` is not one.
FENCE_INFO = "iofence.fence"
#: ``Column.info`` key that marks the tombstone flag made by :func:`tombstone_column`.
TOMBSTONE_INFO = "iofence.tombstone"
#: ``Table.info`` key that marks a fence register table (:func:`fence_register_table`).
REGISTER_INFO = "iofence.register"
#: ``Column.info`` key set by ``fenced_version()``: without a token the model keeps plain
#: optimistic concurrency instead of raising :class:`fence.TokenRequiredError`.
OPTIONAL_INFO = "iofence.optional"

_UPSERT_DIALECTS = ("postgresql", "sqlite")

_DML = TypeVar("_DML", Insert, Update)

# Maps a value (scalar, tuple or mapping) to key values in key-column order.
Key = Any


def fence_column(name: str = DEFAULT_FENCE_COLUMN, **kwargs: Any) -> Column[int]:
    """A fence column: ``BIGINT NOT NULL DEFAULT 0`` (C4, C9).

    Add it to every table whose rows the guard fences. The guard finds it by this marker
    (or by the name ``fence``). Rows start at 0, so the first token accepted raises them.
    The plain DDL, for migrations, is
    ``ALTER TABLE t ADD COLUMN fence BIGINT NOT NULL DEFAULT 0``.

    Args:
        name: the column name.
        kwargs: passed on to :class:`sqlalchemy.Column` (``comment=...``).

    Example::

        accounts = Table(
            "accounts", metadata,
            Column("id", Integer, primary_key=True),
            Column("balance", Integer, nullable=False),
            fence_column(),
        )
    """
    info = {**kwargs.pop("info", {}), FENCE_INFO: True}
    return Column(
        name,
        BigInteger,
        nullable=False,
        default=0,
        server_default=text("0"),
        info=info,
        **kwargs,
    )


def fence_of(table: Table) -> Column[Any] | None:
    """The fence column of ``table``, or ``None``: the one rule of the row guard and the hook.

    A column marked as a fence (:func:`fence_column`, ``mapped_fence_column()``,
    :func:`fence.adapters.orm.fenced_version`, or ``info={FENCE_INFO: True}``) is the
    fence. Without one, a column named ``fence`` is adopted as the fence: a column that
    looks like a fence is never ignored. Mark it ``info={FENCE_INFO: False}`` if it is
    not one.

    Raises:
        ConfigurationError: more than one column is marked as the fence.
    """
    marked = [c for c in table.columns if c.info.get(FENCE_INFO) is True]
    if len(marked) > 1:
        raise ConfigurationError(
            f"table {table.name} marks {len(marked)} columns as its fence "
            f"({', '.join(c.name for c in marked)}); a row has one fence"
        )
    if marked:
        return marked[0]
    for col in table.columns:
        if DEFAULT_FENCE_COLUMN in (col.key, col.name) and col.info.get(FENCE_INFO) is not False:
            return col
    return None


def tombstone_column(name: str = DEFAULT_TOMBSTONE_COLUMN, **kwargs: Any) -> Column[bool]:
    """A soft-delete flag: ``BOOLEAN NOT NULL DEFAULT FALSE`` (C7).

    With it, a fenced delete keeps the row, and its fence, as a tombstone, so a stale
    writer cannot insert the row again. Fenced updates skip tombstones (``MISSING``); a
    fenced upsert with a current token brings the row back.

    Args:
        name: the column name.
        kwargs: passed on to :class:`sqlalchemy.Column`.
    """
    info = {**kwargs.pop("info", {}), TOMBSTONE_INFO: True}
    return Column(
        name,
        Boolean,
        nullable=False,
        default=False,
        server_default=false(),
        info=info,
        **kwargs,
    )


def fence_register_table(
    metadata: MetaData | None = None, name: str = DEFAULT_REGISTER_TABLE
) -> Table:
    """The table of a fence register: ``(scope VARCHAR(512) PRIMARY KEY, fence BIGINT NOT NULL)``.

    Args:
        metadata: the metadata to attach it to (so ``metadata.create_all`` and Alembic
            autogenerate see it); a private one by default.
        name: the table name.
    """
    return Table(
        name,
        metadata if metadata is not None else MetaData(),
        Column("scope", String(512), primary_key=True),
        Column("fence", BigInteger, nullable=False),
        info={REGISTER_INFO: True},
    )


def _counted(stmt: _DML) -> _DML:
    """Keep ``cursor.rowcount`` for the row-count fallback: SQLAlchemy drops it for INSERT."""
    return stmt.execution_options(preserve_rowcount=True)


def _marked(table: Table, marker: str) -> Column[Any] | None:
    found = [c for c in table.columns if c.info.get(marker)]
    return found[0] if len(found) == 1 else None


def _insertable_without(table: Table, skip: set[str]) -> bool:
    """Whether a row can be inserted giving only the ``skip`` columns."""
    for col in table.columns:
        if col.key in skip or col.nullable:
            continue
        if col.default is not None or col.server_default is not None:
            continue
        if col.autoincrement is True or (
            col.autoincrement == "auto" and col is table.autoincrement_column
        ):
            continue
        return False
    return True


class RowStatements:
    """The statements of the row guard for one table.

    Args:
        table: the table; its rows are the fence scopes.
        fence: the fence column name; default: the :func:`fence_column`, else ``"fence"``.
        tombstone: the soft-delete flag; default: the :func:`tombstone_column`, if any.
        key: the columns that name a row (a primary key or unique constraint); default:
            the primary key.

    Raises:
        ConfigurationError: a named column is missing, or the table has no key.
    """

    def __init__(
        self,
        table: Table,
        *,
        fence: str | None = None,
        tombstone: str | None = None,
        key: Sequence[str] | None = None,
    ) -> None:
        self.table = table
        self.name = table.name
        if table.info.get(REGISTER_INFO):
            raise ConfigurationError(
                f"table {table.name} is a fence register; use FenceRegister, not a row guard"
            )
        if fence is None:
            found = fence_of(table)
        else:
            found = self._need(fence, "fence")
            # Named here, it is the fence everywhere: the session hook and the gate that
            # refuses unfenced writes find it by the same rule.
            found.info[FENCE_INFO] = True
        if found is None:
            raise ConfigurationError(f"table {table.name} has no fence column; add fence_column()")
        self.fence: Column[Any] = found
        self.tombstone = self._column(tombstone, TOMBSTONE_INFO, None, "tombstone")
        if key is None:
            self.key: tuple[Column[Any], ...] = tuple(table.primary_key.columns)
        else:
            self.key = tuple(self._need(name, "key") for name in key)
        if not self.key:
            raise ConfigurationError(
                f"table {table.name} has no primary key; name the key columns with key=[...]"
            )
        self.key_names = tuple(c.key for c in self.key)
        self.key_set = frozenset(self.key_names)
        self.columns = frozenset(c.key for c in table.columns)
        self.guarded = {self.fence.key} | (
            {self.tombstone.key} if self.tombstone is not None else set()
        )
        skip = set(self.key_names) | self.guarded
        self.can_insert_tombstone = self.tombstone is not None and _insertable_without(table, skip)
        self._key_params = tuple(f"_key_{c.key}" for c in self.key)
        self._key_eq = and_(
            *(
                c == bindparam(name, type_=c.type)
                for c, name in zip(self.key, self._key_params, strict=True)
            )
        )
        self._cache: dict[Any, Any] = {}

    def _need(self, name: str, what: str) -> Column[Any]:
        if name not in self.table.c:
            raise ConfigurationError(f"table {self.table.name} has no {what} column {name!r}")
        return self.table.c[name]

    def _column(
        self, name: str | None, marker: str, fallback: str | None, what: str
    ) -> Column[Any] | None:
        if name is not None:
            return self._need(name, what)
        found = _marked(self.table, marker)
        if found is None and fallback is not None and fallback in self.table.c:
            found = self.table.c[fallback]
        return found

    # -- inputs -----------------------------------------------------------------------

    def key_values(self, key: Key) -> tuple[Any, ...]:
        """Normalise a key (scalar, tuple or mapping) to values in key-column order.

        Raises:
            ConfigurationError: the key does not match the key columns.
        """
        return key_values(self.name, self.key_names, key)

    def scope(self, keyvals: Sequence[Any]) -> str:
        """The scope name of a row, e.g. ``accounts(42)``."""
        return row_scope(self.name, keyvals)

    def check_values(self, values: Mapping[str, Any], *, upsert: bool) -> dict[str, Any]:
        """Check the column values of a write; return them as a plain dict.

        Raises:
            ConfigurationError: unknown columns, the fence or tombstone column set by
                hand, key columns changed by an update, or key columns missing from an
                upsert.
        """
        data = dict(values)
        keys_ok = self.key_set.issubset(data) if upsert else self.key_set.isdisjoint(data)
        if keys_ok and self.guarded.isdisjoint(data) and self.columns.issuperset(data):
            return data  # the common case, checked with set operations only
        unknown = [name for name in data if name not in self.table.c]
        if unknown:
            raise ConfigurationError(f"table {self.name} has no columns {unknown}")
        managed = [name for name in data if name in self.guarded]
        if managed:
            raise ConfigurationError(
                f"{managed} of {self.name} are set by the guard from the token; leave them out"
            )
        if upsert:
            missing = [name for name in self.key_names if name not in data]
            if missing:
                raise ConfigurationError(f"an upsert of {self.name} needs the key {missing}")
        elif any(name in data for name in self.key_names):
            raise ConfigurationError(
                f"a fenced update of {self.name} cannot change the key {self.key_names}"
            )
        return data

    def key_params(self, keyvals: Sequence[Any]) -> dict[str, Any]:
        """The bind parameters of :attr:`_key_eq`."""
        return dict(zip(self._key_params, keyvals, strict=True))

    # -- one row ----------------------------------------------------------------------

    def _live(self) -> ColumnElement[bool]:
        return self.tombstone == false() if self.tombstone is not None else true()

    def params(
        self, keyvals: Sequence[Any], token: int, values: Mapping[str, Any]
    ) -> dict[str, Any]:
        """The bind parameters of the cached statements: key, token and values."""
        params = {f"_v_{name}": v for name, v in values.items()}
        params.update(zip(self._key_params, keyvals, strict=True))
        params["_token"] = token
        return params

    def update(self, columns: tuple[str, ...], returning: bool) -> Update:
        """``UPDATE t SET ..., fence = :t WHERE <key> AND fence <= :t [AND NOT deleted]``.

        Built once per set of columns; run it with :meth:`params`.
        """
        cache_key = ("update", columns, returning)
        found = self._cache.get(cache_key)
        if found is None:
            token = bindparam("_token", type_=self.fence.type)
            sets: dict[str, Any] = {
                name: bindparam(f"_v_{name}", type_=self.table.c[name].type) for name in columns
            }
            sets[self.fence.key] = token
            stmt = (
                update(self.table)
                .where(self._key_eq, self.fence <= token, self._live())
                .values(sets)
            )
            found = stmt.returning(*self.table.c) if returning else _counted(stmt)
            self._cache[cache_key] = found
        return found

    def raise_fence(self, *, delete: bool, returning: bool) -> Update:
        """Raise the fence of an existing row (claim, registering read, soft delete).

        Built once; run it with :meth:`params` (no values).
        """
        cache_key = ("raise", delete, returning)
        found = self._cache.get(cache_key)
        if found is None:
            token = bindparam("_token", type_=self.fence.type)
            values: dict[str, Any] = {self.fence.key: token}
            if delete:
                assert self.tombstone is not None
                values[self.tombstone.key] = True
            stmt = update(self.table).where(self._key_eq, self.fence <= token).values(values)
            found = stmt.returning(*self.table.c) if returning else _counted(stmt)
            self._cache[cache_key] = found
        return found

    def probe(self) -> Select[Any]:
        """The diagnostic read: fence and tombstone flag of one row (:meth:`key_params`)."""
        found = self._cache.get("probe")
        if found is None:
            live = self.tombstone if self.tombstone is not None else false()
            found = self._cache["probe"] = select(self.fence, live).where(self._key_eq)
        return found

    def _insert(self, dialect: str) -> Any:
        if dialect == "postgresql":
            return postgresql.insert(self.table)
        if dialect == "sqlite":
            return sqlite.insert(self.table)
        raise ConfigurationError(
            f"fenced inserts and upserts need ON CONFLICT: PostgreSQL or SQLite, not {dialect}"
        )

    def upsert(
        self, dialect: str, token: int, values: Mapping[str, Any], returning: bool
    ) -> Insert:
        """``INSERT ... ON CONFLICT (key) DO UPDATE SET ... WHERE t.fence <= excluded.fence``.

        A tombstone comes back to life when the token passes.
        """
        row = {**values, self.fence.key: token}
        if self.tombstone is not None:
            row[self.tombstone.key] = False
        ins = self._insert(dialect).values(row)
        stmt = ins.on_conflict_do_update(
            index_elements=list(self.key),
            set_={name: ins.excluded[name] for name in row if name not in self.key_names},
            where=self.fence <= ins.excluded[self.fence.key],
        )
        return stmt.returning(*self.table.c) if returning else _counted(stmt)  # type: ignore[no-any-return]

    def insert_tombstone(
        self, dialect: str, keyvals: Sequence[Any], token: int, *, delete: bool, returning: bool
    ) -> Insert:
        """Insert a tombstone holding only the key and the fence, for a row that is absent.

        It fences a key before any data exists (claim, delete, registering read). On a
        conflict it raises the fence of the row that won the race, if the token passes.
        """
        assert self.tombstone is not None
        row = dict(zip(self.key_names, keyvals, strict=True))
        row[self.fence.key] = token
        row[self.tombstone.key] = True
        ins = self._insert(dialect).values(row)
        set_ = {self.fence.key: ins.excluded[self.fence.key]}
        if delete:
            set_[self.tombstone.key] = ins.excluded[self.tombstone.key]
        stmt = ins.on_conflict_do_update(
            index_elements=list(self.key),
            set_=set_,
            where=self.fence <= ins.excluded[self.fence.key],
        )
        return stmt.returning(*self.table.c) if returning else _counted(stmt)  # type: ignore[no-any-return]

    # -- many rows --------------------------------------------------------------------

    def _keys_in(self, keys: Sequence[tuple[Any, ...]]) -> ColumnElement[bool]:
        if len(self.key) == 1:
            return self.key[0].in_([k[0] for k in keys])
        return tuple_(*self.key).in_(keys)

    def _match(self, keyvals: Sequence[Any]) -> ColumnElement[bool]:
        return and_(*(c == v for c, v in zip(self.key, keyvals, strict=True)))

    def update_many(
        self, token: int, items: Sequence[tuple[tuple[Any, ...], dict[str, Any]]], returning: bool
    ) -> Update:
        """One statement that updates every row or none (C6).

        A scalar sub-select locks every target row (``FOR UPDATE``, in key order, so two
        batches cannot deadlock) and counts the rows that pass; it is a one-time filter,
        run before the first row is written. Under READ COMMITTED the locking read returns
        the newest version of each row, so the count sees fences raised concurrently.
        """
        keys = [k for k, _ in items]
        locked = (
            select(self.fence.label("f"), self._live().label("live"))
            .where(self._keys_in(keys))
            .order_by(*self.key)
            .with_for_update()
            .subquery("fence_locked")
        )
        passing = (
            select(func.count())
            .select_from(locked)
            .where(locked.c.f <= token, locked.c.live)
            .scalar_subquery()
        )
        columns = sorted({name for _, values in items for name in values})
        sets: dict[str, Any] = {}
        for name in columns:
            col = self.table.c[name]
            whens = [
                (self._match(k), bindparam(None, values[name], type_=col.type))
                for k, values in items
                if name in values
            ]
            sets[name] = case(*whens, else_=col)
        sets[self.fence.key] = token
        stmt = (
            update(self.table)
            .where(self._keys_in(keys), self.fence <= token, self._live(), passing == len(keys))
            .values(sets)
        )
        return stmt.returning(*self.key) if returning else _counted(stmt)

    def probe_many(self, keys: Sequence[tuple[Any, ...]]) -> Select[Any]:
        """The diagnostic read of a batch: key, fence and tombstone flag of each row."""
        live = self.tombstone if self.tombstone is not None else false()
        return select(*self.key, self.fence, live).where(self._keys_in(keys))

    def upsert_many(
        self,
        dialect: str,
        token: int,
        rows: Sequence[dict[str, Any]],
        keys: Sequence[tuple[Any, ...]],
        returning: bool,
    ) -> Insert:
        """A multi-row fenced upsert, gated by a check of every existing fence (C6).

        The rows come from a ``SELECT ... WHERE <no existing row of the batch is above
        the token>``, so a stale batch inserts nothing. SQLite runs the statement under its
        write lock, which makes the gate exact; on PostgreSQL the caller wraps it in a
        savepoint for the race with a concurrent insert of an absent key.
        """
        names = list(rows[0])
        for row in rows:
            if list(row) != names:
                raise ConfigurationError(
                    f"every row of a batch upsert of {self.name} must set the same columns"
                )
        extra = {self.fence.key: token}
        if self.tombstone is not None:
            extra[self.tombstone.key] = False
        selects = [
            select(
                *(bindparam(None, row[n], type_=self.table.c[n].type).label(n) for n in names),
                *(
                    bindparam(None, v, type_=self.table.c[n].type).label(n)
                    for n, v in extra.items()
                ),
            )
            for row in rows
        ]
        source = (union_all(*selects) if len(selects) > 1 else selects[0]).subquery("fence_rows")
        blocking = (
            select(func.count())
            .select_from(self.table)
            .where(self._keys_in(keys), or_(self.fence.is_(None), self.fence > token))
            .scalar_subquery()
        )
        gated = select(*source.c).where(blocking == 0)
        ins = self._insert(dialect).from_select([*names, *extra], gated)
        stmt = ins.on_conflict_do_update(
            index_elements=list(self.key),
            set_={n: ins.excluded[n] for n in [*names, *extra] if n not in self.key_names},
            where=self.fence <= ins.excluded[self.fence.key],
        )
        return stmt.returning(*self.key) if returning else _counted(stmt)  # type: ignore[no-any-return]


class RegisterStatements:
    """The statements of a fence register table ``(scope PK, fence BIGINT)``.

    Args:
        table: the register table (see :func:`fence_register_table`).
    """

    def __init__(self, table: Table) -> None:
        for name in ("scope", "fence"):
            if name not in table.c:
                raise ConfigurationError(f"fence register {table.name} has no column {name!r}")
        # Written only through the register from now on (the gate refuses other writes).
        table.info[REGISTER_INFO] = True
        self.table = table
        self.name = table.name
        self.scope = table.c.scope
        self.fence = table.c.fence

    def claim(self, dialect: str, scopes: Sequence[str], token: int, returning: bool) -> Insert:
        """``INSERT ... ON CONFLICT (scope) DO UPDATE SET fence = :t WHERE fence <= :t``.

        With several scopes the rows are gated by a check of every existing fence (C6).
        """
        if dialect == "postgresql":
            base: Any = postgresql.insert(self.table)
        elif dialect == "sqlite":
            base = sqlite.insert(self.table)
        else:
            raise ConfigurationError(f"a fence register needs PostgreSQL or SQLite, not {dialect}")
        if len(scopes) == 1:
            ins = base.values(scope=scopes[0], fence=token)
        else:
            selects = [
                select(
                    bindparam(None, s, type_=self.scope.type).label("scope"),
                    bindparam(None, token, type_=self.fence.type).label("fence"),
                )
                for s in scopes
            ]
            source = union_all(*selects).subquery("fence_scopes")
            blocking = (
                select(func.count())
                .select_from(self.table)
                .where(self.scope.in_(list(scopes)), self.fence > token)
                .scalar_subquery()
            )
            ins = base.from_select(["scope", "fence"], select(*source.c).where(blocking == 0))
        stmt = ins.on_conflict_do_update(
            index_elements=[self.scope],
            set_={"fence": ins.excluded.fence},
            where=self.fence <= ins.excluded.fence,
        )
        return stmt.returning(self.scope, self.fence) if returning else _counted(stmt)  # type: ignore[no-any-return]

    def probe(self, scopes: Sequence[str]) -> Select[Any]:
        """The fences of ``scopes``."""
        if len(scopes) == 1:
            return select(self.scope, self.fence).where(self.scope == scopes[0])
        return select(self.scope, self.fence).where(self.scope.in_(list(scopes)))


#: The register table used when none is given: ``fence_register``.
DEFAULT_REGISTER = fence_register_table()

_ROW_CACHE: weakref.WeakKeyDictionary[Table, dict[Any, RowStatements]] = weakref.WeakKeyDictionary()
_REGISTER_CACHE: weakref.WeakKeyDictionary[Table, RegisterStatements] = weakref.WeakKeyDictionary()


def row_statements(
    table: Table, fence: str | None, tombstone: str | None, key: Sequence[str] | None
) -> RowStatements:
    """The :class:`RowStatements` of ``table``, built once per table and options."""
    options = (fence, tombstone, tuple(key) if key is not None else None)
    per_table = _ROW_CACHE.setdefault(table, {})
    found = per_table.get(options)
    if found is None:
        found = per_table[options] = RowStatements(table, fence=fence, tombstone=tombstone, key=key)
    return found


def register_statements(table: Table) -> RegisterStatements:
    """The :class:`RegisterStatements` of ``table``, built once."""
    found = _REGISTER_CACHE.get(table)
    if found is None:
        found = _REGISTER_CACHE[table] = RegisterStatements(table)
    return found
