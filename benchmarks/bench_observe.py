#!/usr/bin/env python3
"""What the event bus and the metrics collectors cost a lock and a guarded write.

    python benchmarks/bench_observe.py [--quick]

In-process, no I/O, so the collectors' own cost is not hidden behind a round trip: the
in-memory manager's acquire+release pairs (two events each) and the in-memory guard's
writes (one event each), each variant on a bus of its own, interleaved:

- nothing listening: the bus's one attribute check per event (the baseline);
- a no-op listener: what building and handing out an event costs;
- ``fence.prometheus`` installed (its own registry);
- ``fence.otel`` installed on the SDK (a tracer provider without exporters, an in-memory
  metric reader): spans are created, timed and ended, measurements recorded;
- ``fence.otel`` with ``metrics=False``: the spans alone.

Ratio = rate / the rate with nothing listening.
"""

from __future__ import annotations

from collections.abc import Callable

import _harness
from _harness import Context, Row
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CollectorRegistry

import fence.otel
import fence.prometheus
from fence import EventBus, MemoryLockManager
from fence.testing import MemoryGuard

GROUP = "observe"
BASELINE = "nothing listening"
OTEL_TRACES = "fence.otel (SDK), spans only"


def _variants() -> tuple[dict[str, Callable[[], object]], dict[str, Callable[[], object]]]:
    pairs: dict[str, Callable[[], object]] = {}
    writes: dict[str, Callable[[], object]] = {}
    names = (BASELINE, "a no-op listener", "fence.prometheus", "fence.otel (SDK)", OTEL_TRACES)
    for name in names:
        bus = EventBus()
        if name == "a no-op listener":
            bus.subscribe(lambda event: None)
        elif name == "fence.prometheus":
            fence.prometheus.install(CollectorRegistry(), bus)
        elif name == "fence.otel (SDK)":
            fence.otel.install(
                TracerProvider(), MeterProvider(metric_readers=[InMemoryMetricReader()]), bus
            )
        elif name == OTEL_TRACES:
            fence.otel.install(TracerProvider(), bus=bus, metrics=False)
        manager = MemoryLockManager(ttl=30, events=bus)
        guard = MemoryGuard(events=bus)
        token = manager.acquire("bench:write").token

        def pair(manager: MemoryLockManager = manager) -> None:
            manager.acquire("bench:observe").release()

        def write(guard: MemoryGuard = guard, token: int = token) -> None:
            guard.write("bench:write", token, 1)

        pairs[name] = pair
        writes[name] = write
    return pairs, writes


def collect(ctx: Context) -> list[Row]:
    """Pairs and writes per second with each collector; see the module docstring."""
    pairs, writes = _variants()
    calls = ctx.n(20_000, 1_000)
    with _harness.timer(ctx, "acquire+release with collectors"):
        pair_rates = _harness.interleaved(pairs, calls=calls, repeats=ctx.repeats, batch=100)
    with _harness.timer(ctx, "guarded writes with collectors"):
        write_rates = _harness.interleaved(writes, calls=calls, repeats=ctx.repeats, batch=100)
    rows = _harness.rate_rows(
        GROUP, pair_rates, BASELINE, unit="pairs/s", prefix="memory acquire+release: "
    )
    rows += _harness.rate_rows(
        GROUP, write_rates, BASELINE, unit="writes/s", prefix="memory guard write: "
    )
    return rows


if __name__ == "__main__":
    raise SystemExit(_harness.standalone(collect, __doc__))
