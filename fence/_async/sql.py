"""The SQL lock manager: leases in a PostgreSQL or SQLite table, through SQLAlchemy.

Every driver call is one statement in autocommit mode, so one round trip, and no session
state outlives it: no advisory lock, no open transaction, nothing that a
transaction-pooling proxy would break. The database's clock decides expiry and seeds the
hybrid tokens (C2, C3, C10). The statements are in :mod:`fence._sql_schema`.

Waiting: on PostgreSQL a release runs ``pg_notify`` in its own statement and waiters are
woken through one ``LISTEN`` connection per driver, with a bounded poll as a fallback; on
SQLite a release made in this process wakes a waiter of this process at once and other
waiters poll with a jittered interval. Each release wakes one waiter of each process (the
one that has waited longest), not all of them; where waiters of the process hold places
in the queue of a shared lock (C13), it wakes all of those, and the queue decides who goes
(a batch of readers together). The generic manager also wakes every waiter when the
holder's lease ends by its ttl.

Shared locks: a reader's lease is a row of ``<table>_shared``, as is every queued waiter.
On PostgreSQL every call is still one statement; on SQLite a read acquire, and a write
acquire that meets readers or queued waiters, is one ``BEGIN IMMEDIATE`` transaction in
which :func:`fence._rwlock.decide` decides (in process, no round trip).
"""

from __future__ import annotations

import asyncio  # unasync: remove
import functools
import logging
import os
import random
import socket
import sqlite3
import threading
import time
import weakref
from collections.abc import Awaitable, Callable, Mapping
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, cast

from sqlalchemy import event, text
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL, make_url
from sqlalchemy.ext import asyncio as sa  # unasync: import sqlalchemy as sa
from sqlalchemy.pool import StaticPool

from fence._acompat import Task, Waiter, call_later, settle, spawn
from fence._acompat import sleep as _sleep
from fence._async.manager import AsyncBaseLockManager
from fence._clock import Clock
from fence._core import MAX_TOKEN, LeaseMode, TokenMode
from fence._deadline import deadline, reset, set_deadline
from fence._errors import BackendError, ConfigurationError, InvalidTokenError, RetryableError
from fence._events import EventBus
from fence._rwlock import Holder, Waiting, decide
from fence._signal import Signal
from fence._sql_schema import (
    DEFAULT_TABLE,
    LeaseStatements,
    WakeBoard,
    lease_statements,
    local_board,
    notify_channel,
)
from fence.abc import AcquireReply, LockInfo

#: ``run(step, params)`` in a SQLite transaction of the driver: the rows of one statement.
_Rows = Awaitable[list[Any]]  # unasync: _Rows = list[Any]
_Run = Callable[[str, dict[str, Any]], _Rows]

#: How long a queued waiter keeps its place without an attempt (its heartbeat), in seconds;
#: a queued waiter tries again at least every third of it.
QUEUE_TTL = 3.0

if TYPE_CHECKING:
    from sqlalchemy import Row, TextClause

__all__ = ["AsyncSQLDriver", "AsyncSQLLockManager"]

_log = logging.getLogger("fence.sql")

_IS_ASYNC = True  # unasync: _IS_ASYNC = False

#: Serialises the callers of a single-connection pool (an in-memory SQLite database).
_SerialLock = asyncio.Lock  # unasync: _SerialLock = threading.Lock
_serial_locks: weakref.WeakKeyDictionary[Any, _SerialLock] = weakref.WeakKeyDictionary()
_serial_locks_guard = threading.Lock()

#: Default poll interval (s) of a waiter that no notification can reach.
_SQLITE_POLL = 0.5
#: Default fallback poll (s) on PostgreSQL, where releases are notified.
_POSTGRES_POLL = 2.0
#: Longest pause between two attempts to (re)open the notification connection.
_LISTEN_BACKOFF_MAX = 1.0
#: How long one wait for notifications lasts before the listener re-checks for close().
_LISTEN_SLICE = 1.0

_STATEMENTS = (
    "acquire",
    "renew",
    "renew_read",
    "release",
    "release_read",
    "abandon",
    "inspect",
    "revoke",
)

#: What an engine built from a ``sqlite:`` file URL sets on every connection: WAL (readers
#: never block the writer, a commit appends to the log instead of rewriting pages), the
#: matching ``synchronous=NORMAL`` (a power loss can lose the last commits, not corrupt the
#: file), and a busy timeout for writers that meet another writer.
SQLITE_PRAGMAS: dict[str, str | int] = {
    "journal_mode": "WAL",
    "synchronous": "NORMAL",
    "busy_timeout": 5000,
}

#: ``connect_timeout`` (seconds) of a PostgreSQL engine built from a URL, unless the URL or
#: ``engine_options`` give one: a server that accepts connections and then hangs holds a
#: new connection this long at most (psycopg's floor is 2 s).
PG_CONNECT_TIMEOUT = 5


def _is_memory(url: URL) -> bool:
    if url.get_backend_name() != "sqlite":
        return False
    return url.database in (None, "", ":memory:") or url.query.get("mode") == "memory"


