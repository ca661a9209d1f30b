"""The SQL guards under two real concurrent PostgreSQL transactions.

READ COMMITTED: a fenced write that waits on a concurrent writer's row lock re-evaluates
``fence <= token`` against the committed row, so the verdict is right (STALE or accepted).
REPEATABLE READ and SERIALIZABLE: the same race is a serialization failure (SQLSTATE
40001), which the guards raise as a retryable error, never as STALE (C5).

Transaction B runs in a thread; the test waits until PostgreSQL shows it blocked on a lock
(polling ``pg_locks``, no timing assumption), then lets transaction A commit.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import psycopg
import pytest
from psycopg import sql
from sqlalchemy import ARRAY, Column, Integer, MetaData, Table, create_engine, select

from fence import Reason, RetryableError, StaleTokenError
from fence.adapters.psycopg import REGISTER_TABLE_DDL, FenceRegister, RowGuard, install_triggers
from fence.adapters.sql import RowGuard as CoreRowGuard
from fence.adapters.sql import fence_column
from tests.servers import PostgresServer

pytestmark = pytest.mark.postgres


@pytest.fixture
def conninfo(postgres_server: PostgresServer) -> str:
    """The libpq connection string of the session's cluster."""
    return postgres_server.conninfo


@pytest.fixture
def table(conninfo: str) -> str:
    """A committed table of its own: ``(id PK, v, fence)`` with rows 1 and 2 at fence 30."""
    name = f"iso_{secrets.token_hex(4)}"
    with psycopg.connect(conninfo, autocommit=True) as c:
        c.execute(
            sql.SQL(
                "CREATE TABLE {} (id INT PRIMARY KEY, v INT, fence BIGINT NOT NULL DEFAULT 0)"
            ).format(sql.Identifier(name))
        )
        c.execute(
            sql.SQL("INSERT INTO {} VALUES (1, 0, 30), (2, 0, 30)").format(sql.Identifier(name))
        )
        install_triggers(c, name)  # the database's judge (C14)
    return name


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    """One thread for transaction B."""
    with ThreadPoolExecutor(max_workers=1) as executor:
        yield executor


@pytest.fixture
def connect(conninfo: str) -> Iterator[Callable[..., psycopg.Connection[Any]]]:
    """Open connections that are closed after the test."""
    opened: list[psycopg.Connection[Any]] = []

    def open_(**kwargs: Any) -> psycopg.Connection[Any]:
        conn = psycopg.connect(conninfo, **kwargs)
        opened.append(conn)
        return conn

    yield open_
    for conn in opened:
        conn.close()


def wait_until_blocked(conninfo: str, pid: int, future: Future[Any]) -> None:
    """Return once backend ``pid`` waits for a lock (or B already finished, which fails)."""
    with psycopg.connect(conninfo, autocommit=True) as monitor:
        for _ in range(2000):
            if future.done():
                pytest.fail(f"transaction B did not wait for the lock: {future.result()!r}")
            row = monitor.execute(
                "SELECT count(*) FROM pg_locks WHERE pid = %s AND NOT granted", (pid,)
            ).fetchone()
            if row and row[0]:
                return
            time.sleep(0.005)
    pytest.fail("transaction B never blocked on a lock")


def _row(conninfo: str, table: str, key: int) -> tuple[int, int]:
    with psycopg.connect(conninfo) as c:
        query = sql.SQL("SELECT v, fence FROM {} WHERE id = %s").format(sql.Identifier(table))
        row = c.execute(query, (key,)).fetchone()
        assert row is not None
        return row[0], row[1]


