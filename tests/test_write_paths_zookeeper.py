"""The ZooKeeper write-path catalogue: every way a write reaches fenced nodes, fenced or refused.

C9: every path by which a write can reach fenced storage is fenced or refused before any
I/O. Each row is one path of the guard, run for the sync and the asyncio guard, against
every kind of path, for three callers:

- unbound (no token): refused with :class:`fence.InvalidTokenError` before any I/O; a read
  lease's token (:class:`fence.ReadToken`) with :class:`fence.ReadLeaseError`, also before
  any I/O (the guard of these calls points at a port where nothing listens);
- a stale holder (token 10 under fence 20): refused as ``STALE``, every node unchanged;
- the current holder (token 25): the write lands and the node's fence ends at 25; or, for
  a path the guard must not write (under the lock manager's root, a fence node, not an
  absolute plain path, not a ``str``), refused with :class:`fence.InvalidResourceError`
  before any I/O.

A plain ``set_data`` from any other client is not fenced: ZooKeeper runs no code of ours.
The last rows show that bypass, which ``docs/consensus-guards.md`` states.
"""

from __future__ import annotations

import inspect
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

from fence import (
    InvalidResourceError,
    InvalidTokenError,
    ReadLeaseError,
    ReadToken,
    Reason,
    StaleTokenError,
    ZooKeeperLockManager,
)
from fence._zookeeper import parse_hosts
from fence.adapters.zookeeper import AsyncZooKeeperGuard, ZooKeeperGuard

pytestmark = pytest.mark.zookeeper

STALE, FENCE, CURRENT = 10, 20, 25


@dataclass(frozen=True)
class GuardPath:
    """One write path of the guard.

    Attributes:
        name: the row's name.
        call: ``(guard, path, token) -> result`` for a sync or an asyncio guard.
        landed: ``(data after, result) -> bool``: the current holder's write is in place.
        seed: whether the node holds ``b"old"`` before the call.
    """

    name: str
    call: Callable[[Any, Any, Any], Any]
    landed: Callable[[bytes | None, Any], bool]
    seed: bool = True


async def _execute(batch: Any) -> Any:
    result = batch.execute()
    return await result if inspect.isawaitable(result) else result


