"""The Redis write-path catalogue: every way a write reaches fenced keys, fenced or refused.

C9: every path by which a write can reach fenced storage is fenced or refused before any
I/O. Each row below is one path, a small declarative record; adding a path is adding a
row. Guard rows run for the sync and the asyncio guard, against every kind of key, for
three callers:

- unbound (no token): refused with :class:`fence.InvalidTokenError` before any I/O; a read
  lease's token (:class:`fence.ReadToken`) with :class:`fence.ReadLeaseError`, also before
  any I/O;
- a stale holder (token 10 under fence 20): refused, data and fence unchanged;
- the current holder (token 25): the write lands and the key's fence ends at 25; or, for
  a key the guard must not write (the fence namespace, a lock manager's key, an untagged
  data key in the resource scope), refused with :class:`fence.InvalidResourceError`
  before any I/O.

Keys are judged as the bytes the client sends: some kinds of key come with a client
encoding of their own (a latin-1 key is fenced as its latin-1 bytes; an encoding that
drops a character cannot move a key into the fence namespace, nor send two names as one
key), and keys that are no ``str`` (bytes, memoryviews, numbers) are refused.

A guard cannot be built on a pipeline or a transaction of redis-py, whose queued commands
would hide every verdict: the client rows show it refused before any I/O, so no caller
writes through one.

Every guard row runs once more on a fence key that holds another type (a list, a hash, a
stream): no token can be compared with it, so the stale holder and the current holder are
both refused as ``UNVERIFIABLE``, with nothing written.

The guard rows use a client logged in as the guard's user of the ACL recipe
(:func:`fence.adapters.redis.acl_rules`), which so is shown to be enough for every path.
Raw rows are commands any client could send to the same keys: from the recipe's
application user Redis refuses each one with nothing written; from an unrestricted user
they land, the explicit bypass ``docs/redis-guard.md`` states.
"""

from __future__ import annotations

import inspect
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
import redis.asyncio
from redis.backoff import NoBackoff
from redis.exceptions import NoPermissionError
from redis.retry import Retry

from fence import (
    ConfigurationError,
    InvalidResourceError,
    InvalidTokenError,
    ReadLeaseError,
    ReadToken,
    Reason,
    StaleTokenError,
)
from fence.adapters.redis import AsyncRedisGuard, RedisGuard, acl_rules
from tests.clients_redis import counting_client
from tests.servers import RedisServer

pytestmark = pytest.mark.redis

STALE, FENCE, CURRENT = 10, 20, 25

#: The fenced data keys of this module, for the ACL recipe.
DATA_KEYS = ["{wp:*}*", "wp:*"]


# -- the rows ------------------------------------------------------------------------------


@dataclass(frozen=True)
class GuardPath:
    """One write path of the guard.

    Attributes:
        name: the row's name.
        call: ``(guard, key, token) -> result`` for a sync or an asyncio guard.
        seed: what the key holds before the call (see :data:`SEEDS`).
        landed: ``(admin, key, result) -> bool``: the current holder's write is in place.
        scope: the path takes a fence scope (claim): a bare name is its own resource.
        pipelined: the path returns one outcome per write, an error as a value.
    """

    name: str
    call: Callable[[Any, str, Any], Any]
    seed: str
    landed: Callable[[redis.Redis, Any, Any], bool]
    scope: bool = False
    pipelined: bool = False


def _unchanged(admin: redis.Redis, key: Any, _result: Any) -> bool:
    return admin.get(key) == b"old"


