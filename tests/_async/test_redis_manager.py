"""What the Redis manager adds to the conformance suite: key layout, token modes, waiting
and FIFO fairness, revocation, clients, settings checks and replication.

Runs against the session's throwaway ``redis-server``. The sync twin in ``tests/_sync`` is
generated from this file. Faults that need a server of their own (SIGSTOP, SIGKILL, AOF
loss, a cluster, a replica) are in ``tests/test_redis_manager_faults.py``.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis
import redis.asyncio
from redis.crc import key_slot

from fence import (
    AcquireTimeout,
    BackendError,
    ConfigurationError,
    InvalidResourceError,
    NotOwnerError,
    StaleTokenError,
    TokenMode,
)
from fence._async.redis import AsyncRedisLockManager
from fence._core import LeaseMode
from fence._errors import FenceWarning
from fence._redis_keys import resource_keys, waiter_id
from fence._redis_scripts import DRIVER_SCRIPTS
from fence.abc import AcquireReply
from fence.adapters.redis import AsyncRedisGuard
from tests._acompat import join, sleep, spawn
from tests.servers import RedisServer, free_port

pytestmark = pytest.mark.redis


@pytest.fixture
async def client(redis_url: str) -> AsyncIterator[Any]:
    """A plain client for looking at what the manager wrote."""
    client = redis.asyncio.Redis.from_url(redis_url)
    yield client
    await client.aclose()


@pytest.fixture
def resource() -> str:
    return f"res:{secrets.token_hex(4)}"


async def server_time_us(client: Any) -> int:
    seconds, micros = await client.time()
    return int(seconds) * 1_000_000 + int(micros)


IS_ASYNC = True  # unasync: IS_ASYNC = False


async def until(predicate: Any, timeout: float = 5.0) -> None:
    """Wait (polling, in a test only) until ``await predicate()`` is true."""
    for _ in range(int(timeout / 0.01)):
        if await predicate():
            return
        await sleep(0.01)
    raise AssertionError("condition not reached")


# -- layout (C12) -------------------------------------------------------------------------


async def test_keys_share_a_hash_tag_and_counter_has_no_ttl(
    redis_url: str, client: Any, resource: str
) -> None:
    manager = AsyncRedisLockManager(redis_url, ttl=5)
    try:
        lease = await manager.acquire(resource)
        keys = resource_keys("fence:", resource)
        assert keys.lock == f"fence:{{{resource}}}:lock"
        assert keys.token == f"fence:{{{resource}}}:token"
        assert len({key_slot(k.encode()) for k in keys if not k.endswith(":wake:")}) == 1
        assert int(await client.get(keys.token)) == lease.token
        assert await client.ttl(keys.token) == -1  # counters never expire
        assert 0 < await client.pttl(keys.lock) <= 5000
        held = await client.hgetall(keys.lock)
        assert int(held[b"token"]) == lease.token
        await lease.release()
        assert not await client.exists(keys.lock)
        assert int(await client.get(keys.token)) == lease.token  # the counter outlives it
    finally:
        await manager.close()


async def test_custom_prefix(redis_url: str, client: Any, resource: str) -> None:
    manager = AsyncRedisLockManager(redis_url, prefix="app:locks:")
    try:
        lease = await manager.acquire(resource)
        assert int(await client.get(f"app:locks:{{{resource}}}:token")) == lease.token
        assert not await client.exists(f"fence:{{{resource}}}:token")
        await lease.release()
    finally:
        await manager.close()


def test_names_that_would_break_the_hash_tag_are_refused(redis_url: str) -> None:
    with pytest.raises(ConfigurationError):
        AsyncRedisLockManager(redis_url, prefix="fence:{x}:")
    with pytest.raises(InvalidResourceError):
        resource_keys("fence:", "}starts-with-a-brace")


async def test_resource_with_a_leading_brace_is_refused_before_io(redis_url: str) -> None:
    manager = AsyncRedisLockManager(redis_url)
    try:
        with pytest.raises(InvalidResourceError):
            await manager.acquire("}x")
    finally:
        await manager.close()


# -- tokens (C2, C3) ------------------------------------------------------------------------


async def test_hybrid_tokens_come_from_the_server_clock(
    redis_url: str, client: Any, resource: str
) -> None:
    manager = AsyncRedisLockManager(redis_url)
    try:
        before = await server_time_us(client)
        lease = await manager.acquire(resource)
        after = await server_time_us(client)
        assert before <= lease.token <= after
        await lease.release()
    finally:
        await manager.close()


async def test_hybrid_token_survives_a_lost_counter(
    redis_url: str, client: Any, resource: str
) -> None:
    """C3: the counter key is gone (evicted, lost with an AOF tail): TIME still puts the
    next token above every token issued before."""
    manager = AsyncRedisLockManager(redis_url)
    try:
        lease = await manager.acquire(resource)
        await lease.release()
        await client.delete(resource_keys("fence:", resource).token)
        again = await manager.acquire(resource)
        assert again.token > lease.token
        await again.release()
    finally:
        await manager.close()


async def test_counter_mode_counts_and_regresses_when_the_counter_is_lost(
    redis_url: str, client: Any, resource: str
) -> None:
    """COUNTER mode is last + 1: dense, and only as durable as the counter key."""
    manager = AsyncRedisLockManager(redis_url, token_mode=TokenMode.COUNTER, check_config=False)
    try:
        tokens = []
        for _ in range(3):
            lease = await manager.acquire(resource)
            tokens.append(lease.token)
            await lease.release()
        assert tokens == [1, 2, 3]
        await client.delete(resource_keys("fence:", resource).token)
        lease = await manager.acquire(resource)
        assert lease.token == 1  # regressed: this is what counter mode does not survive
        await lease.release()
    finally:
        await manager.close()


async def test_reentrant_acquire_in_the_script_keeps_the_token(
    redis_url: str, client: Any, resource: str
) -> None:
    """The acquire script itself: the same secret keeps its token and resets the ttl."""
    manager = AsyncRedisLockManager(redis_url)
    try:
        first = await manager.driver.acquire(resource, "secret-a", 0.5, "me")
        second = await manager.driver.acquire(resource, "secret-a", 10.0, "me")
        assert first.token is not None
        assert second.token == first.token
        assert await client.pttl(resource_keys("fence:", resource).lock) > 5000
        other = await manager.driver.acquire(resource, "secret-b", 10.0, "them")
        assert other.token is None
        assert other.holder_ttl is not None
        assert 5 < other.holder_ttl <= 10.01
        assert await manager.driver.release(resource, "secret-a")
    finally:
        await manager.close()


# -- revocation and inspection -------------------------------------------------------------


async def test_revoke_raises_the_guard_fence(redis_url: str, client: Any, resource: str) -> None:
    """The fence register ``fence:{R}:fence`` is raised to the revocation token, whether it
    was absent or lower, and never lowered."""
    keys = resource_keys("fence:", resource)
    manager = AsyncRedisLockManager(redis_url, ttl=60)
    try:
        hung = await manager.acquire(resource)
        assert await client.get(keys.fence) is None
        revoked = await manager.revoke(resource)
        assert revoked > hung.token
        assert int(await client.get(keys.fence)) == revoked
        assert int(await client.get(keys.token)) == revoked
        assert await client.ttl(keys.fence) == -1
        assert await manager.inspect(resource) is None
        with pytest.raises(NotOwnerError):
            await hung.release()
    finally:
        await manager.close()


async def test_revoke_fences_out_the_hung_holder_at_the_guard(
    redis_url: str, client: Any, resource: str
) -> None:
    """End to end with the Redis guard: after a revoke, the hung holder's write is refused
    even though nobody wrote with a newer token yet."""
    manager = AsyncRedisLockManager(redis_url, ttl=60)
    guard = AsyncRedisGuard(client, scope="resource")
    data = f"{{{resource}}}:data"
    try:
        hung = await manager.acquire(resource)
        await guard.set(data, "written by the holder", token=hung.token)
        await manager.revoke(resource)
        with pytest.raises(StaleTokenError):
            await guard.set(data, "written after the revoke", token=hung.token)
        assert await client.get(data) == b"written by the holder"
    finally:
        await manager.close()


@pytest.mark.parametrize("mode", [TokenMode.COUNTER, TokenMode.HYBRID])
async def test_no_token_at_or_below_the_fence_register(
    redis_url: str, client: Any, resource: str, mode: TokenMode
) -> None:
    """A lost counter (an AOF tail, an eviction) does not take revoke or acquire below the
    guards' fence register: the revoker's own claim passes, and so does the next holder's.
    The register is never lowered."""
    keys = resource_keys("fence:", resource)
    manager = AsyncRedisLockManager(redis_url, token_mode=mode, check_config=False)
    guard = AsyncRedisGuard(client, scope="resource")
    try:
        lease = await manager.acquire(resource)
        await guard.claim(resource, lease.token)
        await lease.release()
        fence = lease.token + 10**12  # a register far above the clock and the counter
        await client.set(keys.fence, fence)
        await client.delete(keys.token)  # the counter is lost
        revoked = await manager.revoke(resource)
        assert revoked > fence
        assert await guard.claim(resource, revoked) == revoked
        await client.delete(keys.token)
        await client.set(keys.fence, revoked + 5)
        newer = await manager.acquire(resource)
        assert newer.token > revoked + 5
        assert await guard.claim(resource, newer.token) == newer.token
        assert int(await client.get(keys.fence)) == newer.token
        await newer.release()
    finally:
        await manager.close()


async def test_inspect_reports_holder_token_and_server_ttl(redis_url: str, resource: str) -> None:
    manager = AsyncRedisLockManager(redis_url)
    try:
        lease = await manager.acquire(resource, ttl=3)
        info = await manager.inspect(resource)
        assert info is not None
        assert info.token == lease.token
        assert 2 < info.remaining <= 3
        assert info.holder is not None
        assert ":" in info.holder  # host:pid:owner
        assert lease._secret not in info.holder
        await lease.release()
        assert await manager.inspect(resource) is None
    finally:
        await manager.close()


# -- waiting ------------------------------------------------------------------------------


async def subscribers(client: Any, channel: str) -> int:
    """How many connections are subscribed to ``channel`` (``PUBSUB NUMSUB``)."""
    reply = await client.execute_command("PUBSUB", "NUMSUB", channel)
    return int(reply[1])


async def next_message(pubsub: Any, timeout: float = 5.0) -> Any:
    """The next published message on ``pubsub`` (skipping confirmations), or None."""
    for _ in range(int(timeout / 0.05)):
        msg = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0.05)
        if msg is not None:
            return msg
    return None


async def test_release_wakes_a_waiter_through_the_managers_channel(
    redis_url: str, client: Any, resource: str
) -> None:
    """The waiting manager subscribes to ``fence:{R}:signal`` (one connection, whoever
    waits); the release publishes on it, and the waiter takes the lock long before the
    holder's ttl."""
    manager = AsyncRedisLockManager(redis_url, ttl=60)
    signal = resource_keys("fence:", resource).signal
    try:
        holder = await manager.acquire(resource)

        async def waiter() -> int:
            lease = await manager.acquire(resource, timeout=20)
            await lease.release()
            return int(lease.token)

        tasks = [await spawn(waiter) for _ in range(3)]

        async def parked() -> bool:
            # Subscribed first, then parked on the manager's wake board.
            subscribed = await subscribers(client, signal) == 1
            return subscribed and manager.driver.board.waiting(resource) == 3

        await until(parked)
        await holder.release()
        tokens = [await join(task) for task in tasks]
        assert min(tokens) > holder.token
        assert len(set(tokens)) == 3
        assert await subscribers(client, signal) == 1  # still one connection for them all
    finally:
        await manager.close()

    # The server drops a closed connection's subscriptions when its event loop reads the
    # close, which can come after a command another connection sent later.
    async def unsubscribed() -> bool:
        return await subscribers(client, signal) == 0

    await until(unsubscribed)


