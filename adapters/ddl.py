"""The SQL guards' DDL as text, for migrations and ``fence ddl``: importing it loads no
database driver and no SQLAlchemy.

Each template has a ``{table}`` field and runs on PostgreSQL and SQLite::

    from fence.adapters.ddl import FENCE_COLUMN_DDL, trigger_ddl

    op.execute(FENCE_COLUMN_DDL.format(table="accounts"))  # in an Alembic migration
    for statement in trigger_ddl("accounts", tombstone="deleted"):  # the database's judge
        op.execute(statement)

``fence.adapters.sql`` and ``fence.adapters.psycopg`` export the same constants.

The database's judge (C14) is a set of triggers on every fenced table and on the fence
register: they refuse a row write in a transaction that holds no token, or whose token is
below the row's fence, and any write that would lower a fence, whoever sends it.
:func:`trigger_ddl` is their DDL; running it again upgrades them. See
``docs/database-judge.md``.
"""

from __future__ import annotations

from collections.abc import Sequence

from fence._errors import ConfigurationError
from fence._sql_dialect import SQLSTATE_REFUSED, SQLSTATE_STALE, SQLSTATE_UNFENCED

from ._triggers import (
    JUDGE_VERSION,
    MARIADB_UNFENCED_SQL,
    TOKEN_SETTING,
    TOKEN_VARIABLE,
    UNFENCED_SETTING,
    UNFENCED_SQL,
    UNFENCED_VARIABLE,
    Judged,
    mariadb_drop_ddl,
    mariadb_judge_ddl,
    pg_drop_ddl,
    pg_judge_ddl,
    pg_rewrite_judge_ddl,
    sqlite_drop_ddl,
    sqlite_judge_ddl,
)

__all__ = [
    "DEFAULT_FENCE_COLUMN",
    "DEFAULT_REGISTER_TABLE",
    "DEFAULT_TOMBSTONE_COLUMN",
    "FENCE_COLUMN_DDL",
    "JUDGE_VERSION",
    "MARIADB_UNFENCED_SQL",
    "MYSQL_REGISTER_TABLE_DDL",
    "REGISTER_TABLE_DDL",
    "SQLSTATE_REFUSED",
    "SQLSTATE_STALE",
    "SQLSTATE_UNFENCED",
    "TOKEN_SETTING",
    "TOKEN_VARIABLE",
    "TOMBSTONE_COLUMN_DDL",
    "UNFENCED_SETTING",
    "UNFENCED_SQL",
    "UNFENCED_VARIABLE",
    "drop_trigger_ddl",
    "rewrite_trigger_ddl",
    "trigger_ddl",
]

#: The name the guards look for when no fence column is named.
DEFAULT_FENCE_COLUMN = "fence"

#: The conventional name of the soft-delete flag that turns a deleted row into a tombstone.
DEFAULT_TOMBSTONE_COLUMN = "deleted"

#: The default table of a fence register.
DEFAULT_REGISTER_TABLE = "fence_register"

#: The fence column, for an existing table (PostgreSQL and SQLite). Existing rows start at 0,
#: so the first token accepted raises them.
FENCE_COLUMN_DDL = "ALTER TABLE {table} ADD COLUMN fence BIGINT NOT NULL DEFAULT 0"

#: The soft-delete flag that keeps a deleted row, and its fence, as a tombstone (C7).
TOMBSTONE_COLUMN_DDL = "ALTER TABLE {table} ADD COLUMN deleted BOOLEAN NOT NULL DEFAULT FALSE"

#: The fence register (PostgreSQL and SQLite): one row per fence scope, never deleted.
REGISTER_TABLE_DDL = (
    "CREATE TABLE IF NOT EXISTS {table} (\n"
    "    scope VARCHAR(512) PRIMARY KEY,\n"
    "    fence BIGINT NOT NULL\n"
    ")"
)

#: The fence register on MariaDB and MySQL: the scope compared byte for byte, so that two
#: scopes that differ in case or accents (``Order:1``, ``order:1``) never share a fence, as
#: they would under the server's usual case-insensitive collation.
MYSQL_REGISTER_TABLE_DDL = (
    "CREATE TABLE IF NOT EXISTS {table} (\n"
    "    scope VARCHAR(512) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin PRIMARY KEY,\n"
    "    fence BIGINT NOT NULL\n"
    ")"
)


def _judged(
    table: str,
    *,
    schema: str | None,
    fence: str,
    tombstone: str | None,
    register: bool,
    optional: bool,
    key: Sequence[str] | None,
) -> Judged:
    for what, value in (("table", table), ("fence", fence)):
        if not isinstance(value, str) or not value:
            raise ConfigurationError(f"{what} must be a non-empty str, got {value!r}")
    if register and tombstone is not None:
        raise ConfigurationError("a fence register has no tombstone flag")
    return Judged(
        table,
        schema,
        fence=fence,
        tombstone=tombstone,
        register=register,
        optional=optional,
        key=tuple(key) if key else None,
    )


