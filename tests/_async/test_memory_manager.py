"""The in-memory manager and the test kit: manual time, a stalled or failing backend, and
lost token counters (C3)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from fence import (
    AcquireTimeout,
    AsyncLease,
    AsyncMemoryLockManager,
    AsyncRetryPolicy,
    ConfigurationError,
    EventBus,
    EventKind,
    LeaseLostError,
    LeaseMode,
    MemoryBackend,
    NotOwnerError,
    Reason,
    StaleTokenError,
    TokenMode,
)
from fence._sync import retry as other  # unasync: from fence._async import retry as other
from fence.testing import EventRecorder, ManualClock, MemoryGuard
from tests._acompat import join, sleep, spawn

#: The retry policy of the other kind, which the manager's decorator refuses.
OtherPolicy = other.RetryPolicy  # unasync: OtherPolicy = other.AsyncRetryPolicy


async def test_holder_pause_is_fenced_on_a_manual_clock() -> None:
    """The whole story, deterministic: A pauses past its lease, B takes over, A's write is
    refused."""
    clock = ManualClock()
    manager = AsyncMemoryLockManager(clock=clock)
    store = MemoryGuard()

    a = await manager.acquire("order:42", ttl=10, owner="A")
    clock.advance(11)  # A "pauses" for 11 s
    assert not a.valid
    b = await manager.acquire("order:42", ttl=10, owner="B")
    assert b.token > a.token
    store.write("order:42", b.token, "written by B")
    with pytest.raises(StaleTokenError) as info:
        store.write("order:42", a.token, "written by A")
    assert info.value.fence == b.token
    assert store.read("order:42") == "written by B"
    await manager.close()


def count_waits(manager: Any) -> list[int]:
    """Count the waits of ``manager``'s driver: a waiter that waits has read the clock (its
    deadline) and found the lock held."""
    waits = [0]
    wait = manager.driver.wait

    async def counted(*args: Any) -> None:
        waits[0] += 1
        await wait(*args)

    manager.driver.wait = counted
    return waits


async def until_waiting(waits: list[int]) -> None:
    """Return once a waiter waits (before that, a manual clock moved for it could move
    before it read it)."""
    end = time.monotonic() + 30
    while not waits[0]:
        assert time.monotonic() < end, "the waiter never waited"
        await sleep(0.01)


async def test_waiter_wakes_when_manual_clock_passes_expiry() -> None:
    clock = ManualClock()
    manager = AsyncMemoryLockManager(clock=clock)
    holder = await manager.acquire("r", ttl=10, owner="holder")
    waits = count_waits(manager)

    async def waiter() -> int:
        lease = await manager.acquire("r", timeout=100, owner="waiter")
        return int(lease.token)

    task = await spawn(waiter)
    await until_waiting(waits)
    assert not task.done()
    clock.advance(10.5)
    assert await join(task) > holder.token
    await manager.close()


async def test_acquire_timeout_on_manual_clock() -> None:
    clock = ManualClock()
    manager = AsyncMemoryLockManager(clock=clock)
    await manager.acquire("r", ttl=100, owner="holder")
    waits = count_waits(manager)

    async def waiter() -> Any:
        return await manager.acquire("r", timeout=5, owner="waiter")

    task = await spawn(waiter)
    await until_waiting(waits)
    assert not task.done()
    clock.advance(6)
    with pytest.raises(AcquireTimeout):
        await join(task)
    await manager.close()


async def test_hybrid_tokens_survive_lost_counters() -> None:
    """C3: the backend loses its counters; hybrid tokens still go up, counter tokens do not."""
    clock = ManualClock()
    hybrid = AsyncMemoryLockManager(MemoryBackend(clock, TokenMode.HYBRID))
    counter = AsyncMemoryLockManager(MemoryBackend(clock, TokenMode.COUNTER))
    issued: dict[str, list[int]] = {"hybrid": [], "counter": []}
    for name, manager in (("hybrid", hybrid), ("counter", counter)):
        for _ in range(3):
            lease = await manager.acquire("r")
            issued[name].append(lease.token)
            await lease.release()
    clock.advance(1.0)  # a restart takes time; the backend clock moves on
    hybrid.backend.forget_tokens()
    counter.backend.forget_tokens()
    after_hybrid = await hybrid.acquire("r")
    after_counter = await counter.acquire("r")
    assert after_hybrid.token > max(issued["hybrid"])
    assert issued["counter"] == [1, 2, 3]
    assert after_counter.token == 1  # what counter mode does not survive
    await hybrid.close()
    await counter.close()


async def until_event(recorder: EventRecorder, kind: EventKind) -> None:
    end = time.monotonic() + 30
    while not recorder.of(kind):
        assert time.monotonic() < end, f"no {kind} event"
        await sleep(0.01)


async def test_watchdog_survives_a_transient_failure() -> None:
    bus = EventBus()
    backend = MemoryBackend()
    manager = AsyncMemoryLockManager(backend, renew=True, events=bus)
    with EventRecorder(bus) as recorder:
        lease = await manager.acquire("r", ttl=3)
        acquired = time.monotonic()
        backend.fail()
        await until_event(recorder, EventKind.RENEW_FAILED)  # a renewal (every 1 s) failed
        backend.fail(None)
        await until_event(recorder, EventKind.RENEWED)  # and the next one succeeded
        await sleep(max(0.0, acquired + 3.3 - time.monotonic()))  # past the original ttl
        assert lease.valid
        assert not lease.lost
    assert recorder.of(EventKind.RENEW_FAILED)
    assert recorder.of(EventKind.RENEWED)
    await lease.release()
    await manager.close()


async def test_watchdog_reports_loss_when_backend_stays_down() -> None:
    backend = MemoryBackend()
    manager = AsyncMemoryLockManager(backend, renew=True)
    lost: list[LeaseLostError] = []
    lease = await manager.acquire("r", ttl=0.5, on_lost=lambda _, err: lost.append(err))
    backend.fail()
    assert await lease.wait_lost(timeout=5)
    assert len(lost) == 1
    with pytest.raises(LeaseLostError):
        lease.check()
    backend.fail(None)
    await manager.close()


async def test_stalled_backend_is_reported_as_loss() -> None:
    """A renewal stuck on a frozen backend does not keep the holder in the dark."""
    backend = MemoryBackend()
    manager = AsyncMemoryLockManager(backend, renew=True)
    lease = await manager.acquire("r", ttl=0.5)
    backend.pause()
    assert await lease.wait_lost(timeout=5)
    assert lease.lost
    with pytest.raises(LeaseLostError):
        lease.check()
    backend.resume()
    await manager.close()


async def test_paused_backend_stalls_calls_until_resumed() -> None:
    backend = MemoryBackend()
    manager = AsyncMemoryLockManager(backend)
    backend.pause()
    assert backend.paused

    async def take() -> int:
        lease = await manager.acquire("r")
        return int(lease.token)

    task = await spawn(take)
    await sleep(0.1)
    assert not task.done()
    backend.resume()
    assert await join(task) > 0
    await manager.close()


async def test_explicit_owner_controls_reentrancy() -> None:
    manager = AsyncMemoryLockManager()
    first = await manager.acquire("r", owner="worker-1")
    again = await manager.acquire("r", owner="worker-1")
    assert again is first
    assert await manager.try_acquire("r", owner="worker-2") is None
    await first.release()
    await first.release()
    other = await manager.try_acquire("r", owner="worker-2")
    assert other is not None
    await manager.close()


async def test_reentrant_acquire_of_a_lost_lease_raises() -> None:
    """The loss is not known yet: re-entering a lease the backend no longer holds fails."""
    manager = AsyncMemoryLockManager()
    lease = await manager.acquire("r", ttl=5)
    await manager.revoke("r")
    with pytest.raises(LeaseLostError):
        await manager.acquire("r")
    assert lease.lost
    await manager.close()


async def test_owner_acquires_anew_after_a_known_loss() -> None:
    """Once a lease is known lost, the same owner's next acquire gets a new lease and a new
    token; the lost lease's release still reports that it was not held."""
    manager = AsyncMemoryLockManager()
    lost = await manager.acquire("r", ttl=5)
    revoked = await manager.revoke("r")
    with pytest.raises(LeaseLostError):
        await lost.renew()
    fresh = await manager.acquire("r", timeout=1)
    assert fresh is not lost
    assert fresh.token > revoked
    with pytest.raises(NotOwnerError):
        await lost.release()
    assert fresh.valid
    await fresh.release()
    await manager.close()


