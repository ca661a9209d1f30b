"""How the Redis guard reads what Redis answers: script replies and errors. No I/O.

A script's reply becomes the results of its operations or the error to raise
(:func:`decode`, :func:`parse_fence`); an error raised by redis-py becomes one of the
:class:`fence.FenceError` family (:func:`translate`). Written once for the sync and the
asyncio guard.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.exceptions import (
    BusyLoadingError,
    ClusterCrossSlotError,
    ClusterDownError,
    NoPermissionError,
    NoScriptError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import (
    ConnectionError as RedisConnectionError,
)
from redis.exceptions import (
    TimeoutError as RedisTimeoutError,
)

from fence import BackendError, FenceError, Reason, RetryableError, StaleTokenError
from fence._core import batch_rejection
from fence._redis_keys import CrossSlotError, resource_of

from ._redis_errors import PartialWriteError, RefusedWrite, UnissuedTokenError, WriteRefusedError
from ._redis_ops import Op

__all__ = [
    "METHODS",
    "SERVER_STATES",
    "decode",
    "pairs",
    "parse_fence",
    "pipeline_outcome",
    "read_error",
    "server_state",
    "translate",
]


def _int_or_none(raw: Any) -> int | None:
    if raw is None or isinstance(raw, list) or raw in ("", b""):
        return None
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return int(text) if text.isdigit() else None


#: The guard method behind each opcode, for errors.
METHODS = {
    "set": "set",
    "hset": "hset",
    "del": "delete",
    "incrby": "incr",
    "rpush": "rpush",
    "xadd": "xadd",
    "claim": "claim",
    "get": "read_for_update",
    "hgetall": "hgetall_for_update",
}

#: Error replies that are about the server's state, not one operation: the code the guard
#: raises them with, whether retrying may help, and what to do.
SERVER_STATES: dict[str, tuple[str, bool, str]] = {
    "OOM": ("OOM", False, "Redis is at maxmemory; free memory or raise maxmemory"),
    "READONLY": ("READONLY", True, "this server is a read-only replica; write to the master"),
    "MISCONF": ("MISCONF", False, "Redis refuses writes after a failed save; check its disk"),
    "NOREPLICAS": ("NOREPLICAS", True, "too few replicas for min-replicas-to-write"),
    "NOPERM": ("PERMISSION", False, "the ACL of the guard's user forbids it; see acl_rules()"),
    "BUSY": ("BUSY", True, "a long script is running; retry when it is done"),
    "LOADING": ("LOADING", True, "Redis is loading its dataset; retry shortly"),
    "MASTERDOWN": ("MASTERDOWN", True, "the replica lost its master; retry after failover"),
    "CLUSTERDOWN": ("CLUSTERDOWN", True, "the cluster is down; retry when it is back"),
    "TRYAGAIN": ("TRYAGAIN", True, "the slot is being migrated; retry"),
}

#: A data error reply (from ``redis.pcall``) -> the reason of its RefusedWrite.
_DATA_ERRORS = (
    ("WRONGTYPE", "WRONGTYPE"),
    ("NOPERM", "NOPERM"),
    ("ERR The user executing the script can't", "NOPERM"),  # Redis 7.0 inside a script
    ("ERR value is not an integer", "NOT_INTEGER"),
    ("ERR increment or decrement would overflow", "OVERFLOW"),
    ("ERR The ID specified in XADD", "STREAM_ID"),
    ("ERR The stream has exhausted", "STREAM_EXHAUSTED"),
    ("ERR Elements are too large", "TOO_LARGE"),
)


def server_state(message: str) -> str | None:
    """The :data:`SERVER_STATES` entry an error reply starts with, if any."""
    word = message.split(" ", 1)[0]
    return word if word in SERVER_STATES else None


def _text(raw: Any) -> str:
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)


def _refusal(ops: Sequence[Op], at: Any, code: Any, detail: Any) -> RefusedWrite:
    index = int(at) - 1
    op = ops[index]
    reason, text = _text(code), _text(detail)
    if reason == "ERROR":
        reason = next((r for prefix, r in _DATA_ERRORS if text.startswith(prefix)), "ERROR")
    return RefusedWrite(index, op.key, METHODS.get(op.code, op.code), reason, text)


def decode(token: int, ops: Sequence[Op], reply: Any) -> list[Any] | FenceError:
    """Turn a :data:`WRITE` or :data:`SET` reply into per-operation results, or an error.

    Returns:
        The results in operation order, or the error to raise: a
        :class:`fence.StaleTokenError` (for several operations, ``rejected`` lists one
        error per rejected key, C6), a :class:`WriteRefusedError`, a
        :class:`fence.BackendError` for a server state that refused the first write, or a
        :class:`PartialWriteError`.
    """
    if not isinstance(reply, list | tuple):  # a single operation's number, bare
        return [reply]
    status = int(reply[0])
    if status == 1:
        results = list(reply[1:])
        for i, op in enumerate(ops):
            if op.code == "incrby":  # above 2**53 the script sends the exact decimal string
                results[i] = int(results[i])
        return results
    if status == 2:
        refused = [_refusal(ops, *reply[at : at + 3]) for at in range(1, len(reply), 3)]
        state = server_state(refused[0].detail) if len(refused) == 1 else None
        if state is not None and refused[0].reason == "ERROR":
            code, retryable, advice = SERVER_STATES[state]
            item = refused[0]
            return BackendError(
                f"{item.key}: Redis refused the {item.op} with token {token} before writing"
                f" anything: {item.detail} ({advice})",
                code=code,
                retryable=retryable,
            )
        return WriteRefusedError(token, refused)
    if status == 3:
        failed = _refusal(ops, *reply[1:4])
        return PartialWriteError(token, applied=range(failed.index), failed=failed)
    errors: list[StaleTokenError] = []
    for at in range(1, len(reply), 4):
        op = ops[int(reply[at]) - 1]
        reason = _text(reply[at + 1])
        raw_fence, raw_issued = reply[at + 2], reply[at + 3]
        fence = _int_or_none(raw_fence)
        if reason == "UNISSUED":
            message = None
            if isinstance(raw_issued, list):
                message = (
                    f"{op.key}: token {token} cannot be shown to be issued: the issued counter"
                    f" holds a {_text(raw_issued[0])}, not an integer; nothing was written"
                )
            issued = _int_or_none(raw_issued) or 0
            errors.append(UnissuedTokenError(op.key, token, fence, issued=issued, message=message))
        else:
            message = _other_type(op.key, raw_fence) if isinstance(raw_fence, list) else None
            errors.append(StaleTokenError(op.key, token, fence, Reason(reason), message=message))
    if len(ops) == 1:
        return errors[0]
    return batch_rejection(resource_of(errors[0].scope), token, errors)


def _other_type(scope: str, held: Sequence[Any]) -> str:
    """The message of a verdict on a fence key that holds another type (``held`` is the
    script's ``{type}``)."""
    return (
        f"{scope}: the fence key holds a {_text(held[0])}, not a fence (an integer string);"
        " refusing to guess, nothing was written"
    )


def parse_fence(scope: str, raw: Any) -> int | None:
    """The fence stored at a fence key, or ``None``; raise if it is not an integer.

    Args:
        scope: the key or scope the fence protects.
        raw: what the fence key holds: a string, ``None`` or ``""`` for none, or the read
            script's ``[type]`` for a key of another type.

    Raises:
        StaleTokenError: reason ``UNVERIFIABLE``, the fence key holds something else.
    """
    if isinstance(raw, list):
        raise StaleTokenError(scope, 0, None, Reason.UNVERIFIABLE, message=_other_type(scope, raw))
    if raw is None or raw in ("", b""):
        return None
    value = _int_or_none(raw)
    if value is None:
        raise StaleTokenError(
            scope,
            0,
            None,
            Reason.UNVERIFIABLE,
            message=f"{scope}: the fence key holds {raw!r}, not an integer; refusing to guess",
        )
    return value


#: redis-py parses these error codes into classes and drops the code from the message.
_STATE_ERRORS: tuple[tuple[type[RedisError], str], ...] = (
    (OutOfMemoryError, "OOM"),
    (ReadOnlyError, "READONLY"),
    (NoPermissionError, "NOPERM"),
    (BusyLoadingError, "LOADING"),
    (ClusterDownError, "CLUSTERDOWN"),
    (TryAgainError, "TRYAGAIN"),
)


def translate(err: RedisError, what: str) -> FenceError:
    """Wrap a redis-py error in the FenceError family (the caller chains it with ``from``)."""
    if isinstance(err, RedisTimeoutError):
        return RetryableError(
            f"{what}: Redis did not answer in time; the write may or may not have been"
            " applied. Retrying with the same token is safe for set, hset, delete and claim;"
            " incr, rpush and xadd would apply twice.",
            code="TIMEOUT",
        )
    if isinstance(err, RedisConnectionError):
        return BackendError(
            f"{what}: lost the connection to Redis ({err}); the write may or may not have been"
            " applied. Retry once Redis is reachable (set, hset, delete and claim are safe to"
            " repeat with the same token).",
            code="CONNECTION",
            retryable=True,
        )
    text = str(err)
    if (
        isinstance(err, ClusterCrossSlotError)
        or (isinstance(err, RedisClusterException) and "same key slot" in text)
        # redis-py before 6.0 leaves the server's CROSSSLOT reply a plain ResponseError.
        or (isinstance(err, ResponseError) and text.startswith("CROSSSLOT"))
    ):
        return CrossSlotError(
            f"{what}: the keys of one fenced call hash to several cluster slots (the server"
            f" answered CROSSSLOT: {text})."
            " Give every key of a resource the same hash tag, e.g. '{order:42}:status'."
        )
    if isinstance(err, ResponseError):
        state = next((word for cls, word in _STATE_ERRORS if isinstance(err, cls)), None)
        state = state or server_state(text)
        if state is not None:
            # Redis refuses for its state only a script's first write (a script that wrote
            # may finish), and the scripts' error replies come from reads before it: a
            # state error reply means nothing was written.
            code, retryable, advice = SERVER_STATES[state]
            return BackendError(
                f"{what}: Redis refused the call, nothing was written: {text} ({advice})",
                code=code,
                retryable=retryable,
            )
        return BackendError(f"{what}: Redis refused the command: {text}", code="RESPONSE")
    return BackendError(f"{what}: Redis failed: {text}", code="BACKEND")


def read_error(err: RedisError, scope: str) -> FenceError:
    """:func:`translate` for a plain ``GET`` of the fence of ``scope``: a fence key of
    another type (``WRONGTYPE``) holds no fence, and is ``UNVERIFIABLE`` as
    :func:`parse_fence` has it."""
    if isinstance(err, ResponseError) and str(err).startswith("WRONGTYPE"):
        return StaleTokenError(
            scope,
            0,
            None,
            Reason.UNVERIFIABLE,
            message=f"{scope}: the fence key holds another type than a string, not a fence"
            " (an integer string); refusing to guess",
        )
    return translate(err, f"fence of {scope!r}")


def pairs(flat: Any) -> dict[Any, Any]:
    """A hash as ``HGETALL`` returns it (a flat field/value list, or a RESP3 map) as a dict."""
    if isinstance(flat, dict):  # RESP3 replies are already maps
        return flat
    items = list(flat or ())
    return dict(zip(items[0::2], items[1::2], strict=True))


def pipeline_outcome(token: int, op: Op, reply: Any) -> Any:
    """What one write of a fenced pipeline came to: its result, or the
    :class:`fence.FenceError` that rejected or failed it (chained to a redis-py error).

    Args:
        token: the write's token.
        op: the write.
        reply: its script's reply, or the redis-py error its call got (a ``NOSCRIPT``
            even after the script was loaded again).
    """
    if isinstance(reply, NoScriptError):
        vanished = RetryableError(
            f"{op.key}: the fenced-write script vanished twice; nothing was written",
            code="NOSCRIPT",
        )
        vanished.__cause__ = reply
        return vanished
    if isinstance(reply, RedisError):
        failure = translate(reply, op.key)
        failure.__cause__ = reply
        return failure
    outcome = decode(token, (op,), reply)
    return outcome if isinstance(outcome, FenceError) else outcome[0]
