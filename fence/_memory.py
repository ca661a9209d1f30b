"""The in-memory backend: lock state for one process, shared by sync and async managers.

It is also the test kit's pausable backend: :meth:`MemoryBackend.pause` stalls every call,
:meth:`MemoryBackend.fail` makes every call fail, and :meth:`MemoryBackend.forget_tokens`
loses the token counters the way a crashed server can.
"""

from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass

from fence._clock import Clock, subscribe, system_clock
from fence._core import LeaseMode, TokenMode, issue_token
from fence._errors import BackendError
from fence._rwlock import Holder, Waiting, decide
from fence._signal import Signal, Wakeable
from fence.abc import AcquireReply, LockInfo

__all__ = ["MemoryBackend"]


#: How long a queued waiter keeps its place without an attempt (its heartbeat), in seconds
#: of the backend's clock. Waiters try again at least every few seconds.
QUEUE_TTL = 15.0


@dataclass(slots=True)
class _Entry:
    secret: str
    token: int
    expires_at: float
    holder: str


@dataclass(slots=True)
class _Waiting:
    mode: LeaseMode
    until: float


class MemoryBackend:
    """Lock state and token counters in this process, on an injected clock.

    One backend can serve several managers, sync and async, in any threads. Expiry is
    decided by the backend's clock, like a server's would be.

    Shared locks (C13): a resource is held by one writer or by readers, with a queue of
    waiters kept alive by their attempts, by the rule of :func:`fence._rwlock.decide`.

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
        self._readers: dict[str, dict[str, _Entry]] = {}
        self._queues: dict[str, dict[str, _Waiting]] = {}
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
            self._readers.clear()
            self._bump_all()

    # -- what the drivers call ----------------------------------------------------------

    def gate(self) -> Signal | None:
        """Raise if failing; return the signal to wait on if paused, else ``None``."""
        if self._failure is not None:
            raise BackendError(self._failure, code="CONNECTION", retryable=True)
        running = self._running
        return None if running.is_set() else running

    def acquire(
        self,
        resource: str,
        secret: str,
        ttl: float,
        holder: str,
        mode: LeaseMode = LeaseMode.WRITE,
    ) -> AcquireReply:
        """One acquire attempt, of a writer or (``mode`` READ) a reader; see
        :meth:`fence.abc.AsyncDriver.acquire`."""
        with self._mutex:
            now = self.clock.monotonic()
            entry = self._live(resource, now)
            readers = self._live_readers(resource, now)
            queue = self._live_queue(resource, now)
            reading = mode is LeaseMode.READ
            verdict = decide(
                secret,
                reading,
                None
                if entry is None
                else Holder(entry.secret, entry.token, entry.expires_at - now),
                [Holder(r.secret, r.token, r.expires_at - now) for r in readers.values()],
                [Waiting(s, w.mode is LeaseMode.WRITE, w.until - now) for s, w in queue.items()],
            )
            if verdict.kept is not None:
                held = entry if entry is not None and entry.secret == secret else readers[secret]
                held.expires_at = now + ttl
                return AcquireReply(held.token)
            if not verdict.granted:
                if verdict.queued:
                    if secret in queue:
                        queue[secret].until = now + QUEUE_TTL
                    else:
                        queue[secret] = _Waiting(mode, now + QUEUE_TTL)
                        self._queues[resource] = queue
                cookie = self._versions.get(resource, 0)
                return AcquireReply(None, verdict.wait, cookie, queued=verdict.queued)
            if queue.pop(secret, None) is not None and not queue:
                self._queues.pop(resource, None)
            token = issue_token(
                self._last.get(resource, 0), int(self.clock.time() * 1_000_000), self.token_mode
            )
            self._last[resource] = token
            granted = _Entry(secret, token, now + ttl, holder)
            if reading:
                self._readers.setdefault(resource, {})[secret] = granted
            else:
                self._locks[resource] = granted
            return AcquireReply(token)

    def renew(self, resource: str, secret: str, ttl: float) -> bool:
        """See :meth:`fence.abc.AsyncDriver.renew`; for a writer or a reader."""
        with self._mutex:
            now = self.clock.monotonic()
            entry = self._live(resource, now)
            if entry is None or entry.secret != secret:
                entry = self._live_readers(resource, now).get(secret)
                if entry is None:
                    return False
            entry.expires_at = now + ttl
            return True

    def release(self, resource: str, secret: str) -> bool:
        """See :meth:`fence.abc.AsyncDriver.release`; for a writer or a reader. The last
        reader to leave wakes the waiters."""
        with self._mutex:
            now = self.clock.monotonic()
            entry = self._live(resource, now)
            if entry is not None and entry.secret == secret:
                del self._locks[resource]
            else:
                readers = self._live_readers(resource, now)
                if readers.pop(secret, None) is None:
                    return False
                if readers:
                    return True
                self._readers.pop(resource, None)
            waiters = self._bump(resource)
        for waiter in waiters:
            waiter.wake()
        return True

    def abandon(self, resource: str, secret: str) -> None:
        """A waiter gave up: take it out of the queue and let the others try again."""
        with self._mutex:
            queue = self._queues.get(resource)
            if queue is None or queue.pop(secret, None) is None:
                return
            if not queue:
                del self._queues[resource]
            waiters = self._bump(resource)
        for waiter in waiters:
            waiter.wake()

    def inspect(self, resource: str) -> LockInfo | None:
        """See :meth:`fence.abc.AsyncDriver.inspect`."""
        with self._mutex:
            now = self.clock.monotonic()
            entry = self._live(resource, now)
            if entry is not None:
                return LockInfo(resource, entry.token, entry.expires_at - now, entry.holder)
            readers = [
                LockInfo(resource, r.token, r.expires_at - now, r.holder, LeaseMode.READ)
                for r in self._live_readers(resource, now).values()
            ]
            return LockInfo.of_readers(resource, readers)

    def list_page(
        self, prefix: str, after: str | None, count: int
    ) -> tuple[list[LockInfo], str | None]:
        """Up to ``count`` held locks whose resource starts with ``prefix``, by resource,
        after the resource ``after``; and the last resource returned, or ``None`` if no
        more (see :meth:`fence.abc.AsyncDriver`'s ``list_page``)."""
        with self._mutex:
            now = self.clock.monotonic()
            names = sorted(
                r
                for r in {*self._locks, *self._readers, *self._queues}
                if r.startswith(prefix) and (after is None or r > after)
            )
            rows: list[LockInfo] = []
            for name in names:
                if len(rows) >= count:
                    return rows, rows[-1].resource
                waiting = max(len(self._live_queue(name, now)), len(self._waiters.get(name, ())))
                entry = self._live(name, now)
                if entry is not None:
                    info: LockInfo | None = LockInfo(
                        name, entry.token, entry.expires_at - now, entry.holder
                    )
                else:
                    readers = [
                        LockInfo(name, r.token, r.expires_at - now, r.holder, LeaseMode.READ)
                        for r in self._live_readers(name, now).values()
                    ]
                    info = LockInfo.of_readers(name, readers)
                if info is not None:
                    rows.append(dataclasses.replace(info, waiters=waiting))
            return rows, None

    def revoke(self, resource: str) -> int:
        """See :meth:`fence.abc.AsyncDriver.revoke`: ends the writer's lease or every
        reader's."""
        with self._mutex:
            now = self.clock.monotonic()
            entry = self._live(resource, now)
            last = self._last.get(resource, 0)
            if entry is not None:
                last = max(last, entry.token)
                del self._locks[resource]
            for reader in self._live_readers(resource, now).values():
                last = max(last, reader.token)
            self._readers.pop(resource, None)
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

    def _live_readers(self, resource: str, now: float) -> dict[str, _Entry]:
        readers = self._readers.get(resource)
        if not readers:
            return {}
        for secret in [s for s, r in readers.items() if r.expires_at <= now]:
            del readers[secret]
        if not readers:
            del self._readers[resource]
        return readers

    def _live_queue(self, resource: str, now: float) -> dict[str, _Waiting]:
        queue = self._queues.get(resource)
        if queue is None:
            return {}
        for secret in [s for s, w in queue.items() if w.until <= now]:
            del queue[secret]
        if not queue:
            del self._queues[resource]
        return queue

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
