"""The etcd write-path catalogue: every way a write reaches fenced etcd keys, fenced or refused.

C9: every path by which a write can reach fenced storage is fenced or refused before any
I/O. Each row is one path of the guard, run for the sync and the asyncio guard, against
every kind of key, for three callers:

- unbound (no token): refused with :class:`fence.InvalidTokenError` before any I/O; a read
  lease's token (:class:`fence.ReadToken`) with :class:`fence.ReadLeaseError`, also before
  any I/O (the guard of these calls points at a port where nothing listens);
- a stale holder (token 10 under fence 20): refused as ``STALE``, data and fence unchanged;
- the current holder (token 25): the write lands and the key's fence ends at 25; or, for a
  key the guard must not write (under the prefix: the lock manager's keys, the fences;
  empty; with a NUL; not a ``str``), refused with :class:`fence.InvalidResourceError`
  before any I/O.

A plain put from any other client is not fenced: etcd runs no code of ours. The last row
shows that bypass, which ``docs/consensus-guards.md`` states.
"""

from __future__ import annotations

import inspect
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from fence import (
    EtcdLockManager,
    InvalidResourceError,
    InvalidTokenError,
    ReadLeaseError,
    ReadToken,
    Reason,
    StaleTokenError,
)
from fence._etcd import b64, range_kvs
from fence.adapters.etcd import AsyncEtcdGuard, EtcdGuard, encode_fence

pytestmark = pytest.mark.etcd

STALE, FENCE, CURRENT = 10, 20, 25


@dataclass(frozen=True)
class GuardPath:
    """One write path of the guard.

    Attributes:
        name: the row's name.
        call: ``(guard, key, token) -> result`` for a sync or an asyncio guard.
        seed: whether the key holds ``b"old"`` before the call.
        landed: ``(value after, result) -> bool``: the current holder's write is in place.
    """

    name: str
    call: Callable[[Any, Any, Any], Any]
    landed: Callable[[bytes | None, Any], bool]
    seed: bool = True


async def _execute(batch: Any) -> Any:
    result = batch.execute()
    return await result if inspect.isawaitable(result) else result


GUARD_PATHS = [
    GuardPath("put", lambda g, k, t: g.put(k, b"new", token=t), lambda v, _: v == b"new"),
    GuardPath(
        "put str",
        lambda g, k, t: g.put(k, "néw", token=t),
        lambda v, _: v == "néw".encode(),
    ),
    GuardPath(
        "put must_exist",
        lambda g, k, t: g.put(k, b"new", token=t, must_exist=True),
        lambda v, _: v == b"new",
    ),
    GuardPath(
        "put new key", lambda g, k, t: g.put(k, b"new", token=t), lambda v, _: v == b"new", False
    ),
    GuardPath("delete", lambda g, k, t: g.delete(k, token=t), lambda v, r: v is None and r),
    GuardPath("claim", lambda g, k, t: g.claim(k, t), lambda v, r: v == b"old" and r == CURRENT),
    GuardPath(
        "read_for_update",
        lambda g, k, t: g.read_for_update(k, token=t),
        lambda v, r: v == b"old" and r == b"old",
    ),
    GuardPath(
        "batch put",
        lambda g, k, t: _execute(g.batch(t).put(k, b"new")),
        lambda v, r: v == b"new" and r == [True],
    ),
    GuardPath(
        "batch put and claim",
        lambda g, k, t: _execute(g.batch(t).claim(k).put(k, b"new")),
        lambda v, r: v == b"new" and r == [True, True],
    ),
    GuardPath(
        "batch delete",
        lambda g, k, t: _execute(g.batch(t).delete(k)),
        lambda v, r: v is None and r == [True],
    ),
    GuardPath(
        "batch claim",
        lambda g, k, t: _execute(g.batch(t).claim(k)),
        lambda v, r: v == b"old" and r == [True],
    ),
]


@dataclass(frozen=True)
class KeyKind:
    """A kind of data key; ``None`` as ``key`` is built from the test's namespace."""

    name: str
    key: Callable[[str, str], Any]
    refused: bool = False


KEY_KINDS = [
    KeyKind("plain", lambda ns, prefix: f"{ns}/order:42"),
    KeyKind("unicode", lambda ns, prefix: f"{ns}/ordré/42"),
    KeyKind("fence key", lambda ns, prefix: f"{prefix}guard/{ns}/order:42", True),
    KeyKind("manager key", lambda ns, prefix: f"{prefix}order:42", True),
    KeyKind("the prefix", lambda ns, prefix: prefix, True),
    KeyKind("empty", lambda ns, prefix: "", True),
    KeyKind("nul", lambda ns, prefix: f"{ns}/a\x00b", True),
    KeyKind("surrogate", lambda ns, prefix: f"{ns}/\udc80", True),
    KeyKind("bytes", lambda ns, prefix: f"{ns}/order:42".encode(), True),
    KeyKind("int", lambda ns, prefix: 42, True),
]


