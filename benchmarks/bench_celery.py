#!/usr/bin/env python3
"""What a Celery task under a lease (``FencedTask``) costs over the same task unfenced.

    python benchmarks/bench_celery.py [--quick]

Each task's body does one plain Redis ``SET`` on the suite's redis-server. The tasks run
in Celery's eager mode (``task.apply()``): Celery's tracer runs each one as a worker's
does, without the broker. With a real worker, a task's publish, delivery, acknowledgement
and result are round trips of their own, on a broker that the other variants share and
that load from elsewhere moves; the fence's part of a task is the same either way, and it
is that part measured here, interleaved in batches of 20 tasks:

- a plain ``celery.Task`` (the baseline);
- ``FencedTask`` on the Redis manager (an acquire and a release, one round trip each, and
  the renewal watchdog's thread);
- the same without the watchdog (``fence_renew=False``): the two round trips alone;
- ``FencedTask`` on the in-memory manager: the wrapper's own code and the watchdog, no
  I/O.

Ratio = tasks per second / the unfenced task's; each row's note gives the cost per task in
microseconds.
"""

from __future__ import annotations

from typing import Any

import _harness
import redis
from _harness import Context, Row
from celery import Celery

from fence import MemoryLockManager
from fence._sync.redis import RedisLockManager
from fence.adapters.celery import FencedTask

GROUP = "celery"
BASELINE = "Celery task, unfenced"
PREFIX = "eager, body one SET: "


def _tasks(url: str) -> tuple[Celery, dict[str, Any], list[Any]]:
    client = redis.Redis.from_url(url)
    app = Celery("bench_celery", set_as_current=False)
    app.conf.task_always_eager = True
    app.conf.task_eager_propagates = True
    redis_manager = RedisLockManager(url, ttl=30)
    memory_manager = MemoryLockManager(ttl=30)

    @app.task(name="bench.plain")
    def plain(job_id: int) -> None:
        client.set(f"bench:celery:{job_id}", 1)

    @app.task(
        name="bench.redis", base=FencedTask, fence="job:{job_id}", fence_manager=redis_manager
    )
    def fenced_redis(job_id: int) -> None:
        client.set(f"bench:celery:{job_id}", 1)

    @app.task(
        name="bench.redis-unrenewed",
        base=FencedTask,
        fence="job:{job_id}",
        fence_manager=redis_manager,
        fence_renew=False,
    )
    def fenced_unrenewed(job_id: int) -> None:
        client.set(f"bench:celery:{job_id}", 1)

    @app.task(
        name="bench.memory", base=FencedTask, fence="job:{job_id}", fence_manager=memory_manager
    )
    def fenced_memory(job_id: int) -> None:
        client.set(f"bench:celery:{job_id}", 1)

    variants = {
        BASELINE: lambda: plain.apply((1,)),
        "FencedTask, Redis manager": lambda: fenced_redis.apply((2,)),
        "FencedTask, Redis manager, fence_renew=False": lambda: fenced_unrenewed.apply((4,)),
        "FencedTask, memory manager": lambda: fenced_memory.apply((3,)),
    }
    return app, variants, [client, redis_manager, memory_manager]


def collect(ctx: Context) -> list[Row]:
    """Tasks per second of each variant; see the module docstring."""
    app, variants, closing = _tasks(ctx.servers.redis.url)
    try:
        with _harness.timer(ctx, "Celery tasks, fenced and not"):
            rates = _harness.interleaved(
                variants, calls=ctx.n(1_000, 100), repeats=ctx.repeats, batch=20, warmup=20
            )
    finally:
        for thing in closing:
            thing.close()
        app.close()
    rows = _harness.rate_rows(GROUP, rates, BASELINE, unit="tasks/s", prefix=PREFIX)
    for row in rows:
        extra = 1e6 / row.value - 1e6 / row.baseline_value
        row.note = f"{extra:,.0f} us more per task than the unfenced one"
    return rows


if __name__ == "__main__":
    raise SystemExit(_harness.standalone(collect, __doc__))
