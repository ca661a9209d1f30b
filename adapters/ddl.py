"""The SQL guards' DDL as text, for migrations and ``fence ddl``: importing it loads no
database driver and no SQLAlchemy.

Each template has a ``{table}`` field and runs on PostgreSQL and SQLite::

    from fence.adapters.ddl import FENCE_COLUMN_DDL

    op.execute(FENCE_COLUMN_DDL.format(table="accounts"))  # in an Alembic migration

``fence.adapters.sql`` and ``fence.adapters.psycopg`` export the same constants.
"""

from __future__ import annotations

__all__ = [
    "DEFAULT_FENCE_COLUMN",
    "DEFAULT_REGISTER_TABLE",
    "DEFAULT_TOMBSTONE_COLUMN",
    "FENCE_COLUMN_DDL",
    "REGISTER_TABLE_DDL",
    "TOMBSTONE_COLUMN_DDL",
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
