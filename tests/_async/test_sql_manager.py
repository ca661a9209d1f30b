"""The SQL lock manager beyond the conformance suite: real PostgreSQL restarts and outages,
token regression defence (C3), the table layout, and SQLite configuration errors.

The fault tests start their own PostgreSQL cluster, so restarting it disturbs no other test.
"""

from __future__ import annotations

import asyncio  # unasync: remove
import secrets
import sqlite3
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from sqlalchemy import MetaData, create_engine
from sqlalchemy.engine import make_url
from sqlalchemy.pool import NullPool

from fence import (
    AcquireTimeout,
    BackendError,
    ConfigurationError,
    EventBus,
    EventKind,
    LeaseLostError,
    LeaseMode,
    NotOwnerError,
    TokenMode,
)
from fence._async.sql import AsyncSQLDriver, AsyncSQLLockManager
from fence._sql_schema import (
    lease_schema_ddl,
    lease_table,
    lease_upgrade_ddl,
    notify_channel,
    shared_table_ddl,
)
from fence.adapters._sql_common import REGISTER_TABLE_DDL
from fence.testing import EventRecorder
from tests._acompat import join, sleep, spawn
from tests.servers import PostgresServer


@pytest.fixture(scope="module")
def own_pg() -> Iterator[PostgresServer]:
    """A cluster of this module's own, free to restart. Its sessions commit durably (the
    rig starts clusters with ``synchronous_commit=off``; a test that wants lost commits sets
    it back on its own connections)."""
    server = PostgresServer().start()
    with psycopg.connect(server.conninfo, autocommit=True) as conn:
        # A per-database setting wins over the server's command line.
        conn.execute("ALTER DATABASE postgres SET synchronous_commit = on")
    yield server
    server.destroy()


@pytest.fixture
def table() -> str:
    return f"leases_{secrets.token_hex(4)}"


@pytest.fixture
def resource() -> str:
    return f"res:{secrets.token_hex(4)}"


