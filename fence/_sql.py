"""The SQL lock manager without I/O: engines, errors, wake-ups, shared-lock decisions.

The drivers in ``fence._async.sql`` / ``fence._sync.sql`` move bytes; what they decide is
written here once: how an engine is built from a URL, which :class:`fence.BackendError` a
driver error becomes, where the ``LISTEN`` connection goes and how it backs off, the
process-wide state of an in-process database (its lease tables' wake-up boards, the lock
of a single-connection pool), and what a SQLite transaction reads before
:func:`fence._rwlock.decide` decides. The statements are in :mod:`fence._sql_schema`, and
what differs between databases in :mod:`fence._sql_dialect`.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import weakref
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, make_url

from fence._core import MAX_TOKEN
from fence._errors import BackendError, ConfigurationError, InvalidTokenError, RetryableError
from fence._rwlock import Holder, Waiting
from fence._sql_dialect import CHECK_LOGIN, Fault, SQLDialect, dialect_of_url, first_line
from fence._wake import WakeBoard

__all__ = [
    "CLOSE_WAIT",
    "LISTEN_SLICE",
    "QUEUE_TTL",
    "STATEMENTS",
    "Backoff",
    "ListenTarget",
    "call_name",
    "checked_token",
    "engine_arguments",
    "lease_error",
    "lease_table_board",
    "listen_target",
    "local_board",
    "next_token",
    "no_time_left",
    "pool_lock",
    "queue_seq",
    "shared_state",
    "timed_out",
    "tune_engine",
]

#: How long a queued waiter keeps its place without an attempt (its heartbeat), in seconds;
#: a queued waiter tries again at least every third of it.
QUEUE_TTL = 3.0

#: How long, in seconds, a driver's ``close()`` waits for the clean-ups of acquires that gave
#: up (they run on for as long as the lock could live) before it returns; one that is still
#: running then disposes of the driver's engine itself when it ends.
CLOSE_WAIT = 3.0

#: The statements of :class:`fence._sql_schema.LeaseStatements` every dialect has.
STATEMENTS = (
    "acquire",
    "renew",
    "renew_read",
    "release",
    "release_read",
    "abandon",
    "inspect",
    "revoke",
    "list_page",
)

_L = TypeVar("_L")


def checked_token(value: object) -> int:
    """``value`` if the lease table returned a token in 1..2**53-1.

    Raises:
        InvalidTokenError: it did not.
    """
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TOKEN:
        raise InvalidTokenError(
            f"the lease table returned {value!r}, not a token in 1..2**53-1", value=value
        )
    return value


# -- engines ------------------------------------------------------------------------------


def engine_arguments(
    url: str | URL, options: Mapping[str, Any] | None, *, asyncio: bool
) -> tuple[URL, dict[str, Any], Callable[[Any, Any], None] | None]:
    """What the manager's ``make_engine`` creates an engine with: the URL (with the
    dialect's driver if it names none), the ``create_engine`` arguments, and a ``connect``
    listener or ``None``.

    The engine runs in autocommit mode (every lease statement is its own transaction);
    the dialect adds its own arguments (:meth:`fence._sql_dialect.SQLDialect.engine_options`)
    and ``options`` win over both. A database iofence does not support gets an engine
    all the same, which the driver then refuses with a clear message.

    Args:
        url: a SQLAlchemy URL.
        options: the caller's ``create_engine`` arguments.
        asyncio: for ``create_async_engine``.
    """
    parsed = make_url(url)
    dialect = dialect_of_url(parsed)
    if dialect is not None:
        parsed = dialect.engine_url(parsed, asyncio=asyncio)
    # Autocommit for the whole pool, so no checkout switches the isolation level back and
    # forth, and nothing is left to roll back when a connection returns to the pool.
    kwargs: dict[str, Any] = {"isolation_level": "AUTOCOMMIT", "pool_reset_on_return": None}
    if dialect is not None:
        kwargs.update(dialect.engine_options(parsed))
    given = dict(options or {})
    if "connect_args" in given and "connect_args" in kwargs:
        given["connect_args"] = {**kwargs["connect_args"], **given["connect_args"]}
    kwargs.update(given)
    hook = None if dialect is None else dialect.on_connect(parsed)
    return parsed, kwargs, hook


def tune_engine(engine: Any) -> None:
    """Adjust an engine that the manager's ``make_engine`` created (the ``sync_engine`` of
    an asyncio one) as its dialect asks (:meth:`fence._sql_dialect.SQLDialect.tune_engine`)."""
    dialect = dialect_of_url(engine.url)
    if dialect is not None:
        dialect.tune_engine(engine)


# -- errors -------------------------------------------------------------------------------


def call_name(action: str, resource: str) -> str:
    """How a message names a driver call: ``acquire of 'order:42'``."""
    return f"{action} of {resource!r}" if resource else action


def no_time_left(where: str) -> BackendError:
    """The error of a call whose caller's deadline passed before it sent anything.

    Args:
        where: the call and the table (``acquire of 'r' on sqlite table ...``).
    """
    return BackendError(
        f"{where}: no time left for the statement (the caller's deadline passed); nothing was sent",
        code="TIMEOUT",
        retryable=True,
        sent=False,
    )


def timed_out(where: str, exc: BaseException) -> BackendError:
    """The error of a call whose connection the caller's deadline cut.

    Args:
        where: the call and the table.
        exc: what the driver raised when its socket was shut down.
    """
    return BackendError(
        f"{where}: the database did not answer before the caller's deadline "
        f"({first_line(exc)}); the connection was cut, and the outcome is unknown until it "
        "answers again",
        code="CONNECTION",
        retryable=True,
        sent=True,
    )


def lease_error(exc: BaseException, where: str, dialect: SQLDialect, pool: Any) -> BackendError:
    """The error the lock manager raises for a driver error (chain it with ``from``).

    What the error says comes from :meth:`fence._sql_dialect.SQLDialect.classify`; whether
    the connection is lost, from SQLAlchemy's exception (or the DB-API's, on the driver's
    shortcut past SQLAlchemy).

    Args:
        exc: what the driver raised.
        where: the call and the table.
        dialect: the engine's dialect.
        pool: the engine's pool (for a pool that had no free connection).
    """
    message = first_line(getattr(exc, "orig", None) or exc)
    fault = dialect.classify(exc)
    if fault is Fault.SERIALIZATION or fault is Fault.DEADLOCK:
        return RetryableError(
            f"{where}: serialization failure or deadlock ({message}); repeat the call",
            code="SERIALIZATION",
        )
    if fault is Fault.MISSING_TABLE or fault is Fault.MISSING_COLUMN:
        return BackendError(
            f"{where}: the lease table or its shared table is missing, or lacks a column "
            f"({message}); create them with the manager's create_table() or in a "
            "migration with the DDL of lease_schema_ddl(); a lease table made by an "
            "earlier version (before shared locks, or on PostgreSQL before tombstones) "
            "needs the migration of lease_upgrade_ddl()",
            code="SCHEMA",
        )
    # A wrong user, password or database name fails the same way on every attempt: a
    # mistake in the URL, not a database that is down, so neither is retryable.
    if fault is Fault.NO_DATABASE:
        return BackendError(
            f"{where}: the server answered, but the database does not exist ({message}); "
            f"create it, or {CHECK_LOGIN}",
            code="DATABASE",
        )
    if fault is Fault.AUTH:
        return BackendError(
            f"{where}: the server refused the login ({message}); {CHECK_LOGIN}",
            code="AUTH",
        )
    if fault is Fault.CANNOT_OPEN:
        return BackendError(
            f"{where}: SQLite cannot open the database file ({message}); check that "
            "its directory exists and is writable",
            code="DATABASE",
        )
    connection_lost = isinstance(
        exc, sa_exc.OperationalError | sa_exc.InterfaceError | sqlite3.OperationalError
    ) or (isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated)
    if fault is Fault.BUSY and connection_lost:
        return BackendError(
            f"{where}: the database stayed locked by another writer ({message}); "
            "the call may be repeated",
            code="BUSY",
            retryable=True,
        )
    if connection_lost or isinstance(exc, OSError):
        return BackendError(
            f"{where}: the database is unreachable ({message}); the call may be repeated "
            "once it is back",
            code="CONNECTION",
            retryable=True,
        )
    if isinstance(exc, sa_exc.TimeoutError):
        size = getattr(pool, "size", lambda: "?")()
        overflow = getattr(pool, "_max_overflow", "?")
        return BackendError(
            f"{where}: every connection of the engine's pool was busy ({message}; "
            f"pool_size={size}, max_overflow={overflow}: a client-side limit, nothing "
            "was sent). Raise pool_size, max_overflow or pool_timeout (engine_options "
            "when the manager builds the engine)",
            code="POOL",
            retryable=True,
            sent=False,
        )
    return BackendError(f"{where} failed: {message}", code="SQL")


# -- the LISTEN connection ----------------------------------------------------------------

#: The pause after the first failed attempt to (re)open the notification connection.
_LISTEN_BACKOFF_FIRST = 0.05
#: Longest pause between two attempts to (re)open the notification connection.
_LISTEN_BACKOFF_MAX = 1.0
#: How long one wait for notifications lasts before the listener re-checks for close().
LISTEN_SLICE = 1.0
#: ``connect_timeout`` of a ``LISTEN`` connection that the engine's arguments do not set.
_LISTEN_CONNECT_TIMEOUT = 5


@dataclass(frozen=True, slots=True)
class ListenTarget:
    """Where a driver's ``LISTEN`` connection goes, and what it listens to.

    Attributes:
        args: the positional arguments of ``psycopg.Connection.connect``.
        kwargs: its keyword arguments (``autocommit`` aside).
        channel: the table's channel (:func:`fence._sql_schema.notify_channel`): releases
            and revokes.
        writers: the channel on which the last reader of a shared lock leaves.
    """

    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    channel: str
    writers: str

    @property
    def commands(self) -> tuple[str, ...]:
        """The ``LISTEN`` statements, in the order they are sent."""
        return tuple(f"LISTEN {_quoted(name)}" for name in (self.channel, self.writers))

    def post(self, board: WakeBoard, channel: str, payload: str) -> None:
        """Post one notification to ``board``: a release of ``payload`` (the resource);
        on the writers' channel, one that only waiting writers need."""
        if payload:
            board.wake(payload, writers=channel == self.writers)


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def listen_target(
    engine: Any, listen: bool | str, channel: str, writers: str
) -> ListenTarget | None:
    """The ``LISTEN`` connection a driver on a notifying dialect opens, or ``None``.

    Args:
        engine: the driver's engine.
        listen: ``True``: with the engine's connection arguments; a libpq connection
            string or URL: there; ``False``: none (waiters poll).
        channel: the table's channel.
        writers: the writers' channel.

    Raises:
        ConfigurationError: ``listen`` asks for a connection and psycopg 3 is missing.
    """
    if listen is not False:
        try:
            import psycopg  # noqa: F401
        except ImportError:
            raise ConfigurationError(
                "listen needs psycopg 3 (pip install 'iofence[postgres]'); "
                "or pass listen=False to wait by polling"
            ) from None
    if listen is True:
        args, kwargs = _listen_args(engine)
    elif isinstance(listen, str):
        args, kwargs = [listen], {"connect_timeout": _LISTEN_CONNECT_TIMEOUT}
    else:
        return None
    return ListenTarget(tuple(args), kwargs, channel, writers)


