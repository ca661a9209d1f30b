"""Leases and fenced rows on one MariaDB database: the SQL lock manager and the row guard.

A reader and a writer share the lock in turn, the writer's lease runs out while it stalls,
and its late write is refused by the row's fence.

    MARIADB_URL=mariadb+pymysql://user:password@host/db python examples/mariadb_locks.py
"""

from __future__ import annotations

import os
import sys
import time

from sqlalchemy import Column, Integer, MetaData, Table, create_engine

import fence
from fence import StaleTokenError
from fence.adapters.sql import RowGuard, fence_column


def main() -> int:
    """Run the story; return 0 if the stale write was refused and nothing was lost."""
    url = os.environ.get("MARIADB_URL")
    if not url:
        print("set MARIADB_URL, e.g. mariadb+pymysql://user:password@127.0.0.1/db")
        return 2
    engine = create_engine(url)
    metadata = MetaData()
    accounts = Table(
        f"accounts_{os.getpid()}",
        metadata,
        Column("id", Integer, primary_key=True),
        Column("balance", Integer, nullable=False),
        fence_column(),
    )
    metadata.create_all(engine)  # the table and the database's judge (its triggers)
    manager = fence.connect(url, create_table=True, ttl=0.5)

    with manager.read_lock("account:42") as reader:
        print(f"a reader holds account:42 (read token {int(reader.token)})")
    first = manager.acquire("account:42", owner="first")
    with engine.begin() as conn:
        RowGuard(conn, accounts).upsert(first.token, {"id": 42, "balance": 100})
    print(f"first holder, token {first.token}, writes balance 100, then stalls")

    time.sleep(0.6)  # past its 0.5 s lease, by the server's clock
    with manager.lock("account:42", timeout=5, owner="second") as second, engine.begin() as conn:
        guard = RowGuard(conn, accounts)
        current = guard.read_for_update(42, second.token)
        assert current is not None
        guard.update(42, second.token, {"balance": current.balance + 30})
        print(f"second holder, token {second.token}: balance {current.balance} -> +30")

    try:
        with engine.begin() as conn:
            RowGuard(conn, accounts).update(42, first.token, {"balance": 150})
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
    sys.exit(main())
