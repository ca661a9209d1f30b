"""A task cancelled inside the acquire's round trip leaves no lock behind, on every manager.

The request has reached the server (or will, when it runs again) when the task is
cancelled; the attempt may be granted after all. The manager cleans up before the
``CancelledError`` reaches the caller, so the lock is free at the next round trip instead
of being held for the whole ttl by a secret nobody has (etcd and ZooKeeper: also when
the join ran and its reply is held back). A task cancelled while it waits in the queue
of etcd or ZooKeeper takes its entry out, so the contenders behind it do not wait for its
lease or session to end. asyncio only: a thread cannot be cancelled (its
timeouts are in ``tests/_async/test_manager_deadlines.py`` and, for a waiter on etcd and
ZooKeeper, ``tests/test_consensus_managers.py``).
"""

from __future__ import annotations

import asyncio
import base64
import os
import secrets
import signal
import socket
import sqlite3
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import psycopg
import pytest
import redis
from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

from fence import MemoryBackend
from fence._async.etcd import AsyncEtcdLockManager
from fence._async.memory import AsyncMemoryLockManager
from fence._async.quorum import AsyncQuorumLockManager
from fence._async.redis import AsyncRedisLockManager
from fence._async.sql import AsyncSQLLockManager
from fence._async.zookeeper import AsyncZooKeeperLockManager
from fence._etcd import queue_prefix, range_end
from fence._quorum import SCRIPTS as QUORUM_SCRIPTS
from fence._redis_keys import resource_keys
from fence._zookeeper import queue_order, resource_path
from tests.proxies import ReplyHolder
from tests.proxy_zookeeper import MULTI, ZooKeeperProxy
from tests.servers import EtcdCluster, PostgresServer, RedisServer, ZooKeeperEnsemble

pytestmark = pytest.mark.slow


@pytest.fixture
def resource() -> str:
    return f"res:{secrets.token_hex(4)}"


@pytest.fixture
def debug_redis() -> Iterator[RedisServer]:
    """A redis-server of the test's own that allows ``DEBUG SLEEP``."""
    server = RedisServer("--enable-debug-command", "yes").start()
    yield server
    server.stop()


async def cancel_after(task: asyncio.Task[object], seconds: float) -> None:
    """Cancel ``task`` after ``seconds`` and wait until the cancellation reached its caller."""
    await asyncio.sleep(seconds)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.parametrize("fifo", [False, True])
async def test_redis_cancelled_inside_the_round_trip(
    debug_redis: RedisServer, resource: str, fifo: bool
) -> None:
    """The server is busy (``DEBUG SLEEP``) while the acquire's request waits in its
    buffer; the task is cancelled. By the time the cancellation reaches the caller, the
    clean-up has been sent: when the server wakes it refuses (or releases) the attempt,
    in whichever order it reads the two, and the next attempt finds the lock free."""
    manager = AsyncRedisLockManager(debug_redis.url, ttl=60, fifo=fifo)
    other = AsyncRedisLockManager(debug_redis.url, ttl=60, fifo=fifo)
    raw = redis.Redis.from_url(debug_redis.url)
    # DEBUG SLEEP is sent from here, before the acquire, on a connection already open: the
    # server reads it first. It sleeps 3 s, room for a loaded machine to cancel in time.
    sleeper = socket.create_connection(("127.0.0.1", debug_redis.port))
    try:
        assert await manager.inspect(resource) is None  # connected
        sleeper.sendall(b"*3\r\n$5\r\nDEBUG\r\n$5\r\nSLEEP\r\n$1\r\n3\r\n")
        await asyncio.sleep(0.1)  # the server sleeps from now on
        task = asyncio.create_task(manager.acquire(resource, timeout=30))
        await cancel_after(task, 0.2)
        sleeper.settimeout(60)
        assert sleeper.recv(16) == b"+OK\r\n"  # the server woke
        assert await other.inspect(resource) is None
        lease = await other.try_acquire(resource)
        assert lease is not None
        await lease.release()
        # The clean-up reached the server (its tombstone is there, whenever the server read
        # it), and the stranded attempt never took the lock.
        void = resource_keys("fence:", resource).void_prefix
        for _ in range(100):
            if len(list(raw.scan_iter(match=void + "*"))) == 1:
                break
            await asyncio.sleep(0.05)
        assert len(list(raw.scan_iter(match=void + "*"))) == 1
        assert await other.inspect(resource) is None
    finally:
        sleeper.close()
        raw.close()
        await manager.close()
        await other.close()


