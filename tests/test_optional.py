"""The core reaches the storage guards only through ``fence._optional``: lazily, with a
message naming the extra when a driver is missing, and typed by the guards' own classes
once ``fence.adapters`` sits inside ``fence`` as installed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.test_docs import _mypy_ini, _shadow_package


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)


def test_help_loads_no_guard_and_no_driver() -> None:
    done = _python(
        "import contextlib, sys\n"
        "from fence.cli import main\n"
        "with contextlib.suppress(SystemExit):\n"
        "    main(['--help'])\n"
        "loaded = [m for m in sys.modules if m.split('.')[0] in {'redis', 'sqlalchemy', "
        "'psycopg'} or m.startswith('fence.adapters')]\n"
        "assert not loaded, loaded\n"
    )
    assert done.returncode == 0, done.stderr


def test_a_missing_driver_names_the_extra_that_installs_it() -> None:
    done = _python(
        "import sys\n"
        "sys.modules['sqlalchemy'] = None\n"
        "from fence._optional import fence_column\n"
        "try:\n"
        "    fence_column()\n"
        "except ModuleNotFoundError as exc:\n"
        "    assert exc.name == 'sqlalchemy', exc.name\n"
        "    print(exc)\n"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "sqlalchemy is not installed: pip install 'iofence[sql]'"


def test_the_core_and_the_guards_type_check_together(tmp_path: Path) -> None:
    """mypy run over the source tree cannot resolve ``fence.adapters``; laid out as
    installed, every use of a guard in the core is checked against the guard's own types."""
    src = _shadow_package(tmp_path / "src")
    config = tmp_path / "mypy.ini"
    config.write_text(_mypy_ini(src))
    program = tmp_path / "uses.py"
    users = ["fence._optional", "fence.cli", "fence._demo", "fence._chaos.runner"]
    program.write_text("".join(f"import {name}\n" for name in users))
    done = subprocess.run(
        [
            sys.executable, "-m", "mypy", "--config-file", str(config),
            "--cache-dir", str(tmp_path / "cache"), str(program),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
