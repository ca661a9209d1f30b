"""``fence.prometheus``: real acquires and guarded writes, scraped from a real registry's
text exposition (``generate_latest``) and read back with prometheus_client's own parser.

The managers run on a manual clock, and so does the collector, so every duration in the
scrape is exact.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import Column, Integer, MetaData, Table, create_engine

import fence.prometheus
from fence import (
    ConfigurationError,
    EventBus,
    EventKind,
    ManualClock,
    MemoryBackend,
    MemoryLockManager,
    NotOwnerError,
    RetryPolicy,
    StaleTokenError,
)
from fence.adapters.sql import RowGuard, fence_column
from fence.testing import EventRecorder, MemoryGuard
from tests._compat import join, spawn

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(registry: CollectorRegistry) -> Samples:
    text = generate_latest(registry).decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def wait_until(predicate: Callable[[], object]) -> None:
    end = time.monotonic() + 30  # a bound against a hang, not a measurement
    while not predicate():
        assert time.monotonic() < end
        time.sleep(0.001)


def test_acquires_waits_holds_hand_offs_and_writes_in_the_scrape() -> None:
    clock = ManualClock()
    bus = EventBus()
    manager = MemoryLockManager(clock=clock, events=bus)
    store = MemoryGuard(events=bus)
    registry = CollectorRegistry()
    with fence.prometheus.install(registry, bus, clock=clock):
        first = manager.acquire("order:42", ttl=10)
        store.write("order:42", first.token, "A")
        waiting = spawn(lambda: manager.acquire("order:42", ttl=10))
        wait_until(lambda: manager.backend._waiters.get("order:42"))  # it waits now
        clock.advance(2.0)
        first.release()  # held 2 s; the waiter is let in at once
        second = join(waiting)
        store.write("order:42", second.token, "B")
        with pytest.raises(StaleTokenError):
            store.write("order:42", first.token, "A, late")  # STALE
        with pytest.raises(StaleTokenError):
            store.update("order:43", second.token, str.upper)  # MISSING
        clock.advance(3.0)
        second.release()  # held 3 s
        job = manager.acquire("job", ttl=10)
        job.renew()
        clock.advance(11.0)
        assert job.wait_lost(timeout=0)  # lost after 11 s
        with pytest.raises(NotOwnerError):
            job.release()
        manager.revoke("order:42")
        samples = scrape(registry)

    memory = {"backend": "memory"}
    assert value(samples, "iofence_lock_acquires_total", **memory) == 3
    assert value(samples, "iofence_lock_waits_total", **memory) == 1
    assert value(samples, "iofence_lock_acquire_duration_seconds_count", **memory) == 3
    assert value(samples, "iofence_lock_acquire_duration_seconds_sum", **memory) == 2.0
    assert value(samples, "iofence_lock_handoff_duration_seconds_count", **memory) == 1
    assert value(samples, "iofence_lock_handoff_duration_seconds_sum", **memory) == 0.0
    assert value(samples, "iofence_lock_hold_duration_seconds_count", **memory) == 3
    assert value(samples, "iofence_lock_hold_duration_seconds_sum", **memory) == 16.0
    hold_buckets = {
        le: value(samples, "iofence_lock_hold_duration_seconds_bucket", le=le, **memory)
        for le in ("1.0", "5.0", "10.0", "30.0", "+Inf")
    }
    assert hold_buckets == {"1.0": 0, "5.0": 2, "10.0": 2, "30.0": 3, "+Inf": 3}
    releases = "iofence_lock_releases_total"
    assert value(samples, releases, outcome="released", **memory) == 2
    assert value(samples, releases, outcome="not_held", **memory) == 1
    assert value(samples, "iofence_lock_renewals_total", outcome="renewed", **memory) == 1
    assert value(samples, "iofence_lock_losses_total", **memory) == 1
    assert value(samples, "iofence_lock_revocations_total", **memory) == 1
    writes = "iofence_guard_writes_total"
    guard = {"guard": "memory-guard"}
    assert value(samples, writes, verdict="accepted", reason="", **guard) == 2
    assert value(samples, writes, verdict="rejected", reason="STALE", **guard) == 1
    assert value(samples, writes, verdict="rejected", reason="MISSING", **guard) == 1
    assert not any(name == writes and ("reason", "UNVERIFIABLE") in ls for name, ls in samples)


def test_a_sql_guards_writes_are_counted(tmp_path: Path) -> None:
    bus = EventBus()
    metadata = MetaData()
    accounts = Table(
        "accounts",
        metadata,
        Column("id", Integer, primary_key=True),
        Column("balance", Integer, nullable=False),
        fence_column(),
    )
    engine = create_engine(f"sqlite:///{tmp_path / 'metrics.db'}")
    metadata.create_all(engine)
    registry = CollectorRegistry()
    with fence.prometheus.install(registry, bus), engine.begin() as conn:
        guard = RowGuard(conn, accounts, events=bus)
        guard.upsert(5, {"id": 1, "balance": 10})
        with pytest.raises(StaleTokenError):
            guard.update(1, 4, {"balance": 0})
        samples = scrape(registry)
    engine.dispose()
    writes = "iofence_guard_writes_total"
    assert value(samples, writes, guard="sql-guard", verdict="accepted", reason="") == 1
    assert value(samples, writes, guard="sql-guard", verdict="rejected", reason="STALE") == 1


def test_failed_renewals_and_the_loss_are_counted() -> None:
    bus = EventBus()
    backend = MemoryBackend()
    manager = MemoryLockManager(backend, renew=True, events=bus)
    registry = CollectorRegistry()
    with fence.prometheus.install(registry, bus), EventRecorder(bus) as events:
        lease = manager.acquire("r", ttl=0.5)
        backend.fail()  # every renewal fails until the lease runs out
        assert lease.wait_lost(timeout=10)
        samples = scrape(registry)
    backend.fail(None)
    manager.close()
    failures = len(events.of(EventKind.RENEW_FAILED))
    assert failures >= 1
    renewals = "iofence_lock_renewals_total"
    assert value(samples, renewals, backend="memory", outcome="failed") == failures
    assert value(samples, "iofence_lock_losses_total", backend="memory") == 1


def test_retries_are_counted_by_error() -> None:
    bus = EventBus()
    manager = MemoryLockManager(events=bus)
    registry = CollectorRegistry()
    runs = 0
    with fence.prometheus.install(registry, bus):
        for attempt in RetryPolicy(attempts=3, backoff=lambda n: 0.0, events=bus):
            with attempt, manager.lock("r") as lease:
                runs += 1
                if runs == 1:
                    raise StaleTokenError("r", lease.token, lease.token + 1)
        samples = scrape(registry)
    assert value(samples, "iofence_retries_total", error="StaleTokenError") == 1


def test_group_labels_by_a_bounded_name_never_the_raw_resource() -> None:
    bus = EventBus()
    manager = MemoryLockManager(events=bus)
    registry = CollectorRegistry()
    with fence.prometheus.install(registry, bus, group=lambda s: s.split(":", 1)[0]):
        for order in range(3):
            with manager.lock(f"order:{order}"):
                pass
        samples = scrape(registry)
    assert value(samples, "iofence_lock_acquires_total", backend="memory", group="order") == 3
    assert not any(("group", "order:1") in labels for _, labels in samples)


def test_uninstall_removes_the_metrics_and_a_second_install_is_refused() -> None:
    bus = EventBus()
    registry = CollectorRegistry()
    installed = fence.prometheus.install(registry, bus)
    MemoryLockManager(events=bus).acquire("r").release()
    with pytest.raises(ConfigurationError, match="already registered"):
        fence.prometheus.install(registry, bus)
    assert value(scrape(registry), "iofence_lock_acquires_total", backend="memory") == 1
    installed.uninstall()
    assert generate_latest(registry) == b""
    assert not bus.active
    with fence.prometheus.install(registry, bus):  # a fresh start is fine
        assert value(scrape(registry), "iofence_lock_acquires_total", backend="memory") is None


def test_the_default_registry_and_bus() -> None:
    with fence.prometheus.install() as installed:
        assert installed.registry is REGISTRY
        assert installed.bus is fence.default_bus
        MemoryLockManager().acquire("r").release()
        samples = scrape(REGISTRY)
        assert value(samples, "iofence_lock_acquires_total", backend="memory") == 1
    assert b"iofence_" not in generate_latest(REGISTRY)
