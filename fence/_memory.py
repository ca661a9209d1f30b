"""The in-memory backend: lock state for one process, shared by sync and async managers.

It is also the test kit's pausable backend: :meth:`MemoryBackend.pause` stalls every call,
:meth:`MemoryBackend.fail` makes every call fail, and :meth:`MemoryBackend.forget_tokens`
loses the token counters the way a crashed server can.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from fence._clock import Clock, subscribe, system_clock
from fence._core import TokenMode, issue_token
from fence._errors import BackendError
from fence._signal import Signal, Wakeable
from fence.abc import AcquireReply, LockInfo

__all__ = ["MemoryBackend"]


@dataclass(slots=True)
class _Entry:
    secret: str
    token: int
    expires_at: float
    holder: str


class MemoryBackend:
    """Lock state and token counters in this process, on an injected clock.

    One backend can serve several managers, sync and async, in any threads. Expiry is
    decided by the backend's clock, like a server's would be.

    Args:
        clock: the backend's clock; pass a :class:`fence.testing.ManualClock` to control it.
        token_mode: :attr:`TokenMode.HYBRID` (default) or :attr:`TokenMode.COUNTER`.
    """

    def __init__(
        self, clock: Clock | None = None, token_mode: TokenMode = TokenMode.HYBRID
    ) -> None:
        self.clock: Clock = clock or system_clock
        self.token_mode = TokenMode(token_mode)
        self._mutex = threading.Lock()
        self._locks: dict[str, _Entry] = {}
        self._last: dict[str, int] = {}
        self._versions: dict[str, int] = {}
        self._waiters: dict[str, list[Wakeable]] = {}
        self._running = Signal()
        self._running.set()
        self._failure: str | None = None
        self._unsubscribe = subscribe(self.clock, self._wake_all)

    # -- fault injection ----------------------------------------------------------------

    def pause(self) -> None:
        """Stall every call until :meth:`resume`, like a frozen server or a cut network."""
        with self._mutex:
            if self._running.is_set():
                self._running = Signal()

    def resume(self) -> None:
        """Let stalled and new calls through again."""
        self._running.set()

    @property
    def paused(self) -> bool:
        """Whether calls are stalled."""
        return not self._running.is_set()

    def fail(self, message: str | None = "memory backend is down (injected)") -> None:
        """Make every call raise a retryable :class:`BackendError`; ``None`` heals it."""
        self._failure = message

    def forget_tokens(self) -> None:
        """Lose every token counter and lease, as a server that lost its data would (C3)."""
        with self._mutex:
            self._last.clear()
            self._locks.clear()
            self._bump_all()

    # -- what the drivers call ----------------------------------------------------------

    def gate(self) -> Signal | None:
        """Raise if failing; return the signal to wait on if paused, else ``None``."""
        if self._failure is not None:
            raise BackendError(self._failure, code="CONNECTION", retryable=True)
        running = self._running
        return None if running.is_set() else running

    def acquire(self, resource: str, secret: str, ttl: float, holder: str) -> AcquireReply:
        """One acquire attempt; see :meth:`fence.abc.AsyncDriver.acquire`."""
        with self._mutex:
            now = self.clock.monotonic()
            entry = self._live(resource, now)
            if entry is not None:
                if entry.secret == secret:
                    entry.expires_at = now + ttl
                    return AcquireReply(entry.token)
                return AcquireReply(None, entry.expires_at - now, self._versions.get(resource, 0))
            token = issue_token(
                self._last.get(resource, 0), int(self.clock.time() * 1_000_000), self.token_mode
            )
            self._last[resource] = token
            self._locks[resource] = _Entry(secret, token, now + ttl, holder)
            return AcquireReply(token)

    def renew(self, resource: str, secret: str, ttl: float) -> bool:
        """See :meth:`fence.abc.AsyncDriver.renew`."""
        with self._mutex:
            now = self.clock.monotonic()
            entry = self._live(resource, now)
            if entry is None or entry.secret != secret:
                return False
            entry.expires_at = now + ttl
            return True

    def release(self, resource: str, secret: str) -> bool:
        """See :meth:`fence.abc.AsyncDriver.release`."""
        with self._mutex:
            entry = self._live(resource, self.clock.monotonic())
            if entry is None or entry.secret != secret:
                return False
            del self._locks[resource]
            waiters = self._bump(resource)
        for waiter in waiters:
            waiter.wake()
        return True

    def inspect(self, resource: str) -> LockInfo | None:
        """See :meth:`fence.abc.AsyncDriver.inspect`."""
        with self._mutex:
            now = self.clock.monotonic()
            entry = self._live(resource, now)
            if entry is None:
                return None
            return LockInfo(resource, entry.token, entry.expires_at - now, entry.holder)

    def revoke(self, resource: str) -> int:
        """See :meth:`fence.abc.AsyncDriver.revoke`."""
        with self._mutex:
            entry = self._live(resource, self.clock.monotonic())
            last = self._last.get(resource, 0)
            if entry is not None:
                last = max(last, entry.token)
                del self._locks[resource]
            token = issue_token(last, int(self.clock.time() * 1_000_000), self.token_mode)
            self._last[resource] = token
            waiters = self._bump(resource)
        for waiter in waiters:
            waiter.wake()
        return token

    def attach(self, resource: str, waiter: Wakeable, cookie: object) -> bool:
        """Wake ``waiter`` on the next change of ``resource``.

        Returns ``True`` (attaching nothing) if it changed since the attempt that returned
        ``cookie``, which closes the race between a failed attempt and the wait.
        """
        with self._mutex:
            if self._versions.get(resource, 0) != cookie:
                return True
            self._waiters.setdefault(resource, []).append(waiter)
            return False

    def detach(self, resource: str, waiter: Wakeable) -> None:
        """Stop waking ``waiter`` for ``resource``."""
        with self._mutex:
            waiters = self._waiters.get(resource)
            if waiters is not None:
                try:
                    waiters.remove(waiter)
                except ValueError:
                    pass
                if not waiters:
                    del self._waiters[resource]

    # -- internals ------------------------------------------------------------------------

    def _live(self, resource: str, now: float) -> _Entry | None:
        entry = self._locks.get(resource)
        if entry is not None and entry.expires_at <= now:
            del self._locks[resource]
            return None
        return entry

    def _bump(self, resource: str) -> list[Wakeable]:
        self._versions[resource] = self._versions.get(resource, 0) + 1
        return self._waiters.pop(resource, [])

    def _bump_all(self) -> list[Wakeable]:
        woken: list[Wakeable] = []
        for resource in list(self._waiters):
            woken.extend(self._bump(resource))
        return woken

    def _wake_all(self) -> None:
        # A manual clock moved: expiries may have passed, so every waiter re-checks.
        with self._mutex:
            waiters = self._bump_all()
        for waiter in waiters:
            waiter.wake()
