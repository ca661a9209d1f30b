"""The SQL manager on SQLite when many things happen within one tick of its clock.

SQLite's clock (``julianday('now')``) moves in whole milliseconds. Here the clock is frozen
for the whole test (the connection's ``julianday`` replaced), which puts every call in one
tick:

- waiters that queue in one tick are served in the order they arrived;
- hybrid tokens issued in one tick after the table went back in time (a restored backup)
  still rise (C3).

The first waiter is a reader: on SQLite and PostgreSQL a writer takes a place in the
queue only beside readers (held or queued), as ``fence._rwlock.decide`` rules.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, event

from fence._sync.sql import SQLLockManager, make_engine

FROZEN = 2461000.5  # a julian day: 2026-02-... at midnight, fixed


@pytest.fixture
def frozen_engine(tmp_path: Path) -> Iterator[Engine]:
    engine = make_engine(f"sqlite:///{tmp_path / 'locks.db'}")

    @event.listens_for(engine, "connect")
    def freeze(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.create_function("julianday", -1, lambda *_args: FROZEN)

    yield engine
    engine.dispose()


def test_waiters_queued_in_one_clock_tick_are_served_in_arrival_order(
    frozen_engine: Engine,
) -> None:
    names = ["R1", "W1", "R2", "W2", "R3", "W3"]
    with SQLLockManager(frozen_engine, ttl=30, poll_interval=0.05) as manager:
        manager.create_table()
        driver = manager.driver
        queued: list[str] = []
        real_wait = driver.wait
        local = threading.local()

        def wait(*args: Any) -> Any:
            if getattr(local, "name", None) not in queued:
                queued.append(local.name)
            return real_wait(*args)

        driver.wait = wait  # type: ignore[method-assign]
        order: list[str] = []
        lock = threading.Lock()

        def waiter(name: str) -> None:
            local.name = name
            mode = "read" if name.startswith("R") else "write"
            with manager.lock("r", mode=mode, timeout=30), lock:
                order.append(name)

        first = manager.acquire("r", timeout=5)
        threads = []
        for name in names:
            thread = threading.Thread(target=waiter, args=(name,))
            thread.start()
            threads.append(thread)
            for _ in range(500):  # each one queues before the next arrives
                if name in queued:
                    break
                threading.Event().wait(0.01)
            assert name in queued
        first.release()
        for thread in threads:
            thread.join(30)
        # Each reader alone (a writer queued behind each one), each writer alone.
        assert order == names


def test_hybrid_tokens_issued_in_one_clock_tick_after_a_restore_still_rise(
    frozen_engine: Engine,
) -> None:
    with SQLLockManager(frozen_engine, ttl=30) as manager:
        manager.create_table()
        tokens = []
        for _ in range(3):
            lease = manager.acquire("r", timeout=5)
            tokens.append(lease.token)
            lease.release()
            with frozen_engine.begin() as conn:  # the backup from long ago
                conn.exec_driver_sql("UPDATE fence_leases SET token = 1")
        assert tokens == sorted(set(tokens)), tokens
