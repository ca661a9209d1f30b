"""The Redis guard beyond the conformance suite: every operation, the layout, batches,
pipelines, reads, the issuer check, NOSCRIPT recovery and events, on a real redis-server.

Fault tests with servers of their own (restart, kill, pause, cluster) are in
``tests/test_redis_guard_faults.py``.
"""

from __future__ import annotations

import pickle
from collections.abc import AsyncIterator, Iterator

import pytest
import redis
import redis.asyncio
from redis.backoff import NoBackoff
from redis.retry import Retry

from fence import (
    MAX_TOKEN,
    BackendError,
    ConfigurationError,
    EventBus,
    EventKind,
    InvalidResourceError,
    InvalidTokenError,
    Reason,
    StaleTokenError,
)
from fence.abc import AsyncGuard, Guard
from fence.adapters.redis import (
    AsyncRedisGuard,
    CrossSlotError,
    FenceScope,
    RedisGuard,
    UnissuedTokenError,
    WriteRefusedError,
    hash_tag,
    resource_of,
)
from fence.testing import EventRecorder


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


@pytest.fixture
async def aclient(redis_url: str) -> AsyncIterator[redis.asyncio.Redis]:
    c = redis.asyncio.Redis.from_url(redis_url)
    yield c
    await c.aclose()


@pytest.fixture
def guard(client: redis.Redis) -> RedisGuard:
    return RedisGuard(client)


@pytest.fixture
def rguard(client: redis.Redis) -> RedisGuard:
    return RedisGuard(client, scope="resource")


# -- layout ------------------------------------------------------------------------------


def test_hash_tags_follow_the_cluster_rule() -> None:
    assert hash_tag("x{a}y") == "a"
    assert hash_tag("{a}{b}") == "a"
    assert hash_tag("{}a{b}") is None  # the first '{' decides, and its tag is empty
    assert hash_tag("plain") is None
    assert hash_tag("a{b") is None
    assert resource_of("{order:42}:items") == "order:42"
    assert resource_of("order:42") == "order:42"


def test_key_layout_and_no_ttl_on_fences(client: redis.Redis, guard: RedisGuard) -> None:
    guard.set("{order:1}:status", "new", token=5, ttl=30)
    rguard = RedisGuard(client, scope=FenceScope.RESOURCE)
    rguard.set("{order:2}:status", "new", token=6, ttl=30)
    assert client.get("fence:{order:1}:key:{order:1}:status") == b"5"
    assert client.get("fence:{order:2}:fence") == b"6"
    # The ttl expires the value only; fences never expire (C12).
    assert 0 < client.pttl("{order:1}:status") <= 30_000
    assert client.pttl("fence:{order:1}:key:{order:1}:status") == -1
    assert client.pttl("fence:{order:2}:fence") == -1
    # A custom prefix moves every fence key.
    RedisGuard(client, prefix="app:").set("k", 1, token=1)
    assert client.get("app:{k}:key:k") == b"1"


def test_bad_configuration_is_refused(client: redis.Redis) -> None:
    with pytest.raises(ConfigurationError):
        RedisGuard(client, prefix="{x}:")
    with pytest.raises(ConfigurationError):
        RedisGuard(client, scope="row")


