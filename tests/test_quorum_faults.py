"""The quorum manager against real faults on its nodes, and its rules without I/O.

Every fault test starts its own three redis-servers (``tests/fix_quorum.py``), so killing,
stopping or wiping them disturbs no other test. A node is wiped the hard way: SIGKILL, its
directory emptied, started again with no data.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import random
import secrets
import shutil
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from fence import (
    AcquireTimeout,
    BackendError,
    EventBus,
    EventKind,
    FenceWarning,
    LockInfo,
    TokenMode,
)
from fence._async.quorum import AsyncQuorumLockManager
from fence._chaos.servers import free_port
from fence._quorum import (
    SCRIPTS,
    backoff_delay,
    commit_needed,
    majority,
    merge_inspections,
    merge_tokens,
    node_config_warnings,
    time_until_free,
    validity,
)
from fence._redis_keys import resource_keys
from fence._sync.quorum import QuorumLockManager
from fence.testing import EventRecorder
from tests.fix_quorum import set_up, start_nodes, stop_nodes
from tests.servers import RedisServer

# -- the rules, without I/O ------------------------------------------------------------------


def test_majority() -> None:
    assert [majority(n) for n in (1, 2, 3, 4, 5)] == [1, 2, 2, 3, 3]


def test_validity_subtracts_elapsed_time_and_redlock_drift() -> None:
    """Redlock: validity = ttl - elapsed - (ttl * drift + constant)."""
    assert validity(10.0, 0.1, drift=0.01, margin=0.002) == pytest.approx(10 - 0.1 - 0.102)
    assert validity(1.0, 0.995, drift=0.01, margin=0.002) < 0


def test_merge_tokens_takes_the_largest_candidate() -> None:
    assert merge_tokens([6, 4, 5]) == 6
    with pytest.raises(ValueError, match="no token"):
        merge_tokens([])


def test_commit_is_skipped_only_when_every_node_proposed_the_same_token() -> None:
    assert not commit_needed([7, 7, 7], 3)
    assert commit_needed([7, 7], 3)  # a node did not grant: it must learn the token
    assert commit_needed([7, 8, 7], 3)  # the token exists on one node only


def test_time_until_free_counts_the_nodes_a_majority_needs() -> None:
    # three nodes, none free: the second-shortest holder ttl frees a majority
    assert time_until_free([3.0, 1.0, 2.0], 0, 3) == 2.0
    assert time_until_free([2.0], 1, 3) == 2.0
    assert time_until_free([None, 1.0], 0, 3) is None
    assert time_until_free([], 2, 3) == 0.0


def test_merge_inspections_needs_a_majority_on_one_token() -> None:
    a = LockInfo("r", 7, 4.0, "host:1")
    b = LockInfo("r", 7, 3.0, "host:1")
    other = LockInfo("r", 9, 5.0, "host:2")
    merged = merge_inspections("r", [a, b, other], 3)
    assert merged == LockInfo("r", 7, 3.0, "host:1")
    assert merge_inspections("r", [a, other, None], 3) is None


def test_backoff_is_jittered_and_capped() -> None:
    rng = random.Random(7)
    delays = [backoff_delay(n, base=0.01, cap=0.2, rng=rng) for n in range(12)]
    assert all(0.005 <= d <= 0.2 for d in delays)
    assert max(delays[6:]) <= 0.2
    assert min(delays[6:]) >= 0.1  # capped: [cap/2, cap]
    assert len({round(d, 9) for d in delays}) == len(delays)  # no two alike: jitter


# -- fixtures and helpers -------------------------------------------------------------------


@pytest.fixture
def nodes() -> Iterator[list[RedisServer]]:
    """Three redis-servers of this test's own, without persistence (a restart empties a
    node), the quorum on them set up."""
    servers = start_nodes()
    try:
        set_up(servers)
        yield servers
    finally:
        stop_nodes(servers)


@pytest.fixture
def durable_nodes() -> Iterator[list[RedisServer]]:
    """Three redis-servers that keep every acknowledged write across a restart."""
    servers = start_nodes(3, "--appendonly", "yes", "--appendfsync", "always")
    try:
        set_up(servers)
        yield servers
    finally:
        stop_nodes(servers)


def wipe(server: RedisServer) -> None:
    """Kill ``server``, delete everything in its directory, start it empty."""
    server.kill()
    for path in server.dir.iterdir():
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    server.start()


def raw(node: RedisServer | str) -> redis.Redis:
    url = node if isinstance(node, str) else node.url
    return redis.Redis.from_url(url, socket_timeout=2)


def lock_exists(server: RedisServer | str, resource: str) -> bool:
    client = raw(server)
    try:
        return bool(client.exists(resource_keys("fence:", resource).lock))
    finally:
        client.close()


def counter(server: RedisServer, resource: str) -> int:
    client = raw(server)
    try:
        return int(client.get(resource_keys("fence:", resource).token) or 0)
    finally:
        client.close()


def plant_lock(url: str, resource: str, secret: str, ttl_ms: int) -> None:
    """Another client's lock on one node, as the acquire script writes it."""
    client = raw(url)
    try:
        key = resource_keys("fence:", resource).lock
        client.hset(key, mapping={"secret": secret, "token": "1", "holder": "elsewhere"})
        client.pexpire(key, ttl_ms)
    finally:
        client.close()


def cycle(manager: QuorumLockManager, resource: str) -> int:
    lease = manager.acquire(resource, timeout=5)
    token = lease.token
    lease.release()
    return token


