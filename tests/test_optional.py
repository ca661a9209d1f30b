"""The core reaches the storage guards only through ``fence._optional``: lazily, and with a
message naming the extra when a driver is missing. Its uses are type-checked against the
guards' own classes by ``tests/test_docs.py`` (``GUARD_USERS``)."""

from __future__ import annotations

import subprocess
import sys


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