def test_fence_namespace_is_reserved_before_any_io(client: redis.Redis) -> None:
    """C12: a data key inside the guard's prefix could overwrite a fence or a manager's key."""
    dead = redis.Redis(host="127.0.0.1", port=1, retry=Retry(NoBackoff(), 0))
    try:
        for scope in ("key", "resource"):
            guard = RedisGuard(dead, scope=scope)
            for key in ("fence:{r}:key:{r}:k", "fence:{r}:fence", "fence:{r}:token", "fence:x"):
                calls = [
                    lambda g=guard, k=key: g.set(k, "1", token=1),
                    lambda g=guard, k=key: g.set(k, "1", token=1, must_exist=True),
                    lambda g=guard, k=key: g.hset(k, {"f": 1}, token=1),
                    lambda g=guard, k=key: g.incr(k, token=1),
                    lambda g=guard, k=key: g.rpush(k, 1, token=1),
                    lambda g=guard, k=key: g.xadd(k, {"f": 1}, token=1),
                    lambda g=guard, k=key: g.delete(k, token=1),
                    lambda g=guard, k=key: g.claim(k, 1),
                    lambda g=guard, k=key: g.read_for_update(k, token=1),
                    lambda g=guard, k=key: g.hgetall_for_update(k, token=1),
                    lambda g=guard, k=key: g.batch(1).set(k, 1).execute(),
                    lambda g=guard, k=key: g.batch(1).claim(k).execute(),
                    lambda g=guard, k=key: g.pipeline().set(k, 1, token=1).execute(),
                    lambda g=guard, k=key: g.pipeline().claim(k, token=1).execute(),
                    lambda g=guard, k=key: g.get(k),
                ]
                for call in calls:
                    with pytest.raises(InvalidResourceError, match="fence namespace") as caught:
                        call()
                    assert caught.value.value == key
                    assert "prefix" in str(caught.value)
    finally:
        dead.close()
    # The attack the rule stops: overwrite a per-key fence, then write with a stale token.
    guard = RedisGuard(client)
    guard.set("{r}:k", "new", token=5)
    with pytest.raises(InvalidResourceError):
        guard.set("fence:{r}:key:{r}:k", "1", token=1)
    with pytest.raises(StaleTokenError):
        guard.set("{r}:k", "stale", token=2)
    assert guard.get("{r}:k") == (b"new", 5)
    # A custom prefix moves the namespace with it; the default one is then ordinary data.
    app = RedisGuard(client, prefix="app:")
    with pytest.raises(InvalidResourceError, match="'app:'"):
        app.set("app:{r}:key:k", 1, token=1)
    with pytest.raises(ConfigurationError, match="empty"):
        RedisGuard(client, prefix="")


def test_resource_scope_needs_the_hash_tag(client: redis.Redis) -> None:
    """C12: with one register per resource, an untagged key is fenced only against itself."""
    dead = redis.Redis(host="127.0.0.1", port=1, retry=Retry(NoBackoff(), 0))
    try:
        guard = RedisGuard(dead, scope="resource")
        for call in (
            lambda: guard.set("order:9:status", "paid", token=1),
            lambda: guard.hset("order:9:meta", {"f": 1}, token=1),
            lambda: guard.incr("order:9:n", token=1),
            lambda: guard.rpush("order:9:l", 1, token=1),
            lambda: guard.xadd("order:9:s", {"f": 1}, token=1),
            lambda: guard.delete("order:9:status", token=1),
            lambda: guard.read_for_update("order:9:status", token=1),
            lambda: guard.hgetall_for_update("order:9:meta", token=1),
            lambda: guard.batch(1).set("order:9:status", 1).execute(),
            lambda: guard.pipeline().set("order:9:status", 1, token=1).execute(),
            lambda: guard.get("order:9:status"),
        ):
            with pytest.raises(InvalidResourceError, match="hash tag") as caught:
                call()
            assert "'{order:9}:status'" in str(caught.value) or "{order:9}:" in str(caught.value)
    finally:
        dead.close()
    # A bare name is the resource itself for claim and fence, and per-key scope needs no tag.
    rguard = RedisGuard(client, scope="resource")
    assert rguard.claim("order:9", 4) == 4
    assert rguard.fence("order:9") == 4
    rguard.set("{order:9}:status", "paid", token=4)
    assert rguard.batch(4).claim("order:9").set("{order:9}:status", "sent").execute() == [1, 1]
    assert client.get("fence:{order:9}:fence") == b"4"
    RedisGuard(client).set("order:9:status", "paid", token=4)


