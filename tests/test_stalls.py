"""The stall meter the deadline tests rely on sees a process that was kept from running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

CHILD = """
import sys
from tests.stalls import StallMeter
with StallMeter() as stalled:
    print("ready", flush=True)
    sys.stdin.readline()
print(stalled.seconds, flush=True)
"""


def test_a_stopped_process_reports_the_time_it_was_stopped() -> None:
    """Stopped with SIGSTOP for a second: the meter counts (nearly) all of it."""
    root = Path(__file__).resolve().parent.parent
    with subprocess.Popen(
        [sys.executable, "-c", CHILD],
        cwd=root,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    ) as child:
        assert child.stdin is not None
        assert child.stdout is not None
        try:
            assert child.stdout.readline().strip() == "ready"
            os.kill(child.pid, signal.SIGSTOP)
            time.sleep(1.0)
            os.kill(child.pid, signal.SIGCONT)
            child.stdin.write("\n")
            child.stdin.flush()
            stalled = float(child.stdout.readline())
        finally:
            child.kill()
    assert stalled >= 0.9
