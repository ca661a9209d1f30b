"""A TCP proxy between a ZooKeeper client and one server, that cuts the link where a test
needs it.

- :meth:`ZooKeeperProxy.drop_reply`: the reply to the next request of one kind is dropped
  and the connection closed. The request was applied; the client only lost the answer.
  The session survives: the client connects again (through the proxy) and resumes it.
- :meth:`ZooKeeperProxy.hold_reply`: the link freezes when that reply arrives: the request
  was applied, and its reply and every byte after it are held until :meth:`thaw`.
- :meth:`ZooKeeperProxy.garble_reply`: the reply to the next request of one kind reaches
  the client with another request's xid, as a server that answers out of order would send
  it (ZOOKEEPER-1863). kazoo cannot pair it with its request: its connection thread raises
  ``RuntimeError('xids do not match ...')`` and ends, and the client never connects again
  on its own.
- :meth:`ZooKeeperProxy.freeze`: every byte held from now on, both ways, as on a frozen
  network or with a proxy process stopped by ``SIGSTOP``: the sockets stay open and
  nothing moves. New connections are accepted and held too.

The proxy reads ZooKeeper's framing: every packet has a 4-byte length in front; after the
connect handshake a request starts with its xid and operation code, and a reply with the
xid of its request. So it can pick the reply of one request out of the stream.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading

__all__ = ["DELETE", "EXISTS", "MULTI", "SET_DATA", "ZooKeeperProxy"]

#: Operation codes of ZooKeeper requests (``org.apache.zookeeper.ZooDefs.OpCode``).
DELETE = 2
EXISTS = 3
SET_DATA = 5
MULTI = 14

_DROP, _DROP_FREEZE, _HOLD, _GARBLE = "drop", "drop and freeze", "hold", "garble"


def _read_exact(sock: socket.socket, size: int) -> bytes | None:
    data = b""
    while len(data) < size:
        try:
            chunk = sock.recv(size - len(data))
        except OSError:
            return None
        if not chunk:
            return None
        data += chunk
    return data


def _read_packet(sock: socket.socket) -> bytes | None:
    """One length-prefixed packet, its length included (``None`` at the end)."""
    head = _read_exact(sock, 4)
    if head is None:
        return None
    (length,) = struct.unpack(">i", head)
    body = _read_exact(sock, length) if length > 0 else b""
    return None if body is None else head + body


class _Link:
    """One client connection and the proxy's connection to the server for it."""

    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.client = client
        self.server = server
        self.marked: dict[int, tuple[int, str]] = {}  # xid -> (op, what to do with its reply)
        self.closed = False

    def close(self) -> None:
        self.closed = True
        for sock in (self.client, self.server):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()


class ZooKeeperProxy:
    """Listens on a loopback port of its own and forwards every connection to ``upstream``.

    Args:
        upstream: ``host:port`` of one ZooKeeper server.

    Attributes:
        port: the port clients connect to.
        dropped: the operation codes whose reply was dropped, in order.
        held: the operation codes whose reply froze the link, in order.
        garbled: the operation codes whose reply went out with a wrong xid, in order.
        connections: how many client connections the proxy accepted.
    """

    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.rpartition(":")
        self._upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._flowing = threading.Event()
        self._flowing.set()
        self._armed: list[tuple[int, str]] = []
        self._links: list[_Link] = []
        self.dropped: list[int] = []
        self.held: list[int] = []
        self.garbled: list[int] = []
        self.connections = 0
        self._closed = False
        threading.Thread(target=self._accept, name="zk-proxy", daemon=True).start()

    @property
    def hosts(self) -> str:
        """The proxy's address as a kazoo hosts string."""
        return f"127.0.0.1:{self.port}"

    def drop_reply(self, op: int, *, then_freeze: bool = False) -> None:
        """Drop the reply to the next request with operation code ``op`` and close its
        connection; with ``then_freeze``, freeze the link too, so that the client cannot
        connect again until :meth:`thaw`."""
        with self._lock:
            self._armed.append((op, _DROP_FREEZE if then_freeze else _DROP))

    def hold_reply(self, op: int) -> None:
        """Freeze the link when the reply to the next request with operation code ``op``
        arrives from the server (the reply is held with everything after it)."""
        with self._lock:
            self._armed.append((op, _HOLD))

    def garble_reply(self, op: int) -> None:
        """Send the reply to the next request with operation code ``op`` with an xid that
        is not its request's (the request was applied)."""
        with self._lock:
            self._armed.append((op, _GARBLE))

    def freeze(self) -> None:
        """Hold every byte from now on, both ways, on every connection."""
        self._flowing.clear()

    def thaw(self) -> None:
        """Let the held bytes through, and everything after them."""
        self._flowing.set()

    @property
    def frozen(self) -> bool:
        """Whether the link is frozen."""
        return not self._flowing.is_set()

    def close(self) -> None:
        """Stop listening and close every connection."""
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            links, self._links = self._links, []
        for link in links:
            link.close()
        self._flowing.set()

    def _take(self, op: int) -> str | None:
        with self._lock:
            for index, (armed, action) in enumerate(self._armed):
                if armed == op:
                    del self._armed[index]
                    return action
        return None

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self._upstream, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            link = _Link(client, server)
            with self._lock:
                self._links.append(link)
                self.connections += 1
            for target in (self._requests, self._replies):
                threading.Thread(target=target, args=(link,), daemon=True).start()

    def _forward(self, link: _Link, sock: socket.socket, packet: bytes) -> bool:
        self._flowing.wait()
        if link.closed or self._closed:
            return False
        try:
            sock.sendall(packet)
        except OSError:
            return False
        return True

    def _requests(self, link: _Link) -> None:
        """Client to server; marks the requests whose reply is to be dropped or held."""
        first = True  # the connect request has no xid
        while True:
            packet = _read_packet(link.client)
            if packet is None:
                break
            if not first and len(packet) >= 12:
                xid, op = struct.unpack(">ii", packet[4:12])
                action = self._take(op)
                if action is not None:
                    link.marked[xid] = (op, action)
            first = False
            if not self._forward(link, link.server, packet):
                break
        link.close()

    def _replies(self, link: _Link) -> None:
        """Server to client; drops or holds the marked replies."""
        first = True  # the connect response has no xid
        while True:
            packet = _read_packet(link.server)
            if packet is None:
                break
            if not first and len(packet) >= 8:
                (xid,) = struct.unpack(">i", packet[4:8])
                op, action = link.marked.pop(xid, (0, ""))
                if action == _HOLD:
                    self.held.append(op)
                    self._flowing.clear()
                elif action == _GARBLE:
                    self.garbled.append(op)
                    packet = packet[:4] + struct.pack(">i", xid + 1000) + packet[8:]
                elif action in (_DROP, _DROP_FREEZE):
                    if action == _DROP_FREEZE:
                        self._flowing.clear()
                    self.dropped.append(op)
                    break
            first = False
            if not self._forward(link, link.client, packet):
                break
        link.close()
