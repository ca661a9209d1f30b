"""Registers the ZooKeeper guard with the guard conformance suite, on the session's ensemble.

Every scope is a data node under one namespace of the test's own; the guard shares the
session of a ZooKeeper lock manager, as a user's guard would (``tests/_async/key_harness.py``).
"""

from __future__ import annotations

from typing import Any

import pytest

from fence import AsyncZooKeeperLockManager, ZooKeeperLockManager
from fence.adapters.zookeeper import AsyncZooKeeperGuard, ZooKeeperGuard
from tests._async.key_harness import CALL_TIMEOUT, FEATURES, AsyncKeyHarness
from tests._sync.key_harness import KeyHarness
from tests.registry import GuardHarnessFactory, register_guard_harness


class ZooKeeperHarness(KeyHarness):
    """The sync guard behind the harness interface of ``fence.testing.guards``."""

    def __init__(self, url: str) -> None:
        manager = ZooKeeperLockManager(url, request_timeout=CALL_TIMEOUT)
        super().__init__(manager, ZooKeeperGuard(manager), root="/")

    def create(self, scope: str, token: int, value: int) -> None:
        self.guard.create(self.key(scope), str(value), token=token)

    def update(self, scope: str, token: int, value: int) -> None:
        self.guard.set(self.key(scope), str(value), token=token)

    def stage(self, batch: Any, scope: str, value: int) -> None:
        batch.create(self.key(scope), str(value))


class AsyncZooKeeperHarness(AsyncKeyHarness):
    """The asyncio guard behind the harness interface of ``fence.testing.guards``."""

    def __init__(self, url: str) -> None:
        manager = AsyncZooKeeperLockManager(url, request_timeout=CALL_TIMEOUT)
        super().__init__(manager, AsyncZooKeeperGuard(manager), root="/")

    async def create(self, scope: str, token: int, value: int) -> None:
        await self.guard.create(self.key(scope), str(value), token=token)

    async def update(self, scope: str, token: int, value: int) -> None:
        await self.guard.set(self.key(scope), str(value), token=token)

    def stage(self, batch: Any, scope: str, value: int) -> None:
        batch.create(self.key(scope), str(value))


def _make(request: pytest.FixtureRequest, is_async: bool) -> Any:
    url = request.getfixturevalue("zookeeper_url")
    return AsyncZooKeeperHarness(url) if is_async else ZooKeeperHarness(url)


register_guard_harness(
    GuardHarnessFactory(
        name="zookeeper", make=_make, marks=(pytest.mark.zookeeper,), features=FEATURES
    )
)
