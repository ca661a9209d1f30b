"""The plain parts under the managers' waiting and connections: the wake board (who is
woken by a release) and the RESP2 packing and parsing of the Redis manager's own
connections, the pool's resending after a connection the server closed, and the asyncio
pool's check of an idle connection (on socket servers of the test's own)."""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import threading
import time

import pytest

from fence._async.resp import AsyncRespPool
from fence._resp import MORE, Address, ConnectionFailure, Reader, RespError, pack, parse_url
from fence._sync.resp import RespPool
from fence._wake import WakeBoard


class Probe:
    """A waiter that counts its wake-ups."""

    def __init__(self) -> None:
        self.woken = 0

    def wake(self) -> None:
        self.woken += 1


# -- the wake board --------------------------------------------------------------------------


def test_a_release_wakes_one_waiter_in_arrival_order() -> None:
    board = WakeBoard()
    mark = board.mark()
    first, second, third = Probe(), Probe(), Probe()
    for probe in (first, second, third):
        assert not board.attach("r", probe, mark)
    assert board.wake_one("r")
    assert (first.woken, second.woken, third.woken) == (1, 0, 0)
    assert board.wake_one("r")
    assert (first.woken, second.woken, third.woken) == (1, 1, 0)
    assert board.waiting("r") == 1


def test_a_release_wakes_every_queued_waiter_of_a_shared_lock() -> None:
    """While waiters hold places in the queue of a shared lock, a release wakes all of
    them (the queue decides who goes); the last reader leaving wakes only the writers."""
    board = WakeBoard()
    mark = board.mark()
    readers = [Probe(), Probe()]
    writer = Probe()
    for i, probe in enumerate(readers):
        assert not board.attach("r", probe, mark, ("r", i))
    assert not board.attach("r", writer, mark, ("w", 0))
    board.place("r", 3)
    board.wake("r", writers=True)
    assert [p.woken for p in (*readers, writer)] == [0, 0, 1]
    board.wake("r")
    assert [p.woken for p in (*readers, writer)] == [1, 1, 1]
    board.place("r", -3)
    late = [Probe(), Probe()]
    for probe in late:
        assert not board.attach("r", probe, board.mark())
    board.wake("r")  # nobody queued: one waiter, as for an exclusive lock
    assert [p.woken for p in late] == [1, 0]


def test_the_reader_is_preferred_when_it_waits_for_the_resource() -> None:
    board = WakeBoard()
    mark = board.mark()
    first, reader = Probe(), Probe()
    board.attach("r", first, mark)
    board.attach("r", reader, mark)
    assert board.wake_one("r", prefer=reader)
    assert (first.woken, reader.woken) == (0, 1)
    other = Probe()
    board.attach("s", other, board.mark())
    assert board.wake_one("r", prefer=other)  # not waiting for "r": the first one wakes
    assert (first.woken, other.woken) == (1, 0)


def test_a_named_waiter_is_woken_and_nobody_else() -> None:
    board = WakeBoard()
    mark = board.mark()
    a, b = Probe(), Probe()
    board.attach("r", a, mark, key="waiter-a")
    board.attach("r", b, mark, key="waiter-b")
    assert board.wake_key("r", "waiter-b")
    assert (a.woken, b.woken) == (0, 1)
    assert not board.wake_key("r", "waiter-b")  # woken once, gone
    assert not board.wake_key("r", "someone-elses")
    assert a.woken == 0


def test_a_change_after_the_mark_refuses_the_wait() -> None:
    """The race between a refused attempt and the wait: a release posted in between makes
    attach refuse, so the caller tries again instead of sleeping through it."""
    board = WakeBoard()
    mark = board.mark()
    board.wake_one("r")  # nobody attached yet: only recorded
    assert board.attach("r", Probe(), mark)
    assert not board.attach("other", Probe(), mark)
    later = board.mark()
    board.changed("r")
    assert board.attach("r", Probe(), later)


def test_a_new_generation_wakes_everybody_and_voids_marks() -> None:
    board = WakeBoard()
    mark = board.mark()
    probes = [Probe() for _ in range(3)]
    for index, probe in enumerate(probes):
        board.attach(f"r{index}", probe, mark, key=f"k{index}")
    board.new_generation()
    assert [p.woken for p in probes] == [1, 1, 1]
    assert board.attach("r0", Probe(), mark)
    assert not board.wake_key("r1", "k1")


