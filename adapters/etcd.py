"""The etcd storage guard: fenced writes to etcd keys, sync and asyncio.

Every write is one etcd transaction that compares the key's fence with the token and, in
the same step, writes the data and raises the fence; a stale token changes nothing and
raises :class:`fence.StaleTokenError`::

    from fence import EtcdLockManager
    from fence.adapters.etcd import EtcdGuard

    manager = EtcdLockManager("etcd://10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379")
    guard = EtcdGuard(manager)                      # the manager's client and prefix
    with manager.lock("order:42") as lease:
        guard.claim("orders/42", lease.token)       # shut out older holders first (C8)
        guard.put("orders/42", b"paid", token=lease.token)

The fence of key ``K`` is the key ``<prefix>guard/K``; every key under the prefix is the
lock manager's or a fence, and refused as a data key (C9). A delete keeps the fence
(C7), and a batch is one transaction (C6). See ``docs/consensus-guards.md``.
"""

from __future__ import annotations

from ._async.etcd import AsyncEtcdBatch, AsyncEtcdGuard
from ._etcd_ops import FENCE_DIGITS, encode_fence
from ._sync.etcd import EtcdBatch, EtcdGuard

__all__ = [
    "FENCE_DIGITS",
    "AsyncEtcdBatch",
    "AsyncEtcdGuard",
    "EtcdBatch",
    "EtcdGuard",
    "encode_fence",
]

for _cls in (AsyncEtcdBatch, AsyncEtcdGuard, EtcdBatch, EtcdGuard):
    _cls.__module__ = __name__
del _cls
