"""The SQL lock manager: leases in a PostgreSQL, SQLite or MariaDB table, through SQLAlchemy.

Every driver call is one statement in autocommit mode, so one round trip (on MariaDB an
acquire or a revoke is one short transaction), and no session state outlives it: no
advisory lock, no open transaction, nothing that a transaction-pooling proxy would break.
The database's clock decides expiry and seeds the hybrid tokens (C2, C3, C10). The
statements are in :mod:`fence._sql_schema`, what differs between databases in their
:class:`fence._sql_dialect.SQLDialect`, and what the driver decides without I/O (engines,
errors, wake-ups) in :mod:`fence._sql`.

Waiting: on PostgreSQL a release runs ``pg_notify`` in its own statement and waiters are
woken through one ``LISTEN`` connection per driver, with a bounded poll as a fallback; on
SQLite and MariaDB a release made in this process wakes a waiter of this process at once
and other waiters poll with a jittered interval. Each release wakes one waiter of each process (the
one that has waited longest), not all of them; where waiters of the process hold places
in the queue of a shared lock (C13), it wakes all of those, and the queue decides who goes
(a batch of readers together). The generic manager also wakes every waiter when the
holder's lease ends by its ttl.

Shared locks: a reader's lease is a row of ``<table>_shared``, as is every queued waiter.
On PostgreSQL every call is still one statement; on SQLite a read acquire, and a write
acquire that meets readers or queued waiters, is one ``BEGIN IMMEDIATE`` transaction in
which :func:`fence._rwlock.decide` decides (in process, no round trip). On MariaDB every
acquire and revoke is such a transaction, which first claims the resource's lease row
(an upsert, which locks it), so that the transactions on one resource run one at a time.
"""

from __future__ import annotations

import asyncio  # unasync: remove
import dataclasses
import functools
import logging
import os
import random
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Mapping
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, cast

from sqlalchemy import event, text
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import URL
from sqlalchemy.ext import asyncio as sa  # unasync: import sqlalchemy as sa
from sqlalchemy.pool import StaticPool

from fence._acompat import Task, Waiter, call_later, settle, spawn
from fence._acompat import sleep as _sleep
from fence._async.manager import AsyncBaseLockManager
from fence._clock import Clock
from fence._core import LeaseMode, TokenMode
from fence._deadline import deadline, reset, set_deadline
from fence._errors import BackendError, ConfigurationError
from fence._events import EventBus
from fence._rwlock import decide
from fence._signal import Signal
from fence._sql import (
    CLOSE_WAIT,
    LISTEN_SLICE,
    QUEUE_TTL,
    STATEMENTS,
    Backoff,
    ListenTarget,
    call_name,
    checked_token,
    engine_arguments,
    lease_error,
    lease_table_board,
    listen_target,
    next_token,
    no_time_left,
    pool_lock,
    queue_seq,
    shared_state,
    timed_out,
    tune_engine,
)
from fence._sql_dialect import (
    PG_CONNECT_TIMEOUT,  # noqa: F401 - make_engine's default, named in its docstring
    SQLITE_PRAGMAS,  # noqa: F401 - make_engine's default, named in its docstring and the docs
    SQLDialect,
    dialect_for,
)
from fence._sql_schema import DEFAULT_TABLE, LeaseStatements, lease_statements, notify_channel
from fence._wake import WakeBoard
from fence.abc import AcquireReply, LockInfo

if TYPE_CHECKING:
    from sqlalchemy import Row, TextClause

#: ``run(step, params)`` in a transaction of the driver: the rows of one statement.
_Rows = Awaitable[list[Any]]  # unasync: _Rows = list[Any]
_Run = Callable[[str, dict[str, Any]], _Rows]

__all__ = ["AsyncSQLDriver", "AsyncSQLLockManager"]

_log = logging.getLogger("fence.sql")

_IS_ASYNC = True  # unasync: _IS_ASYNC = False

#: Serialises the callers of a single-connection pool (an in-memory SQLite database).
_SerialLock = asyncio.Lock  # unasync: _SerialLock = threading.Lock


