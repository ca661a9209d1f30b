"""The claim (C8) and the lease check of a bound session.

Each transaction of a session bound with ``claim=True`` starts by claiming the binding's
scope in the fence register (``after_begin``): its fence is raised to the token unless it
is above it, else the holder is refused before its first statement runs. Bound to a read
lease, the claim is a check that never raises the fence, made again at commit.
``before_commit`` checks the lease.

On psycopg the claim leaves with the transaction's ``BEGIN`` as a statement prepared once
per connection, and its reply is read just before the transaction's first statement (or
its commit, prepare, rollback, or the pool's reset). What the claim knows of a connection
(the statements its server session has prepared, the claim in flight and what it claims)
is one :class:`ClaimState`, found from the connection's pool entry.

The claim also carries the binding's token to the database's judge (C14): it makes it the
token of the transaction (its fence value is ``set_config('iofence.token', ...)``), so every
later statement of the transaction, raw SQL included, is judged with it. A transaction
that did not claim (``claim=False``, or a binding made after it began) gets the token
before its first write to a judged table (:func:`token_before_write`). The register's
triggers, and those of each fenced table the session writes, are checked once per DBAPI
connection before the first write.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sqlalchemy import Table
from sqlalchemy.engine import Connection
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, SessionTransaction
from sqlalchemy.sql.dml import UpdateBase

from fence._core import check_read
from fence._errors import ConfigurationError, FenceError, LeaseExpiredError, LeaseLostError
from fence._errors import StaleTokenError as _FenceStale
from fence._events import EventKind
from fence._sql_dialect import DIALECTS

from .. import _sql_gate as gate
from .._judge import (
    CHECKED_KEY,
    SESSION_DIALECTS,
    TOKEN_KEY,
    clear_token,
    ensure_judged,
    hold_token,
    judged_on,
    judged_without_triggers,
    record_verdict,
    set_token,
)
from .._sql_common import missing_register_error, missing_table, translate_error
from .._sql_gate import OWN_OPTIONS, UNFENCED, Kind
from .._sql_statements import register_statements
from .._sync.sql import FenceRegister
from .._triggers import PG_CHECK_QUERY, TOKEN_SETTING, Judged
from . import libpq, refusal
from .binding import (
    BINDING_KEY,
    READ_CHECK_KEY,
    SESSION_OF,
    SessionBinding,
    bound,
    session_of,
)
from .fenced import table_info
from .span import CURRENT
from .verdicts import SOURCE, StaleTokenError

if TYPE_CHECKING:
    from fence._async.manager import AsyncLease
    from fence._sync.manager import Lease

__all__ = [
    "ClaimState",
    "after_begin",
    "before_commit",
    "check_lease",
    "claim_before_commit",
    "claim_before_reset",
    "claim_before_rollback",
    "claim_before_statement",
    "token_before_write",
]


_CLAIMS: weakref.WeakKeyDictionary[Table, dict[str, Any]] = weakref.WeakKeyDictionary()


def _claim_statement(register: Table, dialect: str) -> Any:
    """The register claim of one scope with bind parameters, derived once per register and
    dialect (hot path) from the register guard's own (:meth:`RegisterStatements.claim_row`):
    ``INSERT ... ON CONFLICT (scope) DO UPDATE SET fence = :t WHERE fence <= :t``. On
    MariaDB and MySQL its fence value also makes the token the transaction's
    (``@iofence_token``), in the same statement.
    """
    per_table = _CLAIMS.setdefault(register, {})
    found = per_table.get(dialect)
    if found is None:
        transaction = dialect in SESSION_DIALECTS
        row = register_statements(register).claim_row(dialect, transaction=transaction)
        found = per_table[dialect] = row.execution_options(**OWN_OPTIONS)
    return found


def after_begin(session: Session, transaction: SessionTransaction, connection: Connection) -> None:
    SESSION_OF[connection] = weakref.ref(session)
    found: SessionBinding | None = session.info.get(BINDING_KEY)
    if found is None or transaction.nested:
        return
    dialect = DIALECTS.get(connection.dialect.name)
    if dialect is not None and not dialect.session_hook:
        raise ConfigurationError(
            f"the session hook does not run on {dialect.label} yet: write its fenced "
            "tables with RowGuard and FenceRegister (fence.adapters.sql)"
        )
    if not found.claim:
        if not found.read_only and connection.dialect.driver == "psycopg":
            # No claim, but the token still leaves with the BEGIN (C14): no round trip of
            # its own. Elsewhere it is set before the first write (token_before_write).
            _send_claim(connection, found, token_only=True)
            connection.info[TOKEN_KEY] = found.token
        return
    refusal.check(session)  # a refused transaction claims nothing more
    try:
        _begin(session, connection, found)
    except FenceError as err:  # refused, or failed: the transaction holds no claim
        refusal.refuse(session, err)
        raise


def _begin(session: Session, connection: Connection, found: SessionBinding) -> None:
    """The claim (or a read binding's check) at the start of a transaction."""
    if found.read_only:
        _check_read(connection, found)
        session.info[READ_CHECK_KEY] = connection
        return
    if connection.dialect.driver == "psycopg":
        # Its reply is read before the first statement, or at the latest as the session
        # commits (before_commit); the unit of work reads it now.
        state = _send_claim(connection, found)
        connection.info[TOKEN_KEY] = found.token
        if found.eager:
            _judge_claim(connection, found, _read_claim(state, found))
        return
    # The register's triggers, once per DBAPI connection (C14); on psycopg the check rides
    # in the claim's message.
    ensure_judged(connection, register_statements(found.register).judged)
    stmt = _claim_statement(found.register, connection.dialect.name)
    connection.info[TOKEN_KEY] = found.token  # the claim makes it the transaction's
    hold_token(connection)  # MariaDB: in a session variable, cleared as the transaction ends
    try:
        result = connection.execute(stmt, {"_scope": found.scope, "_token": found.token})
    except _FenceStale:
        # MariaDB's judge refused it (its row count cannot): the register guard runs it
        # again and reports the refusal as it does everywhere else.
        _judge_claim(connection, found, 0)
        return
    except SQLAlchemyError as exc:
        if missing_table(exc):
            raise missing_register_error(found.register.name) from exc
        raise translate_error(exc, "fence claim", found.scope) from exc
    _judge_claim(connection, found, _claimed(connection, result.rowcount))


def _claimed(connection: Connection, count: int) -> int:
    """The claim's row count as the verdict reads it: 1 if the fence was raised (or the
    row inserted), anything else if the register guard must judge it.

    MariaDB and MySQL count the rows an upsert found (``CLIENT_FOUND_ROWS``, which
    SQLAlchemy asks for): 2 for a fence raised, 1 for a row inserted or one left as it was,
    which is a claim at the fence's own token, or a refused one. A refused claim never
    gets that far where the register's triggers are in place (checked before the claim,
    :func:`ensure_judged`): the judge refuses it with an error. Under
    :data:`WITHOUT_JUDGE` the 1 is left to the register guard, which reads the fence.
    """
    dialect = DIALECTS.get(connection.dialect.name)
    if dialect is None or not dialect.upsert_counts_found:
        return count
    if count == 2:
        return 1
    if count == 1 and not judged_without_triggers(connection):
        return 1
    return 0


def _judge_claim(connection: Connection, found: SessionBinding, claimed: int) -> None:
    """Accept a claim that raised the fence; hand any other to the register guard."""
    if claimed == 1:
        if found.events.active:
            found.events.emit(EventKind.WRITE_ACCEPTED, SOURCE, found.scope, found.token)
        return
    # Refused (or unknown): the register guard runs the claim again and judges it (C5).
    try:
        FenceRegister(connection, found.register, events=found.events).claim(
            found.scope, found.token
        )
    except _FenceStale as err:
        # The refused claim made its token the transaction's (the fence value is computed
        # before the conflict is judged): take it back, so that the database refuses
        # whatever this transaction would still write.
        clear_token(connection)
        raise StaleTokenError.from_guard(err, None, None) from None


@dataclass(eq=False, slots=True, weakref_slot=True)
class ClaimState:
    """The claim's state on one psycopg connection, in its pool entry's ``info``
    (:func:`_state_on`): it lasts as long as the DBAPI connection, and a connection the pool
    opens anew starts without one, as its server session has prepared nothing.

    Attributes:
        raw: the psycopg connection.
        prepared: the names of the claims this server session has prepared.
        found: what the claim in flight claims, and at which token (the binding's scope,
            token and register): sent with its transaction's ``BEGIN``, its reply not read
            yet. ``None`` when there is nothing to read.
        connection: the SQLAlchemy connection it was sent on (weakly: a dropped session
            must let its connection go back to the pool).
        name: the name of its prepared statement.
        prepare: the ``PREPARE`` of that statement.
        execute: the ``BEGIN`` and ``EXECUTE`` sent with it.
        fresh: whether the message sent carried the ``PREPARE``.
        judged: the register whose triggers the message also checks (C14), the first
            time on the connection; ``None`` otherwise.
        token_only: the message carries the binding's token and no claim (a session bound
            with ``claim=False``): its reply is read, never judged.
        ref: a weak reference to this state, which leaves :data:`_UNREAD` with it.
    """

    raw: Any
    prepared: set[bytes] = field(default_factory=set)
    found: SessionBinding | None = None
    connection: weakref.ref[Connection] | None = None
    name: bytes = b""
    prepare: bytes = b""
    execute: bytes = b""
    fresh: bool = False
    judged: Judged | None = None
    token_only: bool = False
    ref: weakref.ref[ClaimState] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.ref = weakref.ref(self, _UNREAD.discard)


#: ``info`` key of a pool entry's :class:`ClaimState`.
_STATE_KEY = "iofence.claim"

# The states whose claim's reply is not read yet, by weak reference. Every statement of the
# process asks whether it is empty, and a session's commit finds its own claims in it.
_UNREAD: set[weakref.ref[ClaimState]] = set()


def _state_on(conn: Connection) -> ClaimState | None:
    """The claim's state on ``conn``'s DBAPI connection, if a claim was ever sent on it."""
    if conn.closed or conn.invalidated:
        return None  # an invalidated connection's claim went with it
    state: ClaimState | None = conn.connection.info.get(_STATE_KEY)
    return state


def _send_claim(
    connection: Connection, found: SessionBinding, *, token_only: bool = False
) -> ClaimState:
    """Send the claim with the transaction's ``BEGIN`` and return before its reply (psycopg 3).

    psycopg starts a transaction with a ``BEGIN`` of its own, a round trip before the first
    statement. Here ``BEGIN`` (with the connection's isolation level, as psycopg builds it)
    and the claim go as one simple-protocol message, and the reply is read only when the
    transaction's first statement is about to be sent (or at its commit or rollback,
    whichever comes first): :func:`claim_before_statement`. The server runs the claim
    while the application composes that statement, so a bound transaction waits on one
    round trip fewer than an unbound one.

    Nothing else is sent before the reply is read and judged: a stale holder is refused
    before its first statement leaves, and that statement runs after the claim took the
    register row's lock, so it sees what an older holder that held the lock committed
    (C8). A path that reaches the driver around SQLAlchemy while the reply is pending is
    refused by libpq itself ("another command is already in progress") and sends nothing.

    The claim is the register guard's upsert (``INSERT ... ON CONFLICT (scope) DO UPDATE
    SET fence = $2 WHERE fence <= $2``) without ``RETURNING``: its command tag carries the
    row count, and a refusal (count 0) goes to the register guard, which judges it.

    It runs as a statement prepared once per connection (``PREPARE`` goes in the first
    transaction's message; the name is known from then on by the connection's
    :class:`ClaimState`), so PostgreSQL neither parses nor plans it again. A server
    session that lost it (``DEALLOCATE``, ``DISCARD ALL``, a transaction pooler that moved
    the connection) answers ``26000``: the transaction is rolled back and the message sent
    again with the ``PREPARE``. A search path changed since is honoured: PostgreSQL parses
    a prepared statement again when ``search_path`` changed.
    """
    pg = libpq.driver()
    register = found.register
    entry = connection.connection
    state: ClaimState | None = entry.info.get(_STATE_KEY)
    if state is None:
        state = entry.info[_STATE_KEY] = ClaimState(entry.driver_connection)
    elif state.found is not None:  # a claim whose transaction ended without any event
        _read_claim(state, state.found)  # (defensive)
    raw = state.raw
    if token_only:
        # A session bound without a claim: only its token, made the transaction's.
        message = b"%s; SELECT pg_catalog.set_config('%s', '%d', true)" % (
            libpq.begin(raw, pg),
            TOKEN_SETTING.encode(),
            found.token,
        )
        try:
            libpq.send(raw, message)
        except pg.Error as exc:
            raise translate_error(exc, "setting the transaction's token", found.scope) from exc
        state.found, state.token_only, state.judged = found, True, None
        state.connection = weakref.ref(connection)
        _UNREAD.add(state.ref)
        return state
    claim = _PG_CLAIMS.get(register)
    if claim is None:
        claim = _PG_CLAIMS[register] = _pg_claim(register, raw)
    name, prepare = claim
    # The first claim on a connection also reads the register's triggers (C14), in the
    # same message: their check costs no round trip of its own.
    judged = register_statements(register).judged
    check = b""
    if not judged_on(connection, judged):
        query = PG_CHECK_QUERY.format(param="{}").encode()
        check = query.replace(b"{}", libpq.literal(judged.qualified, raw)) + b"; "
    execute = b"%s; %sEXECUTE %s(%s, %d)" % (
        libpq.begin(raw, pg),
        check,
        name,
        libpq.literal(found.scope, raw),
        found.token,
    )
    fresh = name not in state.prepared
    try:
        libpq.send(raw, prepare + execute if fresh else execute)
    except pg.Error as exc:
        raise translate_error(exc, "fence claim", found.scope) from exc
    state.found = found
    state.token_only = False
    state.judged = judged if check else None
    state.connection = weakref.ref(connection)
    state.name, state.prepare, state.execute, state.fresh = name, prepare, execute, fresh
    _UNREAD.add(state.ref)
    return state


def _read_claim(state: ClaimState, found: SessionBinding) -> int:
    """Read the reply of the claim in flight on ``state``, sending it again if the server
    session lost the statement. The claim is taken off the unread ones first: its reply is
    read once, also when reading it fails.

    Returns:
        The claim's row count: 1 if the fence was raised (or the row inserted), 0 if it
        was refused.
    """
    state.found = None
    _UNREAD.discard(state.ref)
    pg = libpq.driver()
    raw, name, fresh = state.raw, state.name, state.fresh
    if state.token_only:
        try:
            results = libpq.read(raw)
        except pg.Error as exc:
            raise translate_error(exc, "setting the transaction's token", found.scope) from exc
        failure = libpq.failure(raw, results)
        if failure is not None:
            err = translate_error(failure, "setting the transaction's token", found.scope)
            raise err from failure
        return 1
    try:
        results = libpq.read(raw)
        for _attempt in range(3):
            last = results[-1]
            if last.status == pg.COMMAND_OK:
                state.prepared.add(name)
                if state.judged is not None:
                    _judge_register(state, results)
                return int(last.command_tuples or 0)
            sqlstate = last.error_field(pg.SQLSTATE)
            if sqlstate == b"26000" and not fresh:  # the session lost the statement
                state.prepared.discard(name)
                libpq.exchange(raw, b"ROLLBACK")
                fresh = True
            elif sqlstate == b"42P05" and fresh:  # the session has it already (a pooler's)
                state.prepared.add(name)
                fresh = False
            else:
                break
            message = state.prepare + state.execute if fresh else state.execute
            results = libpq.exchange(raw, message)
    except pg.Error as exc:
        raise translate_error(exc, "fence claim", found.scope) from exc
    raise _claim_error(raw, results, found)


def _judge_register(state: ClaimState, results: list[Any]) -> None:
    """Judge the check of the register's triggers that rode in the claim's message."""
    judged, state.judged = state.judged, None
    assert judged is not None
    rows = libpq.rows(results)
    sent_on = state.connection() if state.connection is not None else None
    record_verdict(sent_on, judged, rows)


def claim_before_statement(
    conn: Connection, cursor: Any, statement: str, parameters: Any, context: Any, many: bool
) -> None:
    """Judge the claim in flight on this connection before its first statement is sent."""
    if _UNREAD:
        state = _state_on(conn)
        if state is not None and (found := state.found) is not None:
            try:
                claimed = _read_claim(state, found)
                if not state.token_only:
                    _judge_claim(conn, found, claimed)
            except FenceError as err:
                refusal.refuse_on(conn, err)
                raise


def claim_before_commit(conn: Connection, *_xid: Any) -> None:
    """Judge the claim in flight before a transaction that sent nothing else commits (or
    prepares, for a two-phase commit)."""
    claim_before_statement(conn, None, "", None, None, False)


def claim_before_rollback(conn: Connection, *_twophase: Any) -> None:
    """Read the claim in flight before a rollback; the rollback undoes it either way."""
    if _UNREAD:
        state = _state_on(conn)
        if state is not None and (found := state.found) is not None:
            try:
                _read_claim(state, found)
            except FenceError:
                pass  # refused or failed: the transaction ends here anyway


def claim_before_reset(dbapi_connection: Any, record: Any, reset_state: Any) -> None:
    """Read a claim still in flight on a connection the pool takes back (a session that
    was dropped without being closed), so the pool's rollback can be sent."""
    if _UNREAD:
        state: ClaimState | None = record.info.get(_STATE_KEY)
        if state is None or (found := state.found) is None:
            return
        if not reset_state.asyncio_safe:  # no I/O here: the connection is not kept
            state.found = None
            _UNREAD.discard(state.ref)
            return
        try:
            _read_claim(state, found)
        except FenceError:
            pass  # the pool's rollback follows, or the connection is discarded


def _pg_claim(register: Table, raw: Any) -> tuple[bytes, bytes]:
    """The name of a register's prepared claim and the ``PREPARE`` that defines it.

    The statement is the psycopg register guard's claim in its prepared form
    (:meth:`PgRegisterStatements.prepared_claim`). The name is derived from the statement's
    text, so two processes that share a server session (through a transaction pooler) and
    name the same statement mean the same one.
    """
    import hashlib

    from .._pg_statements import PgRegisterStatements

    table = (register.schema, register.name) if register.schema else register.name
    body = PgRegisterStatements(table).prepared_claim().as_bytes(raw)
    name = b"iofence_claim_" + hashlib.sha1(body, usedforsecurity=False).hexdigest()[:16].encode()
    return name, b"PREPARE %s AS %s; " % (name, body)


def _claim_error(raw: Any, results: list[Any], found: SessionBinding) -> FenceError:
    """The error of a claim's message that failed, in the ``FenceError`` family."""
    failure = libpq.failure(raw, results)
    if failure is None:
        return translate_error(
            RuntimeError("the claim returned no rows"), "fence claim", found.scope
        )
    err: FenceError = (
        missing_register_error(found.register.name)
        if missing_table(failure)
        else translate_error(failure, "fence claim", found.scope)
    )
    err.__cause__ = failure
    return err


# Each register's prepared claim (its name and its PREPARE), composed once; the names a
# connection has prepared are in its ClaimState.
_PG_CLAIMS: weakref.WeakKeyDictionary[Table, tuple[bytes, bytes]] = weakref.WeakKeyDictionary()


def token_before_write(
    conn: Connection,
    elem: Any,
    multiparams: Any,
    params: Any,
    execution_options: Any,
) -> None:
    """Before a write to a table the database judges (C14): check its triggers (once per
    DBAPI connection), and give the transaction the binding's token if it has not got it
    (a session bound with ``claim=False``, or bound after its transaction began): one
    statement on PostgreSQL, none on SQLite.

    A statement marked ``unfenced`` is the opt-out. The guards' own statements carry their
    token, and the hook's run with the guards' option too: in a bound session they get
    the binding's token all the same, which a guard's statement then replaces with its own.
    """
    if not isinstance(elem, UpdateBase) or execution_options.get(UNFENCED):
        return
    table = gate.target_table(elem)
    guarded = gate.classify(table) if table is not None else None
    if guarded is None or guarded.kind is Kind.DEPENDENT:
        return
    assert table is not None
    found = bound(conn)
    if found is not None and found.read_only:
        return  # it writes nothing: the hook refuses every write
    if guarded.kind is Kind.FENCED:
        info = table_info(table)
        if info is None:
            return
        judged = info.statements.judged
    else:
        judged = register_statements(table).judged
    # The hot path (every flush statement): a set lookup and a comparison.
    entry = conn.connection.info
    checked = entry.get(CHECKED_KEY)
    unchecked = (checked is None or judged.check_key not in checked) and not judged_on(conn, judged)
    unset = found is not None and entry.get(TOKEN_KEY) != found.token
    if not unchecked and not unset:
        return
    # The flush counts the rows of its statement from here on (verdicts): what is sent
    # first must not count.
    current = CURRENT.get()
    counted = current.rowcount if current is not None else None
    if unchecked:
        ensure_judged(conn, judged)
    if unset:
        assert found is not None
        set_token(conn, found.token)
    if current is not None:
        current.rowcount = counted


def _check_read(connection: Connection, found: SessionBinding, *, again: bool = False) -> None:
    """A read binding's check (C13): refused if a writer newer than the lease has claimed
    the scope. It reads the register row and never raises the fence.

    ``again``: the check at commit. On MariaDB it reads the row with a shared lock (a
    plain read there sees the snapshot the first check took); the first check, which
    takes that snapshot, locks nothing, so that a writer may overtake the reader."""
    if again and connection.dialect.name in SESSION_DIALECTS:
        fence = _locked_fence(connection, found)
    else:
        fence = FenceRegister(connection, found.register, events=found.events).fence(found.scope)
    try:
        check_read(found.scope, found.token, fence)
    except _FenceStale as err:
        raise StaleTokenError.from_guard(err, None, None) from None


def _locked_fence(connection: Connection, found: SessionBinding) -> int | None:
    """The register's fence of the binding's scope as last committed, on MariaDB and MySQL:
    a plain read in ``REPEATABLE READ`` sees the transaction's snapshot, which at commit
    may predate a newer writer's claim. A shared lock reads the latest row (and waits for
    a writer whose claim is not committed yet)."""
    query = register_statements(found.register).probe(found.scope).with_for_update(read=True)
    try:
        row = connection.execute(query, execution_options=OWN_OPTIONS).first()
    except SQLAlchemyError as exc:
        if missing_table(exc):
            raise missing_register_error(found.register.name) from exc
        raise translate_error(exc, "fence read", found.scope) from exc
    return None if row is None else int(row[1])


def before_commit(session: Session) -> None:
    found: SessionBinding | None = session.info.get(BINDING_KEY)
    if found is None:
        return
    try:
        _check_before_commit(session, found)
    except FenceError as err:  # a claim refused late, a stale read, a lost lease
        refusal.refuse(session, err)
        raise


def _check_before_commit(session: Session, found: SessionBinding) -> None:
    """The claims still in flight, a read binding's second check, and the lease."""
    # A claim whose transaction sent nothing else is judged here, before the flush and the
    # commit: SQLAlchemy 2.0.28 loses a refusal raised inside a two-phase prepare in a
    # rollback of its own there (IllegalStateChangeError).
    if _UNREAD:
        for ref in tuple(_UNREAD):
            state = ref()
            sent_on = state.connection if state is not None else None
            connection = sent_on() if sent_on is not None else None
            if connection is not None and session_of(connection) is session:
                claim_before_commit(connection)
    if found.read_only:
        # Read again at the end: what the transaction read was written under a token no
        # newer than the lease (a newer writer's claim commits with its writes).
        connection = session.info.pop(READ_CHECK_KEY, None)
        if connection is not None:
            _check_read(connection, found, again=True)
    if not found.check_lease or found.lease is None:
        return
    check_lease(found.lease)


def check_lease(lease: Lease | AsyncLease) -> None:
    """Raise :class:`fence.LeaseLostError` unless ``lease`` is still valid.

    An expired lease counts as lost here: the work must not commit on it.
    """
    try:
        lease.check()
    except LeaseLostError:
        raise
    except LeaseExpiredError as exc:
        raise LeaseLostError(
            f"lease on {lease.resource!r} (token {lease.token}) is no longer valid before "
            f"commit: {exc}; nothing was committed",
            resource=lease.resource,
            token=lease.token,
            remaining=exc.remaining,
            cause="the lease ran out before commit",
        ) from exc
