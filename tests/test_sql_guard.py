"""The SQLAlchemy Core row guard and fence register, rule by rule, on SQLite and PostgreSQL.

The guard kit (``fence.testing.guards``, run by ``tests/test_guard_kit.py``) drives the
guard through scope names; these tests cover what only SQL has: the DDL, NULL fences,
composite keys, the row-count fallback, the caller's transaction, the tombstone rows and the
register.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import (
    BigInteger,
    Column,
    Engine,
    Integer,
    MetaData,
    String,
    Table,
    create_engine,
    insert,
    select,
    text,
)
from sqlalchemy.schema import CreateTable

from fence import (
    BackendError,
    ConfigurationError,
    InvalidTokenError,
    Reason,
    StaleTokenError,
)
from fence.adapters.ddl import trigger_ddl
from fence.adapters.sql import (
    FENCE_COLUMN_DDL,
    REGISTER_TABLE_DDL,
    TOMBSTONE_COLUMN_DDL,
    FenceRegister,
    RowGuard,
    fence_column,
    fence_register_table,
    tombstone_column,
)
from fence.testing import EventRecorder

DIALECTS = [
    pytest.param("sqlite", id="sqlite"),
    pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
]


@pytest.fixture(params=DIALECTS)
def engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    """An engine on a file SQLite database or the session's PostgreSQL cluster."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'guard.db'}"
    else:
        url = request.getfixturevalue("postgres_url")
    eng = create_engine(url)
    yield eng
    eng.dispose()


@pytest.fixture
def metadata(engine: Engine) -> Iterator[MetaData]:
    """A metadata whose tables are dropped after the test."""
    md = MetaData()
    yield md
    with engine.begin() as conn:
        md.drop_all(conn)


def _name(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(4)}"


@pytest.fixture
def accounts(engine: Engine, metadata: MetaData) -> Table:
    """``accounts(id PK, owner NOT NULL DEFAULT '', balance, fence, deleted)``, two rows."""
    table = Table(
        _name("accounts"),
        metadata,
        Column("id", Integer, primary_key=True, autoincrement=False),
        Column("owner", String(20), nullable=False, server_default=""),
        Column("balance", Integer),
        fence_column(),
        tombstone_column(),
    )
    with engine.begin() as conn:
        table.create(conn)
        seed = insert(table).execution_options(unfenced=True)  # fixture rows, no token
        conn.execute(seed, [{"id": 1, "balance": 10}, {"id": 2, "balance": 20}])
    return table


def _row(engine: Engine, table: Table, key: int) -> Any:
    with engine.begin() as conn:
        return conn.execute(select(table).where(table.c.id == key)).first()


# -- DDL ----------------------------------------------------------------------------------


def test_fence_column_is_bigint_not_null_default_zero(engine: Engine, accounts: Table) -> None:
    ddl = str(CreateTable(accounts).compile(engine)).lower()
    assert "fence bigint default '0' not null" in ddl or "fence bigint default 0 not null" in ddl
    # Rows inserted without a fence start at 0: the first token raises them.
    assert _row(engine, accounts, 1).fence == 0


def test_documented_ddl_runs_and_fences(engine: Engine, metadata: MetaData) -> None:
    name, register = _name("legacy"), _name("register")
    with engine.begin() as conn:
        conn.execute(text(f"CREATE TABLE {name} (id INTEGER PRIMARY KEY, v INTEGER)"))
        plain = Table(name, MetaData(), Column("id", Integer), Column("v", Integer))
        conn.execute(insert(plain).values(id=1, v=1))
        conn.execute(text(FENCE_COLUMN_DDL.format(table=name)))
        conn.execute(text(TOMBSTONE_COLUMN_DDL.format(table=name)))
        conn.execute(text(REGISTER_TABLE_DDL.format(table=register)))
        # The database's judge of both (C14), as a migration installs it.
        dialect = engine.dialect.name
        for statement in [
            *trigger_ddl(name, dialect=dialect, tombstone="deleted"),
            *trigger_ddl(register, dialect=dialect, register=True),
        ]:
            conn.exec_driver_sql(statement, execution_options={"no_parameters": True})
    legacy = Table(name, metadata, autoload_with=engine)
    reg = fence_register_table(metadata, register)
    with engine.begin() as conn:
        guard = RowGuard(conn, legacy, tombstone="deleted")
        assert guard.fence(1) == 0
        guard.update(1, 5, {"v": 2})
        FenceRegister(conn, reg).claim("legacy:1", 5)
    with engine.begin() as conn:
        with pytest.raises(StaleTokenError) as caught:
            RowGuard(conn, legacy, tombstone="deleted").update(1, 4, {"v": 3})
        assert (caught.value.reason, caught.value.fence) == (Reason.STALE, 5)
        assert FenceRegister(conn, reg).fence("legacy:1") == 5


