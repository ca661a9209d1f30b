# WARNING: this file is generated from tests/_async/test_manager_conformance.py by tools/async_to_sync.py.
# Do not edit it; edit the source and run `python tools/async_to_sync.py`.
"""The lock-manager conformance suite: every backend, sync and async, must pass it.

Each test runs once per backend registered in ``tests/backend_*.py``. The sync twin in
``tests/_sync`` is generated from this file, with threads where this file has tasks.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from fence import (
    MAX_TOKEN,
    AcquireTimeout,
    ConfigurationError,
    EventBus,
    EventKind,
    InvalidResourceError,
    Lease,
    LeaseExpiredError,
    LeaseLostError,
    NotOwnerError,
)
from fence.abc import LockManager
from fence.testing import EventRecorder
from tests._compat import gather, join, sleep, spawn
from tests.registry import ManagerBackend

IS_ASYNC = False

Make = Callable[..., Any]


@pytest.fixture
def make_manager(manager_backend: ManagerBackend, request: pytest.FixtureRequest) -> Iterator[Make]:
    """Build managers that share one lock space; close them all after the test."""
    context = manager_backend.setup(request)
    built: list[Any] = []

    def make(**options: Any) -> Any:
        manager = manager_backend.make(context, IS_ASYNC, **options)
        built.append(manager)
        return manager

    yield make
    for manager in built:
        manager.close()


@pytest.fixture
def resource() -> str:
    return f"res:{secrets.token_hex(4)}"


def other_owner(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` as a different owner (another task, or another thread) and return its result."""
    return join(spawn(fn))


def test_implements_protocol(make_manager: Make) -> None:
    manager = make_manager()
    assert isinstance(manager, LockManager)


def test_acquire_returns_valid_lease(make_manager: Make, resource: str) -> None:
    manager = make_manager(ttl=5)
    lease = manager.acquire(resource)
    assert isinstance(lease, Lease)
    assert lease.resource == resource
    assert isinstance(lease.token, int)
    assert 1 <= lease.token <= MAX_TOKEN
    assert 0 < lease.remaining() <= 5
    assert lease.valid
    lease.check(min_remaining=1)
    lease.release()
    assert not lease.valid
    assert lease.released


def test_tokens_strictly_increase(make_manager: Make, resource: str) -> None:
    """C2: every new acquisition gets a token above every earlier one."""
    manager = make_manager()
    tokens = []
    for _ in range(5):
        lease = manager.acquire(resource)
        tokens.append(lease.token)
        lease.release()
    assert tokens == sorted(tokens)
    assert len(set(tokens)) == len(tokens)


def test_tokens_increase_across_manager_restarts(make_manager: Make, resource: str) -> None:
    """C2: a new manager on the same backend keeps issuing larger tokens."""
    first = make_manager()
    lease = first.acquire(resource)
    lease.release()
    first.close()
    second = make_manager()
    again = second.acquire(resource)
    assert again.token > lease.token
    again.release()


def test_concurrent_owners_get_increasing_tokens_and_exclusion(
    make_manager: Make, resource: str
) -> None:
    """C2 under concurrency: tokens seen inside the critical section strictly increase, and
    no two owners are ever inside at once."""
    manager = make_manager(ttl=10)
    seen: list[int] = []
    inside = [0]
    overlaps = [0]

    def worker() -> None:
        for _ in range(8):
            lease = manager.acquire(resource, timeout=30)
            inside[0] += 1
            if inside[0] > 1:
                overlaps[0] += 1
            seen.append(lease.token)
            sleep(0.001)
            inside[0] -= 1
            lease.release()

    gather(*([worker] * 4))
    assert overlaps[0] == 0
    assert len(seen) == 32
    assert seen == sorted(seen)
    assert len(set(seen)) == len(seen)


def test_try_acquire_when_held_returns_none(make_manager: Make, resource: str) -> None:
    manager = make_manager()
    lease = manager.acquire(resource)

    def attempt() -> Any:
        return manager.try_acquire(resource)

    assert other_owner(attempt) is None
    lease.release()
    got = other_owner(attempt)
    assert got is not None
    assert got.token > lease.token
    got.release()


def test_acquire_timeout(make_manager: Make, resource: str) -> None:
    manager = make_manager(ttl=30)
    lease = manager.acquire(resource)

    def attempt() -> Any:
        return manager.acquire(resource, timeout=0.3)

    with pytest.raises(AcquireTimeout) as info:
        other_owner(attempt)
    assert info.value.resource == resource
    assert lease.valid
    lease.release()


