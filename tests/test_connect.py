"""``fence.connect`` picks the manager by URL."""

from __future__ import annotations

from pathlib import Path

import pytest

import fence
from fence import ConfigurationError
from fence._sync.resp import RespClient
from tests.sqlite_files import sqlite_file


def test_memory_urls() -> None:
    a = fence.connect("memory://")
    b = fence.connect("memory://")
    assert isinstance(a, fence.MemoryLockManager)
    lease = a.acquire("r")
    assert b.try_acquire("r") is not None  # private backends
    shared1 = fence.connect("memory://tests-shared")
    shared2 = fence.connect("memory://tests-shared")
    held = shared1.acquire("r")
    assert shared2.try_acquire("r") is None  # one backend per name
    held.release()
    lease.release()


def test_redis_url(redis_url: str) -> None:
    """A Redis manager by URL opens one pool of its own connections (and one pub/sub
    connection when somebody waits), not a second pool for waiting."""
    manager = fence.connect(redis_url, ttl=5)
    assert isinstance(manager, fence.RedisLockManager)
    with manager.lock("r") as lease:
        assert lease.valid
    client = manager.driver.client
    assert isinstance(client, RespClient)
    assert client.pool.connections == 1
    assert client.pool.max_connections == 3
    manager.close()
    assert client.pool.connections == 0
    wider = fence.connect(redis_url, max_connections=8)
    assert wider.driver.client.pool.max_connections == 8
    wider.close()


def test_sqlite_url(tmp_path: Path) -> None:
    """A SQLite file by URL runs in WAL mode with a busy timeout (without WAL every commit
    rewrites and syncs the database file)."""
    manager = fence.connect(f"sqlite:///{tmp_path}/locks.db", create_table=True)
    assert isinstance(manager, fence.SQLLockManager)
    with manager.lock("r") as lease:
        assert lease.valid
    with manager.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 5000
    manager.close()
    with sqlite_file(tmp_path / "locks.db") as raw:
        assert raw.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    raw.close()


def test_postgres_url(postgres_url: str) -> None:
    url = postgres_url.replace("postgresql+psycopg://", "postgres://")
    manager = fence.connect(url, create_table=True)
    assert isinstance(manager, fence.SQLLockManager)
    with manager.lock("r") as lease:
        assert lease.valid
    manager.close()


@pytest.mark.parametrize("scheme", ["mariadb", "mysql", "mariadb+pymysql", "mysql+aiomysql"])
async def test_mariadb_urls(mariadb_url: str, scheme: str) -> None:
    """``mariadb://`` and ``mysql://`` (a MariaDB server speaks MySQL), with or without a
    driver: the sync manager gets PyMySQL, the asyncio one aiomysql."""
    url = f"{scheme}://{mariadb_url.split('://', 1)[1]}"
    base = scheme.partition("+")[0]
    manager = fence.connect(url, create_table=True)
    assert isinstance(manager, fence.SQLLockManager)
    assert manager.engine.url.drivername == f"{base}+pymysql"
    with manager.lock("r") as lease:
        assert lease.valid
    manager.close()
    waiter = fence.connect_async(url)
    assert isinstance(waiter, fence.AsyncSQLLockManager)
    assert waiter.engine.url.drivername == f"{base}+aiomysql"
    async with waiter.lock("r") as lease:
        assert lease.valid
    await waiter.close()


async def test_async_urls(redis_url: str) -> None:
    manager = fence.connect_async(redis_url)
    assert isinstance(manager, fence.AsyncRedisLockManager)
    async with manager.lock("r") as lease:
        assert lease.valid
    await manager.close()
    memory = fence.connect_async("memory://")
    assert isinstance(memory, fence.AsyncMemoryLockManager)


@pytest.mark.parametrize("url", ["http://x", "oracle://db", "", ["redis://a"]])
def test_unknown_urls(url: str) -> None:
    with pytest.raises(ConfigurationError):
        fence.connect(url)


def test_quorum_urls(quorum_urls: list[str]) -> None:
    manager = fence.connect(quorum_urls, ttl=5)
    assert isinstance(manager, fence.QuorumLockManager)
    with manager.lock("r") as lease:
        assert lease.valid
    manager.close()


def test_etcd_url(etcd_url: str) -> None:
    manager = fence.connect(etcd_url, ttl=5)
    assert isinstance(manager, fence.EtcdLockManager)
    assert manager.driver.prefix.startswith("t-")  # the URL's path is the key prefix
    assert len(manager.driver.endpoints) == 3
    with manager.lock("r") as lease:
        assert lease.valid
    manager.close()


def test_zookeeper_url(zookeeper_url: str) -> None:
    manager = fence.connect(zookeeper_url, ttl=5)
    assert isinstance(manager, fence.ZooKeeperLockManager)
    assert manager.driver.root.startswith("/t-")  # the URL's path is the root node
    with manager.lock("r") as lease:
        assert lease.valid
    manager.close()


async def test_async_consensus_urls(etcd_url: str, zookeeper_url: str) -> None:
    etcd = fence.connect_async(etcd_url)
    assert isinstance(etcd, fence.AsyncEtcdLockManager)
    zookeeper = fence.connect_async(zookeeper_url.replace("zookeeper://", "zk://"))
    assert isinstance(zookeeper, fence.AsyncZooKeeperLockManager)
    for manager in (etcd, zookeeper):
        async with manager.lock("r") as lease:
            assert lease.valid
        await manager.close()


@pytest.mark.parametrize(
    "url", ["etcd://", "etcd:///prefix", "zookeeper://", "zookeeper:///root", "zk://h:1/a//b"]
)
def test_consensus_urls_without_hosts(url: str) -> None:
    with pytest.raises(ConfigurationError):
        fence.connect(url)
