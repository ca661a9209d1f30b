"""The database's judge (C14) on PostgreSQL: its rules with bare SQL, the check the writers
run before their first write, and its refusals as iofence errors.

The rules are tried from plain psycopg connections that use nothing of iofence but the
DDL text: a write without a token, with a stale token and as the current holder, on a
fenced table and on a fence register. The write-path catalogue
(``tests/test_write_paths_db.py``) tries every path a write can take.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from sqlalchemy import Column, Integer, MetaData, Table, create_engine, text

from fence import ConfigurationError, Reason, StaleTokenError, UnfencedWriteError
from fence.adapters import psycopg as pg_guard
from fence.adapters.ddl import (
    JUDGE_VERSION,
    SQLSTATE_REFUSED,
    SQLSTATE_STALE,
    SQLSTATE_UNFENCED,
    UNFENCED_SQL,
    drop_trigger_ddl,
    rewrite_trigger_ddl,
    trigger_ddl,
)
from fence.adapters.sql import FenceRegister, RowGuard, fence_column, install_triggers
from fence.adapters.sql import fence_register_table as register_table
from fence.adapters.sql import tombstone_column as tombstone
from tests.servers import PostgresServer
from tests.sqlite_files import sqlite_file

pytestmark = pytest.mark.postgres

OK = "ok"


@pytest.fixture
def db(postgres_server: PostgresServer) -> Iterator[psycopg.Connection[Any]]:
    """A plain psycopg connection (no iofence code on it), autocommit."""
    with psycopg.connect(postgres_server.conninfo, autocommit=True) as conn:
        yield conn


@pytest.fixture
def accounts(db: psycopg.Connection[Any]) -> str:
    """``accounts_x(id PK, balance, fence, deleted)``: rows 1 and 2 at fence 10, with the
    judge installed by its DDL text."""
    name = f"judged_{secrets.token_hex(4)}"
    db.execute(
        sql.SQL(
            "CREATE TABLE {} (id INT PRIMARY KEY, balance INT NOT NULL DEFAULT 0, "
            "fence BIGINT NOT NULL DEFAULT 0, deleted BOOLEAN NOT NULL DEFAULT FALSE)"
        ).format(sql.Identifier(name))
    )
    db.execute(
        sql.SQL("INSERT INTO {} VALUES (1, 0, 10, false), (2, 0, 10, false)").format(
            sql.Identifier(name)
        )
    )
    with db.transaction():
        for statement in trigger_ddl(name, tombstone="deleted"):
            db.execute(statement.encode())
    return name


def attempt(
    db: psycopg.Connection[Any], token: int | str | None, *statements: str, opt_out: bool = False
) -> str:
    """Run ``statements`` in one transaction with ``token`` as its token (``None``: none);
    return ``OK`` or the SQLSTATE that refused it (the transaction is rolled back then)."""
    try:
        with db.transaction():
            if opt_out:
                db.execute(UNFENCED_SQL)
            if token is not None:
                db.execute("SELECT set_config('iofence.token', %s, true)", (str(token),))
            for statement in statements:
                db.execute(statement.encode())
    except psycopg.Error as exc:
        return str(exc.sqlstate)
    return OK


def rows(db: psycopg.Connection[Any], table: str) -> list[tuple[Any, ...]]:
    query = sql.SQL("SELECT id, balance, fence, deleted FROM {} ORDER BY id")
    return [tuple(r) for r in db.execute(query.format(sql.Identifier(table)))]


# -- the rules, with bare SQL ---------------------------------------------------------------


UPDATE = "UPDATE {t} SET balance = 1 WHERE id = 1"
INSERT = "INSERT INTO {t} (id) VALUES (3)"
UPSERT = "INSERT INTO {t} (id) VALUES (1) ON CONFLICT (id) DO UPDATE SET balance = 9"
DELETE = "DELETE FROM {t} WHERE id = 1"
LOWER = "UPDATE {t} SET fence = 1 WHERE id = 1"

RULES = [
    # (label, statement with {t}, token, opt-out, expected verdict)
    ("update without a token", UPDATE, None, False, SQLSTATE_UNFENCED),
    ("update, stale", UPDATE, 5, False, SQLSTATE_STALE),
    ("update, the holder", UPDATE, 20, False, OK),
    ("update, an equal token", UPDATE, 10, False, OK),
    ("insert without a token", INSERT, None, False, SQLSTATE_UNFENCED),
    ("insert, the holder", INSERT, 20, False, OK),
    ("upsert, stale", UPSERT, 5, False, SQLSTATE_STALE),
    ("upsert, the holder", UPSERT, 20, False, OK),
    ("hard delete, the holder", DELETE, 20, False, SQLSTATE_REFUSED),
    ("hard delete, stale", DELETE, 5, False, SQLSTATE_STALE),
    ("hard delete, opted out", DELETE, None, True, OK),
    ("truncate, the holder", "TRUNCATE {t}", 20, False, SQLSTATE_REFUSED),
    ("truncate, opted out", "TRUNCATE {t}", None, True, OK),
    ("lowering, the holder", LOWER, 20, False, SQLSTATE_REFUSED),
    ("lowering, opted out", LOWER, None, True, SQLSTATE_REFUSED),
    ("update, opted out", UPDATE, None, True, OK),
    ("update, opted out with a stale token", UPDATE, 5, True, SQLSTATE_STALE),
    ("a token of 0", UPDATE, 0, False, SQLSTATE_UNFENCED),
    ("a token above 2**53 - 1", UPDATE, 2**53, False, SQLSTATE_UNFENCED),
]


@pytest.mark.parametrize(
    ("statement", "token", "opt_out", "expected"),
    [pytest.param(*rule[1:], id=rule[0]) for rule in RULES],
)
def test_the_judge_rules_on_every_write(
    db: psycopg.Connection[Any],
    accounts: str,
    statement: str,
    token: int | None,
    opt_out: bool,
    expected: str,
) -> None:
    before = rows(db, accounts)
    verdict = attempt(
        db, token, statement.format(t=sql.Identifier(accounts).as_string()), opt_out=opt_out
    )
    assert verdict == expected
    after = rows(db, accounts)
    if verdict != OK:
        assert after == before  # a refusal writes nothing
    elif token is not None and token >= 10:
        # An accepted write by a holder sets every row it touched to its token (C4).
        assert all(r[2] == token for r in after if r not in before)
    if opt_out and verdict == OK:
        assert all(r[2] == 10 for r in after)  # the opt-out never raises a fence


def test_the_token_is_the_transactions_and_ends_with_it(
    db: psycopg.Connection[Any], accounts: str
) -> None:
    t = sql.Identifier(accounts).as_string()
    with db.transaction():
        db.execute("SELECT set_config('iofence.token', '20', true)")
        db.execute(f"UPDATE {t} SET balance = 5 WHERE id = 1".encode())
    # The same connection, the next transaction: no token is left behind (a pool's reuse).
    assert attempt(db, None, f"UPDATE {t} SET balance = 6 WHERE id = 1") == SQLSTATE_UNFENCED
    assert rows(db, accounts)[0] == (1, 5, 20, False)


def test_a_stale_error_carries_scope_token_and_fence(
    db: psycopg.Connection[Any], accounts: str
) -> None:
    t = sql.Identifier(accounts).as_string()

    def stale_update() -> None:
        with db.transaction():
            db.execute("SELECT set_config('iofence.token', '5', true)")
            db.execute(f"UPDATE {t} SET balance = 1 WHERE id = 2".encode())

    with pytest.raises(psycopg.Error) as caught:
        stale_update()
    assert caught.value.sqlstate == SQLSTATE_STALE
    assert caught.value.diag.table_name == accounts
    from fence.adapters._sql_common import judge_error

    err = judge_error(caught.value)
    assert isinstance(err, StaleTokenError)
    assert (err.scope, err.token, err.fence, err.reason) == (
        f"{accounts}(2)",
        5,
        10,
        Reason.STALE,
    )


def test_the_register_is_judged_and_never_loses_a_row(db: psycopg.Connection[Any]) -> None:
    name = f"reg_{secrets.token_hex(4)}"
    db.execute(
        f"CREATE TABLE {name} (scope VARCHAR(512) PRIMARY KEY, fence BIGINT NOT NULL)".encode()
    )
    db.execute(f"INSERT INTO {name} VALUES ('order:1', 10)".encode())
    with db.transaction():
        for statement in trigger_ddl(name, register=True):
            db.execute(statement.encode())
    claim = (
        f"INSERT INTO {name} AS cur VALUES ('order:1', 0) ON CONFLICT (scope) DO UPDATE "
        "SET fence = EXCLUDED.fence WHERE cur.fence <= EXCLUDED.fence"
    )
    assert attempt(db, None, claim) == SQLSTATE_UNFENCED
    assert attempt(db, 5, claim) == OK  # the claim's own predicate skips the row: no write
    assert attempt(db, 5, f"UPDATE {name} SET fence = fence") == SQLSTATE_STALE
    assert attempt(db, 20, f"UPDATE {name} SET fence = 1") == SQLSTATE_REFUSED
    assert attempt(db, 20, f"DELETE FROM {name}") == SQLSTATE_REFUSED
    assert attempt(db, 20, claim) == OK  # the fence value is the token's
    assert attempt(db, None, f"DELETE FROM {name}", opt_out=True) == OK
    assert db.execute(f"SELECT count(*) FROM {name}".encode()).fetchone() == (0,)


def test_without_the_triggers_nothing_judges(db: psycopg.Connection[Any], accounts: str) -> None:
    """The rules above are the triggers': dropped, a write without a token lands."""
    t = sql.Identifier(accounts).as_string()
    with db.transaction():
        for statement in drop_trigger_ddl(accounts):
            db.execute(statement.encode())
    assert attempt(db, None, f"UPDATE {t} SET fence = 0 WHERE id = 1") == OK


