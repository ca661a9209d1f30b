"""Every timeout honoured, no orphaned lock: the managers against real faults.

``acquire(timeout=t)`` returns within ``t`` plus a small margin whatever the server does
(stopped with SIGSTOP, killed, refusing connections): every round trip is bounded by the
time left and transient errors are retried until then. An acquire that gives up after an
attempt whose reply was lost releases what that attempt took, so nobody is shut out for
the ttl by a lock nobody holds. Every server here is of the test's own.

The bound asserted is generous (:data:`SLACK`, for a loaded 2-core machine): it is the
point of these tests. The sync twin in ``tests/_sync`` runs the same with threads. The
asyncio-only cases (a task cancelled inside the round trip) are in
``tests/test_manager_cancellation.py``.
"""

from __future__ import annotations

import gc
import os
import secrets
import signal
import sqlite3
import threading
import time
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import redis
from sqlalchemy import event as sa_event
from sqlalchemy.engine import make_url

from fence import AcquireTimeout, BackendError, MemoryBackend
from fence._async import sql as sql_module
from fence._async.manager import UNDO_LIMIT
from fence._async.memory import AsyncMemoryLockManager
from fence._async.quorum import AsyncQuorumLockManager
from fence._async.redis import AsyncRedisLockManager
from fence._async.sql import AsyncSQLLockManager
from fence._redis_keys import resource_keys
from fence._resp import ConnectionFailure
from fence._sql_schema import lease_schema_ddl
from tests._acompat import join, sleep, spawn
from tests.fix_quorum import start_nodes, stop_nodes
from tests.servers import PostgresServer, RedisServer
from tests.sqlite_files import sqlite_file
from tests.stalls import StallMeter

pytestmark = pytest.mark.slow

IS_ASYNC = True  # unasync: IS_ASYNC = False

#: How far past its timeout a call may return here: the manager's documented margin
#: (UNDO_LIMIT and a few milliseconds) plus room for a loaded machine.
SLACK = UNDO_LIMIT + 1.5


@pytest.fixture
def server() -> Iterator[RedisServer]:
    """A redis-server of this test's own, so that stopping it disturbs nobody."""
    server = RedisServer().start()
    yield server
    if server.proc is not None:
        server.resume()
    server.stop()


@pytest.fixture(scope="module")
def pg() -> Iterator[PostgresServer]:
    """A PostgreSQL cluster of this module's own, free to stop."""
    server = PostgresServer().start()
    yield server
    server.destroy()


@pytest.fixture
def resource() -> str:
    return f"res:{secrets.token_hex(4)}"


@pytest.fixture
async def managers() -> AsyncIterator[list[Any]]:
    """Managers to close after the test, even if it fails."""
    built: list[Any] = []
    yield built
    for manager in built:
        await manager.close()


def later(seconds: float, fn: Callable[[], Any]) -> threading.Timer:
    """Run ``fn`` (a fault: SIGSTOP, SIGKILL, a restart) in ``seconds``, from a thread."""
    timer = threading.Timer(seconds, fn)
    timer.start()
    return timer


async def timed(fn: Callable[[], Awaitable[Any]]) -> tuple[Any, float]:
    """Run ``fn`` as another owner; return (its result or the exception it raised, seconds).

    The seconds leave out the time the machine kept this process from running
    (:class:`tests.stalls.StallMeter`): a loaded machine is no fault of the manager."""

    async def run() -> tuple[Any, float]:
        with StallMeter() as stalled:
            start = time.monotonic()
            try:
                outcome = await fn()
            except Exception as exc:
                outcome = exc
            elapsed = time.monotonic() - start
        return outcome, elapsed - stalled.seconds

    return tuple(await join(await spawn(run)))  # type: ignore[return-value]


