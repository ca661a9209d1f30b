"""The example Django project (``examples/django_project``) runs its own tests with
pytest-django, as a project would: on SQLite and on the suite's PostgreSQL, in a process
of its own (pytest-django configures Django from the project's settings at start-up; this
suite's process configures Django for ``tests/test_django.py`` in code, and runs with
pytest-django turned off, ``-p no:django``).

Its tests run the bank's writes under leases inside pytest-django's two kinds of test: in a
transaction rolled back at the test's end (the blocks are savepoints), and committed for
real (``transaction=True``), after which pytest-django flushes every table, fenced ones
included.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

PROJECT = Path(__file__).resolve().parent.parent / "examples" / "django_project"
TESTS = 4  # the project's tests; all of them must pass, none skipped


@pytest.mark.parametrize("database", ["sqlite", "postgres"])
def test_the_example_project_passes_its_pytest_django_tests(
    database: str, request: pytest.FixtureRequest
) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "PYTEST_ADDOPTS")}
    if database == "postgres":
        env["DATABASE_URL"] = request.getfixturevalue("postgres_url")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:asyncio"]
    command += [
        "-c",
        str(PROJECT / "pytest.ini"),
        "--rootdir",
        str(PROJECT),
        str(PROJECT / "tests"),
    ]
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        cwd=PROJECT,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    summary = out.strip().splitlines()[-1]
    assert re.fullmatch(rf"{TESTS} passed in [0-9.]+s( \([0-9:]+\))?", summary), out
    assert not list(PROJECT.glob("*.sqlite3")), "the tests ran on pytest-django's test database"
