"""Pick a lock manager by URL: ``memory://``, ``redis://`` (``+cluster``, ``+sentinel``),
``postgresql://``, ``sqlite://``, ``mariadb://``, ``mysql://``, ``etcd://``,
``zookeeper://``."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

from fence._async.manager import AsyncBaseLockManager
from fence._errors import ConfigurationError
from fence._memory import MemoryBackend
from fence._sync.manager import BaseLockManager

__all__ = ["connect", "connect_async"]

_REDIS = {"redis", "rediss", "unix"}
_SQL = {"postgresql", "postgres", "sqlite", "mariadb", "mysql"}
#: MariaDB's drivers, sync and asyncio: a URL that names one gets the other in the other
#: kind of manager, so that one URL serves both (psycopg is both for PostgreSQL).
_MYSQL_DRIVERS = ("pymysql", "aiomysql")
_ETCD = {"etcd", "etcds"}
_ZOOKEEPER = {"zookeeper", "zk"}
_named: dict[str, MemoryBackend] = {}
_named_lock = threading.Lock()


def _memory_backend(url: str) -> MemoryBackend:
    name = urlsplit(url).netloc + urlsplit(url).path
    if not name:
        return MemoryBackend()
    with _named_lock:
        return _named.setdefault(name, MemoryBackend())


def _kind(url: str | Sequence[str]) -> tuple[str, str | list[str]]:
    if not isinstance(url, str):
        nodes = list(url)
        if len(nodes) < 3 or not all(isinstance(n, str) for n in nodes):
            raise ConfigurationError("a quorum needs a list of at least 3 node URLs")
        return "quorum", nodes
    scheme = urlsplit(url).scheme.lower()
    base, _, variant = scheme.partition("+")
    if base == "memory":
        return "memory", url
    if base in _REDIS:
        if variant == "cluster":
            return "redis-cluster", url.replace(f"{base}+cluster://", f"{base}://", 1)
        if variant not in ("", "sentinel"):
            raise ConfigurationError(
                f"no Redis lock manager for {scheme!r}: use redis://, rediss://, unix://, "
                "redis+cluster:// or redis+sentinel://"
            )
        return "redis", url
    if base in _SQL:
        if base == "postgres":
            url = "postgresql" + url[len("postgres") :]
        return "sql", url
    if base in _ETCD:
        return "etcd", url
    if base in _ZOOKEEPER:
        return "zookeeper", url
    raise ConfigurationError(
        f"no lock manager for {scheme!r}: use memory://, redis://, redis+cluster://, "
        "redis+sentinel://, postgresql://, sqlite://, mariadb://, mysql://, etcd://, "
        "zookeeper:// or a list of "
        "redis:// URLs for a quorum"
    )


def _sql_url(url: str, *, asyncio: bool) -> str:
    """``url`` with MariaDB's driver of the manager's kind in place of the other one."""
    scheme, sep, rest = url.partition("://")
    base, _, driver = scheme.partition("+")
    if base.lower() not in ("mariadb", "mysql") or driver.lower() not in _MYSQL_DRIVERS:
        return url
    return f"{base}+{_MYSQL_DRIVERS[1 if asyncio else 0]}{sep}{rest}"


def connect(url: str | Sequence[str], **options: Any) -> BaseLockManager:
    """Build a lock manager from a URL.

    Args:
        url: ``memory://`` (a private in-process backend) or ``memory://name`` (one
            backend per name, shared by every manager of this process); ``redis://``,
            ``rediss://``, ``unix://`` (``RedisLockManager``); ``redis+cluster://``
            (a Redis Cluster); ``redis+sentinel://h1:26379,h2:26379/mymaster/0`` (the
            primary that Redis Sentinel names; ``?sentinel_password=`` for the Sentinels'
            own password); ``postgresql://``, ``sqlite://``, ``mariadb://`` or
            ``mysql://`` (``SQLLockManager``, with any SQLAlchemy driver suffix such as
            ``postgresql+psycopg://``; ``+pymysql`` and ``+aiomysql`` each stand for the
            other in the other kind of manager); or a
            list of 3 or more ``redis://`` URLs (``QuorumLockManager``);
            ``etcd://h1:2379,h2:2379,h3:2379`` (``EtcdLockManager``; ``etcds://`` for TLS,
            a path sets the key prefix); ``zookeeper://h1:2181,h2:2181,h3:2181/prefix``
            (``ZooKeeperLockManager``; the path is the root node).
        **options: the manager's keyword arguments (``ttl``, ``renew``, ``token_mode``...).

    Raises:
        ConfigurationError: an unknown scheme.

    Example::

        manager = fence.connect(os.environ.get("FENCE_URL", "sqlite:///locks.db"), ttl=10)
    """
    kind, target = _kind(url)
    if kind == "memory":
        from fence._sync.memory import MemoryLockManager

        assert isinstance(target, str)
        return MemoryLockManager(_memory_backend(target), **options)
    if kind in ("redis", "redis-cluster"):
        from fence._sync.redis import RedisLockManager

        assert isinstance(target, str)
        return RedisLockManager(target, cluster=kind == "redis-cluster", **options)
    if kind == "sql":
        from fence._sync.sql import SQLLockManager

        assert isinstance(target, str)
        return SQLLockManager(_sql_url(target, asyncio=False), **options)
    if kind == "etcd":
        from fence._sync.etcd import EtcdLockManager

        assert isinstance(target, str)
        return EtcdLockManager(target, **options)
    if kind == "zookeeper":
        from fence._sync.zookeeper import ZooKeeperLockManager

        assert isinstance(target, str)
        return ZooKeeperLockManager(target, **options)
    from fence._sync.quorum import QuorumLockManager

    assert isinstance(target, list)
    return QuorumLockManager(target, **options)


def connect_async(url: str | Sequence[str], **options: Any) -> AsyncBaseLockManager:
    """The asyncio twin of :func:`connect`: same URLs, ``Async*LockManager`` classes.

    The manager opens its connections on first use, so this needs no running loop.
    """
    kind, target = _kind(url)
    if kind == "memory":
        from fence._async.memory import AsyncMemoryLockManager

        assert isinstance(target, str)
        return AsyncMemoryLockManager(_memory_backend(target), **options)
    if kind in ("redis", "redis-cluster"):
        from fence._async.redis import AsyncRedisLockManager

        assert isinstance(target, str)
        return AsyncRedisLockManager(target, cluster=kind == "redis-cluster", **options)
    if kind == "sql":
        from fence._async.sql import AsyncSQLLockManager

        assert isinstance(target, str)
        return AsyncSQLLockManager(_sql_url(target, asyncio=True), **options)
    if kind == "etcd":
        from fence._async.etcd import AsyncEtcdLockManager

        assert isinstance(target, str)
        return AsyncEtcdLockManager(target, **options)
    if kind == "zookeeper":
        from fence._async.zookeeper import AsyncZooKeeperLockManager

        assert isinstance(target, str)
        return AsyncZooKeeperLockManager(target, **options)
    from fence._async.quorum import AsyncQuorumLockManager

    assert isinstance(target, list)
    return AsyncQuorumLockManager(target, **options)