def backends(conninfo: str, app: str) -> list[tuple[int, str, str, str | None]]:
    """``(pid, state, last statement, wait event type)`` of each backend of ``app``."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        return conn.execute(
            "SELECT pid, state, query, wait_event_type FROM pg_stat_activity"
            " WHERE application_name = %s",
            (app,),
        ).fetchall()


async def until(condition: Callable[[], bool], what: str, seconds: float = 20.0) -> None:
    """Poll ``condition`` until it holds; fail after ``seconds``."""
    end = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"gave up waiting for {what}")
        await sleep(0.02)


async def voids(url: str, resource: str) -> int:
    """How many tombstones of cancelled acquires ``resource`` has (SCAN, on a raw client)."""
    client = redis.Redis.from_url(url)
    try:
        pattern = resource_keys("fence:", resource).void_prefix + "*"
        return len(list(client.scan_iter(match=pattern)))
    finally:
        client.close()


# -- Redis --------------------------------------------------------------------------------


async def test_redis_timeout_holds_when_the_server_stops(
    server: RedisServer, managers: list[Any], resource: str
) -> None:
    """A waiter with ``timeout=1`` whose server freezes (SIGSTOP) 0.2 s into the wait
    returns after about 1 s, not after its socket timeouts (8 s before issue 14)."""
    manager = AsyncRedisLockManager(server.url, ttl=30, socket_timeout=5)
    managers.append(manager)
    holder = await manager.acquire(resource)
    timer = later(0.2, server.pause)
    try:
        outcome, elapsed = await timed(lambda: manager.acquire(resource, timeout=1.0))
    finally:
        timer.join()
        server.resume()
    assert isinstance(outcome, AcquireTimeout | BackendError), outcome
    assert elapsed < 1.0 + SLACK
    info = await manager.inspect(resource)
    assert info is not None
    assert info.token == holder.token  # the holder was never disturbed
    await holder.release()


async def test_redis_timeout_holds_when_the_server_is_killed(
    server: RedisServer, managers: list[Any], resource: str
) -> None:
    manager = AsyncRedisLockManager(server.url, ttl=30, socket_timeout=5)
    managers.append(manager)
    await manager.acquire(resource)
    timer = later(0.2, server.kill)
    try:
        outcome, elapsed = await timed(lambda: manager.acquire(resource, timeout=1.0))
    finally:
        timer.join()
    assert isinstance(outcome, AcquireTimeout | BackendError), outcome
    assert elapsed < 1.0 + SLACK


async def test_redis_refused_connections_are_retried_until_the_deadline(
    server: RedisServer, managers: list[Any], resource: str
) -> None:
    """A server that refuses connections is retried with backoff: back 0.5 s later, it
    grants the lock within the caller's timeout."""
    manager = AsyncRedisLockManager(server.url, ttl=30)
    managers.append(manager)
    first = await manager.acquire(resource)
    await first.release()
    server.kill()
    timer = later(0.5, server.start)
    try:
        outcome, _ = await timed(lambda: manager.acquire(resource, timeout=20))
    finally:
        timer.join()
    assert not isinstance(outcome, Exception), outcome
    assert outcome.token > first.token
    await outcome.release()


async def test_redis_refused_until_the_deadline_says_where_and_why(
    server: RedisServer, managers: list[Any], resource: str
) -> None:
    """Refused for the whole timeout: the error comes at the deadline, after several
    attempts, and names the server, the call and the cause. ``timeout=0`` tries once."""
    manager = AsyncRedisLockManager(server.url, ttl=30)
    managers.append(manager)
    attempts = [0]
    real_acquire = manager.driver.acquire

    async def counting(*args: Any) -> Any:
        attempts[0] += 1
        return await real_acquire(*args)

    manager.driver.acquire = counting
    server.kill()
    outcome, elapsed = await timed(lambda: manager.acquire(resource, timeout=1.0))
    assert isinstance(outcome, BackendError), outcome
    assert outcome.code == "CONNECTION"
    assert outcome.retryable
    assert outcome.sent is False
    assert elapsed < 1.0 + SLACK
    assert attempts[0] >= 3
    text = str(outcome)
    assert f"127.0.0.1:{server.port}" in text
    assert f"acquire of {resource!r}" in text
    assert "refused" in text.lower()
    attempts[0] = 0
    once, _ = await timed(lambda: manager.acquire(resource, timeout=0))
    assert isinstance(once, BackendError)
    assert attempts[0] == 1