def make_engine(url: str | URL, options: Mapping[str, Any] | None = None) -> sa.AsyncEngine:
    """Create an engine for the SQL lock manager from a URL.

    ``postgresql://`` gets the psycopg 3 driver (with ``connect_timeout``
    :data:`PG_CONNECT_TIMEOUT`), and ``sqlite://`` the default SQLite driver of the engine
    kind (aiosqlite for asyncio), unless the URL names a driver. The engine runs in
    autocommit mode (every lease statement is its own transaction; on MariaDB and MySQL no
    ``ROLLBACK`` ends a checkout where the server says no transaction is open). A SQLite file gets
    :data:`SQLITE_PRAGMAS` (WAL, ``synchronous=NORMAL``, a 5 s busy timeout unless the URL
    gives ``timeout``) on every
    connection. An in-memory SQLite database gets a single-connection
    :class:`~sqlalchemy.pool.StaticPool`, the only pool that keeps one database for all
    callers.

    Args:
        url: a SQLAlchemy URL.
        options: more ``create_engine`` keyword arguments; they win over the defaults.
    """
    parsed, kwargs, on_connect = engine_arguments(url, options, asyncio=_IS_ASYNC)
    create = sa.create_async_engine  # unasync: create = sa.create_engine
    engine = create(parsed, **kwargs)
    target = engine.sync_engine  # unasync: target = engine
    if on_connect is not None:
        event.listen(target, "connect", on_connect)
    tune_engine(target)
    return engine


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


class _Listener:
    """One ``LISTEN`` connection per driver, on a task of its own (a thread in the sync
    twin), that posts every notification to the driver's board.

    The first wait starts it (:meth:`start`); :attr:`ready` is set while the connection
    listens. A lost connection clears it and is opened again with a backoff
    (:class:`fence._sql.Backoff`); once it listens again, the board starts a new
    generation, as releases may have come while nobody listened.
    """

    def __init__(self, target: ListenTarget, board: WakeBoard, where: str) -> None:
        self.target = target
        self._board = board
        self._where = where
        self._lock = threading.Lock()
        self._task: Task | None = None
        self._closed = False
        #: Set while the connection listens; replaced by a new one when it is lost.
        self.ready = Signal()

    def start(self) -> Signal:
        """Start the listener unless it runs; the signal set once it listens."""
        with self._lock:
            if self._task is None or self._task.done():
                self._task = spawn(self._run, name=f"fence-listen:{self.target.channel}")
            return self.ready

    def stop(self) -> Task | None:
        """Stop after the current wait for notifications (a notification ends it sooner);
        the task to join, or ``None`` if it never started."""
        self._closed = True
        return self._task

    async def _run(self) -> None:
        """Keep one ``LISTEN`` connection open and post every notification to the board."""
        import psycopg

        target = self.target
        backoff = Backoff()
        while not self._closed:
            try:
                conn = await psycopg.AsyncConnection.connect(
                    *target.args, autocommit=True, **target.kwargs
                )
            except psycopg.Error as exc:
                level, pause = backoff.failed()
                _log.log(level, "LISTEN connection for %s failed: %s", self._where, exc)
                await _sleep(pause)
                continue
            try:
                for command in target.commands:
                    await conn.execute(command)
                backoff.succeeded()
                # Releases before this LISTEN were not seen: every waiter retries once.
                self._board.new_generation()
                self.ready.set()
                while not self._closed:
                    notes = conn.notifies(timeout=LISTEN_SLICE, stop_after=1)
                    async for note in notes:  # unasync: for note in notes:
                        target.post(self._board, note.channel, note.payload)
            except psycopg.Error as exc:
                _log.debug("LISTEN connection for %s lost: %s", self._where, exc)
            finally:
                with self._lock:
                    if self.ready.is_set():
                        self.ready = Signal()
                try:
                    await conn.close()
                except psycopg.Error:  # pragma: no cover - closing a broken connection
                    pass