def urls(servers: list[RedisServer]) -> list[str]:
    return [server.url for server in servers]


# -- C2/C3: tokens after nodes lose their data -------------------------------------------------


@pytest.mark.redis
@pytest.mark.slow
@pytest.mark.parametrize("mode", [TokenMode.COUNTER, TokenMode.HYBRID])
def test_tokens_never_go_back_when_a_minority_loses_its_data(
    nodes: list[RedisServer], mode: TokenMode
) -> None:
    """Each node in turn is wiped, first staying down through an acquisition, then coming
    back empty: every token is above the one before. In counter mode a node's counter is
    all it has, so this fails if the token is not written back to the nodes before it is
    handed out (the third wipe would reissue a small token)."""
    manager = QuorumLockManager(urls(nodes), token_mode=mode, check_config=False, ttl=5)
    resource = "minority"
    try:
        tokens = [cycle(manager, resource) for _ in range(3)]
        for victim in nodes * 2:
            victim.kill()
            tokens.append(cycle(manager, resource))  # a majority still answers
            wipe(victim)  # back, empty: its counter is gone
            assert counter(victim, resource) == 0
            tokens.append(cycle(manager, resource))
            tokens.append(cycle(manager, resource))
        assert tokens == sorted(tokens)
        assert len(set(tokens)) == len(tokens)
        if mode is TokenMode.COUNTER:
            # dense counter tokens: one per acquisition, none lost, none repeated
            assert tokens == list(range(tokens[0], tokens[0] + len(tokens)))
            # every node was repaired by the write-back of the last acquisition
            assert [counter(n, resource) for n in nodes] == [tokens[-1]] * 3
    finally:
        manager.close()


@pytest.mark.redis
@pytest.mark.slow
def test_a_node_restarting_empty_cannot_hand_out_the_holders_token(
    nodes: list[RedisServer],
) -> None:
    """The counter-example of issue 16, with at most one faulty node at any moment.

    1. X cannot reach C (partitioned: X's address for C answers nothing); A and B grant,
       and X commits token ``t`` to A and B.
    2. A restarts empty.
    3. Y, who reaches every node, tries: A (empty) and C are free, B refuses because X
       holds it.

    Counting A's grant, Y would have a majority and the token ``max(1, 1) = 1``, equal to
    X's, while X's lease is still valid: both holders' writes would pass a guard. A node
    that lost its data must take no part in a grant until a grant repairs it.
    """
    a, _b, c = nodes
    options: dict[str, Any] = {
        "token_mode": TokenMode.COUNTER,
        "check_config": False,
        "ttl": 30,
        "socket_timeout": 0.2,
    }
    unreachable_c = f"redis://127.0.0.1:{free_port()}/0"
    x = QuorumLockManager([a.url, nodes[1].url, unreachable_c], **options)
    bus = EventBus()
    y = QuorumLockManager(urls(nodes), events=bus, **options)
    resource = "issue-16"
    try:
        held = x.acquire(resource, timeout=5)
        assert [counter(n, resource) for n in nodes] == [held.token, held.token, 0]
        wipe(a)
        with EventRecorder(bus) as recorder:
            stolen = y.try_acquire(resource)
            assert stolen is None or stolen.token > held.token  # before the fix: equal
            assert stolen is None  # X's lease is valid: mutual exclusion holds too
            assert held.valid
            held.release()  # B held it and A lost it, so nobody else could have it: held
            after = y.acquire(resource, timeout=5)
        assert after.token > held.token
        lost = recorder.of(EventKind("node_data_lost"))
        assert [e.detail["node"] for e in lost] == [a.url]
        # Y's grant repaired A: A holds a counter of at least Y's token again
        assert counter(a, resource) >= after.token
        after.release()
        c.kill()  # now A must carry the next grant with B
        assert cycle(y, resource) > after.token
    finally:
        x.close()
        y.close()


def reset_markers(servers: list[RedisServer]) -> None:
    """The documented way out of a loss beyond the fault model: forget every node marker,
    so that the next grant sets the quorum up again."""
    for server in servers:
        client = raw(server)
        try:
            client.delete("fence:quorum:node")
        finally:
            client.close()


