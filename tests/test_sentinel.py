"""Redis Sentinel: ``redis+sentinel://`` URLs for the managers and the guards, and a failover.

One Sentinel setup serves the session (a primary, a replica and one Sentinel, each server
with a password: ``tests/servers.py``), and one test fails it over. That test makes the
failover lose writes, as an asynchronous failover can: the replica is cut off, the primary
issues tokens and raises a fence that never reach the replica, and then the primary
crashes and the replica is promoted. Hybrid tokens do not go back; counter tokens do, which
is the risk ``docs/redis-manager.md`` describes, and shows that the writes were really lost.
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest
import redis

import fence
from fence import BackendError, ConfigurationError, StaleTokenError, TokenMode
from fence._sentinel import SentinelURL, parse_sentinel_url
from fence.adapters.redis import AsyncRedisGuard, RedisGuard
from tests.servers import SentinelSetup

# -- the URL form (no server) ---------------------------------------------------------------


def test_url_names_sentinels_service_db_and_both_passwords() -> None:
    got = parse_sentinel_url(
        "redis+sentinel://app:p%40ss@s1,s2:26380,[::1]:26381/mymaster/3"
        "?sentinel_password=s%2Bcret&sentinel_username=watcher"
    )
    assert got == SentinelURL(
        sentinels=(("s1", 26379), ("s2", 26380), ("::1", 26381)),
        service="mymaster",
        db=3,
        username="app",
        password="p@ss",
        sentinel_username="watcher",
        sentinel_password="s+cret",
    )
    assert "p@ss" not in str(got)
    assert "s+cret" not in str(got)
    assert "s+cret" not in repr(got)
    assert parse_sentinel_url("redis+sentinel://h/svc?db=2").db == 2
    assert parse_sentinel_url("REDIS+SENTINEL://h:1/svc/").db == 0


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis+sentinel://h:26379", "names the monitored service"),
        ("redis+sentinel://h:26379//0", "names the monitored service"),
        ("redis+sentinel:///svc", "names its Sentinels"),
        ("redis+sentinel://h,,g/svc", "empty host"),
        ("redis+sentinel://h:x/svc", "bad port"),
        ("redis+sentinel://h:0/svc", "bad port"),
        ("redis+sentinel://h/svc/x", "bad database"),
        ("redis+sentinel://h/svc/1/2", "not a usable"),
        ("redis+sentinel://h/svc?socket_timeout=1", "unknown option"),
        ("rediss+sentinel://h/svc", "TLS"),
    ],
)
def test_unusable_urls_are_refused_before_any_io(url: str, says: str) -> None:
    with pytest.raises(ConfigurationError, match=says):
        fence.connect(url)
    with pytest.raises(ConfigurationError, match=says):
        RedisGuard.from_url(url)


def test_sentinel_url_refuses_cluster_and_unknown_variants() -> None:
    with pytest.raises(ConfigurationError, match="Sentinel watches one primary"):
        fence.RedisLockManager("redis+sentinel://h/svc", cluster=True)
    with pytest.raises(ConfigurationError, match="redis\\+sentinel://"):
        fence.connect("redis+sentinal://h/svc")


# -- against the session's Sentinel ---------------------------------------------------------


def test_wrong_sentinel_password_is_a_retryable_backend_error(
    sentinel_setup: SentinelSetup, sentinel_url: str
) -> None:
    url = sentinel_url.replace(sentinel_setup.sentinel_password, "wrong")
    manager = fence.connect(url, check_config=False)
    try:
        with pytest.raises(BackendError, match="no Sentinel named a reachable pri") as caught:
            manager.acquire("order:1", timeout=0)
        assert caught.value.code == "UNAVAILABLE"
        assert caught.value.retryable
        assert "wrong" not in str(caught.value)
    finally:
        manager.close()


def test_managers_queue_for_the_connections_they_are_given(sentinel_url: str) -> None:
    # max_connections=1: four threads at once share one connection (and the pub/sub one)
    # instead of failing over a busy pool.
    import threading

    manager = fence.connect(sentinel_url, check_config=False, max_connections=1)
    errors: list[BaseException] = []

    def work(n: int) -> None:
        try:
            for _ in range(20):
                with manager.lock(f"queue:{n}", timeout=5):
                    pass
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(n,)) for n in range(4)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        pool = manager.driver.client.connection_pool
        assert len(pool._holding) == 0  # every slot came back
        assert pool._created_connections <= 2  # one for the calls, one for pub/sub
    finally:
        manager.close()


def _acquire_release(manager: fence.BaseLockManager, resource: str) -> int:
    lease = manager.acquire(resource, timeout=10)
    lease.release()
    return lease.token


async def _acquire_release_async(manager: fence.AsyncBaseLockManager, resource: str) -> int:
    lease = await manager.acquire(resource, timeout=10)
    await lease.release()
    return lease.token


@pytest.mark.slow
def test_failover_that_loses_writes_finds_the_new_primary_and_hybrid_tokens_go_on(
    sentinel_setup: SentinelSetup, sentinel_url: str
) -> None:
    setup = sentinel_setup
    assert setup.master_port() == setup.primary.port, "the session's only failover is this one"
    old, new = setup.primary, setup.replica
    hybrid = fence.connect(sentinel_url, check_config=False, ttl=5)
    counter = fence.connect(sentinel_url, check_config=False, ttl=5, token_mode=TokenMode.COUNTER)
    replicated = fence.connect(
        sentinel_url, check_config=False, ttl=5, min_replicas=1, replica_timeout=0.2
    )
    guard = RedisGuard.from_url(sentinel_url, scope="resource")
    loop = asyncio.Runner()
    amanager = fence.connect_async(sentinel_url, check_config=False, ttl=5)
    aguard = AsyncRedisGuard.from_url(sentinel_url, scope="resource")
    direct = redis.Redis.from_url(old.url)
    try:
        # 1. Tokens and a fence that the replica has.
        h1 = _acquire_release(hybrid, "h")
        c1 = _acquire_release(counter, "c")
        a1 = loop.run(_acquire_release_async(amanager, "a"))
        guard.set("{h}:v", "one", token=h1)
        loop.run(aguard.set("{a}:v", "one", token=a1))
        assert _acquire_release(replicated, "r") > 0  # the replica acknowledges (WAIT)
        direct.set("synced", 1)  # WAIT counts this connection's writes, and all before them
        assert direct.execute_command("WAIT", 1, 5000) == 1

        # 2. Cut the replica off: what the primary does now never reaches it.
        os.kill(new.proc.pid, signal.SIGSTOP)  # type: ignore[union-attr]
        direct.execute_command("CLIENT", "KILL", "TYPE", "replica")
        h2 = _acquire_release(hybrid, "h")
        c2 = _acquire_release(counter, "c")
        a2 = loop.run(_acquire_release_async(amanager, "a"))
        assert h2 > h1
        assert c2 == c1 + 1
        assert a2 > a1
        guard.set("{h}:v", "two", token=h2)
        loop.run(aguard.set("{a}:v", "two", token=a2))
        # With min_replicas, no token is handed out that the replica has not got.
        with pytest.raises(BackendError, match="replicas acknowledged") as caught:
            replicated.acquire("r", timeout=0)
        assert caught.value.code == "REPLICATION"

        # 3. The primary crashes; the replica, back, is promoted.
        old.kill()
        os.kill(new.proc.pid, signal.SIGCONT)  # type: ignore[union-attr]
        setup.failover(to=new)
        with redis.Redis.from_url(new.url) as promoted:
            assert int(promoted.get("fence:{c}:token") or 0) == c1, "the writes were lost"
            assert int(promoted.get("fence:{h}:fence") or 0) == h1

        # 4. The same managers and guards, not rebuilt, reach the new primary.
        h3 = _acquire_release(hybrid, "h")
        c3 = _acquire_release(counter, "c")
        a3 = loop.run(_acquire_release_async(amanager, "a"))
        assert h3 > h2, "a hybrid token went back after the failover"
        assert a3 > a2, "a hybrid token went back after the failover (asyncio)"
        # The counter's last write was lost with the old primary: its token is handed out
        # a second time, which is what the docs warn about.
        assert c3 == c2
        guard.set("{h}:v", "three", token=h3)
        assert guard.fence("{h}:v") == h3
        with pytest.raises(StaleTokenError):
            guard.set("{h}:v", "late", token=h2)
        loop.run(aguard.set("{a}:v", "three", token=a3))
        assert loop.run(aguard.fence("{a}:v")) == a3
        with redis.Redis.from_url(new.url) as promoted:
            assert promoted.get("{h}:v") == b"three"
            assert promoted.get("{a}:v") == b"three"
    finally:
        direct.close()
        for sync in (hybrid, counter, replicated):
            sync.close()
        guard.close()
        loop.run(amanager.close())
        loop.run(aguard.close())
        loop.close()
        if new.proc is not None:
            os.kill(new.proc.pid, signal.SIGCONT)