def test_waiter_is_woken_by_release(make_manager: Make, resource: str) -> None:
    """A waiter gets the lock when it is released, long before the holder's ttl ends, and
    without polling: it makes only a handful of attempts while it waits."""
    manager = make_manager(ttl=60)
    holder = manager.acquire(resource)
    attempts = [0]
    driver = manager.driver
    real_acquire = driver.acquire

    def counting_acquire(*args: Any) -> Any:
        attempts[0] += 1
        return real_acquire(*args)

    driver.acquire = counting_acquire

    def waiter() -> int:
        lease = manager.acquire(resource, timeout=20)
        token = lease.token
        lease.release()
        return int(token)

    task = spawn(waiter)
    sleep(0.5)
    holder.release()
    token = join(task)
    assert token > holder.token
    assert attempts[0] <= 4


def test_waiter_is_woken_when_holder_expires(
    make_manager: Make, manager_backend: ManagerBackend, resource: str
) -> None:
    """A holder that crashed never releases; its lease runs out and the waiter gets in."""
    manager = make_manager()
    crashed = manager.acquire(resource, ttl=0.4)

    def waiter() -> int:
        lease = manager.acquire(resource, timeout=10 + manager_backend.expiry_slack)
        token = lease.token
        lease.release()
        return int(token)

    token = other_owner(waiter)
    assert token > crashed.token
    with pytest.raises(NotOwnerError):
        crashed.release()


def test_reentrant_acquire_keeps_token(make_manager: Make, resource: str) -> None:
    """C2: a reentrant acquire by the same owner keeps its token; it takes as many releases."""
    manager = make_manager()
    outer = manager.acquire(resource)
    inner = manager.acquire(resource)
    assert inner is outer
    assert inner.token == outer.token

    def attempt() -> Any:
        return manager.try_acquire(resource)

    inner.release()
    assert outer.valid
    assert other_owner(attempt) is None
    outer.release()
    got = other_owner(attempt)
    assert got is not None
    got.release()


def test_not_reentrant_when_disabled(make_manager: Make, resource: str) -> None:
    manager = make_manager(reentrant=False)
    lease = manager.acquire(resource)
    assert manager.try_acquire(resource) is None
    lease.release()


def test_owners_do_not_share_ownership(make_manager: Make, resource: str) -> None:
    """C11: another task (or thread) is another owner, even with the same manager."""
    manager = make_manager()
    lease = manager.acquire(resource)

    def second() -> Any:
        return manager.try_acquire(resource)

    results = gather(second, second)
    assert results == [None, None]
    lease.release()


def test_non_owner_cannot_release(make_manager: Make, resource: str) -> None:
    """C11: a forged secret releases nothing, and an expired holder's release does not
    delete the new holder's lock."""
    manager = make_manager()
    holder = manager.acquire(resource, ttl=0.3)
    assert not manager.driver.release(resource, "forged-secret")
    assert not manager.driver.renew(resource, "forged-secret", 10.0)
    info = manager.inspect(resource)
    assert info is not None
    assert info.token == holder.token

    sleep(0.5)

    def take() -> Any:
        return manager.acquire(resource, ttl=10, timeout=5)

    newer = other_owner(take)
    with pytest.raises(NotOwnerError):
        holder.release()
    info = manager.inspect(resource)
    assert info is not None
    assert info.token == newer.token
    newer.release()


def test_release_twice_raises(make_manager: Make, resource: str) -> None:
    manager = make_manager()
    lease = manager.acquire(resource)
    lease.release()
    with pytest.raises(NotOwnerError):
        lease.release()


def test_context_manager_releases(make_manager: Make, resource: str) -> None:
    manager = make_manager()
    with manager.lock(resource) as lease:
        assert lease.valid
        assert (manager.inspect(resource)) is not None
    assert lease.released
    assert manager.inspect(resource) is None
    with manager.acquire(resource) as second:
        assert second.token > lease.token
    assert manager.inspect(resource) is None


def test_client_deadline_ends_before_backend(make_manager: Make, resource: str) -> None:
    """C10: the client stops trusting the lease before the backend expires it."""
    manager = make_manager(ttl=5, drift=0.01, margin=0.002)
    lease = manager.acquire(resource)
    info = manager.inspect(resource)
    client_left = lease.remaining()
    assert info is not None
    assert info.token == lease.token
    assert 0 < client_left < info.remaining <= 5
    lease.release()