def _listen_args(engine: Any) -> tuple[list[Any], dict[str, Any]]:
    """psycopg connection arguments for the ``LISTEN`` connection, from the engine."""
    url = engine.url
    if engine.dialect.driver == "psycopg":
        args, kwargs = engine.dialect.create_connect_args(url)
        kwargs = dict(kwargs)
    else:  # another driver (asyncpg, psycopg2): its arguments may not suit psycopg
        args = []
        kwargs = {
            "host": url.host,
            "port": url.port,
            "user": url.username,
            "password": url.password,
            "dbname": url.database,
        }
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
    kwargs.setdefault("connect_timeout", _LISTEN_CONNECT_TIMEOUT)
    return list(args), kwargs


class Backoff:
    """When the ``LISTEN`` connection is opened again after a failure, and how loudly the
    failure is logged: the first failure in a row is a warning, the next ones debug
    messages; the pause doubles from 50 ms up to 1 s."""

    def __init__(self) -> None:
        self._pause = _LISTEN_BACKOFF_FIRST
        self._warned = False

    def failed(self) -> tuple[int, float]:
        """An attempt failed: the logging level of its message, and the pause before the
        next attempt."""
        level = logging.DEBUG if self._warned else logging.WARNING
        self._warned = True
        pause = self._pause
        self._pause = min(pause * 2, _LISTEN_BACKOFF_MAX)
        return level, pause

    def succeeded(self) -> None:
        """The connection listens: the next failure starts over."""
        self._pause = _LISTEN_BACKOFF_FIRST
        self._warned = False


