"""SQL text of the psycopg guard, composed once with quoted identifiers. No I/O.

Every statement keeps the acceptance rule (C4) inside PostgreSQL: the write happens only
where ``fence <= %s`` holds, and sets ``fence`` to the token in the same statement. The
value it sets hands the token to the database's judge (C14) as the row is written
(:func:`token_sql`).
Statements with a fixed shape are cached as strings, so psycopg prepares them after a few
runs like any other repeated query.
"""

from __future__ import annotations

import datetime
import decimal
import functools
import uuid
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from psycopg import sql

from fence._errors import ConfigurationError
from fence._sql_dialect import DIALECTS

from ._row_statements import Call, ManyCall, RowStatementsBase
from ._sql_common import (
    DEFAULT_FENCE_COLUMN,
    DEFAULT_REGISTER_TABLE,
    chunks,
    one_kind,
)
from ._triggers import TOKEN_SETTING, Judged

__all__ = [
    "JUDGED",
    "TYPES_QUERY",
    "ColumnType",
    "PgRegisterCalls",
    "PgRegisterStatements",
    "PgRowStatements",
    "TableName",
    "forget_judged",
    "read_types",
    "register_calls",
    "row_statements",
    "token_sql",
]

#: A table name: ``"accounts"`` or ``("schema", "accounts")``.
TableName = str | tuple[str, str]

Query = str


#: The column types of a table, read once per connection before its first batch: each column's
#: type by its quoted internal name (``pg_catalog.int4``, ``pg_catalog.bpchar``), never with
#: a length or precision, so that a cast keeps every value whole and the column's own
#: limits apply on write as they do to a single-row write; and whether it holds arrays (a
#: domain over an array does). Parameter: the table as a ``regclass`` literal.
TYPES_QUERY = (
    "SELECT a.attname AS name, "
    "quote_ident(n.nspname) || '.' || quote_ident(t.typname) AS sql, "
    "b.typcategory = 'A' AS is_array, a.atttypid::int8 AS oid "
    "FROM pg_catalog.pg_attribute a "
    "JOIN pg_catalog.pg_type t ON t.oid = a.atttypid "
    "JOIN pg_catalog.pg_namespace n ON n.oid = t.typnamespace "
    "JOIN pg_catalog.pg_type b ON b.oid = "
    "CASE WHEN t.typtype = 'd' THEN t.typbasetype ELSE t.oid END "
    "WHERE a.attrelid = %s::regclass AND a.attnum > 0 AND NOT a.attisdropped"
)


class ColumnType(NamedTuple):
    """A column's type as a batch needs it.

    Attributes:
        sql: the type, schema-qualified and quoted, without length or precision.
        is_array: the column holds arrays (which an ``unnest`` would flatten).
        oid: the type's oid, which each batch checks is still the column's.
    """

    sql: str
    is_array: bool
    oid: int


# Python types whose arrays psycopg sends in binary: its binary dumpers for them are
# built in and much faster on long lists than the text ones (which quote each element);
# a str goes as text (not as an untyped literal), and the cast to the column's type reads
# it with the type's input function, as it would read the literal.
_BINARY: frozenset[Any] = frozenset(
    {str, int, float, bool, decimal.Decimal, datetime.date, datetime.datetime, uuid.UUID}
)


def read_types(rows: Iterable[Mapping[str, Any]]) -> dict[str, ColumnType]:
    """The column types of a table from the rows of :data:`TYPES_QUERY`."""
    return {row["name"]: ColumnType(row["sql"], row["is_array"], row["oid"]) for row in rows}


#: The tables whose triggers (the database's judge, C14) a guard found in place, by psycopg
#: connection: ``(qualified name, kind, fence column)``. One registry for the sync and the
#: asyncio guards, so that installing the triggers clears what either has seen.
JUDGED: weakref.WeakKeyDictionary[Any, set[tuple[str, str, str]]] = weakref.WeakKeyDictionary()


def forget_judged(conn: Any) -> None:
    """Check the triggers of every table again at the next write on ``conn``."""
    JUDGED.pop(conn, None)


def token_sql(value: sql.Composable) -> sql.Composed:
    """The token ``value`` as the fence's value in a fenced write: it also makes it the
    token of the writing transaction, the one the database's judge reads (C14), as the
    ``SET`` or ``VALUES`` of the row is evaluated, before the row's ``BEFORE`` trigger fires.
    A row the ``WHERE`` skips sets nothing.
    """
    return sql.SQL(
        "CAST(pg_catalog.set_config({setting}, CAST({value} AS text), true) AS bigint)"
    ).format(setting=sql.Literal(TOKEN_SETTING), value=value)