def test_check_raises_when_time_is_short(make_manager: Make, resource: str) -> None:
    manager = make_manager()
    lease = manager.acquire(resource, ttl=2)
    with pytest.raises(LeaseExpiredError) as info:
        lease.check(min_remaining=10)
    assert info.value.token == lease.token
    assert not isinstance(info.value, LeaseLostError)
    lease.release()
    with pytest.raises(LeaseExpiredError):
        lease.check()


def test_expired_lease_is_invalid(make_manager: Make, resource: str) -> None:
    manager = make_manager()
    lease = manager.acquire(resource, ttl=0.2)
    sleep(0.3)
    assert not lease.valid
    with pytest.raises(LeaseExpiredError):
        lease.check()
    assert lease.wait_lost(timeout=0)


def test_watchdog_keeps_the_lease(make_manager: Make, resource: str) -> None:
    manager = make_manager(renew=True)
    lease = manager.acquire(resource, ttl=0.6)
    sleep(1.5)
    assert lease.valid
    assert not lease.lost

    def attempt() -> Any:
        return manager.try_acquire(resource)

    assert other_owner(attempt) is None
    info = manager.inspect(resource)
    assert info is not None
    assert info.token == lease.token
    lease.release()


def test_lost_lease_signal_when_renewal_fails(make_manager: Make, resource: str) -> None:
    """C10: when a renewal fails the holder hears it three ways: callback, event, check()."""
    bus = EventBus()
    manager = make_manager(renew=True, events=bus)
    calls: list[tuple[Any, Exception]] = []
    with EventRecorder(bus) as recorder:
        lease = manager.acquire(
            resource, ttl=0.6, on_lost=lambda lease, err: calls.append((lease, err))
        )
        revoked = manager.revoke(resource)
        assert revoked > lease.token
        assert lease.wait_lost(timeout=5)
    assert lease.lost
    assert not lease.valid
    assert len(calls) == 1
    assert calls[0][0] is lease
    assert isinstance(calls[0][1], LeaseLostError)
    with pytest.raises(LeaseLostError) as info:
        lease.check()
    assert info.value.token == lease.token
    assert len(recorder.of(EventKind.LOST)) == 1
    late: list[Any] = []
    lease.on_lost(lambda lease, err: late.append(err))
    assert len(late) == 1
    with pytest.raises(NotOwnerError):
        lease.release()


def test_revoke_fences_out_the_holder(make_manager: Make, resource: str) -> None:
    manager = make_manager()
    hung = manager.acquire(resource, ttl=60)
    revoked = manager.revoke(resource)
    assert revoked > hung.token
    assert manager.inspect(resource) is None

    def take() -> Any:
        return manager.acquire(resource, timeout=5)

    newer = other_owner(take)
    assert newer.token > revoked
    with pytest.raises(LeaseLostError):
        hung.renew()
    newer.release()


def test_inspect(make_manager: Make, resource: str) -> None:
    manager = make_manager()
    assert manager.inspect(resource) is None
    lease = manager.acquire(resource, ttl=5)
    info = manager.inspect(resource)
    assert info is not None
    assert info.resource == resource
    assert info.token == lease.token
    assert 0 < info.remaining <= 5
    assert info.holder
    assert lease._secret not in str(info)
    lease.release()


def test_explicit_renew_extends(make_manager: Make, resource: str) -> None:
    manager = make_manager()
    lease = manager.acquire(resource, ttl=0.5)
    sleep(0.3)
    lease.renew(ttl=5)
    assert lease.remaining() > 1
    info = manager.inspect(resource)
    assert info is not None
    assert info.remaining > 1
    lease.release()
    with pytest.raises(NotOwnerError):
        lease.renew()


@pytest.mark.parametrize("bad", ["", "x" * 513, None, 42, b"bytes", "nul\x00byte"])
def test_bad_resource_names(make_manager: Make, bad: Any) -> None:
    manager = make_manager()
    with pytest.raises(InvalidResourceError):
        manager.acquire(bad)
    with pytest.raises(InvalidResourceError):
        manager.inspect(bad)


@pytest.mark.parametrize("ttl", [0, -1, float("nan"), float("inf"), "10", True])
def test_bad_ttl(make_manager: Make, resource: str, ttl: Any) -> None:
    manager = make_manager()
    with pytest.raises(ConfigurationError):
        manager.acquire(resource, ttl=ttl)


def test_events(make_manager: Make, resource: str) -> None:
    bus = EventBus()
    manager = make_manager(events=bus)
    with EventRecorder(bus) as recorder:
        lease = manager.acquire(resource)
        lease.release()
    assert recorder.kinds() == ["acquired", "released"]
    assert {e.token for e in recorder.events} == {lease.token}
    assert {e.scope for e in recorder.events} == {resource}
