"""Run a unit of work again, under a new lease, after an error a new lease can cure.

Written once for asyncio; ``tools/async_to_sync.py`` generates the sync twin. The
decisions (which errors, how long to wait, when to stop) live in :mod:`fence._retry`.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

from fence._acompat import sleep
from fence._retry import Attempt, RetrySettings, check_function

__all__ = ["AsyncRetryPolicy"]

P = ParamSpec("P")
T = TypeVar("T")

IS_ASYNC = True  # unasync: IS_ASYNC = False


class AsyncRetryPolicy(RetrySettings):
    """Run a unit of work again under a new lease after a stale, lost-lease or retryable error.

    The unit of work must take its lease inside the retried block, so that each attempt
    runs under a new lease with a newer token: retry the block that acquires, never a
    block inside a held lease (a reentrant acquire would hand back the same token).

    Use it as a decorator (the function keeps its signature for type checkers)::

        policy = AsyncRetryPolicy(attempts=5)

        @policy
        async def pay(order_id: int) -> None:
            async with manager.lock(f"order:{order_id}") as lease:
                ...

    or as a loop of attempts, each one a context manager around the lease::

        async for attempt in policy:
            async with attempt, manager.lock("order:42") as lease:
                ...

    A retried error is swallowed and the block runs again after the backoff; the last
    attempt's error, and every error the policy does not retry, propagate unchanged.
    The whole block runs again, so it must be a unit: one that commits whole (a unit of
    work, a batch) or recomputes from what it reads under the new lease.

    Args:
        attempts: how many times the unit of work may run, the first included (>= 1).
        timeout: stop retrying once a retry would start more than this many seconds after
            the first attempt started; ``None``: only ``attempts`` limits.
        backoff: the delay in seconds before retry ``n`` (from 0); any callable. Default:
            :func:`fence.exponential_backoff` from 0.05 s, doubling, up to 2 s, jittered.
        on: which errors to retry (default :func:`fence.is_retryable`). Errors that say
            the same on every run (:class:`fence.ConfigurationError`,
            :class:`fence.InvalidTokenError`, :class:`fence.InvalidResourceError`,
            :class:`fence.TokenRequiredError`) are never retried, whatever ``on`` says.
        events: where to report :attr:`fence.EventKind.RETRYING` (default:
            :data:`fence.default_bus`).
        clock: the monotonic clock ``timeout`` is measured on.

    Raises:
        ConfigurationError: ``attempts`` is not a positive ``int``, or ``timeout`` is not
            positive.
    """

    __slots__ = ()

    async def __aiter__(self) -> AsyncIterator[Attempt]:
        """Yield attempts until one ends without an error the policy retries.

        Sleeps out the backoff between attempts. Enter each attempt (``with attempt``)
        around the whole unit of work, lease included.
        """
        schedule = self.schedule()
        while True:
            attempt = schedule.next()
            yield attempt
            if attempt.retry_after is None:
                return
            await sleep(attempt.retry_after)

    def __call__(
        self,
        fn: Callable[P, Awaitable[T]],  # unasync: fn: Callable[P, T],
    ) -> Callable[P, Coroutine[Any, Any, T]]:  # unasync: ) -> Callable[P, T]:
        """Decorate ``fn`` so that each call runs it under this policy.

        Raises:
            ConfigurationError: ``fn`` is a coroutine function given to the sync policy, or
                a plain function given to the async one.
        """
        check_function(fn, type(self).__name__, is_async=IS_ASYNC)

        @functools.wraps(fn)
        async def run(*args: P.args, **kwargs: P.kwargs) -> T:
            schedule = self.schedule()
            while True:
                attempt = schedule.next()
                with attempt:
                    return await fn(*args, **kwargs)
                assert attempt.retry_after is not None  # swallowed: a retry is due
                await sleep(attempt.retry_after)

        return run
