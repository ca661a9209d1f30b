"""``fence.otel``: spans collected with the SDK's in-memory span exporter and metrics with
its in-memory metric reader, from real acquires, releases and guarded writes.

The managers and the instrumentation share a manual clock, so span times are exact.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

import fence.otel
from fence import (
    AsyncMemoryLockManager,
    EventBus,
    ManualClock,
    MemoryLockManager,
    NotOwnerError,
    RetryPolicy,
    StaleTokenError,
)
from fence._observe import HANDOFF_DURATION, HOLD_DURATION
from fence.testing import MemoryGuard
from tests._compat import join, spawn


class Rig:
    """A tracer provider with an in-memory exporter, a meter provider with an in-memory
    reader, a private bus and a manual clock shared by a manager and the instrumentation."""

    def __init__(self) -> None:
        self.spans = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader])
        self.bus = EventBus()
        self.clock = ManualClock()

    def finished(self, name: str) -> list[ReadableSpan]:
        return [s for s in self.spans.get_finished_spans() if s.name == name]

    def points(self) -> dict[str, list[Any]]:
        data = self.reader.get_metrics_data()
        if data is None:  # nothing was ever recorded
            return {}
        return {
            metric.name: list(metric.data.data_points)
            for rm in data.resource_metrics
            for sm in rm.scope_metrics
            for metric in sm.metrics
        }


@pytest.fixture
def rig() -> Iterator[Rig]:
    found = Rig()
    yield found
    found.tracer_provider.shutdown()
    found.meter_provider.shutdown()


def install(rig: Rig, **kwargs: Any) -> fence.otel.OTelInstrumentation:
    return fence.otel.install(
        rig.tracer_provider, rig.meter_provider, rig.bus, clock=rig.clock, **kwargs
    )


def wait_until(predicate: Callable[[], object]) -> None:
    end = time.monotonic() + 30  # a bound against a hang, not a measurement
    while not predicate():
        assert time.monotonic() < end
        time.sleep(0.001)


def test_acquire_release_and_write_spans(rig: Rig) -> None:
    manager = MemoryLockManager(clock=rig.clock, events=rig.bus)
    store = MemoryGuard(events=rig.bus)
    tracer = rig.tracer_provider.get_tracer("app")
    with install(rig), tracer.start_as_current_span("handle-order") as parent:
        first = manager.acquire("order:42", ttl=10)
        waiting = spawn(lambda: manager.acquire("order:42", ttl=10))
        wait_until(lambda: manager.backend._waiters.get("order:42"))
        rig.clock.advance(1.5)
        first.release()
        second = join(waiting)
        store.write("order:42", second.token, "paid")
        with pytest.raises(StaleTokenError):
            store.write("order:42", first.token, "late")
        second.release()

    acquires = rig.finished(fence.otel.ACQUIRE)
    assert [dict(s.attributes or {}) for s in acquires] == [
        {
            "iofence.backend": "memory",
            "iofence.resource": "order:42",
            "iofence.token": token,
            "iofence.waited": waited,
        }
        for token, waited in ((first.token, False), (second.token, True))
    ]
    # The acquire span starts when the call started: the wait is inside it.
    assert [s.end_time - s.start_time for s in acquires] == [0, 1_500_000_000]  # type: ignore[operator]
    assert acquires[1].end_time == round(rig.clock.time() * 1e9)
    assert all(s.kind is SpanKind.INTERNAL for s in acquires)
    # Spans reported in the caller's context are children of its current span; the waiter
    # ran in a thread of its own, outside it.
    context = parent.get_span_context()
    assert acquires[0].parent is not None
    assert acquires[0].parent.span_id == context.span_id
    assert acquires[1].parent is None

    releases = rig.finished(fence.otel.RELEASE)
    assert [(s.attributes or {}).get("iofence.token") for s in releases] == [
        first.token,
        second.token,
    ]
    assert all((s.attributes or {}).get("iofence.held") is True for s in releases)
    assert all(s.status.status_code is StatusCode.UNSET for s in releases)

    accepted, rejected = rig.finished(fence.otel.WRITE)
    assert dict(accepted.attributes or {}) == {
        "iofence.guard": "memory-guard",
        "iofence.scope": "order:42",
        "iofence.token": second.token,
        "iofence.verdict": "accepted",
    }
    assert accepted.status.status_code is StatusCode.UNSET
    assert dict(rejected.attributes or {}) == {
        "iofence.guard": "memory-guard",
        "iofence.scope": "order:42",
        "iofence.token": first.token,
        "iofence.verdict": "rejected",
        "iofence.reason": "STALE",
        "error.type": "fence.StaleTokenError",
    }
    assert rejected.status.status_code is StatusCode.ERROR
    assert rejected.status.description == "STALE"
    assert all(s.parent is not None and s.parent.span_id == context.span_id for s in releases)


def test_a_release_of_a_lease_no_longer_held_is_an_error_span(rig: Rig) -> None:
    manager = MemoryLockManager(clock=rig.clock, events=rig.bus)
    with install(rig, metrics=False):
        lease = manager.acquire("r", ttl=10)
        rig.clock.advance(11)
        other = manager.acquire("r", ttl=10, owner="B")
        with pytest.raises(NotOwnerError, match="no longer held"):
            lease.release()
        other.release()
    first, second = rig.finished(fence.otel.RELEASE)
    assert (first.attributes or {}).get("iofence.held") is False
    assert first.status.status_code is StatusCode.ERROR
    assert (first.attributes or {}).get("error.type") == "fence.NotOwnerError"
    assert second.status.status_code is StatusCode.UNSET
    assert rig.points() == {}  # metrics off: no instrument recorded anything


def test_spans_of_an_asyncio_task_are_children_of_its_current_span(rig: Rig) -> None:
    tracer = rig.tracer_provider.get_tracer("app")

    async def main() -> None:
        manager = AsyncMemoryLockManager(events=rig.bus)
        with tracer.start_as_current_span("job"):
            async with manager.lock("job:nightly"):
                pass
        await manager.close()

    with install(rig):
        asyncio.run(main())
    (job,) = rig.finished("job")
    (acquire,) = rig.finished(fence.otel.ACQUIRE)
    (release,) = rig.finished(fence.otel.RELEASE)
    for span in (acquire, release):
        assert span.parent is not None
        assert span.parent.span_id == job.context.span_id  # type: ignore[union-attr]


def test_a_retry_is_an_event_on_the_current_span(rig: Rig) -> None:
    manager = MemoryLockManager(events=rig.bus)
    tracer = rig.tracer_provider.get_tracer("app")
    policy = RetryPolicy(attempts=2, backoff=lambda n: 0.25, events=rig.bus)
    with install(rig), tracer.start_as_current_span("pay"):
        for attempt in policy:
            with attempt, manager.lock("order:42") as lease:
                if attempt.number == 1:
                    raise StaleTokenError("order:42", lease.token, lease.token + 1)
    (pay,) = rig.finished("pay")
    (event,) = pay.events
    assert event.name == fence.otel.RETRY_EVENT
    assert dict(event.attributes or {}) == {
        "iofence.attempt": 1,
        "iofence.error": "StaleTokenError",
        "iofence.delay": 0.25,
    }


def test_metrics_through_the_api(rig: Rig) -> None:
    manager = MemoryLockManager(clock=rig.clock, events=rig.bus)
    store = MemoryGuard(events=rig.bus)
    with install(rig, traces=False, group=lambda s: s.split(":", 1)[0]) as installed:
        first = manager.acquire("order:1", ttl=10)
        waiting = spawn(lambda: manager.acquire("order:1", ttl=10))
        wait_until(lambda: manager.backend._waiters.get("order:1"))
        rig.clock.advance(4.0)
        first.release()
        second = join(waiting)
        store.write("order:1", second.token, "x")
        with pytest.raises(StaleTokenError):
            store.write("order:1", first.token, "y")
        rig.clock.advance(0.5)
        second.release()
    assert installed.tracer is None
    assert rig.spans.get_finished_spans() == ()
    points = rig.points()
    lock = {"iofence.backend": "memory", "iofence.group": "order"}

    def counted(name: str) -> dict[frozenset[tuple[str, Any]], int]:
        return {frozenset(p.attributes.items()): p.value for p in points[name]}

    assert counted("iofence.lock.acquires") == {frozenset(lock.items()): 2}
    assert counted("iofence.lock.waits") == {frozenset(lock.items()): 1}
    released = {**lock, "iofence.outcome": "released"}
    assert counted("iofence.lock.releases") == {frozenset(released.items()): 2}
    guard = {"iofence.guard": "memory-guard", "iofence.group": "order"}
    accepted = {**guard, "iofence.verdict": "accepted"}  # no empty reason attribute
    rejected = {**guard, "iofence.verdict": "rejected", "iofence.reason": "STALE"}
    assert counted("iofence.guard.writes") == {
        frozenset(accepted.items()): 1,
        frozenset(rejected.items()): 1,
    }

    hold: HistogramDataPoint
    (hold,) = points["iofence.lock.hold.duration"]
    assert (hold.count, hold.sum) == (2, 4.5)
    assert tuple(hold.explicit_bounds) == HOLD_DURATION.buckets
    (handoff,) = points["iofence.lock.handoff.duration"]
    assert (handoff.count, handoff.sum) == (1, 0.0)
    assert tuple(handoff.explicit_bounds) == HANDOFF_DURATION.buckets
    (acquire,) = points["iofence.lock.acquire.duration"]
    assert (acquire.count, acquire.sum) == (2, 4.0)


def test_uninstall_stops_spans_and_measurements(rig: Rig) -> None:
    manager = MemoryLockManager(events=rig.bus)
    installed = install(rig)
    manager.acquire("r").release()
    installed.uninstall()
    assert not rig.bus.active
    manager.acquire("r").release()
    assert len(rig.finished(fence.otel.ACQUIRE)) == 1
    (point,) = rig.points()["iofence.lock.acquires"]
    assert point.value == 1
