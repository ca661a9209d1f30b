"""asyncio primitives used by the ``_async`` sources.

``tools/async_to_sync.py`` rewrites ``_acompat`` to ``_compat``: the two modules expose the
same names, so the generated sync code runs on threads where the source runs on tasks.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Coroutine, Sequence
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

sleep = asyncio.sleep


class Waiter:
    """A one-shot wake-up: :meth:`wake` from any thread, :meth:`wait` in one event loop."""

    __slots__ = ("_fut", "_loop")

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._fut: asyncio.Future[None] = self._loop.create_future()

    def _set(self) -> None:
        if not self._fut.done():
            self._fut.set_result(None)

    def wake(self) -> None:
        """Wake the waiting task. Safe from any thread, and after the wait is over."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            self._set()
            return
        try:
            self._loop.call_soon_threadsafe(self._set)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass

    async def wait(self, timeout: float | None) -> bool:
        """Wait until woken or ``timeout`` seconds pass; return whether it was woken."""
        if self._fut.done():
            return True
        if timeout is not None and timeout <= 0:
            return False
        try:
            async with asyncio.timeout(timeout):
                await asyncio.shield(self._fut)
        except TimeoutError:
            return self._fut.done()
        return True


class Task:
    """A background task with a join."""

    __slots__ = ("_task",)

    def __init__(self, task: asyncio.Task[None]) -> None:
        self._task = task

    async def join(self) -> None:
        """Wait for the task to finish. Never raises the task's own error."""
        if self._task is asyncio.current_task():
            return
        # The task reports its own failures; a join only waits.
        await asyncio.wait([self._task])

    def done(self) -> bool:
        """Whether the task has finished."""
        return self._task.done()


def spawn(
    fn: Callable[..., Coroutine[Any, Any, None]], *args: Any, name: str | None = None
) -> Task:
    """Run ``fn(*args)`` in the background, as a task of the running loop."""
    return Task(asyncio.get_running_loop().create_task(fn(*args), name=name))


async def shield(aw: Awaitable[T]) -> T:
    """Await ``aw`` so that cancelling the caller does not cancel it (releases, revokes)."""
    return await asyncio.shield(aw)


def current_owner() -> object:
    """The task that owns what it acquires: never a thread-local (C11)."""
    task = asyncio.current_task()
    if task is None:  # pragma: no cover - asyncio always runs coroutines in a task
        raise RuntimeError("no running asyncio task")
    return task


def cancel_after(seconds: float) -> asyncio.Timeout:
    """Cancel the block after ``seconds`` and raise :class:`TimeoutError` in its place.

    A renewal that hangs past the lease's deadline is cut off, so the loss is reported on time.
    """
    return asyncio.timeout(seconds)


class FanOut:
    """Run several calls at once and collect every outcome: a result or an exception.

    The quorum manager sends one request to each node this way. Here the calls run as
    tasks of the running loop; the thread twin in :mod:`fence._compat` runs them on a small
    thread pool.

    Args:
        workers: how many calls may run at once (the thread twin's pool size).
    """

    __slots__ = ()

    def __init__(self, workers: int) -> None:
        del workers  # tasks need no pool

    async def run(self, calls: Sequence[Callable[[], Awaitable[T]]]) -> list[T | Exception]:
        """Start every call, wait for all of them; return their outcomes in order.

        An ``Exception`` a call raises is returned in its place; anything else (a
        cancellation) propagates.
        """
        outcomes = await asyncio.gather(*(call() for call in calls), return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException) and not isinstance(outcome, Exception):
                raise outcome
        return outcomes  # type: ignore[return-value]

    def close(self) -> None:
        """Nothing to stop: the calls ran as tasks."""


class ThreadResult(Protocol):
    """A result that a client library's own thread completes (kazoo's ``IAsyncResult``)."""

    def rawlink(self, callback: Callable[[Any], None]) -> None:
        """Call ``callback(self)`` once the result is set (on the library's thread)."""
        ...

    def unlink(self, callback: Callable[[Any], None]) -> None:
        """Forget a callback given to :meth:`rawlink`."""
        ...

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        """The value, or raise the stored exception."""
        ...


def _settle(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


async def completed(result: ThreadResult, timeout: float) -> Any:
    """Wait up to ``timeout`` seconds for ``result`` without blocking the event loop.

    The library's thread wakes the loop through ``call_soon_threadsafe``: no thread of the
    pool is parked on the wait. The thread twin in :mod:`fence._compat` blocks on it instead.

    Raises:
        TimeoutError: ``result`` was not set in time (the operation may still complete).
        Exception: whatever the operation failed with.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[None] = loop.create_future()

    def done(_: Any) -> None:
        try:
            loop.call_soon_threadsafe(_settle, future)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    result.rawlink(done)
    try:
        async with asyncio.timeout(max(timeout, 0.0)):
            await future
    finally:
        result.unlink(done)
    return result.get(block=False)
