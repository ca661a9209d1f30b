"""``fence demo`` plays the pause story with real processes on SQLite, fenced and not."""

from __future__ import annotations

import subprocess
import sys


def run_demo(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fence", "demo", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_fenced_demo_refuses_the_stale_write() -> None:
    done = run_demo()
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "SIGSTOP A" in out
    assert "REJECTED (STALE" in out
    assert "final: balance = 130" in out
    assert "B's deposit is kept" in out


def test_unfenced_demo_shows_the_lost_update() -> None:
    done = run_demo("--unfenced")
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "REJECTED" not in out
    assert "final: balance = 150" in out
    assert "LOST" in out
