"""Pytest fixtures for the quorum manager: three independent redis-servers.

The three nodes start once per session (:func:`quorum_nodes`) and are flushed and set up
(:func:`set_up`) before each test (:func:`quorum_urls`); a node that a test left stopped or
killed is brought back first. Fault tests that kill, stop or wipe nodes start their own trio with
:func:`start_nodes`, so the shared one stays whole.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

import pytest

from tests.servers import RedisServer, flush_redis

NODES = 3


def start_nodes(count: int = NODES, *extra: str) -> list[RedisServer]:
    """Start ``count`` independent redis-servers; stop the started ones if one fails."""
    servers: list[RedisServer] = []
    try:
        for _ in range(count):
            servers.append(RedisServer(*extra).start())
    except BaseException:
        stop_nodes(servers)
        raise
    return servers


def set_up(servers: list[RedisServer]) -> None:
    """Set the quorum on ``servers`` up, as its first grant does (every node must answer)."""
    from fence._sync.quorum import QuorumLockManager

    manager = QuorumLockManager([s.url for s in servers], check_config=False, ttl=5)
    try:
        manager.acquire("set-up", timeout=5).release()
    finally:
        manager.close()


def stop_nodes(servers: list[RedisServer]) -> None:
    """Stop every server and remove its directory."""
    for server in servers:
        server.stop()


def revive(server: RedisServer) -> None:
    """Make a node answer again: resume it if stopped, start it if killed."""
    if server.proc is None:
        server.start()
        return
    with contextlib.suppress(ProcessLookupError):
        server.proc.send_signal(signal.SIGCONT)


@pytest.fixture(scope="session")
def quorum_nodes() -> Iterator[list[RedisServer]]:
    """Three independent redis-servers for the whole session."""
    servers = start_nodes()
    yield servers
    stop_nodes(servers)


@pytest.fixture
def quorum_urls(quorum_nodes: list[RedisServer]) -> list[str]:
    """The URLs of the session's three nodes, each running and flushed, the quorum on them
    set up (as a quorum in service is)."""
    for server in quorum_nodes:
        revive(server)
        flush_redis(server.url)
    set_up(quorum_nodes)
    return [server.url for server in quorum_nodes]
