"""``fence chaos`` with the consensus managers: etcd and ZooKeeper, each with the Redis guard,
with the SQL row guard and with its own guard on the same cluster.

One run of the command starts its own 3-member etcd cluster, 3-server ZooKeeper ensemble,
redis-server and PostgreSQL, freezes lease holders with ``SIGSTOP`` past their lease (and
past what the cluster keeps: etcd's whole-second lease, ZooKeeper's session), kills the
cluster's leader with ``kill -9`` and freezes members, and kills and disconnects Redis and
PostgreSQL. The checker must find no stale write accepted, no lost update and no token
issued twice, and the guards must have refused the frozen holders' late writes.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from fence._chaos.pairings import PAIRINGS
from tests.test_chaos import run_chaos

CONSENSUS = [
    name
    for name, pairing in PAIRINGS.items()
    if pairing.fenced and {"etcd", "zookeeper"} & set(pairing.servers)
]
PAUSES = 8

pytestmark = [
    pytest.mark.redis,
    pytest.mark.postgres,
    pytest.mark.etcd,
    pytest.mark.zookeeper,
    pytest.mark.slow,
]


@pytest.fixture(scope="module")
def chaos_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("chaos-consensus")
    done = run_chaos(
        *(arg for name in CONSENSUS for arg in ("--pairing", name)),
        "--workers", "4",
        "--records", "2",
        "--ttl", "0.4",
        "--pauses", str(PAUSES),
        "--duration", "45",
        "--fault-every", "2",
        "--summary", str(out / "summary.json"),
        timeout=420,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    summary: dict[str, Any] = json.loads((out / "summary.json").read_text())
    return summary


def test_every_consensus_pairing_is_available() -> None:
    # The suite installs etcd, ZooKeeper, httpx and kazoo: none of the four may be skipped.
    assert sorted(CONSENSUS) == [
        "etcd+etcd",
        "etcd+redis",
        "etcd+sql",
        "zookeeper+redis",
        "zookeeper+sql",
        "zookeeper+zookeeper",
    ]


@pytest.mark.parametrize("name", CONSENSUS)
def test_consensus_pairing_keeps_every_update(chaos_run: dict[str, Any], name: str) -> None:
    result = {r["pairing"]: r for r in chaos_run["pairings"]}[name]
    verdict = result["verdict"]
    assert result["ok"], result
    assert result["stale_accepted"] == 0
    assert result["lost_updates"] == 0
    assert verdict["duplicate_tokens"] == []
    assert verdict["duplicate_values"] == []
    assert not any(verdict["unexplained"].values())
    assert result["pauses_injected"] >= PAUSES
    assert result["accepted"] > 0
    assert result["worker_failures"] == []
    assert result["fault_errors"] == []
    done = {(fault["kind"], fault["server"]) for fault in result["faults"]}
    cluster = "etcd" if name.startswith("etcd") else "zookeeper"
    assert {("kill", cluster), ("pause", cluster)} <= done
    if not name.endswith(cluster):  # the guard on another server: its faults too
        store = "redis" if name.endswith("redis") else "postgres"
        assert {("kill", store), ("drop-connections", store)} <= done


@pytest.mark.parametrize("cluster", ["etcd", "zookeeper"])
def test_frozen_holders_of_each_manager_were_refused(
    chaos_run: dict[str, Any], cluster: str
) -> None:
    """Frozen holders woke up after another took over, and the guards refused them.

    Counted per manager, over its three pairings: a refusal needs a pause that outlasts the
    lease on the cluster *and* a waiter for that record that writes before the frozen
    holder wakes, and leader kills keep extending etcd's leases, so one pairing alone
    sees only a few.
    """
    results = [r for r in chaos_run["pairings"] if r["pairing"].startswith(cluster)]
    assert len(results) == 3
    assert sum(r["rejected"] + r["reads_rejected"] for r in results) > 0


def test_consensus_totals(chaos_run: dict[str, Any]) -> None:
    totals = chaos_run["totals"]
    assert chaos_run["ok"]
    assert totals["stale_accepted"] == 0
    assert totals["lost_updates"] == 0
    assert totals["server_kills"]["etcd"] >= 2
    assert totals["server_kills"]["zookeeper"] >= 2
