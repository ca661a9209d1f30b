"""Registers the Redis guard with the guard conformance suite, per key and per resource.

``redis``: per-key fences; every scope is a key tagged with one test namespace, so a batch
over several scopes stays in one cluster slot. ``redis-resource``: per-resource fences;
every scope is its own resource (``{ns:scope}:v``), so scopes never fence each other and a
batch over several scopes would span resources (no ``"batch"`` feature).
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import Any

import pytest
import redis
import redis.asyncio

from fence.adapters.redis import AsyncRedisGuard, FenceScope, RedisGuard
from tests.registry import GuardHarnessFactory, register_guard_harness


def _int(raw: Any) -> int | None:
    return None if raw is None else int(raw)


class _Keys:
    def __init__(self, scope: FenceScope) -> None:
        self.scope = scope
        self.ns = secrets.token_hex(4)
        self.features = (
            frozenset({"batch", "registering_read"})
            if scope is FenceScope.KEY
            else frozenset({"registering_read"})
        )

    def key(self, name: str) -> str:
        if self.scope is FenceScope.KEY:
            return f"{{{self.ns}}}:{name}"
        return f"{{{self.ns}:{name}}}:v"


class RedisHarness(_Keys):
    """The sync guard behind the harness interface of ``fence.testing.guards``."""

    def __init__(self, url: str, scope: FenceScope) -> None:
        super().__init__(scope)
        self.client = redis.Redis.from_url(url)
        self.guard = RedisGuard(self.client, scope=scope)

    def claim(self, scope: str, token: int) -> int:
        return self.guard.claim(self.key(scope), token)

    def fence(self, scope: str) -> int | None:
        return self.guard.fence(self.key(scope))

    def create(self, scope: str, token: int, value: int) -> None:
        self.guard.set(self.key(scope), value, token=token)

    def update(self, scope: str, token: int, value: int) -> None:
        self.guard.set(self.key(scope), value, token=token, must_exist=True)

    def delete(self, scope: str, token: int) -> None:
        self.guard.delete(self.key(scope), token=token)

    def read(self, scope: str) -> int | None:
        return _int(self.client.get(self.key(scope)))

    def read_for_update(self, scope: str, token: int) -> int | None:
        return _int(self.guard.read_for_update(self.key(scope), token=token))

    def batch(self, token: int, values: Mapping[str, int]) -> None:
        batch = self.guard.batch(token)
        for scope, value in values.items():
            batch.set(self.key(scope), value)
        batch.execute()

    def close(self) -> None:
        self.client.close()


class AsyncRedisHarness(_Keys):
    """The asyncio guard behind the harness interface of ``fence.testing.guards``."""

    def __init__(self, url: str, scope: FenceScope) -> None:
        super().__init__(scope)
        self.client = redis.asyncio.Redis.from_url(url)
        self.guard = AsyncRedisGuard(self.client, scope=scope)

    async def claim(self, scope: str, token: int) -> int:
        return await self.guard.claim(self.key(scope), token)

    async def fence(self, scope: str) -> int | None:
        return await self.guard.fence(self.key(scope))

    async def create(self, scope: str, token: int, value: int) -> None:
        await self.guard.set(self.key(scope), value, token=token)

    async def update(self, scope: str, token: int, value: int) -> None:
        await self.guard.set(self.key(scope), value, token=token, must_exist=True)

    async def delete(self, scope: str, token: int) -> None:
        await self.guard.delete(self.key(scope), token=token)

    async def read(self, scope: str) -> int | None:
        return _int(await self.client.get(self.key(scope)))

    async def read_for_update(self, scope: str, token: int) -> int | None:
        return _int(await self.guard.read_for_update(self.key(scope), token=token))

    async def batch(self, token: int, values: Mapping[str, int]) -> None:
        batch = self.guard.batch(token)
        for scope, value in values.items():
            batch.set(self.key(scope), value)
        await batch.execute()

    async def close(self) -> None:
        await self.client.aclose()


def _maker(scope: FenceScope) -> Any:
    def make(request: pytest.FixtureRequest, is_async: bool) -> Any:
        url = request.getfixturevalue("redis_url")
        return AsyncRedisHarness(url, scope) if is_async else RedisHarness(url, scope)

    return make


register_guard_harness(
    GuardHarnessFactory(
        name="redis",
        make=_maker(FenceScope.KEY),
        marks=(pytest.mark.redis,),
        features=frozenset({"batch", "registering_read"}),
    )
)
register_guard_harness(
    GuardHarnessFactory(
        name="redis-resource",
        make=_maker(FenceScope.RESOURCE),
        marks=(pytest.mark.redis,),
        features=frozenset({"registering_read"}),
    )
)
