"""The Redis lock manager for asyncio: one Lua script per call, waiters woken by pub/sub.

The scripts are in :mod:`fence._redis_scripts`, the key layout in :mod:`fence._redis_keys`,
how replies and errors are read in :mod:`fence._redis_replies`; the deadlines,
reentrancy, waiting loop and renewal watchdog in :mod:`fence._async.manager`.

Connections. A manager built from a plain ``redis://`` or ``unix://`` URL uses connections
of its own (:mod:`fence._async.resp`): a pool of at most ``max_connections`` for the
scripts, and one pub/sub connection for waking waiters. Every round trip is bounded by the
time its caller has left. Given clients, ``rediss://`` URLs, Redis Cluster and Redis
Sentinel (``redis+sentinel://``, :mod:`fence._async.sentinel`) go through redis-py (one
client, one pool), with one pub/sub connection from it.

Waiting. However many tasks and threads wait, a manager holds one pub/sub connection
(the model is Redisson's ``LockPubSub``). The first waiter of a resource subscribes the
manager to the resource's channel; a release publishes on it, and the manager's listener
wakes one of its waiters (or, with FIFO, the one whose turn it is) through a
:class:`fence._wake.WakeBoard`. A waiter takes a mark of the board before each attempt;
a wake-up posted between a refused attempt and the wait makes the wait return at once.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import threading
import time
import warnings
from collections import OrderedDict
from typing import Any

import redis  # unasync: import redis.asyncio
import redis.asyncio
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError, ResponseError

from fence._acompat import Waiter, cancel_after
from fence._async.manager import AsyncBaseLockManager
from fence._async.resp import AsyncRespClient, AsyncRespSubscriber
from fence._async.sentinel import SentinelClients, sentinel_clients
from fence._clock import Clock
from fence._core import LeaseMode, TokenMode, client_deadline, validate_ttl
from fence._deadline import time_left
from fence._errors import ConfigurationError, FenceWarning, InvalidResourceError
from fence._events import EventBus
from fence._lua import Script
from fence._redis_conn import closed_connection, describe_client
from fence._redis_keys import (
    DEFAULT_PREFIX,
    ResourceKeys,
    held_resource,
    resource_keys,
    scan_pattern,
    validate_prefix,
    waiter_id,
)
from fence._redis_replies import (
    driver_error,
    info_field,
    lock_info,
    replication_problem,
    settings_of,
    text,
)
from fence._redis_scripts import DRIVER_SCRIPTS, milliseconds
from fence._redis_settings import SETTINGS, Level, judge_settings
from fence._resp import Address, ConnectionFailure, RespError, pack, parse_url
from fence._sentinel import is_sentinel_url, parse_sentinel_url
from fence._signal import Signal
from fence._wake import WakeBoard
from fence.abc import AcquireReply, LockInfo

__all__ = ["AsyncRedisDriver", "AsyncRedisLockManager"]

_log = logging.getLogger("fence.redis")

#: Whether this module drives asyncio clients; a client of the other flavour is refused.
_ASYNC = True  # unasync: _ASYNC = False
_FLAVOUR = "redis.asyncio.Redis or redis.asyncio.RedisCluster"

AsyncClient = redis.asyncio.Redis | redis.asyncio.RedisCluster

#: How long one read of the pub/sub connection waits; the reader looks after idle
#: subscriptions and the connection's health between reads.
_LISTEN_TICK = 1.0
#: A channel that no waiter of this manager needed for this long is unsubscribed.
_LINGER = 10.0
#: The first pause before reconnecting the pub/sub connection after a failure; it doubles
#: up to 1 s while the failures go on.
_RETRY_CONNECT = 0.05
#: Default size of the pool of a manager built from a URL.
DEFAULT_MAX_CONNECTIONS = 3
#: The listener pings after this long without a message, and reconnects if no answer
#: comes within the socket timeout: a connection that died silently loses no wake-up for
#: longer than this.
_PING_AFTER = 5.0
#: Longest wait between two attempts of a waiter that nothing wakes (the manager's
#: ``max_wait`` hint): the listener does not lose wake-ups, and the holder's expiry
#: shortens each wait anyway.
_MAX_WAIT = 30.0


class _PySubscriber:
    """redis-py's ``PubSub`` behind the listener's three calls (given clients, Cluster)."""

    def __init__(self, pubsub: Any) -> None:
        self._pubsub = pubsub

    async def send(self, command: str, *channels: str) -> None:
        if command == "SUBSCRIBE":
            await self._pubsub.subscribe(*channels)
        elif command == "UNSUBSCRIBE":
            await self._pubsub.unsubscribe(*channels)
        else:
            await self._pubsub.ping()

    async def read(self, timeout: float) -> list[Any] | None:
        msg = await self._pubsub.get_message(ignore_subscribe_messages=False, timeout=timeout)
        if msg is None:
            return None
        return [str(msg["type"]).encode(), msg["channel"], msg["data"]]

    def close(self) -> None:
        # Break a read blocked in another task or thread at once; redis-py has no call for
        # that, so this reaches for its connection's socket (best effort: otherwise the
        # read ends within its tick).
        connection = getattr(self._pubsub, "connection", None)
        writer = getattr(connection, "_writer", None)
        if writer is not None:
            writer.transport.abort()
            return
        sock = getattr(connection, "_sock", None)
        if sock is not None:
            try:
                sock.shutdown(2)
            except OSError:
                pass

    async def shutdown(self) -> None:
        try:
            await self._pubsub.aclose()
        except (RedisError, OSError):
            pass


class _Seat:
    """A waiter's place at the listener: woken by a wake-up for it (:meth:`wake`, which is
    what the board and the subscription signals call) or handed the reader's role."""

    __slots__ = ("_waiter", "baton", "released")

    def __init__(self) -> None:
        self._waiter = Waiter()
        self.released = False
        self.baton = False

    def wake(self) -> None:
        """What the seat waits for happened (a release of its resource, a confirmation)."""
        self.released = True
        self._waiter.wake()

    def pass_baton(self) -> None:
        """Ask this waiter to read the listener's connection from now on."""
        self.baton = True
        self._waiter.wake()

    async def wait(self, timeout: float) -> None:
        if await self._waiter.wait(timeout) and not self.released:
            self._waiter = Waiter()  # woken for the baton: wait again afterwards


