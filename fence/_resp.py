"""The Redis wire protocol (RESP2) for the lock manager's own connections, without I/O.

A Redis lock manager built from a plain ``redis://`` or ``unix://`` URL talks to Redis over
connections of its own (:mod:`fence._async.resp`): it sends a handful of commands, packed
here, and reads the replies with :class:`Reader`. Its hot path is two ``EVALSHA`` calls per
lease; a general client spends most of its time on what those calls do not need. Clients
given by the user, ``rediss://`` URLs and Redis Cluster keep going through redis-py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

__all__ = [
    "MORE",
    "Address",
    "ConnectionFailure",
    "PoolExhausted",
    "Reader",
    "RespError",
    "failure",
    "handshake",
    "pack",
    "parse_url",
]


class RespError(ResponseError):
    """An error reply from Redis (``-ERR ...``, ``-NOSCRIPT ...``).

    A redis-py ``ResponseError``, so that code written for redis-py's clients handles it.

    Attributes:
        message: the reply text.
        kind: its first word (``"ERR"``, ``"NOSCRIPT"``, ``"NOPERM"``, ``"READONLY"``...).
    """

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message
        self.kind = message.split(" ", 1)[0]


class ConnectionFailure(RedisConnectionError):
    """A connection could not be opened, or broke, or did not answer in time.

    A redis-py ``ConnectionError``, so that code written for redis-py's clients handles it.

    Attributes:
        sent: whether the request may have reached the server (its bytes were written);
            ``False`` means it certainly changed nothing.
        timed_out: the server did not answer within the time allowed.
        closed: the server closed a connection that had been open, under the request (a
            restart, an idle ``timeout``, ``CLIENT KILL``); a request that is safe to run
            twice may be sent again on a new connection.
    """

    def __init__(
        self, message: str, *, sent: bool, timed_out: bool = False, closed: bool = False
    ) -> None:
        super().__init__(message)
        self.sent = sent
        self.timed_out = timed_out
        self.closed = closed


def failure(address: Address, exc: BaseException, *, sent: bool) -> ConnectionFailure:
    """What an error of a connection to ``address`` means, as a :class:`ConnectionFailure`.

    Args:
        address: the server.
        exc: the error (``OSError``, ``TimeoutError``, ``ValueError`` for bytes that are not
            RESP2, or a :class:`ConnectionFailure` already).
        sent: whether the request's bytes may have reached the server.
    """
    if isinstance(exc, ConnectionFailure):
        return exc
    if isinstance(exc, TimeoutError):
        return ConnectionFailure(
            f"no answer from {address} in the time allowed", sent=sent, timed_out=True
        )
    detail = str(exc) or type(exc).__name__
    closed = isinstance(exc, ConnectionResetError | BrokenPipeError | ConnectionAbortedError)
    return ConnectionFailure(f"{type(exc).__name__}: {detail}", sent=sent, closed=closed)


class PoolExhausted(ConnectionFailure):
    """Every connection of the client's own pool stayed busy for the time allowed.

    Attributes:
        limit: the pool's ``max_connections``.
    """

    def __init__(self, message: str, *, limit: int) -> None:
        super().__init__(message, sent=False, timed_out=True)
        self.limit = limit


# -- commands -------------------------------------------------------------------------------


def _encode(value: object) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, int) and not isinstance(value, bool):
        return b"%d" % value
    if isinstance(value, float):
        return repr(value).encode()
    raise TypeError(f"cannot send {type(value).__name__} to Redis")


def pack(*args: object) -> bytes:
    """One command as RESP2 bytes: an array of bulk strings.

    ``str`` is sent as UTF-8, ``int`` and ``float`` as their decimal text.

    Example::

        >>> pack("GET", "k")
        b'*2\\r\\n$3\\r\\nGET\\r\\n$1\\r\\nk\\r\\n'
    """
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        data = _encode(arg)
        parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(parts)


def handshake(address: Address) -> list[bytes]:
    """The commands a new connection to ``address`` sends first: ``AUTH``, ``SELECT``."""
    hello = []
    if address.password is not None:
        if address.username:
            hello.append(pack("AUTH", address.username, address.password))
        else:
            hello.append(pack("AUTH", address.password))
    if address.db:
        hello.append(pack("SELECT", address.db))
    return hello


# -- replies --------------------------------------------------------------------------------


class _More:
    """The reader needs more bytes before it can return a reply."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "MORE"