def make_engine(url: str | URL, options: Mapping[str, Any] | None = None) -> sa.AsyncEngine:
    """Create an engine for the SQL lock manager from a URL.

    ``postgresql://`` gets the psycopg 3 driver (with ``connect_timeout``
    :data:`PG_CONNECT_TIMEOUT`), and ``sqlite://`` the default SQLite driver of the engine
    kind (aiosqlite for asyncio), unless the URL names a driver. The engine runs in
    autocommit mode (every lease statement is its own transaction). A SQLite file gets
    :data:`SQLITE_PRAGMAS` (WAL, ``synchronous=NORMAL``, a 5 s busy timeout unless the URL
    gives ``timeout``) on every
    connection. An in-memory SQLite database gets a single-connection
    :class:`~sqlalchemy.pool.StaticPool`, the only pool that keeps one database for all
    callers.

    Args:
        url: a SQLAlchemy URL.
        options: more ``create_engine`` keyword arguments; they win over the defaults.
    """
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    elif parsed.drivername == "sqlite" and _IS_ASYNC:
        parsed = parsed.set(drivername="sqlite+aiosqlite")
    # Autocommit for the whole pool, so no checkout switches the isolation level back and
    # forth, and nothing is left to roll back when a connection returns to the pool.
    kwargs: dict[str, Any] = {"isolation_level": "AUTOCOMMIT", "pool_reset_on_return": None}
    memory = _is_memory(parsed)
    if memory:
        kwargs["poolclass"] = StaticPool
        kwargs["connect_args"] = {"check_same_thread": False}
    elif parsed.get_backend_name() == "postgresql" and "connect_timeout" not in parsed.query:
        kwargs["connect_args"] = {"connect_timeout": PG_CONNECT_TIMEOUT}
    given = dict(options or {})
    if "connect_args" in given and "connect_args" in kwargs:
        given["connect_args"] = {**kwargs["connect_args"], **given["connect_args"]}
    kwargs.update(given)
    create = sa.create_async_engine  # unasync: create = sa.create_engine
    engine = create(parsed, **kwargs)
    if parsed.get_backend_name() == "sqlite" and not memory:
        pragmas = dict(SQLITE_PRAGMAS)
        if "timeout" in parsed.query:  # the URL's own busy timeout (seconds) wins
            del pragmas["busy_timeout"]
        target = engine.sync_engine  # unasync: target = engine
        event.listen(target, "connect", functools.partial(_set_sqlite_pragmas, pragmas))
    return engine


def _set_sqlite_pragmas(
    pragmas: Mapping[str, str | int], dbapi_connection: Any, record: Any
) -> None:
    cursor = dbapi_connection.cursor()
    try:
        for name, value in pragmas.items():
            cursor.execute(f"PRAGMA {name} = {value}")
    finally:
        cursor.close()


def _cut(fd: int, fired: list[bool]) -> None:
    """Shut the socket ``fd`` down: a round trip blocked on it (in any thread) ends with a
    lost-connection error. The connection is not reused afterwards."""
    fired[0] = True
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        sock.close()


def _listen_args(engine: sa.AsyncEngine) -> tuple[list[Any], dict[str, Any]]:
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
    kwargs.setdefault("connect_timeout", 5)
    return list(args), kwargs


