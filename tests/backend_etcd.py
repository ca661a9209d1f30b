"""The etcd manager in the manager conformance suite, on the session's 3-member cluster.

The faults only a consensus cluster has (the leader killed, a member stopped, a minority or
a majority down, the whole cluster restarted from disk) are in
``tests/test_consensus_faults.py``.
"""

from __future__ import annotations

from typing import Any

import pytest

from fence._async.etcd import AsyncEtcdLockManager
from fence._sync.etcd import EtcdLockManager
from tests.registry import ManagerBackend, register_manager_backend


def _setup(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue("etcd_url"))


def _make(url: str, is_async: bool, **options: Any) -> Any:
    cls = AsyncEtcdLockManager if is_async else EtcdLockManager
    # As for ZooKeeper (tests/backend_zookeeper.py): the suite checks decisions, not how
    # fast a loaded cluster answers; the faults that pin request_timeout are elsewhere.
    options.setdefault("request_timeout", 15.0)
    return cls(url, **options)


# etcd's lease is ceil(ttl) + 1 whole seconds, and its leader looks for expired leases
# every half second: a short lease ends up to ~2.5 s after its ttl.
register_manager_backend(
    ManagerBackend("etcd", _setup, _make, marks=(pytest.mark.etcd,), expiry_slack=3.0)
)
