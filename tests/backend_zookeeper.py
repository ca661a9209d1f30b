"""The ZooKeeper manager in the manager conformance suite, on the session's 3-server
ensemble.

The managers ask for 60 s sessions (the ensemble grants up to 120 s), so that every ttl
the suite uses fits in the session, and give a call as long. The faults are in
``tests/test_consensus_faults.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

from fence._async.zookeeper import AsyncZooKeeperLockManager
from fence._sync.zookeeper import ZooKeeperLockManager
from tests.registry import ManagerBackend, register_manager_backend


def _setup(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue("zookeeper_url"))


def _make(url: str, is_async: bool, **options: Any) -> Any:
    cls = AsyncZooKeeperLockManager if is_async else ZooKeeperLockManager
    options.setdefault("session_timeout", 60.0)
    # The suite checks what the manager decides, not how fast a loaded ensemble answers: a
    # write that waits behind three JVMs on two busy cores may take seconds, and an
    # ensemble that holds an election (a JVM starved past its heartbeats) serves nothing
    # until it ends. The default (ttl / 3, so 3.3 s at the suite's usual ttl=10) failed
    # releases that way, and 15 s failed a create five times in loaded runs; a call now
    # gets the session's length. The faults that pin request_timeout are in
    # tests/test_consensus_faults.py and the link tests.
    options.setdefault("request_timeout", 60.0)
    return cls(url, **options)


register_manager_backend(ManagerBackend("zookeeper", _setup, _make, marks=(pytest.mark.zookeeper,)))
