"""How the Redis lock managers read what Redis answers: replies and errors. No I/O.

Written once for the sync and the asyncio drivers (:mod:`fence._async.redis`,
:mod:`fence._async.quorum`): the errors of a call, as :class:`fence.BackendError` with a
code that says what happened; the replies of ``INSPECT``, ``CONFIG GET`` and the ``WAIT``
and ``WAITAOF`` that follow an acquire with ``min_replicas``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from redis.asyncio.sentinel import MasterNotFoundError as AsyncMasterNotFoundError
from redis.exceptions import (
    ClusterDownError,
    NoPermissionError,
    ReadOnlyError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.sentinel import MasterNotFoundError

from fence._core import LeaseMode
from fence._errors import BackendError, ConfigurationError, InvalidTokenError
from fence._resp import ConnectionFailure, PoolExhausted, RespError
from fence.abc import LockInfo

__all__ = [
    "driver_error",
    "info_field",
    "lock_info",
    "replication_problem",
    "settings_of",
    "text",
]

# Sentinel's error when no sentinel names a primary: a class of its own in each flavour.
_NO_PRIMARY = (MasterNotFoundError, AsyncMasterNotFoundError)


def text(value: object) -> str:
    """A reply's bytes (or anything else) as text."""
    return value.decode() if isinstance(value, bytes) else str(value)


def driver_error(
    exc: BaseException, what: str, resource: str = "", *, where: str, client: object
) -> Exception:
    """The error a Redis lock manager raises for ``exc``, raised by its ``what`` call.

    Args:
        exc: what the call raised: redis-py's errors, or those of the manager's own
            connections (:mod:`fence._resp`).
        what: the call (``"acquire"``, ``"release"``, ``"WAIT after the acquire"``).
        resource: the resource of the call, if any.
        where: the server, for messages (never with a password).
        client: the manager's client (its pool's limit is named when it ran out).
    """
    call = f"{what} of {resource!r}" if resource else what
    server = f"Redis at {where}"
    if isinstance(exc, PoolExhausted):
        return BackendError(
            f"{exc}; the {call} waited for a free connection until its deadline",
            code="POOL",
            retryable=True,
            sent=False,
        )
    if isinstance(exc, ConnectionFailure):
        if exc.timed_out:
            return BackendError(
                f"{server} did not answer the {call} in the time allowed ({exc}); the "
                "lock state is unknown until it does, and the call may be retried",
                code="CONNECTION",
                retryable=True,
                sent=exc.sent,
            )
        if not exc.sent:
            return BackendError(
                f"could not reach {server} for the {call} ({exc}); nothing was sent, "
                "and the call may be retried",
                code="CONNECTION",
                retryable=True,
                sent=False,
            )
        return BackendError(
            f"{server} dropped the connection during the {call} ({exc}); the lock state "
            "is unknown until it answers, and the call may be retried",
            code="CONNECTION",
            retryable=True,
            sent=True,
        )
    if isinstance(exc, _NO_PRIMARY):
        return BackendError(
            f"{server}: no Sentinel named a reachable primary for the {call} ({exc}); "
            "during a failover this passes, and the call may be retried",
            code="UNAVAILABLE",
            retryable=True,
            sent=False,
        )
    if isinstance(exc, RedisConnectionError) and (
        "Too many connections" in str(exc) or "No connection available" in str(exc)
    ):
        limit = getattr(getattr(client, "connection_pool", None), "max_connections", None)
        return BackendError(
            f"the connection pool of the Redis client for {where} has no free "
            f"connection for the {call} (max_connections={limit}; a client-side limit: "
            "nothing was sent to Redis). Give the client a larger max_connections, or a "
            "BlockingConnectionPool",
            code="POOL",
            retryable=True,
            sent=False,
        )
    if isinstance(exc, RedisConnectionError | RedisTimeoutError | OSError | TimeoutError):
        return BackendError(
            f"{server} did not answer the {call} ({exc or type(exc).__name__}); the lock "
            "state is unknown until it does, and the call may be retried",
            code="CONNECTION",
            retryable=True,
        )
    message = exc.message if isinstance(exc, RespError) else str(exc)
    kind = exc.kind if isinstance(exc, RespError) else ""
    if isinstance(exc, ClusterDownError | TryAgainError | ReadOnlyError) or kind in (
        "READONLY",
        "CLUSTERDOWN",
        "TRYAGAIN",
        "LOADING",
        "MASTERDOWN",
        "BUSY",
    ):
        return BackendError(
            f"{server} cannot serve the {call} right now ({message}); retry after the "
            "failover, resharding or loading",
            code="UNAVAILABLE",
            retryable=True,
        )
    # Redis ends some replies with a full stop ("... or user is disabled."), and the
    # sentences below go on after the reply.
    sentence = message.rstrip(". ")
    if isinstance(exc, NoPermissionError) or kind == "NOPERM":
        return BackendError(
            f"{server} refused the {call}: {sentence}. The lock manager needs EVALSHA, "
            "SCRIPT LOAD, PUBLISH and SUBSCRIBE on the keys and channels under its prefix",
            code="PERMISSION",
        )
    if kind in ("NOAUTH", "WRONGPASS") or "invalid password" in message.lower():
        return BackendError(
            f"{server} refused the credentials for the {call}: {sentence}. Check the user "
            "and password in the URL",
            code="AUTH",
        )
    if "token space exhausted" in message:
        return InvalidTokenError(f"cannot issue a token: {message}")
    return BackendError(f"{server} failed the {call}: {message}", code="RESPONSE")


