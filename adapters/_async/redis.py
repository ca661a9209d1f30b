"""The Redis storage guard for asyncio: fenced writes in one Lua script each.

``tools/async_to_sync.py`` generates ``adapters/_sync/redis.py`` from this file. Import the
public names from :mod:`fence.adapters.redis`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import redis.asyncio
import redis.asyncio.cluster
from redis.exceptions import NoScriptError, RedisError, ResponseError

from fence import (
    BackendError,
    ConfigurationError,
    EventBus,
    EventKind,
    FenceError,
    RetryableError,
    StaleTokenError,
    default_bus,
    validate_token,
)
from fence._async.sentinel import SentinelClients, sentinel_clients
from fence._lua import Script
from fence._redis_conn import closed_connection
from fence._redis_keys import FenceScope, KeyLayout
from fence._sentinel import is_sentinel_url, parse_sentinel_url

from .._redis_lua import MANY, READ, WRITE
from .._redis_ops import (
    REPEATABLE,
    Op,
    Queued,
    command,
    encode,
    many_part,
    op_claim,
    op_delete,
    op_hset,
    op_incr,
    op_read,
    op_rpush,
    op_set,
    op_xadd,
    pipeline_calls,
    pipeline_replies,
)
from .._redis_replies import (
    decode,
    pairs,
    parse_fence,
    pipeline_outcome,
    read_error,
    translate,
)
from .._redis_wire import (
    RAISE_UNLISTED,
    Wire,
    client_encoding,
    refuse_pipeline,
    takes_command_name,
)

__all__ = ["AsyncFencedPipeline", "AsyncRedisBatch", "AsyncRedisGuard"]

AsyncRedisClient = redis.asyncio.Redis | redis.asyncio.cluster.RedisCluster

_SOURCE = "redis-guard"


class AsyncRedisGuard:
    """Fenced writes to Redis keys: a write whose token is older than the fence changes
    nothing and raises :class:`fence.StaleTokenError` (C4, C5).

    Each write is one ``EVALSHA`` of one Lua script, one round trip: the script reads the
    fence, compares, and applies the write together with the new fence, atomically. A
    delete keeps the fence as a tombstone (C7). Batches are all or nothing (C6).

    Fence scope: with ``scope="key"`` (the default) every data key has its own fence; with
    ``scope="resource"`` all keys of a resource share one register, ``fence:{R}:fence``,
    where ``R`` is the key's hash tag (or the whole key when it has none), the register a
    lock manager's forced revocation raises. Use the resource scope when the keys of ``R``
    are updated together under one lock; there every data key must carry the hash tag.

    Every path is fenced or refused before any I/O (C9): a key in the fence namespace
    (every key starting with ``prefix``, where fences and lock state live) is refused, and
    so is an untagged data key in the resource scope; an operation Redis would refuse on
    the data raises :class:`WriteRefusedError` with nothing written. Raw commands on the
    guard's keys, from any client, are not fenced: use the ACL users of :func:`acl_rules`.

    **Write-only fencing leaves a hole; claim or read-for-update closes it (C8).** Fencing
    only the writes does not stop a lost update in a read-modify-write cycle::

        t=0  A acquires "acct:1" -> token 33, pauses (GC) before writing
        t=1  A's lease ends; B acquires -> token 34
        t=2  B reads balance = 100                    (plain read: the fence stays 0)
        t=3  A wakes, writes 100 - 30 = 70 with 33    -> ACCEPTED (33 >= fence 0)
        t=4  B writes 100 + 50 = 150 with 34          -> accepted; A's debit is lost

    With ``await guard.claim("acct:1", 34)`` right after acquiring, or with
    ``await guard.read_for_update("acct:1", token=34)`` instead of the plain read at
    t=2, the fence is 34 before B reads, and A's write at t=3 is refused as ``STALE``.

    Args:
        client: a ``redis.asyncio.Redis`` or ``redis.asyncio.cluster.RedisCluster``. The
            guard does not close it unless it came from :meth:`from_url`.
        scope: ``"key"`` or ``"resource"`` (a :class:`FenceScope`).
        prefix: the prefix of the fence keys; the same as the lock manager's. Every key
            that starts with it is reserved: the guard refuses it as a data key.
        check_issuer: also refuse tokens above the resource's issued counter
            ``fence:{R}:token``, kept by a lock manager on the same Redis. It catches
            forged or corrupted tokens, tokens from another cluster or environment and a
            counter that went back. Leave it off when the manager lives elsewhere.
        events: where to report accepted and rejected writes (default:
            :data:`fence.default_bus`).

    Raises:
        ConfigurationError: an empty prefix, a prefix with braces or an unknown scope; a
            pipeline or a transaction (``client.pipeline()``) as the client, whose queued
            commands would hide every verdict: use :meth:`pipeline` or :meth:`batch`.

    Example::

        guard = AsyncRedisGuard(redis.asyncio.Redis(), scope="resource")
        async with manager.lock("order:42") as lease:
            await guard.claim("order:42", lease.token)
            status = await guard.read_for_update("{order:42}:status", token=lease.token)
            await guard.set("{order:42}:status", "paid", token=lease.token)
    """

    def __init__(
        self,
        client: AsyncRedisClient,
        *,
        scope: FenceScope | str = FenceScope.KEY,
        prefix: str = "fence:",
        check_issuer: bool = False,
        events: EventBus | None = None,
    ) -> None:
        refuse_pipeline(client, type(self).__name__)
        self.client = client
        cluster = isinstance(client, redis.asyncio.cluster.RedisCluster)
        encoding, errors = client_encoding(client)
        self.layout = KeyLayout(prefix, scope, cluster=cluster, encoding=encoding, errors=errors)
        self.check_issuer = bool(check_issuer)
        self.events = events or default_bus
        self._owns_client = False
        self._sentinel: SentinelClients | None = None
        self._wire = Wire(client)

    @classmethod
    def from_url(cls, url: str, **options: Any) -> AsyncRedisGuard:
        """Build a guard with its own client for ``url``; :meth:`close` closes it.

        Args:
            url: a ``redis://`` or ``rediss://`` URL, or
                ``redis+sentinel://host1:26379,host2:26379/mymaster/0`` for the primary
                that Redis Sentinel names (after a failover, the new one; see
                ``docs/redis-guard.md``).
            **options: keyword arguments of :class:`AsyncRedisGuard`.

        Raises:
            ConfigurationError: a Sentinel URL that cannot be read.
        """
        if is_sentinel_url(url):
            clients = sentinel_clients(parse_sentinel_url(url))
            guard = cls(clients.master, **options)
            guard._sentinel = clients
        else:
            guard = cls(redis.asyncio.Redis.from_url(url), **options)
        guard._owns_client = True
        return guard

    @property
    def scope(self) -> FenceScope:
        """The fence scope: per key or per resource."""
        return self.layout.scope

    def __repr__(self) -> str:
        return f"<{type(self).__name__} scope={self.scope} prefix={self.layout.prefix!r}>"

    async def close(self) -> None:
        """Close the client if this guard created it (:meth:`from_url`)."""
        if self._owns_client:
            self._owns_client = False
            if self._sentinel is not None:
                await self._sentinel.close()
            else:
                await self.client.aclose()

    async def __aenter__(self) -> AsyncRedisGuard:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- fenced writes ------------------------------------------------------------------

    async def set(
        self,
        key: str,
        value: Any,
        *,
        token: int,
        ttl: float | None = None,
        must_exist: bool = False,
    ) -> None:
        """Set ``key`` to ``value`` if ``token`` passes the fence (C4).

        Args:
            key: the data key.
            value: anything redis-py encodes (``str``, ``bytes``, ``int``, ``float``).
            token: the fencing token of the caller's lease.
            ttl: seconds until the *value* expires; the fence never does.
            must_exist: update semantics: reject with ``MISSING`` if ``key`` is absent.

        Raises:
            InvalidTokenError: a bad token, before any I/O.
            InvalidResourceError: a key in the fence namespace, or without a hash tag in
                the resource scope, before any I/O.
            ConfigurationError: a ttl below 1 ms or above :data:`MAX_TTL_MS`, before any I/O.
            StaleTokenError: ``STALE`` (older than the fence), ``MISSING`` (with
                ``must_exist``), nothing written.
            WriteRefusedError: Redis would refuse the operation on the data it found (a
                wrong type, not an integer, ...); nothing written.
            BackendError: Redis failed (``code="CONNECTION"``, ``retryable=True`` for a lost
                connection; ``OOM``, ``READONLY``, ... when the server's state refused the
                write, nothing written); :class:`fence.RetryableError` on a timeout;
                :class:`PartialWriteError` if a write failed after part of it landed.
        """
        await self._one(token, op_set(key, value, ttl, must_exist))

    async def hset(
        self, key: str, mapping: Mapping[Any, Any], *, token: int, must_exist: bool = False
    ) -> int:
        """Set the hash fields in ``mapping`` if ``token`` passes the fence.

        Args:
            key: the hash key.
            mapping: field -> value.
            token: the fencing token.
            must_exist: reject with ``MISSING`` if the hash does not exist.

        Returns:
            The number of fields added (as ``HSET``).

        It raises what :meth:`set` raises.
        """
        return int(await self._one(token, op_hset(key, mapping, must_exist)))

    async def delete(self, key: str, *, token: int) -> bool:
        """Delete ``key`` and keep its fence as a tombstone (C7).

        A stale writer cannot bring the key back: the fence stays at ``token``.

        Returns:
            Whether the key existed.

        It raises what :meth:`set` raises (never ``MISSING``: deleting nothing still fences).
        """
        results = await self._write(token, (op_delete(key),))
        return bool(results[0])

    async def incr(self, key: str, amount: int = 1, *, token: int, must_exist: bool = False) -> int:
        """Add ``amount`` to the integer at ``key`` (``INCRBY``) if ``token`` passes.

        Returns:
            The new value.

        Raises:
            ConfigurationError: ``amount`` is not an int of signed 64 bits, before any I/O.
            WriteRefusedError: the value is no 64-bit integer as Redis reads it (e.g.
                ``"007"``), or the sum would overflow; nothing written.

        Otherwise it raises what :meth:`set` raises.
        """
        results = await self._write(token, (op_incr(key, amount, must_exist),))
        return int(results[0])

    async def rpush(self, key: str, *values: Any, token: int, must_exist: bool = False) -> int:
        """Append ``values`` to the list at ``key`` if ``token`` passes.

        Returns:
            The length of the list.

        It raises what :meth:`set` raises.
        """
        results = await self._write(token, (op_rpush(key, values, must_exist),))
        return int(results[0])

    async def xadd(
        self,
        key: str,
        fields: Mapping[Any, Any],
        *,
        token: int,
        id: str = "*",
        maxlen: int | None = None,
        must_exist: bool = False,
    ) -> Any:
        """Append an entry to the stream at ``key`` if ``token`` passes.

        Args:
            key: the stream key.
            fields: field -> value of the entry.
            token: the fencing token.
            id: the entry id: ``*`` (let Redis choose), ``<ms>-<seq>``, ``<ms>-*`` or
                ``<ms>``.
            maxlen: trim the stream to about this many entries (``MAXLEN ~``).
            must_exist: reject with ``MISSING`` if the stream does not exist.

        Returns:
            The entry id.

        Raises:
            ConfigurationError: a malformed id or ``0-0``, a ``maxlen`` outside
                ``0..2**63-1``, or more than :data:`MAX_XADD_FIELDS` fields, before any I/O.
            WriteRefusedError: the id is at or below the stream's last id (``STREAM_ID``),
                or the stream has no id left; nothing written.

        Otherwise it raises what :meth:`set` raises.
        """
        results = await self._write(token, (op_xadd(key, fields, id, maxlen, must_exist),))
        return results[0]

    # -- claim and reads (C8) ---------------------------------------------------------------

    async def claim(self, scope: str, token: int) -> int:
        """Raise the fence of ``scope`` to ``token`` without writing data (C8).

        Call it right after acquiring, before reading: every older token is refused from
        then on, on this key (``scope="key"``) or on every key of the resource
        (``scope="resource"``; ``scope`` may then be the resource name or any of its keys).

        Returns:
            The fence, now ``token``.

        Raises:
            StaleTokenError: the fence is already above ``token`` (``STALE``).
            InvalidTokenError: a bad token, before any I/O.
            BackendError: Redis failed.
        """
        await self._write(token, (op_claim(scope),))
        return token

    async def fence(self, scope: str) -> int | None:
        """The fence of ``scope``, or ``None`` if nothing was ever fenced there.

        Raises:
            StaleTokenError: ``UNVERIFIABLE``, the fence key holds no integer (or is of
                another type).
            BackendError: Redis failed.
        """
        fence_key = self.layout.wire_keys(scope, data=False)[0]
        try:
            raw = await self.client.get(fence_key)
        except RedisError as err:
            if not closed_connection(err):  # a read is always safe to send again
                raise read_error(err, scope) from err
            try:
                raw = await self.client.get(fence_key)
            except RedisError as again:
                raise read_error(again, scope) from again
        return parse_fence(scope, raw)

    async def read_for_update(self, key: str, *, token: int) -> Any:
        """A registering read: raise the fence to ``token`` and return the value (C8).

        Use it for read-modify-write: a stale holder cannot write between this read and
        the caller's write, and a stale reader is refused.

        Returns:
            The string value, or ``None`` if ``key`` does not exist.

        Raises:
            StaleTokenError: the fence is above ``token`` (``STALE``).
            InvalidTokenError, BackendError: as for :meth:`set`.
        """
        results = await self._write(token, (op_read(key, "get"),))
        return results[0]

    async def hgetall_for_update(self, key: str, *, token: int) -> dict[Any, Any]:
        """The registering read of a hash: raise the fence and return all its fields.

        It raises what :meth:`read_for_update` raises.
        """
        results = await self._write(token, (op_read(key, "hgetall"),))
        return pairs(results[0])

    async def get(self, key: str) -> tuple[Any, int | None]:
        """Read the string at ``key`` together with its fence, in one atomic step.

        A plain read: it does not raise the fence. Use :meth:`read_for_update` to read
        for a write.

        Returns:
            ``(value, fence)``: the value or ``None``, the fence or ``None``.
        """
        fence, value = await self._read(key, "get")
        return value, fence

    async def hgetall(self, key: str) -> tuple[dict[Any, Any], int | None]:
        """Read the hash at ``key`` together with its fence, in one atomic step.

        Returns:
            ``(fields, fence)``; ``fields`` is empty if the hash does not exist.
        """
        fence, value = await self._read(key, "hgetall")
        return pairs(value), fence

    # -- batches and pipelines -----------------------------------------------------------

    def batch(self, token: int) -> AsyncRedisBatch:
        """Start an all-or-nothing batch of writes with one token (C6).

        Every fence, and every operation, is checked before the first write; if any key is
        rejected, nothing is written and the error lists every rejected key. The keys must
        belong to one resource (one hash tag), or :class:`CrossSlotError` is raised before
        any I/O.

        Example::

            results = await (
                guard.batch(lease.token)
                .set("{order:42}:status", "paid")
                .incr("{order:42}:total", 30)
                .execute()
            )

        Raises:
            InvalidTokenError: a bad token (here, before any operation is added).
        """
        return AsyncRedisBatch(self, validate_token(token))

    def pipeline(self) -> AsyncFencedPipeline:
        """Queue independent fenced writes (each with its own token) for one round trip.

        Unlike a batch, each write stands alone: :meth:`AsyncFencedPipeline.execute`
        returns one result per write, a :class:`fence.StaleTokenError` object in place of
        a rejected write's result.
        """
        return AsyncFencedPipeline(self)

    # -- internals ---------------------------------------------------------------------

    async def _one(self, token: int, op: Op) -> Any:
        """One write by the leanest script that does it (:func:`command`); its result."""
        token = validate_token(token)
        script, keys, argv = command(self.layout, token, op, issuer=self.check_issuer)
        repeat = op.code in REPEATABLE
        try:  # _eval, inlined: one coroutine less on the path of every write
            reply = await self._call(script, keys, argv, repeat)
        except RedisError as err:
            reply = await self._recover(err, script, keys, argv, op.key, repeat)
        if isinstance(reply, int):  # the bare number of a write that landed
            result: Any = reply
        else:
            outcome = decode(token, (op,), reply)
            if isinstance(outcome, FenceError):
                if self.events.active and isinstance(outcome, StaleTokenError):
                    self.events.emit(
                        EventKind.WRITE_REJECTED, _SOURCE, op.key, token, reason=outcome.reason
                    )
                raise outcome
            result = outcome[0]
        if self.events.active:
            self.events.emit(EventKind.WRITE_ACCEPTED, _SOURCE, op.key, token, op=op.code)
        return result

    async def _write(self, token: int, ops: Sequence[Op], *, one_slot: bool = False) -> list[Any]:
        token = validate_token(token)
        keys, argv = encode(self.layout, token, ops, issuer=self.check_issuer, one_slot=one_slot)
        repeat = all(op.code in REPEATABLE for op in ops)
        reply = await self._eval(WRITE, keys, argv, ops[0].key, repeat=repeat)
        outcome = decode(token, ops, reply)
        bus = self.events
        if isinstance(outcome, FenceError):
            if bus.active and isinstance(outcome, StaleTokenError):
                for err in outcome.rejected or (outcome,):
                    bus.emit(EventKind.WRITE_REJECTED, _SOURCE, err.scope, token, reason=err.reason)
            raise outcome
        if bus.active:
            for op in ops:
                bus.emit(EventKind.WRITE_ACCEPTED, _SOURCE, op.key, token, op=op.code)
        return outcome

    async def _read(self, key: str, kind: str) -> tuple[int | None, Any]:
        keys = list(self.layout.wire_keys(key))
        reply = await self._eval(READ, keys, [kind], key, repeat=True)
        return parse_fence(key, reply[0]), reply[1]

    async def _eval(
        self, script: Script, keys: list[bytes], argv: list[Any], what: str, *, repeat: bool
    ) -> Any:
        """One ``EVALSHA``; on a failure, :meth:`_recover`."""
        try:
            return await self._call(script, keys, argv, repeat)
        except RedisError as err:
            return await self._recover(err, script, keys, argv, what, repeat)

    async def _recover(
        self,
        err: RedisError,
        script: Script,
        keys: list[bytes],
        argv: list[Any],
        what: str,
        repeat: bool,
    ) -> Any:
        """After ``err`` failed an ``EVALSHA``: the reply of the call sent again, or the
        error translated into the :class:`fence.FenceError` family.

        On ``NOSCRIPT`` (a restart, ``SCRIPT FLUSH``) the script is loaded and the call sent
        once more. A call that is safe to repeat (``repeat``) is sent again, the whole
        sequence once more on a new connection, if the server had closed the connection
        under it (a restart, an idle timeout): redis-py 5 does not reconnect and resend by
        itself, and a client may be configured never to. Any other error is translated.
        """
        resent = loaded = False
        while True:
            try:
                if isinstance(err, NoScriptError):
                    if loaded:
                        raise RetryableError(
                            f"{what}: the {script.name} script vanished from the script cache"
                            " twice in a row (SCRIPT FLUSH or restarts); nothing was written,"
                            " retry",
                            code="NOSCRIPT",
                        ) from err
                    await self.client.script_load(script.source)
                    loaded = True
                elif not resent and repeat and closed_connection(err):
                    resent, loaded = True, False
                else:
                    raise translate(err, what) from err
                return await self._call(script, keys, argv, repeat)
            except RedisError as again:
                err = again

    def _call(self, script: Script, keys: list[bytes], argv: list[Any], repeat: bool) -> Any:
        """One ``EVALSHA`` (awaitable for the asyncio guard): packed by the guard and sent on
        a connection of the client's pool (:mod:`fence.adapters._redis_wire`), or through
        ``execute_command`` for a client kind that path does not cover. A call that is not
        safe to repeat (``repeat`` false: ``INCR``, ``RPUSH``, ``XADD``) is sent once on
        that path, whatever the client's retries (:func:`_round_trip`). Raises redis-py's
        errors as they come. (A plain function returning the call: one coroutine less on
        the path of every write.)"""
        client = self.client
        pool = self._wire.pool(client)
        if pool is None:
            # redis-py types execute_command on some client classes only.
            command: Any = client.execute_command
            return command("EVALSHA", script.sha, len(keys), *keys, *argv)
        return _round_trip(pool, self._wire.pack(((script, keys, argv),)), None, repeat)

    async def _call_all(
        self, calls: list[tuple[Script, list[Any], list[Any]]], repeat: bool
    ) -> list[Any]:
        """Several ``EVALSHA`` s in one round trip, as :meth:`_call`: one reply per call, an
        error reply as its exception object."""
        client = self.client
        pool = self._wire.pool(client)
        if pool is None:
            pipe = client.pipeline(transaction=False)
            for script, keys, argv in calls:
                pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *argv)
            replies: list[Any] = await pipe.execute(raise_on_error=False)
        else:
            replies = await _round_trip(pool, self._wire.pack(calls), len(calls), repeat)
        return replies


async def _round_trip(pool: Any, packed: list[Any], count: int | None, repeat: bool) -> Any:
    """Send ``packed`` on a connection of ``pool`` and read ``count`` replies, or with
    ``count=None`` the one reply of one command.

    The way redis-py's ``execute_command`` and its pipelines do it: the connection comes
    from the pool and goes back to it, disconnected first if the call failed on the
    connection. A call safe to repeat (``repeat``) follows the connection's own ``Retry``
    (sent again after a connection error or a timeout; redis-py before 6.0 only for the
    errors in its ``retry_on_error``). One that is not is sent once: redis-py's default
    client retries, and an ``INCR`` whose reply was lost would land twice; its error
    says the outcome is unknown.

    Returns:
        One reply per command, an error reply as its ``ResponseError`` object; with
        ``count=None`` the reply (an error reply raised).
    """
    named = takes_command_name(pool)
    conn = await (pool.get_connection("EVALSHA") if named else pool.get_connection())

    async def attempt() -> Any:
        await conn.send_packed_command(packed)
        if count is None:
            return await conn.read_response()
        replies: list[Any] = []
        for _ in range(count):
            try:
                replies.append(await conn.read_response())
            except ResponseError as err:
                replies.append(err)
        return replies

    async def failed(error: Exception) -> None:
        await conn.disconnect()
        if RAISE_UNLISTED and not isinstance(error, tuple(conn.retry_on_error or ())):
            raise error

    try:
        if repeat:
            return await conn.retry.call_with_retry(attempt, failed)
        try:
            return await attempt()
        except ResponseError:
            raise  # an error reply: the connection is fine
        except BaseException:
            await conn.disconnect()  # half read, or lost: never back to the pool as it is
            raise
    finally:
        await pool.release(conn)


class AsyncRedisBatch:
    """An all-or-nothing group of fenced writes with one token (C6).

    Build it with :meth:`AsyncRedisGuard.batch`, add operations (each method returns the
    batch, so calls chain), then ``await batch.execute()``. One Lua script checks every
    fence, then every operation as Redis would judge it (types, 64-bit integers, stream
    ids, sizes, the user's ACL) against the state before the batch as changed by its
    earlier operations; only then is every write applied, in order. An error Redis would
    raise while applying so never leaves half a batch behind.
    """

    def __init__(self, guard: AsyncRedisGuard, token: int) -> None:
        self.guard = guard
        self.token = token
        self.ops: list[Op] = []
        # Streams that got an automatic id in this batch (and were not replaced since). Only
        # str keys: any other key is refused by execute(), with every other key check.
        self._auto_ids: set[str] = set()

    def __len__(self) -> int:
        return len(self.ops)

    def set(
        self, key: str, value: Any, *, ttl: float | None = None, must_exist: bool = False
    ) -> AsyncRedisBatch:
        """Add a fenced set; see :meth:`AsyncRedisGuard.set`."""
        self.ops.append(op_set(key, value, ttl, must_exist))
        if self._auto_ids and isinstance(key, str):
            self._auto_ids.discard(key)
        return self

    def hset(
        self, key: str, mapping: Mapping[Any, Any], *, must_exist: bool = False
    ) -> AsyncRedisBatch:
        """Add a fenced hash-field set; see :meth:`AsyncRedisGuard.hset`."""
        self.ops.append(op_hset(key, mapping, must_exist))
        return self

    def delete(self, key: str) -> AsyncRedisBatch:
        """Add a fenced delete that leaves a tombstone; see :meth:`AsyncRedisGuard.delete`."""
        self.ops.append(op_delete(key))
        if self._auto_ids and isinstance(key, str):
            self._auto_ids.discard(key)
        return self

    def incr(self, key: str, amount: int = 1, *, must_exist: bool = False) -> AsyncRedisBatch:
        """Add a fenced increment; see :meth:`AsyncRedisGuard.incr`."""
        self.ops.append(op_incr(key, amount, must_exist))
        return self

    def rpush(self, key: str, *values: Any, must_exist: bool = False) -> AsyncRedisBatch:
        """Add a fenced list append; see :meth:`AsyncRedisGuard.rpush`."""
        self.ops.append(op_rpush(key, values, must_exist))
        return self

    def xadd(
        self,
        key: str,
        fields: Mapping[Any, Any],
        *,
        id: str = "*",
        maxlen: int | None = None,
        must_exist: bool = False,
    ) -> AsyncRedisBatch:
        """Add a fenced stream append; see :meth:`AsyncRedisGuard.xadd`.

        Raises:
            ConfigurationError: as :meth:`AsyncRedisGuard.xadd`; or an explicit id (not
                ``*``) after an automatic one on the same stream in this batch: the id the
                server picks from its clock cannot be predicted, so whether the explicit
                one lies above it cannot be checked before the first write.
        """
        op = op_xadd(key, fields, id, maxlen, must_exist)
        named = isinstance(key, str)
        if op.args[0] != "*" and named and key in self._auto_ids:
            raise ConfigurationError(
                f"xadd {key!r} id={id!r} follows an xadd with id='*' on the same stream in"
                " this batch: the id the server picks for '*' cannot be predicted, so this"
                " batch could fail halfway. Use '*' for both, explicit ids for both, or two"
                " batches."
            )
        if op.args[0] == "*" and named:
            self._auto_ids.add(key)
        self.ops.append(op)
        return self

    def claim(self, key: str) -> AsyncRedisBatch:
        """Add a claim of the fence of ``key``; see :meth:`AsyncRedisGuard.claim`."""
        self.ops.append(op_claim(key))
        return self

    async def execute(self) -> list[Any]:
        """Check every fence, then apply every write, atomically.

        Returns:
            The raw result of each operation, in order (``1`` for set and claim, counts
            for hset/delete/rpush, the new value for incr, the id for xadd).

        Raises:
            StaleTokenError: some keys were rejected; ``rejected`` has one error per
                rejected key, and nothing was written.
            WriteRefusedError: no token was rejected, but Redis would refuse some
                operations; ``refused`` lists each, and nothing was written.
            InvalidResourceError: a key in the fence namespace, or an untagged data key in
                the resource scope (before any I/O).
            CrossSlotError: the keys belong to several resources (before any I/O).
            PartialWriteError: an operation failed while applying after earlier ones
                landed, in a case the checks did not foresee (``code="PARTIAL"``).
            BackendError: Redis failed.
        """
        if not self.ops:
            return []
        return await self.guard._write(self.token, self.ops, one_slot=True)


class AsyncFencedPipeline:
    """Independent fenced writes sent in one round trip, with one result per write.

    Each write is its own ``EVALSHA`` with its own token; a rejection does not stop the
    others. Build it with :meth:`AsyncRedisGuard.pipeline`.

    Example::

        pipe = guard.pipeline()
        for key, value, token in updates:
            pipe.set(key, value, token=token)
        for outcome in await pipe.execute():
            if isinstance(outcome, StaleTokenError):
                ...
    """

    def __init__(self, guard: AsyncRedisGuard) -> None:
        self.guard = guard
        # Per write: its token, its operation, and the script, keys and argv that send it
        # (for MANY, the write's own part of a call).
        self._queued: list[Queued] = []

    def __len__(self) -> int:
        return len(self._queued)

    def _add(self, token: int, op: Op) -> AsyncFencedPipeline:
        # Validate and build now: a bad token or key is the caller's bug and costs no I/O.
        token = validate_token(token)
        guard = self.guard
        layout, issuer = guard.layout, guard.check_issuer
        part = None if layout.cluster else many_part(layout, token, op, issuer=issuer)
        if part is not None:
            self._queued.append((token, op, MANY, part[:2], part[2:]))
        else:
            self._queued.append((token, op, *command(layout, token, op, issuer=issuer)))
        return self

    def set(
        self,
        key: str,
        value: Any,
        *,
        token: int,
        ttl: float | None = None,
        must_exist: bool = False,
    ) -> AsyncFencedPipeline:
        """Queue a fenced set; see :meth:`AsyncRedisGuard.set`."""
        return self._add(token, op_set(key, value, ttl, must_exist))

    def hset(
        self, key: str, mapping: Mapping[Any, Any], *, token: int, must_exist: bool = False
    ) -> AsyncFencedPipeline:
        """Queue a fenced hash-field set; see :meth:`AsyncRedisGuard.hset`."""
        return self._add(token, op_hset(key, mapping, must_exist))

    def delete(self, key: str, *, token: int) -> AsyncFencedPipeline:
        """Queue a fenced delete; see :meth:`AsyncRedisGuard.delete`."""
        return self._add(token, op_delete(key))

    def incr(
        self, key: str, amount: int = 1, *, token: int, must_exist: bool = False
    ) -> AsyncFencedPipeline:
        """Queue a fenced increment; see :meth:`AsyncRedisGuard.incr`."""
        return self._add(token, op_incr(key, amount, must_exist))

    def rpush(
        self, key: str, *values: Any, token: int, must_exist: bool = False
    ) -> AsyncFencedPipeline:
        """Queue a fenced list append; see :meth:`AsyncRedisGuard.rpush`."""
        return self._add(token, op_rpush(key, values, must_exist))

    def claim(self, key: str, *, token: int) -> AsyncFencedPipeline:
        """Queue a claim; see :meth:`AsyncRedisGuard.claim`."""
        return self._add(token, op_claim(key))

    async def _send_repeatable(self, queued: list[Queued]) -> list[Any]:
        """:meth:`_send`, once more if the server closed the connection under it and every
        write is safe to repeat (see :meth:`AsyncRedisGuard._eval`)."""
        try:
            return await self._send(queued)
        except BackendError as err:
            if not closed_connection(err.__cause__ or err):
                raise
            if not all(entry[1].code in REPEATABLE for entry in queued):
                raise
        return await self._send(queued)

    async def execute(self) -> list[Any]:
        """Send every queued write in one round trip (two if the script must be loaded).

        Returns:
            One entry per write, in order: its result (as :meth:`AsyncRedisBatch.execute`)
            or the :class:`fence.FenceError` that rejected or failed it
            (:class:`fence.StaleTokenError` for a stale or missing write,
            :class:`WriteRefusedError` for one Redis would refuse on the data).

        Raises:
            BackendError: the connection failed; which writes were applied is unknown.
        """
        queued, self._queued = self._queued, []
        guard = self.guard
        replies = await self._send_repeatable(queued)
        missing = [i for i, reply in enumerate(replies) if isinstance(reply, NoScriptError)]
        if missing:
            # A restart or SCRIPT FLUSH: those writes did not run. Load and send them again.
            try:
                for script in {queued[i][2] for i in missing}:
                    await guard.client.script_load(script.source)
            except RedisError as err:
                raise translate(err, "fenced pipeline") from err
            again = await self._send([queued[i] for i in missing])
            for i, reply in zip(missing, again, strict=True):
                replies[i] = reply
        bus = guard.events
        out: list[Any] = []
        for (token, op, *_), reply in zip(queued, replies, strict=True):
            # The bare number of a write that landed needs no reading.
            outcome = reply if isinstance(reply, int) else pipeline_outcome(token, op, reply)
            if isinstance(outcome, FenceError):
                if bus.active and isinstance(outcome, StaleTokenError):
                    bus.emit(
                        EventKind.WRITE_REJECTED, _SOURCE, op.key, token, reason=outcome.reason
                    )
            elif bus.active:
                bus.emit(EventKind.WRITE_ACCEPTED, _SOURCE, op.key, token, op=op.code)
            out.append(outcome)
        return out

    async def _send(self, queued: list[Queued]) -> list[Any]:
        """One round trip; a run of plain sets and hsets goes as one :data:`MANY` call.

        Returns one reply per queued write (an error object for a call that failed).
        """
        calls, runs = pipeline_calls(queued)
        try:
            repeat = all(entry[1].code in REPEATABLE for entry in queued)
            replies = await self.guard._call_all(calls, repeat)
        except RedisError as err:
            raise translate(err, "fenced pipeline") from err
        return pipeline_replies(runs, replies)
