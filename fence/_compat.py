"""Thread primitives with the same names as :mod:`fence._acompat`, for the generated sync code."""

from __future__ import annotations

import contextlib
import contextvars
import heapq
import itertools
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
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


def settle(value: T) -> T:
    """A thread is not cancelled from outside: the call has finished already."""
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
        # Each call runs in a copy of the caller's context, so it sees the call's deadline
        # (fence._deadline) as a task of the asyncio twin would.
        futures: list[Future[T]] = [
            self._pool.submit(contextvars.copy_context().run, call) for call in calls[:-1]
        ]
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


class Stream:
    """A blocking socket with a time limit on every read; the twin of the asyncio stream."""

    __slots__ = ("_sock",)

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def write(self, data: bytes) -> None:
        """Send all of ``data``."""
        self._sock.sendall(data)

    def write_now(self, data: bytes) -> None:
        """Send all of ``data`` (the name matches the asyncio twin, which does not wait)."""
        self._sock.sendall(data)

    def read(self, timeout: float) -> bytes:
        """The next bytes from the server, waiting at most ``timeout`` seconds.

        Raises:
            TimeoutError: nothing arrived in time (or ``timeout`` is not positive).
            ConnectionResetError: the server closed the connection.
        """
        if timeout <= 0:
            raise TimeoutError("no time left to wait for the reply")
        self._sock.settimeout(timeout)
        data = self._sock.recv(65536)
        if not data:
            raise ConnectionResetError("the server closed the connection")
        return data

    def alive(self) -> bool:
        """Whether the connection is still open, with nothing unread: a pooled connection
        whose server restarted is found out here, before a request is sent on it."""
        sock = self._sock
        try:
            sock.settimeout(0)
            sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return True
        except OSError:
            return False
        return False  # closed by the server (b""), or bytes nobody asked for

    def close(self) -> None:
        """Close at once. From another thread, it also ends a read blocked on the socket."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


def open_stream(host: str | None, port: int, path: str | None, timeout: float) -> Stream:
    """Connect to ``host:port`` (or the Unix socket ``path``) within ``timeout`` seconds.

    Raises:
        TimeoutError: the connection did not open in time.
        OSError: it was refused or failed.
    """
    if timeout <= 0:
        raise TimeoutError("no time left to connect")
    if path is not None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(path)
        except BaseException:
            sock.close()
            raise
    else:
        sock = socket.create_connection((host, port), timeout=timeout)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return Stream(sock)


class Alarm:
    """A call scheduled by :func:`call_later`; :meth:`cancel` stops it if not yet run."""

    __slots__ = ("_fn", "cancelled")

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn = fn
        self.cancelled = False

    def cancel(self) -> None:
        """Do not run the call (a no-op once it has run)."""
        self.cancelled = True


class _AlarmClock:
    """One daemon thread that runs every alarm of the process when it is due."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Alarm]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None

    def add(self, when: float, alarm: Alarm) -> None:
        with self._cond:
            heapq.heappush(self._heap, (when, next(self._seq), alarm))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="fence-alarms", daemon=True)
                self._thread.start()
            elif self._heap[0][2] is alarm:
                self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    while self._heap and self._heap[0][2].cancelled:
                        heapq.heappop(self._heap)
                    if not self._heap:
                        if not self._cond.wait(60.0) and not self._heap:
                            self._thread = None
                            return
                        continue
                    delay = self._heap[0][0] - time.monotonic()
                    if delay <= 0:
                        alarm = heapq.heappop(self._heap)[2]
                        break
                    self._cond.wait(delay)
            if not alarm.cancelled:
                alarm.cancelled = True
                try:
                    alarm._fn()
                except Exception:  # pragma: no cover - an alarm must not kill the clock
                    logging.getLogger("fence").exception("alarm %r failed", alarm._fn)


_alarms = _AlarmClock()


def call_later(seconds: float, fn: Callable[[], None]) -> Alarm:
    """Call ``fn()`` from a shared background thread in ``seconds`` unless the returned
    alarm is cancelled first. Used to cut off a blocking round trip at its deadline."""
    alarm = Alarm(fn)
    _alarms.add(time.monotonic() + max(seconds, 0.0), alarm)
    return alarm
