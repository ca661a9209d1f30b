"""The database's judge (C14) on MariaDB: its rules with bare SQL, the write paths that do
not go through iofence (a stored procedure, a view, a second process, a cascade,
``TRUNCATE``), the session variable that must never outlive its transaction, and the check
the guards run before their first write.

The rules are tried from plain PyMySQL connections that use nothing of iofence but the DDL
text, and from the ``mariadb`` command-line client, another process.
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pymysql
import pytest
from sqlalchemy import (
    BigInteger,
    Column,
    Engine,
    MetaData,
    String,
    Table,
    create_engine,
    event,
    text,
    update,
)
from sqlalchemy import exc as sa_exc
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.orm import Session
from sqlalchemy.pool import QueuePool

from fence import BackendError, ConfigurationError, Reason, StaleTokenError, UnfencedWriteError
from fence.adapters._sql_common import judge_error
from fence.adapters.ddl import MARIADB_UNFENCED_SQL, drop_trigger_ddl, trigger_ddl
from fence.adapters.orm import bind
from fence.adapters.sql import (
    AsyncRowGuard,
    FenceRegister,
    RowGuard,
    fence_column,
    fence_register_table,
    install_triggers,
    tombstone_column,
)
from tests.servers import MariaDBServer

pytestmark = pytest.mark.mariadb

OK = "ok"


def _connect(server: MariaDBServer, database: str, **kwargs: Any) -> pymysql.Connection[Any]:
    return pymysql.connect(
        host="127.0.0.1",
        port=server.port,
        user=kwargs.pop("user", server.USER),
        password=kwargs.pop("password", server.PASSWORD),
        database=database,
        **kwargs,
    )


@pytest.fixture
def database(mariadb_url: str) -> str:
    """The name of the test's own database."""
    return mariadb_url.rsplit("/", 1)[1]


@pytest.fixture
def db(mariadb_server: MariaDBServer, database: str) -> Iterator[pymysql.Connection[Any]]:
    """A plain PyMySQL connection (no iofence code on it), autocommit."""
    conn = _connect(mariadb_server, database, autocommit=True)
    yield conn
    conn.close()


def run(db: pymysql.Connection[Any], *statements: str) -> None:
    with db.cursor() as cursor:
        for statement in statements:
            cursor.execute(statement)


def one(db: pymysql.Connection[Any], query: str) -> Any:
    with db.cursor() as cursor:
        cursor.execute(query)
        row = cursor.fetchone()
    return None if row is None else row[0]


@pytest.fixture
def accounts(db: pymysql.Connection[Any]) -> str:
    """``judged_x(id PK, balance, fence, deleted)``: rows 1 and 2 at fence 10, with the judge
    installed by its DDL text."""
    name = f"judged_{secrets.token_hex(4)}"
    run(
        db,
        f"CREATE TABLE {name} (id INT PRIMARY KEY, balance INT NOT NULL DEFAULT 0, "
        "fence BIGINT NOT NULL DEFAULT 0, deleted BOOLEAN NOT NULL DEFAULT FALSE)",
        f"INSERT INTO {name} VALUES (1, 0, 10, false), (2, 0, 10, false)",
        *trigger_ddl(name, dialect="mariadb", tombstone="deleted"),
    )
    return name


def attempt(
    db: pymysql.Connection[Any], token: int | None, *statements: str, opt_out: bool = False
) -> str:
    """Run ``statements`` in one transaction with ``token`` in ``@iofence_token`` (``None``:
    none); return ``OK`` or the judge's verdict (``unfenced``, ``stale``, ``refused``), the
    transaction rolled back then. The variables are cleared afterwards either way."""
    try:
        run(db, "BEGIN")
        if opt_out:
            run(db, MARIADB_UNFENCED_SQL)
        if token is not None:
            run(db, f"SET @iofence_token = {token}")
        run(db, *statements)
        run(db, "COMMIT")
    except pymysql.err.OperationalError as exc:
        run(db, "ROLLBACK")
        verdict = str(exc.args[1]) if exc.args[0] == 1644 else repr(exc)
        return verdict.split()[1]
    finally:
        run(db, "SET @iofence_token = NULL, @iofence_unfenced = NULL")
    return OK


