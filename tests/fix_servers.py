"""Pytest fixtures for the real servers: one of each per test session, started on demand.

Tests that need a server carry the marker of that server (``redis``, ``postgres``,
``mariadb``, ``sentinel``, and ``etcd``, ``zookeeper`` for the clusters of
``tests/fix_consensus.py``); the marker is added automatically to any test that uses the
server's fixtures.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest

from tests.servers import (
    MariaDBServer,
    PostgresServer,
    RedisServer,
    SentinelSetup,
    flush_redis,
    reap_orphans,
)

_MARKS = {
    "redis_server": "redis",
    "redis_url": "redis",
    "postgres_server": "postgres",
    "postgres_url": "postgres",
    "mariadb_server": "mariadb",
    "mariadb_url": "mariadb",
    "sentinel_setup": "sentinel",
    "sentinel_url": "sentinel",
    "etcd_cluster": "etcd",
    "etcd_url": "etcd",
    "zookeeper_ensemble": "zookeeper",
    "zookeeper_url": "zookeeper",
}


def pytest_sessionstart(session: pytest.Session) -> None:
    """Stop servers that a test run which died left behind."""
    reap_orphans()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test by the servers its fixtures start."""
    for item in items:
        for fixture in getattr(item, "fixturenames", ()):
            mark = _MARKS.get(fixture)
            if mark is not None:
                item.add_marker(getattr(pytest.mark, mark))


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    """A throwaway ``redis-server`` for the whole session."""
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """The URL of the session's redis-server, flushed before the test."""
    if redis_server.proc is None:  # a fault test left it down
        redis_server.start()
    flush_redis(redis_server.url)
    return redis_server.url


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[PostgresServer]:
    """A throwaway PostgreSQL cluster for the whole session."""
    server = PostgresServer().start()
    yield server
    server.destroy()


@pytest.fixture
def postgres_url(postgres_server: PostgresServer) -> str:
    """A SQLAlchemy URL (psycopg 3) of the session's PostgreSQL cluster."""
    return postgres_server.url


@pytest.fixture(scope="session")
def mariadb_server() -> Iterator[MariaDBServer]:
    """A throwaway MariaDB server for the whole session."""
    server = MariaDBServer().start()
    yield server
    server.destroy()


@pytest.fixture
def mariadb_url(mariadb_server: MariaDBServer) -> Iterator[str]:
    """A SQLAlchemy URL (PyMySQL) of a database of its own on the session's MariaDB server,
    dropped after the test; ``+aiomysql`` in its place gives the asyncio driver."""
    import pymysql

    name = f"t_{secrets.token_hex(6)}"
    admin = pymysql.connect(
        host="127.0.0.1",
        port=mariadb_server.port,
        user=mariadb_server.USER,
        password=mariadb_server.PASSWORD,
        autocommit=True,
    )
    try:
        with admin.cursor() as cursor:
            cursor.execute(f"CREATE DATABASE {name}")
        yield mariadb_server.url(name)
        with admin.cursor() as cursor:
            cursor.execute(f"DROP DATABASE IF EXISTS {name}")
    finally:
        admin.close()


@pytest.fixture(scope="session")
def sentinel_setup() -> Iterator[SentinelSetup]:
    """A Redis primary, a replica and a Sentinel watching them, for the whole session.

    At most one test fails over (``tests/test_sentinel.py``); the setup then has the former
    replica as its primary, which is all the other users need.
    """
    setup = SentinelSetup().start()
    yield setup
    setup.stop()


@pytest.fixture
def sentinel_url(sentinel_setup: SentinelSetup) -> str:
    """The ``redis+sentinel://`` URL of the session's Sentinel, its primary flushed."""
    primary = (
        sentinel_setup.primary
        if sentinel_setup.master_port() == sentinel_setup.primary.port
        else sentinel_setup.replica
    )
    flush_redis(primary.url)
    return sentinel_setup.url
