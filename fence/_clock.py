"""Clocks. Every time-dependent piece of iofence takes one, so tests never patch ``time``."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Protocol, runtime_checkable

__all__ = ["Clock", "ManualClock", "SystemClock", "system_clock"]


@runtime_checkable
class Clock(Protocol):
    """What iofence reads time from. Inheriting from this class is optional.

    ``monotonic()`` measures lease deadlines and waits; ``time()`` is wall-clock seconds
    since the epoch and is used only where a backend would use its own clock (the in-memory
    backend's hybrid tokens).
    """

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back."""
        ...

    def time(self) -> float:
        """Seconds since the Unix epoch."""
        ...


class SystemClock:
    """The process's clocks: :func:`time.monotonic` and :func:`time.time`."""

    def monotonic(self) -> float:
        """Return :func:`time.monotonic`."""
        return time.monotonic()

    def time(self) -> float:
        """Return :func:`time.time`."""
        return time.time()

    def subscribe(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Real time needs no wake-ups: return a no-op unsubscribe."""
        return _noop


def _noop() -> None:
    return None


#: The shared default clock.
system_clock = SystemClock()


class ManualClock:
    """A clock that moves only when told to.

    Waits inside iofence re-check a manual clock whenever it is advanced, so a test can
    expire a lease, time out an acquire, or fire a renewal deterministically::

        clock = ManualClock()
        manager = MemoryLockManager(clock=clock)
        lease = manager.acquire("job", ttl=10)
        clock.advance(11)          # the holder "paused" for 11 s
        assert not lease.valid

    Args:
        start: the initial ``monotonic()`` value.
        wall: the initial ``time()`` value (seconds since the epoch).
    """

    def __init__(self, start: float = 1000.0, wall: float = 1_767_225_600.0) -> None:
        self._mono = float(start)
        self._offset = float(wall) - float(start)
        self._lock = threading.Lock()
        self._listeners: list[Callable[[], None]] = []

    def monotonic(self) -> float:
        """The current manual time."""
        return self._mono

    def time(self) -> float:
        """Wall time, moving in step with :meth:`monotonic`."""
        return self._mono + self._offset

    def advance(self, seconds: float) -> None:
        """Move the clock forward and wake every wait that depends on it.

        Raises:
            ValueError: ``seconds`` is negative; a monotonic clock never goes back.
        """
        if seconds < 0:
            raise ValueError("a monotonic clock cannot go back")
        with self._lock:
            self._mono += seconds
            listeners = list(self._listeners)
        for callback in listeners:
            callback()

    def set_wall(self, wall: float) -> None:
        """Jump the wall clock (only ``time()``), e.g. to simulate an NTP step backwards."""
        with self._lock:
            self._offset = float(wall) - self._mono

    def subscribe(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call ``callback`` after every :meth:`advance`; return a function that unsubscribes."""
        with self._lock:
            self._listeners.append(callback)

        def unsubscribe() -> None:
            with self._lock:
                try:
                    self._listeners.remove(callback)
                except ValueError:
                    pass

        return unsubscribe


def subscribe(clock: Clock, callback: Callable[[], None]) -> Callable[[], None]:
    """Subscribe to a clock's advances if it has them (manual clocks); else a no-op."""
    sub = getattr(clock, "subscribe", None)
    if sub is None:
        return _noop
    result: Callable[[], None] = sub(callback)
    return result