def trigger_ddl(
    table: str,
    *,
    dialect: str = "postgresql",
    schema: str | None = None,
    fence: str = DEFAULT_FENCE_COLUMN,
    tombstone: str | None = None,
    register: bool = False,
    optional: bool = False,
    key: Sequence[str] | None = None,
) -> list[str]:
    """The database's judge of one table (C14): the statements that install its triggers,
    or replace them with this version's (an upgrade). Run them in one transaction, after
    the fence column exists.

    PostgreSQL: one trigger function for the table (its signature in its comment) and four
    triggers: ``BEFORE INSERT``, ``UPDATE``, ``DELETE`` (for each row) and ``TRUNCATE``.
    SQLite: ``BEFORE`` triggers that refuse, and ``AFTER`` triggers that raise the fence of
    a plain write of the current holder; they call functions iofence registers on its own
    connections, so another program's connection cannot write the table. MariaDB and
    MySQL: ``BEFORE INSERT``, ``UPDATE`` and ``DELETE`` triggers that read the token from
    the session variable ``@iofence_token`` (each statement is one trigger, whose body
    holds semicolons: the ``mariadb`` client needs a ``DELIMITER``).

    Args:
        table: the table's name, as the catalogue spells it.
        dialect: ``"postgresql"``, ``"sqlite"``, ``"mariadb"`` or ``"mysql"``.
        schema: its schema (PostgreSQL), attached database (SQLite) or database (MariaDB).
        fence: the fence column.
        tombstone: the tombstone flag, if the table has one: a hard delete is then refused
            (it would drop the fence the tombstone keeps).
        register: the table is a fence register (``scope``, ``fence``): deleting its rows
            is refused.
        optional: a ``fenced_version()`` model's table: writes without a token keep plain
            optimistic concurrency (they pass, never lowering the fence).
        key: the key columns (SQLite, for a ``WITHOUT ROWID`` table; default ``rowid``.
            MariaDB: they name the row in a stale write's error; without them, the table).

    Raises:
        ConfigurationError: an unknown dialect, an empty name, or a register with a
            tombstone flag.

    Example::

        for statement in trigger_ddl("accounts", tombstone="deleted"):
            op.execute(statement)                     # Alembic
    """
    judged = _judged(
        table,
        schema=schema,
        fence=fence,
        tombstone=tombstone,
        register=register,
        optional=optional,
        key=key,
    )
    if dialect == "postgresql":
        return pg_judge_ddl(judged)
    if dialect == "sqlite":
        return sqlite_judge_ddl(judged)
    if dialect in ("mariadb", "mysql"):
        return mariadb_judge_ddl(judged, replace=dialect == "mariadb")
    raise ConfigurationError(
        f"the database's judge exists for postgresql, sqlite, mariadb and mysql, not {dialect!r}"
    )


def drop_trigger_ddl(
    table: str,
    *,
    dialect: str = "postgresql",
    schema: str | None = None,
    fence: str = DEFAULT_FENCE_COLUMN,
) -> list[str]:
    """The statements that remove the judge of a table: a migration's ``downgrade``.

    Without its triggers the table is judged by the client-side checks only; the guards
    then refuse to write it until the triggers are back.

    Raises:
        ConfigurationError: an unknown dialect or an empty name.
    """
    judged = _judged(
        table, schema=schema, fence=fence, tombstone=None, register=False, optional=False, key=None
    )
    if dialect == "postgresql":
        return pg_drop_ddl(judged)
    if dialect == "sqlite":
        return sqlite_drop_ddl(judged)
    if dialect in ("mariadb", "mysql"):
        return mariadb_drop_ddl(judged)
    raise ConfigurationError(
        f"the database's judge exists for postgresql, sqlite, mariadb and mysql, not {dialect!r}"
    )


def rewrite_trigger_ddl(*, schema: str | None = None) -> list[str]:
    """The judge of table rewrites (PostgreSQL, once per database): an event trigger that
    refuses an ``ALTER TABLE`` that would rewrite a fenced table (``ALTER COLUMN ... TYPE
    ... USING``, a volatile default), which fires no row trigger, unless the transaction
    opted out (:data:`UNFENCED_SQL`, as a migration does). Creating an event trigger needs
    a superuser; without it such a rewrite is beyond the judge (see
    ``docs/database-judge.md``).

    Args:
        schema: the schema of its function (default: the first of the search path).
    """
    return pg_rewrite_judge_ddl(schema)