async def test_redis_refused_then_cut_short_names_the_refusal(
    server: RedisServer, managers: list[Any], resource: str
) -> None:
    """Refused, and then the deadline cuts the last attempt short before it sends anything
    (a connect still pending on a loaded machine): the error says what the attempts before
    it learned, a refused connection, rather than only that time ran out."""
    manager = AsyncRedisLockManager(server.url, ttl=30)
    managers.append(manager)
    real_acquire = manager.driver.acquire
    calls = [0]
    end = [0.0]

    async def refused_then_cut(*args: Any) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            return await real_acquire(*args)  # refused: the server is down
        await sleep(max(end[0] - time.monotonic(), 0.0) + 0.01)
        raise manager.driver._error(
            ConnectionFailure(
                "no answer from the server in the time allowed", sent=False, timed_out=True
            ),
            "acquire",
            args[0],
        )

    manager.driver.acquire = refused_then_cut
    server.kill()
    # 5 s: the refused first attempt must end well inside the deadline on a loaded machine
    # (cut short itself, it would learn no refusal).
    end[0] = time.monotonic() + 5.0
    outcome, _ = await timed(lambda: manager.acquire(resource, timeout=5.0))
    assert isinstance(outcome, BackendError), outcome
    assert calls[0] == 2
    assert outcome.sent is False
    text = str(outcome)
    assert "refused" in text.lower(), text
    assert "ran out of time" in text, text


async def test_redis_failed_acquire_leaves_no_lock(
    server: RedisServer, managers: list[Any], resource: str
) -> None:
    """The request reaches a frozen server and the acquire times out: the clean-up
    (release, and a tombstone for the attempt still in the server's buffer) is sent before
    the error reaches the caller, so once the server runs again the lock is free at the
    next round trip, whatever order the server reads them in."""
    manager = AsyncRedisLockManager(server.url, ttl=60, check_config=False)
    managers.append(manager)
    assert await manager.inspect(resource) is None  # connected: the request goes out at once
    server.pause()
    try:
        outcome, elapsed = await timed(lambda: manager.acquire(resource, timeout=0.5))
    finally:
        server.resume()
    assert isinstance(outcome, BackendError), outcome
    assert elapsed < 0.5 + SLACK
    assert await manager.inspect(resource) is None
    other = AsyncRedisLockManager(server.url, ttl=60)
    managers.append(other)
    lease = await other.try_acquire(resource)
    assert lease is not None
    await lease.release()
    # The server reads the stranded attempt and the clean-up (from connections the client
    # has closed) in either order, and maybe after newer requests: whatever the order, the
    # tombstone is there in the end and the attempt never took the lock.
    for _ in range(100):
        if await voids(server.url, resource) == 1:
            break
        await sleep(0.05)
    assert await voids(server.url, resource) == 1
    assert await manager.inspect(resource) is None


async def test_redis_pool_exhaustion_names_the_client_side_limit(
    server: RedisServer, managers: list[Any], resource: str
) -> None:
    """Every connection of the manager's own pool busy until the deadline: the error says
    it is the client's limit, and how to raise it; nothing reached Redis."""
    manager = AsyncRedisLockManager(server.url, max_connections=1)
    managers.append(manager)
    await manager.inspect(resource)
    pool = manager.driver.client.pool
    taken = await pool.get(time.monotonic() + 5)
    try:
        outcome, elapsed = await timed(lambda: manager.acquire(resource, timeout=0.3))
    finally:
        pool.put(taken)
    assert isinstance(outcome, BackendError), outcome
    assert outcome.code == "POOL"
    assert outcome.sent is False
    assert "max_connections" in str(outcome)
    assert "did not answer" not in str(outcome)
    assert elapsed < 0.3 + SLACK
    lease = await manager.acquire(resource, timeout=5)
    await lease.release()


# -- quorum ---------------------------------------------------------------------------------


async def test_quorum_timeout_holds_and_leaves_no_lock(managers: list[Any], resource: str) -> None:
    """Every node frozen during the acquire: it returns by its timeout, and once they run
    again no node holds the lock (each got the clean-up before the caller got the error)."""
    nodes = start_nodes()
    try:
        manager = AsyncQuorumLockManager([n.url for n in nodes], ttl=60, check_config=False)
        managers.append(manager)
        assert await manager.inspect(resource) is None
        for node in nodes:
            node.pause()
        try:
            outcome, elapsed = await timed(lambda: manager.acquire(resource, timeout=0.5))
        finally:
            for node in nodes:
                node.resume()
        assert isinstance(outcome, BackendError), outcome
        assert elapsed < 0.5 + SLACK
        assert await manager.inspect(resource) is None
        lease = await manager.try_acquire(resource)
        assert lease is not None
        await lease.release()
    finally:
        stop_nodes(nodes)