# -- the writers' check ---------------------------------------------------------------------


def _plain(db: psycopg.Connection[Any]) -> str:
    name = f"unjudged_{secrets.token_hex(4)}"
    db.execute(
        f"CREATE TABLE {name} (id INT PRIMARY KEY, v INT, fence BIGINT NOT NULL DEFAULT 0)".encode()
    )
    return name


def _table(name: str, metadata: MetaData | None = None, *extra: Any) -> Table:
    return Table(
        name,
        metadata if metadata is not None else MetaData(),
        Column("id", Integer, primary_key=True),
        Column("v", Integer),
        fence_column(),
        *extra,
    )


def test_guards_refuse_a_table_without_its_judge(
    db: psycopg.Connection[Any], postgres_server: PostgresServer
) -> None:
    name = _plain(db)
    with psycopg.connect(postgres_server.conninfo) as conn:
        with pytest.raises(ConfigurationError, match="missing") as caught:
            pg_guard.RowGuard(conn, name).upsert(5, {"id": 1, "v": 1})
        assert f"--table {name}" in str(caught.value)
        conn.rollback()
        pg_guard.install_triggers(conn, name)
        pg_guard.RowGuard(conn, name).upsert(5, {"id": 1, "v": 1})
        conn.commit()
    engine = create_engine(postgres_server.url)
    table = Table(
        name,
        MetaData(),
        Column("id", Integer, primary_key=True),
        Column("v", Integer),
        fence_column(),
    )
    try:
        with engine.begin() as conn:
            RowGuard(conn, table).update(1, 6, {"v": 2})
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    "damage",
    [
        "ALTER TABLE {t} DISABLE TRIGGER zz_iofence_update",
        "DROP TRIGGER zz_iofence_truncate ON {t}",
        "COMMENT ON FUNCTION {f}() IS 'iofence judge 0: kind=rows fence=fence'",
        "COMMENT ON FUNCTION {f}() IS 'iofence judge {v}: kind=rows fence=other'",
    ],
    ids=["disabled", "dropped", "older version", "another fence column"],
)
def test_every_writer_refuses_a_damaged_judge(
    db: psycopg.Connection[Any], postgres_server: PostgresServer, damage: str
) -> None:
    name = _plain(db)
    pg_guard.install_triggers(db, name)
    db.execute(
        damage.format(
            t=sql.Identifier(name).as_string(),
            f=sql.Identifier(f"iofence_judge_{name}").as_string(),
            v=JUDGE_VERSION,
        ).encode()
    )
    engine = create_engine(postgres_server.url)
    table = Table(
        name,
        MetaData(),
        Column("id", Integer, primary_key=True),
        Column("v", Integer),
        fence_column(),
    )
    try:
        with psycopg.connect(postgres_server.conninfo) as conn, pytest.raises(ConfigurationError):
            pg_guard.RowGuard(conn, name).upsert(5, {"id": 1, "v": 1})
        with engine.begin() as conn, pytest.raises(ConfigurationError, match="install them"):
            RowGuard(conn, table).upsert(5, {"id": 1, "v": 1})
    finally:
        engine.dispose()


