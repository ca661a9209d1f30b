"""Protocols for lock managers, their backend drivers and storage guards.

Implementations need not inherit from these classes; matching the methods is enough. The
conformance suites in ``tests/`` run against every implementation.

A driver learns how long each call may take from :func:`time_left` (or
:func:`call_deadline`): the generic manager sets the deadline of every call it makes, so
that ``acquire(timeout=t)`` returns within ``t`` whatever the backend does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

from fence._core import LeaseMode
from fence._deadline import deadline as call_deadline
from fence._deadline import time_left

if TYPE_CHECKING:
    from fence._async.manager import AsyncLease
    from fence._async.manager import _Locked as _AsyncLocked
    from fence._errors import LeaseLostError
    from fence._sync.manager import Lease, _Locked

__all__ = [
    "AcquireReply",
    "AsyncDriver",
    "AsyncGuard",
    "AsyncLockManager",
    "Driver",
    "Guard",
    "LockInfo",
    "LockManager",
    "LostCallback",
    "call_deadline",
    "time_left",
]

#: Called once when a lease is lost, with the lease and the error ``check()`` will raise.
#: It runs on the renewal thread or task: keep it short and do not block in it.
LostCallback = Callable[["Lease | AsyncLease", "LeaseLostError"], None]


@dataclass(frozen=True, slots=True)
class LockInfo:
    """What a backend knows about a held lock.

    A lock held by readers (C13) is described by its newest reader (the highest token)
    and the longest time left, with every reader in :attr:`readers`.

    Attributes:
        resource: the resource.
        token: the holder's fencing token; with readers, the highest reader token.
        remaining: seconds left on the backend's clock; with readers, until the last
            reader's lease ends.
        holder: the label the holder gave (host, pid, thread or task); never its secret.
            With readers, the label of the newest reader.
        mode: :attr:`LeaseMode.WRITE` for a writer, :attr:`LeaseMode.READ` for readers.
        readers: with readers, one :class:`LockInfo` per reader, by token; else empty.
        waiters: how many acquires wait in the backend's queue for it, where the backend
            keeps one and the call reports it (``list``); else 0.
    """

    resource: str
    token: int
    remaining: float
    holder: str | None
    mode: LeaseMode = LeaseMode.WRITE
    readers: tuple[LockInfo, ...] = ()
    waiters: int = 0

    @classmethod
    def of_readers(cls, resource: str, readers: list[LockInfo]) -> LockInfo | None:
        """The :class:`LockInfo` of a lock held by ``readers`` (``None`` if empty)."""
        if not readers:
            return None
        ordered = tuple(sorted(readers, key=lambda r: r.token))
        newest = ordered[-1]
        return cls(
            resource,
            newest.token,
            max(r.remaining for r in ordered),
            newest.holder,
            LeaseMode.READ,
            ordered,
        )


class AcquireReply(NamedTuple):
    """A driver's answer to one acquire attempt.

    Attributes:
        token: the granted token, or ``None`` if somebody else holds the lock.
        holder_ttl: seconds left on the current holder's lease, if the backend said.
        cookie: driver data handed back to :meth:`AsyncDriver.wait` (e.g. a version
            number that closes the race between a failed attempt and the start of a wait).
        queued: the attempt left the caller in the backend's wait queue (a queue key or
            node). If the caller then gives up without waiting (``try_acquire``, a timeout
            of 0), the manager calls the driver's ``abandon`` hook to take it out again.
    """

    token: int | None
    holder_ttl: float | None = None
    cookie: object = None
    queued: bool = False


class AsyncDriver(Protocol):
    """The bytes-moving half of an asyncio lock manager: one round trip per call.

    The generic manager in ``fence._async.manager`` adds deadlines, reentrancy, waiting,
    renewal and events on top, once for every backend.

    Deadlines: the manager sets the deadline of each call in a context variable. A driver
    bounds every round trip of the call by :func:`time_left` (its own default as the
    cap); under asyncio the manager also cancels an acquire attempt that outlives the
    caller's deadline.

    Optional hooks and attributes (a driver without them works; the manager falls back):

    - ``async def abandon(resource, secret) -> None``: the manager calls it when a blocking
      acquire that has waited gives up (timeout, cancellation, error), so a driver with a
      wait queue can drop the waiter and pass its turn on.
    - ``async def cancel(resource, secret, ttl) -> bool``: the manager calls it when an
      acquire gives up after an attempt whose reply was lost (an error, a timeout, a
      cancellation): release what that attempt may have taken and, where the backend can,
      refuse the attempt should it still arrive (for ``ttl`` seconds). Without it the
      manager calls :meth:`release`. It runs in the background; the caller waits for it
      at most :data:`fence._async.manager.UNDO_LIMIT`.
    - ``max_wait: float``: the longest the manager waits between two attempts when nothing
      wakes the waiter (default 5 s). A driver whose wake-ups are not lost may raise it.
    - ``shared: bool``: the driver grants read leases (C13). The manager then calls
      ``acquire(resource, secret, ttl, holder, LeaseMode.READ)`` for a read lease; a write
      lease is asked for with the four arguments alone. A driver without ``shared`` gets no
      read requests: the manager refuses ``mode="read"`` before any I/O. ``renew``,
      ``release``, ``cancel`` and ``abandon`` take the secret alone, whatever the mode;
      ``inspect`` reports readers as :meth:`LockInfo.of_readers`; ``revoke`` ends every
      lease of the resource, readers' too.
    - ``async def list_page(prefix, cursor, count) -> (rows, next_cursor)``: one page of
      the locks held now whose resource starts with ``prefix`` (literally), about ``count``
      rows of :class:`LockInfo` with ``waiters`` filled in where the backend knows them.
      ``cursor`` is ``None`` for the first page; ``next_cursor`` is ``None`` after the last.
      A page never blocks the backend (no full scan in one call). Without it the manager's
      ``list`` raises :class:`fence.ConfigurationError`.
    """

    #: Short backend name for events and messages (``"memory"``, ``"redis"``, ``"sql"``).
    source: str

    async def acquire(self, resource: str, secret: str, ttl: float, holder: str) -> AcquireReply:
        """Take the lock if free or expired, issuing a new token; with the same secret,
        keep the token and reset the ttl. A shared driver takes a fifth argument, the
        :class:`LeaseMode` (see the ``shared`` attribute above)."""
        ...

    async def renew(self, resource: str, secret: str, ttl: float) -> bool:
        """Reset the ttl if ``secret`` holds the lock; return whether it did."""
        ...

    async def release(self, resource: str, secret: str) -> bool:
        """Delete the lock if ``secret`` holds it, and wake a waiter; return whether it did."""
        ...

    async def wait(self, resource: str, timeout: float, reply: AcquireReply) -> None:
        """Return when the lock may be free (released, expired) or after ``timeout`` s."""
        ...

    async def inspect(self, resource: str) -> LockInfo | None:
        """Who holds ``resource``, or ``None``."""
        ...

    async def revoke(self, resource: str) -> int:
        """End whatever lease ``resource`` has and issue a new token above it; return that."""
        ...

    async def close(self) -> None:
        """Release what the driver opened itself."""
        ...


class Driver(Protocol):
    """The sync twin of :class:`AsyncDriver`; same methods, same meaning."""

    source: str

    def acquire(self, resource: str, secret: str, ttl: float, holder: str) -> AcquireReply:
        """See :meth:`AsyncDriver.acquire`."""
        ...

    def renew(self, resource: str, secret: str, ttl: float) -> bool:
        """See :meth:`AsyncDriver.renew`."""
        ...

    def release(self, resource: str, secret: str) -> bool:
        """See :meth:`AsyncDriver.release`."""
        ...

    def wait(self, resource: str, timeout: float, reply: AcquireReply) -> None:
        """See :meth:`AsyncDriver.wait`."""
        ...

    def inspect(self, resource: str) -> LockInfo | None:
        """See :meth:`AsyncDriver.inspect`."""
        ...

    def revoke(self, resource: str) -> int:
        """See :meth:`AsyncDriver.revoke`."""
        ...

    def close(self) -> None:
        """See :meth:`AsyncDriver.close`."""
        ...


@runtime_checkable
class LockManager(Protocol):
    """Hands out leases with fencing tokens (C2, C10, C11).

    Every implementation passes ``tests/conformance``.
    """

    def acquire(
        self,
        resource: str,
        *,
        mode: LeaseMode | str = LeaseMode.WRITE,
        ttl: float | None = None,
        timeout: float | None = None,
        renew: bool | None = None,
        on_lost: LostCallback | None = None,
    ) -> Lease:
        """Wait up to ``timeout`` seconds (``None``: forever) for the lock; return the lease.

        ``mode="read"`` asks for a shared lease (C13), ``"write"`` (the default) for an
        exclusive one."""
        ...

    def try_acquire(
        self,
        resource: str,
        *,
        mode: LeaseMode | str = LeaseMode.WRITE,
        ttl: float | None = None,
        renew: bool | None = None,
        on_lost: LostCallback | None = None,
    ) -> Lease | None:
        """Take the lock if it is free now; else return ``None``."""
        ...

    def locked(
        self,
        resource: str,
        *,
        mode: LeaseMode | str = LeaseMode.WRITE,
        ttl: float | None = None,
        timeout: float | None = None,
        renew: bool | None = None,
        on_lost: LostCallback | None = None,
    ) -> _Locked:
        """Decorate a function to run under the lock on ``resource``, a ``str.format``
        template filled from the call's arguments; a parameter named ``lease`` gets the
        lease."""
        ...

    def inspect(self, resource: str) -> LockInfo | None:
        """Who holds ``resource``, with its token and the backend's remaining ttl."""
        ...

    def revoke(self, resource: str) -> int:
        """Force the lease of a hung holder to end; return a token above the holder's."""
        ...

    def close(self) -> None:
        """Stop renewals and close what the manager opened."""
        ...