async def test_many_waiters_share_a_few_connections(
    redis_url: str, client: Any, resource: str
) -> None:
    """Issue 14: a thousand asyncio waiters (two hundred threads) on one lock in one
    manager. Every one acquires in turn, with strictly increasing tokens, over at most
    four connections: the pool of three and the pub/sub listener. None fails on a
    client-side limit."""
    waiters = 1000 if IS_ASYNC else 200
    before = len(await client.client_list())
    manager = AsyncRedisLockManager(redis_url, ttl=60, max_connections=3)
    tokens: list[int] = []
    peak = [0]
    try:
        holder = await manager.acquire(resource)

        async def wait() -> None:
            lease = await manager.acquire(resource, timeout=120)
            tokens.append(lease.token)
            await lease.release()

        tasks = [await spawn(wait) for _ in range(waiters)]

        async def all_waiting() -> bool:
            peak[0] = max(peak[0], len(await client.client_list()) - before)
            return manager.driver.board.waiting(resource) == waiters

        await until(all_waiting, timeout=120)
        await holder.release()
        for task in tasks:
            await join(task)
        peak[0] = max(peak[0], len(await client.client_list()) - before)
    finally:
        await manager.close()
    assert len(tokens) == waiters
    assert tokens == sorted(tokens)
    assert len(set(tokens)) == waiters
    assert min(tokens) > holder.token
    assert peak[0] <= 4


