"""The Redis storage guard: fenced writes to Redis keys, sync and asyncio.

Every write is one ``EVALSHA`` of one Lua script that checks the fence and applies the
write with the new fence atomically; a stale token changes nothing and raises
:class:`fence.StaleTokenError`::

    import redis
    from fence.adapters.redis import RedisGuard

    guard = RedisGuard(redis.Redis(), scope="resource")
    with manager.lock("order:42") as lease:
        guard.claim("order:42", lease.token)          # shut out older holders first (C8)
        guard.set("{order:42}:status", "paid", token=lease.token)

The asyncio twin is :class:`AsyncRedisGuard` (``redis.asyncio.Redis`` or
``redis.asyncio.cluster.RedisCluster``). Every write path is fenced or refused before any
I/O (C9): keys in the fence namespace and, in the resource scope, data keys without a hash
tag are refused; an operation Redis would refuse on the data raises
:class:`WriteRefusedError` with nothing written, in a batch as for a single write (C6).
Raw commands on the guard's keys are refused by Redis only for users set up with
:func:`acl_rules`, the server-side judge on Redis (C14). A pipeline or a transaction is
refused as the client, and keys are judged as the bytes the client sends. See
``docs/redis-guard.md`` for the key layout, the rule for every write path, the ACL
recipe, the issuer check and the write-only fencing hole.
"""

from __future__ import annotations

from fence._redis_keys import FenceScope, KeyLayout, hash_tag, resource_of, slot_of

from ._async.redis import AsyncFencedPipeline, AsyncRedisBatch, AsyncRedisGuard
from ._redis_acl import AclRules, acl_rules
from ._redis_errors import (
    CrossSlotError,
    PartialWriteError,
    RefusedWrite,
    UnissuedTokenError,
    WriteRefusedError,
)
from ._redis_lua import READ_LUA, SET_LUA, WRITE_LUA
from ._redis_ops import MAX_TTL_MS, MAX_XADD_FIELDS, stream_id
from ._sync.redis import FencedPipeline, RedisBatch, RedisGuard

__all__ = [
    "MAX_TTL_MS",
    "MAX_XADD_FIELDS",
    "READ_LUA",
    "SET_LUA",
    "WRITE_LUA",
    "AclRules",
    "AsyncFencedPipeline",
    "AsyncRedisBatch",
    "AsyncRedisGuard",
    "CrossSlotError",
    "FenceScope",
    "FencedPipeline",
    "KeyLayout",
    "PartialWriteError",
    "RedisBatch",
    "RedisGuard",
    "RefusedWrite",
    "UnissuedTokenError",
    "WriteRefusedError",
    "acl_rules",
    "hash_tag",
    "resource_of",
    "slot_of",
    "stream_id",
]

for _cls in (
    AsyncFencedPipeline,
    AsyncRedisBatch,
    AsyncRedisGuard,
    FencedPipeline,
    RedisBatch,
    RedisGuard,
    FenceScope,
    KeyLayout,
    AclRules,
):
    _cls.__module__ = __name__
del _cls
