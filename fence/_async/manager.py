"""Leases and the generic lock manager, written once over a backend driver.

The driver moves bytes (one round trip per call); this module owns everything else:
deadlines (C10), reentrancy (C2), ownership (C11), waiting, the renewal watchdog and
the lost-lease signal, and events.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import secrets
import socket
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from types import TracebackType
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, Protocol, TypeVar, overload

from fence._acompat import Waiter, cancel_after, current_owner, shield, spawn
from fence._clock import Clock, subscribe, system_clock
from fence._core import (
    LeaseMode,
    ReadToken,
    client_deadline,
    validate_mode,
    validate_resource,
    validate_ttl,
)
from fence._deadline import reset, set_deadline
from fence._decorate import LockedCall
from fence._errors import (
    AcquireTimeout,
    BackendError,
    ConfigurationError,
    LeaseExpiredError,
    LeaseLostError,
    LockUpgradeError,
    NotOwnerError,
)
from fence._events import EventBus, EventKind, default_bus
from fence._signal import Signal
from fence.abc import AcquireReply, AsyncDriver, LockInfo

if TYPE_CHECKING:
    from fence._async.retry import AsyncRetryPolicy

__all__ = ["AsyncBaseLockManager", "AsyncLease"]

_log = logging.getLogger("fence")

#: Longest single wait between acquire attempts when the backend gives no hint. A lost
#: wake-up can cost at most this much. A driver whose wake-ups are not lost may raise it
#: with the optional attribute ``max_wait`` (seconds).
_MAX_WAIT_SLICE = 5.0

#: The first pause after a failed attempt (a transient backend error); it doubles, with
#: jitter, up to _RETRY_MAX, and never runs past the caller's deadline.
_RETRY_BASE = 0.02
_RETRY_MAX = 1.0

#: How long the clean-up of an acquire that gave up (releasing what an attempt whose reply
#: was lost may have taken) may delay the caller's error; the rest is finished in the
#: background. With _GRACE, this is the margin by which acquire(timeout=t) may pass t.
UNDO_LIMIT = 0.25

#: asyncio: how far past its deadline a driver call runs before the manager cancels it.
#: Drivers that bound their own round trips by the deadline stop first, with a better
#: message.
_GRACE = 0.05

_HOST = socket.gethostname()

LeaseCallback = Callable[["AsyncLease", LeaseLostError], None]

IS_ASYNC = True  # unasync: IS_ASYNC = False

_P = ParamSpec("_P")
_R = TypeVar("_R")


_LeaseFirst = Callable[
    Concatenate["AsyncLease", _P], Awaitable[_R]  # unasync: Concatenate["Lease", _P], _R
]
_Fn = Callable[_P, Awaitable[_R]]  # unasync: _Fn = Callable[_P, _R]
_Run = Callable[_P, Coroutine[Any, Any, _R]]  # unasync: _Run = Callable[_P, _R]


class _Locked(Protocol):
    """What :meth:`AsyncBaseLockManager.locked` returns: a decorator that keeps the types
    of the function's parameters (without ``lease``) and of its result."""

    @overload
    def __call__(self, fn: _LeaseFirst[_P, _R], /) -> _Run[_P, _R]: ...
    @overload
    def __call__(self, fn: _Fn[_P, _R], /) -> _Run[_P, _R]: ...


