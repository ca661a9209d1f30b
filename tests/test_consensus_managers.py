"""What only the etcd and ZooKeeper managers have: their queues, revoke, sessions, layout.

The contract itself is in the conformance suite (``tests/backend_etcd.py``,
``tests/backend_zookeeper.py``); the faults in ``tests/test_consensus_faults.py``.
"""

from __future__ import annotations

import base64
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from kazoo.client import KazooClient

from fence import AcquireTimeout, ConfigurationError, InvalidTokenError, NotOwnerError
from fence._etcd import (
    lease_id,
    lease_seconds,
    parse_endpoints,
    queue_prefix,
    range_end,
    token_of,
)
from fence._queue import Place, owner_after_predecessor_left, place_in
from fence._sync.etcd import EtcdLockManager
from fence._sync.manager import BaseLockManager
from fence._sync.zookeeper import ZooKeeperLockManager
from fence._zookeeper import (
    SessionTimeoutProbe,
    decode_data,
    encode_data,
    new_guid,
    own_node,
    parse_hosts,
    queue_order,
    resource_path,
)
from fence._zookeeper import token_of as zxid_token
from tests.servers import EtcdCluster, ZooKeeperEnsemble

# -- the plain modules -------------------------------------------------------------------------


def test_etcd_lease_outlasts_the_ttl_in_whole_seconds() -> None:
    assert lease_seconds(0.4) == 2
    assert lease_seconds(5) == 6
    assert lease_seconds(5.01) == 7
    for ttl in (0.001, 0.5, 1, 1.5, 29.99, 30):
        # etcd reports what is left rounded down: a second on top keeps it above the ttl.
        assert lease_seconds(ttl) - 1 >= ttl


def test_etcd_lease_ids_come_from_the_secret() -> None:
    a = lease_id("secret-a", "r")
    assert a == lease_id("secret-a", "r")
    assert a != lease_id("secret-b", "r")
    assert a != lease_id("secret-a", "r2")
    assert 1 <= a < 2**63


def test_etcd_ranges_of_resources_never_overlap() -> None:
    short, longer = queue_prefix("fence/", "order:4"), queue_prefix("fence/", "order:42")
    assert not (short <= longer < range_end(short))
    assert short <= short + b"0123456789abcdef" < range_end(short)


def test_etcd_endpoints_from_urls_and_lists() -> None:
    assert parse_endpoints("etcd://a:1,b:2") == (["http://a:1", "http://b:2"], None)
    assert parse_endpoints("etcds://a:1/app/locks") == (["https://a:1"], "app/locks/")
    assert parse_endpoints(["a:1", "http://b:2/"]) == (["http://a:1", "http://b:2"], None)
    for bad in ("redis://a:1", "etcd://", [""]):
        with pytest.raises(ConfigurationError):
            parse_endpoints(bad)


def test_tokens_beyond_the_double_precision_bound_are_refused() -> None:
    assert token_of(2**53 - 1) == 2**53 - 1
    assert zxid_token(0x100000004) == 0x100000004
    for bad in (0, 2**53):
        with pytest.raises(InvalidTokenError):
            token_of(bad)
        with pytest.raises(InvalidTokenError):
            zxid_token(bad)


def test_zookeeper_layout() -> None:
    assert resource_path("/fence", "order:42/a b") == "/fence/order%3A42%2Fa%20b"
    assert resource_path("/fence", "..") == "/fence/%2E%2E"
    guid = new_guid()
    assert len(guid) == 16
    assert guid != new_guid()
    names = [f"{guid}-lock-0000000012", "x-lock-0000000003", "junk", "y-lock-12"]
    assert queue_order(names) == ["x-lock-0000000003", f"{guid}-lock-0000000012"]
    # A join whose reply was lost finds its node by its guid and mark, and nothing else.
    assert own_node(names, guid, "-lock-") == f"{guid}-lock-0000000012"
    assert own_node(names, guid, "-read-") is None
    assert own_node([*names, f"{guid}-lock-12"], "y", "-lock-") is None
    assert decode_data(encode_data("host:1:t", 2.5)) == ("host:1:t", 2.5)
    assert decode_data(b"\xff") == (None, None)
    assert parse_hosts("zookeeper://a:1,b:2/app") == ("a:1,b:2", "/app")
    assert parse_hosts("zookeeper://a:1/") == ("a:1", None)
    assert parse_hosts(["a:1", "b:2"]) == ("a:1,b:2", None)
    for bad in ("zookeeper://", "etcd://a:1", "zk://a:1/x//y"):
        with pytest.raises(ConfigurationError):
            parse_hosts(bad)


