"""How long a loaded machine kept the test process from running.

A deadline test asserts that a call returns within its timeout plus a margin. On a loaded
machine the process itself may not run for a while, and that time is no fault of the code
under test. :class:`StallMeter` measures it: a thread asks to sleep a few milliseconds over
and over, and adds up how late it wakes. A test subtracts that from what it timed, so its
bound stays as tight as on a quiet machine.
"""

from __future__ import annotations

import threading
import time
from types import TracebackType

__all__ = ["StallMeter"]

#: The ticker's sleep: short enough to see a stall, long enough to cost nothing.
TICK = 0.005


class StallMeter:
    """Context manager: :attr:`seconds` is the time the process was kept waiting inside it."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, name="stall-meter", daemon=True)

    def _tick(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            time.sleep(TICK)
            self.seconds += max(0.0, time.monotonic() - start - TICK)

    def __enter__(self) -> StallMeter:
        self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        self._thread.join()
