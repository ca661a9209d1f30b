"""Fenced PostgreSQL rows through plain psycopg 3, sync and asyncio.

The same contract as :mod:`fence.adapters.sql`, without SQLAlchemy:

- :class:`RowGuard` / :class:`AsyncRowGuard`: each row carries its own fence column;
  fenced update, upsert, soft delete, claim, registering read and all-or-nothing batches.
- :class:`FenceRegister` / :class:`AsyncFenceRegister`: fences in a table of their own,
  claimed at the start of a transaction to fence a whole unit of work.

Example::

    import psycopg
    from fence.adapters.psycopg import RowGuard

    with psycopg.connect(dsn) as conn:          # commits on success
        guard = RowGuard(conn, "accounts", key="id", tombstone="deleted")
        guard.update(42, lease.token, {"balance": 10})

See ``docs/sql-guard.md`` for the DDL, the isolation levels and the tombstones.
"""

from __future__ import annotations

from typing import Any

import psycopg

from ._async.psycopg import AsyncFenceRegister, AsyncRowGuard
from ._pg_statements import TableName, forget_judged
from ._sql_common import (
    DEFAULT_FENCE_COLUMN,
    FENCE_COLUMN_DDL,
    REGISTER_TABLE_DDL,
    TOMBSTONE_COLUMN_DDL,
)
from ._sync.psycopg import FenceRegister, RowGuard
from .ddl import trigger_ddl

__all__ = [
    "FENCE_COLUMN_DDL",
    "REGISTER_TABLE_DDL",
    "TOMBSTONE_COLUMN_DDL",
    "AsyncFenceRegister",
    "AsyncRowGuard",
    "FenceRegister",
    "RowGuard",
    "install_triggers",
    "install_triggers_async",
]


def install_triggers(
    conn: psycopg.Connection[Any],
    table: TableName,
    *,
    fence: str = DEFAULT_FENCE_COLUMN,
    tombstone: str | None = None,
    register: bool = False,
) -> None:
    """Install (or upgrade) the database's judge of a table on ``conn`` (C14): triggers that
    refuse a row write without a token, with a token below the row's fence, or one that
    would lower a fence, whoever sends it. The guards refuse to write a table without them.

    It runs in a transaction of its own (a savepoint inside the caller's). On an
    ``AsyncConnection``: :func:`install_triggers_async`.

    Args:
        conn: a psycopg connection.
        table: the table name, or ``(schema, name)``.
        fence: its fence column.
        tombstone: its tombstone flag, if it has one (a hard delete is then refused).
        register: the table is a fence register.

    Raises:
        ConfigurationError: an empty name, or a register with a tombstone flag.
        psycopg.Error: the DDL failed (no such table or column).
    """
    statements = _trigger_ddl(table, fence, tombstone, register)
    with conn.transaction():
        for statement in statements:
            conn.execute(statement)
    forget_judged(conn)


async def install_triggers_async(
    conn: psycopg.AsyncConnection[Any],
    table: TableName,
    *,
    fence: str = DEFAULT_FENCE_COLUMN,
    tombstone: str | None = None,
    register: bool = False,
) -> None:
    """:func:`install_triggers` on an ``AsyncConnection``.

    Raises:
        ConfigurationError: an empty name, or a register with a tombstone flag.
        psycopg.Error: the DDL failed (no such table or column).
    """
    statements = _trigger_ddl(table, fence, tombstone, register)
    async with conn.transaction():
        for statement in statements:
            await conn.execute(statement)
    forget_judged(conn)


def _trigger_ddl(
    table: TableName, fence: str, tombstone: str | None, register: bool
) -> list[bytes]:
    schema, name = table if isinstance(table, tuple) else (None, table)
    statements = trigger_ddl(
        name, schema=schema, fence=fence, tombstone=tombstone, register=register
    )
    # Bytes: psycopg sends them as they are (no parameters, so a % stays a %).
    return [statement.encode() for statement in statements]


for _cls in (AsyncFenceRegister, AsyncRowGuard, FenceRegister, RowGuard):
    _cls.__module__ = __name__
del _cls
