"""The binding of a session to a lease: :func:`bind`, what it records, and how the other
parts of the hook find it from a session or a connection.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import Table
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from fence._core import LeaseMode, validate_mode, validate_resource, validate_token
from fence._errors import ConfigurationError, ReadLeaseError
from fence._events import EventBus, default_bus

from .. import _sql_gate as gate
from .._sql_lex import Target
from .._sql_statements import DEFAULT_REGISTER

if TYPE_CHECKING:
    from fence._async.manager import AsyncLease
    from fence._sync.manager import Lease

__all__ = [
    "BINDING_KEY",
    "READ_CHECK_KEY",
    "SESSION_OF",
    "SessionBinding",
    "allows_of",
    "bind",
    "binding",
    "bound",
    "session_of",
    "unbind",
]

#: ``Session.info`` key of the :class:`SessionBinding`.
BINDING_KEY = "iofence.binding"

#: ``Session.info`` key of the connection whose transaction a read binding checked at its
#: begin: its commit checks the fence again on it.
READ_CHECK_KEY = "iofence.read_check"


@dataclass(eq=False)
class SessionBinding:
    """What :func:`bind` attached to a session (``session.info[BINDING_KEY]``).

    Attributes:
        token: the fencing token every fenced write of the session carries.
        scope: the fence-register scope claimed at the start of each transaction.
        lease: the lease the token came from, if one was given.
        claim: whether the scope is claimed (C8).
        register: the fence register table.
        check_lease: whether ``commit()`` checks the lease first.
        events: the event bus for ``WRITE_ACCEPTED`` / ``WRITE_REJECTED``.
        unfenced: the tables the session may write without a fence (``bind(unfenced=)``).
        read_only: bound to a read lease (C13): every write is refused, and the claim is a
            check that does not raise the fence.
        eager: on psycopg, read the claim's reply as the transaction begins instead of just
            before its first statement (the unit of work sets it, so that a stale holder is
            refused before the block runs at all).
    """

    token: int
    scope: str
    lease: Lease | AsyncLease | None
    claim: bool
    register: Table
    check_lease: bool
    events: EventBus
    unfenced: frozenset[Table] = frozenset()
    read_only: bool = False
    eager: bool = False

    def refusal(self, path: str, scope: str | None = None) -> ReadLeaseError:
        """The error for a write of a session bound to a read lease."""
        return ReadLeaseError(
            f"{path} in a session bound to a read lease (token {self.token}, "
            f"{self.scope!r}): a read lease is shared with other readers, so it never "
            "writes. Take a write lease for work that writes (manager.write_lock, "
            "UnitOfWork(mode='write'))",
            scope=scope,
            token=self.token,
        )

    def allows(self, table: Table | None) -> bool:
        """Whether the session may write ``table`` although it has no fence."""
        return table is not None and table in self.unfenced

    def allows_name(self, target: Target) -> bool:
        """:meth:`allows` for a table named in raw SQL."""
        return any(
            t.name.lower() == target.name
            and (target.schema is None or t.schema is None or t.schema.lower() == target.schema)
            for t in self.unfenced
        )


def _sync_session(session: Any) -> Session:
    sync = getattr(session, "sync_session", session)
    if not isinstance(sync, Session):
        raise ConfigurationError(
            f"bind() needs a Session or an AsyncSession, got {type(session).__name__}"
        )
    return sync


def _unfenced_tables(items: Iterable[Any]) -> frozenset[Table]:
    tables: set[Table] = set()
    for item in items:
        if isinstance(item, Table):
            found = [item]
        else:
            try:
                found = list(sa_inspect(item).tables)
            except Exception:  # anything not a mapped class is the caller's mistake
                raise ConfigurationError(
                    f"unfenced= takes mapped classes and tables, got {item!r}"
                ) from None
        for table in found:
            guarded = gate.classify(table)
            if guarded is not None:
                raise ConfigurationError(
                    f"unfenced= names {guarded.describe()}: it is fenced, it cannot be "
                    "written unfenced"
                )
            tables.add(table)
    return frozenset(tables)


def bind(
    session: Any,
    lease: Lease | AsyncLease | None = None,
    *,
    token: int | None = None,
    scope: str | None = None,
    claim: bool = True,
    register: Table | None = None,
    check_lease: bool = True,
    events: EventBus | None = None,
    unfenced: Iterable[Any] = (),
    mode: LeaseMode | str | None = None,
) -> SessionBinding:
    """Bind a session to a lease: every write of the session is fenced, or refused.

    From now on, for mapped classes with a fence column (``fence_column()``,
    ``fenced_version()``, or a column named ``fence``):

    - a flushed UPDATE adds ``fence <= :token`` (and ``NOT deleted``) and sets
      ``fence = :token``; the other tables of a joined-inheritance class get an
      ``EXISTS`` on their fence row;
    - a flushed DELETE becomes a soft delete that keeps the row as a tombstone (C7) with
      a :func:`tombstone_column`, else a fenced hard delete, allowed only with a register
      claim (the register row is then the tombstone);
    - a flushed INSERT becomes a fenced upsert: a row with the same key is replaced (a
      tombstone revived) iff the token passes, else :class:`StaleTokenError`;
    - ``session.execute(update(...))`` / ``delete(...)``, and a Core ``update()`` /
      ``delete()`` on ``session.connection()``, get the same predicate, gated so that
      every matched row passes or none is written (C6).

    Everything else that would write is refused before any I/O with
    :class:`fence.UnfencedWriteError`: a write of a class or table without a fence (name
    it in ``unfenced`` to allow it), raw SQL (``text()``, ``exec_driver_sql``) that writes,
    Core inserts and the bulk paths. A statement marked
    ``.execution_options(unfenced=True)`` is the explicit, unfenced way out.

    With ``claim=True`` (the default) every transaction of the session starts by claiming
    ``scope`` in the fence register (its fence is raised to the token if it is not above
    it, else the claim is refused) before its first statement runs. A stale holder is
    refused at its first read, and on PostgreSQL the register row stays locked until
    commit, so a newer holder's claim waits for a transaction already under way (C8).
    Without the claim a stale write that lands between this session's read and its write
    is accepted, then overwritten.

    A transaction that was refused (its claim refused or failed, a fenced write refused,
    the lease lost at commit) stays refused: every later statement of it and its commit
    raise :class:`fence.TransactionRefusedError` until ``session.rollback()``; the next
    transaction claims again.

    Bound to a read lease (C13: ``manager.read_lock``, or ``mode="read"``), the session is
    read-only: every write path above (flush, ORM and Core statements, raw SQL, bulk
    paths, tables named in ``unfenced``) raises :class:`fence.ReadLeaseError` before any
    I/O, and the claim becomes a check that never raises the fence (concurrent readers
    would refuse each other): each transaction starts by reading the register row of
    ``scope``, and its commit reads it again, and either raises :class:`StaleTokenError`
    if the fence is above the lease's token, that is, if a writer whose lease came after
    this reader's has written (:func:`fence.check_read`). Only a statement marked
    ``.execution_options(unfenced=True)`` still writes.

    Bind before the session's first statement; the binding lasts until :func:`unbind`
    or the session is garbage collected.

    Args:
        session: a :class:`~sqlalchemy.orm.Session` or
            :class:`~sqlalchemy.ext.asyncio.AsyncSession` (its ``sync_session`` is bound).
        lease: the lease whose token and resource to use.
        token: the token, instead of a lease.
        scope: the register scope to claim (default: the lease's resource).
        claim: claim the scope at the start of each transaction (C8).
        register: the register table (default ``fence_register``, see
            :func:`fence_register_table`); it must exist.
        check_lease: raise :class:`fence.LeaseLostError` from ``commit()`` when the lease
            is lost or expired, before anything commits.
        events: the event bus (default: :data:`fence.default_bus`).
        unfenced: mapped classes or tables without a fence that the session may write
            (an audit log, say); their writes are not fenced.
        mode: ``"read"`` binds read-only (the default for a read lease); ``"write"``
            (the default otherwise) is refused for a read lease.

    Returns:
        The :class:`SessionBinding`.

    Raises:
        InvalidTokenError: the token is not valid (C1).
        InvalidResourceError: the scope is not a valid name.
        ConfigurationError: neither or both of ``lease`` and ``token``; no scope to claim;
            the session already runs a transaction (the claim would come after a read);
            ``unfenced`` names something that is fenced or not mapped; or
            ``mode="write"`` with a read lease.

    Example::

        with manager.lock("order:42") as lease, Session(engine) as session:
            bind(session, lease)
            order = session.get(Order, 42)       # the claim runs first
            order.state = "paid"
            session.commit()                     # UPDATE ... WHERE fence <= :token
    """
    sync = _sync_session(session)
    if (lease is None) == (token is None):
        raise ConfigurationError("bind() needs either a lease or a token")
    held = LeaseMode.WRITE if lease is None else getattr(lease, "mode", LeaseMode.WRITE)
    wanted = held if mode is None else validate_mode(mode)
    if held is LeaseMode.READ and wanted is LeaseMode.WRITE:
        raise ConfigurationError(
            f"bind(mode='write') with a read lease on {lease.resource!r}: a read lease "
            "never writes; take a write lease for work that writes"
            if lease is not None
            else "a read lease never writes"
        )
    if lease is not None:
        token = lease.token
        if scope is None:
            scope = lease.resource
    token = validate_token(token, read=wanted is LeaseMode.READ)
    if claim:
        if scope is None:
            raise ConfigurationError("bind(token=..., claim=True) needs the scope to claim")
        if sync.in_transaction():
            raise ConfigurationError(
                "bind() before the session's first statement: this transaction already "
                "began, so the claim would come after a read. Commit or roll back first, "
                "or pass claim=False"
            )
    scope = validate_resource(scope if scope is not None else "-", what="scope")
    found = SessionBinding(
        token=token,
        scope=scope,
        lease=lease,
        claim=claim,
        register=register if register is not None else DEFAULT_REGISTER,
        check_lease=check_lease and lease is not None,
        events=events or default_bus,
        unfenced=_unfenced_tables(unfenced),
        read_only=wanted is LeaseMode.READ,
    )
    if register is not None:
        gate.mark_register(register)
    sync.info[BINDING_KEY] = found
    return found


def unbind(session: Any) -> SessionBinding | None:
    """Remove the session's binding; return it (``None`` if it had none).

    Afterwards a write of a fenced class raises :class:`fence.TokenRequiredError` (a
    :func:`fenced_version` model goes back to plain optimistic concurrency).
    """
    found: SessionBinding | None = _sync_session(session).info.pop(BINDING_KEY, None)
    return found


def binding(session: Any) -> SessionBinding | None:
    """The session's :class:`SessionBinding`, or ``None``."""
    found: SessionBinding | None = _sync_session(session).info.get(BINDING_KEY)
    return found


# Which session a connection serves, recorded when the session's transaction begins on it.
SESSION_OF: weakref.WeakKeyDictionary[Connection, weakref.ref[Session]] = (
    weakref.WeakKeyDictionary()
)


def session_of(conn: Connection) -> Session | None:
    """The session whose transaction runs on ``conn`` now, if any."""
    ref = SESSION_OF.get(conn)
    session = ref() if ref is not None else None
    if session is None or not session.in_transaction():
        return None
    return session


def bound(conn: Connection) -> SessionBinding | None:
    """The binding of the session whose transaction runs on ``conn`` now, if any."""
    session = session_of(conn)
    if session is None:
        return None
    found: SessionBinding | None = session.info.get(BINDING_KEY)
    return found


def allows_of(conn: Connection) -> Any:
    """The gate's question for raw SQL on ``conn``: may it write this unfenced table?"""
    # The gate asks only about a statement that writes: a read-only session refuses it.
    found = bound(conn)
    if found is not None and found.read_only:
        raise found.refusal("raw SQL that writes")
    return found.allows_name if found is not None else None