# -- process-wide state of in-process databases -------------------------------------------

_registry_lock = threading.Lock()
_boards: dict[Hashable, WakeBoard] = {}
_anchored_boards: weakref.WeakKeyDictionary[Any, dict[Hashable, WakeBoard]] = (
    weakref.WeakKeyDictionary()
)
_pool_locks: weakref.WeakKeyDictionary[Any, dict[Callable[[], Any], Any]] = (
    weakref.WeakKeyDictionary()
)


def local_board(key: Hashable, anchor: object = None) -> WakeBoard:
    """The process-wide board of one lease table, shared by every driver that uses it.

    Args:
        key: what names the table (database file, schema, table).
        anchor: an object the board lives and dies with (the single connection pool of an
            in-memory database); ``None`` for a board that lives as long as the process.
    """
    with _registry_lock:
        boards = _boards if anchor is None else _anchored_boards.setdefault(anchor, {})
        board = boards.get(key)
        if board is None:
            board = boards[key] = WakeBoard()
        return board


def lease_table_board(
    dialect: SQLDialect, url: URL, pool: object, schema: str | None, table: str
) -> WakeBoard:
    """The board that releases of a lease table post to in this process, where they are
    not notified (:attr:`fence._sql_dialect.SQLDialect.notifies`): a release wakes the
    waiters of its own process at once. An in-memory database's board lives as long as
    the engine's ``pool``."""
    anchor = pool if dialect.is_memory(url) else None
    return local_board(dialect.table_key(url, schema, table), anchor)