GUARD_PATHS = [
    GuardPath("set", lambda g, k, t: g.set(k, b"new", token=t), lambda v, _: v == b"new"),
    GuardPath(
        "set str", lambda g, k, t: g.set(k, "néw", token=t), lambda v, _: v == "néw".encode()
    ),
    GuardPath("create", lambda g, k, t: g.create(k, b"new", token=t), lambda v, _: v == b"new"),
    GuardPath(
        "create new node",
        lambda g, k, t: g.create(k, b"new", token=t),
        lambda v, _: v == b"new",
        False,
    ),
    GuardPath("delete", lambda g, k, t: g.delete(k, token=t), lambda v, r: v is None and r),
    GuardPath(
        "delete missing node",
        lambda g, k, t: g.delete(k, token=t),
        lambda v, r: v is None and r is False,
        False,
    ),
    GuardPath("claim", lambda g, k, t: g.claim(k, t), lambda v, r: v == b"old" and r == CURRENT),
    GuardPath(
        "read_for_update",
        lambda g, k, t: g.read_for_update(k, token=t),
        lambda v, r: v == b"old" and r == b"old",
    ),
    GuardPath(
        "batch set",
        lambda g, k, t: _execute(g.batch(t).set(k, b"new")),
        lambda v, r: v == b"new" and r == [True],
    ),
    GuardPath(
        "batch create",
        lambda g, k, t: _execute(g.batch(t).create(k, b"new")),
        lambda v, r: v == b"new" and r == [True],
        False,
    ),
    GuardPath(
        "batch claim and set",
        lambda g, k, t: _execute(g.batch(t).claim(k).set(k, b"new")),
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
class PathKind:
    """A kind of data path, built from the test's namespace and the manager's root."""

    name: str
    path: Callable[[str, str], Any]
    refused: bool = False


PATH_KINDS = [
    PathKind("plain", lambda ns, root: f"/{ns}/order:42"),
    PathKind("deep", lambda ns, root: f"/{ns}/a/b/c"),
    PathKind("unicode", lambda ns, root: f"/{ns}/ordré"),
    PathKind("fence node", lambda ns, root: f"/{ns}/order:42.fence", True),
    PathKind("under the root", lambda ns, root: f"{root}/order:42", True),
    PathKind("the root", lambda ns, root: root, True),
    PathKind("relative", lambda ns, root: f"{ns}/order:42", True),
    PathKind("slash", lambda ns, root: "/", True),
    PathKind("trailing slash", lambda ns, root: f"/{ns}/x/", True),
    PathKind("empty component", lambda ns, root: f"/{ns}//x", True),
    PathKind("nul", lambda ns, root: f"/{ns}/a\x00b", True),
    PathKind("dot", lambda ns, root: f"/{ns}/./x", True),
    PathKind("dot dot", lambda ns, root: f"/{ns}/../x", True),
    PathKind("ZooKeeper's own", lambda ns, root: "/zookeeper/quota", True),
    PathKind("surrogate", lambda ns, root: f"/{ns}/\udc80", True),
    PathKind("bytes", lambda ns, root: f"/{ns}/x".encode(), True),
    PathKind("int", lambda ns, root: 42, True),
]


@pytest.fixture
def admin(zookeeper_url: str) -> Iterator[KazooClient]:
    """A plain kazoo client on the ensemble."""
    hosts, _ = parse_hosts(zookeeper_url)
    client = KazooClient(hosts=hosts)
    client.start(timeout=30)
    yield client
    client.stop()
    client.close()


def _guard(flavor: str, hosts: str) -> Any:
    return (AsyncZooKeeperGuard if flavor == "asyncio" else ZooKeeperGuard)(hosts)


async def _close(guard: Any) -> None:
    closing = guard.close()
    if inspect.isawaitable(closing):
        await closing


async def _run(path: GuardPath, guard: Any, key: Any, token: Any) -> Any:
    result = path.call(guard, key, token)
    return await result if inspect.isawaitable(result) else result


def _data(admin: KazooClient, path: str) -> bytes | None:
    admin.sync(path)  # the admin's server may lag behind the guard's
    try:
        data: bytes = admin.get(path)[0]
    except NoNodeError:
        return None
    return data


def _state(admin: KazooClient, top: str) -> list[tuple[str, bytes, int]]:
    """Every node under ``top`` with its data and data version."""
    out: list[tuple[str, bytes, int]] = []
    admin.sync(top)
    data, stat = admin.get(top)
    out.append((top, data, stat.version))
    for child in sorted(admin.get_children(top)):
        out.extend(_state(admin, f"{top}/{child}"))
    return out


@pytest.mark.parametrize("kind", PATH_KINDS, ids=lambda kind: kind.name)
@pytest.mark.parametrize("path", GUARD_PATHS, ids=lambda path: path.name)
@pytest.mark.parametrize("flavor", ["sync", "asyncio"])
async def test_guard_path(
    flavor: str, path: GuardPath, kind: PathKind, admin: KazooClient, zookeeper_url: str
) -> None:
    ns = f"wp-{secrets.token_hex(4)}"
    root = "/" + zookeeper_url.rsplit("/", 1)[1]
    node = kind.path(ns, root)
    dead = _guard(flavor, "zookeeper://127.0.0.1:1" + root)
    try:
        # Unbound: no token, refused before any I/O (no connection error).
        with pytest.raises(InvalidTokenError):
            await _run(path, dead, node, None)
        # A read lease's token (C13): refused before any I/O too.
        with pytest.raises(ReadLeaseError):
            await _run(path, dead, node, ReadToken(CURRENT))
        if kind.refused:
            for token in (STALE, CURRENT):
                with pytest.raises(InvalidResourceError):
                    await _run(path, dead, node, token)
            return
    finally:
        await _close(dead)

    guard = _guard(flavor, zookeeper_url)
    try:
        fence_node = node + ".fence"
        admin.ensure_path(node.rsplit("/", 1)[0])
        if path.seed:
            admin.create(node, b"old")
        admin.create(fence_node, str(FENCE).encode())
        before = _state(admin, f"/{ns}")
        # A stale holder: refused, nothing written.
        with pytest.raises(StaleTokenError) as caught:
            await _run(path, guard, node, STALE)
        rejected = caught.value.rejected or (caught.value,)
        assert [(e.reason, e.fence) for e in rejected] == [(Reason.STALE, FENCE)]
        assert _state(admin, f"/{ns}") == before
        # The current holder: written, and the fence ends at its token.
        result = await _run(path, guard, node, CURRENT)
        assert path.landed(_data(admin, node), result)
        assert _data(admin, fence_node) == str(CURRENT).encode()
    finally:
        await _close(guard)


def test_a_plain_set_data_from_another_client_is_not_fenced(
    admin: KazooClient, zookeeper_url: str
) -> None:
    """The documented bypass: ZooKeeper runs no code of ours, so a write that does not go
    through the guard lands whatever the fence; the fence node itself stays."""
    node = f"/wp-{secrets.token_hex(4)}/raw"
    with ZooKeeperGuard(zookeeper_url) as guard:
        guard.create(node, b"guarded", token=FENCE)
        admin.set(node, b"raw")
        guard.driver._client.sync(node)
        assert guard.get(node) == (b"raw", FENCE)


def test_the_manager_and_the_guard_share_a_session(zookeeper_url: str) -> None:
    with ZooKeeperLockManager(zookeeper_url, ttl=5) as manager:
        guard = ZooKeeperGuard(manager)
        assert guard.driver is manager.driver
        assert guard.root == manager.driver.root
        with pytest.raises(InvalidResourceError):
            guard.set(manager.driver.root + "/x", b"v", token=1)
        node = f"/wp-{secrets.token_hex(4)}/orders/42"
        with manager.lock("order:42") as lease:
            guard.claim(node, lease.token)
            guard.create(node, b"paid", token=lease.token)
        guard.close()  # the manager's session stays open
        assert guard.get(node) == (b"paid", lease.token)
