"""The ZooKeeper manager when the link to the ensemble freezes: every call ends at its
caller's deadline.

A proxy (``tests/proxy_zookeeper.py``) stands between the manager under test and one
server of the session's ensemble; the reads that count the nodes of a queue go straight
to the ensemble. On a frozen link (every byte held both ways, the sockets open),
``acquire(timeout=t)`` returns within ``t`` and its margin, and a renewal ends at the
lease's deadline, whatever ``request_timeout`` says. The sync twin in ``tests/_sync``
runs the same with threads.

The bound is generous for a loaded 2-core machine: a call returns within its timeout and
:data:`SLACK` (the manager's margin and 1.5 s).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

from fence import BackendError
from fence._async.manager import UNDO_LIMIT
from fence._async.zookeeper import AsyncZooKeeperLockManager
from fence._zookeeper import queue_order, resource_path
from tests._acompat import sleep
from tests.proxy_zookeeper import ZooKeeperProxy
from tests.servers import ZooKeeperEnsemble

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent.parent

#: How far past its timeout a call may return: the manager's margin and room for load.
SLACK = UNDO_LIMIT + 1.5

#: The lease time of the managers under test; their session is as long.
TTL = 5.0

#: What a dead process's node may take beyond its session timeout (see the module's doc).
EXPIRY_SLACK = 3.0


@dataclass
class Rig:
    """The ensemble, the proxy in front of one of its servers, and a client that reads
    the queues straight from the ensemble."""

    ensemble: ZooKeeperEnsemble
    proxy: ZooKeeperProxy
    root: str
    observer: KazooClient
    built: list[AsyncZooKeeperLockManager] = field(default_factory=list)

    def url(self, *, direct: bool = False) -> str:
        hosts = self.ensemble.hosts if direct else self.proxy.hosts
        return f"zookeeper://{hosts}{self.root}"

    def manager(self, *, direct: bool = False, **options: Any) -> AsyncZooKeeperLockManager:
        """A manager through the proxy (or straight to the ensemble); ``request_timeout``
        is 5 s unless given, so that only the caller's deadline can end a call sooner."""
        options.setdefault("ttl", TTL)
        options.setdefault("session_timeout", max(options["ttl"], 4.0))
        options.setdefault("request_timeout", 5.0)
        manager = AsyncZooKeeperLockManager(self.url(direct=direct), **options)
        self.built.append(manager)
        return manager

    def path(self, resource: str) -> str:
        return resource_path(self.root, resource)

    def queue(self, resource: str) -> list[str]:
        """The resource's lock nodes, as the leader has them (a sync first)."""
        path = self.path(resource)
        try:
            self.observer.sync(path)
            return queue_order(self.observer.get_children(path))
        except NoNodeError:
            return []

    def czxid(self, resource: str, name: str) -> int:
        _, stat = self.observer.get(f"{self.path(resource)}/{name}")
        return int(stat.czxid)

    async def until(self, condition: Callable[[], object], within: float, what: str) -> float:
        """Wait until ``condition()`` holds; return how long that took."""
        start = time.monotonic()
        while not condition():
            assert time.monotonic() - start < within, f"{what}: not within {within:g} s"
            await sleep(0.05)
        return time.monotonic() - start

    async def emptied(self, resource: str, within: float) -> float:
        """Wait until the resource's queue is empty; return how long that took."""
        return await self.until(
            lambda: not self.queue(resource), within, f"nodes of {resource!r} left"
        )


@pytest.fixture
async def rig(
    zookeeper_ensemble: ZooKeeperEnsemble, zookeeper_url: str, zookeeper_proxy: ZooKeeperProxy
) -> AsyncIterator[Rig]:
    observer = KazooClient(hosts=zookeeper_ensemble.hosts)
    observer.start(timeout=15)
    found = Rig(zookeeper_ensemble, zookeeper_proxy, "/" + zookeeper_url.split("/", 3)[3], observer)
    try:
        yield found
    finally:
        zookeeper_proxy.thaw()
        for manager in found.built:
            await manager.close()
        observer.stop()
        observer.close()


async def timed(fn: Callable[[], Awaitable[Any]]) -> tuple[Any, float]:
    """Run ``fn``; return (its result or the exception it raised, seconds)."""
    start = time.monotonic()
    try:
        outcome = await fn()
    except Exception as exc:
        outcome = exc
    return outcome, time.monotonic() - start


async def warm(manager: AsyncZooKeeperLockManager, resource: str) -> None:
    """Connect ``manager`` and create the resource's node, so that the next acquire's
    first write is its join."""
    lease = await manager.acquire(resource, timeout=10)
    await lease.release()


# -- a frozen link ---------------------------------------------------------------------------


async def test_frozen_link_acquire_returns_within_its_timeout(rig: Rig) -> None:
    """Every byte held both ways (the sockets stay open): ``acquire(timeout=0.5)`` raises
    within its timeout and margin, not after ``request_timeout`` (5 s)."""
    manager = rig.manager(ttl=30.0, session_timeout=30.0)
    await warm(manager, "frozen")
    rig.proxy.freeze()
    outcome, took = await timed(lambda: manager.acquire("frozen", timeout=0.5))
    assert isinstance(outcome, BackendError), outcome
    assert took < 0.5 + SLACK, f"acquire(timeout=0.5) took {took:.2f} s on a frozen link"
    rig.proxy.thaw()
    lease = await manager.acquire("frozen", timeout=10)
    await lease.release()
    assert rig.queue("frozen") == []


async def test_frozen_link_renewal_ends_at_the_lease_deadline(rig: Rig) -> None:
    """The watchdog's renewal on a frozen link gives up at the lease's deadline, and the
    lease is reported lost then, not after ``request_timeout`` (20 s here)."""
    manager = rig.manager(ttl=6.0, request_timeout=20.0)
    lost: list[float] = []
    lease = await manager.acquire(
        "renewed", renew=True, on_lost=lambda lease, err: lost.append(time.monotonic())
    )
    rig.proxy.freeze()
    await rig.until(lambda: lost, lease.ttl + 30, "the lost-lease callback")
    late = lost[0] - lease.deadline
    assert late < SLACK, f"the lease was reported lost {late:.2f} s after its deadline"
