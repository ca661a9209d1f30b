"""Blocks of ORM work under a lease's token (:func:`fenced`) or explicitly without one
(:func:`unfenced`), on one Django connection.

A block is a transaction: it opens ``transaction.atomic(using)``, so that the token that
travels with the transaction (C14) covers exactly the block's statements. Under Django's
autocommit every statement outside ``atomic()`` is a transaction of its own: a token set
by one statement would be gone at the next, and a connection kept open
(``CONN_MAX_AGE``) must never carry it into the next request. Inside the caller's own
``atomic()`` (or without autocommit, ``AUTOCOMMIT: False``) the block is a savepoint; its
end sets the transaction's token back to the enclosing block's (or to none), so the rest
of the caller's transaction is unfenced again.

Django's async ORM (``asave()``, ``aupdate()``, ``adelete()``, ``abulk_create()``...) runs
the sync ORM in ``sync_to_async``'s one thread, over that thread's connection, and
refuses the sync calls in the event loop's thread (``SynchronousOnlyOperation``): async
code opens the block with ``async with`` :func:`afenced` (or :func:`aunfenced`), which
enters and leaves it in that same thread, on that same connection.
"""

from __future__ import annotations

from contextlib import ContextDecorator
from types import TracebackType
from typing import Any, Self

from asgiref.sync import sync_to_async
from django.db import DEFAULT_DB_ALIAS, connections, transaction

from fence._core import validate_token

from ._state import Binding, began, install_wrapper, restore, state_of

__all__ = ["afenced", "aunfenced", "fenced", "unfenced"]


class _Block(ContextDecorator):
    """A block bound to a connection: a transaction (or a savepoint) and its binding."""

    def __init__(self, token: int | None, using: str | None, scope: str | None = None) -> None:
        self._token = token
        self._using = using or DEFAULT_DB_ALIAS
        self._scope = scope
        self._open: list[tuple[Any, Binding]] = []

    def _recreate_cm(self) -> Self:
        # A decorated function may run in several threads at once: a block each.
        fresh = type(self).__new__(type(self))
        _Block.__init__(fresh, self._token, self._using, self._scope)
        return fresh

    def _begin(self) -> None:
        conn = connections[self._using]
        install_wrapper(conn)
        nested = conn.in_atomic_block
        atomic = transaction.atomic(using=self._using)
        atomic.__enter__()
        # Without autocommit (AUTOCOMMIT: False) Django's outermost atomic() is a savepoint
        # of a transaction that goes on after it: the block is nested there too.
        binding = Binding(self._token, nested or not conn.commit_on_exit, self._scope)
        state_of(conn).stack.append(binding)
        began(conn)
        self._open.append((atomic, binding))

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        atomic, binding = self._open.pop()
        conn = connections[self._using]
        state = state_of(conn)
        if binding in state.stack:
            state.stack.remove(binding)
        try:
            restore(conn, binding, failed=exc_type is not None)
        except BaseException as error:
            atomic.__exit__(type(error), error, error.__traceback__)
            raise
        result: bool | None = atomic.__exit__(exc_type, exc, tb)
        return result


class fenced(_Block):
    """Run a block of Django ORM work under ``lease``'s token, in one transaction.

    Every statement of the block on the connection ``using`` carries the token to the
    database (the first sends it; C14): ``Model.save()``, ``QuerySet.update()``,
    ``delete()``, ``bulk_update()``, ``bulk_create(update_conflicts=True)`` and raw
    ``cursor.execute()`` are judged by the fenced models' triggers. A write with a token
    below a row's fence raises :class:`fence.StaleTokenError` and changes nothing; the
    transaction is rolled back. Use it as a context manager or a decorator::

        with manager.lock("account:42") as lease, fenced(lease):
            account = Account.objects.get(pk=42)
            account.balance += 5
            account.save()

    The first statement of the block also claims the lease's resource (C8): it raises
    the resource's fence in the app's fence register (``iofence_fence_register``, made
    by ``migrate iofence``) to the token, so that from then on a stale holder's block is
    refused at its first statement, a read included, and cannot write between the new
    holder's read and its first write. On PostgreSQL the claim travels in the same query
    text as the statement.

    Args:
        lease: a write lease (its ``token`` is used; it is checked to be valid at the
            start of the block), or a token (no claim: a token names no resource).
        using: the database alias (default ``"default"``).
        claim: claim the lease's resource at the first statement (the default).

    Raises:
        InvalidTokenError: the token is not one (C1).
        ReadLeaseError: a read lease's token (C13).
        LeaseExpiredError: the lease is no longer valid at the start of the block.
        StaleTokenError: (at the block's first statement) a newer holder claimed the
            lease's resource; or a write met a row a newer holder wrote.
    """

    def __init__(self, lease: Any, *, using: str | None = None, claim: bool = True) -> None:
        self._lease = lease
        token = lease if isinstance(lease, int) else lease.token
        scope = None if isinstance(lease, int) or not claim else str(lease.resource)
        super().__init__(validate_token(token), using, scope)

    def _recreate_cm(self) -> Self:
        fresh = super()._recreate_cm()
        fresh._lease = self._lease
        return fresh

    def __enter__(self) -> Self:
        check = getattr(self._lease, "check", None)
        if check is not None:
            check()
        self._begin()
        return self


class unfenced(_Block):
    """Run a block that writes fenced models without a token: the explicit opt-out (C9).

    The block is a transaction that the database sees opting out
    (``iofence.unfenced = on`` on PostgreSQL, the connection's flag on SQLite): the judge
    lets its writes without a token through, but never lets one lower a fence. For data
    migrations and repairs, not for work a lease should cover. Inside :func:`fenced` the
    block's token stays, and its writes are judged by it.

    Args:
        using: the database alias (default ``"default"``).
    """

    def __init__(self, *, using: str | None = None) -> None:
        super().__init__(None, using)

    def __enter__(self) -> Self:
        self._begin()
        return self


class _AsyncBlock:
    """A sync block entered and left through ``sync_to_async`` (thread-sensitive: the
    thread and connection the async ORM uses)."""

    def __init__(self, block: fenced | unfenced) -> None:
        self._block = block

    async def __aenter__(self) -> Self:
        await sync_to_async(self._block.__enter__)()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        result: bool | None = await sync_to_async(self._block.__exit__)(exc_type, exc, tb)
        return result


class afenced(_AsyncBlock):
    """:func:`fenced` for Django's async ORM: ``async with afenced(lease):`` around
    ``asave()``, ``aupdate()``, ``adelete()``, ``abulk_create()``, ``abulk_update()`` and
    the other ``a``-methods, which run in ``sync_to_async``'s thread on the connection the
    block is bound to::

        async with afenced(lease):
            account = await Account.objects.aget(pk=42)
            account.balance += 5
            await account.asave()

    Args:
        lease: as :func:`fenced`'s.
        using: the database alias (default ``"default"``).
        claim: claim the lease's resource at the first statement (the default).

    Raises:
        InvalidTokenError: the token is not one (C1).
        ReadLeaseError: a read lease's token (C13).
        LeaseExpiredError: (at the start of the block) the lease is no longer valid.
        StaleTokenError: see :func:`fenced`.
    """

    def __init__(self, lease: Any, *, using: str | None = None, claim: bool = True) -> None:
        super().__init__(fenced(lease, using=using, claim=claim))


class aunfenced(_AsyncBlock):
    """:func:`unfenced` for Django's async ORM (``async with aunfenced():``).

    Args:
        using: the database alias (default ``"default"``).
    """

    def __init__(self, *, using: str | None = None) -> None:
        super().__init__(unfenced(using=using))