def _outcome(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except Exception as exc:
        return exc


# -- READ COMMITTED -----------------------------------------------------------------------


@pytest.mark.parametrize(("token_b", "accepted"), [(33, False), (34, True), (35, True)])
def test_read_committed_rechecks_the_fence_after_the_lock_wait(
    conninfo: str, table: str, connect: Any, pool: ThreadPoolExecutor, token_b: int, accepted: bool
) -> None:
    a, b = connect(), connect()
    RowGuard(a, table).update(1, 34, {"v": 1})  # A holds the row lock, fence 34 uncommitted

    def write_b() -> Any:
        result = _outcome(lambda: RowGuard(b, table, returning=True).update(1, token_b, {"v": 2}))
        b.commit()
        return result

    future = pool.submit(write_b)
    wait_until_blocked(conninfo, b.info.backend_pid, future)
    a.commit()
    outcome = future.result(timeout=30)
    if accepted:
        assert outcome["fence"] == token_b
        assert _row(conninfo, table, 1) == (2, token_b)
    else:
        assert isinstance(outcome, StaleTokenError)
        assert (outcome.reason, outcome.fence) == (Reason.STALE, 34)
        assert _row(conninfo, table, 1) == (1, 34)


def test_read_committed_batch_sees_a_fence_raised_while_it_waited(
    conninfo: str, table: str, connect: Any, pool: ThreadPoolExecutor
) -> None:
    a, b = connect(), connect()
    RowGuard(a, table).claim(2, 40)  # A holds row 2, fence 40 uncommitted

    def batch_b() -> Any:
        result = _outcome(lambda: RowGuard(b, table).update_many(35, {1: {"v": 7}, 2: {"v": 7}}))
        b.commit()
        return result

    future = pool.submit(batch_b)
    wait_until_blocked(conninfo, b.info.backend_pid, future)
    a.commit()
    outcome = future.result(timeout=30)
    assert isinstance(outcome, StaleTokenError)
    assert [(e.scope, e.reason, e.fence) for e in outcome.rejected] == [
        (f"{table}(2)", Reason.STALE, 40)
    ]
    assert _row(conninfo, table, 1) == (0, 30)  # all or nothing: row 1 was not written


def test_register_lock_fences_a_unit_of_work_until_commit(
    conninfo: str, table: str, connect: Any, pool: ThreadPoolExecutor
) -> None:
    register = f"reg_{secrets.token_hex(4)}"
    with psycopg.connect(conninfo, autocommit=True) as c:
        c.execute(REGISTER_TABLE_DDL.format(table=register))  # type: ignore[arg-type]
        install_triggers(c, register, register=True)
    a, b = connect(), connect()
    update = sql.SQL("UPDATE {} SET v = %s WHERE id = %s").format(sql.Identifier(table))
    # A: new holder, token 34, claims then writes two rows; not committed yet.
    FenceRegister(a, register).claim("order", 34)
    a.execute(update, (34, 1))

    def unit_b() -> Any:  # B: the old holder, token 33, does the same
        def work() -> None:
            FenceRegister(b, register).claim("order", 33)
            b.execute(update, (33, 1))
            b.execute(update, (33, 2))

        result = _outcome(work)
        b.rollback()
        return result

    future = pool.submit(unit_b)
    wait_until_blocked(conninfo, b.info.backend_pid, future)
    a.execute(update, (34, 2))
    a.commit()
    outcome = future.result(timeout=30)
    assert isinstance(outcome, StaleTokenError)
    assert (outcome.reason, outcome.fence, outcome.scope) == (Reason.STALE, 34, "order")
    assert [_row(conninfo, table, k)[0] for k in (1, 2)] == [34, 34]


# -- REPEATABLE READ / SERIALIZABLE -------------------------------------------------------


@pytest.mark.parametrize("level", ["REPEATABLE READ", "SERIALIZABLE"])
@pytest.mark.parametrize("token_b", [33, 35])
def test_snapshot_isolation_conflict_is_retryable_never_stale(
    conninfo: str, table: str, connect: Any, level: str, token_b: int
) -> None:
    a, b = connect(), connect()
    b.execute(sql.SQL("SET TRANSACTION ISOLATION LEVEL {}").format(sql.SQL(level)))
    b.execute(sql.SQL("SELECT v FROM {}").format(sql.Identifier(table)))  # B's snapshot
    RowGuard(a, table).update(1, 34, {"v": 1})
    a.commit()
    with pytest.raises(RetryableError) as caught:
        RowGuard(b, table).update(1, token_b, {"v": 2})
    assert not isinstance(caught.value, StaleTokenError)
    assert caught.value.code == "SERIALIZATION"
    assert caught.value.retryable
    assert isinstance(caught.value.__cause__, psycopg.errors.SerializationFailure)
    b.rollback()
    # Retried as a whole, in a new transaction, the write gets its true verdict.
    if token_b > 34:
        RowGuard(b, table).update(1, token_b, {"v": 2})
        b.commit()
        assert _row(conninfo, table, 1) == (2, token_b)
    else:
        with pytest.raises(StaleTokenError):
            RowGuard(b, table).update(1, token_b, {"v": 2})
        assert _row(conninfo, table, 1) == (1, 34)


def test_repeatable_read_lock_wait_ends_in_a_retryable_error(
    conninfo: str, table: str, connect: Any, pool: ThreadPoolExecutor
) -> None:
    a, b = connect(), connect()
    b.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    b.execute(sql.SQL("SELECT v FROM {}").format(sql.Identifier(table)))
    RowGuard(a, table).update(1, 34, {"v": 1})

    def write_b() -> Any:
        result = _outcome(lambda: RowGuard(b, table).update(1, 35, {"v": 2}))
        b.rollback()
        return result

    future = pool.submit(write_b)
    wait_until_blocked(conninfo, b.info.backend_pid, future)
    a.commit()
    outcome = future.result(timeout=30)
    assert isinstance(outcome, RetryableError)
    assert outcome.code == "SERIALIZATION"
    assert _row(conninfo, table, 1) == (1, 34)


def test_core_guard_under_repeatable_read_is_retryable(
    postgres_url: str, conninfo: str, table: str, connect: Any
) -> None:
    rows = Table(
        table,
        MetaData(),
        Column("id", Integer, primary_key=True),
        Column("v", Integer),
        fence_column(),
    )
    engine = create_engine(postgres_url, isolation_level="REPEATABLE READ")
    try:
        with engine.connect() as b:
            b.execute(select(rows.c.v))  # B's snapshot
            a = connect()
            RowGuard(a, table).update(2, 34, {"v": 1})
            a.commit()
            with pytest.raises(RetryableError) as caught:
                CoreRowGuard(b, rows).update(2, 35, {"v": 2})
            assert caught.value.code == "SERIALIZATION"
            b.rollback()
            CoreRowGuard(b, rows).update(2, 35, {"v": 2})
            b.commit()
    finally:
        engine.dispose()
    assert _row(conninfo, table, 2) == (2, 35)


@pytest.mark.parametrize("path", ["set", "row"])
@pytest.mark.parametrize("kind", ["psycopg", "core"])
def test_read_committed_upsert_batch_raced_by_an_insert_is_undone(
    conninfo: str,
    postgres_url: str,
    connect: Any,
    pool: ThreadPoolExecutor,
    kind: str,
    path: str,
) -> None:
    # A key absent when the batch checks the fences cannot be locked. A inserts it with a
    # newer fence; B's batch waits on A's row, and once A commits it skips that row: the
    # count comes up short and B's savepoint undoes the row it had written (C6). An array
    # column sends the batch down the row path (fences read first, then executemany).
    name = f"race_{secrets.token_hex(4)}"
    with psycopg.connect(conninfo, autocommit=True) as c:
        c.execute(
            sql.SQL(
                "CREATE TABLE {} (id INT PRIMARY KEY, v INT, tags INT[], "
                "fence BIGINT NOT NULL DEFAULT 0)"
            ).format(sql.Identifier(name))
        )
        c.execute(
            sql.SQL("INSERT INTO {} (id, v, fence) VALUES (1, 0, 30)").format(sql.Identifier(name))
        )
        install_triggers(c, name)
    rows = [{"id": 1, "v": 7}, {"id": 3, "v": 7}]
    if path == "row":
        rows = [{**r, "tags": [7]} for r in rows]
    a = connect()
    # A newer holder (token 40) inserts the row with plain SQL: the judge gives it fence 40.
    a.execute("SELECT set_config('iofence.token', '40', true)")
    a.execute(
        sql.SQL("INSERT INTO {} (id, v, fence) VALUES (3, 0, 40)").format(sql.Identifier(name))
    )
    engine = create_engine(postgres_url)
    table = Table(
        name,
        MetaData(),
        Column("id", Integer, primary_key=True),
        Column("v", Integer),
        Column("tags", ARRAY(Integer)),
        fence_column(),
    )
    try:
        if kind == "psycopg":
            b = connect()
            pid = b.info.backend_pid

            def batch_b() -> Any:
                result = _outcome(lambda: RowGuard(b, name).upsert_many(35, rows))
                b.commit()
                return result

        else:
            core = engine.connect()
            pid = core.connection.dbapi_connection.info.backend_pid  # type: ignore[union-attr]

            def batch_b() -> Any:
                result = _outcome(lambda: CoreRowGuard(core, table).upsert_many(35, rows))
                core.commit()
                return result

        future = pool.submit(batch_b)
        wait_until_blocked(conninfo, pid, future)
        a.commit()
        outcome = future.result(timeout=30)
        if kind == "core":
            core.close()
    finally:
        engine.dispose()
    assert isinstance(outcome, StaleTokenError)
    assert [(e.scope, e.reason, e.fence) for e in outcome.rejected] == [
        (f"{name}(3)", Reason.STALE, 40)
    ]
    assert [_row(conninfo, name, k) for k in (1, 3)] == [(0, 30), (0, 40)]


@pytest.mark.parametrize("kind", ["psycopg", "core"])
def test_upsert_batch_locks_rows_in_key_order(
    conninfo: str, table: str, postgres_url: str, connect: Any, pool: ThreadPoolExecutor, kind: str
) -> None:
    # A holds row 1. B's batch lists row 2 first: taken in that order, it would lock row 2
    # and wait for row 1, and A's write to row 2 would close a deadlock. In key order B
    # waits for row 1 holding nothing; A writes row 2 and commits; B's batch is then judged
    # against A's fences (STALE both) instead of failing with a deadlock.
    a = connect()
    RowGuard(a, table).update(1, 40, {"v": 1})
    rows = [{"id": 2, "v": 7}, {"id": 1, "v": 7}]
    engine = create_engine(postgres_url)
    core_table = Table(
        table,
        MetaData(),
        Column("id", Integer, primary_key=True),
        Column("v", Integer),
        fence_column(),
    )
    try:
        if kind == "psycopg":
            b = connect()
            pid = b.info.backend_pid

            def batch_b() -> Any:
                result = _outcome(lambda: RowGuard(b, table).upsert_many(35, rows))
                b.commit()
                return result

        else:
            core = engine.connect()
            pid = core.connection.dbapi_connection.info.backend_pid  # type: ignore[union-attr]

            def batch_b() -> Any:
                result = _outcome(lambda: CoreRowGuard(core, core_table).upsert_many(35, rows))
                core.commit()
                return result

        future = pool.submit(batch_b)
        wait_until_blocked(conninfo, pid, future)
        RowGuard(a, table).update(2, 40, {"v": 2})  # would wait for B, closing the cycle
        a.commit()
        outcome = future.result(timeout=30)
        if kind == "core":
            core.close()
    finally:
        engine.dispose()
    assert isinstance(outcome, StaleTokenError)
    assert sorted((e.scope, e.reason, e.fence) for e in outcome.rejected) == [
        (f"{table}(1)", Reason.STALE, 40),
        (f"{table}(2)", Reason.STALE, 40),
    ]
    assert [_row(conninfo, table, k) for k in (1, 2)] == [(1, 40), (2, 40)]
