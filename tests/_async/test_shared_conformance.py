"""The shared-lock (read/write) conformance suite (C13): every manager with shared locks,
sync and async, must pass it; the others must refuse ``mode="read"``.

Each test runs once per backend registered in ``tests/backend_*.py`` with ``shared=True``
(the refusal test on the others). The sync twin in ``tests/_sync`` is generated from this
file, with threads where this file has tasks. The suite is kept lean: short ttls, bounded
waits, one manager per test where one is enough.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from fence import (
    AcquireTimeout,
    ConfigurationError,
    LeaseMode,
    LockUpgradeError,
    NotOwnerError,
)
from fence._acompat import current_owner
from tests._acompat import join, sleep, spawn
from tests.registry import ManagerBackend

IS_ASYNC = True  # unasync: IS_ASYNC = False

Make = Callable[..., Any]

#: The longest any waiter in this suite waits: generous, because the bound is not the point.
PATIENCE = 20.0


@pytest.fixture
async def make_manager(
    shared_backend: ManagerBackend, request: pytest.FixtureRequest
) -> AsyncIterator[Make]:
    """Build managers that share one lock space; close them all after the test."""
    context = shared_backend.setup(request)
    built: list[Any] = []

    def make(**options: Any) -> Any:
        manager = shared_backend.make(context, IS_ASYNC, **options)
        built.append(manager)
        return manager

    yield make
    for manager in built:
        await manager.close()


@pytest.fixture
def resource() -> str:
    return f"rw:{secrets.token_hex(4)}"


async def other_owner(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` as a different owner (another task, or another thread); return its result."""
    return await join(await spawn(fn))


async def owners(*fns: Callable[[], Any]) -> list[Any]:
    """Run each function concurrently as an owner of its own (a task, or a new thread:
    never a reused pool thread, which would re-enter another's lease); return results."""
    tasks = [await spawn(fn) for fn in fns]
    return [await join(task) for task in tasks]


async def until(condition: Callable[[], bool], what: str) -> None:
    """Poll ``condition`` until it holds; fail after :data:`PATIENCE` seconds."""
    end = time.monotonic() + PATIENCE
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"gave up waiting for {what}")
        await sleep(0.01)


def watch_waits(manager: Any) -> set[object]:
    """Record the owners that entered a wait (their first attempt was refused, so they
    hold a place in the queue); returns the live set."""
    waiting: set[object] = set()
    driver = manager.driver
    real_wait = driver.wait

    async def wait(*args: Any) -> Any:
        waiting.add(current_owner())
        return await real_wait(*args)

    driver.wait = wait
    return waiting


async def start_waiter(
    manager: Any,
    resource: str,
    mode: str,
    waiting: set[object],
    body: Callable[[Any], Awaitable[Any]],
) -> Any:
    """Start an owner that acquires ``resource`` in ``mode``, runs ``body(lease)`` and
    releases; return its task (thread) once it has entered its wait."""
    me: list[object] = []

    async def run() -> Any:
        me.append(current_owner())
        lease = await manager.acquire(resource, mode=mode, timeout=PATIENCE)
        try:
            return await body(lease)
        finally:
            await lease.release()

    task = await spawn(run)
    await until(lambda: bool(me) and me[0] in waiting, f"a {mode} waiter to queue")
    return task


async def test_readers_share_the_lock_and_keep_writers_out(
    make_manager: Make, resource: str
) -> None:
    """Many readers at once; no writer beside them; inspect shows every reader."""
    manager = make_manager(ttl=10)

    async def read() -> Any:
        return await manager.try_acquire(resource, mode="read")

    async def write() -> Any:
        return await manager.try_acquire(resource)

    first = await other_owner(read)
    second = await other_owner(read)
    assert first is not None
    assert second is not None
    assert first.mode is LeaseMode.READ
    assert second.mode is LeaseMode.READ
    assert first.token != second.token
    assert await other_owner(write) is None
    info = await manager.inspect(resource)
    assert info is not None
    assert info.mode is LeaseMode.READ
    assert sorted(r.token for r in info.readers) == sorted([first.token, second.token])
    assert info.token == max(first.token, second.token)
    assert all(r.holder for r in info.readers)
    assert first._secret not in str(info)
    await first.release()
    assert await other_owner(write) is None  # one reader still holds it
    await second.release()
    writer = await other_owner(write)
    assert writer is not None
    assert writer.mode is LeaseMode.WRITE
    assert writer.token > max(first.token, second.token)
    assert await other_owner(read) is None
    info = await manager.inspect(resource)
    assert info is not None
    assert info.mode is LeaseMode.WRITE
    assert info.token == writer.token
    assert info.readers == ()
    await writer.release()
    assert await manager.inspect(resource) is None