def test_the_check_reads_the_catalogue_once_per_table_and_connection(
    postgres_server: PostgresServer,
) -> None:
    engine = create_engine(postgres_server.url, pool_size=1, max_overflow=0)
    metadata = MetaData()
    table = Table(
        f"once_{secrets.token_hex(4)}",
        metadata,
        Column("id", Integer, primary_key=True),
        Column("v", Integer),
        fence_column(),
    )
    register = register_table(metadata, f"once_reg_{secrets.token_hex(4)}")
    sent: list[str] = []
    try:
        metadata.create_all(engine)  # installs the judge of both (after_create)
        from sqlalchemy import event

        event.listen(engine, "before_cursor_execute", lambda c, cur, stmt, *a: sent.append(stmt))
        for token in (5, 6, 7):
            with engine.begin() as conn:
                RowGuard(conn, table).upsert(token, {"id": 1, "v": token})
                FenceRegister(conn, register).claim("a", token)
        checks = [s for s in sent if "pg_trigger" in s]
        assert len(checks) == 2  # one per table, on the one connection
        assert len(sent) == 2 + 3 * 2
    finally:
        metadata.drop_all(engine)
        engine.dispose()


def test_install_triggers_upgrades_in_place(db: psycopg.Connection[Any]) -> None:
    name = _plain(db)
    pg_guard.install_triggers(db, name)
    pg_guard.install_triggers(db, name)  # again: replaced, not doubled
    found = db.execute(
        "SELECT count(*) FROM pg_trigger WHERE tgrelid = %s::regclass AND NOT tgisinternal",
        (name,),
    ).fetchone()
    assert found == (4,)


