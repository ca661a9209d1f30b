"""Thread primitives with the same names as :mod:`fence._acompat`, for the generated sync code."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["Task", "Waiter", "cancel_after", "current_owner", "shield", "sleep", "spawn"]

T = TypeVar("T")

sleep = time.sleep


class Waiter:
    """A one-shot wake-up: :meth:`wake` from any thread, :meth:`wait` in one thread."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = threading.Event()

    def wake(self) -> None:
        """Wake the waiting thread."""
        self._event.set()

    def wait(self, timeout: float | None) -> bool:
        """Wait until woken or ``timeout`` seconds pass; return whether it was woken."""
        if timeout is not None and timeout <= 0:
            return self._event.is_set()
        return self._event.wait(timeout)


class Task:
    """A background daemon thread with a join."""

    __slots__ = ("_thread",)

    def __init__(self, thread: threading.Thread) -> None:
        self._thread = thread

    def join(self) -> None:
        """Wait for the thread to finish."""
        if self._thread is not threading.current_thread():
            self._thread.join()

    def done(self) -> bool:
        """Whether the thread has finished."""
        return not self._thread.is_alive()


def spawn(fn: Callable[..., None], *args: Any, name: str | None = None) -> Task:
    """Run ``fn(*args)`` in a daemon thread."""
    thread = threading.Thread(target=fn, args=args, name=name, daemon=True)
    thread.start()
    return Task(thread)


def shield(value: T) -> T:
    """Threads cannot be cancelled from outside: nothing to shield."""
    return value


def current_owner() -> object:
    """The thread that owns what it acquires."""
    return threading.current_thread()


def cancel_after(seconds: float) -> contextlib.nullcontext[None]:
    """A blocking call cannot be cut off from outside: the driver's socket timeouts bound it."""
    return contextlib.nullcontext()
