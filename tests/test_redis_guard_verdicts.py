"""What cannot hide the Redis guard's verdict. Sync and asyncio, on the suite's
redis-server.

- A pipeline or a transaction only queues what it is sent: a guard built on one would
  return ``None`` for a stale write and leave the refusal in ``pipeline.execute()``. The
  guard refuses such a client when it is built, before any I/O.
- A key is judged as the bytes the client sends: an encoding that drops or replaces
  characters must not move a key into the fence namespace (C12), nor make two names one
  key with two fences.
- A fence key that holds another type (a list, a hash, a stream, ...) is no fence a token
  can be compared with: the write is refused as ``UNVERIFIABLE`` with nothing written,
  never a ``WRONGTYPE`` error of the backend.

These are rows of the write-path catalogue too (``tests/test_write_paths_redis.py``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
import redis.asyncio
from redis.backoff import NoBackoff
from redis.retry import Retry

from fence import (
    BackendError,
    ConfigurationError,
    InvalidResourceError,
    Reason,
    StaleTokenError,
)
from fence.adapters.redis import (
    AsyncRedisGuard,
    RedisGuard,
    UnissuedTokenError,
    WriteRefusedError,
)

pytestmark = pytest.mark.redis

FLAVORS = ["sync", "asyncio"]


@pytest.fixture
def admin(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def _client(flavor: str, url: str, **options: Any) -> Any:
    cls = redis.asyncio.Redis if flavor == "asyncio" else redis.Redis
    return cls.from_url(url, **options)


def _dead_client(flavor: str, **options: Any) -> Any:
    """A client whose server does not exist: any I/O raises a connection error."""
    cls = redis.asyncio.Redis if flavor == "asyncio" else redis.Redis
    return cls(host="127.0.0.1", port=1, retry=Retry(NoBackoff(), 0), **options)


def _guard_class(flavor: str) -> Any:
    return AsyncRedisGuard if flavor == "asyncio" else RedisGuard


async def _close(client: Any) -> None:
    closing = client.aclose() if isinstance(client, redis.asyncio.Redis) else client.close()
    if inspect.isawaitable(closing):
        await closing


async def _settle(result: Any) -> Any:
    return await result if inspect.isawaitable(result) else result


def _state(admin: redis.Redis) -> dict[bytes, Any]:
    """Every key with its serialized value and ttl: equal states mean nothing changed."""
    return {key: (admin.dump(key), admin.pttl(key)) for key in sorted(admin.keys("*"))}


def _raise_pipelined(outcomes: list[Any]) -> list[Any]:
    for outcome in outcomes:
        if isinstance(outcome, Exception):
            raise outcome
    return outcomes


async def _pipelined(pipeline: Any) -> list[Any]:
    return _raise_pipelined(await _settle(pipeline.execute()))


#: Every guard method that reaches the storage, as ``(guard, key, token) -> awaitable or
#: result``; a pipelined write's error is raised as a direct call's would be.
CALLS: dict[str, Callable[[Any, Any, int], Any]] = {
    "set": lambda g, k, t: g.set(k, "new", token=t),
    "set must_exist": lambda g, k, t: g.set(k, "new", token=t, must_exist=True),
    "set ttl": lambda g, k, t: g.set(k, "new", token=t, ttl=60),
    "hset": lambda g, k, t: g.hset(k, {"f": "new"}, token=t),
    "incr": lambda g, k, t: g.incr(k, 2, token=t),
    "rpush": lambda g, k, t: g.rpush(k, "new", token=t),
    "xadd": lambda g, k, t: g.xadd(k, {"f": "new"}, token=t),
    "delete": lambda g, k, t: g.delete(k, token=t),
    "claim": lambda g, k, t: g.claim(k, t),
    "read_for_update": lambda g, k, t: g.read_for_update(k, token=t),
    "hgetall_for_update": lambda g, k, t: g.hgetall_for_update(k, token=t),
    "batch": lambda g, k, t: g.batch(t).set(k, "new").delete(k).execute(),
    "batch claim": lambda g, k, t: g.batch(t).claim(k).execute(),
    "pipeline set": lambda g, k, t: _pipelined(g.pipeline().set(k, "new", token=t)),
    "pipeline hset": lambda g, k, t: _pipelined(g.pipeline().hset(k, {"f": 1}, token=t)),
    "pipeline incr": lambda g, k, t: _pipelined(g.pipeline().incr(k, token=t)),
    "pipeline claim": lambda g, k, t: _pipelined(g.pipeline().claim(k, token=t)),
    "get": lambda g, k, t: g.get(k),
    "hgetall": lambda g, k, t: g.hgetall(k),
    "fence": lambda g, k, t: g.fence(k),
}


# -- a pipeline or a transaction is refused ----------------------------------------------


@pytest.mark.parametrize("transaction", [False, True], ids=["pipeline", "transaction"])
@pytest.mark.parametrize("client_flavor", FLAVORS)
@pytest.mark.parametrize("flavor", FLAVORS)
async def test_a_guard_on_a_pipeline_is_refused_before_any_io(
    flavor: str, client_flavor: str, transaction: bool
) -> None:
    """Whichever guard and whichever pipeline: a queued command returns no verdict."""
    dead = _dead_client(client_flavor)
    try:
        pipeline = dead.pipeline(transaction=transaction)
        with pytest.raises(ConfigurationError, match="pipeline") as caught:
            _guard_class(flavor)(pipeline)
        message = str(caught.value)
        assert "guard.pipeline()" in message
        assert "guard.batch(token)" in message
        assert len(pipeline) == 0
    finally:
        await _close(dead)


@pytest.mark.parametrize("flavor", FLAVORS)
async def test_a_stale_write_cannot_hide_in_a_pipeline(
    flavor: str, redis_url: str, admin: redis.Redis
) -> None:
    """The hole the refusal closes: on a pipeline a stale set returned ``None`` and its
    verdict came back as a raw reply of ``execute()``. The guard's own pipeline and batch
    give each write its verdict."""
    client = _client(flavor, redis_url)
    try:
        guard = _guard_class(flavor)(client)
        await _settle(guard.set("{p}:k", "v", token=20))
        before = _state(admin)
        pipeline = client.pipeline()
        with pytest.raises(ConfigurationError):
            _guard_class(flavor)(pipeline)
        assert len(pipeline) == 0
        (outcome,) = await _settle(guard.pipeline().set("{p}:k", "stale", token=10).execute())
        assert isinstance(outcome, StaleTokenError)
        assert outcome.reason is Reason.STALE
        with pytest.raises(StaleTokenError):
            await _settle(guard.batch(10).set("{p}:k", "stale").execute())
        assert _state(admin) == before
    finally:
        await _close(client)


# -- keys as the bytes the client sends ----------------------------------------------------


@pytest.mark.parametrize("errors", ["ignore", "replace"])
@pytest.mark.parametrize("flavor", FLAVORS)
async def test_an_encoding_cannot_move_a_key_into_the_fence_namespace(
    flavor: str, errors: str, redis_url: str, admin: redis.Redis
) -> None:
    """With ``encoding_errors="ignore"`` the 'é' is dropped on the way and the rest is a
    per-key fence: the key is judged as the bytes the client sends."""
    admin.set("{a}:k", "old")
    admin.set("fence:{a}:key:{a}:k", 20)
    client = _client(flavor, redis_url, encoding="ascii", encoding_errors=errors)
    try:
        guard = _guard_class(flavor)(client)
        before = _state(admin)
        key = "\u00e9fence:{a}:key:{a}:k" if errors == "ignore" else "fence:{a}:key:{a}:k"
        for name, call in CALLS.items():
            with pytest.raises(InvalidResourceError, match="fence namespace") as caught:
                await _settle(call(guard, key, 1))
            assert caught.value.value == key, name
        assert _state(admin) == before
        # The fenced key itself is still fenced.
        with pytest.raises(StaleTokenError):
            await _settle(guard.set("{a}:k", "stale", token=10))
        assert _state(admin) == before
    finally:
        await _close(client)


@pytest.mark.parametrize("errors", ["ignore", "replace", "backslashreplace"])
@pytest.mark.parametrize("flavor", FLAVORS)
async def test_a_key_the_encoding_would_change_is_refused(
    flavor: str, errors: str, redis_url: str, admin: redis.Redis
) -> None:
    """Under a lossy encoding two names reach Redis as one key: ``{é}a`` is sent as
    ``{}a`` with 'ignore', whose hash tag is empty. Fenced by its name, that one key would
    have two fences, and a stale holder could write it through the other name."""
    client = _client(flavor, redis_url, encoding="ascii", encoding_errors=errors)
    dead = _dead_client(flavor, encoding="ascii", encoding_errors=errors)
    try:
        guard = _guard_class(flavor)(client)
        dead_guard = _guard_class(flavor)(dead)
        for name, call in CALLS.items():
            for key in ("{\u00e9}a", "{a}:\u00e9"):
                with pytest.raises(InvalidResourceError, match="encoding") as caught:
                    await _settle(call(dead_guard, key, 1))
                assert caught.value.value == key, name
        # Its ASCII twin is an ordinary key: fenced by its own name, as ever.
        await _settle(guard.set("{}a", "new", token=20))
        with pytest.raises(StaleTokenError):
            await _settle(guard.set("{}a", "stale", token=10))
        assert admin.get("{}a") == b"new"
        assert admin.get("fence:{{}a}:key:{}a") == b"20"
    finally:
        await _close(client)
        await _close(dead)


@pytest.mark.parametrize("flavor", FLAVORS)
async def test_a_key_the_client_cannot_send_is_refused_before_any_io(flavor: str) -> None:
    """A lone surrogate has no UTF-8: refused with the other key checks, not left to fail
    in the client's encoder."""
    dead = _dead_client(flavor)
    try:
        guard = _guard_class(flavor)(dead)
        for name, call in CALLS.items():
            with pytest.raises(InvalidResourceError, match="cannot send it") as caught:
                await _settle(call(guard, "{a}:\ud800", 1))
            assert caught.value.value == "{a}:\ud800", name
    finally:
        await _close(dead)