@pytest.mark.redis
@pytest.mark.slow
@pytest.mark.parametrize("mode", [TokenMode.COUNTER, TokenMode.HYBRID])
def test_a_majority_losing_its_data_is_refused_and_reported(
    nodes: list[RedisServer], mode: TokenMode
) -> None:
    """Two nodes of three lose their data: beyond the fault model. The quorum cannot show
    that the next token is above the last one (in counter mode the survivor alone holds
    it), so it refuses with ``DATA_LOST`` and reports both nodes, whether or not the
    survivor answers. Nothing is served until an operator resets the markers; then the
    survivor's counter (counter mode) or the clocks (hybrid) keep tokens ahead."""
    bus = EventBus()
    manager = QuorumLockManager(
        urls(nodes), token_mode=mode, check_config=False, ttl=5, socket_timeout=0.2, events=bus
    )
    resource = "majority"
    try:
        before = [cycle(manager, resource) for _ in range(5)]
        wipe(nodes[0])
        wipe(nodes[1])
        with EventRecorder(bus) as recorder:
            with pytest.raises(BackendError) as info:
                manager.acquire(resource, timeout=1)
            assert info.value.code == "DATA_LOST"
            assert info.value.retryable
            # a client that cannot reach the survivor is refused as well
            cut_off = QuorumLockManager(
                [nodes[0].url, nodes[1].url, f"redis://127.0.0.1:{free_port()}/0"],
                token_mode=mode,
                check_config=False,
                ttl=5,
                events=bus,
            )
            try:
                with pytest.raises(BackendError) as info:
                    cut_off.try_acquire(resource)
                assert info.value.code == "DATA_LOST"
            finally:
                cut_off.close()
        lost = {e.detail["node"] for e in recorder.of(EventKind.NODE_DATA_LOST)}
        assert lost == {nodes[0].url, nodes[1].url}
        refused = recorder.of(EventKind.REFUSED)
        assert refused
        assert {r.detail["reason"] for r in refused} == {"data_lost"}
        assert not recorder.of(EventKind.ACQUIRED)
        reset_markers(nodes)
        if mode is TokenMode.COUNTER:
            # a counter-mode manager that saw a grant takes every node answering as new for
            # a loss of every node's data: the reset is for managers started after it
            with pytest.raises(BackendError) as info:
                manager.try_acquire(resource)
            assert info.value.code == "DATA_LOST"
            manager.close()
            manager = QuorumLockManager(
                urls(nodes), token_mode=mode, check_config=False, ttl=5, events=bus
            )
        with EventRecorder(bus) as recorder:
            after = cycle(manager, resource)
        assert recorder.of(EventKind.QUORUM_INITIALIZED)
        assert after > before[-1]
    finally:
        manager.close()


@pytest.mark.redis
@pytest.mark.slow
def test_nodes_that_keep_their_data_across_restarts_stay_eligible(
    durable_nodes: list[RedisServer],
) -> None:
    """With ``appendfsync always`` a restart loses nothing: every node may be killed and
    restarted, a majority at once, and counter-mode tokens go on without a repair."""
    nodes = durable_nodes
    bus = EventBus()
    manager = QuorumLockManager(
        urls(nodes), token_mode=TokenMode.COUNTER, check_config=False, ttl=5, events=bus
    )
    try:
        with EventRecorder(bus) as recorder:
            tokens = [cycle(manager, "durable")]
            for node in nodes:
                node.restart()
                tokens.append(cycle(manager, "durable"))
            nodes[0].kill()
            nodes[1].kill()
            nodes[0].start()
            nodes[1].start()
            tokens.append(cycle(manager, "durable"))
        assert tokens == list(range(tokens[0], tokens[0] + len(tokens)))
        assert not recorder.of(EventKind.NODE_DATA_LOST)
    finally:
        manager.close()


@pytest.mark.redis
@pytest.mark.slow
def test_quorum_warns_about_persistence_that_can_roll_a_node_back() -> None:
    """RDB snapshots bring a node back with an older copy of its data, which looks intact:
    outside the fault model, so the first use warns. Nodes without persistence (the test
    servers) or with ``appendfsync always`` fit it and are not warned about."""
    servers = start_nodes(3, "--save", "3600 1")
    try:
        manager = QuorumLockManager(urls(servers), ttl=5)
        try:
            with pytest.warns(FenceWarning, match="older copy"):
                cycle(manager, "warned")
        finally:
            manager.close()
        for server in servers:
            client = raw(server)
            try:
                client.config_set("save", "")
            finally:
                client.close()
        quiet = QuorumLockManager(urls(servers), ttl=5)
        try:
            cycle(quiet, "quiet")  # filterwarnings=error: any warning fails here
        finally:
            quiet.close()
    finally:
        stop_nodes(servers)


@pytest.mark.redis
@pytest.mark.parametrize("flavour", ["sync", "async"])
async def test_a_node_without_persistence_that_loaded_an_old_dump_is_reported(
    flavour: str,
) -> None:
    """``save ''`` and ``appendonly no`` do not stop a start-up from loading a dump.rdb left
    in the node's directory (a SAVE, a BGSAVE, an earlier configuration): the node comes
    back with an older copy of its data, marker included, and looks intact. The check on
    first use asks the node what it loaded and says so."""
    servers = start_nodes()
    kind = QuorumLockManager if flavour == "sync" else AsyncQuorumLockManager
    try:
        set_up(servers)
        quiet = kind(urls(servers), ttl=5)
        try:
            lease = await _now(quiet.acquire("before", timeout=5))  # warnings are errors
            await _now(lease.release())
        finally:
            await _now(quiet.close())
        client = raw(servers[0])
        try:
            client.save()  # an old copy of the node's data, marker and counters
        finally:
            client.close()
        servers[0].kill()
        servers[0].start()  # settings that keep no data; the dump.rdb is loaded all the same
        manager = kind(urls(servers), ttl=5)
        try:
            with pytest.warns(FenceWarning, match="loaded [0-9]+ keys from its RDB file") as got:
                lease = await _now(manager.acquire("after", timeout=5))
            await _now(lease.release())
            assert [str(w.message) for w in got if servers[0].url in str(w.message)]
            assert not [w for w in got if servers[1].url in str(w.message)]
        finally:
            await _now(manager.close())
    finally:
        stop_nodes(servers)


