"""The retry policy's decisions, without I/O: which errors a new lease can cure, and when.

:class:`fence.RetryPolicy` and :class:`fence.AsyncRetryPolicy` (``fence/_async/retry.py``,
the sync twin generated) are two thin loops over the schedule here: it counts attempts,
asks the predicate, picks the delay and reports :attr:`EventKind.RETRYING`.

The predicate is the point of the module. A unit of work under a lease fails in three ways
that running it again, under a new lease, can cure: a newer holder wrote first (stale), the
lease ran out or was lost before the work finished, and a transient backend failure that
wrote nothing. Every other error says something that a second run would say again: a bad
token, a write without a token, a setting, a missing row.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable
from types import TracebackType

from fence._clock import Clock, system_clock
from fence._core import backoff_delay
from fence._errors import (
    BackendError,
    ConfigurationError,
    InvalidResourceError,
    InvalidTokenError,
    LeaseExpiredError,
    Reason,
    StaleTokenError,
    TokenRequiredError,
)
from fence._events import EventBus, EventKind, default_bus

__all__ = ["Attempt", "RetrySchedule", "RetrySettings", "exponential_backoff", "is_retryable"]

#: Errors that say the same thing on every run: no predicate can make a policy retry them.
NEVER_RETRIED: tuple[type[Exception], ...] = (
    ConfigurationError,
    InvalidTokenError,
    InvalidResourceError,
    TokenRequiredError,  # UnfencedWriteError too
)

_SOURCE = "retry"


def is_retryable(error: BaseException) -> bool:
    """Whether running the unit of work again, under a new lease, may succeed.

    ``True`` for:

    - :class:`fence.StaleTokenError` with reason ``STALE`` (for a batch: every rejected
      item ``STALE``): a newer holder wrote first; a new lease brings a newer token.
    - :class:`fence.LeaseExpiredError` and :class:`fence.LeaseLostError`: the lease ran out
      or was lost before the work finished (``check()``, or a unit of work's commit).
    - :class:`fence.BackendError` with ``retryable=True``, :class:`fence.RetryableError`
      included: a transient failure (a serialization failure, a timeout, a dropped
      connection before the write) that wrote nothing.

    ``False`` for everything else, in particular ``MISSING`` and ``UNVERIFIABLE``
    rejections, :class:`fence.TokenRequiredError`, :class:`fence.InvalidTokenError`,
    :class:`fence.ConfigurationError`, :class:`fence.NotOwnerError` (the work may have
    landed before the lease ended), :class:`fence.AcquireTimeout` (the caller's own wait
    limit), a ``BackendError`` that is not retryable, errors from outside iofence, and
    anything that is not an :class:`Exception` (cancellation, ``KeyboardInterrupt``).

    Pass it to other retry libraries as they are: ``stamina.retry(on=fence.is_retryable)``,
    ``tenacity.retry_if_exception(fence.is_retryable)``.

    Example::

        >>> from fence import Reason, StaleTokenError, is_retryable
        >>> is_retryable(StaleTokenError("order:42", 33, 34, Reason.STALE))
        True
        >>> is_retryable(StaleTokenError("order:42", 34, 34, Reason.MISSING))
        False
    """
    if not isinstance(error, Exception) or isinstance(error, NEVER_RETRIED):
        return False
    if isinstance(error, StaleTokenError):
        return all(item.reason is Reason.STALE for item in error.rejected or (error,))
    if isinstance(error, LeaseExpiredError):
        return True
    if isinstance(error, BackendError):
        return error.retryable
    return False


def exponential_backoff(
    base: float = 0.05, cap: float = 2.0, *, rng: random.Random | None = None
) -> Callable[[int], float]:
    """A jittered exponential backoff: the delay before retry ``n`` (from 0).

    Uniform in ``[d / 2, d]`` with ``d = min(cap, base * 2**n)``: clients that failed
    together do not come back together. The same backoff the quorum manager uses after a
    split vote.

    Args:
        base: the longest delay before the first retry, in seconds.
        cap: the longest delay, in seconds.
        rng: the random source (default: the :mod:`random` module's).

    Raises:
        ConfigurationError: ``base`` or ``cap`` is negative, or ``cap < base``.
    """
    if not 0 <= base <= cap:
        raise ConfigurationError(f"need 0 <= base <= cap, got base={base!r} cap={cap!r}")

    def delay(retry: int) -> float:
        return backoff_delay(retry, base=base, cap=cap, rng=rng)

    return delay


class RetrySettings:
    """What a retry policy is made of; shared by :class:`fence.RetryPolicy` and its async twin.

    Args:
        attempts: how many times the unit of work may run, the first included (>= 1).
        timeout: stop retrying once a retry would start more than this many seconds after
            the first attempt started; ``None``: only ``attempts`` limits.
        backoff: the delay in seconds before retry ``n`` (from 0); any callable. Default:
            :func:`exponential_backoff` from 0.05 s, doubling, up to 2 s, jittered.
        on: which errors to retry (default :func:`is_retryable`). Errors that say the same
            on every run (:class:`fence.ConfigurationError`, :class:`fence.InvalidTokenError`,
            :class:`fence.InvalidResourceError`, :class:`fence.TokenRequiredError`) are never
            retried, whatever ``on`` says.
        events: where to report :attr:`fence.EventKind.RETRYING` (default:
            :data:`fence.default_bus`).
        clock: the monotonic clock ``timeout`` is measured on.

    Raises:
        ConfigurationError: ``attempts`` is not a positive ``int``, or ``timeout`` is not
            positive.
    """

    __slots__ = ("attempts", "backoff", "clock", "events", "on", "timeout")

    def __init__(
        self,
        attempts: int = 5,
        *,
        timeout: float | None = None,
        backoff: Callable[[int], float] | None = None,
        on: Callable[[Exception], bool] = is_retryable,
        events: EventBus | None = None,
        clock: Clock | None = None,
    ) -> None:
        if isinstance(attempts, bool) or not isinstance(attempts, int) or attempts < 1:
            raise ConfigurationError(f"attempts must be an int >= 1, got {attempts!r}")
        if timeout is not None and not timeout > 0:
            raise ConfigurationError(f"timeout must be > 0 seconds or None, got {timeout!r}")
        self.attempts = attempts
        self.timeout = timeout
        self.backoff = backoff or exponential_backoff()
        self.on = on
        self.events = events or default_bus
        self.clock: Clock = clock or system_clock

    def __repr__(self) -> str:
        return f"<{type(self).__name__} attempts={self.attempts} timeout={self.timeout}>"

    def schedule(self) -> RetrySchedule:
        """A fresh schedule for one call: attempts counted from 1, the clock started now."""
        return RetrySchedule(self)


class RetrySchedule:
    """One call's way through a policy: which attempt this is, and whether to go again."""

    __slots__ = ("_settings", "_started", "number")

    def __init__(self, settings: RetrySettings) -> None:
        self._settings = settings
        self._started = settings.clock.monotonic()
        self.number = 0

    def next(self) -> Attempt:
        """Start the next attempt."""
        self.number += 1
        return Attempt(self, self.number)

    def failed(self, error: BaseException) -> float | None:
        """The delay before the next attempt, or ``None``: give up and let ``error`` out."""
        settings = self._settings
        if not isinstance(error, Exception) or isinstance(error, NEVER_RETRIED):
            return None
        if self.number >= settings.attempts or not settings.on(error):
            return None
        delay = max(0.0, float(settings.backoff(self.number - 1)))
        if settings.timeout is not None:
            elapsed = settings.clock.monotonic() - self._started
            if elapsed + delay > settings.timeout:
                return None
        settings.events.emit(
            EventKind.RETRYING,
            _SOURCE,
            _scope_of(error),
            getattr(error, "token", None),
            delay,
            attempt=self.number,
            error=type(error).__name__,
        )
        return delay


def _scope_of(error: Exception) -> str:
    for name in ("resource", "scope"):
        value = getattr(error, name, None)
        if isinstance(value, str):
            return value
    return ""


class Attempt:
    """One run of the unit of work: a context manager that judges how the run ended.

    An error the policy retries is swallowed and the loop goes on after the backoff;
    any other error, and the last attempt's, leaves the block unchanged. Use it as the
    outermost context manager, so that the lease is taken and released inside it::

        for attempt in policy:
            with attempt, manager.lock("order:42") as lease:
                ...

    It also works with ``async with`` (``async with attempt, uow("order:42") as s:``).

    Attributes:
        number: which attempt this is, from 1.
    """

    __slots__ = ("_schedule", "number", "retry_after")

    def __init__(self, schedule: RetrySchedule, number: int) -> None:
        self._schedule = schedule
        self.number = number
        #: Seconds to wait before the next attempt; ``None`` when there is none.
        self.retry_after: float | None = None

    def __repr__(self) -> str:
        return f"<Attempt {self.number}>"

    def __enter__(self) -> Attempt:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        if exc is None:
            return False
        self.retry_after = self._schedule.failed(exc)
        return self.retry_after is not None

    async def __aenter__(self) -> Attempt:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool:
        return self.__exit__(exc_type, exc, tb)


def check_function(fn: Callable[..., object], policy: str, *, is_async: bool) -> None:
    """Refuse to decorate a function the policy would not actually retry.

    A sync policy on a coroutine function would retry the creation of the coroutine, not
    its run; an async policy on a plain function has nothing to await.

    Raises:
        ConfigurationError: ``fn`` is a coroutine function and the policy is sync, or the
            other way round.
    """
    if inspect.iscoroutinefunction(fn) != is_async:
        other = "RetryPolicy" if is_async else "AsyncRetryPolicy"
        kind = "a plain function" if is_async else "a coroutine function"
        raise ConfigurationError(
            f"{policy} cannot retry {getattr(fn, '__qualname__', fn)!r}, {kind}; use {other}"
        )
