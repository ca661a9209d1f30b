"""Batches stay all or nothing under every error Redis raises while applying them (C6).

The guard's script checks every operation before its first write, against the state the
batch's earlier operations leave: data types, Redis's own int64 parsing and overflow rule
for ``INCRBY``, the stream's last generated id for ``XADD``, entry sizes and the caller's
ACL. Where the outcome is in doubt the verdict of the real server is the reference: each
case is also sent as a raw command to a scratch copy of the key.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from fence import BackendError, ConfigurationError, FenceError, Reason, StaleTokenError
from fence.adapters._redis_ops import Op
from fence.adapters.redis import (
    PartialWriteError,
    RedisGuard,
    RefusedWrite,
    WriteRefusedError,
)

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)
U64_MAX = 2**64 - 1


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


@pytest.fixture
def guard(client: redis.Redis) -> RedisGuard:
    return RedisGuard(client)


@pytest.fixture
def dead_guard() -> Iterator[RedisGuard]:
    """A guard whose server does not exist: any I/O would raise BackendError."""
    dead = redis.Redis(host="127.0.0.1", port=1, retry=Retry(NoBackoff(), 0))
    yield RedisGuard(dead)
    dead.close()


def snapshot(client: redis.Redis) -> dict[bytes, Any]:
    """Every key with its serialized value and ttl: equal snapshots mean nothing changed."""
    return {key: (client.dump(key), client.pttl(key)) for key in sorted(client.keys("*"))}


def server_refuses(client: redis.Redis, *command: Any) -> bool:
    """The real server's verdict on a raw command."""
    try:
        client.execute_command(*command)
    except redis.ResponseError:
        return True
    return False


# -- INCRBY --------------------------------------------------------------------------------


#: Values and amounts around every edge of Redis's int64 rule (``string2ll``).
INCR_CASES = [
    ("9223372036854775807", 1),
    ("9223372036854775807", 0),
    ("9223372036854775806", 1),
    ("-9223372036854775808", -1),
    ("-9223372036854775808", 1),
    ("-9223372036854775807", -1),
    ("4611686018427387904", 4611686018427387904),
    ("4611686018427387904", 4611686018427387903),
    ("-1", INT64_MIN),
    ("0", INT64_MIN),
    ("1", INT64_MAX),
    ("0", INT64_MAX),
    ("999999999", 1),
    ("-1000000000", 1),
    ("-999999999", -1),
    ("1000000000", -1000000001),
    ("007", 1),
    ("+5", 1),
    (" 5", 1),
    ("5 ", 1),
    ("-0", 1),
    ("0", 1),
    ("00", 1),
    ("-", 1),
    ("", 1),
    ("1e3", 1),
    ("0x10", 1),
    ("3.0", 1),
    ("\u0663", 1),  # an Arabic-Indic digit: not an ASCII digit
    ("9223372036854775808", -1),
    ("-9223372036854775809", 1),
    ("18446744073709551616", 1),
    ("123456789012345678901", 1),
    ("-12345678901234567890", 1),
    ("5\x00", 1),
]


@pytest.mark.parametrize(("value", "amount"), INCR_CASES)
def test_incr_follows_redis_integer_rule(client: redis.Redis, value: str, amount: int) -> None:
    client.set("{s}:scratch", value)
    refused = server_refuses(client, "INCRBY", "{s}:scratch", amount)
    client.set("{o}:n", value)
    before = snapshot(client)
    batch = RedisGuard(client).batch(100).set("{o}:a", "x").incr("{o}:n", amount)
    if refused:
        with pytest.raises(WriteRefusedError) as caught:
            batch.execute()
        (item,) = caught.value.refused
        assert (item.index, item.key, item.op) == (1, "{o}:n", "incr")
        assert item.reason in ("NOT_INTEGER", "OVERFLOW")
        assert snapshot(client) == before
        # A single write gets the same structured error, with nothing written.
        with pytest.raises(WriteRefusedError) as single:
            RedisGuard(client).incr("{o}:n", amount, token=100)
        assert single.value.refused[0].reason == item.reason
        assert snapshot(client) == before
    else:
        assert batch.execute() == [1, int(value) + amount]
        assert client.get("{o}:n") == client.get("{s}:scratch")


