"""An acquire granted by the server whose reply is lost with the connection leaves no lock
behind, on Redis, PostgreSQL, etcd and the Redis quorum, sync and asyncio.

A proxy between the manager and the server forwards everything until it is armed; while
armed, it throws away every reply of the server and closes that connection at both ends.
The acquire tries for a second and gives up with an error; the server has granted one of
its attempts (its token counter moved), and the clean-up cannot get through either. Once
replies flow again, the clean-up (retried from the background) frees the lock well within
its ttl (60 s here); without it, the lock stays for the whole ttl.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Iterator
from typing import Any

import httpx
import psycopg
import pytest
import redis

from fence import BackendError
from fence._async.etcd import AsyncEtcdLockManager
from fence._async.quorum import AsyncQuorumLockManager
from fence._async.redis import AsyncRedisLockManager
from fence._async.sql import AsyncSQLLockManager
from fence._redis_keys import resource_keys
from fence._sql_schema import lease_schema_ddl
from fence._sync.etcd import EtcdLockManager
from fence._sync.quorum import QuorumLockManager
from fence._sync.redis import RedisLockManager
from fence._sync.sql import SQLLockManager
from tests.proxies import ReplyDropper
from tests.servers import EtcdCluster, PostgresServer

pytestmark = pytest.mark.slow

TTL = 60.0


@pytest.fixture
def resource() -> str:
    return f"res:{secrets.token_hex(4)}"


# The asyncio managers' loop, the same for every call of a test: their background work
# (the clean-up that retries) belongs to it.
loop = asyncio.new_event_loop()


@pytest.fixture(scope="module", autouse=True)
def _close_loop() -> Iterator[None]:
    yield
    loop.close()


def run(flavour: str, target: Any, method: str, *args: Any, **kwargs: Any) -> Any:
    """Call ``target``'s ``method`` (a manager's, a lease's), awaited if it is asyncio's."""
    if flavour == "sync":
        return getattr(target, method)(*args, **kwargs)

    async def call() -> Any:
        return await getattr(target, method)(*args, **kwargs)

    return loop.run_until_complete(call())


def check_reply_lost(flavour: str, manager: Any, proxy: ReplyDropper, resource: str) -> None:
    """Warm up (config check, scripts, a pooled connection), then lose every reply while an
    acquire tries for a second: it gives up with an error, its clean-up cannot get through
    either, and once replies flow again the clean-up (from the background) frees the lock
    long before its ttl."""
    run(flavour, run(flavour, manager, "acquire", resource), "release")
    proxy.armed.set()
    try:
        with pytest.raises(BackendError):
            run(flavour, manager, "acquire", resource, timeout=1)
    finally:
        proxy.armed.clear()
    assert proxy.dropped > 0
    assert wait_free(flavour, manager, resource, 20.0)


def wait_free(flavour: str, manager: Any, resource: str, seconds: float) -> bool:
    """Whether the lock is free within ``seconds`` (the manager's background work runs
    meanwhile, on its event loop for asyncio)."""

    async def poll() -> bool:
        for _ in range(int(seconds / 0.1)):
            if await manager.inspect(resource) is None:
                return True
            await asyncio.sleep(0.1)
        return False

    if flavour != "sync":
        return loop.run_until_complete(poll())
    for _ in range(int(seconds / 0.1)):
        if manager.inspect(resource) is None:
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
def test_redis_reply_lost(redis_url: str, resource: str, flavour: str) -> None:
    client = redis.Redis.from_url(redis_url)
    host, port = (
        client.connection_pool.connection_kwargs["host"],
        client.connection_pool.connection_kwargs["port"],
    )
    proxy = ReplyDropper(host, port)
    url = f"redis://127.0.0.1:{proxy.port}/0"
    cls = RedisLockManager if flavour == "sync" else AsyncRedisLockManager
    manager = cls(url, ttl=TTL, check_config=False)
    try:
        check_reply_lost(flavour, manager, proxy, resource)
        token = int(client.get(resource_keys("fence:", resource).token))
        assert token >= 2  # the server granted the acquire whose reply was lost
        assert client.exists(resource_keys("fence:", resource).lock) == 0
    finally:
        run(flavour, manager, "close")
        proxy.close()
        client.close()


@pytest.fixture
def table(postgres_server: PostgresServer) -> Iterator[str]:
    name = f"leases_{secrets.token_hex(4)}"
    with psycopg.connect(postgres_server.conninfo, autocommit=True) as conn:
        for statement in lease_schema_ddl("postgresql", table=name):
            conn.execute(statement)
    yield name
    with psycopg.connect(postgres_server.conninfo, autocommit=True) as conn:
        conn.execute(f'DROP TABLE IF EXISTS "{name}", "{name}_shared"')


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
def test_postgres_reply_lost(
    postgres_server: PostgresServer, table: str, resource: str, flavour: str
) -> None:
    proxy = ReplyDropper("127.0.0.1", postgres_server.port)
    url = postgres_server.url.replace(f":{postgres_server.port}/", f":{proxy.port}/")
    cls = SQLLockManager if flavour == "sync" else AsyncSQLLockManager
    manager = cls(url, table=table, ttl=TTL)
    try:
        check_reply_lost(flavour, manager, proxy, resource)
        with psycopg.connect(postgres_server.conninfo, autocommit=True) as conn:
            token, owner = conn.execute(
                f'SELECT token, owner FROM "{table}" WHERE resource = %s', (resource,)
            ).fetchone()
        assert token >= 2  # the server granted the acquire whose reply was lost
        assert owner is None
    finally:
        run(flavour, manager, "close")
        proxy.close()


def etcd_revision(endpoint: str) -> int:
    """The etcd cluster's current revision (every write moves it)."""
    reply = httpx.post(f"http://{endpoint}/v3/kv/range", json={"key": "AA=="}, timeout=10)
    return int(reply.json()["header"]["revision"])


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
def test_etcd_reply_lost(
    etcd_cluster: EtcdCluster, etcd_url: str, resource: str, flavour: str
) -> None:
    """The same against one etcd member, for the transaction that joins the queue (the
    lease grant before it goes through): every reply to it is dropped, on a connection
    of its own each, so the acquire, which sends it again, gives up after a second with
    its key written. The clean-up revokes the lease, and the key goes with it, long
    before the lease's 61 s."""
    endpoint = etcd_cluster.endpoints[0]
    host, port = endpoint.rsplit(":", 1)
    proxy = ReplyDropper(host, int(port), only=b"/v3/kv/txn")
    url = f"etcd://127.0.0.1:{proxy.port}/{etcd_url.split('/', 3)[3]}"
    cls = EtcdLockManager if flavour == "sync" else AsyncEtcdLockManager
    manager = cls(url, ttl=TTL)
    try:
        before = etcd_revision(endpoint)
        check_reply_lost(flavour, manager, proxy, resource)
        # The warm-up's put and delete, then the lost acquire's put and the clean-up's
        # delete: the acquire whose replies were lost did write its key.
        assert etcd_revision(endpoint) - before >= 4
    finally:
        run(flavour, manager, "close")
        proxy.close()