GUARD_PATHS = [
    GuardPath(
        "set",
        lambda g, k, t: g.set(k, "new", token=t),
        "string",
        lambda a, k, _: a.get(k) == b"new",
    ),
    GuardPath(
        "set ttl",
        lambda g, k, t: g.set(k, "new", token=t, ttl=60),
        "string",
        lambda a, k, _: a.get(k) == b"new" and 0 < a.pttl(k) <= 60_000,
    ),
    GuardPath(
        "set must_exist",
        lambda g, k, t: g.set(k, "new", token=t, must_exist=True),
        "string",
        lambda a, k, _: a.get(k) == b"new",
    ),
    GuardPath(
        "hset",
        lambda g, k, t: g.hset(k, {"f": "new"}, token=t),
        "hash",
        lambda a, k, _: a.hget(k, "f") == b"new",
    ),
    GuardPath(
        "hset must_exist",
        lambda g, k, t: g.hset(k, {"g": "new"}, token=t, must_exist=True),
        "hash",
        lambda a, k, r: r == 1 and a.hget(k, "g") == b"new",
    ),
    GuardPath(
        "delete",
        lambda g, k, t: g.delete(k, token=t),
        "string",
        lambda a, k, r: r is True and a.exists(k) == 0,
    ),
    GuardPath(
        "incr",
        lambda g, k, t: g.incr(k, 2, token=t),
        "int",
        lambda a, k, r: r == 9 and a.get(k) == b"9",
    ),
    GuardPath(
        "incr must_exist",
        lambda g, k, t: g.incr(k, -2, token=t, must_exist=True),
        "int",
        lambda a, k, r: r == 5 and a.get(k) == b"5",
    ),
    GuardPath(
        "rpush",
        lambda g, k, t: g.rpush(k, "new", token=t),
        "list",
        lambda a, k, r: r == 2 and a.lrange(k, 0, -1) == [b"old", b"new"],
    ),
    GuardPath(
        "xadd",
        lambda g, k, t: g.xadd(k, {"f": "new"}, token=t),
        "stream",
        lambda a, k, r: a.xlen(k) == 2 and a.xrange(k)[-1][0] == r,
    ),
    GuardPath(
        "xadd id",
        lambda g, k, t: g.xadd(k, {"f": "new"}, id="2-*", token=t, maxlen=10),
        "stream",
        lambda a, k, r: r == b"2-0" and a.xlen(k) == 2,
    ),
    GuardPath("claim", lambda g, k, t: g.claim(k, t), "string", _unchanged, scope=True),
    GuardPath(
        "read_for_update",
        lambda g, k, t: g.read_for_update(k, token=t),
        "string",
        lambda a, k, r: r == b"old" and _unchanged(a, k, r),
    ),
    GuardPath(
        "hgetall_for_update",
        lambda g, k, t: g.hgetall_for_update(k, token=t),
        "hash",
        lambda a, k, r: r == {b"f": b"old"} and a.hgetall(k) == {b"f": b"old"},
    ),
    GuardPath(
        "batch set",
        lambda g, k, t: g.batch(t).set(k, "new").execute(),
        "string",
        lambda a, k, r: r == [1] and a.get(k) == b"new",
    ),
    GuardPath(
        "batch hset",
        lambda g, k, t: g.batch(t).hset(k, {"f": "new"}, must_exist=True).execute(),
        "hash",
        lambda a, k, _: a.hget(k, "f") == b"new",
    ),
    GuardPath(
        "batch delete",
        lambda g, k, t: g.batch(t).delete(k).execute(),
        "string",
        lambda a, k, r: r == [1] and a.exists(k) == 0,
    ),
    GuardPath(
        "batch incr",
        lambda g, k, t: g.batch(t).incr(k, 2).incr(k, 1).execute(),
        "int",
        lambda a, k, r: r == [9, 10] and a.get(k) == b"10",
    ),
    GuardPath(
        "batch rpush",
        lambda g, k, t: g.batch(t).rpush(k, "new").execute(),
        "list",
        lambda a, k, _: a.lrange(k, 0, -1) == [b"old", b"new"],
    ),
    GuardPath(
        "batch xadd",
        lambda g, k, t: g.batch(t).xadd(k, {"f": "new"}, id="2-1").xadd(k, {"f": 3}).execute(),
        "stream",
        lambda a, k, r: r[0] == b"2-1" and a.xlen(k) == 3,
    ),
    GuardPath(
        "batch claim",
        lambda g, k, t: g.batch(t).claim(k).execute(),
        "string",
        _unchanged,
        scope=True,
    ),
    GuardPath(
        "pipeline set",
        lambda g, k, t: g.pipeline().set(k, "new", token=t).execute(),
        "string",
        lambda a, k, _: a.get(k) == b"new",
        pipelined=True,
    ),
    GuardPath(
        "pipeline hset",
        lambda g, k, t: g.pipeline().hset(k, {"f": "new"}, token=t).execute(),
        "hash",
        lambda a, k, _: a.hget(k, "f") == b"new",
        pipelined=True,
    ),
    GuardPath(
        "pipeline delete",
        lambda g, k, t: g.pipeline().delete(k, token=t).execute(),
        "string",
        lambda a, k, _: a.exists(k) == 0,
        pipelined=True,
    ),
    GuardPath(
        "pipeline incr",
        lambda g, k, t: g.pipeline().incr(k, 2, token=t).execute(),
        "int",
        lambda a, k, r: r == 9 and a.get(k) == b"9",
        pipelined=True,
    ),
    GuardPath(
        "pipeline rpush",
        lambda g, k, t: g.pipeline().rpush(k, "new", token=t).execute(),
        "list",
        lambda a, k, _: a.lrange(k, 0, -1) == [b"old", b"new"],
        pipelined=True,
    ),
    GuardPath(
        "pipeline claim",
        lambda g, k, t: g.pipeline().claim(k, token=t).execute(),
        "string",
        _unchanged,
        scope=True,
        pipelined=True,
    ),
]