# -- C4 / C5 ------------------------------------------------------------------------------


def test_update_accepts_equal_and_newer_tokens(engine: Engine, accounts: Table) -> None:
    with engine.begin() as conn:
        guard = RowGuard(conn, accounts, returning=True)
        row = guard.update(1, 7, {"balance": 11})
        assert row is not None
        assert (row.balance, row.fence) == (11, 7)
        guard.update(1, 7, {"balance": 12})
        guard.update(1, 9, {"balance": 13})
    assert (_row(engine, accounts, 1).balance, _row(engine, accounts, 1).fence) == (13, 9)


def test_writes_prove_themselves_by_row_count_unless_asked_for_the_row(
    engine: Engine, accounts: Table
) -> None:
    """The default costs a plain UPDATE: no row comes back; a registering read still
    returns its row."""
    with engine.begin() as conn:
        guard = RowGuard(conn, accounts)
        assert guard.update(1, 7, {"balance": 11}) is None
        assert guard.upsert(7, {"id": 9, "balance": 1}) is None
        row = guard.read_for_update(1, 7)
        assert row is not None
        assert (row.balance, row.fence) == (11, 7)
        assert RowGuard(conn, accounts, returning=True).update(1, 7, {"balance": 12}) is not None


def test_stale_update_changes_nothing_and_reports_the_fence(
    engine: Engine, accounts: Table
) -> None:
    with engine.begin() as conn:
        RowGuard(conn, accounts).update(1, 34, {"balance": 50})
    with engine.begin() as conn:
        guard = RowGuard(conn, accounts)
        with pytest.raises(StaleTokenError) as caught:
            guard.update(1, 33, {"balance": 99})
        err = caught.value
        assert (err.reason, err.token, err.fence) == (Reason.STALE, 33, 34)
        assert err.scope == f"{accounts.name}(1)"
        # The caller's transaction is still usable after a rejection.
        guard.update(2, 34, {"balance": 21})
    assert _row(engine, accounts, 1).balance == 50
    assert _row(engine, accounts, 2).balance == 21


def test_update_of_a_missing_row_is_missing(engine: Engine, accounts: Table) -> None:
    with engine.begin() as conn, pytest.raises(StaleTokenError) as caught:
        RowGuard(conn, accounts).update(404, 5, {"balance": 1})
    assert (caught.value.reason, caught.value.fence) == (Reason.MISSING, None)
    assert _row(engine, accounts, 404) is None


def test_null_fence_is_unverifiable_never_accepted(engine: Engine, metadata: MetaData) -> None:
    table = Table(
        _name("nullable"),
        metadata,
        Column("id", Integer, primary_key=True, autoincrement=False),
        Column("v", Integer),
        Column("fence", BigInteger, nullable=True),
    )
    with engine.begin() as conn:
        table.create(conn)
        conn.execute(insert(table).values(id=1, v=1, fence=None).execution_options(unfenced=True))
    with engine.begin() as conn:
        guard = RowGuard(conn, table)
        for write in (
            lambda: guard.update(1, 5, {"v": 2}),
            lambda: guard.upsert(5, {"id": 1, "v": 2}),
            lambda: guard.claim(1, 5),
            lambda: guard.update_many(5, {1: {"v": 2}}),
        ):
            with pytest.raises(StaleTokenError) as caught:
                write()
            assert caught.value.reason is Reason.UNVERIFIABLE
        with pytest.raises(ConfigurationError, match="NULL"):
            guard.fence(1)
    assert _row(engine, table, 1).v == 1