def test_the_issue_example_writes_nothing(client: redis.Redis, guard: RedisGuard) -> None:
    client.set("{o}:n", "9223372036854775807")
    with pytest.raises(WriteRefusedError) as caught:
        guard.batch(100).set("{o}:a", "x").incr("{o}:n", 1).execute()
    err = caught.value
    assert not isinstance(err, StaleTokenError | BackendError)
    assert isinstance(err, FenceError)
    assert err.token == 100
    assert err.refused == (RefusedWrite(1, "{o}:n", "incr", "OVERFLOW", err.refused[0].detail),)
    for word in ("{o}:n", "incr", "overflow"):
        assert word in str(err)
    assert client.get("{o}:a") is None
    assert guard.fence("{o}:a") is None
    assert guard.fence("{o}:n") is None


def test_incr_amounts_beyond_int64_are_refused_before_io(dead_guard: RedisGuard) -> None:
    for amount in (2**63, -(2**63) - 1, 10**30):
        with pytest.raises(ConfigurationError, match="64-bit"):
            dead_guard.incr("n", amount, token=1)
        with pytest.raises(ConfigurationError, match="64-bit"):
            dead_guard.batch(1).incr("n", amount)
        with pytest.raises(ConfigurationError, match="64-bit"):
            dead_guard.pipeline().incr("n", amount, token=1)


def test_incrs_on_one_key_are_summed_exactly(client: redis.Redis, guard: RedisGuard) -> None:
    before = snapshot(client)
    with pytest.raises(WriteRefusedError) as caught:
        guard.batch(5).set("{o}:a", 1).incr("{o}:n", 2**62).incr("{o}:n", 2**62).execute()
    assert [(i.index, i.reason) for i in caught.value.refused] == [(2, "OVERFLOW")]
    assert snapshot(client) == before
    # One below the edge, in halves that each lose precision as doubles.
    assert guard.batch(5).incr("{o}:n", 2**62).incr("{o}:n", 2**62 - 1).execute() == [
        2**62,
        INT64_MAX,
    ]
    assert client.get("{o}:n") == str(INT64_MAX).encode()


def test_incr_sees_the_batch_own_writes(client: redis.Redis, guard: RedisGuard) -> None:
    client.set("{o}:n", "5")
    with pytest.raises(WriteRefusedError) as caught:
        guard.batch(5).set("{o}:n", "007").incr("{o}:n").execute()
    assert caught.value.refused[0].reason == "NOT_INTEGER"
    with pytest.raises(WriteRefusedError) as caught:
        guard.batch(5).set("{o}:n", INT64_MAX).incr("{o}:n").execute()
    assert caught.value.refused[0].reason == "OVERFLOW"
    with pytest.raises(WriteRefusedError) as caught:
        guard.batch(5).hset("{o}:h", {"f": 1}).incr("{o}:h").execute()
    assert caught.value.refused[0].reason == "WRONGTYPE"
    assert client.get("{o}:n") == b"5"
    assert client.exists("{o}:h") == 0
    results = guard.batch(5).set("{o}:n", "41").incr("{o}:n").delete("{o}:n").incr("{o}:n", -3)
    assert results.execute() == [1, 42, 1, -3]


# -- XADD ----------------------------------------------------------------------------------


def _stream_with_last_id(client: redis.Redis, key: str, last: str) -> None:
    """A stream whose last generated id is ``last`` and whose entries are all deleted."""
    client.delete(key)
    client.xadd(key, {"f": "v"}, id=last)
    client.xdel(key, last)


