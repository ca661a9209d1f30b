"""iofence: fencing tokens for distributed locks.

A lock manager hands out leases that carry strictly increasing fencing tokens; storage guards
refuse every write whose token is older than the last one they accepted. A holder that paused
past its lease therefore cannot corrupt data after it lost the lock.

Example::

    from fence import MemoryLockManager

    manager = MemoryLockManager()
    with manager.lock("order:42", ttl=10) as lease:
        save(order, fence_token=lease.token)   # a guarded write

See the README for the Redis, SQL and SQLAlchemy guards in ``fence.adapters``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from fence._async.manager import AsyncBaseLockManager, AsyncLease
from fence._async.memory import AsyncMemoryLockManager
from fence._async.retry import AsyncRetryPolicy
from fence._clock import Clock, ManualClock, SystemClock, system_clock
from fence._connect import connect, connect_async
from fence._core import (
    MAX_RESOURCE_LENGTH,
    MAX_TOKEN,
    LeaseMode,
    ReadToken,
    TokenMode,
    accepts,
    check_read,
    client_deadline,
    issue_token,
    rejection,
    validate_mode,
    validate_resource,
    validate_token,
    validate_ttl,
)
from fence._errors import (
    AcquireTimeout,
    BackendError,
    ConfigurationError,
    FenceError,
    FenceWarning,
    InvalidResourceError,
    InvalidTokenError,
    LeaseExpiredError,
    LeaseLostError,
    LockUpgradeError,
    NotOwnerError,
    ReadLeaseError,
    Reason,
    RetryableError,
    StaleTokenError,
    TokenRequiredError,
    TransactionRefusedError,
    UnfencedWriteError,
)
from fence._events import Event, EventBus, EventKind, default_bus, log_events
from fence._memory import MemoryBackend
from fence._retry import exponential_backoff, is_retryable
from fence._sync.manager import BaseLockManager, Lease
from fence._sync.memory import MemoryLockManager
from fence._sync.retry import RetryPolicy
from fence.abc import AsyncGuard, AsyncLockManager, Guard, LockInfo, LockManager

if TYPE_CHECKING:
    from fence._async.etcd import AsyncEtcdLockManager
    from fence._async.quorum import AsyncQuorumLockManager
    from fence._async.redis import AsyncRedisLockManager
    from fence._async.sql import AsyncSQLLockManager
    from fence._async.zookeeper import AsyncZooKeeperLockManager
    from fence._sql_schema import (
        lease_schema_ddl,
        lease_table,
        lease_table_ddl,
        lease_upgrade_ddl,
    )
    from fence._sync.etcd import EtcdLockManager
    from fence._sync.quorum import QuorumLockManager
    from fence._sync.redis import RedisLockManager
    from fence._sync.sql import SQLLockManager
    from fence._sync.zookeeper import ZooKeeperLockManager

__version__ = "0.2.0"

# Backends whose driver packages are optional extras load on first use, so that
# ``import fence`` needs neither redis-py, SQLAlchemy, httpx nor kazoo.
_LAZY = {
    "AsyncRedisLockManager": "fence._async.redis",
    "RedisLockManager": "fence._sync.redis",
    "AsyncSQLLockManager": "fence._async.sql",
    "SQLLockManager": "fence._sync.sql",
    "AsyncQuorumLockManager": "fence._async.quorum",
    "QuorumLockManager": "fence._sync.quorum",
    "AsyncEtcdLockManager": "fence._async.etcd",
    "EtcdLockManager": "fence._sync.etcd",
    "AsyncZooKeeperLockManager": "fence._async.zookeeper",
    "ZooKeeperLockManager": "fence._sync.zookeeper",
    "lease_schema_ddl": "fence._sql_schema",
    "lease_table": "fence._sql_schema",
    "lease_table_ddl": "fence._sql_schema",
    "lease_upgrade_ddl": "fence._sql_schema",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fence' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


# What this file imports for itself: no part of the package's API.
_OWN = frozenset({"Any", "TYPE_CHECKING", "annotations", "importlib"})


def __dir__() -> list[str]:
    # dir(fence) and tab completion: the lazy exports before their first use too, and
    # neither this file's own imports nor its private names.
    names = {n for n in globals() if n not in _OWN and (n[:1] != "_" or n[:2] == "__")}
    return sorted(names | _LAZY.keys())


__all__ = [
    "MAX_RESOURCE_LENGTH",
    "MAX_TOKEN",
    "AcquireTimeout",
    "AsyncBaseLockManager",
    "AsyncEtcdLockManager",
    "AsyncGuard",
    "AsyncLease",
    "AsyncLockManager",
    "AsyncMemoryLockManager",
    "AsyncQuorumLockManager",
    "AsyncRedisLockManager",
    "AsyncRetryPolicy",
    "AsyncSQLLockManager",
    "AsyncZooKeeperLockManager",
    "BackendError",
    "BaseLockManager",
    "Clock",
    "ConfigurationError",
    "EtcdLockManager",
    "Event",
    "EventBus",
    "EventKind",
    "FenceError",
    "FenceWarning",
    "Guard",
    "InvalidResourceError",
    "InvalidTokenError",
    "Lease",
    "LeaseExpiredError",
    "LeaseLostError",
    "LeaseMode",
    "LockInfo",
    "LockManager",
    "LockUpgradeError",
    "ManualClock",
    "MemoryBackend",
    "MemoryLockManager",
    "NotOwnerError",
    "QuorumLockManager",
    "ReadLeaseError",
    "ReadToken",
    "Reason",
    "RedisLockManager",
    "RetryPolicy",
    "RetryableError",
    "SQLLockManager",
    "StaleTokenError",
    "SystemClock",
    "TokenMode",
    "TokenRequiredError",
    "TransactionRefusedError",
    "UnfencedWriteError",
    "ZooKeeperLockManager",
    "accepts",
    "check_read",
    "client_deadline",
    "connect",
    "connect_async",
    "default_bus",
    "exponential_backoff",
    "is_retryable",
    "issue_token",
    "lease_schema_ddl",
    "lease_table",
    "lease_table_ddl",
    "lease_upgrade_ddl",
    "log_events",
    "rejection",
    "system_clock",
    "validate_mode",
    "validate_resource",
    "validate_token",
    "validate_ttl",
]

for _name in (
    "AsyncBaseLockManager",
    "AsyncLease",
    "AsyncMemoryLockManager",
    "AsyncRetryPolicy",
    "BaseLockManager",
    "Lease",
    "MemoryLockManager",
    "RetryPolicy",
    "MemoryBackend",
    "Event",
    "EventBus",
    "EventKind",
    "LockInfo",
    "TokenMode",
    "LeaseMode",
    "ReadToken",
    "ManualClock",
    "SystemClock",
):
    globals()[_name].__module__ = "fence"
del _name