_TOKEN = token_sql(sql.Placeholder())


def _judged(table: TableName, **columns: Any) -> Judged:
    if isinstance(table, tuple):
        return Judged(table[1], table[0], **columns)
    return Judged(table, **columns)


def _ident(name: TableName) -> sql.Identifier:
    return sql.Identifier(*name) if isinstance(name, tuple) else sql.Identifier(name)


def _text(composed: sql.Composable) -> Query:
    return composed.as_string()


def _names(names: Sequence[str]) -> sql.Composed:
    return sql.SQL(", ").join(sql.Identifier(n) for n in names)


class PgRowStatements(RowStatementsBase):
    """The statements of the psycopg row guard for one table: what the row flow writes
    through (:class:`~fence.adapters._row_statements.RowStatementSet`).

    Args:
        table: the table name, or ``(schema, name)``.
        key: the columns naming a row (a primary key or unique constraint).
        fence: the fence column.
        tombstone: the soft-delete column, if the table has one.
        tombstone_insert: whether a row holding only the key, fence and tombstone flag
            can be inserted (every other column is nullable or has a default).

    Raises:
        ConfigurationError: no key column, or a key that repeats the fence column.
    """

    #: The columns are known to a batch only (from the catalogue).
    columns = None
    #: A batch's read of its fences locks the rows.
    locks_rows = True
    #: psycopg begins the caller's transaction before any statement: no opener.
    opener = None
    #: PostgreSQL counts the rows an upsert wrote (see ``RowStatementSet.found_rows``).
    found_rows = False
    #: Bind parameters per statement when a batch reads its rows by key in chunks.
    chunk_params = DIALECTS["postgresql"].max_params

    def __init__(
        self,
        table: TableName,
        *,
        key: Sequence[str],
        fence: str = DEFAULT_FENCE_COLUMN,
        tombstone: str | None = None,
        tombstone_insert: bool = True,
    ) -> None:
        if not key:
            raise ConfigurationError("a row guard needs at least one key column")
        self.name = ".".join(table) if isinstance(table, tuple) else table
        self.key_names = tuple(key)
        self.key_set = frozenset(key)
        self.fence_name = fence
        self.tombstone_name = tombstone
        self.guarded = {fence} | ({tombstone} if tombstone else set())
        if self.guarded & set(self.key_names):
            raise ConfigurationError("the fence and tombstone columns cannot be key columns")
        self.can_insert_tombstone = tombstone is not None and tombstone_insert
        self.t = _ident(table)
        self.f = sql.Identifier(fence)
        self.dead = sql.Identifier(tombstone) if tombstone else sql.SQL("false")
        self.live = (
            sql.SQL("NOT {}").format(sql.Identifier(tombstone)) if tombstone else sql.SQL("true")
        )
        self.key_eq = sql.SQL(" AND ").join(
            sql.SQL("{} = %s").format(sql.Identifier(k)) for k in self.key_names
        )
        self.key_cols = _names(self.key_names)
        self.regclass = _text(self.t)
        #: The table as the database's judge sees it (C14).
        self.judged = _judged(table, fence=fence, tombstone=tombstone)
        self._cache: dict[Any, Query] = {}
        #: (columns, returning) -> the update of columns that passed :meth:`check_values`
        #: once (the check depends on the names only): the hot path skips it. Its
        #: parameters are positional, so no names come with it.
        self.checked_updates: dict[tuple[tuple[str, ...], bool], tuple[Query, None]] = {}
        self.probe = _text(
            sql.SQL("SELECT {f}, {dead} FROM {t} WHERE {key}").format(
                f=self.f, dead=self.dead, t=self.t, key=self.key_eq
            )
        )
        self.row = _text(sql.SQL("SELECT * FROM {t} WHERE {key}").format(t=self.t, key=self.key_eq))

    # -- one row ----------------------------------------------------------------------

    def update(self, columns: tuple[str, ...], returning: bool) -> Query:
        """``UPDATE t SET c = %s, ..., fence = %s WHERE <key> AND fence <= %s [AND live]``.

        Parameters: the values, the token, the key values, the token.
        """
        found = self._cache.get(("update", columns, returning))
        if found is None:
            sets = sql.SQL(", ").join(sql.SQL("{} = %s").format(sql.Identifier(c)) for c in columns)
            tail = sql.SQL(" RETURNING *") if returning else sql.SQL("")
            found = self._cache[("update", columns, returning)] = _text(
                sql.SQL(
                    "UPDATE {t} SET {sets}, {f} = {tok} WHERE {key} AND {f} <= %s AND {live}{tail}"
                ).format(
                    t=self.t,
                    sets=sets,
                    f=self.f,
                    tok=_TOKEN,
                    key=self.key_eq,
                    live=self.live,
                    tail=tail,
                )
            )
        return found

    def raise_fence(self, *, delete: bool) -> Query:
        """Raise the fence of an existing row (claim, registering read, soft delete).

        Parameters: the token, the key values, the token.
        """
        found = self._cache.get(("raise", delete))
        if found is None:
            extra = (
                sql.SQL(", {} = true").format(sql.Identifier(self.tombstone_name))
                if delete and self.tombstone_name
                else sql.SQL("")
            )
            found = self._cache[("raise", delete)] = _text(
                sql.SQL(
                    "UPDATE {t} SET {f} = {tok}{extra} WHERE {key} AND {f} <= %s RETURNING *"
                ).format(t=self.t, f=self.f, tok=_TOKEN, extra=extra, key=self.key_eq)
            )
        return found

    def insert_tombstone(self, *, delete: bool) -> Query:
        """Insert a tombstone holding only the key and the fence, for an absent row.

        On a conflict it raises the fence of the row that won the race, if the token
        passes. Parameters: the key values, the token.
        """
        assert self.tombstone_name is not None
        found = self._cache.get(("tombstone", delete))
        if found is None:
            tomb = sql.Identifier(self.tombstone_name)
            extra = sql.SQL(", {0} = true").format(tomb) if delete else sql.SQL("")
            found = self._cache[("tombstone", delete)] = _text(
                sql.SQL(
                    "INSERT INTO {t} AS cur ({keys}, {f}, {tomb}) VALUES ({marks}, {tok}, true) "
                    "ON CONFLICT ({keys}) DO UPDATE SET {f} = EXCLUDED.{f}{extra} "
                    "WHERE cur.{f} <= EXCLUDED.{f} RETURNING *"
                ).format(
                    t=self.t,
                    keys=self.key_cols,
                    f=self.f,
                    tomb=tomb,
                    tok=_TOKEN,
                    marks=sql.SQL(", ").join(sql.Placeholder() * len(self.key_names)),
                    extra=extra,
                )
            )
        return found

    def _upsert_head(self, columns: tuple[str, ...]) -> tuple[sql.Composed, sql.Composed]:
        names = [*columns, self.fence_name]
        if self.tombstone_name:
            names.append(self.tombstone_name)
        settable = [n for n in names if n not in self.key_names]
        sets = sql.SQL(", ").join(
            sql.SQL("{0} = EXCLUDED.{0}").format(sql.Identifier(n)) for n in settable
        )
        head = sql.SQL("INSERT INTO {t} AS cur ({names}) VALUES ").format(
            t=self.t, names=_names(names)
        )
        tail = sql.SQL(
            " ON CONFLICT ({keys}) DO UPDATE SET {sets} WHERE cur.{f} <= EXCLUDED.{f}"
        ).format(keys=self.key_cols, sets=sets, f=self.f)
        return head, tail

    def _row_marks(self, count: int) -> sql.Composed:
        tomb = sql.SQL(", false") if self.tombstone_name else sql.SQL("")
        return sql.SQL("({marks}, {tok}{tomb})").format(
            marks=sql.SQL(", ").join(sql.Placeholder() * count), tok=_TOKEN, tomb=tomb
        )

    def upsert(self, columns: tuple[str, ...], returning: bool) -> Query:
        """``INSERT ... ON CONFLICT (key) DO UPDATE SET ... WHERE cur.fence <= EXCLUDED.fence``.

        A tombstone comes back to life. Parameters: the values, the token.
        """
        found = self._cache.get(("upsert", columns, returning))
        if found is None:
            head, tail = self._upsert_head(columns)
            end = sql.SQL(" RETURNING *") if returning else sql.SQL("")
            found = self._cache[("upsert", columns, returning)] = _text(
                head + self._row_marks(len(columns)) + tail + end
            )
        return found

    # -- one row: the calls of the row flow -------------------------------------------

    def checked_update(self, columns: tuple[str, ...], returning: bool) -> tuple[Query, None]:
        """Remember the update of ``columns`` (checked)."""
        found = self.checked_updates[(columns, returning)] = (self.update(columns, returning), None)
        return found

    def update_params(
        self, names: None, keyvals: Sequence[Any], token: int, values: Mapping[str, Any]
    ) -> tuple[Any, ...]:
        """The parameters of :meth:`update`: the values, the token, the key, the token."""
        return (*values.values(), token, *keyvals, token)

    def row_params(
        self,
        columns: tuple[str, ...],
        keyvals: Sequence[Any],
        token: int,
        values: Mapping[str, Any],
    ) -> tuple[Any, ...]:
        """:meth:`update_params` for the values of ``columns``, in that order."""
        return (*(values[c] for c in columns), token, *keyvals, token)

    def upsert_call(self, data: Mapping[str, Any], token: int, returning: bool) -> Call:
        """:meth:`upsert` of the columns of ``data`` with its parameters."""
        columns = tuple(data)
        # A statement built before is taken from the cache here, without one more call.
        query = self._cache.get(("upsert", columns, returning)) or self.upsert(columns, returning)
        return query, (*data.values(), token)

    def raise_fence_call(
        self, keyvals: Sequence[Any], token: int, delete: bool, returning: bool
    ) -> Call:
        """:meth:`raise_fence` with its parameters (it returns the row either way)."""
        query = self._cache.get(("raise", delete)) or self.raise_fence(delete=delete)
        return query, (token, *keyvals, token)

    def tombstone_call(
        self, keyvals: Sequence[Any], token: int, delete: bool, returning: bool
    ) -> Call:
        """:meth:`insert_tombstone` with its parameters (it returns the row either way)."""
        return self.insert_tombstone(delete=delete), (*keyvals, token)

    def probe_call(self, keyvals: Sequence[Any]) -> Call:
        """:attr:`probe` with its parameters."""
        return self.probe, keyvals

    def row_call(self, keyvals: Sequence[Any]) -> Call:
        """:attr:`row` (the whole row) with its parameters."""
        return self.row, keyvals

    def is_dead(self, row: Mapping[str, Any]) -> bool:
        """Whether a row a write returned is a tombstone."""
        return self.tombstone_name is not None and bool(row[self.tombstone_name])

    # -- many rows --------------------------------------------------------------------
    #
    # As in the Core guard (see docs/sql-guard.md, "Batches"): the set path is one
    # statement fed by one array per column; the row path reads every fence, then sends the
    # single-row statement with executemany, in a savepoint. psycopg knows only column
    # names, so the guard reads the column types from the catalogue (:data:`TYPES_QUERY`,
    # once per connection and table) and casts each array to its column's type; each
    # set-path statement checks that the types still hold. The types come in as an
    # argument: one table name may name tables of different types on two connections.

    def check_types(self, types: Mapping[str, ColumnType]) -> None:
        """Refuse a table that lacks the fence, tombstone or a key column.

        Raises:
            ConfigurationError: a column the guard was told of is not in the table.
        """
        missing = [n for n in (*self.key_names, *sorted(self.guarded)) if n not in types]
        if missing:
            raise ConfigurationError(f"table {self.name} has no columns {missing}")

    def _types_check(
        self, names: Sequence[str], types: Mapping[str, ColumnType], params: dict[str, Any]
    ) -> sql.SQL:
        """A condition that holds while ``names`` keep the types the statement casts to.

        The types are read once per connection; if a column's type has changed since, the
        condition fails, the statement writes nothing, and the guard reads the types again.
        """
        params["tr"] = self.regclass
        params["tn"] = list(names)
        params["to"] = [types[n].oid for n in names]
        params["tc"] = len(names)
        return sql.SQL(
            "(SELECT count(*) FROM pg_catalog.pg_attribute WHERE attrelid = %(tr)s::regclass "
            "AND attnum > 0 AND NOT attisdropped AND (attname::text, atttypid) IN "
            "(SELECT * FROM unnest(%(tn)s::text[], %(to)s::int8[]::oid[]))) = %(tc)s"
        )

    def check_known(self, names: Iterable[str], types: Mapping[str, ColumnType]) -> None:
        """Refuse columns the table does not have.

        Raises:
            ConfigurationError: a column is not in the table.
        """
        unknown = sorted({n for n in names if n not in types})
        if unknown:
            raise ConfigurationError(f"table {self.name} has no columns {unknown}")

    def _carried(self, names: Iterable[str], types: Mapping[str, ColumnType]) -> bool:
        """Whether arrays can carry these columns: none is itself of an array type."""
        return not any(types[n].is_array for n in names)

    @staticmethod
    def _array(
        param: str, name: str, types: Mapping[str, ColumnType], binary: Mapping[str, bool]
    ) -> sql.Composed:
        mark = "b" if binary.get(param) else "s"
        return sql.SQL("%({}){}::{}[]").format(
            sql.SQL(param), sql.SQL(mark), sql.SQL(types[name].sql)
        )

    @staticmethod
    def _spec(names: Iterable[str], types: Mapping[str, ColumnType]) -> tuple[str, ...]:
        """The type names a statement casts to: part of its cache key."""
        return tuple(types[n].sql for n in names)

    def _keys_match(
        self, params: Sequence[str], types: Mapping[str, ColumnType], binary: Mapping[str, bool]
    ) -> sql.Composed:
        arrays = [
            self._array(p, k, types, binary) for p, k in zip(params, self.key_names, strict=True)
        ]
        if len(arrays) == 1:
            return sql.SQL("{} = ANY({})").format(sql.Identifier(self.key_names[0]), arrays[0])
        return sql.SQL("({}) IN (SELECT * FROM unnest({}))").format(
            self.key_cols, sql.SQL(", ").join(arrays)
        )

    def upsert_set_call(
        self,
        token: int,
        columns: tuple[str, ...],
        rows: Sequence[Mapping[str, Any]],
        types: Mapping[str, ColumnType],
    ) -> tuple[Query, dict[str, Any]] | None:
        """The set path of ``upsert_many``: the statement and its parameters, or ``None``.

        ``INSERT INTO t (...) SELECT ... FROM unnest(%(a0)s::type[], ...) WHERE (SELECT
        count(*) FROM t WHERE key = ANY(...) AND (fence IS NULL OR fence > %(tok)s)) = 0
        ON CONFLICT (key) DO UPDATE SET ... WHERE cur.fence <= EXCLUDED.fence``: the gate
        is a one-time filter, checked before the first row is written; run it in a
        savepoint for the race with a concurrent insert of an absent key. ``None`` (the row
        path) for a column of an array type or one whose values mix Python types.
        """
        if not self._carried(columns, types):
            return None
        params: dict[str, Any] = {"tok": token}
        binary: dict[str, bool] = {}
        for i, name in enumerate(columns):
            values = [row[name] for row in rows]
            kind = one_kind(values)
            if kind is False:
                return None
            params[f"a{i}"] = values
            binary[f"a{i}"] = kind in _BINARY
        types_ok = self._types_check(columns, types, params)
        cache_key = (
            "upsert_set",
            columns,
            self._spec(columns, types),
            tuple(binary.values()),
        )
        found = self._cache.get(cache_key)
        if found is None:
            names = [*columns, self.fence_name]
            if self.tombstone_name:
                names.append(self.tombstone_name)
            settable = [n for n in names if n not in self.key_names]
            arrays = sql.SQL(", ").join(
                self._array(f"a{i}", n, types, binary) for i, n in enumerate(columns)
            )
            outputs: list[sql.Composable] = [
                sql.SQL("fence_rows.{}").format(sql.Identifier(f"a{i}"))
                for i in range(len(columns))
            ]
            outputs.append(token_sql(sql.SQL("%(tok)s")))
            if self.tombstone_name:
                outputs.append(sql.SQL("false"))
            key_params = [f"a{columns.index(k)}" for k in self.key_names]
            found = self._cache[cache_key] = _text(
                sql.SQL(
                    "INSERT INTO {t} AS cur ({names}) SELECT {outputs} FROM unnest({arrays}) "
                    "AS fence_rows({aliases}) WHERE (SELECT count(*) FROM {t} WHERE {keys} "
                    "AND ({f} IS NULL OR {f} > %(tok)s)) = 0 AND {types_ok} "
                    "ON CONFLICT ({key_cols}) "
                    "DO UPDATE SET {sets} WHERE cur.{f} <= EXCLUDED.{f}"
                ).format(
                    t=self.t,
                    names=_names(names),
                    outputs=sql.SQL(", ").join(outputs),
                    arrays=arrays,
                    aliases=_names([f"a{i}" for i in range(len(columns))]),
                    keys=self._keys_match(key_params, types, binary),
                    f=self.f,
                    types_ok=types_ok,
                    key_cols=self.key_cols,
                    sets=sql.SQL(", ").join(
                        sql.SQL("{0} = EXCLUDED.{0}").format(sql.Identifier(n)) for n in settable
                    ),
                )
            )
        return found, params

    def update_set_call(
        self,
        token: int,
        items: Sequence[tuple[tuple[Any, ...], Mapping[str, Any]]],
        types: Mapping[str, ColumnType],
    ) -> tuple[Query, dict[str, Any]] | None:
        """The set path of ``update_many``: the statement and its parameters, or ``None``.

        ``UPDATE t AS cur SET c = fence_rows.c, ..., fence = %(tok)s FROM unnest(...) AS
        fence_rows WHERE cur.key = fence_rows.key AND cur.fence <= %(tok)s [AND live] AND
        (<rows that pass, locked in key order>) = %(n)s``: the locking count is a one-time
        filter, run before the first row is written, and sees fences raised concurrently
        (READ COMMITTED). A column only some rows set comes with an array of booleans
        (``CASE WHEN fence_rows.s THEN fence_rows.a ELSE cur.c END``). ``None`` as for
        :meth:`upsert_set_call`.
        """
        columns = tuple(sorted({name for _, values in items for name in values}))
        if not self._carried((*self.key_names, *columns), types):
            return None
        params: dict[str, Any] = {"tok": token, "n": len(items)}
        binary: dict[str, bool] = {}
        for j in range(len(self.key_names)):
            keys = [k[j] for k, _ in items]
            kind = one_kind(keys)
            if kind is False:
                return None
            params[f"k{j}"] = keys
            binary[f"k{j}"] = kind in _BINARY
        flagged = []
        for i, name in enumerate(columns):
            values = [v.get(name) for _, v in items]
            kind = one_kind(values)
            if kind is False:
                return None
            params[f"a{i}"] = values
            binary[f"a{i}"] = kind in _BINARY
            sets = [name in v for _, v in items]
            flagged.append(not all(sets))
            if flagged[-1]:
                params[f"s{i}"] = sets
        names = (*self.key_names, *columns)
        types_ok = self._types_check(names, types, params)
        cache_key = (
            "update_set",
            columns,
            tuple(flagged),
            self._spec(names, types),
            tuple(binary.values()),
        )
        found = self._cache.get(cache_key)
        if found is None:
            key_params = [f"k{j}" for j in range(len(self.key_names))]
            arrays = [
                self._array(p, k, types, binary)
                for p, k in zip(key_params, self.key_names, strict=True)
            ]
            aliases = list(key_params)
            sets_sql = []
            for i, name in enumerate(columns):
                arrays.append(self._array(f"a{i}", name, types, binary))
                aliases.append(f"a{i}")
                value = sql.SQL("fence_rows.{}").format(sql.Identifier(f"a{i}"))
                if flagged[i]:
                    arrays.append(sql.SQL("%({})b::boolean[]").format(sql.SQL(f"s{i}")))
                    aliases.append(f"s{i}")
                    value = sql.SQL("CASE WHEN fence_rows.{s} THEN {v} ELSE cur.{c} END").format(
                        s=sql.Identifier(f"s{i}"), v=value, c=sql.Identifier(name)
                    )
                sets_sql.append(sql.SQL("{} = {}").format(sql.Identifier(name), value))
            sets_sql.append(sql.SQL("{} = {}").format(self.f, token_sql(sql.SQL("%(tok)s"))))
            matched = sql.SQL(" AND ").join(
                sql.SQL("cur.{} = fence_rows.{}").format(sql.Identifier(k), sql.Identifier(p))
                for k, p in zip(self.key_names, key_params, strict=True)
            )
            found = self._cache[cache_key] = _text(
                sql.SQL(
                    "UPDATE {t} AS cur SET {sets} FROM unnest({arrays}) AS fence_rows({aliases}) "
                    "WHERE {matched} AND cur.{f} <= %(tok)s AND {live} "
                    "AND (SELECT count(*) FROM (SELECT {f} AS f, {live_plain} AS live FROM {t} "
                    "WHERE {keys} ORDER BY {key_cols} FOR UPDATE) AS fence_locked "
                    "WHERE fence_locked.f <= %(tok)s AND fence_locked.live) = %(n)s "
                    "AND {types_ok}"
                ).format(
                    t=self.t,
                    sets=sql.SQL(", ").join(sets_sql),
                    arrays=sql.SQL(", ").join(arrays),
                    aliases=_names(aliases),
                    matched=matched,
                    f=self.f,
                    live=self._live_of("cur"),
                    live_plain=self.live,
                    keys=self._keys_match(key_params, types, binary),
                    key_cols=self.key_cols,
                    types_ok=types_ok,
                )
            )
        return found, params

    def _live_of(self, alias: str) -> sql.Composable:
        if self.tombstone_name is None:
            return sql.SQL("true")
        return sql.SQL("NOT {}.{}").format(
            sql.Identifier(alias), sql.Identifier(self.tombstone_name)
        )

    def probe_set_call(
        self, keys: Sequence[tuple[Any, ...]], types: Mapping[str, ColumnType], *, lock: bool
    ) -> tuple[Query, dict[str, Any]] | None:
        """Key, fence and tombstone flag of every row of ``keys`` at once (key arrays).

        With ``lock`` the rows are locked in key order. ``None`` (read in chunks with
        :meth:`probe_many`) if the keys cannot travel in arrays.
        """
        if not self._carried(self.key_names, types):
            return None
        params: dict[str, Any] = {}
        binary: dict[str, bool] = {}
        for j in range(len(self.key_names)):
            values = [k[j] for k in keys]
            kind = one_kind(values)
            if kind is False:
                return None
            params[f"k{j}"] = values
            binary[f"k{j}"] = kind in _BINARY
        cache_key = (
            "probe_set",
            lock,
            self._spec(self.key_names, types),
            tuple(binary.values()),
        )
        found = self._cache.get(cache_key)
        if found is None:
            found = self._cache[cache_key] = _text(
                sql.SQL("SELECT {keys}, {f}, {dead} FROM {t} WHERE {match}{lock}").format(
                    keys=self.key_cols,
                    f=self.f,
                    dead=self.dead,
                    t=self.t,
                    match=self._keys_match(
                        [f"k{j}" for j in range(len(self.key_names))], types, binary
                    ),
                    lock=self._lock(lock),
                )
            )
        return found, params

    def _lock(self, lock: bool) -> sql.Composable:
        if not lock:
            return sql.SQL("")
        return sql.SQL(" ORDER BY {} FOR UPDATE").format(self.key_cols)

    def probe_many(self, count: int, *, lock: bool = False) -> Query:
        """Key, fence and tombstone flag of ``count`` rows. Parameters: the key values.

        With ``lock`` the rows are locked in key order.
        """
        found = self._cache.get(("probe_many", count, lock))
        if found is None:
            one = sql.SQL("({})").format(
                sql.SQL(", ").join(sql.Placeholder() * len(self.key_names))
            )
            found = self._cache[("probe_many", count, lock)] = _text(
                sql.SQL(
                    "SELECT {keys}, {f}, {dead} FROM {t} WHERE ({keys}) IN ({rows}){lock}"
                ).format(
                    keys=self.key_cols,
                    f=self.f,
                    dead=self.dead,
                    t=self.t,
                    rows=sql.SQL(", ").join([one] * count),
                    lock=self._lock(lock),
                )
            )
        return found

    # -- many rows: the calls of the row flow -----------------------------------------

    def upsert_rows(
        self, token: int, columns: tuple[str, ...], rows: Sequence[Mapping[str, Any]]
    ) -> ManyCall:
        """:meth:`upsert` of ``columns`` with the parameters of every row."""
        params = [(*(row[c] for c in columns), token) for row in rows]
        return self.upsert(columns, False), params

    def probe_reads(self, keys: Sequence[tuple[Any, ...]], types: Any, *, lock: bool) -> list[Call]:
        """:meth:`probe_set_call`, or :meth:`probe_many` in chunks of :attr:`chunk_params`."""
        call = None if types is None else self.probe_set_call(keys, types, lock=lock)
        if call is not None:
            return [call]
        per = self.chunk_params // len(self.key_names)
        return [
            (self.probe_many(len(chunk), lock=lock), [v for k in chunk for v in k])
            for chunk in chunks(keys, per)
        ]