# redis-py before 5.3 needs a command name to hand out a connection; later ones warn.
_COMMAND_NAME = ("PING",) if tuple(map(int, redis.__version__.split(".")[:2])) < (5, 3) else ()


async def test_pool_of_a_given_client_names_its_limit(redis_url: str, resource: str) -> None:
    """A given client whose own pool is exhausted: the error says so (a client-side limit
    and how to raise it), and does not blame the server."""
    given = redis.asyncio.Redis.from_url(redis_url, max_connections=1)
    manager = AsyncRedisLockManager(given, check_config=False)
    taken = await given.connection_pool.get_connection(*_COMMAND_NAME)
    try:
        with pytest.raises(BackendError) as info:
            await manager.acquire(resource, timeout=0)
    finally:
        await given.connection_pool.release(taken)
        await manager.close()
        await given.aclose()
    assert info.value.code == "POOL"
    assert "max_connections=1" in str(info.value)
    assert "did not answer" not in str(info.value)


async def test_a_channel_dropped_under_a_waiter_is_subscribed_again(
    redis_url: str, client: Any, resource: str
) -> None:
    """The listener drops channels nobody waited on for a while; if that crosses a waiter
    coming back (its UNSUBSCRIBE reaches the server after the waiter's check), the waiter
    must not be left deaf until the holder's ttl: the manager subscribes again."""
    manager = AsyncRedisLockManager(redis_url, ttl=60)
    signal = resource_keys("fence:", resource).signal
    try:
        holder = await manager.acquire(resource)

        async def waiter() -> int:
            lease = await manager.acquire(resource, timeout=10)
            await lease.release()
            return int(lease.token)

        task = await spawn(waiter)

        async def subscribed() -> bool:
            return await subscribers(client, signal) == 1

        async def listening() -> bool:
            # The listener sends SUBSCRIBE on a new connection before it keeps the
            # connection, so the server can count the waiter a moment before it is kept.
            return await subscribed() and manager.driver._listener._conn is not None

        await until(listening)
        await manager.driver._listener._conn.send("UNSUBSCRIBE", signal)
        await sleep(0.3)
        await until(subscribed)  # subscribed again
        await holder.release()
        assert await join(task) > holder.token
    finally:
        await manager.close()


