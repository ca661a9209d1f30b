"""The Celery app that ``tests/test_celery.py`` runs in real worker processes.

The worker imports it with ``celery -A tests.celery_app worker``; ``FENCE_TEST_REDIS_URL``
names the suite's redis-server, which is the broker, the result backend, the lock
manager and the guarded storage at once. Each run of a job leaves a line in the Redis list
``runs:{job_id}``, and each retry the name of its error in ``retries``, for the test to
read.
"""

from __future__ import annotations

import os
from typing import Any

import redis
from celery import Celery
from celery.signals import task_retry

from fence.adapters.celery import FencedTask
from fence.adapters.redis import RedisGuard

REDIS_URL = os.environ["FENCE_TEST_REDIS_URL"]
WORKER = os.environ.get("FENCE_TEST_WORKER", "test")

app = Celery("fence_tests", broker=REDIS_URL, backend=REDIS_URL)
app.conf.update(
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    iofence_manager=REDIS_URL,
)

client = redis.Redis.from_url(REDIS_URL)
guard = RedisGuard(client, scope="resource")


def count_key(job_id: int) -> str:
    """The job's effect: a counter in the job's hash tag, written once per job."""
    return f"{{job:{job_id}}}:count"


def _run(task: FencedTask, job_id: int, hold: bool) -> dict[str, Any]:
    token = task.lease.token
    retries = task.request.retries
    client.rpush(f"runs:{job_id}", f"{WORKER} {token} {retries}")
    guard.claim(f"job:{job_id}", token)  # older holders can no longer write (C8)
    done, _ = guard.get(count_key(job_id))
    if done is not None:
        return {"outcome": "already done", "token": token, "retries": retries}
    if hold:
        client.rpush("holding", WORKER)
        client.blpop([f"gate:{job_id}"], timeout=120)
    guard.incr(count_key(job_id), 1, token=token)
    return {"outcome": "done", "token": token, "retries": retries}


@app.task(  # type: ignore[untyped-decorator]  # Celery ships no type information
    base=FencedTask,
    bind=True,
    fence="job:{job_id}",
    fence_ttl=2.0,
    fence_timeout=45.0,
    max_retries=3,
    default_retry_delay=0.1,
)
def run_job(self: FencedTask, job_id: int, hold: bool = False) -> dict[str, Any]:
    """Do job ``job_id`` once; with ``hold``, wait at the job's gate before writing."""
    return _run(self, job_id, hold)


@app.task(  # type: ignore[untyped-decorator]
    base=FencedTask,
    bind=True,
    fence="job:{job_id}",
    fence_ttl=5.0,
    fence_timeout=0.1,
    max_retries=2,
    default_retry_delay=0.1,
)
def run_job_soon(self: FencedTask, job_id: int) -> dict[str, Any]:
    """Do job ``job_id`` once, waiting at most 0.1 s for its lock at each try."""
    return _run(self, job_id, False)


@app.task(  # type: ignore[untyped-decorator]
    base=FencedTask,
    bind=True,
    fence="job:{job_id}",
    fence_ttl=5.0,
    fence_timeout=0.1,
    max_retries=None,
    default_retry_delay=0.1,
)
def run_job_until_free(self: FencedTask, job_id: int) -> dict[str, Any]:
    """Do job ``job_id`` once, trying for its lock 0.1 s at a time, with no limit of tries."""
    return _run(self, job_id, False)


@task_retry.connect
def _record_retry(reason: Any = None, **_: Any) -> None:
    # ``reason`` is Celery's Retry; the error that caused it is its ``exc``.
    client.rpush("retries", type(getattr(reason, "exc", reason)).__name__)
