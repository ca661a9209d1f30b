"""The Redis lock manager's own connections: a bounded pool and a pub/sub connection.

Used by a manager built from a plain ``redis://`` or ``unix://`` URL (see
:func:`fence._resp.parse_url`). Every request has a deadline (``time.monotonic()``), which
the manager derives from the caller's timeout. The pool never opens more than
``max_connections`` connections: callers queue for them in arrival order, releases and
renewals first, until their deadline. The protocol is in :mod:`fence._resp`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

from fence._acompat import Stream, Waiter, open_stream
from fence._deadline import time_left
from fence._resp import (
    MORE,
    Address,
    ConnectionFailure,
    PoolExhausted,
    Reader,
    RespError,
    failure,
    handshake,
    pack,
)

__all__ = [
    "AsyncRespClient",
    "AsyncRespConnection",
    "AsyncRespPool",
    "AsyncRespSubscriber",
]


class AsyncRespConnection:
    """One connection to Redis: one request at a time, each with its own deadline.

    A request that fails or times out leaves the connection unusable (its reply may still
    come), and marks it broken; the pool then closes it.
    """

    __slots__ = ("_reader", "_stream", "address", "broken")

    def __init__(self, address: Address, stream: Stream) -> None:
        self.address = address
        self._stream = stream
        self._reader = Reader()
        self.broken = False

    @classmethod
    async def open(cls, address: Address, deadline: float) -> AsyncRespConnection:
        """Connect, authenticate and select the database before ``deadline``.

        Raises:
            ConnectionFailure: the server refused, failed or did not answer (``sent`` False).
            RespError: it refused the credentials or the database.
        """
        try:
            stream = await open_stream(
                address.host, address.port, address.path, deadline - time.monotonic()
            )
        except (OSError, TimeoutError) as exc:
            raise failure(address, exc, sent=False) from exc
        conn = cls(address, stream)
        try:
            for reply in await conn.requests(handshake(address), deadline, sent=False):
                if isinstance(reply, RespError):
                    raise reply
        except BaseException:
            conn.close()
            raise
        return conn

    async def request(self, command: bytes, deadline: float) -> Any:
        """Send one packed command and return its reply (an error reply as a value).

        Raises:
            ConnectionFailure: the connection broke or the reply did not come before
                ``deadline``; ``sent`` says whether the command may have run.
        """
        stream = self._stream
        reader = self._reader
        if deadline <= time.monotonic():
            raise ConnectionFailure(
                f"no time left to send to {self.address}", sent=False, timed_out=True
            )
        written = False
        try:
            await stream.write(command)
            written = True
            reply = reader.get()
            while reply is MORE:
                reader.feed(await stream.read(deadline - time.monotonic()))
                reply = reader.get()
            return reply
        except BaseException as exc:
            self.close()
            if isinstance(exc, OSError | TimeoutError | ValueError):
                raise failure(self.address, exc, sent=written) from exc
            raise

    async def requests(
        self, commands: list[bytes], deadline: float, *, sent: bool = True
    ) -> list[Any]:
        """Send packed commands at once (a pipeline) and return their replies in order."""
        if not commands:
            return []
        if deadline <= time.monotonic():
            raise ConnectionFailure(
                f"no time left to send to {self.address}", sent=False, timed_out=True
            )
        written = False
        try:
            await self._stream.write(b"".join(commands))
            written = True
            replies = []
            reader = self._reader
            for _ in commands:
                reply = reader.get()
                while reply is MORE:
                    reader.feed(await self._stream.read(deadline - time.monotonic()))
                    reply = reader.get()
                replies.append(reply)
            return replies
        except BaseException as exc:
            self.close()
            if isinstance(exc, OSError | TimeoutError | ValueError):
                raise failure(self.address, exc, sent=sent and written) from exc
            raise

    def close(self) -> None:
        """Close the connection. Safe from any task or thread."""
        self.broken = True
        self._stream.close()


class _Slot:
    """A caller queued for a connection: handed one, or the right to open one."""

    __slots__ = ("conn", "may_open", "waiter")

    def __init__(self) -> None:
        self.waiter = Waiter()
        self.conn: AsyncRespConnection | None = None
        self.may_open = False


class AsyncRespPool:
    """At most ``max_connections`` connections, shared by every caller of one manager.

    A caller that finds them all busy queues (first come, first served; ``urgent``
    callers, releases and renewals, go to the front) until its deadline, then fails with
    :class:`fence._resp.PoolExhausted`, which names the limit. A connection whose request
    failed is closed, never reused.

    Args:
        address: the server.
        max_connections: the limit.
    """

    def __init__(self, address: Address, max_connections: int) -> None:
        self.address = address
        self.max_connections = max_connections
        self._lock = threading.Lock()
        self._idle: list[AsyncRespConnection] = []
        self._queue: deque[_Slot] = deque()
        self._count = 0
        self._closed = False

    async def get(self, deadline: float, *, urgent: bool = False) -> AsyncRespConnection:
        """A connection for one request, before ``deadline``.

        Raises:
            PoolExhausted: every connection stayed busy.
            ConnectionFailure, RespError: a new connection could not be opened.
        """
        with self._lock:
            if self._closed:
                raise ConnectionFailure("the manager is closed", sent=False)
            while self._idle:
                conn = self._idle.pop()
                if conn._stream.alive():
                    return conn
                conn.close()  # the server closed it (a restart): never send on it
                self._count -= 1
            slot = None
            if self._count < self.max_connections:
                self._count += 1
            else:
                slot = _Slot()
                if urgent:
                    self._queue.appendleft(slot)
                else:
                    self._queue.append(slot)
        if slot is not None:
            try:
                await slot.waiter.wait(deadline - time.monotonic())
            except BaseException:
                self._leave(slot)
                raise
            with self._lock:
                handed, may_open, closed = slot.conn, slot.may_open, self._closed
                if handed is None and not may_open and slot in self._queue:
                    self._queue.remove(slot)
            if handed is not None:
                return handed
            if not may_open:
                if closed:
                    raise ConnectionFailure("the manager is closed", sent=False)
                raise PoolExhausted(
                    f"all {self.max_connections} connections of the manager's pool to "
                    f"{self.address} stayed busy until the call's deadline (a client-side "
                    "limit: nothing was sent to Redis); raise max_connections",
                    limit=self.max_connections,
                )
        try:
            return await AsyncRespConnection.open(self.address, deadline)
        except BaseException:
            self._discard()
            raise

    def put(self, conn: AsyncRespConnection) -> None:
        """Give a connection back after its request: reuse it, or close it if it broke."""
        if conn.broken:
            self._discard()
            return
        with self._lock:
            if not self._closed:
                if self._queue:
                    slot = self._queue.popleft()
                    slot.conn = conn
                    slot.waiter.wake()
                else:
                    self._idle.append(conn)
                return
            self._count -= 1
        conn.close()

    def _leave(self, slot: _Slot) -> None:
        """A queued caller gave up (cancelled): pass on what it may have been handed."""
        with self._lock:
            if slot in self._queue:
                self._queue.remove(slot)
                return
        if slot.conn is not None:
            self.put(slot.conn)
        elif slot.may_open:
            self._discard()

    def _discard(self) -> None:
        with self._lock:
            if self._queue and not self._closed:
                slot = self._queue.popleft()
                slot.may_open = True  # it takes over the place of the closed connection
                slot.waiter.wake()
                return
            self._count -= 1

    async def request(
        self, command: bytes, deadline: float, *, urgent: bool = False, resend: bool = False
    ) -> Any:
        """Run one packed command on a pooled connection; see
        :meth:`AsyncRespConnection.request`.

        With ``resend``, a command whose connection the server closed under it (a restart
        closes every connection, and an idle one can look open until its first read) is
        sent once more on a new connection: only for a command that is safe to run twice.
        """
        conn = await self.get(deadline, urgent=urgent)
        try:
            return await conn.request(command, deadline)
        except ConnectionFailure as exc:
            if not (resend and exc.closed):
                raise
        finally:
            self.put(conn)
        self._drop_idle()  # opened before the same restart, most likely closed as well
        conn = await self.get(deadline, urgent=urgent)
        try:
            return await conn.request(command, deadline)
        finally:
            self.put(conn)

    def _drop_idle(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
            self._count -= len(idle)
        for conn in idle:
            conn.close()

    async def requests(self, commands: list[bytes], deadline: float) -> list[Any]:
        """Run packed commands as one pipeline on a pooled connection."""
        conn = await self.get(deadline)
        try:
            return await conn.requests(commands, deadline)
        finally:
            self.put(conn)

    @property
    def connections(self) -> int:
        """How many connections are open, opening or in use."""
        return self._count

    def close(self) -> None:
        """Close the idle connections; the busy ones close when they come back."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
            self._count -= len(idle)
            queue, self._queue = self._queue, deque()
        for conn in idle:
            conn.close()
        for slot in queue:
            slot.waiter.wake()


