"""iofence's own guards through the guard kit (:mod:`fence.testing.guards`).

The kit adds its conformance tests (C1, C4-C9, C13, the write paths, pickled errors, the
differential test against ``MemoryGuard``) to this module because it defines the fixture
``fence_guard_harness``: once per guard registered in ``tests/guard_*.py``, sync and asyncio.
"""

from __future__ import annotations

from typing import Any

import pytest

from fence.testing.guards import GuardFactory
from tests.registry import GUARD_HARNESSES, GuardHarnessFactory


@pytest.fixture(
    params=[pytest.param(g, id=g.name, marks=g.marks) for g in GUARD_HARNESSES.values()]
)
def fence_guard_harness(request: pytest.FixtureRequest) -> GuardFactory:
    """Every registered guard, as the kit makes it."""
    guard: GuardHarnessFactory = request.param

    def make(is_async: bool) -> Any:
        harness = guard.make(request, is_async)
        assert guard.features <= harness.features  # what the registry says, it has
        return harness

    return GuardFactory(make=lambda: make(False), make_async=lambda: make(True))


def test_the_kit_adds_its_tests_here(request: pytest.FixtureRequest) -> None:
    """The plugin is loaded (``tests/conftest.py``): without it this module would collect
    no kit test at all and pass empty."""
    assert request.config.pluginmanager.has_plugin("fence.testing.guards")
    module = request.node.getparent(pytest.Module)
    assert module is not None
    assert "GuardKit" in [collector.name for collector in module.collect()]
