"""A refused transaction stays refused until it is rolled back.

A transaction of a bound session is *refused* when

- its claim (C8) is refused, or fails: the transaction holds no claim;
- the check of a read binding (C13) is refused, at the transaction's start or its commit;
- a fenced write of the session (a flush statement, an ORM or Core ``update()`` /
  ``delete()``) is refused: a :class:`StaleTokenError`, whatever its reason;
- its lease is found lost or expired at commit (``check_lease``).

Code that catches the first error (the ORM's :class:`StaleTokenError` is a
``StaleDataError``, which optimistic-concurrency retry code catches) and carries on
would otherwise write, and commit, under a token the storage no longer accepts, with no
claim. So the session remembers the first refusal (:class:`Refusal`, in
``session.info``), and every later statement of the transaction (through the session or
on any of its connections, an ``unfenced=True`` one included), its flushes and its commit
raise :class:`fence.TransactionRefusedError` until the transaction ends.
``session.rollback()`` (or ``close()``) ends it; the next transaction claims again::

    A (token 33)  BEGIN; claim 33 -> refused (fence 34)   StaleTokenError, recorded
    A             catches it; SELECT ...                  TransactionRefusedError
    A             session.add(row); session.commit()      TransactionRefusedError
    A             session.rollback()                      the refusal ends with the transaction
    A             SELECT ...                              BEGIN; claim 33 -> refused again

A write refused before any I/O (``UnfencedWriteError``, ``ReadLeaseError``, a
``ConfigurationError``) does not refuse the transaction: the statement never left, and it
says nothing of the token. A rollback to a savepoint does not end a refusal either: the
claim, or the token, is as stale as before.

The statements are refused by the gate (``_sql_gate``, ``before_execute``): each asks
whether any transaction of the process is refused (:data:`~.._sql_gate.REFUSED`, almost
always empty), and only then looks for its own. After a refused flush outside a
savepoint, SQLAlchemy rolls the transaction back itself and refuses the session's calls
with its own ``PendingRollbackError``; a connection taken from the session before is
refused here.

The error is not a SQLAlchemy error, so code that translates those (the SQL guards'
executors, the claim's) lets it through as it is: a ``RowGuard`` on a refused
transaction's connection raises it too.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.engine import Connection
from sqlalchemy.orm import Session

from fence._errors import FenceError, TransactionRefusedError

from .. import _sql_gate as gate
from .binding import session_of

__all__ = [
    "REFUSAL_KEY",
    "Refusal",
    "before_commit",
    "before_connection_commit",
    "check",
    "end",
    "refuse",
    "refuse_on",
    "refused_of",
]


#: ``Session.info`` key of the :class:`Refusal` of the session's transaction.
REFUSAL_KEY = "iofence.refused"


@dataclass(eq=False, slots=True, weakref_slot=True)
class Refusal:
    """The first refusal of a session's transaction, kept until the transaction ends.

    Attributes:
        first: the error that refused it.
        ref: a weak reference to this record, in :data:`~.._sql_gate.REFUSED` while the
            transaction lasts.
    """

    first: FenceError
    ref: weakref.ref[Refusal] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.ref = weakref.ref(self, gate.REFUSED.discard)

    def error(self) -> TransactionRefusedError:
        """The error for a statement or a commit of the refused transaction."""
        err = TransactionRefusedError(
            f"this transaction was refused ({type(self.first).__name__}: {self.first}); "
            "every later statement and its commit raise until it is rolled back. Call "
            "session.rollback() (the next transaction claims again), and run the work "
            "again under a new lease",
            first=self.first,
        )
        err.__cause__ = self.first
        return err


def refuse(session: Session, err: FenceError) -> None:
    """Record that ``err`` refused ``session``'s transaction (the first refusal is kept)."""
    if session.in_transaction() and REFUSAL_KEY not in session.info:
        found = session.info[REFUSAL_KEY] = Refusal(err)
        gate.REFUSED.add(found.ref)


def refuse_on(conn: Connection, err: FenceError) -> None:
    """:func:`refuse` for the session whose transaction runs on ``conn``, if any."""
    session = session_of(conn)
    if session is not None:
        refuse(session, err)


def end(session: Session) -> None:
    """Forget the refusal of ``session``'s transaction, which has ended."""
    found: Refusal | None = session.info.pop(REFUSAL_KEY, None)
    if found is not None:
        gate.REFUSED.discard(found.ref)


def check(session: Session) -> None:
    """Raise :class:`TransactionRefusedError` if ``session``'s transaction was refused."""
    if gate.REFUSED:
        found: Refusal | None = session.info.get(REFUSAL_KEY)
        if found is not None:
            raise found.error()


def refused_of(conn: Connection) -> Exception | None:
    """The gate's question: the error for a statement on ``conn``, whose transaction may
    have been refused (``None`` if it was not)."""
    session = session_of(conn)
    found: Refusal | None = session.info.get(REFUSAL_KEY) if session is not None else None
    return found.error() if found is not None else None


def before_commit(session: Session) -> None:
    """Refuse the commit of a refused transaction, before the flush and the lease check."""
    check(session)


def before_connection_commit(conn: Connection, *_xid: Any) -> None:
    """Refuse ``Connection.commit()`` (or a two-phase prepare) called on a refused
    transaction's connection, around the session."""
    if gate.REFUSED:
        err = refused_of(conn)
        if err is not None:
            raise err
