"""The lock-manager conformance suite: every backend, sync and async, must pass it.

Each test runs once per backend registered in ``tests/backend_*.py``. The sync twin in
``tests/_sync`` is generated from this file, with threads where this file has tasks.
"""

from __future__ import annotations

import asyncio  # unasync: remove
import math
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

import fence._async.manager as manager_module
from fence import (
    MAX_TOKEN,
    AcquireTimeout,
    AsyncLease,
    BackendError,
    ConfigurationError,
    EventBus,
    EventKind,
    FenceError,
    InvalidResourceError,
    LeaseExpiredError,
    LeaseLostError,
    LeaseMode,
    NotOwnerError,
)
from fence.abc import AsyncLockManager
from fence.testing import EventRecorder
from tests._acompat import gather, join, sleep, spawn
from tests.registry import ManagerBackend

IS_ASYNC = True  # unasync: IS_ASYNC = False

Make = Callable[..., Any]

#: How a call under the lock is cut short: a task is cancelled, a thread is interrupted.
Interrupted = asyncio.CancelledError  # unasync: Interrupted = KeyboardInterrupt


@pytest.fixture
async def make_manager(
    manager_backend: ManagerBackend, request: pytest.FixtureRequest
) -> AsyncIterator[Make]:
    """Build managers that share one lock space; close them all after the test."""
    context = manager_backend.setup(request)
    built: list[Any] = []

    def make(**options: Any) -> Any:
        manager = manager_backend.make(context, IS_ASYNC, **options)
        built.append(manager)
        return manager

    yield make
    for manager in built:
        await manager.close()


@pytest.fixture
def resource() -> str:
    return f"res:{secrets.token_hex(4)}"


