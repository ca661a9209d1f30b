"""What the metrics collectors measure, written once for Prometheus and OpenTelemetry.

:mod:`fence.prometheus` and :mod:`fence.otel` only create instruments from :data:`METRICS`
and record what :class:`Measurements` derives from each event. No third-party import here.

Two measurements span two events, so no single event carries them; the collector pairs
the events itself, on its own clock, and needs no change to what managers report:

- **hold time**: from ``ACQUIRED`` to the ``RELEASED`` (or ``LOST``, whichever comes first)
  of the same lease, matched by backend, resource and token.
- **hand-off**: from a ``RELEASED`` of a resource to the ``WAITED`` acquire that it let in,
  when that acquire was already waiting at the moment of the release. An acquire that
  found the lock free is no hand-off. Only releases and acquires reported to the same bus
  pair up: a hand-off between two processes is seen by neither.

Both keep a bounded table of open leases and recent releases (:data:`OPEN_LIMIT` entries,
oldest dropped first), so a lease that is never released, or a manager closed with leases
held, cannot grow it without end.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal, Self, TypeVar

from fence._clock import Clock, system_clock
from fence._errors import ConfigurationError
from fence._events import Event, EventBus, EventKind

__all__ = ["METRICS", "OPEN_LIMIT", "Installation", "Measurements", "Metric"]

#: How many open leases (and recent releases) the hold-time and hand-off pairing remembers.
OPEN_LIMIT = 10_000

# Bucket bounds in seconds. An acquire is a round trip when free and a wait when not; a
# hand-off is about one round trip (sub-millisecond on loopback); a hold is the work.
_ACQUIRE_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60,
)  # fmt: skip
_HOLD_BUCKETS = (
    0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600,
)  # fmt: skip
_HANDOFF_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,
)  # fmt: skip


@dataclass(frozen=True, slots=True, eq=False)  # compared and hashed by identity: fast
class Metric:
    """One instrument, named the OpenTelemetry way; :attr:`prometheus_name` derives the other.

    Attributes:
        name: the OpenTelemetry name, e.g. ``iofence.lock.acquires``.
        kind: ``"counter"`` or ``"histogram"``.
        unit: the UCUM unit (``s``, or an annotation such as ``{acquire}``).
        description: one line for the ``HELP`` text and the instrument description.
        labels: label names (Prometheus); the OpenTelemetry attributes are ``iofence.<label>``.
        buckets: histogram bucket bounds, in seconds.
    """

    name: str
    kind: Literal["counter", "histogram"]
    unit: str
    description: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...] = ()

    @property
    def prometheus_name(self) -> str:
        """The name without the suffix prometheus_client adds (``_total``, ``_seconds``)."""
        return self.name.replace(".", "_")


def _counter(name: str, unit: str, description: str, *labels: str) -> Metric:
    return Metric(name, "counter", unit, description, labels)


def _histogram(name: str, description: str, buckets: tuple[float, ...]) -> Metric:
    return Metric(name, "histogram", "s", description, ("backend",), buckets)


ACQUIRES = _counter("iofence.lock.acquires", "{acquire}", "Leases granted.", "backend")
WAITS = _counter("iofence.lock.waits", "{acquire}", "Acquires that had to wait.", "backend")
RENEWALS = _counter(
    "iofence.lock.renewals", "{renewal}", "Lease renewals, by outcome.", "backend", "outcome"
)
LOSSES = _counter("iofence.lock.losses", "{lease}", "Leases lost.", "backend")
RELEASES = _counter(
    "iofence.lock.releases", "{release}", "Lease releases, by outcome.", "backend", "outcome"
)
REVOCATIONS = _counter("iofence.lock.revocations", "{revocation}", "Leases revoked.", "backend")
WRITES = _counter(
    "iofence.guard.writes",
    "{write}",
    "Guarded writes, by verdict and reason for a rejection.",
    "guard",
    "verdict",
    "reason",
)
BACKEND_DOWN = _counter(
    "iofence.backend.down", "{event}", "A backend or node stopped answering.", "backend", "node"
)
DATA_LOSSES = _counter(
    "iofence.quorum.data_losses", "{event}", "Quorum nodes found without their data.",
    "backend", "node",
)  # fmt: skip
REFUSALS = _counter(
    "iofence.quorum.refusals", "{call}", "Calls a quorum manager refused.", "backend", "reason"
)
INITIALIZATIONS = _counter(
    "iofence.quorum.initializations", "{event}", "Quorums set up on empty nodes.", "backend"
)
RETRIES = _counter("iofence.retries", "{retry}", "Units of work run again.", "error")
ACQUIRE_DURATION = _histogram(
    "iofence.lock.acquire.duration", "Time from an acquire call to the grant.", _ACQUIRE_BUCKETS
)
HOLD_DURATION = _histogram(
    "iofence.lock.hold.duration", "Time a lease was held: acquire to release or loss.",
    _HOLD_BUCKETS,
)  # fmt: skip
HANDOFF_DURATION = _histogram(
    "iofence.lock.handoff.duration",
    "Time from a release to the grant of an acquire that was waiting for it.",
    _HANDOFF_BUCKETS,
)

#: Every instrument the collectors create, in the order the docs list them.
METRICS: tuple[Metric, ...] = (
    ACQUIRES,
    WAITS,
    RENEWALS,
    LOSSES,
    RELEASES,
    REVOCATIONS,
    WRITES,
    BACKEND_DOWN,
    DATA_LOSSES,
    REFUSALS,
    INITIALIZATIONS,
    RETRIES,
    ACQUIRE_DURATION,
    HOLD_DURATION,
    HANDOFF_DURATION,
)

#: ``(metric, label values, value)``: the values in the order of :meth:`Measurements.labels`.
Measurement = tuple[Metric, tuple[str, ...], float]
K = TypeVar("K")
V = TypeVar("V")


class Measurements:
    """Turn events into measurements, ``(metric, label values, value)``; pair the two-event
    ones.

    Args:
        clock: the monotonic clock hold times and hand-offs are measured on; give the
            managers' clock if they run on another one (a :class:`fence.ManualClock`).
        group: maps a lock's resource or a guard's fence scope to a bounded label value,
            added as the label ``group`` to every metric but ``iofence.retries``;
            ``None``: no such label. Never label by the raw resource: every order would
            become a time series of its own.
        limit: how many open leases and recent releases to remember.
    """

    def __init__(
        self,
        clock: Clock | None = None,
        group: Callable[[str], str] | None = None,
        limit: int = OPEN_LIMIT,
    ) -> None:
        if limit < 1:
            raise ConfigurationError(f"limit must be >= 1, got {limit!r}")
        self.clock: Clock = clock or system_clock
        self.group = group
        self.limit = limit
        self._lock = threading.Lock()
        self._held: dict[tuple[str, str, int | None], float] = {}
        self._released: dict[tuple[str, str], float] = {}
        # Waiters granted before a release was reported (the holder's thread reports it
        # after the waiter's did): when, and with which token.
        self._waited: dict[tuple[str, str], tuple[float, int]] = {}

    def labels(self, metric: Metric) -> tuple[str, ...]:
        """The label names of ``metric`` under this configuration."""
        if self.group is None or metric is RETRIES:
            return metric.labels
        return (*metric.labels, "group")

    def __call__(self, event: Event) -> Iterator[Measurement]:
        """The measurements ``event`` makes: label values in the order of :meth:`labels`."""
        kind, source = event.kind, event.source
        group: tuple[str, ...] = () if self.group is None else (self.group(event.scope),)
        lock = (source, *group)
        if kind is EventKind.ACQUIRED:
            self._open(event)
            yield ACQUIRES, lock, 1
            if event.duration is not None:
                yield ACQUIRE_DURATION, lock, event.duration
        elif kind is EventKind.WAITED:
            yield WAITS, lock, 1
            handoff = self._handoff(event)
            if handoff is not None:
                yield HANDOFF_DURATION, lock, handoff
        elif kind is EventKind.RELEASED:
            held = bool(event.detail.get("held", True))
            yield RELEASES, (source, "released" if held else "not_held", *group), 1
            hold = self._close(event, released=held)
            if hold is not None:
                yield HOLD_DURATION, lock, hold
            if held and self._late_handoff(event, hold):
                yield HANDOFF_DURATION, lock, 0.0
        elif kind is EventKind.LOST:
            yield LOSSES, lock, 1
            hold = self._close(event, released=False)
            if hold is not None:
                yield HOLD_DURATION, lock, hold
        elif kind is EventKind.RENEWED:
            yield RENEWALS, (source, "renewed", *group), 1
        elif kind is EventKind.RENEW_FAILED:
            yield RENEWALS, (source, "failed", *group), 1
        elif kind is EventKind.REVOKED:
            yield REVOCATIONS, lock, 1
        elif kind is EventKind.WRITE_ACCEPTED:
            yield WRITES, (source, "accepted", "", *group), 1
        elif kind is EventKind.WRITE_REJECTED:
            reason = str(event.detail.get("reason", ""))
            yield WRITES, (source, "rejected", reason, *group), 1
        elif kind is EventKind.BACKEND_DOWN:
            yield BACKEND_DOWN, (source, str(event.detail.get("node", "")), *group), 1
        elif kind is EventKind.NODE_DATA_LOST:
            yield DATA_LOSSES, (source, str(event.detail.get("node", "")), *group), 1
        elif kind is EventKind.REFUSED:
            yield REFUSALS, (source, str(event.detail.get("reason", "")), *group), 1
        elif kind is EventKind.QUORUM_INITIALIZED:
            yield INITIALIZATIONS, lock, 1
        elif kind is EventKind.RETRYING:
            yield RETRIES, (str(event.detail.get("error", "")),), 1

    def label_dict(self, metric: Metric, values: tuple[str, ...]) -> dict[str, str]:
        """``values`` (as a measurement gives them) by label name."""
        return dict(zip(self.labels(metric), values, strict=True))

    def _open(self, event: Event) -> None:
        now = self.clock.monotonic()
        with self._lock:
            self._released.pop((event.source, event.scope), None)
            _put(self._held, (event.source, event.scope, event.token), now, self.limit)

    def _close(self, event: Event, *, released: bool) -> float | None:
        now = self.clock.monotonic()
        with self._lock:
            start = self._held.pop((event.source, event.scope, event.token), None)
            if released:
                _put(self._released, (event.source, event.scope), now, self.limit)
        return None if start is None else max(0.0, now - start)

    def _handoff(self, event: Event) -> float | None:
        now = self.clock.monotonic()
        key = (event.source, event.scope)
        with self._lock:
            released = self._released.pop(key, None)
            if released is None and event.token is not None:
                _put(self._waited, key, (now, event.token), self.limit)
        if released is None or event.duration is None:
            return None
        if released < now - event.duration:
            return None  # released before this acquire began waiting: not its hand-off
        return max(0.0, now - released)

    def _late_handoff(self, event: Event, hold: float | None) -> bool:
        """Whether the release ``event``, of a lease held for ``hold`` seconds, let in a
        waiter whose grant was reported before it: a waiter with a larger token, granted
        while this lease was held (what the release is to it is then counted as 0 s)."""
        with self._lock:
            waited = self._waited.pop((event.source, event.scope), None)
        if waited is None or hold is None or event.token is None:
            return False
        granted, token = waited
        return event.token < token and self.clock.monotonic() - hold <= granted


def _put(table: dict[K, V], key: K, value: V, limit: int) -> None:
    """Remember ``key`` as the newest entry; drop the oldest one when the table is full."""
    table.pop(key, None)
    while len(table) >= limit:
        del table[next(iter(table))]
    table[key] = value


class Installation:
    """A collector subscribed to an event bus; :meth:`uninstall` (or leaving a ``with``
    block) stops it.

    Args:
        bus: the bus the collector listens to.
        listener: the collector's listener.
    """

    def __init__(self, bus: EventBus, listener: Callable[[Event], None]) -> None:
        self.bus = bus
        self._unsubscribe: Callable[[], None] | None = bus.subscribe(listener)

    @property
    def installed(self) -> bool:
        """Whether the collector still listens."""
        return self._unsubscribe is not None

    def uninstall(self) -> None:
        """Stop listening and remove what the collector registered. Calling it twice is fine."""
        unsubscribe, self._unsubscribe = self._unsubscribe, None
        if unsubscribe is not None:
            unsubscribe()
            self._removed()

    def _removed(self) -> None:
        """Hook for subclasses: undo registrations after the listener is gone."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.uninstall()