def rows(db: pymysql.Connection[Any], table: str) -> list[tuple[Any, ...]]:
    with db.cursor() as cursor:
        cursor.execute(f"SELECT id, balance, fence, deleted FROM {table} ORDER BY id")
        return [tuple(r) for r in cursor.fetchall()]


# -- the rules, with bare SQL ---------------------------------------------------------------


UPDATE = "UPDATE {t} SET balance = 1 WHERE id = 1"
INSERT = "INSERT INTO {t} (id) VALUES (3)"
UPSERT = "INSERT INTO {t} (id) VALUES (1) ON DUPLICATE KEY UPDATE balance = 9"
REPLACE = "REPLACE INTO {t} (id, balance) VALUES (1, 9)"
DELETE = "DELETE FROM {t} WHERE id = 1"
LOWER = "UPDATE {t} SET fence = 1 WHERE id = 1"
MULTI = "UPDATE {t} AS a JOIN {t} AS b ON b.id = a.id SET a.balance = 7"

RULES = [
    # (label, statement with {t}, token, opt-out, expected verdict)
    ("update without a token", UPDATE, None, False, "unfenced"),
    ("update, stale", UPDATE, 5, False, "stale"),
    ("update, the holder", UPDATE, 20, False, OK),
    ("update, an equal token", UPDATE, 10, False, OK),
    ("update, opted out", UPDATE, None, True, OK),
    ("update, not a token", UPDATE, 0, False, "unfenced"),
    ("multi-table update without a token", MULTI, None, False, "unfenced"),
    ("insert without a token", INSERT, None, False, "unfenced"),
    ("insert, the holder", INSERT, 20, False, OK),
    ("upsert without a token", UPSERT, None, False, "unfenced"),
    ("upsert, stale", UPSERT, 5, False, "stale"),
    ("upsert, the holder", UPSERT, 20, False, OK),
    ("replace, stale", REPLACE, 5, False, "stale"),
    ("hard delete without a token", DELETE, None, False, "unfenced"),
    ("hard delete, the holder", DELETE, 20, False, "refused"),
    ("hard delete, stale", DELETE, 5, False, "stale"),
    ("hard delete, opted out", DELETE, None, True, OK),
    ("lowering, the holder", LOWER, 20, False, "refused"),
    ("lowering, opted out", LOWER, None, True, "refused"),
]


@pytest.mark.parametrize(
    ("label", "statement", "token", "opt_out", "expected"), RULES, ids=[r[0] for r in RULES]
)
def test_the_judge_rules_on_every_write(
    db: pymysql.Connection[Any],
    accounts: str,
    label: str,
    statement: str,
    token: int | None,
    opt_out: bool,
    expected: str,
) -> None:
    before = rows(db, accounts)
    verdict = attempt(db, token, statement.format(t=accounts), opt_out=opt_out)
    assert verdict == expected, label
    if expected != OK:
        assert rows(db, accounts) == before  # nothing written
    elif token is not None:
        # An accepted write of the holder raises the fence to its token (C4).
        assert all(r[2] in (10, token) for r in rows(db, accounts))


def test_a_plain_write_of_the_holder_raises_the_fence(
    db: pymysql.Connection[Any], accounts: str
) -> None:
    assert attempt(db, 20, f"UPDATE {accounts} SET balance = 5 WHERE id = 1") == OK
    assert attempt(db, 30, f"INSERT INTO {accounts} (id, fence) VALUES (3, 1)") == OK
    assert rows(db, accounts)[0] == (1, 5, 20, 0)
    assert rows(db, accounts)[2] == (3, 0, 30, 0)  # the token, not the fence it named
    # The old holder can no longer write either row.
    assert attempt(db, 15, f"UPDATE {accounts} SET balance = 0 WHERE id = 1") == "stale"


