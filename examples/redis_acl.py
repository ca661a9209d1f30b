"""Raw commands on fenced keys, refused by Redis: the guard's ACL recipe.

Redis cannot tell the guard's client from any other, so a raw ``SET`` on a fenced key is
an ordinary command to it. Two ACL users close that door: the guard's user runs the
guard's scripts; the application's user may read the fenced keys but not write them, and
may not touch the fence namespace. The example creates both (it needs a Redis 7 user that
may run ACL SETUSER), takes a lease on the order, writes through the guard with the lease's
token, and shows the raw writes refused. The token comes from the lease, so the example runs
again, or after the other examples on ``order:42``, against the same Redis.

    REDIS_URL=redis://127.0.0.1:6379/0 python examples/redis_acl.py
"""

from __future__ import annotations

import os
import secrets
from typing import Any

import redis
from redis.exceptions import NoPermissionError

from fence import RedisLockManager
from fence.adapters.redis import RedisGuard, acl_rules


def main() -> int:
    """Run the story; return 0 if every raw write was refused."""
    url = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")
    admin = redis.Redis.from_url(url)
    admin_command: Any = admin.execute_command  # redis-py types it on some clients only
    rules = acl_rules(["{order:*}:*"], app_keys=["cache:*"])
    passwords = {"order-guard": secrets.token_hex(16), "order-app": secrets.token_hex(16)}
    admin_command("ACL", "SETUSER", "order-guard", *rules.guard, ">" + passwords["order-guard"])
    admin_command("ACL", "SETUSER", "order-app", *rules.app, ">" + passwords["order-app"])
    guard_client = redis.Redis.from_url(
        url, username="order-guard", password=passwords["order-guard"]
    )
    app = redis.Redis.from_url(
        url, username="order-app", password=passwords["order-app"], decode_responses=True
    )
    app_command: Any = app.execute_command
    refused = 0
    try:
        guard = RedisGuard(guard_client, scope="resource")
        # The locks live outside the fenced keys: the manager runs as the admin user.
        with RedisLockManager(admin, ttl=10) as manager, manager.lock("order:42") as lease:
            guard.claim("order:42", lease.token)
            guard.set("{order:42}:status", "paid", token=lease.token)
            print(f"guard user, token {lease.token}: status = paid (fenced)")
        print(f"app user reads status = {app.get('{order:42}:status')!r}")
        app.set("cache:order:42", "paid")  # its own, unfenced keys
        for command in (
            ("SET", "{order:42}:status", "hacked"),
            ("DEL", "{order:42}:status"),
            ("SET", "fence:{order:42}:fence", "1"),
            ("EVAL", "return redis.call('SET', KEYS[1], 'x')", 1, "{order:42}:status"),
            ("FLUSHALL",),
        ):
            try:
                app_command(*command)
            except NoPermissionError:
                refused += 1
                print(f"app user: {command[0]} refused by Redis")
        value, fence = guard.get("{order:42}:status")
        print(f"status = {value!r}, fence = {fence}")
    finally:
        app.close()
        guard_client.close()
        admin_command("ACL", "DELUSER", "order-guard", "order-app")
        admin.close()
    return 0 if refused == 5 else 1


if __name__ == "__main__":
    raise SystemExit(main())
