"""The Redis lock manager's Lua scripts and key naming, without I/O.

Every key of resource ``R`` shares the hash tag ``{R}`` (C12), so one script touches one
Redis Cluster slot. With the default prefix ``fence:``:

- ``fence:{R}:lock``: the holder, a hash ``secret``/``token``/``holder`` with a ``PX`` ttl.
- ``fence:{R}:token``: the last token issued for ``R``; an integer string with no ttl.
- ``fence:{R}:fence``: the storage guards' fence register. :data:`REVOKE` raises it, and
  no new token is ever issued at or below it.
- ``fence:{R}:queue`` and ``fence:{R}:queue-deadlines``: the FIFO wait queue (a sorted set
  of waiter ids by arrival, and a hash of each waiter's deadline in server milliseconds).
- ``fence:{R}:void:<secret>``: left by :data:`CANCEL` for an acquire that gave up without
  knowing its outcome; an attempt with that secret that arrives later is refused.

and the pub/sub channel ``fence:{R}:signal``, on which a release (or revoke, or a waiter
that gives up while the lock is free) publishes a wake-up: an empty message (wake one
waiter per listening manager) or, with FIFO, the id of the waiter whose turn it is.

Only the lock, queue and void keys carry a ttl. Counters and fences never do.

Tokens in Lua are doubles; every token is below ``2**53`` (C1), so they are exact. They are
written with ``string.format('%d', t)``: passing a number to ``redis.call`` would format it
as ``%.14g`` and lose digits.
"""

from __future__ import annotations

import functools
import hashlib
import math
from typing import NamedTuple

from fence._core import TokenMode, validate_resource
from fence._errors import ConfigurationError, InvalidResourceError

__all__ = [
    "ABANDON",
    "ACQUIRE",
    "CANCEL",
    "DEFAULT_PREFIX",
    "ENQUEUE",
    "INSPECT",
    "RELEASE",
    "RENEW",
    "REVOKE",
    "ResourceKeys",
    "config_warnings",
    "milliseconds",
    "resource_keys",
    "validate_prefix",
    "waiter_id",
]

#: The key prefix shared with the Redis guard.
DEFAULT_PREFIX = "fence:"

# Shared Lua prelude: the token rule of fence._core.issue_token and the wake-up step.
_PRELUDE = """
local MAX_TOKEN = 9007199254740991

local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

-- max(last + 1, TIME in microseconds) for 'hybrid', last + 1 for 'counter'.
local function issue(last, mode)
  local nxt = last + 1
  if mode == 'hybrid' then
    local clock = now_us()
    if clock > nxt then nxt = clock end
  end
  if nxt > MAX_TOKEN then
    return nil
  end
  return nxt
end

-- The largest token known for the resource: the counter, and the guards' fence register
-- (a counter lost with an AOF tail, or evicted, must not take tokens below the fence).
local function last_token(token_key, fence_key)
  local last = tonumber(redis.call('GET', token_key) or '0') or 0
  local fence = tonumber(redis.call('GET', fence_key) or '0') or 0
  if fence > last then return fence end
  return last
end

-- '<prefix>{R}:' from the lock key '<prefix>{R}:lock'.
local function base_of(lock_key)
  return string.sub(lock_key, 1, -5)
end

-- Drop queue heads whose deadline passed; return the live head or nil.
local function queue_head(queue, deadlines, now_ms)
  while true do
    local head = redis.call('ZRANGE', queue, 0, 0)[1]
    if not head then return nil end
    local deadline = tonumber(redis.call('HGET', deadlines, head))
    if deadline and deadline > now_ms then return head end
    redis.call('ZREM', queue, head)
    redis.call('HDEL', deadlines, head)
  end
end

-- Wake waiters: publish on the resource's channel '<prefix>{R}:signal'. Without FIFO an
-- empty message (each listening manager wakes one of its waiters); with FIFO the id of the
-- queue's head (only its manager wakes it), and nothing when nobody is queued.
local function wake(signal, queue, deadlines, fifo)
  local payload = ''
  if fifo then
    payload = queue_head(queue, deadlines, math.floor(now_us() / 1000))
    if not payload then return end
  end
  redis.call('PUBLISH', signal, payload)
end
"""

