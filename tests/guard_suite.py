"""The interface of a guard harness: what the guard conformance suite drives.

Each storage guard registers a :class:`tests.registry.GuardHarnessFactory` in its own
``tests/guard_<name>.py``; ``make(request, is_async)`` returns an object with the methods
below (coroutines when ``is_async`` is true). Scope names are short strings such as
``"acct:1"``; the harness maps them to a Redis key or a SQL row. Values are ``int``.

Every write raises :class:`fence.StaleTokenError` (with ``reason``, ``token``, ``fence``,
``scope`` and, for batches, ``rejected``) exactly as the contract says, and
:class:`fence.InvalidTokenError` before any I/O for a bad token. An error's ``scope``
contains the harness scope name (e.g. ``"{ns}:acct:1"`` or ``"accounts(acct:1)"``).

Features (``GuardHarnessFactory.features`` and ``harness.features``):

- ``"batch"``: :meth:`GuardHarness.batch` is all-or-nothing over several scopes (C6).
- ``"registering_read"``: :meth:`GuardHarness.read_for_update` raises the fence (C8).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

__all__ = ["AsyncGuardHarness", "GuardHarness"]


class GuardHarness(Protocol):
    """A guard under test, driven through scope names and int values."""

    features: frozenset[str]

    def claim(self, scope: str, token: int) -> int:
        """C8: raise the fence without writing data; return the fence."""
        ...

    def fence(self, scope: str) -> int | None:
        """The current fence, ``None`` if there is none."""
        ...

    def create(self, scope: str, token: int, value: int) -> None:
        """A fenced insert-or-replace (upsert)."""
        ...

    def update(self, scope: str, token: int, value: int) -> None:
        """A fenced update; ``MISSING`` if the row or key does not exist."""
        ...

    def delete(self, scope: str, token: int) -> None:
        """A fenced delete that leaves a tombstone (C7)."""
        ...

    def read(self, scope: str) -> int | None:
        """The current value; ``None`` if absent or deleted."""
        ...

    def read_for_update(self, scope: str, token: int) -> int | None:
        """A registering read (C8): raise the fence, return the value."""
        ...

    def batch(self, token: int, values: Mapping[str, int]) -> None:
        """An all-or-nothing multi-write (C6), if the harness has ``"batch"``."""
        ...

    def close(self) -> None:
        """Release what the harness opened."""
        ...


class AsyncGuardHarness(Protocol):
    """The asyncio twin of :class:`GuardHarness`; same methods, as coroutines."""

    features: frozenset[str]

    async def claim(self, scope: str, token: int) -> int:
        """See :meth:`GuardHarness.claim`."""
        ...

    async def fence(self, scope: str) -> int | None:
        """See :meth:`GuardHarness.fence`."""
        ...

    async def create(self, scope: str, token: int, value: int) -> None:
        """See :meth:`GuardHarness.create`."""
        ...

    async def update(self, scope: str, token: int, value: int) -> None:
        """See :meth:`GuardHarness.update`."""
        ...

    async def delete(self, scope: str, token: int) -> None:
        """See :meth:`GuardHarness.delete`."""
        ...

    async def read(self, scope: str) -> int | None:
        """See :meth:`GuardHarness.read`."""
        ...

    async def read_for_update(self, scope: str, token: int) -> int | None:
        """See :meth:`GuardHarness.read_for_update`."""
        ...

    async def batch(self, token: int, values: Mapping[str, int]) -> None:
        """See :meth:`GuardHarness.batch`."""
        ...

    async def close(self) -> None:
        """See :meth:`GuardHarness.close`."""
        ...
