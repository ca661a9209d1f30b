"""The error family of iofence, rooted at :class:`FenceError`.

Every error carries its data as attributes, survives ``pickle`` (so it can cross a process
pool or a task queue), and is shown as ``fence.X`` in tracebacks.
"""

from __future__ import annotations

import enum
from typing import Any

__all__ = [
    "AcquireTimeout",
    "BackendError",
    "ConfigurationError",
    "FenceError",
    "FenceWarning",
    "InvalidResourceError",
    "InvalidTokenError",
    "LeaseExpiredError",
    "LeaseLostError",
    "LockUpgradeError",
    "NotOwnerError",
    "ReadLeaseError",
    "Reason",
    "RetryableError",
    "StaleTokenError",
    "TokenRequiredError",
    "TransactionRefusedError",
    "UnfencedWriteError",
]


class Reason(enum.StrEnum):
    """Why a guarded write was rejected (C5).

    Attributes:
        STALE: the presented token is older than the fence of the scope.
        MISSING: the write updates a row or key that does not exist. Creation is its own
            fenced insert or upsert; an update of nothing is never a success.
        UNVERIFIABLE: the storage cannot prove the write was fenced (a NULL fence column,
            a driver that does not report row counts). Refused rather than guessed (C9).
    """

    STALE = "STALE"
    MISSING = "MISSING"
    UNVERIFIABLE = "UNVERIFIABLE"


def _restore(cls: type[FenceError], args: tuple[Any, ...], state: dict[str, Any]) -> FenceError:
    err = cls.__new__(cls)
    err.args = args
    err.__dict__.update(state)
    return err


class FenceError(Exception):
    """Root of every error iofence raises.

    Catch this to handle any iofence failure. Subclasses carry structured data as attributes;
    ``str(err)`` is a sentence meant for a person.
    """

    def __reduce__(self) -> tuple[Any, ...]:
        # The default reduction calls ``cls(*self.args)``, which loses keyword-only data.
        return (_restore, (type(self), self.args, dict(self.__dict__)))


class FenceWarning(UserWarning):
    """A setting that weakens the contract without breaking it outright.

    For example a Redis ``maxmemory-policy`` that may evict token counters and fences, or
    counter-mode tokens on a server without persistence. Filter it with the usual
    :mod:`warnings` machinery.
    """


class InvalidTokenError(FenceError, ValueError):
    """A fencing token is not an ``int`` in ``1 .. 2**53 - 1`` (C1).

    Raised before any I/O. ``bool``, ``float``, ``str`` and ``None`` are refused even when
    they look like integers, because a token that silently changed type is a bug upstream.

    Attributes:
        value: the rejected value, as given.
    """

    def __init__(self, message: str, *, value: object = None) -> None:
        super().__init__(message)
        self.value = value


class InvalidResourceError(FenceError, ValueError):
    """A resource or scope name is empty, too long, or not a ``str``.

    Attributes:
        value: the rejected value, as given.
    """

    def __init__(self, message: str, *, value: object = None) -> None:
        super().__init__(message)
        self.value = value


class ConfigurationError(FenceError, ValueError):
    """An argument or a backend setting makes the contract impossible to keep."""


class LockUpgradeError(ConfigurationError):
    """An owner that holds a read lease asked for a write lease on the same resource (C13).

    Refused before any I/O. An upgrade deadlocks: two readers that both wait to become the
    writer each wait for the other to leave. Release the read lease, then acquire the
    write lease (and read again under it), or take the write lease from the start.

    Attributes:
        resource: the resource.
        token: the token of the read lease the owner holds.
    """

    def __init__(self, message: str, *, resource: str | None = None, token: int | None = None):
        super().__init__(message)
        self.resource = resource
        self.token = token


class StaleTokenError(FenceError):
    """A guarded write was rejected; nothing was written (C5).

    Attributes:
        scope: what the fence protects: a Redis key, ``table(key)`` or a register scope.
        token: the token that was presented.
        fence: the fence the storage held when it refused, or ``None`` if it has none.
        reason: a :class:`Reason`.
        rejected: for a batch (C6), one error per rejected item; empty otherwise.
    """

    def __init__(
        self,
        scope: str,
        token: int,
        fence: int | None,
        reason: Reason = Reason.STALE,
        *,
        rejected: tuple[StaleTokenError, ...] = (),
        message: str | None = None,
    ) -> None:
        if message is None:
            message = _stale_message(scope, token, fence, reason, rejected)
        super().__init__(message)
        self.scope = scope
        self.token = token
        self.fence = fence
        self.reason = Reason(reason)
        self.rejected = rejected


def _stale_message(
    scope: str,
    token: int,
    fence: int | None,
    reason: Reason,
    rejected: tuple[StaleTokenError, ...],
) -> str:
    if rejected and len(rejected) > 1:
        items = "; ".join(f"{e.scope}: {e.reason} (fence {e.fence})" for e in rejected)
        return f"write with token {token} rejected on {len(rejected)} scopes: {items}"
    if reason is Reason.MISSING:
        return f"{scope}: update with token {token} found nothing to update (fence {fence})"
    if reason is Reason.UNVERIFIABLE:
        return f"{scope}: write with token {token} cannot be verified (fence {fence})"
    return f"{scope}: token {token} is older than the fence {fence}; a newer holder wrote"


class TokenRequiredError(FenceError):
    """A write to a fenced table, model or key came without a token (C9).

    Attributes:
        scope: what the write targeted.
    """

    def __init__(self, message: str, *, scope: str | None = None) -> None:
        super().__init__(message)
        self.scope = scope