@pytest.mark.parametrize("flavor", FLAVORS)
async def test_a_key_is_fenced_as_the_bytes_the_client_sends(
    flavor: str, redis_url: str, admin: redis.Redis
) -> None:
    """A latin-1 client sends 'é' as one byte: the key and its fence are those bytes."""
    client = _client(flavor, redis_url, encoding="latin-1")
    try:
        guard = _guard_class(flavor)(client)
        await _settle(guard.set("{caf\u00e9}:k", "new", token=20))
        assert admin.get(b"{caf\xe9}:k") == b"new"
        assert admin.get(b"fence:{caf\xe9}:key:{caf\xe9}:k") == b"20"
        assert guard.layout.wire_keys("{caf\u00e9}:k") == (
            b"fence:{caf\xe9}:key:{caf\xe9}:k",
            b"{caf\xe9}:k",
        )
        with pytest.raises(StaleTokenError) as caught:
            await _settle(guard.set("{caf\u00e9}:k", "stale", token=10))
        assert (caught.value.reason, caught.value.fence) == (Reason.STALE, 20)
        assert await _settle(guard.get("{caf\u00e9}:k")) == (b"new", 20)
        assert await _settle(guard.fence("{caf\u00e9}:k")) == 20
        resource = _guard_class(flavor)(client, scope="resource", check_issuer=True)
        admin.set(b"fence:{caf\xe9}:token", 30)
        await _settle(resource.claim("caf\u00e9", 30))
        assert admin.get(b"fence:{caf\xe9}:fence") == b"30"
        with pytest.raises(UnissuedTokenError):
            await _settle(resource.set("{caf\u00e9}:k", "x", token=31))
        assert admin.get(b"{caf\xe9}:k") == b"new"
    finally:
        await _close(client)