def test_node_settings_outside_the_fault_model() -> None:
    assert node_config_warnings({"appendonly": "no", "save": ""}) == []
    assert node_config_warnings({"appendonly": "yes", "appendfsync": "always"}) == []
    assert "older copy" in node_config_warnings({"appendonly": "yes", "appendfsync": "everysec"})[0]
    assert "snapshot" in node_config_warnings({"appendonly": "no", "save": "3600 1"})[0]
    assert "evict" in node_config_warnings({"maxmemory-policy": "allkeys-lru"})[0]
    loaded = {"appendonly": "no", "save": "", "rdb_last_load_keys_loaded": "12"}
    assert "loaded 12 keys" in node_config_warnings(loaded)[0]
    assert node_config_warnings({**loaded, "rdb_last_load_keys_loaded": "0"}) == []
    durable = {"appendonly": "yes", "appendfsync": "always", "rdb_last_load_keys_loaded": "12"}
    assert node_config_warnings(durable) == []  # its data is meant to come back
    # Counter tokens on nodes that keep no data: a rolling restart of an idle quorum makes
    # a manager started since set it up again, and counter tokens start over at 1.
    empty = {"appendonly": "no", "save": ""}
    (said,) = node_config_warnings(empty, TokenMode.COUNTER)
    assert "counter tokens start over at 1" in said
    assert node_config_warnings(durable, TokenMode.COUNTER) == []
    assert node_config_warnings(empty, TokenMode.HYBRID) == []


@pytest.mark.redis
@pytest.mark.parametrize("flavour", ["sync", "async"])
async def test_counter_tokens_on_nodes_that_keep_no_data_are_warned_about(flavour: str) -> None:
    """The check on first use says, once per node, that counter tokens can start over on
    nodes without persistence; hybrid tokens on the same nodes, and counter tokens on nodes
    that keep every write, say nothing (warnings are errors here)."""
    kind = QuorumLockManager if flavour == "sync" else AsyncQuorumLockManager
    for extra, mode, warned in (
        ((), TokenMode.COUNTER, True),
        ((), TokenMode.HYBRID, False),
        (("--appendonly", "yes", "--appendfsync", "always"), TokenMode.COUNTER, False),
    ):
        servers = start_nodes(3, *extra)
        try:
            manager = kind(urls(servers), token_mode=mode, ttl=5)
            try:
                if warned:
                    with pytest.warns(FenceWarning, match="start over at 1") as got:
                        lease = await _now(manager.acquire("job", timeout=5))
                    said = [str(w.message) for w in got]
                    assert len(said) == len(servers)
                    for server in servers:
                        assert sum(f"quorum node {server.url}:" in m for m in said) == 1
                else:
                    lease = await _now(manager.acquire("job", timeout=5))
                await _now(lease.release())
                again = await _now(manager.acquire("job", timeout=5))  # once per node
                await _now(again.release())
            finally:
                await _now(manager.close())
        finally:
            stop_nodes(servers)


# -- a majority down: no lease, a clean error ----------------------------------------------------


@pytest.mark.redis
@pytest.mark.slow
def test_majority_killed_acquire_fails_cleanly(durable_nodes: list[RedisServer]) -> None:
    """Two nodes of three killed: no lease, a clean error; they come back with their data
    (``appendfsync always``) and the quorum works again."""
    nodes = durable_nodes
    bus = EventBus()
    # The killed nodes refuse connections at once; the live one gets 30 s to answer: its
    # writes wait for an fsync (appendfsync always), and on a loaded machine the default
    # (0.5 s at this ttl), then 5 s, were spent, and it was reported down.
    manager = QuorumLockManager(
        urls(nodes), check_config=False, ttl=5, events=bus, socket_timeout=30.0
    )
    try:
        held = manager.acquire("job")
        held.release()
        nodes[0].kill()
        nodes[1].kill()
        with EventRecorder(bus) as recorder:
            with pytest.raises(BackendError) as info:
                manager.acquire("job", timeout=1)
            assert info.value.code == "QUORUM"
            assert info.value.retryable
            assert nodes[0].url in str(info.value)
            with pytest.raises(BackendError):
                manager.try_acquire("job")
            with pytest.raises(BackendError):
                manager.inspect("job")
            with pytest.raises(BackendError):
                manager.revoke("job")
        assert not lock_exists(nodes[2], "job")  # the attempt was undone on the live node
        assert manager._held == {}
        reported = recorder.of(EventKind.BACKEND_DOWN)
        down = {e.detail["node"] for e in reported}
        assert down == {nodes[0].url, nodes[1].url}, [e.detail for e in reported]
        assert not recorder.of(EventKind.ACQUIRED)
        # the nodes come back: the manager works again, with a larger token
        nodes[0].start()
        nodes[1].start()
        again = manager.acquire("job", timeout=5)
        assert again.token > held.token
        again.release()
    finally:
        manager.close()


@pytest.mark.redis
@pytest.mark.slow
def test_majority_stopped_acquire_fails_cleanly(nodes: list[RedisServer]) -> None:
    """Nodes that hang (SIGSTOP) cost the per-node timeout, then the same clean error."""
    manager = QuorumLockManager(urls(nodes), check_config=False, ttl=5, socket_timeout=0.2)
    try:
        nodes[0].pause()
        nodes[1].pause()
        try:
            with pytest.raises(BackendError) as info:
                manager.acquire("job", timeout=1)
            assert info.value.code == "QUORUM"
            assert not lock_exists(nodes[2], "job")
        finally:
            nodes[0].resume()
            nodes[1].resume()
        assert manager._held == {}
    finally:
        manager.close()


# -- partial failures: a minority stopped, killed, refusing ---------------------------------------


