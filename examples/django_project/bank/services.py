"""What the bank does under a lease: the writes go inside ``fenced(lease)``."""

from __future__ import annotations

from typing import Any

from fence.adapters.django import fenced

from .models import Account


def open_account(lease: Any, owner: str) -> Account:
    """Open an account under ``lease`` (its token becomes the row's fence)."""
    with fenced(lease):
        account: Account = Account.objects.create(owner=owner)
    return account


def deposit(lease: Any, pk: int, amount: int) -> int:
    """Add ``amount`` to account ``pk`` under ``lease``; the new balance.

    Raises:
        fence.StaleTokenError: a newer holder of the lease's resource came first.
    """
    with fenced(lease):
        account = Account.objects.get(pk=pk)  # claims the lease's resource (C8)
        account.balance += amount
        account.save(update_fields=["balance"])
    balance: int = account.balance
    return balance