# -- memory ---------------------------------------------------------------------------------


async def test_memory_paused_backend_honours_the_timeout(resource: str) -> None:
    """The pausable backend stands in for a frozen server: a call waits for it only until
    its deadline, and nothing is taken."""
    backend = MemoryBackend()
    manager = AsyncMemoryLockManager(backend, ttl=30)
    try:
        backend.pause()
        try:
            outcome, elapsed = await timed(lambda: manager.acquire(resource, timeout=0.3))
        finally:
            backend.resume()
        assert isinstance(outcome, BackendError), outcome
        assert outcome.sent is False
        assert elapsed < 0.3 + SLACK
        assert await manager.inspect(resource) is None
    finally:
        await manager.close()


async def test_memory_reentrant_acquire_honours_the_timeout(resource: str) -> None:
    """A reentrant acquire renews the held lock: on a frozen backend that renewal is bounded
    by the caller's timeout too, and the lease stays held at its depth."""
    backend = MemoryBackend()
    manager = AsyncMemoryLockManager(backend, ttl=30)
    try:
        lease = await manager.acquire(resource)
        backend.pause()
        start = time.monotonic()
        try:
            with pytest.raises(BackendError):
                await manager.acquire(resource, timeout=0.3)  # the same owner: reentrant
        finally:
            elapsed = time.monotonic() - start
            backend.resume()
        assert elapsed < 0.3 + SLACK
        assert not lease.lost
        await lease.release()
        assert await manager.inspect(resource) is None  # one release: the depth stayed 1
    finally:
        await manager.close()


# -- SQL ------------------------------------------------------------------------------------


async def test_sqlite_url_gets_wal_and_a_busy_timeout(tmp_path: Path, resource: str) -> None:
    path = tmp_path / "locks.db"
    manager = AsyncSQLLockManager(f"sqlite:///{path}", create_table=True)
    try:
        lease = await manager.acquire(resource)
        await lease.release()
        async with manager.engine.connect() as conn:
            mode = (await conn.exec_driver_sql("PRAGMA journal_mode")).scalar()
            busy = (await conn.exec_driver_sql("PRAGMA busy_timeout")).scalar()
        assert mode == "wal"
        assert busy == 5000
    finally:
        await manager.close()


async def test_sqlite_busy_database_honours_the_timeout(tmp_path: Path, resource: str) -> None:
    """Another connection holds the write lock longer than the caller's timeout: the busy
    wait is cut at the deadline, not at the 5 s busy timeout."""
    path = tmp_path / "locks.db"
    with sqlite_file(path) as conn:
        for statement in lease_schema_ddl("sqlite"):
            conn.execute(statement)
    manager = AsyncSQLLockManager(f"sqlite:///{path}")
    blocker = sqlite3.connect(path, isolation_level=None)
    try:
        await manager.inspect(resource)
        blocker.execute("BEGIN IMMEDIATE")
        try:
            outcome, elapsed = await timed(lambda: manager.acquire(resource, timeout=0.5))
        finally:
            blocker.execute("COMMIT")
        assert isinstance(outcome, BackendError | AcquireTimeout), outcome
        assert elapsed < 0.5 + SLACK
        lease = await manager.acquire(resource, timeout=5)
        await lease.release()
    finally:
        blocker.close()
        await manager.close()


async def test_postgres_timeout_holds_when_the_server_stops(
    pg: PostgresServer, managers: list[Any], resource: str
) -> None:
    """A waiter whose database freezes 0.2 s into the wait returns by its timeout."""
    table = f"leases_{secrets.token_hex(4)}"
    manager = AsyncSQLLockManager(pg.url, table=table, create_table=True, ttl=30)
    managers.append(manager)
    holder = await manager.acquire(resource)
    timer = later(0.2, pg.pause)
    try:
        outcome, elapsed = await timed(lambda: manager.acquire(resource, timeout=1.0))
    finally:
        timer.join()
        pg.resume()
    assert isinstance(outcome, AcquireTimeout | BackendError), outcome
    assert elapsed < 1.0 + SLACK
    info = await manager.inspect(resource)
    assert info is not None
    assert info.token == holder.token
    await holder.release()


