"""The ACL recipe of the Redis guard, on the suite's redis-server.

``acl_rules`` must refuse key patterns that reach the fence namespace (checked against
Redis's own glob matcher), the guard's user it describes must be able to run every fenced
write, and a guard whose user lacks a command must refuse the write whole, before its
first write. The raw commands an application user could send are rows of the write-path
catalogue, ``tests/test_write_paths_redis.py``.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from itertools import product

import pytest
import redis
from hypothesis import given, settings
from hypothesis import strategies as st

from fence import ConfigurationError
from fence.adapters._redis_acl import _tokens, common_match
from fence.adapters.redis import RedisGuard, WriteRefusedError, acl_rules
from tests.servers import RedisServer

pytestmark = pytest.mark.redis


@pytest.fixture
def admin(redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


@pytest.fixture
def make_user(admin: redis.Redis, redis_url: str) -> Iterator[object]:
    """Create ACL users with given rules; return a client logged in as each."""
    made: list[tuple[str, redis.Redis]] = []

    def make(*rules: str) -> redis.Redis:
        name, password = f"u-{secrets.token_hex(4)}", secrets.token_hex(8)
        admin.execute_command("ACL", "SETUSER", name, *rules, f">{password}")
        client = redis.Redis.from_url(redis_url, username=name, password=password)
        made.append((name, client))
        return client

    yield make
    for name, client in made:
        client.close()
        admin.execute_command("ACL", "DELUSER", name)


# -- the rules ---------------------------------------------------------------------------


def test_rules_refuse_patterns_that_reach_the_fence_namespace() -> None:
    for pattern in ("*", "f*", "?ence:*", "[a-g]ence:*", "fence:{order:*}:*", "fence\\:x"):
        with pytest.raises(ConfigurationError, match="fence namespace"):
            acl_rules([pattern])
        with pytest.raises(ConfigurationError, match="fence namespace"):
            acl_rules(["{order:*}:*"], app_keys=[pattern])
    with pytest.raises(ConfigurationError, match=r"e\.g\. 'app:x'"):
        acl_rules(["{order:*}:*"], prefix="app:", app_keys=["app:x"])
    with pytest.raises(ConfigurationError, match="fenced data keys"):
        acl_rules(["{order:*}:*"], app_keys=["{*"])
    for bad in ([], "order:*", [""], ["[ab"]):
        with pytest.raises(ConfigurationError):
            acl_rules(bad)
    with pytest.raises(ConfigurationError):
        acl_rules(["{order:*}:*"], prefix="")
    rules = acl_rules(["{order:*}:*"], app_keys=["cache:*"])
    assert rules.guard[:2] == ("reset", "on")
    assert {"~{order:*}:*", "~fence:*"} <= set(rules.guard)
    assert {"%R~{order:*}:*", "~cache:*"} <= set(rules.app)
    assert not any("fence" in rule for rule in rules.app)
    # A prefix with glob characters is escaped, not taken as a pattern.
    assert "~a\\*b:*" in acl_rules(["{o:*}:*"], prefix="a*b:").guard


ALPHABET = "ab[]^-\\*?"
KEYS = ["".join(p) for n in range(1, 5) for p in product(ALPHABET, repeat=n)]


def _closed(pattern: str) -> bool:
    try:
        _tokens(pattern)
    except ConfigurationError:
        return False
    return True


PATTERNS = st.text(ALPHABET, min_size=1, max_size=5).filter(_closed)


@pytest.fixture(scope="module")
def matcher(redis_server: RedisServer) -> Iterator[redis.Redis]:
    """Database 9 of the suite's server: KEYS asks Redis's own glob matcher."""
    client = redis.Redis(host="127.0.0.1", port=redis_server.port, db=9)
    yield client
    client.flushdb()
    client.close()


@settings(max_examples=300, deadline=None)
@given(a=PATTERNS, b=PATTERNS)
def test_common_match_agrees_with_redis(matcher: redis.Redis, a: str, b: str) -> None:
    """Against every key of up to 4 bytes over the patterns' alphabet: no common key is
    missed, and the one found is a shortest one that Redis matches with both patterns."""
    if matcher.dbsize() != len(KEYS):  # another test flushed the server
        matcher.flushdb()
        pipe = matcher.pipeline(transaction=False)
        for key in KEYS:
            pipe.set(key, 1)
        pipe.execute()
    found = common_match(a, b)
    both = set(matcher.keys(a)) & set(matcher.keys(b))
    if found is None:
        assert not both, f"{a!r} and {b!r} both match {sorted(both)[:3]}"
        return
    assert all(len(key) >= len(found) for key in both)
    if found not in both:  # longer, or a byte outside the alphabet: ask Redis directly
        matcher.set(found, 1)
        try:
            assert found in matcher.keys(a)
            assert found in matcher.keys(b)
        finally:
            matcher.delete(found)


# -- the guard's user --------------------------------------------------------------------------


def test_a_user_missing_a_command_is_refused_whole(admin: redis.Redis, make_user: object) -> None:
    """The batch checks the user's ACL for each command before its first write."""
    rules = acl_rules(["{o}:*"])
    client = make_user(*rules.guard, "-incrby")  # type: ignore[operator]
    guard = RedisGuard(client)
    guard.set("{o}:n", 1, token=3)
    before = {key: admin.dump(key) for key in admin.keys("*")}
    with pytest.raises(WriteRefusedError) as caught:
        guard.batch(3).set("{o}:a", "x").incr("{o}:n").rpush("{o}:l", 1).execute()
    assert [(i.index, i.op, i.reason) for i in caught.value.refused] == [(1, "incr", "NOPERM")]
    with pytest.raises(WriteRefusedError) as single:
        guard.incr("{o}:n", token=3)
    assert single.value.refused[0].reason == "NOPERM"
    assert {key: admin.dump(key) for key in admin.keys("*")} == before
    # A user that may HSET but not SET could write a hash and not raise its fence.
    hasher = RedisGuard(make_user(*rules.guard, "-set"))  # type: ignore[operator]
    with pytest.raises(WriteRefusedError) as caught:
        hasher.hset("{o}:h", {"f": 1}, token=4)
    assert caught.value.refused[0].reason == "NOPERM"
    with pytest.raises(WriteRefusedError):
        hasher.batch(4).hset("{o}:h", {"f": 1}).execute()
    assert admin.exists("{o}:h") == 0
    assert {key: admin.dump(key) for key in admin.keys("*")} == before