#: What a key holds before a call, written raw by the admin client.
SEEDS: dict[str, Callable[[redis.Redis, Any], Any]] = {
    "string": lambda a, k: a.set(k, "old"),
    "int": lambda a, k: a.set(k, 7),
    "hash": lambda a, k: a.hset(k, "f", "old"),
    "list": lambda a, k: a.rpush(k, "old"),
    "stream": lambda a, k: a.xadd(k, {"f": "old"}, id="1-1"),
}


@dataclass(frozen=True)
class KeyKind:
    """A kind of key a caller may pass, in one fence scope.

    Attributes:
        name: the kind's name.
        scope: the guard's fence scope, ``"key"`` or ``"resource"``.
        key: an example key.
        reserved: the key lies in the fence namespace: every path refuses it.
        untagged: a key without a hash tag: data paths refuse it in the resource scope.
        encoding: the client's ``encoding`` and ``encoding_errors``.
        refusal: what every path's ``InvalidResourceError`` says, for a key refused for
            another reason than the namespace or the hash tag.
    """

    name: str
    scope: str
    key: Any
    reserved: bool = False
    untagged: bool = False
    encoding: tuple[str, str] = ("utf-8", "strict")
    refusal: str | None = None

    def refused(self, path: GuardPath) -> bool:
        """Whether ``path`` must refuse this key before any I/O."""
        return (
            self.reserved
            or self.refusal is not None
            or (self.untagged and self.scope == "resource" and not path.scope)
        )

    @property
    def options(self) -> dict[str, str]:
        """The client's options for this kind."""
        return {"encoding": self.encoding[0], "encoding_errors": self.encoding[1]}


KEY_KINDS = [
    KeyKind("tagged", "key", "{wp:1}:k"),
    KeyKind("tagged in resource scope", "resource", "{wp:1}:k"),
    KeyKind("untagged", "key", "wp:1:k", untagged=True),
    KeyKind("untagged in resource scope", "resource", "wp:1:k", untagged=True),
    # A bare resource name, outside the data key patterns: claim takes it, data paths don't.
    KeyKind("resource name", "resource", "wpr:1", untagged=True),
    KeyKind("fence key", "key", "fence:{wp:1}:key:{wp:1}:k", reserved=True),
    KeyKind("fence register", "resource", "fence:{wp:1}:fence", reserved=True),
    KeyKind("manager counter", "key", "fence:{wp:1}:token", reserved=True),
    KeyKind("manager lock", "resource", "fence:{wp:1}:lock", reserved=True),
    # As the client sends them: a latin-1 client sends 'é' as one byte, key and fence alike.
    KeyKind("latin-1", "key", "{wp:1}:k\u00e9", encoding=("latin-1", "strict")),
    KeyKind(
        "latin-1 in resource scope", "resource", "{wp:\u00e9}:k", encoding=("latin-1", "strict")
    ),
    # With encoding_errors="ignore" the 'é' is dropped on the way: what is left is a fence.
    KeyKind(
        "a fence key behind a dropped character",
        "key",
        "\u00e9fence:{wp:1}:key:{wp:1}:k",
        reserved=True,
        encoding=("ascii", "ignore"),
    ),
    KeyKind(
        "a register behind a dropped character",
        "resource",
        "\u00e9fence:{wp:1}:fence",
        reserved=True,
        encoding=("ascii", "ignore"),
    ),
    # Sent as '{wp:1}:k' and '{wp:?}:k': names other keys have too, with other fences.
    KeyKind(
        "a dropped character",
        "key",
        "{wp:1}:k\u00e9",
        encoding=("ascii", "ignore"),
        refusal="encoding",
    ),
    KeyKind(
        "a replaced character",
        "resource",
        "{wp:\u00e9}:k",
        encoding=("ascii", "replace"),
        refusal="encoding",
    ),
    # redis-py sends these as keys too; the guard takes a str only.
    KeyKind("bytes in the namespace", "key", b"fence:{wp:1}:key:{wp:1}:k", refusal="must be a str"),
    KeyKind("bytes", "resource", b"{wp:1}:k", refusal="must be a str"),
    KeyKind("memoryview", "key", memoryview(b"fence:{wp:1}:fence"), refusal="must be a str"),
    KeyKind("int", "key", 12, refusal="must be a str"),
    KeyKind("float", "resource", 1.5, refusal="must be a str"),
]