ACQUIRE = (
    _PRELUDE
    + """
-- ACQUIRE: take the lock if free, issuing the next token in the same step.
-- KEYS[1] lock hash      KEYS[2] token counter   KEYS[3] guard fence register
-- KEYS[4] FIFO queue     KEYS[5] FIFO queue deadlines      (FIFO only)
-- ARGV[1] owner secret   ARGV[2] ttl in ms       ARGV[3] holder label
-- ARGV[4] 'hybrid' or 'counter'
-- ARGV[5] waiter id      ARGV[6] queue entry lifetime in ms (FIFO only; their presence
--                                                            turns FIFO on)
-- Returns the granted token as a bare number (the same one for a reentrant acquire; a
-- table reply costs the server a microsecond more), else {0, wait_ms, queued}:
--   wait_ms when not granted, ms until the lock may change without a wake-up (the holder's
--           PTTL, or the deadline of the FIFO queue's head), -1 if unknown;
--   queued  1 if the caller has a place in the FIFO queue.
-- A new token is above the counter and above the guards' fence register. An attempt whose
-- acquire was cancelled (CANCEL left its tombstone) is refused with wait_ms -1.
-- Error 'token space exhausted' when the next token would pass 2**53-1.
local held = redis.call('HMGET', KEYS[1], 'secret', 'token')
if held[1] == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return tonumber(held[2])
end
local fifo = ARGV[5] ~= nil
local queued = 0
local now_ms = 0
if fifo then
  now_ms = math.floor(now_us() / 1000)
  if redis.call('ZSCORE', KEYS[4], ARGV[5]) then
    queued = 1
    -- A waiter's attempt is its heartbeat: its place lives while it keeps trying.
    redis.call('HSET', KEYS[5], ARGV[5], string.format('%d', now_ms + tonumber(ARGV[6])))
    redis.call('PEXPIRE', KEYS[4], ARGV[6])
    redis.call('PEXPIRE', KEYS[5], ARGV[6])
  end
end
if held[1] then
  return {0, redis.call('PTTL', KEYS[1]), queued}
end
if redis.call('EXISTS', base_of(KEYS[1]) .. 'void:' .. ARGV[1]) == 1 then
  return {0, -1, 0}
end
if fifo then
  local head = queue_head(KEYS[4], KEYS[5], now_ms)
  if head and head ~= ARGV[5] then
    return {0, tonumber(redis.call('HGET', KEYS[5], head)) - now_ms, queued}
  end
  if head then
    redis.call('ZREM', KEYS[4], head)
    redis.call('HDEL', KEYS[5], head)
  end
end
local token = issue(last_token(KEYS[2], KEYS[3]), ARGV[4])
if not token then
  return redis.error_reply('ERR fence: token space exhausted for ' .. KEYS[2])
end
local text = string.format('%d', token)
redis.call('SET', KEYS[2], text)
redis.call('HSET', KEYS[1], 'secret', ARGV[1], 'token', text, 'holder', ARGV[3])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return token
"""
)

RENEW = """
-- RENEW: reset the ttl if the caller holds the lock (C11).
-- KEYS[1] lock hash
-- ARGV[1] owner secret   ARGV[2] ttl in ms
-- Returns 1 if renewed, 0 if the lock is not held by this secret.
if redis.call('HGET', KEYS[1], 'secret') == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

RELEASE = (
    _PRELUDE
    + """
-- RELEASE: delete the lock if the caller holds it (C11), and publish a wake-up.
-- KEYS[1] lock hash
-- KEYS[2] FIFO queue     KEYS[3] FIFO queue deadlines      (FIFO only)
-- ARGV[1] owner secret   ARGV[2] '1' for FIFO (its presence turns FIFO on)
-- Returns 1 if released, 0 if the lock is not held by this secret (nothing changed).
if redis.call('HGET', KEYS[1], 'secret') ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
wake(base_of(KEYS[1]) .. 'signal', KEYS[2], KEYS[3], ARGV[2])
return 1
"""
)

ENQUEUE = (
    _PRELUDE
    + """
-- ENQUEUE: put a FIFO waiter at the tail of the queue (or refresh its place).
-- KEYS[1] lock hash      KEYS[2] FIFO queue      KEYS[3] FIFO queue deadlines
-- ARGV[1] waiter id      ARGV[2] queue entry lifetime in ms
-- Returns 1 if the lock is free and the caller is first in line (try again now), else 0.
local now_ms = math.floor(now_us() / 1000)
if not redis.call('ZSCORE', KEYS[2], ARGV[1]) then
  local tail = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')
  local score = 1
  if tail[2] then score = tonumber(tail[2]) + 1 end
  redis.call('ZADD', KEYS[2], string.format('%d', score), ARGV[1])