async def test_token_order_between_writers_and_readers(make_manager: Make, resource: str) -> None:
    """A writer's token is above every token before it, readers' included; a reader's is
    above every earlier writer's."""
    manager = make_manager(ttl=10)
    history: list[tuple[str, int]] = []

    async def take(mode: str) -> Any:
        lease = await manager.acquire(resource, mode=mode, timeout=PATIENCE)
        history.append((mode, lease.token))
        return lease

    for _ in range(2):
        writer = await other_owner(lambda: take("write"))
        await writer.release()
        readers = await owners(lambda: take("read"), lambda: take("read"), lambda: take("read"))
        for lease in readers:
            await lease.release()
    for index, (mode, token) in enumerate(history):
        before = history[:index]
        if mode == "write":
            assert all(token > t for _, t in before), history
        else:
            assert all(token > t for m, t in before if m == "write"), history
    reader_tokens = [t for m, t in history if m == "read"]
    assert len(set(reader_tokens)) == len(reader_tokens)


async def test_writer_excludes_everyone_under_concurrency(
    make_manager: Make, resource: str
) -> None:
    """Readers and writers in a loop: never a writer beside anyone."""
    manager = make_manager(ttl=10)
    inside = {"read": 0, "write": 0}
    overlaps: list[str] = []
    count = threading.Lock()

    async def worker(mode: str) -> None:
        for _ in range(4):
            lease = await manager.acquire(resource, mode=mode, timeout=PATIENCE)
            with count:
                inside[mode] += 1
                if inside["write"] > 1 or (inside["write"] and inside["read"]):
                    overlaps.append(f"{inside}")
            await sleep(0.002)
            with count:
                inside[mode] -= 1
            await lease.release()

    await owners(
        lambda: worker("read"),
        lambda: worker("write"),
        lambda: worker("read"),
        lambda: worker("write"),
    )
    assert overlaps == []


async def test_waiting_writer_blocks_new_readers(make_manager: Make, resource: str) -> None:
    """No writer starvation: readers that hand the lock over to each other never leave it
    free, yet once a writer waits, no new reader gets in, and the writer gets the lock."""
    manager = make_manager(ttl=10)
    waiting = watch_waits(manager)

    async def read() -> Any:
        return await manager.try_acquire(resource, mode="read")

    held = await other_owner(read)
    assert held is not None

    async def token_of(lease: Any) -> int:
        return int(lease.token)

    writer = await start_waiter(manager, resource, "write", waiting, token_of)
    # The writer waits for the reader that holds the lock; a reader that comes now would
    # share it with that reader, but must queue behind the writer.
    assert await other_owner(read) is None, "a new reader got in while a writer waited"
    await held.release()
    assert await join(writer) > held.token
    after = await other_owner(read)
    assert after is not None
    await after.release()


async def test_stream_of_readers_does_not_starve_a_writer(
    make_manager: Make, resource: str
) -> None:
    """Readers keep the lock held by overlapping leases; a writer still gets in, and no
    reader is inside while it holds the lock."""
    manager = make_manager(ttl=10)
    stop = [False]
    inside = [0, 0]  # readers, writers
    overlaps: list[str] = []
    count = threading.Lock()

    async def reader() -> int:
        reads = 0
        while not stop[0]:
            lease = await manager.acquire(resource, mode="read", timeout=PATIENCE)
            with count:
                inside[0] += 1
                if inside[1]:
                    overlaps.append("reader beside the writer")
            reads += 1
            await sleep(0.02)
            with count:
                inside[0] -= 1
            await lease.release()
        return reads

    async def writer() -> int:
        await sleep(0.1)
        try:
            lease = await manager.acquire(resource, timeout=PATIENCE)
            with count:
                inside[1] += 1
                if inside[0]:
                    overlaps.append("writer beside a reader")
            await sleep(0.01)
            with count:
                inside[1] -= 1
            await lease.release()
            return int(lease.token)
        finally:
            stop[0] = True

    results = await owners(reader, reader, reader, writer)
    assert overlaps == []
    assert results[3] > 0
    assert sum(results[:3]) >= 3