def _checked_token(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_TOKEN:
        raise InvalidTokenError(
            f"the lease table returned {value!r}, not a token in 1..2**53-1", value=value
        )
    return value


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


class AsyncSQLDriver:
    """Runs the lease statements on a SQLAlchemy engine; see :class:`AsyncSQLLockManager`.

    Args:
        engine: an engine on PostgreSQL (psycopg 3) or SQLite.
        table: the lease table's name.
        schema: its schema, or ``None``.
        token_mode: :class:`fence.TokenMode` for new tokens.
        listen: PostgreSQL only. ``True`` opens a ``LISTEN`` connection with the engine's
            connection arguments; a libpq connection string or URL opens it there instead
            (a direct connection when the engine goes through a transaction-pooling proxy);
            ``False`` polls.
        notify: PostgreSQL only. Releases and revokes send ``pg_notify``; turn it off only
            when no manager on the table listens (PostgreSQL serialises the commits of
            notifying transactions).
        poll_interval: the longest wait, in seconds, between two attempts of a waiter that
            no release wakes (jittered down to half of it). Default 0.5 on SQLite, 2 on
            PostgreSQL.
        create_table: create the lease table, if missing, before the first statement.
        autocommit: the engine was created with ``isolation_level="AUTOCOMMIT"``; the
            driver then uses it as it is. Otherwise each call's connection is switched to
            autocommit at checkout and back at return.
        owns_engine: dispose of the engine in :meth:`close` (and it was built by
            :func:`make_engine`, with :data:`SQLITE_PRAGMAS` on SQLite).
        fence_table: the storage guards' fence register table (``(scope, fence)``, see
            ``fence.adapters.sql.AsyncFenceRegister``) in the same schema, whose row with
            the resource's name as scope no token may go below: acquire and revoke issue
            tokens above it, and revoke raises it. ``None``: the lease row is the only
            register.

    Raises:
        ConfigurationError: an unsupported database, an in-memory SQLite database without
            a :class:`~sqlalchemy.pool.StaticPool`, or bad names.
    """

    source = "sql"
    #: Grants read leases (C13).
    shared = True

    def __init__(
        self,
        engine: sa.AsyncEngine,
        *,
        table: str = DEFAULT_TABLE,
        schema: str | None = None,
        token_mode: TokenMode = TokenMode.HYBRID,
        listen: bool | str = True,
        notify: bool = True,
        poll_interval: float | None = None,
        create_table: bool = False,
        autocommit: bool = False,
        owns_engine: bool = False,
        fence_table: str | None = None,
    ) -> None:
        dialect = engine.dialect.name
        if dialect not in ("postgresql", "sqlite"):
            raise ConfigurationError(
                f"the SQL lock manager supports PostgreSQL and SQLite, not {dialect!r}"
            )
        self.engine = engine
        self.dialect = dialect
        self.table = table
        self.schema = schema
        self.token_mode = TokenMode(token_mode)
        self.fence_table = fence_table
        self.statements: LeaseStatements = lease_statements(
            dialect,
            table=table,
            schema=schema,
            token_mode=self.token_mode,
            notify=notify,
            fence_table=fence_table,
        )
        self._raw_sql: dict[str, str] = {
            name: getattr(self.statements, name) for name in _STATEMENTS
        }
        self._sql: dict[str, TextClause] = {name: text(sql) for name, sql in self._raw_sql.items()}
        if self.statements.raise_fence is not None:
            self._raw_sql["raise_fence"] = self.statements.raise_fence
            self._sql["raise_fence"] = text(self.statements.raise_fence)
        if self.statements.acquire_read is not None:
            self._raw_sql["acquire_read"] = self.statements.acquire_read
            self._sql["acquire_read"] = text(self.statements.acquire_read)
        self._steps = {name: text(sql) for name, sql in self.statements.steps.items()}
        # SQLite's hybrid token floor takes the driver's reading of the clock, in
        # microseconds (see fence._sql_schema).
        self._clock = dialect == "sqlite" and self.token_mode is TokenMode.HYBRID
        # The leases this driver granted to readers, and the waiters it put in the queue:
        # their calls take the shared table's statements.
        self._reading: set[tuple[str, str]] = set()
        self._placed: set[tuple[str, str]] = set()
        self._lock_row = text(self.statements.lock_row or "")
        # Autocommit: each statement is its own transaction, one round trip, no BEGIN/COMMIT.
        self._auto = (
            engine if autocommit else engine.execution_options(isolation_level="AUTOCOMMIT")
        )
        self._owns_engine = owns_engine
        self._create_pending = create_table
        self._closed = False
        where = engine.url.render_as_string(hide_password=True)
        self._where = f"{self.statements.dialect} table {table!r} ({where})"

        self._pg = dialect == "postgresql"
        self._busy_ms = int(SQLITE_PRAGMAS["busy_timeout"]) if owns_engine else None
        pool = engine.pool
        memory = _is_memory(engine.url)
        if memory and not isinstance(pool, StaticPool):
            raise ConfigurationError(
                "an in-memory SQLite database exists once per connection: create its engine "
                "with poolclass=StaticPool and connect_args={'check_same_thread': False} "
                "(the manager does this when given a 'sqlite://' URL), or use a file"
            )
        self._serial: _SerialLock | None = None
        if isinstance(pool, StaticPool):
            with _serial_locks_guard:
                self._serial = _serial_locks.setdefault(pool, _SerialLock())
        # The DB-API shortcut needs an engine that is autocommit already, on pysqlite.
        self._raw = (
            dialect == "sqlite"
            and autocommit
            and self._serial is None
            and engine.dialect.driver == "pysqlite"
        )

        self._channel: str | None = None
        self._writers_channel: str | None = None
        self._params: dict[str, Any] = {}
        self._wake_params: dict[str, Any] = {}
        self._listen_args: tuple[list[Any], dict[str, Any]] | None = None
        self._listener: Task | None = None
        self._listener_lock = threading.Lock()
        self._ready = Signal()
        if dialect == "postgresql":
            self._channel = notify_channel(table, schema)
            self._writers_channel = notify_channel(table, schema, writers=True)
            self._params = (
                {"channel": self._channel, "channel_w": self._writers_channel} if notify else {}
            )
            self._wake_params = {"channel": self._channel}
            self._sql["wake"] = text(self.statements.wake or "")
            self._board = WakeBoard()
            self._local = False
            if listen is not False:
                try:
                    import psycopg  # noqa: F401
                except ImportError:
                    raise ConfigurationError(
                        "listen needs psycopg 3 (pip install 'iofence[postgres]'); "
                        "or pass listen=False to wait by polling"
                    ) from None
            if listen is True:
                self._listen_args = _listen_args(engine)
            elif isinstance(listen, str):
                self._listen_args = ([listen], {"connect_timeout": 5})
            default_poll = _POSTGRES_POLL
        else:
            if isinstance(listen, str):
                raise ConfigurationError("listen=<conninfo> is for PostgreSQL only")
            database = engine.url.database or ""
            if memory:
                self._board = local_board(("sqlite", schema, table), anchor=pool)
            else:
                path = os.path.realpath(database)
                self._board = local_board(("sqlite", path, schema, table))
            self._local = True
            default_poll = _SQLITE_POLL
        self.poll_interval = default_poll if poll_interval is None else float(poll_interval)
        if not self.poll_interval > 0:
            raise ConfigurationError(f"poll_interval must be > 0, got {poll_interval!r}")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._where}>"

    # -- the driver protocol --------------------------------------------------------------

    async def acquire(
        self,
        resource: str,
        secret: str,
        ttl: float,
        holder: str,
        mode: LeaseMode = LeaseMode.WRITE,
    ) -> AcquireReply:
        """One attempt of a writer or (``mode`` READ) a reader; see
        :meth:`fence.abc.AsyncDriver.acquire`. One statement (on SQLite, a read or a write
        beside readers or queued waiters: one transaction)."""
        key = (resource, secret)
        reading = mode is LeaseMode.READ
        # The wait needs the board's mark (taken before the attempt) and the mode.
        cookie = (self._mark(), reading)
        if not self._pg and (reading or key in self._placed):
            return await self._decide(resource, secret, ttl, holder, reading, cookie)
        params = {
            "resource": resource,
            "secret": secret,
            "holder": holder,
            "ttl": float(ttl),
        }
        if self._pg:
            params["queue_ttl"] = QUEUE_TTL
        row = await self._execute("acquire_read" if reading else "acquire", resource, params)
        if row is None:
            raise BackendError(f"acquire of {resource!r} on {self._where} returned no row")
        token, granted, remaining, flag = tuple(row)
        if not self._pg and not granted and flag:
            # SQLite: readers or queued waiters: the transaction decides (and queues).
            return await self._decide(resource, secret, ttl, holder, reading, cookie)
        queued = bool(flag) and self._pg
        return self._reply(key, reading, token, granted, remaining, queued, cookie)

    def _reply(
        self,
        key: tuple[str, str],
        reading: bool,
        token: object,
        granted: object,
        remaining: object,
        queued: bool,
        cookie: object,
    ) -> AcquireReply:
        if granted:
            self._placed.discard(key)
            if reading:
                self._reading.add(key)
            return AcquireReply(_checked_token(token))
        if queued:
            self._placed.add(key)
        holder_ttl = None if remaining is None else max(float(cast("float", remaining)), 0.0)
        return AcquireReply(None, holder_ttl, cookie, queued=queued)

    async def _decide(
        self, resource: str, secret: str, ttl: float, holder: str, reading: bool, cookie: object
    ) -> AcquireReply:
        """SQLite: one attempt decided in a ``BEGIN IMMEDIATE`` transaction by
        :func:`fence._rwlock.decide`, which sees the lease row and the shared table as
        they are (SQLite runs one writer at a time)."""
        base = {"resource": resource, "secret": secret}

        async def body(run: _Run) -> tuple[object, bool, float | None, bool]:
            last, owner, owner_left, first, now = (await run("state", base))[0]
            entries = await run("entries", base)
            writer = None
            if owner is not None and owner_left is not None and owner_left > 0:
                writer = Holder(owner, int(last), float(owner_left))
            readers = [
                Holder(e[0], int(e[2]), float(e[3])) for e in entries if e[1] == "r" and e[3] > 0
            ]
            live = sorted(
                (e for e in entries if e[1] in ("R", "W") and e[3] > 0), key=lambda e: (e[4], e[0])
            )
            queue = [Waiting(e[0], e[1] == "W", float(e[3])) for e in live]
            verdict = decide(secret, reading, writer, readers, queue)
            params: dict[str, Any] = {**base, "holder": holder, "ttl": float(ttl)}
            if verdict.kept is not None:
                params["token"] = verdict.kept
                if reading:
                    await run("put", {**params, "kind": "r", "seq": 0})
                else:
                    await run("write", params)
                return verdict.kept, True, None, False
            if not verdict.granted:
                if verdict.queued:
                    # Arrival order: kept by a waiter that has a place; a newcomer goes
                    # after every place there is, as the clock (whole milliseconds on
                    # SQLite) may not have moved since the last one came.
                    seq = next((e[4] for e in entries if e[0] == secret), None)
                    if seq is None:
                        last_seq = max((int(e[4] or 0) for e in entries), default=0)
                        seq = max(int(now * 1_000_000), last_seq + 1)
                    kind = "R" if reading else "W"
                    await run(
                        "put", {**params, "kind": kind, "token": None, "ttl": QUEUE_TTL, "seq": seq}
                    )
                return None, False, verdict.wait, verdict.queued
            # The token rule of the statements: max(last + 1, first), first being the
            # floor of the token mode (and of the fence register, if any).
            token = max(int(last or 0) + 1, int(first))
            if token > MAX_TOKEN:
                raise InvalidTokenError(
                    f"token space exhausted for {resource!r}: next token {token} > 2**53-1",
                    value=token,
                )
            params["token"] = token
            if reading:
                await run("count", params)
                await run("put", {**params, "kind": "r", "seq": 0})
            else:
                await run("write", params)
                if verdict.placed:
                    await run("drop", base)
            await run("sweep", base)
            return token, True, None, False

        token, granted, wait, queued = await self._transaction("acquire", resource, body)
        return self._reply((resource, secret), reading, token, granted, wait, queued, cookie)

    async def renew(self, resource: str, secret: str, ttl: float) -> bool:
        """See :meth:`fence.abc.AsyncDriver.renew`; a writer's or a reader's lease."""
        name = "renew_read" if (resource, secret) in self._reading else "renew"
        row = await self._execute(
            name, resource, {"resource": resource, "secret": secret, "ttl": float(ttl)}
        )
        return row is not None

    async def release(self, resource: str, secret: str) -> bool:
        """See :meth:`fence.abc.AsyncDriver.release`; a writer's or a reader's lease. On
        PostgreSQL it also notifies (a reader: the last one)."""
        key = (resource, secret)
        reading = key in self._reading
        self._reading.discard(key)
        row = await self._execute(
            "release_read" if reading else "release",
            resource,
            {"resource": resource, "secret": secret, **self._params},
        )
        if row is None:
            return False
        if self._local:
            # A reader leaving lets only writers in, never a reader that waits.
            self._board.wake(resource, writers=reading)
        return True

    async def cancel(self, resource: str, secret: str, ttl: float) -> bool:
        """An acquire gave up without knowing what its last statement did (a timeout, a
        cancellation): release the lock (or the read lease) if that statement took it, and
        the place in the queue if it took one.

        The statement may still be waiting in the database, behind another transaction's
        lock on the row. The release therefore first takes that row lock itself, in a
        transaction, so it queues behind the stranded statement and sees what it did
        (PostgreSQL grants row locks in arrival order). ``ttl`` is unused: SQL has no
        tombstone. Returns whether the lock was held.
        """
        # The release may have to open a connection, which the caller's deadline cannot
        # cut short (psycopg waits at least 2 s for a server that hangs): it runs on its
        # own, for as long as the lock could live, and the caller waits only until its
        # deadline.
        outcome: list[Any] = []
        done = Signal()
        spawn(self._cancel, resource, secret, ttl, outcome, done, name=f"fence-cancel:{resource}")
        at = deadline()
        waiter = Waiter()
        if not done.attach(waiter):
            try:
                await waiter.wait(None if at is None else at - time.monotonic())
            finally:
                done.detach(waiter)
        if not outcome:
            raise BackendError(
                f"cancel of {resource!r} on {self._where}: no answer before the caller's "
                "deadline; the release goes on until the database answers",
                code="CONNECTION",
                retryable=True,
            )
        if isinstance(outcome[0], BaseException):
            raise outcome[0]
        return bool(outcome[0])

    async def _cancel(
        self, resource: str, secret: str, ttl: float, outcome: list[Any], done: Signal
    ) -> None:
        scope = set_deadline(time.monotonic() + ttl)
        key = (resource, secret)
        self._reading.discard(key)
        self._placed.discard(key)
        try:
            params = {"resource": resource, "secret": secret, **self._params}
            rows = await self._execute_locked(
                resource, [("release", params), ("release_read", params), ("abandon", params)]
            )
            held = rows[0] is not None or rows[1] is not None
            if (held or rows[2] is not None) and self._local:
                self._board.wake(resource)
            outcome.append(held)
        except Exception as exc:
            outcome.append(exc)
        finally:
            reset(scope)
            done.set()

    async def wait(self, resource: str, timeout: float, reply: AcquireReply) -> None:
        """Return on a release seen by this process, or after a jittered poll slice (for a
        queued waiter, at most a third of :data:`QUEUE_TTL`: its attempts keep its place)."""
        if timeout <= 0:
            return
        slice_ = min(timeout, self.poll_interval * random.uniform(0.5, 1.0))
        if reply.queued:
            slice_ = min(slice_, QUEUE_TTL / 3)
        if self._listen_args is not None and not self._closed:
            ready = self._start_listener()
            if not ready.is_set():
                # Nothing listens yet: wait for LISTEN, then have the caller try again, as
                # a release may have come between its attempt and the LISTEN.
                await self._wait_signal(ready, slice_)
                return
        waiter = Waiter()
        cookie = reply.cookie
        mark, reading = cookie if isinstance(cookie, tuple) and len(cookie) == 2 else (None, False)
        reading = reading is True
        key = ("r" if reading else "w", id(waiter)) if reply.queued else None
        if reply.queued:
            self._board.place(resource, 1)
        try:
            if self._board.attach(resource, waiter, mark, key):
                return
            try:
                await waiter.wait(slice_)
            finally:
                self._board.detach(resource, waiter)
        finally:
            if reply.queued:
                self._board.place(resource, -1)

    async def abandon(self, resource: str, secret: str) -> None:
        """A waiter gave up; it may have been the one a release woke (each release wakes
        one waiter of this process): wake another in its place. A waiter that held a place
        in the queue leaves it (one statement; on PostgreSQL it notifies the others)."""
        key = (resource, secret)
        if key in self._placed:
            self._placed.discard(key)
            await self._execute(
                "abandon", resource, {"resource": resource, "secret": secret, **self._params}
            )
        self._board.wake(resource)

    async def inspect(self, resource: str) -> LockInfo | None:
        """The writer, or every reader; see :meth:`fence.abc.AsyncDriver.inspect`."""
        rows = await self._execute("inspect", resource, {"resource": resource}, every=True)
        infos = [
            LockInfo(
                resource,
                _checked_token(token),
                max(float(remaining), 0.0),
                holder,
                LeaseMode.WRITE if kind == "w" else LeaseMode.READ,
            )
            for kind, token, remaining, holder in rows
        ]
        writers = [info for info in infos if info.mode is LeaseMode.WRITE]
        if writers:
            return writers[0]
        return LockInfo.of_readers(resource, infos)

    async def revoke(self, resource: str) -> int:
        """End every lease of ``resource`` (the writer's, or every reader's); see
        :meth:`fence.abc.AsyncDriver.revoke`. The lease row keeps the new token."""
        params = {"resource": resource, **self._params}
        if self._pg:
            row = await self._execute("revoke", resource, params)
            if row is None:
                raise BackendError(f"revoke of {resource!r} on {self._where} returned no row")
            token = _checked_token(row[0])
        else:
            # SQLite has no data-modifying CTE: the readers' rows go, and the register is
            # raised, in the same transaction, after the lease row holds the new token.
            async def body(run: _Run) -> int:
                got = _checked_token((await run("revoke", params))[0][0])
                await run("drop_readers", params)
                if "raise_fence" in self._sql:
                    await run("raise_fence", {"resource": resource, "token": got})
                return got

            token = await self._transaction("revoke", resource, body)
        if self._local:
            self._board.wake(resource)
        return token

    async def close(self) -> None:
        """Stop the notification listener; dispose of the engine if the driver owns it."""
        if self._closed:
            return
        self._closed = True
        listener = self._listener
        if listener is not None:
            try:
                # Wake the listener out of its wait for notifications.
                await self._execute("wake", "", {"resource": "", **self._wake_params}, retry=False)
            except BackendError:
                pass
            await listener.join()
        if self._owns_engine:
            await self.engine.dispose()

    # -- schema -----------------------------------------------------------------------------

    async def create_table(self) -> None:
        """Create the lease table and its shared table if they do not exist (the DDL of
        :func:`fence.lease_schema_ddl`).

        Raises:
            BackendError: the database refused or is unreachable.
        """
        for statement in self.statements.create:
            try:
                async with self._serialised(), self._auto.connect() as conn:
                    await conn.execute(text(statement))
            except sa_exc.IntegrityError:
                # PostgreSQL: a concurrent CREATE TABLE IF NOT EXISTS won the race.
                pass
            except sa_exc.SQLAlchemyError as exc:
                raise self._error(exc, "create_table", "") from exc
        self._create_pending = False

    # -- internals --------------------------------------------------------------------------

    def _serialised(self) -> _SerialLock | nullcontext[None]:
        return self._serial or nullcontext()

    def _mark(self) -> object:
        if self._listen_args is not None and not self._ready.is_set():
            return None  # no listener yet: the wait must not trust a mark
        return self._board.mark()

    async def _execute(
        self,
        name: str,
        resource: str,
        params: dict[str, Any],
        *,
        retry: bool = True,
        every: bool = False,
    ) -> Any:
        """Run statement ``name``: its first row, or ``None`` (with ``every``: all rows)."""
        if self._create_pending:
            await self.create_table()
        if self._clock:
            params = {**params, "clock_us": time.time_ns() // 1000}
        if not _IS_ASYNC and self._raw:
            return self._execute_raw(name, resource, params, deadline(), every)
        statement = self._sql[name]

        async def work(conn: Any) -> Any:
            if self._pg:
                result = await conn.execute(statement, params)
            else:
                # aiosqlite runs the statement on in its thread if the task is cancelled:
                # let it finish, so a clean-up sees what it did.
                result = await settle(conn.execute(statement, params))
            return list(result.fetchall()) if every else result.first()

        return await self._connected(name, resource, work, retry=retry)

    async def _execute_locked(
        self, resource: str, steps: list[tuple[str, dict[str, Any]]]
    ) -> list[Row[Any] | None]:
        """Run statements in one transaction that first takes the resource's row lock
        (PostgreSQL) or the database's write lock (SQLite); their first rows."""
        if self._create_pending:
            await self.create_table()

        async def work(conn: Any) -> list[Row[Any] | None]:
            await conn.exec_driver_sql("BEGIN" if self._pg else "BEGIN IMMEDIATE")
            try:
                if self._pg:
                    await conn.execute(self._lock_row, {"resource": resource})
                clock = {"clock_us": time.time_ns() // 1000} if self._clock else {}
                rows = [
                    (await conn.execute(self._sql[n], {**p, **clock})).first() for n, p in steps
                ]
                await conn.exec_driver_sql("COMMIT")
            except BaseException:
                try:
                    await conn.exec_driver_sql("ROLLBACK")
                except sa_exc.SQLAlchemyError:
                    pass  # the connection broke: the server rolls back by itself
                raise
            return rows

        return cast("list[Row[Any] | None]", await self._connected("cancel", resource, work))

    async def _transaction(self, name: str, resource: str, body: Any) -> Any:
        """SQLite: run ``body(run)`` in one ``BEGIN IMMEDIATE`` transaction, where
        ``run(step, params)`` runs a statement of :attr:`LeaseStatements.steps` (or of
        the driver's) and returns its rows. Rolled back if ``body`` raises."""
        if self._create_pending:
            await self.create_table()

        async def work(conn: Any) -> Any:
            async def run(step: str, params: dict[str, Any]) -> list[Any]:
                statement = self._steps.get(step)
                if statement is None:
                    statement = self._sql[step]
                if self._clock:
                    params = {**params, "clock_us": time.time_ns() // 1000}
                result = await settle(conn.execute(statement, params))
                return list(result.fetchall()) if result.returns_rows else []

            await conn.exec_driver_sql("BEGIN IMMEDIATE")
            try:
                outcome = await body(run)
                await conn.exec_driver_sql("COMMIT")
            except BaseException:
                try:
                    await conn.exec_driver_sql("ROLLBACK")
                except sa_exc.SQLAlchemyError:
                    pass
                raise
            return outcome

        return await self._connected(name, resource, work)

    async def _connected(self, name: str, resource: str, work: Any, *, retry: bool = True) -> Any:
        """Run ``work(conn)`` on a pooled connection within the caller's deadline (a
        PostgreSQL socket is cut at the deadline; SQLite waits for a busy database at most
        until then); map the driver's errors."""
        at = deadline()
        for attempt in (1, 2):
            if at is not None and at <= time.monotonic():
                raise BackendError(
                    f"{self._call(name, resource)} on {self._where}: no time left for the "
                    "statement (the caller's deadline passed); nothing was sent",
                    code="TIMEOUT",
                    retryable=True,
                    sent=False,
                )
            fired = [False]
            try:
                async with self._serialised(), self._auto.connect() as conn:
                    alarm = None
                    busy = None
                    if at is not None:
                        if self._pg:
                            fd = self._socket(conn)
                            if fd is not None:
                                alarm = call_later(
                                    at - time.monotonic(), functools.partial(_cut, fd, fired)
                                )
                        elif self._busy_ms is not None:
                            busy = max(1, int((at - time.monotonic()) * 1000))
                            if busy < self._busy_ms:
                                await conn.exec_driver_sql(f"PRAGMA busy_timeout = {busy}")
                            else:
                                busy = None
                    try:
                        return await work(conn)
                    finally:
                        if alarm is not None:
                            alarm.cancel()
                        if busy is not None:
                            await conn.exec_driver_sql(f"PRAGMA busy_timeout = {self._busy_ms}")
            except sa_exc.DBAPIError as exc:
                if fired[0]:
                    raise self._timed_out(name, resource, exc) from exc
                if retry and attempt == 1 and exc.connection_invalidated:
                    # A pooled connection died (the server restarted). SQLAlchemy has
                    # invalidated the pool; the call is safe to repeat once on a new one.
                    continue
                raise self._error(exc, name, resource) from exc
            except sa_exc.SQLAlchemyError as exc:
                raise self._error(exc, name, resource) from exc
            except OSError as exc:
                if fired[0]:
                    raise self._timed_out(name, resource, exc) from exc
                raise self._error(exc, name, resource) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def _execute_raw(
        self, name: str, resource: str, params: dict[str, Any], at: float | None, every: bool
    ) -> Any:
        """Sync SQLite on an autocommit engine: one statement on the pool's DB-API
        connection, without SQLAlchemy's per-statement work (most of a call's cost
        in-process). Same statements, same pool, same connect-time settings."""
        if at is not None and at <= time.monotonic():
            raise BackendError(
                f"{self._call(name, resource)} on {self._where}: no time left for the "
                "statement (the caller's deadline passed); nothing was sent",
                code="TIMEOUT",
                retryable=True,
                sent=False,
            )
        engine: Any = self.engine
        try:
            conn = engine.raw_connection()
        except sa_exc.SQLAlchemyError as exc:
            raise self._error(exc, name, resource) from exc
        try:
            cursor = conn.cursor()
            busy = None
            try:
                if at is not None and self._busy_ms is not None:
                    busy = max(1, int((at - time.monotonic()) * 1000))
                    if busy < self._busy_ms:
                        cursor.execute(f"PRAGMA busy_timeout = {busy}")
                    else:
                        busy = None
                cursor.execute(self._raw_sql[name], params)
                rows = cursor.fetchall()
            finally:
                if busy is not None:
                    cursor.execute(f"PRAGMA busy_timeout = {self._busy_ms}")
                cursor.close()
        except sqlite3.Error as exc:
            raise self._error(exc, name, resource) from exc
        finally:
            conn.close()
        if every:
            return rows
        return rows[0] if rows else None

    @staticmethod
    def _socket(conn: Any) -> int | None:
        """The file descriptor of a pooled PostgreSQL connection's socket."""
        try:
            proxied = conn.sync_connection  # unasync: proxied = conn
            return int(proxied.connection.driver_connection.pgconn.socket)
        except Exception:  # a driver other than psycopg, or a broken connection
            return None

    @staticmethod
    def _call(action: str, resource: str) -> str:
        return f"{action} of {resource!r}" if resource else action

    def _timed_out(self, action: str, resource: str, exc: BaseException) -> BackendError:
        return BackendError(
            f"{self._call(action, resource)} on {self._where}: the database did not answer "
            f"before the caller's deadline ({_first_line(exc)}); the connection was cut, and "
            "the outcome is unknown until it answers again",
            code="CONNECTION",
            retryable=True,
            sent=True,
        )

    def _error(self, exc: BaseException, action: str, resource: str) -> BackendError:
        where = f"{self._call(action, resource)} on {self._where}"
        orig = getattr(exc, "orig", None) or exc
        sqlstate = getattr(orig, "sqlstate", None)
        message = _first_line(orig)
        text_ = str(orig)
        if sqlstate in ("40001", "40P01"):
            return RetryableError(
                f"{where}: serialization failure or deadlock ({message}); repeat the call",
                code="SERIALIZATION",
            )
        if sqlstate in ("42P01", "3F000", "42703") or (
            "no such table" in message or "no such column" in message or "has no column" in message
        ):
            return BackendError(
                f"{where}: the lease table or its shared table is missing, or lacks a column "
                f"({message}); create them with the manager's create_table() or in a "
                "migration with the DDL of lease_schema_ddl(); a lease table made before "
                "shared locks needs the migration of lease_upgrade_ddl()",
                code="SCHEMA",
            )
        if sqlstate == "3D000" or ("database" in text_ and "does not exist" in text_):
            return BackendError(
                f"{where}: the server answered, but the database does not exist ({message}); "
                "create it or fix the database name in the URL",
                code="DATABASE",
            )
        if sqlstate in ("28P01", "28000") or "authentication failed" in text_:
            return BackendError(
                f"{where}: the server refused the credentials ({message}); fix the user or "
                "password in the URL",
                code="AUTH",
            )
        if self.dialect == "sqlite" and "unable to open database file" in text_:
            return BackendError(
                f"{where}: SQLite cannot open the database file ({message}); check that "
                "its directory exists and is writable",
                code="DATABASE",
            )
        connection_lost = isinstance(
            exc, sa_exc.OperationalError | sa_exc.InterfaceError | sqlite3.OperationalError
        ) or (isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated)
        if self.dialect == "sqlite" and connection_lost and "locked" in message:
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
            pool = self.engine.pool
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

    async def _wait_signal(self, signal: Signal, timeout: float) -> None:
        waiter = Waiter()
        if signal.attach(waiter):
            return
        try:
            await waiter.wait(timeout)
        finally:
            signal.detach(waiter)

    def _start_listener(self) -> Signal:
        with self._listener_lock:
            if self._listener is None or self._listener.done():
                self._listener = spawn(self._listen, name=f"fence-listen:{self._channel}")
            return self._ready

    async def _listen(self) -> None:
        """Keep one ``LISTEN`` connection open and post every notification to the board."""
        import psycopg

        assert self._listen_args is not None
        args, kwargs = self._listen_args
        quoted = '"' + (self._channel or "").replace('"', '""') + '"'
        writers = '"' + (self._writers_channel or "").replace('"', '""') + '"'
        backoff = 0.05
        warned = False
        while not self._closed:
            try:
                conn = await psycopg.AsyncConnection.connect(*args, autocommit=True, **kwargs)
            except psycopg.Error as exc:
                level = logging.DEBUG if warned else logging.WARNING
                warned = True
                _log.log(level, "LISTEN connection for %s failed: %s", self._where, exc)
                await _sleep(backoff)
                backoff = min(backoff * 2, _LISTEN_BACKOFF_MAX)
                continue
            try:
                await conn.execute(f"LISTEN {quoted}")
                await conn.execute(f"LISTEN {writers}")
                backoff = 0.05
                warned = False
                # Releases before this LISTEN were not seen: every waiter retries once.
                self._board.new_generation()
                self._ready.set()
                while not self._closed:
                    notes = conn.notifies(timeout=_LISTEN_SLICE, stop_after=1)
                    async for note in notes:  # unasync: for note in notes:
                        if note.payload:
                            only = note.channel == self._writers_channel
                            self._board.wake(note.payload, writers=only)
            except psycopg.Error as exc:
                _log.debug("LISTEN connection for %s lost: %s", self._where, exc)
            finally:
                with self._listener_lock:
                    if self._ready.is_set():
                        self._ready = Signal()
                try:
                    await conn.close()
                except psycopg.Error:  # pragma: no cover - closing a broken connection
                    pass


class AsyncSQLLockManager(AsyncBaseLockManager):
    """A lock manager whose leases live in a PostgreSQL or SQLite table.

    Acquire, renew and release are one statement each; the database's clock decides
    expiry and seeds the tokens, so clients with skewed clocks agree. Create the tables
    once with :meth:`create_table` or with the DDL from :func:`fence.lease_schema_ddl`
    (a lease table of an earlier version: :func:`fence.lease_upgrade_ddl`). Shared locks
    (C13): ``read_lock``/``write_lock``; see ``docs/shared-locks.md``.

    Args:
        engine: an :class:`~sqlalchemy.ext.asyncio.AsyncEngine`, or a URL
            (``postgresql://...``, ``sqlite:///locks.db``, ``sqlite://`` in memory) for an
            engine the manager creates and disposes of.
        table: the lease table's name (default ``fence_leases``).
        schema: its schema (PostgreSQL) or attached database (SQLite).
        token_mode: :attr:`fence.TokenMode.HYBRID` (default) survives a lost or restored
            table as long as the database clock does not go back;
            :attr:`~fence.TokenMode.COUNTER` survives what the table survives.
        listen: see :class:`AsyncSQLDriver` (PostgreSQL wake-ups).
        notify: see :class:`AsyncSQLDriver`.
        poll_interval: see :class:`AsyncSQLDriver`.
        create_table: create the lease table, if missing, before the first statement (handy
            for an in-memory database); or call :meth:`create_table` once.
        autocommit: whether ``engine`` was created with ``isolation_level="AUTOCOMMIT"``
            (saves switching each connection at checkout); default: only an engine the
            manager created.
        engine_options: more engine-creation arguments when ``engine`` is a URL.
        fence_table: the guards' fence register table; see :class:`AsyncSQLDriver`.
        **options: see :class:`fence.AsyncBaseLockManager` (``ttl``, ``renew``, ``drift``,
            ``margin``, ``clock``, ``events``, ``reentrant``).

    Raises:
        ConfigurationError: an unsupported database or bad options.

    Example::

        manager = AsyncSQLLockManager("postgresql://app@db/app", ttl=10)
        await manager.create_table()
        async with manager.lock("invoice:7") as lease:
            await guard.claim("invoice:7", lease.token)
            ...
        await manager.close()
    """

    def __init__(
        self,
        engine: sa.AsyncEngine | str,
        *,
        table: str = DEFAULT_TABLE,
        schema: str | None = None,
        token_mode: TokenMode = TokenMode.HYBRID,
        listen: bool | str = True,
        notify: bool = True,
        poll_interval: float | None = None,
        create_table: bool = False,
        autocommit: bool | None = None,
        engine_options: Mapping[str, Any] | None = None,
        fence_table: str | None = None,
        ttl: float = 30.0,
        renew: bool = False,
        drift: float = 0.01,
        margin: float = 0.002,
        clock: Clock | None = None,
        events: EventBus | None = None,
        reentrant: bool = True,
    ) -> None:
        owns = isinstance(engine, str)
        if autocommit is None:
            autocommit = owns and "isolation_level" not in (engine_options or {})
        if isinstance(engine, str):
            engine = make_engine(engine, engine_options)
        elif engine_options:
            raise ConfigurationError("engine_options apply only when engine is a URL")
        driver = AsyncSQLDriver(
            engine,
            table=table,
            schema=schema,
            token_mode=token_mode,
            listen=listen,
            notify=notify,
            poll_interval=poll_interval,
            create_table=create_table,
            autocommit=autocommit,
            owns_engine=owns,
            fence_table=fence_table,
        )
        self.sql_driver = driver
        super().__init__(
            driver,
            ttl=ttl,
            renew=renew,
            drift=drift,
            margin=margin,
            clock=clock,
            events=events,
            reentrant=reentrant,
        )

    @property
    def engine(self) -> sa.AsyncEngine:
        """The engine the leases are stored through."""
        return self.sql_driver.engine

    async def create_table(self) -> None:
        """Create the lease table if it does not exist.

        Raises:
            BackendError: the database refused or is unreachable.
        """
        await self.sql_driver.create_table()
