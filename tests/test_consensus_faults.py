"""Faults on the real etcd cluster and ZooKeeper ensemble, for both consensus managers.

Each test runs once against etcd (3 members) and once against ZooKeeper (3 servers), on
the session's cluster, and heals what it broke (only the member it killed is started
again, except in the full restart):

- the leader killed with ``SIGKILL`` while workers acquire, release and renew;
- the leader frozen with ``SIGSTOP`` (a member that keeps its sockets and answers nothing);
- a follower killed (a minority down);
- every member killed and started again from its data on disk;
- a majority frozen: acquire fails within its timeout with a retryable ``BackendError``,
  and a held lease is reported lost;
- a lease holder in another process frozen past its lease.

After each, the record of every lease is checked: tokens on a resource only grow in the
order the leases were granted (C2); no two leases on a resource were valid at the same
time, by the clients' own deadlines (C10, the one monotonic clock of the machine); a lease
whose release found it gone was either reported lost first or already past its deadline
(silence is a defect); and the workers kept getting the lock through the fault (waiters
are woken).
"""

from __future__ import annotations

import itertools
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from fence import AcquireTimeout, BackendError, LeaseLostError, NotOwnerError
from fence._sync.etcd import EtcdLockManager
from fence._sync.manager import BaseLockManager
from fence._sync.zookeeper import ZooKeeperLockManager
from tests.servers import EtcdCluster, ZooKeeperEnsemble

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow

TTL = 3.0


@dataclass
class Consensus:
    """One backend under test: its cluster, a URL with a prefix of the test's own, and a
    factory of sync managers."""

    kind: str
    cluster: EtcdCluster | ZooKeeperEnsemble
    url: str
    built: list[BaseLockManager] = field(default_factory=list)

    def manager(self, **options: Any) -> BaseLockManager:
        options.setdefault("ttl", TTL)
        options.setdefault("request_timeout", 3.0)
        manager: BaseLockManager
        if self.kind == "etcd":
            manager = EtcdLockManager(self.url, **options)
        else:
            manager = ZooKeeperLockManager(self.url, **options)
        self.built.append(manager)
        return manager

    def others(self, index: int) -> list[int]:
        return [i for i in range(len(self.cluster.members)) if i != index]


@pytest.fixture(params=["etcd", "zookeeper"])
def consensus(request: pytest.FixtureRequest) -> Iterator[Consensus]:
    kind = request.param
    url = request.getfixturevalue(f"{kind}_url")
    cluster = request.getfixturevalue("etcd_cluster" if kind == "etcd" else "zookeeper_ensemble")
    backend = Consensus(kind, cluster, url)
    try:
        yield backend
    finally:
        cluster.heal()
        for manager in backend.built:
            manager.close()


def leader_of(consensus: Consensus, timeout: float = 30.0) -> int:
    end = time.monotonic() + timeout
    while True:
        found = consensus.cluster.leader()
        if found is not None:
            return found
        assert time.monotonic() < end, "no leader"
        time.sleep(0.05)


# -- the workload and its record -------------------------------------------------------------


@dataclass
class Held:
    """One lease as its worker saw it."""

    worker: str
    resource: str
    token: int
    granted_at: float
    deadline: float = 0.0
    valid_until: float = 0.0
    released_at: float = 0.0
    lost_at: float | None = None
    release: str = "ok"
    renewals: int = 0