async def test_fifo_serves_waiters_in_arrival_order(
    redis_url: str, client: Any, resource: str
) -> None:
    """FIFO: waiters get the lock in the order they queued, each woken by a message that
    names it: after the release, each makes exactly one attempt, the one that wins (no
    thundering herd)."""
    manager = AsyncRedisLockManager(redis_url, fifo=True, queue_ttl=30, ttl=60)
    keys = resource_keys("fence:", resource)
    attempts: dict[str, int] = {}
    real_acquire = manager.driver.acquire

    async def counting_acquire(res: str, secret: str, ttl: float, holder: str) -> Any:
        attempts[secret] = attempts.get(secret, 0) + 1
        return await real_acquire(res, secret, ttl, holder)

    manager.driver.acquire = counting_acquire
    order: list[int] = []
    try:
        holder = await manager.acquire(resource)

        def waiter(name: int) -> Any:
            async def run() -> None:
                lease = await manager.acquire(resource, timeout=20)
                order.append(name)
                await sleep(0.02)
                await lease.release()

            return run

        tasks = []
        for name in range(3):
            tasks.append(await spawn(waiter(name)))

            async def queued(n: int = name + 1) -> bool:
                return int(await client.zcard(keys.queue)) == n

            await until(queued)

        async def all_waiting() -> bool:
            return manager.driver.board.waiting(resource) == 3

        await until(all_waiting)
        attempts.clear()
        await holder.release()
        for task in tasks:
            await join(task)
        assert order == [0, 1, 2]
        assert sorted(attempts.values()) == [1, 1, 1]
        assert await client.zcard(keys.queue) == 0
    finally:
        await manager.close()


