"""The third party's test module (copied in as ``test_toyguard.py``): the fixture is all."""

from __future__ import annotations

import pytest
from toyguard import AsyncToyHarness, ToyHarness

from fence.testing.guards import GuardFactory


@pytest.fixture
def fence_guard_harness() -> GuardFactory:
    """The toy guard, sync and asyncio, on a fresh dict each time."""
    return GuardFactory(make=ToyHarness, make_async=AsyncToyHarness)