@pytest.fixture
def admin(etcd_url: str) -> Iterator[EtcdGuard]:
    """A guard whose driver reads and writes the cluster directly."""
    guard = EtcdGuard(etcd_url)
    yield guard
    guard.close()


def _guard(flavor: str, endpoints: str) -> Any:
    return (AsyncEtcdGuard if flavor == "asyncio" else EtcdGuard)(endpoints)


async def _close(guard: Any) -> None:
    closing = guard.close()
    if inspect.isawaitable(closing):
        await closing


async def _run(path: GuardPath, guard: Any, key: Any, token: Any) -> Any:
    result = path.call(guard, key, token)
    return await result if inspect.isawaitable(result) else result


def _raw_put(admin: EtcdGuard, key: bytes, value: bytes) -> None:
    admin.driver._call("/v3/kv/put", {"key": b64(key), "value": b64(value)}, "seed", safe=True)


def _raw_get(admin: EtcdGuard, key: bytes) -> bytes | None:
    kvs, _ = range_kvs(admin.driver._call("/v3/kv/range", {"key": b64(key)}, "read", safe=True))
    return kvs[0].value if kvs else None


def _state(admin: EtcdGuard) -> list[tuple[bytes, bytes, int]]:
    """Every key of the cluster with its value and modification revision."""
    body = {"key": b64(b"\x00"), "range_end": b64(b"\x00")}
    kvs = admin.driver._call("/v3/kv/range", body, "state", safe=True).get("kvs", ())
    return [(kv["key"], kv.get("value", ""), int(kv["mod_revision"])) for kv in kvs]


@pytest.mark.parametrize("kind", KEY_KINDS, ids=lambda kind: kind.name)
@pytest.mark.parametrize("path", GUARD_PATHS, ids=lambda path: path.name)
@pytest.mark.parametrize("flavor", ["sync", "asyncio"])
async def test_guard_path(
    flavor: str, path: GuardPath, kind: KeyKind, admin: EtcdGuard, etcd_url: str
) -> None:
    prefix = admin.prefix
    key = kind.key(f"wp-{secrets.token_hex(4)}", prefix)
    dead = _guard(flavor, "etcd://127.0.0.1:1/" + prefix)
    try:
        # Unbound: no token, refused before any I/O (no connection error).
        with pytest.raises(InvalidTokenError):
            await _run(path, dead, key, None)
        # A read lease's token (C13): refused before any I/O too.
        with pytest.raises(ReadLeaseError):
            await _run(path, dead, key, ReadToken(CURRENT))
        if kind.refused:
            for token in (STALE, CURRENT):
                with pytest.raises(InvalidResourceError):
                    await _run(path, dead, key, token)
            return
    finally:
        await _close(dead)

    guard = _guard(flavor, etcd_url)
    try:
        wire = guard.layout.data_key(key)
        fence_key = guard.layout.fence_key(wire)
        if path.seed:
            _raw_put(admin, wire, b"old")
        _raw_put(admin, fence_key, encode_fence(FENCE))
        before = _state(admin)
        # A stale holder: refused, nothing written.
        with pytest.raises(StaleTokenError) as caught:
            await _run(path, guard, key, STALE)
        rejected = caught.value.rejected or (caught.value,)
        assert [(e.reason, e.fence) for e in rejected] == [(Reason.STALE, FENCE)]
        assert _state(admin) == before
        # The current holder: written, and the fence ends at its token.
        result = await _run(path, guard, key, CURRENT)
        assert path.landed(_raw_get(admin, wire), result)
        assert _raw_get(admin, fence_key) == encode_fence(CURRENT)
    finally:
        await _close(guard)


def test_a_plain_put_from_another_client_is_not_fenced(admin: EtcdGuard, etcd_url: str) -> None:
    """The documented bypass: etcd runs no code of ours, so a put that does not go through
    the guard lands whatever the fence; the fence itself stays."""
    key = f"wp-{secrets.token_hex(4)}/raw"
    admin.put(key, b"guarded", token=FENCE)
    _raw_put(admin, key.encode(), b"raw")
    assert admin.get(key) == (b"raw", FENCE)


def test_the_manager_and_the_guard_share_a_client(etcd_url: str) -> None:
    with EtcdLockManager(etcd_url, ttl=5) as manager:
        guard = EtcdGuard(manager)
        assert guard.driver is manager.driver
        assert guard.prefix == manager.driver.prefix
        with pytest.raises(InvalidResourceError):
            guard.put(manager.driver.prefix + "x", b"v", token=1)
        key = f"wp-{secrets.token_hex(4)}/orders/42"
        with manager.lock("order:42") as lease:
            guard.claim(key, lease.token)
            guard.put(key, b"paid", token=lease.token)
        guard.close()  # the manager's client stays open
        assert guard.get(key) == (b"paid", lease.token)