class AsyncSQLDriver:
    """Runs the lease statements on a SQLAlchemy engine; see :class:`AsyncSQLLockManager`.

    Args:
        engine: an engine on PostgreSQL (psycopg 3), SQLite or MariaDB (PyMySQL,
            aiomysql).
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
        dialect = dialect_for(engine.dialect.name)
        self.engine = engine
        #: The database's name (``engine.dialect.name``).
        self.dialect = dialect.name
        #: What the driver needs to know about the database.
        self.sql_dialect: SQLDialect = dialect
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
            name: getattr(self.statements, name) for name in STATEMENTS
        }
        self._sql: dict[str, TextClause] = {name: text(sql) for name, sql in self._raw_sql.items()}
        if self.statements.raise_fence is not None:
            self._raw_sql["raise_fence"] = self.statements.raise_fence
            self._sql["raise_fence"] = text(self.statements.raise_fence)
        for optional in ("acquire_read", "void"):
            sql = getattr(self.statements, optional)
            if sql is not None:
                self._raw_sql[optional] = sql
                self._sql[optional] = text(sql)
        self._steps = {name: text(sql) for name, sql in self.statements.steps.items()}
        # The dialect's ways, resolved once: the calls test these flags, not the dialect.
        # Shared locks and queued writers decided in process, in a transaction:
        self._decides = dialect.decides_in_process
        # A release wakes this process's waiters itself (nobody is notified):
        self._wakes_here = not dialect.notifies
        # No socket to cut at a deadline; a statement runs on after a cancellation:
        self._in_process = dialect.in_process
        self._socket_of = dialect.socket_of
        self._begin = dialect.begin
        # Every attempt and revoke is a transaction that first claims the lease row
        # (MariaDB: no statement can decide and report in one round trip).
        self._claims = dialect.locks_first
        # No RETURNING on UPDATE (MariaDB): a statement without rows reports by its row
        # count, which is of rows found, not changed: SQLAlchemy's MySQL dialects connect
        # with CLIENT_FOUND_ROWS, so a renewal that writes the same expiry (the same
        # microsecond) still counts.
        self._counts = not dialect.returning
        # The hybrid token floor takes the driver's reading of the clock, in microseconds
        # (see fence._sql_dialect.SQLiteDialect.token_floor).
        self._clock = dialect.client_clock and self.token_mode is TokenMode.HYBRID
        # The leases this driver granted to readers, and the waiters it put in the queue:
        # their calls take the shared table's statements.
        self._reading: set[tuple[str, str]] = set()
        self._placed: set[tuple[str, str]] = set()
        # The clean-up of an acquire that gave up: a tombstone first where a statement can
        # outlive its client (PostgreSQL), then the releases, in one transaction.
        self._undo_steps: tuple[str, ...] = ("release", "release_read", "abandon")
        if self.statements.void is not None:
            self._undo_steps = ("void", *self._undo_steps)
        # Autocommit: each statement is its own transaction, one round trip, no BEGIN/COMMIT.
        self._auto = (
            engine if autocommit else engine.execution_options(isolation_level="AUTOCOMMIT")
        )
        self._owns_engine = owns_engine
        self._create_pending = create_table
        self._closed = False
        # The clean-ups in flight, by (resource, secret): their done signals and outcomes.
        # A retry of one joins it. A connection that one hands back after the engine's
        # disposal stays out of every pool, open, until the garbage collector closes it:
        # the engine goes once the last of them has ended.
        self._cleanups: dict[tuple[str, str], tuple[Signal, list[Any]]] = {}
        self._dispose_pending = False
        self._cleanup_lock = threading.Lock()
        where = engine.url.render_as_string(hide_password=True)
        self._where = f"{self.statements.dialect} table {table!r} ({where})"

        self._busy_ms = dialect.busy_timeout_ms if owns_engine else None
        self._busy_sql = dialect.busy_timeout_sql
        self._busy_back = "" if self._busy_ms is None else self._busy_sql(self._busy_ms)
        pool = engine.pool
        if dialect.is_memory(engine.url) and not isinstance(pool, StaticPool):
            raise ConfigurationError(
                "an in-memory SQLite database exists once per connection: create its engine "
                "with poolclass=StaticPool and connect_args={'check_same_thread': False} "
                "(the manager does this when given a 'sqlite://' URL), or use a file"
            )
        self._serial: _SerialLock | None = None
        if isinstance(pool, StaticPool):
            self._serial = pool_lock(pool, _SerialLock)
        # The DB-API shortcut needs an engine that is autocommit already, on a driver that
        # takes the statements as they are.
        self._raw = (
            autocommit and self._serial is None and engine.dialect.driver == dialect.raw_driver
        )
        self._raw_error: type[Exception] = (
            engine.dialect.loaded_dbapi.Error if self._raw else Exception
        )

        self._params: dict[str, Any] = {}
        self._wake_params: dict[str, Any] = {}
        self._listener: _Listener | None = None
        if dialect.notifies:
            channel = notify_channel(table, schema)
            writers = notify_channel(table, schema, writers=True)
            self._params = {"channel": channel, "channel_w": writers} if notify else {}
            self._wake_params = {"channel": channel}
            self._sql["wake"] = text(self.statements.wake or "")
            self._board = WakeBoard()
            target = listen_target(engine, listen, channel, writers)
            if target is not None:
                self._listener = _Listener(target, self._board, self._where)
        else:
            if isinstance(listen, str):
                raise ConfigurationError("listen=<conninfo> is for PostgreSQL only")
            self._board = lease_table_board(dialect, engine.url, pool, schema, table)
        self.poll_interval = (
            dialect.poll_interval if poll_interval is None else float(poll_interval)
        )
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
        if self._decides and (reading or key in self._placed or self._claims):
            return await self._decide(resource, secret, ttl, holder, reading, cookie)
        params = {
            "resource": resource,
            "secret": secret,
            "holder": holder,
            "ttl": float(ttl),
        }
        if not self._decides:
            params["queue_ttl"] = QUEUE_TTL
        row = await self._execute("acquire_read" if reading else "acquire", resource, params)
        if row is None:
            raise BackendError(f"acquire of {resource!r} on {self._where} returned no row")
        token, granted, remaining, flag = tuple(row)
        if self._decides:
            if not granted and flag:
                # Readers or queued waiters: the transaction decides (and queues).
                return await self._decide(resource, secret, ttl, holder, reading, cookie)
            queued = False
        else:
            queued = bool(flag)
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
            return AcquireReply(checked_token(token))
        if queued:
            self._placed.add(key)
        holder_ttl = None if remaining is None else max(float(cast("float", remaining)), 0.0)
        return AcquireReply(None, holder_ttl, cookie, queued=queued)

    async def _decide(
        self, resource: str, secret: str, ttl: float, holder: str, reading: bool, cookie: object
    ) -> AcquireReply:
        """A dialect that decides in process (SQLite): one attempt decided in a transaction
        (``BEGIN IMMEDIATE``) by :func:`fence._rwlock.decide`, which sees the lease row and
        the shared table as they are (SQLite runs one writer at a time)."""
        base = {"resource": resource, "secret": secret}

        async def body(run: _Run) -> tuple[object, bool, float | None, bool]:
            if self._claims:
                await run("claim", base)
            state = (await run("state", base))[0]
            last, first, now = state[0], state[3], state[4]
            entries = await run("entries", base)
            writer, readers, queue = shared_state(state, entries)
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
                    seq = queue_seq(entries, secret, now)
                    kind = "R" if reading else "W"
                    await run(
                        "put", {**params, "kind": kind, "token": None, "ttl": QUEUE_TTL, "seq": seq}
                    )
                return None, False, verdict.wait, verdict.queued
            token = next_token(resource, last, first)
            params["token"] = token
            if reading:
                await run("count", params)
                await run("put", {**params, "kind": "r", "seq": 0})
            else:
                await run("write", params)
                if verdict.placed:
                    await run("drop", base)
            # Rows of the shared table are added only by transactions like this one, which
            # hold the resource (its lease row, or SQLite's write lock): with none read,
            # none is there to sweep but the one this one put (the common uncontended
            # writer: a statement saved).
            if entries:
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
        if self._wakes_here:
            # A reader leaving lets only writers in, never a reader that waits.
            self._board.wake(resource, writers=reading)
        return True

    async def cancel(self, resource: str, secret: str, ttl: float) -> bool:
        """An acquire gave up without knowing what its last statement did (a timeout, a
        cancellation, a broken connection): refuse that statement should it still run,
        release the lock (or the read lease) if it took it, and the place in the queue if
        it took one. Returns whether the lock was held.

        On PostgreSQL the statement may not have run yet: the server may not even have
        read it (a loaded or frozen server, a slow network), and it runs to its end
        whether the client is there or not. The clean-up is one transaction whose first
        statement leaves a tombstone of ``secret`` for ``ttl`` seconds in the resource's
        row and takes the row's lock; every acquire reads the tombstones of the row it
        locks, at its latest version. Whichever of the two locks the row first, nothing
        is left::

            the statement first                 the clean-up first
            t=0  acquire locks the row, takes   t=0  tombstone, row lock; release: none
                 the lock, commits              t=1  commit
            t=1  tombstone, row lock            t=2  acquire locks the row, finds the
                 (waits for t=0's commit)            tombstone: no lock, no place in
            t=2  release: held, released             the queue
            t=3  commit

        Waiting for the row lock alone would order them only if the statement were
        already queued for it, and an ``INSERT ... ON CONFLICT`` is not always in that
        queue: it waits outside it for a transaction that writes the row. SQLite runs a
        statement to its end in this process before the clean-up starts (see
        :meth:`_execute`), and its ``BEGIN IMMEDIATE`` is the lock.
        """
        # The release may have to open a connection, which the caller's deadline cannot
        # cut short (psycopg waits at least 2 s for a server that hangs): it runs on its
        # own, for as long as the lock could live, and the caller waits only until its
        # deadline. A retry (the manager's, after that deadline) waits for the clean-up
        # in flight: a second transaction would only queue behind it for the same row.
        key = (resource, secret)
        with self._cleanup_lock:
            running = self._cleanups.get(key)
            if running is None:
                done, outcome = self._cleanups[key] = (Signal(), [])
            else:
                done, outcome = running
        if running is None:
            spawn(
                self._cancel, resource, secret, ttl, outcome, done, name=f"fence-cancel:{resource}"
            )
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
            params = {"resource": resource, "secret": secret, "ttl": float(ttl), **self._params}
            rows = dict(
                zip(
                    self._undo_steps,
                    await self._execute_locked(
                        resource, [(step, params) for step in self._undo_steps]
                    ),
                    strict=True,
                )
            )
            held = rows["release"] is not None or rows["release_read"] is not None
            if (held or rows["abandon"] is not None) and self._wakes_here:
                self._board.wake(resource)
            outcome.append(held)
        except Exception as exc:
            outcome.append(exc)
        finally:
            reset(scope)
            with self._cleanup_lock:
                del self._cleanups[key]
                last = self._dispose_pending and not self._cleanups
                if last:
                    self._dispose_pending = False
            done.set()
            if last:
                # close() returned before this clean-up ended and left the engine to it.
                try:
                    await self.engine.dispose()
                except Exception as exc:  # pragma: no cover - nobody to report to
                    _log.debug("disposing of the engine of %s failed: %s", self._where, exc)

    async def wait(self, resource: str, timeout: float, reply: AcquireReply) -> None:
        """Return on a release seen by this process, or after a jittered poll slice (for a
        queued waiter, at most a third of :data:`QUEUE_TTL`: its attempts keep its place)."""
        if timeout <= 0:
            return
        slice_ = min(timeout, self.poll_interval * random.uniform(0.5, 1.0))
        if reply.queued:
            slice_ = min(slice_, QUEUE_TTL / 3)
        listener = self._listener
        if listener is not None and not self._closed:
            ready = listener.start()
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
                checked_token(token),
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

    async def list_page(
        self, prefix: str, cursor: str | None, count: int
    ) -> tuple[list[LockInfo], str | None]:
        """One keyset page of the locks held now (by the database's clock), by resource;
        the cursor is the last resource listed. Readers come from the shared table."""
        params = {"prefix": prefix, "length": len(prefix), "after": cursor or "", "count": count}
        rows = await self._execute("list_page", prefix, params, every=True)
        found: dict[str, list[LockInfo]] = {}
        waiting: dict[str, int] = {}
        for resource, kind, token, remaining, holder, waiters in rows:
            found.setdefault(resource, []).append(
                LockInfo(
                    resource,
                    checked_token(token),
                    max(float(remaining), 0.0),
                    holder,
                    LeaseMode.WRITE if kind == "w" else LeaseMode.READ,
                )
            )
            waiting[resource] = int(waiters)
        infos = []
        for resource, leases in found.items():
            writers = [info for info in leases if info.mode is LeaseMode.WRITE]
            info = writers[0] if writers else LockInfo.of_readers(resource, leases)
            if info is not None:
                infos.append(dataclasses.replace(info, waiters=waiting[resource]))
        # The database's order (its collation) is the keyset's: the cursor is the last
        # resource it returned. Fewer resources than asked: the keyset is walked to its end.
        last = next(reversed(found)) if len(found) >= count else None
        return infos, last

    async def revoke(self, resource: str) -> int:
        """End every lease of ``resource`` (the writer's, or every reader's); see
        :meth:`fence.abc.AsyncDriver.revoke`. The lease row keeps the new token."""
        params = {"resource": resource, **self._params}
        if not self._decides:
            row = await self._execute("revoke", resource, params)
            if row is None:
                raise BackendError(f"revoke of {resource!r} on {self._where} returned no row")
            token = checked_token(row[0])
        else:
            # No data-modifying CTE (SQLite): the readers' rows go, and the register is
            # raised, in the same transaction, after the lease row holds the new token.
            async def body(run: _Run) -> int:
                if self._claims:
                    await run("claim", params)
                    await run("revoke", params)
                    got = checked_token((await run("token", params))[0][0])
                else:
                    got = checked_token((await run("revoke", params))[0][0])
                await run("drop_readers", params)
                if "raise_fence" in self._sql:
                    await run("raise_fence", {"resource": resource, "token": got})
                return got

            token = await self._transaction("revoke", resource, body)
        if self._wakes_here:
            self._board.wake(resource)
        return token

    async def close(self) -> None:
        """Stop the notification listener; dispose of the engine if the driver owns it.

        The clean-ups of acquires that gave up (see :meth:`cancel`) may still be running:
        ``close()`` waits for them at most :data:`fence._sql.CLOSE_WAIT` seconds, and one
        still running then disposes of the engine when it ends, once its connection is
        back in the pool (the engine's disposal closes only the connections in the pool).
        """
        if self._closed:
            return
        self._closed = True
        task = None if self._listener is None else self._listener.stop()
        if task is not None:
            try:
                # Wake the listener out of its wait for notifications.
                await self._execute("wake", "", {"resource": "", **self._wake_params}, retry=False)
            except BackendError:
                pass
            await task.join()
        if await self._cleanups_ended(CLOSE_WAIT) and self._owns_engine:
            await self.engine.dispose()

    async def _cleanups_ended(self, timeout: float) -> bool:
        """Wait at most ``timeout`` seconds for the clean-ups in flight; whether they all
        ended. If not, the last one to end disposes of the engine (if the driver owns it)."""
        end = time.monotonic() + timeout
        while True:
            with self._cleanup_lock:
                running = next(iter(self._cleanups.values()), None)
                if running is None:
                    return True
                if time.monotonic() >= end:
                    self._dispose_pending = self._owns_engine
                    return False
            await self._wait_signal(running[0], end - time.monotonic())

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
        listener = self._listener
        if listener is not None and not listener.ready.is_set():
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
            if not self._in_process:
                result = await conn.execute(statement, params)
            else:
                # aiosqlite runs the statement on in its thread if the task is cancelled:
                # let it finish, so a clean-up sees what it did.
                result = await settle(conn.execute(statement, params))
            if self._counts and not result.returns_rows:
                return (result.rowcount,) if result.rowcount > 0 else None
            return list(result.fetchall()) if every else result.first()

        return await self._connected(name, resource, work, retry=retry)

    async def _execute_locked(
        self, resource: str, steps: list[tuple[str, dict[str, Any]]]
    ) -> list[Row[Any] | None]:
        """Run statements in one transaction (SQLite's takes the database's write lock);
        their first rows."""

        async def body(run: _Run) -> list[Any]:
            found = []
            for name, params in steps:
                rows = await run(name, params)
                found.append(rows[0] if rows else None)
            return found

        return cast("list[Row[Any] | None]", await self._transaction("cancel", resource, body))

    async def _transaction(self, name: str, resource: str, body: Any) -> Any:
        """Run ``body(run)`` in one transaction, where ``run(step, params)`` runs a
        statement of :attr:`LeaseStatements.steps` (or of the driver's) and returns its
        rows. The transaction begins with the dialect's ``BEGIN`` (SQLite: ``BEGIN
        IMMEDIATE``, the database's write lock). Rolled back if ``body`` raises."""
        if self._create_pending:
            await self.create_table()

        async def work(conn: Any) -> Any:
            async def run(step: str, params: dict[str, Any]) -> list[Any]:
                statement = self._steps.get(step)
                if statement is None:
                    statement = self._sql[step]
                if self._clock:
                    params = {**params, "clock_us": time.time_ns() // 1000}
                if self._in_process:
                    result = await settle(conn.execute(statement, params))
                else:
                    result = await conn.execute(statement, params)
                if result.returns_rows:
                    return list(result.fetchall())
                if self._counts and result.rowcount > 0:
                    return [(result.rowcount,)]
                return []

            await conn.exec_driver_sql(self._begin)
            try:
                outcome = await body(run)
                await conn.exec_driver_sql("COMMIT")
            except BaseException:
                try:
                    await conn.exec_driver_sql("ROLLBACK")
                except sa_exc.SQLAlchemyError:
                    pass  # the connection broke: the server rolls back by itself
                raise
            return outcome

        return await self._connected(name, resource, work)

    async def _connected(self, name: str, resource: str, work: Any, *, retry: bool = True) -> Any:
        """Run ``work(conn)`` on a pooled connection within the caller's deadline (a
        server's socket is cut at the deadline; SQLite waits for a busy database at most
        until then); map the driver's errors."""
        at = deadline()
        for attempt in (1, 2):
            if at is not None and at <= time.monotonic():
                raise no_time_left(self._on(name, resource))
            fired = [False]
            try:
                async with self._serialised(), self._auto.connect() as conn:
                    alarm = None
                    busy = None
                    if at is not None:
                        if not self._in_process:
                            proxied = conn.sync_connection  # unasync: proxied = conn
                            fd = self._socket_of(proxied)
                            if fd is not None:
                                alarm = call_later(
                                    at - time.monotonic(), functools.partial(_cut, fd, fired)
                                )
                        elif self._busy_ms is not None:
                            busy = max(1, int((at - time.monotonic()) * 1000))
                            if busy < self._busy_ms:
                                await conn.exec_driver_sql(self._busy_sql(busy))
                            else:
                                busy = None
                    try:
                        return await work(conn)
                    finally:
                        if alarm is not None:
                            alarm.cancel()
                        if busy is not None:
                            await conn.exec_driver_sql(self._busy_back)
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
        """Sync, on an autocommit engine of the dialect's :attr:`~SQLDialect.raw_driver`
        (SQLite's sqlite3): one statement on the pool's DB-API connection, without
        SQLAlchemy's per-statement work (most of a call's cost in-process). Same
        statements, same pool, same connect-time settings."""
        if at is not None and at <= time.monotonic():
            raise no_time_left(self._on(name, resource))
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
                        cursor.execute(self._busy_sql(busy))
                    else:
                        busy = None
                cursor.execute(self._raw_sql[name], params)
                rows = cursor.fetchall()
            finally:
                if busy is not None:
                    cursor.execute(self._busy_back)
                cursor.close()
        except self._raw_error as exc:
            raise self._error(exc, name, resource) from exc
        finally:
            conn.close()
        if every:
            return rows
        return rows[0] if rows else None

    def _on(self, action: str, resource: str) -> str:
        """The call and the table, for messages."""
        return f"{call_name(action, resource)} on {self._where}"

    def _timed_out(self, action: str, resource: str, exc: BaseException) -> BackendError:
        return timed_out(self._on(action, resource), exc)

    def _error(self, exc: BaseException, action: str, resource: str) -> BackendError:
        return lease_error(exc, self._on(action, resource), self.sql_dialect, self.engine.pool)

    async def _wait_signal(self, signal: Signal, timeout: float) -> None:
        waiter = Waiter()
        if signal.attach(waiter):
            return
        try:
            await waiter.wait(timeout)
        finally:
            signal.detach(waiter)


class AsyncSQLLockManager(AsyncBaseLockManager):
    """A lock manager whose leases live in a PostgreSQL, SQLite or MariaDB table.

    Acquire, renew and release are one statement each; the database's clock decides
    expiry and seeds the tokens, so clients with skewed clocks agree. Create the tables
    once with :meth:`create_table` or with the DDL from :func:`fence.lease_schema_ddl`
    (a lease table of an earlier version: :func:`fence.lease_upgrade_ddl`). Shared locks
    (C13): ``read_lock``/``write_lock``; see ``docs/shared-locks.md``.

    Args:
        engine: an :class:`~sqlalchemy.ext.asyncio.AsyncEngine`, or a URL
            (``postgresql://...``, ``sqlite:///locks.db``, ``sqlite://`` in memory,
            ``mariadb://...``) for an engine the manager creates and disposes of.
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
