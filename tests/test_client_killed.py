"""A client killed (``SIGKILL``) while it holds a lock, or while it waits for it, leaves
nothing that outlives its ttl (or its place's ``queue_ttl``): the next contender is granted
within that bound, on Redis, PostgreSQL, SQLite, etcd and the Redis quorum, whether the
dead client ran the sync or the asyncio manager.

A killed client sends no clean-up, so its lock lives out its ttl (etcd: its lease,
``ceil(ttl) + 1`` s) and its place in a queue its ``queue_ttl``; what these tests pin is
that nothing lives longer. A dead waiter is given a long ttl (:data:`WAITER_TTL`): had it
been granted the lock, or left anything tied to its lease, the next contender would wait
that long, past every bound here.
The other faults (a cancelled task, a timed-out acquire, a reply that never comes) are in
``tests/test_manager_cancellation.py``, ``tests/_async/test_manager_deadlines.py``,
``tests/test_reply_lost.py`` and ``tests/_async/test_redis_manager.py``; ZooKeeper's
killed contenders are in ``tests/_async/test_zookeeper_links.py``.
"""

from __future__ import annotations

import base64
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import redis

from fence._etcd import lease_seconds, queue_prefix, range_end
from fence._redis_keys import resource_keys
from fence._sql_schema import DEFAULT_TABLE, lease_schema_ddl
from fence._sync.etcd import EtcdLockManager
from fence._sync.quorum import QuorumLockManager
from fence._sync.redis import RedisLockManager
from fence._sync.sql import SQLLockManager
from tests.servers import EtcdCluster, PostgresServer
from tests.sqlite_files import sqlite_file

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent

#: A held lock's ttl: long enough that a loaded machine cannot let it lapse before the
#: test has seen the child hold it and killed it.
TTL = 5.0
QUEUE_TTL = 2.0
#: The ttl of a client killed while it waits: far past every bound the tests assert.
WAITER_TTL = 30.0
#: The queue ttl of the SQL manager (``fence._sql.QUEUE_TTL``), fixed.
SQL_QUEUE_TTL = 3.0
# Room for a loaded machine: the bound is the ttl, the slack only the time to notice.
SLACK = 4.0

# The dead client: takes the lock (or waits for it) with the flavour, the manager and the
# mode it is given, says "ready", and waits to be killed.
_CHILD = """
import asyncio, importlib, sys, time
flavour, kind, url, table, resource, role, mode, ttl = sys.argv[1:]
options = {"ttl": float(ttl)}
if kind == "redis":
    options.update(fifo=True, queue_ttl=QUEUE_TTL)
elif kind == "quorum":
    options.update(check_config=False)
elif table:
    options.update(table=table)
where = url.split(",") if kind == "quorum" else url
module, name = {
    "redis": ("redis", "RedisLockManager"),
    "postgres": ("sql", "SQLLockManager"),
    "sqlite": ("sql", "SQLLockManager"),
    "etcd": ("etcd", "EtcdLockManager"),
    "quorum": ("quorum", "QuorumLockManager"),
}[kind]
how = {} if mode == "write" else {"mode": mode}
if flavour == "sync":
    manager = getattr(importlib.import_module("fence._sync." + module), name)(where, **options)
    if role == "hold":
        manager.acquire(resource, **how)
    print("ready", flush=True)
    if role == "wait":
        manager.acquire(resource, timeout=600, **how)
    time.sleep(600)
else:
    cls = getattr(importlib.import_module("fence._async." + module), "Async" + name)

    async def main():
        manager = cls(where, **options)
        if role == "hold":
            await manager.acquire(resource, **how)
        print("ready", flush=True)
        if role == "wait":
            await manager.acquire(resource, timeout=600, **how)
        await asyncio.sleep(600)

    asyncio.run(main())
""".replace("QUEUE_TTL", repr(QUEUE_TTL))


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


