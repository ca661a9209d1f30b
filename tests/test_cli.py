"""The ``fence`` command, run as a user runs it: a subprocess, against the suite's servers.

Every run is checked for its exit status (0 ok, 1 failed, 2 usage, 130 interrupted), for
what it prints, and for the absence of a traceback: bad URLs, unreachable ports, a missing
server program and Ctrl-C each end in one line that says what happened.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa

import fence
from fence._chaos.servers import free_port
from fence.adapters.redis import RedisGuard
from fence.adapters.sql import (
    FENCE_COLUMN_DDL,
    REGISTER_TABLE_DDL,
    TOMBSTONE_COLUMN_DDL,
    FenceRegister,
    fence_register_table,
)
from tests.servers import MariaDBServer, PostgresServer, RedisClusterServers
from tests.sqlite_files import sqlite_file


def run(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``fence ARGS`` in a subprocess; never a traceback, whatever the outcome."""
    done = subprocess.run(
        [sys.executable, "-m", "fence", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    assert "Traceback" not in done.stderr + done.stdout, done.stderr
    return done


def lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines()]


def fields(text: str) -> dict[str, str]:
    """The ``name: value`` rows of ``fence inspect``."""
    rows = (line.split(": ", 1) for line in lines(text) if ": " in line)
    return {name: value.strip() for name, value in rows}


def unique(stem: str) -> str:
    return f"{stem}_{secrets.token_hex(3)}"


# -- usage errors, bad URLs, unreachable servers ------------------------------------------------


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["inspect", "nope", "r"], "not a URL"),
        (["inspect", "oracle://h/db", "r"], "no lock manager for 'oracle'"),
        (["revoke", "memory://", "r"], "memory:// locks live inside one process"),
        (["doctor", "sqlite://"], "in-memory SQLite"),
        (["inspect", "redis://127.0.0.1:6379/0", ""], "resource"),
        (["inspect", "redis://h:notaport/0", "r"], "Redis URL"),
        (["inspect", "postgresql://u@h:notaport/db", "r"], "not a usable URL"),
        (["doctor", "postgresql://[bad"], "not a URL"),
        (["doctor", "etcd://"], "no etcd endpoint"),
        (["doctor", "etcd://127.0.0.1:2379", "--prefix", "x:"], "--prefix is for Redis"),
        (["inspect", "redis://h/0", "r", "--timeout", "0"], "--timeout must be positive"),
        (["ddl", "--dialect", "postgresql", "--table", "a..b"], "not a table name"),
    ],
)
def test_usage_errors_exit_2(args: list[str], says: str) -> None:
    done = run(*args)
    assert done.returncode == 2, done.stderr
    assert says in done.stderr
    assert done.stdout == ""


def test_argparse_errors_exit_2() -> None:
    assert run("ddl").returncode == 2  # --dialect is required
    assert run("ddl", "--dialect", "oracle").returncode == 2
    assert run("inspect", "redis://h/0").returncode == 2  # RESOURCE missing
    assert run().returncode == 2  # no command: the help (on stderr), and 2


def test_no_command_prints_the_help_on_stderr_and_exits_2() -> None:
    done = run()
    assert done.returncode == 2
    assert done.stdout == ""  # nothing for a pipe that expected a command's output
    assert done.stderr.startswith("usage: fence")
    for command in ("inspect", "revoke", "ddl", "doctor", "demo", "chaos"):
        assert command in done.stderr


def test_ddl_takes_postgres_for_postgresql() -> None:
    postgresql = run("ddl", "--dialect", "postgresql", "--table", "accounts")
    assert postgresql.returncode == 0
    for spelling in ("postgres", "PostgreSQL"):
        done = run("ddl", "--dialect", spelling, "--table", "accounts")
        assert done.returncode == 0, done.stderr
        assert done.stdout == postgresql.stdout
    assert "postgres is postgresql" in run("ddl", "--help").stdout