@pytest.mark.redis
@pytest.mark.slow
def test_a_stopped_node_costs_its_timeout_not_the_lock(nodes: list[RedisServer]) -> None:
    """One node hangs (SIGSTOP) through acquire, renew and release: the majority decides,
    the node is reported once, and its leftover lock does not block the next holder."""
    bus = EventBus()
    manager = QuorumLockManager(
        urls(nodes), check_config=False, ttl=5, socket_timeout=0.15, events=bus
    )
    try:
        first = cycle(manager, "job")
        with EventRecorder(bus) as recorder:
            nodes[1].pause()
            try:
                lease = manager.acquire("job", timeout=2)
                assert lease.token > first
                assert lease.valid
                lease.renew()
                info = manager.inspect("job")
                assert info is not None
                assert info.token == lease.token
                lease.release()  # two of three release: done
                assert manager.driver.down == [nodes[1].url]
            finally:
                nodes[1].resume()
        down = recorder.of(EventKind.BACKEND_DOWN)
        assert len(down) == 1  # reported when it went down, not on every call
        assert down[0].detail["node"] == nodes[1].url
        assert down[0].detail["operation"] == "acquire"
        # the resumed node may run the acquire it had queued: the lock it holds there is a
        # minority and expires with its ttl; the next holder needs only the other two
        assert cycle(manager, "job") > lease.token
        assert manager.driver.down == []
    finally:
        manager.close()


@pytest.mark.redis
@pytest.mark.slow
def test_a_killed_node_refuses_connections(nodes: list[RedisServer]) -> None:
    bus = EventBus()
    manager = QuorumLockManager(urls(nodes), check_config=False, ttl=5, events=bus)
    try:
        with EventRecorder(bus) as recorder:
            nodes[2].kill()
            tokens = [cycle(manager, "job") for _ in range(4)]
            nodes[2].start()
            tokens += [cycle(manager, "job") for _ in range(2)]
        assert tokens == sorted(tokens)
        assert len(set(tokens)) == len(tokens)
        down = recorder.of(EventKind.BACKEND_DOWN)
        assert [e.detail["node"] for e in down] == [nodes[2].url]
        assert down[0].detail["code"] == "CONNECTION"
        assert counter(nodes[2], "job") == tokens[-1]  # repaired by the write-back
    finally:
        manager.close()


@pytest.mark.redis
@pytest.mark.slow
def test_a_node_that_refuses_writes(nodes: list[RedisServer]) -> None:
    """A node out of memory (``maxmemory`` reached, ``noeviction``) refuses every script
    that writes: it counts as a failed vote, and the other two carry the lock."""
    admin = raw(nodes[0])
    bus = EventBus()
    manager = QuorumLockManager(urls(nodes), check_config=False, ttl=5, events=bus)
    try:
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", "1")
        with EventRecorder(bus) as recorder:
            lease = manager.acquire("job", timeout=2)
            assert not lock_exists(nodes[0], "job")
            assert lock_exists(nodes[1], "job")
            lease.release()
        down = recorder.of(EventKind.BACKEND_DOWN)
        assert [e.detail["node"] for e in down] == [nodes[0].url]
        assert "maxmemory" in down[0].detail["error"]
    finally:
        admin.config_set("maxmemory", "0")
        admin.close()
        manager.close()


@pytest.mark.redis
@pytest.mark.slow
def test_release_that_fails_on_a_node(nodes: list[RedisServer]) -> None:
    """The release reaches two nodes of three: it succeeds, and the failing node is
    reported. Whatever copy of the lock the third node keeps expires with its ttl and holds
    up nobody: the next holder needs only a majority."""
    bus = EventBus()
    manager = QuorumLockManager(
        urls(nodes), check_config=False, ttl=5, socket_timeout=0.15, events=bus
    )
    try:
        lease = manager.acquire("job")
        with EventRecorder(bus) as recorder:
            nodes[0].pause()
            try:
                lease.release()
                assert lease.released
            finally:
                nodes[0].resume()
        down = recorder.of(EventKind.BACKEND_DOWN)
        assert [(e.detail["node"], e.detail["operation"]) for e in down] == [
            (nodes[0].url, "release")
        ]
        assert [e.kind for e in recorder.events if e.kind != EventKind.BACKEND_DOWN] == [
            EventKind.RELEASED
        ]
        assert recorder.of(EventKind.RELEASED)[0].detail["held"] is True
        assert not lock_exists(nodes[1], "job")
        assert not lock_exists(nodes[2], "job")
        assert cycle(manager, "job") > lease.token  # a majority is free
    finally:
        manager.close()


@pytest.mark.redis
@pytest.mark.slow
def test_release_unconfirmed_when_a_majority_does_not_answer(nodes: list[RedisServer]) -> None:
    manager = QuorumLockManager(urls(nodes), check_config=False, ttl=1, socket_timeout=0.15)
    try:
        lease = manager.acquire("job")
        nodes[0].pause()
        nodes[1].pause()
        try:
            with pytest.raises(BackendError) as info:
                lease.release()
            assert info.value.code == "QUORUM"
        finally:
            nodes[0].resume()
            nodes[1].resume()
    finally:
        manager.close()