def test_implements_the_guard_protocols(client: redis.Redis, redis_url: str) -> None:
    assert isinstance(RedisGuard(client), Guard)
    assert isinstance(AsyncRedisGuard(redis.asyncio.Redis.from_url(redis_url)), AsyncGuard)


def test_tokens_and_keys_are_checked_before_any_io() -> None:
    # Nothing listens on port 1: any I/O would raise BackendError instead.
    dead = redis.Redis(host="127.0.0.1", port=1, retry=Retry(NoBackoff(), 0))
    guard = RedisGuard(dead)
    try:
        for bad in (0, MAX_TOKEN + 1, True, 3.0, "3", None):
            with pytest.raises(InvalidTokenError):
                guard.set("k", 1, token=bad)  # type: ignore[arg-type]
            with pytest.raises(InvalidTokenError):
                guard.batch(bad)  # type: ignore[arg-type]
            with pytest.raises(InvalidTokenError):
                guard.pipeline().set("k", 1, token=bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidResourceError):
            guard.set("", 1, token=1)
        with pytest.raises(ConfigurationError):
            guard.incr("k", 1.5, token=1)  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError):
            guard.set("k", 1, token=1, ttl=0)
        with pytest.raises(BackendError) as caught:
            guard.set("k", 1, token=1)
        assert caught.value.code == "CONNECTION"
        assert caught.value.retryable
        assert isinstance(caught.value.__cause__, redis.ConnectionError)
    finally:
        dead.close()


# -- operations --------------------------------------------------------------------------


def test_every_operation_is_fenced(client: redis.Redis, guard: RedisGuard) -> None:
    assert guard.hset("h", {"a": 1, "b": 2}, token=5) == 2
    assert guard.incr("n", 3, token=5) == 3
    assert guard.incr("n", token=5) == 4
    assert guard.rpush("l", "x", "y", token=5) == 2
    entry = guard.xadd("s", {"f": "v"}, token=5, maxlen=100)
    assert client.xrange("s")[0][0] == entry
    for call in (
        lambda: guard.hset("h", {"a": 9}, token=4),
        lambda: guard.incr("n", 10, token=4),
        lambda: guard.rpush("l", "z", token=4),
        lambda: guard.xadd("s", {"f": "w"}, token=4),
        lambda: guard.set("h", "over", token=4),
        lambda: guard.delete("l", token=4),
    ):
        with pytest.raises(StaleTokenError) as caught:
            call()
        assert caught.value.reason is Reason.STALE
        assert caught.value.fence == 5
    assert client.hgetall("h") == {b"a": b"1", b"b": b"2"}
    assert client.get("n") == b"4"
    assert client.lrange("l", 0, -1) == [b"x", b"y"]
    assert client.xlen("s") == 1


def test_update_semantics_report_missing(client: redis.Redis, guard: RedisGuard) -> None:
    for call in (
        lambda: guard.hset("h", {"a": 1}, token=3, must_exist=True),
        lambda: guard.incr("n", token=3, must_exist=True),
        lambda: guard.rpush("l", 1, token=3, must_exist=True),
        lambda: guard.set("s", 1, token=3, must_exist=True),
    ):
        with pytest.raises(StaleTokenError) as caught:
            call()
        assert (caught.value.reason, caught.value.token, caught.value.fence) == (
            Reason.MISSING,
            3,
            None,
        )
    assert client.keys("*") == []
    guard.hset("h", {"a": 1}, token=3)
    assert guard.hset("h", {"b": 2}, token=3, must_exist=True) == 1


def test_wrong_types_fail_before_any_write(client: redis.Redis, guard: RedisGuard) -> None:
    client.set("{r}s", "text")
    with pytest.raises(WriteRefusedError) as caught:
        guard.batch(5).set("{r}a", 1).hset("{r}s", {"f": 1}).execute()
    assert "WRONGTYPE" in str(caught.value)
    with pytest.raises(WriteRefusedError):
        guard.batch(5).set("{r}a", "x").incr("{r}a").execute()
    assert client.get("{r}a") is None
    assert guard.fence("{r}a") is None
    # A batch sees its own earlier operations: delete, then re-create as a hash.
    guard.batch(5).delete("{r}s").hset("{r}s", {"f": 1}).set("{r}a", 2).incr("{r}a").execute()
    assert client.hgetall("{r}s") == {b"f": b"1"}
    assert client.get("{r}a") == b"3"


