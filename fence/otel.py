"""OpenTelemetry spans and metrics from iofence's event bus (the ``iofence[otel]`` extra).

One call subscribes to the event bus; spans go to a tracer provider and metrics to a meter
provider, the global ones unless given::

    import fence.otel

    fence.otel.install()   # after the SDK is configured, as any instrumentation

``import fence`` never imports OpenTelemetry; only this module does, and it needs only
``opentelemetry-api``: without an SDK every span and measurement is a no-op.

**How the spans are timed.** A manager or guard reports an event once the call is over,
in the caller's thread or task, so the span is created then, as a child of whatever span
is current there, with explicit start and end times:

- ``iofence.acquire`` starts when the acquire call started (the event carries the
  duration, waiting included) and ends at the grant.
- ``iofence.release`` and ``iofence.write`` end when the backend's answer was known. Their
  events carry no duration today, so these spans have no length: they mark the moment and
  carry the verdict. An event that carries a ``duration`` gives its span that length.

Nothing is measured until :func:`install` runs, and when nothing listens the managers and
guards pay one attribute check per event. Names and attributes: ``docs/observability.md``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from opentelemetry import metrics as otel_metrics
from opentelemetry import trace
from opentelemetry.metrics import Counter, Histogram, MeterProvider
from opentelemetry.trace import SpanKind, Status, StatusCode, TracerProvider

from fence._clock import Clock, SystemClock
from fence._events import Event, EventBus, EventKind, default_bus
from fence._observe import METRICS, Installation, Measurements, Metric

__all__ = ["ACQUIRE", "RELEASE", "RETRY_EVENT", "WRITE", "OTelInstrumentation", "install"]

#: Name of the span of a granted acquire, from the start of the call to the grant.
ACQUIRE = "iofence.acquire"
#: Name of the span of a release.
RELEASE = "iofence.release"
#: Name of the span of a guarded write, accepted or rejected (the verdict is an attribute).
WRITE = "iofence.write"
#: Name of the span event added to the current span when a retry policy runs work again.
RETRY_EVENT = "iofence.retry"

_SCOPE = "iofence"


def _version() -> str:
    import fence  # a module-level import would be circular while fence is loading

    return fence.__version__


class OTelInstrumentation(Installation):
    """The installed instrumentation; :meth:`uninstall` stops it.

    OpenTelemetry has no way to remove an instrument from a meter: after
    :meth:`uninstall` the instruments stay, and record nothing more.

    Attributes:
        tracer: the tracer spans come from, or ``None`` when traces are off.
        instruments: each OpenTelemetry ``Counter`` or ``Histogram`` by name; empty when
            metrics are off.
    """

    def __init__(
        self,
        bus: EventBus,
        tracer: trace.Tracer | None,
        meter: otel_metrics.Meter | None,
        measure: Measurements,
    ) -> None:
        self.tracer = tracer
        self.instruments: dict[str, Counter | Histogram] = {}
        if meter is not None:
            for metric in METRICS:
                if metric.kind == "counter":
                    self.instruments[metric.name] = meter.create_counter(
                        metric.name, metric.unit, metric.description
                    )
                else:
                    self.instruments[metric.name] = meter.create_histogram(
                        metric.name,
                        metric.unit,
                        metric.description,
                        explicit_bucket_boundaries_advisory=metric.buckets,
                    )
        self._measure = measure
        # Per label set: the instrument's add/record and the attributes, built once.
        self._record: dict[
            tuple[Metric, tuple[str, ...]],
            tuple[Callable[[float, dict[str, str]], None], dict[str, str]],
        ] = {}
        self._waited: dict[tuple[str, str, int | None], None] = {}
        self._lock = threading.Lock()
        super().__init__(bus, self._on_event)

    def _on_event(self, event: Event) -> None:
        if self.instruments:
            record = self._record
            for metric, values, value in self._measure(event):
                key = (metric, values)
                found = record.get(key)
                if found is None:
                    found = record[key] = self._recorder(metric, values)
                fn, attributes = found
                fn(value, attributes)
        if self.tracer is not None:
            self._trace(self.tracer, event)

    def _recorder(
        self, metric: Metric, values: tuple[str, ...]
    ) -> tuple[Callable[[float, dict[str, str]], None], dict[str, str]]:
        labels = self._measure.label_dict(metric, values)
        attributes = {f"iofence.{k}": v for k, v in labels.items() if v != ""}
        instrument = self.instruments[metric.name]
        return (
            instrument.add if isinstance(instrument, Counter) else instrument.record
        ), attributes

    def _trace(self, tracer: trace.Tracer, event: Event) -> None:
        kind = event.kind
        if kind is EventKind.WAITED:
            with self._lock:  # ACQUIRED follows at once, in the same thread or task
                self._waited[(event.source, event.scope, event.token)] = None
                if len(self._waited) > 1024:  # an ACQUIRED that never came: stay bounded
                    del self._waited[next(iter(self._waited))]
            return
        attributes: dict[str, Any]
        error: tuple[str, str] | None = None
        if kind is EventKind.ACQUIRED:
            key = (event.source, event.scope, event.token)
            with self._lock:
                waited = key in self._waited
                self._waited.pop(key, None)
            name = ACQUIRE
            attributes = _lock_attributes(event)
            attributes["iofence.waited"] = waited
        elif kind is EventKind.RELEASED:
            name = RELEASE
            held = bool(event.detail.get("held", True))
            attributes = _lock_attributes(event)
            attributes["iofence.held"] = held
            if not held:
                error = ("fence.NotOwnerError", "the lease was no longer held when released")
        elif kind is EventKind.WRITE_ACCEPTED or kind is EventKind.WRITE_REJECTED:
            name = WRITE
            attributes = {"iofence.guard": event.source, "iofence.scope": event.scope}
            if event.token is not None:
                attributes["iofence.token"] = event.token
            op = event.detail.get("op")
            if isinstance(op, str):
                attributes["iofence.operation"] = op
            if kind is EventKind.WRITE_ACCEPTED:
                attributes["iofence.verdict"] = "accepted"
            else:
                reason = str(event.detail.get("reason", ""))
                attributes["iofence.verdict"] = "rejected"
                attributes["iofence.reason"] = reason
                fence = event.detail.get("fence")
                if isinstance(fence, int):
                    attributes["iofence.fence"] = fence
                error = ("fence.StaleTokenError", reason)
        elif kind is EventKind.RETRYING:
            span = trace.get_current_span()
            if span.is_recording():
                span.add_event(
                    RETRY_EVENT,
                    {
                        "iofence.attempt": int(event.detail.get("attempt", 0)),
                        "iofence.error": str(event.detail.get("error", "")),
                        "iofence.delay": event.duration or 0.0,
                    },
                )
            return
        else:
            return
        end = self._now_ns()
        start = end if event.duration is None else end - round(event.duration * 1e9)
        span = tracer.start_span(name, kind=SpanKind.INTERNAL, start_time=start)
        if span.is_recording():
            span.set_attributes(attributes)
            if error is not None:
                span.set_attribute("error.type", error[0])
                span.set_status(Status(StatusCode.ERROR, error[1]))
        span.end(end_time=end)

    def _now_ns(self) -> int:
        clock = self._measure.clock
        if isinstance(clock, SystemClock):
            return time.time_ns()
        return round(clock.time() * 1e9)


def _lock_attributes(event: Event) -> dict[str, Any]:
    attributes: dict[str, Any] = {"iofence.backend": event.source, "iofence.resource": event.scope}
    if event.token is not None:
        attributes["iofence.token"] = event.token
    return attributes


def install(
    tracer_provider: TracerProvider | None = None,
    meter_provider: MeterProvider | None = None,
    bus: EventBus | None = None,
    *,
    traces: bool = True,
    metrics: bool = True,
    group: Callable[[str], str] | None = None,
    clock: Clock | None = None,
) -> OTelInstrumentation:
    """Trace and measure what iofence does, through the OpenTelemetry API.

    Args:
        tracer_provider: where spans go (default: the global tracer provider).
        meter_provider: where metrics go (default: the global meter provider).
        bus: the event bus to listen to (default: :data:`fence.default_bus`).
        traces: create spans for acquires, releases and guarded writes.
        metrics: record the counters and histograms (turn off if
            :mod:`fence.prometheus` already counts them).
        group: maps a lock's resource or a guard's fence scope to a value with few
            distinct values, added to the metrics as ``iofence.group`` (spans always carry
            the full resource). Without it no metric carries the resource.
        clock: the clock for hold times, hand-offs and span timestamps (default: the
            system's); pass the managers' clock if they run on a :class:`fence.ManualClock`.

    Returns:
        The installed instrumentation; :meth:`OTelInstrumentation.uninstall` stops it.

    Example::

        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor, ConsoleSpanExporter

        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
        with fence.otel.install(tracer_provider=provider, metrics=False):
            with MemoryLockManager().lock("order:42"):
                pass
    """
    version = _version()
    tracer = trace.get_tracer(_SCOPE, version, tracer_provider) if traces else None
    meter = otel_metrics.get_meter(_SCOPE, version, meter_provider) if metrics else None
    return OTelInstrumentation(bus or default_bus, tracer, meter, Measurements(clock, group))
