"""A lease holder in a process of its own, for the paused-holder fault tests.

    python -m tests.consensus_holder etcd|zookeeper URL RESOURCE TTL

Acquires ``RESOURCE`` with the renewal watchdog on, prints one JSON line per event on
stdout (``acquired`` with the token and the client's deadline; ``renewed`` with the new
deadline; ``lost`` with the cause and whether the deadline had passed) and exits after the
loss, or after 60 s. Deadlines are ``time.monotonic()`` values: on Linux that clock is the
same in every process, so the test can compare them with its own.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from typing import Any

from fence import EventBus, EventKind


def say(**data: Any) -> None:
    print(json.dumps(data), flush=True)


def main(argv: list[str]) -> int:
    kind, url, resource, ttl = argv[0], argv[1], argv[2], float(argv[3])
    bus = EventBus()
    options: dict[str, Any] = {"ttl": ttl, "renew": True, "events": bus}
    if kind == "etcd":
        from fence._sync.etcd import EtcdLockManager

        manager: Any = EtcdLockManager(url, **options)
    else:
        from fence._sync.zookeeper import ZooKeeperLockManager

        manager = ZooKeeperLockManager(url, **options)
    lost = threading.Event()
    holder: dict[str, Any] = {}

    def on_event(event: Any) -> None:
        if event.kind is EventKind.RENEWED and "lease" in holder:
            say(event="renewed", deadline=holder["lease"].deadline)

    def on_lost(lease: Any, err: Any) -> None:
        now = time.monotonic()
        say(event="lost", cause=err.cause, at=now, past_deadline=now >= lease.deadline)
        lost.set()

    bus.subscribe(on_event)
    lease = manager.acquire(resource, timeout=30, on_lost=on_lost)
    holder["lease"] = lease
    say(event="acquired", token=lease.token, deadline=lease.deadline)
    lost.wait(60)
    manager.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