def test_queue_places() -> None:
    assert place_in([3, 5, 9], 3) == Place(0, None)
    second = place_in([3, 5, 9], 5)
    third = place_in([3, 5, 9], 9)
    assert second is not None
    assert third is not None
    assert owner_after_predecessor_left(second)  # 3 owned the lock: 5 owns it now
    assert not owner_after_predecessor_left(third)  # 5 was a waiter: 9 must look again
    assert place_in([3, 5], 4) is None


def test_session_probe_reads_kazoo_s_line_and_drops_its_chatter() -> None:
    probe = SessionTimeoutProbe()
    line = logging.LogRecord(
        "kazoo",
        5,
        __file__,
        1,
        "Session created, session_id: %r session_passwd: %s\n"
        "    negotiated session timeout: %s\n    connect timeout: %s\n    read timeout: %s",
        (1, "ab", 4000, 1333.3, 2666.6),
        None,
    )
    assert probe.filter(line) is False
    assert probe.granted == 4.0
    warning = logging.LogRecord("kazoo", logging.WARNING, __file__, 1, "dropped", (), None)
    assert probe.filter(warning) is True


# -- on the real clusters ------------------------------------------------------------------


@dataclass
class Backend:
    """One backend on its session cluster, with a prefix of the test's own."""

    kind: str
    url: str
    cluster: EtcdCluster | ZooKeeperEnsemble
    built: list[BaseLockManager] = field(default_factory=list)

    def manager(self, **options: Any) -> BaseLockManager:
        cls = EtcdLockManager if self.kind == "etcd" else ZooKeeperLockManager
        manager: BaseLockManager = cls(self.url, **options)
        self.built.append(manager)
        return manager

    def queue_length(self, resource: str) -> int:
        """How many entries the resource's queue has, read straight from the cluster."""
        path = self.url.split("/", 3)[3]
        if isinstance(self.cluster, EtcdCluster):
            start = queue_prefix(path, resource)
            reply = httpx.post(
                f"http://{self.cluster.endpoints[0]}/v3/kv/range",
                json={
                    "key": base64.b64encode(start).decode(),
                    "range_end": base64.b64encode(range_end(start)).decode(),
                    "count_only": True,
                },
            ).json()
            return int(reply.get("count", 0))
        client = KazooClient(hosts=self.cluster.hosts)
        client.start(timeout=10)
        try:
            node = resource_path("/" + path, resource)
            # Through the leader first: the server this client reached may lag behind the
            # one the manager writes through.
            client.sync(node)
            return len(queue_order(client.get_children(node)))
        finally:
            client.stop()
            client.close()


def until(condition: Callable[[], object], what: str, seconds: float = 30.0) -> None:
    """Poll ``condition`` until it holds; fail after ``seconds``."""
    end = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < end, f"gave up waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(params=["etcd", "zookeeper"])
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    kind = request.param
    url = request.getfixturevalue(f"{kind}_url")
    cluster = request.getfixturevalue("etcd_cluster" if kind == "etcd" else "zookeeper_ensemble")
    found = Backend(kind, url, cluster)
    yield found
    for manager in found.built:
        manager.close()


def test_failed_try_leaves_no_entry_in_the_queue(backend: Backend) -> None:
    """A try_acquire that joined the queue and lost takes its entry out again: the manager
    calls the driver's abandon hook for a queued attempt that does not wait."""
    holder, other = backend.manager(), backend.manager()
    lease = holder.acquire("try")
    for _ in range(3):
        assert other.try_acquire("try") is None
    assert backend.queue_length("try") == 1
    lease.release()
    assert backend.queue_length("try") == 0


