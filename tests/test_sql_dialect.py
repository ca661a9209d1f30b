"""The SQL dialects and the SQL lock manager's plain parts, without a database.

- a dialect is found by SQLAlchemy's name, and an unknown one is refused;
- a driver error is classified by SQLSTATE (PostgreSQL) or by result code and message
  (SQLite), and the manager turns each class into its error (code, retryable);
- an engine built from a URL gets the dialect's driver, options and connect hook;
- the LISTEN connection's target, its backoff, the process-wide boards and pool locks;
- what a SQLite transaction reads before ``fence._rwlock.decide`` decides.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from typing import Any

import psycopg
import pymysql
import pytest
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import make_url
from sqlalchemy.pool import StaticPool

from fence._core import MAX_TOKEN, TokenMode
from fence._errors import BackendError, ConfigurationError, InvalidTokenError, RetryableError
from fence._rwlock import Holder, Waiting
from fence._sql import (
    Backoff,
    ListenTarget,
    checked_token,
    engine_arguments,
    lease_error,
    lease_table_board,
    listen_target,
    local_board,
    next_token,
    pool_lock,
    queue_seq,
    shared_state,
)
from fence._sql_dialect import (
    DIALECTS,
    PG_CONNECT_TIMEOUT,
    SQLITE_PRAGMAS,
    Fault,
    SQLDialect,
    dialect_for,
    dialect_of_url,
    error_code,
    fault_of,
    set_sqlite_pragmas,
)
from fence._sql_schema import lease_statements
from fence._sync.sql import SQLDriver, make_engine
from fence._wake import WakeBoard

PG = dialect_for("postgresql")
LITE = dialect_for("sqlite")


def _wrapped(cls: type[sa_exc.DBAPIError], orig: BaseException, **kw: Any) -> BaseException:
    return cls("SELECT 1", {}, orig, **kw)


def _pg(state: str, message: str = "boom") -> BaseException:
    return _wrapped(sa_exc.OperationalError, psycopg.errors.lookup(state)(message))


# -- finding a dialect -----------------------------------------------------------------------


def test_dialects_are_found_by_sqlalchemys_name() -> None:
    assert set(DIALECTS) == {"postgresql", "sqlite", "mariadb", "mysql"}
    for name, dialect in DIALECTS.items():
        assert isinstance(dialect, SQLDialect)
        assert dialect.name == name
        assert dialect_for(name) is dialect
        assert dialect_for(dialect) is dialect
        assert dialect.sqlalchemy.name == name


def test_an_unknown_dialect_is_refused_with_the_supported_ones() -> None:
    with pytest.raises(
        ConfigurationError, match="supports PostgreSQL, SQLite, MariaDB and MySQL, not 'oracle'"
    ):
        dialect_for("oracle")
    with pytest.raises(ConfigurationError, match="not 'oracle'"):
        lease_statements("oracle")


def test_mariadb_has_lease_statements_decided_in_transactions() -> None:
    for name in ("mariadb", "mysql"):
        dialect = dialect_for(name)
        assert dialect.lock_manager
        assert dialect.decides_in_process
        assert dialect.locks_first
        statements = lease_statements(name)
        assert statements.dialect == name
        assert "ON DUPLICATE KEY UPDATE" in statements.steps["claim"]
        assert "RETURNING" not in statements.renew


@pytest.mark.parametrize(
    ("code", "fault"),
    [
        (1213, Fault.DEADLOCK),
        (1205, Fault.LOCK_TIMEOUT),
        (1969, Fault.CANCELED),
        (1317, Fault.CANCELED),
        (1146, Fault.MISSING_TABLE),
        (1054, Fault.MISSING_COLUMN),
        (1049, Fault.NO_DATABASE),
        (1045, Fault.AUTH),
        (2013, Fault.CONNECTION),
        (1062, None),  # a duplicate key: the caller's to read
    ],
)
def test_mariadb_errors_are_read_by_number(code: int, fault: Fault | None) -> None:
    # PyMySQL's errors carry the server's SQLSTATE too (HY000 for most): still MariaDB's.
    orig = pymysql.err.OperationalError(code, "boom", sqlstate="HY000")
    wrapped = _wrapped(sa_exc.OperationalError, orig)
    for exc in (orig, wrapped):
        assert fault_of(exc) is fault
        assert DIALECTS["mariadb"].classify(exc) is fault
        assert not PG.owns(exc)
    assert error_code(wrapped) == f"MariaDB error {code}"
    assert error_code(_pg("40001")) == "SQLSTATE 40001"


def test_a_url_names_its_dialect_aliases_included() -> None:
    assert dialect_of_url(make_url("postgres://h/db")) is PG
    assert dialect_of_url(make_url("postgresql+asyncpg://h/db")) is PG
    assert dialect_of_url(make_url("sqlite:///x.db")) is LITE
    assert dialect_of_url(make_url("mysql://h/db")) is DIALECTS["mysql"]
    assert dialect_of_url(make_url("mariadb+pymysql://h/db")) is DIALECTS["mariadb"]
    assert dialect_of_url(make_url("oracle://h/db")) is None


def test_what_the_dialects_say_about_themselves() -> None:
    assert (PG.begin, LITE.begin) == ("BEGIN", "BEGIN IMMEDIATE")
    assert PG.notifies
    assert not LITE.notifies
    assert (PG.poll_interval, LITE.poll_interval) == (2.0, 0.5)
    assert LITE.decides_in_process
    assert not PG.decides_in_process
    assert LITE.in_process
    assert not PG.in_process
    assert LITE.client_clock
    assert not PG.client_clock
    assert (PG.busy_timeout_ms, LITE.busy_timeout_ms) == (None, SQLITE_PRAGMAS["busy_timeout"])
    assert LITE.busy_timeout_sql(250) == "PRAGMA busy_timeout = 250"
    assert PG.quote("select") == '"select"'
    assert LITE.quote("plain") == "plain"
    assert PG.returning
    assert LITE.returning
    assert LITE.rowcount_after_fetch
    assert not PG.rowcount_after_fetch
    assert (PG.max_params, LITE.max_params) == (30_000, 999)


def test_the_hybrid_floor_reads_the_databases_clock() -> None:
    assert PG.token_floor("c.now") == "CAST(floor(extract(epoch FROM c.now) * 1000000) AS BIGINT)"
    assert LITE.token_floor("n") == "max(:clock_us, CAST(n * 1000000 AS INTEGER))"
    pg = lease_statements(
        PG, table="t", schema=None, token_mode=TokenMode.HYBRID, notify=True, fence_table=None
    )
    assert "clock_timestamp()" in pg.acquire
    assert pg.steps == {}
    lite = lease_statements(
        LITE, table="t", schema=None, token_mode=TokenMode.HYBRID, notify=True, fence_table=None
    )
    assert ":clock_us" in lite.acquire
    assert LITE.clock_sql in lite.acquire
    assert set(lite.steps) >= {"state", "entries", "write", "put"}
    counter = lease_statements(
        LITE, table="t", schema=None, token_mode=TokenMode.COUNTER, notify=True, fence_table=None
    )
    assert ":clock_us" not in counter.acquire


def test_the_socket_a_deadline_cuts() -> None:
    class Psycopg:
        class pgconn:
            socket = 7

    class Entry:
        driver_connection = Psycopg()

    class Connection:
        connection = Entry()

    assert PG.socket_of(Connection()) == 7
    assert PG.socket_of(object()) is None  # another driver, or a broken connection
    assert LITE.socket_of(Connection()) is None  # in process: nothing to cut


def test_insert_constructs_have_on_conflict() -> None:
    from sqlalchemy import Column, Integer, MetaData, Table

    table = Table("t", MetaData(), Column("id", Integer, primary_key=True))
    for dialect in (PG, LITE):
        insert = dialect.insert(table)
        assert isinstance(insert, dialect.insert_class)
        assert hasattr(insert, "on_conflict_do_update")


# -- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("state", "fault"),
    [
        ("40001", Fault.SERIALIZATION),
        ("40P01", Fault.DEADLOCK),
        ("55P03", Fault.LOCK_TIMEOUT),
        ("57014", Fault.CANCELED),
        ("25P02", Fault.ABORTED),
        ("42P01", Fault.MISSING_TABLE),
        ("3F000", Fault.MISSING_TABLE),
        ("42703", Fault.MISSING_COLUMN),
        ("3D000", Fault.NO_DATABASE),
        ("28P01", Fault.AUTH),
        ("28000", Fault.AUTH),
        ("08006", Fault.CONNECTION),
        ("57P01", Fault.CONNECTION),
        ("23505", None),
    ],
)
def test_postgresql_classifies_by_sqlstate(state: str, fault: Fault | None) -> None:
    assert PG.classify(_pg(state)) is fault
    assert PG.classify(psycopg.errors.lookup(state)("raw")) is fault


def test_postgresql_reads_connection_errors_by_their_message() -> None:
    """psycopg raises a failed connection without a SQLSTATE."""
    nodb = psycopg.OperationalError('connection failed: FATAL:  database "x" does not exist')
    auth = psycopg.OperationalError("connection failed: FATAL: password authentication failed")
    assert PG.classify(_wrapped(sa_exc.OperationalError, nodb)) is Fault.NO_DATABASE
    assert PG.classify(_wrapped(sa_exc.OperationalError, auth)) is Fault.AUTH
    assert PG.classify(OSError("refused")) is None


@pytest.mark.parametrize(
    "message",
    [
        'FATAL:  role "nobody" does not exist',  # 28000
        'FATAL:  role "database_admin" does not exist',  # not a missing database
        'FATAL:  no pg_hba.conf entry for host "10.0.0.1", user "app", database "app"',
        'FATAL:  password authentication failed for user "app"',  # 28P01
    ],
)
def test_a_refused_login_is_read_from_its_message(message: str) -> None:
    """psycopg raises a failed connection without a SQLSTATE: a wrong user or password is
    a mistake in the URL, never a connection to repeat."""
    raised = psycopg.OperationalError(f'connection failed: connection to server at "h" {message}')
    assert PG.classify(_wrapped(sa_exc.OperationalError, raised)) is Fault.AUTH
    error = lease_error(_wrapped(sa_exc.OperationalError, raised), "acquire of 'r'", PG, None)
    assert (error.code, error.retryable) == ("AUTH", False)
    assert "check the user, password and database in the URL" in str(error)
    assert "unreachable" not in str(error)


@pytest.mark.parametrize(
    ("state", "code"), [("28000", "AUTH"), ("28P01", "AUTH"), ("3D000", "DATABASE")]
)
def test_the_guards_call_a_refused_login_no_connection_loss(state: str, code: str) -> None:
    from fence.adapters._sql_common import translate_error

    error = translate_error(_pg(state), "fenced update", "accounts(1)")
    assert (type(error), error.code, error.retryable) == (BackendError, code, False)
    assert "check the user, password and database in the URL" in str(error)


def test_a_wrong_user_or_database_fails_the_manager_at_once(postgres_server: Any) -> None:
    import fence

    where = f"127.0.0.1:{postgres_server.port}"
    for url, code in (
        (f"postgresql://nobody@{where}/postgres", "AUTH"),
        (f"postgresql://postgres@{where}/no_such_db", "DATABASE"),
    ):
        manager = fence.connect(url)
        try:
            with pytest.raises(BackendError) as caught:
                manager.acquire("r", ttl=5)
        finally:
            manager.close()
        assert (caught.value.code, caught.value.retryable) == (code, False)
        assert "check the user, password and database in the URL" in str(caught.value)


@pytest.mark.parametrize(
    ("message", "fault"),
    [
        ("no such table: t", Fault.MISSING_TABLE),
        ("no such column: x", Fault.MISSING_COLUMN),
        ("table t has no column named x", Fault.MISSING_COLUMN),
        ("unable to open database file", Fault.CANNOT_OPEN),
        ("database is locked", Fault.BUSY),
        ("database table is locked", Fault.BUSY),
        ("disk I/O error", None),
    ],
)
def test_sqlite_classifies_by_message(message: str, fault: Fault | None) -> None:
    error = sqlite3.OperationalError(message)
    assert LITE.classify(error) is fault
    assert LITE.classify(_wrapped(sa_exc.OperationalError, error)) is fault


def test_sqlite_classifies_busy_by_result_code() -> None:
    error = sqlite3.OperationalError("cannot commit transaction - SQL statements in progress")
    error.sqlite_errorcode = 5  # type: ignore[attr-defined]
    assert LITE.classify(error) is Fault.BUSY
    error.sqlite_errorcode = 6 | (1 << 8)  # type: ignore[attr-defined]  # an extended code
    assert LITE.classify(error) is Fault.BUSY


def test_sqlite_result_code_wins_over_the_message() -> None:
    """A constraint named ``locked_...`` is not a busy database: the message is read only
    for an error that came without a result code."""
    error = sqlite3.IntegrityError("CHECK constraint failed: locked_amount >= 0")
    error.sqlite_errorcode = 19 | (1 << 8)  # type: ignore[attr-defined]  # SQLITE_CONSTRAINT_CHECK
    assert LITE.classify(error) is None


def test_fault_of_reads_an_error_by_the_dialect_whose_code_it_carries() -> None:
    """The guards hold no dialect: each error goes to the dialect whose code it carries."""
    serial = psycopg.errors.SerializationFailure("could not serialize access")
    assert fault_of(_wrapped(sa_exc.OperationalError, serial)) is Fault.SERIALIZATION
    busy = sqlite3.OperationalError("database is locked")
    busy.sqlite_errorcode = 5  # type: ignore[attr-defined]
    assert fault_of(_wrapped(sa_exc.OperationalError, busy)) is Fault.BUSY
    # Without a code no dialect reads it, whatever its message says.
    assert fault_of(sqlite3.OperationalError("database is locked")) is None
    assert fault_of(OSError("no such table: t")) is None


def test_retryable_faults_are_never_a_verdict() -> None:
    retryable = {f for f in Fault if f.retryable}
    assert retryable == {
        Fault.SERIALIZATION,
        Fault.DEADLOCK,
        Fault.LOCK_TIMEOUT,
        Fault.CANCELED,
        Fault.BUSY,
    }


@pytest.mark.parametrize(
    ("dialect", "exc", "kind", "code", "retryable"),
    [
        (PG, _pg("40001"), RetryableError, "SERIALIZATION", True),
        (PG, _pg("40P01"), RetryableError, "SERIALIZATION", True),
        (PG, _pg("42P01"), BackendError, "SCHEMA", False),
        (PG, _pg("42703"), BackendError, "SCHEMA", False),
        (PG, _pg("3D000"), BackendError, "DATABASE", False),
        (PG, _pg("28P01"), BackendError, "AUTH", False),
        (PG, _pg("57014"), BackendError, "CONNECTION", True),
        (PG, _pg("55P03"), BackendError, "CONNECTION", True),
        (PG, _pg("25P02"), BackendError, "CONNECTION", True),
        (
            PG,
            _wrapped(sa_exc.IntegrityError, psycopg.errors.lookup("23505")("dup")),
            BackendError,
            "SQL",
            False,
        ),
        (
            PG,
            _wrapped(sa_exc.DBAPIError, psycopg.ProgrammingError("x"), connection_invalidated=True),
            BackendError,
            "CONNECTION",
            True,
        ),
        (PG, OSError("refused"), BackendError, "CONNECTION", True),
        (LITE, sqlite3.OperationalError("no such table: t"), BackendError, "SCHEMA", False),
        (
            LITE,
            sqlite3.OperationalError("unable to open database file"),
            BackendError,
            "DATABASE",
            False,
        ),
        (LITE, sqlite3.OperationalError("database is locked"), BackendError, "BUSY", True),
        (LITE, sqlite3.OperationalError("disk I/O error"), BackendError, "CONNECTION", True),
        (
            LITE,
            _wrapped(sa_exc.ProgrammingError, sqlite3.ProgrammingError("locked")),
            BackendError,
            "SQL",
            False,
        ),
        (
            LITE,
            _wrapped(sa_exc.IntegrityError, sqlite3.IntegrityError("CHECK constraint failed")),
            BackendError,
            "SQL",
            False,
        ),
    ],
)
def test_the_manager_maps_each_fault_to_its_error(
    dialect: SQLDialect, exc: BaseException, kind: type, code: str, retryable: bool
) -> None:
    error = lease_error(exc, "acquire of 'r' on t", dialect, pool=None)
    assert type(error) is kind
    assert (error.code, error.retryable) == (code, retryable)
    assert str(error).startswith("acquire of 'r' on t")


def test_a_full_pool_is_a_client_side_limit() -> None:
    engine = make_engine("postgresql://u@localhost:1/db", {"pool_size": 2})
    error = lease_error(sa_exc.TimeoutError("QueuePool limit"), "acquire", PG, engine.pool)
    assert (error.code, error.retryable, error.sent) == ("POOL", True, False)
    assert "pool_size=2, max_overflow=10" in str(error)
    engine.dispose()


def test_a_driver_maps_through_its_engines_dialect() -> None:
    engine = make_engine("postgresql://u:secret@localhost:1/db")
    driver = SQLDriver(engine, listen=False)
    assert driver.sql_dialect is PG
    assert driver.dialect == "postgresql"
    error = driver._error(_pg("40001"), "acquire", "r")
    assert isinstance(error, RetryableError)
    assert "secret" not in str(error)
    assert "acquire of 'r' on postgresql table 'fence_leases'" in str(error)
    engine.dispose()


def test_checked_tokens() -> None:
    assert checked_token(1) == 1
    assert checked_token(MAX_TOKEN) == MAX_TOKEN
    for bad in (0, MAX_TOKEN + 1, True, 1.0, "1", None):
        with pytest.raises(InvalidTokenError):
            checked_token(bad)


# -- engines ----------------------------------------------------------------------------------


def test_engine_arguments_of_postgresql() -> None:
    url, kwargs, hook = engine_arguments("postgres://u@h/db", None, asyncio=True)
    assert url.drivername == "postgresql+psycopg"
    assert kwargs == {
        "isolation_level": "AUTOCOMMIT",
        "pool_reset_on_return": None,
        "connect_args": {"connect_timeout": PG_CONNECT_TIMEOUT},
    }
    assert hook is None
    url, kwargs, _ = engine_arguments(
        "postgresql+psycopg://u@h/db?connect_timeout=9",
        {"connect_args": {"application_name": "x"}},
        asyncio=False,
    )
    assert url.drivername == "postgresql+psycopg"
    assert kwargs["connect_args"] == {"application_name": "x"}


def test_engine_arguments_of_sqlite() -> None:
    url, kwargs, hook = engine_arguments("sqlite://", None, asyncio=True)
    assert url.drivername == "sqlite+aiosqlite"
    assert kwargs["poolclass"] is StaticPool
    assert kwargs["connect_args"] == {"check_same_thread": False}
    assert hook is None  # no pragmas in memory
    url, kwargs, hook = engine_arguments("sqlite:///x.db", {"pool_size": 3}, asyncio=False)
    assert url.drivername == "sqlite"
    assert kwargs == {"isolation_level": "AUTOCOMMIT", "pool_reset_on_return": None, "pool_size": 3}
    assert hook is not None
    _, _, hook = engine_arguments("sqlite:///x.db?timeout=3", None, asyncio=False)
    assert hook is not None

    class Connection:
        def __init__(self) -> None:
            self.executed: list[str] = []

        def cursor(self) -> Any:
            return self

        def execute(self, sql: str) -> None:
            self.executed.append(sql)

        def close(self) -> None:
            pass

    conn = Connection()
    hook(conn, None)
    assert conn.executed == ["PRAGMA journal_mode = WAL", "PRAGMA synchronous = NORMAL"]
    conn = Connection()
    set_sqlite_pragmas(SQLITE_PRAGMAS, conn, None)
    assert conn.executed[-1] == "PRAGMA busy_timeout = 5000"


def test_an_unsupported_url_gets_an_engine_that_the_driver_refuses() -> None:
    url, kwargs, hook = engine_arguments("oracle://h/db", None, asyncio=False)
    assert url.drivername == "oracle"
    assert kwargs == {"isolation_level": "AUTOCOMMIT", "pool_reset_on_return": None}
    assert hook is None


# -- the LISTEN connection ----------------------------------------------------------------------


def test_listen_target_from_the_engine_or_a_conninfo() -> None:
    engine = make_engine("postgresql://u:p@h:5/db?connect_timeout=3")
    target = listen_target(engine, True, "fence:t", "fence:t:w")
    assert target is not None
    assert target.args == ()
    assert target.kwargs["host"] == "h"
    assert target.kwargs["connect_timeout"] == "3"
    target = listen_target(engine, "host=elsewhere", "fence:t", "fence:t:w")
    assert target == ListenTarget(
        ("host=elsewhere",), {"connect_timeout": 5}, "fence:t", "fence:t:w"
    )
    assert listen_target(engine, False, "fence:t", "fence:t:w") is None
    engine.dispose()


def test_listen_target_quotes_its_channels_and_posts_to_the_board() -> None:
    target = ListenTarget((), {}, 'fence:s."t"', 'fence:s."t":w')
    assert target.commands == ('LISTEN "fence:s.""t"""', 'LISTEN "fence:s.""t"":w"')

    class Board:
        def __init__(self) -> None:
            self.woken: list[tuple[str, bool]] = []

        def wake(self, resource: str, *, writers: bool = False) -> None:
            self.woken.append((resource, writers))

    board = Board()
    target.post(board, target.channel, "r1")  # type: ignore[arg-type]
    target.post(board, target.writers, "r2")  # type: ignore[arg-type]
    target.post(board, target.channel, "")  # type: ignore[arg-type]
    assert board.woken == [("r1", False), ("r2", True)]


