"""The SQL lock manager: leases in a PostgreSQL or SQLite table, through SQLAlchemy.

Every driver call is one statement in autocommit mode, so one round trip, and no session
state outlives it: no advisory lock, no open transaction, nothing that a
transaction-pooling proxy would break. The database's clock decides expiry and seeds the
hybrid tokens (C2, C3, C10). The statements are in :mod:`fence._sql_schema`.

Waiting: on PostgreSQL a release runs ``pg_notify`` in its own statement and waiters are
woken through one ``LISTEN`` connection per driver, with a bounded poll as a fallback; on
SQLite a release made in this process wakes a waiter of this process at once and other
waiters poll with a jittered interval. Each release wakes one waiter of each process (the
one that has waited longest), not all of them. The generic manager also wakes every waiter when the
holder's lease ends by its ttl.
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
from collections.abc import Mapping
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
from fence._core import MAX_TOKEN, TokenMode
from fence._deadline import deadline, reset, set_deadline
from fence._errors import BackendError, ConfigurationError, InvalidTokenError, RetryableError
from fence._events import EventBus
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

_STATEMENTS = ("acquire", "renew", "release", "inspect", "revoke")

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
        self._params: dict[str, Any] = {}
        self._wake_params: dict[str, Any] = {}
        self._listen_args: tuple[list[Any], dict[str, Any]] | None = None
        self._listener: Task | None = None
        self._listener_lock = threading.Lock()
        self._ready = Signal()
        if dialect == "postgresql":
            self._channel = notify_channel(table, schema)
            self._params = {"channel": self._channel} if notify else {}
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

    async def acquire(self, resource: str, secret: str, ttl: float, holder: str) -> AcquireReply:
        """See :meth:`fence.abc.AsyncDriver.acquire`; one upsert statement."""
        cookie = self._mark()
        row = await self._execute(
            "acquire",
            resource,
            {"resource": resource, "secret": secret, "holder": holder, "ttl": float(ttl)},
        )
        if row is None:
            raise BackendError(f"acquire of {resource!r} on {self._where} returned no row")
        token, granted, remaining = tuple(row)
        if granted:
            return AcquireReply(_checked_token(token))
        holder_ttl = None if remaining is None else max(float(remaining), 0.0)
        return AcquireReply(None, holder_ttl, cookie)

    async def renew(self, resource: str, secret: str, ttl: float) -> bool:
        """See :meth:`fence.abc.AsyncDriver.renew`."""
        row = await self._execute(
            "renew", resource, {"resource": resource, "secret": secret, "ttl": float(ttl)}
        )
        return row is not None

    async def release(self, resource: str, secret: str) -> bool:
        """See :meth:`fence.abc.AsyncDriver.release`; on PostgreSQL it also notifies."""
        row = await self._execute(
            "release", resource, {"resource": resource, "secret": secret, **self._params}
        )
        if row is None:
            return False
        if self._local:
            self._board.wake_one(resource)
        return True

    async def cancel(self, resource: str, secret: str, ttl: float) -> bool:
        """An acquire gave up without knowing what its last statement did (a timeout, a
        cancellation): release the lock if that statement took it.

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
        try:
            params = {"resource": resource, "secret": secret, **self._params}
            row = await self._execute("release", resource, params, lock_row=True)
            if row is not None and self._local:
                self._board.wake_one(resource)
            outcome.append(row is not None)
        except Exception as exc:
            outcome.append(exc)
        finally:
            reset(scope)
            done.set()

    async def wait(self, resource: str, timeout: float, reply: AcquireReply) -> None:
        """Return on a release seen by this process, or after a jittered poll slice."""
        if timeout <= 0:
            return
        slice_ = min(timeout, self.poll_interval * random.uniform(0.5, 1.0))
        if self._listen_args is not None and not self._closed:
            ready = self._start_listener()
            if not ready.is_set():
                # Nothing listens yet: wait for LISTEN, then have the caller try again, as
                # a release may have come between its attempt and the LISTEN.
                await self._wait_signal(ready, slice_)
                return
        waiter = Waiter()
        if self._board.attach(resource, waiter, reply.cookie):
            return
        try:
            await waiter.wait(slice_)
        finally:
            self._board.detach(resource, waiter)

    async def abandon(self, resource: str, secret: str) -> None:
        """A waiter gave up; it may have been the one a release woke (each release wakes
        one waiter of this process): wake another in its place. No I/O."""
        del secret
        self._board.wake_one(resource)

    async def inspect(self, resource: str) -> LockInfo | None:
        """See :meth:`fence.abc.AsyncDriver.inspect`."""
        row = await self._execute("inspect", resource, {"resource": resource})
        if row is None:
            return None
        token, remaining, holder = tuple(row)
        return LockInfo(resource, _checked_token(token), max(float(remaining), 0.0), holder)

    async def revoke(self, resource: str) -> int:
        """See :meth:`fence.abc.AsyncDriver.revoke`; the row keeps the new token."""
        row = await self._execute("revoke", resource, {"resource": resource, **self._params})
        if row is None:
            raise BackendError(f"revoke of {resource!r} on {self._where} returned no row")
        token = _checked_token(row[0])
        if "raise_fence" in self._sql:
            # SQLite has no data-modifying CTE: the register is raised in a second
            # statement, after the lease row already holds the token.
            await self._execute("raise_fence", resource, {"resource": resource, "token": token})
        if self._local:
            self._board.wake_one(resource)
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
        """Create the lease table if it does not exist (the DDL of :func:`lease_table_ddl`).

        Raises:
            BackendError: the database refused or is unreachable.
        """
        try:
            async with self._serialised(), self._auto.connect() as conn:
                await conn.execute(text(self.statements.create))
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
        lock_row: bool = False,
    ) -> Row[Any] | None:
        if self._create_pending:
            await self.create_table()
        at = deadline()
        if not _IS_ASYNC and self._raw and not lock_row:
            return cast("Row[Any] | None", self._execute_raw(name, resource, params, at))
        statement = self._sql[name]
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
                        if lock_row:
                            return await self._locked(conn, statement, params)
                        if self._pg:
                            result = await conn.execute(statement, params)
                        else:
                            # aiosqlite runs the statement on in its thread if the task is
                            # cancelled: let it finish, so a clean-up sees what it did.
                            result = await settle(conn.execute(statement, params))
                        return result.first()
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
        self, name: str, resource: str, params: dict[str, Any], at: float | None
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
        return rows[0] if rows else None

    async def _locked(
        self, conn: Any, statement: TextClause, params: dict[str, Any]
    ) -> Row[Any] | None:
        """Run ``statement`` in a transaction that first takes the resource's row lock
        (PostgreSQL) or the database's write lock (SQLite)."""
        await conn.exec_driver_sql("BEGIN" if self._pg else "BEGIN IMMEDIATE")
        try:
            if self._pg:
                await conn.execute(self._lock_row, {"resource": params["resource"]})
            row: Row[Any] | None = (await conn.execute(statement, params)).first()
            await conn.exec_driver_sql("COMMIT")
        except BaseException:
            try:
                await conn.exec_driver_sql("ROLLBACK")
            except sa_exc.SQLAlchemyError:
                pass  # the connection broke: the server rolls back by itself
            raise
        return row

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
        if sqlstate in ("42P01", "3F000") or "no such table" in message:
            return BackendError(
                f"{where}: the lease table is missing ({message}); create it with the "
                "manager's create_table() or in a migration with the DDL of lease_table_ddl()",
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
                backoff = 0.05
                warned = False
                # Releases before this LISTEN were not seen: every waiter retries once.
                self._board.new_generation()
                self._ready.set()
                while not self._closed:
                    notes = conn.notifies(timeout=_LISTEN_SLICE, stop_after=1)
                    async for note in notes:  # unasync: for note in notes:
                        if note.payload:
                            self._board.wake_one(note.payload)
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
    expiry and seeds the tokens, so clients with skewed clocks agree. Create the table once
    with :meth:`create_table` or with the DDL from :func:`fence.lease_table_ddl`.

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