class _Listener:
    """One pub/sub connection per driver, read by the waiters themselves.

    Whoever waits takes turns at reading the connection (leader and followers): one
    waiter reads and posts every wake-up it reads to the driver's board, the others sleep
    until the board wakes them or the reader leaves and hands the role on. A wake-up for
    the reader itself therefore costs no hand-over to another thread or task. No thread
    or task of its own runs while nobody waits.

    Waiters call :meth:`enter` and :meth:`leave` around a wait, :meth:`ensure` to have
    their resource's channel subscribed, and :meth:`serve` to wait. A lost connection
    wakes every waiter (wake-ups may have been missed); the next waiter reconnects.
    """

    def __init__(self, driver: AsyncRedisDriver) -> None:
        self._driver = driver
        self._board = driver.board
        self._lock = threading.Lock()
        self._channels: dict[str, str] = {}  # channel -> resource, subscribed or wanted
        self._confirmed: set[str] = set()
        self._pending: dict[str, Signal] = {}
        self._inside: dict[str, int] = {}  # resource -> waiters inside a wait
        self._idle: dict[str, float] = {}  # channel -> when its last waiter left
        self._candidates: OrderedDict[_Seat, None] = OrderedDict()
        self._conn: Any = None
        self._connecting = False
        self._reader: _Seat | None = None
        self._heard = 0.0
        self._pinged: float | None = None
        self._tidied = 0.0
        self._closed = False
        self._failures = 0  # connections lost or refused in a row
        self._failed_at = 0.0
        self._denied: RespError | None = None  # SUBSCRIBE refused (ACL): said to waiters

    def enter(self, resource: str) -> None:
        """A waiter starts waiting for ``resource``."""
        with self._lock:
            self._inside[resource] = self._inside.get(resource, 0) + 1

    def leave(self, resource: str, channel: str) -> None:
        """A waiter stops waiting for ``resource``."""
        with self._lock:
            count = self._inside.get(resource, 0) - 1
            if count > 0:
                self._inside[resource] = count
            else:
                self._inside.pop(resource, None)
                if channel in self._channels:
                    self._idle[channel] = time.monotonic()

    async def ensure(self, resource: str, channel: str, deadline: float) -> bool:
        """Have ``channel`` subscribed; True if it already was before this call.

        False means it was not: the caller's last attempt may have missed a release, so it
        must try again (the subscription is confirmed by now, unless ``deadline`` passed).
        """
        denied = self._denied
        if denied is not None:
            self._denied = None  # said once; the next waiter tries again
            raise self._driver._error(denied, "wait (SUBSCRIBE)", resource)
        send = connect = False
        with self._lock:
            if channel in self._confirmed:
                self._idle.pop(channel, None)
                return True
            if self._closed:
                return False
            # After failures, reconnect with a backoff rather than in a tight loop.
            pause = min(_RETRY_CONNECT * 2 ** (self._failures - 1), 1.0) if self._failures else 0
            backing_off = self._conn is None and time.monotonic() - self._failed_at < pause
            self._idle.pop(channel, None)
            if channel not in self._channels:
                self._channels[channel] = resource
                send = True
            signal = self._pending.get(channel)
            if signal is None:
                signal = self._pending[channel] = Signal()
            conn = self._conn
            if conn is None and not self._connecting and not backing_off:
                self._connecting = connect = True
        if backing_off:
            waiter = Waiter()
            await waiter.wait(min(pause, deadline - time.monotonic()))
            return False
        if connect:
            await self._connect(deadline)
        elif send and conn is not None:
            try:
                await conn.send("SUBSCRIBE", channel)
            except (ConnectionFailure, RedisError, OSError):
                self._lost(conn)
        seat = _Seat()
        if not signal.attach(seat):
            try:
                await self.serve(seat, deadline)
            finally:
                signal.detach(seat)
        return False

    async def _connect(self, deadline: float) -> None:
        driver = self._driver
        conn: Any = None
        try:
            if driver.address is not None:
                conn = await AsyncRespSubscriber.open(driver.address, deadline)
            else:
                conn = self._redis_py_subscriber()
            with self._lock:
                channels = list(self._channels)
            if channels:
                await conn.send("SUBSCRIBE", *channels)
        except (ConnectionFailure, RespError, RedisError, OSError) as exc:
            _log.debug("pub/sub connection to %s failed: %s", driver._where, exc)
            if conn is not None:
                conn.close()
            with self._lock:
                self._connecting = False
                self._failures += 1
                self._failed_at = time.monotonic()
                pending = list(self._pending.values())
                self._pending.clear()
            for signal in pending:
                signal.set()  # nobody can confirm them: their waiters try again
            return
        with self._lock:
            self._connecting = False
            if self._closed:
                conn.close()
                return
            self._conn = conn
            self._heard = self._tidied = time.monotonic()
            self._pinged = None

    def _redis_py_subscriber(self) -> _PySubscriber:
        client: Any = self._driver.client
        if _ASYNC and self._driver.is_cluster:
            # The asyncio cluster client has no pub/sub: listen on one node. Messages
            # published on any node reach every node.
            node = client.get_default_node()
            allowed = (
                "username",
                "password",
                "ssl",
                "ssl_ca_certs",
                "ssl_certfile",
                "ssl_keyfile",
                "ssl_cert_reqs",
                "ssl_check_hostname",
            )
            kwargs = {k: v for k, v in client.connection_kwargs.items() if k in allowed}
            single: Any = redis.asyncio.Redis(host=str(node.host), port=int(node.port), **kwargs)
            return _PySubscriber(single.pubsub())
        return _PySubscriber(client.pubsub())

    async def serve(self, seat: _Seat, deadline: float) -> None:
        """Wait until ``seat`` is woken or ``deadline`` passes, reading the connection
        whenever nobody else does."""
        reading = False
        try:
            while not seat.released:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                if not reading:
                    with self._lock:
                        if self._reader is None and self._conn is not None and not self._closed:
                            self._reader = seat
                            reading = True
                            self._candidates.pop(seat, None)
                        else:
                            self._candidates[seat] = None
                            seat.baton = False
                    if not reading:
                        await seat.wait(left)
                        continue
                await self._read_once(min(left, _LISTEN_TICK))
        finally:
            successor = None
            with self._lock:
                self._candidates.pop(seat, None)
                if reading and self._reader is seat:
                    self._reader = None
                if self._reader is None and (reading or seat.baton) and self._candidates:
                    successor = next(iter(self._candidates))
            if successor is not None:
                successor.pass_baton()

    async def _read_once(self, timeout: float) -> None:
        conn = self._conn
        if conn is None:
            return
        try:
            message = await conn.read(timeout)
            now = time.monotonic()
            if message is not None:
                self._heard, self._pinged = now, None
                await self._dispatch(conn, message)
            elif self._pinged is not None and now - self._pinged > self._driver.socket_timeout:
                raise ConnectionFailure("no answer to PING", sent=False, timed_out=True)
            elif self._pinged is None and now - self._heard > _PING_AFTER:
                self._pinged = now
                await conn.send("PING")
            if now - self._tidied > _LISTEN_TICK:
                self._tidied = now
                await self._tidy(conn)
        except (ConnectionFailure, RespError, RedisError, OSError) as exc:
            _log.debug("pub/sub connection to %s lost: %s", self._driver._where, exc)
            if isinstance(exc, RespError) and exc.kind == "NOPERM":
                self._denied = exc
            self._lost(conn)

    def _lost(self, conn: Any) -> None:
        """The connection broke: forget it and wake everybody, who may have missed a
        wake-up; the next waiter reconnects."""
        with self._lock:
            if self._conn is not conn:
                return
            self._conn = None
            self._confirmed.clear()
            self._failures += 1
            self._failed_at = time.monotonic()
            pending = list(self._pending.values())
            self._pending.clear()
            candidates = list(self._candidates)
        conn.close()
        for signal in pending:
            signal.set()
        self._board.new_generation()
        for seat in candidates:
            seat.pass_baton()

    async def _dispatch(self, conn: Any, message: list[Any]) -> None:
        kind = message[0]
        channel = text(message[1]) if len(message) > 1 else ""
        if kind == b"message":
            resource = self._channels.get(channel)
            if resource is None:
                return
            payload = message[2]
            if payload:
                # The waiters whose turn it is: a writer, or a batch of readers.
                for key in text(payload).split():
                    self._board.wake_key(resource, key)
            else:
                self._board.wake_one(resource, prefer=self._reader)
        elif kind == b"subscribe":
            with self._lock:
                resource = self._channels.get(channel)
                if resource is None:
                    return
                self._confirmed.add(channel)
                self._failures = 0
                signal = self._pending.pop(channel, None)
            # Attempts made before the subscription could miss a release: they try again.
            self._board.changed(resource)
            if signal is not None:
                signal.set()
        elif kind == b"unsubscribe":
            # An idle channel was dropped while a waiter came back for it (the two crossed
            # on the wire): subscribe again, and have its waiters try again meanwhile.
            with self._lock:
                resource = self._channels.get(channel)
                if resource is None:
                    return
                self._confirmed.discard(channel)
                if channel not in self._pending:
                    self._pending[channel] = Signal()
            self._board.bump(resource)
            await conn.send("SUBSCRIBE", channel)

    async def _tidy(self, conn: Any) -> None:
        """Unsubscribe channels no waiter needed for a while."""
        now = time.monotonic()
        with self._lock:
            stale = [
                channel
                for channel, since in self._idle.items()
                if now - since > _LINGER
                and self._inside.get(self._channels.get(channel, ""), 0) == 0
            ]
            for channel in stale:
                del self._idle[channel]
                self._channels.pop(channel, None)
                self._confirmed.discard(channel)
        if stale:
            await conn.send("UNSUBSCRIBE", *stale)

    async def close(self) -> None:
        """Close the connection; every waiter wakes."""
        with self._lock:
            self._closed = True
            conn = self._conn
        if conn is not None:
            self._lost(conn)
            if isinstance(conn, _PySubscriber):
                await conn.shutdown()