@dataclass(frozen=True)
class RawCommand:
    """A raw command any client could send to a key.

    Attributes:
        name: the row's name.
        args: ``key -> command arguments``, sent by ``execute_command``.
        bypass: show that an unrestricted user's command lands (server-wide commands such
            as ``FLUSHALL`` are not run for that).
        creates: the command creates a key of its own type: the bypass is shown on a new key.
        transaction: sent inside ``MULTI``/``EXEC``.
    """

    name: str
    args: Callable[[str], tuple[Any, ...]]
    bypass: bool = True
    creates: bool = False
    transaction: bool = False


_SCRIPT = "return redis.call('SET', KEYS[1], 'raw')"

RAW_COMMANDS = [
    RawCommand("SET", lambda k: ("SET", k, "raw")),
    RawCommand("MSET", lambda k: ("MSET", k, "raw")),
    RawCommand("SETRANGE", lambda k: ("SETRANGE", k, 0, "raw")),
    RawCommand("APPEND", lambda k: ("APPEND", k, "raw")),
    RawCommand("INCR", lambda k: ("INCR", k)),
    RawCommand("DEL", lambda k: ("DEL", k)),
    RawCommand("UNLINK", lambda k: ("UNLINK", k)),
    RawCommand("GETDEL", lambda k: ("GETDEL", k)),
    RawCommand("GETEX", lambda k: ("GETEX", k, "EX", 100)),
    RawCommand("EXPIRE", lambda k: ("EXPIRE", k, 100)),
    RawCommand("PEXPIREAT", lambda k: ("PEXPIREAT", k, 1)),
    RawCommand("RENAME", lambda k: ("RENAME", k, "app:renamed")),
    RawCommand("RENAME onto", lambda k: ("RENAME", "app:src", k)),
    RawCommand("COPY onto", lambda k: ("COPY", "app:src", k, "REPLACE")),
    RawCommand("MOVE", lambda k: ("MOVE", k, 1)),
    # An unrestricted user could restore a real DUMP; this payload only has to be refused.
    RawCommand("RESTORE", lambda k: ("RESTORE", k, 0, b"\x00\x03raw", "REPLACE"), bypass=False),
    RawCommand("SORT STORE", lambda k: ("SORT", "app:list", "ALPHA", "STORE", k)),
    RawCommand("HSET", lambda k: ("HSET", k, "f", "raw"), creates=True),
    RawCommand("LPUSH", lambda k: ("LPUSH", k, "raw"), creates=True),
    RawCommand("XADD", lambda k: ("XADD", k, "*", "f", "raw"), creates=True),
    RawCommand("EVAL", lambda k: ("EVAL", _SCRIPT, 1, k)),
    RawCommand("EVAL undeclared", lambda k: ("EVAL", _SCRIPT.replace("KEYS[1]", repr(k)), 0)),
    RawCommand("FUNCTION", lambda k: ("FUNCTION", "LOAD", "REPLACE", _library(k))),
    RawCommand("MULTI SET", lambda k: ("SET", k, "raw"), transaction=True),
    RawCommand("FLUSHALL", lambda k: ("FLUSHALL",), bypass=False),
    RawCommand("FLUSHDB", lambda k: ("FLUSHDB",), bypass=False),
    RawCommand("SWAPDB", lambda k: ("SWAPDB", 0, 1), bypass=False),
    RawCommand(
        "CONFIG SET", lambda k: ("CONFIG", "SET", "maxmemory-policy", "allkeys-lru"), bypass=False
    ),
    RawCommand("ACL SETUSER", lambda k: ("ACL", "SETUSER", "intruder", "on"), bypass=False),
]