def test_a_tombstone_keeps_its_fence(db: pymysql.Connection[Any], accounts: str) -> None:
    """C7: a soft delete by the holder leaves the row, and the fence with it; a stale
    writer can neither revive it nor delete it for good."""
    assert attempt(db, 20, f"UPDATE {accounts} SET deleted = true WHERE id = 1") == OK
    revive = f"UPDATE {accounts} SET deleted = false, balance = 3 WHERE id = 1"
    assert attempt(db, 15, revive) == "stale"
    assert attempt(db, 15, f"INSERT INTO {accounts} (id) VALUES (1) "
                   "ON DUPLICATE KEY UPDATE deleted = false") == "stale"  # fmt: skip
    assert attempt(db, 25, f"DELETE FROM {accounts} WHERE id = 1") == "refused"
    assert rows(db, accounts)[0] == (1, 0, 20, 1)


def test_the_register_is_judged_and_never_loses_a_row(db: pymysql.Connection[Any]) -> None:
    name = f"register_{secrets.token_hex(4)}"
    run(
        db,
        f"CREATE TABLE {name} (scope VARCHAR(512) PRIMARY KEY, fence BIGINT NOT NULL)",
        *trigger_ddl(name, dialect="mariadb", register=True),
    )
    claim = f"INSERT INTO {name} VALUES ('s', 0) ON DUPLICATE KEY UPDATE fence = VALUES(fence)"
    assert attempt(db, None, claim) == "unfenced"
    assert attempt(db, 10, claim) == OK
    assert one(db, f"SELECT fence FROM {name}") == 10
    assert attempt(db, 9, claim) == "stale"
    assert attempt(db, 11, f"UPDATE {name} SET fence = 10") == OK  # the token, not 10
    assert one(db, f"SELECT fence FROM {name}") == 11
    assert attempt(db, 12, f"UPDATE {name} SET fence = 5") == "refused"  # never lowered
    assert attempt(db, None, f"UPDATE {name} SET fence = 5", opt_out=True) == "refused"
    assert attempt(db, 12, f"DELETE FROM {name}") == "refused"
    assert attempt(db, None, f"DELETE FROM {name}", opt_out=True) == OK


def test_a_stale_refusal_is_a_stale_token_error_with_scope_token_and_fence(
    db: pymysql.Connection[Any],
) -> None:
    name = f"keyed_{secrets.token_hex(4)}"
    run(
        db,
        f"CREATE TABLE {name} (a VARCHAR(8), b INT, fence BIGINT NOT NULL, PRIMARY KEY (a, b))",
        f"INSERT INTO {name} VALUES ('x', 2, 10)",
        *trigger_ddl(name, dialect="mariadb", key=("a", "b")),
    )
    run(db, "SET @iofence_token = 4")
    with pytest.raises(pymysql.err.OperationalError) as caught:
        run(db, f"UPDATE {name} SET fence = fence")
    found = judge_error(caught.value)
    assert isinstance(found, StaleTokenError)
    assert (found.scope, found.token, found.fence, found.reason) == (
        f"{name}('x', 2)",
        4,
        10,
        Reason.STALE,
    )
    # The refusal took the token out of the session: the next write carries none.
    assert one(db, "SELECT @iofence_token") is None
    with pytest.raises(pymysql.err.OperationalError) as caught:
        run(db, f"UPDATE {name} SET b = 3")
    assert isinstance(judge_error(caught.value), UnfencedWriteError)


# -- the paths that do not go through iofence -------------------------------------------------


def test_a_procedure_and_a_view_are_judged(db: pymysql.Connection[Any], accounts: str) -> None:
    run(
        db,
        f"CREATE PROCEDURE pay_{accounts}() UPDATE {accounts} SET balance = balance + 1",
        f"CREATE VIEW view_{accounts} AS SELECT * FROM {accounts}",
    )
    assert attempt(db, None, f"CALL pay_{accounts}()") == "unfenced"
    assert attempt(db, 5, f"CALL pay_{accounts}()") == "stale"
    assert attempt(db, None, f"UPDATE view_{accounts} SET balance = 4") == "unfenced"
    assert attempt(db, None, f"DELETE FROM view_{accounts}") == "unfenced"
    assert attempt(db, 20, f"CALL pay_{accounts}()") == OK
    assert [r[1:3] for r in rows(db, accounts)] == [(1, 20), (1, 20)]