# -- the Redis quorum ------------------------------------------------------------------------

#: The quorum's ttl when its nodes stay cut off: the lock they hold must end with it.
CUT_TTL = 6.0
# Room for a loaded machine past a bound that is the ttl.
SLACK = 4.0


def node_has(url: str, key: str) -> bool:
    client = redis.Redis.from_url(url, socket_timeout=5)
    try:
        return bool(client.exists(key))
    finally:
        client.close()


def node_counter(url: str, resource: str) -> int:
    client = redis.Redis.from_url(url, socket_timeout=5)
    try:
        return int(client.get(resource_keys("fence:", resource).token) or 0)
    finally:
        client.close()


def nodes_free(flavour: str, urls: list[str], key: str, seconds: float) -> bool:
    """Whether no node has ``key`` within ``seconds`` (the manager's background work runs
    meanwhile, on its event loop for asyncio)."""
    for _ in range(int(seconds / 0.1)):
        if not any(node_has(url, key) for url in urls):
            return True
        if flavour == "sync":
            time.sleep(0.1)
        else:
            loop.run_until_complete(asyncio.sleep(0.1))
    return False


@pytest.mark.redis
@pytest.mark.parametrize("heals", [True, False], ids=["link-heals", "link-stays-down"])
@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
def test_quorum_reply_lost(
    quorum_urls: list[str], resource: str, flavour: str, heals: bool
) -> None:
    """Two nodes of three (a majority) grant the acquire, and their replies are lost with
    the connection; the link to each then stays cut (no request gets through: not the
    quorum's undo, nor the manager's clean-up). The third node's grant is undone, the
    acquire gives up with an error, and the two nodes hold the lock for a secret nobody
    has: a majority, so nobody else can take it. When the links heal, the clean-up from
    the background frees it long before its ttl (60 s); while they stay cut, it ends with
    its ttl (6 s) and a contender that reaches the nodes directly gets it then, not
    later."""
    ttl = TTL if heals else CUT_TTL
    proxies = []
    for url in quorum_urls[:2]:
        host, port = url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
        proxies.append(ReplyDropper(host, int(port), cut_off=True))
    targets = [f"redis://127.0.0.1:{p.port}/0" for p in proxies] + quorum_urls[2:]
    cls = QuorumLockManager if flavour == "sync" else AsyncQuorumLockManager
    manager = cls(targets, ttl=ttl, check_config=False)
    contender = QuorumLockManager(quorum_urls, check_config=False)
    key = resource_keys("fence:", resource).lock
    try:
        run(flavour, run(flavour, manager, "acquire", resource), "release")  # warm up
        before = [node_counter(url, resource) for url in quorum_urls[:2]]
        for proxy in proxies:
            proxy.armed.set()
        sent = time.monotonic()
        try:
            with pytest.raises(BackendError):
                run(flavour, manager, "acquire", resource, timeout=1)
            held = [node_has(url, key) for url in quorum_urls]
            assert all(proxy.cut.is_set() for proxy in proxies)
        finally:
            if heals:
                for proxy in proxies:
                    proxy.heal()
        # Both nodes granted the acquire whose reply was lost: their counters moved.
        assert all(a > b for a, b in zip(
            [node_counter(url, resource) for url in quorum_urls[:2]], before, strict=True
        ))  # fmt: skip
        if heals:
            assert held == [True, True, False]  # the orphan, on a majority
            # Read on the nodes: an uncommitted orphan has a different token on each node,
            # so the manager's inspect, which needs a majority to agree, calls it free.
            assert nodes_free(flavour, quorum_urls, key, 20.0)
        else:
            lease = contender.acquire(resource, timeout=ttl + 60)
            took = time.monotonic() - sent
            lease.release()
            assert took < ttl + SLACK, f"granted {took:.2f} s after the grant (ttl {ttl:g} s)"
    finally:
        for proxy in proxies:
            proxy.heal()
        run(flavour, manager, "close")
        contender.close()
        for proxy in proxies:
            proxy.close()
