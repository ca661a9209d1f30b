"""The unit of work: acquire, bind, claim, run, commit, release, around one session.

Written once for asyncio; ``tools/async_to_sync.py`` generates the sync twin.
"""

from __future__ import annotations

import asyncio  # unasync: remove
import functools
import inspect
import logging
import string
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar, overload

from sqlalchemy import Table
from sqlalchemy.ext.asyncio import AsyncSession  # unasync: from sqlalchemy.orm import Session

from fence._async.manager import AsyncLease
from fence._core import LeaseMode, validate_mode, validate_resource
from fence._errors import ConfigurationError, NotOwnerError
from fence._events import EventBus
from fence.abc import AsyncLockManager

from .._orm import bind, check_lease
from .._orm_watch import LossWatch  # unasync: remove

__all__ = ["AsyncUnitOfWork"]

_log = logging.getLogger("fence")

_P = ParamSpec("_P")
_R = TypeVar("_R")

# A unit of work that takes the session first, then the caller's arguments _P; what the
# caller calls; and a unit of work whose session is a keyword argument, which PEP 612
# cannot take out of its parameters (only leading positional ones).
_Work = Callable[
    Concatenate[AsyncSession, _P], Awaitable[_R]  # unasync: Concatenate[Session, _P], _R
]
_Call = Callable[_P, Awaitable[_R]]  # unasync: _Call = Callable[_P, _R]
_AnyCall = Callable[..., Awaitable[_R]]  # unasync: _AnyCall = Callable[..., _R]


class _Decorator(Protocol):
    """What :meth:`AsyncUnitOfWork.fenced` returns: a decorator that keeps the types of
    the function's other parameters and of its result."""

    @overload
    def __call__(self, fn: _Work[_P, _R], /) -> _Call[_P, _R]: ...
    @overload
    def __call__(self, fn: _AnyCall[_R], /) -> _AnyCall[_R]: ...


