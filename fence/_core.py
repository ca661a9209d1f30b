"""The contract as plain functions: no I/O, no clocks read, written once.

Every backend and guard calls these, and the Lua scripts and SQL statements mirror them.
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Sequence

from fence._errors import (
    ConfigurationError,
    InvalidResourceError,
    InvalidTokenError,
    ReadLeaseError,
    Reason,
    StaleTokenError,
)

__all__ = [
    "MAX_RESOURCE_LENGTH",
    "MAX_TOKEN",
    "LeaseMode",
    "ReadToken",
    "TokenMode",
    "accepts",
    "backoff_delay",
    "batch_rejection",
    "check_read",
    "client_deadline",
    "issue_token",
    "rejection",
    "validate_mode",
    "validate_resource",
    "validate_token",
    "validate_ttl",
]

#: The largest token (C1). Lua numbers and JSON stay exact below it.
MAX_TOKEN = 2**53 - 1

#: Longest resource or scope name, in UTF-8 bytes. Redis keys and SQL primary keys with room
#: for a prefix stay well inside what both store efficiently.
MAX_RESOURCE_LENGTH = 512


class ReadToken(int):
    """The token of a read lease (C13): an ``int`` that guarded writes refuse.

    A read lease is shared with other readers, so its token proves nothing about who
    writes. Every guarded write, claim and registering read refuses a ``ReadToken`` with
    :class:`ReadLeaseError` before any I/O; checked reads (:func:`check_read`) and a
    read-only session (``bind(..., mode="read")``) take it. It compares, hashes, prints and
    pickles as the number it is. A token turned into a plain ``int`` (``int(token)``, or a
    trip through JSON to another process) is no longer recognised as a reader's: keep the
    lease where the work runs.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        return f"ReadToken({int.__repr__(self)})"

    __str__ = int.__repr__


def validate_token(token: object, *, read: bool = False) -> int:
    """Return ``token`` if it is a valid fencing token, else raise (C1).

    Args:
        token: the value to check.
        read: the caller only reads under the token (a checked read): a read lease's token
            (:class:`ReadToken`) is welcome. Otherwise the token is for a write, a claim or
            a registering read, and a read lease's token is refused.

    Returns:
        The token as a plain ``int``.

    Raises:
        InvalidTokenError: ``token`` is not an ``int`` (``bool`` is refused) or is outside
            ``1 .. 2**53 - 1``.
        ReadLeaseError: ``token`` is a read lease's and ``read`` is false (C13).
    """
    if type(token) is int and 0 < token <= MAX_TOKEN:
        return token  # the common case: a plain int in range (no subclass, no bool)
    if isinstance(token, ReadToken) and not read:
        raise ReadLeaseError(
            f"token {int.__repr__(token)} is a read lease's: a read lease is shared with "
            "other readers, so its token cannot fence a write, a claim or a registering "
            "read. Take a write lease (manager.write_lock(resource)) for work that writes; "
            "under a read lease, read and check with fence.check_read",
            token=int.__index__(token),
        )
    if isinstance(token, bool) or not isinstance(token, int):
        raise InvalidTokenError(
            f"a fencing token must be an int, got {type(token).__name__} {token!r}",
            value=token,
        )
    # The int's own value, read by int's slot: a subclass may override __int__, __index__
    # and the comparisons, and the storage must get the number that was checked.
    value = int.__index__(token)
    if not 1 <= value <= MAX_TOKEN:
        raise InvalidTokenError(
            f"a fencing token must be in 1..2**53-1, got {value}",
            value=token,
        )
    return value


def validate_resource(resource: object, *, what: str = "resource") -> str:
    """Return ``resource`` if it is a usable resource or scope name, else raise.

    Args:
        resource: the name to check.
        what: the word used in the error message (``"resource"``, ``"scope"``).

    Raises:
        InvalidResourceError: not a ``str``, empty, longer than :data:`MAX_RESOURCE_LENGTH`
            bytes in UTF-8, or containing a NUL character.
    """
    if not isinstance(resource, str):
        raise InvalidResourceError(
            f"a {what} name must be a str, got {type(resource).__name__}", value=resource
        )
    if not resource:
        raise InvalidResourceError(f"a {what} name must not be empty", value=resource)
    if "\x00" in resource:
        raise InvalidResourceError(f"a {what} name must not contain NUL", value=resource)
    size = len(resource.encode("utf-8", "surrogatepass"))
    if size > MAX_RESOURCE_LENGTH:
        raise InvalidResourceError(
            f"a {what} name is at most {MAX_RESOURCE_LENGTH} bytes, got {size}",
            value=resource[:64] + "...",
        )
    return resource