#: What :meth:`Reader.get` returns while a reply is incomplete.
MORE: Any = _More()


def _parse(buf: bytearray, pos: int) -> tuple[Any, int]:
    end = buf.find(b"\r\n", pos)
    if end < 0:
        return MORE, pos
    kind = buf[pos]
    line = buf[pos + 1 : end]
    pos = end + 2
    if kind == 58:  # ':' integer
        return int(line), pos
    if kind == 36:  # '$' bulk string
        size = int(line)
        if size < 0:
            return None, pos
        stop = pos + size
        if len(buf) < stop + 2:
            return MORE, pos
        return bytes(buf[pos:stop]), stop + 2
    if kind == 42:  # '*' array
        count = int(line)
        if count < 0:
            return None, pos
        items = []
        for _ in range(count):
            item, pos = _parse(buf, pos)
            if item is MORE:
                return MORE, pos
            items.append(item)
        return items, pos
    if kind == 43:  # '+' simple string
        return bytes(line), pos
    if kind == 45:  # '-' error
        return RespError(line.decode("utf-8", "replace")), pos
    raise ValueError(f"not a RESP2 reply: {bytes(buf[pos - len(line) - 3 : end])!r}")


class Reader:
    """Turns the bytes read from a connection into replies, one at a time.

    Error replies come back as :class:`RespError` values (not raised), so a pipeline's
    other replies are still read. Example::

        reader = Reader()
        reader.feed(b":42\\r\\n$-1\\r\\n")
        reader.get()  # 42
        reader.get()  # None (a nil bulk string)
        reader.get()  # MORE
    """

    __slots__ = ("_buf", "_pos")

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pos = 0

    def feed(self, data: bytes) -> None:
        """Add bytes read from the connection."""
        if self._pos and self._pos == len(self._buf):
            self._buf = bytearray(data)
            self._pos = 0
        else:
            self._buf += data

    def get(self) -> Any:
        """The next complete reply, or :data:`MORE` if its bytes have not all arrived.

        Raises:
            ValueError: the bytes are not RESP2 (the connection is unusable).
        """
        buf = self._buf
        if self._pos >= len(buf):
            return MORE
        reply, pos = _parse(buf, self._pos)
        if reply is MORE:
            return MORE
        self._pos = pos
        if pos == len(buf):
            buf.clear()
            self._pos = 0
        return reply

    @property
    def pending(self) -> bool:
        """Whether bytes of a reply not yet returned are buffered."""
        return self._pos < len(self._buf)


# -- addresses ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Address:
    """Where and how to connect, from a ``redis://`` or ``unix://`` URL.

    Attributes:
        host: the host name (TCP), or ``None`` for a Unix socket.
        port: the TCP port.
        path: the Unix socket's path, or ``None``.
        db: the database number (``SELECT``).
        username: the ACL user, if any.
        password: the password, if any (never shown by ``str``).
    """

    host: str | None
    port: int
    path: str | None
    db: int
    username: str | None
    password: str | None

    def __str__(self) -> str:
        where = f"unix:{self.path}" if self.path else f"{self.host}:{self.port}"
        return where if self.db == 0 else f"{where}/{self.db}"


def parse_url(url: str) -> Address | None:
    """The :class:`Address` of a plain ``redis://`` or ``unix://`` URL.

    Returns ``None`` for anything the lock manager's own connections do not do (TLS,
    query options other than ``db``), which then goes through redis-py.

    Raises:
        ValueError: a malformed URL (a bad port or database number).

    Example::

        >>> str(parse_url("redis://:secret@10.0.0.5:6380/2"))
        '10.0.0.5:6380/2'
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in ("redis", "unix"):
        return None
    query = parse_qs(parts.query, keep_blank_values=True)
    if set(query) - {"db"}:
        return None
    db_text = query["db"][-1] if "db" in query else ""
    username = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password is not None else None
    if scheme == "unix":
        if not parts.path:
            raise ValueError(f"a unix:// URL needs a socket path: {url!r}")
        return Address(None, 0, unquote(parts.path), int(db_text or 0), username, password)
    path = parts.path.lstrip("/")
    if path and not db_text:
        db_text = path
    return Address(
        parts.hostname or "localhost",
        parts.port or 6379,
        None,
        int(db_text or 0),
        username,
        password,
    )
