"""The etcd guard beyond the conformance suite: bad input, round trips, verdicts of batches,
events, a fence key written by hand, and the leader killed under batches (C6 on a cluster
that changes its leader: every batch is all or nothing).
"""

from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from fence import (
    AsyncEtcdLockManager,
    BackendError,
    ConfigurationError,
    EventBus,
    EventKind,
    InvalidTokenError,
    Reason,
    StaleTokenError,
)
from fence._etcd import b64
from fence.adapters.etcd import EtcdGuard
from tests._async.key_harness import CALL_TIMEOUT
from tests.servers import EtcdCluster

pytestmark = pytest.mark.etcd


@pytest.fixture
def guard(etcd_url: str) -> Iterator[EtcdGuard]:
    guard = EtcdGuard(etcd_url, request_timeout=CALL_TIMEOUT)
    yield guard
    guard.close()


@pytest.fixture
def ns() -> str:
    return f"eg-{secrets.token_hex(4)}"


def _count_posts(guard: EtcdGuard) -> list[str]:
    posts: list[str] = []

    def hook(request: httpx.Request) -> None:
        posts.append(request.url.path)

    guard.driver._http.event_hooks["request"].append(hook)
    return posts


def test_bad_values_and_batches_are_refused_before_any_io() -> None:
    guard = EtcdGuard("etcd://127.0.0.1:1/")
    try:
        for bad in (1, None, True, 1.5, bytearray(b"x"), "\udc80"):
            with pytest.raises(ConfigurationError):
                guard.put("k", bad, token=5)  # type: ignore[arg-type]
            with pytest.raises(ConfigurationError):
                guard.batch(5).put("k", bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidTokenError):
            guard.batch(0)
        with pytest.raises(ConfigurationError, match="twice"):
            guard.batch(5).put("k", b"1").delete("k")
        with pytest.raises(ConfigurationError, match="twice"):
            guard.batch(5).put("k", b"1").put("k", b"2")
        assert guard.batch(5).execute() == []
    finally:
        guard.close()
    for prefix in ("", "a\x00b", 5):
        with pytest.raises(ConfigurationError):
            EtcdGuard("etcd://127.0.0.1:1", prefix=prefix)  # type: ignore[arg-type]
    for url in ("redis://127.0.0.1:1", "etcd://"):
        with pytest.raises(ConfigurationError):
            EtcdGuard(url)
    manager = AsyncEtcdLockManager("etcd://127.0.0.1:1")
    try:
        with pytest.raises(ConfigurationError, match="EtcdLockManager"):
            EtcdGuard(manager)  # type: ignore[arg-type]
    finally:
        asyncio.run(manager.close())


def test_every_write_is_one_round_trip(guard: EtcdGuard, ns: str) -> None:
    posts = _count_posts(guard)
    calls: list[Any] = [
        lambda: guard.put(f"{ns}/a", b"1", token=5),  # a new fence
        lambda: guard.put(f"{ns}/a", b"2", token=5),  # an existing one
        lambda: guard.put(f"{ns}/a", b"3", token=6, must_exist=True),
        lambda: guard.claim(f"{ns}/b", 6),
        lambda: guard.read_for_update(f"{ns}/a", token=7),
        lambda: guard.delete(f"{ns}/a", token=7),
        lambda: guard.get(f"{ns}/a"),
        lambda: guard.batch(8).put(f"{ns}/a", b"4").put(f"{ns}/b", b"5").execute(),
    ]
    for call in calls:
        posts.clear()
        call()
        assert posts == ["/v3/kv/txn"]
    # A batch over fences the guard wrote and a new one: one round trip too.
    posts.clear()
    guard.batch(9).put(f"{ns}/a", b"6").put(f"{ns}/new", b"7").execute()
    assert posts == ["/v3/kv/txn"]
    assert guard.get(f"{ns}/new") == (b"7", 9)


def test_a_wrong_hint_costs_a_round_trip_never_a_verdict(
    guard: EtcdGuard, etcd_url: str, ns: str
) -> None:
    guard.put(f"{ns}/a", b"1", token=5)
    # Another guard has not seen the fence: its batch expects it missing, and sends again.
    with EtcdGuard(etcd_url) as other:
        posts = _count_posts(other)
        other.batch(6).put(f"{ns}/a", b"2").put(f"{ns}/b", b"2").execute()
        assert posts == ["/v3/kv/txn", "/v3/kv/txn"]
        with pytest.raises(StaleTokenError):
            other.batch(5).put(f"{ns}/a", b"3").put(f"{ns}/c", b"3").execute()
    # A fence key deleted by hand: the guard that wrote it expects it, and sends again.
    fence_key = guard.layout.fence_key(f"{ns}/a".encode())
    guard.driver._call("/v3/kv/deleterange", {"key": b64(fence_key)}, "x", safe=True)
    posts = _count_posts(guard)
    guard.put(f"{ns}/a", b"4", token=1)
    assert posts == ["/v3/kv/txn", "/v3/kv/txn"]
    assert guard.get(f"{ns}/a") == (b"4", 1)
    assert guard.get(f"{ns}/c") == (None, None)