async def test_postgres_statement_is_cut_at_the_deadline(
    pg: PostgresServer, managers: list[Any], resource: str
) -> None:
    """The database freezes with the statement in flight: the connection is cut at the
    caller's deadline (psycopg would wait for ever), and the manager works again after."""
    table = f"leases_{secrets.token_hex(4)}"
    manager = AsyncSQLLockManager(pg.url, table=table, create_table=True, ttl=30)
    managers.append(manager)
    assert await manager.inspect(resource) is None  # a pooled connection to use
    pg.pause()
    try:
        outcome, elapsed = await timed(lambda: manager.acquire(resource, timeout=0.5))
    finally:
        pg.resume()
    assert isinstance(outcome, BackendError), outcome
    assert elapsed < 0.5 + SLACK
    lease = await manager.acquire(resource, timeout=10)
    await lease.release()


async def test_postgres_failed_acquire_leaves_no_lock(
    pg: PostgresServer, managers: list[Any], resource: str
) -> None:
    """The acquire's statement waits on a row lock held by another transaction and the
    caller's timeout runs out: the clean-up leaves its tombstone and releases once it has
    the row, so when the other transaction ends, the lock is free at once, not after the
    ttl, whichever of the statement and the clean-up gets the row first."""
    table = f"leases_{secrets.token_hex(4)}"
    manager = AsyncSQLLockManager(pg.url, table=table, create_table=True, ttl=60)
    managers.append(manager)
    first = await manager.acquire(resource)
    await first.release()
    with psycopg.connect(pg.conninfo) as blocker:
        blocker.execute(f'SELECT 1 FROM "{table}" WHERE resource = %s FOR UPDATE', (resource,))
        outcome, elapsed = await timed(lambda: manager.acquire(resource, timeout=0.5))
        assert isinstance(outcome, BackendError), outcome
        assert elapsed < 0.5 + SLACK
    # The blocker committed: the stranded attempt and the clean-up ran, in either order.
    for _ in range(100):
        if await manager.inspect(resource) is None:
            break
        await sleep(0.05)
    assert await manager.inspect(resource) is None
    lease = await manager.try_acquire(resource)
    assert lease is not None
    assert lease.token > first.token
    await lease.release()


@pytest.mark.mariadb
async def test_mariadb_failed_acquire_leaves_no_lock(
    mariadb_url: str, managers: list[Any], resource: str
) -> None:
    """The acquire's transaction waits for the lease row, which another transaction holds,
    and the caller's timeout runs out: the socket is cut at the deadline, and the server
    rolls the stranded transaction back (it never sent COMMIT); the clean-up's release
    waits for the row too. When the other transaction ends, the lock is free at once."""
    import pymysql

    table = f"leases_{secrets.token_hex(4)}"
    manager = AsyncSQLLockManager(
        mariadb_url.replace("+pymysql", ""), table=table, create_table=True, ttl=60
    )
    managers.append(manager)
    first = await manager.acquire(resource)
    await first.release()
    url = make_url(mariadb_url)
    blocker = pymysql.connect(
        host=url.host,
        port=url.port,
        user=url.username,
        password=url.password,
        database=url.database,
    )
    try:
        with blocker.cursor() as cursor:
            cursor.execute(f"SELECT 1 FROM `{table}` WHERE resource = %s FOR UPDATE", (resource,))
        outcome, elapsed = await timed(lambda: manager.acquire(resource, timeout=0.5))
        assert isinstance(outcome, BackendError), outcome
        assert elapsed < 0.5 + SLACK
    finally:
        blocker.commit()
        blocker.close()
    for _ in range(100):
        if await manager.inspect(resource) is None:
            break
        await sleep(0.05)
    assert await manager.inspect(resource) is None
    lease = await manager.try_acquire(resource)
    assert lease is not None
    assert lease.token > first.token
    await lease.release()


#: The timeout of an acquire whose statement must reach the frozen backend's socket before
#: it runs out: sending it takes a thread, a pool check-out and a write, which a loaded
#: machine held up for longer than half a second, and once (at load 13 on two cores) for
#: longer than 2 s. Had it run out first, the clean-up would take the pooled connection,
#: the frozen one, and the schedule the test is about would not happen.
ON_THE_WIRE = 5.0