@pytest.mark.redis
@pytest.mark.slow
def test_watchdog_reports_loss_when_a_majority_stops(nodes: list[RedisServer]) -> None:
    bus = EventBus()
    manager = QuorumLockManager(
        urls(nodes), check_config=False, ttl=0.9, socket_timeout=0.1, renew=True, events=bus
    )
    lost: list[Any] = []
    try:
        with EventRecorder(bus) as recorder:
            lease = manager.acquire("job", on_lost=lambda _l, err: lost.append(err))
            nodes[0].pause()
            nodes[1].pause()
            try:
                assert lease.wait_lost(timeout=5)
                # close() stops the watchdogs of held leases only; this one is lost, and
                # may still be inside a renewal that is timing out.
                lease._watchdog.join()
            finally:
                nodes[0].resume()
                nodes[1].resume()
        assert len(lost) == 1
        assert recorder.of(EventKind.RENEW_FAILED)
        assert len(recorder.of(EventKind.LOST)) == 1
    finally:
        manager.close()


# -- split votes and undone attempts ------------------------------------------------------------


@pytest.mark.redis
def test_split_vote_is_undone_and_retried_with_backoff(quorum_urls: list[str]) -> None:
    """Two other clients hold one node each: nobody has a majority. Our attempt wins only
    the third node, gives it back, and retries after a jittered delay until they expire.
    (Their locks live 4 s: the checks before they expire take about 1 s on a quiet
    machine.)"""
    servers = quorum_urls
    resource = f"split:{secrets.token_hex(4)}"
    manager = QuorumLockManager(quorum_urls, ttl=5)
    attempts = [0]
    real = manager.driver.acquire

    def counting(*args: Any) -> Any:
        attempts[0] += 1
        return real(*args)

    manager.driver.acquire = counting  # type: ignore[method-assign]
    try:
        plant_lock(servers[0], resource, "client-x", 4000)
        plant_lock(servers[1], resource, "client-y", 4000)
        assert manager.try_acquire(resource) is None
        assert not lock_exists(servers[2], resource)  # our single vote was given back
        # The deadline ends the wait, or cuts its last attempt short (QUORUM).
        with pytest.raises((AcquireTimeout, BackendError)):
            manager.acquire(resource, timeout=1.0)
        assert not lock_exists(servers[2], resource)
        assert attempts[0] >= 3  # retried, after backoff delays, not after a wake-up
        lease = manager.acquire(resource, timeout=30)  # the planted locks expire
        assert lease.valid
        lease.release()
    finally:
        manager.close()


@pytest.mark.redis
async def test_cancelled_acquire_leaves_no_lock(quorum_urls: list[str]) -> None:
    """A task cancelled in the middle of an acquire round gives back what it took."""
    resource = f"cancel:{secrets.token_hex(4)}"
    manager = AsyncQuorumLockManager(quorum_urls, ttl=30)
    clients = [redis.asyncio.Redis.from_url(url) for url in quorum_urls]
    try:
        for _ in range(5):
            task = asyncio.get_running_loop().create_task(manager.acquire(resource))
            await asyncio.sleep(0.0005)
            task.cancel()
            try:
                lease = await task
            except asyncio.CancelledError:
                pass
            else:
                await lease.release()
            # The shielded undo runs on after the cancel: wait for it (a loaded machine
            # may hold it up for a while), never past 20 s.
            key = resource_keys("fence:", resource).lock
            end = time.monotonic() + 20.0
            while (found := [await c.exists(key) for c in clients]) != [0, 0, 0]:
                assert time.monotonic() < end, f"the cancelled acquire left its lock: {found}"
                await asyncio.sleep(0.02)
    finally:
        for client in clients:
            await client.aclose()
        await manager.close()


@pytest.mark.redis
async def test_async_manager_with_a_stopped_node(nodes: list[RedisServer]) -> None:
    bus = EventBus()
    manager = AsyncQuorumLockManager(
        urls(nodes), check_config=False, ttl=2, socket_timeout=0.15, events=bus
    )
    try:
        with EventRecorder(bus) as recorder:
            nodes[0].pause()
            try:
                lease = await manager.acquire("job", timeout=2)
                info = await manager.inspect("job")
                assert info is not None
                assert info.token == lease.token
                await lease.release()
            finally:
                nodes[0].resume()
        assert [e.detail["node"] for e in recorder.of(EventKind.BACKEND_DOWN)] == [nodes[0].url]
    finally:
        await manager.close()


def test_bad_node_lists() -> None:
    from fence import ConfigurationError

    with pytest.raises(ConfigurationError):
        QuorumLockManager("redis://127.0.0.1:1/0")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        QuorumLockManager([])
    with pytest.raises(ConfigurationError):
        QuorumLockManager(["redis://127.0.0.1:1/0", "redis://127.0.0.1:1/0"])


# -- retries: a late undo of one attempt and the next attempt's grant ---------------------------


