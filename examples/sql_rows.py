"""Fenced SQL rows with SQLAlchemy Core, on SQLite (or PostgreSQL via DATABASE_URL).

Two holders in turn deposit onto one account; the first one's late write is refused.

    python examples/sql_rows.py
"""

from __future__ import annotations

import os
import tempfile
import time

from sqlalchemy import Column, Integer, MetaData, Table, create_engine

from fence import SQLLockManager, StaleTokenError
from fence.adapters.sql import RowGuard, fence_column


def main() -> int:
    """Run the story; return 0 if the stale write was refused and nothing was lost."""
    with tempfile.TemporaryDirectory(prefix="iofence-example-") as tmp:
        return story(tmp)


def story(tmp: str) -> int:
    """Deposit twice into an account kept in ``tmp`` (unless DATABASE_URL names a database)."""
    engine = create_engine(os.environ.get("DATABASE_URL") or f"sqlite:///{tmp}/bank.db")
    metadata = MetaData()
    accounts = Table(
        f"accounts_{os.getpid()}",
        metadata,
        Column("id", Integer, primary_key=True),
        Column("balance", Integer, nullable=False),
        fence_column(),  # BIGINT NOT NULL DEFAULT 0
    )
    metadata.create_all(engine)
    manager = SQLLockManager(engine, create_table=True, ttl=0.5)

    first = manager.acquire("account:42", owner="first")
    with engine.begin() as conn:
        RowGuard(conn, accounts).upsert(first.token, {"id": 42, "balance": 100})
        row = RowGuard(conn, accounts).read_for_update(42, first.token)  # claim + read (C8)
    assert row is not None  # None would mean: no live row (absent, or a tombstone)
    print(f"first holder, token {first.token}, reads balance {row.balance}, then stalls")

    time.sleep(0.6)  # past its 0.5 s lease
    with manager.lock("account:42", timeout=5, owner="second") as second, engine.begin() as conn:
        guard = RowGuard(conn, accounts)
        current = guard.read_for_update(42, second.token)
        assert current is not None
        guard.update(42, second.token, {"balance": current.balance + 30})
        print(f"second holder, token {second.token}: balance {current.balance} -> +30")

    try:
        with engine.begin() as conn:
            RowGuard(conn, accounts).update(42, first.token, {"balance": row.balance + 50})
    except StaleTokenError as err:
        print(f"first holder wakes, writes with {err.token}: {err.reason} (fence {err.fence})")
    with engine.connect() as conn:
        balance = conn.execute(accounts.select()).one().balance
    print(f"balance = {balance}")
    accounts.drop(engine)
    manager.close()
    engine.dispose()
    return 0 if balance == 130 else 1


if __name__ == "__main__":
    raise SystemExit(main())
