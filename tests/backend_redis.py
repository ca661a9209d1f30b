"""The Redis manager in the manager conformance suite, with and without FIFO waiting.

Both run against the session's throwaway ``redis-server``; the fault tests for what only
Redis can do (SIGSTOP, SIGKILL, AOF loss, a cluster) are in ``tests/test_redis_manager_faults.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

from fence._async.redis import AsyncRedisLockManager
from fence._sync.redis import RedisLockManager
from tests.registry import ManagerBackend, register_manager_backend


def _setup(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue("redis_url"))


def _make(url: str, is_async: bool, **options: Any) -> Any:
    cls = AsyncRedisLockManager if is_async else RedisLockManager
    return cls(url, **options)


def _make_fifo(url: str, is_async: bool, **options: Any) -> Any:
    return _make(url, is_async, fifo=True, **options)


register_manager_backend(ManagerBackend("redis", _setup, _make, marks=(pytest.mark.redis,)))
register_manager_backend(
    ManagerBackend("redis-fifo", _setup, _make_fifo, marks=(pytest.mark.redis,))
)
