"""Fenced writes to Redis keys, with the Redis lock manager in the same Redis.

A worker takes the lease on ``order:42``, claims the resource and writes two keys. A second
worker takes over after the first one's lease ran out; the first one's late write is refused.

    REDIS_URL=redis://127.0.0.1:6379/0 python examples/redis_keys.py
"""

from __future__ import annotations

import os
import time

import redis

from fence import RedisLockManager, StaleTokenError
from fence.adapters.redis import RedisGuard


def main() -> int:
    """Run the story; return 0 if the stale write was refused."""
    url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    client = redis.Redis.from_url(url)
    manager = RedisLockManager(client, ttl=0.5)
    guard = RedisGuard(client, scope="resource")  # one fence for all keys of {order:42}

    first = manager.acquire("order:42", owner="first")
    guard.claim("order:42", first.token)  # shut out every older holder first (C8)
    guard.set("{order:42}:status", "packing", token=first.token)
    print(f"first holder, token {first.token}: status = packing")

    time.sleep(0.6)  # the first holder stalls past its 0.5 s lease
    second = manager.acquire("order:42", timeout=5, owner="second")
    guard.claim("order:42", second.token)
    guard.set("{order:42}:status", "shipped", token=second.token)
    guard.incr("{order:42}:parcels", 1, token=second.token)
    print(f"second holder, token {second.token}: status = shipped, parcels += 1")
    second.release()

    try:
        guard.set("{order:42}:status", "packed", token=first.token)
    except StaleTokenError as err:
        print(f"first holder wakes, writes with {err.token}: {err.reason} (fence {err.fence})")
    else:
        print("the stale write was accepted: this must never happen")
        return 1
    value, fence = guard.get("{order:42}:status")
    print(f"status = {value.decode()}, fence = {fence}")
    client.close()
    return 0 if value == b"shipped" else 1


if __name__ == "__main__":
    raise SystemExit(main())
