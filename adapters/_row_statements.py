"""The statements every SQL guard writes through, as the flows see them. No I/O.

The row and register flows (``_async/row_flow.py``) decide; a statements object builds each
statement with its parameters, and an executor runs it. Two statement sets implement the
protocols here: :class:`~fence.adapters._sql_statements.DialectRowStatements` (SQLAlchemy
Core constructs for one dialect) and :class:`~fence.adapters._pg_statements.PgRowStatements`
(psycopg ``sql`` text), with their register twins. Another database or driver is one more
statement set (or one more executor running one of these).

:class:`RowStatementsBase` holds what the row statement sets share, once: the key, value
and batch checks that run before any I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from fence._errors import ConfigurationError

from ._sql_common import key_order, row_scope
from ._triggers import Judged

__all__ = [
    "SCALAR_KEYS",
    "Call",
    "Key",
    "ManyCall",
    "RegisterStatementSet",
    "RowStatementSet",
    "RowStatementsBase",
]

#: A row key as the caller gives it: a scalar, a tuple, or a mapping of key column to value.
Key = Any

#: A statement and its parameters, as the executor runs them: a SQLAlchemy construct and a
#: dict of bind parameters, or psycopg text and a tuple or dict.
Call = tuple[Any, Any]

#: A statement and the parameters of each of its rows, for ``executemany``.
ManyCall = tuple[Any, Sequence[Any]]

#: Which of its checked updates a statement set remembers: (columns, returning) -> the
#: statement and its value parameters' names (``None`` where they are positional).
Checked = dict[tuple[tuple[str, ...], bool], tuple[Any, Any]]

_T = TypeVar("_T")

#: Key types taken as one key value without further checks (exact types: a subclass of
#: either may be a tuple-like or mapping-like value and goes the general way).
SCALAR_KEYS = frozenset({int, str})


class RowStatementSet(Protocol):
    """The statements of the row guard for one table, as the row flow uses them.

    Inheriting is optional. The ``*_call`` methods return a statement with its parameters
    (:data:`Call`); every write keeps the acceptance rule (C4) inside the database: it
    changes the row only where ``fence <= token`` holds and sets ``fence = token`` in the
    same statement. ``types`` is what the executor's ``column_types`` read (``None`` where
    the statements know the column types themselves).

    Attributes:
        name: the table's name, the scope of batch errors.
        key_names: the key columns, in key order.
        tombstone_name: the soft-delete column, ``None`` if the table has none.
        can_insert_tombstone: a row holding only its key, fence and tombstone flag can be
            inserted for an absent key (claims and deletes of absent rows).
        checked_updates: the single-row updates whose columns passed
            :meth:`check_values` once (:meth:`checked_update`): the hot path skips the check.
        locks_rows: a batch's read of its fences locks the rows (``FOR UPDATE``); not on
            SQLite, whose write lock covers the database.
        opener: a write that changes nothing, sent before a batch's savepoint where the
            driver begins a transaction only before a write (SQLite); ``None`` elsewhere.
        judged: the table as the database's judge sees it (C14): what its triggers must
            have been made for.
        found_rows: MariaDB and MySQL: an upsert counts 1 both for an inserted row and for
            an existing row it left as it was (a refused one), 2 for a changed row; and a
            plain read sees the transaction's snapshot (REPEATABLE READ), not the rows as
            the write found them. The flows settle a count of 1, and read every verdict,
            with a locking read of the fences.
    """

    name: str
    judged: Judged
    key_names: tuple[str, ...]
    tombstone_name: str | None
    can_insert_tombstone: bool
    checked_updates: Checked
    locks_rows: bool
    opener: Any
    found_rows: bool

    def key_values(self, key: Key) -> tuple[Any, ...]:
        """Normalise a key (scalar, tuple or mapping) to values in key-column order."""
        ...

    def scope(self, keyvals: Sequence[Any]) -> str:
        """The scope name of a row, e.g. ``accounts(42)``."""
        ...

    def check_values(self, values: Mapping[str, Any], *, upsert: bool) -> dict[str, Any]:
        """Check the column values of a write; return them as a plain dict."""
        ...

    def checked_update(self, columns: tuple[str, ...], returning: bool) -> tuple[Any, Any]:
        """Remember and return the update of ``columns`` (already checked)."""
        ...

    def update_params(
        self, names: Any, keyvals: Sequence[Any], token: int, values: Mapping[str, Any]
    ) -> Any:
        """The parameters of a checked update; ``names`` as :meth:`checked_update` gave."""
        ...

    def upsert_call(self, data: Mapping[str, Any], token: int, returning: bool) -> Call:
        """The fenced insert-or-replace of one row (``data`` includes the key)."""
        ...

    def raise_fence_call(
        self, keyvals: Sequence[Any], token: int, delete: bool, returning: bool
    ) -> Call:
        """Raise the fence of an existing row (and mark it deleted with ``delete``)."""
        ...

    def tombstone_call(
        self, keyvals: Sequence[Any], token: int, delete: bool, returning: bool
    ) -> Call:
        """Insert a tombstone holding only the key and the fence, for an absent row."""
        ...

    def probe_call(self, keyvals: Sequence[Any]) -> Call:
        """The diagnostic read of one row: its fence and tombstone flag."""
        ...

    def row_call(self, keyvals: Sequence[Any]) -> Call:
        """The read of one whole row, for a registering read where the database has no
        ``UPDATE ... RETURNING`` (MariaDB, MySQL)."""
        ...

    def is_dead(self, row: Any) -> bool:
        """Whether a row a write returned is a tombstone."""
        ...

    def update_batch(
        self, items: Mapping[Key, Mapping[str, Any]]
    ) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
        """The keys and checked values of an ``update_many``."""
        ...

    def upsert_batch(
        self, rows: Sequence[Mapping[str, Any]]
    ) -> tuple[tuple[str, ...], list[tuple[tuple[Any, ...], dict[str, Any]]]]:
        """The columns and the keyed, checked rows of an ``upsert_many``, in key order."""
        ...

    def check_known(self, names: Iterable[str], types: Any) -> None:
        """Refuse columns the table does not have (where :meth:`check_values` cannot)."""
        ...

    def update_set_call(
        self, token: int, items: Sequence[tuple[tuple[Any, ...], Mapping[str, Any]]], types: Any
    ) -> Call | None:
        """The set path of ``update_many`` (one statement fed by arrays), if it applies."""
        ...

    def update_rows(
        self, token: int, items: Sequence[tuple[tuple[Any, ...], Mapping[str, Any]]]
    ) -> list[ManyCall]:
        """The row path of ``update_many``: single-row updates, one per set of columns."""
        ...

    def upsert_set_call(
        self,
        token: int,
        columns: tuple[str, ...],
        rows: Sequence[Mapping[str, Any]],
        types: Any,
    ) -> Call | None:
        """The set path of ``upsert_many``, if it applies."""
        ...

    def upsert_rows(
        self, token: int, columns: tuple[str, ...], rows: Sequence[Mapping[str, Any]]
    ) -> ManyCall:
        """The row path of ``upsert_many``: the single-row upsert of every row."""
        ...

    def probe_reads(self, keys: Sequence[tuple[Any, ...]], types: Any, *, lock: bool) -> list[Call]:
        """Reads of key, fence and tombstone flag of the rows of ``keys`` that exist."""
        ...


class RegisterStatementSet(Protocol):
    """The statements of a fence register table ``(scope PK, fence)``, as its flow uses them.

    Inheriting is optional.

    Attributes:
        name: the register table's name, the scope of batch errors.
        locks_rows: as :attr:`RowStatementSet.locks_rows`.
        opener: as :attr:`RowStatementSet.opener`.
        judged: as :attr:`RowStatementSet.judged`.
        found_rows: as :attr:`RowStatementSet.found_rows`.
    """

    name: str
    judged: Judged
    locks_rows: bool
    opener: Any
    found_rows: bool

    def claim_call(self, scope: str, token: int, returning: bool) -> Call:
        """The claim of one scope: insert its fence, or raise it iff ``token`` passes."""
        ...

    def claim_set_call(self, scopes: Sequence[str], token: int) -> Call | None:
        """The claim of every scope in one statement, gated (C6); ``None``: the row path."""
        ...

    def claim_rows(self, scopes: Sequence[str], token: int) -> ManyCall:
        """The single claim of every scope, for ``executemany`` (the row path)."""
        ...

    def probe_call(self, scope: str) -> Call:
        """The read of one scope's row: ``(scope, fence)``."""
        ...

    def probe_reads(self, scopes: Sequence[str], *, lock: bool) -> list[Call]:
        """Reads of ``(scope, fence)`` of every scope that has a row."""
        ...


