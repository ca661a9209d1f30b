"""asyncio primitives used by the ``_async`` sources.

``tools/async_to_sync.py`` rewrites ``_acompat`` to ``_compat``: the two modules expose the
same names, so the generated sync code runs on threads where the source runs on tasks.
"""

from __future__ import annotations

import asyncio
import select
import socket
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, Protocol, TypeVar

__all__ = [
    "Alarm",
    "FanOut",
    "Stream",
    "Task",
    "ThreadResult",
    "Waiter",
    "call_later",
    "cancel_after",
    "completed",
    "current_owner",
    "open_stream",
    "settle",
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


async def settle(aw: Awaitable[T]) -> T:
    """Await ``aw``; if the caller is cancelled meanwhile, let ``aw`` finish first, then
    raise the cancellation.

    For a call that runs on in a thread whatever happens to the task that awaits it (an
    aiosqlite statement): its outcome must be settled before a clean-up looks at what it
    did. A second cancellation stops the waiting.
    """
    task = asyncio.ensure_future(aw)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait([task])
        raise


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


_poll = getattr(select, "poll", None)  # not on Windows


class Stream:
    """A byte stream to a server (TCP or a Unix socket) with a time limit on every read.

    The thread twin in :mod:`fence._compat` wraps a blocking socket; both have the same
    methods, so the connection code in ``fence._async.resp`` is written once.
    """

    __slots__ = ("_poller", "_reader", "_writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._poller: Any = None  # a poll object for the socket, made at the first check

    async def write(self, data: bytes) -> None:
        """Send ``data`` (buffered; waits only while the transport's buffer is full)."""
        self._writer.write(data)
        await self._writer.drain()

    def write_now(self, data: bytes) -> None:
        """Send ``data`` without waiting for the transport's buffer to drain."""
        self._writer.write(data)

    async def read(self, timeout: float) -> bytes:
        """The next bytes from the server, waiting at most ``timeout`` seconds.

        Raises:
            TimeoutError: nothing arrived in time (or ``timeout`` is not positive).
            ConnectionResetError: the server closed the connection.
        """
        if timeout <= 0:
            raise TimeoutError("no time left to wait for the reply")
        async with asyncio.timeout(timeout):
            data = await self._reader.read(65536)
        if not data:
            raise ConnectionResetError("the server closed the connection")
        return data

    def alive(self) -> bool:
        """Whether the connection is still open, with nothing unread: a pooled connection
        whose server restarted is found out here, before a request is sent on it. The
        event loop may not have read the server's close yet (the restart happened while
        no task ran), so the socket itself is asked too, as the sync twin peeks at it."""
        if self._reader.at_eof() or self._writer.transport.is_closing():
            return False
        try:
            poller = self._poller
            if poller is None:
                sock = self._writer.get_extra_info("socket")
                if sock is None:
                    return True
                if _poll is None:
                    return not select.select([sock.fileno()], [], [], 0)[0]
                # poll, not select: no limit on the descriptor's number
                poller = self._poller = _poll()
                poller.register(sock.fileno(), select.POLLIN)
            readable = bool(poller.poll(0))
        except (OSError, ValueError):
            return False
        return not readable  # closed by the server, or bytes nobody asked for

    def close(self) -> None:
        """Close at once, without sending what is still buffered. Safe from any task."""
        self._writer.transport.abort()


async def open_stream(host: str | None, port: int, path: str | None, timeout: float) -> Stream:
    """Connect to ``host:port`` (or the Unix socket ``path``) within ``timeout`` seconds.

    Raises:
        TimeoutError: the connection did not open in time.
        OSError: it was refused or failed.
    """
    if timeout <= 0:
        raise TimeoutError("no time left to connect")
    async with asyncio.timeout(timeout):
        if path is not None:
            reader, writer = await asyncio.open_unix_connection(path)
        else:
            reader, writer = await asyncio.open_connection(host, port)
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return Stream(reader, writer)


Alarm = asyncio.TimerHandle


def call_later(seconds: float, fn: Callable[[], None]) -> Alarm:
    """Call ``fn()`` on the running loop in ``seconds`` unless the returned alarm is
    cancelled first (``alarm.cancel()``). Used to cut off a round trip at its deadline."""
    return asyncio.get_running_loop().call_later(max(seconds, 0.0), fn)