# -- the judge's refusals as iofence errors -------------------------------------------------


def test_a_refusal_through_sqlalchemy_is_a_fence_error(
    db: psycopg.Connection[Any], accounts: str, postgres_server: PostgresServer
) -> None:
    """A table iofence has never seen declared (so the client-side gate knows nothing of
    it) is still judged; SQLAlchemy raises the judge's refusal as the iofence error."""
    engine = create_engine(postgres_server.url)
    t = sql.Identifier(accounts).as_string()
    try:
        with engine.begin() as conn, pytest.raises(UnfencedWriteError, match="no fencing token"):
            conn.execute(text(f"UPDATE {t} SET balance = 1 WHERE id = 1"))
        stale = f"UPDATE {t} SET balance = 1 WHERE id = 1"
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT set_config('iofence.token', '5', true)")
            with pytest.raises(StaleTokenError) as caught:
                conn.exec_driver_sql(stale)
        assert (caught.value.token, caught.value.fence) == (5, 10)
        with engine.begin() as conn, pytest.raises(UnfencedWriteError, match="TRUNCATE"):
            conn.exec_driver_sql(f"TRUNCATE {t}")
    finally:
        engine.dispose()
    assert rows(db, accounts) == [(1, 0, 10, False), (2, 0, 10, False)]


