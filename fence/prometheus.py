"""Prometheus metrics from iofence's event bus (the ``iofence[prometheus]`` extra).

One call subscribes a collector to the event bus and registers its counters and
histograms in a prometheus_client registry::

    import fence.prometheus
    from prometheus_client import start_http_server

    fence.prometheus.install()      # prometheus_client's default registry, fence.default_bus
    start_http_server(9464)

``import fence`` never imports prometheus_client; only this module does. Nothing is
measured until :func:`install` runs, and when nothing listens the managers and guards pay
one attribute check per event. The metric names, labels and buckets are listed in
``docs/observability.md``; the same measurements reach OpenTelemetry through
:mod:`fence.otel`.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram

from fence._clock import Clock
from fence._errors import ConfigurationError
from fence._events import Event, EventBus, default_bus
from fence._observe import METRICS, Installation, Measurements, Metric

__all__ = ["PrometheusMetrics", "install"]


class PrometheusMetrics(Installation):
    """The installed collector: its instruments, and :meth:`uninstall` to remove them.

    Use it as a context manager to uninstall at the end of the block (tests do).

    Attributes:
        registry: the registry the instruments are registered in (``None``: none).
        instruments: each prometheus_client ``Counter`` or ``Histogram``, by its
            OpenTelemetry-style name (``"iofence.lock.acquires"``).
    """

    def __init__(
        self,
        registry: CollectorRegistry | None,
        bus: EventBus,
        measure: Measurements,
    ) -> None:
        self.registry = registry
        self.instruments: dict[str, Counter | Histogram] = {}
        try:
            for metric in METRICS:
                self.instruments[metric.name] = _instrument(metric, measure, registry)
        except ValueError as exc:  # a name taken in the registry
            self._unregister()
            raise ConfigurationError(
                f"iofence metrics are already registered in {registry!r} ({exc}); "
                "uninstall the first collector, or install into another registry"
            ) from exc
        by_metric = {metric: self.instruments[metric.name] for metric in METRICS}
        # One bound inc/observe per label set: the label sets are few, and labels() is slow.
        record: dict[tuple[Metric, tuple[str, ...]], Callable[[float], None]] = {}

        def listener(event: Event) -> None:
            for metric, values, value in measure(event):
                key = (metric, values)
                fn = record.get(key)
                if fn is None:
                    child = by_metric[metric].labels(*values)
                    fn = record[key] = child.inc if isinstance(child, Counter) else child.observe
                fn(value)

        super().__init__(bus, listener)

    def _removed(self) -> None:
        self._unregister()

    def _unregister(self) -> None:
        if self.registry is not None:
            for instrument in self.instruments.values():
                self.registry.unregister(instrument)
        self.instruments.clear()


def _instrument(
    metric: Metric, measure: Measurements, registry: CollectorRegistry | None
) -> Counter | Histogram:
    labels = measure.labels(metric)
    if metric.kind == "counter":
        return Counter(metric.prometheus_name, metric.description, labels, registry=registry)
    return Histogram(  # unit "s": prometheus_client appends _seconds to the name
        metric.prometheus_name,
        metric.description,
        labels,
        registry=registry,
        unit="seconds",
        buckets=metric.buckets,
    )


def install(
    registry: CollectorRegistry | None = REGISTRY,
    bus: EventBus | None = None,
    *,
    group: Callable[[str], str] | None = None,
    clock: Clock | None = None,
) -> PrometheusMetrics:
    """Count and time what iofence does, into ``registry``.

    Args:
        registry: where to register the instruments; prometheus_client's default registry
            unless given, ``None`` to register nowhere (read them from
            :attr:`PrometheusMetrics.instruments`).
        bus: the event bus to listen to (default: :data:`fence.default_bus`).
        group: maps a lock's resource or a guard's fence scope to a label value with few
            distinct values, added as the label ``group`` (e.g.
            ``lambda s: re.split(r"[:(]", s, maxsplit=1)[0]`` turns ``order:42`` into
            ``order`` and a row's scope ``jobs(42)`` into ``jobs``; a split on ``:`` alone
            would make one series per row). Without
            it no metric is labelled by resource: every order would be a series of its own.
        clock: the monotonic clock for hold times and hand-offs (default: the system's);
            pass the managers' clock if they run on a :class:`fence.ManualClock`.

    Returns:
        The installed collector; :meth:`PrometheusMetrics.uninstall` stops it and removes its
        instruments from ``registry``.

    Raises:
        ConfigurationError: ``registry`` already holds iofence's metrics.

    Example::

        from prometheus_client import CollectorRegistry, generate_latest

        registry = CollectorRegistry()
        with fence.prometheus.install(registry):
            with MemoryLockManager().lock("order:42"):
                pass
            print(generate_latest(registry).decode())
    """
    return PrometheusMetrics(registry, bus or default_bus, Measurements(clock, group))
