"""The ZooKeeper guard beyond the conformance suite: bad input, round trips, hints that went
out of date, verdicts of batches, a fence node written by hand, a node with children,
events, and the leader killed under batches (C6 on an ensemble that changes its leader:
every batch is all or nothing).
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kazoo.protocol.serialization import Transaction

from fence import (
    AsyncZooKeeperLockManager,
    BackendError,
    ConfigurationError,
    EventBus,
    EventKind,
    InvalidTokenError,
    Reason,
    StaleTokenError,
)
from fence.adapters.zookeeper import ZooKeeperGuard
from tests._async.key_harness import CALL_TIMEOUT
from tests.servers import ZooKeeperEnsemble

pytestmark = pytest.mark.zookeeper


@pytest.fixture
def guard(zookeeper_url: str) -> Iterator[ZooKeeperGuard]:
    guard = ZooKeeperGuard(zookeeper_url, request_timeout=CALL_TIMEOUT)
    yield guard
    guard.close()


@pytest.fixture
def ns() -> str:
    return f"/zg-{secrets.token_hex(4)}"


def _count_requests(guard: ZooKeeperGuard) -> list[str]:
    """The kinds of the requests the guard sends from now on."""
    client = guard.driver._client
    sent: list[str] = []
    call = client._call

    def counting(request: Any, async_object: Any) -> Any:
        sent.append("multi" if isinstance(request, Transaction) else type(request).__name__)
        return call(request, async_object)

    client._call = counting
    return sent


def test_bad_values_and_batches_are_refused_before_any_io() -> None:
    guard = ZooKeeperGuard("zookeeper://127.0.0.1:1/root")
    try:
        for bad in (1, None, True, 1.5, bytearray(b"x"), "\udc80"):
            with pytest.raises(ConfigurationError):
                guard.set("/k", bad, token=5)  # type: ignore[arg-type]
            with pytest.raises(ConfigurationError):
                guard.batch(5).create("/k", bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidTokenError):
            guard.batch(0)
        with pytest.raises(ConfigurationError, match="twice"):
            guard.batch(5).set("/k", b"1").delete("/k")
        assert guard.batch(5).execute() == []
        assert guard.batch(5).claim("/k").set("/k", b"1").ops[0].code == "claim"
    finally:
        guard.close()
    for url in ("redis://127.0.0.1:1", "zookeeper:///root"):
        with pytest.raises(ConfigurationError):
            ZooKeeperGuard(url)
    with pytest.raises(ConfigurationError):
        ZooKeeperGuard("zookeeper://127.0.0.1:1", root="relative")
    manager = AsyncZooKeeperLockManager("zookeeper://127.0.0.1:1")
    try:
        with pytest.raises(ConfigurationError, match="ZooKeeperLockManager"):
            ZooKeeperGuard(manager)  # type: ignore[arg-type]
    finally:
        asyncio.run(manager.close())


def test_a_holder_that_writes_again_pays_one_round_trip(guard: ZooKeeperGuard, ns: str) -> None:
    guard.create(f"{ns}/a", b"1", token=5)
    sent = _count_requests(guard)
    calls: list[Any] = [
        lambda: guard.set(f"{ns}/a", b"2", token=5),
        lambda: guard.set(f"{ns}/a", b"3", token=6),
        lambda: guard.create(f"{ns}/a", b"4", token=6),
        lambda: guard.claim(f"{ns}/a", 7),
        lambda: guard.delete(f"{ns}/a", token=7),
        lambda: guard.create(f"{ns}/a", b"5", token=7),
        lambda: guard.batch(8).set(f"{ns}/a", b"6").execute(),
    ]
    for call in calls:
        sent.clear()
        call()
        assert sent == ["multi"]
    # A registering read: the multi and the read behind it, sent together.
    sent.clear()
    assert guard.read_for_update(f"{ns}/a", token=8) == b"6"
    assert sent == ["multi", "GetData"]
    # A new node with its parent there: one multi-operation creates both nodes.
    sent.clear()
    guard.create(f"{ns}/b", b"1", token=8)
    assert sent == ["multi"]
    assert guard.get(f"{ns}/b") == (b"1", 8)


def test_a_fence_moved_by_another_guard_is_read_and_refused(
    guard: ZooKeeperGuard, zookeeper_url: str, ns: str
) -> None:
    guard.create(f"{ns}/a", b"1", token=5)
    with ZooKeeperGuard(zookeeper_url) as other:
        other.claim(f"{ns}/a", 9)
    sent = _count_requests(guard)
    with pytest.raises(StaleTokenError) as caught:
        guard.set(f"{ns}/a", b"2", token=6)
    assert (caught.value.reason, caught.value.token, caught.value.fence) == (Reason.STALE, 6, 9)
    assert sent == ["multi", "GetData", "Exists"]
    # Now the guard knows the fence: a stale token is refused after one read, no write.
    sent.clear()
    with pytest.raises(StaleTokenError):
        guard.set(f"{ns}/a", b"2", token=8)
    assert "multi" not in sent
    guard.set(f"{ns}/a", b"3", token=9)
    assert guard.get(f"{ns}/a") == (b"3", 9)


def test_a_batch_lists_every_rejected_node(guard: ZooKeeperGuard, ns: str) -> None:
    guard.claim(f"{ns}/a", 12)
    guard.create(f"{ns}/b", b"b", token=5)
    guard.claim(f"{ns}/c", 13)
    with pytest.raises(StaleTokenError) as caught:
        (
            guard.batch(11)
            .create(f"{ns}/a", b"x")
            .set(f"{ns}/b", b"x")
            .create(f"{ns}/c", b"x")
            .set(f"{ns}/d", b"x")
            .execute()
        )
    found = sorted((e.scope, e.reason, e.fence) for e in caught.value.rejected)
    assert found == [
        (f"{ns}/a", Reason.STALE, 12),
        (f"{ns}/c", Reason.STALE, 13),
        (f"{ns}/d", Reason.MISSING, None),
    ]
    assert caught.value.reason is Reason.STALE
    assert caught.value.fence == 13
    assert guard.get(f"{ns}/b") == (b"b", 5)
    assert guard.fence(f"{ns}/d") is None
    with pytest.raises(StaleTokenError) as caught:
        guard.batch(14).set(f"{ns}/b", b"y").set(f"{ns}/d", b"y").execute()
    assert caught.value.reason is Reason.MISSING
    assert guard.get(f"{ns}/b") == (b"b", 5)
    assert guard.batch(14).set(f"{ns}/b", b"y").delete(f"{ns}/d").execute() == [True, False]
    assert guard.fence(f"{ns}/d") == 14
    assert guard.get(f"{ns}/b") == (b"y", 14)


def test_an_update_under_a_missing_parent_is_missing_and_creates_nothing(
    guard: ZooKeeperGuard, ns: str
) -> None:
    with pytest.raises(StaleTokenError) as caught:
        guard.set(f"{ns}/none/a", b"1", token=5)
    assert (caught.value.reason, caught.value.fence) == (Reason.MISSING, None)
    with pytest.raises(StaleTokenError) as caught:
        guard.batch(5).create(f"{ns}/b", b"1").set(f"{ns}/none/a", b"1").execute()
    assert caught.value.reason is Reason.MISSING
    assert guard.driver._client.exists(ns) is None
    # A create makes the parents, empty and unfenced.
    guard.create(f"{ns}/none/a", b"1", token=5)
    assert guard.get(f"{ns}/none/a") == (b"1", 5)
    assert guard.get(f"{ns}/none") == (b"", None)


def test_a_fence_node_written_by_hand_is_unverifiable(guard: ZooKeeperGuard, ns: str) -> None:
    assert guard.get(f"{ns}/x") == (None, None)  # the session starts on first use
    guard.driver._client.ensure_path(ns)
    guard.driver._client.create(f"{ns}/a.fence", b"abc")
    for call in (
        lambda: guard.set(f"{ns}/a", b"1", token=5),
        lambda: guard.create(f"{ns}/a", b"1", token=5),
        lambda: guard.claim(f"{ns}/a", 5),
        lambda: guard.fence(f"{ns}/a"),
    ):
        with pytest.raises(StaleTokenError) as caught:
            call()
        assert caught.value.reason is Reason.UNVERIFIABLE
    assert guard.driver._client.exists(f"{ns}/a") is None
    assert guard.driver._client.get(f"{ns}/a.fence")[0] == b"abc"


def test_a_node_with_children_is_not_deleted(guard: ZooKeeperGuard, ns: str) -> None:
    guard.create(f"{ns}/a", b"1", token=5)
    guard.create(f"{ns}/a/child", b"1", token=5)
    with pytest.raises(BackendError) as caught:
        guard.delete(f"{ns}/a", token=6)
    assert caught.value.code == "NOT_EMPTY"
    assert guard.get(f"{ns}/a") == (b"1", 5)


def test_events_report_accepted_and_rejected_writes(zookeeper_url: str, ns: str) -> None:
    bus = EventBus()
    seen: list[Any] = []
    bus.subscribe(seen.append)
    with ZooKeeperGuard(zookeeper_url, events=bus) as guard:
        guard.create(f"{ns}/a", b"1", token=5)
        with pytest.raises(StaleTokenError):
            guard.set(f"{ns}/a", b"1", token=4)
    assert [(e.kind, e.source, e.scope, e.token) for e in seen] == [
        (EventKind.WRITE_ACCEPTED, "zookeeper-guard", f"{ns}/a", 5),
        (EventKind.WRITE_REJECTED, "zookeeper-guard", f"{ns}/a", 4),
    ]


@pytest.mark.slow
def test_leader_killed_under_batches_leaves_every_batch_whole(
    zookeeper_ensemble: ZooKeeperEnsemble, zookeeper_url: str, ns: str
) -> None:
    """SIGKILL the leader while batches write five nodes: every read sees the five nodes of
    one batch, never a mix, and the batches go on once a new leader is elected."""
    nodes = [f"{ns}/k{i}" for i in range(5)]
    stop = threading.Event()
    done: list[int] = []
    failed: list[BaseException] = []
    seen: list[set[bytes | None]] = []

    def writer() -> None:
        with ZooKeeperGuard(zookeeper_url, request_timeout=10.0) as guard:
            n = 0
            while not stop.is_set():
                n += 1
                batch = guard.batch(n)
                for node in nodes:
                    batch.create(node, str(n))
                try:
                    batch.execute()
                    done.append(n)
                except BackendError as exc:
                    failed.append(exc)
                try:
                    seen.append({guard.get(node)[0] for node in nodes})
                except BackendError:
                    pass

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        time.sleep(1.0)
        leader = zookeeper_ensemble.leader()
        assert leader is not None
        before = len(done)
        zookeeper_ensemble.kill(leader)
        time.sleep(2.0)
        zookeeper_ensemble.start_member(leader)
        end = time.monotonic() + 60
        while len(done) < before + 20 and time.monotonic() < end:
            time.sleep(0.1)
    finally:
        stop.set()
        thread.join(60)
    assert len(done) >= before + 20, f"the batches did not go on: {failed[-3:]}"
    # Reads between two batches of one session see one batch whole (a node read after
    # another in the same session is never older than it).
    assert all(len(values) == 1 for values in seen), [v for v in seen if len(v) != 1][:3]
    with ZooKeeperGuard(zookeeper_url) as guard:
        guard.fence(nodes[0])  # the session starts on first use
        guard.driver._client.sync(ns)  # its server may lag behind the writer's
        fences = {guard.fence(node) for node in nodes}
        values = {guard.get(node)[0] for node in nodes}
    assert len(fences) == 1
    assert len(values) == 1
    assert fences.pop() in (max(done), max(done) + 1)
