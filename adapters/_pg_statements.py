"""SQL text of the psycopg guard, composed once with quoted identifiers. No I/O.

Every statement keeps the acceptance rule (C4) inside PostgreSQL: the write happens only
where ``fence <= %s`` holds, and sets ``fence`` to the token in the same statement.
Statements with a fixed shape are cached as strings, so psycopg prepares them after a few
runs like any other repeated query.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from psycopg import sql

from fence._errors import ConfigurationError

from ._sql_common import DEFAULT_FENCE_COLUMN, DEFAULT_REGISTER_TABLE, key_values, row_scope

__all__ = ["PgRegisterStatements", "PgRowStatements", "TableName"]

#: A table name: ``"accounts"`` or ``("schema", "accounts")``.
TableName = str | tuple[str, str]

Query = str


def _ident(name: TableName) -> sql.Identifier:
    return sql.Identifier(*name) if isinstance(name, tuple) else sql.Identifier(name)


def _text(composed: sql.Composable) -> Query:
    return composed.as_string()


def _names(names: Sequence[str]) -> sql.Composed:
    return sql.SQL(", ").join(sql.Identifier(n) for n in names)


class PgRowStatements:
    """The statements of the psycopg row guard for one table.

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
        self._cache: dict[Any, Query] = {}
        self.probe = _text(
            sql.SQL("SELECT {f}, {dead} FROM {t} WHERE {key}").format(
                f=self.f, dead=self.dead, t=self.t, key=self.key_eq
            )
        )

    # -- inputs -----------------------------------------------------------------------

    def key_values(self, key: Any) -> tuple[Any, ...]:
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
            ConfigurationError: the fence or tombstone column set by hand, key columns
                changed by an update, key columns missing from an upsert, or a column
                name that is not a ``str``.
        """
        data = dict(values)
        keys_ok = self.key_set.issubset(data) if upsert else self.key_set.isdisjoint(data)
        if keys_ok and self.guarded.isdisjoint(data):
            return data  # the common case, checked with set operations only
        if not all(isinstance(name, str) for name in data):
            raise ConfigurationError("column names must be str")
        managed = sorted(name for name in data if name in self.guarded)
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
                    "UPDATE {t} SET {sets}, {f} = %s WHERE {key} AND {f} <= %s AND {live}{tail}"
                ).format(t=self.t, sets=sets, f=self.f, key=self.key_eq, live=self.live, tail=tail)
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
                    "UPDATE {t} SET {f} = %s{extra} WHERE {key} AND {f} <= %s RETURNING *"
                ).format(t=self.t, f=self.f, extra=extra, key=self.key_eq)
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
                    "INSERT INTO {t} AS cur ({keys}, {f}, {tomb}) VALUES ({marks}, %s, true) "
                    "ON CONFLICT ({keys}) DO UPDATE SET {f} = EXCLUDED.{f}{extra} "
                    "WHERE cur.{f} <= EXCLUDED.{f} RETURNING *"
                ).format(
                    t=self.t,
                    keys=self.key_cols,
                    f=self.f,
                    tomb=tomb,
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
        return sql.SQL("({marks}, %s{tomb})").format(
            marks=sql.SQL(", ").join(sql.Placeholder() * count), tomb=tomb
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

    # -- many rows --------------------------------------------------------------------

    def _keys_in(self, count: int) -> sql.Composed:
        one = sql.SQL("({})").format(sql.SQL(", ").join(sql.Placeholder() * len(self.key_names)))
        return sql.SQL("({keys}) IN ({rows})").format(
            keys=self.key_cols, rows=sql.SQL(", ").join([one] * count)
        )

    def update_many(
        self, items: Sequence[tuple[tuple[Any, ...], Mapping[str, Any]]], token: int
    ) -> tuple[Query, list[Any]]:
        """One statement that updates every row or none (C6), and its parameters.

        A scalar sub-select locks every target row (``FOR UPDATE``, in key order) and
        counts those that pass; PostgreSQL runs it as a one-time filter before the first
        row is written, and under READ COMMITTED the locking read sees the newest fences.
        """
        params: list[Any] = []
        columns = sorted({name for _, values in items for name in values})
        match = sql.SQL("({})").format(self.key_eq)
        sets = []
        for name in columns:
            col = sql.Identifier(name)
            whens = []
            for keyvals, values in items:
                if name in values:
                    whens.append(sql.SQL("WHEN {} THEN %s").format(match))
                    params.extend(keyvals)
                    params.append(values[name])
            sets.append(
                sql.SQL("{col} = CASE {whens} ELSE {col} END").format(
                    col=col, whens=sql.SQL(" ").join(whens)
                )
            )
        keys_in = self._keys_in(len(items))
        flat_keys = [v for keyvals, _ in items for v in keyvals]
        query = sql.SQL(
            "UPDATE {t} SET {sets}, {f} = %s WHERE {keys_in} AND {f} <= %s AND {live} "
            "AND (SELECT count(*) FROM (SELECT {f} AS f, {live} AS live FROM {t} "
            "WHERE {keys_in} ORDER BY {keys} FOR UPDATE) AS fence_locked "
            "WHERE fence_locked.f <= %s AND fence_locked.live) = %s "
            "RETURNING {keys}"
        ).format(
            t=self.t,
            sets=sql.SQL(", ").join(sets),
            f=self.f,
            keys_in=keys_in,
            live=self.live,
            keys=self.key_cols,
        )
        params += [token, *flat_keys, token, *flat_keys, token, len(items)]
        return _text(query), params

    def probe_many(self, count: int) -> Query:
        """Key, fence and tombstone flag of ``count`` rows. Parameters: the key values."""
        return _text(
            sql.SQL("SELECT {keys}, {f}, {dead} FROM {t} WHERE {keys_in}").format(
                keys=self.key_cols, f=self.f, dead=self.dead, t=self.t, keys_in=self._keys_in(count)
            )
        )

    def upsert_many(self, columns: tuple[str, ...], count: int) -> Query:
        """A multi-row fenced upsert; run it in a savepoint and check the returned count.

        Parameters: per row, its values and the token.
        """
        head, tail = self._upsert_head(columns)
        rows = sql.SQL(", ").join([self._row_marks(len(columns))] * count)
        return _text(head + rows + tail + sql.SQL(" RETURNING {}").format(self.key_cols))


class PgRegisterStatements:
    """The statements of a fence register table ``(scope PK, fence BIGINT)``.

    Args:
        table: the register table name, or ``(schema, name)``.
    """

    def __init__(self, table: TableName = DEFAULT_REGISTER_TABLE) -> None:
        self.name = ".".join(table) if isinstance(table, tuple) else table
        self.t = _ident(table)
        self.claim = self.claim_many(1)
        self.probe = _text(sql.SQL("SELECT scope, fence FROM {} WHERE scope = %s").format(self.t))

    def claim_many(self, count: int) -> Query:
        """``INSERT ... ON CONFLICT (scope) DO UPDATE SET fence = %s WHERE fence <= %s``.

        Parameters: per scope, the scope and the token.
        """
        rows = sql.SQL(", ").join([sql.SQL("(%s, %s)")] * count)
        return _text(
            sql.SQL(
                "INSERT INTO {t} AS cur (scope, fence) VALUES {rows} ON CONFLICT (scope) "
                "DO UPDATE SET fence = EXCLUDED.fence WHERE cur.fence <= EXCLUDED.fence "
                "RETURNING scope"
            ).format(t=self.t, rows=rows)
        )

    def probe_many(self, count: int) -> Query:
        """The fences of ``count`` scopes. Parameters: the scopes."""
        marks = sql.SQL(", ").join(sql.Placeholder() * count)
        return _text(
            sql.SQL("SELECT scope, fence FROM {t} WHERE scope IN ({marks})").format(
                t=self.t, marks=marks
            )
        )
