"""Celery tasks under a lease (``fence.adapters.celery``), on real worker processes.

Two ``celery worker`` processes (solo pool, one queue each: ``a`` and ``b``) run the tasks
of ``tests/celery_app.py`` on the suite's redis-server, which is broker, result backend,
lock manager and guarded storage at once. The test freezes worker ``a`` with SIGSTOP in the
middle of a job, past its lease, while ``b`` runs the same job. What the configuration of a
task refuses is checked in this process, in Celery's eager mode.

Nothing here waits a fixed time: every wait is on a condition, with a generous limit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from fence import (
    AcquireTimeout,
    ConfigurationError,
    MemoryLockManager,
    Reason,
    RedisLockManager,
    StaleTokenError,
)
from fence.adapters.celery import FencedTask
from fence.testing import ManualClock, MemoryGuard
from tests.servers import RedisServer

ROOT = Path(__file__).resolve().parent.parent
TASKS = "tests.celery_app"
LIMIT = 60.0  # seconds: a condition that takes longer is a failure, not a slow machine


def _wait(condition: Callable[[], Any], what: str, logs: Path) -> Any:
    end = time.monotonic() + LIMIT
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    pytest.fail(f"gave up waiting for {what}; the workers' logs:\n" + _tail(logs))


def _tail(logs: Path) -> str:
    return "".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(logs.glob("*.log")))


class Workers:
    """Two worker processes, ``a`` and ``b``, each on its own queue."""

    def __init__(self, url: str, logs: Path) -> None:
        self.url = url
        self.logs = logs
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.client = redis.Redis.from_url(url)
        self.app = Celery("fence_tests_client", broker=url, backend=url)
        self.app.conf.broker_connection_retry_on_startup = True

    def start(self, name: str) -> None:
        env = {
            **os.environ,
            "FENCE_TEST_REDIS_URL": self.url,
            "FENCE_TEST_WORKER": name,
            "PYTHONPATH": str(ROOT),
        }
        command = [
            sys.executable, "-m", "celery", "-A", TASKS, "worker", "--pool=solo",
            "--queues", name, "--hostname", f"{name}@fence-tests", "--loglevel", "info",
            "--without-gossip", "--without-mingle", "--without-heartbeat",
        ]  # fmt: skip
        with (self.logs / f"{name}.log").open("wb") as log:
            self.procs[name] = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT
            )

    def send(self, task: str, *args: Any, queue: str, **kwargs: Any) -> Any:
        return self.app.send_task(f"{TASKS}.{task}", args=args, kwargs=kwargs, queue=queue)

    def result(self, sent: Any) -> Any:
        try:
            return sent.get(timeout=LIMIT)
        except Exception as exc:
            if type(exc).__name__ == "TimeoutError":
                pytest.fail(f"no result of {sent.id} in {LIMIT} s:\n" + _tail(self.logs))
            raise

    def stop(self) -> None:
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
        self.app.close()
        self.client.close()


@pytest.fixture(scope="module")
def crew(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workers]:
    """Workers ``a`` and ``b`` on the session's redis-server, for this module's tests.

    Not ``redis_url``: its flush would take the broker's queues from under the workers.
    """
    if redis_server.proc is None:  # a fault test left it down
        redis_server.start()
    crew = Workers(redis_server.url, tmp_path_factory.mktemp("celery"))
    try:
        crew.start("a")
        crew.start("b")
        yield crew
    finally:
        crew.stop()


@pytest.fixture
def workers(crew: Workers) -> Workers:
    """The workers, with the lists the tests read emptied (each test has its own jobs)."""
    crew.client.delete("retries", "holding")
    return crew


def _runs(workers: Workers, job_id: int) -> list[tuple[str, int, int]]:
    runs = []
    for line in workers.client.lrange(f"runs:{job_id}", 0, -1):
        name, token, retries = line.decode().split()
        runs.append((name, int(token), int(retries)))
    return runs


@pytest.mark.redis
def test_a_task_runs_under_a_lease_and_writes_through_the_guard(workers: Workers) -> None:
    out = workers.result(workers.send("run_job", 1, queue="b"))
    assert out["outcome"] == "done"
    assert out["retries"] == 0
    assert workers.client.get("{job:1}:count") == b"1"
    assert _runs(workers, 1) == [("b", out["token"], 0)]
    manager = RedisLockManager(workers.url)
    try:
        assert manager.inspect("job:1") is None  # released at the end
    finally:
        manager.close()


@pytest.mark.redis
def test_a_worker_frozen_past_its_lease_is_refused_and_the_job_happens_once(
    workers: Workers,
) -> None:
    """Worker ``a`` takes job 2 and stops (SIGSTOP) before its write; ``b`` does the job.

    ::

        a  acquires job:2 -> t1, claims, finds no count, waits at the gate
        a  SIGSTOP ............................... (its lease ends 2 s later, unrenewed)
        b  acquires job:2 -> t2 > t1, claims, count = 1, releases
        a  SIGCONT, passes the gate, INCR with t1 -> refused (StaleTokenError)
        a  releases nothing it holds, retries: acquires -> t3 > t2, finds count = 1, done
    """
    first = workers.send("run_job", 2, hold=True, queue="a")
    _wait(lambda: workers.client.lrange("holding", 0, -1) == [b"a"], "a at the gate", workers.logs)
    worker_a = workers.procs["a"]
    worker_a.send_signal(signal.SIGSTOP)
    try:
        second = workers.result(workers.send("run_job", 2, queue="b"))
        assert second["outcome"] == "done"
        workers.client.rpush("gate:2", "go")
    finally:
        worker_a.send_signal(signal.SIGCONT)
    out = workers.result(first)
    assert out["outcome"] == "already done"
    assert out["retries"] == 1
    assert workers.client.lrange("retries", 0, -1) == [b"StaleTokenError"]
    (a1, t1, _), (b, t2, _), (a2, t3, _) = _runs(workers, 2)
    assert (a1, b, a2) == ("a", "b", "a")
    assert t1 < t2 == second["token"] < t3 == out["token"]
    # The effect, read from the storage: once, by b's lease, the fence at a's retry.
    assert workers.client.get("{job:2}:count") == b"1"


@pytest.mark.redis
def test_acquire_timeout_retries_under_a_new_lease(workers: Workers) -> None:
    manager = RedisLockManager(workers.url)
    try:
        held = manager.acquire("job:3", ttl=60)
        sent = workers.send("run_job_until_free", 3, queue="b")
        _wait(lambda: sent.state == "RETRY", "a retry", workers.logs)
        held.release()
        out = workers.result(sent)
    finally:
        manager.close()
    assert out["outcome"] == "done"
    assert out["retries"] >= 1
    assert out["token"] > held.token
    assert workers.client.get("{job:3}:count") == b"1"
    retries = workers.client.lrange("retries", 0, -1)
    assert retries == [b"AcquireTimeout"] * out["retries"]


@pytest.mark.redis
def test_acquire_timeout_past_max_retries_fails_the_task(workers: Workers) -> None:
    manager = RedisLockManager(workers.url)
    try:
        with manager.lock("job:4", ttl=60):
            sent = workers.send("run_job_soon", 4, queue="b")
            with pytest.raises(AcquireTimeout, match="job:4"):
                sent.get(timeout=LIMIT)
    finally:
        manager.close()
    assert sent.state == "FAILURE"
    assert workers.client.lrange("retries", 0, -1) == [b"AcquireTimeout"] * 2
    assert workers.client.get("{job:4}:count") is None
    assert _runs(workers, 4) == []


# What a task's configuration refuses, in this process (eager mode, in-memory manager).


@pytest.fixture
def eager() -> Iterator[Celery]:
    app = Celery("fence_eager", set_as_current=False)
    app.conf.task_always_eager = True
    app.conf.task_eager_propagates = True
    app.conf.iofence_manager = MemoryLockManager(ttl=5)
    yield app
    app.close()


def test_eager_run_hands_the_lease_to_the_body(eager: Celery) -> None:
    guard = MemoryGuard()

    @eager.task(base=FencedTask, bind=True, fence="job:{job_id}")
    def job(self: FencedTask, job_id: int) -> int:
        guard.write(f"job:{job_id}", self.lease.token, "done")
        return self.lease.token

    token = job.delay(5).get()
    assert guard.fence("job:5") == token
    assert eager.conf.iofence_manager.inspect("job:5") is None
    with pytest.raises(ConfigurationError, match="only while"):
        _ = job.lease


def test_a_lease_lost_in_the_body_retries_under_a_new_lease(eager: Celery) -> None:
    clock = ManualClock()
    eager.conf.iofence_manager = MemoryLockManager(ttl=5, clock=clock)
    tokens: list[int] = []

    @eager.task(base=FencedTask, bind=True, fence="job:{job_id}", default_retry_delay=0)
    def job(self: FencedTask, job_id: int) -> int:
        tokens.append(self.lease.token)
        if len(tokens) == 1:
            clock.advance(6)  # the worker stalls past its lease
        self.lease.check()
        return self.lease.token

    # Not propagated: an eager retry runs from apply(), which a propagated Retry would leave.
    assert job.apply(args=(6,), throw=False).get() == tokens[1]
    assert len(tokens) == 2
    assert tokens[0] < tokens[1]


def test_stale_writes_retry_with_celerys_backoff_until_max_retries(eager: Celery) -> None:
    countdowns: list[float | None] = []

    class Recording(FencedTask):
        def retry(self, *args: Any, **kwargs: Any) -> Any:
            countdowns.append(kwargs.get("countdown"))
            return super().retry(*args, **kwargs)

    manager = eager.conf.iofence_manager
    eager.conf.task_eager_propagates = False  # each eager retry is an apply() of its own
    tokens: list[int] = []

    @eager.task(
        base=Recording,
        bind=True,
        fence="job:{job_id}",
        max_retries=2,
        retry_backoff=2,
        retry_jitter=False,
    )
    def job(self: FencedTask, job_id: int) -> None:
        tokens.append(self.lease.token)
        raise StaleTokenError(f"job:{job_id}", self.lease.token, 2**52, Reason.STALE)

    outcome = job.apply(args=(7,), throw=False)
    assert outcome.state == "FAILURE"
    assert isinstance(outcome.result, StaleTokenError)
    assert countdowns == [2, 4, 8]  # the third asks past max_retries: the error is raised
    assert len(tokens) == 3
    assert tokens == sorted(set(tokens))  # a new lease, a newer token, each run
    assert manager.inspect("job:7") is None


def test_an_error_a_new_lease_does_not_cure_fails_at_once_and_releases(eager: Celery) -> None:
    manager = eager.conf.iofence_manager
    runs = []

    @eager.task(base=FencedTask, bind=True, fence="job:{job_id}", default_retry_delay=0)
    def job(self: FencedTask, job_id: int) -> None:
        runs.append(self.lease.token)
        raise KeyError("no such customer")

    outcome = job.apply(args=(8,), throw=False)
    assert outcome.state == "FAILURE"
    assert isinstance(outcome.result, KeyError)
    assert len(runs) == 1
    assert manager.inspect("job:8") is None


def test_a_template_naming_a_missing_parameter_is_refused_when_the_task_is_made(
    eager: Celery,
) -> None:
    def job(self: FencedTask, job_id: int) -> None:
        raise AssertionError("never runs")

    with pytest.raises(ConfigurationError, match=r"names \['jobid'\]"):
        eager.task(base=FencedTask, bind=True, fence="job:{jobid}")(job).name  # noqa: B018
    with pytest.raises(ConfigurationError, match="positional field"):
        eager.task(base=FencedTask, bind=True, fence="job:{}", name="t2")(job).name  # noqa: B018
    with pytest.raises(ConfigurationError, match="no fence="):
        eager.task(base=FencedTask, bind=True, name="t3")(job).name  # noqa: B018


def test_arguments_the_template_cannot_use_are_refused_before_any_io(eager: Celery) -> None:
    manager = eager.conf.iofence_manager
    ran = []

    @eager.task(base=FencedTask, fence="user:{user[id]}")
    def job(user: dict[str, int]) -> None:
        ran.append(user)

    with pytest.raises(ConfigurationError, match="cannot be filled"):
        job.delay({"name": 7})
    # A message sent by name (send_task) skips the caller's check of the arguments.
    with pytest.raises(ConfigurationError, match="missing a required argument: 'user'"):
        job.apply()
    assert ran == []
    assert list(manager.list()) == []


def test_no_manager_or_an_async_one_is_refused(eager: Celery) -> None:
    from fence import AsyncMemoryLockManager

    @eager.task(base=FencedTask, fence="job:{job_id}", fence_manager=AsyncMemoryLockManager())
    def job(job_id: int) -> None:
        raise AssertionError("never runs")

    with pytest.raises(ConfigurationError, match="sync lock manager"):
        job.delay(1)
    eager.conf.iofence_manager = None

    @eager.task(base=FencedTask, fence="job:{job_id}")
    def other(job_id: int) -> None:
        raise AssertionError("never runs")

    with pytest.raises(ConfigurationError, match="has no lock manager"):
        other.delay(1)