class Workload:
    """Worker threads, each with a manager of its own (its own connection or session),
    acquiring random resources, holding them a little, and releasing them."""

    def __init__(
        self,
        consensus: Consensus,
        *,
        workers: int = 3,
        resources: int = 2,
        hold: float = 0.02,
        renew: bool = False,
        seed: int = 0,
        name: str = "res",
    ) -> None:
        self.resources = [f"{name}:{i}" for i in range(resources)]
        self.hold = hold
        self.renew = renew
        self.records: list[Held] = []
        self.errors: list[str] = []
        self.timeouts = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(
                target=self._run,
                args=(f"w{i}", consensus.manager(), random.Random(seed * 100 + i)),
                daemon=True,
            )
            for i in range(workers)
        ]

    def __enter__(self) -> Workload:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(60)
        assert not any(t.is_alive() for t in self._threads), "a worker hung"

    def _run(self, name: str, manager: BaseLockManager, rng: random.Random) -> None:
        while not self._stop.is_set():
            resource = rng.choice(self.resources)
            lost: list[float] = []
            try:
                lease = manager.acquire(
                    resource, timeout=10, renew=self.renew, on_lost=_stamp_into(lost)
                )
            except AcquireTimeout:
                with self._lock:
                    self.timeouts += 1
                continue
            except BackendError as exc:
                with self._lock:
                    self.errors.append(f"{name} acquire: {exc}")
                time.sleep(0.05)
                continue
            record = Held(name, resource, lease.token, time.monotonic(), lease.deadline)
            time.sleep(self.hold * rng.uniform(0.5, 1.5))
            record.released_at = time.monotonic()
            record.deadline = lease.deadline  # renewals move it
            record.valid_until = min(record.released_at, record.deadline)
            try:
                lease.release()
            except NotOwnerError:
                record.release = "not held"
            except BackendError as exc:
                record.release = f"error: {exc}"
            record.lost_at = lost[0] if lost else None
            if record.lost_at is not None:
                record.valid_until = min(record.valid_until, record.lost_at)
            with self._lock:
                self.records.append(record)

    def report(self) -> str:
        """Counts and the first errors, for assertion messages."""
        return (
            f"{len(self.records)} leases, {self.timeouts} acquire timeouts, "
            f"{len(self.errors)} errors: {self.errors[:4]}"
        )

    def progress(self, after: float, within: float = 30.0) -> bool:
        """Wait until a lease is granted after ``after`` (monotonic); whether one was."""
        end = time.monotonic() + within
        while time.monotonic() < end:
            with self._lock:
                if any(r.granted_at > after for r in self.records):
                    return True
            time.sleep(0.05)
        return False

    def granted_between(self, start: float, end: float) -> list[Held]:
        return [r for r in self.records if start <= r.granted_at <= end]

    def check(self) -> None:
        """C2, exclusion by the clients' deadlines, and no silent loss."""
        assert self.records, "no lease was granted at all"
        for resource in self.resources:
            mine = sorted(
                (r for r in self.records if r.resource == resource), key=lambda r: r.granted_at
            )
            tokens = [r.token for r in mine]
            assert tokens == sorted(tokens), f"{resource}: tokens went back: {tokens}"
            assert len(set(tokens)) == len(tokens), f"{resource}: a token was issued twice"
            for before, after in itertools.pairwise(mine):
                assert after.granted_at >= before.valid_until, (
                    f"{resource}: {after.worker} got token {after.token} at "
                    f"{after.granted_at:.3f} while {before.worker}'s lease {before.token} "
                    f"was valid until {before.valid_until:.3f}"
                )
        for record in self.records:
            if record.release == "not held":
                assert record.lost_at is not None or record.released_at >= record.deadline, (
                    f"{record}: the backend dropped a lease before its deadline, unannounced"
                )


def _stamp_into(lost: list[float]) -> Any:
    return lambda lease, err: lost.append(time.monotonic())


def steady(seconds: float) -> None:
    time.sleep(seconds)


# -- the leader killed -----------------------------------------------------------------------


def test_leader_killed_during_acquires_and_renewals(consensus: Consensus) -> None:
    """SIGKILL the leader while workers take short leases and others renew long ones."""
    cluster = consensus.cluster
    with (
        Workload(consensus, workers=3, resources=2, hold=0.02, seed=1) as short,
        Workload(
            consensus, workers=2, resources=1, hold=TTL * 0.9, renew=True, seed=2, name="long"
        ) as long,
    ):
        steady(1.5)
        leader = leader_of(consensus)
        killed_at = time.monotonic()
        cluster.kill(leader)
        # Two members left, a majority: the lock works again once they elect a leader.
        assert short.progress(after=killed_at + 0.5), short.report()
        steady(1.0)
        restarted_at = time.monotonic()
        cluster.start_member(leader)
        assert short.progress(after=restarted_at), short.report()
        assert long.progress(after=killed_at + 0.5), long.report()
    short.check()
    long.check()
    held_across = [r for r in long.records if r.granted_at < killed_at < r.released_at]
    assert held_across, long.report()
    # Each lease held across the kill kept being renewed, or was reported lost.
    for record in held_across:
        assert record.release == "ok" or record.lost_at is not None, record


# -- a member frozen, a minority down --------------------------------------------------------


def test_leader_frozen_with_sigstop(consensus: Consensus) -> None:
    """SIGSTOP the leader: it keeps its sockets and answers nothing; the others elect a new
    leader, and clients that talked to it move on."""
    cluster = consensus.cluster
    with Workload(consensus, workers=3, resources=2, seed=3) as work:
        steady(1.0)
        leader = leader_of(consensus)
        stopped_at = time.monotonic()
        cluster.pause(leader)
        # No write commits while the leader is frozen: a grant now comes from a new leader.
        assert work.progress(after=stopped_at + 0.5), work.report()
        steady(1.0)
        resumed_at = time.monotonic()
        cluster.resume(leader)
        assert work.progress(after=resumed_at), work.report()
    work.check()


def test_minority_down(consensus: Consensus) -> None:
    """SIGKILL a follower: the majority carries on; the member rejoins from its data."""
    cluster = consensus.cluster
    with Workload(consensus, workers=3, resources=2, seed=4) as work:
        steady(1.0)
        follower = consensus.others(leader_of(consensus))[0]
        killed_at = time.monotonic()
        cluster.kill(follower)
        assert work.progress(after=killed_at + 1.0), work.report()
        steady(1.0)
        restarted_at = time.monotonic()
        cluster.start_member(follower)
        assert work.progress(after=restarted_at), work.report()
    work.check()


# -- the whole cluster restarted from disk ---------------------------------------------------


