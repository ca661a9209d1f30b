"""A read lease's token cannot fence a write (C13), and every guard knows one when it sees it.

A read lease is shared: other readers hold the lock with it, so its token proves nothing
about who writes. Its token is a :class:`fence.ReadToken`, an ``int`` that every guarded
write, claim and registering read refuses with :class:`fence.ReadLeaseError` before any
I/O; checked reads (:func:`fence.check_read`, ``MemoryGuard.read_checked``) and
``bind(..., mode="read")`` take it. The Redis guard's paths are also rows of the write-path
catalogue (``tests/test_write_paths_redis.py``).
"""

from __future__ import annotations

import pickle
import sqlite3
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from sqlalchemy import Column, Integer, MetaData, Table, create_engine, select, text
from sqlalchemy.orm import Session

from fence import (
    InvalidTokenError,
    LeaseMode,
    MemoryBackend,
    MemoryLockManager,
    ReadLeaseError,
    ReadToken,
    StaleTokenError,
    check_read,
    validate_token,
)
from fence.adapters.orm import bind
from fence.adapters.psycopg import FenceRegister as PgFenceRegister
from fence.adapters.psycopg import RowGuard as PgRowGuard
from fence.adapters.sql import (
    FenceRegister,
    RowGuard,
    fence_column,
    fence_register_table,
    tombstone_column,
)
from fence.testing import MemoryGuard
from tests.servers import PostgresServer


@pytest.fixture
def manager() -> Iterator[MemoryLockManager]:
    manager = MemoryLockManager(MemoryBackend())
    yield manager
    manager.close()


def test_a_read_lease_carries_a_read_token_and_a_write_lease_a_plain_int(
    manager: MemoryLockManager,
) -> None:
    with manager.write_lock("r") as writer:
        assert type(writer.token) is int
    with manager.read_lock("r") as reader:
        assert reader.mode is LeaseMode.READ
        assert isinstance(reader.token, ReadToken)
        assert reader.token > writer.token
        assert reader.token == int(reader.token)
        assert repr(reader.token) == f"ReadToken({int(reader.token)})"
        again = pickle.loads(pickle.dumps(reader.token))
        assert type(again) is ReadToken
        assert again == reader.token


def test_validate_token_refuses_a_read_token_for_writes_only() -> None:
    token = ReadToken(7)
    with pytest.raises(ReadLeaseError, match="read lease") as caught:
        validate_token(token)
    assert caught.value.token == 7
    assert isinstance(caught.value, InvalidTokenError) is False  # not a malformed token
    assert validate_token(token, read=True) == 7
    assert type(validate_token(token, read=True)) is int
    with pytest.raises(InvalidTokenError):
        validate_token(ReadToken(0), read=True)
    check_read("k", token, 7)  # a checked read takes it
    with pytest.raises(StaleTokenError):
        check_read("k", token, 8)


def test_the_memory_guard(manager: MemoryLockManager) -> None:
    guard = MemoryGuard()
    with manager.write_lock("k") as writer:
        guard.write("k", writer.token, "v1")
    with manager.read_lock("k") as reader:
        writes: list[Callable[[], Any]] = [
            lambda: guard.write("k", reader.token, "v2"),
            lambda: guard.update("k", reader.token, lambda v: v),
            lambda: guard.write_many(reader.token, {"k": "v2"}),
            lambda: guard.delete("k", reader.token),
            lambda: guard.claim("k", reader.token),
            lambda: guard.read_for_update("k", reader.token),
        ]
        for write in writes:
            with pytest.raises(ReadLeaseError):
                write()
        assert guard.read("k") == "v1"
        assert guard.fence("k") == writer.token
        assert guard.read_checked("k", reader.token) == "v1"


def _table() -> Table:
    return Table(
        "docs",
        MetaData(),
        Column("id", Integer, primary_key=True),
        Column("v", Integer),
        fence_column(),
        tombstone_column(),
    )