def test_detach_forgets_a_waiter() -> None:
    board = WakeBoard()
    mark = board.mark()
    gone, stays = Probe(), Probe()
    board.attach("r", gone, mark, key="gone")
    board.attach("r", stays, mark)
    board.detach("r", gone)
    board.detach("r", gone)  # twice is harmless
    assert not board.wake_key("r", "gone")
    assert board.wake_one("r")
    assert (gone.woken, stays.woken) == (0, 1)


def test_bump_wakes_all_waiters_of_the_resource() -> None:
    board = WakeBoard()
    mark = board.mark()
    probes = [Probe() for _ in range(3)]
    for probe in probes:
        board.attach("r", probe, mark)
    board.bump("r")
    assert [p.woken for p in probes] == [1, 1, 1]


# -- RESP2 -----------------------------------------------------------------------------------


def test_pack_sends_bulk_strings() -> None:
    assert pack("SET", "k", b"v\r\n", 42) == (
        b"*4\r\n$3\r\nSET\r\n$1\r\nk\r\n$3\r\nv\r\n\r\n$2\r\n42\r\n"
    )
    assert pack("X", "é") == b"*2\r\n$1\r\nX\r\n$2\r\n\xc3\xa9\r\n"
    with pytest.raises(TypeError):
        pack("X", None)


def test_reader_parses_every_reply_kind_in_pieces() -> None:
    wire = (
        b":1795450710097854\r\n$-1\r\n+OK\r\n-NOSCRIPT No matching script\r\n"
        b"*3\r\n:0\r\n:-1\r\n*0\r\n$5\r\nab\r\nc\r\n*-1\r\n"
    )
    reader = Reader()
    got = []
    for byte in wire:  # one byte at a time: every cut of a reply is a valid pause
        reader.feed(bytes([byte]))
        reply = reader.get()
        while reply is not MORE:
            got.append(reply)
            reply = reader.get()
    assert got[0] == 1795450710097854
    assert got[1] is None
    assert got[2] == b"OK"
    assert isinstance(got[3], RespError)
    assert got[3].kind == "NOSCRIPT"
    assert got[4] == [0, -1, []]
    assert got[5] == b"ab\r\nc"
    assert got[6] is None
    assert not reader.pending


def test_reader_refuses_what_is_not_resp() -> None:
    reader = Reader()
    reader.feed(b"HTTP/1.1 400 Bad Request\r\n")
    with pytest.raises(ValueError, match="not a RESP2 reply"):
        reader.get()


@pytest.mark.parametrize(
    ("url", "address"),
    [
        ("redis://127.0.0.1:6380/2", Address("127.0.0.1", 6380, None, 2, None, None)),
        ("redis://:s%40cret@db", Address("db", 6379, None, 0, None, "s@cret")),
        ("redis://app:pw@db:7000?db=3", Address("db", 7000, None, 3, "app", "pw")),
        ("unix:///run/redis.sock?db=1", Address(None, 0, "/run/redis.sock", 1, None, None)),
    ],
)
def test_parse_url(url: str, address: Address) -> None:
    assert parse_url(url) == address
    assert "pw" not in str(address)
    assert "cret" not in str(address)


@pytest.mark.parametrize(
    "url", ["rediss://db:6380/0", "redis://db/0?socket_timeout=3", "http://db", "redis+x://db"]
)
def test_urls_the_own_connections_do_not_serve(url: str) -> None:
    """TLS and client options go through redis-py."""
    assert parse_url(url) is None


# -- resending after a connection the server closed ------------------------------------------