def test_exact_integers_and_corrupt_fences(client: redis.Redis, guard: RedisGuard) -> None:
    # 2**53 + 1 is not a double; it must still count as above every token.
    client.set("fence:{a}:key:a", str(2**53 + 1))
    with pytest.raises(StaleTokenError) as caught:
        guard.set("a", 1, token=MAX_TOKEN)
    assert caught.value.reason is Reason.STALE
    assert caught.value.fence == 2**53 + 1
    # A fence that is no integer is refused, never guessed (C9).
    client.set("fence:{b}:key:b", "1e3")
    with pytest.raises(StaleTokenError) as caught:
        guard.set("b", 1, token=5000)
    assert caught.value.reason is Reason.UNVERIFIABLE
    with pytest.raises(StaleTokenError):
        guard.fence("b")
    assert client.get("a") is None
    assert client.get("b") is None


# -- fence scopes, claims and reads ------------------------------------------------------------


def test_resource_scope_shares_one_register(client: redis.Redis, rguard: RedisGuard) -> None:
    rguard.set("{acct:1}:balance", 100, token=5)
    rguard.set("{acct:1}:owner", "ann", token=6)
    with pytest.raises(StaleTokenError) as caught:
        rguard.set("{acct:1}:balance", 0, token=5)
    assert (caught.value.reason, caught.value.fence) == (Reason.STALE, 6)
    assert rguard.fence("acct:1") == 6
    assert rguard.fence("{acct:1}:anything") == 6
    # A lock manager's forced revocation raises the register: the hung holder is out.
    client.set("fence:{acct:1}:fence", 9)
    with pytest.raises(StaleTokenError):
        rguard.set("{acct:1}:owner", "bob", token=8)
    assert rguard.claim("acct:1", 9) == 9
    # Per-key fences of the same keys are independent of the register.
    RedisGuard(client).set("{acct:1}:balance", 1, token=1)


def test_write_only_fencing_loses_an_update_and_claim_prevents_it(guard: RedisGuard) -> None:
    guard.set("acct", 100, token=33)  # A, holder 33, wrote once and paused
    # Write-only fencing: B (34) reads plainly; A's late write lands, then B overwrites it.
    value, _ = guard.get("acct")
    guard.set("acct", 100 - 30, token=33)  # A wakes: accepted, the fence is still 33
    guard.set("acct", int(value) + 50, token=34)
    assert guard.get("acct") == (b"150", 34)  # A's debit of 30 is lost

    # With a registering read, A's late write is refused and nothing is lost.
    guard.set("acct2", 100, token=33)
    value = guard.read_for_update("acct2", token=34)
    with pytest.raises(StaleTokenError):
        guard.set("acct2", 100 - 30, token=33)
    guard.set("acct2", int(value) + 50, token=34)
    assert guard.get("acct2") == (b"150", 34)


def test_reads_return_value_and_fence(client: redis.Redis, guard: RedisGuard) -> None:
    assert guard.get("k") == (None, None)
    assert guard.hgetall("h") == ({}, None)
    guard.set("k", "v", token=3)
    guard.hset("h", {"a": "1"}, token=4)
    assert guard.get("k") == (b"v", 3)
    assert guard.hgetall("h") == ({b"a": b"1"}, 4)
    assert guard.hgetall_for_update("h", token=7) == {b"a": b"1"}
    assert guard.fence("h") == 7
    with pytest.raises(StaleTokenError):
        guard.hgetall_for_update("h", token=6)
    with pytest.raises(StaleTokenError):
        guard.read_for_update("k", token=2)
    assert guard.fence("k") == 3


