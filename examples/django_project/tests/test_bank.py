"""The bank's tests, as a project writes them with pytest-django: a lease from an
in-memory lock manager on a manual clock (a pause is a clock step), the database's judge
(the migrations install it in the test database) refusing what a paused holder writes.

``django_db`` runs a test inside a transaction rolled back at its end (the blocks are
savepoints of it); ``django_db(transaction=True)`` commits for real, and pytest-django
flushes every table after the test, fenced ones included.
"""

from __future__ import annotations

import pytest
from bank.models import Account
from bank.services import deposit, open_account
from django.db import transaction

from fence import (
    Lease,
    LeaseExpiredError,
    ManualClock,
    MemoryLockManager,
    StaleTokenError,
    TokenRequiredError,
)
from fence.adapters.django import fenced, unfenced


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def manager(clock: ManualClock) -> MemoryLockManager:
    return MemoryLockManager(clock=clock, ttl=10)


def _paused_holder(manager: MemoryLockManager, clock: ManualClock) -> tuple[Lease, Lease]:
    """A holder that paused past its lease, and the one that took the lock meanwhile."""
    old = manager.acquire("account:1", owner="old")
    clock.advance(15)  # old's lease ran out while it was paused
    new = manager.acquire("account:1", owner="new")
    return old, new


def _story(manager: MemoryLockManager, clock: ManualClock) -> None:
    with manager.lock("account:1") as lease:
        pk = open_account(lease, "ada").pk
        assert deposit(lease, pk, 100) == 100
    old, new = _paused_holder(manager, clock)
    assert deposit(new, pk, 5) == 105
    with pytest.raises(LeaseExpiredError):
        deposit(old, pk, 1000)  # a block checks the lease as it starts: run out
    with pytest.raises(StaleTokenError):
        # The paused holder's block had started before its pause: it writes with the token
        # it held. The database refuses it: the row's fence is new's.
        deposit(old.token, pk, 1000)
    with pytest.raises(StaleTokenError), fenced(old.token):
        Account.objects.filter(pk=pk).update(balance=0)
    # No token: refused before any I/O. Django marks the transaction around a failed
    # update() for rollback, as for any error: the test's own atomic() keeps it apart.
    with pytest.raises(TokenRequiredError), transaction.atomic():
        Account.objects.filter(pk=pk).update(balance=0)
    account = Account.objects.get(pk=pk)
    assert (account.balance, account.fence) == (105, new.token)


@pytest.mark.django_db
def test_a_paused_holder_is_refused(manager: MemoryLockManager, clock: ManualClock) -> None:
    _story(manager, clock)


@pytest.mark.django_db(transaction=True)
def test_a_paused_holder_is_refused_in_committed_transactions(
    manager: MemoryLockManager, clock: ManualClock
) -> None:
    _story(manager, clock)


@pytest.mark.django_db(transaction=True)
def test_the_flush_after_a_committed_test_left_nothing() -> None:
    assert not Account.objects.exists()


@pytest.mark.django_db
def test_a_repair_opts_out(manager: MemoryLockManager) -> None:
    with manager.lock("account:1") as lease:
        pk = open_account(lease, "ada").pk
    with unfenced():
        Account.objects.filter(pk=pk).update(owner="Ada")  # a data fix, no lease
    assert Account.objects.get(pk=pk).owner == "Ada"
