"""The consensus clusters of the test rig are real, never run ZooKeeper as root, stay small,
and are reaped when the run that started them died."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.servers import OWNER_FILE, EtcdCluster, ZooKeeperEnsemble, reap_orphans


def _uid(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    return int(next(line.split()[1] for line in status if line.startswith("Uid:")))


def test_etcd_cluster_is_real(etcd_cluster: EtcdCluster) -> None:
    etcd_cluster.heal()
    statuses = [etcd_cluster.status(i) for i in range(3)]
    assert all(statuses)
    assert {s["version"] for s in statuses if s} == {"3.4.23"}
    assert len({s["header"]["member_id"] for s in statuses if s}) == 3
    assert len({s["leader"] for s in statuses if s}) == 1  # one leader, seen by all


def test_zookeeper_runs_as_an_unprivileged_user_with_a_small_heap(
    zookeeper_ensemble: ZooKeeperEnsemble,
) -> None:
    zookeeper_ensemble.heal()
    modes = sorted(str(zookeeper_ensemble.mode(i)) for i in range(3))
    assert modes == ["follower", "follower", "leader"]
    for member in zookeeper_ensemble.members:
        assert member.proc is not None
        assert _uid(member.proc.pid) != 0
        command = Path(f"/proc/{member.proc.pid}/cmdline").read_bytes().split(b"\0")
        assert b"-Xmx128m" in command


def test_heal_waits_for_an_ensemble_that_lost_its_form_behind_the_rigs_back(
    zookeeper_ensemble: ZooKeeperEnsemble, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ensemble can stop serving with no fault test touching it (a member starved on a
    loaded machine misses its heartbeats and an election follows): ``heal`` looks
    (``serving``, from each member's ``srvr``) and waits for it to form again, though the
    rig saw no member change. Here one member's ``srvr`` says what a member out of the
    ensemble says (nothing); the other members are left alone."""
    ensemble = zookeeper_ensemble
    ensemble.heal()
    assert ensemble.serving()
    assert not ensemble.dirty
    mode = ensemble.mode
    out = {1}
    monkeypatch.setattr(
        ensemble, "mode", lambda index, timeout=1.0: None if index in out else mode(index)
    )
    assert not ensemble.serving()
    seen: list[bool] = []
    wait_ready = ensemble.wait_ready

    def waiting(timeout: float = 60.0, **options: Any) -> None:
        seen.append(ensemble.serving())
        out.clear()  # the member is back
        wait_ready(timeout, **options)

    monkeypatch.setattr(ensemble, "wait_ready", waiting)
    ensemble.heal()
    assert seen == [False]  # it looked, saw the ensemble not formed, and waited
    assert ensemble.serving()
    ensemble.heal()
    assert seen == [False]  # a formed ensemble, untouched: no wait


def test_a_cluster_of_a_dead_run_is_reaped() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    cluster = EtcdCluster(size=1).start()
    procs = [m.proc for m in cluster.members]
    (cluster.dir / OWNER_FILE).write_text(str(dead.pid))
    reaped = reap_orphans()
    assert str(cluster.dir) in reaped
    assert not cluster.dir.exists()
    for proc in procs:
        assert proc is not None
        assert proc.wait(timeout=10) == -signal.SIGKILL  # killed by the reaper
    for member in cluster.members:
        member.proc = None


def test_a_zookeeper_member_that_does_not_rejoin_is_restarted_from_its_data(
    zookeeper_ensemble: ZooKeeperEnsemble,
) -> None:
    """A member that stays out of the ensemble (here: stopped behind the rig's back, as a
    follower looping in its sync with a woken leader stays out) holds up ``wait_ready``
    until ``restart_after``; then every running member is restarted from its data, and the
    ensemble forms again with its nodes and zxids."""
    from kazoo.client import KazooClient

    zookeeper_ensemble.heal()
    client = KazooClient(hosts=zookeeper_ensemble.hosts, timeout=10.0)
    client.start(timeout=15)
    try:
        path = client.create("/rejoin-", b"kept", sequence=True)
        _, before = client.get(path)
    finally:
        client.stop()
        client.close()
    stuck = zookeeper_ensemble.members[1]
    assert stuck.proc is not None
    pids = [m.proc.pid for m in zookeeper_ensemble.members if m.proc is not None]
    stuck.proc.send_signal(signal.SIGSTOP)  # the rig still counts it as running
    zookeeper_ensemble.wait_ready(timeout=90, restart_after=2)
    assert all(m.proc is not None and m.proc.pid not in pids for m in zookeeper_ensemble.members)
    client = KazooClient(hosts=zookeeper_ensemble.hosts, timeout=10.0)
    client.start(timeout=15)
    try:
        data, stat = client.get(path)
        assert data == b"kept"
        assert stat.czxid == before.czxid
        after = client.create("/rejoin-", b"", sequence=True)
        assert client.get(after)[1].czxid > before.czxid
    finally:
        client.stop()
        client.close()