class _PingServer:
    """A TCP server on 127.0.0.1 that answers ``PING`` s with ``+OK``; each subclass says
    what it does with a connection it accepted (:meth:`_accepted`)."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            self._accepted(conn)

    def _accepted(self, conn: socket.socket) -> None:
        raise NotImplementedError

    @staticmethod
    def _answer(conn: socket.socket, close_unanswered: bool = False) -> None:
        """Answer the connection's ``PING`` s until the client closes it, or read its first
        command and close it unanswered."""
        with contextlib.suppress(OSError), conn:
            while data := conn.recv(65536):
                if close_unanswered:
                    return
                conn.sendall(b"+OK\r\n" * data.count(b"PING"))

    def close(self) -> None:
        self.listener.close()


class _Closer(_PingServer):
    """Reads the first command of each connection and closes it unanswered, except from
    connection ``answer_from`` on, which it answers: a server that died under a command,
    then came back. Serves one connection at a time."""

    def __init__(self, answer_from: int) -> None:
        self.answer_from = answer_from
        self.connections = 0
        super().__init__()

    def _accepted(self, conn: socket.socket) -> None:
        self.connections += 1
        self._answer(conn, close_unanswered=self.connections < self.answer_from)


@pytest.mark.parametrize("resend", [True, False])
def test_a_pool_resends_once_only_when_asked(resend: bool) -> None:
    """A command whose connection the server closed under it is sent once more on a new
    connection with ``resend`` (the single managers' scripts), never without it (the
    quorum's calls, whose fault model has no duplicated messages)."""
    server = _Closer(answer_from=2)
    pool = RespPool(parse_url(f"redis://127.0.0.1:{server.port}"), max_connections=2)
    try:
        deadline = time.monotonic() + 5
        if resend:
            assert pool.request(pack("PING"), deadline, resend=True) == b"OK"
        else:
            with pytest.raises(ConnectionFailure) as caught:
                pool.request(pack("PING"), deadline)
            assert caught.value.closed
            assert caught.value.sent
        assert server.connections == (2 if resend else 1)
    finally:
        pool.close()
        server.close()


def test_a_pool_resends_at_most_once() -> None:
    server = _Closer(answer_from=3)
    pool = RespPool(parse_url(f"redis://127.0.0.1:{server.port}"), max_connections=2)
    try:
        with pytest.raises(ConnectionFailure) as caught:
            pool.request(pack("PING"), time.monotonic() + 5, resend=True)
        assert caught.value.closed
        assert server.connections == 2
    finally:
        pool.close()
        server.close()


class _Answerer(_PingServer):
    """Answers every connection, each on a thread of its own, and can close every
    connection it accepted at once (a restart, as the client sees it)."""

    def __init__(self) -> None:
        self.accepted: list[socket.socket] = []
        super().__init__()

    def _accepted(self, conn: socket.socket) -> None:
        self.accepted.append(conn)
        threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def drop_all(self) -> None:
        for conn in self.accepted:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()

    def close(self) -> None:
        self.listener.close()
        self.drop_all()


async def test_an_asyncio_pool_never_sends_on_a_connection_the_server_closed() -> None:
    """The server closes the idle connection while no task runs, so the event loop has not
    read the close when the next request takes a connection: the pool asks the socket,
    opens a new connection and the request (never sent twice) succeeds."""
    server = _Answerer()
    pool = AsyncRespPool(parse_url(f"redis://127.0.0.1:{server.port}"), max_connections=2)
    try:
        assert await pool.request(pack("PING"), time.monotonic() + 5) == b"OK"
        server.drop_all()
        time.sleep(0.2)  # the close reaches this side's socket; the event loop does not run
        assert await pool.request(pack("PING"), time.monotonic() + 5) == b"OK"
        assert len(server.accepted) == 2
    finally:
        pool.close()
        server.close()


async def test_an_asyncio_pool_reuses_a_connection_whose_descriptor_is_past_1024() -> None:
    """``select()`` cannot take a descriptor numbered 1024 or more; the pool's check of an
    idle connection must not count such a connection dead (it would open a new connection
    for every request of a process with many files open)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert hard == resource.RLIM_INFINITY or hard >= 2048, "raise the open-file limit"
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2048), hard))
    filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    server = _Answerer()
    pool = AsyncRespPool(parse_url(f"redis://127.0.0.1:{server.port}"), max_connections=2)
    try:
        for _ in range(3):
            assert await pool.request(pack("PING"), time.monotonic() + 5) == b"OK"
        (idle,) = pool._idle
        assert idle._stream._writer.get_extra_info("socket").fileno() >= 1024
        assert len(server.accepted) == 1
    finally:
        pool.close()
        server.close()
        for fd in filler:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