async def test_redis_cancelled_while_the_server_is_stopped(resource: str) -> None:
    """Cancelled while the server is frozen (SIGSTOP): the caller gets its cancellation
    after at most the clean-up limit, and once the server runs again the lock is free."""
    server = RedisServer().start()
    manager = AsyncRedisLockManager(server.url, ttl=60)
    try:
        assert await manager.inspect(resource) is None
        server.pause()
        try:
            task = asyncio.create_task(manager.acquire(resource, timeout=30))
            await cancel_after(task, 0.3)
        finally:
            server.resume()
        assert await manager.inspect(resource) is None
        lease = await manager.try_acquire(resource)
        assert lease is not None
        await lease.release()
    finally:
        await manager.close()
        server.stop()


async def test_postgres_cancelled_inside_the_round_trip(
    postgres_server: PostgresServer, resource: str
) -> None:
    """The acquire's statement waits behind another transaction's row lock when the task
    is cancelled: psycopg cancels it on the server, the manager's clean-up refuses it and
    releases whatever it did, and when the other transaction ends the lock is free."""
    table = f"leases_{secrets.token_hex(4)}"
    manager = AsyncSQLLockManager(postgres_server.url, table=table, create_table=True, ttl=60)
    try:
        first = await manager.acquire(resource)
        await first.release()
        with psycopg.connect(postgres_server.conninfo) as blocker:
            blocker.execute(
                f'SELECT 1 FROM "{table}" WHERE resource = %s FOR UPDATE',
                (resource,),
            )
            task = asyncio.create_task(manager.acquire(resource, timeout=30))
            await cancel_after(task, 0.3)
        for _ in range(100):
            if await manager.inspect(resource) is None:
                break
            await asyncio.sleep(0.05)
        assert await manager.inspect(resource) is None
        lease = await manager.try_acquire(resource)
        assert lease is not None
        await lease.release()
    finally:
        await manager.close()
        with psycopg.connect(postgres_server.conninfo, autocommit=True) as conn:
            conn.execute(f'DROP TABLE IF EXISTS "{table}"')


async def test_postgres_cancelled_before_the_server_read_the_statement(
    postgres_server: PostgresServer, resource: str
) -> None:
    """The task is cancelled while the acquire's statement waits, unread, for a backend
    that is frozen (``SIGSTOP``); psycopg's cancel request reaches a backend that has not
    started the statement, which ignores it. The clean-up commits first; then the backend
    runs the statement, which finds the clean-up's tombstone and takes nothing."""
    table = f"leases_{secrets.token_hex(4)}"
    app = f"fence-{table}"
    manager = AsyncSQLLockManager(
        postgres_server.url,
        table=table,
        create_table=True,
        ttl=60,
        engine_options={"connect_args": {"application_name": app}},
    )

    def backends() -> list[tuple[int, str, str]]:
        with psycopg.connect(postgres_server.conninfo, autocommit=True) as conn:
            return conn.execute(
                "SELECT pid, state, query FROM pg_stat_activity WHERE application_name = %s",
                (app,),
            ).fetchall()

    async def until(condition: Callable[[], bool]) -> None:
        for _ in range(1000):
            if condition():
                return
            await asyncio.sleep(0.02)
        raise AssertionError("gave up waiting")

    try:
        first = await manager.acquire(resource)
        await first.release()
        (pid,) = [row[0] for row in backends()]  # the pool's one connection
        os.kill(pid, signal.SIGSTOP)
        try:
            task = asyncio.create_task(manager.acquire(resource, timeout=30))
            await cancel_after(task, 0.3)
            await until(
                lambda: any(p != pid and s == "idle" and q == "COMMIT" for p, s, q in backends())
            )
        finally:
            os.kill(pid, signal.SIGCONT)
        await until(lambda: pid not in {row[0] for row in backends()})
        assert await manager.inspect(resource) is None
        lease = await manager.try_acquire(resource)
        assert lease is not None
        assert lease.token > first.token
        await lease.release()
    finally:
        await manager.close()
        with psycopg.connect(postgres_server.conninfo, autocommit=True) as conn:
            conn.execute(f'DROP TABLE IF EXISTS "{table}", "{table}_shared"')


