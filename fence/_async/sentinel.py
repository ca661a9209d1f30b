"""redis-py clients of the primary that Redis Sentinel names, from a ``redis+sentinel://`` URL.

The client is redis-py's ``master_for``: each new connection asks the Sentinels where the
primary is, a connection to a demoted primary is dropped when it answers ``READONLY``, and
idle connections are dropped when the Sentinels name another primary. So after a failover
the next call that fails (``BackendError``, retryable) is followed by calls that reach the
new primary. The URL's form is in :mod:`fence._sentinel`.
"""

from __future__ import annotations

import asyncio  # unasync: import threading
from typing import Any

import redis.asyncio
import redis.asyncio.sentinel
from redis.exceptions import ConnectionError as RedisConnectionError

from fence._sentinel import SentinelURL

__all__ = ["SentinelClients", "sentinel_clients"]


async def _take(slots: Any, timeout: float) -> bool:
    try:  # unasync: remove
        async with asyncio.timeout(timeout):  # unasync: return bool(slots.acquire(timeout=timeout))
            await slots.acquire()  # unasync: remove
    except TimeoutError:  # unasync: remove
        return False  # unasync: remove
    return True  # unasync: remove


class _QueuedPool(redis.asyncio.sentinel.SentinelConnectionPool):
    """redis-py's Sentinel pool with at most ``limit`` connections in use: a caller waits
    up to ``queue_timeout`` for a free one (as ``BlockingConnectionPool`` does), then gets
    the error ``BlockingConnectionPool`` gives ("No connection available.")."""

    def __init__(self, service_name: str, sentinel_manager: Any, **kwargs: Any) -> None:
        limit = int(kwargs.pop("limit"))
        self._queue_timeout = float(kwargs.pop("queue_timeout"))
        super().__init__(service_name, sentinel_manager, **kwargs)  # type: ignore[no-untyped-call]
        self._slots = asyncio.Semaphore(limit)  # unasync: self._slots = threading.Semaphore(limit)
        self._holding: set[int] = set()

    async def get_connection(self, *args: Any, **kwargs: Any) -> Any:
        if not await _take(self._slots, self._queue_timeout):
            raise RedisConnectionError("No connection available.")
        try:
            # (redis-py annotates this call in one of its two flavours only)
            connection = await super().get_connection(*args, **kwargs)  # type: ignore[no-untyped-call, unused-ignore]
        except BaseException:
            self._slots.release()
            raise
        self._holding.add(id(connection))
        return connection

    async def release(self, connection: Any) -> None:
        try:
            await super().release(connection)
        finally:
            if id(connection) in self._holding:
                self._holding.discard(id(connection))
                self._slots.release()


class SentinelClients:
    """A client of the primary, and the clients of the Sentinels it asks; :meth:`close`
    closes both.

    Attributes:
        master: the ``redis.asyncio.Redis`` of the primary (``master_for``).
        sentinel: redis-py's ``Sentinel``.
    """

    def __init__(self, master: redis.asyncio.Redis, sentinel: Any) -> None:
        self.master = master
        self.sentinel = sentinel

    async def close(self) -> None:
        """Close the primary's connections and the Sentinels'."""
        await self.master.aclose()
        for client in self.sentinel.sentinels:
            await client.aclose()


def sentinel_clients(
    target: SentinelURL,
    *,
    socket_timeout: float | None = None,
    max_connections: int | None = None,
    no_retry: bool = False,
) -> SentinelClients:
    """Build (without I/O) a client of the primary that ``target``'s Sentinels name.

    Args:
        target: the parsed URL.
        socket_timeout: the longest one round trip may take, to the primary and to a
            Sentinel; ``None`` leaves redis-py's default (none).
        max_connections: connections to the primary in use at once; a caller waits for a
            free one up to ``socket_timeout``. ``None``: no limit (redis-py's default).
        no_retry: no silent retries inside redis-py, to the primary or to a Sentinel (the
            lock manager retries itself, within the caller's timeout).
    """
    sentinel_options: dict[str, Any] = {}
    options: dict[str, Any] = {"db": target.db}
    if socket_timeout is not None:
        for name in ("socket_timeout", "socket_connect_timeout"):
            sentinel_options[name] = socket_timeout
            options[name] = socket_timeout
    if target.sentinel_username is not None:
        sentinel_options["username"] = target.sentinel_username
    if target.sentinel_password is not None:
        sentinel_options["password"] = target.sentinel_password
    if target.username is not None:
        options["username"] = target.username
    if target.password is not None:
        options["password"] = target.password
    if no_retry:
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff

        options["retry"] = Retry(NoBackoff(), 0)
        sentinel_options["retry"] = Retry(NoBackoff(), 0)
    sentinel = redis.asyncio.sentinel.Sentinel(  # type: ignore[no-untyped-call]
        list(target.sentinels), sentinel_kwargs=sentinel_options, **options
    )
    pool: dict[str, Any] = {}
    if max_connections is not None:
        pool = {
            "connection_pool_class": _QueuedPool,
            "limit": max_connections,
            "queue_timeout": socket_timeout if socket_timeout is not None else 20.0,
        }
    master = sentinel.master_for(  # type: ignore[no-untyped-call, unused-ignore]
        target.service, redis_class=redis.asyncio.Redis, **pool
    )
    return SentinelClients(master, sentinel)
