"""Registers the etcd guard with the guard conformance suite, on the session's etcd cluster.

Every scope is a data key under one namespace of the test's own; the guard shares the
client of an etcd lock manager, as a user's guard would (``tests/_async/key_harness.py``).
"""

from __future__ import annotations

from typing import Any

import pytest

from fence import AsyncEtcdLockManager, EtcdLockManager
from fence.adapters.etcd import AsyncEtcdGuard, EtcdGuard
from tests._async.key_harness import CALL_TIMEOUT, FEATURES, AsyncKeyHarness
from tests._sync.key_harness import KeyHarness
from tests.registry import GuardHarnessFactory, register_guard_harness


class EtcdHarness(KeyHarness):
    """The sync guard behind the harness interface of ``fence.testing.guards``."""

    def __init__(self, url: str) -> None:
        manager = EtcdLockManager(url, request_timeout=CALL_TIMEOUT)
        super().__init__(manager, EtcdGuard(manager))

    def create(self, scope: str, token: int, value: int) -> None:
        self.guard.put(self.key(scope), str(value), token=token)

    def update(self, scope: str, token: int, value: int) -> None:
        self.guard.put(self.key(scope), str(value), token=token, must_exist=True)

    def stage(self, batch: Any, scope: str, value: int) -> None:
        batch.put(self.key(scope), str(value))


class AsyncEtcdHarness(AsyncKeyHarness):
    """The asyncio guard behind the harness interface of ``fence.testing.guards``."""

    def __init__(self, url: str) -> None:
        manager = AsyncEtcdLockManager(url, request_timeout=CALL_TIMEOUT)
        super().__init__(manager, AsyncEtcdGuard(manager))

    async def create(self, scope: str, token: int, value: int) -> None:
        await self.guard.put(self.key(scope), str(value), token=token)

    async def update(self, scope: str, token: int, value: int) -> None:
        await self.guard.put(self.key(scope), str(value), token=token, must_exist=True)

    def stage(self, batch: Any, scope: str, value: int) -> None:
        batch.put(self.key(scope), str(value))


def _make(request: pytest.FixtureRequest, is_async: bool) -> Any:
    url = request.getfixturevalue("etcd_url")
    return AsyncEtcdHarness(url) if is_async else EtcdHarness(url)


register_guard_harness(
    GuardHarnessFactory(name="etcd", make=_make, marks=(pytest.mark.etcd,), features=FEATURES)
)
