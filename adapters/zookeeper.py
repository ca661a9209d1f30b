"""The ZooKeeper storage guard: fenced writes to ZooKeeper nodes, sync and asyncio.

The fence of node ``/a/b`` is its sibling node ``/a/b.fence``. Every write is one
multi-operation that writes the fence node at the version the guard last saw (so the
fence is still the one the token was compared with) together with the data; a stale
token changes nothing and raises :class:`fence.StaleTokenError`::

    from fence import ZooKeeperLockManager
    from fence.adapters.zookeeper import ZooKeeperGuard

    manager = ZooKeeperLockManager("zookeeper://10.0.0.1:2181,10.0.0.2:2181,10.0.0.3:2181")
    guard = ZooKeeperGuard(manager)                  # the manager's session and root
    with manager.lock("order:42") as lease:
        guard.claim("/orders/42", lease.token)       # shut out older holders first (C8)
        guard.set("/orders/42", b"paid", token=lease.token)

Nodes under the manager's root and nodes named ``*.fence`` are refused as data (C9). A
delete keeps the fence node (C7), and a batch is one multi-operation (C6). See
``docs/consensus-guards.md``.
"""

from __future__ import annotations

from ._async.zookeeper import AsyncZooKeeperBatch, AsyncZooKeeperGuard
from ._sync.zookeeper import ZooKeeperBatch, ZooKeeperGuard
from ._zookeeper_ops import FENCE_SUFFIX

__all__ = [
    "FENCE_SUFFIX",
    "AsyncZooKeeperBatch",
    "AsyncZooKeeperGuard",
    "ZooKeeperBatch",
    "ZooKeeperGuard",
]

for _cls in (AsyncZooKeeperBatch, AsyncZooKeeperGuard, ZooKeeperBatch, ZooKeeperGuard):
    _cls.__module__ = __name__
del _cls