def frozen_manager(pg: PostgresServer, managers: list[Any]) -> tuple[Any, str, str]:
    """A manager of a table of its own whose connections name the table (to find them in
    ``pg_stat_activity``); returns it, the table and that name."""
    table = f"leases_{secrets.token_hex(4)}"
    app = f"fence-{table}"
    manager = AsyncSQLLockManager(
        pg.url,
        table=table,
        create_table=True,
        ttl=60,
        engine_options={"connect_args": {"application_name": app}},
    )
    managers.append(manager)
    return manager, table, app


async def test_postgres_attempt_that_arrives_after_its_clean_up_is_refused(
    pg: PostgresServer, managers: list[Any], resource: str
) -> None:
    """The acquire's statement reaches the database only after the clean-up has run: its
    backend is frozen (``SIGSTOP``) when the statement is sent, as a loaded server or a
    slow network leaves it in a socket buffer. The acquire times out, the clean-up runs to
    its commit on another connection and finds nothing; then the backend runs the late
    statement. The clean-up's tombstone refuses it, so the lock stays free (before the
    tombstone, the late statement took the lock for its whole ttl)."""
    manager, _, app = frozen_manager(pg, managers)
    first = await manager.acquire(resource)
    await first.release()
    (pid,) = [row[0] for row in backends(pg.conninfo, app)]  # the pool's one connection
    os.kill(pid, signal.SIGSTOP)
    try:
        outcome, elapsed = await timed(lambda: manager.acquire(resource, timeout=ON_THE_WIRE))
        assert isinstance(outcome, BackendError), outcome
        assert elapsed < ON_THE_WIRE + SLACK
        await until(
            lambda: any(
                p != pid and state == "idle" and query == "COMMIT"
                for p, state, query, _ in backends(pg.conninfo, app)
            ),
            "the clean-up's commit",
        )
    finally:
        os.kill(pid, signal.SIGCONT)
    # The backend runs the late statement, then finds the client gone and ends.
    await until(lambda: pid not in {row[0] for row in backends(pg.conninfo, app)}, "the attempt")
    assert await manager.inspect(resource) is None
    lease = await manager.try_acquire(resource)
    assert lease is not None
    assert lease.token > first.token
    await lease.release()


def count_clean_ups(manager: Any) -> tuple[list[int], list[int]]:
    """Count the calls of the driver's ``cancel`` (the clean-up of an acquire that gave up,
    and the manager's retries of it) and the clean-up transactions they start."""
    driver = manager.driver
    calls, started = [0], [0]
    cancel, transaction = driver.cancel, driver._cancel

    async def counted_cancel(*args: Any) -> Any:
        calls[0] += 1
        return await cancel(*args)

    async def counted_transaction(*args: Any) -> Any:
        started[0] += 1
        return await transaction(*args)

    driver.cancel, driver._cancel = counted_cancel, counted_transaction
    return calls, started


async def test_postgres_attempt_queued_behind_its_clean_up_is_refused(
    pg: PostgresServer, managers: list[Any], resource: str
) -> None:
    """The clean-up queues for the row ahead of the acquire's statement: another
    transaction holds the row, the statement's backend is frozen until the clean-up waits
    for the row (``pg_stat_activity``), and runs on until it waits behind the clean-up.
    When the row is free the clean-up goes first and the statement after it: the
    tombstone, read in the row the statement locks, refuses it.

    The clean-up outlives the caller's deadline, so the manager retries it in the
    background: a retry waits for the clean-up in flight and starts no second transaction
    (each one held a connection, queued for the row, for as long as the row was held)."""
    manager, table, app = frozen_manager(pg, managers)
    first = await manager.acquire(resource)
    await first.release()
    (pid,) = [row[0] for row in backends(pg.conninfo, app)]
    calls, started = count_clean_ups(manager)

    def waiting() -> set[int]:
        return {p for p, _, _, event in backends(pg.conninfo, app) if event == "Lock"}

    with psycopg.connect(pg.conninfo) as blocker:
        blocker.execute(f'SELECT 1 FROM "{table}" WHERE resource = %s FOR UPDATE', (resource,))
        os.kill(pid, signal.SIGSTOP)
        try:
            outcome, _ = await timed(lambda: manager.acquire(resource, timeout=ON_THE_WIRE))
            assert isinstance(outcome, BackendError), outcome
            await until(lambda: calls[0] >= 2, "the manager to retry the clean-up")
            assert started[0] == 1  # the retry joined the clean-up in flight
            await until(lambda: len(waiting() - {pid}) == 1, "the clean-up to wait for the row")
        finally:
            os.kill(pid, signal.SIGCONT)
        await until(lambda: pid in waiting(), "the attempt to wait behind the clean-up")
    await until(lambda: pid not in {row[0] for row in backends(pg.conninfo, app)}, "the attempt")
    assert await manager.inspect(resource) is None
    lease = await manager.try_acquire(resource)
    assert lease is not None
    await lease.release()
    assert started[0] == 1


