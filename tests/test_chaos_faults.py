"""The fault thread of ``fence chaos``: each fault leaves the servers ``--fault-every``
seconds after it ends, however long it took (a server slow to restart on a loaded
machine must not leave the workers no time to work between faults)."""

from __future__ import annotations

import itertools
import time

from fence._chaos.controller import Fault, FaultInjector


def test_each_fault_is_followed_by_a_full_interval_however_long_it_took() -> None:
    spans: list[tuple[float, float]] = []

    def slow_restart() -> str:
        start = time.monotonic()
        time.sleep(0.3)  # longer than the interval
        spans.append((start, time.monotonic()))
        return "restarted"

    injector = FaultInjector([Fault("kill", "x", slow_restart)], every=0.2, first=0.0, log=[])
    injector.start()
    end = time.monotonic() + 30.0
    while len(spans) < 3:
        assert time.monotonic() < end, "the fault thread stopped injecting"
        time.sleep(0.01)
    injector.finish()
    gaps = [after[0] - before[1] for before, after in itertools.pairwise(spans)]
    assert all(gap >= 0.2 for gap in gaps), gaps
    assert len(injector.done) == len(spans)
    assert injector.errors == []