@runtime_checkable
class AsyncLockManager(Protocol):
    """The asyncio twin of :class:`LockManager`."""

    async def acquire(
        self,
        resource: str,
        *,
        mode: LeaseMode | str = LeaseMode.WRITE,
        ttl: float | None = None,
        timeout: float | None = None,
        renew: bool | None = None,
        on_lost: LostCallback | None = None,
    ) -> AsyncLease:
        """See :meth:`LockManager.acquire`."""
        ...

    async def try_acquire(
        self,
        resource: str,
        *,
        mode: LeaseMode | str = LeaseMode.WRITE,
        ttl: float | None = None,
        renew: bool | None = None,
        on_lost: LostCallback | None = None,
    ) -> AsyncLease | None:
        """See :meth:`LockManager.try_acquire`."""
        ...

    def locked(
        self,
        resource: str,
        *,
        mode: LeaseMode | str = LeaseMode.WRITE,
        ttl: float | None = None,
        timeout: float | None = None,
        renew: bool | None = None,
        on_lost: LostCallback | None = None,
    ) -> _AsyncLocked:
        """See :meth:`LockManager.locked`; it decorates ``async def`` functions."""
        ...

    async def inspect(self, resource: str) -> LockInfo | None:
        """See :meth:`LockManager.inspect`."""
        ...

    async def revoke(self, resource: str) -> int:
        """See :meth:`LockManager.revoke`."""
        ...

    async def close(self) -> None:
        """See :meth:`LockManager.close`."""
        ...


@runtime_checkable
class Guard(Protocol):
    """The part every storage guard shares (C4, C8).

    Guards add their own write operations (fenced UPDATE, fenced SET, ...); those all
    follow :func:`fence.accepts` and raise :class:`fence.StaleTokenError`.
    """

    def claim(self, scope: str, token: int) -> int:
        """Raise the fence of ``scope`` to ``token`` without writing data; return the fence.

        Raises:
            StaleTokenError: the fence is already above ``token``.
        """
        ...

    def fence(self, scope: str) -> int | None:
        """The fence of ``scope``, or ``None`` if it has none."""
        ...


@runtime_checkable
class AsyncGuard(Protocol):
    """The asyncio twin of :class:`Guard`."""

    async def claim(self, scope: str, token: int) -> int:
        """See :meth:`Guard.claim`."""
        ...

    async def fence(self, scope: str) -> int | None:
        """See :meth:`Guard.fence`."""
        ...
