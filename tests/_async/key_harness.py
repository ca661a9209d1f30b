"""What the etcd and ZooKeeper guards' harnesses for the guard conformance suite share
(``tests/guard_etcd.py``, ``tests/guard_zookeeper.py``).

Every scope is a data key (a node) under one namespace of the harness's own; the guard
shares the client of a lock manager, as a user's guard would. A subclass says how a value
is created, updated and put in a batch.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any

FEATURES = frozenset({"batch", "registering_read"})

#: The suite checks what the guard decides, not how fast a loaded cluster answers: a call
#: may wait that long (the managers' default is a third of their ttl, at most 5 s).
CALL_TIMEOUT = 15.0


def as_int(raw: bytes | None) -> int | None:
    """A stored value as the suite writes it, or ``None``."""
    return None if raw is None else int(raw)


class AsyncKeyHarness:
    """A guard behind the harness interface of ``fence.testing.guards``.

    Args:
        manager: the lock manager whose client the guard shares; closed with the harness.
        guard: the guard under test.
        root: what every key starts with, before the namespace.
    """

    features = FEATURES

    def __init__(self, manager: Any, guard: Any, root: str = "") -> None:
        self.manager = manager
        self.guard = guard
        self.ns = f"{root}g-{secrets.token_hex(4)}"

    def key(self, name: str) -> str:
        return f"{self.ns}/{name}"

    async def create(self, scope: str, token: int, value: int) -> None:
        raise NotImplementedError

    async def update(self, scope: str, token: int, value: int) -> None:
        raise NotImplementedError

    def stage(self, batch: Any, scope: str, value: int) -> None:
        """Add the write of ``value`` to ``scope`` to ``batch``."""
        raise NotImplementedError

    async def claim(self, scope: str, token: int) -> int:
        return await self.guard.claim(self.key(scope), token)

    async def fence(self, scope: str) -> int | None:
        return await self.guard.fence(self.key(scope))

    async def delete(self, scope: str, token: int) -> None:
        await self.guard.delete(self.key(scope), token=token)

    async def read(self, scope: str) -> int | None:
        return as_int((await self.guard.get(self.key(scope)))[0])

    async def read_for_update(self, scope: str, token: int) -> int | None:
        return as_int(await self.guard.read_for_update(self.key(scope), token=token))

    async def batch(self, token: int, values: Mapping[str, int]) -> None:
        batch = self.guard.batch(token)
        for scope, value in values.items():
            self.stage(batch, scope, value)
        await batch.execute()

    async def close(self) -> None:
        await self.guard.close()
        await self.manager.close()