class UnfencedWriteError(TokenRequiredError):
    """A write that cannot carry its token to the storage was refused before any I/O (C9).

    Raised for raw SQL that writes a fenced table (the hook cannot read it), for a write
    to a table without a fence in a session bound to a lease, for bulk paths that bypass
    the flush, and for Core writes the hook cannot fence. The message names the fenced
    way to do the same, and the explicit opt-out where one exists. A subclass of
    :class:`TokenRequiredError`, so code that handles a missing token handles it too.

    Attributes:
        scope: the table (or key) the write targeted.
    """


class ReadLeaseError(UnfencedWriteError):
    """A write under a read lease was refused before any I/O (C13).

    A read lease is shared: other readers hold the same lock at the same time, so its
    token cannot fence a write. The session hook, the unit of work and the repository
    wrapper raise it for every write path of a session bound to a read lease. Take a
    write lease (``manager.write_lock``) for the work that writes.

    Attributes:
        scope: what the write targeted (a table, a model), if known.
        token: the read lease's token.
    """

    def __init__(self, message: str, *, scope: str | None = None, token: int | None = None):
        super().__init__(message, scope=scope)
        self.token = token


class TransactionRefusedError(FenceError):
    """A statement or the commit of a transaction that was refused before (C8, C9).

    Once a transaction bound to a lease is refused (its claim refused or failed, one of its
    fenced writes refused, or its lease found lost at commit) it holds no claim the
    storage can trust. Code that caught that first error and carried on would write, and
    commit, without one; so every later statement of the transaction, and its commit,
    raise this error until the transaction is rolled back, as SQLAlchemy's
    ``PendingRollbackError`` does after a failed flush. The rollback ends it; the next
    transaction claims again::

        A (token 33)  BEGIN; claim 33 -> refused (fence 34)    StaleTokenError
        A catches it; session.add(row); session.commit()       TransactionRefusedError
        A: session.rollback()                                  the next transaction claims again

    Attributes:
        first: the error that refused the transaction first (a :class:`StaleTokenError`,
            a :class:`LeaseLostError`, or the error of a claim that failed).
    """

    def __init__(self, message: str, *, first: FenceError | None = None) -> None:
        super().__init__(message)
        self.first = first


class LeaseExpiredError(FenceError):
    """The lease has less time left than the caller asked for, or none (C10).

    Attributes:
        resource: the leased resource.
        token: the lease's token.
        remaining: seconds the client still counted when the check failed (may be negative).
    """

    def __init__(
        self,
        message: str,
        *,
        resource: str | None = None,
        token: int | None = None,
        remaining: float | None = None,
    ) -> None:
        super().__init__(message)
        self.resource = resource
        self.token = token
        self.remaining = remaining


class LeaseLostError(LeaseExpiredError):
    """The lease is known to be gone: a renewal failed, it was revoked, or it expired.

    Attributes:
        cause: a short description of what made the lease lost.
    """

    def __init__(
        self,
        message: str,
        *,
        resource: str | None = None,
        token: int | None = None,
        remaining: float | None = None,
        cause: str | None = None,
    ) -> None:
        super().__init__(message, resource=resource, token=token, remaining=remaining)
        self.cause = cause


class NotOwnerError(FenceError):
    """Release or renewal by someone who does not hold the lock (C11).

    The lock of the current holder, if any, is untouched.

    Attributes:
        resource: the resource named in the call.
    """

    def __init__(self, message: str, *, resource: str | None = None) -> None:
        super().__init__(message)
        self.resource = resource


class AcquireTimeout(FenceError, TimeoutError):
    """A blocking acquire did not get the lock within its wait timeout.

    Attributes:
        resource: the resource that was asked for.
        timeout: the wait timeout, in seconds.
    """

    def __init__(self, message: str, *, resource: str | None = None, timeout: float | None = None):
        super().__init__(message)
        self.resource = resource
        self.timeout = timeout


class BackendError(FenceError):
    """The backend failed: connection lost, server restarted, bad reply.

    The driver's own exception is chained as ``__cause__``. The message says what to do.

    Attributes:
        code: a short machine-readable code, e.g. ``"CONNECTION"``, ``"POOL"`` (a
            client-side connection limit), ``"TIMEOUT"``.
        retryable: ``True`` when the same call may succeed if repeated.
        sent: ``False`` when the request certainly never reached the backend (no
            connection could be opened, or none was free), so it changed nothing; ``True``
            or ``None`` when it may have run.
    """

    def __init__(
        self,
        message: str,
        *,
        code: str = "BACKEND",
        retryable: bool = False,
        sent: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.code = code
        self.retryable = retryable
        self.sent = sent


class RetryableError(BackendError):
    """A transient failure that is never a verdict on the token (C5).

    Serialization failures (SQLSTATE 40001), a Lua script missing from the script cache and
    timeouts raise this: the write did not happen and may be retried as a whole.
    """

    def __init__(self, message: str, *, code: str = "RETRY") -> None:
        super().__init__(message, code=code, retryable=True)


for _cls in (
    FenceError,
    FenceWarning,
    InvalidTokenError,
    InvalidResourceError,
    ConfigurationError,
    StaleTokenError,
    TokenRequiredError,
    UnfencedWriteError,
    TransactionRefusedError,
    LeaseExpiredError,
    LeaseLostError,
    LockUpgradeError,
    NotOwnerError,
    ReadLeaseError,
    AcquireTimeout,
    BackendError,
    RetryableError,
    Reason,
):
    _cls.__module__ = "fence"
del _cls
