"""Celery tasks under a lease, on a real worker: two runs of one job, its effect once.

This file is the Celery app and the program that uses it: it starts a worker on itself
(``celery -A``, a pool of two threads) and sends the same billing job twice at once.
Each run takes the lease on ``order:N``, claims the order with its token and bills only
if nobody did; the second run waits for the first one's release, gets a newer token and
finds the invoice there. Redis is the broker, the result backend, the lock manager and
the guarded storage at once.

    REDIS_URL=redis://127.0.0.1:6379/0 python examples/celery_jobs.py
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import redis
from celery import Celery

from fence.adapters.celery import FencedTask
from fence.adapters.redis import RedisGuard

REDIS_URL = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0")

app = Celery("shop", broker=REDIS_URL, backend=REDIS_URL)
app.conf.broker_connection_retry_on_startup = True
app.conf.iofence_manager = REDIS_URL  # one lock manager per worker process
guard = RedisGuard(redis.Redis.from_url(REDIS_URL), scope="resource")


@app.task(  # type: ignore[untyped-decorator]  # Celery ships no type information
    name="shop.bill", base=FencedTask, bind=True, fence="order:{order_id}", fence_ttl=10
)
def bill(self: FencedTask, order_id: int, amount: int) -> str:
    """Bill an order once, however many times the job runs."""
    token = self.lease.token
    guard.claim(f"order:{order_id}", token)  # older holders can no longer write (C8)
    invoice, _ = guard.get(f"{{order:{order_id}}}:invoice")
    if invoice is not None:
        return f"token {token}: order {order_id} was billed already ({invoice.decode()})"
    guard.set(f"{{order:{order_id}}}:invoice", f"{amount} EUR", token=token)
    return f"token {token}: order {order_id} billed {amount} EUR"


def main() -> int:
    """Start a worker on this file, send one job twice, and check the invoice."""
    here = Path(__file__).resolve()
    worker = subprocess.Popen(
        [
            sys.executable, "-m", "celery", "--quiet", "-A", here.stem, "worker", "--pool=threads",
            "--concurrency=2", "--loglevel=warning", "--without-gossip", "--without-mingle",
            "--without-heartbeat",
        ],
        cwd=here.parent,
        env={**os.environ, "PYTHONPATH": str(here.parent)},
    )  # fmt: skip
    try:
        order_id = random.randrange(1, 1_000_000)  # a new order each time the example runs
        runs = [bill.delay(order_id, 30), bill.delay(order_id, 30)]
        outcomes = sorted(run.get(timeout=60) for run in runs)
    finally:
        worker.terminate()
        worker.wait(timeout=30)
    for outcome in outcomes:
        print(outcome)
    invoice, fence = guard.get(f"{{order:{order_id}}}:invoice")
    print(f"invoice of order {order_id}: {invoice.decode()}, fence {fence}")
    billed = [outcome for outcome in outcomes if "billed 30 EUR" in outcome]
    return 0 if len(billed) == 1 else 1


if __name__ == "__main__":
    raise SystemExit(main())