async def test_fifo_newcomer_queues_behind_waiters(redis_url: str, resource: str) -> None:
    """FIFO: while somebody waits, a newcomer's try_acquire fails even in the moment the
    lock is free, so the waiter's turn cannot be stolen."""
    manager = AsyncRedisLockManager(redis_url, fifo=True, queue_ttl=30)
    try:
        holder = await manager.acquire(resource)
        await manager.driver.wait(resource, 0.01, _reply("queued-secret"))
        await holder.release()  # wakes the queued (absent) waiter, who has the turn

        async def newcomer() -> Any:
            return await manager.try_acquire(resource)

        assert await join(await spawn(newcomer)) is None
        got = await manager.driver.acquire(resource, "queued-secret", 5.0, "queued")
        assert got.token is not None
    finally:
        await manager.close()


async def test_fifo_waiter_that_gives_up_passes_its_turn(
    redis_url: str, client: Any, resource: str
) -> None:
    """A FIFO waiter that times out leaves the queue at once (the manager's abandon hook),
    so the waiter behind it is woken by the next release, not after ``queue_ttl``.
    (Both are seen queued within the first one's 5 s: room for a loaded machine.)"""
    keys = resource_keys("fence:", resource)
    manager = AsyncRedisLockManager(redis_url, fifo=True, queue_ttl=60, ttl=60)
    try:
        holder = await manager.acquire(resource)

        async def impatient() -> None:
            await manager.acquire(resource, timeout=5.0)

        async def patient() -> int:
            lease = await manager.acquire(resource, timeout=20)
            await lease.release()
            return int(lease.token)

        first = await spawn(impatient)

        async def queued_one() -> bool:
            return int(await client.zcard(keys.queue)) == 1

        await until(queued_one)
        second = await spawn(patient)

        async def queued_two() -> bool:
            return int(await client.zcard(keys.queue)) == 2

        await until(queued_two)
        with pytest.raises(AcquireTimeout):
            await join(first)
        assert await client.zcard(keys.queue) == 1  # the impatient one left
        await holder.release()
        assert await join(second) > holder.token
    finally:
        await manager.close()


async def test_fifo_dead_waiter_expires_from_the_queue(
    redis_url: str, client: Any, resource: str
) -> None:
    """A waiter that died in the queue (no heartbeat) holds its place only ``queue_ttl``."""
    keys = resource_keys("fence:", resource)
    manager = AsyncRedisLockManager(redis_url, fifo=True, queue_ttl=0.5)
    try:
        holder = await manager.acquire(resource)
        dead = waiter_id("dead-secret")
        await manager.driver.wait(resource, 0.001, _reply("dead-secret"))  # enqueue, never return
        assert await client.zscore(keys.queue, dead) is not None
        await holder.release()  # wakes the dead waiter, who never comes

        async def live() -> int:
            lease = await manager.acquire(resource, timeout=5)
            await lease.release()
            return int(lease.token)

        assert await join(await spawn(live)) > holder.token
        assert await client.zscore(keys.queue, dead) is None
    finally:
        await manager.close()


async def test_abandon_passes_the_turn_on_only_when_the_lock_is_free(
    redis_url: str, client: Any, resource: str
) -> None:
    """A waiter that gave up may have been the one its manager woke: its abandon publishes
    a new wake-up if the lock is free, and nothing while it is held."""
    keys = resource_keys("fence:", resource)
    manager = AsyncRedisLockManager(redis_url)
    pubsub = client.pubsub()
    try:
        await pubsub.subscribe(keys.signal)
        holder = await manager.acquire(resource)
        await manager.driver.abandon(resource, "gone-secret")
        await holder.release()
        assert (await next_message(pubsub))["data"] == b""  # the release's, nothing before
        await manager.driver.abandon(resource, "gone-secret")
        assert (await next_message(pubsub))["data"] == b""
        assert await next_message(pubsub, 0.2) is None
    finally:
        await pubsub.aclose()
        await manager.close()