class AsyncLease:
    """A held lock: the fencing token, the client's deadline and the lost-lease signal.

    Use it as a context manager to release on exit::

        async with await manager.acquire("order:42", ttl=10) as lease:
            await guard.claim("order:42", lease.token)
            ...

    Pass ``lease.token`` to every guarded write. A lease whose holder paused past its
    deadline is no longer valid; the guards then reject its token once a newer holder wrote.

    A read lease (:attr:`mode` ``READ``, from ``manager.read_lock``) shares the lock with
    other readers and never writes: pass its token to checked reads
    (:func:`fence.check_read`), never to a guarded write (C13).

    Attributes:
        resource: the locked resource.
        token: the fencing token (C1, C2, C13).
        ttl: the lease time asked for, in seconds.
        mode: :attr:`LeaseMode.WRITE` (exclusive) or :attr:`LeaseMode.READ` (shared).
    """

    def __init__(
        self,
        manager: AsyncBaseLockManager,
        resource: str,
        token: int,
        secret: str,
        ttl: float,
        deadline: float,
        owner: object,
        mode: LeaseMode = LeaseMode.WRITE,
    ) -> None:
        self._manager = manager
        self.resource = resource
        # A read lease's token is marked, so that no guard takes it for a write (C13).
        self.token: int = ReadToken(token) if mode is LeaseMode.READ else token
        self.mode = mode
        self._secret = secret
        self.ttl = ttl
        self._deadline = deadline
        self._owner = owner
        self._depth = 1
        self._released = False
        self._issued = False  # set by the manager that acquired it; a forged lease has not
        self._lost = Signal()
        self._stop = Signal()
        self._error: LeaseLostError | None = None
        self._callbacks: list[LeaseCallback] = []
        self._callback_lock = threading.Lock()
        self._watchdog: Any = None

    def __repr__(self) -> str:
        state = "lost" if self.lost else "released" if self._released else "held"
        return f"<AsyncLease {self.mode} {self.resource!r} token={self.token} {state}>"

    @property
    def deadline(self) -> float:
        """The client's deadline on the manager's monotonic clock (C10)."""
        return self._deadline

    def remaining(self) -> float:
        """Seconds until the client's deadline; 0 once released or lost."""
        if self._released or self._lost.is_set():
            return 0.0
        return max(0.0, self._deadline - self._manager.clock.monotonic())

    @property
    def valid(self) -> bool:
        """Held, not lost, and before the client's deadline."""
        return self.remaining() > 0

    @property
    def lost(self) -> bool:
        """Whether the lease is known to be lost (renewal failed, revoked, or expired)."""
        return self._lost.is_set()

    @property
    def released(self) -> bool:
        """Whether :meth:`release` ended the lease."""
        return self._released

    def check(self, min_remaining: float = 0.0) -> None:
        """Raise unless the lease is valid for at least ``min_remaining`` more seconds.

        Call it before a step that must finish under the lock. It narrows the window; only
        a guard closes it, because the holder can pause right after the check.

        Raises:
            LeaseLostError: the lease is lost; ``cause`` says why.
            LeaseExpiredError: released, or less than ``min_remaining`` seconds are left.
        """
        if self._error is not None:
            raise self._error
        if self._released:
            raise LeaseExpiredError(
                f"lease on {self.resource!r} (token {self.token}) was released",
                resource=self.resource,
                token=self.token,
                remaining=0.0,
            )
        left = self._deadline - self._manager.clock.monotonic()
        if left <= min_remaining:
            raise LeaseExpiredError(
                f"lease on {self.resource!r} (token {self.token}) has {left:.3f}s left, "
                f"needed more than {min_remaining:.3f}s",
                resource=self.resource,
                token=self.token,
                remaining=left,
            )

    def on_lost(self, callback: LeaseCallback) -> None:
        """Call ``callback(lease, error)`` once when the lease is lost (now, if it is).

        It runs on the renewal task or thread; keep it short. Exceptions are logged.
        """
        with self._callback_lock:
            error = self._error if self._lost.is_set() else None
            if error is None:
                self._callbacks.append(callback)
        if error is not None:
            _call_back(callback, self, error)

    async def wait_lost(self, timeout: float | None = None) -> bool:
        """Wait until the lease is lost or ``timeout`` seconds pass; return whether it was.

        Reaching the client's deadline without a renewal counts as lost, so this also
        serves leases that have no watchdog.
        """
        clock = self._manager.clock
        end = None if timeout is None else clock.monotonic() + timeout
        while True:
            if self._lost.is_set():
                return True
            if self._released:
                return False
            now = clock.monotonic()
            if now >= self._deadline:
                self._mark_lost("the lease reached its deadline without a renewal")
                return True
            if end is not None and now >= end:
                return False
            until = self._deadline if end is None else min(self._deadline, end)
            await self._manager._sleep_until(self._lost, until)

    async def renew(self, ttl: float | None = None) -> None:
        """Extend the lease to ``ttl`` seconds from now (default: its own ttl).

        Raises:
            LeaseLostError: the backend no longer holds the lock for this lease.
            NotOwnerError: the lease was released.
        """
        await self._manager._renew(self, self.ttl if ttl is None else validate_ttl(ttl))

    async def release(self) -> None:
        """Release the lease (after as many releases as reentrant acquires).

        Raises:
            NotOwnerError: the lease was already released, or the backend no longer holds it
                for this lease (it expired, maybe another holder took it). Nobody else's
                lock is touched.
        """
        await self._manager._release(self)

    async def __aenter__(self) -> AsyncLease:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self.release()
        except NotOwnerError:
            if exc is None:
                raise
            # The body failed already; its error says more than the release would.
            _log.warning("release of %r failed after an error in its block", self)

    def _mark_lost(self, cause: str) -> None:
        error = LeaseLostError(
            f"lease on {self.resource!r} (token {self.token}) was lost: {cause}",
            resource=self.resource,
            token=self.token,
            remaining=self._deadline - self._manager.clock.monotonic(),
            cause=cause,
        )
        with self._callback_lock:
            if self._lost.is_set():
                return
            self._error = error
            self._lost.set()
            callbacks, self._callbacks = self._callbacks, []
        self._stop.set()
        manager = self._manager
        # A lost lease is no longer held: the owner's next acquire starts a new lease with a
        # new token instead of re-entering one that is gone.
        key = (self._owner, self.resource)
        if manager._held.get(key) is self:
            del manager._held[key]
        manager.events.emit(EventKind.LOST, manager.source, self.resource, self.token, cause=cause)
        for callback in callbacks:
            _call_back(callback, self, error)


def _call_back(callback: LeaseCallback, lease: AsyncLease, error: LeaseLostError) -> None:
    try:
        callback(lease, error)
    except Exception:
        _log.exception("on_lost callback %r failed for %r", callback, lease)


#: Rows asked of the driver per page by :meth:`AsyncBaseLockManager.list`.
_LIST_PAGE = 100