# -- batches and pipelines ------------------------------------------------------------------


def test_batch_lists_every_rejected_key(client: redis.Redis, guard: RedisGuard) -> None:
    guard.claim("{o}:a", 10)
    with pytest.raises(StaleTokenError) as caught:
        (
            guard.batch(9)
            .set("{o}:a", 1)
            .hset("{o}:b", {"f": 1})
            .incr("{o}:c", must_exist=True)
            .rpush("{o}:d", 1)
            .execute()
        )
    reasons = {e.scope: e.reason for e in caught.value.rejected}
    assert reasons == {"{o}:a": Reason.STALE, "{o}:c": Reason.MISSING}
    assert "2 scopes" in str(caught.value)
    assert sorted(client.keys("*")) == [b"fence:{o}:key:{o}:a"]
    assert guard.batch(10).set("{o}:a", 1).incr("{o}:c").rpush("{o}:d", 1, 2).execute() == [
        1,
        1,
        2,
    ]
    assert guard.batch(10).execute() == []


def test_batch_across_resources_is_refused_before_io(guard: RedisGuard) -> None:
    with pytest.raises(CrossSlotError) as caught:
        guard.batch(5).set("{a}:x", 1).set("{b}:x", 2).execute()
    assert "CROSSSLOT" in str(caught.value)
    assert caught.value.keys == ("{a}:x", "{b}:x")
    assert isinstance(caught.value, ConfigurationError)
    assert guard.fence("{a}:x") is None


def test_pipeline_gives_one_result_per_write(client: redis.Redis, guard: RedisGuard) -> None:
    guard.set("p1", "old", token=10)
    pipe = guard.pipeline()
    pipe.set("p1", "stale", token=9).set("p2", "new", token=1).incr("p3", 5, token=2)
    pipe.hset("p4", {"f": 1}, token=3, must_exist=True).delete("p1", token=10)
    pipe.rpush("p5", "a", token=1).claim("p6", token=4)
    assert len(pipe) == 7
    results = pipe.execute()
    assert isinstance(results[0], StaleTokenError)
    assert (results[0].reason, results[0].fence) == (Reason.STALE, 10)
    assert results[1:3] == [1, 5]
    assert isinstance(results[3], StaleTokenError)
    assert results[3].reason is Reason.MISSING
    assert results[4:] == [1, 1, 1]
    assert client.get("p1") is None
    assert client.get("p2") == b"new"
    assert guard.fence("p6") == 4
    assert len(pipe) == 0
    assert pipe.execute() == []


def test_a_run_of_sets_and_hsets_in_one_call_keeps_each_verdict(
    client: redis.Redis, guard: RedisGuard
) -> None:
    """Consecutive plain sets and hsets travel as one script call; each still stands alone,
    in order, with its own token."""
    guard.set("r1", "old", token=10)
    client.set("r4", "a string")
    client.set("fence:{r5}:key:r5", "not a number")
    pipe = guard.pipeline()
    pipe.set("r1", "stale", token=9)  # STALE
    pipe.set("r2", "v", token=3, ttl=60)  # with PX
    pipe.hset("r3", {"a": 1, "b": 2}, token=3)  # 2 fields added
    pipe.hset("r4", {"a": 1}, token=3)  # WRONGTYPE: nothing written
    pipe.set("r5", "v", token=3)  # UNVERIFIABLE fence
    pipe.set("r2", "w", token=4)  # the same key again, later in the run, newer token
    pipe.incr("r6", token=1)  # another kind: its own call, in order
    pipe.set("r2", "x", token=3)  # now stale: r2's fence is 4
    client.script_flush()  # the calls meet NOSCRIPT and are sent again
    results = pipe.execute()
    assert isinstance(results[0], StaleTokenError)
    assert (results[0].reason, results[0].fence) == (Reason.STALE, 10)
    assert results[1:3] == [1, 2]
    assert isinstance(results[3], WriteRefusedError)
    assert results[3].refused[0].reason == "WRONGTYPE"
    assert isinstance(results[4], StaleTokenError)
    assert results[4].reason is Reason.UNVERIFIABLE
    assert results[5:7] == [1, 1]
    assert isinstance(results[7], StaleTokenError)
    assert results[7].fence == 4
    assert client.get("r1") == b"old"
    assert client.get("r2") == b"w"
    assert client.pttl("r2") == -1  # the later plain set of "w" dropped the expiry
    assert client.hgetall("r3") == {b"a": b"1", b"b": b"2"}
    assert client.get("r4") == b"a string"
    assert guard.fence("r3") == 3
    assert guard.fence("r4") is None