def pg_execute(server: PostgresServer, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(server.conninfo, autocommit=True) as conn:
        cur = conn.execute(sql, params or None)
        return cur.fetchall() if cur.description else []


@pytest.fixture
async def managers() -> AsyncIterator[list[AsyncSQLLockManager]]:
    """Managers to close after the test, even if it fails."""
    built: list[AsyncSQLLockManager] = []
    yield built
    for manager in built:
        await manager.close()


async def make_pg(
    built: list[AsyncSQLLockManager], server: PostgresServer, table: str, **options: Any
) -> AsyncSQLLockManager:
    manager = AsyncSQLLockManager(server.url, table=table, **options)
    built.append(manager)
    await manager.create_table()
    # The table itself must survive the crash tests: write it out now.
    pg_execute(server, "CHECKPOINT")
    return manager


async def blocking(fn: Callable[..., Any], *args: Any) -> Any:
    """Run a blocking server operation without stalling the event loop."""
    return await asyncio.to_thread(fn, *args)  # unasync: return fn(*args)


async def restart(server: PostgresServer, mode: str) -> None:
    await blocking(server.restart, mode)


async def stop(server: PostgresServer) -> None:
    await blocking(server.stop, "fast")


async def start(server: PostgresServer) -> None:
    await blocking(server.start)


async def wait_for(predicate: Any, timeout: float = 10.0) -> bool:
    """Poll ``predicate`` every 50 ms until it holds or ``timeout`` passes."""
    for _ in range(int(timeout / 0.05)):
        if predicate():
            return True
        await sleep(0.05)
    return bool(predicate())


# -- PostgreSQL faults ---------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.postgres
async def test_immediate_restart_holder_carries_on_and_tokens_increase(
    own_pg: PostgresServer, managers: list[Any], table: str, resource: str
) -> None:
    """A crash-restart (pg_ctl -m immediate) while a lease is held, with durable commits:
    the watchdog rides out the outage on retryable errors, the holder keeps its lease and
    token, and the next holder's token is larger."""
    bus = EventBus()
    manager = await make_pg(managers, own_pg, table, renew=True, events=bus)
    with EventRecorder(bus) as recorder:
        lease = await manager.acquire(resource, ttl=6)
        await restart(own_pg, "immediate")
        renewed_after = len(recorder.of(EventKind.RENEWED))
        assert await wait_for(lambda: len(recorder.of(EventKind.RENEWED)) > renewed_after)
    assert not lease.lost
    assert lease.valid
    info = await manager.inspect(resource)
    assert info is not None
    assert info.token == lease.token
    for event in recorder.of(EventKind.RENEW_FAILED):
        assert "unreachable" in event.detail["error"]
    await lease.release()
    again = await manager.acquire(resource, ttl=6)
    assert again.token > lease.token
    await again.release()


@pytest.mark.slow
@pytest.mark.postgres
async def test_immediate_restart_losing_commits_keeps_tokens_increasing(
    own_pg: PostgresServer, managers: list[Any], table: str, resource: str
) -> None:
    """C3 for real: with ``synchronous_commit=off`` a crash may lose the latest commits,
    the lease row included. The holder then hears that its lease is lost (or carries on if
    the row survived), and hybrid tokens still increase after the restart."""
    bus = EventBus()
    lossy = {"connect_args": {"options": "-c synchronous_commit=off"}}
    manager = await make_pg(managers, own_pg, table, renew=True, events=bus, engine_options=lossy)
    tokens = []
    for _ in range(3):
        lease = await manager.acquire(resource, ttl=6)
        tokens.append(lease.token)
        await lease.release()
    with EventRecorder(bus) as recorder:
        held = await manager.acquire(resource, ttl=6)
        await restart(own_pg, "immediate")
        renewed_after = len(recorder.of(EventKind.RENEWED))
        assert await wait_for(
            lambda: held.lost or len(recorder.of(EventKind.RENEWED)) > renewed_after
        )
    if held.lost:
        assert len(recorder.of(EventKind.LOST)) == 1
        with pytest.raises(LeaseLostError):
            held.check()
        with pytest.raises(NotOwnerError):
            await held.release()
    else:
        info = await manager.inspect(resource)
        assert info is not None
        assert info.token == held.token
        await held.release()
    newer = await manager.acquire(resource, ttl=6, timeout=10)
    assert newer.token > max([*tokens, held.token])
    await newer.release()


def restore_backup(server: PostgresServer, backup: Path) -> None:
    """Crash the server and put an older copy of its data directory in place."""
    server.stop("immediate")
    subprocess.run(["rm", "-rf", str(server.data)], check=True)
    subprocess.run(["cp", "-a", str(backup), str(server.data)], check=True)
    server.start()


@pytest.mark.slow
@pytest.mark.postgres
async def test_restored_backup_hybrid_tokens_stay_above_counter_tokens_repeat(
    own_pg: PostgresServer, managers: list[Any], table: str, tmp_path: Path
) -> None:
    """C3 with a real restore: the cluster goes back to a file-level backup taken before the
    last acquisitions. Hybrid tokens issued afterwards still exceed every token issued
    before; counter tokens start again below them (documented: a counter survives only
    what the table survives)."""
    hybrid = await make_pg(managers, own_pg, table)
    counter = AsyncSQLLockManager(own_pg.url, table=table, token_mode=TokenMode.COUNTER)
    managers.append(counter)
    for manager in (hybrid, counter):
        lease = await manager.acquire(f"{table}:{manager.sql_driver.token_mode}")
        await lease.release()
    backup = tmp_path / "backup"
    await stop(own_pg)
    subprocess.run(["cp", "-a", str(own_pg.data), str(backup)], check=True)
    await start(own_pg)

    issued: dict[TokenMode, list[int]] = {TokenMode.HYBRID: [], TokenMode.COUNTER: []}
    for _ in range(3):
        for manager in (hybrid, counter):
            mode = manager.sql_driver.token_mode
            lease = await manager.acquire(f"{table}:{mode}")
            issued[mode].append(lease.token)
            await lease.release()
    await blocking(restore_backup, own_pg, backup)

    after_hybrid = await hybrid.acquire(f"{table}:{TokenMode.HYBRID}")
    after_counter = await counter.acquire(f"{table}:{TokenMode.COUNTER}")
    assert after_hybrid.token > max(issued[TokenMode.HYBRID])
    assert after_counter.token <= max(issued[TokenMode.COUNTER])
    await after_hybrid.release()
    await after_counter.release()


@pytest.mark.slow
@pytest.mark.postgres
async def test_outage_gives_retryable_connection_errors_then_recovers(
    own_pg: PostgresServer, managers: list[Any], table: str, resource: str
) -> None:
    """While the server is down every call raises BackendError(CONNECTION, retryable) with
    the driver's error chained; once it is back the same manager works again, although its
    pooled connections all died."""
    manager = await make_pg(managers, own_pg, table)
    before = await manager.acquire(resource, ttl=5)
    await before.release()
    await stop(own_pg)
    try:
        for call in (manager.inspect, manager.try_acquire, manager.revoke):
            with pytest.raises(BackendError) as info:
                await call(resource)
            assert info.value.code == "CONNECTION"
            assert info.value.retryable
            assert info.value.__cause__ is not None
    finally:
        await start(own_pg)
    assert await manager.inspect(resource) is None
    after = await manager.acquire(resource, ttl=5)
    assert after.token > before.token
    await after.release()


@pytest.mark.slow
@pytest.mark.postgres
async def test_watchdog_retries_through_a_short_outage(
    own_pg: PostgresServer, managers: list[Any], table: str, resource: str
) -> None:
    """A renewal that meets a stopped server is retried while the lease has time left; the
    lease is not reported lost and the backend still holds it afterwards."""
    bus = EventBus()
    manager = await make_pg(managers, own_pg, table, renew=True, events=bus)
    with EventRecorder(bus) as recorder:
        lease = await manager.acquire(resource, ttl=6)
        await stop(own_pg)
        try:
            assert await wait_for(lambda: bool(recorder.of(EventKind.RENEW_FAILED)))
        finally:
            await start(own_pg)
        renewed_after = len(recorder.of(EventKind.RENEWED))
        assert await wait_for(lambda: len(recorder.of(EventKind.RENEWED)) > renewed_after)
    failure = recorder.of(EventKind.RENEW_FAILED)[0]
    assert "unreachable" in failure.detail["error"]
    assert not lease.lost
    info = await manager.inspect(resource)
    assert info is not None
    assert info.token == lease.token
    await lease.release()


@pytest.mark.slow
@pytest.mark.postgres
async def test_waiters_are_notified_after_the_listener_reconnects(
    own_pg: PostgresServer, managers: list[Any], table: str, resource: str
) -> None:
    """The LISTEN connection dies with the server and comes back by itself: a release after
    the restart still wakes a waiter that no poll would wake in time (poll interval 60 s,
    holder ttl 60 s, waiter timeout 4 s)."""
    manager = await make_pg(managers, own_pg, table, poll_interval=60)

    async def handoff() -> int:
        holder = await manager.acquire(resource, ttl=60)

        async def waiter() -> int:
            lease = await manager.acquire(resource, timeout=4)
            token = lease.token
            await lease.release()
            return int(token)

        task = await spawn(waiter)
        await sleep(0.3)
        await holder.release()
        token = await join(task)
        assert token > holder.token
        return token

    first = await handoff()
    await restart(own_pg, "immediate")
    second = await handoff()
    assert second > first


async def test_holder_ttl_and_no_session_state(
    postgres_server: PostgresServer, managers: list[Any], table: str, resource: str
) -> None:
    """Every call is one autocommit statement: the manager works with a fresh connection per
    call (as behind a transaction-pooling proxy), and a refused attempt reports the holder's
    remaining time so the waiter wakes when the lease ends."""
    manager = await make_pg(
        managers, postgres_server, table, engine_options={"poolclass": NullPool}
    )
    lease = await manager.acquire(resource, ttl=5)
    reply = await manager.driver.acquire(resource, "someone-else", 5.0, "test")
    assert reply.token is None
    assert reply.holder_ttl is not None
    assert 0 < reply.holder_ttl <= 5

    async def waiter() -> int:
        got = await manager.acquire(resource, timeout=10)
        token = got.token
        await got.release()
        return int(token)

    # Nothing lives in a session: no advisory lock is held while the lease is.
    advisory = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
    assert pg_execute(postgres_server, advisory) == [(0,)]
    task = await spawn(waiter)
    await sleep(0.2)
    await lease.release()
    assert await join(task) > lease.token


async def test_hybrid_tokens_come_from_the_database_clock(
    postgres_server: PostgresServer, managers: list[Any], table: str, resource: str
) -> None:
    """C3: a hybrid token is at least the server's clock in microseconds at the acquire."""
    manager = await make_pg(managers, postgres_server, table)
    clock_sql = "SELECT CAST(floor(extract(epoch FROM clock_timestamp()) * 1e6) AS BIGINT)"
    before = pg_execute(postgres_server, clock_sql)[0][0]
    lease = await manager.acquire(resource)
    after = pg_execute(postgres_server, clock_sql)[0][0]
    assert before <= lease.token <= after
    await lease.release()


async def test_release_notifies_on_the_table_channel(
    postgres_server: PostgresServer, managers: list[Any], table: str, resource: str
) -> None:
    """A release announces the resource on the table's channel, for waiters anywhere;
    with ``notify=False`` it announces nothing (the first notification seen is the other
    manager's, sent after it)."""
    manager = await make_pg(managers, postgres_server, table)
    quiet = AsyncSQLLockManager(postgres_server.url, table=table, notify=False, listen=False)
    managers.append(quiet)
    silent = await quiet.acquire(f"{resource}:quiet")
    lease = await manager.acquire(resource)
    with psycopg.connect(postgres_server.conninfo, autocommit=True) as listener:
        channel = notify_channel(table)
        listener.execute(f'LISTEN "{channel}"')
        await silent.release()
        await lease.release()
        notes = list(listener.notifies(timeout=5, stop_after=1))
    assert [(n.channel, n.payload) for n in notes] == [(channel, resource)]


# -- both databases --------------------------------------------------------------------------


def my_execute(url: str, sql: str, *params: Any) -> list[tuple[Any, ...]]:
    """Run ``sql`` on the MariaDB database of ``url`` (PyMySQL, autocommit)."""
    import pymysql

    parsed = make_url(url)
    conn = pymysql.connect(
        host=parsed.host,
        port=parsed.port,
        user=parsed.username,
        password=parsed.password,
        database=parsed.database,
        autocommit=True,
    )
    try:
        with conn.cursor() as cursor:
            cursor.execute(sql, params or None)
            return list(cursor.fetchall()) if cursor.description else []
    finally:
        conn.close()


@pytest.fixture(params=["sqlite", "postgres", pytest.param("mariadb", marks=pytest.mark.mariadb)])
def database(request: pytest.FixtureRequest, tmp_path: Path, table: str) -> Iterator[Any]:
    """(url, run_sql) for a fresh lease table on SQLite (a file), PostgreSQL or MariaDB
    (a URL without a driver: the manager picks PyMySQL or aiomysql)."""
    if request.param == "mariadb":
        url: str = request.getfixturevalue("mariadb_url")

        def run_my(sql: str, *params: Any) -> list[tuple[Any, ...]]:
            return my_execute(url, sql, *params)

        for statement in lease_schema_ddl("mariadb", table=table):
            run_my(statement)
        yield url.replace("+pymysql", ""), run_my
    elif request.param == "sqlite":
        path = tmp_path / "locks.db"

        def run_sqlite(sql: str, *params: Any) -> list[tuple[Any, ...]]:
            conn = sqlite3.connect(path)
            try:
                with conn:
                    return conn.execute(sql.replace("%s", "?"), params).fetchall()
            finally:
                conn.close()

        for statement in lease_schema_ddl("sqlite", table=table):
            run_sqlite(statement)
        yield f"sqlite:///{path}", run_sqlite
    else:
        server: PostgresServer = request.getfixturevalue("postgres_server")
        for statement in lease_schema_ddl("postgresql", table=table):
            pg_execute(server, statement)

        def run_pg(sql: str, *params: Any) -> list[tuple[Any, ...]]:
            return pg_execute(server, sql, *params)

        yield server.url, run_pg
        pg_execute(server, f'DROP TABLE IF EXISTS "{table}", "{table}_shared"')


async def test_restored_table_hybrid_survives_counter_does_not(
    database: Any, managers: list[Any], table: str, resource: str
) -> None:
    """C3: when the table goes back in time (a restored backup), hybrid tokens still exceed
    every token issued before; counter tokens repeat, as documented."""
    url, run = database
    hybrid = AsyncSQLLockManager(url, table=table)
    counter = AsyncSQLLockManager(url, table=table, token_mode=TokenMode.COUNTER)
    managers.extend([hybrid, counter])
    lease = await hybrid.acquire(resource)
    await lease.release()
    restore = f"UPDATE {table} SET token = 1"
    run(restore)  # the backup from long ago
    newer = await hybrid.acquire(resource)
    assert newer.token > lease.token
    await newer.release()

    first = await counter.acquire(resource)
    await first.release()
    run(restore)
    again = await counter.acquire(resource)
    assert again.token == 2 <= first.token
    await again.release()


async def test_row_keeps_the_last_token_after_release_and_revoke(
    database: Any, managers: list[Any], table: str, resource: str
) -> None:
    """C2 in the table: a release or a revoke leaves the row with the last token and no
    owner, so the next token is computed from it."""
    url, run = database
    manager = AsyncSQLLockManager(url, table=table)
    managers.append(manager)
    lease = await manager.acquire(resource)
    await lease.release()
    assert await manager.inspect(resource) is None
    select = f"SELECT token, owner, holder FROM {table} WHERE resource = %s"
    assert run(select, resource) == [(lease.token, None, None)]
    revoked = await manager.revoke(resource)
    assert run(select, resource) == [(revoked, None, None)]
    assert revoked > lease.token
    newer = await manager.acquire(resource)
    assert newer.token > revoked
    await newer.release()


async def test_fence_register_is_a_floor_and_revoke_raises_it(
    database: Any, managers: list[Any], table: str, resource: str
) -> None:
    """With ``fence_table``, no token goes at or below the guards' register row for the
    resource, even when the lease row (the counter) is lost; revoke raises the row to its
    token, never lowering it. Counter mode, where a lost counter would start over at 1."""
    url, run = database
    register = f"{table}_register"
    run(REGISTER_TABLE_DDL.format(table=register))
    manager = AsyncSQLLockManager(
        url, table=table, token_mode=TokenMode.COUNTER, fence_table=register
    )
    managers.append(manager)
    first = await manager.acquire(resource)
    await first.release()
    assert first.token == 1
    run(f"INSERT INTO {register} (scope, fence) VALUES (%s, 50)", resource)
    lease = await manager.acquire(resource)
    assert lease.token == 51
    await lease.release()
    revoked = await manager.revoke(resource)
    assert revoked == 52
    assert run(f"SELECT fence FROM {register} WHERE scope = %s", resource) == [(52,)]
    run(f"DELETE FROM {table} WHERE resource = %s", resource)  # the counter is lost
    again = await manager.acquire(resource)
    assert again.token == 53
    await again.release()
    run(f"UPDATE {register} SET fence = 100 WHERE scope = %s", resource)
    assert await manager.revoke(resource) == 101
    run(f"UPDATE {register} SET fence = 500 WHERE scope = %s", resource)
    run(f"DELETE FROM {table} WHERE resource = %s", resource)
    assert await manager.revoke(resource) == 501
    assert run(f"SELECT fence FROM {register} WHERE scope = %s", resource) == [(501,)]


async def test_missing_table_is_a_schema_error(
    database: Any, managers: list[Any], resource: str
) -> None:
    url, _run = database
    manager = AsyncSQLLockManager(url, table="no_such_lease_table")
    managers.append(manager)
    with pytest.raises(BackendError) as info:
        await manager.acquire(resource)
    assert info.value.code == "SCHEMA"
    assert not info.value.retryable
    assert "create_table()" in str(info.value)


async def test_create_table_is_idempotent_and_schema_aware(
    database: Any, managers: list[Any], resource: str
) -> None:
    url, run = database
    name = f"made_{secrets.token_hex(3)}"
    manager = AsyncSQLLockManager(url, table=name)
    managers.append(manager)
    await manager.create_table()
    await manager.create_table()
    lease = await manager.acquire(resource)
    assert lease.token >= 1
    await lease.release()
    if url.startswith("postgresql"):
        run(f'DROP TABLE "{name}", "{name}_shared"')


async def test_table_from_metadata_is_the_same_table(
    database: Any, managers: list[Any], resource: str
) -> None:
    """``lease_table()`` (for ``create_all`` or Alembic autogenerate) builds a table the
    manager uses as it uses the one from the plain DDL."""
    url, run = database
    name = f"meta_{secrets.token_hex(3)}"
    engine = create_engine(url.replace("mariadb://", "mariadb+pymysql://"))
    metadata = MetaData()
    try:
        table = lease_table(metadata, name=name)
        assert table.name == name
        assert set(metadata.tables) == {name, f"{name}_shared"}
        metadata.create_all(engine)
    finally:
        engine.dispose()
    manager = AsyncSQLLockManager(url, table=name)
    managers.append(manager)
    lease = await manager.acquire(resource, ttl=5)
    info = await manager.inspect(resource)
    assert info is not None
    assert info.token == lease.token
    assert 0 < info.remaining <= 5
    await lease.release()
    reader = await manager.acquire(resource, mode="read", ttl=5)
    info = await manager.inspect(resource)
    assert info is not None
    assert [r.token for r in info.readers] == [reader.token]
    # A queued writer ('W') and reader ('R') are no readers ('r'), whatever the collation.
    blocked = await manager.driver.acquire(resource, "w", 5.0, "writer")
    assert blocked.queued
    queued = await manager.driver.acquire(resource, "r2", 5.0, "reader", LeaseMode.READ)
    assert queued.queued
    info = await manager.inspect(resource)
    assert info is not None
    assert [r.token for r in info.readers] == [reader.token]
    await manager.driver.abandon(resource, "w")
    await manager.driver.abandon(resource, "r2")
    await reader.release()
    if url.startswith("postgresql"):
        run(f'DROP TABLE "{name}", "{name}_shared"')


# The lease table as versions before shared locks created it.
_EARLIER_DDL = {
    "sqlite": """CREATE TABLE {name} (resource TEXT PRIMARY KEY,
        token BIGINT NOT NULL CHECK (token BETWEEN 1 AND 9007199254740991),
        owner TEXT, holder TEXT, expires_at REAL NOT NULL)""",
    "postgresql": """CREATE TABLE {name} (resource TEXT PRIMARY KEY,
        token BIGINT NOT NULL CHECK (token BETWEEN 1 AND 9007199254740991),
        owner TEXT, holder TEXT, expires_at TIMESTAMPTZ NOT NULL)""",
    # No version made it on MariaDB: the same columns, as MariaDB's lease table has them.
    "mariadb": """CREATE TABLE {name} (resource VARCHAR(255) PRIMARY KEY,
        token BIGINT NOT NULL CHECK (token BETWEEN 1 AND 9007199254740991),
        owner TEXT, holder TEXT, expires_at DOUBLE NOT NULL)
        DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin""",
}


async def test_upgrade_ddl_migrates_an_earlier_lease_table(
    database: Any, managers: list[Any], resource: str
) -> None:
    """A lease table from before shared locks, with a lease row in it, migrated by
    ``lease_upgrade_ddl()``: the manager keeps its token sequence and has shared locks."""
    url, run = database
    dialect = url.split(":", 1)[0].split("+")[0]
    name = f"old_{secrets.token_hex(3)}"
    run(_EARLIER_DDL[dialect].format(name=name))
    run(
        f"INSERT INTO {name} (resource, token, owner, holder, expires_at) "
        f"VALUES (%s, 41, NULL, NULL, {'now()' if dialect == 'postgresql' else '0'})",
        resource,
    )
    manager = AsyncSQLLockManager(url, table=name)
    managers.append(manager)
    with pytest.raises(BackendError, match="lease_upgrade_ddl"):
        await manager.acquire(resource)
    for statement in lease_upgrade_ddl(dialect, table=name):
        run(statement)
    writer = await manager.acquire(resource)
    assert writer.token > 41
    await writer.release()
    reader = await manager.acquire(resource, mode="read")
    assert reader.token > writer.token
    await reader.release()
    if dialect == "postgresql":
        # The failed acquire's clean-up may still be retrying in the background, and with
        # asyncio the blocking DROP below would stop it inside its transaction, whose locks
        # the DROP waits for: closed first, it is done.
        await manager.close()
        run(f'DROP TABLE "{name}", "{name}_shared"')


# The PostgreSQL lease table as versions with shared locks but before tombstones made it.
_BEFORE_TOMBSTONES_DDL = """CREATE TABLE {name} (resource TEXT PRIMARY KEY,
    token BIGINT NOT NULL CHECK (token BETWEEN 1 AND 9007199254740991),
    owner TEXT, holder TEXT, expires_at TIMESTAMPTZ NOT NULL,
    readers INTEGER NOT NULL DEFAULT 0, read_until TIMESTAMPTZ,
    wtoken BIGINT NOT NULL DEFAULT 0)"""


async def test_upgrade_ddl_adds_the_tombstones_on_postgresql(
    postgres_server: PostgresServer, managers: list[Any], resource: str
) -> None:
    """A PostgreSQL lease table from before tombstones: the manager names the migration,
    ``lease_upgrade_ddl()`` adds only the missing column (the others are there), and the
    clean-up's tombstone then refuses a late attempt of its secret."""
    name = f"prev_{secrets.token_hex(3)}"
    pg_execute(postgres_server, _BEFORE_TOMBSTONES_DDL.format(name=name))
    pg_execute(postgres_server, shared_table_ddl("postgresql", table=name))
    pg_execute(
        postgres_server,
        f"INSERT INTO {name} (resource, token, expires_at) VALUES (%s, 41, now())",
        resource,
    )
    manager = AsyncSQLLockManager(postgres_server.url, table=name)
    managers.append(manager)
    with pytest.raises(BackendError, match="lease_upgrade_ddl"):
        await manager.acquire(resource)
    for statement in lease_upgrade_ddl("postgresql", table=name):
        pg_execute(postgres_server, statement)
    lease = await manager.acquire(resource)
    assert lease.token > 41
    await lease.release()
    driver = manager.sql_driver
    assert await driver.cancel(resource, "gone", 5.0) is False
    late = await driver.acquire(resource, "gone", 5.0, "late")
    assert late.token is None
    assert not late.queued
    assert await manager.inspect(resource) is None
    await manager.close()  # its clean-ups done before the blocking DROP (see above)
    pg_execute(postgres_server, f'DROP TABLE "{name}", "{name}_shared"')


# -- SQLite configuration ---------------------------------------------------------------------


async def test_sqlite_memory_url_gets_a_single_connection(resource: str) -> None:
    """``sqlite://`` is one in-memory database for every caller of the manager."""
    manager = AsyncSQLLockManager("sqlite://", create_table=True)
    try:
        lease = await manager.acquire(resource)

        async def attempt() -> Any:
            return await manager.try_acquire(resource)

        assert await join(await spawn(attempt)) is None
        await lease.release()
    finally:
        await manager.close()


def test_sqlite_memory_engine_without_static_pool_is_refused() -> None:
    engine = create_engine("sqlite://")
    try:
        with pytest.raises(ConfigurationError, match="StaticPool"):
            AsyncSQLDriver(engine)  # unasync: SQLDriver(engine)
    finally:
        engine.dispose()


def test_unsupported_options_are_refused() -> None:
    with pytest.raises(ConfigurationError):
        AsyncSQLLockManager("sqlite://", listen="host=elsewhere")
    with pytest.raises(ConfigurationError):
        AsyncSQLLockManager("sqlite://", poll_interval=0)


async def test_sqlite_waiter_in_another_process_polls(
    tmp_path: Path, managers: list[Any], resource: str
) -> None:
    """A release made through another SQLite file handle that this process cannot see
    (here: plain sqlite3) is found by the jittered poll, not missed."""
    path = tmp_path / "locks.db"
    manager = AsyncSQLLockManager(f"sqlite:///{path}", poll_interval=0.1, create_table=True)
    managers.append(manager)
    holder = await manager.acquire(resource, ttl=30)
    task = await spawn(lambda: manager.acquire(resource, timeout=10))
    await sleep(0.2)
    conn = sqlite3.connect(path)
    try:
        with conn:
            conn.execute("UPDATE fence_leases SET owner = NULL WHERE resource = ?", (resource,))
    finally:
        conn.close()
    got = await join(task)
    assert got.token > holder.token
    await got.release()


async def test_sqlite_acquire_timeout_while_held(
    tmp_path: Path, managers: list[Any], resource: str
) -> None:
    manager = AsyncSQLLockManager(f"sqlite:///{tmp_path / 'l.db'}", create_table=True)
    managers.append(manager)
    holder = await manager.acquire(resource, ttl=30)

    async def attempt() -> Any:
        return await manager.acquire(resource, timeout=0.3)

    with pytest.raises(AcquireTimeout):
        await join(await spawn(attempt))
    await holder.release()


# -- MariaDB ----------------------------------------------------------------------------------


@pytest.fixture
def mariadb(mariadb_url: str, table: str) -> str:
    """A URL without a driver (the manager picks PyMySQL or aiomysql) of a database with a
    fresh lease table."""
    for statement in lease_schema_ddl("mariadb", table=table):
        my_execute(mariadb_url, statement)
    return mariadb_url.replace("+pymysql", "")


_MY_CLOCK_US = "SELECT TIMESTAMPDIFF(MICROSECOND, '1970-01-01', UTC_TIMESTAMP(6))"


@pytest.mark.mariadb
async def test_mariadb_hybrid_tokens_come_from_the_server_clock(
    mariadb: str, managers: list[Any], table: str, resource: str
) -> None:
    """C3: a hybrid token is the server's UTC clock in microseconds at the acquire, whatever
    the session's time zone; expiry too: a manager in another time zone sees the lease's
    remaining time as its holder set it."""
    manager = AsyncSQLLockManager(mariadb, table=table)
    shifted = AsyncSQLLockManager(
        mariadb,
        table=table,
        engine_options={"connect_args": {"init_command": "SET time_zone = '+05:00'"}},
    )
    managers.extend([manager, shifted])
    before = my_execute(mariadb, _MY_CLOCK_US)[0][0]
    lease = await shifted.acquire(resource, ttl=5)
    after = my_execute(mariadb, _MY_CLOCK_US)[0][0]
    assert before <= lease.token <= after
    info = await manager.inspect(resource)
    assert info is not None
    assert 4 < info.remaining <= 5
    await lease.release()


@pytest.mark.mariadb
async def test_mariadb_connections_count_rows_found(mariadb: str, managers: list[Any]) -> None:
    """The manager's engine connects with CLIENT_FOUND_ROWS (SQLAlchemy's MySQL dialects
    ask for it), so that a renewal or a release reports by the rows it found."""
    from pymysql.constants import CLIENT

    manager = AsyncSQLLockManager(mariadb)
    managers.append(manager)
    engine = manager.engine.sync_engine  # unasync: engine = manager.engine
    _args, kwargs = engine.dialect.create_connect_args(engine.url)
    assert kwargs["client_flag"] & CLIENT.FOUND_ROWS


@pytest.mark.mariadb
async def test_mariadb_resources_compare_as_bytes(
    mariadb: str, managers: list[Any], table: str
) -> None:
    """The lease tables' keys have a binary collation: two resources that differ in case
    only are two locks, as on the other databases (MariaDB's default collation would make
    them one)."""
    manager = AsyncSQLLockManager(mariadb, table=table)
    managers.append(manager)
    upper = await manager.acquire("Order:1")
    lower = await manager.try_acquire("order:1")
    assert lower is not None
    reader = await manager.acquire("R", mode="read")
    writer = await manager.try_acquire("r")  # kind 'r' (a reader) is not 'R' (queued)
    assert writer is not None
    for lease in (upper, lower, reader, writer):
        await lease.release()


async def _session_counts(engine: Any) -> dict[str, int]:
    """Statements and ``ROLLBACK`` s the session of the engine's one pooled connection ran."""
    async with engine.connect() as conn:
        result = await conn.exec_driver_sql(
            "SHOW SESSION STATUS WHERE Variable_name IN ('Questions', 'Com_rollback')"
        )
        return {str(name): int(value) for name, value in result.all()}


@pytest.mark.mariadb
async def test_mariadb_acquire_and_release_are_seven_statements(
    mariadb: str, managers: list[Any], table: str, resource: str
) -> None:
    """An uncontended acquire is one transaction of six statements (``START TRANSACTION``,
    the claim, the lease row, the shared rows, the write, ``COMMIT``) and a release one
    statement: no ``ROLLBACK`` ends a checkout whose last reply said no transaction is
    open, and no sweep runs where no shared row was read. A checkout that leaves a
    transaction open is still rolled back."""
    manager = AsyncSQLLockManager(mariadb, table=table, engine_options={"pool_size": 1})
    managers.append(manager)
    await (await manager.acquire(resource)).release()
    before = await _session_counts(manager.engine)
    for _ in range(3):
        lease = await manager.acquire(resource)
        await lease.release()
    after = await _session_counts(manager.engine)
    assert after["Com_rollback"] == before["Com_rollback"]
    assert after["Questions"] - before["Questions"] == 3 * 7 + 1  # and the SHOW
    async with manager.engine.connect() as conn:
        await conn.exec_driver_sql("START TRANSACTION")
        await conn.exec_driver_sql("SELECT 1")
    final = await _session_counts(manager.engine)
    assert final["Com_rollback"] == after["Com_rollback"] + 1