def test_whole_cluster_restarted_from_disk(consensus: Consensus) -> None:
    """Kill every member and start them again: the held lease, the queue and the token
    order survive; the waiter is woken by the release after the restart."""
    cluster = consensus.cluster
    holder = consensus.manager(ttl=30.0, request_timeout=5.0)
    waiter_manager = consensus.manager(ttl=30.0, request_timeout=5.0)
    first = holder.acquire("restart:a")
    first.release()
    held = holder.acquire("restart:b")
    got: dict[str, Any] = {}

    def wait_for_it() -> None:
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline:
            try:
                lease = waiter_manager.acquire("restart:b", timeout=30)
            except BackendError:  # while the cluster is down
                time.sleep(0.1)
                continue
            got["token"] = lease.token
            got["at"] = time.monotonic()
            lease.release()
            return

    thread = threading.Thread(target=wait_for_it, daemon=True)
    thread.start()
    time.sleep(0.5)
    cluster.kill_all()
    time.sleep(0.5)
    for member in cluster.members:
        cluster.start_member(member.index)
    cluster.wait_ready()
    assert "token" not in got, "the waiter got a lock that was held across the restart"
    released_at = time.monotonic()
    end = time.monotonic() + 15
    while True:  # the holder's client reconnects and releases
        try:
            held.release()
            break
        except BackendError:
            assert time.monotonic() < end
            time.sleep(0.2)
    thread.join(40)
    assert got, "the waiter was never woken"
    assert got["at"] >= released_at
    assert got["token"] > held.token > first.token
    after = holder.acquire("restart:a")
    assert after.token > got["token"]  # C2 across the restart, on another resource too
    after.release()


# -- a majority down -------------------------------------------------------------------------


def test_majority_frozen_acquire_fails_in_time_and_lease_is_lost(consensus: Consensus) -> None:
    """SIGSTOP two of three: acquire raises a retryable BackendError within its timeout
    instead of hanging, and a renewed lease is reported lost at its deadline."""
    cluster = consensus.cluster
    manager = consensus.manager(ttl=TTL, request_timeout=2.0)
    lost: list[LeaseLostError] = []
    lease = manager.acquire("majority", renew=True, on_lost=lambda lease, err: lost.append(err))
    leader = leader_of(consensus)
    frozen = [leader, consensus.others(leader)[0]]
    for index in frozen:
        cluster.pause(index)
    try:
        other = consensus.manager(ttl=TTL, request_timeout=2.0)
        started = time.monotonic()
        with pytest.raises(BackendError) as info:
            # Retried with backoff while the deadline allows (docs/managers.md), then the
            # last error: within the timeout and its small margin, whatever the cluster does.
            other.acquire("majority:other", timeout=3)
        took = time.monotonic() - started
        assert info.value.retryable
        assert took < 3.0 + 1.5, f"acquire took {took:.1f} s with a 3 s timeout"
        assert lease.wait_lost(timeout=TTL + 5)
        assert lost
        assert lost[0].token == lease.token
        assert time.monotonic() >= lease.deadline
        with pytest.raises(LeaseLostError):
            lease.check()
    finally:
        for index in frozen:
            cluster.resume(index)
    cluster.wait_ready()
    again = consensus.manager().acquire("majority:other", timeout=15)
    assert again.token > lease.token
    again.release()


# -- a paused lease holder in another process ------------------------------------------------


def test_paused_holder_loses_its_lease_and_hears_it(consensus: Consensus, tmp_path: Path) -> None:
    """A holder process frozen past its lease: its lease ends on the cluster (etcd: the
    lease expires without keepalives; ZooKeeper: the session expires), a waiter gets the
    lock only after the holder's own deadline, and the holder reports the loss on waking."""
    resource = "paused"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    errors = tmp_path / "holder.stderr"
    with errors.open("w") as stderr:
        child = subprocess.Popen(
            [sys.executable, "-m", "tests.consensus_holder", consensus.kind, consensus.url,
             resource, "2.0"],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
            cwd=ROOT,
        )  # fmt: skip
    try:
        assert child.stdout is not None
        line = child.stdout.readline()
        assert line, f"the holder process failed: {errors.read_text()[-2000:]}"
        acquired = json.loads(line)
        assert acquired["event"] == "acquired"
        child.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        waiter = consensus.manager(ttl=TTL)
        lease = waiter.acquire(resource, timeout=30)
        granted_at = time.monotonic()
        child.send_signal(signal.SIGCONT)
        events = [json.loads(line) for line in iter(child.stdout.readline, "")]
        child.wait(30)
        deadlines = [acquired["deadline"]] + [e["deadline"] for e in events if "deadline" in e]
        assert lease.token > acquired["token"]
        assert granted_at > max(deadlines), "the waiter got in before the holder's deadline"
        assert granted_at > stopped_at + 1.0
        lost = [e for e in events if e["event"] == "lost"]
        assert len(lost) == 1, events
        assert lost[0]["past_deadline"], lost
        lease.release()
    finally:
        if child.poll() is None:
            child.send_signal(signal.SIGCONT)
            child.kill()
        child.wait(10)
        if child.stdout is not None:
            child.stdout.close()