def test_the_unfenced_option_opts_out_for_its_statement_only(
    db: psycopg.Connection[Any], postgres_server: PostgresServer
) -> None:
    engine = create_engine(postgres_server.url)
    metadata = MetaData()
    table = Table(
        f"opt_{secrets.token_hex(4)}",
        metadata,
        Column("id", Integer, primary_key=True),
        Column("v", Integer),
        fence_column(),
        tombstone(),
    )
    try:
        metadata.create_all(engine)
        with engine.begin() as conn:
            conn.execute(table.insert().values(id=1, v=1).execution_options(unfenced=True))
            # The opt-out ended with its statement: the transaction's next write is judged.
            setting = "SELECT current_setting('iofence.unfenced', true)"
            assert conn.exec_driver_sql(setting).scalar() in ("", None)
        with engine.begin() as conn:
            assert conn.execute(table.select()).all() == [(1, 1, 0, False)]
            install_triggers(conn, table)  # idempotent: an upgrade in place
    finally:
        metadata.drop_all(engine)
        engine.dispose()


# -- fence doctor -----------------------------------------------------------------------------


def test_doctor_names_every_table_without_a_current_judge(postgres_server: PostgresServer) -> None:
    from fence._doctor import FAIL, OK, WARN, sql_checks

    name = f"doctor_{secrets.token_hex(4)}"
    with psycopg.connect(postgres_server.conninfo, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    conninfo = postgres_server.conninfo.replace("dbname=postgres", f"dbname={name}")
    url = postgres_server.url.rsplit("/", 1)[0] + f"/{name}"
    engine = create_engine(url)
    try:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            conn.execute(
                b"CREATE TABLE accounts (id INT PRIMARY KEY, fence BIGINT NOT NULL DEFAULT 0, "
                b"deleted BOOLEAN NOT NULL DEFAULT FALSE)"
            )
            conn.execute(b"CREATE TABLE old (id INT PRIMARY KEY, fence BIGINT NOT NULL)")
            pg_guard.install_triggers(conn, "old")
            conn.execute(b"COMMENT ON FUNCTION iofence_judge_old() IS 'iofence judge 0: kind=rows'")

            def judge_lines() -> list[tuple[str, str, str]]:
                checks = sql_checks(
                    engine, lease_table="fence_leases", schema=None, register="r", path=None
                )
                return [(c.status, c.finding, c.advice) for c in checks if "judge" in c.name]

            found = judge_lines()
            assert (found[0][0], found[0][1].split('"')[1]) == (FAIL, "accounts")
            assert "missing" in found[0][1]
            assert "--triggers-only --no-register --table accounts" in found[0][2]
            assert "version 0" in found[1][1]
            assert "--no-tombstone --table old" in found[1][2]
            assert found[2][0] == WARN  # no judge of table rewrites
            pg_guard.install_triggers(conn, "accounts", tombstone="deleted")
            pg_guard.install_triggers(conn, "old")  # the upgrade doctor named
            with conn.transaction():
                for statement in rewrite_trigger_ddl():
                    conn.execute(statement.encode())
            assert [status for status, _, _ in judge_lines()] == [OK, OK]
    finally:
        engine.dispose()
        with psycopg.connect(postgres_server.conninfo, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))


# -- SQLite ------------------------------------------------------------------------------------


