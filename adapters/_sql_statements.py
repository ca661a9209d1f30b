"""SQLAlchemy Core statements of the SQL guard, built once for sync and async. No I/O.

Every statement here keeps the acceptance rule (C4) inside the database: the write happens
only where ``fence <= :token`` holds, and sets ``fence = :token`` in the same statement.
"""

from __future__ import annotations

import json
import math
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeVar

from sqlalchemy import (
    ARRAY,
    BigInteger,
    BindParameter,
    Boolean,
    Column,
    ColumnElement,
    Dialect,
    Enum,
    Insert,
    Integer,
    MetaData,
    Row,
    Select,
    String,
    Table,
    Update,
    and_,
    any_,
    bindparam,
    case,
    cast,
    false,
    func,
    literal,
    literal_column,
    or_,
    select,
    text,
    true,
    tuple_,
    update,
)
from sqlalchemy.dialects import mysql
from sqlalchemy.exc import CompileError
from sqlalchemy.ext.compiler import compiles
from sqlalchemy.sql.compiler import SQLCompiler
from sqlalchemy.sql.visitors import InternalTraversal
from sqlalchemy.types import NullType, TypeDecorator, TypeEngine, UserDefinedType

from fence._errors import ConfigurationError
from fence._sql_dialect import DIALECTS

from ._row_statements import Call, Key, ManyCall, RowStatementsBase
from ._sql_common import (
    CHUNK_PARAMS_DEFAULT,
    DEFAULT_FENCE_COLUMN,
    DEFAULT_REGISTER_TABLE,
    DEFAULT_TOMBSTONE_COLUMN,
    chunks,
    one_kind,
)
from ._triggers import ROW_TOKEN_VARIABLE, TOKEN_SETTING, TOKEN_VARIABLE, Judged

