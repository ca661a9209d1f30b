"""``fence chaos --celery``: real Celery workers frozen past their lease while another runs
the same job.

Two ``celery worker`` processes ``a`` and ``b`` (solo pool, one queue each) run the job
of :mod:`fence._chaos.celery_jobs` on the run's redis-server (broker, result backend, lock
manager and guarded storage). For each job the controller picks a victim and a rescuer at
random::

    victim   takes job:j -> t1, claims, finds no count, waits at its gate
    victim   SIGSTOP ......................... (its lease ends, the watchdog is frozen too)
    rescuer  takes job:j -> t2 > t1, claims, count = 1, releases
    victim   SIGCONT, passes the gate, INCR with t1 -> refused (StaleTokenError)
    victim   retries under a new lease t3 > t2, finds count = 1: "already done"

The check reads the storage: every job's count is 1 (0 would be a lost job, 2 a stale
write accepted), the victim's first write was refused (a ``StaleTokenError`` retry per
job), and every job's tokens grew run after run.

Its own mode, not a pairing: a pairing's workers are the runner's processes, cycling on a
board in shared memory that the pauser reads to stop a holder at the right moment; a
Celery worker is Celery's process, fed by the broker, and says where it is through Redis.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["count_key", "resource", "run_celery"]

#: The task's name as the workers register it.
_TASK = "fence._chaos.celery_jobs.job"
#: The longest any one step may take (a worker starting, a job finishing), in seconds.
_LIMIT = 120.0
_WORKERS = ("a", "b")


def _queue(worker: str) -> str:
    # Queues of the scenario's own: a Redis shared with other Celery workers keeps them apart.
    return f"fence-chaos-{worker}"


def _hostname(worker: str) -> str:
    return f"{worker}@fence-chaos"


def resource(job_id: int) -> str:
    """The lock (and the claim's scope) of job ``job_id``."""
    return f"chaos-job:{job_id}"


def count_key(job_id: int) -> str:
    """The job's effect: a counter in the job's hash tag, incremented once per job."""
    return f"{{chaos-job:{job_id}}}:count"


def _wait(
    condition: Callable[[], Any], what: str, procs: dict[str, subprocess.Popen[bytes]]
) -> Any:
    end = time.monotonic() + _LIMIT
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        dead = [name for name, proc in procs.items() if proc.poll() is not None]
        if dead:
            raise RuntimeError(f"celery worker {dead} exited while waiting for {what}")
        time.sleep(0.02)
    raise RuntimeError(f"fence chaos --celery: gave up waiting for {what}")


def _start(name: str, url: str, ttl: float, logs: Path) -> subprocess.Popen[bytes]:
    env = {
        **os.environ,
        "FENCE_CHAOS_REDIS_URL": url,
        "FENCE_CHAOS_WORKER": name,
        "FENCE_CHAOS_TTL": str(ttl),
    }
    command = [
        sys.executable, "-m", "celery", "-A", "fence._chaos.celery_jobs", "worker",
        "--pool=solo", "--queues", _queue(name), "--hostname", _hostname(name),
        "--loglevel", "info", "--without-gossip", "--without-mingle", "--without-heartbeat",
    ]  # fmt: skip
    with (logs / f"celery-{name}.log").open("wb") as log:
        return subprocess.Popen(  # noqa: S603 - this interpreter, fixed arguments
            command, env=env, stdout=log, stderr=subprocess.STDOUT
        )


def _stop(procs: dict[str, subprocess.Popen[bytes]]) -> None:
    for proc in procs.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.terminate()
    for proc in procs.values():
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_celery(
    url: str, jobs: int, ttl: float, seed: int, logs: Path, *, guarded: bool = True
) -> dict[str, Any]:
    """Run ``jobs`` jobs, each with a worker frozen past its lease; return the summary.

    Args:
        url: the run's Redis (``redis://``).
        jobs: how many jobs (one pause each).
        ttl: the jobs' lease time, in seconds; a pause lasts 1.3 to 2 times as long.
        seed: the controller's random seed (victims, pause lengths).
        logs: where the workers' logs go.
        guarded: ``False`` runs the broken job (plain ``GET``/``INCR``, no token): the
            check must find the frozen workers' stale writes accepted.

    Raises:
        RuntimeError: a worker died, or a step took longer than two minutes.
    """
    import redis
    from celery import Celery

    rng = random.Random(f"{seed}:celery")
    client = redis.Redis.from_url(url)
    sender = Celery("fence_chaos_client", broker=url, backend=url)
    sender.conf.broker_connection_retry_on_startup = True
    procs: dict[str, subprocess.Popen[bytes]] = {}
    pauses: list[dict[str, Any]] = []
    results: dict[int, list[dict[str, Any]]] = {}
    started = time.monotonic()
    try:
        for name in _WORKERS:
            procs[name] = _start(name, url, ttl, logs)
        # Both workers answer a ping (theirs by name: a shared broker may have others).
        names = [_hostname(name) for name in _WORKERS]
        _wait(
            lambda: len(sender.control.ping(destination=names, timeout=0.5) or []) >= len(names),
            "the celery workers to start",
            procs,
        )
        for job_id in range(1, jobs + 1):
            victim, rescuer = rng.sample(_WORKERS, 2)
            pause = ttl * rng.uniform(1.3, 2.0)
            job = _Job(sender, client, procs, job_id, guarded)
            pauses.append(job.run(victim, rescuer, pause))
            pauses[-1]["ttl_s"] = ttl
            results[job_id] = job.outcomes
        summary = _summary(client, results, pauses, jobs, ttl, time.monotonic() - started)
        summary["guarded"] = guarded
        return summary
    finally:
        _stop(procs)
        sender.close()
        client.close()


class _Job:
    """One job: its first run frozen on the victim, its second on the rescuer."""

    def __init__(
        self,
        sender: Any,
        client: Any,
        procs: dict[str, subprocess.Popen[bytes]],
        job_id: int,
        guarded: bool,
    ) -> None:
        self.sender = sender
        self.client = client
        self.procs = procs
        self.job_id = job_id
        self.guarded = guarded
        self.outcomes: list[dict[str, Any]] = []

    def _send(self, queue: str, **kwargs: Any) -> Any:
        kwargs["guarded"] = self.guarded
        return self.sender.send_task(_TASK, args=(self.job_id,), kwargs=kwargs, queue=_queue(queue))

    def _holding(self, victim: str) -> bool:
        held = self.client.lrange("chaos-holding", 0, -1)
        return f"{victim} {self.job_id}".encode() in held

    def run(self, victim: str, rescuer: str, pause: float) -> dict[str, Any]:
        """Run it; the pause as the summary lists it."""
        job_id = self.job_id
        first = self._send(victim, hold=True)
        _wait(lambda: self._holding(victim), f"worker {victim} at job {job_id}'s gate", self.procs)
        stopped = time.monotonic()
        self.procs[victim].send_signal(signal.SIGSTOP)
        try:
            time.sleep(pause)  # past the lease: the victim's watchdog is frozen too
            second = self._send(rescuer)
            _wait(second.ready, f"job {job_id} on {rescuer}", self.procs)
            self.client.rpush(f"chaos-gate:{job_id}", "go")
        finally:
            self.procs[victim].send_signal(signal.SIGCONT)
        frozen = time.monotonic() - stopped
        _wait(first.ready, f"job {job_id}'s first run on {victim}", self.procs)
        self.outcomes = [_outcome(first, victim, "frozen"), _outcome(second, rescuer, "rescuer")]
        return {"job": job_id, "worker": victim, "stopped_s": round(frozen, 2)}


def _outcome(sent: Any, worker: str, role: str) -> dict[str, Any]:
    if sent.successful():
        return {"role": role, "worker": worker, **sent.result}
    return {"role": role, "worker": worker, "outcome": "failed", "error": repr(sent.result)}


def _summary(
    client: Any,
    results: dict[int, list[dict[str, Any]]],
    pauses: list[dict[str, Any]],
    jobs: int,
    ttl: float,
    elapsed: float,
) -> dict[str, Any]:
    effects: dict[str, int] = {}
    runs: dict[str, list[str]] = {}
    tokens_ordered = True
    for job_id in range(1, jobs + 1):
        raw = client.get(count_key(job_id))
        effects[str(job_id)] = int(raw) if raw is not None else 0
        lines = [line.decode() for line in client.lrange(f"{resource(job_id)}:runs", 0, -1)]
        runs[str(job_id)] = lines
        tokens = [int(line.split()[1]) for line in lines]
        tokens_ordered = tokens_ordered and tokens == sorted(set(tokens))
    retries = [name.decode() for name in client.lrange("chaos-retries", 0, -1)]
    refused = retries.count("StaleTokenError")
    lost = sum(1 for count in effects.values() if count == 0)
    stale_accepted = sum(count - 1 for count in effects.values() if count > 1)
    failed = [r for rs in results.values() for r in rs if r["outcome"] == "failed"]
    summary: dict[str, Any] = {
        "scenario": "celery",
        "description": "two celery workers (solo pool) on Redis; per job one is frozen with "
        "SIGSTOP between its read and its write, past its lease, while the other runs the "
        "same job",
        "workers": len(_WORKERS),
        "jobs": jobs,
        "ttl_s": ttl,
        "elapsed_s": round(elapsed, 2),
        "pauses_injected": len(pauses),
        "pauses": pauses,
        "stale_refused": refused,
        "stale_accepted": stale_accepted,
        "lost_jobs": lost,
        "effects": effects,
        "tokens_grow": tokens_ordered,
        "retries": retries,
        "runs": runs,
        "results": {str(job): outcome for job, outcome in results.items()},
        "failed_tasks": failed,
    }
    summary["ok"] = bool(
        len(pauses) == jobs
        and all(count == 1 for count in effects.values())
        and refused >= jobs
        and tokens_ordered
        and not failed
    )
    return summary
