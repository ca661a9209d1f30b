"""How the Redis guard puts its calls on the wire (``adapters/_redis_wire.py``).

The guard packs its ``EVALSHA`` calls itself and sends them on a connection of a plain
client's pool. These tests hold it to what ``execute_command`` would do: the same bytes,
the same replies and errors for every kind of client (``decode_responses``, RESP3), the
connection back in the pool after every call, and ``execute_command`` itself for every
client kind the guard does not send around.
"""

from __future__ import annotations

import enum
import inspect
import logging
from collections.abc import Callable
from typing import Any

import pytest
import redis
import redis.asyncio
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import NoBackoff
from redis.exceptions import DataError
from redis.retry import Retry

from fence import FenceError, RetryableError
from fence._lua import Script
from fence.adapters._redis_lua import HSET, MANY, SET, WRITE
from fence.adapters._redis_wire import Wire, pack_calls
from fence.adapters.redis import AsyncRedisGuard, RedisGuard
from tests.clients_redis import counting_client
from tests.servers import RedisServer

pytestmark = pytest.mark.redis

# -- packing (no I/O) -----------------------------------------------------------------------


class Level(enum.IntEnum):
    """An int subclass: redis-py encodes it by ``repr``, and so must the guard."""

    HIGH = 3


class Name(str):
    """A str subclass."""


#: Arguments of every kind and size redis-py's packer treats differently.
ARGUMENTS: list[Any] = [
    "",
    "a",
    "ü€",
    Name("named"),
    "x" * 255,
    "x" * 256,
    "y" * 6000,
    "z" * 6001,
    b"",
    b"\x00\r\n$*",
    b"b" * 7000,
    0,
    -1,
    2**70,
    1.5,
    -0.0,
    Level.HIGH,
    memoryview(b"view"),
    memoryview(b"v" * 7000),
]


def _theirs(connection: redis.Connection, calls: list[tuple[Script, list[Any], list[Any]]]) -> Any:
    chunks = []
    for script, keys, argv in calls:
        chunks += connection.pack_command("EVALSHA", script.sha, len(keys), *keys, *argv)
    return chunks


@pytest.mark.parametrize("encoding", [("utf-8", "strict"), ("latin-1", "replace")])
def test_packing_matches_redis_py(encoding: tuple[str, str]) -> None:
    connection = redis.Connection(encoding=encoding[0], encoding_errors=encoding[1])
    calls: list[tuple[Script, list[Any], list[Any]]] = [
        (HSET, ["fence:{k}:key:{k}", "{k}"], ARGUMENTS),
        (SET, ["fence:{s}:key:{s}", "{s}"], [b"7", "v"]),
        (MANY, ["a", "b", "c", "d"], ["x" * 7001]),  # a large argument last
        (WRITE, [], []),
    ]
    ours = pack_calls(calls, connection.encoder)
    assert b"".join(ours) == b"".join(_theirs(connection, calls))
    # Large arguments are chunks of their own, never copied, as redis-py sends them.
    for big in (ARGUMENTS[10], ARGUMENTS[18]):
        assert any(chunk is big for chunk in ours)


@pytest.mark.parametrize("odd", [None, True, {}, bytearray(b"x"), [1]], ids=repr)
def test_arguments_redis_py_refuses_are_refused_alike(odd: Any) -> None:
    """``None``, a bool, a dict, ... are refused by both packers; a ``bytearray`` by
    both or neither (redis-py's versions differ)."""
    connection = redis.Connection()
    outcomes = []
    for pack in (
        lambda: b"".join(_theirs(connection, [(SET, ["k"], [odd])])),
        lambda: b"".join(pack_calls([(SET, ["k"], [odd])], connection.encoder)),
    ):
        try:
            outcomes.append(pack())
        except DataError:
            outcomes.append(DataError)
    assert outcomes[0] == outcomes[1]
    if not isinstance(odd, bytearray):
        assert outcomes[0] is DataError


# -- which clients the guard sends around ---------------------------------------------------