@pytest.mark.parametrize(
    ("last", "entry_id"),
    [
        ("5-5", "5-5"),
        ("5-5", "5-4"),
        ("5-5", "4-9"),
        ("5-5", "4-*"),
        ("5-5", "5-*"),
        ("5-5", "5-6"),
        ("5-5", "6-0"),
        ("5-5", "*"),
        ("5-5", "5"),
        ("5-5", "6"),
        (f"5-{U64_MAX}", "5-*"),
        (f"5-{U64_MAX}", "6-*"),
        (f"{U64_MAX}-{U64_MAX - 1}", "*"),
        (f"{U64_MAX}-{U64_MAX - 1}", f"{U64_MAX}-*"),
        (f"{U64_MAX}-{U64_MAX}", "*"),
        (f"{U64_MAX}-{U64_MAX}", f"{U64_MAX}-*"),
        (f"{U64_MAX}-{U64_MAX}", f"{U64_MAX}-{U64_MAX}"),
        (f"{U64_MAX - 1}-{U64_MAX}", f"{U64_MAX}-0"),
        (f"{U64_MAX - 1}-{U64_MAX}", f"{U64_MAX - 1}-{U64_MAX}"),
        ("10000000000000000000-0", "9999999999999999999-99"),
        ("9999999999999999999-99", "10000000000000000000-0"),
    ],
)
def test_xadd_ids_follow_the_stream_last_generated_id(
    client: redis.Redis, last: str, entry_id: str
) -> None:
    _stream_with_last_id(client, "{s}:scratch", last)
    refused = server_refuses(client, "XADD", "{s}:scratch", entry_id, "f", "v")
    _stream_with_last_id(client, "{o}:s", last)
    before = snapshot(client)
    batch = RedisGuard(client).batch(7).set("{o}:a", "x").xadd("{o}:s", {"f": "v"}, id=entry_id)
    if refused:
        with pytest.raises(WriteRefusedError) as caught:
            batch.execute()
        (item,) = caught.value.refused
        assert (item.index, item.key, item.op) == (1, "{o}:s", "xadd")
        assert item.reason in ("STREAM_ID", "STREAM_EXHAUSTED")
        assert snapshot(client) == before
        with pytest.raises(WriteRefusedError):
            RedisGuard(client).xadd("{o}:s", {"f": "v"}, id=entry_id, token=7)
        assert snapshot(client) == before
    else:
        results = batch.execute()
        assert results[1] == client.xinfo_stream("{o}:s")["last-generated-id"]
        if entry_id != "*":
            assert results[1] == client.xinfo_stream("{s}:scratch")["last-generated-id"]


def test_xadd_ids_within_one_batch(client: redis.Redis, guard: RedisGuard) -> None:
    before = snapshot(client)
    with pytest.raises(WriteRefusedError) as caught:
        guard.batch(3).xadd("{o}:s", {"f": 1}, id="7-1").xadd("{o}:s", {"f": 2}, id="7-1").execute()
    assert [(i.index, i.reason) for i in caught.value.refused] == [(1, "STREAM_ID")]
    assert snapshot(client) == before
    ids = (
        guard.batch(3)
        .xadd("{o}:s", {"f": 1}, id="7-*")
        .xadd("{o}:s", {"f": 2}, id="7-*")
        .xadd("{o}:s", {"f": 3}, id="8")
        .xadd("{o}:s", {"f": 4})
        .execute()
    )
    assert ids[:3] == [b"7-0", b"7-1", b"8-0"]
    assert client.xlen("{o}:s") == 4
    # After a delete the stream starts over at 0-0.
    assert guard.batch(3).delete("{o}:s").xadd("{o}:s", {"f": 1}, id="1-1").execute() == [
        1,
        b"1-1",
    ]