def test_a_rejected_write_is_one_round_trip_and_says_why(guard: EtcdGuard, ns: str) -> None:
    guard.put(f"{ns}/a", b"1", token=10)
    posts = _count_posts(guard)
    with pytest.raises(StaleTokenError) as caught:
        guard.put(f"{ns}/a", b"2", token=9)
    assert (caught.value.reason, caught.value.token, caught.value.fence) == (Reason.STALE, 9, 10)
    assert posts == ["/v3/kv/txn"]


def test_a_batch_lists_every_rejected_key(guard: EtcdGuard, ns: str) -> None:
    guard.claim(f"{ns}/a", 12)
    guard.put(f"{ns}/b", b"b", token=5)
    guard.claim(f"{ns}/c", 13)
    with pytest.raises(StaleTokenError) as caught:
        (
            guard.batch(11)
            .put(f"{ns}/a", b"x")
            .put(f"{ns}/b", b"x")
            .put(f"{ns}/c", b"x")
            .put(f"{ns}/d", b"x", must_exist=True)
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
    # Without the stale keys, the missing one alone refuses the batch.
    with pytest.raises(StaleTokenError) as caught:
        guard.batch(14).put(f"{ns}/b", b"y").put(f"{ns}/d", b"y", must_exist=True).execute()
    assert caught.value.reason is Reason.MISSING
    assert guard.get(f"{ns}/b") == (b"b", 5)
    assert guard.batch(14).put(f"{ns}/b", b"y").delete(f"{ns}/d").execute() == [True, False]
    assert guard.fence(f"{ns}/d") == 14


def test_a_fence_key_written_by_hand_is_unverifiable(guard: EtcdGuard, ns: str) -> None:
    fence_key = guard.layout.fence_key(f"{ns}/a".encode())
    guard.driver._call("/v3/kv/put", {"key": b64(fence_key), "value": b64(b"abc")}, "x", safe=True)
    for call in (
        lambda: guard.put(f"{ns}/a", b"1", token=5),
        lambda: guard.claim(f"{ns}/a", 5),
        lambda: guard.fence(f"{ns}/a"),
    ):
        with pytest.raises(StaleTokenError) as caught:
            call()
        assert caught.value.reason is Reason.UNVERIFIABLE
    raw = guard.driver._call("/v3/kv/range", {"key": b64(fence_key)}, "x", safe=True)
    assert raw["kvs"][0]["value"] == b64(b"abc")
    assert (
        guard.driver._call("/v3/kv/range", {"key": b64(f"{ns}/a".encode())}, "x", safe=True).get(
            "kvs"
        )
        is None
    )


def test_events_report_accepted_and_rejected_writes(etcd_url: str, ns: str) -> None:
    bus = EventBus()
    seen: list[Any] = []
    bus.subscribe(seen.append)
    with EtcdGuard(etcd_url, events=bus) as guard:
        guard.put(f"{ns}/a", b"1", token=5)
        with pytest.raises(StaleTokenError):
            guard.put(f"{ns}/a", b"1", token=4)
    assert [(e.kind, e.source, e.scope, e.token) for e in seen] == [
        (EventKind.WRITE_ACCEPTED, "etcd-guard", f"{ns}/a", 5),
        (EventKind.WRITE_REJECTED, "etcd-guard", f"{ns}/a", 4),
    ]


@pytest.mark.slow
def test_leader_killed_under_batches_leaves_every_batch_whole(
    etcd_cluster: EtcdCluster, etcd_url: str, ns: str
) -> None:
    """SIGKILL the leader while batches write five keys: every read sees the five keys of
    one batch, never a mix, and the batches go on once a new leader is elected."""
    keys = [f"{ns}/k{i}" for i in range(5)]
    stop = threading.Event()
    done: list[int] = []
    failed: list[BaseException] = []
    seen: list[set[bytes | None]] = []

    def writer() -> None:
        with EtcdGuard(etcd_url, request_timeout=3.0) as guard:
            n = 0
            while not stop.is_set():
                n += 1
                batch = guard.batch(n)
                for key in keys:
                    batch.put(key, str(n))
                try:
                    batch.execute()
                    done.append(n)
                except BackendError as exc:
                    failed.append(exc)
                try:
                    seen.append(_whole(guard))
                except BackendError:
                    pass

    def _whole(guard: EtcdGuard) -> set[bytes | None]:
        body = {"success": [{"request_range": {"key": b64(k.encode())}} for k in keys]}
        reply = guard.driver._call("/v3/kv/txn", body, "read", safe=True)
        return {
            (item["response_range"].get("kvs") or [{}])[0].get("value")
            for item in reply.get("responses", ())
        }

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        time.sleep(0.5)
        leader = etcd_cluster.leader()
        assert leader is not None
        before = len(done)
        etcd_cluster.kill(leader)
        time.sleep(2.0)
        etcd_cluster.start_member(leader)
        end = time.monotonic() + 30
        while len(done) < before + 20 and time.monotonic() < end:
            time.sleep(0.1)
    finally:
        stop.set()
        thread.join(30)
    assert len(done) >= before + 20, f"the batches did not go on: {failed[-3:]}"
    assert all(len(values) == 1 for values in seen), [v for v in seen if len(v) != 1][:3]
    with EtcdGuard(etcd_url) as guard:
        fences = {guard.fence(key) for key in keys}
        values = {guard.get(key)[0] for key in keys}
    # The last batch, cut short, may or may not have landed; either way it is whole.
    assert len(fences) == 1
    assert len(values) == 1
    assert fences.pop() in (max(done), max(done) + 1)