def _client(server: MariaDBServer, database: str, sql: str) -> subprocess.CompletedProcess[str]:
    client = shutil.which("mariadb") or shutil.which("mysql")
    if client is None:
        pytest.skip("no mariadb command-line client")
    return subprocess.run(
        [
            client,
            "--no-defaults",
            "--protocol=TCP",
            "-h127.0.0.1",
            f"-P{server.port}",
            f"-u{server.USER}",
            f"-p{server.PASSWORD}",
            database,
            "-e",
            sql,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_a_second_process_writing_plain_sql_is_refused(
    mariadb_server: MariaDBServer, database: str, db: pymysql.Connection[Any], accounts: str
) -> None:
    """The ``mariadb`` client, another process with a session of its own, writes with
    plain SQL: refused without a token and with a stale one, accepted for the holder."""
    done = _client(mariadb_server, database, f"UPDATE {accounts} SET balance = 9")
    assert done.returncode != 0
    assert "iofence: unfenced update" in done.stderr
    stale = f"SET @iofence_token = 5; UPDATE {accounts} SET balance = 9"
    done = _client(mariadb_server, database, stale)
    assert "iofence: stale token 5" in done.stderr
    assert [r[1] for r in rows(db, accounts)] == [0, 0]
    holder = f"SET @iofence_token = 20; UPDATE {accounts} SET balance = 9 WHERE id = 2"
    assert _client(mariadb_server, database, holder).returncode == 0
    assert rows(db, accounts)[1] == (2, 9, 20, 0)


def test_a_cascade_fires_no_trigger_so_the_guards_refuse_its_table(
    engine: Engine, db: pymysql.Connection[Any]
) -> None:
    """InnoDB's foreign-key cascades fire no trigger: a cascade into a fenced table would
    write it unjudged. The guards refuse such a table; ``RESTRICT`` is judged as usual."""
    suffix = secrets.token_hex(4)
    run(
        db,
        f"CREATE TABLE parent_{suffix} (id INT PRIMARY KEY)",
        f"INSERT INTO parent_{suffix} VALUES (1)",
    )
    metadata = MetaData()
    child = Table(
        f"child_{suffix}",
        metadata,
        Column("k", String(8), primary_key=True),
        Column("parent", BigInteger, nullable=False),
        fence_column(),
    )
    with engine.begin() as conn:
        child.create(conn)
        conn.exec_driver_sql(
            f"ALTER TABLE child_{suffix} MODIFY parent INT NOT NULL, ADD CONSTRAINT "
            f"cascading_{suffix} FOREIGN KEY (parent) REFERENCES parent_{suffix} (id) "
            "ON DELETE CASCADE"
        )
    with (
        engine.begin() as conn,
        pytest.raises(ConfigurationError, match=r"fire no trigger.*make them RESTRICT"),
    ):
        RowGuard(conn, child).upsert(5, {"k": "a", "parent": 1})
    run(db, "SET @iofence_token = 5", f"INSERT INTO child_{suffix} VALUES ('a', 1, 0)")
    run(db, "SET @iofence_token = NULL", f"DELETE FROM parent_{suffix}")
    # The hole the refusal keeps the guards out of: the row went, and no trigger saw it.
    assert one(db, f"SELECT COUNT(*) FROM child_{suffix}") == 0
    run(
        db,
        f"ALTER TABLE child_{suffix} DROP FOREIGN KEY cascading_{suffix}",
        f"ALTER TABLE child_{suffix} ADD CONSTRAINT restricting_{suffix} FOREIGN KEY "
        f"(parent) REFERENCES parent_{suffix} (id) ON DELETE RESTRICT",
        f"INSERT INTO parent_{suffix} VALUES (2)",
    )
    with engine.begin() as conn:
        RowGuard(conn, child).upsert(5, {"k": "a", "parent": 2})


def test_truncate_fires_no_trigger_and_is_refused_by_the_privilege_recipe(
    mariadb_server: MariaDBServer, database: str, db: pymysql.Connection[Any], accounts: str
) -> None:
    """``TRUNCATE`` fires no trigger on MariaDB, and needs the ``DROP`` privilege: the
    application's user, granted the row privileges only, cannot empty a fenced table."""
    user = f"app_{secrets.token_hex(4)}"
    run(
        db,
        f"CREATE USER '{user}'@'127.0.0.1' IDENTIFIED BY 'app'",
        f"GRANT SELECT, INSERT, UPDATE, DELETE, EXECUTE ON {database}.* TO '{user}'@'127.0.0.1'",
    )
    try:
        app = _connect(mariadb_server, database, user=user, password="app", autocommit=True)
        try:
            with pytest.raises(pymysql.err.OperationalError) as caught:
                run(app, f"TRUNCATE TABLE {accounts}")
            assert caught.value.args[0] == 1142  # ER_TABLEACCESS_DENIED_ERROR
            with pytest.raises(pymysql.err.OperationalError, match="iofence: unfenced"):
                run(app, f"DELETE FROM {accounts}")
        finally:
            app.close()
        assert len(rows(db, accounts)) == 2
        # The hole, for a user who holds DROP: no trigger stops it.
        run(db, f"TRUNCATE TABLE {accounts}")
        assert rows(db, accounts) == []
    finally:
        run(db, f"DROP USER '{user}'@'127.0.0.1'")


# -- the session variable never outlives its transaction -----------------------------------


@pytest.fixture
def engine(mariadb_url: str) -> Iterator[Engine]:
    """An engine whose pool holds one connection: every transaction reuses it."""
    found = create_engine(mariadb_url, poolclass=QueuePool, pool_size=1, max_overflow=0)
    yield found
    found.dispose()


@pytest.fixture
def table(engine: Engine) -> Table:
    """A fresh fenced table, its judge installed by ``create_all``."""
    metadata = MetaData()
    found = Table(
        f"rows_{secrets.token_hex(4)}",
        metadata,
        Column("k", String(32), primary_key=True),
        Column("v", BigInteger, nullable=True),
        fence_column(),
        tombstone_column(),
    )
    metadata.create_all(engine)
    return found


def _driver_write(engine: Engine, table: Table) -> tuple[Any, str]:
    """The token the pooled connection's session holds, and what a write through the bare
    driver cursor (no iofence check on the way) gets from the judge."""
    with engine.connect() as conn:
        cursor = conn.connection.dbapi_connection.cursor()  # type: ignore[union-attr]
        try:
            cursor.execute("SELECT COALESCE(@iofence_row_token, @iofence_token)")
            token = cursor.fetchone()[0]
            try:
                cursor.execute(f"UPDATE {table.name} SET fence = fence")
            except pymysql.err.OperationalError as exc:
                return token, str(exc.args[1])
            return token, OK
        finally:
            cursor.close()
            conn.rollback()


def test_an_accepted_write_leaves_no_token_and_costs_no_round_trip(
    engine: Engine, table: Table
) -> None:
    """The token rides in the fenced statement and the judge's AFTER trigger clears it: the
    guard's transaction sends its write and nothing else (the check of the triggers, once
    per connection and table, comes first)."""
    with engine.begin() as conn:
        RowGuard(conn, table).upsert(20, {"k": "a", "v": 1})
    sent: list[str] = []

    def record(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        sent.append(statement)

    event.listen(engine, "before_cursor_execute", record)
    try:
        with engine.begin() as conn:
            RowGuard(conn, table).update("a", 21, {"v": 2})
    finally:
        event.remove(engine, "before_cursor_execute", record)
    assert len(sent) == 1
    assert sent[0].startswith("UPDATE")
    assert "@iofence_row_token :=" in sent[0]
    token, verdict = _driver_write(engine, table)
    assert token is None
    assert verdict.startswith("iofence: unfenced update")


def test_a_failed_fenced_statement_leaves_no_token_past_its_transaction(
    engine: Engine, db: pymysql.Connection[Any]
) -> None:
    """A duplicate key fails the holder's update after its row took the token and before
    the AFTER trigger that clears it: the end of the transaction clears it instead."""
    metadata = MetaData()
    table = Table(
        f"unique_{secrets.token_hex(4)}",
        metadata,
        Column("k", String(8), primary_key=True),
        Column("u", BigInteger, unique=True),
        fence_column(),
        tombstone_column(),
    )
    metadata.create_all(engine)
    with engine.begin() as conn:
        RowGuard(conn, table).upsert(20, {"k": "a", "u": 1})
        RowGuard(conn, table).upsert(20, {"k": "b", "u": 2})
    with engine.connect() as conn:
        conn.begin()
        with pytest.raises(BackendError, match="Duplicate entry"):
            RowGuard(conn, table).update("b", 21, {"u": 1})
        token = "SELECT @iofence_row_token"
        assert conn.exec_driver_sql(token).scalar() == 21  # the holder's, in its transaction
        conn.rollback()
    token, verdict = _driver_write(engine, table)
    assert token is None
    assert verdict.startswith("iofence: unfenced update")


def test_a_pooled_connection_carries_no_token_after_commit(engine: Engine, table: Table) -> None:
    with engine.begin() as conn:
        RowGuard(conn, table).upsert(20, {"k": "a", "v": 1})
    token, verdict = _driver_write(engine, table)
    assert token is None
    assert verdict.startswith("iofence: unfenced update")


def test_a_pooled_connection_carries_no_token_after_rollback(engine: Engine, table: Table) -> None:
    with engine.begin() as conn:
        RowGuard(conn, table).upsert(20, {"k": "a", "v": 1})
    with engine.connect() as conn:
        conn.begin()
        RowGuard(conn, table).update("a", 21, {"v": 2})
        conn.rollback()
    expected = f"iofence: unfenced update of {table.name}: the transaction carries no fencing token"
    assert _driver_write(engine, table) == (None, expected)


def test_a_connection_returned_mid_transaction_carries_no_token(
    engine: Engine, table: Table
) -> None:
    with engine.begin() as conn:
        RowGuard(conn, table).upsert(20, {"k": "a", "v": 1})
    conn = engine.connect()
    conn.begin()
    RowGuard(conn, table).update("a", 21, {"v": 2})
    conn.close()  # back to the pool, its transaction open: the pool's reset clears it
    token, verdict = _driver_write(engine, table)
    assert token is None
    assert verdict.startswith("iofence: unfenced update")


def test_a_connection_that_cannot_be_cleared_is_discarded(engine: Engine, table: Table) -> None:
    """The session is killed between the fenced write and the commit: the commit fails
    as SQLAlchemy reports a lost connection, the pool discards the connection, and the
    next transaction starts a new session."""
    with engine.begin() as conn:
        RowGuard(conn, table).upsert(20, {"k": "a", "v": 1})
    with engine.connect() as conn:
        conn.begin()
        RowGuard(conn, table).update("a", 21, {"v": 2})
        thread = conn.exec_driver_sql("SELECT CONNECTION_ID()").scalar()
        with engine.pool._creator() as admin, admin.cursor() as cursor:  # type: ignore[attr-defined]
            cursor.execute(f"KILL {int(thread)}")
        with pytest.raises(sa_exc.OperationalError) as failed:
            conn.commit()
        assert failed.value.connection_invalidated
    token, verdict = _driver_write(engine, table)
    assert token is None
    assert verdict.startswith("iofence: unfenced update")
    with engine.begin() as conn:
        assert conn.execute(text(f"SELECT v, fence FROM {table.name}")).one() == (1, 20)


def test_a_session_variable_that_cannot_be_cleared_fails_the_commit_as_sqlalchemy_does(
    engine: Engine, table: Table
) -> None:
    """A bound session without a claim keeps its token in a session variable until the
    transaction ends; its connection is killed before the commit. The clearing before the
    COMMIT fails, and the commit raises what SQLAlchemy raises for a lost connection (not
    the driver's bare error, which SQLAlchemy never saw): the connection is discarded and
    nothing was committed."""
    with engine.begin() as conn:
        RowGuard(conn, table).upsert(20, {"k": "a", "v": 1})
    with Session(engine) as session:
        bind(session, token=21, claim=False)
        session.execute(update(table).where(table.c.k == "a").values(v=2))
        conn = session.connection()
        thread = conn.exec_driver_sql("SELECT CONNECTION_ID()").scalar()
        assert conn.exec_driver_sql("SELECT @iofence_token").scalar() == 21
        with engine.pool._creator() as admin, admin.cursor() as cursor:  # type: ignore[attr-defined]
            cursor.execute(f"KILL {int(thread)}")
        with pytest.raises(sa_exc.OperationalError) as failed:
            session.commit()
        assert failed.value.connection_invalidated
        assert isinstance(failed.value.orig, pymysql.err.OperationalError)
    token, verdict = _driver_write(engine, table)
    assert token is None
    assert verdict.startswith("iofence: unfenced update")
    with engine.begin() as conn:
        assert conn.execute(text(f"SELECT v, fence FROM {table.name}")).one() == (1, 20)


def test_the_unfenced_option_opts_out_for_its_statement_only(engine: Engine, table: Table) -> None:
    with engine.begin() as conn:
        RowGuard(conn, table).upsert(20, {"k": "a", "v": 1})
    update = text(f"UPDATE {table.name} SET v = 3").execution_options(unfenced=True)
    with engine.begin() as conn:
        conn.execute(update)  # the database sees the opt-out, for this statement
        assert conn.exec_driver_sql("SELECT @iofence_unfenced").scalar() is None
    assert _driver_write(engine, table)[1].startswith("iofence: unfenced update")


def test_the_guards_refuse_a_table_with_outdated_triggers(engine: Engine, table: Table) -> None:
    with engine.begin() as conn:
        for statement in drop_trigger_ddl(table.name, dialect="mariadb"):
            conn.exec_driver_sql(statement)
        for statement in trigger_ddl(table.name, dialect="mariadb", tombstone="deleted"):
            conn.exec_driver_sql(statement.replace("iofence judge 1:", "iofence judge 0:"))
    with engine.begin() as conn, pytest.raises(ConfigurationError, match="they are version 0"):
        RowGuard(conn, table).upsert(5, {"k": "a", "v": 1})
    with engine.begin() as conn:
        install_triggers(conn, table)  # an upgrade, in place
    with engine.begin() as conn:
        RowGuard(conn, table).upsert(5, {"k": "a", "v": 1})


def test_fence_ddl_through_the_mariadb_client_installs_a_current_judge(
    mariadb_server: MariaDBServer, database: str, engine: Engine
) -> None:
    name = f"cli_{secrets.token_hex(4)}"
    register = f"reg_{secrets.token_hex(4)}"
    with engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE TABLE {name} (k VARCHAR(8) PRIMARY KEY, v INT)")
    script = subprocess.run(
        [sys.executable, "-m", "fence", "ddl", "--dialect", "mariadb", "--table", name,
         "--register", register],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout  # fmt: skip
    done = _client(mariadb_server, database, script)
    assert done.returncode == 0, done.stderr
    metadata = MetaData()
    table = Table(
        name,
        metadata,
        Column("k", String(8), primary_key=True),
        Column("v", BigInteger),
        fence_column(),
        tombstone_column(),
    )
    with engine.begin() as conn:
        RowGuard(conn, table).upsert(7, {"k": "a", "v": 1})
        FenceRegister(conn, fence_register_table(metadata, register)).claim("s", 7)
    assert _driver_write(engine, table)[1].startswith("iofence: unfenced update")


async def _async_table(mariadb_url: str) -> tuple[AsyncEngine, Table]:
    """An asyncio engine (aiomysql, one pooled connection) and a fenced table made with its
    judge, holding the row ``a`` written by the holder of token 20."""
    engine = create_async_engine(
        mariadb_url.replace("+pymysql", "+aiomysql"), pool_size=1, max_overflow=0
    )
    metadata = MetaData()
    table = Table(
        f"async_{secrets.token_hex(4)}",
        metadata,
        Column("k", String(32), primary_key=True),
        Column("v", BigInteger, nullable=True),
        fence_column(),
        tombstone_column(),
    )
    async with engine.begin() as conn:
        await conn.run_sync(metadata.create_all)
    async with engine.begin() as conn:
        await AsyncRowGuard(conn, table).upsert(20, {"k": "a", "v": 1})
    return engine, table


async def test_an_asyncio_pooled_connection_carries_no_token(mariadb_url: str) -> None:
    engine, table = await _async_table(mariadb_url)
    try:
        async with engine.begin() as conn:
            token = "SELECT COALESCE(@iofence_row_token, @iofence_token)"
            assert (await conn.exec_driver_sql(token)).scalar() is None
            with pytest.raises(UnfencedWriteError):
                await conn.execute(
                    text(f"UPDATE {table.name} SET v = 2").execution_options(iofence=True)
                )
        async with engine.connect() as conn:
            await conn.begin()
            with pytest.raises(StaleTokenError) as caught:
                await AsyncRowGuard(conn, table).upsert(19, {"k": "a", "v": 3})
            assert (caught.value.scope, caught.value.fence) == (f"{table.name}('a')", 20)
            await conn.rollback()
    finally:
        await engine.dispose()


async def test_asyncio_a_session_variable_that_cannot_be_cleared_fails_the_commit(
    mariadb_url: str,
) -> None:
    """The asyncio twin (aiomysql) of the test above: the clearing before the ``COMMIT``
    meets a killed session; the commit raises SQLAlchemy's error for a lost connection,
    the connection is discarded, nothing was committed."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.ext.asyncio import AsyncSession

    engine, table = await _async_table(mariadb_url)
    url = make_url(mariadb_url)
    admin = pymysql.connect(
        host=url.host, port=url.port, user=url.username, password=url.password, autocommit=True
    )
    try:
        async with AsyncSession(engine) as session:
            bind(session, token=21, claim=False)
            await session.execute(update(table).where(table.c.k == "a").values(v=2))
            conn = await session.connection()
            thread = (await conn.exec_driver_sql("SELECT CONNECTION_ID()")).scalar()
            assert (await conn.exec_driver_sql("SELECT @iofence_token")).scalar() == 21
            with admin.cursor() as cursor:
                cursor.execute(f"KILL {int(thread)}")
            with pytest.raises(sa_exc.OperationalError) as failed:
                await session.commit()
            assert failed.value.connection_invalidated
        async with engine.begin() as conn:
            token = "SELECT COALESCE(@iofence_row_token, @iofence_token)"
            assert (await conn.exec_driver_sql(token)).scalar() is None  # a new session
            row = (await conn.execute(text(f"SELECT v, fence FROM {table.name}"))).one()
            assert tuple(row) == (1, 20)
    finally:
        admin.close()
        await engine.dispose()


def test_a_mysql_url_installs_the_judge_by_drop_and_create(mariadb_url: str) -> None:
    """``mysql+pymysql://`` gets SQLAlchemy's MySQL dialect, whose DDL has no ``CREATE OR
    REPLACE TRIGGER`` (MySQL 8 lacks it): the judge is dropped and created. Run here on
    MariaDB, which takes both; MySQL itself is not tested."""
    ddl = trigger_ddl("t", dialect="mysql")
    assert [s.split()[0] for s in ddl] == ["DROP", "CREATE"] * 5
    assert "OR REPLACE" not in " ".join(ddl)
    engine = create_engine(mariadb_url.replace("mariadb+pymysql", "mysql+pymysql"))
    assert engine.dialect.name == "mysql"
    metadata = MetaData()
    table = Table(
        f"mysql_{secrets.token_hex(4)}",
        metadata,
        Column("k", String(32), primary_key=True),
        Column("v", BigInteger, nullable=True),
        fence_column(),
        tombstone_column(),
    )
    try:
        metadata.create_all(engine)
        with engine.begin() as conn:
            install_triggers(conn, table)  # again: an upgrade
            RowGuard(conn, table).upsert(20, {"k": "a", "v": 1})
        with engine.connect() as conn, pytest.raises(StaleTokenError):
            RowGuard(conn, table).upsert(19, {"k": "a", "v": 2})
        token, verdict = _driver_write(engine, table)
        assert token is None
        assert verdict.startswith("iofence: unfenced update")
    finally:
        engine.dispose()