class AsyncRespSubscriber:
    """A connection in pub/sub mode, of its own (never one from the pool).

    Any task or thread may (un)subscribe with :meth:`send`; one reader takes the
    confirmations and messages with :meth:`read`.
    """

    def __init__(self, conn: AsyncRespConnection) -> None:
        self._conn = conn
        self._write_lock = threading.Lock()

    @classmethod
    async def open(cls, address: Address, deadline: float) -> AsyncRespSubscriber:
        """Open the connection before ``deadline``."""
        return cls(await AsyncRespConnection.open(address, deadline))

    async def send(self, *args: object) -> None:
        """Send ``SUBSCRIBE``, ``UNSUBSCRIBE`` or ``PING``; the answer comes to :meth:`read`.

        It never waits for the connection (safe to call while another task reads).

        Raises:
            ConnectionFailure: the connection broke.
        """
        data = pack(*args)
        conn = self._conn
        try:
            with self._write_lock:
                conn._stream.write_now(data)
        except OSError as exc:
            conn.close()
            raise failure(conn.address, exc, sent=False) from exc

    async def read(self, timeout: float) -> list[Any] | None:
        """The next push (``[b"message", channel, payload]``, ``[b"subscribe", channel,
        count]``...), or ``None`` if nothing complete came within ``timeout`` seconds.

        Raises:
            ConnectionFailure: the connection broke or was closed.
        """
        conn = self._conn
        reader = conn._reader
        reply = reader.get()
        if reply is MORE:
            if conn.broken:
                raise ConnectionFailure("the subscriber connection was closed", sent=False)
            try:
                reader.feed(await conn._stream.read(timeout))
            except TimeoutError:
                return None
            except (OSError, ValueError) as exc:
                conn.close()
                raise failure(conn.address, exc, sent=False) from exc
            reply = reader.get()
            if reply is MORE:
                return None
        if isinstance(reply, RespError):
            raise reply
        return reply if isinstance(reply, list) else [reply]

    def close(self) -> None:
        """Close the connection; a read blocked on it (in another task or thread) ends."""
        self._conn.close()


