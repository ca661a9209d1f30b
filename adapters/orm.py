"""Fencing for the SQLAlchemy ORM (2.x): a session hook, a drop-in for ``version_id_col``
and a unit-of-work wrapper, for ``Session`` and ``AsyncSession``.

Importing this module installs the session hook (class-level listeners, once). Bind a
session to a lease and every flush of a mapped class with a fence column is fenced::

    from fence.adapters.orm import bind, fence_column

    class Account(Base):
        __tablename__ = "accounts"
        id: Mapped[int] = mapped_column(primary_key=True)
        balance: Mapped[int]
        fence: Mapped[int] = fence_column()

    with manager.lock("account:42") as lease, Session(engine) as session:
        bind(session, lease)                 # claims "account:42" before the first read
        session.get(Account, 42).balance += 5
        session.commit()                     # UPDATE ... WHERE fence <= :token

See ``docs/orm.md``.
"""

from __future__ import annotations

from ._async.repository import AsyncUnitOfWork
from ._orm import (
    BINDING_KEY,
    INCLUDE_TOMBSTONES,
    SessionBinding,
    StaleTokenError,
    bind,
    binding,
    check_lease,
    fence_column,
    fenced_version,
    install,
    tombstone_column,
    unbind,
)
from ._sql_gate import UNFENCED
from ._sql_statements import FENCE_INFO, fence_of, fence_register_table
from ._sync.repository import UnitOfWork

__all__ = [
    "BINDING_KEY",
    "FENCE_INFO",
    "INCLUDE_TOMBSTONES",
    "UNFENCED",
    "AsyncUnitOfWork",
    "SessionBinding",
    "StaleTokenError",
    "UnitOfWork",
    "bind",
    "binding",
    "check_lease",
    "fence_column",
    "fence_of",
    "fence_register_table",
    "fenced_version",
    "tombstone_column",
    "unbind",
]

install()

for _name in (
    "AsyncUnitOfWork",
    "SessionBinding",
    "UnitOfWork",
    "bind",
    "binding",
    "check_lease",
    "fence_column",
    "fenced_version",
    "tombstone_column",
    "unbind",
):
    globals()[_name].__module__ = __name__
del _name
