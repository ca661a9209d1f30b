"""The SQLAlchemy ORM session hook, written once as sync listeners. No asyncio here.

``AsyncSession`` runs its ``sync_session`` inside a greenlet, so the same listeners serve
both. The hook works at three points:

- ``SessionEvents``: ``before_flush`` refuses writes without a token, and writes of
  unfenced models in a bound session (C9), before any I/O; ``after_begin`` claims the
  bound scope in a fence register (C8) before the first read; ``before_commit`` checks the
  lease; ``do_orm_execute`` fences ORM-enabled ``update()`` / ``delete()`` and refuses
  bulk paths; the transaction events mark the span of each flush. Once a claim, a fenced
  write or the lease check refuses a transaction, every later statement of it and its
  commit are refused until it is rolled back (``refusal``).
- Mapper events (``before_insert`` / ``before_update``) set the fence attribute to the
  token, so the ORM writes it and keeps it in the identity map.
- The gate's engine hook (``_sql_gate``) hands this package every insert, update and
  delete of a session: inside a flush it rewrites them for a fenced table (``fence <=
  :token`` on UPDATE, a soft delete for DELETE, ``ON CONFLICT ... WHERE fence <=
  excluded.fence`` for INSERT) and for the other tables of a fenced class (an ``EXISTS``
  on the fence row); outside a flush it fences a Core ``update()`` / ``delete()`` of a
  bound session. Each is judged by its row count before the ORM looks at it; a statement
  shape it does not know is refused. What the hook cannot fence (raw SQL, Core inserts)
  the gate refuses.

The statements and the verdicts come from the SQL row guard (``_sql_statements``,
``_sql_common``). The modules, each importing only those before it:

- ``fenced``: which tables and mapped classes have a fence, found once; the typed columns.
- ``binding``: :func:`bind` and the :class:`SessionBinding`, found from a session or a
  connection.
- ``refusal``: a refused transaction stays refused until it is rolled back
  (:class:`fence.TransactionRefusedError`).
- ``span``: the span of a flush, and what a flush may write (``before_flush``).
- ``verdicts``: the ORM's :class:`StaleTokenError`; each fenced statement judged by its
  row count; refusals.
- ``flush``: the statements of a flush, rewritten; :func:`fenced_version`.
- ``criteria``: ORM-enabled and Core ``update()`` / ``delete()`` of a bound session;
  tombstones hidden from queries.
- ``claim``: the claim at the start of each transaction and the lease check at commit.
- ``libpq``: a transport that sends messages on psycopg's connection and reads their
  results later (the claim's, on psycopg); it knows nothing of fences. It imports nothing
  of the hook.

This module installs the listeners.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import Engine, event
from sqlalchemy.orm import Mapper, Session
from sqlalchemy.pool import Pool

from .. import _judge as judge
from .. import _sql_gate as gate
from .._sql_statements import OPTIONAL_INFO
from .binding import BINDING_KEY, SessionBinding, allows_of, bind, binding, unbind
from .claim import (
    after_begin,
    before_commit,
    check_lease,
    claim_before_commit,
    claim_before_reset,
    claim_before_rollback,
    claim_before_statement,
    token_before_write,
)
from .criteria import INCLUDE_TOMBSTONES, do_orm_execute, session_statement
from .fenced import fence_column, mapper_constructed, mapper_info, table_info, tombstone_column
from .flush import fenced_version
from .refusal import before_commit as refused_before_commit
from .refusal import before_connection_commit, refused_of
from .span import (
    after_transaction_create,
    after_transaction_end,
    before_flush,
    mark_flushing,
    set_fence,
)
from .verdicts import (
    StaleTokenError,
    _restore,  # noqa: F401 - pickled errors name it here
    after_cursor_execute,
    after_execute,
    flush_retryable,
    judge_refused,
)

__all__ = [
    "BINDING_KEY",
    "INCLUDE_TOMBSTONES",
    "OPTIONAL_INFO",
    "SessionBinding",
    "StaleTokenError",
    "bind",
    "binding",
    "check_lease",
    "fence_column",
    "fenced_version",
    "install",
    "mapper_info",
    "table_info",
    "tombstone_column",
    "unbind",
]

_INSTALLED = False


def install() -> None:
    """Install the listeners (once per process; importing ``fence.adapters.orm`` does it).

    They are class-level listeners on :class:`~sqlalchemy.orm.Session` (and so on every
    ``AsyncSession.sync_session``), on :class:`~sqlalchemy.orm.Mapper`, on
    :class:`~sqlalchemy.Engine` (also through the gate, ``_sql_gate``) and on
    :class:`~sqlalchemy.pool.Pool` (a claim still in flight when a connection returns).
    Writes to tables without a fence, outside a session bound to a lease, pass untouched.
    """
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    gate.install()
    judge.install()
    gate.set_hooks(session_statement, allows_of, refused_of)
    judge.REFUSAL_HOOKS.append(judge_refused)
    event.listen(Session, "before_flush", before_flush)
    event.listen(Session, "after_transaction_create", after_transaction_create)
    event.listen(Session, "after_transaction_end", after_transaction_end)
    event.listen(Session, "after_begin", after_begin)
    event.listen(Session, "before_commit", refused_before_commit)  # before the lease check
    event.listen(Session, "before_commit", before_commit)
    event.listen(Session, "do_orm_execute", do_orm_execute)
    event.listen(Mapper, "before_insert", set_fence)
    event.listen(Mapper, "before_update", set_fence)
    event.listen(Mapper, "before_delete", mark_flushing)
    event.listen(Mapper, "after_mapper_constructed", mapper_constructed)
    event.listen(Engine, "after_cursor_execute", after_cursor_execute)
    event.listen(Engine, "after_execute", after_execute)
    event.listen(Engine, "handle_error", flush_retryable)
    event.listen(Engine, "before_execute", token_before_write)  # after the gate's rewrite
    event.listen(Engine, "before_cursor_execute", claim_before_statement)
    event.listen(Engine, "commit", claim_before_commit)
    event.listen(Engine, "prepare_twophase", claim_before_commit)
    event.listen(Engine, "commit", before_connection_commit)
    event.listen(Engine, "prepare_twophase", before_connection_commit)
    event.listen(Engine, "rollback", claim_before_rollback)
    event.listen(Engine, "rollback_twophase", claim_before_rollback)
    event.listen(Pool, "reset", claim_before_reset)
    for mapper in _all_mappers():
        mapper_constructed(mapper, mapper.class_)


def _all_mappers() -> list[Mapper[Any]]:
    from sqlalchemy.orm import mapperlib

    found: list[Mapper[Any]] = []
    for registry in list(mapperlib._mapper_registries):
        found.extend(registry.mappers)
    return found
