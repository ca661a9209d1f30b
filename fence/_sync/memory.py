# WARNING: this file is generated from fence/_async/memory.py by tools/async_to_sync.py.
# Do not edit it; edit the source and run `python tools/async_to_sync.py`.
"""The in-memory lock manager for asyncio."""

from __future__ import annotations

from fence._clock import Clock
from fence._compat import Waiter
from fence._core import TokenMode
from fence._events import EventBus
from fence._memory import MemoryBackend
from fence._sync.manager import BaseLockManager
from fence.abc import AcquireReply, LockInfo

__all__ = ["MemoryDriver", "MemoryLockManager"]


class MemoryDriver:
    """Drives a :class:`MemoryBackend`; waits until it is resumed when it is paused."""

    source = "memory"

    def __init__(self, backend: MemoryBackend) -> None:
        self.backend = backend

    def _enter(self) -> None:
        while True:
            paused = self.backend.gate()
            if paused is None:
                return
            waiter = Waiter()
            if not paused.attach(waiter):
                waiter.wait(None)

    def acquire(self, resource: str, secret: str, ttl: float, holder: str) -> AcquireReply:
        """See :meth:`fence.abc.Driver.acquire`."""
        self._enter()
        return self.backend.acquire(resource, secret, ttl, holder)

    def renew(self, resource: str, secret: str, ttl: float) -> bool:
        """See :meth:`fence.abc.Driver.renew`."""
        self._enter()
        return self.backend.renew(resource, secret, ttl)

    def release(self, resource: str, secret: str) -> bool:
        """See :meth:`fence.abc.Driver.release`."""
        self._enter()
        return self.backend.release(resource, secret)

    def wait(self, resource: str, timeout: float, reply: AcquireReply) -> None:
        """Wait for a release, an expiry (seen on the backend's clock) or ``timeout``."""
        waiter = Waiter()
        if self.backend.attach(resource, waiter, reply.cookie):
            return
        try:
            waiter.wait(timeout)
        finally:
            self.backend.detach(resource, waiter)

    def inspect(self, resource: str) -> LockInfo | None:
        """See :meth:`fence.abc.Driver.inspect`."""
        self._enter()
        return self.backend.inspect(resource)

    def revoke(self, resource: str) -> int:
        """See :meth:`fence.abc.Driver.revoke`."""
        self._enter()
        return self.backend.revoke(resource)

    def close(self) -> None:
        """Nothing to close: the backend outlives its managers."""


class MemoryLockManager(BaseLockManager):
    """A lock manager for tasks of one process, with fencing tokens.

    Use it for tests, single-process programs and the embedded default. Several managers,
    sync and async, can share one :class:`MemoryBackend`.

    Args:
        backend: the shared state; a new private one by default.
        clock: the clock of a new backend and of this manager's deadlines.
        token_mode: the token mode of a new backend.
        **options: see :class:`BaseLockManager` (``ttl``, ``renew``, ``drift``,
            ``margin``, ``events``, ``reentrant``).

    Example::

        manager = MemoryLockManager()
        with manager.lock("report:2026-11", ttl=5) as lease:
            write_report(fence_token=lease.token)
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
            MemoryDriver(backend),
            ttl=ttl,
            renew=renew,
            drift=drift,
            margin=margin,
            clock=clock or backend.clock,
            events=events,
            reentrant=reentrant,
        )
