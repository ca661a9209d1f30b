"""``fence chaos --celery``: real Celery workers frozen past their lease while another runs
the same job.

Two ``celery worker`` processes ``a`` and ``b`` (solo pool, one queue each) run the job
of :mod:`fence._chaos.celery_jobs` on the run's redis-server (broker, result backend, lock
manager and guarded storage). For each job the controller picks a victim and a rescuer at
random::

    victim   takes job:j -> t1, claims, finds no count, waits at its gate
    victim   SIGSTOP ......................... (its lease ends, the watchdog is frozen too)
    redis    a server fault, while the victim is frozen (unless faults are off)
    rescuer  takes job:j -> t2 > t1, claims, count = 1, releases
    victim   SIGCONT, passes the gate, INCR with t1 -> refused (StaleTokenError)
    victim   retries under a new lease t3 > t2, finds count = 1: "already done"

The server faults take turns, one per job: every client connection dropped (``CLIENT
KILL TYPE normal``), then redis-server killed with ``kill -9`` and started again from its
append-only file. Each one lands on the broker, the result backend, the lock manager and
the storage at once: the rescuer's worker has to connect to its queue again, the frozen
victim wakes up on a dead connection, the controller sends and polls through one.

The check reads the storage: every job's count is 1 (0 would be a lost job, 2 a stale
write accepted), the victim's first write was refused (a ``StaleTokenError`` retry per
job), every job's tokens grew run after run, and every fault was done.

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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fence._chaos.controller import Fault

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


class _Crew:
    """The worker processes, started again when one exits, as a supervisor would.

    Celery's Redis transport does not always live through a server fault: a worker that
    loses the broker while it acknowledges a message can stop with "Unrecoverable error"
    (kombu's reconnect meets a half-closed channel). A service runs its workers under a
    supervisor that starts them again; so does the scenario, and the summary lists each
    restart. What the scenario checks (each job's effect once, stale writes refused) must
    hold through them.
    """

    def __init__(self, url: str, ttl: float, logs: Path, most: int) -> None:
        self.url, self.ttl, self.logs, self.most = url, ttl, logs, most
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.restarts: list[dict[str, Any]] = []

    def start(self, name: str) -> None:
        """Start worker ``name`` (its log goes on where an earlier process left it)."""
        self.procs[name] = _start(name, self.url, self.ttl, self.logs)

    def revive(self, what: str) -> None:
        """Start again the workers that exited, while waiting for ``what``.

        Raises:
            RuntimeError: more than ``most`` restarts in the run.
        """
        for name, proc in list(self.procs.items()):
            code = proc.poll()
            if code is None:
                continue
            if len(self.restarts) >= self.most:
                raise RuntimeError(
                    f"celery worker {name} exited ({code}) while waiting for {what}, after "
                    f"{len(self.restarts)} restarts"
                )
            self.restarts.append({"worker": name, "exit": code, "while": what})
            self.start(name)

    def stop(self) -> None:
        """Stop every worker (frozen ones too)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait(condition: Callable[[], Any], what: str, crew: _Crew) -> Any:
    end = time.monotonic() + _LIMIT
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        crew.revive(what)
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
    with (logs / f"celery-{name}.log").open("ab") as log:
        return subprocess.Popen(  # noqa: S603 - this interpreter, fixed arguments
            command, env=env, stdout=log, stderr=subprocess.STDOUT
        )


def run_celery(
    url: str,
    jobs: int,
    ttl: float,
    seed: int,
    logs: Path,
    *,
    guarded: bool = True,
    faults: Sequence[Fault] = (),
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
        faults: server faults of ``url``'s redis-server
            (:func:`fence._chaos.controller.fault_plan`), one per job in turn, done while
            the job's victim is frozen; none by default.

    Raises:
        RuntimeError: a worker died, or a step took longer than two minutes.
    """
    import redis
    from celery import Celery

    rng = random.Random(f"{seed}:celery")
    client = redis.Redis.from_url(url)
    sender = Celery("fence_chaos_client", broker=url, backend=url)
    sender.conf.broker_connection_retry_on_startup = True
    crew = _Crew(url, ttl, logs, most=len(faults) and jobs)  # a restart per fault at most
    pauses: list[dict[str, Any]] = []
    results: dict[int, list[dict[str, Any]]] = {}
    started = time.monotonic()
    try:
        for name in _WORKERS:
            crew.start(name)
        # Both workers answer a ping (theirs by name: a shared broker may have others).
        names = [_hostname(name) for name in _WORKERS]
        _wait(
            lambda: len(sender.control.ping(destination=names, timeout=0.5) or []) >= len(names),
            "the celery workers to start",
            crew,
        )
        for job_id in range(1, jobs + 1):
            victim, rescuer = rng.sample(_WORKERS, 2)
            pause = ttl * rng.uniform(1.3, 2.0)
            fault = faults[(job_id - 1) % len(faults)] if faults else None
            job = _Job(sender, client, crew, job_id, guarded)
            pauses.append(job.run(victim, rescuer, pause, fault))
            pauses[-1]["ttl_s"] = ttl
            results[job_id] = job.outcomes
        summary = _summary(client, results, pauses, jobs, ttl, time.monotonic() - started)
        summary["guarded"] = guarded
        summary["worker_restarts"] = crew.restarts
        return summary
    finally:
        crew.stop()
        sender.close()
        client.close()


class _Job:
    """One job: its first run frozen on the victim, its second on the rescuer."""

    def __init__(
        self,
        sender: Any,
        client: Any,
        crew: _Crew,
        job_id: int,
        guarded: bool,
    ) -> None:
        self.sender = sender
        self.client = client
        self.crew = crew
        self.job_id = job_id
        self.guarded = guarded
        self.outcomes: list[dict[str, Any]] = []

    def _send(self, queue: str, **kwargs: Any) -> Any:
        kwargs["guarded"] = self.guarded
        return self.sender.send_task(_TASK, args=(self.job_id,), kwargs=kwargs, queue=_queue(queue))

    def _holding(self, victim: str) -> bool:
        held = self.client.lrange("chaos-holding", 0, -1)
        return f"{victim} {self.job_id}".encode() in held

    def run(
        self, victim: str, rescuer: str, pause: float, fault: Fault | None = None
    ) -> dict[str, Any]:
        """Run it, with ``fault`` done while the victim is frozen; the pause (and the
        fault) as the summary lists them."""
        job_id = self.job_id
        first = self._send(victim, hold=True)
        _wait(lambda: self._holding(victim), f"worker {victim} at job {job_id}'s gate", self.crew)
        stopped = time.monotonic()
        frozen_proc = self.crew.procs[victim]
        frozen_proc.send_signal(signal.SIGSTOP)
        done: dict[str, Any] | None = None
        try:
            if fault is not None:
                done = _do(fault)
            # Past the lease, counted from the fault's end: the victim's watchdog is frozen too.
            time.sleep(pause)
            second = self._send(rescuer)
            _wait(second.ready, f"job {job_id} on {rescuer}", self.crew)
            self.client.rpush(f"chaos-gate:{job_id}", "go")
        finally:
            frozen_proc.send_signal(signal.SIGCONT)
        frozen = time.monotonic() - stopped
        _wait(first.ready, f"job {job_id}'s first run on {victim}", self.crew)
        self.outcomes = [_outcome(first, victim, "frozen"), _outcome(second, rescuer, "rescuer")]
        listed: dict[str, Any] = {"job": job_id, "worker": victim, "stopped_s": round(frozen, 2)}
        if done is not None:
            listed["fault"] = done
        return listed


def _do(fault: Fault) -> dict[str, Any]:
    """Do ``fault``; what it did, or the error it met (the run then fails)."""
    began = time.monotonic()
    done: dict[str, Any] = {"kind": fault.kind, "server": fault.server}
    try:
        done["detail"] = fault.action()
    except Exception as exc:  # reported in the summary; the run is not ok
        done["error"] = f"{type(exc).__name__}: {exc}"
    done["s"] = round(time.monotonic() - began, 3)
    return done


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
    faults = [pause["fault"] for pause in pauses if "fault" in pause]
    fault_errors = [fault for fault in faults if "error" in fault]
    summary: dict[str, Any] = {
        "scenario": "celery",
        "description": "two celery workers (solo pool) on Redis; per job one is frozen with "
        "SIGSTOP between its read and its write, past its lease, while the other runs the "
        "same job; a Redis fault (connections dropped, or a kill -9 and restart) while "
        "it is frozen",
        "workers": len(_WORKERS),
        "jobs": jobs,
        "ttl_s": ttl,
        "elapsed_s": round(elapsed, 2),
        "pauses_injected": len(pauses),
        "pauses": pauses,
        "faults": faults,
        "fault_errors": fault_errors,
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
        and not fault_errors
    )
    return summary
