"""``fence chaos`` without the programs it needs, and under Ctrl-C: one line, exit status 1 or
130, no traceback, and nothing left behind (no temporary folder, no server process).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [sys.executable, "-m", "fence", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert "Traceback" not in done.stderr + done.stdout, done.stderr
    return done


@pytest.fixture
def private_tmp(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A TMPDIR of the test's own (to see what a run leaves), and an environment using it."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    return tmp, {**os.environ, "TMPDIR": str(tmp)}


def test_chaos_without_redis_server(
    private_tmp: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    tmp, env = private_tmp
    empty = tmp_path / "bin"
    empty.mkdir()
    done = run("chaos", "--pairing", "redis+redis", env={**env, "PATH": str(empty)})
    assert done.returncode == 1
    assert "redis-server is not installed" in done.stderr
    assert list(tmp.iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="only a run as root starts PostgreSQL by runuser")
def test_chaos_without_runuser(private_tmp: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    tmp, env = private_tmp
    empty = tmp_path / "bin"
    empty.mkdir()
    done = run("chaos", "--pairing", "sql+sql", env={**env, "PATH": str(empty)})
    assert done.returncode == 1
    assert "runuser" in done.stderr
    assert list(tmp.iterdir()) == []


def _processes_under(path: Path) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if str(path) in cmdline:
                found.append(cmdline)
    return found


@pytest.mark.slow
def test_ctrl_c_stops_a_chaos_run_cleanly(private_tmp: tuple[Path, dict[str, str]]) -> None:
    tmp, env = private_tmp
    err = tmp.parent / "stderr.txt"
    with err.open("w") as stderr:
        proc = subprocess.Popen(
            [
                sys.executable, "-m", "fence", "chaos", "--pairing", "redis+redis",
                "--workers", "3", "--duration", "120", "--no-faults",
            ],
            stdout=subprocess.PIPE,
            stderr=stderr,
            env=env,
            text=True,
            start_new_session=True,
        )  # fmt: skip
        try:
            # Wait until the workers write their logs: the servers and the workers are up.
            end = time.monotonic() + 120
            while not any(p.stat().st_size for p in tmp.rglob("*.jsonl")):
                assert proc.poll() is None, err.read_text()
                assert time.monotonic() < end, "the chaos run never started its workers"
                time.sleep(0.05)
            os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the whole foreground process group
            out, _ = proc.communicate(timeout=120)
        finally:
            if proc.returncode is None:  # the test failed: leave no process and no open pipe
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    text = err.read_text()
    assert proc.returncode == 130, text
    assert "Traceback" not in text
    assert "KeyboardInterrupt" not in text
    assert "fence chaos: interrupted" in text
    assert out == ""
    assert list(tmp.iterdir()) == []
    assert _processes_under(tmp) == []


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--soak", "0"], "--soak must be positive"),
        (["--soak", "1", "--pauses", "5"], "--pauses does not go with --soak"),
        (["--soak", "1", "--long"], "--long does not go with --soak"),
        (["--soak", "1", "--timeline", "x.svg"], "--timeline does not go with --soak"),
        (["--soak", "1", "--pairing", "baseline"], "fenced pairings only"),
    ],
)
def test_soak_usage_errors(
    private_tmp: tuple[Path, dict[str, str]], args: list[str], says: str
) -> None:
    """A soak asked for wrongly is refused before any server starts: exit status 2."""
    tmp, env = private_tmp
    done = run("chaos", *args, env=env)
    assert done.returncode == 2
    assert says in done.stderr
    assert list(tmp.iterdir()) == []


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--celery", "--pairing", "redis+redis"], "--pairing does not go with --celery"),
        (["--celery", "--soak", "1"], "--soak does not go with --celery"),
        (["--celery", "--timeline", "x.svg"], "--timeline does not go with --celery"),
    ],
)
def test_celery_usage_errors(
    private_tmp: tuple[Path, dict[str, str]], args: list[str], says: str
) -> None:
    """The Celery scenario asked for with a pairing's options is refused before any server
    or worker starts: exit status 2."""
    tmp, env = private_tmp
    done = run("chaos", *args, env=env)
    assert done.returncode == 2
    assert says in done.stderr
    assert list(tmp.iterdir()) == []


def test_a_soak_shorter_than_a_round_still_runs_every_pairing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The first round runs whole whatever the time: a soak whose minutes are up before its
    second pairing starts (a slow machine) still gives that pairing its shortest slice,
    and stops after the round. The slices stand in for real ones (the servers, the workers
    and the faults are ``tests/test_chaos.py``'s): each takes the soak's whole time."""
    from fence._chaos import runner

    ran: list[tuple[str, float]] = []

    def slice_(pairing, servers, settings, workdir, round_):  # type: ignore[no-untyped-def]
        ran.append((pairing.name, settings.duration))
        time.sleep(0.2)  # past the soak's minutes
        counts = dict.fromkeys(
            ("pauses_injected", "pauses_between_read_and_write", "acquired", "accepted",
             "rejected", "reads_accepted", "reads_rejected", "unknown_outcomes",
             "lost_updates", "stale_accepted", "stale_reads", "tokens_issued_twice",
             "faults_injected"),
            1,
        )  # fmt: skip
        summary = {
            **counts,
            "server_kills": {"redis": 1},
            "faults": [],
            "orphan_locks": [],
            "worker_failures": [],
            "workers_killed": [],
            "fault_errors": [],
            "elapsed_s": 0.2,
            "ok": True,
        }
        return summary, []

    monkeypatch.setattr(runner, "run_pairing", slice_)
    monkeypatch.setattr(runner, "_servers_for", lambda chosen: contextlib.nullcontext({}))
    settings = runner.Settings(pairings=("redis+redis", "sql+plain-sql"), duration=60.0)
    report = runner.soak(settings, 0.2 / 60, tmp_path)
    assert [name for name, _ in ran] == ["redis+redis", "sql+plain-sql"]
    assert ran[1][1] == runner._SHORTEST_SLICE  # the time was up: the shortest slice
    assert report["rounds"] == 1
    assert report["totals"]["slices"] == 2
    assert report["elapsed_s"] > report["soak_minutes"] * 60