def start_child(
    flavour: str,
    kind: str,
    url: str,
    table: str,
    resource: str,
    role: str,
    *,
    mode: str = "write",
    ttl: float = TTL,
) -> Any:
    """Start the client process; return it once it has said "ready"."""
    child = subprocess.Popen(
        [sys.executable, "-c", _CHILD, flavour, kind, url, table, resource, role, mode,
         str(ttl)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
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


def until(condition: Callable[[], object], what: str, seconds: float = 30.0) -> None:
    """Poll ``condition`` until it holds; fail after ``seconds``."""
    end = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < end, f"gave up waiting for {what}"
        time.sleep(0.05)


def granted_within(manager: Any, resource: str, since: float, bound: float) -> None:
    """The next acquire gets the lock, ``bound`` seconds after ``since`` at the latest; it
    may wait much longer, so that a broken bound fails here and not as a timeout."""
    lease = manager.acquire(resource, timeout=bound + 60)
    took = time.monotonic() - since
    lease.release()
    assert took < bound, f"granted {took:.2f} s after the kill (bound {bound:g} s)"


# -- Redis ------------------------------------------------------------------------------------


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


# -- SQL ----------------------------------------------------------------------------------------


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


def listening(conninfo: str, app: str) -> bool:
    """Whether a backend of ``app`` listens: its manager made an attempt and now waits."""
    with psycopg.connect(conninfo, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE application_name = %s AND query LIKE 'LISTEN%%'",
            (app,),
        ).fetchone()
    return bool(row and row[0])


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
def test_postgres_waiter_killed(
    postgres_server: PostgresServer, table: str, resource: str, flavour: str
) -> None:
    """A writer is killed while its acquire waits behind another writer (its attempt was
    refused; it listens for the release): it has no place in a queue and no row, so the
    next contender gets the lock as soon as the holder releases, not after the dead
    waiter's ttl."""
    app = f"fence-{table}"
    url = f"{postgres_server.url}?application_name={app}"
    manager = SQLLockManager(postgres_server.url, table=table)
    child = None
    try:
        holder = manager.acquire(resource)
        child = start_child(flavour, "postgres", url, table, resource, "wait", ttl=WAITER_TTL)
        until(lambda: listening(postgres_server.conninfo, app), "the waiter to listen")
        kill(child)
        holder.release()
        granted_within(manager, resource, time.monotonic(), SLACK)
    finally:
        if child is not None:
            reap(child)
        manager.close()


def places(kind: str, where: str, table: str, resource: str) -> int:
    """How many live places ``resource``'s queue has (``W`` and ``R`` rows whose time is
    not up, by the database's clock), read from the database (``where``: a conninfo, or a
    SQLite file). A place whose time is up may keep its row until the next clean-up."""
    now = "clock_timestamp()" if kind == "postgres" else "(julianday('now') - 2440587.5) * 86400"
    query = (
        f'SELECT count(*) FROM "{table}_shared"'
        f" WHERE resource = {{}} AND kind IN ('W', 'R') AND expires_at > {now}"
    )
    if kind == "sqlite":
        with sqlite_file(where) as conn:
            return int(conn.execute(query.format("?"), (resource,)).fetchone()[0])
    with psycopg.connect(where, autocommit=True) as conn:
        row = conn.execute(query.format("%s"), (resource,)).fetchone()
    return int(row[0]) if row else 0


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
@pytest.mark.parametrize("kind", ["postgres", "sqlite"])
def test_sql_queued_writer_killed(
    request: pytest.FixtureRequest, tmp_path: Path, resource: str, kind: str, flavour: str
) -> None:
    """A writer is killed while it waits behind a reader, with a place in the queue (which
    keeps new readers out): when the reader releases, the dead writer's place holds the
    lock until its queue ttl (3 s) ends, not longer; then the next writer is granted and
    the place is gone."""
    if kind == "postgres":
        server: PostgresServer = request.getfixturevalue("postgres_server")
        table = request.getfixturevalue("table")
        url, where = server.url, server.conninfo
    else:
        table = DEFAULT_TABLE
        where = str(tmp_path / "locks.db")
        url = f"sqlite:///{where}"
        with sqlite_file(where) as conn:
            for statement in lease_schema_ddl("sqlite"):
                conn.execute(statement)
    manager = SQLLockManager(url, table=table)
    child = None
    try:
        reader = manager.acquire(resource, mode="read")
        child = start_child(flavour, kind, url, table, resource, "wait", ttl=WAITER_TTL)
        until(lambda: places(kind, where, table, resource) == 1, "the writer's place")
        kill(child)
        reader.release()
        granted_within(manager, resource, time.monotonic(), SQL_QUEUE_TTL + SLACK)
        assert places(kind, where, table, resource) == 0
    finally:
        if child is not None:
            reap(child)
        manager.close()


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
def test_sqlite_holder_killed(tmp_path: Path, resource: str, flavour: str) -> None:
    """The holder is killed (SQLite's file locks go with its process): its lease ends
    with its ttl, and the next acquire gets it."""
    url = f"sqlite:///{tmp_path / 'locks.db'}"
    manager = SQLLockManager(url, create_table=True)
    child = None
    try:
        assert manager.inspect(resource) is None  # the table is there
        child = start_child(flavour, "sqlite", url, "", resource, "hold")
        kill(child)
        killed = time.monotonic()
        assert manager.inspect(resource) is not None
        granted_within(manager, resource, killed, TTL + SLACK)
    finally:
        if child is not None:
            reap(child)
        manager.close()


# -- etcd ---------------------------------------------------------------------------------------


def etcd_entries(cluster: EtcdCluster, url: str, resource: str) -> int:
    """How many keys ``resource``'s queue has (its holder's and its waiters'), read
    straight from the cluster."""
    start = queue_prefix(url.split("/", 3)[3], resource)
    reply = httpx.post(
        f"http://{cluster.endpoints[0]}/v3/kv/range",
        json={
            "key": base64.b64encode(start).decode(),
            "range_end": base64.b64encode(range_end(start)).decode(),
            "count_only": True,
        },
        timeout=10,
    ).json()
    return int(reply.get("count", 0))


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
def test_etcd_holder_killed(
    etcd_cluster: EtcdCluster, etcd_url: str, resource: str, flavour: str
) -> None:
    """The holder is killed: no keepalive comes, its lease (``ceil(ttl) + 1`` s) expires
    and takes its key, and the next acquire gets the lock."""
    child = start_child(flavour, "etcd", etcd_url, "", resource, "hold")
    manager = EtcdLockManager(etcd_url)
    try:
        kill(child)
        killed = time.monotonic()
        assert etcd_entries(etcd_cluster, etcd_url, resource) == 1
        granted_within(manager, resource, killed, lease_seconds(TTL) + SLACK)
        assert etcd_entries(etcd_cluster, etcd_url, resource) == 0
    finally:
        reap(child)
        manager.close()


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
def test_etcd_waiter_killed(
    etcd_cluster: EtcdCluster, etcd_url: str, resource: str, flavour: str
) -> None:
    """A waiter is killed in the queue: when the holder releases, the dead waiter's key
    comes first and goes when its lease expires (it renews that lease while it waits, so
    the lease is ``ceil(ttl) + 1`` s); then the next contender gets the lock. The dead
    waiter's ttl here is the short one: a waiter's lease is as long as its ttl."""
    manager = EtcdLockManager(etcd_url)
    child = None
    try:
        holder = manager.acquire(resource)
        child = start_child(flavour, "etcd", etcd_url, "", resource, "wait")
        until(lambda: etcd_entries(etcd_cluster, etcd_url, resource) == 2, "the waiter's key")
        kill(child)
        killed = time.monotonic()
        holder.release()
        granted_within(manager, resource, killed, lease_seconds(TTL) + SLACK)
        assert etcd_entries(etcd_cluster, etcd_url, resource) == 0
    finally:
        if child is not None:
            reap(child)
        manager.close()


# -- the Redis quorum ------------------------------------------------------------------------


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
def test_quorum_holder_killed(quorum_urls: list[str], resource: str, flavour: str) -> None:
    """The holder is killed: its lock ends with its ttl on every node, and the next
    acquire gets it."""
    child = start_child(flavour, "quorum", ",".join(quorum_urls), "", resource, "hold")
    manager = QuorumLockManager(quorum_urls, check_config=False)
    try:
        kill(child)
        killed = time.monotonic()
        assert manager.inspect(resource) is not None
        granted_within(manager, resource, killed, TTL + SLACK)
        key = resource_keys("fence:", resource).lock
        for url in quorum_urls:
            client = redis.Redis.from_url(url)
            try:
                assert client.exists(key) == 0
            finally:
                client.close()
    finally:
        reap(child)
        manager.close()


def subscribed(urls: list[str], channel: str) -> bool:
    """Whether a client listens on ``channel`` on one of the nodes: a quorum waiter
    waits there, on one node that refused it."""
    for url in urls:
        client = redis.Redis.from_url(url)
        try:
            if any(n for _, n in client.pubsub_numsub(channel)):
                return True
        finally:
            client.close()
    return False


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
def test_quorum_waiter_killed(quorum_urls: list[str], resource: str, flavour: str) -> None:
    """A waiter is killed while its acquire waits for a held lock (it listens on one
    node that refused it; the quorum queues nobody): it left nothing on the nodes, so
    when the holder releases, the next contender gets the lock at once, not after the
    dead waiter's ttl; no node keeps a lock."""
    manager = QuorumLockManager(quorum_urls, check_config=False)
    keys = resource_keys("fence:", resource)
    child = None
    try:
        holder = manager.acquire(resource)
        child = start_child(
            flavour, "quorum", ",".join(quorum_urls), "", resource, "wait", ttl=WAITER_TTL
        )
        until(lambda: subscribed(quorum_urls, keys.signal), "the waiter to listen")
        kill(child)
        holder.release()
        granted_within(manager, resource, time.monotonic(), SLACK)
        for url in quorum_urls:
            client = redis.Redis.from_url(url)
            try:
                assert client.exists(keys.lock) == 0
            finally:
                client.close()
    finally:
        if child is not None:
            reap(child)
        manager.close()