def test_explicit_id_after_an_automatic_one_is_refused_before_io(dead_guard: RedisGuard) -> None:
    batch = dead_guard.batch(1).xadd("{o}:s", {"f": 1})
    for entry_id in ("9-9", "9-*", "9"):
        with pytest.raises(ConfigurationError, match="cannot be predicted"):
            batch.xadd("{o}:s", {"f": 2}, id=entry_id)
    assert len(batch) == 1
    # Another stream, another automatic id, or a delete first: predictable again.
    batch.xadd("{o}:t", {"f": 1}, id="9-9").xadd("{o}:s", {"f": 1})
    batch.delete("{o}:s").xadd("{o}:s", {"f": 1}, id="9-9")
    assert len(batch) == 5


@pytest.mark.parametrize(
    "entry_id",
    ["0-0", "0", "abc", "5-", "-5", "5-x", "+", "-", "5-5-5", " 5-1", "5-1 ", "", "*-1",
     f"{U64_MAX + 1}-0", f"0-{U64_MAX + 1}", "\u0665-1", "maxlen", "5--1"],
)  # fmt: skip
def test_malformed_xadd_ids_are_refused_before_io(dead_guard: RedisGuard, entry_id: str) -> None:
    with pytest.raises(ConfigurationError, match="id"):
        dead_guard.xadd("s", {"f": 1}, id=entry_id, token=1)
    with pytest.raises(ConfigurationError, match="id"):
        dead_guard.batch(1).xadd("s", {"f": 1}, id=entry_id)


def test_xadd_ids_and_maxlen_are_canonical(client: redis.Redis, guard: RedisGuard) -> None:
    assert guard.xadd("s", {"f": 1}, id="007-01", token=1) == b"7-1"
    assert guard.xadd("s", {"f": 1}, id="0009", token=1, maxlen=0) == b"9-0"
    for maxlen in (-1, 2**63, True, 1.0):
        with pytest.raises(ConfigurationError, match="maxlen"):
            guard.xadd("s", {"f": 1}, token=1, maxlen=maxlen)  # type: ignore[arg-type]


def test_xadd_field_count_is_bounded(client: redis.Redis, dead_guard: RedisGuard) -> None:
    # One entry is one XADD: it cannot be split like HSET and RPUSH, and Lua's unpack stops
    # near 8000 values. Past the bound the guard refuses before any I/O.
    with pytest.raises(ConfigurationError, match="fields"):
        dead_guard.xadd("s", {f"f{i}": i for i in range(3001)}, token=1)
    fields = {f"f{i}": i for i in range(3000)}
    assert RedisGuard(client).batch(1).xadd("{o}:s", fields).execute()[0]
    assert len(client.xrange("{o}:s")[0][1]) == 3000


# -- sizes, types, ttl ------------------------------------------------------------------------


def test_many_arguments_are_applied_in_chunks(client: redis.Redis, guard: RedisGuard) -> None:
    mapping = {f"f{i}": i for i in range(12_000)}
    assert guard.hset("{o}:h", mapping, token=1) == 12_000
    assert guard.rpush("{o}:l", *range(20_000), token=1) == 20_000
    results = guard.batch(1).hset("{o}:h", {**mapping, "new": 1}).rpush("{o}:l", *range(9000))
    assert results.execute() == [1, 29_000]
    assert client.hlen("{o}:h") == 12_001
    assert client.lindex("{o}:l", -1) == b"8999"
    assert guard.pipeline().rpush("{o}:l", *range(9000), token=1).execute() == [38_000]


def test_absurd_ttls_are_refused_before_io(dead_guard: RedisGuard) -> None:
    for ttl in (2.0**53, 1e300, 10**20):
        with pytest.raises(ConfigurationError, match="ttl"):
            dead_guard.set("k", 1, token=1, ttl=ttl)
        with pytest.raises(ConfigurationError, match="ttl"):
            dead_guard.batch(1).set("k", 1, ttl=ttl)


