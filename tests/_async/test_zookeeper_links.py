"""The ZooKeeper manager when the link to the ensemble breaks: no orphan lock node, and
every call ends at its caller's deadline.

A proxy (``tests/proxy_zookeeper.py``) stands between the manager under test and one
server of the session's ensemble; the holders it waits for and the reads that count the
nodes of a queue go straight to the ensemble. Each fault leaves a contender dead or cut
off, and the test checks that its node is gone within its ttl (the managers here ask for
a session as long as the ttl, the bound a cut-off contender's node has):

- a join (the multi-operation that creates the contender's node) whose reply is lost with
  the connection while the session survives, on a free lock and behind a holder, for
  writers and readers: the contender finds its own node and goes on with it, and leaves
  one node, not two;
- the same with the link down until the acquire gives up: the node goes once the link is
  back;
- a join whose reply comes after the acquire timed out;
- a frozen link: ``acquire(timeout=t)`` returns within ``t`` and its margin, and a
  renewal ends at the lease's deadline, whatever ``request_timeout`` says;
- a contender process killed (``SIGKILL``), holding or waiting: its node goes with its
  session.

A task cancelled inside the join is in ``tests/test_manager_cancellation.py`` (asyncio
only). The sync twin in ``tests/_sync`` runs the same with threads.

Bounds, all generous for a loaded 2-core machine: a call returns within its timeout and
:data:`SLACK` (the manager's margin and 1.5 s); a node is gone within the ttl of its lease
once the link is back; a dead process's node within its session timeout and 3 s (ZooKeeper
expires sessions a tick late, the JVM may be descheduled, the waiter's wake-up is a round
trip).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
from tests._acompat import join, sleep, spawn
from tests.proxy_zookeeper import MULTI, SET_DATA, ZooKeeperProxy
from tests.servers import ZooKeeperEnsemble
from tests.stalls import StallMeter

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
    """Run ``fn``; return (its result or the exception it raised, seconds).

    The seconds leave out the time the machine kept this process from running
    (:class:`tests.stalls.StallMeter`): a loaded machine is no fault of the manager."""
    with StallMeter() as stalled:
        start = time.monotonic()
        try:
            outcome = await fn()
        except Exception as exc:
            outcome = exc
        elapsed = time.monotonic() - start
    return outcome, elapsed - stalled.seconds


async def warm(manager: AsyncZooKeeperLockManager, resource: str) -> None:
    """Connect ``manager`` and create the resource's node, so that the next acquire's
    first write is its join."""
    lease = await manager.acquire(resource, timeout=10)
    await lease.release()


# -- a join whose reply is lost with the connection ---------------------------------------


@pytest.mark.parametrize("mode", ["write", "read"])
async def test_join_reply_lost_on_a_free_lock(rig: Rig, mode: str) -> None:
    """The join's reply is dropped and its connection closed; the session survives. The
    contender finds its own node (named by its guid) instead of creating a second one,
    takes the lock with it, and leaves nothing once it releases."""
    manager = rig.manager()
    rig.proxy.drop_reply(MULTI)
    lease = await manager.acquire("free", mode=mode, timeout=10)
    assert rig.proxy.dropped == [MULTI]
    nodes = rig.queue("free")
    assert len(nodes) == 1, nodes
    assert lease.token == rig.czxid("free", nodes[0])
    await lease.release()
    assert rig.queue("free") == []


@pytest.mark.parametrize("mode", ["write", "read"])
async def test_join_reply_lost_behind_a_holder(rig: Rig, mode: str) -> None:
    """The same for a contender that has to wait (a writer holds the lock): it waits with
    the node it found, gets the lock when the holder releases, and leaves nothing."""
    holder = rig.manager(direct=True, ttl=30.0)
    held = await holder.acquire("busy")
    waiter = rig.manager()
    rig.proxy.drop_reply(MULTI)
    task = await spawn(lambda: waiter.acquire("busy", mode=mode, timeout=15))
    await rig.until(lambda: rig.proxy.dropped and rig.proxy.connections >= 2, 10, "reply drop")
    await sleep(0.5)  # the waiter is back on the link, looking at the queue
    await held.release()
    lease = await join(task)
    nodes = rig.queue("busy")
    assert len(nodes) == 1, nodes
    assert lease.token == rig.czxid("busy", nodes[0])
    await lease.release()
    assert rig.queue("busy") == []


async def test_join_reply_lost_and_link_down_until_the_acquire_gives_up(rig: Rig) -> None:
    """The join's reply is dropped and the link stays down: the acquire raises within its
    timeout; the node the join made goes once the link is back, within the ttl."""
    manager = rig.manager()
    await warm(manager, "cut")
    rig.proxy.drop_reply(MULTI, then_freeze=True)
    outcome, took = await timed(lambda: manager.acquire("cut", timeout=1))
    assert isinstance(outcome, BackendError), outcome
    assert outcome.retryable
    assert took < 1 + SLACK, f"acquire(timeout=1) took {took:.2f} s"
    assert rig.proxy.dropped == [MULTI]
    assert len(rig.queue("cut")) == 1  # the join landed; nobody knows its name
    rig.proxy.thaw()
    await rig.emptied("cut", within=TTL)
    lease = await manager.acquire("cut", timeout=10)
    await lease.release()


async def test_join_reply_late_after_the_acquire_timed_out(rig: Rig) -> None:
    """The join reached the ensemble and its reply is held (the link frozen): the acquire
    raises within its timeout; when the reply comes, the node goes, within the ttl."""
    manager = rig.manager()
    await warm(manager, "late")
    rig.proxy.hold_reply(MULTI)
    outcome, took = await timed(lambda: manager.acquire("late", timeout=1))
    assert isinstance(outcome, BackendError), outcome
    assert took < 1 + SLACK, f"acquire(timeout=1) took {took:.2f} s"
    assert rig.proxy.held == [MULTI]
    assert len(rig.queue("late")) == 1
    rig.proxy.thaw()
    await rig.emptied("late", within=TTL)


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


# -- a reply kazoo cannot pair with its request ------------------------------------------------


# kazoo's connection thread ends with the RuntimeError: that is the fault under test.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
async def test_a_reply_out_of_order_ends_kazoo_s_connection_and_the_manager_resumes(
    rig: Rig,
) -> None:
    """The renewal's reply comes back with another request's xid (a server answering out
    of order, ZOOKEEPER-1863): kazoo's connection thread raises ``RuntimeError('xids do
    not match')`` and ends, and on its own the client would never connect again. The
    manager starts it again on the same session: the renewal, cut off like one whose
    connection dropped, is sent again and holds; the lease stays this manager's; and the
    next calls are served."""
    manager = rig.manager(ttl=30.0, session_timeout=30.0)
    lease = await manager.acquire("garbled", timeout=10)
    session = manager.driver._client.client_id
    first = manager.driver._client._connection._connection_routine
    rig.proxy.garble_reply(SET_DATA)
    await lease.renew(30.0)  # raises if the lease is lost
    assert rig.proxy.garbled == [SET_DATA]
    assert not first.is_alive()  # the fault did end kazoo's connection thread
    assert manager.driver._client.client_id == session  # resumed, not a new session
    assert not lease.lost
    held = await manager.inspect("garbled")
    assert held is not None
    assert held.token == lease.token  # still this lease's lock
    await lease.release()
    assert rig.queue("garbled") == []
    again = await manager.acquire("garbled:next", timeout=10)
    await again.release()


# -- a contender process killed ------------------------------------------------------------


def start_contender(rig: Rig, resource: str, ttl: float) -> subprocess.Popen[str]:
    """A contender in a process of its own (``tests/consensus_holder.py``), straight to the
    ensemble, with a session of ``max(ttl, 4)`` seconds."""
    return subprocess.Popen(
        [sys.executable, "-m", "tests.consensus_holder", "zookeeper", rig.url(direct=True),
         resource, str(ttl)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        cwd=ROOT,
    )  # fmt: skip


def stop(child: subprocess.Popen[str]) -> None:
    if child.poll() is None:
        child.kill()
    child.wait(10)
    if child.stdout is not None:
        child.stdout.close()


async def test_killed_holder_s_node_goes_with_its_session(rig: Rig) -> None:
    """A holder process killed (``SIGKILL``): its node goes when its session expires, and
    a waiter gets the lock then, with a larger token."""
    child = start_contender(rig, "killed", 4.0)
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line, "the holder process failed"
        acquired = json.loads(line)
        child.kill()
        killed_at = time.monotonic()
        waiter = rig.manager(direct=True)
        lease = await waiter.acquire("killed", timeout=30)
        took = time.monotonic() - killed_at
        assert lease.token > acquired["token"]
        assert took < 4.0 + EXPIRY_SLACK, f"the dead holder's node lasted {took:.2f} s"
        await lease.release()
    finally:
        stop(child)


async def test_killed_waiter_s_node_goes_with_its_session(rig: Rig) -> None:
    """A waiter process killed (``SIGKILL``) while queued: when the holder releases, the
    dead waiter's node comes first, and goes when its session expires."""
    holder = rig.manager(direct=True, ttl=30.0)
    held = await holder.acquire("queued")
    child = start_contender(rig, "queued", 4.0)
    try:
        await rig.until(lambda: len(rig.queue("queued")) == 2, 30, "the waiter process queued")
        child.kill()
        killed_at = time.monotonic()
        await held.release()
        other = rig.manager(direct=True)
        lease = await other.acquire("queued", timeout=30)
        took = time.monotonic() - killed_at
        assert took < 4.0 + EXPIRY_SLACK, f"the dead waiter's node lasted {took:.2f} s"
        await lease.release()
        assert rig.queue("queued") == []
    finally:
        stop(child)