__all__ = [
    "DEFAULT_REGISTER",
    "FENCE_INFO",
    "OPTIONAL_INFO",
    "REGISTER_INFO",
    "TOMBSTONE_INFO",
    "DialectRegisterStatements",
    "DialectRowStatements",
    "Key",
    "RegisterStatements",
    "RowStatements",
    "TokenOf",
    "dialect_register_statements",
    "dialect_row_statements",
    "fence_column",
    "fence_of",
    "fence_register_table",
    "fenced_upsert",
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

_DML = TypeVar("_DML", Insert, Update)


class TokenOf(ColumnElement[int]):
    """The fence value of a fenced write: the token, handed to the database's judge (C14)
    as the row is written, in the same statement.

    PostgreSQL: ``CAST(set_config('iofence.token', CAST(:t AS TEXT), true) AS BIGINT)``,
    the transaction-local setting the triggers read, made as the ``SET`` or ``VALUES`` of
    the row is evaluated, before its ``BEFORE`` trigger fires (a row the ``WHERE`` skips
    sets nothing). MariaDB and MySQL: ``(@iofence_row_token := :t)``, the session variable
    the triggers read, assigned as the row is evaluated (the judge's ``AFTER`` trigger
    clears it once the row is written). SQLite: ``iofence_set_token(:t)``, a function
    iofence registers on its connections. Elsewhere: the token itself. It costs no round
    trip.

    On PostgreSQL and SQLite the token is the transaction's from then on. On MariaDB and
    MySQL only with ``transaction=True`` (the session hook's claim):
    ``(@iofence_row_token := (@iofence_token := :t))``, a session variable that outlives
    the transaction, so its caller has the end of the transaction clear it
    (``_judge.hold_token``).

    Args:
        value: the token: a bind parameter or any expression of it.
        type_: the fence column's type (default ``BIGINT``).
        transaction: make it the transaction's token on MariaDB and MySQL too.
    """

    inherit_cache = True
    _traverse_internals = [  # noqa: RUF012 - SQLAlchemy's own attribute
        ("value", InternalTraversal.dp_clauseelement),
        ("transaction", InternalTraversal.dp_boolean),
    ]

    def __init__(
        self, value: ColumnElement[Any], type_: Any = None, *, transaction: bool = False
    ) -> None:
        self.value = value
        self.type = type_ if type_ is not None else BigInteger()
        self.transaction = transaction


@compiles(TokenOf)
def _token_plain(element: TokenOf, compiler: SQLCompiler, **kw: Any) -> str:
    return compiler.process(element.value, **kw)


@compiles(TokenOf, "postgresql")
def _token_postgresql(element: TokenOf, compiler: SQLCompiler, **kw: Any) -> str:
    value = compiler.process(element.value, **kw)
    return f"CAST(pg_catalog.set_config('{TOKEN_SETTING}', CAST({value} AS TEXT), true) AS BIGINT)"


@compiles(TokenOf, "mysql")
@compiles(TokenOf, "mariadb")
def _token_mysql(element: TokenOf, compiler: SQLCompiler, **kw: Any) -> str:
    # The session variable the triggers read, assigned as the row is evaluated; the judge's
    # AFTER trigger clears it once the row is written.
    value = compiler.process(element.value, **kw)
    if element.transaction:
        value = f"({TOKEN_VARIABLE} := {value})"
    return f"({ROW_TOKEN_VARIABLE} := {value})"


@compiles(TokenOf, "sqlite")
def _token_sqlite(element: TokenOf, compiler: SQLCompiler, **kw: Any) -> str:
    return f"iofence_set_token({compiler.process(element.value, **kw)})"


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

    On MariaDB and MySQL the scope's collation is ``utf8mb4_bin``: scopes differing only in
    case are distinct.

    Args:
        metadata: the metadata to attach it to (so ``metadata.create_all`` and Alembic
            autogenerate see it); a private one by default.
        name: the table name.
    """
    # MariaDB and MySQL compare the scope byte for byte (see MYSQL_REGISTER_TABLE_DDL).
    scope = String(512).with_variant(
        mysql.VARCHAR(512, charset="utf8mb4", collation="utf8mb4_bin"), "mysql", "mariadb"
    )
    return Table(
        name,
        metadata if metadata is not None else MetaData(),
        Column("scope", scope, primary_key=True),
        Column("fence", BigInteger, nullable=False),
        info={REGISTER_INFO: True},
    )


#: A checked update: the statement and the names of its value parameters.
_Checked = tuple[Update, tuple[str, ...]]


#: The integers SQLite stores as integers; JSON would carry a larger one as a float.
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


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


def fenced_upsert(
    ins: Any, key: Sequence[Column[Any]], names: Iterable[str], fence: Column[Any]
) -> Any:
    """``ins`` made an upsert: on a conflict on ``key`` it sets the columns ``names`` (by
    key) to the inserted row's values where the row's fence is not above the inserted fence
    (C4), and leaves the row as it is otherwise.

    PostgreSQL and SQLite: ``ON CONFLICT (key) DO UPDATE SET ... WHERE t.fence <=
    excluded.fence``. MariaDB and MySQL have no ``WHERE`` there: ``ON DUPLICATE KEY UPDATE``
    sets every column to ``CASE WHEN t.fence <= VALUES(fence) THEN VALUES(c) ELSE c END``,
    the fence last, since the assignments run left to right and each sees the columns the
    ones before it set; a refused upsert thus sets every column to what it was.
    """
    if hasattr(ins, "on_conflict_do_update"):
        return ins.on_conflict_do_update(
            index_elements=list(key),
            set_={name: ins.excluded[name] for name in names},
            where=fence <= ins.excluded[fence.key],
        )
    table = ins.table
    passes = fence <= ins.inserted[fence.key]
    sets: list[tuple[str, Any]] = [
        (name, case((passes, ins.inserted[name]), else_=table.c[name]))
        for name in names
        if name != fence.key
    ]
    sets.append((fence.key, case((passes, ins.inserted[fence.key]), else_=fence)))
    return ins.on_duplicate_key_update(sets)


class RowStatements(RowStatementsBase):
    """The statements of the row guard for one table, whatever the dialect.

    The guard writes through their :class:`DialectRowStatements`; the session hook uses
    these.

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
        self.tombstone_name = self.tombstone.key if self.tombstone is not None else None
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
        #: The table as the database's judge sees it (C14).
        self.judged = Judged(
            table.name,
            table.schema,
            fence=self.fence.name,
            tombstone=self.tombstone.name if self.tombstone is not None else None,
            optional=bool(self.fence.info.get(OPTIONAL_INFO)),
            key=tuple(c.name for c in table.primary_key.columns) or None,
        )
        self.columns: frozenset[str] | None = frozenset(c.key for c in table.columns)
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
        #: (columns, returning) -> the update of columns that passed :meth:`check_values`
        #: once (the check depends on the names only) and its value parameters' names:
        #: the hot path skips the check.
        self.checked_updates: dict[tuple[tuple[str, ...], bool], _Checked] = {}

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

    def row_params(
        self,
        columns: tuple[str, ...],
        keyvals: Sequence[Any],
        token: int,
        values: Mapping[str, Any],
    ) -> dict[str, Any]:
        """:meth:`params` (by name, so ``columns`` need not give their order)."""
        return self.params(keyvals, token, values)

    def update_params(
        self, names: Sequence[str], keyvals: Sequence[Any], token: int, values: Mapping[str, Any]
    ) -> dict[str, Any]:
        """:meth:`params` with the value parameters' names known (``checked_updates``)."""
        params = dict(zip(names, values.values(), strict=True))
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
            sets[self.fence.key] = TokenOf(token, self.fence.type)
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
            values: dict[str, Any] = {self.fence.key: TokenOf(token, self.fence.type)}
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

    def probe_keys(self, *, lock: bool) -> Select[Any]:
        """Key, fence and tombstone flag of the rows whose keys are in ``_keys``.

        ``_keys`` is a list of key values (tuples for a composite key), expanded into an
        ``IN`` list; the caller cuts a batch into chunks that stay under the dialect's limit
        on bind parameters. With ``lock`` the rows are locked in key order (``FOR UPDATE``;
        not on SQLite, whose write lock covers the database).
        """
        cache_key = ("probe_keys", lock)
        found = self._cache.get(cache_key)
        if found is None:
            keys: BindParameter[Any] = bindparam("_keys", expanding=True)
            where = self.key[0].in_(keys) if len(self.key) == 1 else tuple_(*self.key).in_(keys)
            live = self.tombstone if self.tombstone is not None else false()
            found = select(*self.key, self.fence, live).where(where)
            if lock:
                found = found.order_by(*self.key).with_for_update()
            self._cache[cache_key] = found
        return found

    def open_write(self) -> Update:
        """A write that changes nothing, to make SQLite begin the transaction (row path).

        The sqlite3 driver begins a transaction only before a write; a ``SAVEPOINT`` sent
        first would start one of its own, and releasing it would commit the caller's work.
        The write also takes SQLite's write lock, so the fences the batch then reads stay
        as they are until it commits.
        """
        found = self._cache.get("open_write")
        if found is None:
            stmt = update(self.table).where(false()).values({self.fence.key: self.fence})
            found = self._cache["open_write"] = stmt
        return found


class _OnDialect:
    """What the guards' statements know of their SQL dialect, learnt once per dialect.

    The answers come from the dialect object of :mod:`fence._sql_dialect`; a database
    iofence has no dialect for gets the plainest ones (no arrays, no ``ON CONFLICT``).
    """

    dialect: Dialect
    #: A batch's rows travel as one array per column (``unnest``): PostgreSQL.
    arrays: bool
    #: A batch's read of its fences locks the rows (``FOR UPDATE``); not on SQLite, whose
    #: write lock covers the database.
    locks_rows: bool
    #: The driver begins a transaction only before a write (Python's sqlite3), so a
    #: savepoint sent first would be a transaction of its own, and releasing it would commit.
    begins_on_write: bool
    #: Bind parameters per statement when a batch reads its rows by key in chunks.
    chunk_params: int
    #: The ``INSERT`` construct with ``ON CONFLICT`` (``ON DUPLICATE KEY UPDATE`` on MariaDB
    #: and MySQL); ``None`` where the dialect has none.
    insert_of: Callable[[Table], Any] | None
    #: See ``RowStatementSet.found_rows``: MariaDB and MySQL.
    found_rows: bool
    #: A batch's rows travel as one JSON text (``json_each``) in one ``UPDATE ... FROM``:
    #: SQLite 3.38 or later (``UPDATE ... FROM`` since 3.33, JSON built in since 3.38).
    json_rows: bool

    def _learn(self, dialect: Dialect) -> None:
        self.dialect = dialect
        version = getattr(dialect, "server_version_info", None) or ()
        self.json_rows = dialect.name == "sqlite" and tuple(version) >= (3, 38)
        found = DIALECTS.get(dialect.name)
        if found is None:
            self.arrays, self.locks_rows, self.begins_on_write = False, True, False
            self.chunk_params, self.insert_of = CHUNK_PARAMS_DEFAULT, None
            self.found_rows = False
            return
        self.arrays = found.batch_arrays
        self.locks_rows = found.locks_rows
        self.begins_on_write = found.begins_on_write
        self.chunk_params = found.max_params
        self.insert_of = found.insert
        self.found_rows = found.upsert_counts_found


class DialectRowStatements(_OnDialect, RowStatements):
    """The statements of the row guard for one table on one dialect: what the row flow
    writes through (:class:`~fence.adapters._row_statements.RowStatementSet`).

    Args:
        table: the table; its rows are the fence scopes.
        fence: the fence column name (see :class:`RowStatements`).
        tombstone: the soft-delete flag.
        key: the columns that name a row.
        dialect: the dialect of the connections that run the statements.

    Raises:
        ConfigurationError: as :class:`RowStatements`.
    """

    def __init__(
        self,
        table: Table,
        *,
        fence: str | None,
        tombstone: str | None,
        key: Sequence[str] | None,
        dialect: Dialect,
    ) -> None:
        super().__init__(table, fence=fence, tombstone=tombstone, key=key)
        self._learn(dialect)
        #: Sent before a batch's savepoint where the driver begins a transaction only
        #: before a write. The write also takes SQLite's write lock, so the fences the
        #: batch then reads stay as they are until it commits.
        self.opener = self.open_write() if self.begins_on_write else None

    # -- one row: the calls of the row flow -------------------------------------------

    def checked_update(self, columns: tuple[str, ...], returning: bool) -> _Checked:
        """Remember the update of ``columns`` (checked) with its value parameters' names."""
        found = self.checked_updates[(columns, returning)] = (
            self.update(columns, returning),
            tuple(f"_v_{name}" for name in columns),
        )
        return found

    def upsert_call(self, data: Mapping[str, Any], token: int, returning: bool) -> Call:
        """:meth:`upsert`, its values inline."""
        return self.upsert(token, data, returning), None

    def raise_fence_call(
        self, keyvals: Sequence[Any], token: int, delete: bool, returning: bool
    ) -> Call:
        """:meth:`raise_fence` with its parameters."""
        stmt = self._cache.get(("raise", delete, returning))
        if stmt is None:  # (a clause has no truth value)
            stmt = self.raise_fence(delete=delete, returning=returning)
        return stmt, self.params(keyvals, token, {})

    def tombstone_call(
        self, keyvals: Sequence[Any], token: int, delete: bool, returning: bool
    ) -> Call:
        """:meth:`insert_tombstone`, its values inline."""
        stmt = self.insert_tombstone(keyvals, token, delete=delete, returning=returning)
        return stmt, None

    def probe_call(self, keyvals: Sequence[Any]) -> Call:
        """:meth:`probe` with its parameters."""
        return self.probe(), self.key_params(keyvals)

    def row_call(self, keyvals: Sequence[Any]) -> Call:
        """The whole row, by key, with its parameters."""
        found = self._cache.get("row")
        if found is None:
            found = self._cache["row"] = select(self.table).where(self._key_eq)
        return found, self.key_params(keyvals)

    def is_dead(self, row: Row[Any]) -> bool:
        """Whether a row a write returned is a tombstone."""
        return self.tombstone is not None and bool(row._mapping[self.tombstone])

    def _token_value(self, token: int) -> TokenOf:
        """The token of a statement built with its values inline, as the fence's value."""
        return TokenOf(literal(token, type_=self.fence.type), self.fence.type)

    def _insert(self) -> Any:
        if self.insert_of is None:
            raise ConfigurationError(
                "fenced inserts and upserts need ON CONFLICT or ON DUPLICATE KEY UPDATE: "
                f"PostgreSQL, SQLite or MariaDB, not {self.dialect.name}"
            )
        return self.insert_of(self.table)

    def upsert(self, token: int, values: Mapping[str, Any], returning: bool) -> Insert:
        """``INSERT ... ON CONFLICT (key) DO UPDATE SET ... WHERE t.fence <= excluded.fence``.

        A tombstone comes back to life when the token passes.
        """
        row = {**values, self.fence.key: self._token_value(token)}
        if self.tombstone is not None:
            row[self.tombstone.key] = False
        ins = self._insert().values(row)
        names = [name for name in row if name not in self.key_names]
        stmt = fenced_upsert(ins, self.key, names, self.fence)
        return stmt.returning(*self.table.c) if returning else _counted(stmt)  # type: ignore[no-any-return]

    def insert_tombstone(
        self, keyvals: Sequence[Any], token: int, *, delete: bool, returning: bool
    ) -> Insert:
        """Insert a tombstone holding only the key and the fence, for a row that is absent.

        It fences a key before any data exists (claim, delete, registering read). On a
        conflict it raises the fence of the row that won the race, if the token passes.
        """
        assert self.tombstone is not None
        row = dict(zip(self.key_names, keyvals, strict=True))
        row[self.fence.key] = self._token_value(token)
        row[self.tombstone.key] = True
        ins = self._insert().values(row)
        names = [self.fence.key, *([self.tombstone.key] if delete else [])]
        stmt = fenced_upsert(ins, self.key, names, self.fence)
        return stmt.returning(*self.table.c) if returning else _counted(stmt)  # type: ignore[no-any-return]

    # -- many rows --------------------------------------------------------------------
    #
    # A batch takes one of two paths (see docs/sql-guard.md, "Batches"):
    #
    # - the set path (PostgreSQL): one statement whose rows come from one array parameter
    #   per column (``unnest``), so its size never meets a limit on parameters or on the
    #   depth of the statement;
    # - the row path (SQLite, and PostgreSQL for what an array cannot carry): a read of every
    #   fence first, then the single-row statement sent with ``executemany``, in a savepoint.

    def item_sql(self, name: str) -> str | None:
        """The SQL type to which a batch casts the array of column ``name``, or ``None``.

        It is the cast SQLAlchemy itself puts on a single value of the column (``VARCHAR``
        for a ``String(3)``: no length, so a long value fails on the column as it would in
        a single-row write, where a cast to ``VARCHAR(3)[]`` would cut it silently); for a
        type without such a cast, its DDL, with a string type's length dropped the same way.
        ``None`` for a column an array cannot carry: an array type (``unnest`` would flatten
        it) or a type that does not compile.
        """
        cache_key = ("item_sql", name)
        if cache_key in self._cache:
            found: str | None = self._cache[cache_key]
            return found
        found = _item_sql(self.table.c[name].type, self.dialect)
        self._cache[cache_key] = found
        return found

    def processor(self, name: str) -> Any:
        """The column type's bind processor (``None`` if values go to the driver as they are)."""
        cache_key = ("processor", name)
        if cache_key not in self._cache:
            type_ = self.table.c[name].type
            self._cache[cache_key] = type_.dialect_impl(self.dialect).bind_processor(self.dialect)
        return self._cache[cache_key]

    def _array(self, param: str, name: str) -> ColumnElement[Any]:
        item = self.item_sql(name)
        assert item is not None
        return _array_param(param, item)

    def _keys_match(self, params: Sequence[str]) -> ColumnElement[bool]:
        """The rows whose keys are in the key arrays ``params`` (one per key column)."""
        arrays = [self._array(p, c.key) for p, c in zip(params, self.key, strict=True)]
        if len(arrays) == 1:
            return self.key[0] == any_(arrays[0])
        keys = func.unnest(*arrays).table_valued(*params).render_derived(name="fence_keys")
        return tuple_(*self.key).in_(select(*keys.c))

    def upsert_set(self, columns: tuple[str, ...]) -> Insert:
        """The set path of ``upsert_many``: every row from arrays, gated (C6). PostgreSQL.

        ``INSERT INTO t (...) SELECT ... FROM unnest(:_a0, ...) WHERE (SELECT count(*) FROM
        t WHERE key = ANY(:_a<key>) AND (fence IS NULL OR fence > :_token)) = 0 ON CONFLICT
        (key) DO UPDATE SET ... WHERE t.fence <= excluded.fence``. The gate is a one-time
        filter, run before the first row is written; run the statement in a savepoint for the
        race with a concurrent insert of an absent key. Parameters: ``_a<i>``, the list of
        the values of ``columns[i]``, and ``_token``. Proven by its row count.
        """
        cache_key = ("upsert_set", columns)
        found = self._cache.get(cache_key)
        if found is None:
            token = bindparam("_token", type_=self.fence.type)
            params = [f"_a{i}" for i in range(len(columns))]
            rows = (
                func.unnest(*(self._array(p, n) for p, n in zip(params, columns, strict=True)))
                .table_valued(*params)
                .render_derived(name="fence_rows")
            )
            key_params = [params[columns.index(name)] for name in self.key_names]
            blocking = (
                select(func.count())
                .select_from(self.table)
                .where(
                    self._keys_match(key_params),
                    or_(self.fence.is_(None), self.fence > token),
                )
                .scalar_subquery()
            )
            names = [*columns, self.fence.key]
            values: list[Any] = [*rows.c, TokenOf(token, self.fence.type)]
            if self.tombstone is not None:
                names.append(self.tombstone.key)
                values.append(false())
            gated = select(*values).where(blocking == 0)
            ins = self._insert().from_select(names, gated)
            stmt = ins.on_conflict_do_update(
                index_elements=list(self.key),
                set_={n: ins.excluded[n] for n in names if n not in self.key_names},
                where=self.fence <= ins.excluded[self.fence.key],
            )
            found = self._cache[cache_key] = _counted(stmt)
        return found  # type: ignore[no-any-return]

    def update_set(self, columns: tuple[str, ...], flagged: tuple[bool, ...]) -> Update:
        """The set path of ``update_many``: one statement, every row or none (C6). PostgreSQL.

        ``UPDATE t SET c = rows.c, ..., fence = :_token FROM unnest(:_k0, ..., :_a0, ...)
        AS rows WHERE t.key = rows.key AND fence <= :_token [AND NOT deleted] AND
        (<rows that pass, locked>) = :_count``. A scalar sub-select locks every target row
        (``FOR UPDATE``, in key order, so two batches cannot deadlock) and counts the rows
        that pass; it is a one-time filter, run before the first row is written. Under READ
        COMMITTED the locking read returns the newest version of each row, so the count sees
        fences raised concurrently.

        A column that only some rows set is ``flagged``: its array ``_s<i>`` of booleans
        tells which rows set it (``CASE WHEN rows.s THEN rows.v ELSE t.c END``).

        Parameters: ``_k<j>`` (the key values of column ``j``), ``_a<i>`` (the values of
        ``columns[i]``), ``_s<i>`` for flagged columns, ``_token`` and ``_count``. Proven by
        its row count.
        """
        cache_key = ("update_set", columns, flagged)
        found = self._cache.get(cache_key)
        if found is None:
            token = bindparam("_token", type_=self.fence.type)
            key_params = [f"_k{j}" for j in range(len(self.key))]
            arrays = [self._array(p, c.key) for p, c in zip(key_params, self.key, strict=True)]
            names = list(key_params)
            for i, name in enumerate(columns):
                arrays.append(self._array(f"_a{i}", name))
                names.append(f"_a{i}")
                if flagged[i]:
                    arrays.append(_array_param(f"_s{i}", "BOOLEAN"))
                    names.append(f"_s{i}")
            rows = func.unnest(*arrays).table_valued(*names).render_derived(name="fence_rows")
            locked = (
                select(self.fence.label("f"), self._live().label("live"))
                .where(self._keys_match(key_params))
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
            sets: dict[str, Any] = {}
            for i, name in enumerate(columns):
                value = rows.c[f"_a{i}"]
                sets[name] = (
                    case((rows.c[f"_s{i}"], value), else_=self.table.c[name])
                    if flagged[i]
                    else value
                )
            sets[self.fence.key] = TokenOf(token, self.fence.type)
            matched = and_(*(c == rows.c[p] for c, p in zip(self.key, key_params, strict=True)))
            stmt = (
                update(self.table)
                .where(
                    matched,
                    self.fence <= token,
                    self._live(),
                    passing == bindparam("_count", type_=Integer()),
                )
                .values(sets)
            )
            found = self._cache[cache_key] = _counted(stmt)
        return found

    def _array_values(self, name: str, values: list[Any]) -> list[Any] | None:
        """``values`` as the column type binds them; ``None`` if they mix Python types."""
        process = self.processor(name)
        if process is not None:
            values = [process(v) for v in values]
        return None if one_kind(values) is False else values

    def update_set_call(
        self,
        token: int,
        items: Sequence[tuple[tuple[Any, ...], Mapping[str, Any]]],
        types: Any = None,
    ) -> tuple[Update, dict[str, Any]] | None:
        """The set path's statement and parameters for ``update_many``, if it applies.

        On SQLite, :meth:`update_json`'s (``None`` for a value JSON cannot carry). ``None``
        (take the row path) on a database with neither arrays nor JSON rows, and on
        PostgreSQL for a column an array cannot carry (:meth:`item_sql`) and for a column
        whose values mix Python types. ``types`` is
        not needed: the table knows its column types.
        """
        if not self.arrays:
            return self._update_json_call(token, items) if self.json_rows else None
        columns = tuple(sorted({name for _, values in items for name in values}))
        if any(self.item_sql(n) is None for n in (*self.key_names, *columns)):
            return None
        params: dict[str, Any] = {"_token": token, "_count": len(items)}
        for j, name in enumerate(self.key_names):
            keys = self._array_values(name, [k[j] for k, _ in items])
            if keys is None:
                return None
            params[f"_k{j}"] = keys
        flagged = []
        for i, name in enumerate(columns):
            process = self.processor(name)
            sets = [name in values for _, values in items]
            column = [values.get(name) for _, values in items]
            if process is not None:
                column = [
                    process(v) if set_ else None for v, set_ in zip(column, sets, strict=True)
                ]
            if one_kind(column) is False:
                return None
            params[f"_a{i}"] = column
            flagged.append(not all(sets))
            if flagged[-1]:
                params[f"_s{i}"] = sets
        return self.update_set(columns, tuple(flagged)), params

    def _update_json_call(
        self, token: int, items: Sequence[tuple[tuple[Any, ...], Mapping[str, Any]]]
    ) -> tuple[Update, dict[str, Any]] | None:
        """:meth:`update_json` and its parameters (SQLite); ``None`` (take the row path) for
        a value JSON cannot carry as the driver would bind it: anything but a string without a
        NUL, a 64-bit integer, a finite float or ``NULL`` once the column type has processed
        it."""
        columns = tuple(sorted({name for _, values in items for name in values}))
        processors = [self.processor(name) for name in columns]
        flagged = tuple(any(name not in values for _, values in items) for name in columns)
        rows: list[list[Any]]
        if not any(flagged) and not any(p is not None for p in processors):
            rows = [[*keyvals, *(values[name] for name in columns)] for keyvals, values in items]
        else:
            rows = []
            for keyvals, values in items:
                row = [*keyvals]
                for name, process, flag in zip(columns, processors, flagged, strict=True):
                    if name in values:
                        value = values[name]
                        row.append(process(value) if process is not None else value)
                        if flag:
                            row.append(1)
                    else:
                        row += (None, 0)
                rows.append(row)
        # Inline, not a call per value: this loop is most of a large batch's Python time.
        for row in rows:
            for value in row:
                kind = type(value)
                if kind is int:
                    if not _INT64_MIN <= value <= _INT64_MAX:
                        return None
                elif kind is float:
                    if not math.isfinite(value):
                        return None
                elif kind is str:
                    if "\x00" in value:
                        return None  # json_extract ends the text at a NUL; a bound value keeps it
                elif value is not None:
                    return None  # bool, bytes, Decimal, a subclass: the row path binds them
        # Not ASCII-escaped: SQLite would store an escaped lone surrogate as bytes that no
        # decoder reads back; as UTF-8 the driver refuses it, as it refuses it on a row.
        params = {
            "_rows": json.dumps(rows, ensure_ascii=False),
            "_token": token,
            "_count": len(items),
        }
        return self.update_json(columns, flagged), params

    def update_json(self, columns: tuple[str, ...], flagged: tuple[bool, ...]) -> Update:
        """The set path of ``update_many`` on SQLite: one statement, every row or none (C6).

        ``UPDATE t SET c = json_extract(r.value, '$[i]'), ..., fence = :_token FROM
        json_each(:_rows) AS r WHERE t.key = json_extract(r.value, '$[0]') AND fence <=
        :_token [AND NOT deleted] AND (<rows that pass>) = :_count``. Each row of the batch
        is a JSON array: its key values, then per column its value (and, for a ``flagged``
        column that only some rows set, ``1`` or ``0`` for whether it sets it). The count
        is an uncorrelated sub-select, which SQLite runs once, before the first row is
        written; the write lock the statement takes keeps every fence as it read it, and
        the judge's triggers, as on every row write, refuse a row whose fence is above the
        token: an abort undoes the whole statement. Parameters: ``_rows``, ``_token`` and
        ``_count``. Proven by its row count.
        """
        cache_key = ("update_json", columns, flagged)
        found = self._cache.get(cache_key)
        if found is None:
            token = bindparam("_token", type_=self.fence.type)
            data = bindparam("_rows", type_=String())
            rows = func.json_each(data).table_valued("value").alias("fence_rows")
            each = func.json_each(data).table_valued("value").alias("fence_keys")

            def item(of: Any, i: int) -> ColumnElement[Any]:
                return func.json_extract(of.c.value, literal_column(f"'$[{i}]'"))

            nkeys = len(self.key)
            keys = [item(each, j) for j in range(nkeys)]
            listed = (
                self.key[0].in_(select(keys[0]))
                if nkeys == 1
                else tuple_(*self.key).in_(select(*keys))
            )
            current = (
                select(self.fence.label("f"), self._live().label("live"))
                .where(listed)
                .subquery("fence_current")
            )
            passing = (
                select(func.count())
                .select_from(current)
                .where(current.c.f <= token, current.c.live)
                .scalar_subquery()
            )
            sets: dict[str, Any] = {}
            i = nkeys
            for name, flag in zip(columns, flagged, strict=True):
                value: ColumnElement[Any] = item(rows, i)
                i += 1
                if flag:
                    value = case((item(rows, i) == 1, value), else_=self.table.c[name])
                    i += 1
                sets[name] = value
            sets[self.fence.key] = TokenOf(token, self.fence.type)
            matched = and_(*(c == item(rows, j) for j, c in enumerate(self.key)))
            stmt = (
                update(self.table)
                .where(
                    matched,
                    self.fence <= token,
                    self._live(),
                    passing == bindparam("_count", type_=Integer()),
                )
                .values(sets)
            )
            found = self._cache[cache_key] = _counted(stmt)
        return found

    def upsert_set_call(
        self,
        token: int,
        columns: tuple[str, ...],
        rows: Sequence[Mapping[str, Any]],
        types: Any = None,
    ) -> tuple[Insert, dict[str, Any]] | None:
        """The set path's statement and parameters for ``upsert_many``, if it applies.

        ``None`` when :meth:`update_set_call` would be.
        """
        if not self.arrays:
            return None
        if any(self.item_sql(n) is None for n in columns):
            return None
        params: dict[str, Any] = {"_token": token}
        for i, name in enumerate(columns):
            values = self._array_values(name, [row[name] for row in rows])
            if values is None:
                return None
            params[f"_a{i}"] = values
        return self.upsert_set(columns), params

    def upsert_row(self, columns: tuple[str, ...]) -> Insert:
        """One row's fenced upsert with bind parameters, for ``executemany`` (the row path).

        Parameters: ``_v_<column>`` and ``_token`` (see :meth:`params`). Proven by its row
        count.
        """
        cache_key = ("upsert_row", columns)
        found = self._cache.get(cache_key)
        if found is None:
            row: dict[str, Any] = {
                name: bindparam(f"_v_{name}", type_=self.table.c[name].type) for name in columns
            }
            row[self.fence.key] = TokenOf(
                bindparam("_token", type_=self.fence.type), self.fence.type
            )
            if self.tombstone is not None:
                row[self.tombstone.key] = False
            ins = self._insert().values(row)
            names = [name for name in row if name not in self.key_names]
            stmt = fenced_upsert(ins, self.key, names, self.fence)
            found = self._cache[cache_key] = _counted(stmt)
        return found  # type: ignore[no-any-return]

    def probe_set_call(
        self, keys: Sequence[tuple[Any, ...]], *, lock: bool
    ) -> tuple[Select[Any], dict[str, Any]] | None:
        """On PostgreSQL, :meth:`probe_keys` for every key at once: one array per key column.

        ``None`` (read in chunks) elsewhere, or if the keys cannot travel in arrays.
        """
        if not self.arrays:
            return None
        if any(self.item_sql(n) is None for n in self.key_names):
            return None
        params: dict[str, Any] = {}
        for j, name in enumerate(self.key_names):
            values = self._array_values(name, [k[j] for k in keys])
            if values is None:
                return None
            params[f"_k{j}"] = values
        cache_key = ("probe_set", lock)
        found = self._cache.get(cache_key)
        if found is None:
            key_params = [f"_k{j}" for j in range(len(self.key))]
            live = self.tombstone if self.tombstone is not None else false()
            found = select(*self.key, self.fence, live).where(self._keys_match(key_params))
            if lock:
                found = found.order_by(*self.key).with_for_update()
            self._cache[cache_key] = found
        return found, params

    # -- many rows: the calls of the row flow -----------------------------------------

    def check_known(self, names: Iterable[str], types: Any) -> None:
        """Nothing to check: :meth:`check_values` knows the table's columns."""

    def upsert_rows(
        self, token: int, columns: tuple[str, ...], rows: Sequence[Mapping[str, Any]]
    ) -> ManyCall:
        """:meth:`upsert_row` with the parameters of every row."""
        params = [{**{f"_v_{n}": row[n] for n in columns}, "_token": token} for row in rows]
        return self.upsert_row(columns), params

    def probe_reads(self, keys: Sequence[tuple[Any, ...]], types: Any, *, lock: bool) -> list[Call]:
        """:meth:`probe_set_call`, or :meth:`probe_keys` in chunks of :attr:`chunk_params`."""
        call = self.probe_set_call(keys, lock=lock)
        if call is not None:
            return [call]
        stmt = self.probe_keys(lock=lock)
        width = len(self.key)
        return [
            (stmt, {"_keys": [k[0] for k in chunk] if width == 1 else list(chunk)})
            for chunk in chunks(keys, self.chunk_params // width)
        ]


def _array_param(name: str, item: str) -> ColumnElement[Any]:
    """``CAST(:name AS item[])``: one list bound as one array of the given item type."""
    return cast(bindparam(name, type_=NullType()), _SqlType(f"{item}[]"))


class _SqlType(UserDefinedType[Any]):
    """A type known by its SQL name only: the target of a batch array's cast."""

    cache_ok = True

    def __init__(self, spec: str) -> None:
        self.spec = spec

    def get_col_spec(self, **kw: Any) -> str:
        return self.spec


def _is_array(type_: TypeEngine[Any]) -> bool:
    if isinstance(type_, TypeDecorator):
        return _is_array(type_.impl_instance)
    return isinstance(type_, ARRAY)


def _item_sql(type_: TypeEngine[Any], dialect: Dialect) -> str | None:
    """See :meth:`RowStatements.item_sql`."""
    if _is_array(type_):
        return None
    try:
        rendered = str(bindparam("x", type_=type_).compile(dialect=dialect))
        if "::" in rendered:
            spec = rendered.split("::", 1)[1]
        else:
            impl = type_.dialect_impl(dialect)
            plain = impl.impl_instance if isinstance(impl, TypeDecorator) else impl
            native_enum = isinstance(plain, Enum) and plain.native_enum
            if isinstance(plain, String) and plain.length is not None and not native_enum:
                plain = String()
            spec = plain.compile(dialect=dialect)
    except CompileError:
        return None
    return None if spec.endswith("]") else spec


class RegisterStatements:
    """The statements of a fence register table ``(scope PK, fence BIGINT)``.

    The claim's shape is written once, in :meth:`_on_conflict`: ``INSERT ... ON CONFLICT
    (scope) DO UPDATE SET fence = excluded.fence WHERE fence <= excluded.fence``; every
    claim below (one scope, one scope with bind parameters, which the session hook runs
    too, and a set of scopes) is that upsert with its own rows. Its psycopg twin is
    ``PgRegisterStatements`` in ``_pg_statements``.

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
        #: The register as the database's judge sees it (C14).
        self.judged = Judged(table.name, table.schema, fence="fence", register=True, key=("scope",))
        self._cache: dict[Any, Any] = {}

    def _base(self, dialect: str) -> Any:
        found = DIALECTS.get(dialect)
        if found is None:
            labels = " or ".join(d.label for d in DIALECTS.values())
            raise ConfigurationError(f"a fence register needs {labels}, not {dialect}")
        return found.insert(self.table)

    def _on_conflict(self, ins: Any) -> Any:
        """The claim of the rows ``ins`` inserts: each fence is raised to the token where it
        is not above it, and a scope without a row gets one (C4, C8)."""
        return fenced_upsert(ins, [self.scope], ["fence"], self.fence)

    def claim(self, dialect: str, scope: str, token: int, returning: bool) -> Insert:
        """``INSERT ... ON CONFLICT (scope) DO UPDATE SET fence = :t WHERE fence <= :t``."""
        value = TokenOf(literal(token, type_=self.fence.type), self.fence.type)
        stmt = self._on_conflict(self._base(dialect).values(scope=scope, fence=value))
        return stmt.returning(self.scope, self.fence) if returning else _counted(stmt)  # type: ignore[no-any-return]

    def claim_row(self, dialect: str, *, transaction: bool = False) -> Insert:
        """The claim of one scope with bind parameters ``_scope`` and ``_token``, for
        ``executemany`` (the row path of ``claim_many``) and the session hook's claim at
        the start of a transaction. Proven by its row count.

        Args:
            dialect: SQLAlchemy's name of the dialect.
            transaction: the claim also makes the token the transaction's on MariaDB and
                MySQL (:class:`TokenOf`), as it does elsewhere.
        """
        cache_key = ("claim_row", dialect, transaction)
        found = self._cache.get(cache_key)
        if found is None:
            token = bindparam("_token", type_=self.fence.type)
            ins = self._base(dialect).values(
                scope=bindparam("_scope", type_=self.scope.type),
                fence=TokenOf(token, self.fence.type, transaction=transaction),
            )
            found = self._cache[cache_key] = _counted(self._on_conflict(ins))
        return found  # type: ignore[no-any-return]

    def claim_set(self, dialect: Dialect) -> Insert | None:
        """The set path of ``claim_many`` on PostgreSQL: every scope from one array, gated.

        ``INSERT ... SELECT s, :_token FROM unnest(:_scopes) s WHERE (SELECT count(*) ...
        WHERE scope = ANY(:_scopes) AND fence > :_token) = 0 ON CONFLICT ...``; run it in a
        savepoint. ``None`` if the scope column cannot travel in an array.
        """
        cache_key = ("claim_set", dialect.name)
        if cache_key not in self._cache:
            item = _item_sql(self.scope.type, dialect)
            stmt = None
            if item is not None:
                token = bindparam("_token", type_=self.fence.type)
                scopes = (
                    func.unnest(_array_param("_scopes", item))
                    .table_valued("scope")
                    .render_derived(name="fence_scopes")
                )
                blocking = (
                    select(func.count())
                    .select_from(self.table)
                    .where(self.scope == any_(_array_param("_scopes", item)), self.fence > token)
                    .scalar_subquery()
                )
                gated = select(scopes.c.scope, TokenOf(token, self.fence.type)).where(blocking == 0)
                ins = self._base(dialect.name).from_select(["scope", "fence"], gated)
                stmt = _counted(self._on_conflict(ins))
            self._cache[cache_key] = stmt
        return self._cache[cache_key]  # type: ignore[no-any-return]

    def open_write(self) -> Update:
        """See :meth:`RowStatements.open_write`."""
        found = self._cache.get("open_write")
        if found is None:
            stmt = update(self.table).where(false()).values({"fence": self.fence})
            found = self._cache["open_write"] = stmt
        return found

    def probe_scopes_set(self, dialect: Dialect, *, lock: bool) -> Select[Any, Any] | None:
        """On PostgreSQL, :meth:`probe_scopes` for every scope at once (``scope = ANY(...)``).

        Parameter: ``_scopes``. ``None`` elsewhere, or if the scope column cannot travel in
        an array.
        """
        cache_key = ("probe_scopes_set", dialect.name, lock)
        if cache_key not in self._cache:
            found_dialect = DIALECTS.get(dialect.name)
            arrays = found_dialect is not None and found_dialect.batch_arrays
            item = _item_sql(self.scope.type, dialect) if arrays else None
            found = None
            if item is not None:
                found = select(self.scope, self.fence).where(
                    self.scope == any_(_array_param("_scopes", item))
                )
                if lock:
                    found = found.order_by(self.scope).with_for_update()
            self._cache[cache_key] = found
        return self._cache[cache_key]  # type: ignore[no-any-return]

    def probe(self, scope: str) -> Select[Any, Any]:
        """The fence of ``scope``."""
        return select(self.scope, self.fence).where(self.scope == scope)

    def probe_scopes(self, *, lock: bool) -> Select[Any, Any]:
        """The fences of the scopes in ``_scopes`` (an expanding ``IN``; see
        :meth:`RowStatements.probe_keys`)."""
        found = self._cache.get(("probe_scopes", lock))
        if found is None:
            found = select(self.scope, self.fence).where(
                self.scope.in_(bindparam("_scopes", expanding=True))
            )
            if lock:
                found = found.order_by(self.scope).with_for_update()
            self._cache[("probe_scopes", lock)] = found
        return found


class DialectRegisterStatements(_OnDialect, RegisterStatements):
    """The statements of a fence register table on one dialect: what the register flow
    writes through (:class:`~fence.adapters._row_statements.RegisterStatementSet`).

    Args:
        table: the register table (see :func:`fence_register_table`).
        dialect: the dialect of the connections that run the statements.
    """

    def __init__(self, table: Table, dialect: Dialect) -> None:
        super().__init__(table)
        self._learn(dialect)
        self.opener = self.open_write() if self.begins_on_write else None

    def claim_call(self, scope: str, token: int, returning: bool) -> Call:
        """:meth:`claim`, its values inline."""
        return self.claim(self.dialect.name, scope, token, returning), None

    def claim_set_call(self, scopes: Sequence[str], token: int) -> Call | None:
        """:meth:`claim_set` with its parameters, on PostgreSQL; ``None`` elsewhere."""
        stmt = self.claim_set(self.dialect) if self.arrays else None
        return None if stmt is None else (stmt, {"_scopes": list(scopes), "_token": token})

    def claim_rows(self, scopes: Sequence[str], token: int) -> ManyCall:
        """:meth:`claim_row` with the parameters of every scope."""
        params = [{"_scope": scope, "_token": token} for scope in scopes]
        return self.claim_row(self.dialect.name), params

    def probe_call(self, scope: str) -> Call:
        """:meth:`probe` (its scope inline)."""
        return self.probe(scope), None

    def probe_reads(self, scopes: Sequence[str], *, lock: bool) -> list[Call]:
        """:meth:`probe_scopes_set`, or :meth:`probe_scopes` in chunks."""
        whole = self.probe_scopes_set(self.dialect, lock=lock)
        if whole is not None:
            return [(whole, {"_scopes": list(scopes)})]
        stmt = self.probe_scopes(lock=lock)
        return [(stmt, {"_scopes": list(c)}) for c in chunks(scopes, self.chunk_params)]


#: The register table used when none is given: ``fence_register``.
DEFAULT_REGISTER = fence_register_table()

_ROW_CACHE: weakref.WeakKeyDictionary[Table, dict[Any, RowStatements]] = weakref.WeakKeyDictionary()
_REGISTER_CACHE: weakref.WeakKeyDictionary[Table, RegisterStatements] = weakref.WeakKeyDictionary()
_DIALECT_ROW_CACHE: weakref.WeakKeyDictionary[Table, dict[Any, DialectRowStatements]] = (
    weakref.WeakKeyDictionary()
)
_DIALECT_REGISTER_CACHE: weakref.WeakKeyDictionary[Table, dict[str, DialectRegisterStatements]] = (
    weakref.WeakKeyDictionary()
)


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


def dialect_row_statements(
    table: Table,
    fence: str | None,
    tombstone: str | None,
    key: Sequence[str] | None,
    dialect: Dialect,
) -> DialectRowStatements:
    """The :class:`DialectRowStatements` of ``table``, built once per table, options and
    dialect name.

    Raises:
        ConfigurationError: as :class:`RowStatements`.
    """
    options = (fence, tombstone, tuple(key) if key is not None else None, dialect.name)
    per_table = _DIALECT_ROW_CACHE.setdefault(table, {})
    found = per_table.get(options)
    if found is None:
        found = per_table[options] = DialectRowStatements(
            table, fence=fence, tombstone=tombstone, key=key, dialect=dialect
        )
    return found


def register_statements(table: Table) -> RegisterStatements:
    """The :class:`RegisterStatements` of ``table``, built once."""
    found = _REGISTER_CACHE.get(table)
    if found is None:
        found = _REGISTER_CACHE[table] = RegisterStatements(table)
    return found


def dialect_register_statements(table: Table, dialect: Dialect) -> DialectRegisterStatements:
    """The :class:`DialectRegisterStatements` of ``table``, built once per dialect name.

    Raises:
        ConfigurationError: the table lacks the ``scope`` or ``fence`` column.
    """
    per_table = _DIALECT_REGISTER_CACHE.setdefault(table, {})
    found = per_table.get(dialect.name)
    if found is None:
        found = per_table[dialect.name] = DialectRegisterStatements(table, dialect)
    return found