def test_timed_out_waiter_leaves_no_entry_in_the_queue(backend: Backend) -> None:
    """An acquire that timed out while it waited in the queue behind a holder takes its
    entry out (etcd: it revokes its lease; ZooKeeper: it deletes its node) as it gives
    up, not when its lease or session ends (30 s here): the contender that comes next is
    first behind the holder, and gets the lock as soon as the holder releases (10 s is
    room for a loaded machine, a third of the lease)."""
    holder, waiter = backend.manager(ttl=30), backend.manager(ttl=30)
    lease = holder.acquire("timed-out")
    outcome: list[BaseException] = []
    # The queue's length, read while the waiter waits in it: its entry cannot go before
    # its wait returns (polled from outside, the entry's 2 s could pass unseen).
    queued: list[int] = []
    wait_in_queue = waiter.driver.wait

    def counted_wait(resource: str, timeout: float, reply: Any) -> None:
        if not queued:
            queued.append(backend.queue_length(resource))
        wait_in_queue(resource, timeout, reply)

    waiter.driver.wait = counted_wait

    def wait() -> None:
        try:
            waiter.acquire("timed-out", timeout=2)
        except AcquireTimeout as exc:
            outcome.append(exc)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    thread.join(60)
    assert len(outcome) == 1, outcome
    assert queued == [2]  # the holder's entry and the waiter's
    until(lambda: backend.queue_length("timed-out") == 1, "the entry to go", seconds=10)
    lease.release()
    released = time.monotonic()
    again = waiter.acquire("timed-out", timeout=30)
    took = time.monotonic() - released
    again.release()
    assert took < 10.0, f"granted {took:.2f} s after the release"


def test_waiters_are_served_in_arrival_order(backend: Backend) -> None:
    holder = backend.manager()
    lease = holder.acquire("fifo")
    order: list[str] = []
    threads = []
    for name in ("first", "second", "third"):
        manager = backend.manager()

        def wait(name: str = name, manager: BaseLockManager = manager) -> None:
            got = manager.acquire("fifo", timeout=30)
            order.append(name)
            got.release()

        thread = threading.Thread(target=wait, daemon=True)
        thread.start()
        threads.append(thread)
        # each is queued before the next arrives (the queue only grows until the release)
        queued = len(threads) + 1  # the holder's entry and each waiter's
        until(lambda q=queued: backend.queue_length("fifo") == q, f"{name} queued")
    lease.release()
    for thread in threads:
        thread.join(30)
    assert order == ["first", "second", "third"]


def test_revoke_ends_every_lease_below_its_token(backend: Backend) -> None:
    """A waiter queued before a revoke never holds a live lease with a token below the
    revoke's once the revoke returned: either it joins again and gets a token above it,
    or (etcd, which revokes lease by lease) it was granted while the revoke ran, and the
    revoke ended its lease too, or it released that lease before the revoke returned."""
    holder, waiter = backend.manager(), backend.manager()
    hung = holder.acquire("revoke", ttl=30)
    got: dict[str, Any] = {}

    def wait() -> None:
        lease = waiter.acquire("revoke", timeout=30)
        got["token"] = lease.token
        try:
            lease.release()
            got["released"] = True
        except NotOwnerError:
            got["released"] = False
        got["done"] = time.monotonic()

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    time.sleep(0.5)  # queued behind the hung holder
    revoked = holder.revoke("revoke")
    returned = time.monotonic()
    thread.join(30)
    assert revoked > hung.token
    # A release that went through after the revoke returned would be a live lease below it.
    # (Client clocks cannot order a release inside the revoke reply's flight; the queue
    # model, tests/test_queue_model.py, checks the order of revoke and grants.)
    assert got["token"] > revoked or not got["released"] or got["done"] < returned, got
    after = waiter.acquire("revoke", timeout=10)
    assert after.token > revoked
    after.release()


def test_zookeeper_refuses_a_lease_longer_than_the_granted_session(
    zookeeper_url: str,
) -> None:
    # The ensemble grants at most 120 s (maxSessionTimeout), whatever is asked.
    manager = ZooKeeperLockManager(zookeeper_url, ttl=5, session_timeout=300)
    try:
        manager.acquire("short").release()
        assert manager.driver.granted_session_timeout == 120.0
        with pytest.raises(ConfigurationError, match="longer than the ZooKeeper session"):
            manager.acquire("long", ttl=150)
        assert manager.inspect("long") is None  # refused before the lock was touched
    finally:
        manager.close()