def _library(key: str) -> str:
    return (
        "#!lua name=intruder\n"
        "redis.register_function('intrude', function() "
        f"return redis.call('SET', {key!r}, 'raw') end)"
    )


#: Where raw commands are aimed: a fenced data key, its fence, a manager's counter.
RAW_TARGETS = ["{wp:1}:k", "fence:{wp:1}:key:{wp:1}:k", "fence:{wp:1}:token"]


# -- fixtures ------------------------------------------------------------------------------


@dataclass
class Users:
    """The recipe's two users on the suite's server, as URLs with their credentials."""

    guard_url: str
    app_url: str


@pytest.fixture(scope="module")
def users(redis_server: RedisServer) -> Iterator[Users]:
    rules = acl_rules(DATA_KEYS, app_keys=["app:*"])
    admin = redis.Redis.from_url(redis_server.url)
    names = []
    urls = []
    for rule_list in (rules.guard, rules.app):
        name, password = f"wp-{secrets.token_hex(4)}", secrets.token_hex(8)
        admin.execute_command("ACL", "SETUSER", name, *rule_list, f">{password}")
        names.append(name)
        urls.append(redis_server.url.replace("redis://", f"redis://{name}:{password}@", 1))
    yield Users(*urls)
    for name in names:
        admin.execute_command("ACL", "DELUSER", name)
    admin.close()