async def test_fifo_between_writers_and_reader_batches(make_manager: Make, resource: str) -> None:
    """Waiters are served in arrival order: consecutive readers together, a writer alone.

    W0 holds; R1, R2, W1, R3 arrive in that order. R1 and R2 get the lock together (each
    waits inside until the other is in), then W1, then R3.
    """
    manager = make_manager(ttl=10)
    waiting = watch_waits(manager)
    order: list[tuple[str, int]] = []
    entered: set[str] = set()

    async def hold_with(name: str, partner: str | None) -> Any:
        # A reader stays in until its partner came in: at that moment both are inside.
        async def body(lease: Any) -> int:
            order.append((name, lease.token))
            entered.add(name)
            if partner is not None:
                await until(lambda: partner in entered, f"{partner} beside {name}")
            await sleep(0.01)
            return int(lease.token)

        return body

    async def take_first() -> Any:
        return await manager.acquire(resource, timeout=PATIENCE)

    first = await other_owner(take_first)
    tasks = []
    for name, mode, partner in (
        ("R1", "read", "R2"),
        ("R2", "read", "R1"),
        ("W1", "write", None),
        ("R3", "read", None),
    ):
        body = await hold_with(name, partner)
        tasks.append(await start_waiter(manager, resource, mode, waiting, body))
    await first.release()
    tokens = [await join(task) for task in tasks]
    names = [name for name, _ in order]
    assert set(names[:2]) == {"R1", "R2"}, order
    assert names[2:] == ["W1", "R3"], order
    r1, r2, w1, r3 = tokens
    assert w1 > max(r1, r2, first.token)
    assert r3 > w1


async def test_readers_are_woken_together_by_a_release(make_manager: Make, resource: str) -> None:
    """Readers queued behind a writer all get the lock when it releases: each of them
    waits inside until all three are in, which a one-at-a-time hand-off never allows."""
    manager = make_manager(ttl=10)
    waiting = watch_waits(manager)
    inside: set[int] = set()

    async def take_first() -> Any:
        return await manager.acquire(resource, timeout=PATIENCE)

    holder = await other_owner(take_first)

    async def body(lease: Any) -> int:
        inside.add(lease.token)
        await until(lambda: len(inside) == 3, "three readers inside at once")
        return int(lease.token)

    tasks = [await start_waiter(manager, resource, "read", waiting, body) for _ in range(3)]
    await holder.release()
    tokens = [await join(task) for task in tasks]
    assert all(token > holder.token for token in tokens)
    assert len(set(tokens)) == 3


async def test_waiters_woken_when_leases_expire(
    make_manager: Make, shared_backend: ManagerBackend, resource: str
) -> None:
    """A reader that crashed never releases: the writer gets in once its lease ends; a
    writer that crashed likewise lets the readers in."""
    manager = make_manager(ttl=10)
    patience = PATIENCE + shared_backend.expiry_slack

    async def crashed(mode: str) -> Any:
        return await manager.acquire(resource, mode=mode, ttl=0.4)

    reader = await other_owner(lambda: crashed("read"))

    async def take(mode: str) -> int:
        lease = await manager.acquire(resource, mode=mode, timeout=patience)
        token = int(lease.token)
        await lease.release()
        return token

    token = await other_owner(lambda: take("write"))
    assert token > reader.token
    writer = await other_owner(lambda: crashed("write"))
    tokens = await owners(lambda: take("read"), lambda: take("read"))
    assert min(tokens) > writer.token
    with pytest.raises(NotOwnerError):
        await reader.release()


async def test_reentrancy_and_refused_upgrade(make_manager: Make, resource: str) -> None:
    """read -> read re-enters (same token); read -> write is refused before any I/O; a
    writer's read re-enters its write lease (same token, still exclusive)."""
    manager = make_manager(ttl=10)
    calls = [0]
    driver = manager.driver
    real_acquire = driver.acquire

    async def counting(*args: Any) -> Any:
        calls[0] += 1
        return await real_acquire(*args)

    driver.acquire = counting
    outer = await manager.acquire(resource, mode="read")
    inner = await manager.acquire(resource, mode="read")
    assert inner is outer
    before = calls[0]
    with pytest.raises(LockUpgradeError) as info:
        await manager.acquire(resource, mode="write", timeout=0)
    assert info.value.resource == resource
    assert info.value.token == outer.token
    with pytest.raises(LockUpgradeError):
        await manager.try_acquire(resource)
    assert calls[0] == before  # refused before any I/O
    await inner.release()
    assert outer.valid
    await outer.release()
    assert outer.released

    writer = await manager.acquire(resource)
    read = await manager.acquire(resource, mode="read")
    assert read is writer
    assert read.mode is LeaseMode.WRITE
    assert read.token == writer.token

    async def attempt() -> Any:
        return await manager.try_acquire(resource, mode="read")

    await read.release()
    assert await other_owner(attempt) is None  # the write lease is still held
    await writer.release()
    got = await other_owner(attempt)
    assert got is not None
    await got.release()


