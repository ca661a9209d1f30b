"""``fence chaos``: real pauses (SIGSTOP past the lease) and real server faults, per pairing.

One short run of the command covers every fenced pairing and the unfenced baseline. Each
pairing runs until lease holders were stopped past their ttl often enough for 200 such
pauses over the fenced pairings, and until every fault of its servers ran once (dropped
connections, ``kill -9`` / immediate shutdown and restart). The checker must then find no
stale write accepted, no lost update and no token issued twice, while the baseline, under
the same pauses, must lose updates.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fence._chaos.pairings import PAIRINGS

# The pairings on the consensus clusters run in tests/test_chaos_consensus.py.
CORE = {"redis", "postgres"}
FENCED = [
    name for name, pairing in PAIRINGS.items() if pairing.fenced and set(pairing.servers) <= CORE
]
RUN = [*FENCED, *(name for name, pairing in PAIRINGS.items() if not pairing.fenced)]
PAUSES_PER_PAIRING = math.ceil(200 / len(FENCED)) + 5

pytestmark = [pytest.mark.redis, pytest.mark.postgres, pytest.mark.slow]


def run_chaos(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fence", "chaos", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def chaos_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("chaos")
    done = run_chaos(
        *(arg for name in RUN for arg in ("--pairing", name)),
        "--workers", "5",
        "--records", "3",
        "--ttl", "0.4",
        "--pauses", str(PAUSES_PER_PAIRING),
        "--duration", "45",
        "--summary", str(out / "summary.json"),
        "--timeline", str(out / "timeline.svg"),
        timeout=280,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert json.loads(done.stdout) == summary
    return summary, out


def by_name(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {result["pairing"]: result for result in summary["pairings"]}


@pytest.mark.parametrize("name", FENCED)
def test_fenced_pairing_keeps_every_update(
    chaos_run: tuple[dict[str, Any], Path], name: str
) -> None:
    result = by_name(chaos_run[0])[name]
    verdict = result["verdict"]
    assert result["ok"], result
    assert verdict["ok"]
    assert result["stale_accepted"] == 0
    assert result["lost_updates"] == 0
    assert verdict["duplicate_tokens"] == []
    assert verdict["duplicate_values"] == []
    assert not any(verdict["unexplained"].values())
    # The run did real work and the fence did real refusing.
    assert result["pauses_injected"] >= PAUSES_PER_PAIRING
    assert result["accepted"] > 0
    assert result["rejected"] + result["reads_rejected"] > 0
    assert sum(result["final"].values()) >= result["accepted"]
    assert result["worker_failures"] == []
    assert result["fault_errors"] == []


def test_readers_check_every_read_and_stale_readers_are_refused(
    chaos_run: tuple[dict[str, Any], Path],
) -> None:
    """The pairing with readers (C13): readers read under read leases beside the writers'
    cycles; every accepted read saw a value written under a token not newer than the fence
    it read with, nor newer than its lease; readers paused past their lease while a writer
    wrote were refused at their next read."""
    shared = [name for name in FENCED if PAIRINGS[name].readers]
    assert shared
    for name in shared:
        result = by_name(chaos_run[0])[name]
        assert result["ok"], result
        assert result["reads_accepted"] > 0
        assert result["stale_reads"] == 0
        assert result["verdict"]["stale_reads"] == []
        assert result["reads_rejected"] > 0
        assert result["accepted"] > 0  # the writers wrote too


@pytest.mark.parametrize("name", FENCED)
def test_every_server_of_a_pairing_is_killed_and_its_connections_dropped(
    chaos_run: tuple[dict[str, Any], Path], name: str
) -> None:
    result = by_name(chaos_run[0])[name]
    done = {(fault["kind"], fault["server"]) for fault in result["faults"]}
    for server in PAIRINGS[name].servers:
        assert ("kill", server) in done
        assert ("drop-connections", server) in done
        assert result["server_kills"][server] >= 1


def test_totals_cover_two_hundred_pauses_and_a_kill_per_server(
    chaos_run: tuple[dict[str, Any], Path],
) -> None:
    summary = chaos_run[0]
    totals = summary["totals"]
    assert summary["ok"]
    assert totals["pauses_injected"] >= 200
    assert totals["stale_accepted"] == 0
    assert totals["lost_updates"] == 0
    assert totals["server_kills"]["redis"] >= 1
    assert totals["server_kills"]["postgres"] >= 1


def test_unfenced_baseline_loses_updates(chaos_run: tuple[dict[str, Any], Path]) -> None:
    summary = chaos_run[0]
    baseline = by_name(summary)["baseline"]
    assert not baseline["fenced"]
    assert baseline["pauses_injected"] >= PAUSES_PER_PAIRING
    assert baseline["lost_updates"] > 0
    assert baseline["verdict"]["duplicate_values"]  # two writers produced the same value
    assert sum(baseline["final"].values()) < baseline["accepted"]
    assert summary["totals"]["baseline_lost_updates"] == baseline["lost_updates"]


def test_timeline_per_pairing(chaos_run: tuple[dict[str, Any], Path]) -> None:
    out = chaos_run[1]
    for name in RUN:
        svg = (out / f"timeline-{name.replace('+', '-')}.svg").read_text()
        assert svg.startswith("<svg")
        assert "stopped (SIGSTOP)" in svg
        assert f"fence chaos {name}" in svg


def test_missing_pairings_are_reported(chaos_run: tuple[dict[str, Any], Path]) -> None:
    summary = chaos_run[0]
    ran = {result["pairing"] for result in summary["pairings"]}
    assert ran == set(RUN)
    assert not ran & set(summary["not_covered"])
