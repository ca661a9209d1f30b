"""The Redis lock manager for asyncio: one Lua script per call, waiters woken by ``BLPOP``.

The scripts and the key layout are in :mod:`fence._redis_scripts`; the deadlines,
reentrancy, waiting loop and renewal watchdog in :mod:`fence._async.manager`.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import redis  # unasync: import redis.asyncio
import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import (
    ClusterDownError,
    NoPermissionError,
    NoScriptError,
    ReadOnlyError,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from fence._acompat import sleep
from fence._async.manager import AsyncBaseLockManager
from fence._clock import Clock
from fence._core import TokenMode, client_deadline, validate_ttl
from fence._errors import BackendError, ConfigurationError, FenceWarning, InvalidTokenError
from fence._events import EventBus
from fence._redis_conn import closed_connection
from fence._redis_scripts import (
    ABANDON,
    ACQUIRE,
    DEFAULT_PREFIX,
    ENQUEUE,
    INSPECT,
    RELEASE,
    RENEW,
    REVOKE,
    ResourceKeys,
    config_warnings,
    milliseconds,
    resource_keys,
    validate_prefix,
    waiter_id,
)
from fence.abc import AcquireReply, LockInfo

__all__ = ["AsyncRedisDriver", "AsyncRedisLockManager"]

#: Longest single ``BLPOP``. The manager re-attempts after it, so it bounds what a wake-up
#: lost to a crashed or cancelled waiter can cost.
_BLOCK_CAP = 5.0

#: Whether this module drives asyncio clients; a client of the other flavour is refused.
_ASYNC = True  # unasync: _ASYNC = False
_FLAVOUR = "redis.asyncio.Redis or redis.asyncio.RedisCluster"

AsyncClient = redis.asyncio.Redis | redis.asyncio.RedisCluster


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _socket_timeout(client: object) -> float | None:
    """The read timeout a redis-py client was built with, if it can be found."""
    for path in (("connection_pool", "connection_kwargs"), ("nodes_manager", "connection_kwargs")):
        found: Any = client
        for name in path:
            found = getattr(found, name, None)
        if isinstance(found, dict) and found.get("socket_timeout") is not None:
            return float(found["socket_timeout"])
    return None


class AsyncRedisDriver:
    """Moves the bytes of :class:`AsyncRedisLockManager`: one round trip per call.

    Args:
        client: a URL (``redis://...``), a ``redis.asyncio.Redis`` or a
            ``redis.asyncio.RedisCluster``. From a URL the driver builds (and closes) its own
            clients, with ``socket_timeout`` and no silent retries; a client given is never
            closed.
        prefix: the key prefix; must match the Redis guard's. No braces.
        token_mode: :attr:`TokenMode.HYBRID` (default) or :attr:`TokenMode.COUNTER`.
        fifo: serve waiters in arrival order, waking only the next one.
        queue_ttl: how long a FIFO waiter keeps its place without a heartbeat, in seconds.
        min_replicas: replicas that must acknowledge an acquire (``WAIT``) before its token
            is handed out; 0 disables.
        replica_timeout: how long ``WAIT`` may take, in seconds.
        wait_aof: also require the acquire to be fsynced to the AOF (``WAITAOF``, Redis 7.2+).
        socket_timeout: read and connect timeout of the clients built from a URL.
        cluster: build a ``RedisCluster`` from the URL.
        check_config: on first use, warn about server settings that can lose tokens.

    Raises:
        ConfigurationError: a bad argument, or a client of the wrong flavour.
    """

    source = "redis"

    def __init__(
        self,
        client: str | AsyncClient,
        *,
        prefix: str = DEFAULT_PREFIX,
        token_mode: TokenMode = TokenMode.HYBRID,
        fifo: bool = False,
        queue_ttl: float = 3.0,
        min_replicas: int = 0,
        replica_timeout: float = 1.0,
        wait_aof: bool = False,
        socket_timeout: float = 5.0,
        cluster: bool = False,
        check_config: bool = True,
    ) -> None:
        self.prefix = validate_prefix(prefix)
        self.token_mode = TokenMode(token_mode)
        self.fifo = bool(fifo)
        self.queue_ttl = validate_ttl(queue_ttl, what="queue_ttl")
        if isinstance(min_replicas, bool) or not isinstance(min_replicas, int) or min_replicas < 0:
            raise ConfigurationError(f"min_replicas must be an int >= 0, got {min_replicas!r}")
        self.min_replicas = min_replicas
        self.replica_timeout = validate_ttl(replica_timeout, what="replica_timeout")
        self.wait_aof = bool(wait_aof)
        socket_timeout = validate_ttl(socket_timeout, what="socket_timeout")
        self.check_config = check_config
        self._checked = not check_config
        self._appendonly: bool | None = None
        if isinstance(client, str):
            self._owned = True
            self.client: Any = self._connect(client, socket_timeout, cluster)
            # Waits block up to _BLOCK_CAP: their reads get that much more time.
            self._waits: Any = self._connect(client, socket_timeout + _BLOCK_CAP, cluster)
            self._where = client.rsplit("@", 1)[-1]
        elif not hasattr(client, "register_script") or (
            inspect.iscoroutinefunction(getattr(client, "execute_command", None)) is not _ASYNC
        ):
            raise ConfigurationError(
                f"{type(self).__name__} needs a Redis URL or a {_FLAVOUR} client, "
                f"got {type(client).__name__}"
            )
        else:
            self._owned = False
            self.client = self._waits = client
            self._where = repr(client)
        self.is_cluster = isinstance(self.client, redis.asyncio.RedisCluster)
        if self.min_replicas and self.is_cluster:
            raise ConfigurationError(
                "min_replicas is not supported on Redis Cluster: WAIT must follow the write on "
                "the same connection to the slot's primary"
            )
        if self.wait_aof and not self.min_replicas:
            raise ConfigurationError("wait_aof needs min_replicas >= 1")
        timeout = _socket_timeout(self._waits)
        cap = _BLOCK_CAP if timeout is None else min(_BLOCK_CAP, timeout * 0.75)
        if self.fifo:
            # A FIFO waiter's attempts are its heartbeat: it must try again well inside
            # queue_ttl, or it loses its place.
            cap = min(cap, self.queue_ttl / 3)
        self._block_cap = cap
        self._mode = self.token_mode.value
        self._mode_bytes = self._mode.encode()
        self._queue_ms = milliseconds(self.queue_ttl)
        client_ = self.client
        self._acquire = client_.register_script(ACQUIRE)
        self._renew = client_.register_script(RENEW)
        self._release = client_.register_script(RELEASE)
        self._enqueue = client_.register_script(ENQUEUE)
        self._abandon = client_.register_script(ABANDON)
        self._inspect = client_.register_script(INSPECT)
        self._revoke = client_.register_script(REVOKE)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._where} prefix={self.prefix!r}>"

    @staticmethod
    def _connect(url: str, socket_timeout: float, cluster: bool) -> Any:
        # No retries inside redis-py: a retried release that already ran would report
        # "not held", and the renewal watchdog does its own retrying within the ttl.
        options: dict[str, Any] = {
            "socket_timeout": socket_timeout,
            "socket_connect_timeout": socket_timeout,
            "retry": Retry(NoBackoff(), 0),
        }
        try:
            if cluster:
                return redis.asyncio.RedisCluster.from_url(url, **options)
            return redis.asyncio.Redis.from_url(url, **options)
        except ValueError as exc:
            raise ConfigurationError(f"not a usable Redis URL: {url!r} ({exc})") from exc

    def keys(self, resource: str) -> ResourceKeys:
        """The keys of ``resource`` (see :func:`fence._redis_scripts.resource_keys`)."""
        return resource_keys(self.prefix, resource)

    # -- errors --------------------------------------------------------------------------

    def _error(self, exc: BaseException, what: str) -> Exception:
        if isinstance(exc, RedisConnectionError | RedisTimeoutError | OSError):
            return BackendError(
                f"Redis at {self._where} did not answer the {what} ({exc}); the lock state "
                "is unknown until it does, and the call may be retried",
                code="CONNECTION",
                retryable=True,
            )
        if isinstance(exc, ClusterDownError | TryAgainError | ReadOnlyError):
            return BackendError(
                f"Redis at {self._where} cannot serve the {what} right now ({exc}); "
                "retry after the failover or resharding",
                code="UNAVAILABLE",
                retryable=True,
            )
        if isinstance(exc, NoPermissionError):
            return BackendError(
                f"Redis at {self._where} refused the {what}: {exc}. The lock manager needs "
                "EVALSHA, SCRIPT LOAD and BLPOP on the keys under its prefix",
                code="PERMISSION",
            )
        if isinstance(exc, ResponseError) and "token space exhausted" in str(exc):
            return InvalidTokenError(f"cannot issue a token: {exc}")
        return BackendError(
            f"Redis at {self._where} failed the {what}: {exc}", code="RESPONSE", retryable=False
        )

    async def _run(
        self, script: Any, keys: list[str], args: list[Any], what: str, *, repeat: bool = True
    ) -> Any:
        # EVALSHA straight through execute_command: the hot path is one round trip, and
        # a server that lost its script cache (restart, failover, SCRIPT FLUSH) gets the
        # script loaded again and the call repeated, never reported as a verdict.
        try:
            try:
                return await self._evalsha(script, keys, args)
            except RedisConnectionError as exc:
                if not (repeat and closed_connection(exc)):
                    raise
            # The server closed the pooled connection under the call (a restart, an idle
            # timeout): redis-py 5, and a client without retries, do not send it again.
            # Every script here may run twice with the same arguments: acquire is reentrant
            # by secret, renew and inspect change nothing more, abandon and enqueue keep one
            # place, revoke issues one more token; a release whose first run's reply was
            # lost in a crash finds the lock free and reports it not held.
            return await self._evalsha(script, keys, args)
        except (RedisError, OSError) as exc:
            raise self._error(exc, what) from exc

    async def _evalsha(self, script: Any, keys: list[str], args: list[Any]) -> Any:
        client = self.client
        try:
            return await client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
        except NoScriptError:
            await client.script_load(script.script)
            return await client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)

    # -- the driver protocol -------------------------------------------------------------

    async def acquire(self, resource: str, secret: str, ttl: float, holder: str) -> AcquireReply:
        """One attempt: take the lock if free, issuing a token; see
        :meth:`fence.abc.AsyncDriver.acquire`."""
        if not self._checked:
            await self._check_config()
        keys = self.keys(resource)
        script_keys = [keys.lock, keys.token]
        # Numbers and fixed words as bytes: redis-py encodes every str and int it is given.
        args: list[Any] = [secret, b"%d" % milliseconds(ttl), holder, self._mode_bytes]
        wid = ""
        if self.fifo:
            wid = waiter_id(secret)
            script_keys += [keys.queue, keys.deadlines]
            args += [wid, self._queue_ms]
        if self.min_replicas:
            reply = await self._acquire_replicated(resource, script_keys, args)
        else:
            reply = await self._run(self._acquire, script_keys, args, "acquire")
        if not isinstance(reply, list):  # granted: the bare token
            return AcquireReply(int(reply))
        wait_ms, queued = int(reply[1]), int(reply[2])
        # PTTL is truncated to whole ms: add one so the wait does not end just before expiry.
        holder_ttl = (wait_ms + 1) / 1000 if wait_ms >= 0 else None
        return AcquireReply(None, holder_ttl, (wid, bool(queued)))

    async def _acquire_replicated(
        self, resource: str, script_keys: list[str], args: list[Any]
    ) -> Any:
        # WAIT counts the writes of its own connection: a pipeline sends both on one.
        timeout_ms = milliseconds(self.replica_timeout)
        try:
            async with self.client.pipeline(transaction=False) as pipe:
                pipe.eval(ACQUIRE, len(script_keys), *script_keys, *args)
                pipe.execute_command("WAIT", self.min_replicas, timeout_ms)
                if self.wait_aof:
                    local = 1 if self._appendonly else 0
                    pipe.execute_command("WAITAOF", local, self.min_replicas, timeout_ms)
                results = await pipe.execute(raise_on_error=False)
        except (RedisError, OSError) as exc:
            raise self._error(exc, "acquire") from exc
        reply = results[0]
        if isinstance(reply, Exception):
            raise self._error(reply, "acquire") from reply
        if isinstance(reply, list):  # not granted: nothing to wait for
            return reply
        problem: Exception | None = None
        aof = results[2] if self.wait_aof else None
        if isinstance(aof, ResponseError) and "unknown command" in str(aof).lower():
            problem = ConfigurationError(
                f"wait_aof needs Redis 7.2 or later (WAITAOF); {self._where} has no WAITAOF"
            )
        elif isinstance(results[1], Exception):
            problem = self._error(results[1], "WAIT")
        elif int(results[1]) < self.min_replicas:
            problem = BackendError(
                f"only {int(results[1])} of {self.min_replicas} replicas acknowledged the "
                f"acquire within {self.replica_timeout}s; the lock was released and its token "
                "not handed out (a failover could have lost it)",
                code="REPLICATION",
                retryable=True,
            )
        elif isinstance(aof, Exception):
            problem = self._error(aof, "WAITAOF")
        elif aof is not None and (
            int(aof[1]) < self.min_replicas or (self._appendonly and int(aof[0]) < 1)
        ):
            problem = BackendError(
                f"the acquire was not fsynced to the AOF of {self.min_replicas} replicas "
                f"within {self.replica_timeout}s; the lock was released and its token "
                "not handed out",
                code="REPLICATION",
                retryable=True,
            )
        if problem is None:
            return reply
        await self.release(resource, args[0])
        raise problem

    async def renew(self, resource: str, secret: str, ttl: float) -> bool:
        """See :meth:`fence.abc.AsyncDriver.renew`."""
        lock = self.keys(resource).lock
        return bool(await self._run(self._renew, [lock], [secret, milliseconds(ttl)], "renewal"))

    async def release(self, resource: str, secret: str) -> bool:
        """Delete the lock if ``secret`` holds it and wake one waiter; see
        :meth:`fence.abc.AsyncDriver.release`."""
        keys = self.keys(resource)
        if self.fifo:
            script_keys = [keys.lock, keys.signal, keys.queue, keys.deadlines]
            args = [secret, keys.wake_prefix]
        else:
            script_keys, args = [keys.lock, keys.signal], [secret]
        return bool(await self._run(self._release, script_keys, args, "release"))

    async def wait(self, resource: str, timeout: float, reply: AcquireReply) -> None:
        """Block on the resource's signal list (or, FIFO, the waiter's own list) until a
        release pushes to it, or ``timeout`` seconds pass (at most a few seconds)."""
        keys = self.keys(resource)
        wid, queued = reply.cookie if isinstance(reply.cookie, tuple) else ("", False)
        if self.fifo:
            if not queued:
                go = await self._run(
                    self._enqueue,
                    [keys.lock, keys.queue, keys.deadlines],
                    [wid, self._queue_ms],
                    "enqueue",
                )
                if go:
                    return
            key = keys.wake_prefix + wid
        else:
            key = keys.signal
        blocking_ms = int(min(timeout, self._block_cap) * 1000)
        if blocking_ms < 1:
            return  # BLPOP 0 would block forever
        try:
            await self._waits.execute_command("BLPOP", key, f"{blocking_ms / 1000:.3f}")
        except (RedisError, OSError) as exc:
            error = self._error(exc, "wait")
            if not isinstance(error, BackendError) or not error.retryable:
                raise error from exc
            # The next attempt reports a real outage; do not spin against a flapping one.
            await sleep(min(0.05, blocking_ms / 1000))

    async def abandon(self, resource: str, secret: str) -> None:
        """A waiter gave up: drop it from the FIFO queue and, if the lock is free, wake the
        next waiter in its place."""
        keys = self.keys(resource)
        script_keys = [keys.lock, keys.signal, keys.queue, keys.deadlines]
        args = [waiter_id(secret)]
        if self.fifo:
            args.append(keys.wake_prefix)
        await self._run(self._abandon, script_keys, args, "abandon")

    async def inspect(self, resource: str) -> LockInfo | None:
        """See :meth:`fence.abc.AsyncDriver.inspect`."""
        got = await self._run(self._inspect, [self.keys(resource).lock], [], "inspect")
        if not got:
            return None
        token, pttl, holder = got
        return LockInfo(resource, int(token), max(int(pttl), 0) / 1000, _text(holder) or None)

    async def revoke(self, resource: str) -> int:
        """End the lease, issue a token above every earlier one and raise the guards'
        fence register ``<prefix>{R}:fence`` to it; see :meth:`fence.abc.AsyncDriver.revoke`."""
        if not self._checked:
            await self._check_config()
        keys = self.keys(resource)
        args = [self._mode, keys.wake_prefix] if self.fifo else [self._mode]
        token = await self._run(
            self._revoke,
            [keys.lock, keys.token, keys.fence, keys.signal, keys.queue, keys.deadlines],
            args,
            "revoke",
        )
        return int(token)

    async def close(self) -> None:
        """Close the clients built from a URL; a client given is left open."""
        if self._owned:
            self._owned = False
            await self.client.aclose()
            await self._waits.aclose()

    # -- server settings -----------------------------------------------------------------

    async def _check_config(self) -> None:
        """Warn once about settings that can lose tokens or fences (C3, C12).

        Managed services often disable ``CONFIG``; then nothing is checked or said.
        """
        self._checked = True
        settings: dict[str, str] = {}
        for name in ("maxmemory-policy", "appendonly", "appendfsync", "save"):
            try:
                got = await self.client.config_get(name)
            except ResponseError:
                return
            except (RedisError, OSError) as exc:
                self._checked = False
                raise self._error(exc, "CONFIG GET") from exc
            settings.update({_text(k): _text(v) for k, v in got.items()})
        self._appendonly = settings.get("appendonly") == "yes"
        for message in config_warnings(settings, self.token_mode):
            warnings.warn(f"Redis at {self._where}: {message}", FenceWarning, stacklevel=4)


class AsyncRedisLockManager(AsyncBaseLockManager):
    """A lock manager on Redis that issues fencing tokens (C2, C3, C10-C12).

    Acquire, renew and release are one Lua script each. Tokens are issued in the acquire
    script, from Redis ``TIME`` (hybrid, the default) or a plain counter. A blocking acquire
    sleeps in ``BLPOP`` and is woken by the release, or by the holder's expiry. All keys of
    a resource share the hash tag ``{resource}``, so Redis Cluster works.

    Args:
        client: a URL (``redis://host:6379/0``), a ``redis.asyncio.Redis`` or a
            ``redis.asyncio.RedisCluster``. The manager closes only clients it built.
        prefix: the key prefix; must match the Redis guard's. No braces.
        token_mode: :attr:`TokenMode.HYBRID` (default) survives a lost counter;
            :attr:`TokenMode.COUNTER` survives only what the AOF keeps. See
            ``docs/redis-manager.md``.
        fifo: serve waiters in arrival order, waking only the next one (no thundering
            herd). Every manager on a resource must agree on it.
        queue_ttl: how long a FIFO waiter that stopped trying keeps its place, in seconds.
        min_replicas: replicas that must acknowledge an acquire (``WAIT``) before its token
            is handed out; if fewer do, the lock is released and
            :class:`BackendError` raised. Not on Redis Cluster.
        replica_timeout: how long ``WAIT`` may take, in seconds.
        wait_aof: also wait for the AOF fsync (``WAITAOF``, Redis 7.2+).
        socket_timeout: read and connect timeout of clients built from a URL (default:
            ``ttl / 3``, at most 5 s), so that a renewal cannot hang past the lease.
        cluster: build a ``RedisCluster`` from the URL.
        check_config: on first use, read ``maxmemory-policy`` and the persistence settings
            and warn (:class:`fence.FenceWarning`) about any that can lose tokens or fences.
        ttl: default lease time in seconds.
        renew: default for the renewal watchdog.
        drift: fraction of the ttl the client gives up for clock rate differences (C10).
        margin: seconds the client gives up for the request's own latency (C10).
        clock: the monotonic clock for client deadlines.
        events: where to report events.
        reentrant: whether a second acquire by the same owner returns the held lease.

    Raises:
        ConfigurationError: a bad argument, or a sync client given to this manager.

    Example::

        manager = AsyncRedisLockManager("redis://127.0.0.1:6379/0", ttl=10, renew=True)
        async with manager.lock("order:42") as lease:
            await guard.claim("order:42", lease.token)
            ...
        await manager.close()
    """

    driver: AsyncRedisDriver

    def __init__(
        self,
        client: str | AsyncClient,
        *,
        prefix: str = DEFAULT_PREFIX,
        token_mode: TokenMode = TokenMode.HYBRID,
        fifo: bool = False,
        queue_ttl: float = 3.0,
        min_replicas: int = 0,
        replica_timeout: float = 1.0,
        wait_aof: bool = False,
        socket_timeout: float | None = None,
        cluster: bool = False,
        check_config: bool = True,
        ttl: float = 30.0,
        renew: bool = False,
        drift: float = 0.01,
        margin: float = 0.002,
        clock: Clock | None = None,
        events: EventBus | None = None,
        reentrant: bool = True,
    ) -> None:
        ttl = validate_ttl(ttl)
        client_deadline(0.0, ttl, drift=drift, margin=margin)  # fail before any client exists
        if socket_timeout is None:
            socket_timeout = min(5.0, max(0.05, ttl / 3))
        driver = AsyncRedisDriver(
            client,
            prefix=prefix,
            token_mode=token_mode,
            fifo=fifo,
            queue_ttl=queue_ttl,
            min_replicas=min_replicas,
            replica_timeout=replica_timeout,
            wait_aof=wait_aof,
            socket_timeout=socket_timeout,
            cluster=cluster,
            check_config=check_config,
        )
        super().__init__(
            driver,
            ttl=ttl,
            renew=renew,
            drift=drift,
            margin=margin,
            clock=clock,
            events=events,
            reentrant=reentrant,
        )
