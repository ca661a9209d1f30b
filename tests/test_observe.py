"""What the collectors measure (``fence._observe``), shared by Prometheus and OpenTelemetry:
hold times and hand-offs paired from two events, bounded tables, and no cost when off.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from fence import ConfigurationError, Event, EventBus, EventKind, ManualClock
from fence._observe import (
    HANDOFF_DURATION,
    HOLD_DURATION,
    METRICS,
    RETRIES,
    WRITES,
    Installation,
    Measurements,
)


def event(kind: EventKind, scope: str = "r", token: int | None = 7, **kw: object) -> Event:
    duration = kw.pop("duration", None)
    assert duration is None or isinstance(duration, float)
    return Event(kind, "memory", scope, token, duration, dict(kw))


def values(measure: Measurements, ev: Event, metric: object) -> list[float]:
    return [value for m, _, value in measure(ev) if m is metric]


def test_hold_time_runs_from_acquired_to_released_of_the_same_lease() -> None:
    clock = ManualClock()
    measure = Measurements(clock)
    list(measure(event(EventKind.ACQUIRED, token=7, duration=0.0)))
    clock.advance(1.0)
    list(measure(event(EventKind.ACQUIRED, scope="other", token=7, duration=0.0)))
    clock.advance(2.5)
    assert values(measure, event(EventKind.RELEASED, token=7, held=True), HOLD_DURATION) == [3.5]
    # A second release of the same lease, or one of a lease never seen, measures nothing.
    assert values(measure, event(EventKind.RELEASED, token=7, held=True), HOLD_DURATION) == []
    assert values(measure, event(EventKind.RELEASED, token=8, held=True), HOLD_DURATION) == []


def test_a_loss_ends_the_hold_and_the_late_release_adds_nothing() -> None:
    clock = ManualClock()
    measure = Measurements(clock)
    list(measure(event(EventKind.ACQUIRED, duration=0.0)))
    clock.advance(11.0)
    assert values(measure, event(EventKind.LOST, cause="expired"), HOLD_DURATION) == [11.0]
    clock.advance(5.0)
    assert values(measure, event(EventKind.RELEASED, held=False), HOLD_DURATION) == []


def test_a_hand_off_is_a_release_that_a_waiting_acquire_followed() -> None:
    clock = ManualClock()
    measure = Measurements(clock)
    list(measure(event(EventKind.ACQUIRED, token=1, duration=0.0)))
    clock.advance(2.0)  # another acquire starts waiting here ...
    list(measure(event(EventKind.RELEASED, token=1, held=True)))
    clock.advance(0.25)  # ... and is granted 0.25 s after the release
    waited = event(EventKind.WAITED, token=2, duration=3.0)
    assert values(measure, waited, HANDOFF_DURATION) == [0.25]
    list(measure(event(EventKind.ACQUIRED, token=2, duration=3.0)))


def test_no_hand_off_without_a_wait_through_the_release() -> None:
    clock = ManualClock()
    measure = Measurements(clock)
    list(measure(event(EventKind.ACQUIRED, token=1, duration=0.0)))
    list(measure(event(EventKind.RELEASED, token=1, held=True)))
    clock.advance(5.0)
    # It started waiting (behind another holder) 1 s ago, after the release: not its hand-off.
    assert values(measure, event(EventKind.WAITED, token=2, duration=1.0), HANDOFF_DURATION) == []
    # A release that was not held (the lease had expired) lets nobody in either.
    list(measure(event(EventKind.ACQUIRED, token=3, duration=0.0)))
    list(measure(event(EventKind.RELEASED, token=3, held=False)))
    assert values(measure, event(EventKind.WAITED, token=4, duration=9.0), HANDOFF_DURATION) == []
    # A free acquire after a release uses it up: a later waiter does not pair with it.
    list(measure(event(EventKind.RELEASED, token=2, held=True)))
    list(measure(event(EventKind.ACQUIRED, token=5, duration=0.0)))
    assert values(measure, event(EventKind.WAITED, token=6, duration=9.0), HANDOFF_DURATION) == []


def test_the_pairing_tables_stay_bounded() -> None:
    clock = ManualClock()
    measure = Measurements(clock, limit=2)
    for token in (1, 2, 3):
        list(measure(event(EventKind.ACQUIRED, scope=f"r{token}", token=token, duration=0.0)))
    clock.advance(1.0)
    assert values(measure, event(EventKind.RELEASED, scope="r1", token=1), HOLD_DURATION) == []
    assert values(measure, event(EventKind.RELEASED, scope="r3", token=3), HOLD_DURATION) == [1.0]
    assert len(measure._held) <= 2
    assert len(measure._released) <= 2
    with pytest.raises(ConfigurationError):
        Measurements(clock, limit=0)


def test_group_labels_every_metric_but_retries() -> None:
    measure = Measurements(group=lambda scope: scope.split(":", 1)[0])
    for metric in METRICS:
        assert ("group" in measure.labels(metric)) == (metric is not RETRIES)
    ((metric, values, value),) = measure(
        Event(EventKind.WRITE_REJECTED, "sql-guard", "order:42", 3, None, {"reason": "STALE"})
    )
    assert metric is WRITES
    assert measure.label_dict(metric, values) == {
        "guard": "sql-guard",
        "verdict": "rejected",
        "reason": "STALE",
        "group": "order",
    }
    assert value == 1


def test_every_event_kind_is_measured() -> None:
    measure = Measurements()
    for kind in EventKind:
        assert list(measure(event(kind, duration=0.0))), kind


def test_uninstall_leaves_the_bus_as_it_was() -> None:
    bus = EventBus()
    seen: list[Event] = []
    with Installation(bus, seen.append) as installed:
        assert bus.active
        bus.emit(EventKind.ACQUIRED, "memory", "r", 1, 0.0)
    assert not installed.installed
    assert not bus.active  # nothing listens: the managers are back to one attribute check
    bus.emit(EventKind.ACQUIRED, "memory", "r", 2, 0.0)
    installed.uninstall()  # twice is fine
    assert [e.token for e in seen] == [1]


def test_importing_fence_imports_no_metrics_library() -> None:
    code = (
        "import sys, fence, fence.testing; "
        "assert not {'prometheus_client', 'opentelemetry'} & set(sys.modules); "
        "import fence.prometheus, fence.otel; "
        "assert {'prometheus_client', 'opentelemetry'} <= set(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_release_reported_after_the_waiters_grant_still_counts_its_hand_off() -> None:
    """The holder's thread may report its release after the waiter's thread reported its
    grant: the hand-off is counted then, as 0 s (it was shorter than the reports' gap), and
    only for a release of a lease that was held when the waiter was granted."""
    clock = ManualClock()
    measure = Measurements(clock)
    list(measure(event(EventKind.ACQUIRED, token=1, duration=0.0)))
    clock.advance(2.0)
    waited = event(EventKind.WAITED, token=2, duration=1.5)
    assert values(measure, waited, HANDOFF_DURATION) == []  # no release reported yet
    list(measure(event(EventKind.ACQUIRED, token=2, duration=1.5)))
    clock.advance(0.1)
    released = event(EventKind.RELEASED, token=1, held=True)
    assert values(measure, released, HANDOFF_DURATION) == [0.0]
    # Counted once: the waiter's own release, later, is no hand-off of its own.
    clock.advance(1.0)
    assert values(measure, event(EventKind.RELEASED, token=2, held=True), HANDOFF_DURATION) == []
    # A release of a lease never seen held does not pair with a waiter either.
    waiting = event(EventKind.WAITED, scope="s", token=9, duration=5.0)
    assert values(measure, waiting, HANDOFF_DURATION) == []
    unseen = event(EventKind.RELEASED, scope="s", token=8, held=True)
    assert values(measure, unseen, HANDOFF_DURATION) == []