def test_bad_tokens_raise_before_any_io(engine: Engine, accounts: Table) -> None:
    conn = engine.connect()
    guard = RowGuard(conn, accounts)
    conn.close()  # any statement would now fail with BackendError
    for bad in (0, -1, 2**53, True, 1.5, "3", None):
        with pytest.raises(InvalidTokenError):
            guard.update(1, bad, {"balance": 1})
        with pytest.raises(InvalidTokenError):
            guard.upsert(bad, {"id": 1, "balance": 1})
        with pytest.raises(InvalidTokenError):
            guard.delete(1, bad)
        with pytest.raises(InvalidTokenError):
            guard.update_many(bad, {1: {"balance": 1}})


def test_closed_connection_is_a_backend_error(engine: Engine, accounts: Table) -> None:
    conn = engine.connect()
    guard = RowGuard(conn, accounts)
    register = FenceRegister(conn, fence_register_table())
    conn.close()
    with pytest.raises(BackendError, match="closed") as caught:
        guard.update(1, 5, {"balance": 1})
    assert caught.value.code == "CONNECTION"
    with pytest.raises(BackendError, match="closed"):
        register.claim("a", 5)
    assert _row(engine, accounts, 1).balance == 10


def test_bad_values_are_refused_before_io(engine: Engine, accounts: Table) -> None:
    with engine.begin() as conn:
        guard = RowGuard(conn, accounts)
        with pytest.raises(ConfigurationError, match="set by the guard"):
            guard.update(1, 5, {"fence": 1})
        with pytest.raises(ConfigurationError, match="no columns"):
            guard.update(1, 5, {"nope": 1})
        with pytest.raises(ConfigurationError, match="key"):
            guard.update(1, 5, {"id": 3})
        with pytest.raises(ConfigurationError, match="needs the key"):
            guard.upsert(5, {"balance": 3})
        # A name that is not a str is an unknown column, not an error of SQLAlchemy's.
        with pytest.raises(ConfigurationError, match="no columns"):
            guard.update(1, 5, {1: 3})  # type: ignore[dict-item]
        with pytest.raises(ConfigurationError, match="no columns"):
            guard.upsert(5, {"id": 1, 1: 3})  # type: ignore[dict-item]
    assert _row(engine, accounts, 1).fence == 0


@pytest.mark.parametrize("returning", [False, True])
def test_each_new_set_of_columns_is_checked_and_a_refused_one_every_time(
    engine: Engine, accounts: Table, returning: bool
) -> None:
    """The guard remembers the sets of columns that passed its check (the hot path skips
    it then); a set it refused is never remembered, so it is refused again."""
    with engine.begin() as conn:
        guard = RowGuard(conn, accounts, returning=returning)
        guard.update(1, 5, {"balance": 11})
        for _ in range(2):
            with pytest.raises(ConfigurationError, match="set by the guard"):
                guard.update(1, 5, {"balance": 12, "fence": 99})
            with pytest.raises(ConfigurationError, match="no columns"):
                guard.update(1, 5, {"balance": 12, "nope": 1})
            with pytest.raises(ConfigurationError, match="key"):
                guard.update(1, 5, {"id": 3})
            with pytest.raises(ConfigurationError, match="needs values"):
                guard.update(1, 5, {})
            for bad in ([("balance", 12)], "balance", 5, None):  # not a mapping
                with pytest.raises(ConfigurationError, match="mapping"):
                    guard.update(1, 5, bad)  # type: ignore[arg-type]
        guard.update(1, 6, {"balance": 14})
    row = _row(engine, accounts, 1)
    assert (row.balance, row.fence) == (14, 6)


def test_guard_runs_inside_the_callers_transaction(
    engine: Engine, accounts: Table, register_table: Table
) -> None:
    # Neither guard commits: the caller's rollback undoes the write, the claim and the batch.
    with engine.connect() as conn:
        conn.begin()
        guard = RowGuard(conn, accounts)
        guard.update(1, 5, {"balance": 99})
        guard.upsert_many(5, [{"id": 8, "balance": 8}, {"id": 9, "balance": 9}])
        FenceRegister(conn, register_table).claim_many(["x", "y"], 5)
        assert conn.in_transaction()
        conn.rollback()
    assert (_row(engine, accounts, 1).balance, _row(engine, accounts, 1).fence) == (10, 0)
    assert _row(engine, accounts, 8) is None
    with engine.begin() as conn:
        assert FenceRegister(conn, register_table).fence("x") is None