async def test_memory_cancelled_while_the_backend_is_paused(resource: str) -> None:
    backend = MemoryBackend()
    manager = AsyncMemoryLockManager(backend, ttl=60)
    try:
        backend.pause()
        try:
            task = asyncio.create_task(manager.acquire(resource, timeout=30))
            await cancel_after(task, 0.1)
        finally:
            backend.resume()
        assert await manager.inspect(resource) is None
        lease = await manager.try_acquire(resource)
        assert lease is not None
        await lease.release()
    finally:
        await manager.close()


async def test_sqlite_cancelled_inside_the_round_trip(tmp_path: Path, resource: str) -> None:
    """The acquire's statement waits for another connection's write lock (SQLite's busy
    wait, in aiosqlite's thread, which a cancelled task does not stop) when the task is
    cancelled; the other connection commits a moment later and the stranded statement is
    granted the lock after all. The cancellation reaches the caller once that statement is
    done, and the clean-up that follows releases what it took."""
    path = tmp_path / "locks.db"
    manager = AsyncSQLLockManager(f"sqlite:///{path}", create_table=True, ttl=60)
    try:
        first = await manager.acquire(resource)
        await first.release()
        blocker = sqlite3.connect(path, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        try:
            task = asyncio.create_task(manager.acquire(resource, timeout=30))
            await asyncio.sleep(0.3)  # the statement waits for the blocker's write lock
            task.cancel()
            blocker.execute("COMMIT")  # then it gets the lock, in aiosqlite's thread
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            blocker.close()
        assert await manager.inspect(resource) is None
        lease = await manager.try_acquire(resource)
        assert lease is not None
        assert lease.token > first.token
        await lease.release()
    finally:
        await manager.close()


async def test_zookeeper_cancelled_inside_the_join(
    zookeeper_ensemble: ZooKeeperEnsemble, zookeeper_url: str, zookeeper_proxy: ZooKeeperProxy
) -> None:
    """The join (the multi-operation that creates the contender's node) reached the
    ensemble and its reply is held by a frozen link (``tests/proxy_zookeeper.py``) when
    the task is cancelled. The node is the lock, or a place in its queue, for a secret
    nobody has: it goes when the reply comes, well within the lease's ttl (5 s)."""
    root = "/" + zookeeper_url.split("/", 3)[3]
    path = resource_path(root, "cancelled")
    manager = AsyncZooKeeperLockManager(
        f"zookeeper://{zookeeper_proxy.hosts}{root}", ttl=5, request_timeout=5
    )
    observer = KazooClient(hosts=zookeeper_ensemble.hosts)
    observer.start(timeout=15)

    def nodes() -> list[str]:
        try:
            observer.sync(path)
            return queue_order(observer.get_children(path))
        except NoNodeError:
            return []

    try:
        await (await manager.acquire("cancelled", timeout=10)).release()  # connected
        zookeeper_proxy.hold_reply(MULTI)
        task = asyncio.create_task(manager.acquire("cancelled", timeout=30))
        for _ in range(200):
            if zookeeper_proxy.held:
                break
            await asyncio.sleep(0.05)
        assert zookeeper_proxy.held == [MULTI]
        await cancel_after(task, 0.0)
        assert len(nodes()) == 1  # the join landed
        zookeeper_proxy.thaw()
        for _ in range(100):
            if not nodes():
                break
            await asyncio.sleep(0.05)
        assert nodes() == []
        lease = await manager.try_acquire("cancelled")
        assert lease is not None
        await lease.release()
    finally:
        zookeeper_proxy.thaw()
        await manager.close()
        observer.stop()
        observer.close()


def queue_entries(request: pytest.FixtureRequest, kind: str, url: str, resource: str) -> int:
    """How many entries ``resource``'s queue has (its holder's and its waiters'), read
    straight from the session's etcd cluster or ZooKeeper ensemble."""
    path = url.split("/", 3)[3]
    if kind == "etcd":
        cluster: EtcdCluster = request.getfixturevalue("etcd_cluster")
        start = queue_prefix(path, resource)
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
    ensemble: ZooKeeperEnsemble = request.getfixturevalue("zookeeper_ensemble")
    client = KazooClient(hosts=ensemble.hosts)
    client.start(timeout=15)
    try:
        node = resource_path("/" + path, resource)
        client.sync(node)
        return len(queue_order(client.get_children(node)))
    except NoNodeError:
        return 0
    finally:
        client.stop()
        client.close()


@pytest.mark.parametrize("kind", ["etcd", "zookeeper"])
async def test_consensus_cancelled_while_waiting(
    request: pytest.FixtureRequest, resource: str, kind: str
) -> None:
    """A task cancelled while it waits in the queue behind a holder takes its entry out
    (etcd: it revokes its lease; ZooKeeper: it deletes its node) before the cancellation
    reaches the caller, not when its lease or session ends (30 s here): once the holder
    releases, the next contender gets the lock at once (10 s is room for a loaded
    machine, a third of the lease)."""
    url = request.getfixturevalue(f"{kind}_url")
    cls = AsyncEtcdLockManager if kind == "etcd" else AsyncZooKeeperLockManager
    holder, waiter = cls(url, ttl=30), cls(url, ttl=30)

    async def until(condition: Callable[[], bool], what: str) -> None:
        for _ in range(200):
            if condition():
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"gave up waiting for {what}")

    try:
        lease = await holder.acquire(resource)
        task = asyncio.create_task(waiter.acquire(resource, timeout=60))
        await until(lambda: queue_entries(request, kind, url, resource) == 2, "the waiter")
        await cancel_after(task, 0.0)
        await until(lambda: queue_entries(request, kind, url, resource) == 1, "the entry to go")
        await lease.release()
        released = time.monotonic()
        again = await waiter.acquire(resource, timeout=30)
        took = time.monotonic() - released
        await again.release()
        assert took < 10.0, f"granted {took:.2f} s after the release"
    finally:
        await holder.close()
        await waiter.close()


