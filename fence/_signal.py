"""A set-once signal that both threads and asyncio tasks can wait on."""

from __future__ import annotations

import threading
from typing import Protocol

__all__ = ["Signal", "Wakeable"]


class Wakeable(Protocol):
    """Anything with a thread-safe ``wake()``: the waiters of both compat modules."""

    def wake(self) -> None:
        """Wake whoever waits."""
        ...


class Signal:
    """A flag that is set once and wakes every attached waiter when it is."""

    __slots__ = ("_is_set", "_lock", "_waiters")

    def __init__(self) -> None:
        self._is_set = False
        self._lock = threading.Lock()
        self._waiters: list[Wakeable] = []

    def is_set(self) -> bool:
        """Whether :meth:`set` was called."""
        return self._is_set

    def set(self) -> bool:
        """Set the flag and wake all waiters; return ``False`` if it was already set."""
        with self._lock:
            if self._is_set:
                return False
            self._is_set = True
            waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            waiter.wake()
        return True

    def attach(self, waiter: Wakeable) -> bool:
        """Wake ``waiter`` when set. Return ``True`` (and attach nothing) if already set."""
        with self._lock:
            if self._is_set:
                return True
            self._waiters.append(waiter)
            return False

    def detach(self, waiter: Wakeable) -> None:
        """Stop waking ``waiter``."""
        with self._lock:
            try:
                self._waiters.remove(waiter)
            except ValueError:
                pass