def lock_info(resource: str, got: Any) -> LockInfo | None:
    """The holder that the manager's ``INSPECT`` script reports: the writer, or every
    reader; ``None`` when the lock is free."""
    if not got:
        return None
    kind, rest = text(got[0]), got[1:]
    infos = [
        LockInfo(
            resource,
            int(token),
            max(int(ms), 0) / 1000,
            text(holder) or None,
            LeaseMode.WRITE if kind == "w" else LeaseMode.READ,
        )
        for token, ms, holder in zip(rest[0::3], rest[1::3], rest[2::3], strict=True)
    ]
    if kind == "w":
        return infos[0]
    return LockInfo.of_readers(resource, infos)


def settings_of(replies: Mapping[Any, Any]) -> dict[str, str]:
    """A ``CONFIG GET`` reply (name -> value, in bytes or text) as text."""
    return {text(k): text(v) for k, v in replies.items()}


def info_field(reply: Any, name: str) -> str | None:
    """One field of an ``INFO`` reply: redis-py's parsed dict, or the raw text
    (``name:value`` lines) of the manager's own connections; ``None`` if it is not there.

    Example::

        >>> info_field(b"rdb_last_load_keys_loaded:2", "rdb_last_load_keys_loaded")
        '2'
        >>> info_field({"loading": 0}, "loading"), info_field({}, "loading")
        ('0', None)
    """
    if isinstance(reply, Mapping):
        value = reply.get(name)
        return None if value is None else text(value)
    for line in text(reply).splitlines():
        key, _, value = line.partition(":")
        if key == name:
            return value.strip()
    return None


def replication_problem(
    acknowledged: Any,
    aof: Any,
    *,
    resource: str,
    min_replicas: int,
    appendonly: bool,
    timeout: float,
    where: str,
    error: Callable[[BaseException, str], Exception],
) -> Exception | None:
    """What is wrong with the ``WAIT`` (and ``WAITAOF``) that followed a granted acquire.

    Args:
        acknowledged: the reply of ``WAIT``, or the error it got.
        aof: the reply of ``WAITAOF`` or its error; ``None`` when it was not sent.
        resource: the resource.
        min_replicas: the replicas that must acknowledge the acquire.
        appendonly: the server itself writes an AOF (``WAITAOF`` counts it).
        timeout: the ``WAIT`` timeout in seconds, for messages.
        where: the server, for messages.
        error: turns an error of a call into the one to raise (the driver's own).

    Returns:
        The error to raise once the lock is released again, or ``None`` when the acquire
        was replicated (and fsynced) as required.
    """
    if isinstance(aof, Exception) and "unknown command" in str(aof).lower():
        return ConfigurationError(
            f"wait_aof needs Redis 7.2 or later (WAITAOF); {where} has no WAITAOF"
        )
    if isinstance(acknowledged, Exception):
        return error(acknowledged, "WAIT after the acquire")
    if int(acknowledged) < min_replicas:
        return BackendError(
            f"only {int(acknowledged)} of {min_replicas} replicas acknowledged the "
            f"acquire of {resource!r} within {timeout}s; the lock was "
            "released and its token not handed out (a failover could have lost it)",
            code="REPLICATION",
            retryable=True,
        )
    if isinstance(aof, Exception):
        return error(aof, "WAITAOF after the acquire")
    if aof is not None and (int(aof[1]) < min_replicas or (appendonly and int(aof[0]) < 1)):
        return BackendError(
            f"the acquire of {resource!r} was not fsynced to the AOF of "
            f"{min_replicas} replicas within {timeout}s; the lock was "
            "released and its token not handed out",
            code="REPLICATION",
            retryable=True,
        )
    return None