def test_events_report_accepted_and_rejected_writes(engine: Engine, accounts: Table) -> None:
    with EventRecorder() as events, engine.begin() as conn:
        guard = RowGuard(conn, accounts)
        guard.update(1, 5, {"balance": 1})
        with pytest.raises(StaleTokenError):
            guard.update(1, 4, {"balance": 2})
    accepted, rejected = events.of("write_accepted"), events.of("write_rejected")
    assert [(e.source, e.scope, e.token) for e in accepted] == [
        ("sql-guard", f"{accounts.name}(1)", 5)
    ]
    assert [(e.scope, e.token, e.detail["reason"]) for e in rejected] == [
        (f"{accounts.name}(1)", 4, "STALE")
    ]


# -- upsert, C7 tombstones ----------------------------------------------------------------


def test_upsert_inserts_replaces_and_refuses_stale(engine: Engine, accounts: Table) -> None:
    with engine.begin() as conn:
        guard = RowGuard(conn, accounts, returning=True)
        row = guard.upsert(5, {"id": 3, "balance": 30})
        assert row is not None
        assert (row.balance, row.fence, row.owner) == (30, 5, "")
        guard.upsert(6, {"id": 3, "balance": 31, "owner": "b"})
        with pytest.raises(StaleTokenError) as caught:
            guard.upsert(5, {"id": 3, "balance": 32})
        assert (caught.value.reason, caught.value.fence) == (Reason.STALE, 6)
    row = _row(engine, accounts, 3)
    assert (row.balance, row.owner, row.fence) == (31, "b", 6)


def test_soft_delete_keeps_a_tombstone_a_stale_writer_cannot_revive(
    engine: Engine, accounts: Table
) -> None:
    with engine.begin() as conn:
        RowGuard(conn, accounts).delete(1, 8)
    row = _row(engine, accounts, 1)
    assert (row.deleted, row.fence) == (True, 8)
    with engine.begin() as conn:
        guard = RowGuard(conn, accounts)
        for stale in (
            lambda: guard.upsert(7, {"id": 1, "balance": 70}),
            lambda: guard.update(1, 7, {"balance": 70}),
            lambda: guard.delete(1, 7),
        ):
            with pytest.raises(StaleTokenError) as caught:
                stale()
            assert (caught.value.reason, caught.value.fence) == (Reason.STALE, 8)
        # A current token: an update finds nothing (MISSING), an upsert brings it back.
        with pytest.raises(StaleTokenError) as caught:
            guard.update(1, 8, {"balance": 80})
        assert caught.value.reason is Reason.MISSING
        assert guard.read_for_update(1, 8) is None
        guard.upsert(9, {"id": 1, "balance": 90})
    row = _row(engine, accounts, 1)
    assert (row.deleted, row.balance, row.fence) == (False, 90, 9)


def test_delete_of_an_absent_row_inserts_a_tombstone(engine: Engine, accounts: Table) -> None:
    with engine.begin() as conn:
        RowGuard(conn, accounts).delete(7, 4)
    row = _row(engine, accounts, 7)
    assert (row.deleted, row.fence, row.balance) == (True, 4, None)
    with engine.begin() as conn, pytest.raises(StaleTokenError):
        RowGuard(conn, accounts).upsert(3, {"id": 7, "balance": 1})


def test_delete_without_tombstone_column_is_refused(engine: Engine, metadata: MetaData) -> None:
    table = Table(
        _name("plain"),
        metadata,
        Column("id", Integer, primary_key=True, autoincrement=False),
        fence_column(),
    )
    with engine.begin() as conn:
        table.create(conn)
        conn.execute(insert(table).values(id=1).execution_options(unfenced=True))
        with pytest.raises(ConfigurationError, match="tombstone"):
            RowGuard(conn, table).delete(1, 5)
        # Without tombstones an absent row cannot be claimed: MISSING, not a silent pass.
        with pytest.raises(StaleTokenError) as caught:
            RowGuard(conn, table).claim(2, 5)
        assert caught.value.reason is Reason.MISSING
    assert _row(engine, table, 1).fence == 0