# -- the lock decorator: what the conformance suite leaves to one backend ----------------


async def test_locked_retry_runs_the_whole_locked_call_again() -> None:
    """``retry=`` retries from the acquire: each attempt has a new lease and a newer token;
    an error the policy does not retry leaves at once."""
    manager = AsyncMemoryLockManager()
    guard = MemoryGuard()
    policy = AsyncRetryPolicy(attempts=3, backoff=lambda n: 0.0)
    tokens: list[int] = []

    @manager.locked("order:{order_id}", retry=policy)
    async def pay(lease: AsyncLease, order_id: int) -> int:
        tokens.append(lease.token)
        if len(tokens) == 1:
            # A newer holder wrote first: a new lease cures it.
            raise StaleTokenError(lease.resource, lease.token, lease.token + 1, Reason.STALE)
        guard.write(lease.resource, lease.token, order_id)
        return len(tokens)

    assert await pay(42) == 2
    assert tokens[1] > tokens[0]
    assert await manager.inspect("order:42") is None

    @manager.locked("order:{order_id}", retry=policy)
    async def missing(lease: AsyncLease, order_id: int) -> None:
        tokens.append(lease.token)
        raise StaleTokenError(lease.resource, lease.token, lease.token, Reason.MISSING)

    tokens.clear()
    with pytest.raises(StaleTokenError):
        await missing(42)
    assert len(tokens) == 1
    assert await manager.inspect("order:42") is None
    await manager.close()


