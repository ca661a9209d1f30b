"""A client killed (``SIGKILL``) while it holds a lock, or while it waits in the FIFO queue,
leaves nothing that outlives its ttl (or ``queue_ttl``): the next contender is granted
within that bound, on Redis and PostgreSQL, whether the dead client ran the sync or the
asyncio manager.

A killed client sends no clean-up, so its lock lives out its ttl and its place in the
queue its ``queue_ttl``; what these tests pin is that nothing lives longer. The other
faults (a cancelled task, a timed-out acquire, a reply that never comes) are in
``tests/test_manager_cancellation.py``, ``tests/_async/test_manager_deadlines.py`` and
``tests/_async/test_redis_manager.py``.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
import redis

from fence._redis_keys import resource_keys
from fence._sql_schema import lease_schema_ddl
from fence._sync.redis import RedisLockManager
from fence._sync.sql import SQLLockManager
from tests.servers import PostgresServer

pytestmark = pytest.mark.slow

TTL = 2.0
QUEUE_TTL = 2.0
# Room for a loaded machine: the bound is the ttl, the slack only the time to notice.
SLACK = 4.0

# The dead client: takes the lock (or waits for it) with the flavour it is given, says
# "ready", and waits to be killed.
_CHILD = """
import asyncio, sys, time
flavour, kind, url, table, resource, role = sys.argv[1:]
options = {"ttl": TTL}
if kind == "redis":
    options.update(fifo=True, queue_ttl=QUEUE_TTL)
else:
    options.update(table=table)
if flavour == "sync":
    from fence._sync.redis import RedisLockManager as Redis
    from fence._sync.sql import SQLLockManager as SQL
    manager = (Redis if kind == "redis" else SQL)(url, **options)
    if role == "hold":
        manager.acquire(resource)
    print("ready", flush=True)
    if role == "wait":
        manager.acquire(resource, timeout=600)
    time.sleep(600)
else:
    from fence._async.redis import AsyncRedisLockManager as Redis
    from fence._async.sql import AsyncSQLLockManager as SQL

    async def main():
        manager = (Redis if kind == "redis" else SQL)(url, **options)
        if role == "hold":
            await manager.acquire(resource)
        print("ready", flush=True)
        if role == "wait":
            await manager.acquire(resource, timeout=600)
        await asyncio.sleep(600)

    asyncio.run(main())
""".replace("QUEUE_TTL", repr(QUEUE_TTL)).replace("TTL", repr(TTL))


@pytest.fixture
def resource() -> str:
    return f"res:{secrets.token_hex(4)}"


@pytest.fixture
def table(postgres_server: PostgresServer) -> Iterator[str]:
    name = f"leases_{secrets.token_hex(4)}"
    with psycopg.connect(postgres_server.conninfo, autocommit=True) as conn:
        for statement in lease_schema_ddl("postgresql", table=name):
            conn.execute(statement)
    yield name
    with psycopg.connect(postgres_server.conninfo, autocommit=True) as conn:
        conn.execute(f'DROP TABLE IF EXISTS "{name}", "{name}_shared"')


def start_child(flavour: str, kind: str, url: str, table: str, resource: str, role: str) -> Any:
    """Start the client process; return it once it has said "ready"."""
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, flavour, kind, url, table, resource, role],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "ready"
    return child


def kill(child: Any) -> None:
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=30)


def reap(child: Any) -> None:
    """The child is gone, whatever the test did, and its pipe closed."""
    if child.poll() is None:
        kill(child)
    child.stdout.close()


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
def test_redis_holder_killed(redis_url: str, resource: str, flavour: str) -> None:
    """The holder is killed: its lock ends with its ttl, and the next acquire gets it."""
    child = start_child(flavour, "redis", redis_url, "", resource, "hold")
    manager = RedisLockManager(redis_url, fifo=True, queue_ttl=QUEUE_TTL)
    try:
        kill(child)
        killed = time.monotonic()
        assert manager.inspect(resource) is not None
        lease = manager.acquire(resource, timeout=TTL + 60)
        assert time.monotonic() - killed < TTL + SLACK
        lease.release()
    finally:
        reap(child)
        manager.close()


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
def test_redis_fifo_waiter_killed(redis_url: str, resource: str, flavour: str) -> None:
    """A FIFO waiter is killed in the queue: the release wakes its place, which nobody
    takes, and the waiter behind it is granted once that place ends (``queue_ttl``), not
    later; the place is gone."""
    keys = resource_keys("fence:", resource)
    client = redis.Redis.from_url(redis_url)
    manager = RedisLockManager(redis_url, fifo=True, queue_ttl=QUEUE_TTL)
    child = None
    try:
        holder = manager.acquire(resource)
        child = start_child(flavour, "redis", redis_url, "", resource, "wait")
        for _ in range(600):
            if client.zcard(keys.queue) >= 1:
                break
            time.sleep(0.05)
        assert client.zcard(keys.queue) == 1
        kill(child)
        holder.release()
        released = time.monotonic()
        lease = manager.acquire(resource, timeout=QUEUE_TTL + 60)
        assert time.monotonic() - released < QUEUE_TTL + SLACK
        lease.release()
        assert client.zcard(keys.queue) == 0
    finally:
        if child is not None:
            reap(child)
        client.close()
        manager.close()


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
def test_postgres_holder_killed(
    postgres_server: PostgresServer, table: str, resource: str, flavour: str
) -> None:
    """The holder is killed (its connection goes with it): the lock's row ends with its
    ttl, and the next acquire gets it."""
    url = postgres_server.url
    child = start_child(flavour, "postgres", url, table, resource, "hold")
    manager = SQLLockManager(url, table=table)
    try:
        kill(child)
        killed = time.monotonic()
        assert manager.inspect(resource) is not None
        lease = manager.acquire(resource, timeout=TTL + 60)
        assert time.monotonic() - killed < TTL + SLACK
        lease.release()
    finally:
        reap(child)
        manager.close()