def validate_ttl(ttl: object, *, what: str = "ttl") -> float:
    """Return ``ttl`` in seconds if it is a finite positive number of at least 1 ms."""
    if isinstance(ttl, bool) or not isinstance(ttl, int | float):
        raise ConfigurationError(f"{what} must be a number of seconds, got {ttl!r}")
    value = float(ttl)
    if not math.isfinite(value) or value < 0.001:
        raise ConfigurationError(f"{what} must be at least 0.001 seconds, got {ttl!r}")
    return value


class TokenMode(enum.StrEnum):
    """How a manager computes the next token (C2, C3).

    Attributes:
        HYBRID: ``max(last + 1, backend clock in microseconds)``. If the stored counter is
            lost (an AOF tail, a failover, a restored backup), the backend's clock still puts
            the next token above every token issued before, as long as that clock did not go
            back. The default.
        COUNTER: ``last + 1``. Small, dense numbers; survives only what the stored counter
            survives.
    """

    HYBRID = "hybrid"
    COUNTER = "counter"


class LeaseMode(enum.StrEnum):
    """What a lease allows (C13): many readers, or one writer.

    Attributes:
        READ: a shared lease. Readers hold the lock together; no writer holds it while any
            reader does. A read lease never writes: integrations refuse it for writes.
        WRITE: an exclusive lease, the default: no other writer and no reader holds the lock.
    """

    READ = "read"
    WRITE = "write"


def validate_mode(mode: object) -> LeaseMode:
    """Return ``mode`` as a :class:`LeaseMode` (``"read"`` or ``"write"``), else raise.

    Raises:
        ConfigurationError: anything else, before any I/O.
    """
    if isinstance(mode, LeaseMode):
        return mode
    if isinstance(mode, str):
        try:
            return LeaseMode(mode)
        except ValueError:
            pass
    raise ConfigurationError(f'mode must be "read" or "write", got {mode!r}')


def issue_token(last: int, clock_us: int, mode: TokenMode = TokenMode.HYBRID) -> int:
    """Compute the token for a new acquisition (C2, C3).

    Args:
        last: the last token issued for the resource, 0 if none is known.
        clock_us: the backend's clock in whole microseconds since the epoch.
        mode: :class:`TokenMode`.

    Raises:
        InvalidTokenError: the next token would exceed :data:`MAX_TOKEN`.
    """
    nxt = last + 1 if mode is TokenMode.COUNTER else max(last + 1, clock_us)
    if nxt > MAX_TOKEN:
        raise InvalidTokenError(f"token space exhausted: next token {nxt} > 2**53-1", value=nxt)
    return nxt


def accepts(token: int, fence: int | None) -> bool:
    """The acceptance rule (C4): a write with ``token`` passes a fence iff ``token >= fence``.

    A missing fence counts as 0. Equal tokens pass because a holder writes more than once.
    """
    return token >= (fence or 0)


def check_read(scope: str, token: int, fence: int | None) -> None:
    """A checked read under a read lease: refuse it if a newer writer has written.

    A reader never raises a fence (concurrent readers would refuse each other). Instead it
    reads the data together with its fence (one atomic step: ``RedisGuard.get``, a row's
    fence column, ``FenceRegister.fence`` in the transaction) and calls this afterwards:
    the read stands iff ``fence <= token``, that is, no writer whose lease came after the
    reader's wrote what was read. Equal tokens pass (the reader's own lease).

    Args:
        scope: what was read (for the error).
        token: the read lease's token.
        fence: the fence read with the data, ``None`` if there is none.

    Raises:
        StaleTokenError: ``STALE``: the fence is above ``token``; a writer newer than the
            reader's lease wrote, so the read may mix states. Read again under a new lease.
        InvalidTokenError: ``token`` is not a valid token.
    """
    token = validate_token(token, read=True)
    if fence is not None and fence > token:
        raise StaleTokenError(
            scope,
            token,
            fence,
            Reason.STALE,
            message=(
                f"{scope}: read under token {token} is stale: the fence is {fence}, a writer "
                "newer than the read lease wrote; read again under a new lease"
            ),
        )