class AsyncBaseLockManager:
    """A lock manager over any :class:`fence.abc.AsyncDriver`.

    Backends subclass it only to build their driver; all behaviour lives here.

    Args:
        driver: the backend driver.
        ttl: default lease time in seconds.
        renew: default for the renewal watchdog (renews at about ``ttl / 3``).
        drift: the fraction of ttl the client gives up for clock rate differences (C10).
        margin: seconds the client gives up for the request's own latency (C10).
        clock: the monotonic clock for deadlines and waits.
        events: where to report events (default: :data:`fence.default_bus`).
        reentrant: whether a second acquire by the same owner returns the held lease.
    """

    def __init__(
        self,
        driver: AsyncDriver,
        *,
        ttl: float = 30.0,
        renew: bool = False,
        drift: float = 0.01,
        margin: float = 0.002,
        clock: Clock | None = None,
        events: EventBus | None = None,
        reentrant: bool = True,
    ) -> None:
        self.driver = driver
        self.source = driver.source
        self.ttl = validate_ttl(ttl)
        self.renew = renew
        self.drift = drift
        self.margin = margin
        client_deadline(0.0, self.ttl, drift=drift, margin=margin)  # validates the three
        self.clock: Clock = clock or system_clock
        self.events = events or default_bus
        self.reentrant = reentrant
        self._held: dict[tuple[object, str], AsyncLease] = {}
        self._watchdogs: list[Any] = []
        self._closed = False
        self._closing = Signal()
        self._max_wait = float(getattr(driver, "max_wait", _MAX_WAIT_SLICE))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.source} ttl={self.ttl}>"

    async def acquire(
        self,
        resource: str,
        *,
        mode: LeaseMode | str = LeaseMode.WRITE,
        ttl: float | None = None,
        timeout: float | None = None,
        renew: bool | None = None,
        on_lost: LeaseCallback | None = None,
        owner: object = None,
    ) -> AsyncLease:
        """Wait for the lock on ``resource`` and return a lease with a fresh token.

        A waiter is woken by the release (or by the holder's expiry), not by polling.

        Shared locks (C13): ``mode="read"`` takes a read lease, which the lock grants to
        many readers at once but never beside a writer; ``"write"`` (the default) takes
        the lock alone. Every lease gets a new token from the resource's one sequence, so
        a writer's token is above every token issued before it, readers' included, and a
        reader's is above every earlier writer's. A waiting writer keeps new readers out,
        and waiters are served in arrival order, readers in batches. Reentrancy: an
        owner's second read re-enters its read lease, a second write its write lease, and
        a read by the writer re-enters the write lease (same token, still exclusive);
        a write by an owner that holds a read lease raises :class:`LockUpgradeError`.

        Args:
            resource: what to lock; a non-empty ``str`` of at most 512 bytes.
            mode: ``"write"`` (exclusive, the default) or ``"read"`` (shared).
            ttl: lease time in seconds (default: the manager's).
            timeout: how long to wait, in seconds. The call returns within ``timeout``
                plus :data:`UNDO_LIMIT` and a few milliseconds, whatever the backend does:
                every round trip is bounded by the time left, and transient backend errors
                are retried with backoff until then. ``0`` tries once. ``None`` waits for
                the lock as long as it takes, but raises a backend error at once.
            renew: run the renewal watchdog for this lease (default: the manager's).
            on_lost: called once if the lease is lost; see :meth:`AsyncLease.on_lost`.
            owner: who owns the lease for reentrancy; default: the current task.

        If the call fails or is cancelled after an attempt whose reply was lost (a timeout,
        a broken connection, a cancellation), it releases whatever that attempt may have
        taken before the error reaches the caller (in the background if the backend does
        not answer within :data:`UNDO_LIMIT`).

        Raises:
            AcquireTimeout: the lock was not free within ``timeout``.
            LeaseLostError: a reentrant acquire found the held lease lost.
            LockUpgradeError: a write asked for by an owner that holds a read lease on
                ``resource`` (it would deadlock), before any I/O.
            InvalidResourceError, ConfigurationError: bad arguments, or ``mode="read"`` on
                a manager without shared locks, before any I/O.
            BackendError: the backend failed (with a timeout: it kept failing, or did not
                answer, until the timeout ran out).
        """
        lease = await self._acquire(resource, ttl, timeout, renew, on_lost, owner, True, mode)
        assert lease is not None
        return lease

    async def try_acquire(
        self,
        resource: str,
        *,
        mode: LeaseMode | str = LeaseMode.WRITE,
        ttl: float | None = None,
        renew: bool | None = None,
        on_lost: LeaseCallback | None = None,
        owner: object = None,
    ) -> AsyncLease | None:
        """Take the lock if it is free now, in one round trip; else return ``None``.

        Same arguments as :meth:`acquire`, without ``timeout``. A read is refused while a
        writer holds the lock or waits for it.
        """
        return await self._acquire(resource, ttl, 0.0, renew, on_lost, owner, False, mode)

    @asynccontextmanager
    async def lock(
        self,
        resource: str,
        *,
        mode: LeaseMode | str = LeaseMode.WRITE,
        ttl: float | None = None,
        timeout: float | None = None,
        renew: bool | None = None,
        on_lost: LeaseCallback | None = None,
        owner: object = None,
    ) -> AsyncIterator[AsyncLease]:
        """Acquire ``resource`` for the ``async with`` block and release at its end.

        Same arguments as :meth:`acquire`.
        """
        lease = await self.acquire(
            resource,
            mode=mode,
            ttl=ttl,
            timeout=timeout,
            renew=renew,
            on_lost=on_lost,
            owner=owner,
        )
        async with lease:
            yield lease

    @asynccontextmanager
    async def read_lock(
        self,
        resource: str,
        *,
        ttl: float | None = None,
        timeout: float | None = None,
        renew: bool | None = None,
        on_lost: LeaseCallback | None = None,
        owner: object = None,
    ) -> AsyncIterator[AsyncLease]:
        """Hold a read lease on ``resource`` for the ``async with`` block (C13).

        Many readers hold the lock at once; none while a writer holds it or waits for it.
        The lease's token serves checked reads (:func:`fence.check_read`); the session
        hook and the unit of work refuse it for writes. Same arguments as :meth:`acquire`.

        Example::

            async with manager.read_lock("catalog") as lease:
                value, fence = await guard.get("{catalog}:prices")
                fence.check_read("{catalog}:prices", lease.token, fence)
        """
        async with self.lock(
            resource,
            mode=LeaseMode.READ,
            ttl=ttl,
            timeout=timeout,
            renew=renew,
            on_lost=on_lost,
            owner=owner,
        ) as lease:
            yield lease

    @asynccontextmanager
    async def write_lock(
        self,
        resource: str,
        *,
        ttl: float | None = None,
        timeout: float | None = None,
        renew: bool | None = None,
        on_lost: LeaseCallback | None = None,
        owner: object = None,
    ) -> AsyncIterator[AsyncLease]:
        """Hold the write lease on ``resource`` for the ``async with`` block (C13).

        The same as :meth:`lock`: exclusive, beside no other writer and no reader. Its
        token is above every token issued before for ``resource``, readers' included.
        Same arguments as :meth:`acquire`.
        """
        async with self.lock(
            resource,
            mode=LeaseMode.WRITE,
            ttl=ttl,
            timeout=timeout,
            renew=renew,
            on_lost=on_lost,
            owner=owner,
        ) as lease:
            yield lease

    def locked(
        self,
        resource: str,
        *,
        mode: LeaseMode | str = LeaseMode.WRITE,
        ttl: float | None = None,
        timeout: float | None = None,
        renew: bool | None = None,
        on_lost: LeaseCallback | None = None,
        owner: object = None,
        retry: AsyncRetryPolicy | None = None,
    ) -> _Locked:
        """Decorate a function to run under the lock on a resource named by its arguments.

        Each call formats ``resource`` from the call's arguments by name (defaults
        applied), takes the lock as :meth:`lock` does, runs the function and releases the
        lock when it returns or raises (or, under asyncio, is cancelled).

        A function that takes a parameter named ``lease`` gets the lease there; callers do
        not pass it. Take it as the first parameter: type checkers then see the decorated
        function with the function's other parameters and its result (``Concatenate``,
        PEP 612), as they see a function without ``lease`` unchanged. A keyword-only
        ``lease`` (after ``*``) gets the lease too, but type checkers still ask callers
        for it: PEP 612 cannot take a keyword parameter out of a signature. (Type checkers
        match the first parameter by type, not by name: a first parameter typed ``object``
        is taken for the lease's place too.)

        With ``retry``, a call that fails with an error the policy retries runs again
        from the acquire, under a new lease with a newer token; it is the same as
        decorating the locked function with the policy (``@policy`` above
        ``@manager.locked(...)``), never the other way round, which would retry inside
        the held lease with the same token.

        Args:
            resource: a ``str.format`` template whose fields name the function's
                parameters (``"order:{order_id}"``, ``"user:{user.id}"``).
            mode: ``"write"`` (exclusive, the default) or ``"read"`` (shared, C13).
            ttl: lease time in seconds (default: the manager's).
            timeout: how long each call waits for the lock (see :meth:`acquire`).
            renew: run the renewal watchdog (default: the manager's).
            on_lost: called once if a call's lease is lost; see :meth:`AsyncLease.on_lost`.
            owner: who holds the lock (default: the current task or thread).
            retry: an :class:`fence.AsyncRetryPolicy` that runs the whole locked call
                again on the errors it retries.

        Raises:
            ConfigurationError: at decoration time: a bad ``mode``, ``ttl`` or
                ``timeout``; the function is not an ``async def`` function (a plain one
                for the sync manager), is a generator function, or takes ``lease``
                other than first or keyword-only; the template does not
                parse or names a parameter the function does not take; ``retry`` is a
                policy of the other kind. At call time :meth:`acquire` raises as usual
                (an invalid formatted resource: :class:`fence.InvalidResourceError`).

        Example::

            @manager.locked("order:{order_id}", ttl=10, timeout=5)
            async def pay(lease: AsyncLease, order_id: int) -> None:
                await guard.claim(f"order:{order_id}", lease.token)
                ...

            await pay(42)
        """
        name = type(self).__name__
        mode = validate_mode(mode)
        if ttl is not None:
            ttl = validate_ttl(ttl)
        if timeout is not None and not timeout >= 0:
            raise ConfigurationError(f"timeout must be >= 0 or None, got {timeout!r}")

        def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
            call = LockedCall(fn, resource, name, is_async=IS_ASYNC)
            leading = call.leading
            wants_lease = call.wants_lease

            @functools.wraps(fn)
            async def run(*args: Any, **kwargs: Any) -> Any:
                async with self.lock(
                    call.resource(args, kwargs),
                    mode=mode,
                    ttl=ttl,
                    timeout=timeout,
                    renew=renew,
                    on_lost=on_lost,
                    owner=owner,
                ) as lease:
                    if leading:
                        return await fn(lease, *args, **kwargs)
                    if wants_lease:
                        return await fn(*args, lease=lease, **kwargs)
                    return await fn(*args, **kwargs)

            run.__signature__ = call.signature  # type: ignore[attr-defined]
            if retry is not None:
                return retry(run)
            return run

        return decorate

    async def inspect(self, resource: str) -> LockInfo | None:
        """Who holds ``resource``: its token, the backend's remaining ttl, and the holder's
        label (never its secret); for readers, ``mode`` is ``READ`` and ``readers`` lists
        each of them. ``None`` if nobody does."""
        return await self.driver.inspect(validate_resource(resource))

    async def list(self, prefix: str = "", *, limit: int | None = None) -> AsyncIterator[LockInfo]:
        """The locks held now whose resource starts with ``prefix``, page by page.

        Each row is a :class:`LockInfo` (a writer, or readers as in :meth:`inspect`) with
        ``waiters``, the acquires queued for it, where the backend keeps a queue. Rows
        come in the backend's order: by resource on SQL, etcd, ZooKeeper and memory; in
        scan order on Redis (primary by primary on a cluster; node by node on the
        quorum, which lists only what a majority agrees on). The prefix matches
        literally: ``*``, ``%`` or ``_`` in it are plain characters. The backend is
        read a page at a time (Redis ``SCAN``, SQL keyset pages, etcd ranges), never in
        one blocking call; a lock taken or released during the listing may or may not
        appear.

        Args:
            prefix: list only resources that start with it (default: every resource).
            limit: stop after this many rows (default: all).

        Raises:
            ConfigurationError: the backend has no list, or ``limit`` is below 0.
            BackendError: the backend failed; rows already yielded stay valid.
        """
        if not isinstance(prefix, str):
            raise ConfigurationError(f"prefix must be a str, got {type(prefix).__name__}")
        if limit is not None and limit < 0:
            raise ConfigurationError(f"limit must be 0 or more, got {limit}")
        page = getattr(self.driver, "list_page", None)
        if page is None:
            raise ConfigurationError(
                f"the {self.source} backend has no list of held locks: use inspect on a "
                "resource you know"
            )
        count = _LIST_PAGE if limit is None else max(1, min(limit, _LIST_PAGE))
        # A scan may return a resource twice (Redis SCAN across a rehash): yield it once.
        listed: set[str] = set()
        cursor: Any = None
        while limit is None or len(listed) < limit:
            rows, cursor = await page(prefix, cursor, count)
            for row in rows:
                if limit is not None and len(listed) >= limit:
                    return
                if row.resource in listed:
                    continue
                listed.add(row.resource)
                yield row
            if cursor is None:
                return

    async def revoke(self, resource: str) -> int:
        """End the lease on ``resource`` by force, whoever holds it: the writer, or every
        reader.

        For a hung holder. Returns a token above every token issued for ``resource``; pass it
        to the guards' ``claim`` so that the hung holder's writes are refused from now on
        (and checked reads of readers, :func:`fence.check_read`).
        """
        resource = validate_resource(resource)
        token = await shield(self.driver.revoke(resource))
        self.events.emit(EventKind.REVOKED, self.source, resource, token)
        return token

    async def close(self) -> None:
        """Stop every watchdog, release held leases (best effort) and close the driver."""
        if self._closed:
            return
        self._closed = True
        self._closing.set()
        held = list(self._held.values())
        for lease in held:
            lease._stop.set()
        # Lost leases have left _held, but their watchdogs may still be in a call: join
        # every one before the driver closes the connections under them.
        for watchdog in self._watchdogs:
            await watchdog.join()
        self._watchdogs.clear()
        for lease in held:
            if not lease._released and not lease.lost:
                lease._released = True
                try:
                    await shield(self.driver.release(lease.resource, lease._secret))
                except BackendError:
                    pass
        self._held.clear()
        await self.driver.close()

    async def __aenter__(self) -> AsyncBaseLockManager:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    # -- internals ---------------------------------------------------------------------

    def _holder_label(self, owner: object) -> str:
        get_name = getattr(owner, "get_name", None)
        name = get_name() if callable(get_name) else getattr(owner, "name", "")
        return f"{_HOST}:{os.getpid()}:{name}"

    async def _acquire(
        self,
        resource: str,
        ttl: float | None,
        timeout: float | None,
        renew: bool | None,
        on_lost: LeaseCallback | None,
        owner: object,
        blocking: bool,
        mode: LeaseMode | str = LeaseMode.WRITE,
    ) -> AsyncLease | None:
        if self._closed:
            raise ConfigurationError(f"{self!r} is closed")
        resource = validate_resource(resource)
        mode = validate_mode(mode)
        ttl = self.ttl if ttl is None else validate_ttl(ttl)
        if timeout is not None and not timeout >= 0:
            raise ConfigurationError(f"timeout must be >= 0 or None, got {timeout!r}")
        shared = mode is LeaseMode.READ
        if shared and not getattr(self.driver, "shared", False):
            raise ConfigurationError(
                f"{self!r} has no shared locks: mode='read' is refused (see the docs on "
                "shared locks for the managers that have them); take a write lease instead"
            )
        if owner is None:
            owner = current_owner()
        key = (owner, resource)
        held = self._held.get(key)
        if held is not None and not held._released:
            if held.mode is LeaseMode.READ and not shared:
                # Two readers that both wait to become the writer wait for each other.
                raise LockUpgradeError(
                    f"cannot take a write lease on {resource!r} while holding a read lease "
                    f"on it (token {held.token}): an upgrade deadlocks when two readers try "
                    "it. Release the read lease first, then take the write lease and read "
                    "again under it",
                    resource=resource,
                    token=held.token,
                )
            if self.reentrant:
                # A read by the writer re-enters the write lease: it is exclusive already.
                await self._reenter(held, ttl, timeout)
                if on_lost is not None:
                    held.on_lost(on_lost)
                return held

        clock = self.clock
        secret = secrets.token_urlsafe(24)
        holder = self._holder_label(owner)
        start = clock.monotonic()
        wait_end = None if timeout is None else start + timeout
        # Round trips are bounded by the caller's deadline, on the clock sockets time out
        # on. A timeout of 0 tries once, with a whole round trip (the driver's own limit).
        real_end = time.monotonic() + timeout if timeout else None
        waited = False
        queued = False
        uncertain = False  # an attempt failed after it may have reached the backend
        refused = False  # the last attempt was answered: the lock was held
        failures = 0
        error: BackendError | None = None
        uncut: BackendError | None = None  # the last failed attempt the deadline did not cut
        try:
            while True:
                sent = clock.monotonic()
                scope = set_deadline(real_end)
                try:
                    if real_end is None:
                        reply = await self._attempt(resource, secret, ttl, holder, shared)
                    else:
                        async with cancel_after(max(real_end - time.monotonic(), 0.0) + _GRACE):
                            reply = await self._attempt(resource, secret, ttl, holder, shared)
                except BaseException as exc:
                    if not (isinstance(exc, BackendError) and getattr(exc, "sent", None) is False):
                        uncertain = True
                    if isinstance(exc, TimeoutError) and not isinstance(exc, AcquireTimeout):
                        error = BackendError(
                            f"{self.source} did not answer the acquire of {resource!r} within "
                            f"the time left of its {timeout}s timeout; the lock state is unknown",
                            code="TIMEOUT",
                            retryable=True,
                        )
                        error.__cause__ = exc
                    elif isinstance(exc, BackendError):
                        error = exc
                    else:
                        raise
                    if refused and wait_end is not None and clock.monotonic() >= wait_end:
                        # The deadline came during a last attempt: the lock was held when
                        # last heard of, so this is a timeout, not an outage.
                        raise AcquireTimeout(
                            f"{resource!r} was not free within {timeout}s (the last attempt "
                            f"did not finish in time: {error})",
                            resource=resource,
                            timeout=timeout,
                        ) from exc
                    if not (error.retryable and blocking and timeout):
                        raise error from exc
                    if (
                        uncut is not None
                        and getattr(error, "sent", None) is False
                        and real_end is not None
                        and time.monotonic() >= real_end
                    ):
                        # The deadline cut the last attempt short before it sent anything:
                        # the attempt before it says more about why (a refused connection).
                        error = BackendError(
                            f"{uncut} (the last attempt ran out of time before it could "
                            "send anything)",
                            code=uncut.code,
                            retryable=uncut.retryable,
                            sent=False,
                        )
                        error.__cause__ = exc
                    else:
                        uncut = error
                    failures += 1
                    refused = False
                    await self._retry_pause(resource, error, failures, wait_end, timeout, start)
                    continue
                finally:
                    reset(scope)
                if reply.token is not None:
                    break
                failures = 0
                error = None
                refused = True
                queued = queued or reply.queued
                now = clock.monotonic()
                if not blocking:
                    if queued:
                        await self._abandon(resource, secret)
                    return None
                if wait_end is not None and now >= wait_end:
                    raise AcquireTimeout(
                        f"{resource!r} was not free within {timeout}s",
                        resource=resource,
                        timeout=timeout,
                    )
                waited = True
                # Jittered, so that many waiters woken by nothing do not try all at once.
                slice_ = self._max_wait * random.uniform(0.75, 1.0)
                if wait_end is not None:
                    slice_ = min(slice_, wait_end - now)
                if reply.holder_ttl is not None:
                    slice_ = min(slice_, max(reply.holder_ttl, 0.001))
                scope = set_deadline(time.monotonic() + slice_)
                try:
                    await self.driver.wait(resource, slice_, reply)
                except BackendError as exc:
                    if not (exc.retryable and timeout):
                        raise
                    error = exc
                    failures += 1
                    await self._retry_pause(resource, error, failures, wait_end, timeout, start)
                finally:
                    reset(scope)
        except BaseException:
            if uncertain:
                await self._undo(resource, secret, ttl)
            if waited or queued:
                await self._abandon(resource, secret)
            raise

        deadline = client_deadline(sent, ttl, drift=self.drift, margin=self.margin)
        lease = AsyncLease(self, resource, reply.token, secret, ttl, deadline, owner, mode)
        lease._issued = True
        if on_lost is not None:
            lease.on_lost(on_lost)
        self._held[key] = lease
        events = self.events
        if events.active:
            now = clock.monotonic()
            detail = {"mode": "read"} if shared else {}
            if waited:
                events.emit(
                    EventKind.WAITED, self.source, resource, reply.token, now - start, **detail
                )
            events.emit(
                EventKind.ACQUIRED, self.source, resource, reply.token, now - start, **detail
            )
        if self.renew if renew is None else renew:
            lease._watchdog = spawn(self._watch, lease, name=f"fence-renew:{resource}")
            self._watchdogs = [w for w in self._watchdogs if not w.done()]
            self._watchdogs.append(lease._watchdog)
        return lease

    async def _attempt(
        self, resource: str, secret: str, ttl: float, holder: str, shared: bool
    ) -> AcquireReply:
        if shared:
            return await self.driver.acquire(  # type: ignore[call-arg]
                resource, secret, ttl, holder, LeaseMode.READ
            )
        return await self.driver.acquire(resource, secret, ttl, holder)

    async def _retry_pause(
        self,
        resource: str,
        error: BackendError,
        failures: int,
        wait_end: float | None,
        timeout: float | None,
        start: float,
    ) -> None:
        """Wait before the next attempt after a transient error, or raise it if the
        caller's deadline comes first."""
        now = self.clock.monotonic()
        delay = min(_RETRY_MAX, _RETRY_BASE * 2 ** (failures - 1)) * random.uniform(0.5, 1.0)
        if wait_end is not None and now + delay >= wait_end:
            raise BackendError(
                f"{error} [the acquire of {resource!r} gave up after {failures} failed "
                f"attempt(s) in {now - start:.2f}s of its {timeout}s timeout]",
                code=error.code,
                retryable=error.retryable,
                sent=getattr(error, "sent", None),
            ) from error
        _log.debug("acquire of %r retries after: %s", resource, error)
        if await self._sleep_until(self._closing, now + delay):
            raise ConfigurationError(f"{self!r} was closed while an acquire retried") from error

    async def _undo(self, resource: str, secret: str, ttl: float) -> None:
        """Release what an acquire that gave up may have taken, before its error reaches
        the caller (C11: nobody must be left holding a lock for a secret nobody has).

        The optional driver hook ``cancel(resource, secret, ttl)`` also refuses an attempt
        still on its way (Redis leaves a tombstone); without it the manager releases. The
        first try runs here, with a deadline of :data:`UNDO_LIMIT` (the driver bounds its
        round trips by it), so the clean-up is on its way to the backend before the caller
        gets its error. If the backend does not answer in time, the clean-up goes on in the
        background until it does, for as long as such a lock could live.
        """
        scope = set_deadline(time.monotonic() + UNDO_LIMIT)
        try:
            async with cancel_after(UNDO_LIMIT + _GRACE):
                await shield(self._clean_up(resource, secret, ttl))
            return
        except (BackendError, TimeoutError):
            _log.debug("clean-up of a failed acquire of %r deferred", resource, exc_info=True)
        finally:
            reset(scope)
        if not self._closed:
            task = spawn(self._reap, resource, secret, ttl, name=f"fence-undo:{resource}")
            self._watchdogs = [w for w in self._watchdogs if not w.done()]
            self._watchdogs.append(task)

    async def _clean_up(self, resource: str, secret: str, ttl: float) -> bool:
        """One try of the clean-up; whether the lock was held (and is released now)."""
        cancel = getattr(self.driver, "cancel", None)
        if cancel is not None:
            return bool(await cancel(resource, secret, ttl))
        return await self.driver.release(resource, secret)

    async def _reap(self, resource: str, secret: str, ttl: float) -> None:
        """Retry the clean-up of a failed acquire until the backend answers, the lock it
        may have taken has expired, or the manager closes."""
        clock = self.clock
        until = clock.monotonic() + ttl
        delay = _RETRY_BASE
        while True:
            if await self._sleep_until(self._closing, min(clock.monotonic() + delay, until)):
                return
            if clock.monotonic() >= until:
                return
            try:
                await self._clean_up(resource, secret, ttl)
                return
            except BackendError:
                delay = min(delay * 2, _RETRY_MAX)
            except Exception:
                _log.exception("clean-up of a failed acquire of %r failed", resource)
                return

    async def _abandon(self, resource: str, secret: str) -> None:
        """Tell the driver that a waiter gave up (timeout, cancellation, error).

        Optional driver hook ``abandon(resource, secret)``: a driver with a wait queue
        (FIFO fairness) removes the waiter and passes its turn on, so a waiter that left
        never holds up the ones behind it. Failures are ignored: queue entries also expire.
        """
        abandon = getattr(self.driver, "abandon", None)
        if abandon is None:
            return
        scope = set_deadline(time.monotonic() + UNDO_LIMIT)
        try:
            async with cancel_after(UNDO_LIMIT + _GRACE):
                await shield(abandon(resource, secret))
        except (BackendError, TimeoutError):
            _log.debug("abandon of a wait on %r failed", resource, exc_info=True)
        finally:
            reset(scope)

    async def _reenter(self, lease: AsyncLease, ttl: float, timeout: float | None) -> None:
        """Renew the held lease for a reentrant acquire, within the acquire's ``timeout``.

        On a slow or frozen backend the renewal is cut off at the caller's deadline, as a
        first acquire's attempts are; the lease keeps its depth and its deadline then, and
        the watchdog's own renewals go on deciding whether it is lost.
        """
        if lease._error is not None:
            raise lease._error
        sent = self.clock.monotonic()
        real_end = time.monotonic() + timeout if timeout else None
        scope = set_deadline(real_end)
        try:
            if real_end is None:
                renewed = await self.driver.renew(lease.resource, lease._secret, ttl)
            else:
                async with cancel_after(max(real_end - time.monotonic(), 0.0) + _GRACE):
                    renewed = await self.driver.renew(lease.resource, lease._secret, ttl)
        except TimeoutError as exc:
            raise BackendError(
                f"{self.source} did not answer the renewal of the reentrant acquire of "
                f"{lease.resource!r} within its {timeout}s timeout; the lease is still held "
                "at its depth",
                code="TIMEOUT",
                retryable=True,
            ) from exc
        finally:
            reset(scope)
        if not renewed:
            lease._mark_lost("a reentrant acquire found the lock no longer held")
            assert lease._error is not None
            raise lease._error
        lease._deadline = client_deadline(sent, ttl, drift=self.drift, margin=self.margin)
        lease._depth += 1

    def _check_issued(self, lease: AsyncLease, what: str) -> None:
        if not lease._issued or lease._manager is not self:
            raise NotOwnerError(
                f"cannot {what} the lease on {lease.resource!r} (token {lease.token}): "
                f"{self!r} did not issue it, so its holder does not own the lock",
                resource=lease.resource,
            )

    async def _renew(self, lease: AsyncLease, ttl: float) -> None:
        self._check_issued(lease, "renew")
        if lease._released:
            raise NotOwnerError(
                f"lease on {lease.resource!r} (token {lease.token}) was released",
                resource=lease.resource,
            )
        if lease._error is not None:
            raise lease._error
        sent = self.clock.monotonic()
        if not await self.driver.renew(lease.resource, lease._secret, ttl):
            lease._mark_lost("the backend no longer holds the lock for this lease")
            assert lease._error is not None
            raise lease._error
        lease._deadline = client_deadline(sent, ttl, drift=self.drift, margin=self.margin)
        self.events.emit(EventKind.RENEWED, self.source, lease.resource, lease.token)

    async def _release(self, lease: AsyncLease) -> None:
        self._check_issued(lease, "release")
        if lease._released:
            raise NotOwnerError(
                f"lease on {lease.resource!r} (token {lease.token}) is already released",
                resource=lease.resource,
            )
        if lease._depth > 1:
            lease._depth -= 1
            return
        lease._released = True
        lease._stop.set()
        key = (lease._owner, lease.resource)
        if self._held.get(key) is lease:
            del self._held[key]
        released = await shield(self.driver.release(lease.resource, lease._secret))
        self.events.emit(
            EventKind.RELEASED, self.source, lease.resource, lease.token, held=released
        )
        if not released:
            raise NotOwnerError(
                f"lease on {lease.resource!r} (token {lease.token}) was no longer held when "
                "released: it expired or was revoked, and another holder may have written",
                resource=lease.resource,
            )

    async def _sleep_until(self, signal: Signal, until: float) -> bool:
        """Wait until ``signal`` is set (return True) or the clock reaches ``until``."""
        clock = self.clock
        while True:
            if signal.is_set():
                return True
            delay = until - clock.monotonic()
            if delay <= 0:
                return False
            waiter = Waiter()
            if signal.attach(waiter):
                return True
            unsubscribe = subscribe(clock, waiter.wake)
            try:
                await waiter.wait(delay)
            finally:
                signal.detach(waiter)
                unsubscribe()

    async def _watch(self, lease: AsyncLease) -> None:
        """The renewal watchdog: renew at about ttl/3, report loss the moment it is certain."""
        clock = self.clock
        interval = lease.ttl / 3
        next_at = clock.monotonic() + interval
        while True:
            if await self._sleep_until(lease._stop, next_at):
                return
            sent = clock.monotonic()
            if sent >= lease._deadline:
                lease._mark_lost("the lease reached its deadline before a renewal succeeded")
                return
            # The renewal may take until the lease's deadline, and no longer.
            scope = set_deadline(time.monotonic() + max(lease._deadline - sent, 0.001))
            try:
                async with cancel_after(max(lease._deadline - sent, 0.001)):
                    renewed = await self.driver.renew(lease.resource, lease._secret, lease.ttl)
            except TimeoutError:
                lease._mark_lost("renewal did not answer before the lease ran out")
                return
            except BackendError as exc:
                if lease._stop.is_set():
                    return
                now = clock.monotonic()
                left = lease._deadline - now
                self.events.emit(
                    EventKind.RENEW_FAILED,
                    self.source,
                    lease.resource,
                    lease.token,
                    error=str(exc),
                    remaining=left,
                )
                if left <= 0 or not exc.retryable:
                    lease._mark_lost(f"renewal failed: {exc}")
                    return
                # Transient: try again soon, while the lease still has time.
                next_at = now + min(interval, max(left / 4, 0.01))
                continue
            except Exception as exc:
                lease._mark_lost(f"renewal failed unexpectedly: {exc!r}")
                raise
            finally:
                reset(scope)
            if lease._stop.is_set():
                return
            if not renewed:
                lease._mark_lost("the backend no longer holds the lock (expired or revoked)")
                return
            lease._deadline = client_deadline(sent, lease.ttl, drift=self.drift, margin=self.margin)
            self.events.emit(EventKind.RENEWED, self.source, lease.resource, lease.token)
            next_at = sent + interval
