"""``fence demo`` plays the pause story with real processes on SQLite, fenced and not."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


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


def _stopped_in_session(sid: int) -> bool:
    """Whether a process of session ``sid`` is stopped (SIGSTOP): the demo froze worker A."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] == "T":  # state, ppid, pgrp, session
            return True
    return False


def test_ctrl_c_while_a_worker_is_frozen(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "fence", "demo"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp_path)},
        start_new_session=True,
    )
    try:
        end = time.monotonic() + 60
        while not _stopped_in_session(proc.pid):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < end, "worker A was never frozen"
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C, while A is frozen and B runs
        _, err = proc.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):  # what a hang would leave behind
            os.killpg(proc.pid, signal.SIGCONT)
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert list(tmp_path.iterdir()) == []


def test_a_ctrl_c_while_workers_start_is_not_lost() -> None:
    """The parent ignores SIGINT only for its children: one that arrives meanwhile is raised
    once the workers are started, not dropped (the demo would then run to its end).

    In a process of its own with one thread, as the demo's parent is while it starts its
    workers: SIGINT is blocked in the calling thread only, and a thread that leaves it
    unblocked (this test process has several) would take the signal while it is ignored.
    """
    code = (
        "import os, signal, time\n"
        "from fence._interrupt import sigint_ignored\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal\n"
        "try:\n"
        "    with sigint_ignored():\n"
        "        os.kill(os.getpid(), signal.SIGINT)\n"
        "    time.sleep(1)  # where a pending signal would be too late\n"
        "except KeyboardInterrupt:\n"
        "    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler\n"
        "    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])\n"
        "    print('raised')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "raised"


def test_scripts_demo_installs_only_when_pyproject_changes(tmp_path: Path) -> None:
    """``scripts/demo`` in a copy of the checkout whose .venv logs what it is asked to run."""
    root = Path(__file__).resolve().parent.parent
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "demo").write_bytes((root / "scripts" / "demo").read_bytes())
    (tmp_path / "scripts" / "demo").chmod(0o755)
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n')
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    log = tmp_path / "log"
    python = bin_dir / "python"
    # The first install also puts the fence command in place, as pip would.
    python.write_text(
        f'#!/bin/sh\necho "python $*" >> {log}\n'
        f'printf "#!/bin/sh\\necho \\"fence \\$*\\" >> {log}\\n" > {bin_dir}/fence\n'
        f"chmod +x {bin_dir}/fence\n"
    )
    python.chmod(0o755)

    def demo(*args: str) -> list[str]:
        log.write_text("")
        done = subprocess.run(
            [str(tmp_path / "scripts" / "demo"), *args], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return [line.split(" ")[0] + (" install" if " install " in line else "") for line in
                log.read_text().splitlines()]  # fmt: skip

    assert demo() == ["python install", "fence"]
    assert demo("--unfenced") == ["fence"]  # nothing changed: no pip
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\nversion = "2"\n')
    assert demo() == ["python install", "fence"]
    assert demo() == ["fence"]
