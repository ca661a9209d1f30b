"""TCP proxies that keep back or drop a server's replies: a client then waits inside a round
trip, or loses the reply of a request that ran, when the test says so.

:class:`ReplyDropper` (``tests/test_reply_lost.py``) drops replies and closes the connection;
:class:`ReplyHolder` (``tests/test_manager_cancellation.py``) keeps them back on a connection
that stays open. Both pipe every connection through :class:`Proxy`.
"""

from __future__ import annotations

import contextlib
import enum
import socket
import threading

from tests.servers import free_port


class Verdict(enum.Enum):
    """What becomes of one piece of a server's reply."""

    SEND = enum.auto()
    #: Swallowed; the connection goes on.
    HOLD = enum.auto()
    #: Swallowed, and the connection is closed at both ends.
    DROP = enum.auto()


class Proxy:
    """A TCP proxy on a free loopback port to a server at ``host:port``: two threads pipe
    each connection, one for each way, and ask :meth:`request` and :meth:`reply` what to do
    with what they read. A subclass sets its own attributes before calling this
    constructor: the first connection may come at once."""

    def __init__(self, host: str, port: int) -> None:
        self.upstream = (host, port)
        self.port = free_port()
        self._listener = socket.create_server(("127.0.0.1", self.port))
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        for sock in [self._listener, *self._sockets]:
            sock.close()

    def refuses(self) -> bool:
        """Whether a new connection is closed at once."""
        return False

    def request(self, data: bytes, marked: threading.Event) -> bool:
        """Whether ``data``, read from the client, goes on to the server (if not, the
        connection is closed); set ``marked`` to mark the connection for :meth:`reply`."""
        del data, marked
        return True

    def reply(self, data: bytes, marked: threading.Event) -> Verdict:
        """What becomes of ``data``, read from the server."""
        del data, marked
        return Verdict.SEND

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.refuses():
                client.close()
                continue
            server = socket.create_connection(self.upstream)
            self._sockets += [client, server]
            marked = threading.Event()
            for args in ((client, server, False, marked), (server, client, True, marked)):
                threading.Thread(target=self._pipe, args=args, daemon=True).start()

    def _pipe(
        self, source: socket.socket, sink: socket.socket, replies: bool, marked: threading.Event
    ) -> None:
        try:
            while data := source.recv(65536):
                if not replies and not self.request(data, marked):
                    break
                if replies:
                    verdict = self.reply(data, marked)
                    if verdict is Verdict.HOLD:
                        continue
                    if verdict is Verdict.DROP:
                        break
                sink.sendall(data)
        except OSError:
            pass
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


class ReplyDropper(Proxy):
    """A TCP proxy to ``upstream`` that, while armed, drops every reply of the server and
    closes that connection at both ends (the requests it carried may have run). With
    ``only``, it drops only the replies on connections whose requests contained those
    bytes (an HTTP client with one connection per request: the replies to one call).
    With ``cut_off``, the first reply it drops also cuts the link: until :meth:`heal`, no
    request gets through and new connections are closed at once."""

    def __init__(
        self, host: str, port: int, *, only: bytes | None = None, cut_off: bool = False
    ) -> None:
        self.only = only
        self.cut_off = cut_off
        self.armed = threading.Event()
        #: Set at the first reply dropped, with ``cut_off``: from then on, while armed, no
        #: request reaches the server (a link that fails for good after the reply it lost).
        self.cut = threading.Event()
        self.dropped = 0
        super().__init__(host, port)

    def heal(self) -> None:
        """Let everything through again."""
        self.armed.clear()
        self.cut.clear()

    def refuses(self) -> bool:
        return self.cut.is_set()

    def request(self, data: bytes, marked: threading.Event) -> bool:
        if self.cut.is_set():
            return False
        if self.only is not None and self.only in data:
            marked.set()  # before the request goes on: its reply comes after
        return True

    def reply(self, data: bytes, marked: threading.Event) -> Verdict:
        if self.armed.is_set() and (self.only is None or marked.is_set()):
            self.dropped += 1
            if self.cut_off:
                self.cut.set()
            return Verdict.DROP
        return Verdict.SEND


class ReplyHolder(Proxy):
    """A TCP proxy to a server (an etcd member, a Redis node) that, while armed, keeps
    back the reply on every connection whose request contained ``marker`` (the request
    goes on and runs): the client waits inside that round trip for as long as the test
    likes. A held reply is never delivered; the connection ends when the client closes
    it."""

    def __init__(self, host: str, port: int, marker: bytes) -> None:
        self.marker = marker
        self.armed = threading.Event()
        self.held = threading.Event()
        super().__init__(host, port)

    def request(self, data: bytes, marked: threading.Event) -> bool:
        if self.armed.is_set() and self.marker in data:
            marked.set()  # before the request goes on: its reply comes after
        return True

    def reply(self, data: bytes, marked: threading.Event) -> Verdict:
        if marked.is_set():
            self.held.set()
            return Verdict.HOLD
        return Verdict.SEND