def test_wrong_types_are_structured_errors(client: redis.Redis, guard: RedisGuard) -> None:
    client.set("{o}:text", "x")
    client.hset("{o}:hash", "f", "v")
    before = snapshot(client)
    with pytest.raises(WriteRefusedError) as caught:
        (
            guard.batch(4)
            .set("{o}:a", 1)
            .hset("{o}:text", {"f": 1})
            .rpush("{o}:hash", 1)
            .xadd("{o}:text", {"f": 1})
            .incr("{o}:hash")
            .execute()
        )
    assert [(i.index, i.op, i.reason) for i in caught.value.refused] == [
        (1, "hset", "WRONGTYPE"),
        (2, "rpush", "WRONGTYPE"),
        (3, "xadd", "WRONGTYPE"),
        (4, "incr", "WRONGTYPE"),
    ]
    assert "4 operations" in str(caught.value)
    for call in (
        lambda: guard.hset("{o}:text", {"f": 1}, token=4),
        lambda: guard.rpush("{o}:text", 1, token=4),
        lambda: guard.read_for_update("{o}:hash", token=4),
        lambda: guard.hgetall_for_update("{o}:text", token=4),
    ):
        with pytest.raises(WriteRefusedError) as single:
            call()
        assert single.value.refused[0].reason == "WRONGTYPE"
    assert snapshot(client) == before  # the registering reads did not raise the fence
    outcome = guard.pipeline().incr("{o}:text", token=4).set("{o}:b", 1, token=4).execute()
    assert isinstance(outcome[0], WriteRefusedError)
    assert outcome[0].refused[0].reason == "NOT_INTEGER"
    assert outcome[1] == 1


def test_the_token_verdict_wins_over_data_errors(client: redis.Redis, guard: RedisGuard) -> None:
    guard.claim("{o}:a", 9)
    client.set("{o}:n", "x")
    before = snapshot(client)
    with pytest.raises(StaleTokenError) as caught:
        guard.batch(8).set("{o}:a", 1).incr("{o}:n").execute()
    assert caught.value.reason is Reason.STALE
    assert snapshot(client) == before


def test_refusals_pickle_with_their_data() -> None:
    items = (
        RefusedWrite(0, "{o}:n", "incr", "OVERFLOW", "the sum overflows"),
        RefusedWrite(2, "{o}:s", "xadd", "STREAM_ID", "5-5 is not above 5-5"),
    )
    err = pickle.loads(pickle.dumps(WriteRefusedError(7, items)))
    assert (err.token, err.refused) == (7, items)
    assert type(err).__module__ == "fence.adapters.redis"
    assert "2 operations" in str(err)
    failed = RefusedWrite(1, "{o}:b", "set", "ERROR", "boom")
    partial = pickle.loads(pickle.dumps(PartialWriteError(7, applied=(0,), failed=failed)))
    assert (partial.code, partial.token, partial.applied, partial.failed) == (
        "PARTIAL",
        7,
        (0,),
        failed,
    )
    assert isinstance(partial, BackendError)


def test_a_failure_nobody_foresaw_is_reported_as_partial(
    client: redis.Redis, guard: RedisGuard
) -> None:
    """The last line of defence: an operation the checks pass but Redis refuses while
    applying, after an earlier one was written. The public API refuses this expiry before
    any I/O; built by hand it stands for a case the checks did not foresee."""
    unforeseen = Op("set", "{o}:b", ("v", b"-5"))
    with pytest.raises(PartialWriteError) as caught:
        guard._write(3, [Op("set", "{o}:a", ("v", b"")), unforeseen])
    err = caught.value
    assert (err.code, err.applied, err.failed.index, err.failed.key) == (
        "PARTIAL",
        (0,),
        1,
        "{o}:b",
    )
    assert "expire" in err.failed.detail
    assert "PARTIAL" in str(err) or "partly" in str(err)
    assert client.get("{o}:a") == b"v"  # loud, not silent: operation 0 did land
    assert guard.fence("{o}:a") == 3
    assert client.exists("{o}:b") == 0
    # The same operation alone fails before any write: an ordinary refusal.
    with pytest.raises(WriteRefusedError) as single:
        guard._write(3, [unforeseen])
    assert single.value.refused[0].reason == "ERROR"
    assert guard.fence("{o}:b") is None
