"""The ORM session hook: a holder that paused past its lease cannot flush its stale write.

A reads an account, then pauses; its lease runs out. B takes the lock, adds 50 and
commits. A wakes and flushes its own change, computed from what it read: refused.

    python examples/session_hook.py
    DATABASE_URL=postgresql+psycopg://... python examples/session_hook.py
"""

from __future__ import annotations

import os
import tempfile

from sqlalchemy import Integer, create_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from fence import ManualClock, MemoryLockManager
from fence.adapters.orm import StaleTokenError, bind, fence_column, fence_register_table


class Base(DeclarativeBase):
    pass


class Account(Base):
    __tablename__ = "example_hook_accounts"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    balance: Mapped[int]
    fence: Mapped[int] = fence_column()  # BIGINT NOT NULL DEFAULT 0


REGISTER = fence_register_table(Base.metadata, "example_hook_register")


def main(url: str) -> int:
    """Run the story; return 0 if A's stale flush was refused."""
    engine = create_engine(url)
    Base.metadata.drop_all(engine)
    Base.metadata.create_all(engine)
    clock = ManualClock()
    manager = MemoryLockManager(clock=clock, ttl=10)

    lease_a = manager.acquire("account:1", owner="A")
    with Session(engine) as seed:
        bind(seed, lease_a, register=REGISTER)
        seed.add(Account(id=1, balance=100))  # a fenced insert (upsert)
        seed.commit()

    with Session(engine) as a:
        bind(a, lease_a, claim=False)
        account = a.get_one(Account, 1)
        print(f"A (token {lease_a.token}) reads balance {account.balance}, then pauses")
        clock.advance(15)  # A's lease runs out while it is paused

        lease_b = manager.acquire("account:1", owner="B")
        with Session(engine) as b:
            bind(b, lease_b, register=REGISTER)  # claims account:1 before its first read
            b.get_one(Account, 1).balance += 50
            b.commit()
        print(f"B (token {lease_b.token}) adds 50 and commits")

        account.balance -= 30  # A wakes and writes what it computed from its old read
        try:
            a.flush()
        except StaleTokenError as err:
            print(f"A's flush is refused: {err.reason}, token {err.token} < fence {err.fence}")
            a.rollback()
        else:
            return 1

    with Session(engine) as check:
        final = check.get_one(Account, 1)
        print(f"balance {final.balance}, fence {final.fence}")
        ok = final.balance == 150 and final.fence == lease_b.token
    lease_b.release()
    manager.close()
    engine.dispose()
    return 0 if ok else 1


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:  # SQLite by default; or DATABASE_URL
        raise SystemExit(main(os.environ.get("DATABASE_URL", f"sqlite:///{tmp}/hook.db")))