class AsyncRedisDriver:
    """Moves the bytes of :class:`AsyncRedisLockManager`: one round trip per call.

    Args:
        client: a URL (``redis://...``, ``redis+sentinel://...``), a
            ``redis.asyncio.Redis`` or a ``redis.asyncio.RedisCluster``. From a URL the
            driver builds (and closes) its own connections, with ``socket_timeout`` and no
            silent retries; a client given is never closed.
        prefix: the key prefix; must match the Redis guard's. No braces.
        token_mode: :attr:`TokenMode.HYBRID` (default) or :attr:`TokenMode.COUNTER`.
        fifo: serve waiters in arrival order, waking only the next one.
        queue_ttl: how long a FIFO waiter keeps its place without a heartbeat, in seconds.
        min_replicas: replicas that must acknowledge an acquire (``WAIT``) before its token
            is handed out; 0 disables.
        replica_timeout: how long ``WAIT`` may take, in seconds.
        wait_aof: also require the acquire to be fsynced to the AOF (``WAITAOF``, Redis 7.2+).
        socket_timeout: the longest one round trip may take (connect, read) on connections
            built from a URL; a caller's own deadline shortens it.
        cluster: build a ``RedisCluster`` from the URL.
        check_config: on first use, warn about server settings that can lose tokens.
        max_connections: the size of the connection pool built from a URL (the pub/sub
            connection comes on top). Callers queue for a connection when all are busy.

    Raises:
        ConfigurationError: a bad argument, or a client of the wrong flavour.
    """

    source = "redis"
    #: Grants read leases (C13).
    shared = True

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
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
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
        self.socket_timeout = validate_ttl(socket_timeout, what="socket_timeout")
        if (
            isinstance(max_connections, bool)
            or not isinstance(max_connections, int)
            or max_connections < 1
        ):
            raise ConfigurationError(
                f"max_connections must be an int >= 1, got {max_connections!r}"
            )
        self.max_connections = max_connections
        self.check_config = check_config
        self._checked = not check_config
        self._appendonly: bool | None = None
        self.address: Address | None = None
        self._sentinel: SentinelClients | None = None
        if isinstance(client, str) and is_sentinel_url(client):
            if cluster:
                raise ConfigurationError(
                    "cluster=True with a redis+sentinel:// URL: Sentinel watches one primary "
                    "and its replicas, not a Redis Cluster"
                )
            self._owned = True
            target = parse_sentinel_url(client)
            # The pub/sub connection comes from the same pool: one more than the calls'.
            self._sentinel = sentinel_clients(
                target,
                socket_timeout=self.socket_timeout,
                max_connections=max_connections + 1,
                no_retry=True,
            )
            self.client: Any = self._sentinel.master
            self._where = str(target)
        elif isinstance(client, str):
            self._owned = True
            try:
                self.address = None if cluster else parse_url(client)
            except ValueError as exc:
                raise ConfigurationError(f"not a usable Redis URL: {client!r} ({exc})") from exc
            if self.address is not None:
                self.client = AsyncRespClient(
                    self.address,
                    max_connections=max_connections,
                    socket_timeout=self.socket_timeout,
                )
                self._where = str(self.address)
            else:
                self.client = self._connect(client, self.socket_timeout, cluster, max_connections)
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
            self.client = client
            self._where = describe_client(client)
        self._pool = self.client.pool if self.address is not None else None
        self.is_cluster = isinstance(self.client, redis.asyncio.RedisCluster)
        if self.min_replicas and self.is_cluster:
            raise ConfigurationError(
                "min_replicas is not supported on Redis Cluster: WAIT must follow the write on "
                "the same connection to the slot's primary"
            )
        if self.wait_aof and not self.min_replicas:
            raise ConfigurationError("wait_aof needs min_replicas >= 1")
        self._mode = self.token_mode.value
        self._mode_bytes = self._mode.encode()
        self._fifo_flag = b"1" if self.fifo else b"0"
        self._queue_ms = milliseconds(self.queue_ttl)
        scripts = DRIVER_SCRIPTS
        self._acquire = scripts["acquire"]
        self._renew = scripts["renew"]
        self._release = scripts["release"]
        self._enqueue = scripts["enqueue"]
        self._abandon = scripts["abandon"]
        self._cancel = scripts["cancel"]
        self._inspect = scripts["inspect"]
        self._revoke = scripts["revoke"]
        self.board = WakeBoard()
        self._listener = _Listener(self)
        self._closed = False
        # (resource, waiter id) of FIFO waits whose ENQUEUE got no answer (a timeout, a
        # cancellation): it may still reach the server, so giving up must leave CANCEL's
        # tombstone, which ENQUEUE reads, and not only leave the queue.
        self._unanswered: set[tuple[str, str]] = set()
        # A FIFO waiter's attempts are its heartbeat: it must try again well inside
        # queue_ttl, or it loses its place.
        self.max_wait = min(_MAX_WAIT, self.queue_ttl / 3) if self.fifo else _MAX_WAIT

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._where} prefix={self.prefix!r}>"

    @staticmethod
    def _connect(url: str, socket_timeout: float, cluster: bool, max_connections: int) -> Any:
        # No retries inside redis-py: a retried release that already ran would report
        # "not held", and the manager does its own retrying within the caller's timeout.
        options: dict[str, Any] = {
            "socket_timeout": socket_timeout,
            "socket_connect_timeout": socket_timeout,
            "retry": Retry(NoBackoff(), 0),
            "max_connections": max_connections,
        }
        try:
            if cluster:
                return redis.asyncio.RedisCluster.from_url(url, **options)
            pool = redis.asyncio.BlockingConnectionPool.from_url(
                url, timeout=socket_timeout, **options
            )
            return redis.asyncio.Redis(connection_pool=pool)
        except ValueError as exc:
            raise ConfigurationError(f"not a usable Redis URL: {url!r} ({exc})") from exc

    def keys(self, resource: str) -> ResourceKeys:
        """The keys of ``resource`` (see :func:`fence._redis_keys.resource_keys`)."""
        return resource_keys(self.prefix, resource)

    # -- errors --------------------------------------------------------------------------

    def _error(self, exc: BaseException, what: str, resource: str = "") -> Exception:
        """The error to raise for ``exc`` (see :func:`fence._redis_replies.driver_error`)."""
        return driver_error(exc, what, resource, where=self._where, client=self.client)

    async def _run(
        self,
        script: Script,
        keys: list[str],
        args: list[Any],
        what: str,
        resource: str = "",
        *,
        urgent: bool = False,
        repeat: bool = True,
    ) -> Any:
        # EVALSHA: one round trip. A server that lost its script cache (restart, failover,
        # SCRIPT FLUSH) gets the script loaded again and the call repeated, never reported
        # as a verdict.
        pool = self._pool
        if pool is not None:
            deadline = time.monotonic() + time_left(self.socket_timeout)
            command = pack("EVALSHA", script.sha, len(keys), *keys, *args)
            # A connection the server closed under the call (a restart) gets the call sent
            # once more, unless the caller forbids it: see the redis-py branch below.
            try:
                reply = await pool.request(command, deadline, urgent=urgent, resend=repeat)
                if isinstance(reply, RespError) and reply.kind == "NOSCRIPT":
                    load = pack("SCRIPT", "LOAD", script.source)
                    loaded = await pool.request(load, deadline, resend=repeat)
                    if isinstance(loaded, RespError):
                        raise loaded
                    reply = await pool.request(command, deadline, urgent=urgent, resend=repeat)
                if isinstance(reply, RespError):
                    raise reply
            except (ConnectionFailure, RespError) as exc:
                raise self._error(exc, what, resource) from exc
            return reply
        try:
            async with cancel_after(max(time_left(self.socket_timeout), 0.0) + 0.05):
                try:
                    return await self._evalsha(script, keys, args)
                except RedisConnectionError as exc:
                    if not (repeat and closed_connection(exc)):
                        raise
                # The server closed the pooled connection under the call (a restart, an
                # idle timeout): redis-py 5, and a client without retries, do not send it
                # again. Every script here may run twice with the same arguments: acquire
                # is reentrant by secret, renew and inspect change nothing more, abandon
                # and enqueue keep one place, revoke issues one more token; a release
                # whose first run's reply was lost in a crash finds the lock free and
                # reports it not held.
                return await self._evalsha(script, keys, args)
        except (RedisError, OSError, TimeoutError) as exc:
            raise self._error(exc, what, resource) from exc

    async def _evalsha(self, script: Script, keys: list[str], args: list[Any]) -> Any:
        client = self.client
        try:
            return await client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
        except NoScriptError:
            await client.script_load(script.source)
            return await client.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)

    # -- the driver protocol -------------------------------------------------------------

    async def acquire(
        self,
        resource: str,
        secret: str,
        ttl: float,
        holder: str,
        mode: LeaseMode = LeaseMode.WRITE,
    ) -> AcquireReply:
        """One attempt: take the lock (a writer) or a read lease (``mode`` READ) if the
        queue lets it, issuing a token; see :meth:`fence.abc.AsyncDriver.acquire`."""
        if not self._checked:
            await self._check_config("acquire", resource)
        keys = self.keys(resource)
        mark = self.board.mark()
        script_keys = [keys.lock, keys.token, keys.fence, keys.queue, keys.deadlines]
        wid = waiter_id(secret)
        # Numbers and fixed words as bytes: no encoding on the hot path.
        args: list[Any] = [
            secret,
            b"%d" % milliseconds(ttl),
            holder,
            self._mode_bytes,
            wid,
            self._queue_ms,
            b"r" if mode is LeaseMode.READ else b"w",
            self._fifo_flag,
        ]
        if self.min_replicas:
            reply = await self._acquire_replicated(resource, script_keys, args)
        else:
            reply = await self._run(self._acquire, script_keys, args, "acquire", resource)
        if not isinstance(reply, list):  # granted: the bare token
            if self._unanswered:
                self._unanswered.discard((resource, wid))
            return AcquireReply(int(reply))
        wait_ms, queued = int(reply[1]), int(reply[2])
        # PTTL is truncated to whole ms: add one so the wait does not end just before expiry.
        holder_ttl = (wait_ms + 1) / 1000 if wait_ms >= 0 else None
        cookie = (mark, wid, bool(queued), secret)
        return AcquireReply(None, holder_ttl, cookie, queued=bool(queued))

    async def _pipeline(self, commands: list[tuple[Any, ...]]) -> list[Any]:
        """Send commands in one pipeline on one connection; errors are returned in place."""
        if self._pool is not None:
            deadline = time.monotonic() + time_left(self.socket_timeout)
            return list(await self._pool.requests([pack(*c) for c in commands], deadline))
        async with self.client.pipeline(transaction=False) as pipe:
            for command in commands:
                pipe.execute_command(*command)
            return list(await pipe.execute(raise_on_error=False))

    async def _acquire_replicated(
        self, resource: str, script_keys: list[str], args: list[Any]
    ) -> Any:
        # WAIT counts the writes of its own connection: a pipeline sends both on one.
        timeout_ms = milliseconds(self.replica_timeout)
        commands: list[tuple[Any, ...]] = [
            ("EVAL", self._acquire.source, len(script_keys), *script_keys, *args),
            ("WAIT", self.min_replicas, timeout_ms),
        ]
        if self.wait_aof:
            commands.append(
                ("WAITAOF", 1 if self._appendonly else 0, self.min_replicas, timeout_ms)
            )
        try:
            results = await self._pipeline(commands)
        except (ConnectionFailure, RedisError, OSError) as exc:
            raise self._error(exc, "acquire", resource) from exc
        reply = results[0]
        if isinstance(reply, Exception):
            raise self._error(reply, "acquire", resource) from reply
        if isinstance(reply, list):  # not granted: nothing to wait for
            return reply
        problem = replication_problem(
            results[1],
            results[2] if self.wait_aof else None,
            resource=resource,
            min_replicas=self.min_replicas,
            appendonly=bool(self._appendonly),
            timeout=self.replica_timeout,
            where=self._where,
            error=lambda exc, what: self._error(exc, what, resource),
        )
        if problem is None:
            return reply
        await self.release(resource, args[0])
        raise problem

    async def renew(self, resource: str, secret: str, ttl: float) -> bool:
        """See :meth:`fence.abc.AsyncDriver.renew`."""
        lock = self.keys(resource).lock
        renewed = await self._run(
            self._renew, [lock], [secret, milliseconds(ttl)], "renewal", resource, urgent=True
        )
        return bool(renewed)

    async def release(self, resource: str, secret: str) -> bool:
        """End the lease ``secret`` holds (the writer's or a reader's) and publish a
        wake-up; see :meth:`fence.abc.AsyncDriver.release`."""
        keys = self.keys(resource)
        released = await self._run(
            self._release,
            [keys.lock, keys.queue, keys.deadlines],
            [secret, self._fifo_flag],
            "release",
            resource,
            urgent=True,
        )
        return bool(released)

    async def wait(self, resource: str, timeout: float, reply: AcquireReply) -> None:
        """Wait until this manager's listener hears a wake-up for ``resource`` (or, FIFO,
        for this waiter), or ``timeout`` seconds pass.

        The first waiter of a resource subscribes the manager to its channel, and returns
        at once so that its caller tries again: a release may have come before the
        subscription.
        """
        if timeout <= 0 or self._closed:
            return
        cookie = reply.cookie
        if isinstance(cookie, tuple) and len(cookie) == 4:
            mark, wid, queued, secret = cookie
        else:  # a reply that is not this driver's (the quorum's): no mark to trust
            mark, wid, queued, secret = None, "", False, ""
        if (queued or self.fifo) and wid:
            # A queued waiter's attempts are its heartbeat: try again well inside queue_ttl.
            timeout = min(timeout, self.queue_ttl / 3)
        deadline = time.monotonic() + timeout
        keys = self.keys(resource)
        listener = self._listener
        listener.enter(resource)
        try:
            if self.fifo and wid and not queued:
                place = (resource, wid)
                self._unanswered.add(place)
                go = await self._run(
                    self._enqueue,
                    [keys.lock, keys.queue, keys.deadlines],
                    [wid, self._queue_ms, secret],
                    "enqueue",
                    resource,
                )
                self._unanswered.discard(place)
                if go:
                    return
                queued = True
            if not await listener.ensure(resource, keys.signal, deadline):
                return
            if mark is None:
                mark = self.board.mark()
            seat = _Seat()
            if self.board.attach(resource, seat, mark, wid if queued else None):
                return
            try:
                await listener.serve(seat, deadline)
            finally:
                self.board.detach(resource, seat)
        finally:
            listener.leave(resource, keys.signal)

    async def abandon(self, resource: str, secret: str) -> None:
        """A waiter gave up: drop it from the FIFO queue and, if the lock is free, publish a
        wake-up in its place. A wait whose ENQUEUE got no answer first leaves CANCEL's
        tombstone (for ``queue_ttl``), so that the ENQUEUE takes no place should it
        arrive later."""
        keys = self.keys(resource)
        wid = waiter_id(secret)
        place = (resource, wid)
        if place in self._unanswered:
            # Forgotten first: a CANCEL that fails here leaves a place that ends with
            # queue_ttl, and nothing to keep for it.
            self._unanswered.discard(place)
            await self.cancel(resource, secret, self.queue_ttl)
        args: list[Any] = [wid, self._fifo_flag]
        await self._run(
            self._abandon,
            [keys.lock, keys.queue, keys.deadlines],
            args,
            "abandon",
            resource,
            urgent=True,
        )

    async def cancel(self, resource: str, secret: str, ttl: float) -> bool:
        """An acquire gave up without knowing whether an attempt took the lock: release it
        if one did, and leave a tombstone (for ``ttl``) that refuses an attempt with this
        secret still on its way. Returns whether the lock was held."""
        keys = self.keys(resource)
        args: list[Any] = [secret, milliseconds(ttl), waiter_id(secret), self._fifo_flag]
        held = await self._run(
            self._cancel,
            [keys.lock, keys.queue, keys.deadlines],
            args,
            "cancel",
            resource,
            urgent=True,
        )
        return bool(held)

    async def inspect(self, resource: str) -> LockInfo | None:
        """The writer, or every reader; see :meth:`fence.abc.AsyncDriver.inspect`."""
        got = await self._run(self._inspect, [self.keys(resource).lock], [], "inspect", resource)
        return lock_info(resource, got)

    async def list_page(
        self, prefix: str, cursor: str | None, count: int
    ) -> tuple[list[LockInfo], str | None]:
        """One ``SCAN`` step over the keys of the resources that start with ``prefix``,
        then each held one inspected, with its queue's length as ``waiters``.

        The cursor is the ``SCAN`` cursor (on Redis Cluster, the primary's place among the
        primaries by name, a colon, and its ``SCAN`` cursor: the primaries are scanned one
        after the other). Rows come in the server's scan order, and a resource may come
        twice (``SCAN``'s own guarantee); the manager drops repeats.
        """
        index, _, step = (cursor or "0:0").rpartition(":") if self.is_cluster else ("", "", "")
        command = ("SCAN", step or cursor or "0", "MATCH", scan_pattern(self.prefix, prefix))
        primaries: list[Any] = []
        try:
            if self.is_cluster:
                await self.client.initialize()  # unasync: remove
                primaries = sorted(self.client.get_primaries(), key=lambda node: node.name)
                if int(index) >= len(primaries):
                    return [], None
                async with cancel_after(max(time_left(self.socket_timeout), 0.0) + 0.05):
                    reply = await self.client.execute_command(
                        *command, "COUNT", count, target_nodes=primaries[int(index)]
                    )
                if isinstance(reply[0], dict):  # redis-py: the cursor of each node
                    (next_step,) = reply[0].values()
                    reply = [next_step, reply[1]]
            else:
                (reply,) = await self._pipeline([(*command, "COUNT", count)])
                if isinstance(reply, BaseException):
                    raise reply
            after, keys = text(reply[0]), [text(k) for k in reply[1]]
            names = list(dict.fromkeys(r for k in keys if (r := held_resource(self.prefix, k))))
            names = [r for r in names if r.startswith(prefix) and self._listable(r)]
            if self.is_cluster:  # one slot a key: no pipeline across them
                queued = []
                for name in names:
                    async with cancel_after(max(time_left(self.socket_timeout), 0.0) + 0.05):
                        queued.append(
                            await self.client.execute_command("ZCARD", self.keys(name).queue)
                        )
            else:
                queued = await self._pipeline([("ZCARD", self.keys(r).queue) for r in names])
        except (ConnectionFailure, RespError, RedisError, OSError, TimeoutError) as exc:
            raise self._error(exc, "list", prefix) from exc
        rows = []
        for name, waiting in zip(names, queued, strict=True):
            info = await self.inspect(name)
            if info is not None:
                waiters = waiting if isinstance(waiting, int) else 0
                rows.append(dataclasses.replace(info, waiters=waiters))
        if not self.is_cluster:
            return rows, None if after == "0" else after
        if after != "0":
            return rows, f"{index}:{after}"
        if int(index) + 1 < len(primaries):
            return rows, f"{int(index) + 1}:0"
        return rows, None

    def _listable(self, name: str) -> bool:
        try:
            self.keys(name)
        except InvalidResourceError:
            return False  # read from a key that is no lock's (a data key's fence)
        return True

    async def revoke(self, resource: str) -> int:
        """End the lease, issue a token above every earlier one and above the guards' fence
        register ``<prefix>{R}:fence``, and raise the register to it; see
        :meth:`fence.abc.AsyncDriver.revoke`."""
        if not self._checked:
            await self._check_config("revoke", resource)
        keys = self.keys(resource)
        args: list[Any] = [self._mode, self._fifo_flag]
        token = await self._run(
            self._revoke,
            [keys.lock, keys.token, keys.fence, keys.queue, keys.deadlines],
            args,
            "revoke",
            resource,
            urgent=True,
        )
        return int(token)

    async def close(self) -> None:
        """Stop the listener; close the connections built from a URL (a client given is
        left open)."""
        self._closed = True
        await self._listener.close()
        if self._owned:
            self._owned = False
            if self._sentinel is not None:
                await self._sentinel.close()
            else:
                await self.client.aclose()

    # -- server settings -----------------------------------------------------------------

    async def read_settings(self, what: str, resource: str = "") -> dict[str, str] | None:
        """The server's settings that tokens and fences depend on
        (:data:`fence._redis_settings.SETTINGS`), or ``None`` if ``CONFIG`` is forbidden
        or renamed (managed services often disable it).

        Raises:
            BackendError: the server did not answer (for the call ``what``).
        """
        settings: dict[str, str] = {}
        for name in SETTINGS:
            try:
                got = await self.client.config_get(name)
            except ResponseError:  # CONFIG forbidden or renamed (RespError is one too)
                return None
            except (RedisError, OSError) as exc:
                raise self._error(exc, what, resource) from exc
            settings.update(settings_of(got))
        return settings

    async def loaded_keys(self, what: str) -> int | None:
        """How many keys the server loaded from an RDB file when it last started
        (``rdb_last_load_keys_loaded`` of ``INFO persistence``, Redis 7.0 and later), or
        ``None`` if the server does not say (older, or ``INFO`` forbidden).

        Raises:
            BackendError: the server did not answer (for the call ``what``).
        """
        try:
            reply = await self.client.execute_command("INFO", "persistence")
        except ResponseError:
            return None
        except (RedisError, OSError) as exc:
            raise self._error(exc, what, "") from exc
        value = info_field(reply, "rdb_last_load_keys_loaded")
        return int(value) if value is not None and value.isdigit() else None

    async def _check_config(self, what: str, resource: str) -> None:
        """Warn once about settings that can lose tokens or fences (C3, C12; the verdicts
        of :func:`fence._redis_settings.judge_settings`).

        Managed services often disable ``CONFIG``; then nothing is checked or said.
        """
        self._checked = True
        try:
            settings = await self.read_settings(what, resource)
        except Exception:
            self._checked = False
            raise
        if settings is None:
            return
        self._appendonly = settings.get("appendonly") == "yes"
        for finding in judge_settings(settings, self.token_mode, fences=False):
            if finding.level is not Level.OK:
                warnings.warn(
                    f"Redis at {self._where}: {finding.message}", FenceWarning, stacklevel=4
                )


