"""Fenced SQL rows through SQLAlchemy Core (2.x), sync and asyncio, PostgreSQL, SQLite and
MariaDB (see ``docs/mariadb.md``: its fenced tables carry the database judge too;
:data:`WITHOUT_JUDGE` writes a MariaDB table without it).

Two guards, both run inside the caller's connection and transaction:

- :class:`RowGuard` / :class:`AsyncRowGuard`: each row of a table carries its own fence
  (:func:`fence_column`); fenced update, upsert, soft delete, claim, registering read, and
  all-or-nothing batches.
- :class:`FenceRegister` / :class:`AsyncFenceRegister`: fences in a table of their own
  (:func:`fence_register_table`), claimed at the start of a transaction to fence a whole
  unit of work spanning many rows and tables.

Example::

    from fence.adapters.sql import RowGuard, fence_column

    accounts = Table("accounts", metadata,
                     Column("id", Integer, primary_key=True),
                     Column("balance", Integer, nullable=False),
                     fence_column())

    with engine.begin() as conn:
        RowGuard(conn, accounts).update(42, lease.token, {"balance": 10})

See ``docs/sql-guard.md`` for the DDL, the isolation levels and the tombstones.
"""

from __future__ import annotations

from . import _judge
from ._async.sql import AsyncFenceRegister, AsyncRowGuard
from ._judge import WITHOUT_JUDGE, install_triggers
from ._sql_common import (
    FENCE_COLUMN_DDL,
    REGISTER_TABLE_DDL,
    TOMBSTONE_COLUMN_DDL,
)
from ._sql_gate import UNFENCED
from ._sql_gate import install as _install_gate
from ._sql_statements import (
    FENCE_INFO,
    fence_column,
    fence_of,
    fence_register_table,
    tombstone_column,
)
from ._sync.sql import FenceRegister, RowGuard

__all__ = [
    "FENCE_COLUMN_DDL",
    "FENCE_INFO",
    "REGISTER_TABLE_DDL",
    "TOMBSTONE_COLUMN_DDL",
    "UNFENCED",
    "WITHOUT_JUDGE",
    "AsyncFenceRegister",
    "AsyncRowGuard",
    "FenceRegister",
    "RowGuard",
    "fence_column",
    "fence_of",
    "fence_register_table",
    "install_triggers",
    "tombstone_column",
]

_install_gate()  # every write SQLAlchemy sends to a fenced table is fenced or refused
_judge.install()  # create_all installs the database's judge (C14); its refusals as errors

for _cls in (AsyncFenceRegister, AsyncRowGuard, FenceRegister, RowGuard):
    _cls.__module__ = __name__
del _cls
