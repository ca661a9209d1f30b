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

from ._async.psycopg import AsyncFenceRegister, AsyncRowGuard
from ._sql_common import FENCE_COLUMN_DDL, REGISTER_TABLE_DDL, TOMBSTONE_COLUMN_DDL
from ._sync.psycopg import FenceRegister, RowGuard

__all__ = [
    "FENCE_COLUMN_DDL",
    "REGISTER_TABLE_DDL",
    "TOMBSTONE_COLUMN_DDL",
    "AsyncFenceRegister",
    "AsyncRowGuard",
    "FenceRegister",
    "RowGuard",
]

for _cls in (AsyncFenceRegister, AsyncRowGuard, FenceRegister, RowGuard):
    _cls.__module__ = __name__
del _cls