def test_the_core_row_guard_and_register_refuse_before_any_io(tmp_path: Any) -> None:
    table = _table()
    register = fence_register_table(MetaData())
    engine = create_engine(f"sqlite:///{tmp_path / 'db.sqlite'}")
    table.metadata.create_all(engine)
    register.metadata.create_all(engine)
    with engine.begin() as conn:  # the seed row, opted out (a bare sqlite3 connection
        # lacks the functions the database's judge calls, so it cannot write at all)
        seed = table.insert().values(id=1, v=1, fence=5, deleted=False)
        conn.execute(seed.execution_options(unfenced=True))
    token = ReadToken(9)
    statements: list[str] = []
    try:
        with engine.connect() as conn:
            conn.exec_driver_sql("SELECT 1")  # the connection is open: only the guard's I/O
            raw = conn.connection.dbapi_connection
            assert isinstance(raw, sqlite3.Connection)
            raw.set_trace_callback(statements.append)
            guard = RowGuard(conn, table)
            fences = FenceRegister(conn, register)
            calls: list[Callable[[], Any]] = [
                lambda: guard.update(1, token, {"v": 2}),
                lambda: guard.upsert(token, {"id": 2, "v": 2}),
                lambda: guard.update_many(token, {1: {"v": 2}}),
                lambda: guard.upsert_many(token, [{"id": 2, "v": 2}]),
                lambda: guard.delete(1, token),
                lambda: guard.read_for_update(1, token),
                lambda: guard.claim(1, token),
                lambda: fences.claim("doc:1", token),
                lambda: fences.claim_many(["doc:1"], token),
                lambda: fences.read("doc:1", token, select(table)),
            ]
            for call in calls:
                with pytest.raises(ReadLeaseError):
                    call()
            assert statements == []
            conn.rollback()
        with engine.connect() as conn:
            assert conn.execute(select(table.c.id, table.c.v, table.c.fence)).all() == [(1, 1, 5)]
            assert conn.execute(select(register)).all() == []
    finally:
        engine.dispose()


@pytest.mark.postgres
def test_the_psycopg_guards_refuse_before_any_io(postgres_server: PostgresServer) -> None:
    with psycopg.connect(postgres_server.conninfo, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS read_token_docs")
        conn.execute(
            "CREATE TABLE read_token_docs (id INT PRIMARY KEY, v INT, fence BIGINT NOT NULL "
            "DEFAULT 0, deleted BOOLEAN NOT NULL DEFAULT FALSE)"
        )
        conn.execute("INSERT INTO read_token_docs VALUES (1, 1, 5)")
        token = ReadToken(9)
        guard = PgRowGuard(conn, "read_token_docs", tombstone="deleted")
        fences = PgFenceRegister(conn)
        calls: list[Callable[[], Any]] = [
            lambda: guard.update(1, token, {"v": 2}),
            lambda: guard.upsert(token, {"id": 2, "v": 2}),
            lambda: guard.update_many(token, {1: {"v": 2}}),
            lambda: guard.upsert_many(token, [{"id": 2, "v": 2}]),
            lambda: guard.delete(1, token),
            lambda: guard.read_for_update(1, token),
            lambda: guard.claim(1, token),
            lambda: fences.claim("doc:1", token),
            lambda: fences.claim_many(["doc:1"], token),
            lambda: fences.read("doc:1", token, "SELECT 1"),
        ]
        before = conn.pgconn.transaction_status
        for call in calls:
            with pytest.raises(ReadLeaseError):
                call()
        assert conn.pgconn.transaction_status == before
        assert conn.execute("SELECT id, v, fence FROM read_token_docs").fetchall() == [(1, 1, 5)]
        conn.execute("DROP TABLE read_token_docs")


def test_bind_takes_a_read_token_only_for_a_read_only_session(manager: MemoryLockManager) -> None:
    engine = create_engine("sqlite://")
    try:
        with manager.read_lock("doc:1") as reader:
            with Session(engine) as session, pytest.raises(ReadLeaseError):
                bind(session, token=reader.token, scope="doc:1")  # a write binding
            with Session(engine) as session:
                binding = bind(session, token=reader.token, scope="doc:1", mode="read", claim=False)
                assert binding.token == reader.token
                assert session.execute(text("SELECT 1")).scalar() == 1
    finally:
        engine.dispose()