async def test_postgres_missing_database_is_not_called_unreachable(
    pg: PostgresServer, resource: str
) -> None:
    url = pg.url.rsplit("/", 1)[0] + "/no_such_database"
    manager = AsyncSQLLockManager(url)
    try:
        outcome, _ = await timed(lambda: manager.acquire(resource, timeout=0))
    finally:
        await manager.close()
    assert isinstance(outcome, BackendError), outcome
    assert outcome.code == "DATABASE"
    assert not outcome.retryable
    assert "does not exist" in str(outcome)
    assert "unreachable" not in str(outcome)
    assert f"127.0.0.1:{pg.port}" in str(outcome)


# -- close() with a clean-up in flight -------------------------------------------------------


def open_connections(manager: Any) -> Callable[[], int]:
    """How many connections the manager's engine has opened and not closed yet."""
    opened = [0]
    pool = manager.engine.sync_engine.pool  # unasync: pool = manager.engine.pool

    def connect(*_: Any) -> None:
        opened[0] += 1

    def close(*_: Any) -> None:
        opened[0] -= 1

    sa_event.listen(pool, "connect", connect)
    sa_event.listen(pool, "close", close)
    sa_event.listen(pool, "close_detached", close)
    return lambda: opened[0]


@pytest.mark.parametrize("waits", [True, False], ids=["close-waits", "clean-up-disposes"])
@pytest.mark.parametrize("database", ["sqlite", "postgresql"])
async def test_close_leaves_no_connection_to_the_collector(
    database: str,
    waits: bool,
    request: pytest.FixtureRequest,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    resource: str,
) -> None:
    """An acquire gives up while another connection holds what its clean-up needs (SQLite's
    write lock, the PostgreSQL row's lock), and the manager is closed with the clean-up in
    flight. A connection the clean-up hands back to a pool the engine's disposal has closed
    stays open until the garbage collector closes it (Python 3.13 reports that, in whatever
    runs then): ``close()`` waits for the clean-up, or, once it has waited its bound
    (``clean-up-disposes``: no wait at all), the clean-up disposes of the engine when it
    ends. Either way every connection is closed, and a collection finds none."""
    if not waits:
        monkeypatch.setattr(sql_module, "CLOSE_WAIT", 0.0, raising=False)
    if database == "sqlite":
        path = tmp_path / "locks.db"
        manager = AsyncSQLLockManager(f"sqlite:///{path}", create_table=True, ttl=60)
        blocker: Any = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        block: Callable[[], Any] = lambda: blocker.execute("BEGIN IMMEDIATE")  # noqa: E731
        unblock: Callable[[], Any] = lambda: blocker.execute("COMMIT")  # noqa: E731
    else:
        pg: PostgresServer = request.getfixturevalue("pg")
        table = f"leases_{secrets.token_hex(4)}"
        manager = AsyncSQLLockManager(pg.url, table=table, create_table=True, ttl=60)
        blocker = psycopg.connect(pg.conninfo)
        query = f'SELECT 1 FROM "{table}" WHERE resource = %s FOR UPDATE'
        block = lambda: blocker.execute(query, (resource,))  # noqa: E731
        unblock = blocker.commit
    opened = open_connections(manager)
    try:
        first = await manager.acquire(resource)
        await first.release()
        block()
        outcome, _ = await timed(lambda: manager.acquire(resource, timeout=0.5))
        assert isinstance(outcome, BackendError | AcquireTimeout), outcome
        timer = later(0.3, unblock)
        try:
            await manager.close()
        finally:
            timer.join()
    finally:
        await manager.close()
        blocker.close()
    if waits:
        assert opened() == 0
    else:
        await until(lambda: opened() == 0, "the clean-up to end and dispose of the engine", 10)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        gc.collect()
