"""A unit of work under a lease: acquire, bind, claim, run, commit, release in one decorator.

python examples/repository_wrapper.py
DATABASE_URL=postgresql+psycopg://... python examples/repository_wrapper.py
"""

from __future__ import annotations

import os
import tempfile

from sqlalchemy import create_engine, select
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

from fence import MemoryLockManager
from fence.adapters.orm import UnitOfWork, fence_column, fence_register_table


class Base(DeclarativeBase):
    pass


class Account(Base):
    __tablename__ = "example_uow_accounts"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=False)
    balance: Mapped[int]
    fence: Mapped[int] = fence_column()


REGISTER = fence_register_table(Base.metadata, "example_uow_register")


def main(url: str) -> int:
    """Deposit twice through the wrapper; return 0 if both landed, fenced."""
    engine = create_engine(url)
    Base.metadata.drop_all(engine)
    Base.metadata.create_all(engine)
    manager = MemoryLockManager(ttl=10)
    uow = UnitOfWork(manager, sessionmaker(engine), register=REGISTER)

    with uow("account:7") as session:  # the context-manager form
        session.add(Account(id=7, balance=0))

    @uow.fenced("account:{account_id}")  # the lock and claim scope, from the arguments
    def deposit(account_id: int, amount: int, *, session: Session) -> None:
        account = session.get_one(Account, account_id)
        account.balance += amount
        print(f"deposit {amount} into account {account_id}")

    deposit(7, 100)
    deposit(7, 50)
    with Session(engine) as s:
        balance, fence = s.execute(select(Account.balance, Account.fence)).one()
    print(f"balance {balance}, fence {fence} (the token of the last unit of work)")
    manager.close()
    engine.dispose()
    return 0 if balance == 150 and fence > 0 else 1


if __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:  # SQLite by default; or DATABASE_URL
        raise SystemExit(main(os.environ.get("DATABASE_URL", f"sqlite:///{tmp}/uow.db")))
