"""The database-level write-path catalogue (C14): every way a write reaches a fenced table
inside the database, judged by the database itself, whoever sends it.

Nothing of iofence runs on the writing side here but the DDL that installed the judge: the
writes come from bare psycopg connections and from ``psql`` in a subprocess. Each path is
tried three times against the same seeded rows (every fence at 10):

- **no token** (the transaction never set ``iofence.token``): refused, nothing written;
- a **stale** token (5): refused, nothing written;
- the **current holder** (20): accepted, and every row it wrote carries fence 20 (C4); or,
  for what would drop fences (a hard delete where a tombstone keeps the fence, ``TRUNCATE``,
  a table rewrite), refused unless the transaction opted out, which is then tried too.

The exceptions are written next to their rows: a new key (an ``INSERT`` or a ``COPY`` of a
key with no row and no tombstone) takes any token, since a missing fence counts as 0 (C4);
a claim (C8) or a tombstone is what shuts a stale writer out of a key.

The second test drops the triggers and runs the catalogue again: the refusals are gone,
so the catalogue can fail. The database is one of its own on the suite's cluster, since the
judge of table rewrites is an event trigger, which covers a whole database.
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
from psycopg import sql

from fence.adapters.ddl import (
    UNFENCED_SQL,
    drop_trigger_ddl,
    rewrite_trigger_ddl,
    trigger_ddl,
)
from tests.servers import PostgresServer
from tests.sqlite_files import sqlite_file

pytestmark = pytest.mark.postgres

SEED, STALE, CURRENT = 10, 5, 20
OK, REFUSED = "accepted", "refused"

# The fenced tables, with their kind: (name, trigger options).
FENCED = {
    "acct": {"tombstone": "deleted"},  # rows carry a tombstone flag
    "plain": {},  # no tombstone: a hard delete is judged by its token only
    "child": {},  # fenced, under a parent that cascades
    "reg": {"register": True},  # the fence register
}

SCHEMA = [
    (
        "CREATE TABLE acct (id INT PRIMARY KEY, balance INT NOT NULL DEFAULT 0, "
        "fence BIGINT NOT NULL DEFAULT 0, deleted BOOLEAN NOT NULL DEFAULT FALSE)"
    ),
    (
        "CREATE TABLE plain (id INT PRIMARY KEY, v INT NOT NULL DEFAULT 0, "
        "fence BIGINT NOT NULL DEFAULT 0)"
    ),
    "CREATE TABLE parent (id INT PRIMARY KEY, name TEXT)",
    (
        "CREATE TABLE child (id INT PRIMARY KEY, "
        "parent_id INT REFERENCES parent ON DELETE CASCADE ON UPDATE CASCADE, v INT, "
        "fence BIGINT NOT NULL DEFAULT 0)"
    ),
    "CREATE TABLE reg (scope VARCHAR(512) PRIMARY KEY, fence BIGINT NOT NULL)",
    "CREATE TABLE src (id INT PRIMARY KEY, v INT)",
    "CREATE VIEW acct_view AS SELECT id, balance FROM acct WHERE NOT deleted",
    (
        "CREATE FUNCTION bump(k INT) RETURNS VOID LANGUAGE plpgsql AS "
        "$$ BEGIN UPDATE acct SET balance = balance + 1 WHERE id = k; END $$"
    ),
    (
        "CREATE FUNCTION bump_definer(k INT) RETURNS VOID LANGUAGE sql SECURITY DEFINER AS "
        "$$ UPDATE acct SET balance = balance + 1 WHERE id = k $$"
    ),
    (
        "CREATE PROCEDURE bump_proc(k INT) LANGUAGE plpgsql AS "
        "$$ BEGIN UPDATE plain SET v = v + 1 WHERE id = k; END $$"
    ),
    # A write on another table that a trigger of the application's own carries on to acct.
    "CREATE TABLE audit (id INT)",
    (
        "CREATE FUNCTION audit_writes() RETURNS trigger LANGUAGE plpgsql AS "
        "$$ BEGIN UPDATE acct SET balance = balance + 100 WHERE id = NEW.id; RETURN NEW; END $$"
    ),
    (
        "CREATE TRIGGER audit_writes AFTER INSERT ON audit FOR EACH ROW "
        "EXECUTE FUNCTION audit_writes()"
    ),
]

SEED_ROWS = [
    # rows 1 and 2 live, 3 a tombstone: every fence at SEED
    f"INSERT INTO acct VALUES (1, 1, {SEED}, false), (2, 2, {SEED}, false), (3, 0, {SEED}, true)",
    f"INSERT INTO plain VALUES (1, 1, {SEED}), (2, 2, {SEED})",
    "INSERT INTO parent VALUES (1, 'p')",
    f"INSERT INTO child VALUES (1, 1, 1, {SEED})",
    f"INSERT INTO reg VALUES ('order:1', {SEED})",
    "INSERT INTO src VALUES (1, 7), (2, 8)",
]


@dataclass(frozen=True)
class Path:
    """One way a write reaches fenced rows.

    Attributes:
        name: what it is.
        run: the write, on a psycopg connection inside the attempt's transaction.
        none, stale, holder: the verdict expected without a token, with a stale one, and
            for the current holder.
        opted: the verdict for the current holder who opted out (where ``holder`` is
            refused); ``None`` if not tried.
        why: why a verdict differs from refused / refused / accepted.
    """

    name: str
    run: Callable[[psycopg.Connection[Any]], Any]
    none: str = REFUSED
    stale: str = REFUSED
    holder: str = OK
    opted: str | None = None
    why: str = ""


def _sql(*statements: str) -> Callable[[psycopg.Connection[Any]], None]:
    def run(conn: psycopg.Connection[Any]) -> None:
        for statement in statements:
            conn.execute(statement.encode())

    return run


def _copy(conn: psycopg.Connection[Any]) -> None:
    with conn.cursor().copy(b"COPY acct (id, balance) FROM STDIN") as copy:
        copy.write_row((4, 40))


def _copy_over_a_tombstone(conn: psycopg.Connection[Any]) -> None:
    # COPY only inserts: a key that a tombstone holds is a unique violation, never a write.
    with conn.cursor().copy(b"COPY plain (id, v) FROM STDIN") as copy:
        copy.write_row((5, 50))


def _prepared(conn: psycopg.Connection[Any], statement: str) -> None:
    name = f"w_{secrets.token_hex(4)}"  # PREPARE outlives a rolled-back transaction
    conn.execute(f"PREPARE {name} AS {statement}".encode())
    conn.execute(f"EXECUTE {name}".encode())
    conn.execute(f"DEALLOCATE {name}".encode())


NEW_KEY = "a new key has no fence: any token passes (C4); a claim or a tombstone shuts it"
DROPS = "it would drop fences: refused unless the transaction opted out"

PATHS = [
    Path("UPDATE of one row", _sql("UPDATE acct SET balance = 9 WHERE id = 1")),
    Path("UPDATE of every row", _sql("UPDATE acct SET balance = 0")),
    Path(
        "UPDATE ... FROM a join",
        _sql("UPDATE acct SET balance = s.v FROM src s WHERE acct.id = s.id"),
    ),
    Path(
        "UPDATE that lowers the fence",
        _sql("UPDATE acct SET fence = 1 WHERE id = 1"),
        holder=REFUSED,
        opted=REFUSED,
        why="a fence never goes down, opted out or not",
    ),
    Path("UPDATE that revives a tombstone", _sql("UPDATE acct SET deleted = false WHERE id = 3")),
    Path(
        "INSERT of a new key",
        _sql("INSERT INTO acct (id, balance) VALUES (4, 4)"),
        stale=OK,
        why=NEW_KEY,
    ),
    Path(
        "INSERT ... ON CONFLICT DO UPDATE (an existing row)",
        _sql(
            "INSERT INTO acct (id, balance) VALUES (1, 5) "
            "ON CONFLICT (id) DO UPDATE SET balance = 5"
        ),
    ),
    Path(
        "INSERT ... ON CONFLICT over a tombstone",
        _sql(
            "INSERT INTO acct (id, balance) VALUES (3, 5) "
            "ON CONFLICT (id) DO UPDATE SET balance = 5, deleted = false"
        ),
    ),
    Path(
        "INSERT ... SELECT over existing keys",
        _sql(
            "INSERT INTO acct (id, balance) SELECT id, v FROM src "
            "ON CONFLICT (id) DO UPDATE SET balance = EXCLUDED.balance"
        ),
    ),
    Path(
        "MERGE",
        _sql(
            "MERGE INTO acct USING src ON acct.id = src.id "
            "WHEN MATCHED THEN UPDATE SET balance = src.v"
        ),
    ),
    Path(
        "a data-modifying CTE",
        _sql(
            "WITH w AS (UPDATE acct SET balance = 7 WHERE id = 1 RETURNING id) "
            "SELECT count(*) FROM w"
        ),
    ),
    Path(
        "a data-modifying CTE under another statement",
        _sql(
            "WITH w AS (UPDATE plain SET v = 7 RETURNING id) "
            "INSERT INTO src SELECT id + 10, 0 FROM w"
        ),
    ),
    Path(
        "DELETE where a tombstone keeps the fence",
        _sql("DELETE FROM acct WHERE id = 1"),
        holder=REFUSED,
        opted=OK,
        why=DROPS,
    ),
    Path("DELETE of a row without a tombstone flag", _sql("DELETE FROM plain WHERE id = 1")),
    Path("ON DELETE CASCADE from an unfenced parent", _sql("DELETE FROM parent WHERE id = 1")),
    Path(
        "ON UPDATE CASCADE from an unfenced parent", _sql("UPDATE parent SET id = 9 WHERE id = 1")
    ),
    Path("TRUNCATE", _sql("TRUNCATE acct"), none=REFUSED, holder=REFUSED, opted=OK, why=DROPS),
    Path(
        "TRUNCATE ... CASCADE of an unfenced parent",
        _sql("TRUNCATE parent CASCADE"),
        holder=REFUSED,
        opted=OK,
        why=DROPS,
    ),
    Path("a function", _sql("SELECT bump(1)")),
    Path("a SECURITY DEFINER function", _sql("SELECT bump_definer(1)")),
    Path("a procedure (CALL)", _sql("CALL bump_proc(1)")),
    Path("a DO block", _sql("DO $$ BEGIN UPDATE acct SET balance = 3 WHERE id = 2; END $$")),
    Path(
        "dynamic SQL (EXECUTE format(...))",
        _sql("DO $$ BEGIN EXECUTE format('UPDATE %I SET v = 3', 'plain'); END $$"),
    ),
    Path("an updatable view", _sql("UPDATE acct_view SET balance = 6 WHERE id = 1")),
    Path(
        "a trigger of the application's own on another table", _sql("INSERT INTO audit VALUES (1)")
    ),
    Path(
        "a prepared statement",
        lambda conn: _prepared(conn, "UPDATE acct SET balance = 8 WHERE id = 1"),
    ),
    Path("COPY FROM (new keys)", _copy, stale=OK, why=NEW_KEY),
    Path(
        "COPY FROM into a table without a tombstone flag",
        _copy_over_a_tombstone,
        stale=OK,
        why=NEW_KEY,
    ),
    Path(
        "ALTER TABLE ... TYPE ... USING (a rewrite)",
        _sql("ALTER TABLE plain ALTER COLUMN v TYPE BIGINT USING v + 1"),
        holder=REFUSED,
        opted=OK,
        why="a rewrite fires no row trigger: the event trigger refuses it unless opted out",
    ),
    Path(
        "ALTER TABLE ... ADD COLUMN with a volatile default (a rewrite)",
        _sql("ALTER TABLE plain ADD COLUMN r FLOAT DEFAULT random()"),
        holder=REFUSED,
        opted=OK,
        why="a rewrite: refused unless opted out",
    ),
    Path(
        "the register: a claim's upsert without its predicate",
        _sql(
            "INSERT INTO reg VALUES ('order:1', 1) "
            "ON CONFLICT (scope) DO UPDATE SET fence = EXCLUDED.fence"
        ),
    ),
    Path(
        "the register: a new scope",
        _sql("INSERT INTO reg VALUES ('order:2', 1)"),
        stale=OK,
        why=NEW_KEY,
    ),
    Path(
        "the register: lowering a fence",
        _sql("UPDATE reg SET fence = 0"),
        holder=REFUSED,
        opted=REFUSED,
        why="a fence never goes down",
    ),
    Path(
        "the register: deleting a row", _sql("DELETE FROM reg"), holder=REFUSED, opted=OK, why=DROPS
    ),
]

MODES = {"none": None, "stale": STALE, "holder": CURRENT, "opted": CURRENT}


@pytest.fixture(scope="module")
def database(postgres_server: PostgresServer) -> Iterator[str]:
    """A database of its own on the suite's cluster, with the schema and the judge: the
    triggers of every fenced table and the register, and the judge of table rewrites."""
    name = f"paths_{secrets.token_hex(4)}"
    with psycopg.connect(postgres_server.conninfo, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    conninfo = postgres_server.conninfo.replace("dbname=postgres", f"dbname={name}")
    with psycopg.connect(conninfo, autocommit=True) as conn, conn.transaction():
        for statement in SCHEMA:
            conn.execute(statement.encode())
        for table, options in FENCED.items():
            for statement in trigger_ddl(table, **options):
                conn.execute(statement.encode())
        for statement in rewrite_trigger_ddl():
            conn.execute(statement.encode())
    yield conninfo
    with psycopg.connect(postgres_server.conninfo, autocommit=True) as admin:
        admin.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(name)))


def reseed(conn: psycopg.Connection[Any]) -> None:
    """Every table back to the seed, in an opted-out transaction of its own."""
    with conn.transaction():
        conn.execute(UNFENCED_SQL)
        conn.execute(b"TRUNCATE acct, plain, parent, child, reg, src, audit")
        for statement in SEED_ROWS:
            conn.execute(statement.encode())


def snapshot(conn: psycopg.Connection[Any]) -> dict[str, set[tuple[Any, ...]]]:
    """Every row of every table, with its fence where it has one."""
    return {
        table: {tuple(row) for row in conn.execute(f"SELECT * FROM {table}".encode())}
        for table in ("acct", "plain", "parent", "child", "reg", "src", "audit")
    }


def _fence_of(table: str, row: tuple[Any, ...]) -> int | None:
    position = {"acct": 2, "plain": 2, "child": 3, "reg": 1}.get(table)
    return None if position is None else row[position]


def attempt(conn: psycopg.Connection[Any], path: Path, mode: str) -> tuple[str, str]:
    """Run ``path`` in ``mode`` in a transaction that is rolled back; return the verdict
    and what is wrong with the rows it left (empty if nothing)."""
    reseed(conn)
    before = snapshot(conn)
    token = MODES[mode]
    tx = conn.transaction()
    tx.__enter__()
    try:
        if mode == "opted":
            conn.execute(UNFENCED_SQL)
        if token is not None:
            conn.execute("SELECT set_config('iofence.token', %s, true)", (str(token),))
        try:
            with conn.transaction():  # a savepoint: the refusal leaves the rows to read
                path.run(conn)
        except psycopg.Error as exc:
            if str(exc.sqlstate).startswith("IOF"):
                wrong = "" if snapshot(conn) == before else "a refusal changed rows"
                return REFUSED, wrong
            raise
        after = snapshot(conn)
        wrong = ""
        if mode != "opted":
            for table in FENCED:
                for row in after[table] - before[table]:
                    if _fence_of(table, row) != token:
                        wrong = f"{table} row {row} written without fence {token}"
        else:
            for table in FENCED:
                for row in after[table] - before[table]:
                    old = [r for r in before[table] if r[0] == row[0]]
                    if old and (_fence_of(table, row) or 0) < (_fence_of(table, old[0]) or 0):
                        wrong = f"{table} row {row}: the opt-out lowered a fence"
        return OK, wrong
    finally:
        tx.__exit__(psycopg.Rollback, psycopg.Rollback(), None)


def run_catalogue(conninfo: str) -> list[str]:
    """Every path in every mode; one line per verdict that is not the expected one."""
    failures = []
    with psycopg.connect(conninfo, autocommit=True) as conn:
        for path in PATHS:
            expected = {"none": path.none, "stale": path.stale, "holder": path.holder}
            if path.opted is not None:
                expected["opted"] = path.opted
            for mode, wanted in expected.items():
                got, wrong = attempt(conn, path, mode)
                if got != wanted or wrong:
                    failures.append(f"{path.name} [{mode}]: {got}, expected {wanted} {wrong}")
    return failures


def test_the_database_judges_every_write_path(database: str) -> None:
    assert run_catalogue(database) == []


def test_without_the_triggers_the_catalogue_fails(database: str) -> None:
    """The same catalogue against the same schema without the judge: the writes without a
    token go through, so the catalogue above is able to fail."""
    with psycopg.connect(database, autocommit=True) as conn, conn.transaction():
        for table in FENCED:
            for statement in drop_trigger_ddl(table):
                conn.execute(statement.encode())
        conn.execute(b"DROP EVENT TRIGGER iofence_rewrite")
    try:
        failures = run_catalogue(database)
        refused_without_a_token = [p.name for p in PATHS if p.none == REFUSED]
        for name in refused_without_a_token:
            assert any(f.startswith(f"{name} [none]") for f in failures), name
    finally:
        with psycopg.connect(database, autocommit=True) as conn, conn.transaction():
            for table, options in FENCED.items():
                for statement in trigger_ddl(table, **options):
                    conn.execute(statement.encode())
            for statement in rewrite_trigger_ddl():
                conn.execute(statement.encode())


@pytest.mark.skipif(shutil.which("psql") is None, reason="psql is not installed")
def test_another_program_psql_is_judged_too(database: str) -> None:
    """``psql`` in a subprocess: another program, which never imports iofence."""
    host, port = _host_port(database)
    dbname = database.split("dbname=")[1].split()[0]
    base = ["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-h", host, "-p", port, "-U", "postgres"]

    def psql(*commands: str) -> subprocess.CompletedProcess[str]:
        args = [*base, "-d", dbname]
        for command in commands:
            args += ["-c", command]
        return subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)

    with psycopg.connect(database, autocommit=True) as conn:
        reseed(conn)
        refused = psql("UPDATE acct SET balance = 99 WHERE id = 1")
        assert refused.returncode != 0
        assert "iofence: unfenced update" in refused.stderr
        stale = psql(
            "BEGIN",
            f"SELECT set_config('iofence.token', '{STALE}', true)",
            "UPDATE acct SET balance = 99 WHERE id = 1",
            "COMMIT",
        )
        assert "iofence: stale token 5" in stale.stderr
        assert snapshot(conn)["acct"] == {
            (1, 1, SEED, False),
            (2, 2, SEED, False),
            (3, 0, SEED, True),
        }
        held = psql(
            "BEGIN",
            f"SELECT set_config('iofence.token', '{CURRENT}', true)",
            "UPDATE acct SET balance = 99 WHERE id = 1",
            "COMMIT",
        )
        assert held.returncode == 0, held.stderr
        assert (1, 99, CURRENT, False) in snapshot(conn)["acct"]


def _host_port(conninfo: str) -> tuple[str, str]:
    fields = dict(part.split("=", 1) for part in conninfo.split())
    return fields["host"], fields["port"]


# -- SQLite -----------------------------------------------------------------------------------
#
# SQLite's triggers call functions that iofence registers on the connections of its engines
# (``iofence_token()``...). The writes below run on such a connection's DB-API cursor, with
# raw SQL that no gate reads; the token is set the way any code on it could set it
# (``SELECT iofence_set_token(t)``). A connection without the functions (another program, the
# ``sqlite3`` shell) cannot write a judged table at all.

SQLITE_SCHEMA = [
    (
        "CREATE TABLE acct (id INTEGER PRIMARY KEY, balance INTEGER NOT NULL DEFAULT 0, "
        "fence BIGINT NOT NULL DEFAULT 0, deleted BOOLEAN NOT NULL DEFAULT 0)"
    ),
    (
        "CREATE TABLE plain (id INTEGER PRIMARY KEY, v INTEGER NOT NULL DEFAULT 0, "
        "fence BIGINT NOT NULL DEFAULT 0)"
    ),
    "CREATE TABLE parent (id INTEGER PRIMARY KEY, name TEXT)",
    (
        "CREATE TABLE child (id INTEGER PRIMARY KEY, parent_id INTEGER REFERENCES parent "
        "ON DELETE CASCADE ON UPDATE CASCADE, v INTEGER, fence BIGINT NOT NULL DEFAULT 0)"
    ),
    "CREATE TABLE reg (scope VARCHAR(512) PRIMARY KEY, fence BIGINT NOT NULL)",
    "CREATE TABLE src (id INTEGER PRIMARY KEY, v INTEGER)",
    "CREATE TABLE audit (id INTEGER)",
    (
        "CREATE TRIGGER audit_writes AFTER INSERT ON audit FOR EACH ROW BEGIN "
        "UPDATE acct SET balance = balance + 100 WHERE id = NEW.id; END"
    ),
    "CREATE VIEW acct_view AS SELECT id, balance FROM acct WHERE NOT deleted",
    (
        "CREATE TRIGGER acct_view_update INSTEAD OF UPDATE ON acct_view BEGIN "
        "UPDATE acct SET balance = NEW.balance WHERE id = OLD.id; END"
    ),
]

_REG_UPSERT = (
    "INSERT INTO reg VALUES ('order:1', {value}) "
    "ON CONFLICT (scope) DO UPDATE SET fence = excluded.fence"
)
_UPSERT_ACCT = (
    "INSERT INTO acct (id, balance) VALUES (1, 5) ON CONFLICT (id) DO UPDATE SET balance = 5"
)
_CTE_UPDATE = (
    "WITH w AS (SELECT 1 AS id) UPDATE acct SET balance = 7 WHERE id IN (SELECT id FROM w)"
)
_REPLACE = "INSERT OR REPLACE INTO plain (id, v) VALUES (1, 5)"
NO_NEW = (
    "SQLite's BEFORE triggers cannot set NEW.fence to the token as PostgreSQL's do: "
    "the value written, 1, would lower the fence"
)
REPLACE_GAP = (
    "REPLACE deletes the row it replaces without its delete trigger unless "
    "recursive_triggers is on: a stale token set by hand on iofence's own connection gets "
    "through (docs/database-judge.md)"
)

SQLITE_PATHS = [
    Path("UPDATE of one row", _sql("UPDATE acct SET balance = 9 WHERE id = 1")),
    Path("UPDATE of every row", _sql("UPDATE acct SET balance = 0")),
    Path(
        "UPDATE ... FROM", _sql("UPDATE acct SET balance = src.v FROM src WHERE acct.id = src.id")
    ),
    Path(
        "UPDATE that lowers the fence",
        _sql("UPDATE acct SET fence = 1 WHERE id = 1"),
        holder=REFUSED,
        opted=REFUSED,
        why="a fence never goes down",
    ),
    Path("UPDATE that revives a tombstone", _sql("UPDATE acct SET deleted = 0 WHERE id = 3")),
    Path(
        "INSERT of a new key",
        _sql("INSERT INTO acct (id, balance) VALUES (4, 4)"),
        stale=OK,
        why=NEW_KEY,
    ),
    Path("INSERT ... ON CONFLICT DO UPDATE (an existing row)", _sql(_UPSERT_ACCT)),
    Path(
        "INSERT OR REPLACE, recursive_triggers on", _sql("PRAGMA recursive_triggers = ON", _REPLACE)
    ),
    Path(
        "INSERT OR REPLACE, recursive_triggers off (the default)",
        _sql(_REPLACE),
        stale=OK,
        why=REPLACE_GAP,
    ),
    Path(
        "DELETE where a tombstone keeps the fence",
        _sql("DELETE FROM acct WHERE id = 1"),
        holder=REFUSED,
        opted=OK,
        why=DROPS,
    ),
    Path("DELETE of a row without a tombstone flag", _sql("DELETE FROM plain WHERE id = 1")),
    Path("DELETE of every row (no TRUNCATE in SQLite)", _sql("DELETE FROM plain")),
    Path("ON DELETE CASCADE from an unfenced parent", _sql("DELETE FROM parent WHERE id = 1")),
    Path(
        "ON UPDATE CASCADE from an unfenced parent", _sql("UPDATE parent SET id = 9 WHERE id = 1")
    ),
    Path("a CTE feeding an UPDATE", _sql(_CTE_UPDATE)),
    Path(
        "a view with an INSTEAD OF trigger", _sql("UPDATE acct_view SET balance = 6 WHERE id = 1")
    ),
    Path(
        "a trigger of the application's own on another table", _sql("INSERT INTO audit VALUES (1)")
    ),
    Path(
        "the register: an upsert of a lower fence",
        _sql(_REG_UPSERT.format(value=1)),
        holder=REFUSED,
        why=NO_NEW,
    ),
    Path("the register: an upsert of the token", _sql(_REG_UPSERT.format(value="iofence_token()"))),
    Path(
        "the register: lowering a fence",
        _sql("UPDATE reg SET fence = 0"),
        holder=REFUSED,
        opted=REFUSED,
        why="a fence never goes down",
    ),
    Path(
        "the register: deleting a row", _sql("DELETE FROM reg"), holder=REFUSED, opted=OK, why=DROPS
    ),
]


class _SQLite:
    """A SQLite file with the schema, the judge, and a connection of iofence's own engine
    (the judge's functions registered on it), used through its DB-API cursor."""

    def __init__(self, path: Any) -> None:
        from sqlalchemy import create_engine

        import fence.adapters.sql  # noqa: F401 - registers the judge's functions on engines
        from fence.adapters._judge import sqlite_state

        self.engine = create_engine(f"sqlite:///{path}")
        self.conn = self.engine.connect()
        self.state = sqlite_state(self.conn)
        assert self.state is not None
        self.raw = self.conn.connection.dbapi_connection
        self.raw.isolation_level = None  # transactions by hand: BEGIN ... ROLLBACK
        self.raw.execute("PRAGMA foreign_keys = ON")  # (a no-op inside a transaction)
        for statement in SQLITE_SCHEMA:
            self.raw.execute(statement)
        for table, options in FENCED.items():
            for statement in trigger_ddl(table, dialect="sqlite", **options):
                self.raw.execute(statement)

    def reseed(self) -> None:
        self.raw.execute("PRAGMA recursive_triggers = OFF")
        self.state.unfenced, self.state.token = True, None
        try:
            for table in ("acct", "plain", "child", "parent", "reg", "src", "audit"):
                self.raw.execute(f"DELETE FROM {table}")
            for statement in SEED_ROWS:
                self.raw.execute(statement.replace("false", "0").replace("true", "1"))
        finally:
            self.state.unfenced = False

    def snapshot(self) -> dict[str, set[tuple[Any, ...]]]:
        return {
            table: {tuple(row) for row in self.raw.execute(f"SELECT * FROM {table}")}
            for table in ("acct", "plain", "parent", "child", "reg", "src", "audit")
        }

    def close(self) -> None:
        self.conn.close()
        self.engine.dispose()


class _Cursor:
    """What a path's ``run`` calls (``execute``), on the SQLite connection."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw

    def execute(self, statement: bytes) -> Any:
        return self.raw.execute(statement.decode())


def sqlite_attempt(db: _SQLite, path: Path, mode: str) -> tuple[str, str]:
    import sqlite3

    db.reseed()
    before = db.snapshot()
    token = MODES[mode]
    db.raw.execute("BEGIN")
    try:
        db.state.unfenced = mode == "opted"
        if token is not None:
            db.raw.execute("SELECT iofence_set_token(?)", (token,))
        try:
            path.run(_Cursor(db.raw))  # type: ignore[arg-type]
        except sqlite3.DatabaseError as exc:
            if str(exc).startswith("iofence: "):
                return REFUSED, "" if db.snapshot() == before else "a refusal changed rows"
            raise
        after = db.snapshot()
        wrong = ""
        if mode != "opted":
            for table in FENCED:
                for row in after[table] - before[table]:
                    if _fence_of(table, row) != token:
                        wrong = f"{table} row {row} written without fence {token}"
        return OK, wrong
    finally:
        db.raw.execute("ROLLBACK")
        db.state.clear()


def test_the_sqlite_judge_judges_every_write_path(tmp_path: Any) -> None:
    db = _SQLite(tmp_path / "paths.db")
    failures = []
    try:
        for path in SQLITE_PATHS:
            expected = {"none": path.none, "stale": path.stale, "holder": path.holder}
            if path.opted is not None:
                expected["opted"] = path.opted
            for mode, wanted in expected.items():
                got, wrong = sqlite_attempt(db, path, mode)
                if got != wanted or wrong:
                    failures.append(f"{path.name} [{mode}]: {got}, expected {wanted} {wrong}")
    finally:
        db.close()
    assert failures == [], "\n".join(failures)


def test_another_program_cannot_write_a_judged_sqlite_table(tmp_path: Any) -> None:
    """A connection without iofence's functions (the ``sqlite3`` shell, another program):
    every write of a judged table fails; reads go on."""
    import sqlite3

    db = _SQLite(tmp_path / "other.db")
    try:
        db.reseed()
    finally:
        db.close()
    with sqlite_file(tmp_path / "other.db") as other:
        for statement in (
            "UPDATE acct SET balance = 1",
            "INSERT INTO acct (id) VALUES (9)",
            "DELETE FROM plain",
            "UPDATE reg SET fence = 99",
        ):
            with pytest.raises(sqlite3.OperationalError, match="no such function: iofence_"):
                other.execute(statement)
        assert other.execute("SELECT count(*) FROM acct").fetchone() == (3,)


def test_without_the_triggers_the_sqlite_catalogue_fails(tmp_path: Any) -> None:
    """As on PostgreSQL: the same paths without the triggers, and writes without a token
    land, so the catalogue can fail."""
    db = _SQLite(tmp_path / "bare.db")
    try:
        for table in FENCED:
            for statement in drop_trigger_ddl(table, dialect="sqlite"):
                db.raw.execute(statement)
        for path in SQLITE_PATHS:
            # (REPLACE with recursive triggers deletes through the triggers dropped here;
            # the token's upsert writes NULL without one, which NOT NULL refuses.)
            skipped = (
                "INSERT OR REPLACE, recursive_triggers on",
                "the register: an upsert of the token",
            )
            if path.none == REFUSED and path.name not in skipped:
                assert sqlite_attempt(db, path, "none")[0] == OK, path.name
    finally:
        db.close()