@pytest.mark.parametrize("held", [False, True], ids=["lock-free", "lock-held"])
async def test_etcd_cancelled_inside_the_join(
    request: pytest.FixtureRequest,
    etcd_cluster: EtcdCluster,
    etcd_url: str,
    resource: str,
    held: bool,
) -> None:
    """The transaction that joins the queue (its key, on the contender's lease) has run
    on the member, and its reply is held (:class:`ReplyHolder`) when the task is
    cancelled. The key is the lock (the lock was free), or a place behind a holder, for a
    secret nobody has; its lease lives 31 s. The manager revokes that lease before the
    cancellation reaches the caller: the key is gone, and the next contender gets the lock
    at once (or when the holder releases), not when the lease ends."""
    host, port = etcd_cluster.endpoints[0].rsplit(":", 1)
    proxy = ReplyHolder(host, int(port), b"/v3/kv/txn")
    path = etcd_url.split("/", 3)[3]
    manager = AsyncEtcdLockManager(f"etcd://127.0.0.1:{proxy.port}/{path}", ttl=30)
    other = AsyncEtcdLockManager(etcd_url, ttl=30)

    def entries() -> int:
        return queue_entries(request, "etcd", etcd_url, resource)

    try:
        await (await manager.acquire(resource, timeout=10)).release()  # connected
        lease = await other.acquire(resource, timeout=10) if held else None
        proxy.armed.set()
        task = asyncio.create_task(manager.acquire(resource, timeout=60))
        for _ in range(600):
            if proxy.held.is_set():
                break
            await asyncio.sleep(0.05)
        assert proxy.held.is_set()
        assert entries() == 1 + int(held)  # the join landed
        await cancel_after(task, 0.0)
        proxy.armed.clear()
        # The revoke is sent before the caller hears of the cancellation; a member slow to
        # answer (a loaded machine) gets it from the background, well within the lease.
        for _ in range(200):
            if entries() == int(held):
                break
            await asyncio.sleep(0.05)
        assert entries() == int(held)
        if lease is not None:
            await lease.release()
        released = time.monotonic()
        again = await other.acquire(resource, timeout=60)
        took = time.monotonic() - released
        await again.release()
        assert took < 10.0, f"granted {took:.2f} s after the cancellation (lease 31 s)"
    finally:
        await manager.close()
        await other.close()
        proxy.close()


