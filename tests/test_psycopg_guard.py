"""The psycopg row guard and fence register, rule by rule, on the session's PostgreSQL.

The conformance suite covers the harness rules; these tests cover what is psycopg's own:
composite keys, schema-qualified tables, NULL fences, savepoints inside the caller's
transaction, closed connections and the register.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from fence import BackendError, ConfigurationError, InvalidTokenError, Reason, StaleTokenError
from fence.adapters.psycopg import REGISTER_TABLE_DDL, FenceRegister, RowGuard, install_triggers
from fence.testing import EventRecorder
from tests.servers import PostgresServer

pytestmark = pytest.mark.postgres


@pytest.fixture
def conn(postgres_server: PostgresServer) -> Iterator[psycopg.Connection[Any]]:
    """A connection in the default (non-autocommit) mode, rolled back and closed after."""
    c = psycopg.connect(postgres_server.conninfo)
    yield c
    if not c.broken:
        c.rollback()
    c.close()


@pytest.fixture
def accounts(postgres_server: PostgresServer) -> str:
    """A fresh committed ``accounts_xxx(id PK, owner, balance, fence, deleted)``, two rows.

    Each test gets its own table name, so nothing needs dropping on the shared cluster.
    """
    name = f"accounts_{secrets.token_hex(4)}"
    ident = sql.Identifier(name)
    with psycopg.connect(postgres_server.conninfo, autocommit=True) as c:
        c.execute(
            sql.SQL(
                "CREATE TABLE {} (id INT PRIMARY KEY, owner TEXT NOT NULL DEFAULT '', "
                "balance INT, fence BIGINT NOT NULL DEFAULT 0, "
                "deleted BOOLEAN NOT NULL DEFAULT FALSE)"
            ).format(ident)
        )
        c.execute(sql.SQL("INSERT INTO {} (id, balance) VALUES (1, 10), (2, 20)").format(ident))
        install_triggers(c, name, tombstone="deleted")  # the database's judge (C14)
    return name


@pytest.fixture
def register(postgres_server: PostgresServer) -> str:
    """A committed fence register table."""
    name = f"register_{secrets.token_hex(4)}"
    with psycopg.connect(postgres_server.conninfo, autocommit=True) as c:
        c.execute(REGISTER_TABLE_DDL.format(table=name))  # type: ignore[arg-type]
        install_triggers(c, name, register=True)
    return name


def _row(conn: psycopg.Connection[Any], table: str, key: int) -> Any:
    query = sql.SQL("SELECT balance, fence, deleted FROM {} WHERE id = %s").format(
        sql.Identifier(table)
    )
    return conn.execute(query, (key,)).fetchone()


def _guard(conn: psycopg.Connection[Any], table: str, **kwargs: Any) -> RowGuard:
    return RowGuard(conn, table, key="id", tombstone="deleted", **kwargs)


def test_update_upsert_delete_and_their_rejections(
    conn: psycopg.Connection[Any], accounts: str
) -> None:
    guard = _guard(conn, accounts, returning=True)
    row = guard.update(1, 7, {"balance": 11})
    assert (row["balance"], row["fence"]) == (11, 7)
    with pytest.raises(StaleTokenError) as caught:
        guard.update(1, 6, {"balance": 0})
    err = caught.value
    assert (err.reason, err.token, err.fence, err.scope) == (
        Reason.STALE,
        6,
        7,
        f"{accounts}(1)",
    )
    with pytest.raises(StaleTokenError) as caught:
        guard.update(404, 6, {"balance": 0})
    assert caught.value.reason is Reason.MISSING
    assert guard.upsert(8, {"id": 3, "balance": 30})["fence"] == 8
    with pytest.raises(StaleTokenError):
        guard.upsert(7, {"id": 3, "balance": 31})
    guard.delete(3, 9)
    assert _row(conn, accounts, 3) == (30, 9, True)
    with pytest.raises(StaleTokenError) as caught:
        guard.upsert(8, {"id": 3, "balance": 32})  # a stale writer cannot revive it
    assert (caught.value.reason, caught.value.fence) == (Reason.STALE, 9)
    assert guard.read_for_update(3, 9) is None
    assert guard.upsert(9, {"id": 3, "balance": 33})["deleted"] is False
    assert _row(conn, accounts, 1) == (11, 7, False)


def test_claim_and_registering_read(conn: psycopg.Connection[Any], accounts: str) -> None:
    guard = _guard(conn, accounts)
    assert guard.claim(1, 4) == 4
    assert guard.read_for_update(2, 5) == {
        "id": 2,
        "owner": "",
        "balance": 20,
        "fence": 5,
        "deleted": False,
    }
    with pytest.raises(StaleTokenError) as caught:
        guard.read_for_update(2, 4)
    assert (caught.value.reason, caught.value.fence) == (Reason.STALE, 5)
    assert guard.claim(50, 5) == 5  # an absent row: a tombstone now holds the fence
    assert _row(conn, accounts, 50) == (None, 5, True)
    assert guard.fence(50) == 5
    assert guard.fence(51) is None


def test_update_many_all_or_nothing(conn: psycopg.Connection[Any], accounts: str) -> None:
    guard = _guard(conn, accounts)
    guard.claim(2, 9)
    with pytest.raises(StaleTokenError) as caught:
        guard.update_many(6, {1: {"balance": 1}, 2: {"balance": 2}, 404: {"balance": 4}})
    assert sorted((e.scope, e.reason, e.fence) for e in caught.value.rejected) == [
        (f"{accounts}(2)", Reason.STALE, 9),
        (f"{accounts}(404)", Reason.MISSING, None),
    ]
    assert _row(conn, accounts, 1) == (10, 0, False)
    guard.update_many(9, {1: {"balance": 100}, 2: {"owner": "x", "balance": 200}})
    assert [_row(conn, accounts, k) for k in (1, 2)] == [(100, 9, False), (200, 9, False)]


def test_upsert_many_rolls_back_its_savepoint_only(
    conn: psycopg.Connection[Any], accounts: str
) -> None:
    guard = _guard(conn, accounts)
    guard.update(1, 5, {"balance": 15})  # the caller's own work in the same transaction
    guard.claim(2, 9)
    with pytest.raises(StaleTokenError) as caught:
        guard.upsert_many(
            6, [{"id": 1, "balance": 1}, {"id": 2, "balance": 2}, {"id": 3, "balance": 3}]
        )
    assert [(e.scope, e.fence) for e in caught.value.rejected] == [(f"{accounts}(2)", 9)]
    assert _row(conn, accounts, 3) is None
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
    assert _row(conn, accounts, 1) == (15, 5, False)  # the caller's write survived
    guard.upsert_many(9, [{"id": 1, "balance": 1}, {"id": 3, "balance": 3}])
    assert [_row(conn, accounts, k) for k in (1, 3)] == [(1, 9, False), (3, 9, False)]


def test_composite_key_and_schema_qualified_table(conn: psycopg.Connection[Any]) -> None:
    schema = f"s_{secrets.token_hex(3)}"
    conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    conn.execute(
        sql.SQL(
            "CREATE TABLE {}.lines (order_id INT, line INT, qty INT, "
            "fence BIGINT NOT NULL DEFAULT 0, PRIMARY KEY (order_id, line))"
        ).format(sql.Identifier(schema))
    )
    install_triggers(conn, (schema, "lines"))
    guard = RowGuard(conn, (schema, "lines"), key=("order_id", "line"))
    guard.upsert(5, {"order_id": 1, "line": 1, "qty": 1})
    guard.upsert(5, {"order_id": 1, "line": 2, "qty": 2})
    guard.update({"order_id": 1, "line": 1}, 5, {"qty": 10})
    guard.update_many(6, {(1, 1): {"qty": 11}, (1, 2): {"qty": 22}})
    with pytest.raises(StaleTokenError) as caught:
        guard.update((1, 2), 5, {"qty": 0})
    assert caught.value.scope == f"{schema}.lines(1, 2)"
    with pytest.raises(ConfigurationError, match="tombstone"):
        guard.delete((1, 1), 7)
    with pytest.raises(StaleTokenError) as caught:
        guard.claim((9, 9), 7)  # no tombstone column: an absent row cannot be fenced
    assert caught.value.reason is Reason.MISSING
    qty = conn.execute(
        sql.SQL("SELECT qty FROM {}.lines ORDER BY line").format(sql.Identifier(schema))
    ).fetchall()
    assert qty == [(11,), (22,)]


def test_null_fence_is_unverifiable(conn: psycopg.Connection[Any]) -> None:
    conn.execute("CREATE TEMP TABLE nullable (id INT PRIMARY KEY, v INT, fence BIGINT)")
    conn.execute("INSERT INTO nullable VALUES (1, 1, NULL)")
    install_triggers(conn, "nullable")
    guard = RowGuard(conn, "nullable")
    for write in (
        lambda: guard.update(1, 5, {"v": 2}),
        lambda: guard.upsert(5, {"id": 1, "v": 2}),
        lambda: guard.claim(1, 5),
    ):
        with pytest.raises(StaleTokenError) as caught:
            write()
        assert caught.value.reason is Reason.UNVERIFIABLE
    with pytest.raises(ConfigurationError, match="NULL"):
        guard.fence(1)
    assert conn.execute("SELECT v FROM nullable").fetchone() == (1,)


def test_tombstone_insert_refused_by_schema_is_missing(conn: psycopg.Connection[Any]) -> None:
    conn.execute(
        "CREATE TEMP TABLE strict (id INT PRIMARY KEY, owner TEXT NOT NULL, "
        "fence BIGINT NOT NULL DEFAULT 0, deleted BOOLEAN NOT NULL DEFAULT FALSE)"
    )
    install_triggers(conn, "strict", tombstone="deleted")
    guard = RowGuard(conn, "strict", tombstone="deleted", tombstone_insert=False)
    with pytest.raises(StaleTokenError) as caught:
        guard.claim(1, 5)
    assert caught.value.reason is Reason.MISSING
    assert conn.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS


def test_bad_tokens_before_io_and_closed_connection(
    postgres_server: PostgresServer, accounts: str, register: str
) -> None:
    conn = psycopg.connect(postgres_server.conninfo)
    guard, reg = _guard(conn, accounts), FenceRegister(conn, register)
    conn.close()
    for bad in (0, 2**53, True, 2.0, "1", None):
        with pytest.raises(InvalidTokenError):
            guard.update(1, bad, {"balance": 1})
        with pytest.raises(InvalidTokenError):
            reg.claim("a", bad)
    with pytest.raises(BackendError, match="closed") as caught:
        guard.update(1, 5, {"balance": 1})
    assert caught.value.code == "CONNECTION"
    with pytest.raises(BackendError, match="closed"):
        reg.claim("a", 5)
    with pytest.raises(BackendError, match="closed"):
        guard.upsert_many(5, [{"id": 1}])


def test_server_error_is_wrapped(conn: psycopg.Connection[Any], accounts: str) -> None:
    with pytest.raises(BackendError) as caught:
        _guard(conn, accounts).update(1, 5, {"no_such_column": 1})
    assert caught.value.code == "BACKEND"
    assert isinstance(caught.value.__cause__, psycopg.errors.UndefinedColumn)


def test_register_claims_and_reads(
    conn: psycopg.Connection[Any], register: str, accounts: str
) -> None:
    reg = FenceRegister(conn, register)
    with EventRecorder() as events:
        assert reg.claim("order:1", 5) == 5
        with pytest.raises(StaleTokenError) as caught:
            reg.claim("order:1", 4)
    assert (caught.value.reason, caught.value.fence) == (Reason.STALE, 5)
    assert [(e.kind, e.source, e.scope) for e in events.events] == [
        ("write_accepted", "psycopg-guard", "order:1"),
        ("write_rejected", "psycopg-guard", "order:1"),
    ]
    rows = reg.read(
        "order:1",
        6,
        sql.SQL("SELECT balance FROM {} WHERE id = %s")
        .format(sql.Identifier(accounts))
        .as_string(),
        (1,),
    )
    assert rows == [{"balance": 10}]
    reg.claim("c", 12)
    with pytest.raises(StaleTokenError) as caught:
        reg.claim_many(["a", "b", "c"], 11)
    assert [(e.scope, e.fence) for e in caught.value.rejected] == [("c", 12)]
    assert [reg.fence(s) for s in ("a", "b", "c", "order:1")] == [None, None, 12, 6]
    reg.claim_many(["a", "b", "c"], 12)
    assert [reg.fence(s) for s in ("a", "b", "c")] == [12, 12, 12]


def test_batches_on_an_autocommit_connection(
    postgres_server: PostgresServer, accounts: str, register: str
) -> None:
    # Outside any transaction each batch is its own transaction: still all or nothing.
    with psycopg.connect(postgres_server.conninfo, autocommit=True) as conn:
        guard, reg = _guard(conn, accounts), FenceRegister(conn, register)
        guard.claim(2, 9)
        with pytest.raises(StaleTokenError):
            guard.upsert_many(6, [{"id": 1, "balance": 1}, {"id": 2, "balance": 2}])
        assert _row(conn, accounts, 1) == (10, 0, False)
        guard.upsert_many(9, [{"id": 1, "balance": 1}, {"id": 2, "balance": 2}])
        reg.claim_many(["x", "y"], 3)
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        assert [reg.fence("x"), _row(conn, accounts, 2)] == [3, (2, 9, False)]


def test_lost_connection_is_a_backend_error(
    postgres_server: PostgresServer, conn: psycopg.Connection[Any], accounts: str
) -> None:
    guard = _guard(conn, accounts)
    guard.update(1, 5, {"balance": 1})
    with psycopg.connect(postgres_server.conninfo, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,))
    with pytest.raises(BackendError) as caught:
        guard.update(1, 6, {"balance": 2})
    assert caught.value.code == "CONNECTION"
    assert isinstance(caught.value.__cause__, psycopg.OperationalError)
    with psycopg.connect(postgres_server.conninfo) as fresh:
        assert _row(fresh, accounts, 1) == (10, 0, False)  # nothing was committed


@pytest.mark.parametrize("returning", [False, True])
def test_each_new_set_of_columns_is_checked_and_a_refused_one_every_time(
    conn: psycopg.Connection[Any], accounts: str, returning: bool
) -> None:
    """The guard remembers the sets of columns that passed its check (the hot path skips
    it then); a set it refused is never remembered, so it is refused again."""
    guard = _guard(conn, accounts, returning=returning)
    guard.update(1, 5, {"balance": 11})
    for _ in range(2):
        with pytest.raises(ConfigurationError, match="set by the guard"):
            guard.update(1, 5, {"balance": 12, "fence": 99})
        with pytest.raises(ConfigurationError, match="set by the guard"):
            guard.update(1, 5, {"deleted": True})
        with pytest.raises(ConfigurationError, match="key"):
            guard.update(1, 5, {"id": 3})
        with pytest.raises(ConfigurationError, match="needs values"):
            guard.update(1, 5, {})
        for bad in ([("balance", 12)], "balance", 5, None):  # not a mapping
            with pytest.raises(ConfigurationError, match="mapping"):
                guard.update(1, 5, bad)  # type: ignore[arg-type]
    guard.update(1, 6, {"owner": "b", "balance": 13})
    guard.update(1, 6, {"balance": 14, "owner": "c"})  # the same columns, in another order
    assert _row(conn, accounts, 1) == (14, 6, False)
    assert _row(conn, accounts, 3) is None


class _SlowCursor(psycopg.Cursor[Any]):
    """A cursor that yields to other threads between its statement and its row count."""

    def execute(self, *args: Any, **kwargs: Any) -> Any:
        done = super().execute(*args, **kwargs)
        time.sleep(0.0005)
        return done


@pytest.mark.parametrize("returning", [False, True])
def test_threads_sharing_a_guard_each_get_the_verdict_of_their_own_write(
    postgres_server: PostgresServer, accounts: str, returning: bool
) -> None:
    """The guard reuses its cursors, one per statement under way: threads writing through
    one guard never read each other's row count, even when each thread pauses between its
    statement and its row count. Half the writes are stale; each must be refused, and
    each current one accepted."""
    with psycopg.connect(
        postgres_server.conninfo, autocommit=True, cursor_factory=_SlowCursor
    ) as c:
        guard = _guard(c, accounts, returning=returning)
        for key in (1, 2):
            guard.update(key, 10, {"balance": 0})
        wrong: list[tuple[str, int, int]] = []

        def work(n: int) -> None:
            for i in range(60):
                stale = (i + n) % 2 == 0
                try:
                    guard.update(1 + i % 2, 5 if stale else 10, {"balance": i})
                except StaleTokenError:
                    if not stale:
                        wrong.append(("refused", n, i))
                else:
                    if stale:
                        wrong.append(("accepted", n, i))

        threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        assert wrong == []
        assert [_row(c, accounts, key)[1] for key in (1, 2)] == [10, 10]