async def test_fifo_abandon_leaves_the_queue_and_wakes_the_next(
    redis_url: str, client: Any, resource: str
) -> None:
    keys = resource_keys("fence:", resource)
    manager = AsyncRedisLockManager(redis_url, fifo=True, queue_ttl=30)
    pubsub = client.pubsub()
    try:
        await pubsub.subscribe(keys.signal)
        holder = await manager.acquire(resource)
        first, second = waiter_id("first-secret"), waiter_id("second-secret")
        await manager.driver.wait(resource, 0.001, _reply("first-secret"))
        await manager.driver.wait(resource, 0.001, _reply("second-secret"))
        assert await client.zrange(keys.queue, 0, -1) == [first.encode(), second.encode()]
        await holder.release()  # wakes the head, "first", by name
        assert (await next_message(pubsub))["data"] == first.encode()
        await manager.driver.abandon(resource, "first-secret")
        assert await client.zrange(keys.queue, 0, -1) == [second.encode()]
        assert (await next_message(pubsub))["data"] == second.encode()
    finally:
        await pubsub.aclose()
        await manager.close()


async def test_attempt_after_its_cancel_takes_no_place_and_holds_up_nobody(
    redis_url: str, client: Any, resource: str
) -> None:
    """A reader's acquire is cancelled while a writer holds the lock, and its attempt
    reaches the server after CANCEL (sent here in that order): the tombstone refuses it
    without a place in the queue. Before, the attempt queued, and the waiters behind its
    place (a writer here) waited for that place to expire (``queue_ttl``), since the
    release woke only the absent reader."""
    keys = resource_keys("fence:", resource)
    manager = AsyncRedisLockManager(redis_url, queue_ttl=30)
    try:
        holder = await manager.acquire(resource)
        driver = manager.driver
        assert await driver.cancel(resource, "cancelled-reader", 5.0) is False
        late = await driver.acquire(resource, "cancelled-reader", 5.0, "late", LeaseMode.READ)
        assert late.token is None
        assert not late.queued
        assert await client.zscore(keys.queue, waiter_id("cancelled-reader")) is None

        async def writer() -> tuple[int, float]:
            lease = await manager.acquire(resource, timeout=60)
            at = time.monotonic()
            await lease.release()
            return int(lease.token), at

        task = await spawn(writer)
        await sleep(0.2)  # the writer waits
        released = time.monotonic()
        await holder.release()
        token, granted = await join(task)
        assert token > holder.token
        assert granted - released < 10  # not the queue's 30 s
        assert await client.zcard(keys.queue) == 0
    finally:
        await manager.close()


async def test_late_enqueue_after_an_unanswered_wait_takes_no_place(resource: str) -> None:
    """A FIFO wait whose ENQUEUE got no answer (the server froze) gives up: the manager's
    abandon leaves CANCEL's tombstone, so the ENQUEUE, reaching the server after it (sent
    here in that order), takes no place. Before, it queued a waiter that was gone."""
    server = RedisServer().start()
    keys = resource_keys("fence:", resource)
    manager = AsyncRedisLockManager(server.url, fifo=True, queue_ttl=30, check_config=False)
    raw = redis.Redis.from_url(server.url)
    try:
        holder = await manager.acquire(resource)
        driver = manager.driver
        secret = "unanswered-secret"
        refused = await driver.acquire(resource, secret, 5.0, "waiter")
        assert refused.token is None
        server.pause()
        try:
            with pytest.raises(BackendError):
                await driver.wait(resource, 0.3, refused)  # its ENQUEUE gets no answer
        finally:
            server.resume()
        await driver.abandon(resource, secret)
        assert raw.exists(keys.void_prefix + secret) == 1
        enqueue = [keys.lock, keys.queue, keys.deadlines]
        args = [waiter_id(secret), "30000", secret]
        assert raw.eval(DRIVER_SCRIPTS["enqueue"].source, 3, *enqueue, *args) == 0
        assert raw.zscore(keys.queue, waiter_id(secret)) is None
        await holder.release()
    finally:
        raw.close()
        await manager.close()
        server.stop()


