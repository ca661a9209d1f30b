"""The quorum manager in the manager conformance suite, over three real redis-servers.

The nodes come from the session fixture ``quorum_urls`` in ``tests/fix_quorum.py`` (started
once, flushed per test). The faults only a quorum has (a node stopped, killed, wiped or
refusing; a minority or a majority losing its data) are in ``tests/test_quorum_faults.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

from fence._async.quorum import AsyncQuorumLockManager
from fence._sync.quorum import QuorumLockManager
from tests.registry import ManagerBackend, register_manager_backend


def _setup(request: pytest.FixtureRequest) -> list[str]:
    return list(request.getfixturevalue("quorum_urls"))


def _make(urls: list[str], is_async: bool, **options: Any) -> Any:
    cls = AsyncQuorumLockManager if is_async else QuorumLockManager
    return cls(urls, **options)


# No shared locks: the quorum refuses mode="read" (tests/_async/test_shared_conformance.py
# checks the refusal).
register_manager_backend(
    ManagerBackend("quorum", _setup, _make, marks=(pytest.mark.redis,), shared=False)
)
