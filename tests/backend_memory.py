"""The in-memory manager in the manager conformance suite."""

from __future__ import annotations

from typing import Any

import pytest

from fence import AsyncMemoryLockManager, MemoryBackend, MemoryLockManager
from tests.registry import ManagerBackend, register_manager_backend


def _setup(request: pytest.FixtureRequest) -> MemoryBackend:
    return MemoryBackend()


def _make(backend: MemoryBackend, is_async: bool, **options: Any) -> Any:
    cls = AsyncMemoryLockManager if is_async else MemoryLockManager
    return cls(backend, **options)


register_manager_backend(ManagerBackend("memory", _setup, _make))