def test_absent_row_claim_needs_an_insertable_tombstone(engine: Engine, metadata: MetaData) -> None:
    table = Table(
        _name("strict"),
        metadata,
        Column("id", Integer, primary_key=True, autoincrement=False),
        Column("owner", String(20), nullable=False),  # no default: no tombstone row possible
        fence_column(),
        tombstone_column(),
    )
    with engine.begin() as conn:
        table.create(conn)
        conn.execute(insert(table).values(id=1, owner="a").execution_options(unfenced=True))
    with engine.begin() as conn:
        guard = RowGuard(conn, table)
        assert guard.claim(1, 5) == 5
        with pytest.raises(StaleTokenError) as caught:
            guard.claim(2, 5)
        assert caught.value.reason is Reason.MISSING
        guard.delete(1, 6)  # a present row is soft-deleted all the same
    assert _row(engine, table, 1).deleted is True


# -- C8 -----------------------------------------------------------------------------------


def test_claim_and_registering_read_shut_out_the_old_holder(
    engine: Engine, accounts: Table
) -> None:
    with engine.begin() as conn:
        guard = RowGuard(conn, accounts)
        assert guard.claim(1, 3) == 3
        row = guard.read_for_update(2, 4)
        assert row is not None
        assert (row.balance, row.fence) == (20, 4)
    with engine.begin() as conn:
        guard = RowGuard(conn, accounts)
        with pytest.raises(StaleTokenError):
            guard.update(1, 2, {"balance": 0})
        with pytest.raises(StaleTokenError) as caught:
            guard.read_for_update(2, 3)
        assert (caught.value.reason, caught.value.fence) == (Reason.STALE, 4)
    assert (_row(engine, accounts, 1).balance, _row(engine, accounts, 1).fence) == (10, 3)


# -- C6 batches ---------------------------------------------------------------------------


def test_update_many_is_all_or_nothing_and_lists_every_rejection(
    engine: Engine, accounts: Table
) -> None:
    with engine.begin() as conn:
        guard = RowGuard(conn, accounts)
        guard.upsert(5, {"id": 3, "balance": 30})
        guard.claim(2, 9)
        with pytest.raises(StaleTokenError) as caught:
            guard.update_many(6, {1: {"balance": 1}, 2: {"balance": 2}, 404: {"balance": 4}})
        err = caught.value
        assert err.reason is Reason.STALE
        assert sorted((e.scope, e.reason, e.fence) for e in err.rejected) == [
            (f"{accounts.name}(2)", Reason.STALE, 9),
            (f"{accounts.name}(404)", Reason.MISSING, None),
        ]
        # All rows pass: every row is written, each with its own values.
        guard.update_many(9, {1: {"balance": 100}, 2: {"owner": "x"}, 3: {"balance": 300}})
    rows = {k: _row(engine, accounts, k) for k in (1, 2, 3)}
    assert [(rows[k].balance, rows[k].owner, rows[k].fence) for k in (1, 2, 3)] == [
        (100, "", 9),
        (20, "x", 9),
        (300, "", 9),
    ]


def test_batches_on_a_composite_key(engine: Engine, metadata: MetaData) -> None:
    table = Table(
        _name("lines"),
        metadata,
        Column("order_id", Integer, primary_key=True, autoincrement=False),
        Column("line", Integer, primary_key=True, autoincrement=False),
        Column("qty", Integer),
        fence_column(),
        tombstone_column(),
    )
    with engine.begin() as conn:
        table.create(conn)
        guard = RowGuard(conn, table)
        guard.upsert_many(5, [{"order_id": 1, "line": n, "qty": n} for n in (1, 2, 3)])
        guard.update_many(6, {(1, 1): {"qty": 10}, (1, 2): {"qty": 0}})
        guard.update({"order_id": 1, "line": 2}, 6, {"qty": 20})
        guard.delete((1, 3), 6)
        with pytest.raises(StaleTokenError) as caught:
            guard.upsert_many(5, [{"order_id": 1, "line": n, "qty": 0} for n in (1, 4)])
        assert [e.scope for e in caught.value.rejected] == [f"{table.name}(1, 1)"]
        rows = conn.execute(select(table).order_by(table.c.line)).all()
    assert [(r.line, r.qty, r.fence, r.deleted) for r in rows] == [
        (1, 10, 6, False),
        (2, 20, 6, False),
        (3, 3, 6, True),
    ]