@pytest.mark.parametrize(
    ("driver", "package"), [("psycopg2", "psycopg2-binary"), ("pg8000", "pg8000")]
)
def test_a_driver_no_extra_installs_is_named_with_its_package(driver: str, package: str) -> None:
    code = (
        f"import sys; sys.modules[{driver!r}] = None; from fence.cli import main; "
        f"sys.exit(main(['inspect', 'postgresql+{driver}://u@127.0.0.1:1/db', 'r']))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 1
    assert f"{driver} is not installed" in done.stderr
    assert f"pip install {package}" in done.stderr
    assert "pip install 'iofence[postgres]'" in done.stderr  # or the extra's driver
    assert "Traceback" not in done.stderr
    assert len(done.stderr.splitlines()) == 1


def test_wrong_redis_credentials_are_one_sentence(redis_url: str) -> None:
    url = redis_url.replace("redis://", "redis://nobody:wrong@", 1)
    done = run("inspect", url, "order:42", "--timeout", "2")
    assert done.returncode == 1
    assert "refused the credentials" in done.stderr
    assert "WRONGPASS" in done.stderr
    assert ".." not in done.stderr  # Redis's reply ends in a full stop of its own
    assert "wrong" not in done.stderr  # the password is never shown


@pytest.mark.parametrize(
    ("wrong", "says"),
    [
        ("postgresql://nobody@{host}/postgres", 'role "nobody" does not exist'),
        ("postgresql://postgres@{host}/no_such_db", 'database "no_such_db" does not exist'),
    ],
)
def test_wrong_postgresql_user_or_database_is_not_called_unreachable(
    postgres_server: PostgresServer, wrong: str, says: str
) -> None:
    url = wrong.format(host=f"127.0.0.1:{postgres_server.port}")
    for args in (["inspect", url, "order:42"], ["revoke", url, "order:42"]):
        done = run(*args, "--timeout", "2")
        assert done.returncode == 1, done.stderr
        assert says in done.stderr
        assert "check the user, password and database in the URL" in done.stderr
        assert "unreachable" not in done.stderr
        assert "repeated" not in done.stderr  # not transient: the same URL fails again
        assert done.stdout == ""
    doctor = run("doctor", url, "--timeout", "2")
    assert doctor.returncode == 1
    first = lines(doctor.stdout)[1]
    assert first.startswith("fail  reachable:"), doctor.stdout
    assert "refused the connection" in first
    assert says in first
    assert "-> check the user, password and database in the URL" in lines(doctor.stdout)


class _Worker:
    """An owner whose name, the end of the holder's label, holds a tab."""

    name = "worker\t7"


def test_a_resource_with_a_newline_is_shown_escaped(redis_url: str) -> None:
    resource = "order:42\nheld by: nobody"
    client = redis.Redis.from_url(redis_url)
    manager = fence.RedisLockManager(client, ttl=30)
    try:
        with manager.lock(resource, owner=_Worker()):
            done = run("inspect", redis_url, resource)
    finally:
        manager.close()
        client.close()
    assert done.returncode == 0, done.stderr
    shown = fields(done.stdout)
    assert shown["resource"] == repr(resource)
    assert shown["held by"] != "nobody: the lock is free"
    assert shown["held by"].startswith("'")
    assert shown["held by"].endswith(":worker\\t7'")
    # The name's second line did not become a row of its own.
    assert [line.startswith("held by") for line in lines(done.stdout)].count(True) == 1
    assert repr(resource)[1:-1] in shown["fence"]  # the key, escaped
    assert json.loads(run("inspect", redis_url, resource, "--json").stdout)["resource"] == (
        resource
    )


@pytest.mark.parametrize("command", ["inspect", "revoke", "list"])
@pytest.mark.parametrize(
    ("scheme", "says"),
    [
        ("redis://127.0.0.1:{port}/0", "could not reach Redis at 127.0.0.1:"),
        ("postgresql://postgres@127.0.0.1:{port}/postgres", "unreachable"),
        ("etcd://127.0.0.1:{port}", "refused the connection"),
    ],
)
def test_unreachable_server_exits_1(command: str, scheme: str, says: str) -> None:
    done = run(command, scheme.format(port=free_port()), "order:42", "--timeout", "2")
    assert done.returncode == 1, done.stderr
    assert says in done.stderr
    assert done.stdout == ""


def test_doctor_of_an_unreachable_server_fails_its_first_check() -> None:
    port = free_port()
    done = run("doctor", f"redis://127.0.0.1:{port}/0", "--timeout", "2")
    assert done.returncode == 1
    assert lines(done.stdout)[1].startswith("fail  reachable:")
    assert "0 ok, 0 warn, 1 fail" in done.stdout


def test_missing_sqlite_file_is_not_created(tmp_path: Path) -> None:
    path = tmp_path / "absent.db"
    for args in (["inspect", f"sqlite:///{path}", "r"], ["doctor", f"sqlite:///{path}"]):
        done = run(*args)
        assert done.returncode == 1
        assert f"no SQLite database at {path}" in done.stderr
    assert not path.exists()


def test_missing_driver_package_names_the_extra() -> None:
    code = (
        "import sys; sys.modules['redis'] = None; from fence.cli import main; "
        "sys.exit(main(['inspect', 'redis://127.0.0.1:1/0', 'r']))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 1
    assert "pip install 'iofence[redis]'" in done.stderr
    assert "Traceback" not in done.stderr


# -- ddl --------------------------------------------------------------------------------------


def test_ddl_prints_the_library_ddl() -> None:
    done = run("ddl", "--dialect", "postgresql", "--table", "accounts", "--table", "app.Orders")
    assert done.returncode == 0
    text = done.stdout
    for statement in fence.lease_schema_ddl("postgresql"):  # the shared locks' table too
        assert statement + ";" in text
    assert REGISTER_TABLE_DDL.format(table="fence_register") + ";" in text

    def again(ddl: str) -> str:  # PostgreSQL's ALTERs may run again
        return ddl.replace(" ADD COLUMN ", " ADD COLUMN IF NOT EXISTS ")

    assert again(FENCE_COLUMN_DDL.format(table="accounts")) + ";" in text
    assert again(TOMBSTONE_COLUMN_DDL.format(table="accounts")) + ";" in text
    assert again(FENCE_COLUMN_DDL.format(table='app."Orders"')) + ";" in text  # quoted
    bare = run("ddl", "--dialect", "sqlite", "--no-lease-table", "--no-register", "--table", "t")
    statements = [s for s in bare.stdout.split(";") if s.strip() and "ALTER" in s]
    assert len(statements) == 2  # the fence column and the tombstone flag, nothing else
    assert FENCE_COLUMN_DDL.format(table="t") + ";" in bare.stdout  # SQLite's, as they are
    assert TOMBSTONE_COLUMN_DDL.format(table="t") + ";" in bare.stdout
    assert "TABLE IF NOT EXISTS" not in bare.stdout


def test_the_ddl_shown_in_the_docs_is_what_the_command_prints() -> None:
    command = "fence ddl --dialect postgresql --table accounts --no-triggers"
    text = (Path(__file__).resolve().parent.parent / "docs" / "sql-guard.md").read_text()
    shown = text.split(f"```bash\n{command}\n```\n\n```sql\n", 1)[1].split("```", 1)[0]
    assert shown == run(*command.split()[1:]).stdout


def test_ddl_runs_on_postgresql_and_the_managers_use_it(postgres_url: str) -> None:
    table, leases, register = unique("cli_accounts"), unique("cli_leases"), unique("cli_reg")
    engine = sa.create_engine(postgres_url)
    with engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE TABLE {table} (id INT PRIMARY KEY, balance INT)")
        conn.exec_driver_sql(f"INSERT INTO {table} VALUES (1, 10)")
    done = run(
        "ddl", "--dialect", "postgresql", "--table", table,
        "--lease-table", leases, "--register", register,
    )  # fmt: skip
    assert done.returncode == 0
    with engine.begin() as conn:
        conn.exec_driver_sql(done.stdout)
        columns = {c["name"]: c for c in sa.inspect(conn).get_columns(table)}
        assert conn.exec_driver_sql(f"SELECT fence, deleted FROM {table}").one() == (0, False)
    assert str(columns["fence"]["type"]) == "BIGINT"
    names = ["--lease-table", leases, "--register", register]
    manager = fence.connect(postgres_url, table=leases)
    try:
        lease = manager.acquire("account:1", ttl=30)
        held = run("inspect", postgres_url, "account:1", *names, "--json")
        assert held.returncode == 0, held.stderr
        report = json.loads(held.stdout)
        assert report["held"] is True
        assert report["token"] == report["last_token"] == lease.token
        assert 0 < report["remaining"] <= 30
        assert report["fence"] is None
        assert report["fence_at"] == f"{register} row of scope 'account:1'"
        revoked = run("revoke", postgres_url, "account:1", "--lease-table", leases)
        assert revoked.returncode == 0, revoked.stderr
        token = int(revoked.stdout)
        assert token > lease.token
        with engine.begin() as conn:  # what the message after a revoke asks for
            FenceRegister(conn, fence_register_table(name=register)).claim("account:1", token)
        after = fields(run("inspect", postgres_url, "account:1", *names).stdout)
        assert after["held by"] == "nobody: the lock is free"
        assert after["last token"] == f"{token} ({leases} row)"
        assert after["fence"] == f"{token} ({register} row of scope 'account:1')"
        assert manager.acquire("account:1", owner="next", ttl=5).token > token
        doctor = run("doctor", postgres_url, *names)
        assert f"ok    lease table: {leases} exists" in lines(doctor.stdout)
        assert f"ok    fence register: {register} exists" in lines(doctor.stdout)
    finally:
        manager.close()
        with engine.begin() as conn:
            conn.exec_driver_sql(f"DROP TABLE {table}, {leases}, {register}")
        engine.dispose()


def test_the_mariadb_ddl_runs_again_through_its_client_and_the_guards_use_it(
    mariadb_server: MariaDBServer, mariadb_url: str
) -> None:
    database = sa.make_url(mariadb_url).database
    assert database is not None
    table, register = unique("cli_accounts"), unique("cli_reg")
    engine = sa.create_engine(mariadb_url)
    with engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE TABLE {table} (id INT PRIMARY KEY, balance INT)")
        conn.exec_driver_sql(f"INSERT INTO {table} VALUES (1, 10)")
    done = run("ddl", "--dialect", "mariadb", "--table", table, "--register", register)
    assert done.returncode == 0, done.stderr
    assert "CREATE TABLE IF NOT EXISTS fence_leases_shared (" in done.stdout
    assert done.stdout.count("CREATE OR REPLACE TRIGGER") == 10  # the judge: 5 per table
    client = shutil.which("mariadb") or "/usr/bin/mariadb"
    for _ in range(2):  # it runs again unharmed
        piped = subprocess.run(
            [
                client, "--no-defaults", "-h", "127.0.0.1", "-P", str(mariadb_server.port),
                "-u", mariadb_server.USER, f"-p{mariadb_server.PASSWORD}", database,
            ],
            input=done.stdout,
            capture_output=True,
            text=True,
            timeout=60,
        )  # fmt: skip
        assert piped.returncode == 0, piped.stderr
    try:
        with engine.begin() as conn:
            assert conn.exec_driver_sql(f"SELECT fence, deleted FROM {table}").one() == (0, 0)
            fences = FenceRegister(conn, fence_register_table(name=register))
            assert fences.claim("Order:1", 5) == 5
            assert fences.claim("order:1", 3) == 3  # another scope: the case counts
    finally:
        engine.dispose()
    names = ["--register", register, "--timeout", "10"]
    manager = fence.connect(mariadb_url)  # the lease tables the script made
    try:
        lease = manager.acquire("account:1", ttl=30)
        held = run("inspect", mariadb_url, "account:1", *names, "--json")
        assert held.returncode == 0, held.stderr
        report = json.loads(held.stdout)
        assert report["held"] is True
        assert report["token"] == report["last_token"] == lease.token
        assert 0 < report["remaining"] <= 30
        assert report["fence"] is None  # the register has "Order:1" and "order:1" only
        revoked = run("revoke", mariadb_url.replace("mariadb+pymysql", "mysql"), "account:1")
        assert revoked.returncode == 0, revoked.stderr
        token = int(revoked.stdout)
        assert token > lease.token
        after = fields(run("inspect", mariadb_url, "account:1", *names).stdout)
        assert after["held by"] == "nobody: the lock is free"
        assert after["last token"] == f"{token} (fence_leases row)"
        assert manager.acquire("account:1", owner="next", ttl=5).token > token
        doctor = run("doctor", mariadb_url, *names)
        found = lines(doctor.stdout)
        assert doctor.returncode == 0, doctor.stdout
        assert "ok    lease table: fence_leases exists" in found
        assert f"ok    fence register: {register} exists" in found
        assert "ok    found_rows: the connections count rows found (CLIENT_FOUND_ROWS)" in found
        assert any(line.startswith("ok    isolation: transaction isolation REPEATABLE-READ")
                   for line in found)  # fmt: skip
    finally:
        manager.close()
    triggers = run("ddl", "--dialect", "mariadb", "--triggers-only", "--table", table)
    assert triggers.returncode == 0, triggers.stderr
    assert "ADD COLUMN" not in triggers.stdout
    assert "DELIMITER //" in triggers.stdout


def test_doctor_judges_the_triggers_of_mariadb_fenced_tables(mariadb_url: str) -> None:
    """On MariaDB as on PostgreSQL and SQLite: every table with a fence column (and the
    register) must carry the judge's current triggers; a table without them, or with one
    dropped, fails the check with the command that installs them."""
    from fence.adapters.sql import fence_column, install_triggers, tombstone_column

    metadata = sa.MetaData()
    accounts = sa.Table(
        unique("cli_judged"),
        metadata,
        sa.Column("id", sa.Integer, primary_key=True),
        fence_column(),
        tombstone_column(),
    )
    register = fence_register_table(metadata, unique("cli_reg"))
    bare = unique("cli_bare")
    engine = sa.create_engine(mariadb_url)
    names = ["--register", register.name, "--timeout", "10"]
    try:
        metadata.create_all(engine)  # the tables and their triggers
        manager = fence.SQLLockManager(mariadb_url)
        manager.create_table()  # the lease tables
        manager.close()
        good = lines(run("doctor", mariadb_url, *names).stdout)
        assert "ok    judge: every fenced table carries current triggers (2 with the register)" in (
            good
        ), good
        with engine.begin() as conn:  # a fenced table that never got its judge
            conn.exec_driver_sql(f"CREATE TABLE {bare} (id INT PRIMARY KEY, fence BIGINT)")
            conn.exec_driver_sql(f"DROP TRIGGER iofence_{accounts.name}_delete")
        done = run("doctor", mariadb_url, *names)
        out = lines(done.stdout)
        assert done.returncode == 1, done.stdout
        assert any(
            line.startswith(f"fail  judge: the triggers of {bare} are missing (iofence_{bare}_")
            and f"writes that bypass the guards reach {bare} unjudged" in line
            for line in out
        ), out
        assert any(
            line.startswith(
                f"fail  judge: the triggers of {accounts.name} are missing "
                f"(iofence_{accounts.name}_delete)"
            )
            for line in out
        ), out
        hints = [line for line in out if line.startswith("-> install them")]
        assert any(
            f"fence ddl --dialect mariadb --triggers-only --no-register --table {accounts.name}`"
            in line
            for line in hints
        ), hints  # its tombstone flag kept
        assert any(f"--no-register --no-tombstone --table {bare}`" in line for line in hints), hints
        assert not any("judge: every fenced table" in line for line in out)
        with engine.begin() as conn:
            install_triggers(conn, accounts)
            conn.exec_driver_sql(f"DROP TABLE {bare}")
        again = run("doctor", mariadb_url, *names)
        assert again.returncode == 0, again.stdout
        assert "ok    judge: every fenced table carries current triggers (2 with the register)" in (
            lines(again.stdout)
        )
    finally:
        with engine.begin() as conn:
            conn.exec_driver_sql(f"DROP TABLE IF EXISTS {bare}")
        metadata.drop_all(engine)
        engine.dispose()


def psql(server: PostgresServer, script: str) -> subprocess.CompletedProcess[str]:
    """``SCRIPT | psql -v ON_ERROR_STOP=1``, as the docs pipe ``fence ddl``."""
    program = shutil.which("psql") or str(Path(server.bindir) / "psql")
    return subprocess.run(
        [program, "-X", "-q", "-v", "ON_ERROR_STOP=1", server.conninfo],
        input=script,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_postgresql_ddl_runs_again_through_psql(postgres_server: PostgresServer) -> None:
    table, fenced = unique("cli_again"), unique("cli_fenced")
    leases, register = unique("cli_leases"), unique("cli_reg")
    made = psql(
        postgres_server,
        f"CREATE TABLE {table} (id INT PRIMARY KEY, balance INT);"
        # A table that has its fence column already, as after a migration run before.
        f"CREATE TABLE {fenced} (id INT PRIMARY KEY, fence BIGINT NOT NULL DEFAULT 0);",
    )
    assert made.returncode == 0, made.stderr
    names = ["--lease-table", leases, "--register", register]
    try:
        for args in (
            ["--table", table, "--table", fenced, *names],
            ["--table", table, "--table", fenced, *names, "--no-triggers"],
            ["--table", table, *names, "--triggers-only"],
        ):
            done = run("ddl", "--dialect", "postgresql", *args)
            assert done.returncode == 0, done.stderr
            for _ in range(2):
                ran = psql(postgres_server, done.stdout)
                assert ran.returncode == 0, (args, ran.stderr)
            assert "ADD COLUMN IF NOT EXISTS" in done.stdout or "--triggers-only" in args
    finally:
        dropped = psql(
            postgres_server,
            f"DROP TABLE IF EXISTS {table}, {fenced}, {leases}, {leases}_shared, {register};",
        )
        assert dropped.returncode == 0, dropped.stderr


def test_the_sqlite_ddl_says_how_to_run_it_again(tmp_path: Path) -> None:
    path = tmp_path / "app.db"
    with sqlite_file(path) as db:
        db.execute("CREATE TABLE accounts (id INTEGER PRIMARY KEY, balance INTEGER)")
    done = run("ddl", "--dialect", "sqlite", "--table", "accounts")
    assert "SQLite has no ADD COLUMN IF NOT EXISTS" in done.stdout
    assert "SQLite has no ADD COLUMN IF NOT EXISTS" in run("ddl", "--help").stdout
    with sqlite_file(path) as db:
        db.executescript(done.stdout)
    with sqlite_file(path) as db, pytest.raises(sqlite3.OperationalError, match="duplicate"):
        db.executescript(done.stdout)  # what the comment says: the ALTERs run once
    # What it says to run instead, to upgrade the judge: again and again.
    again = run("ddl", "--dialect", "sqlite", "--table", "accounts", "--triggers-only")
    for _ in range(2):
        with sqlite_file(path) as db:
            db.executescript(again.stdout)
    # And to fence one more table: the CREATEs run again, the new table's ALTERs once.
    with sqlite_file(path) as db:
        db.execute("CREATE TABLE invoices (id INTEGER PRIMARY KEY)")
        db.executescript(run("ddl", "--dialect", "sqlite", "--table", "invoices").stdout)
        columns = [row[1] for row in db.execute("PRAGMA table_info(invoices)")]
    assert columns == ["id", "fence", "deleted"]


def test_ddl_runs_on_sqlite_and_doctor_judges_the_file(tmp_path: Path) -> None:
    path = tmp_path / "app.db"
    url = f"sqlite:///{path}"
    with sqlite_file(path) as db:
        db.execute("CREATE TABLE accounts (id INTEGER PRIMARY KEY, balance INTEGER)")
    before = run("doctor", url)
    assert before.returncode == 1  # the lease table is missing
    out = lines(before.stdout)
    assert (
        "fail  lease table: fence_leases is missing: the SQL lock manager refuses every "
        "call until it exists" in out
    )
    assert any(line.startswith("warn  fence register: fence_register is missing") for line in out)
    assert any(line.startswith("warn  journal_mode: delete") for line in out)
    with sqlite_file(path) as db:  # a lease table of a version before shared locks
        db.execute(
            "CREATE TABLE fence_leases (resource TEXT PRIMARY KEY, token INTEGER NOT NULL, "
            "owner TEXT, holder TEXT, expires_at REAL NOT NULL)"
        )
    old = lines(run("doctor", url).stdout)
    assert any(
        line.startswith("fail  lease table: fence_leases lacks readers, read_until, wtoken")
        for line in old
    ), old
    assert any(
        line.startswith("-> migrate it once") and "lease_upgrade_ddl" in line for line in old
    )
    assert any(
        line.startswith("fail  shared table: fence_leases_shared is missing") for line in old
    ), old
    with sqlite_file(path) as db:
        db.execute("DROP TABLE fence_leases")
    assert any(line.startswith("ok    busy_timeout: 5000 ms") for line in out)

    done = run("ddl", "--dialect", "sqlite", "--table", "accounts")
    with sqlite_file(path) as db:
        db.executescript(done.stdout)  # as `fence ddl ... | sqlite3 app.db` would
        db.execute("PRAGMA journal_mode=WAL")
    after = run("doctor", url)
    assert after.returncode == 0, after.stdout
    assert "7 ok, 0 warn, 0 fail" in after.stdout  # the judge of accounts too
    assert "ok    shared table: fence_leases_shared exists" in lines(after.stdout)
    slow = run("doctor", f"{url}?timeout=0")
    assert "warn  busy_timeout: 0 ms" in slow.stdout
    assert slow.returncode == 0
    assert run("doctor", f"{url}?timeout=0", "--strict").returncode == 1

    manager = fence.connect(url)
    try:
        lease = manager.acquire("account:7", ttl=30)
        shown = run("inspect", url, "account:7")
        assert shown.returncode == 0
        assert fields(shown.stdout)["token"] == str(lease.token)
        assert fields(shown.stdout)["fence"] == "not set (fence_register row of scope 'account:7')"
    finally:
        manager.close()


# -- inspect and revoke -----------------------------------------------------------------------


def test_inspect_and_revoke_on_redis(redis_url: str) -> None:
    free = run("inspect", redis_url, "order:42")
    assert free.returncode == 0
    shown = fields(free.stdout)
    assert shown["held by"] == "nobody: the lock is free"
    assert shown["last token"] == "none issued (fence:{order:42}:token)"
    assert shown["fence"] == "not set (fence:{order:42}:fence)"
    client = redis.Redis.from_url(redis_url)
    manager = fence.RedisLockManager(client, ttl=30)
    guard = RedisGuard(client, scope="resource")
    try:
        lease = manager.acquire("order:42")
        guard.set("{order:42}:status", "paid", token=lease.token)
        held = run("inspect", redis_url, "order:42", "--json")
        report = json.loads(held.stdout)
        assert report["held"] is True
        assert report["token"] == report["last_token"] == lease.token
        assert report["holder"] == manager.inspect("order:42").holder  # type: ignore[union-attr]
        assert 0 < report["remaining"] <= 30
        assert report["fence"] == lease.token  # the guarded write raised the resource fence

        revoked = run("revoke", redis_url, "order:42")
        assert revoked.returncode == 0
        token = int(revoked.stdout)
        assert token > lease.token
        assert "fence:{order:42}:fence is raised to it" in revoked.stderr
        after = run("inspect", redis_url, "order:42")
        assert fields(after.stdout)["fence"] == f"{token} (fence:{{order:42}}:fence)"
        assert fields(after.stdout)["held by"] == "nobody: the lock is free"
        # The hung holder's late write is refused: the revoke raised the resource's fence.
        with pytest.raises(fence.StaleTokenError):
            guard.set("{order:42}:status", "stale", token=lease.token)
        assert client.get("{order:42}:status") == b"paid"
    finally:
        manager.close()
        client.close()


def test_inspect_and_revoke_with_a_prefix_and_counter_tokens(redis_url: str) -> None:
    manager = fence.connect(
        redis_url, prefix="app:", token_mode=fence.TokenMode.COUNTER, check_config=False
    )
    try:
        lease = manager.acquire("job", ttl=30)
        assert lease.token == 1
        revoked = run("revoke", redis_url, "job", "--prefix", "app:", "--token-mode", "counter")
        assert revoked.stdout.strip() == "2"
        # The manager's start-up check of the server (no persistence, counter tokens): one
        # line on stderr, not a Python warning with its source line.
        assert "fence: warning: Redis at" in revoked.stderr
        assert "Warning:" not in revoked.stderr
        shown = run("inspect", redis_url, "job", "--prefix", "app:")
        assert fields(shown.stdout)["fence"] == "2 (app:{job}:fence)"
    finally:
        manager.close()


@pytest.mark.parametrize("backend", ["etcd", "zookeeper"])
def test_inspect_and_revoke_on_consensus(backend: str, request: pytest.FixtureRequest) -> None:
    url = request.getfixturevalue(f"{backend}_url")
    manager = fence.connect(url)
    try:
        lease = manager.acquire("job:7", ttl=30)
        held = run("inspect", url, "job:7")
        assert held.returncode == 0, held.stderr
        shown = fields(held.stdout)
        assert shown["token"] == str(lease.token)
        name = "etcd" if backend == "etcd" else "ZooKeeper"
        assert (
            shown["fence"] == f"not set ({name} keeps none: the guards keep fences with the data)"
        )
        revoked = run("revoke", url, "job:7")
        assert revoked.returncode == 0, revoked.stderr
        assert int(revoked.stdout) > lease.token
        assert "nobody: the lock is free" in run("inspect", url, "job:7").stdout
        assert manager.acquire("job:7", owner="next", ttl=5, timeout=10).token > int(revoked.stdout)
    finally:
        manager.close()


# -- list ---------------------------------------------------------------------------------------


def listed(text: str) -> dict[str, list[str]]:
    """The rows of ``fence list`` by resource, each its columns after the resource."""
    rows = [line.split() for line in text.splitlines()[1:]]
    return {row[0]: row[1:] for row in rows}


def test_list_on_redis(redis_url: str) -> None:
    stem = unique("list")
    client = redis.Redis.from_url(redis_url)
    manager = fence.RedisLockManager(client, ttl=30)
    try:
        assert run("list", redis_url, stem).stdout == (
            f"no locks held on resources that start with {stem!r}\n"
        )
        write = manager.acquire(f"{stem}:a*")
        manager.acquire(f"{stem}:ab")
        manager.acquire(f"{stem}:read", mode="read")
        manager.acquire(f"{stem}:read", mode="read", owner="second")
        manager.acquire(f"{stem}:odd\tname")
        done = run("list", redis_url, stem)
        assert done.returncode == 0, done.stderr
        assert done.stdout.splitlines()[0].split() == [
            "RESOURCE", "HOLDER", "TOKEN", "MODE", "READERS", "WAITERS", "TIME", "LEFT",
        ]  # fmt: skip
        rows = listed(done.stdout)
        assert set(rows) == {f"{stem}:a*", f"{stem}:ab", f"{stem}:read", repr(f"{stem}:odd\tname")}
        assert rows[f"{stem}:a*"][1:5] == [str(write.token), "write", "0", "0"]
        assert rows[f"{stem}:read"][2:4] == ["read", "2"]
        assert set(listed(run("list", redis_url, f"{stem}:a*").stdout)) == {f"{stem}:a*"}
        assert len(listed(run("list", redis_url, stem, "--limit", "2").stdout)) == 2
        objects = [
            json.loads(line) for line in run("list", redis_url, stem, "--json").stdout.splitlines()
        ]
        assert {o["resource"] for o in objects} == {
            f"{stem}:a*", f"{stem}:ab", f"{stem}:read", f"{stem}:odd\tname"
        }  # fmt: skip
        assert "0 or more" in run("list", redis_url, "--limit", "-1").stderr
    finally:
        manager.close()
        client.close()


def test_list_on_sqlite_and_etcd(tmp_path: Path, etcd_url: str) -> None:
    url = f"sqlite:///{tmp_path / 'locks.db'}"
    manager = fence.connect(url, create_table=True)
    try:
        manager.acquire("job", ttl=30).release()
        assert run("list", url).stdout == "no locks held\n"
        lease = manager.acquire("job%1", ttl=30)
        manager.acquire("job_2", ttl=30)
        manager.acquire("jobx", ttl=30)
        assert list(listed(run("list", url).stdout)) == ["job%1", "job_2", "jobx"]
        only = listed(run("list", url, "job%").stdout)
        assert list(only) == ["job%1"]
        assert only["job%1"][1] == str(lease.token)
        assert list(listed(run("list", url, "job_").stdout)) == ["job_2"]
    finally:
        manager.close()
    consensus = fence.connect(etcd_url)
    try:
        stem = unique("list")
        lease = consensus.acquire(f"{stem}:a", ttl=30)
        done = run("list", etcd_url, stem)
        assert done.returncode == 0, done.stderr
        assert listed(done.stdout)[f"{stem}:a"][1:3] == [str(lease.token), "write"]
    finally:
        consensus.close()


# -- doctor -----------------------------------------------------------------------------------


@pytest.fixture
def redis_config(redis_url: str) -> Iterator[redis.Redis]:
    """A client of the session's redis-server whose settings are put back afterwards."""
    client = redis.Redis.from_url(redis_url)
    saved = {
        name: client.config_get(name)[name]
        for name in ("maxmemory-policy", "maxmemory", "appendonly", "appendfsync")
    }
    yield client
    for name, value in saved.items():
        client.config_set(name, value)
    client.close()


def test_doctor_redis_reads_eviction_persistence_and_clock(
    redis_url: str, redis_config: redis.Redis
) -> None:
    done = run("doctor", redis_url)
    out = lines(done.stdout)
    assert done.returncode == 0, done.stdout  # the suite's server: no persistence, a warning
    assert out[1].startswith("ok    reachable:")
    assert out[1].endswith("role master")
    assert out[2].startswith("ok    maxmemory-policy: noeviction")
    assert out[3].startswith("warn  persistence: appendonly no, no snapshots")
    assert any(line.startswith("ok    clock: the server's TIME is") for line in out)
    assert run("doctor", redis_url, "--strict").returncode == 1
    assert run("doctor", redis_url, "--token-mode", "counter").returncode == 1

    redis_config.config_set("maxmemory", "512mb")
    redis_config.config_set("maxmemory-policy", "allkeys-lru")
    redis_config.config_set("appendonly", "yes")
    redis_config.config_set("appendfsync", "always")
    done = run("doctor", redis_url)
    out = lines(done.stdout)
    assert done.returncode == 1
    assert out[2].startswith("fail  maxmemory-policy: allkeys-lru (maxmemory 536870912)")
    assert (
        out[3] == "-> CONFIG SET maxmemory-policy noeviction (best) or a volatile-* "
        "policy, which evicts only keys with a ttl; and in redis.conf"
    )
    assert any(
        line.startswith("ok    persistence: appendonly yes, appendfsync always") for line in out
    )


@pytest.mark.redis
async def _listed_async(url: str, prefix: str) -> list[str]:
    manager = fence.connect_async(url)
    try:
        return [info.resource async for info in manager.list(prefix)]
    finally:
        await manager.close()


def test_doctor_inspect_and_revoke_on_a_redis_cluster() -> None:
    cluster = RedisClusterServers().start()
    try:
        url = cluster.url.replace("redis://", "redis+cluster://")
        done = run("doctor", url)
        assert done.returncode == 0, done.stdout
        for port in cluster.ports:  # every primary is checked
            assert any(
                line.startswith(f"ok    maxmemory-policy (127.0.0.1:{port}): noeviction")
                for line in lines(done.stdout)
            )
        token = int(run("revoke", url, "order:1").stdout)
        assert fields(run("inspect", url, "order:1").stdout)["fence"] == (
            f"{token} (fence:{{order:1}}:fence)"
        )
        manager = fence.connect(url)
        try:
            names = [f"job:{i}" for i in range(12)]  # slots on every primary
            for name in names:
                manager.acquire(name, ttl=30)
            assert sorted(info.resource for info in manager.list("job:")) == sorted(names)
            assert sorted(listed(run("list", url, "job:").stdout)) == sorted(names)
            assert sorted(asyncio.run(_listed_async(url, "job:"))) == sorted(names)
        finally:
            manager.close()
    finally:
        cluster.stop()


def test_doctor_postgres_reads_durability_clock_and_tables(postgres_url: str) -> None:
    missing = unique("cli_absent")
    done = run("doctor", postgres_url, "--lease-table", missing, "--register", missing)
    out = lines(done.stdout)
    assert done.returncode == 1
    assert out[1].startswith("ok    reachable:")
    assert "PostgreSQL" in out[1]
    # The suite's throwaway cluster trades durability for speed, and doctor says so.
    assert out[2].startswith("fail  fsync: fsync off")
    assert out[4].startswith("warn  synchronous_commit: synchronous_commit off")
    assert any(line.startswith("ok    wal_level: wal_level replica") for line in out)
    assert any(line.startswith("ok    clock: the server's clock_timestamp() is") for line in out)
    assert (
        f"fail  lease table: {missing} is missing: the SQL lock manager refuses every "
        "call until it exists" in out
    )
    # synchronous_commit is read from the session, as the lock manager's statements see it.
    sync = run("doctor", postgres_url + "?options=-c%20synchronous_commit%3Don")
    assert any(
        line.startswith("ok    synchronous_commit: synchronous_commit on")
        for line in lines(sync.stdout)
    )


def test_doctor_judges_mariadb_settings() -> None:
    """The verdicts on MariaDB's settings, without a server: rows changed fail (a renewal
    could read as a lost lease); SERIALIZABLE, a long lock wait, a lazy log flush and
    statement-based binlogs warn."""
    from fence._doctor import judge_mariadb

    good = {
        "isolation": "REPEATABLE-READ",
        "found_rows": "on",
        "innodb_lock_wait_timeout": "50",
        "innodb_flush_log_at_trx_commit": "1",
        "log_bin": "ON",
        "binlog_format": "ROW",
    }
    assert {check.status for check in judge_mariadb(good)} == {"ok"}
    bad = {
        "isolation": "SERIALIZABLE",
        "found_rows": "off",
        "innodb_lock_wait_timeout": "600",
        "innodb_flush_log_at_trx_commit": "2",
        "log_bin": "ON",
        "binlog_format": "STATEMENT",
    }
    verdicts = {check.name: check.status for check in judge_mariadb(bad)}
    assert verdicts == {
        "isolation": "warn",
        "found_rows": "fail",
        "innodb_lock_wait_timeout": "warn",
        "innodb_flush_log_at_trx_commit": "warn",
        "binlog_format": "warn",
    }


def test_doctor_etcd_and_zookeeper(etcd_url: str, zookeeper_url: str) -> None:
    for url, answered in (
        (etcd_url, "endpoints: all 3 answer"),
        (zookeeper_url, "quorum: all 3 servers serve"),
    ):
        done = run("doctor", url)
        out = lines(done.stdout)
        assert done.returncode == 0, done.stdout
        assert sum(line.startswith("ok    member:") for line in out) == 3
        assert f"ok    {answered}" in out
        assert any(line.startswith("ok    leader:") for line in out)
    dead = free_port()
    base, _, path = etcd_url.partition("://")[2].partition("/")
    done = run("doctor", f"etcd://{base},127.0.0.1:{dead}/{path}", "--timeout", "2")
    out = lines(done.stdout)
    assert done.returncode == 0
    assert any(line.startswith(f"warn  member: 127.0.0.1:{dead}:") for line in out)
    assert "warn  endpoints: 3 of the URL's 4 endpoints answer" in out
    assert any(line.startswith("ok    leader:") for line in out)


def test_doctor_etcd_names_a_missing_member(etcd_url: str) -> None:
    first = etcd_url.split("://")[1].split(",")[0]
    done = run("doctor", f"etcd://{first}")
    assert done.returncode == 0
    assert (
        "warn  endpoints: the URL names 1 of the cluster's 3 members: the lock manager "
        "talks only to those" in lines(done.stdout)
    )


# -- Ctrl-C -----------------------------------------------------------------------------------


class _Silent:
    """A TCP server that accepts connections and never answers: a hung server."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = threading.Event()
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            self.accepted.set()

    def close(self) -> None:
        self.sock.close()
        for conn in self.conns:
            conn.close()


@pytest.mark.parametrize(
    ("command", "says"),
    [
        ("doctor", "fence: interrupted\n"),
        ("revoke", "fence: interrupted: the revoke may or may not have ended the lease"),
    ],
)
def test_ctrl_c_on_a_hung_server_exits_130(command: str, says: str) -> None:
    server = _Silent()
    args = [command, f"redis://127.0.0.1:{server.port}/0"]
    args += ["order:42"] if command == "revoke" else []
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "fence", *args, "--timeout", "100"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert server.accepted.wait(60), "the command never connected"
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        _, err = proc.communicate(timeout=60)
    finally:
        server.close()
    assert proc.returncode == 130
    assert says in err
    assert "Traceback" not in err


class _Deaf:
    """A port that listens and never accepts: the kernel completes the handshake (the
    backlog), and nothing ever reads or answers."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=16)
        self.port = self.sock.getsockname()[1]

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("silent", [_Silent, _Deaf], ids=["accepts", "never-accepts"])
@pytest.mark.parametrize("scheme", ["zookeeper", "etcd"])
def test_inspect_and_revoke_honour_the_timeout_of_a_server_that_never_answers(
    scheme: str, silent: type[_Silent | _Deaf]
) -> None:
    server = silent()
    try:
        for command in ("inspect", "revoke"):
            started = time.monotonic()
            done = run(command, f"{scheme}://127.0.0.1:{server.port}", "x", "--timeout", "2")
            took = time.monotonic() - started
            assert done.returncode == 1, done.stderr
            assert "2 s" in done.stderr  # what it says is what it waited
            assert took < 2 + 3, (command, took)  # the timeout, the interpreter's start
    finally:
        server.close()


@pytest.mark.parametrize("scheme", ["zookeeper", "etcd"])
def test_a_refused_connection_fails_at_once(scheme: str) -> None:
    port = free_port()
    for command in ("inspect", "revoke"):
        started = time.monotonic()
        done = run(command, f"{scheme}://127.0.0.1:{port}", "x", "--timeout", "10")
        took = time.monotonic() - started
        assert done.returncode == 1, done.stderr
        assert f"127.0.0.1:{port} refused the connection" in done.stderr
        assert "check the host and port in the URL, and that the server runs" in done.stderr
        assert took < 4, (command, took)  # well under the timeout


@pytest.mark.parametrize("command", ["inspect", "revoke"])
@pytest.mark.parametrize("scheme", ["zookeeper", "etcd"])
def test_ctrl_c_on_a_silent_consensus_server_exits_at_once(scheme: str, command: str) -> None:
    server = _Silent()
    try:
        url = f"{scheme}://127.0.0.1:{server.port}"
        proc = subprocess.Popen(
            [sys.executable, "-m", "fence", command, url, "order:42", "--timeout", "100"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        assert server.accepted.wait(60), "the command never connected"
        time.sleep(0.3)  # inside the call, waiting for an answer
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
        started = time.monotonic()
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - started
    finally:
        server.close()
    assert proc.returncode == 130, err
    assert err.startswith("fence: interrupted")
    assert "Traceback" not in err
    assert took < 2.5, took