@pytest.fixture
def admin(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    yield client
    client.close()


def _dead_client(flavor: str, counting: bool = False, **options: Any) -> Any:
    """A client whose server does not exist: any I/O raises a connection error."""
    retry = Retry(NoBackoff(), 0)
    if counting:
        return counting_client(flavor, "redis://127.0.0.1:1", retry=retry, **options)
    if flavor == "asyncio":
        return redis.asyncio.Redis(host="127.0.0.1", port=1, retry=retry, **options)
    return redis.Redis(host="127.0.0.1", port=1, retry=retry, **options)


def _client(flavor: str, url: str, **options: Any) -> Any:
    cls = redis.asyncio.Redis if flavor == "asyncio" else redis.Redis
    return cls.from_url(url, **options)


async def _close(client: Any) -> None:
    closing = client.aclose() if isinstance(client, redis.asyncio.Redis) else client.close()
    if inspect.isawaitable(closing):
        await closing


def _guard(flavor: str, client: Any, scope: str) -> Any:
    return (AsyncRedisGuard if flavor == "asyncio" else RedisGuard)(client, scope=scope)


async def _run(path: GuardPath, guard: Any, key: str, token: Any) -> Any:
    """Call ``path``; raise a pipelined error as a direct call would."""
    result = path.call(guard, key, token)
    if inspect.isawaitable(result):
        result = await result
    if path.pipelined:
        (outcome,) = result
        if isinstance(outcome, Exception):
            raise outcome
    return result


def _state(admin: redis.Redis) -> dict[bytes, Any]:
    """Every key with its serialized value and ttl."""
    return {key: (admin.dump(key), admin.pttl(key)) for key in sorted(admin.keys("*"))}


# -- guard rows ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KEY_KINDS, ids=lambda kind: kind.name)
@pytest.mark.parametrize("path", GUARD_PATHS, ids=lambda path: path.name)
@pytest.mark.parametrize("flavor", ["sync", "asyncio"])
async def test_guard_path(
    flavor: str, path: GuardPath, kind: KeyKind, users: Users, admin: redis.Redis
) -> None:
    client = _client(flavor, users.guard_url, **kind.options)
    try:
        await _check_path(flavor, path, kind, client, admin)
    finally:
        await _close(client)


@pytest.mark.parametrize("kind", KEY_KINDS[:2], ids=lambda kind: kind.name)
@pytest.mark.parametrize("path", GUARD_PATHS, ids=lambda path: path.name)
@pytest.mark.parametrize("flavor", ["sync", "asyncio"])
async def test_guard_path_through_execute_command(
    flavor: str, path: GuardPath, kind: KeyKind, users: Users, admin: redis.Redis
) -> None:
    """The same rows through a client with an ``execute_command`` of its own: the guard's
    other way to the storage (it sends its calls through that method, not around it)."""
    client = counting_client(flavor, users.guard_url)
    try:
        await _check_path(flavor, path, kind, client, admin, counting=True)
        assert ("pipeline" if path.pipelined else "EVALSHA") in client.commands
    finally:
        await _close(client)


async def _check_path(
    flavor: str,
    path: GuardPath,
    kind: KeyKind,
    client: Any,
    admin: redis.Redis,
    *,
    counting: bool = False,
) -> None:
    """The three callers of one row: unbound, a stale holder, the current holder."""
    key = kind.key
    dead = _dead_client(flavor, counting, **kind.options)
    try:
        dead_guard = _guard(flavor, dead, kind.scope)
        # Unbound: no token, refused before any I/O (no connection error).
        with pytest.raises(InvalidTokenError):
            await _run(path, dead_guard, key, None)
        # A read lease's token (C13): refused before any I/O too.
        with pytest.raises(ReadLeaseError):
            await _run(path, dead_guard, key, ReadToken(CURRENT))
        if kind.refused(path):
            refusal = kind.refusal or r"fence namespace|hash tag"
            for token in (STALE, CURRENT):
                with pytest.raises(InvalidResourceError, match=refusal):
                    await _run(path, dead_guard, key, token)
            return
    finally:
        await _close(dead)

    guard = _guard(flavor, client, kind.scope)
    # The key and its fence as the client sends them; the admin client reads those bytes.
    fence_key, sent = guard.layout.wire_keys(key, data=not path.scope)
    SEEDS[path.seed](admin, sent)
    admin.set(fence_key, FENCE)
    before = _state(admin)
    # A stale holder: refused, nothing written.
    with pytest.raises(StaleTokenError) as caught:
        await _run(path, guard, key, STALE)
    assert (caught.value.reason, caught.value.fence) == (Reason.STALE, FENCE)
    assert _state(admin) == before
    # The current holder: written, and the fence ends at its token.
    result = await _run(path, guard, key, CURRENT)
    assert path.landed(admin, sent, result[0] if path.pipelined else result)
    assert admin.get(fence_key) == str(CURRENT).encode()


@pytest.mark.parametrize("transaction", [False, True], ids=["pipeline", "transaction"])
@pytest.mark.parametrize("flavor", ["sync", "asyncio"])
async def test_guard_on_a_pipeline_is_refused(
    flavor: str, transaction: bool, users: Users, admin: redis.Redis
) -> None:
    """Client rows: a guard built on ``client.pipeline()`` would queue its script and
    return before the verdict (a stale set returned ``None``). Refused when the guard is
    built, for every caller alike, with nothing queued and nothing written."""
    client = _client(flavor, users.guard_url)
    try:
        SEEDS["string"](admin, "{wp:1}:k")
        admin.set("fence:{wp:1}:key:{wp:1}:k", FENCE)
        before = _state(admin)
        pipeline = client.pipeline(transaction=transaction)
        for scope in ("key", "resource"):
            with pytest.raises(ConfigurationError, match="pipeline"):
                _guard(flavor, pipeline, scope)
        assert len(pipeline) == 0
        await _settle(pipeline.execute())
        assert _state(admin) == before
    finally:
        await _close(client)


async def _settle(result: Any) -> Any:
    return await result if inspect.isawaitable(result) else result


#: What a fence key may hold instead of a fence, written raw.
WRONG_TYPES: dict[str, Callable[[redis.Redis, str], Any]] = {
    "list": lambda a, k: a.rpush(k, "x"),
    "hash": lambda a, k: a.hset(k, "f", "x"),
    "stream": lambda a, k: a.xadd(k, {"f": "x"}),
}


@pytest.mark.parametrize("wrong", WRONG_TYPES)
@pytest.mark.parametrize("kind", KEY_KINDS[:2], ids=lambda kind: kind.name)
@pytest.mark.parametrize("path", GUARD_PATHS, ids=lambda path: path.name)
@pytest.mark.parametrize("flavor", ["sync", "asyncio"])
async def test_guard_path_on_a_fence_key_of_another_type(
    flavor: str, path: GuardPath, kind: KeyKind, wrong: str, users: Users, admin: redis.Redis
) -> None:
    """The three callers of one row, on a fence key that holds no fence: unbound, refused
    before any I/O; a stale holder and the current holder, ``UNVERIFIABLE``, nothing
    written (never a ``WRONGTYPE`` error of the backend)."""
    key = kind.key
    dead = _dead_client(flavor)
    try:
        with pytest.raises(InvalidTokenError):
            await _run(path, _guard(flavor, dead, kind.scope), key, None)
    finally:
        await _close(dead)
    client = _client(flavor, users.guard_url)
    try:
        guard = _guard(flavor, client, kind.scope)
        fence_key = guard.layout.fence_key(key, data=not path.scope)
        SEEDS[path.seed](admin, key)
        WRONG_TYPES[wrong](admin, fence_key)
        before = _state(admin)
        for token in (STALE, CURRENT):
            with pytest.raises(StaleTokenError) as caught:
                await _run(path, guard, key, token)
            assert (caught.value.reason, caught.value.fence) == (Reason.UNVERIFIABLE, None)
            assert _state(admin) == before
    finally:
        await _close(client)


# -- raw rows ------------------------------------------------------------------------------


def _send(client: redis.Redis, row: RawCommand, key: str) -> None:
    if row.transaction:
        pipe = client.pipeline(transaction=True)
        pipe.execute_command(*row.args(key))
        pipe.execute()
    else:
        client.execute_command(*row.args(key))


def _seed_raw(admin: redis.Redis) -> None:
    admin.set("{wp:1}:k", 7)
    admin.set("fence:{wp:1}:key:{wp:1}:k", FENCE)
    admin.set("fence:{wp:1}:token", FENCE)
    admin.set("app:src", "src")
    admin.rpush("app:list", "x")


@pytest.mark.parametrize("target", RAW_TARGETS)
@pytest.mark.parametrize("row", RAW_COMMANDS, ids=lambda row: row.name)
def test_raw_command_from_the_app_user_is_refused(
    row: RawCommand, target: str, users: Users, admin: redis.Redis
) -> None:
    _seed_raw(admin)
    before = _state(admin)
    functions = admin.execute_command("FUNCTION", "LIST")
    app = redis.Redis.from_url(users.app_url)
    try:
        # In a transaction the command is refused when queued, and EXEC aborts.
        with pytest.raises(NoPermissionError):
            _send(app, row, target)
    finally:
        app.close()
    assert _state(admin) == before
    assert admin.execute_command("FUNCTION", "LIST") == functions
    assert admin.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"


@pytest.mark.parametrize("row", [row for row in RAW_COMMANDS if row.bypass], ids=lambda r: r.name)
def test_raw_command_from_an_unrestricted_user_lands(row: RawCommand, admin: redis.Redis) -> None:
    """Without the ACL recipe a raw command is an explicit bypass: nothing fences it."""
    _seed_raw(admin)
    before = _state(admin)
    functions = admin.execute_command("FUNCTION", "LIST")
    try:
        _send(admin, row, "{wp:1}:new" if row.creates else "{wp:1}:k")
        assert _state(admin) != before or admin.execute_command("FUNCTION", "LIST") != functions
    finally:
        admin.execute_command("FUNCTION", "FLUSH")
        admin.flushall()


def test_the_app_user_reads_data_and_writes_its_own_keys(users: Users, admin: redis.Redis) -> None:
    """The recipe's positive side: reads of fenced data and writes of unfenced keys work."""
    _seed_raw(admin)
    app = redis.Redis.from_url(users.app_url)
    try:
        assert app.get("{wp:1}:k") == b"7"
        assert app.set("app:x", 1)
        assert app.incr("app:x") == 2
        with pytest.raises(NoPermissionError):
            app.get("fence:{wp:1}:key:{wp:1}:k")
    finally:
        app.close()