# -- row-count fallback -------------------------------------------------------------------


def test_row_count_fallback_without_returning(engine: Engine, accounts: Table) -> None:
    with engine.begin() as conn:
        guard = RowGuard(conn, accounts, returning=False)
        assert guard.update(1, 5, {"balance": 1}) is None
        assert guard.upsert(5, {"id": 5, "balance": 5}) is None
        guard.update_many(6, {1: {"balance": 2}, 5: {"balance": 6}})
        guard.delete(5, 7)
        assert guard.claim(2, 7) == 7
        for stale in (
            lambda: guard.update(1, 5, {"balance": 9}),
            lambda: guard.upsert(5, {"id": 1, "balance": 9}),
            lambda: guard.update_many(5, {1: {"balance": 9}}),
        ):
            with pytest.raises(StaleTokenError) as caught:
                stale()
            assert (caught.value.reason, caught.value.fence) == (Reason.STALE, 6)
    assert (_row(engine, accounts, 1).balance, _row(engine, accounts, 5).deleted) == (2, True)


# -- fence register -----------------------------------------------------------------------


@pytest.fixture
def register_table(engine: Engine, metadata: MetaData) -> Table:
    """A fresh fence register."""
    table = fence_register_table(metadata, _name("register"))
    with engine.begin() as conn:
        table.create(conn)
    return table


def test_register_claim_fence_and_registering_read(
    engine: Engine, register_table: Table, accounts: Table
) -> None:
    with engine.begin() as conn:
        register = FenceRegister(conn, register_table)
        assert register.fence("order:1") is None
        assert register.claim("order:1", 5) == 5
        assert register.claim("order:1", 5) == 5
        result = register.read("order:1", 6, select(accounts.c.balance).where(accounts.c.id == 1))
        assert result.scalar() == 10
        with pytest.raises(StaleTokenError) as caught:
            register.claim("order:1", 4)
        assert (caught.value.reason, caught.value.fence, caught.value.scope) == (
            Reason.STALE,
            6,
            "order:1",
        )
        with pytest.raises(StaleTokenError):
            register.read("order:1", 4, select(accounts))
    with engine.begin() as conn:
        assert FenceRegister(conn, register_table).fence("order:1") == 6


def test_register_claim_many_is_all_or_nothing(engine: Engine, register_table: Table) -> None:
    with engine.begin() as conn:
        register = FenceRegister(conn, register_table)
        register.claim("a", 10)
        register.claim("c", 12)
        with pytest.raises(StaleTokenError) as caught:
            register.claim_many(["a", "b", "c", "d"], 11)
        assert [(e.scope, e.fence) for e in caught.value.rejected] == [("c", 12)]
        assert [register.fence(s) for s in "abcd"] == [10, None, 12, None]
        register.claim_many(["a", "b", "c"], 12)
        assert [register.fence(s) for s in "abc"] == [12, 12, 12]


def test_register_fences_a_unit_of_work_across_tables(
    engine: Engine, register_table: Table, metadata: MetaData
) -> None:
    # C6/C7 with a register: claim the scope, then write and hard-delete rows of tables
    # that have no fence column of their own by hand.
    lines = Table(
        _name("lines"),
        metadata,
        Column("id", Integer, primary_key=True, autoincrement=False),
        Column("qty", Integer),
    )
    with engine.begin() as conn:
        lines.create(conn)
        conn.execute(insert(lines), [{"id": 1, "qty": 10}, {"id": 2, "qty": 20}])
    with engine.begin() as conn:
        FenceRegister(conn, register_table).claim("acct", 7)
        conn.execute(lines.update().where(lines.c.id == 1).values(qty=0))
        conn.execute(lines.delete().where(lines.c.id == 2))
    # The old holder claims first and is refused before it writes anything.
    with engine.begin() as conn, pytest.raises(StaleTokenError):
        FenceRegister(conn, register_table).claim("acct", 6)
    assert _row(engine, lines, 2) is None
    assert _row(engine, lines, 1).qty == 0
