"""The Celery app of ``fence chaos --celery``: the job that real ``celery worker`` processes run.

Each worker imports it (``celery -A fence._chaos.celery_jobs worker``) with the run's Redis
in ``FENCE_CHAOS_REDIS_URL``: Redis is the broker, the result backend, the lock manager
and the guarded storage at once. ``FENCE_CHAOS_WORKER`` names the worker,
``FENCE_CHAOS_TTL`` is the jobs' lease time.

A job is a :class:`fence.adapters.celery.FencedTask`: it runs under a lease on
``chaos-job:<id>`` and writes its effect through the Redis guard with the lease's token.
Its effect is one increment of its counter, done once: a run that finds the counter
written returns ``"already done"``. A run that ``hold`` asks to stop tells the controller
it is between its read and its write (the list ``chaos-holding``) and waits at its gate
(``chaos-gate:<id>``); the controller stops the worker there with SIGSTOP, and may
drop its connections or restart Redis meanwhile. Every run
leaves a line in ``chaos-job:<id>:runs`` and every retry its error's name in
``chaos-retries``, for the controller's check.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery
from celery.signals import task_retry

from fence._chaos.celery_scenario import count_key, resource
from fence._optional import celery_task, redis_guard

__all__ = ["REDIS_URL", "app", "job"]

REDIS_URL = os.environ.get("FENCE_CHAOS_REDIS_URL", "redis://127.0.0.1:6379/0")
_WORKER = os.environ.get("FENCE_CHAOS_WORKER", "client")
_TTL = float(os.environ.get("FENCE_CHAOS_TTL", "1.0"))

app = Celery("fence_chaos", broker=REDIS_URL, backend=REDIS_URL)
app.conf.update(
    broker_connection_retry_on_startup=True,
    worker_prefetch_multiplier=1,
    iofence_manager=REDIS_URL,
)

_client = redis.Redis.from_url(REDIS_URL)
_guard = redis_guard(_client, scope="resource")  # the claim and the count share a fence


@app.task(  # type: ignore[untyped-decorator]  # Celery ships no type information
    base=celery_task(),
    bind=True,
    fence="chaos-job:{job_id}",
    fence_ttl=_TTL,
    fence_timeout=60.0,
    max_retries=5,
    default_retry_delay=0.05,
)
def job(self: Any, job_id: int, hold: bool = False, guarded: bool = True) -> dict[str, Any]:
    """Do job ``job_id`` once; with ``hold`` (on its first try), wait at the job's gate
    between the read and the write. ``guarded=False`` is the broken job the check must
    catch: plain ``GET`` and ``INCR``, no claim, no token."""
    token = self.lease.token
    retries = self.request.retries
    key = count_key(job_id)
    _client.rpush(f"{resource(job_id)}:runs", f"{_WORKER} {token} {retries}")
    if guarded:
        _guard.claim(resource(job_id), token)  # older holders can no longer write (C8)
        done, _ = _guard.get(key)
    else:
        done = _client.get(key)
    if done is not None:
        return {"outcome": "already done", "worker": _WORKER, "token": token, "retries": retries}
    if hold and retries == 0:
        _client.rpush("chaos-holding", f"{_WORKER} {job_id}")
        _wait_at_gate(job_id)
    if guarded:
        _guard.incr(key, 1, token=token)
    else:
        _client.incr(key)
    return {"outcome": "done", "worker": _WORKER, "token": token, "retries": retries}


def _wait_at_gate(job_id: int) -> None:
    """Wait until the controller opens the job's gate. The controller stops this worker
    here and may drop its connection meanwhile (a server fault): the wait then goes on, on
    a new one. The gate is the scenario's own; the job's writes take no such care."""
    end = time.monotonic() + 300
    while time.monotonic() < end:
        try:
            if _client.blpop([f"chaos-gate:{job_id}"], timeout=1) is not None:
                return
        except redis.ConnectionError:
            time.sleep(0.05)
    raise RuntimeError(f"job {job_id}: the controller never opened the gate")


@task_retry.connect  # type: ignore[untyped-decorator]
def _record_retry(reason: Any = None, **_: Any) -> None:
    # ``reason`` is Celery's Retry; the error that caused it is its ``exc``.
    _client.rpush("chaos-retries", type(getattr(reason, "exc", reason)).__name__)