class RowStatementsBase:
    """What the row statement sets share: the checks of keys, values and batches. No I/O.

    A subclass sets the attributes below and ``update``/``row_params`` for
    :meth:`update_rows`.

    Attributes:
        name: the table's name, for scopes and errors.
        key_names: the key columns, in key order.
        key_set: the same, as a set.
        guarded: the columns the guard sets from the token (fence, tombstone flag).
        columns: every column of the table, or ``None`` if the statements do not know them
            (psycopg: the batch path reads them from the catalogue).
    """

    name: str
    key_names: tuple[str, ...]
    key_set: frozenset[str]
    guarded: set[str]
    columns: frozenset[str] | None

    # -- inputs -----------------------------------------------------------------------

    def key_values(self, key: Key) -> tuple[Any, ...]:
        """Normalise a key (scalar, tuple or mapping) to values in key-column order.

        Raises:
            ConfigurationError: the key does not match the key columns, or holds ``None``.
        """
        key_names = self.key_names
        if type(key) in SCALAR_KEYS and len(key_names) == 1:
            return (key,)  # the common case: one key column, an int or str key
        if isinstance(key, Mapping):
            try:
                values = tuple(key[name] for name in key_names)
            except KeyError as exc:
                raise ConfigurationError(
                    f"key {dict(key)!r} of {self.name} lacks column {exc.args[0]!r}"
                ) from None
            if len(key) != len(values):
                raise ConfigurationError(
                    f"key {dict(key)!r} of {self.name} has columns beyond {tuple(key_names)}"
                )
            return values
        values = key if isinstance(key, tuple) else (key,)
        if len(values) != len(key_names):
            raise ConfigurationError(f"{self.name} is keyed by {tuple(key_names)}; got key {key!r}")
        if any(v is None for v in values):
            raise ConfigurationError(f"key {key!r} of {self.name} contains None")
        return values

    def scope(self, keyvals: Sequence[Any]) -> str:
        """The scope name of a row, e.g. ``accounts(42)``."""
        return row_scope(self.name, keyvals)

    def check_values(self, values: Mapping[str, Any], *, upsert: bool) -> dict[str, Any]:
        """Check the column values of a write; return them as a plain dict.

        Raises:
            ConfigurationError: not a mapping, a column the table lacks (where the
                statements know the columns) or a name that is not a ``str``, the fence or
                tombstone column set by hand, key columns changed by an update, or key
                columns missing from an upsert.
        """
        if not isinstance(values, Mapping):
            raise ConfigurationError(
                f"the values of a write to {self.name} must be a mapping of column name to "
                f"value, got {type(values).__name__}"
            )
        data = dict(values)
        keys_ok = self.key_set.issubset(data) if upsert else self.key_set.isdisjoint(data)
        columns = self.columns
        if (
            keys_ok
            and self.guarded.isdisjoint(data)
            and (columns is None or columns.issuperset(data))
        ):
            return data  # the common case, checked with set operations only
        if columns is not None:
            unknown = [name for name in data if name not in columns]
            if unknown:
                raise ConfigurationError(f"table {self.name} has no columns {unknown}")
        elif not all(isinstance(name, str) for name in data):
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

    # -- batches ----------------------------------------------------------------------

    def keyed(self, pairs: Iterable[tuple[Key, _T]]) -> list[tuple[tuple[Any, ...], _T]]:
        """Normalise the keys of ``(key, item)`` pairs; refuse a key given twice.

        Raises:
            ConfigurationError: a key does not match the key columns, or appears twice.
        """
        out: dict[tuple[Any, ...], _T] = {}
        for key, item in pairs:
            keyvals = self.key_values(key)
            if keyvals in out:
                raise ConfigurationError(f"key {keyvals!r} appears twice in the batch")
            out[keyvals] = item
        return list(out.items())

    def update_batch(
        self, items: Mapping[Key, Mapping[str, Any]]
    ) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
        """The keys and checked values of an ``update_many``, in the caller's order.

        Raises:
            ConfigurationError: as :meth:`keyed` and :meth:`check_values`.
        """
        return [(k, self.check_values(v, upsert=False)) for k, v in self.keyed(items.items())]

    def upsert_batch(
        self, rows: Sequence[Mapping[str, Any]]
    ) -> tuple[tuple[str, ...], list[tuple[tuple[Any, ...], dict[str, Any]]]]:
        """The columns and the keyed, checked rows of an ``upsert_many``, in key order.

        An upsert takes its row locks in the order of its rows; in key order, two batches
        that share keys wait for each other instead of deadlocking.

        Raises:
            ConfigurationError: rows that set different columns, and as :meth:`keyed` and
                :meth:`check_values`.
        """
        data = [self.check_values(row, upsert=True) for row in rows]
        if not data:
            return (), []
        columns = tuple(data[0])
        names = set(columns)
        if any(row.keys() != names for row in data):
            raise ConfigurationError(
                f"every row of a batch upsert of {self.name} must set the same columns"
            )
        key_names = self.key_names
        return columns, key_order(
            self.keyed((tuple(row[n] for n in key_names), row) for row in data)
        )

    def update_rows(
        self, token: int, items: Sequence[tuple[tuple[Any, ...], Mapping[str, Any]]]
    ) -> list[ManyCall]:
        """The row path of ``update_many``: the single-row update of each set of columns,
        with the parameters of every row that sets them."""
        groups: dict[tuple[str, ...], list[Any]] = {}
        for keyvals, values in items:
            columns = tuple(sorted(values))
            groups.setdefault(columns, []).append(self.row_params(columns, keyvals, token, values))
        return [(self.update(columns, False), rows) for columns, rows in groups.items()]

    def update(self, columns: tuple[str, ...], returning: bool) -> Any:
        """The fenced single-row update of ``columns`` (see the subclasses)."""
        raise NotImplementedError

    def row_params(
        self,
        columns: tuple[str, ...],
        keyvals: Sequence[Any],
        token: int,
        values: Mapping[str, Any],
    ) -> Any:
        """The parameters of :meth:`update` of ``columns`` for one row of a batch."""
        raise NotImplementedError