def rejection(
    scope: str,
    token: int,
    fence: int | None,
    *,
    exists: bool = True,
    fence_is_null: bool = False,
) -> StaleTokenError:
    """Build the error for a guarded write that changed nothing (C5).

    Guards call this after their conditional write matched no row or key, with what a
    diagnostic read found.

    Args:
        scope: what the write targeted.
        token: the presented token.
        fence: the current fence, or ``None`` if there is none.
        exists: whether the row or key exists (``False`` gives ``MISSING`` unless stale).
        fence_is_null: the row exists but its fence column is NULL (C9).
    """
    if fence_is_null:
        reason = Reason.UNVERIFIABLE
    elif not accepts(token, fence):
        reason = Reason.STALE
    elif not exists:
        reason = Reason.MISSING
    else:
        # The row exists and the token passes, yet the write changed nothing: a concurrent
        # writer must have moved the fence between the write and the read. Refuse as stale
        # rather than report a success that did not happen.
        reason = Reason.STALE
    return StaleTokenError(scope, token, fence, reason)


def batch_rejection(scope: str, token: int, errors: Sequence[StaleTokenError]) -> StaleTokenError:
    """One error for an all-or-nothing batch, listing every rejected item (C6).

    Every guard builds its batch verdicts here, so they read the same: the headline reason
    is ``STALE`` if any item is stale (a newer holder wrote), else ``UNVERIFIABLE`` if any
    item is, else ``MISSING``; the headline fence is the highest one. A batch with one
    rejected item is headlined by that item.

    Args:
        scope: what the batch targeted (a table name, a resource).
        token: the presented token.
        errors: one error per rejected item, at least one.
    """
    reasons = {e.reason for e in errors}
    reason = next(r for r in (Reason.STALE, Reason.UNVERIFIABLE, Reason.MISSING) if r in reasons)
    if len(errors) == 1:
        only = errors[0]
        return StaleTokenError(only.scope, token, only.fence, only.reason, rejected=tuple(errors))
    fences = [e.fence for e in errors if e.fence is not None]
    return StaleTokenError(
        scope, token, max(fences) if fences else None, reason, rejected=tuple(errors)
    )


def client_deadline(sent_at: float, ttl: float, *, drift: float, margin: float) -> float:
    """The moment the client must stop trusting a lease (C10).

    ``sent_at + ttl * (1 - drift) - margin``, where ``sent_at`` is read on a monotonic clock
    *before* the acquire or renew request is sent. The backend starts its own ttl when the
    request arrives, later, on its own clock, so the client's view ends first as long as the
    two clocks' rates differ by less than ``drift``.

    Raises:
        ConfigurationError: the arguments leave no valid lease time.
    """
    if not 0 <= drift < 1:
        raise ConfigurationError(f"drift must be in [0, 1), got {drift!r}")
    if margin < 0:
        raise ConfigurationError(f"margin must be >= 0, got {margin!r}")
    validity = ttl * (1 - drift) - margin
    if validity <= 0:
        raise ConfigurationError(
            f"ttl {ttl}s leaves no validity after drift {drift} and margin {margin}s"
        )
    return sent_at + validity


def backoff_delay(
    attempt: int, *, base: float, cap: float, rng: random.Random | None = None
) -> float:
    """A jittered exponential backoff: uniform in ``[d / 2, d]``.

    ``d = min(cap, base * 2**attempt)``.

    The delay is random so that clients that failed together (a split vote of the quorum
    manager, contention under a retry policy) do not collide again on the next attempt.

    Args:
        attempt: how many attempts failed before this one (0 for the first retry).
        base: the delay before the first retry, in seconds.
        cap: the longest delay, in seconds.
        rng: the random source (default: the :mod:`random` module's).
    """
    ceiling = min(cap, base * 2 ** min(attempt, 30))
    return (rng or random).uniform(ceiling / 2, ceiling)
