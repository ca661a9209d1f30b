"""The deadline of the current lock-manager call, handed from the manager to its driver.

``acquire(timeout=t)`` must return within ``t`` whatever the server does, so every round
trip it makes is bounded by the time left. The generic manager sets the deadline of each
driver call in a context variable; a driver reads it with :func:`time_left` and bounds its
I/O (socket reads, pool waits, connects) by it. A context variable reaches the driver
through any call chain without a new parameter in the driver protocol, and it is per task
under asyncio and per thread in the sync code.

The deadline is on :func:`time.monotonic`, the clock sockets time out on, whatever
clock the manager itself was given.
"""

from __future__ import annotations

import time
from contextvars import ContextVar, Token

__all__ = ["deadline", "reset", "set_deadline", "time_left"]

_deadline: ContextVar[float | None] = ContextVar("fence_call_deadline", default=None)


def deadline() -> float | None:
    """The current call's deadline on :func:`time.monotonic`, or ``None`` if it has none."""
    return _deadline.get()


def time_left(default: float) -> float:
    """Seconds the next round trip may take: ``default``, or less if the call's deadline is
    nearer. May be 0 or negative when the deadline has passed.

    Args:
        default: the driver's own limit (its socket timeout).
    """
    at = _deadline.get()
    if at is None:
        return default
    return min(default, at - time.monotonic())


def set_deadline(at: float | None) -> Token[float | None]:
    """Make ``at`` (``time.monotonic()`` seconds, or ``None``) the current call's deadline;
    pass the returned token to :func:`reset` afterwards."""
    return _deadline.set(at)


def reset(token: Token[float | None]) -> None:
    """Restore the deadline that was current before :func:`set_deadline`."""
    _deadline.reset(token)
