"""The Redis guard under real faults, on servers these tests own: a restart (the script
cache is gone), a killed server, a stopped server, and a Redis Cluster.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.cluster
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.retry import Retry

from fence import BackendError, ConfigurationError, Reason, RetryableError, StaleTokenError
from fence.adapters.redis import AsyncRedisGuard, CrossSlotError, RedisGuard, slot_of
from tests.servers import RedisServer, free_port

pytestmark = pytest.mark.redis


@pytest.fixture
def aof_server() -> Iterator[RedisServer]:
    """A redis-server that fsyncs every write, so data survives a SIGKILL restart."""
    server = RedisServer("--appendonly", "yes", "--appendfsync", "always").start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def cluster_server() -> Iterator[RedisServer]:
    """A one-node Redis Cluster that owns every slot: the server enforces CROSSSLOT."""
    # The bus port on a free port of its own: the default, port + 10000, can be taken by a
    # client connection's local port (it falls in the ephemeral range) or pass 65535.
    server = RedisServer(
        "--cluster-enabled", "yes",
        "--cluster-config-file", "nodes.conf",
        "--cluster-port", str(free_port()),
    )  # fmt: skip
    server.start()
    admin = redis.Redis(port=server.port)
    try:
        admin.execute_command("CLUSTER", "ADDSLOTSRANGE", 0, 16383)
        deadline = time.monotonic() + 20
        while b"cluster_state:ok" not in admin.execute_command("CLUSTER", "INFO"):
            assert time.monotonic() < deadline, "the one-node cluster did not come up"
            time.sleep(0.05)
    finally:
        admin.close()
    yield server
    server.stop()


def _no_retry_client(server: RedisServer, **options: float) -> redis.Redis:
    return redis.Redis(port=server.port, retry=Retry(NoBackoff(), 0), **options)


def test_restart_mid_run_reloads_the_script_and_keeps_fences(aof_server: RedisServer) -> None:
    client = redis.Redis(port=aof_server.port)
    guard = RedisGuard(client)
    try:
        guard.set("k", 1, token=7)
        aof_server.restart()  # SIGKILL: the script cache is empty afterwards
        # redis-py reconnects; the guard meets NOSCRIPT, loads the script, retries once.
        guard.set("k", 2, token=7)
        assert guard.get("k") == (b"2", 7)
        aof_server.restart()
        with pytest.raises(StaleTokenError) as caught:  # a real verdict, from the AOF fence
            guard.set("k", 3, token=6)
        assert caught.value.fence == 7
        aof_server.restart()
        assert guard.pipeline().set("k", 4, token=8).execute() == [1]
        assert guard.get("k") == (b"4", 8)
    finally:
        client.close()


async def test_async_restart_mid_run_reloads_the_script(aof_server: RedisServer) -> None:
    client = redis.asyncio.Redis(port=aof_server.port)
    guard = AsyncRedisGuard(client)
    try:
        await guard.set("k", 1, token=7)
        aof_server.restart()
        await guard.set("k", 2, token=7)
        assert await guard.get("k") == (b"2", 7)
        aof_server.restart()
        results = await guard.pipeline().set("k", 3, token=6).set("k", 4, token=8).execute()
        assert isinstance(results[0], StaleTokenError)
        assert results[1] == 1
    finally:
        await client.aclose()


async def test_async_restart_needs_no_client_retries(aof_server: RedisServer) -> None:
    """A restart closes the pooled connection; a client without retries (redis-py 5's
    default) does not send again, so the guard does, once, for a write that is safe to
    repeat with its token, and never for one that would apply twice."""
    client = redis.asyncio.Redis(port=aof_server.port, retry=Retry(NoBackoff(), 0))
    guard = AsyncRedisGuard(client)
    try:
        await guard.set("k", 1, token=7)
        await guard.incr("n", 5, token=7)
        aof_server.restart()
        await guard.set("k", 2, token=7)
        aof_server.restart()
        assert await guard.fence("k") == 7
        aof_server.restart()
        assert await guard.read_for_update("k", token=8) == b"2"
        aof_server.restart()
        results = await guard.pipeline().set("k", 3, token=7).set("k", 4, token=8).execute()
        assert isinstance(results[0], StaleTokenError)
        assert results[1] == 1
        aof_server.restart()
        batch = guard.batch(8).set("{b}:k", 5).hset("{b}:h", {"f": 1}).delete("{b}:d")
        assert await batch.execute() == [1, 1, 0]
        aof_server.restart()
        with pytest.raises(BackendError) as caught:  # not sent again: it would apply twice
            await guard.incr("n", 1, token=8)
        assert (caught.value.code, caught.value.retryable) == ("CONNECTION", True)
        assert await guard.get("n") == (b"5", 7)
        assert await guard.get("k") == (b"4", 8)
    finally:
        await client.aclose()


def test_killed_server_is_a_retryable_connection_error(aof_server: RedisServer) -> None:
    client = _no_retry_client(aof_server)
    guard = RedisGuard(client)
    try:
        guard.set("k", 1, token=1)
        aof_server.kill()
        with pytest.raises(BackendError) as caught:
            guard.set("k", 2, token=1)
        err = caught.value
        assert (err.code, err.retryable) == ("CONNECTION", True)
        assert isinstance(err.__cause__, redis.ConnectionError)
        assert not isinstance(err, StaleTokenError)
        with pytest.raises(BackendError) as caught:
            guard.pipeline().set("k", 2, token=1).execute()
        assert caught.value.code == "CONNECTION"
        aof_server.start()
        guard.set("k", 2, token=1)
        assert guard.get("k") == (b"2", 1)
    finally:
        client.close()


async def test_async_killed_server_is_a_retryable_connection_error(
    aof_server: RedisServer,
) -> None:
    client = redis.asyncio.Redis(port=aof_server.port, retry=Retry(NoBackoff(), 0))
    guard = AsyncRedisGuard(client)
    try:
        await guard.set("k", 1, token=1)
        aof_server.kill()
        with pytest.raises(BackendError) as caught:
            await guard.claim("k", 2)
        assert (caught.value.code, caught.value.retryable) == ("CONNECTION", True)
    finally:
        await client.aclose()


# -- a write whose reply is lost is never sent twice ------------------------------------------

#: A client that retries after a connection error, as redis-py's own default client does
#: from 6.0 on (``redis.Redis()``: 3 retries, 10 in 8.x); the error listed for redis-py 5.
_RETRYING = {"retry": Retry(NoBackoff(), 3), "retry_on_error": [redis.ConnectionError]}

#: The writes that would apply twice if sent again, each with what checks it applied once.
_NOT_REPEATABLE = {
    "incr": lambda guard: guard.incr("n", 1, token=5),
    "rpush": lambda guard: guard.rpush("n:list", b"x", token=5),
    "xadd": lambda guard: guard.xadd("n:stream", {b"f": b"v"}, token=5),
    "pipeline incr": lambda guard: guard.pipeline().incr("n", 1, token=5).execute(),
    "batch incr": lambda guard: guard.batch(5).incr("n", 1).execute(),
}


def _applied(admin: redis.Redis) -> tuple[int, int, int]:
    return int(admin.get("n") or 0), admin.llen("n:list"), admin.xlen("n:stream")


@pytest.mark.parametrize("write", sorted(_NOT_REPEATABLE))
def test_a_write_whose_reply_is_lost_is_never_sent_again(redis_url: str, write: str) -> None:
    """redis-py resends a command after a connection error when its client retries (the
    default client does): an ``INCR`` whose reply was lost would land twice. The guard
    sends the writes that are not safe to repeat once, and says the outcome is unknown."""
    from tests.proxies import ReplyDropper

    admin = redis.Redis.from_url(redis_url)
    admin.delete("n", "n:list", "n:stream", "{n}:fence", "n:fence")
    kwargs = admin.connection_pool.connection_kwargs
    proxy = ReplyDropper(kwargs["host"], kwargs["port"])
    client = redis.Redis(host="127.0.0.1", port=proxy.port, **_RETRYING)  # type: ignore[arg-type]
    guard = RedisGuard(client)
    try:
        _NOT_REPEATABLE[write](guard)  # the connection is up, the fence at 5
        before = _applied(admin)
        proxy.armed.set()
        with pytest.raises(BackendError) as caught:
            _NOT_REPEATABLE[write](guard)
        assert (caught.value.code, caught.value.retryable) == ("CONNECTION", True)
        assert proxy.dropped == 1, "sent once, its one reply lost"
        proxy.heal()
        after = _applied(admin)
        assert sum(after) == sum(before) + 1, (before, after)  # it ran once, not again
        assert guard.get("n")[1] == 5 or write not in ("incr", "pipeline incr", "batch incr")
    finally:
        client.close()
        proxy.close()
        admin.delete("n", "n:list", "n:stream")
        admin.close()


async def test_async_a_write_whose_reply_is_lost_is_never_sent_again(redis_url: str) -> None:
    """The asyncio guard, the same: an ``INCR`` sent once, its outcome unknown."""
    from tests.proxies import ReplyDropper

    admin = redis.Redis.from_url(redis_url)
    admin.delete("n")
    kwargs = admin.connection_pool.connection_kwargs
    proxy = ReplyDropper(kwargs["host"], kwargs["port"])
    client = redis.asyncio.Redis(
        host="127.0.0.1",
        port=proxy.port,
        retry=AsyncRetry(NoBackoff(), 3),
        retry_on_error=[redis.ConnectionError],
    )
    guard = AsyncRedisGuard(client)
    try:
        await guard.incr("n", 1, token=5)
        proxy.armed.set()
        with pytest.raises(BackendError) as caught:
            await guard.incr("n", 1, token=5)
        assert caught.value.code == "CONNECTION"
        assert proxy.dropped == 1
        proxy.heal()
        assert int(admin.get("n") or 0) == 2
        assert await guard.incr("n", 1, token=5) == 3  # the guard goes on after it
    finally:
        await client.aclose()
        proxy.close()
        admin.delete("n")
        admin.close()


def test_a_write_safe_to_repeat_still_follows_the_clients_retries(redis_url: str) -> None:
    """A ``SET`` with its token is safe to send again: the client's retries still serve it
    (here every reply is lost, so each try runs and the call fails in the end)."""
    from tests.proxies import ReplyDropper

    admin = redis.Redis.from_url(redis_url)
    kwargs = admin.connection_pool.connection_kwargs
    proxy = ReplyDropper(kwargs["host"], kwargs["port"])
    client = redis.Redis(host="127.0.0.1", port=proxy.port, **_RETRYING)  # type: ignore[arg-type]
    guard = RedisGuard(client)
    try:
        guard.set("s", 1, token=5)
        proxy.armed.set()
        with pytest.raises(BackendError):
            guard.set("s", 2, token=5)
        assert proxy.dropped >= 4, "the first try and the client's 3 retries"
    finally:
        client.close()
        proxy.close()
        admin.delete("s")
        admin.close()


def test_stopped_server_is_a_retryable_timeout(aof_server: RedisServer) -> None:
    client = _no_retry_client(aof_server, socket_timeout=0.3)
    guard = RedisGuard(client)
    try:
        guard.set("k", 1, token=1)
        aof_server.pause()
        try:
            with pytest.raises(RetryableError) as caught:
                guard.set("k", 2, token=1)
        finally:
            aof_server.resume()
        assert caught.value.code == "TIMEOUT"
        assert caught.value.retryable
        assert isinstance(caught.value.__cause__, redis.TimeoutError)
    finally:
        client.close()


# -- cluster -------------------------------------------------------------------------------


def test_cluster_client_fenced_writes(cluster_server: RedisServer) -> None:
    client = redis.cluster.RedisCluster(host="127.0.0.1", port=cluster_server.port)
    try:
        client.flushall()
        guard = RedisGuard(client)
        rguard = RedisGuard(client, scope="resource", check_issuer=True)
        guard.set("plain", 1, token=3)  # no hash tag: the fence key is tagged {plain}
        assert guard.get("plain") == (b"1", 3)
        client.script_flush()
        guard.set("{o:1}:a", 1, token=3)
        assert guard.batch(3).set("{o:1}:a", 2).incr("{o:1}:b").execute() == [1, 1]
        with pytest.raises(StaleTokenError) as caught:
            guard.batch(2).set("{o:1}:a", 3).set("{o:1}:c", 3).execute()
        assert [e.scope for e in caught.value.rejected] == ["{o:1}:a"]
        client.set("fence:{o:2}:token", 9)
        rguard.claim("o:2", 9)
        assert rguard.fence("{o:2}:x") == 9
        results = guard.pipeline().set("{o:1}:a", 9, token=2).set("{o:3}:a", 1, token=1).execute()
        assert isinstance(results[0], StaleTokenError)
        assert results[1] == 1
        # Mixed hash tags are refused before I/O, with CROSSSLOT explained.
        with pytest.raises(CrossSlotError, match="CROSSSLOT"):
            guard.batch(5).set("{o:1}:a", 1).set("{o:2}:a", 1).execute()
        # A key whose fence cannot share its slot is refused up front on a cluster.
        with pytest.raises(CrossSlotError):
            guard.set("a}b", 1, token=1)
    finally:
        client.close()


def test_cluster_server_crossslot_reply_is_explained(cluster_server: RedisServer) -> None:
    # Bypass the client-side check: a plain client sends keys of two slots to the cluster
    # node, which answers CROSSSLOT; the guard turns that into CrossSlotError.
    client = redis.Redis(port=cluster_server.port)
    guard = RedisGuard(client)
    try:
        keys = ["{o:1}:a", "{o:9}:a"]
        assert slot_of(keys[0]) != slot_of(keys[1])
        batch = guard.batch(5).set(keys[0], 1).set(keys[1], 1)
        with pytest.raises(CrossSlotError) as caught:
            guard._write(5, batch.ops)  # one_slot=False: the server decides
        assert "CROSSSLOT" in str(caught.value)
    finally:
        client.close()


async def test_async_cluster_client_fenced_writes(cluster_server: RedisServer) -> None:
    client = redis.asyncio.cluster.RedisCluster(host="127.0.0.1", port=cluster_server.port)
    try:
        guard = AsyncRedisGuard(client, scope="resource")
        await client.script_flush()
        await guard.set("{acct:5}:balance", 10, token=4)
        assert await guard.read_for_update("{acct:5}:balance", token=5) == b"10"
        with pytest.raises(StaleTokenError) as caught:
            await guard.set("{acct:5}:balance", 0, token=4)
        assert caught.value.reason is Reason.STALE
        assert await guard.batch(5).set("{acct:5}:balance", 20).execute() == [1]
        results = await guard.pipeline().incr("{acct:6}:n", token=1).execute()
        assert results == [1]
        with pytest.raises(CrossSlotError):
            await guard.batch(5).set("{acct:5}:a", 1).set("{acct:6}:a", 1).execute()
    finally:
        await client.aclose()


def test_a_guard_on_a_cluster_pipeline_is_refused(cluster_server: RedisServer) -> None:
    """A cluster pipeline queues as any other: its commands would hide every verdict."""
    client = redis.cluster.RedisCluster(host="127.0.0.1", port=cluster_server.port)
    try:
        pipeline = client.pipeline()
        with pytest.raises(ConfigurationError, match=r"guard\.pipeline\(\)"):
            RedisGuard(pipeline)
        assert len(pipeline) == 0
    finally:
        client.close()


async def test_async_guard_on_a_cluster_pipeline_is_refused(cluster_server: RedisServer) -> None:
    client = redis.asyncio.cluster.RedisCluster(host="127.0.0.1", port=cluster_server.port)
    try:
        pipeline = client.pipeline()
        with pytest.raises(ConfigurationError, match=r"guard\.pipeline\(\)"):
            AsyncRedisGuard(pipeline)
        assert len(pipeline) == 0
    finally:
        await client.aclose()


# -- a server out of memory ------------------------------------------------------------------


def test_out_of_memory_refuses_the_first_write_and_never_half_applies() -> None:
    """Redis 7 refuses a script's first write at maxmemory, and lets a script that already
    wrote finish. The guard's scripts make their first write the first command the server
    can refuse, so every write is applied whole or not at all."""
    server = RedisServer("--maxmemory-policy", "noeviction").start()
    client = redis.Redis(port=server.port)
    try:
        guard = RedisGuard(client)
        guard.set("{o}:n", 1, token=1)
        guard.set("{o}:gone", 1, token=1)
        pipe = client.pipeline(transaction=False)
        for i in range(20_000):
            pipe.set(f"fill:{i}", "x" * 200)
        pipe.execute()
        client.config_set("maxmemory", client.info("memory")["used_memory"] // 2)
        state = [(key, client.dump(key)) for key in sorted(client.keys("{o}:*"))]
        fences = [client.get(key) for key in sorted(client.keys("fence:*"))]
        (in_pipeline,) = guard.pipeline().set("{o}:a", "x", token=2).execute()
        assert isinstance(in_pipeline, BackendError)
        assert in_pipeline.code == "OOM"
        for call in (
            lambda: guard.batch(2).set("{o}:a", "x").incr("{o}:n").execute(),
            lambda: guard.batch(2).claim("{o}:n").execute(),
            lambda: guard.set("{o}:a", "x", token=2),
            lambda: guard.incr("{o}:n", token=2),
            lambda: guard.claim("{o}:n", 2),
        ):
            with pytest.raises(BackendError) as caught:
                call()
            assert caught.value.code == "OOM"
            assert "maxmemory" in str(caught.value)
            assert [(key, client.dump(key)) for key in sorted(client.keys("{o}:*"))] == state
            assert [client.get(key) for key in sorted(client.keys("fence:*"))] == fences
        # DEL may run at maxmemory; after it, the script's writes go on to the end.
        assert guard.batch(2).delete("{o}:gone").set("{o}:a", "x").incr("{o}:n").execute() == [
            1,
            1,
            2,
        ]
        assert guard.get("{o}:a") == (b"x", 2)
        assert client.info("memory")["used_memory"] > int(
            client.config_get("maxmemory")["maxmemory"]
        )
    finally:
        client.close()
        server.stop()