def test_sqlite_guards_refuse_a_table_without_its_judge_and_the_token_ends_with_commit(
    tmp_path: Any,
) -> None:

    from fence.adapters._judge import sqlite_state

    path = tmp_path / "judged.db"
    with sqlite_file(path) as db:  # a table made by hand, before the judge
        db.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, v INTEGER, fence BIGINT NOT NULL)")
        db.execute("INSERT INTO t VALUES (1, 0, 10)")
    engine = create_engine(f"sqlite:///{path}")
    table = _table("t")
    try:
        with engine.begin() as conn, pytest.raises(ConfigurationError, match="--dialect sqlite"):
            RowGuard(conn, table).update(1, 20, {"v": 1})
        with engine.begin() as conn:
            install_triggers(conn, table)
        with engine.begin() as conn:
            RowGuard(conn, table).update(1, 20, {"v": 1})
            state = sqlite_state(conn)
            assert state is not None
            assert state.get_token() == 20
        assert state.get_token() is None  # the commit ended the transaction and its token
        with engine.begin() as conn, pytest.raises(UnfencedWriteError, match="no fencing token"):
            conn.exec_driver_sql("UPDATE t SET v = 2", execution_options={"iofence": True})
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT iofence_set_token(15)")
            with pytest.raises(StaleTokenError) as caught:
                conn.exec_driver_sql("UPDATE t SET v = 3", execution_options={"iofence": True})
            assert (caught.value.scope, caught.value.token) == ("t", 15)
        with engine.begin() as conn:
            assert conn.exec_driver_sql("SELECT v, fence FROM t").one() == (1, 20)
    finally:
        engine.dispose()


@pytest.mark.parametrize("name", ["odd{name}", "it's", 'say "t"', "a{0}b"])
def test_the_sqlite_judge_takes_any_table_name(tmp_path: Any, name: str) -> None:
    """The triggers' text quotes the table's name in identifiers and in their messages;
    braces, quotes and the like stay text."""
    engine = create_engine(f"sqlite:///{tmp_path / 'names.db'}")
    table = _table(name, MetaData(), tombstone())
    try:
        table.metadata.create_all(engine)  # the table and its judge
        with engine.begin() as conn:
            RowGuard(conn, table).upsert(10, {"id": 1, "v": 1})
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT iofence_set_token(5)")
            with pytest.raises(StaleTokenError):
                conn.execute(table.update().values(v=2), execution_options={"iofence": True})
        with engine.begin() as conn, pytest.raises(UnfencedWriteError, match="no fencing token"):
            conn.execute(table.delete(), execution_options={"iofence": True})
        with engine.begin() as conn:
            assert conn.execute(table.select()).one()[1:] == (1, 10, False)
    finally:
        engine.dispose()


def test_a_temporary_table_that_shadows_the_register_is_refused(
    db: psycopg.Connection[Any], postgres_server: PostgresServer
) -> None:
    """A temporary table of the register's name comes first in the search path: the claims
    would go to it, unjudged. Its check finds no triggers, so every claim is refused."""
    name = f"shadowed_{secrets.token_hex(4)}"
    db.execute(
        f"CREATE TABLE {name} (scope VARCHAR(512) PRIMARY KEY, fence BIGINT NOT NULL)".encode()
    )
    pg_guard.install_triggers(db, name, register=True)
    shadow = f"CREATE TEMP TABLE {name} (scope VARCHAR(512) PRIMARY KEY, fence BIGINT NOT NULL)"
    with psycopg.connect(postgres_server.conninfo) as conn:
        pg_guard.FenceRegister(conn, name).claim("a", 5)  # the real one, judged
        conn.commit()
    with psycopg.connect(postgres_server.conninfo) as conn:
        conn.execute(shadow.encode())
        with pytest.raises(ConfigurationError, match="missing"):
            pg_guard.FenceRegister(conn, name).claim("a", 4)
    engine = create_engine(postgres_server.url)
    try:
        with engine.begin() as conn:
            conn.exec_driver_sql(shadow)
            with pytest.raises(ConfigurationError, match="missing"):
                FenceRegister(conn, register_table(MetaData(), name)).claim("a", 4)
    finally:
        engine.dispose()