async def test_a_shorter_cancel_keeps_the_longer_tombstone(
    redis_url: str, client: Any, resource: str
) -> None:
    """An acquire that gave up leaves its tombstone for the lease's ttl; its FIFO wait's
    CANCEL that follows (for ``queue_ttl``, shorter here) must not shorten it, or an
    attempt still on its way would be granted once the shorter one ended."""
    keys = resource_keys("fence:", resource)
    manager = AsyncRedisLockManager(redis_url, fifo=True, queue_ttl=0.2)
    try:
        driver = manager.driver
        await driver.cancel(resource, "gave-up", 30.0)
        await driver.cancel(resource, "gave-up", 0.2)
        assert await client.pttl(keys.void_prefix + "gave-up") > 20_000
        await driver.cancel(resource, "gave-up", 60.0)  # a longer one lengthens it
        assert await client.pttl(keys.void_prefix + "gave-up") > 50_000
    finally:
        await manager.close()


def _reply(secret: str) -> AcquireReply:
    """What a failed attempt of a waiter (owner ``secret``) that is not queued yet hands to
    ``wait`` (no mark of the board: the wait takes its own)."""
    return AcquireReply(None, None, (None, waiter_id(secret), False, secret))


# -- clients ------------------------------------------------------------------------------


async def test_given_client_is_used_and_never_closed(redis_url: str, resource: str) -> None:
    client = redis.asyncio.Redis.from_url(redis_url)
    try:
        manager = AsyncRedisLockManager(client)
        lease = await manager.acquire(resource)
        await lease.release()
        await manager.close()
        assert await client.ping()  # still open and usable
    finally:
        await client.aclose()


async def test_decoded_client_works(redis_url: str, resource: str) -> None:
    client = redis.asyncio.Redis.from_url(redis_url, decode_responses=True)
    try:
        manager = AsyncRedisLockManager(client)
        lease = await manager.acquire(resource)
        info = await manager.inspect(resource)
        assert info is not None
        assert info.token == lease.token
        assert isinstance(info.holder, str)
        await lease.release()
        await manager.close()
    finally:
        await client.aclose()


async def test_url_manager_closes_its_connections(
    redis_url: str, client: Any, resource: str
) -> None:
    """A manager built from a URL opens one pool (at most ``max_connections``) and one
    pub/sub connection, and closes them all."""
    before = len(await client.client_list())
    manager = AsyncRedisLockManager(redis_url, max_connections=2)
    try:
        lease = await manager.acquire(resource)

        async def wait() -> None:
            got = await manager.acquire(resource, timeout=10)
            await got.release()

        waiters = [await spawn(wait) for _ in range(5)]

        async def subscribed() -> bool:
            return await subscribers(client, resource_keys("fence:", resource).signal) == 1

        await until(subscribed)
        assert len(await client.client_list()) - before <= 3
        await lease.release()
        for task in waiters:
            await join(task)
    finally:
        await manager.close()

    # close() drops every connection; the server counts a dropped one out when it reads
    # the close, which may come after this client's next command (seen on Python 3.13).
    async def all_closed() -> bool:
        return len(await client.client_list()) == before

    await until(all_closed)


def test_wrong_client_flavour_is_refused(redis_url: str) -> None:
    other = redis.Redis(port=1)  # unasync: other = redis.asyncio.Redis(port=1)
    with pytest.raises(ConfigurationError, match="needs a Redis URL or a"):
        AsyncRedisLockManager(other)
    with pytest.raises(ConfigurationError):
        AsyncRedisLockManager(object())  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        AsyncRedisLockManager("http://not-redis/")


async def test_connection_errors_are_backend_errors() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    manager = AsyncRedisLockManager(url, socket_timeout=0.5)
    try:
        with pytest.raises(BackendError) as info:
            await manager.acquire("res:down")
        assert info.value.code == "CONNECTION"
        assert info.value.retryable
        assert "127.0.0.1" in str(info.value)
        assert info.value.__cause__ is not None
        with pytest.raises(BackendError):
            await manager.inspect("res:down")
    finally:
        await manager.close()


# -- server settings ------------------------------------------------------------------------


async def test_warns_about_allkeys_eviction(redis_url: str, client: Any, resource: str) -> None:
    await client.config_set("maxmemory-policy", "allkeys-lru")
    manager = AsyncRedisLockManager(redis_url)
    try:
        with pytest.warns(FenceWarning, match="allkeys-lru"):
            lease = await manager.acquire(resource)
        await lease.release()
        second = await manager.acquire(resource)  # warned once, on first use only
        await second.release()
    finally:
        await client.config_set("maxmemory-policy", "noeviction")
        await manager.close()


