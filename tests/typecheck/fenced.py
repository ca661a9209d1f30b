"""What type checkers see of ``UnitOfWork.fenced``: checked by ``tests/test_docs.py``.

Not run: ``mypy --strict`` reads it. Each ``type: ignore`` must be needed (strict warns on
an unused one), so a decorated function typed ``(*Any, **Any) -> Any`` again fails here.
"""

from __future__ import annotations

from typing import assert_type

from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from fence.adapters.orm import AsyncUnitOfWork, UnitOfWork


def sync_side(uow: UnitOfWork) -> None:
    @uow.fenced("account:{account_id}")
    def deposit(session: Session, account_id: int, amount: int = 1) -> str:
        return f"{account_id}:{amount}"

    assert_type(deposit(7, 100), str)
    assert_type(deposit(account_id=7), str)
    deposit("7")  # type: ignore[arg-type]
    deposit(7, session=None)  # type: ignore[call-arg]

    @uow.fenced("account:{account_id}")  # the session as a keyword: its result keeps its type
    def withdraw(account_id: int, *, session: Session) -> int:
        return account_id

    assert_type(withdraw(7), int)


async def async_side(uow: AsyncUnitOfWork) -> None:
    @uow.fenced("account:{account_id}")
    async def deposit(session: AsyncSession, account_id: int, amount: int = 1) -> str:
        return f"{account_id}:{amount}"

    assert_type(await deposit(7, 100), str)
    await deposit("7")  # type: ignore[arg-type]

    @uow.fenced("account:{account_id}")
    async def withdraw(account_id: int, *, session: AsyncSession) -> int:
        return account_id

    assert_type(await withdraw(7), int)
