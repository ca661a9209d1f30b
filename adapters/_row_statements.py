"""What the row statements of every SQL guard share: the checks of keys and values. No I/O.

:class:`~fence.adapters._sql_statements.RowStatements` (SQLAlchemy Core) and
:class:`~fence.adapters._pg_statements.PgRowStatements` (psycopg) build their statements
each in their own way; the checks that run before any I/O are written once, here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fence._errors import ConfigurationError

from ._sql_common import row_scope

__all__ = ["Key", "RowStatementsBase"]

#: A row key as the caller gives it: a scalar, a tuple, or a mapping of key column to value.
Key = Any

#: Key types taken as one key value without further checks (exact types: a subclass of
#: either may be a tuple-like or mapping-like value and goes the general way).
_SCALAR_KEYS = frozenset({int, str})


class RowStatementsBase:
    """What the row statement sets share: the checks of keys, values and batches. No I/O.

    A subclass sets the attributes below.

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
        if type(key) in _SCALAR_KEYS and len(key_names) == 1:
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
