"""The errors of the Redis guard, shown as ``fence.adapters.redis.X``. No I/O.

Each carries its data as attributes and pickles (C5, C6). :class:`CrossSlotError` lives
with the key schema (:mod:`fence._redis_keys`), which raises it before any I/O; it is
re-exported here so that every error of the guard has one home in ``adapters``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fence import BackendError, FenceError, Reason, StaleTokenError
from fence._redis_keys import CrossSlotError

__all__ = [
    "CrossSlotError",
    "PartialWriteError",
    "RefusedWrite",
    "UnissuedTokenError",
    "WriteRefusedError",
]


class UnissuedTokenError(StaleTokenError):
    """The issuer check refused a token that was never issued (reason ``UNVERIFIABLE``).

    The token is above the resource's issued counter ``fence:{R}:token``, kept by a lock
    manager on the same Redis. It is forged or corrupted, comes from another cluster or
    environment, or the counter went back (a lost AOF tail, a failover, a restored backup).

    Attributes:
        issued: the issued counter the guard found, 0 if there was none.
    """

    def __init__(
        self,
        scope: str,
        token: int,
        fence: int | None,
        *,
        issued: int,
        message: str | None = None,
    ) -> None:
        if message is None:
            message = (
                f"{scope}: token {token} was never issued: the issued counter is {issued}"
                " (a forged or corrupted token, a token from another environment, or a"
                " counter that went back)"
            )
        super().__init__(scope, token, fence, Reason.UNVERIFIABLE, message=message)
        self.issued = issued


@dataclass(frozen=True, slots=True)
class RefusedWrite:
    """One operation Redis would refuse whatever the token, in a :class:`WriteRefusedError`.

    Attributes:
        index: the operation's position in its batch (0 for a single write).
        key: the data key.
        op: the guard method: ``set``, ``hset``, ``delete``, ``incr``, ``rpush``, ``xadd``,
            ``claim``, ``read_for_update`` or ``hgetall_for_update``.
        reason: ``WRONGTYPE`` (the key holds another type), ``NOT_INTEGER`` (``incr`` on a
            value Redis does not read as a 64-bit integer), ``OVERFLOW`` (the sum leaves
            int64), ``STREAM_ID`` (an ``xadd`` id at or below the stream's last id),
            ``STREAM_EXHAUSTED`` (the stream reached the last possible id), ``TOO_LARGE``
            (an entry above 1 GiB), ``NOPERM`` (the ACL of the guard's user forbids the
            command), or ``ERROR`` (another error of the server, in ``detail``).
        detail: a sentence: what Redis said or would say.
    """

    index: int
    key: str
    op: str
    reason: str
    detail: str


class WriteRefusedError(FenceError):
    """Redis would refuse some operations of a write, whatever the token; nothing was written.

    The guard checks every operation of a batch inside its script before the first write
    (C6), and a single write's data command runs before its fence is raised, so a data
    error never leaves half a write behind. This is not a verdict on the token: the token
    may be current. Fix the data or the call, then write again. When a batch has stale
    tokens too, :class:`fence.StaleTokenError` is raised instead: the token verdict wins.

    Attributes:
        token: the token of the write.
        refused: one :class:`RefusedWrite` per refused operation, in batch order.
    """

    def __init__(
        self, token: int, refused: Sequence[RefusedWrite], *, message: str | None = None
    ) -> None:
        refused = tuple(refused)
        if message is None:
            items = "; ".join(
                f"#{r.index} {r.op} {r.key!r}: {r.reason} ({r.detail})" for r in refused
            )
            what = f"{len(refused)} operations of this" if len(refused) > 1 else "this"
            message = (
                f"Redis would refuse {what} write with token {token}, so nothing was"
                f" written: {items}. This is not a token verdict: fix the data or the call"
                " and write again."
            )
        super().__init__(message)
        self.token = token
        self.refused = refused


class PartialWriteError(BackendError):
    """A fenced write failed halfway: some of its operations were applied (``code="PARTIAL"``).

    The guard's checks are meant to make this impossible (C6); when a case nobody foresaw
    gets through, it is reported, never hidden. The operations in ``applied`` were written
    and their fences raised; ``failed`` was not (or only in part); later ones were not.
    Inspect the keys before trying again, and please report it.

    Attributes:
        token: the token of the write.
        applied: the indices of the operations that were applied.
        failed: the operation that failed, with the server's error as ``detail``.
    """

    def __init__(
        self,
        token: int,
        *,
        applied: Sequence[int],
        failed: RefusedWrite,
        message: str | None = None,
    ) -> None:
        applied = tuple(applied)
        if message is None:
            done = (
                f"operations {list(applied)} were applied and their fences raised"
                if applied
                else "its data may have been written without its fence"
            )
            message = (
                f"PARTIAL: a fenced write with token {token} failed while applying #"
                f"{failed.index} {failed.op} {failed.key!r} ({failed.detail}) after part of"
                f" it landed: {done}. All-or-nothing is broken for this write: inspect"
                " these keys before writing again, and report it (the guard's checks should"
                " have refused it before any write)."
            )
        super().__init__(message, code="PARTIAL", retryable=False)
        self.token = token
        self.applied = applied
        self.failed = failed


for _cls in (
    UnissuedTokenError,
    RefusedWrite,
    WriteRefusedError,
    PartialWriteError,
):
    _cls.__module__ = "fence.adapters.redis"
del _cls
