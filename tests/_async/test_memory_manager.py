"""The in-memory manager and the test kit: manual time, a stalled or failing backend, and
lost token counters (C3)."""

from __future__ import annotations

from typing import Any

import pytest

from fence import (
    AcquireTimeout,
    AsyncMemoryLockManager,
    EventBus,
    EventKind,
    LeaseLostError,
    MemoryBackend,
    NotOwnerError,
    StaleTokenError,
    TokenMode,
)
from fence.testing import EventRecorder, ManualClock, MemoryGuard
from tests._acompat import join, sleep, spawn


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


async def test_waiter_wakes_when_manual_clock_passes_expiry() -> None:
    clock = ManualClock()
    manager = AsyncMemoryLockManager(clock=clock)
    holder = await manager.acquire("r", ttl=10, owner="holder")

    async def waiter() -> int:
        lease = await manager.acquire("r", timeout=100, owner="waiter")
        return int(lease.token)

    task = await spawn(waiter)
    await sleep(0.05)
    assert not task.done()
    clock.advance(10.5)
    assert await join(task) > holder.token
    await manager.close()


async def test_acquire_timeout_on_manual_clock() -> None:
    clock = ManualClock()
    manager = AsyncMemoryLockManager(clock=clock)
    await manager.acquire("r", ttl=100, owner="holder")

    async def waiter() -> Any:
        return await manager.acquire("r", timeout=5, owner="waiter")

    task = await spawn(waiter)
    await sleep(0.05)
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


async def test_watchdog_survives_a_transient_failure() -> None:
    bus = EventBus()
    backend = MemoryBackend()
    manager = AsyncMemoryLockManager(backend, renew=True, events=bus)
    with EventRecorder(bus) as recorder:
        lease = await manager.acquire("r", ttl=0.9)
        backend.fail()
        await sleep(0.45)  # at least one renewal attempt fails (every 0.3 s)
        backend.fail(None)
        await sleep(0.9)  # renewals succeed again, past the original ttl
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