async def test_locked_stacked_under_a_policy_is_the_same() -> None:
    """``@policy`` above ``@manager.locked`` retries the locked call, new lease each time."""
    manager = AsyncMemoryLockManager()
    policy = AsyncRetryPolicy(attempts=2, backoff=lambda n: 0.0)
    tokens: list[int] = []

    @policy
    @manager.locked("job:{job_id}")
    async def run(job_id: int, *, lease: AsyncLease) -> None:
        tokens.append(lease.token)
        if len(tokens) == 1:
            lease._mark_lost("revoked in a test")
            lease.check()

    await run(1)
    assert len(tokens) == 2
    assert tokens[1] > tokens[0]
    await manager.close()


async def test_locked_refuses_a_policy_of_the_other_kind() -> None:
    manager = AsyncMemoryLockManager()

    async def work() -> None:
        pass

    with pytest.raises(ConfigurationError, match="cannot retry 'test_locked_refuses"):
        manager.locked("job", retry=OtherPolicy())(work)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        manager.locked("job", mode="exclusive")
    with pytest.raises(ConfigurationError):
        manager.locked("job", ttl=-1)
    with pytest.raises(ConfigurationError):
        manager.locked("job", timeout=-1)
    await manager.close()


async def test_locked_passes_mode_owner_and_on_lost() -> None:
    clock = ManualClock()
    manager = AsyncMemoryLockManager(clock=clock)
    lost: list[AsyncLease] = []

    @manager.locked(
        "doc:{doc}", mode="read", owner="reader", on_lost=lambda lease, _: lost.append(lease)
    )
    async def read(lease: AsyncLease, doc: str) -> AsyncLease:
        other = await manager.acquire(f"doc:{doc}", mode="read", owner="other", timeout=0)
        await other.release()
        clock.advance(lease.ttl + 1)
        assert await lease.wait_lost(0)
        return lease

    with pytest.raises(NotOwnerError):  # the lease ran out under the call: release says so
        await read("a")
    assert len(lost) == 1
    assert lost[0].mode is LeaseMode.READ
    assert lost[0]._owner == "reader"
    await manager.close()