@functools.lru_cache(maxsize=1024)
def row_statements(
    table: TableName,
    key: tuple[str, ...],
    fence: str,
    tombstone: str | None,
    tombstone_insert: bool,
) -> PgRowStatements:
    """The :class:`PgRowStatements` of a table, built once per table and options and shared
    by every guard (the statements it caches are plain strings).

    Raises:
        ConfigurationError: as :class:`PgRowStatements`.
    """
    return PgRowStatements(
        table, key=key, fence=fence, tombstone=tombstone, tombstone_insert=tombstone_insert
    )


class PgRegisterStatements:
    """The statements of a fence register table ``(scope PK, fence BIGINT)``.

    The claim's shape is written once, in :meth:`_claim`: ``INSERT ... ON CONFLICT (scope)
    DO UPDATE SET fence = EXCLUDED.fence WHERE cur.fence <= EXCLUDED.fence``; every claim
    below (one scope, a set of scopes, the session hook's prepared claim) is that upsert
    with its own rows. It is the psycopg twin of the Core register's claim
    (``RegisterStatements`` in ``_sql_statements``).

    Args:
        table: the register table name, or ``(schema, name)``.
    """

    def __init__(self, table: TableName = DEFAULT_REGISTER_TABLE) -> None:
        self.name = ".".join(table) if isinstance(table, tuple) else table
        self.t = _ident(table)
        #: The register as the database's judge sees it (C14).
        self.judged = _judged(table, register=True, key=("scope",))
        self.claim = _text(self._claim(sql.SQL("VALUES (%s, {})").format(_TOKEN), returning=True))
        self.probe = _text(sql.SQL("SELECT scope, fence FROM {} WHERE scope = %s").format(self.t))
        self._claim_set = _text(
            self._claim(
                sql.SQL(
                    "SELECT s, {tok} FROM unnest(%(scopes)b::text[]) AS s WHERE (SELECT "
                    "count(*) FROM {t} WHERE scope = ANY(%(scopes)b::text[]) AND fence > "
                    "%(tok)s) = 0"
                ).format(t=self.t, tok=token_sql(sql.SQL("%(tok)s")))
            )
        )
        self._probe_set = _text(
            sql.SQL("SELECT scope, fence FROM {} WHERE scope = ANY(%(scopes)b::text[])").format(
                self.t
            )
        )

    def _claim(self, rows: sql.Composable, *, returning: bool = False) -> sql.Composed:
        """The claim of the scopes and token of ``rows``: each fence is raised to the token
        where it is not above it, and a scope without a row gets one (C4, C8). With
        ``returning`` a claimed scope comes back as a row."""
        return sql.SQL(
            "INSERT INTO {t} AS cur (scope, fence) {rows} ON CONFLICT (scope) DO UPDATE SET "
            "fence = EXCLUDED.fence WHERE cur.fence <= EXCLUDED.fence{tail}"
        ).format(t=self.t, rows=rows, tail=sql.SQL(" RETURNING scope" if returning else ""))

    def claim_set(self) -> Query:
        """Every scope of ``claim_many`` from one array, gated: nothing is raised unless every
        fence passes. Run it in a savepoint. Parameters: ``scopes`` (a list), ``tok``."""
        return self._claim_set

    def prepared_claim(self) -> sql.Composed:
        """The claim of one scope for ``PREPARE``: parameters ``$1`` (the scope) and ``$2``
        (the token), no ``RETURNING`` (the command tag's row count proves it).

        Composed, not text: the caller renders it for the connection that prepares it.
        """
        return self._claim(sql.SQL("VALUES ($1, {})").format(token_sql(sql.SQL("$2"))))

    def probe_set(self) -> Query:
        """The fences of the scopes in the list ``scopes``."""
        return self._probe_set