def test_pipeline_reports_per_write_failures(client: redis.Redis, guard: RedisGuard) -> None:
    client.set("text", "x")
    results = guard.pipeline().incr("text", token=1).set("ok", 1, token=1).execute()
    assert isinstance(results[0], WriteRefusedError)
    assert results[0].refused[0].reason == "NOT_INTEGER"
    assert results[1] == 1
    assert guard.fence("text") is None


# -- issuer check ------------------------------------------------------------------------


def test_issuer_check_refuses_tokens_never_issued(client: redis.Redis) -> None:
    guard = RedisGuard(client, scope="resource", check_issuer=True)
    with pytest.raises(UnissuedTokenError) as caught:
        guard.set("{job:1}:state", "run", token=1)  # no counter: nothing was ever issued
    assert caught.value.issued == 0
    client.set("fence:{job:1}:token", 41)
    guard.set("{job:1}:state", "run", token=41)
    with pytest.raises(UnissuedTokenError) as caught:
        guard.set("{job:1}:state", "forged", token=10**12)
    err = caught.value
    assert isinstance(err, StaleTokenError)
    assert (err.reason, err.token, err.fence, err.issued) == (Reason.UNVERIFIABLE, 10**12, 41, 41)
    assert "never issued" in str(err)
    assert client.get("{job:1}:state") == b"run"
    # Staleness is still checked first, and per-key guards check the same counter.
    with pytest.raises(StaleTokenError) as stale:
        guard.set("{job:1}:state", "old", token=40)
    assert stale.value.reason is Reason.STALE
    keyed = RedisGuard(client, check_issuer=True)
    keyed.set("{job:1}:other", 1, token=41)
    with pytest.raises(UnissuedTokenError):
        keyed.set("{job:1}:other", 1, token=42)


def test_errors_pickle_with_their_data() -> None:
    err = pickle.loads(pickle.dumps(UnissuedTokenError("k", 9, 3, issued=5)))
    assert (err.scope, err.token, err.fence, err.issued, err.reason) == (
        "k",
        9,
        3,
        5,
        Reason.UNVERIFIABLE,
    )
    cross = pickle.loads(pickle.dumps(CrossSlotError("mixed", keys=("a", "b"))))
    assert cross.keys == ("a", "b")
    assert type(cross).__module__ == "fence.adapters.redis"


# -- NOSCRIPT and events -------------------------------------------------------------------


def test_script_flush_mid_run_is_neither_an_error_nor_stale(
    client: redis.Redis, guard: RedisGuard
) -> None:
    guard.set("k", 1, token=5)
    client.script_flush()
    guard.set("k", 2, token=5)  # reloads the script and retries once
    client.script_flush()
    assert guard.get("k") == (b"2", 5)
    client.script_flush()
    results = guard.pipeline().set("k", 3, token=5).set("k", 4, token=4).execute()
    assert results[0] == 1
    assert isinstance(results[1], StaleTokenError)
    client.script_flush()
    assert guard.batch(6).set("k", 5).execute() == [1]
    assert guard.get("k") == (b"5", 6)