def test_plain_clients_are_sent_to_directly_others_keep_execute_command(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = redis.Redis.from_url(redis_url)
    hand_built = redis.Redis(host="127.0.0.1", port=plain.connection_pool.connection_kwargs["port"])
    single = redis.Redis.from_url(redis_url, single_connection_client=True)
    counting = counting_client("sync", redis_url)
    try:
        for client in (plain, hand_built):
            assert Wire(client).pool(client) is client.connection_pool
        for client in (single, counting):
            assert Wire(client).pool(client) is None
        # An instrumentation installed after the guard was built is never gone around.
        guard = RedisGuard(plain)
        guard.set("k", "u", token=1)  # the script is loaded
        seen: list[Any] = []
        original = redis.Redis.execute_command

        def traced(self: redis.Redis, *args: Any, **options: Any) -> Any:
            seen.append(args[0])
            return original(self, *args, **options)

        monkeypatch.setattr(redis.Redis, "execute_command", traced)
        guard.set("k", "v", token=1)
        assert seen == ["EVALSHA"]
        monkeypatch.undo()
        guard.set("k", "w", token=1)
        assert seen == ["EVALSHA"]
        # redis-py's debug log of failed calls (sync clients) is never gone around.
        logger = logging.getLogger("redis.client")
        level = logger.level
        logger.setLevel(logging.DEBUG)
        try:
            assert Wire(plain).pool(plain) is None
        finally:
            logger.setLevel(level)
        assert Wire(plain).pool(plain) is plain.connection_pool
        # A single-connection client still writes, on its one connection.
        RedisGuard(single).set("k", "x", token=2)
        assert plain.get("k") == b"x"
    finally:
        for client in (plain, hand_built, single, counting):
            client.close()


# -- the same outcomes through either way ---------------------------------------------------

#: Client options whose replies differ in type: the guard's must match redis-py's.
CLIENT_OPTIONS = [
    {},
    {"decode_responses": True},
    {"protocol": 3},
    {"protocol": 3, "decode_responses": True},
]


def _outcome(value: Any) -> Any:
    """A comparable record of a result or an error."""
    if isinstance(value, FenceError):
        return (type(value).__name__, getattr(value, "code", None), getattr(value, "reason", None))
    if isinstance(value, list):
        return [_outcome(item) for item in value]
    return value


async def _scenario(guard: Any, plain: Callable[[str], Any], prefix: str) -> list[Any]:
    """Every kind of write and read, accepted and refused; one outcome per step."""
    k, h, s, n = (f"{{{prefix}}}:{name}" for name in ("k", "h", "s", "n"))
    steps: list[Callable[[], Any]] = [
        lambda: guard.set(k, "v", token=5),
        lambda: guard.set(k, "stale", token=4),
        lambda: guard.hset(h, {"a": 1, "b": "ü"}, token=5),
        lambda: guard.hset(k, {"a": 1}, token=5),  # a string key: refused on the data
        lambda: guard.set(k, None, token=5),  # redis-py refuses to encode it
        lambda: guard.incr(n, 7, token=5),
        lambda: guard.xadd(s, {"f": "v"}, token=5, id="1-1"),
        lambda: guard.read_for_update(k, token=6),
        lambda: guard.hgetall_for_update(h, token=6),
        lambda: guard.get(k),
        lambda: guard.hgetall(h),
        lambda: guard.fence(k),
        lambda: guard.claim(k, 3),
        lambda: guard.batch(6).set(k, "w").hset(h, {"c": 3}).incr(n).execute(),
        lambda: guard.batch(5).set(k, "stale").execute(),
        lambda: (
            guard.pipeline()
            .set(k, "p", token=6)
            .set(k, "stale", token=1)
            .hset(h, {"d": 4}, token=6)
            .incr(n, 1, token=6)
            .claim(s, token=6)
            .execute()
        ),
    ]
    out = []
    for step in steps:
        try:
            result = step()
            if inspect.isawaitable(result):
                result = await result
        except FenceError as err:
            result = err
        out.append(_outcome(result))
    # The values as the same client reads them with redis-py itself.
    for key in (k, h):
        read = plain(key)
        out.append(await read if inspect.isawaitable(read) else read)
    return out


def _close(client: Any) -> Any:
    return client.aclose() if isinstance(client, redis.asyncio.Redis) else client.close()


@pytest.mark.parametrize("options", CLIENT_OPTIONS, ids=lambda o: ",".join(o) or "default")
@pytest.mark.parametrize("flavor", ["sync", "asyncio"])
async def test_direct_and_execute_command_give_the_same_outcomes(
    flavor: str, options: dict[str, Any], redis_url: str
) -> None:
    plain_cls = redis.asyncio.Redis if flavor == "asyncio" else redis.Redis
    guard_cls = AsyncRedisGuard if flavor == "asyncio" else RedisGuard
    direct = plain_cls.from_url(redis_url, **options)
    generic = counting_client(flavor, redis_url, **options)
    try:
        assert Wire(direct).pool(direct) is not None
        outcomes = []
        for prefix, client in (("direct", direct), ("generic", generic)):

            def read(key: str, client: Any = client) -> Any:
                return client.hgetall(key) if key.endswith(":h") else client.get(key)

            outcomes.append(await _scenario(guard_cls(client), read, prefix))
        assert outcomes[0] == outcomes[1]
        assert "EVALSHA" in generic.commands
        # The outcomes are what the scenario means, not merely alike.
        value = "p" if options.get("decode_responses") else b"p"
        assert outcomes[0][0] is None
        assert outcomes[0][1][2] == "STALE"
        assert outcomes[0][4][1] == "BACKEND"  # DataError: nothing sent
        assert outcomes[0][-2] == value
    finally:
        for client in (direct, generic):
            closing = _close(client)
            if inspect.isawaitable(closing):
                await closing


# -- connections ---------------------------------------------------------------------------


def test_every_call_gives_its_connection_back(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    pool = client.connection_pool
    guard = RedisGuard(client)
    try:
        guard.set("k", "v", token=5)
        assert not pool._in_use_connections
        for failing in (
            lambda: guard.set("k", "v", token=4),  # stale
            lambda: guard.set("k", None, token=5),  # refused before any I/O
            lambda: guard.hset("k", {"f": 1}, token=5),  # refused on the data
        ):
            with pytest.raises(FenceError):
                failing()
            assert not pool._in_use_connections
        client.script_flush()  # NOSCRIPT: loaded and sent again
        guard.set("k", "w", token=5)
        assert not pool._in_use_connections
        assert len(pool._available_connections) == 1
    finally:
        client.close()


def test_a_timed_out_call_disconnects_its_connection() -> None:
    server = RedisServer().start()
    client = redis.Redis(port=server.port, socket_timeout=0.3, retry=Retry(NoBackoff(), 0))
    pool = client.connection_pool
    guard = RedisGuard(client)
    try:
        guard.set("k", "v", token=5)
        (connection,) = pool._available_connections
        server.pause()
        try:
            with pytest.raises(RetryableError):
                guard.set("k", "w", token=5)
        finally:
            server.resume()
        assert not pool._in_use_connections
        assert connection._sock is None  # disconnected: its late reply is never read
        guard.set("k", "x", token=5)
        assert guard.get("k") == (b"x", 5)
    finally:
        client.close()
        server.stop()


@pytest.mark.parametrize("flavor", ["sync", "asyncio"])
async def test_a_write_after_a_restart_is_sent_at_most_once(
    flavor: str,
) -> None:
    """After a restart closed the pooled connection, a fenced ``incr`` is sent at most
    once: it lands where the pool finds the closed connection before sending (the sync
    pool does), as redis-py's own ``INCRBY`` does, and never where only a retry would
    send it again (after a connection error the guard cannot tell a request that never
    ran from a reply that was lost); redis-py's ``INCRBY`` follows the client's
    ``Retry``."""
    server = RedisServer("--appendonly", "yes", "--appendfsync", "always").start()
    try:
        for retries in (0, 1):
            landed, values = await _incr_after_restart(flavor, server, retries)
            plain, fenced = landed
            if retries == 0 or flavor == "sync":
                assert fenced == plain
            else:
                assert fenced <= plain
            # Each call applied once or not at all, never twice.
            assert values == [b"2" if ok else b"1" for ok in landed]
    finally:
        server.stop()


async def _incr_after_restart(
    flavor: str, server: RedisServer, retries: int
) -> tuple[list[bool], list[Any]]:
    """Whether a plain ``INCRBY`` and a fenced ``incr`` landed after a restart, and the
    values they left."""
    if flavor == "asyncio":
        client: Any = redis.asyncio.Redis(
            port=server.port,
            retry=AsyncRetry(NoBackoff(), retries),
            retry_on_error=[redis.ConnectionError],
        )
        guard: Any = AsyncRedisGuard(client)
    else:
        client = redis.Redis(
            port=server.port,
            retry=Retry(NoBackoff(), retries),
            retry_on_error=[redis.ConnectionError],
        )
        guard = RedisGuard(client)
    writes = [
        lambda: client.incrby("plain", 1),
        lambda: guard.incr("fenced", 1, token=1),
    ]
    landed = []
    try:
        deleted = client.delete("plain", "fenced")
        if inspect.isawaitable(deleted):
            await deleted
        for write in writes:
            for attempt in range(2):
                if attempt:
                    server.restart()
                try:
                    result = write()
                    if inspect.isawaitable(result):
                        await result
                except (redis.ConnectionError, FenceError):
                    assert attempt == 1
                    landed.append(False)
                else:
                    if attempt:
                        landed.append(True)
        values = [client.get(key) for key in ("plain", "fenced")]
        return landed, [await value if inspect.isawaitable(value) else value for value in values]
    finally:
        closing = _close(client)
        if inspect.isawaitable(closing):
            await closing