end
redis.call('HSET', KEYS[3], ARGV[1], string.format('%d', now_ms + tonumber(ARGV[2])))
redis.call('PEXPIRE', KEYS[2], ARGV[2])
redis.call('PEXPIRE', KEYS[3], ARGV[2])
if redis.call('EXISTS', KEYS[1]) == 0 and queue_head(KEYS[2], KEYS[3], now_ms) == ARGV[1] then
  return 1
end
return 0
"""
)

ABANDON = (
    _PRELUDE
    + """
-- ABANDON: a waiter gave up. Drop its place and, if the lock is free, pass the turn on, so
-- a waiter that left (or took a wake-up it will not use) never holds up the others.
-- KEYS[1] lock hash      KEYS[2] FIFO queue     KEYS[3] FIFO queue deadlines
-- ARGV[1] waiter id      ARGV[2] '1' for FIFO
-- Returns 1 if a wake-up was published, else 0.
if ARGV[2] then
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('HDEL', KEYS[3], ARGV[1])
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
wake(base_of(KEYS[1]) .. 'signal', KEYS[2], KEYS[3], ARGV[2])
return 1
"""
)

CANCEL = (
    _PRELUDE
    + """
-- CANCEL: an acquire gave up without knowing what one of its attempts did (the reply was
-- lost to a timeout, a broken connection or a cancellation). Leave a tombstone for its
-- secret, so that an attempt still on its way is refused when it arrives; release the lock
-- if an attempt took it; leave the FIFO queue. The outcome no longer depends on the order
-- in which the attempt and this script reach the server.
-- KEYS[1] lock hash      KEYS[2] FIFO queue     KEYS[3] FIFO queue deadlines
-- ARGV[1] owner secret   ARGV[2] tombstone ttl in ms (the lease's ttl)
-- ARGV[3] waiter id      ARGV[4] '1' for FIFO
-- Returns 1 if the secret held the lock (released now), else 0.
redis.call('SET', base_of(KEYS[1]) .. 'void:' .. ARGV[1], '1', 'PX', ARGV[2])
if ARGV[4] then
  redis.call('ZREM', KEYS[2], ARGV[3])
  redis.call('HDEL', KEYS[3], ARGV[3])
end
if redis.call('HGET', KEYS[1], 'secret') ~= ARGV[1] then
  return 0
end
redis.call('DEL', KEYS[1])
wake(base_of(KEYS[1]) .. 'signal', KEYS[2], KEYS[3], ARGV[4])
return 1
"""
)

INSPECT = """
-- INSPECT: who holds the lock.
-- KEYS[1] lock hash
-- Returns {token, pttl_ms, holder} or nil when free. Never the secret.
local held = redis.call('HMGET', KEYS[1], 'token', 'holder')
if not held[1] then
  return nil
end
return {tonumber(held[1]), redis.call('PTTL', KEYS[1]), held[2] or ''}
"""

REVOKE = (
    _PRELUDE
    + """
-- REVOKE: end whatever lease the resource has, issue a token above every token issued
-- so far and above the guards' fence register, and raise the register to it, so a hung
-- holder's writes are refused from now on (C8, C12). Publishes a wake-up.
-- KEYS[1] lock hash      KEYS[2] token counter   KEYS[3] guard fence register
-- KEYS[4] FIFO queue     KEYS[5] FIFO queue deadlines      (FIFO only)
-- ARGV[1] 'hybrid' or 'counter'                  ARGV[2] '1' for FIFO
-- Returns the new token. Error 'token space exhausted' as in ACQUIRE.
local last = last_token(KEYS[2], KEYS[3])
local held = tonumber(redis.call('HGET', KEYS[1], 'token') or '0') or 0
if held > last then last = held end
local token = issue(last, ARGV[1])
if not token then
  return redis.error_reply('ERR fence: token space exhausted for ' .. KEYS[2])
end
local text = string.format('%d', token)
redis.call('SET', KEYS[2], text)
redis.call('SET', KEYS[3], text)
redis.call('DEL', KEYS[1])
wake(base_of(KEYS[1]) .. 'signal', KEYS[4], KEYS[5], ARGV[2])
return token
"""
)


class ResourceKeys(NamedTuple):
    """The Redis keys of one resource; they all share the hash tag ``{resource}``.

    Attributes:
        lock: the holder hash (ttl: the lease).
        token: the last token issued (no ttl).
        fence: the guards' fence register (no ttl).
        signal: the pub/sub channel a release publishes its wake-up on (not a key).
        queue: the FIFO wait queue (sorted set of waiter ids).
        deadlines: the FIFO waiters' deadlines (hash).
        void_prefix: prepend to a secret for the tombstone of a cancelled acquire.
    """

    lock: str
    token: str
    fence: str
    signal: str
    queue: str
    deadlines: str
    void_prefix: str


def validate_prefix(prefix: object) -> str:
    """Return ``prefix`` if it can start the keys of every resource, else raise.

    Raises:
        ConfigurationError: not a ``str``, or it contains ``{`` or ``}``, which would
            move the hash tag off the resource name.
    """
    if not isinstance(prefix, str) or "{" in prefix or "}" in prefix:
        raise ConfigurationError(f"a Redis key prefix must be a str without braces, got {prefix!r}")
    return prefix


@functools.lru_cache(maxsize=4096)
def resource_keys(prefix: str, resource: str) -> ResourceKeys:
    """The keys of ``resource`` under ``prefix`` (C12).

    Args:
        prefix: a key prefix without braces (default :data:`DEFAULT_PREFIX`).
        resource: the resource name.

    Raises:
        InvalidResourceError: not a valid resource name, or it starts with ``}``: the hash
            tag ``{}`` would be empty and Redis Cluster would hash each key on its own,
            scattering one resource's keys over several slots.

    Example::

        >>> resource_keys("fence:", "order:42").token
        'fence:{order:42}:token'
    """
    resource = validate_resource(resource)
    if resource.startswith("}"):
        raise InvalidResourceError(
            f"a Redis resource name must not start with '}}': the hash tag of {resource!r} "
            "would be empty and its keys would land in different cluster slots",
            value=resource,
        )
    base = f"{prefix}{{{resource}}}:"
    return ResourceKeys(
        lock=base + "lock",
        token=base + "token",
        fence=base + "fence",
        signal=base + "signal",
        queue=base + "queue",
        deadlines=base + "queue-deadlines",
        void_prefix=base + "void:",
    )


def waiter_id(secret: str) -> str:
    """A short public id for a waiter, derived from its owner secret.

    Queue members and wake keys are visible to anyone who can list keys, so they carry a
    digest of the secret, never the secret itself.
    """
    return hashlib.blake2b(secret.encode(), digest_size=10).hexdigest()


def milliseconds(seconds: float) -> int:
    """``seconds`` as whole milliseconds, rounded up and at least 1.

    Rounding up keeps the server's ttl at least as long as the one the client counts on.
    """
    return max(1, math.ceil(seconds * 1000 - 1e-6))


def config_warnings(settings: dict[str, str], token_mode: TokenMode) -> list[str]:
    """What is wrong with a server's settings for tokens and fences (C3, C12).

    Args:
        settings: ``CONFIG GET`` results for ``maxmemory-policy``, ``appendonly``,
            ``appendfsync`` and ``save`` (missing ones are not judged).
        token_mode: the manager's token mode.

    Returns:
        One sentence per problem; empty when nothing can lose tokens or fences.
    """
    problems = []
    policy = settings.get("maxmemory-policy", "")
    if policy.startswith("allkeys-"):
        problems.append(
            f"maxmemory-policy is {policy}: under memory pressure Redis may evict token "
            "counters and fence keys, which have no ttl; an evicted fence lets a stale token "
            "write again. Use noeviction or a volatile-* policy"
        )
    if token_mode is TokenMode.COUNTER and settings.get("appendonly") == "no":
        if settings.get("save", "") == "":
            problems.append(
                "persistence is off (appendonly no, no save points): a restart resets every "
                "token counter and counter-mode tokens go back to 1. Enable appendonly "
                "(appendfsync always) or use hybrid tokens"
            )
        else:
            problems.append(
                "appendonly is off: a restart loads the last snapshot and loses the counters "
                "issued since, so counter-mode tokens can repeat. Enable appendonly "
                "(appendfsync always) or use hybrid tokens"
            )
    return problems