async def test_renewal_revoke_and_lost_signal_for_readers(
    make_manager: Make, resource: str
) -> None:
    """The watchdog keeps a read lease; revoke ends every reader's lease, issues a token
    above all of them, and the readers hear it (lost-lease signal)."""
    manager = make_manager(renew=True)
    lost: list[Any] = []

    # A lease of 3 s, held past it: the watchdog renews every second, so a renewal may wait
    # 2 s. On MariaDB a renewal waits for an acquire's transaction on the same resource
    # (six round trips); 0.9 s, renewed every 0.3 s, was spent by a loaded machine alone.
    async def read() -> Any:
        return await manager.acquire(
            resource, mode="read", ttl=3.0, on_lost=lambda lease, err: lost.append(lease)
        )

    first = await other_owner(read)
    second = await other_owner(read)
    await sleep(3.6)
    assert first.valid
    assert second.valid
    info = await manager.inspect(resource)
    assert info is not None
    assert len(info.readers) == 2
    revoked = await manager.revoke(resource)
    assert revoked > max(first.token, second.token)
    assert await first.wait_lost(timeout=PATIENCE)
    assert await second.wait_lost(timeout=PATIENCE)
    assert {id(lease) for lease in lost} == {id(first), id(second)}
    assert await manager.inspect(resource) is None

    async def write() -> Any:
        return await manager.acquire(resource, timeout=PATIENCE, renew=False)

    writer = await other_owner(write)
    assert writer.token > revoked
    await writer.release()


#: The waiter's timeout in :func:`test_deadlines_for_both_modes`.
WAIT = 1.5


async def test_deadlines_for_both_modes(make_manager: Make, resource: str) -> None:
    """A reader waiting behind a writer, and a writer behind a reader, give up at their
    timeout; the holder keeps its lease."""
    # Long enough for the server to answer the first attempt on a loaded machine: one that
    # cannot answer in time is a BackendError (the outcome unknown), not this test's wait.
    manager = make_manager(ttl=30)

    async def hold(mode: str) -> Any:
        return await manager.acquire(resource, mode=mode)

    for held_mode, asked in (("write", "read"), ("read", "write")):
        lease = await other_owner(lambda held_mode=held_mode: hold(held_mode))
        elapsed: list[float] = []

        async def attempt(asked: str = asked, elapsed: list[float] = elapsed) -> Any:
            start = time.monotonic()
            try:
                return await manager.acquire(resource, mode=asked, timeout=WAIT)
            finally:
                elapsed.append(time.monotonic() - start)

        with pytest.raises(AcquireTimeout):
            await other_owner(attempt)
        assert WAIT <= elapsed[0] < WAIT + 5.0
        assert lease.valid
        await lease.release()


async def test_bad_mode_is_refused(make_manager: Make, resource: str) -> None:
    manager = make_manager()
    for bad in ("exclusive", "", None, 1, "READ "):
        with pytest.raises(ConfigurationError):
            await manager.acquire(resource, mode=bad)
    assert await manager.inspect(resource) is None


async def test_managers_without_shared_locks_refuse_readers(
    unshared_backend: ManagerBackend, request: pytest.FixtureRequest, resource: str
) -> None:
    """A manager without shared locks refuses mode="read" before any I/O, whatever its
    backend's state; its write leases work as before."""
    context = unshared_backend.setup(request)
    manager = unshared_backend.make(context, IS_ASYNC, ttl=5)
    try:
        with pytest.raises(ConfigurationError, match="no shared locks"):
            await manager.acquire(resource, mode="read")
        with pytest.raises(ConfigurationError, match="no shared locks"):
            await manager.try_acquire(resource, mode=LeaseMode.READ)
        async with manager.write_lock(resource) as lease:
            assert lease.mode is LeaseMode.WRITE
    finally:
        await manager.close()