def test_backoff_doubles_to_a_second_and_warns_once_in_a_row() -> None:
    backoff = Backoff()
    seen = [backoff.failed() for _ in range(7)]
    assert [level for level, _ in seen] == [logging.WARNING] + [logging.DEBUG] * 6
    assert [pause for _, pause in seen] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0]
    backoff.succeeded()
    assert backoff.failed() == (logging.WARNING, 0.05)


# -- process-wide state -------------------------------------------------------------------------


def test_boards_are_shared_by_table_and_die_with_their_pool() -> None:
    board = local_board(("test", "a"))
    assert isinstance(board, WakeBoard)
    assert local_board(("test", "a")) is board
    assert local_board(("test", "b")) is not board
    url = make_url("sqlite:///x.db")
    file_board = lease_table_board(LITE, url, object(), None, "t")
    assert lease_table_board(LITE, make_url("sqlite:///./x.db"), object(), None, "t") is file_board
    assert lease_table_board(LITE, url, object(), "other", "t") is not file_board

    class Pool:
        pass

    pool = Pool()
    memory = make_url("sqlite://")
    in_memory = lease_table_board(LITE, memory, pool, None, "t")
    assert lease_table_board(LITE, memory, pool, None, "t") is in_memory
    assert lease_table_board(LITE, memory, Pool(), None, "t") is not in_memory