class PgRegisterCalls(PgRegisterStatements):
    """:class:`PgRegisterStatements` with the calls of the register flow
    (:class:`~fence.adapters._row_statements.RegisterStatementSet`).

    Args:
        table: the register table name, or ``(schema, name)``.
    """

    #: psycopg begins the caller's transaction before any statement: no opener.
    opener = None
    #: PostgreSQL counts the rows an upsert wrote (see ``RowStatementSet.found_rows``).
    found_rows = False
    #: A read of the fences for a batch's check locks the rows.
    locks_rows = True

    def __init__(self, table: TableName = DEFAULT_REGISTER_TABLE) -> None:
        super().__init__(table)
        self._probe_set_locked = self.probe_set() + " ORDER BY scope FOR UPDATE"

    def claim_call(self, scope: str, token: int, returning: bool) -> Call:
        """:attr:`claim` with its parameters (it returns the scope either way)."""
        return self.claim, (scope, token)

    def claim_set_call(self, scopes: Sequence[str], token: int) -> Call:
        """:meth:`claim_set` with its parameters: any number of scopes in one statement."""
        return self.claim_set(), {"scopes": list(scopes), "tok": token}

    def claim_rows(self, scopes: Sequence[str], token: int) -> ManyCall:
        """Never needed: :meth:`claim_set_call` carries every batch.

        Raises:
            NotImplementedError: always.
        """
        raise NotImplementedError("the psycopg register claims every batch in one statement")

    def probe_call(self, scope: str) -> Call:
        """:attr:`probe` with its parameter."""
        return self.probe, (scope,)

    def probe_reads(self, scopes: Sequence[str], *, lock: bool) -> list[Call]:
        """:meth:`probe_set` of every scope at once (locking the rows, in scope order)."""
        return [(self._probe_set_locked if lock else self.probe_set(), {"scopes": list(scopes)})]


@functools.lru_cache(maxsize=64)
def register_calls(table: TableName) -> PgRegisterCalls:
    """The :class:`PgRegisterCalls` of a register table, built once and shared."""
    return PgRegisterCalls(table)