async def test_etcd_cancelled_inside_the_attempt_after_the_wake(
    request: pytest.FixtureRequest, etcd_cluster: EtcdCluster, etcd_url: str, resource: str
) -> None:
    """A waiter queued behind a holder is woken by the release; the first round trip of
    its next attempt (the keepalive of its lease) has run on the member and its reply is
    held (:class:`ReplyHolder`) when the task is cancelled. Its key comes first now: the
    lock is its own, for a secret nobody has, and its lease lives 31 s. The manager
    revokes the lease before the cancellation reaches the caller (and takes its place
    out): the next contender gets the lock at once, not when the lease ends."""
    host, port = etcd_cluster.endpoints[0].rsplit(":", 1)
    proxy = ReplyHolder(host, int(port), b"/v3/lease/keepalive")
    path = etcd_url.split("/", 3)[3]
    manager = AsyncEtcdLockManager(f"etcd://127.0.0.1:{proxy.port}/{path}", ttl=30)
    other = AsyncEtcdLockManager(etcd_url, ttl=30)

    async def until(condition: Callable[[], bool], what: str) -> None:
        for _ in range(400):
            if condition():
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"gave up waiting for {what}")

    def entries() -> int:
        return queue_entries(request, "etcd", etcd_url, resource)

    try:
        lease = await other.acquire(resource, timeout=10)
        task = asyncio.create_task(manager.acquire(resource, timeout=60))
        await until(lambda: entries() == 2, "the waiter's key")
        proxy.armed.set()
        await lease.release()
        await until(proxy.held.is_set, "the waiter's keepalive")
        assert entries() == 1  # the waiter's key, first in the queue
        await cancel_after(task, 0.0)
        proxy.armed.clear()
        cancelled = time.monotonic()
        await until(lambda: entries() == 0, "the waiter's key to go")
        again = await other.acquire(resource, timeout=60)
        took = time.monotonic() - cancelled
        await again.release()
        assert took < 10.0, f"granted {took:.2f} s after the cancellation (lease 31 s)"
    finally:
        await manager.close()
        await other.close()
        proxy.close()


async def test_quorum_cancelled_inside_the_acquire_round(
    quorum_urls: list[str], resource: str
) -> None:
    """Two nodes of three (a majority) have run the acquire and their replies are held
    (:class:`ReplyHolder`: the requests go through, no reply comes back) when the task is
    cancelled. The undo that goes out before the cancellation reaches the caller runs on
    every node, whether or not its reply comes: nobody is left holding the lock for a
    secret nobody has, and a contender gets it at once, while those replies are still
    held (its ttl is 60 s)."""
    proxies = []
    for url in quorum_urls[:2]:
        host, port = url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
        proxies.append(ReplyHolder(host, int(port), b"EVALSHA"))
    targets = [f"redis://127.0.0.1:{p.port}/0" for p in proxies] + quorum_urls[2:]
    manager = AsyncQuorumLockManager(targets, ttl=60, check_config=False)
    other = AsyncQuorumLockManager(quorum_urls, ttl=60, check_config=False)
    keys = resource_keys("fence:", resource)
    clients = [redis.Redis.from_url(url, socket_timeout=5) for url in quorum_urls]

    def tokens() -> list[int]:
        return [int(client.get(keys.token) or 0) for client in clients[:2]]

    try:
        for client in clients:
            # As on a node in service, every script is loaded: a held NOSCRIPT reply would
            # keep the undo from running at all.
            for source in QUORUM_SCRIPTS.values():
                client.script_load(source)
        await (await manager.acquire(resource, timeout=10)).release()  # warm up
        before = tokens()
        for proxy in proxies:
            proxy.armed.set()
        task = asyncio.create_task(manager.acquire(resource, timeout=60))
        for _ in range(600):
            if all(proxy.held.is_set() for proxy in proxies):
                break
            await asyncio.sleep(0.05)
        assert all(proxy.held.is_set() for proxy in proxies)
        assert all(a > b for a, b in zip(tokens(), before, strict=True))  # both granted it
        await cancel_after(task, 0.0)
        for _ in range(200):
            if not any(client.exists(keys.lock) for client in clients):
                break
            await asyncio.sleep(0.05)
        assert not any(client.exists(keys.lock) for client in clients)
        lease = await other.try_acquire(resource)
        assert lease is not None  # the replies are held still
        await lease.release()
    finally:
        for proxy in proxies:
            proxy.armed.clear()
        await manager.close()
        await other.close()
        for client in clients:
            client.close()
        for proxy in proxies:
            proxy.close()
