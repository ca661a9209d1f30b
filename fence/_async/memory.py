"""The in-memory lock manager for asyncio."""

from __future__ import annotations

import time

from fence._acompat import Waiter
from fence._async.manager import AsyncBaseLockManager
from fence._clock import Clock
from fence._core import LeaseMode, TokenMode
from fence._deadline import deadline
from fence._errors import BackendError
from fence._events import EventBus
from fence._memory import MemoryBackend
from fence.abc import AcquireReply, LockInfo

__all__ = ["AsyncMemoryDriver", "AsyncMemoryLockManager"]


class AsyncMemoryDriver:
    """Drives a :class:`MemoryBackend`; waits until it is resumed when it is paused, or
    until the caller's deadline (:mod:`fence._deadline`), as a frozen server would make a
    client wait for its socket timeout."""

    source = "memory"
    #: Grants read leases (C13).
    shared = True

    def __init__(self, backend: MemoryBackend) -> None:
        self.backend = backend

    async def _enter(self, what: str, resource: str) -> None:
        while True:
            paused = self.backend.gate()
            if paused is None:
                return
            at = deadline()
            waiter = Waiter()
            if paused.attach(waiter):
                continue
            try:
                if not await waiter.wait(None if at is None else at - time.monotonic()):
                    raise BackendError(
                        f"the memory backend is paused: the {what} of {resource!r} did not "
                        "run before the caller's deadline (nothing was done)",
                        code="CONNECTION",
                        retryable=True,
                        sent=False,
                    )
            finally:
                paused.detach(waiter)

    async def acquire(
        self,
        resource: str,
        secret: str,
        ttl: float,
        holder: str,
        mode: LeaseMode = LeaseMode.WRITE,
    ) -> AcquireReply:
        """See :meth:`fence.abc.AsyncDriver.acquire`."""
        await self._enter("acquire", resource)
        return self.backend.acquire(resource, secret, ttl, holder, mode)

    async def renew(self, resource: str, secret: str, ttl: float) -> bool:
        """See :meth:`fence.abc.AsyncDriver.renew`."""
        await self._enter("renew", resource)
        return self.backend.renew(resource, secret, ttl)

    async def release(self, resource: str, secret: str) -> bool:
        """See :meth:`fence.abc.AsyncDriver.release`."""
        await self._enter("release", resource)
        return self.backend.release(resource, secret)

    async def wait(self, resource: str, timeout: float, reply: AcquireReply) -> None:
        """Wait for a release, an expiry (seen on the backend's clock) or ``timeout``."""
        waiter = Waiter()
        if self.backend.attach(resource, waiter, reply.cookie):
            return
        try:
            await waiter.wait(timeout)
        finally:
            self.backend.detach(resource, waiter)

    async def abandon(self, resource: str, secret: str) -> None:
        """A waiter gave up: take it out of the resource's queue."""
        self.backend.abandon(resource, secret)

    async def inspect(self, resource: str) -> LockInfo | None:
        """See :meth:`fence.abc.AsyncDriver.inspect`."""
        await self._enter("inspect", resource)
        return self.backend.inspect(resource)

    async def list_page(
        self, prefix: str, cursor: str | None, count: int
    ) -> tuple[list[LockInfo], str | None]:
        """One page of held locks, by resource; the cursor is the last resource listed."""
        await self._enter("list", prefix)
        return self.backend.list_page(prefix, cursor, count)

    async def revoke(self, resource: str) -> int:
        """See :meth:`fence.abc.AsyncDriver.revoke`."""
        await self._enter("revoke", resource)
        return self.backend.revoke(resource)

    async def close(self) -> None:
        """Nothing to close: the backend outlives its managers."""


class AsyncMemoryLockManager(AsyncBaseLockManager):
    """A lock manager for tasks of one process, with fencing tokens.

    Use it for tests, single-process programs and the embedded default. Several managers,
    sync and async, can share one :class:`MemoryBackend`.

    Args:
        backend: the shared state; a new private one by default.
        clock: the clock of a new backend and of this manager's deadlines.
        token_mode: the token mode of a new backend.
        **options: see :class:`AsyncBaseLockManager` (``ttl``, ``renew``, ``drift``,
            ``margin``, ``events``, ``reentrant``).

    Example::

        manager = AsyncMemoryLockManager()
        async with manager.lock("report:2026-11", ttl=5) as lease:
            await write_report(fence_token=lease.token)
    """

    def __init__(
        self,
        backend: MemoryBackend | None = None,
        *,
        clock: Clock | None = None,
        token_mode: TokenMode = TokenMode.HYBRID,
        ttl: float = 30.0,
        renew: bool = False,
        drift: float = 0.01,
        margin: float = 0.002,
        events: EventBus | None = None,
        reentrant: bool = True,
    ) -> None:
        if backend is None:
            backend = MemoryBackend(clock, token_mode)
        self.backend = backend
        super().__init__(
            AsyncMemoryDriver(backend),
            ttl=ttl,
            renew=renew,
            drift=drift,
            margin=margin,
            clock=clock or backend.clock,
            events=events,
            reentrant=reentrant,
        )