def pool_lock(pool: object, kind: Callable[[], _L]) -> _L:
    """The lock that serialises the callers of a single-connection ``pool`` (an in-memory
    SQLite database) in this process: one per pool and ``kind`` (``threading.Lock``,
    ``asyncio.Lock``), shared by every driver on the pool, living as long as it."""
    with _registry_lock:
        locks = _pool_locks.setdefault(pool, {})
        lock = locks.get(kind)
        if lock is None:
            lock = locks[kind] = kind()
        return cast("_L", lock)


# -- shared locks decided in process ------------------------------------------------------


def shared_state(
    state: Sequence[Any], entries: Sequence[Sequence[Any]]
) -> tuple[Holder | None, list[Holder], list[Waiting]]:
    """The writer, the readers and the queue, from the rows a dialect that decides in
    process reads first in its transaction (the ``state`` and ``entries`` steps of
    :data:`fence._sql_schema.SQLITE_STEPS`): the input of :func:`fence._rwlock.decide`.
    Leases and places that ran out are left out; the queue is in arrival order."""
    last, owner, owner_left = state[0], state[1], state[2]
    writer = None
    if owner is not None and owner_left is not None and owner_left > 0:
        writer = Holder(owner, int(last), float(owner_left))
    readers = [Holder(e[0], int(e[2]), float(e[3])) for e in entries if e[1] == "r" and e[3] > 0]
    live = sorted(
        (e for e in entries if e[1] in ("R", "W") and e[3] > 0), key=lambda e: (e[4], e[0])
    )
    queue = [Waiting(e[0], e[1] == "W", float(e[3])) for e in live]
    return writer, readers, queue


def queue_seq(entries: Sequence[Sequence[Any]], secret: str, now: float) -> Any:
    """The arrival order of a waiter that takes (or keeps) a place in the queue.

    Kept by a waiter that has a place; a newcomer goes after every place there is, as the
    clock (whole milliseconds on SQLite) may not have moved since the last one came.

    Args:
        entries: the ``entries`` rows of the resource.
        secret: the waiter's secret.
        now: the database's clock, in seconds.
    """
    seq = next((e[4] for e in entries if e[0] == secret), None)
    if seq is None:
        last_seq = max((int(e[4] or 0) for e in entries), default=0)
        seq = max(int(now * 1_000_000), last_seq + 1)
    return seq


def next_token(resource: str, last: object, first: object) -> int:
    """The token rule of the statements: ``max(last + 1, first)``, ``first`` being the
    floor of the token mode (and of the fence register, if any).

    Raises:
        InvalidTokenError: the token space of ``resource`` is exhausted.
    """
    token = max(int(cast("int", last) or 0) + 1, int(cast("int", first)))
    if token > MAX_TOKEN:
        raise InvalidTokenError(
            f"token space exhausted for {resource!r}: next token {token} > 2**53-1",
            value=token,
        )
    return token
