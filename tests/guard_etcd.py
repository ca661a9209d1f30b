"""Registers the etcd guard with the guard conformance suite, on the session's etcd cluster.

Every scope is a data key under one namespace of the test's own; the guard shares the
client of an etcd lock manager, as a user's guard would.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any

import pytest

from fence import AsyncEtcdLockManager, EtcdLockManager
from fence.adapters.etcd import AsyncEtcdGuard, EtcdGuard
from tests.registry import GuardHarnessFactory, register_guard_harness

FEATURES = frozenset({"batch", "registering_read"})


def _int(raw: bytes | None) -> int | None:
    return None if raw is None else int(raw)


# The suite checks what the guard decides, not how fast a loaded cluster answers: a call
# may wait that long (the manager's default is a third of its ttl, at most 5 s).
_CALL = 15.0


class _Keys:
    features = FEATURES

    def __init__(self) -> None:
        self.ns = f"g-{secrets.token_hex(4)}"

    def key(self, name: str) -> str:
        return f"{self.ns}/{name}"


class EtcdHarness(_Keys):
    """The sync guard behind the harness interface of ``fence.testing.guards``."""

    def __init__(self, url: str) -> None:
        super().__init__()
        self.manager = EtcdLockManager(url, request_timeout=_CALL)
        self.guard = EtcdGuard(self.manager)

    def claim(self, scope: str, token: int) -> int:
        return self.guard.claim(self.key(scope), token)

    def fence(self, scope: str) -> int | None:
        return self.guard.fence(self.key(scope))

    def create(self, scope: str, token: int, value: int) -> None:
        self.guard.put(self.key(scope), str(value), token=token)

    def update(self, scope: str, token: int, value: int) -> None:
        self.guard.put(self.key(scope), str(value), token=token, must_exist=True)

    def delete(self, scope: str, token: int) -> None:
        self.guard.delete(self.key(scope), token=token)

    def read(self, scope: str) -> int | None:
        return _int(self.guard.get(self.key(scope))[0])

    def read_for_update(self, scope: str, token: int) -> int | None:
        return _int(self.guard.read_for_update(self.key(scope), token=token))

    def batch(self, token: int, values: Mapping[str, int]) -> None:
        batch = self.guard.batch(token)
        for scope, value in values.items():
            batch.put(self.key(scope), str(value))
        batch.execute()

    def close(self) -> None:
        self.guard.close()
        self.manager.close()


class AsyncEtcdHarness(_Keys):
    """The asyncio guard behind the harness interface of ``fence.testing.guards``."""

    def __init__(self, url: str) -> None:
        super().__init__()
        self.manager = AsyncEtcdLockManager(url, request_timeout=_CALL)
        self.guard = AsyncEtcdGuard(self.manager)

    async def claim(self, scope: str, token: int) -> int:
        return await self.guard.claim(self.key(scope), token)

    async def fence(self, scope: str) -> int | None:
        return await self.guard.fence(self.key(scope))

    async def create(self, scope: str, token: int, value: int) -> None:
        await self.guard.put(self.key(scope), str(value), token=token)

    async def update(self, scope: str, token: int, value: int) -> None:
        await self.guard.put(self.key(scope), str(value), token=token, must_exist=True)

    async def delete(self, scope: str, token: int) -> None:
        await self.guard.delete(self.key(scope), token=token)

    async def read(self, scope: str) -> int | None:
        return _int((await self.guard.get(self.key(scope)))[0])

    async def read_for_update(self, scope: str, token: int) -> int | None:
        return _int(await self.guard.read_for_update(self.key(scope), token=token))

    async def batch(self, token: int, values: Mapping[str, int]) -> None:
        batch = self.guard.batch(token)
        for scope, value in values.items():
            batch.put(self.key(scope), str(value))
        await batch.execute()

    async def close(self) -> None:
        await self.guard.close()
        await self.manager.close()


def _make(request: pytest.FixtureRequest, is_async: bool) -> Any:
    url = request.getfixturevalue("etcd_url")
    return AsyncEtcdHarness(url) if is_async else EtcdHarness(url)


register_guard_harness(
    GuardHarnessFactory(name="etcd", make=_make, marks=(pytest.mark.etcd,), features=FEATURES)
)