def test_pool_locks_are_one_per_pool_and_kind() -> None:
    class Pool:
        pass

    pool = Pool()
    lock = pool_lock(pool, threading.Lock)
    assert pool_lock(pool, threading.Lock) is lock
    assert pool_lock(Pool(), threading.Lock) is not lock
    assert pool_lock(pool, threading.RLock) is not lock


# -- shared locks decided in process -------------------------------------------------------------


def test_shared_state_keeps_live_leases_and_places_in_arrival_order() -> None:
    state = (7, "w-secret", 4.5, 1000, 50.0)
    entries = [
        ("r1", "r", 5, 2.0, 0, "h"),
        ("r0", "r", 4, -1.0, 0, "h"),  # ran out
        ("q2", "W", None, 3.0, 20, "h"),
        ("q1", "R", None, 3.0, 10, "h"),
        ("q0", "W", None, 0.0, 5, "h"),  # ran out
    ]
    writer, readers, queue = shared_state(state, entries)
    assert writer == Holder("w-secret", 7, 4.5)
    assert readers == [Holder("r1", 5, 2.0)]
    assert queue == [Waiting("q1", False, 3.0), Waiting("q2", True, 3.0)]
    assert shared_state((7, None, None, 1000, 50.0), [])[0] is None
    assert shared_state((7, "gone", 0.0, 1000, 50.0), [])[0] is None


def test_queue_seq_keeps_a_place_and_puts_newcomers_last() -> None:
    entries = [("a", "W", None, 3.0, 50_000_007, "h")]
    assert queue_seq(entries, "a", 50.0) == 50_000_007
    assert queue_seq(entries, "b", 50.0) == 50_000_008  # the clock did not move
    assert queue_seq(entries, "b", 60.0) == 60_000_000
    assert queue_seq([], "b", 1.5) == 1_500_000


def test_next_token_follows_the_statements_rule() -> None:
    assert next_token("r", None, 1) == 1
    assert next_token("r", 41, 1) == 42
    assert next_token("r", 41, 1000) == 1000
    with pytest.raises(InvalidTokenError, match="token space exhausted for 'r'"):
        next_token("r", MAX_TOKEN, 1)
