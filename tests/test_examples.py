"""Every script in ``examples/`` runs and exits 0.

Examples that need a server read ``REDIS_URL``, ``DATABASE_URL`` or ``MARIADB_URL``; this
test points them at the suite's throwaway servers when the script mentions the variable.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).resolve().parent.parent / "examples").glob("*.py"))


@pytest.mark.parametrize("script", EXAMPLES, ids=lambda p: p.name)
def test_example_runs(script: Path, request: pytest.FixtureRequest) -> None:
    env = dict(os.environ)
    text = script.read_text()
    if "REDIS_URL" in text:
        env["REDIS_URL"] = request.getfixturevalue("redis_url")
    if "DATABASE_URL" in text:
        env["DATABASE_URL"] = request.getfixturevalue("postgres_url")
    if "MARIADB_URL" in text:
        env["MARIADB_URL"] = request.getfixturevalue("mariadb_url")
    completed = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert completed.stdout.strip(), "an example shows what it does"


def test_redis_acl_runs_again_on_the_same_database(redis_url: str) -> None:
    """Its token comes from a lease: after the Redis keys example, and a second time."""
    env = {**os.environ, "REDIS_URL": redis_url}
    root = EXAMPLES[0].parent
    tokens = []
    for script in ("redis_keys.py", "redis_acl.py", "redis_acl.py"):
        completed = subprocess.run(
            [sys.executable, str(root / script)],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert completed.returncode == 0, completed.stdout + completed.stderr
        if script == "redis_acl.py":
            found = re.search(r"guard user, token (\d+):", completed.stdout)
            assert found is not None, completed.stdout
            tokens.append(int(found.group(1)))
    assert tokens[0] < tokens[1]
