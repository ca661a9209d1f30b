"""A third party's guard: a fenced key-value store in a dict, written against public names.

It imports nothing of iofence but ``fence`` and ``fence.testing.guards``, as a package
outside the project would. ``TOYGUARD_MUTANT`` breaks it on purpose, one way at a time:

- ``older``: accepts a token one below the fence (an older holder gets through);
- ``half-batch``: a batch writes the items it accepts and refuses the others;
- ``write-on-refusal``: a refused write stores its value anyway, then raises.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from fence import Reason, StaleTokenError, validate_token

MUTANT = os.environ.get("TOYGUARD_MUTANT", "")


class ToyGuard:
    """Each key is its own fence scope; a delete keeps the fence."""

    def __init__(self) -> None:
        self.values: dict[str, int] = {}
        self.fences: dict[str, int] = {}

    def _check(self, key: str, token: object, *, must_exist: bool = False) -> int:
        checked = validate_token(token)
        fence = self.fences.get(key, 0)
        floor = fence - 1 if MUTANT == "older" else fence
        if checked < floor:
            raise StaleTokenError(f"toy:{key}", checked, fence, Reason.STALE)
        if must_exist and key not in self.values:
            raise StaleTokenError(f"toy:{key}", checked, fence or None, Reason.MISSING)
        return checked

    def set(self, key: str, value: int, token: int, *, must_exist: bool = False) -> None:
        """Write ``value`` under ``token``; ``must_exist`` makes it an update."""
        try:
            checked = self._check(key, token, must_exist=must_exist)
        except StaleTokenError:
            if MUTANT == "write-on-refusal":
                self.values[key] = value
            raise
        self.fences[key] = checked
        self.values[key] = value

    def delete(self, key: str, token: int) -> None:
        """Delete the value and keep the fence."""
        self.fences[key] = self._check(key, token)
        self.values.pop(key, None)

    def claim(self, key: str, token: int) -> int:
        """Raise the fence without writing."""
        self.fences[key] = self._check(key, token)
        return self.fences[key]

    def read_for_update(self, key: str, token: int) -> int | None:
        """Raise the fence and return the value."""
        self.fences[key] = self._check(key, token)
        return self.values.get(key)

    def set_many(self, token: int, values: Mapping[str, int]) -> None:
        """Write several keys, all or nothing."""
        checked = validate_token(token)
        refused: list[StaleTokenError] = []
        for key in values:
            try:
                self._check(key, checked)
            except StaleTokenError as err:
                refused.append(err)
        if MUTANT == "half-batch":
            for key, value in values.items():
                if all(err.scope != f"toy:{key}" for err in refused):
                    self.fences[key], self.values[key] = checked, value
        if len(refused) == 1:
            raise refused[0]
        if refused:
            raise StaleTokenError("toy:batch", checked, refused[0].fence, rejected=tuple(refused))
        for key, value in values.items():
            self.fences[key], self.values[key] = checked, value


class ToyHarness:
    """The toy guard behind the kit's harness interface."""

    features = frozenset({"batch", "registering_read"})

    def __init__(self) -> None:
        self.guard = ToyGuard()

    def claim(self, scope: str, token: int) -> int:
        return self.guard.claim(scope, token)

    def fence(self, scope: str) -> int | None:
        return self.guard.fences.get(scope)

    def create(self, scope: str, token: int, value: int) -> None:
        self.guard.set(scope, value, token)

    def update(self, scope: str, token: int, value: int) -> None:
        self.guard.set(scope, value, token, must_exist=True)

    def delete(self, scope: str, token: int) -> None:
        self.guard.delete(scope, token)

    def read(self, scope: str) -> int | None:
        return self.guard.values.get(scope)

    def read_for_update(self, scope: str, token: int) -> int | None:
        return self.guard.read_for_update(scope, token)

    def batch(self, token: int, values: Mapping[str, int]) -> None:
        self.guard.set_many(token, values)

    def close(self) -> None:
        pass


class AsyncToyHarness:
    """The same guard with coroutines, as a guard with an asyncio API has."""

    features = ToyHarness.features

    def __init__(self) -> None:
        self.sync = ToyHarness()

    async def claim(self, scope: str, token: int) -> int:
        return self.sync.claim(scope, token)

    async def fence(self, scope: str) -> int | None:
        return self.sync.fence(scope)

    async def create(self, scope: str, token: int, value: int) -> None:
        self.sync.create(scope, token, value)

    async def update(self, scope: str, token: int, value: int) -> None:
        self.sync.update(scope, token, value)

    async def delete(self, scope: str, token: int) -> None:
        self.sync.delete(scope, token)

    async def read(self, scope: str) -> int | None:
        return self.sync.read(scope)

    async def read_for_update(self, scope: str, token: int) -> int | None:
        return self.sync.read_for_update(scope, token)

    async def batch(self, token: int, values: Mapping[str, int]) -> None:
        self.sync.batch(token, values)

    async def close(self) -> None:
        pass