class HoldingProxy:
    """A TCP proxy to a node that, while holding, keeps back every request it receives
    (a request delayed past the client's timeout) and forwards it on :meth:`deliver`,
    even on a connection the client has given up on since: the node runs it late."""

    def __init__(self, host: str, port: int) -> None:
        self.upstream = (host, port)
        self.port = free_port()
        self.holding = threading.Event()
        self.held: list[tuple[socket.socket, bytes]] = []
        self._ended: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def deliver(self) -> None:
        """Stop holding; forward what was held, in order, and let those connections end."""
        with self._lock:
            self.holding.clear()
            held, self.held = self.held, []
            for server, data in held:
                with contextlib.suppress(OSError):
                    server.sendall(data)
        time.sleep(0.2)  # the node runs them
        with self._lock:
            for server in {server for server, _ in held} & self._ended:
                with contextlib.suppress(OSError):
                    server.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        for sock in [self._listener, *self._sockets]:
            sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            self._sockets += [client, server]
            threading.Thread(target=self._requests, args=(client, server), daemon=True).start()
            threading.Thread(target=self._replies, args=(server, client), daemon=True).start()

    def _requests(self, client: socket.socket, server: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := client.recv(65536):
                with self._lock:
                    if self.holding.is_set() or any(s is server for s, _ in self.held):
                        self.held.append((server, data))
                        continue
                server.sendall(data)
        with self._lock:
            if any(s is server for s, _ in self.held):
                self._ended.add(server)  # ended by deliver(), after the held requests
                return
        with contextlib.suppress(OSError):
            server.shutdown(socket.SHUT_RDWR)

    def _replies(self, server: socket.socket, client: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := server.recv(65536):
                client.sendall(data)
        with contextlib.suppress(OSError):
            client.shutdown(socket.SHUT_RDWR)


async def _now(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


@pytest.mark.redis
@pytest.mark.parametrize("flavour", ["sync", "async"])
async def test_a_late_undo_of_one_attempt_leaves_the_next_attempts_grant(
    nodes: list[RedisServer], flavour: str
) -> None:
    """Every attempt of an acquire call sends the call's secret. Attempt 1 meets two held
    nodes; its requests to the third (the acquire and then the undo) are held back past
    its timeout. Attempt 2, once one holder is gone, is granted by the third node and the
    freed one. Then the held requests reach the third node: attempt 1's undo must not end
    the lock attempt 2 holds there, or a contender gets the third node and the second
    holder's, a majority, while attempt 2's lease runs."""
    resource = f"late-undo:{secrets.token_hex(4)}"
    proxy = HoldingProxy("127.0.0.1", nodes[0].port)
    targets = [proxy.url, nodes[1].url, nodes[2].url]
    kind = QuorumLockManager if flavour == "sync" else AsyncQuorumLockManager
    manager = kind(targets, check_config=False, ttl=10, socket_timeout=0.3)
    other = kind(urls(nodes), check_config=False, ttl=10, socket_timeout=0.3)
    driver = manager.driver
    secret = secrets.token_hex(8)
    try:
        for node in nodes:
            # As on a node in service, every script is loaded: a late EVALSHA finds it.
            client = raw(node)
            for source in SCRIPTS.values():
                client.script_load(source)
            client.close()
        plant_lock(nodes[1].url, resource, "client-y", 1200)
        plant_lock(nodes[2].url, resource, "client-z", 4000)
        planted = time.monotonic()
        proxy.holding.set()
        reply = await _now(driver.acquire(resource, secret, 10.0, "x"))  # attempt 1
        assert reply.token is None
        assert proxy.held  # its acquire and undo to the third node, held back
        await asyncio.sleep(1.3)  # client-y's lock on the second node expires
        proxy.holding.clear()  # new requests pass; the held ones still wait
        reply = await _now(driver.acquire(resource, secret, 10.0, "x"))  # attempt 2
        assert reply.token is not None  # granted by the third and second nodes
        proxy.deliver()  # attempt 1's acquire and undo run now, late
        assert lock_exists(nodes[0], resource)  # attempt 2's lock stays
        await asyncio.sleep(max(0.0, planted + 4.1 - time.monotonic()))  # client-z's ends
        contender = await _now(other.try_acquire(resource))
        assert contender is None  # attempt 2 still holds a majority
    finally:
        proxy.close()
        await _now(manager.close())
        await _now(other.close())


# -- set-up and rolling restarts (issue 28) --------------------------------------------------


def counter_manager(flavour: str, nodes: list[RedisServer], bus: EventBus) -> Any:
    """A counter-mode quorum manager over ``nodes``, sync or asyncio, reporting to ``bus``
    (2 s per node and call: a loaded machine is no node's fault)."""
    kind = QuorumLockManager if flavour == "sync" else AsyncQuorumLockManager
    return kind(
        urls(nodes),
        token_mode=TokenMode.COUNTER,
        check_config=False,
        ttl=5,
        socket_timeout=2,
        events=bus,
    )


@pytest.mark.redis
@pytest.mark.parametrize("flavour", ["sync", "async"])
async def test_a_rolling_restart_of_an_idle_quorum_is_refused_in_counter_mode(
    nodes: list[RedisServer], flavour: str
) -> None:
    """Nodes that keep no data, counter tokens: each node restarts empty in turn while no
    acquire runs. Every node answers as a new one; a manager that saw the quorum grant
    knows that is not a new deployment. It refuses with ``DATA_LOST`` rather than set the
    quorum up again and hand out token 1 once more."""
    bus = EventBus()
    manager = counter_manager(flavour, nodes, bus)
    try:
        tokens = []
        for _ in range(3):
            lease = await _now(manager.acquire("rolling", timeout=5))
            tokens.append(lease.token)
            await _now(lease.release())
        for node in nodes:
            wipe(node)
        with EventRecorder(bus) as recorder:
            error = await _first_verdict(manager, "rolling")
        assert error.code == "DATA_LOST", str(error)
        assert not recorder.of(EventKind.QUORUM_INITIALIZED)
        assert not recorder.of(EventKind.ACQUIRED)
        assert recorder.of(EventKind.REFUSED)
    finally:
        await _now(manager.close())


async def _first_verdict(manager: Any, resource: str) -> BackendError:
    """The error of the first attempt that reached every node: an attempt that did not
    (``QUORUM``: connections broken by a restart, a node slow on a loaded machine) is made
    again, for up to 30 s. A blocking acquire is no good here: it retries ``DATA_LOST``
    until its deadline, and the attempt that the deadline cuts short says ``QUORUM``."""
    end = time.monotonic() + 30
    while True:
        try:
            lease = await _now(manager.try_acquire(resource))
        except BackendError as exc:
            if exc.code != "QUORUM" or time.monotonic() > end:
                return exc
        else:
            pytest.fail(f"the acquire was not refused: {lease!r}")


def plant_marker(server: RedisServer, **fields: str) -> None:
    client = raw(server)
    try:
        client.delete("fence:quorum:node")
        client.hset("fence:quorum:node", mapping=fields)
    finally:
        client.close()


@pytest.mark.redis
@pytest.mark.parametrize("flavour", ["sync", "async"])
async def test_two_set_ups_at_once_leave_a_quorum_that_grants(
    nodes: list[RedisServer], flavour: str
) -> None:
    """Two managers set up a new quorum at once: A prepared every node under its set-up
    and confirmed the first; B, having seen every node new, prepared the other two under
    its own set-up, and failed on the first. No lock was ever granted, so nothing can have
    been lost: the next acquire sets the quorum up again and is granted (it used to be
    refused with ``DATA_LOST`` for ever, naming nodes that lost nothing)."""
    plant_marker(nodes[0], state="genesis", id="i0", genesis="g1")
    plant_marker(nodes[1], state="pending", id="i1", genesis="g2")
    plant_marker(nodes[2], state="pending", id="i2", genesis="g2")
    bus = EventBus()
    manager = counter_manager(flavour, nodes, bus)
    try:
        with EventRecorder(bus) as recorder:
            lease = await _now(manager.acquire("both", timeout=5))
            await _now(lease.release())
        assert lease.token >= 1
        assert not recorder.of(EventKind.REFUSED)
        assert not recorder.of(EventKind.NODE_DATA_LOST)
        for node in nodes:
            client = raw(node)
            try:
                assert client.hget("fence:quorum:node", "state") == b"genesis"
            finally:
                client.close()
    finally:
        await _now(manager.close())


@pytest.mark.redis
@pytest.mark.parametrize(("flavour", "joins"), [("sync", True), ("async", True), ("sync", False)])
async def test_a_pending_node_prepared_under_the_set_up_joins_it(
    nodes: list[RedisServer], flavour: str, joins: bool
) -> None:
    """After a set-up that crossed another (the first set-up was confirmed on two nodes and
    granted; the third node was prepared under the second set-up since, and its repair was
    lost), the first node restarts empty. One node with data is left: the third joins its
    set-up, which it was prepared under, and the quorum grants above every token handed out
    (it used to refuse every acquire with ``DATA_LOST`` for ever). A third node that
    restarted empty since it was prepared under the set-up may have held a grant's token:
    it does not join, and the acquire is refused."""
    first = QuorumLockManager(urls(nodes), token_mode=TokenMode.COUNTER, check_config=False)
    try:
        before = [cycle(first, "crossed") for _ in range(3)]
    finally:
        first.close()
    client = raw(nodes[2])
    try:
        setup = client.hget("fence:quorum:node", "genesis")
        assert setup
        incarnation = client.hget("fence:quorum:node", "id")
        assert incarnation
    finally:
        client.close()
    prepared = f"{setup.decode()} g2" if joins else "g2"
    plant_marker(
        nodes[2], state="pending", id=incarnation.decode(), genesis="g2", prepared=prepared
    )
    wipe(nodes[0])
    bus = EventBus()
    manager = counter_manager(flavour, nodes, bus)
    try:
        with EventRecorder(bus) as recorder:
            if joins:
                lease = await _now(manager.acquire("crossed", timeout=5))
                await _now(lease.release())
                assert lease.token > max(before)
            else:
                error = await _first_verdict(manager, "crossed")
                assert error.code == "DATA_LOST", str(error)
        lost = {e.detail["node"] for e in recorder.of(EventKind.NODE_DATA_LOST)}
        assert lost == {nodes[0].url}  # the pending node lost nothing it was known to hold
        assert not recorder.of(EventKind.QUORUM_INITIALIZED)  # never set up again
        client = raw(nodes[2])
        try:
            state = client.hget("fence:quorum:node", "state")
        finally:
            client.close()
        assert state == (b"genesis" if joins else b"pending")
    finally:
        await _now(manager.close())


@pytest.mark.redis
@pytest.mark.parametrize("flavour", ["sync", "async"])
async def test_a_node_restart_costs_no_attempt(
    durable_nodes: list[RedisServer], flavour: str
) -> None:
    """A node that restarted (with its data) closed the manager's idle connection to it.
    The next acquire opens a new one instead of sending on the closed one: the node takes
    part at once, and nothing reports it down. (The quorum never sends a request twice, so
    a request sent on the closed connection would have failed on that node.)"""
    kind = QuorumLockManager if flavour == "sync" else AsyncQuorumLockManager
    bus = EventBus()
    manager = kind(urls(durable_nodes), check_config=False, ttl=5, socket_timeout=2, events=bus)
    try:
        lease = await _now(manager.acquire("restart", timeout=5))
        await _now(lease.release())
        for node in durable_nodes:
            node.restart()
        with EventRecorder(bus) as recorder:
            lease = await _now(manager.try_acquire("restart"))
            assert lease is not None
            await _now(lease.release())
        assert not recorder.of(EventKind.BACKEND_DOWN)
    finally:
        await _now(manager.close())
