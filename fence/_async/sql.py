"""The SQL lock manager: leases in a PostgreSQL or SQLite table, through SQLAlchemy.

Every driver call is one statement in autocommit mode, so one round trip, and no session
state outlives it: no advisory lock, no open transaction, nothing that a
transaction-pooling proxy would break. The database's clock decides expiry and seeds the
hybrid tokens (C2, C3, C10). The statements are in :mod:`fence._sql_schema`.

Waiting: on PostgreSQL a release runs ``pg_notify`` in its own statement and waiters are
woken through one ``LISTEN`` connection per driver, with a bounded poll as a fallback; on
SQLite a release made in this process wakes the waiters of this process at once and other
waiters poll with a jittered interval. The generic manager also wakes every waiter when the
holder's lease ends by its ttl.
"""

from __future__ import annotations

import asyncio  # unasync: remove
import logging
import os
import random
import threading
import weakref
from collections.abc import Mapping
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

from sqlalchemy import exc as sa_exc
from sqlalchemy import text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.ext import asyncio as sa  # unasync: import sqlalchemy as sa
from sqlalchemy.pool import StaticPool

from fence._acompat import Task, Waiter, spawn
from fence._acompat import sleep as _sleep
from fence._async.manager import AsyncBaseLockManager
from fence._clock import Clock
from fence._core import MAX_TOKEN, TokenMode
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


def _is_memory(url: URL) -> bool:
    if url.get_backend_name() != "sqlite":
        return False
    return url.database in (None, "", ":memory:") or url.query.get("mode") == "memory"


def make_engine(url: str | URL, options: Mapping[str, Any] | None = None) -> sa.AsyncEngine:
    """Create an engine for the SQL lock manager from a URL.

    ``postgresql://`` gets the psycopg 3 driver, and ``sqlite://`` the default SQLite
    driver of the engine kind (aiosqlite for asyncio), unless the URL names a driver. The
    engine runs in autocommit mode (every lease statement is its own transaction). An
    in-memory SQLite database gets a single-connection
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
    if _is_memory(parsed):
        kwargs["poolclass"] = StaticPool
        kwargs["connect_args"] = {"check_same_thread": False}
    kwargs.update(options or {})
    create = sa.create_async_engine  # unasync: create = sa.create_engine
    return create(parsed, **kwargs)


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
        owns_engine: dispose of the engine in :meth:`close`.

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
        self.statements: LeaseStatements = lease_statements(
            dialect, table=table, schema=schema, token_mode=self.token_mode, notify=notify
        )
        self._sql: dict[str, TextClause] = {
            name: text(getattr(self.statements, name)) for name in _STATEMENTS
        }
        # Autocommit: each statement is its own transaction, one round trip, no BEGIN/COMMIT.
        self._auto = (
            engine if autocommit else engine.execution_options(isolation_level="AUTOCOMMIT")
        )
        self._owns_engine = owns_engine
        self._create_pending = create_table
        self._closed = False
        where = engine.url.render_as_string(hide_password=True)
        self._where = f"{self.statements.dialect} table {table!r} ({where})"

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
            self._board.bump(resource)
        return True

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
        if self._local:
            self._board.bump(resource)
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
        self, name: str, resource: str, params: dict[str, Any], *, retry: bool = True
    ) -> Row[Any] | None:
        if self._create_pending:
            await self.create_table()
        statement = self._sql[name]
        for attempt in (1, 2):
            try:
                async with self._serialised(), self._auto.connect() as conn:
                    result = await conn.execute(statement, params)
                    return result.first()
            except sa_exc.DBAPIError as exc:
                if retry and attempt == 1 and exc.connection_invalidated:
                    # A pooled connection died (the server restarted). SQLAlchemy has
                    # invalidated the pool; the call is safe to repeat once on a new one.
                    continue
                raise self._error(exc, name, resource) from exc
            except sa_exc.SQLAlchemyError as exc:
                raise self._error(exc, name, resource) from exc
            except OSError as exc:
                raise self._error(exc, name, resource) from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def _error(self, exc: BaseException, action: str, resource: str) -> BackendError:
        what = f"{action} of {resource!r}" if resource else action
        where = f"{what} on {self._where}"
        orig = getattr(exc, "orig", None) or exc
        sqlstate = getattr(orig, "sqlstate", None)
        message = _first_line(orig)
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
        connection_lost = isinstance(exc, sa_exc.OperationalError | sa_exc.InterfaceError) or (
            isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated
        )
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
            return BackendError(
                f"{where}: no connection free in the pool ({message}); raise pool_size or "
                "the pool timeout",
                code="POOL",
                retryable=True,
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
                            self._board.bump(note.payload)
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