class AsyncUnitOfWork:
    """Run a unit of work under a lease: acquire, bind, claim, run, commit, release.

    ``async with uow("order:42") as session`` acquires the lease on ``order:42``, opens a
    session, binds it to the lease (:func:`fence.adapters.orm.bind`), starts the
    transaction so that the claim runs before the block's first read (C8), runs the block,
    checks the lease and commits, and always closes the session and releases the lease.
    An error in the block rolls the transaction back. A refusal the block catches (a
    ``StaleTokenError`` of a write, say) still refuses the transaction: every later
    statement and the commit raise :class:`fence.TransactionRefusedError`, and nothing is
    committed.

    When the lease is lost while the block runs (a renewal failed, or the lease reached
    its deadline without one), the task running the block is cancelled and
    :class:`fence.LeaseLostError` is raised in place of the cancellation. The watch is
    disarmed just before commit: from there on the fences judge the writes.

    With ``mode="read"`` the unit of work takes a read lease (C13), shared with other
    readers, and the session is read-only: every write raises :class:`fence.ReadLeaseError`
    before any I/O, and instead of claiming, the transaction checks at its start and at
    its commit that no writer newer than the lease has written (:class:`StaleTokenError`
    otherwise; see :func:`fence.adapters.orm.bind`).

    Args:
        manager: the lock manager.
        sessions: makes a new session (an ``async_sessionmaker``).
        ttl: lease time in seconds (default: the manager's).
        timeout: how long to wait for the lock (``None``: forever).
        renew: run the renewal watchdog (default: the manager's).
        claim: claim the resource in the fence register at the start (C8).
        register: the register table (default ``fence_register``).
        events: the event bus for the session hook's events.
        unfenced: mapped classes or tables without a fence that the work may write
            (see :func:`fence.adapters.orm.bind`).
        mode: ``"write"`` (the default) or ``"read"``: the lease to take, and a
            read-only session for ``"read"``.

    Example::

        uow = AsyncUnitOfWork(manager, async_sessionmaker(engine))

        async with uow("order:42") as session:
            order = await session.get(Order, 42)
            order.state = "paid"

        @uow.fenced("order:{order_id}")
        async def pay(session: AsyncSession, order_id: int) -> None:
            (await session.get_one(Order, order_id)).state = "paid"

        await pay(42)
    """

    def __init__(
        self,
        manager: AsyncLockManager,
        sessions: Callable[[], AsyncSession],
        *,
        ttl: float | None = None,
        timeout: float | None = None,
        renew: bool | None = None,
        claim: bool = True,
        register: Table | None = None,
        events: EventBus | None = None,
        unfenced: Iterable[Any] = (),
        mode: LeaseMode | str = LeaseMode.WRITE,
    ) -> None:
        self.mode = validate_mode(mode)
        self.manager = manager
        self.sessions = sessions
        self.ttl = ttl
        self.timeout = timeout
        self.renew = renew
        self.claim = claim
        self.register = register
        self.events = events
        self.unfenced = tuple(unfenced)

    @asynccontextmanager
    async def __call__(
        self, resource: str, *, mode: LeaseMode | str | None = None
    ) -> AsyncIterator[AsyncSession]:
        """Run the ``async with`` block as one fenced unit of work on ``resource``.

        Args:
            resource: the resource to lock; also the fence-register scope claimed.
            mode: ``"read"`` or ``"write"`` for this unit of work (default: the one given
                to the constructor).

        Raises:
            AcquireTimeout: the lock was not free within ``timeout``.
            StaleTokenError: the claim or a write was refused (a newer holder wrote); for
                a read: a writer newer than the lease wrote.
            TransactionRefusedError: the block caught such a refusal and went on; its
                transaction stayed refused, so nothing was committed.
            ReadLeaseError: the block wrote under a read lease (before any I/O).
            LeaseLostError: the lease was lost before commit; nothing was committed.
            BackendError: the lock manager or the database failed.
        """
        mode = self.mode if mode is None else validate_mode(mode)
        resource = validate_resource(resource)
        lease = await self.manager.acquire(
            resource, mode=mode, ttl=self.ttl, timeout=self.timeout, renew=self.renew
        )
        watch = LossWatch(lease)  # unasync: remove
        committed = False
        try:
            session = self.sessions()
            try:
                found = bind(
                    session,
                    lease,
                    claim=self.claim,
                    register=self.register,
                    events=self.events,
                    unfenced=self.unfenced,
                    mode=mode,
                )
                found.eager = True  # refused before the block runs, not at its first read
                await session.connection()  # begins the transaction: the claim runs here
                yield session
                await watch.stop()  # unasync: remove
                check_lease(lease)
                await session.commit()
                committed = True
            except asyncio.CancelledError as exc:  # unasync: remove
                if watch.fired:  # unasync: remove
                    raise watch.error() from exc  # unasync: remove
                raise  # unasync: remove
            finally:
                await watch.stop()  # unasync: remove
                await session.close()
        finally:
            await self._release(lease, committed)

    async def _release(self, lease: AsyncLease, committed: bool) -> None:
        try:
            await lease.release()  # the manager shields the release from cancellation
        except NotOwnerError:
            if committed:
                # The commit was fenced, so no newer holder had written before it; the
                # lease ran out afterwards. Worth knowing, not worth failing the work.
                _log.warning("lease on %r ended before its release, after commit", lease.resource)

    def fenced(
        self, resource: str | Callable[..., str], *, mode: LeaseMode | str | None = None
    ) -> _Decorator:
        """Decorate a function to run as a unit of work; it gets the session.

        The function takes the session as its first parameter, named ``session``, and is
        called without it: type checkers see the decorated function with the other
        parameters and the result of the function (``Concatenate``, PEP 612). A function
        that takes ``session`` as a keyword argument instead is served too, but type
        checkers then see its parameters as ``...`` (PEP 612 cannot take a keyword
        parameter out of a signature); its result keeps its type.

        Args:
            resource: a ``str.format`` template filled from the call's arguments by name
                (``"order:{order_id}"``), or a function of the same arguments that returns
                the resource.
            mode: ``"read"`` for a read-only unit of work under a read lease, ``"write"``
                (default: the constructor's).

        Raises:
            ConfigurationError: the template names an argument the function does not take.

        Example::

            @uow.fenced("account:{account_id}")
            async def deposit(session: AsyncSession, account_id: int, amount: int) -> None:
                account = await session.get_one(Account, account_id)
                account.balance += amount

            await deposit(7, 100)
        """

        chosen = None if mode is None else validate_mode(mode)

        def decorate(fn: _AnyCall[Any]) -> _AnyCall[Any]:
            signature = inspect.signature(fn)
            if "session" not in signature.parameters:
                raise ConfigurationError(f"{fn.__qualname__} must take a 'session' argument")
            first = next(iter(signature.parameters.values()))
            leading = first.name == "session" and first.kind in (
                inspect.Parameter.POSITIONAL_ONLY,
                inspect.Parameter.POSITIONAL_OR_KEYWORD,
            )
            # The caller's view: the function's parameters without the session.
            outer = signature.replace(
                parameters=[p for p in signature.parameters.values() if p.name != "session"]
            )
            if isinstance(resource, str):
                names = {f[1] for f in string.Formatter().parse(resource) if f[1]}
                unknown = names - set(outer.parameters)
                if unknown:
                    raise ConfigurationError(
                        f"resource template {resource!r} names {sorted(unknown)}, which "
                        f"{fn.__qualname__} does not take"
                    )

            @functools.wraps(fn)
            async def run(*args: Any, **kwargs: Any) -> Any:
                if callable(resource):
                    name = resource(*args, **kwargs)
                else:
                    bound = outer.bind_partial(*args, **kwargs)
                    bound.apply_defaults()
                    name = resource.format(**bound.arguments)
                async with self(name, mode=chosen) as session:
                    if leading:
                        return await fn(session, *args, **kwargs)
                    return await fn(*args, session=session, **kwargs)

            run.__signature__ = outer  # type: ignore[attr-defined]
            return run

        return decorate