def test_events_report_accepted_and_rejected_writes(client: redis.Redis) -> None:
    bus = EventBus()
    guard = RedisGuard(client, events=bus)
    with EventRecorder(bus) as events:
        guard.set("k", 1, token=2)
        with pytest.raises(StaleTokenError):
            guard.set("k", 1, token=1)
        guard.pipeline().set("k", 1, token=1).set("k", 2, token=2).execute()
    accepted = events.of(EventKind.WRITE_ACCEPTED)
    rejected = events.of(EventKind.WRITE_REJECTED)
    assert [(e.scope, e.token, e.source) for e in accepted] == [
        ("k", 2, "redis-guard"),
        ("k", 2, "redis-guard"),
    ]
    assert [(e.token, e.detail["reason"]) for e in rejected] == [
        (1, Reason.STALE),
        (1, Reason.STALE),
    ]


# -- asyncio -----------------------------------------------------------------------------


async def test_async_guard_operations_and_pipeline(aclient: redis.asyncio.Redis) -> None:
    guard = AsyncRedisGuard(aclient, scope="resource")
    await guard.claim("{cart:7}:items", 4)
    assert await guard.rpush("{cart:7}:items", "apple", token=4) == 1
    assert await guard.hset("{cart:7}:meta", {"n": 1}, token=4) == 1
    assert await guard.incr("{cart:7}:n", token=4) == 1
    await guard.xadd("{cart:7}:log", {"e": "add"}, token=4)
    with pytest.raises(StaleTokenError):
        await guard.set("{cart:7}:meta", "x", token=3)
    assert await guard.read_for_update("{cart:7}:n", token=5) == b"1"
    assert await guard.hgetall_for_update("{cart:7}:meta", token=5) == {b"n": b"1"}
    assert await guard.get("{cart:7}:n") == (b"1", 5)
    assert await guard.hgetall("{cart:7}:meta") == ({b"n": b"1"}, 5)
    assert await guard.delete("{cart:7}:n", token=5) is True
    assert await guard.fence("cart:7") == 5
    batch = guard.batch(5).set("{cart:7}:a", 1).delete("{cart:7}:a").claim("{cart:7}:b")
    assert await batch.execute() == [1, 1, 1]
    await aclient.script_flush()
    results = (
        await guard.pipeline().set("{cart:7}:a", 1, token=4).incr("{cart:7}:c", token=5).execute()
    )
    assert isinstance(results[0], StaleTokenError)
    assert results[1] == 1


async def test_async_from_url_owns_and_closes_its_client(redis_url: str) -> None:
    async with AsyncRedisGuard.from_url(redis_url) as guard:
        await guard.set("k", 1, token=1)
        assert await guard.get("k") == (b"1", 1)
    with RedisGuard.from_url(redis_url) as sync_guard:
        assert sync_guard.fence("k") == 1


# -- with the Redis lock manager on the same server ----------------------------------------


def test_with_the_redis_lock_manager_issuer_check_and_revoke(
    client: redis.Redis, redis_url: str
) -> None:
    from fence._sync.redis import RedisLockManager

    guard = RedisGuard(client, scope="resource", check_issuer=True)
    manager = RedisLockManager(redis_url, ttl=5)
    try:
        lease = manager.acquire("order:42")
        guard.claim("order:42", lease.token)
        guard.set("{order:42}:status", "paid", token=lease.token)
        with pytest.raises(UnissuedTokenError):  # a token the manager never handed out
            guard.set("{order:42}:status", "forged", token=lease.token + 1)
        # A forced revocation raises the register: the (hung) holder is fenced out at once.
        newer = manager.revoke("order:42")
        assert guard.fence("order:42") == newer
        with pytest.raises(StaleTokenError) as caught:
            guard.set("{order:42}:status", "late", token=lease.token)
        assert (caught.value.reason, caught.value.fence) == (Reason.STALE, newer)
        assert guard.get("{order:42}:status") == (b"paid", newer)
    finally:
        manager.close()