class AsyncRespClient:
    """The few commands the Redis lock manager sends, over :class:`AsyncRespPool`.

    It offers the part of redis-py's client interface that the drivers use besides the
    scripts (``script_load``, ``config_get``, ``execute_command``), so they work with
    either.

    Args:
        address: the server.
        max_connections: the pool's limit.
        socket_timeout: the longest a request may take when the caller sets no deadline.
    """

    def __init__(self, address: Address, *, max_connections: int, socket_timeout: float) -> None:
        self.address = address
        self.socket_timeout = socket_timeout
        self.pool = AsyncRespPool(address, max_connections)

    def __repr__(self) -> str:
        limit = self.pool.max_connections
        return f"<{type(self).__name__} {self.address} max_connections={limit}>"

    async def execute_command(self, *args: object) -> Any:
        """Run one command within ``socket_timeout`` (or the caller's deadline, if nearer:
        :mod:`fence._deadline`); an error reply is raised as :class:`fence._resp.RespError`."""
        deadline = time.monotonic() + time_left(self.socket_timeout)
        reply = await self.pool.request(pack(*args), deadline)
        if isinstance(reply, RespError):
            raise reply
        return reply

    async def script_load(self, script: str) -> Any:
        """``SCRIPT LOAD``."""
        return await self.execute_command("SCRIPT", "LOAD", script)

    async def config_get(self, name: str) -> dict[bytes, bytes]:
        """``CONFIG GET name`` as a dict."""
        reply = await self.execute_command("CONFIG", "GET", name)
        return dict(zip(reply[::2], reply[1::2], strict=True))

    async def aclose(self) -> None:
        """Close every connection of the pool."""
        self.pool.close()