async def other_owner(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` as a different owner (another task, or another thread) and return its result."""
    return await join(await spawn(fn))


async def test_implements_protocol(make_manager: Make) -> None:
    manager = make_manager()
    assert isinstance(manager, AsyncLockManager)


async def test_acquire_returns_valid_lease(make_manager: Make, resource: str) -> None:
    manager = make_manager(ttl=5)
    lease = await manager.acquire(resource)
    assert isinstance(lease, AsyncLease)
    assert lease.resource == resource
    assert isinstance(lease.token, int)
    assert 1 <= lease.token <= MAX_TOKEN
    assert 0 < lease.remaining() <= 5
    assert lease.valid
    lease.check(min_remaining=1)
    await lease.release()
    assert not lease.valid
    assert lease.released


async def test_tokens_strictly_increase(make_manager: Make, resource: str) -> None:
    """C2: every new acquisition gets a token above every earlier one."""
    manager = make_manager()
    tokens = []
    for _ in range(5):
        lease = await manager.acquire(resource)
        tokens.append(lease.token)
        await lease.release()
    assert tokens == sorted(tokens)
    assert len(set(tokens)) == len(tokens)


async def test_tokens_increase_across_manager_restarts(make_manager: Make, resource: str) -> None:
    """C2: a new manager on the same backend keeps issuing larger tokens."""
    first = make_manager()
    lease = await first.acquire(resource)
    await lease.release()
    await first.close()
    second = make_manager()
    again = await second.acquire(resource)
    assert again.token > lease.token
    await again.release()


async def test_concurrent_owners_get_increasing_tokens_and_exclusion(
    make_manager: Make, resource: str
) -> None:
    """C2 under concurrency: tokens seen inside the critical section strictly increase, and
    no two owners are ever inside at once."""
    manager = make_manager(ttl=10)
    seen: list[int] = []
    inside = [0]
    overlaps = [0]

    async def worker() -> None:
        for _ in range(8):
            lease = await manager.acquire(resource, timeout=30)
            inside[0] += 1
            if inside[0] > 1:
                overlaps[0] += 1
            seen.append(lease.token)
            await sleep(0.001)
            inside[0] -= 1
            await lease.release()

    await gather(*([worker] * 4))
    assert overlaps[0] == 0
    assert len(seen) == 32
    assert seen == sorted(seen)
    assert len(set(seen)) == len(seen)


async def test_try_acquire_when_held_returns_none(make_manager: Make, resource: str) -> None:
    manager = make_manager()
    lease = await manager.acquire(resource)

    async def attempt() -> Any:
        return await manager.try_acquire(resource)

    assert await other_owner(attempt) is None
    await lease.release()
    got = await other_owner(attempt)
    assert got is not None
    assert got.token > lease.token
    await got.release()


async def test_acquire_timeout(make_manager: Make, resource: str) -> None:
    """The wait ends at the timeout (with a generous bound for a loaded machine: the bound
    is the point), and a timeout of 0 tries once."""
    manager = make_manager(ttl=30)
    lease = await manager.acquire(resource)

    async def attempt() -> Any:
        start = time.monotonic()
        try:
            return await manager.acquire(resource, timeout=1.5)
        finally:
            elapsed.append(time.monotonic() - start)

    elapsed: list[float] = []
    # A loaded machine can hold one round trip past the whole timeout: the deadline then
    # cuts it, and the outcome is unknown (C10), which is a BackendError that says so.
    with pytest.raises((AcquireTimeout, BackendError)) as info:
        await other_owner(attempt)
    if isinstance(info.value, AcquireTimeout):
        assert info.value.resource == resource
    else:
        assert info.value.sent, info.value
        assert "deadline" in str(info.value), info.value
    assert 1.5 <= elapsed[0] < 1.5 + 2.0

    async def once() -> Any:
        return await manager.acquire(resource, timeout=0)

    with pytest.raises(AcquireTimeout):
        await other_owner(once)
    assert lease.valid
    await lease.release()


async def test_waiter_is_woken_by_release(make_manager: Make, resource: str) -> None:
    """A waiter gets the lock when it is released, long before the holder's ttl ends, and
    without polling: it makes only a handful of attempts while it waits."""
    manager = make_manager(ttl=60)
    holder = await manager.acquire(resource)
    attempts = [0]
    driver = manager.driver
    real_acquire = driver.acquire

    async def counting_acquire(*args: Any) -> Any:
        attempts[0] += 1
        return await real_acquire(*args)

    driver.acquire = counting_acquire

    async def waiter() -> int:
        lease = await manager.acquire(resource, timeout=20)
        token = lease.token
        await lease.release()
        return int(token)

    start = time.monotonic()
    task = await spawn(waiter)
    await sleep(0.5)
    await holder.release()
    waited = time.monotonic() - start
    token = await join(task)
    assert token > holder.token
    # A driver that polls (SQLite, MariaDB) tries again every half to whole poll interval
    # while it waits: on a loaded machine the release may come later than 0.5 s.
    poll = getattr(driver, "poll_interval", None)
    allowed = 4 if poll is None else max(4, 2 + math.ceil(waited / (0.5 * poll)))
    assert attempts[0] <= allowed, f"{attempts[0]} attempts in {waited:.2f} s"


async def test_waiter_is_woken_when_holder_expires(
    make_manager: Make, manager_backend: ManagerBackend, resource: str
) -> None:
    """A holder that crashed never releases; its lease runs out and the waiter gets in."""
    manager = make_manager()
    crashed = await manager.acquire(resource, ttl=0.4)

    async def waiter() -> int:
        lease = await manager.acquire(resource, timeout=10 + manager_backend.expiry_slack)
        token = lease.token
        await lease.release()
        return int(token)

    token = await other_owner(waiter)
    assert token > crashed.token
    with pytest.raises(NotOwnerError):
        await crashed.release()


async def test_reentrant_acquire_keeps_token(make_manager: Make, resource: str) -> None:
    """C2: a reentrant acquire by the same owner keeps its token; it takes as many releases."""
    manager = make_manager()
    outer = await manager.acquire(resource)
    inner = await manager.acquire(resource)
    assert inner is outer
    assert inner.token == outer.token

    async def attempt() -> Any:
        return await manager.try_acquire(resource)

    await inner.release()
    assert outer.valid
    assert await other_owner(attempt) is None
    await outer.release()
    got = await other_owner(attempt)
    assert got is not None
    await got.release()


async def test_not_reentrant_when_disabled(make_manager: Make, resource: str) -> None:
    manager = make_manager(reentrant=False)
    lease = await manager.acquire(resource)
    assert await manager.try_acquire(resource) is None
    await lease.release()


async def test_owners_do_not_share_ownership(make_manager: Make, resource: str) -> None:
    """C11: another task (or thread) is another owner, even with the same manager."""
    manager = make_manager()
    lease = await manager.acquire(resource)

    async def second() -> Any:
        return await manager.try_acquire(resource)

    results = await gather(second, second)
    assert results == [None, None]
    await lease.release()


async def test_non_owner_cannot_release(make_manager: Make, resource: str) -> None:
    """C11: a forged secret releases nothing, and an expired holder's release does not
    delete the new holder's lock."""
    manager = make_manager()
    # A lease that outlives the three round trips below on a loaded machine (0.3 s did not).
    holder = await manager.acquire(resource, ttl=2)
    assert not await manager.driver.release(resource, "forged-secret")
    assert not await manager.driver.renew(resource, "forged-secret", 10.0)
    info = await manager.inspect(resource)
    assert info is not None
    assert info.token == holder.token

    await sleep(2.5)

    async def take() -> Any:
        return await manager.acquire(resource, ttl=10, timeout=5)

    newer = await other_owner(take)
    with pytest.raises(NotOwnerError):
        await holder.release()
    info = await manager.inspect(resource)
    assert info is not None
    assert info.token == newer.token
    await newer.release()


async def test_forged_lease_cannot_renew_or_release(make_manager: Make, resource: str) -> None:
    """C11: a lease the manager did not issue (built by hand, with a guessed secret) is
    refused by renew() as by release(), with NotOwnerError, before any I/O; the real
    holder keeps its lock."""
    manager = make_manager()
    holder = await manager.acquire(resource, ttl=30)
    forged = AsyncLease(
        manager,
        resource,
        holder.token,
        "a-guessed-secret",
        30.0,
        manager.clock.monotonic() + 30,
        object(),
    )
    with pytest.raises(NotOwnerError):
        await forged.renew()
    with pytest.raises(NotOwnerError):
        await forged.release()
    info = await manager.inspect(resource)
    assert info is not None
    assert info.token == holder.token
    foreign = make_manager()
    stolen = AsyncLease(
        foreign, resource, holder.token, holder._secret, 30.0, holder.deadline, object()
    )
    with pytest.raises(NotOwnerError):
        await stolen.renew()
    assert holder.valid
    await holder.release()


async def test_release_twice_raises(make_manager: Make, resource: str) -> None:
    manager = make_manager()
    lease = await manager.acquire(resource)
    await lease.release()
    with pytest.raises(NotOwnerError):
        await lease.release()


async def test_context_manager_releases(make_manager: Make, resource: str) -> None:
    manager = make_manager()
    async with manager.lock(resource) as lease:
        assert lease.valid
        assert (await manager.inspect(resource)) is not None
    assert lease.released
    assert await manager.inspect(resource) is None
    async with await manager.acquire(resource) as second:
        assert second.token > lease.token
    assert await manager.inspect(resource) is None


async def test_client_deadline_ends_before_backend(make_manager: Make, resource: str) -> None:
    """C10: the client stops trusting the lease before the backend expires it."""
    manager = make_manager(ttl=5, drift=0.01, margin=0.002)
    lease = await manager.acquire(resource)
    info = await manager.inspect(resource)
    client_left = lease.remaining()
    assert info is not None
    assert info.token == lease.token
    assert 0 < client_left < info.remaining <= 5
    await lease.release()


async def test_check_raises_when_time_is_short(make_manager: Make, resource: str) -> None:
    manager = make_manager()
    lease = await manager.acquire(resource, ttl=2)
    with pytest.raises(LeaseExpiredError) as info:
        lease.check(min_remaining=10)
    assert info.value.token == lease.token
    assert not isinstance(info.value, LeaseLostError)
    await lease.release()
    with pytest.raises(LeaseExpiredError):
        lease.check()


async def test_expired_lease_is_invalid(make_manager: Make, resource: str) -> None:
    manager = make_manager()
    lease = await manager.acquire(resource, ttl=0.2)
    await sleep(0.3)
    assert not lease.valid
    with pytest.raises(LeaseExpiredError):
        lease.check()
    assert await lease.wait_lost(timeout=0)


async def test_watchdog_keeps_the_lease(make_manager: Make, resource: str) -> None:
    # Three ttls' worth of renewals, each due a third of the way into a 3 s lease: a loaded
    # machine (or an etcd member slow to fsync) may hold one up by a second and more.
    manager = make_manager(renew=True)
    lease = await manager.acquire(resource, ttl=3)
    await sleep(4.5)
    assert lease.valid
    assert not lease.lost

    async def attempt() -> Any:
        return await manager.try_acquire(resource)

    assert await other_owner(attempt) is None
    info = await manager.inspect(resource)
    assert info is not None
    assert info.token == lease.token
    await lease.release()


async def test_lost_lease_signal_when_renewal_fails(make_manager: Make, resource: str) -> None:
    """C10: when a renewal fails the holder hears it three ways: callback, event, check()."""
    bus = EventBus()
    manager = make_manager(renew=True, events=bus)
    calls: list[tuple[Any, Exception]] = []
    with EventRecorder(bus) as recorder:
        lease = await manager.acquire(
            resource, ttl=0.6, on_lost=lambda lease, err: calls.append((lease, err))
        )
        revoked = await manager.revoke(resource)
        assert revoked > lease.token
        assert await lease.wait_lost(timeout=5)
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
        await lease.release()


async def test_revoke_fences_out_the_holder(make_manager: Make, resource: str) -> None:
    manager = make_manager()
    hung = await manager.acquire(resource, ttl=60)
    revoked = await manager.revoke(resource)
    assert revoked > hung.token
    assert await manager.inspect(resource) is None

    async def take() -> Any:
        return await manager.acquire(resource, timeout=5)

    newer = await other_owner(take)
    assert newer.token > revoked
    with pytest.raises(LeaseLostError):
        await hung.renew()
    await newer.release()


async def test_inspect(make_manager: Make, resource: str) -> None:
    manager = make_manager()
    assert await manager.inspect(resource) is None
    lease = await manager.acquire(resource, ttl=5)
    info = await manager.inspect(resource)
    assert info is not None
    assert info.resource == resource
    assert info.token == lease.token
    assert 0 < info.remaining <= 5
    assert info.holder
    assert lease._secret not in str(info)
    await lease.release()


async def _listed(manager: Any, prefix: str = "", **options: Any) -> list[Any]:
    rows = []
    async for row in manager.list(prefix, **options):
        rows.append(row)
    return rows


#: The backends whose list reports the acquires that wait in their queue.
_QUEUE_COUNTED = {"memory", "redis-fifo", "etcd", "zookeeper"}


async def test_list_held_locks(
    make_manager: Make, manager_backend: ManagerBackend, resource: str
) -> None:
    """``list`` shows each held lock once, with its token, holder, mode, readers and
    waiters; the prefix filters; an expired lease is not listed."""
    manager = make_manager(ttl=30)
    if not hasattr(manager.driver, "list_page"):
        with pytest.raises(ConfigurationError, match="no list"):
            await _listed(manager)
        return
    base = f"{resource}/"
    one = await manager.acquire(base + "p/one")
    other = await manager.acquire(base + "q")
    await manager.acquire(base + "p/gone", ttl=0.2)
    if manager_backend.shared:
        await manager.acquire(base + "p/read", mode="read")
        await other_owner(lambda: manager.acquire(base + "p/read", mode="read"))
    busy = await manager.acquire(base + "p/wait")
    waiter = await spawn(lambda: manager.acquire(base + "p/wait", timeout=20))
    await sleep(0.5 + manager_backend.expiry_slack)  # p/gone expires

    # The waiter joins the queue in its own time: where the listing counts waiters, list
    # again until it counts one (or 30 s have passed, and the assertions below say so).
    end = time.monotonic() + 30
    while True:
        rows = {row.resource: row for row in await _listed(manager, base + "p/")}
        waiting = rows.get(base + "p/wait")
        if manager_backend.name not in _QUEUE_COUNTED or waiting is None:
            break
        if waiting.waiters >= 1 or time.monotonic() > end:
            break
        await sleep(0.05)
    expected = {base + "p/one", base + "p/wait"}
    if manager_backend.shared:
        expected.add(base + "p/read")
        read = rows[base + "p/read"]
        assert read.mode is LeaseMode.READ
        assert len(read.readers) == 2
    assert set(rows) == expected
    assert rows[base + "p/one"].token == one.token
    assert rows[base + "p/one"].mode is LeaseMode.WRITE
    assert rows[base + "p/one"].holder
    assert 0 < rows[base + "p/one"].remaining <= 30
    assert one._secret not in str(rows[base + "p/one"])
    assert rows[base + "p/wait"].token == busy.token
    if manager_backend.name in _QUEUE_COUNTED:
        assert rows[base + "p/wait"].waiters == 1
    everything = {row.resource for row in await _listed(manager)}
    assert expected | {base + "q"} <= everything
    assert base + "p/gone" not in everything
    assert [row.token for row in await _listed(manager, base + "q")] == [other.token]

    await busy.release()
    lease = await join(waiter)
    await lease.release()


async def test_list_prefix_is_literal_and_pages(
    make_manager: Make, resource: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Glob and LIKE characters in the prefix match only themselves; small pages list
    every lock once; ``limit`` stops early."""
    manager = make_manager(ttl=30)
    if not hasattr(manager.driver, "list_page"):
        return
    base = f"{resource}/"
    names = [base + n for n in ("a*x", "a%x", "a_x", "abx", "a?x", "a[x]", "a\\x")]
    for name in names:
        await manager.acquire(name)
    for start in ("a*", "a%", "a_", "a?", "a[", "a\\"):
        assert [r.resource for r in await _listed(manager, base + start)] == [
            n for n in names if n.startswith(base + start)
        ], start
    monkeypatch.setattr(manager_module, "_LIST_PAGE", 2)
    paged = [r.resource for r in await _listed(manager, base)]
    assert sorted(paged) == sorted(names)
    assert len(await _listed(manager, base, limit=3)) == 3
    assert await _listed(manager, base, limit=0) == []
    with pytest.raises(ConfigurationError):
        await _listed(manager, base, limit=-1)


async def test_explicit_renew_extends(make_manager: Make, resource: str) -> None:
    """A renewal with a ttl past the lease's own extends it to that ttl (a lease of 3 s
    renewed for 30 s has more than 3 s left, on the client and on the server)."""
    manager = make_manager()
    lease = await manager.acquire(resource, ttl=3)
    await sleep(0.3)
    await lease.renew(ttl=30)
    assert lease.remaining() > 5
    info = await manager.inspect(resource)
    assert info is not None
    assert info.remaining > 5
    await lease.release()
    with pytest.raises(NotOwnerError):
        await lease.renew()


@pytest.mark.parametrize("bad", ["", "x" * 513, None, 42, b"bytes", "nul\x00byte"])
async def test_bad_resource_names(make_manager: Make, bad: Any) -> None:
    manager = make_manager()
    with pytest.raises(InvalidResourceError):
        await manager.acquire(bad)
    with pytest.raises(InvalidResourceError):
        await manager.inspect(bad)


@pytest.mark.parametrize("ttl", [0, -1, float("nan"), float("inf"), "10", True])
async def test_bad_ttl(make_manager: Make, resource: str, ttl: Any) -> None:
    manager = make_manager()
    with pytest.raises(ConfigurationError):
        await manager.acquire(resource, ttl=ttl)


async def test_events(make_manager: Make, resource: str) -> None:
    bus = EventBus()
    manager = make_manager(events=bus)
    with EventRecorder(bus) as recorder:
        lease = await manager.acquire(resource)
        await lease.release()
    assert recorder.kinds() == ["acquired", "released"]
    assert {e.token for e in recorder.events} == {lease.token}
    assert {e.scope for e in recorder.events} == {resource}


# -- the lock decorator ----------------------------------------------------------------


async def test_locked_formats_the_resource_and_passes_the_lease(
    make_manager: Make, resource: str
) -> None:
    manager = make_manager(ttl=5)
    seen: list[tuple[Any, Any]] = []

    @manager.locked(resource + ":{order_id}:{part}", ttl=4, timeout=5)
    async def first(lease: AsyncLease, order_id: int, part: str = "a") -> int:
        seen.append((lease, await manager.inspect(lease.resource)))
        return order_id

    @manager.locked(resource + ":{order_id}")
    async def keyword(order_id: int, *, lease: AsyncLease) -> str:
        seen.append((lease, await manager.inspect(lease.resource)))
        return "kw"

    @manager.locked(resource + ":{order_id}")
    async def without(order_id: int) -> int | None:
        info = await manager.inspect(f"{resource}:{order_id}")
        return None if info is None else info.token

    assert await first(7) == 7
    assert await first(order_id=8, part="b") == 8
    assert await keyword(9) == "kw"
    assert [lease.resource for lease, _ in seen] == [
        f"{resource}:7:a",
        f"{resource}:8:b",
        f"{resource}:9",
    ]
    for lease, info in seen:
        assert isinstance(lease, AsyncLease)
        assert info is not None
        assert info.token == lease.token
        assert lease.ttl == (4 if lease.resource.count(":") == 3 else 5)
        assert lease.released
        assert await manager.inspect(lease.resource) is None
    token = await without(10)
    assert token is not None
    assert token > 0
    assert await manager.inspect(f"{resource}:10") is None
    assert first.__name__ == "first"


async def test_locked_releases_when_the_function_raises(make_manager: Make, resource: str) -> None:
    manager = make_manager()
    leases: list[AsyncLease] = []

    @manager.locked(resource)
    async def fail(lease: AsyncLease) -> None:
        leases.append(lease)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        await fail()
    assert leases[0].released
    assert await manager.inspect(resource) is None
    async with manager.lock(resource, timeout=5) as lease:
        assert lease.token > leases[0].token


async def test_locked_releases_when_the_call_is_cancelled(
    make_manager: Make, resource: str
) -> None:
    """Cancelled (a task) or interrupted (a thread, by KeyboardInterrupt): released."""
    manager = make_manager()
    started: list[AsyncLease] = []

    @manager.locked(resource)
    async def work(lease: AsyncLease) -> None:
        started.append(lease)
        await sleep(60)  # unasync: raise KeyboardInterrupt

    task = await spawn(work)
    deadline = time.monotonic() + 10
    while not started and time.monotonic() < deadline:
        await sleep(0.01)
    assert started
    task.cancel()  # unasync: remove
    with pytest.raises(Interrupted):
        await join(task)
    assert started[0].released
    assert await manager.inspect(resource) is None


async def test_locked_refuses_at_decoration_time(make_manager: Make, resource: str) -> None:
    manager = make_manager()

    async def work(order_id: int) -> None:
        pass

    with pytest.raises(ConfigurationError, match=r"\['user_id'\]") as refused:
        manager.locked("order:{user_id}")(work)
    assert isinstance(refused.value, FenceError)
    with pytest.raises(ConfigurationError, match="positional field"):
        manager.locked("order:{0}")(work)
    with pytest.raises(ConfigurationError, match="does not parse"):
        manager.locked("order:{order_id")(work)
    with pytest.raises(ConfigurationError, match="not an argument"):
        manager.locked("order:{lease}")(work)

    def wrong_kind() -> None:  # unasync: async def wrong_kind() -> None:
        pass

    with pytest.raises(ConfigurationError, match="wrong_kind"):
        manager.locked(resource)(wrong_kind)

    async def generator() -> Any:
        yield 1

    with pytest.raises(ConfigurationError, match="generator"):
        manager.locked(resource)(generator)

    async def lease_in_the_middle(order_id: int, lease: AsyncLease) -> None:
        pass

    with pytest.raises(ConfigurationError, match="first parameter, or keyword-only"):
        manager.locked(resource)(lease_in_the_middle)
    assert await manager.inspect(resource) is None


async def test_locked_invalid_resource_and_wrong_calls(make_manager: Make, resource: str) -> None:
    """A formatted resource that is not valid, or a call that does not fit the function,
    is refused before any lock is taken."""
    manager = make_manager()
    calls: list[str] = []

    @manager.locked("{name}")
    async def work(lease: AsyncLease, name: str) -> None:
        calls.append(name)

    with pytest.raises(InvalidResourceError):
        await work("")
    with pytest.raises(InvalidResourceError):
        await work("x" * 513)
    with pytest.raises(TypeError):
        await work(resource, lease=None)
    with pytest.raises(TypeError):
        await work()
    assert calls == []
    await work(resource)
    assert calls == [resource]
    assert await manager.inspect(resource) is None
