"""The SQL dialects, without a database.

- a dialect is found by SQLAlchemy's name, and an unknown one is refused;
- a driver error is classified by SQLSTATE (PostgreSQL) or by result code and message
  (SQLite).
"""

from __future__ import annotations

import sqlite3
from typing import Any

import psycopg
import pytest
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import make_url

from fence._core import TokenMode
from fence._errors import ConfigurationError
from fence._sql_dialect import (
    DIALECTS,
    SQLITE_PRAGMAS,
    Fault,
    SQLDialect,
    dialect_for,
    dialect_of_url,
)
from fence._sql_schema import lease_statements

PG = dialect_for("postgresql")
LITE = dialect_for("sqlite")


def _wrapped(cls: type[sa_exc.DBAPIError], orig: BaseException, **kw: Any) -> BaseException:
    return cls("SELECT 1", {}, orig, **kw)


def _pg(state: str, message: str = "boom") -> BaseException:
    return _wrapped(sa_exc.OperationalError, psycopg.errors.lookup(state)(message))


# -- finding a dialect -----------------------------------------------------------------------


def test_dialects_are_found_by_sqlalchemys_name() -> None:
    assert set(DIALECTS) == {"postgresql", "sqlite"}
    for name, dialect in DIALECTS.items():
        assert isinstance(dialect, SQLDialect)
        assert dialect.name == name
        assert dialect_for(name) is dialect
        assert dialect_for(dialect) is dialect
        assert dialect.sqlalchemy.name == name


def test_an_unknown_dialect_is_refused_with_the_supported_ones() -> None:
    with pytest.raises(ConfigurationError, match="supports PostgreSQL and SQLite, not 'mysql'"):
        dialect_for("mysql")
    with pytest.raises(ConfigurationError, match="not 'mysql'"):
        lease_statements("mysql")


def test_a_url_names_its_dialect_aliases_included() -> None:
    assert dialect_of_url(make_url("postgres://h/db")) is PG
    assert dialect_of_url(make_url("postgresql+asyncpg://h/db")) is PG
    assert dialect_of_url(make_url("sqlite:///x.db")) is LITE
    assert dialect_of_url(make_url("mysql://h/db")) is None


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
    pg = PG.lease_statements(
        table="t", schema=None, token_mode=TokenMode.HYBRID, notify=True, fence_table=None
    )
    assert "clock_timestamp()" in pg.acquire
    assert pg.steps == {}
    lite = LITE.lease_statements(
        table="t", schema=None, token_mode=TokenMode.HYBRID, notify=True, fence_table=None
    )
    assert ":clock_us" in lite.acquire
    assert LITE.clock_sql in lite.acquire
    assert set(lite.steps) >= {"state", "entries", "write", "put"}
    counter = LITE.lease_statements(
        table="t", schema=None, token_mode=TokenMode.COUNTER, notify=True, fence_table=None
    )
    assert ":clock_us" not in counter.acquire


def test_the_socket_a_deadline_cuts() -> None:
    class PGconn:
        socket = 7

    class Psycopg:
        pgconn = PGconn()

    assert PG.socket_of(Psycopg()) == 7
    assert PG.socket_of(object()) is None  # another driver
    assert LITE.socket_of(Psycopg()) is None  # in process: nothing to cut


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


def test_retryable_faults_are_never_a_verdict() -> None:
    retryable = {f for f in Fault if f.retryable}
    assert retryable == {
        Fault.SERIALIZATION,
        Fault.DEADLOCK,
        Fault.LOCK_TIMEOUT,
        Fault.CANCELED,
        Fault.BUSY,
    }