class AsyncRedisLockManager(AsyncBaseLockManager):
    """A lock manager on Redis that issues fencing tokens (C2, C3, C10-C12).

    Acquire, renew and release are one Lua script each. Tokens are issued in the acquire
    script, from Redis ``TIME`` (hybrid, the default) or a plain counter, and always above
    the guards' fence register. A blocking acquire is woken by the release (pub/sub: one
    listening connection per manager, however many tasks wait), or by the holder's expiry.
    All keys of a resource share the hash tag ``{resource}``, so Redis Cluster works.

    Shared locks (C13): ``read_lock``/``write_lock`` (``acquire(..., mode="read")``); a
    reader is a member of ``<prefix>{R}:readers``, and readers and writers waiting beside
    them queue in arrival order; see ``docs/shared-locks.md``.

    Args:
        client: a URL (``redis://host:6379/0``;
            ``redis+sentinel://host1:26379,host2:26379/mymaster/0`` for the primary that
            Redis Sentinel names, see ``docs/redis-manager.md``), a
            ``redis.asyncio.Redis`` or a ``redis.asyncio.RedisCluster``. The manager closes
            only clients it built.
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
        socket_timeout: the longest one round trip may take on connections built from a
            URL (default: ``ttl / 3``, at most 5 s), so that a renewal cannot hang past the
            lease; an acquire's own timeout shortens it.
        cluster: build a ``RedisCluster`` from the URL.
        max_connections: how many connections a manager built from a URL opens for its
            calls (default 3), plus one for pub/sub. Callers queue for a free one, up to
            their deadline; then :class:`BackendError` ``code="POOL"`` names this limit.
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
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
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
            max_connections=max_connections,
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
