"""Thread primitives with the same names as :mod:`fence._acompat`, for the generated sync code."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol, TypeVar

__all__ = [
    "FanOut",
    "Task",
    "ThreadResult",
    "Waiter",
    "cancel_after",
    "completed",
    "current_owner",
    "shield",
    "sleep",
    "spawn",
]

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


class FanOut:
    """Run several calls at once on a small thread pool and collect every outcome.

    The calling thread runs the last call itself, so ``n`` calls cost ``n - 1`` hand-offs
    to the pool. The pool's threads start on first use.

    Args:
        workers: the pool's size; more calls than that wait for a free thread.
    """

    __slots__ = ("_pool",)

    def __init__(self, workers: int) -> None:
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="fence")

    def run(self, calls: Sequence[Callable[[], T]]) -> list[T | Exception]:
        """Run every call, wait for all of them; return their outcomes in order.

        An ``Exception`` a call raises is returned in its place.
        """
        if not calls:
            return []
        futures: list[Future[T]] = [self._pool.submit(call) for call in calls[:-1]]
        try:
            last: T | Exception = calls[-1]()
        except Exception as exc:
            last = exc
        outcomes: list[T | Exception] = []
        for future in futures:
            try:
                outcomes.append(future.result())
            except Exception as exc:
                outcomes.append(exc)
        outcomes.append(last)
        return outcomes

    def close(self) -> None:
        """Stop the pool's threads once the calls under way finish."""
        self._pool.shutdown(wait=True)


class ThreadResult(Protocol):
    """A result that a client library's own thread completes (kazoo's ``IAsyncResult``)."""

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the result is set or ``timeout`` passes; return whether it is set."""
        ...

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        """The value, or raise the stored exception."""
        ...


def completed(result: ThreadResult, timeout: float) -> Any:
    """Block up to ``timeout`` seconds for ``result``; the twin of the asyncio bridge.

    Raises:
        TimeoutError: ``result`` was not set in time (the operation may still complete).
        Exception: whatever the operation failed with.
    """
    if not result.wait(max(timeout, 0.0)):
        raise TimeoutError(f"no answer within {timeout:.3f} s")
    return result.get(block=False)