@pytest.mark.parametrize("encoding", ["utf-16", "utf-32", "utf-16-le"])
@pytest.mark.parametrize("flavor", FLAVORS)
async def test_a_client_that_would_move_the_namespace_is_refused(
    flavor: str, encoding: str
) -> None:
    """The fence namespace is the prefix's UTF-8 bytes, as the lock managers and the ACL
    recipe name it; a client that sends the prefix otherwise would put every fence of
    the guard outside it."""
    dead = _dead_client(flavor, encoding=encoding)
    try:
        with pytest.raises(ConfigurationError, match="encoding"):
            _guard_class(flavor)(dead)
    finally:
        await _close(dead)
    dead = _dead_client(flavor, encoding="ascii")
    try:
        with pytest.raises(ConfigurationError, match="encoding"):
            _guard_class(flavor)(dead, prefix="f\u00e9nce:")
    finally:
        await _close(dead)


class _Disguised(str):
    """A str whose own ``encode`` says it is a fence key."""

    def encode(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        return b"fence:{a}:key:{a}:k"

    def startswith(self, *args: Any) -> bool:
        return False


@pytest.mark.parametrize("flavor", FLAVORS)
async def test_the_bytes_checked_are_the_bytes_sent(
    flavor: str, redis_url: str, admin: redis.Redis
) -> None:
    """A str subclass cannot show one name to the check and send another."""
    client = _client(flavor, redis_url)
    try:
        guard = _guard_class(flavor)(client)
        await _settle(guard.set("{a}:k", "old", token=20))
        await _settle(guard.set(_Disguised("{a}:k"), "new", token=21))
        assert admin.get("{a}:k") == b"new"
        assert admin.get("fence:{a}:key:{a}:k") == b"21"
    finally:
        await _close(client)


@pytest.mark.parametrize(
    "key",
    [
        b"fence:{a}:key:{a}:k",
        b"{a}:k",
        memoryview(b"fence:{a}:fence"),
        bytearray(b"fence:{a}:token"),
        12,
        1.5,
    ],
    # A memoryview's repr names its address: the ids must be the same in every process.
    ids=lambda key: f"memoryview({bytes(key)!r})" if isinstance(key, memoryview) else repr(key),
)
@pytest.mark.parametrize("flavor", FLAVORS)
async def test_a_key_that_is_no_str_is_refused_before_any_io(flavor: str, key: Any) -> None:
    """redis-py sends bytes, memoryviews, ints and floats as keys too; the guard takes a
    str only, whatever bytes the key would be, inside the fence namespace or out."""
    dead = _dead_client(flavor)
    try:
        guard = _guard_class(flavor)(dead)
        numbered = _guard_class(flavor)(dead, prefix="1")  # 12 and 1.5 would lie in it
        for call in CALLS.values():
            for each in (guard, numbered):
                with pytest.raises(InvalidResourceError, match="must be a str"):
                    await _settle(call(each, key, 1))
    finally:
        await _close(dead)


# -- a fence key of another type ---------------------------------------------------------------

#: What a fence key may hold by accident or malice, written raw.
WRONG_TYPES: dict[str, Callable[[redis.Redis, str], Any]] = {
    "list": lambda a, k: a.rpush(k, "x"),
    "hash": lambda a, k: a.hset(k, "f", "x"),
    "stream": lambda a, k: a.xadd(k, {"f": "x"}),
    "set": lambda a, k: a.sadd(k, "x"),
    "zset": lambda a, k: a.zadd(k, {"x": 1}),
}


@pytest.mark.parametrize("kind", WRONG_TYPES)
@pytest.mark.parametrize("flavor", FLAVORS)
async def test_a_fence_key_of_another_type_is_unverifiable(
    flavor: str, kind: str, redis_url: str, admin: redis.Redis
) -> None:
    client = _client(flavor, redis_url)
    try:
        for scope, fence_key in (
            ("key", "fence:{w}:key:{w}:k"),
            ("resource", "fence:{w}:fence"),
        ):
            admin.flushall()
            admin.set("{w}:k", "old")
            WRONG_TYPES[kind](admin, fence_key)
            guard = _guard_class(flavor)(client, scope=scope)
            before = _state(admin)
            for name, call in CALLS.items():
                key = "w" if scope == "resource" and "claim" in name else "{w}:k"
                with pytest.raises(StaleTokenError) as caught:
                    await _settle(call(guard, key, 25))
                error = caught.value
                assert error.reason is Reason.UNVERIFIABLE, name
                assert error.fence is None, name
                shown = str(error.rejected[0] if error.rejected else error)
                assert (kind if name != "fence" else "another type") in shown, name
                assert _state(admin) == before, name
    finally:
        await _close(client)


@pytest.mark.parametrize("flavor", FLAVORS)
async def test_an_issued_counter_of_another_type_is_unverifiable(
    flavor: str, redis_url: str, admin: redis.Redis
) -> None:
    client = _client(flavor, redis_url)
    try:
        admin.rpush("fence:{w}:token", "x")
        guard = _guard_class(flavor)(client, scope="resource", check_issuer=True)
        before = _state(admin)
        for call in (
            lambda: guard.set("{w}:k", "new", token=5),
            lambda: guard.claim("w", 5),
            lambda: guard.batch(5).set("{w}:k", "new").execute(),
        ):
            with pytest.raises(UnissuedTokenError) as caught:
                await _settle(call())
            assert caught.value.reason is Reason.UNVERIFIABLE
        assert _state(admin) == before
    finally:
        await _close(client)


@pytest.mark.parametrize("flavor", FLAVORS)
async def test_a_data_key_of_another_type_is_still_the_callers_data(
    flavor: str, redis_url: str, admin: redis.Redis
) -> None:
    """Only the fence key is the guard's: a data key of the wrong type for the operation
    is refused as before (WriteRefusedError for a write, the backend's error for a plain
    read), and a set replaces it, as SET does."""
    client = _client(flavor, redis_url)
    try:
        guard = _guard_class(flavor)(client)
        admin.rpush("{d}:k", "x")
        with pytest.raises(WriteRefusedError) as refused:
            await _settle(guard.hset("{d}:k", {"f": 1}, token=5))
        assert refused.value.refused[0].reason == "WRONGTYPE"
        with pytest.raises(BackendError, match="WRONGTYPE"):
            await _settle(guard.get("{d}:k"))
        await _settle(guard.set("{d}:k", "v", token=5))
        assert admin.get("{d}:k") == b"v"
    finally:
        await _close(client)