async def test_warns_about_counter_mode_without_persistence(redis_url: str, resource: str) -> None:
    manager = AsyncRedisLockManager(redis_url, token_mode=TokenMode.COUNTER)
    try:
        with pytest.warns(FenceWarning, match="persistence is off"):
            lease = await manager.acquire(resource)
        await lease.release()
    finally:
        await manager.close()


async def test_hybrid_without_persistence_is_quiet(redis_url: str, resource: str) -> None:
    """Hybrid tokens survive a lost counter, so no persistence is no reason to warn (the
    suite turns warnings into errors)."""
    manager = AsyncRedisLockManager(redis_url)
    try:
        lease = await manager.acquire(resource)
        await lease.release()
        assert manager.driver._checked
    finally:
        await manager.close()


async def test_a_user_who_may_not_subscribe_is_told(
    redis_url: str, client: Any, resource: str
) -> None:
    """Waiting needs SUBSCRIBE: a user without it gets a PERMISSION error that says so,
    not a silent wait until the holder's ttl."""
    user = f"nosub-{secrets.token_hex(3)}"
    await client.acl_setuser(
        user,
        enabled=True,
        nopass=True,
        keys=["*"],
        channels=["*"],
        commands=["+@all", "-subscribe"],
    )
    holder_manager = AsyncRedisLockManager(redis_url, check_config=False)
    url = redis_url.replace("redis://", f"redis://{user}:x@")
    manager = AsyncRedisLockManager(url, check_config=False)
    try:
        holder = await holder_manager.acquire(resource, ttl=30)
        with pytest.raises(BackendError) as info:
            await manager.acquire(resource, timeout=5)
        assert info.value.code == "PERMISSION"
        assert "SUBSCRIBE" in str(info.value)
        await holder.release()
    finally:
        await manager.close()
        await holder_manager.close()
        await client.acl_deluser(user)


async def test_disabled_config_is_skipped_quietly(
    redis_url: str, client: Any, resource: str
) -> None:
    """Managed Redis often forbids CONFIG: the check is skipped, the manager works."""
    user = f"limited-{secrets.token_hex(3)}"
    await client.acl_setuser(
        user, enabled=True, nopass=True, keys=["*"], channels=["*"], commands=["+@all", "-config"]
    )
    await client.config_set("maxmemory-policy", "allkeys-lru")  # would warn if seen
    limited = redis.asyncio.Redis.from_url(redis_url, username=user)
    try:
        manager = AsyncRedisLockManager(limited)
        lease = await manager.acquire(resource)
        await lease.release()
        await manager.close()
    finally:
        await client.config_set("maxmemory-policy", "noeviction")
        await limited.aclose()
        await client.acl_deluser(user)


# -- replication ----------------------------------------------------------------------------


async def test_min_replicas_without_replicas_fails_and_hands_out_nothing(
    redis_url: str, client: Any, resource: str
) -> None:
    manager = AsyncRedisLockManager(redis_url, min_replicas=1, replica_timeout=0.1)
    try:
        with pytest.raises(BackendError) as info:
            await manager.acquire(resource)
        assert info.value.code == "REPLICATION"
        assert "0 of 1 replicas" in str(info.value)
        assert await manager.inspect(resource) is None  # released, not left held
        assert await client.exists(resource_keys("fence:", resource).token)
    finally:
        await manager.close()
    plain = AsyncRedisLockManager(redis_url)
    try:
        lease = await plain.acquire(resource)
        assert lease.token > 0
        await lease.release()
    finally:
        await plain.close()


async def test_wait_aof_needs_a_capable_server(redis_url: str, client: Any, resource: str) -> None:
    info = await client.info("server")
    version = tuple(int(x) for x in str(info["redis_version"]).split(".")[:2])
    manager = AsyncRedisLockManager(redis_url, min_replicas=1, replica_timeout=0.1, wait_aof=True)
    try:
        expected = ConfigurationError if version < (7, 2) else BackendError
        with pytest.raises(expected):
            await manager.acquire(resource)
        assert await manager.inspect(resource) is None
    finally:
        await manager.close()


def test_min_replicas_options_are_checked(redis_url: str) -> None:
    with pytest.raises(ConfigurationError):
        AsyncRedisLockManager(redis_url, min_replicas=-1)
    with pytest.raises(ConfigurationError):
        AsyncRedisLockManager(redis_url, wait_aof=True)
