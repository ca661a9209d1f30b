#!/usr/bin/env python3
"""Run the examples and the README's quick starts with an installed iofence, as a user would.

    python tools/check_package.py --python VENV/bin/python --sdist dist/iofence-X.tar.gz

``VENV`` is a virtualenv outside the checkout with the wheel installed. The sdist is
unpacked into a temporary folder; every script of its ``examples/`` and every program of its
README (the chains of ``tests/test_docs.py``: a block, or the blocks it continues) runs with
``VENV``'s python, each in an empty folder of its own, with the test suite's throwaway
servers handed in through ``REDIS_URL``, ``DATABASE_URL`` and ``MARIADB_URL`` (a server
started only if a program reads it) when the text reads them, as
``tests/test_examples.py`` and ``tests/test_docs.py`` do. Nothing of the checkout is on the
path: the programs import the installed package, and the check says where it came from.

Before that, the release's paperwork: the installed metadata's version has its section in
the sdist's ``CHANGELOG.md``, and every project URL of the metadata is there (a path names a
file of the sdist; a web address is well formed, not fetched).

Exit status 0 when the paperwork is in order and every program ran and exited 0; 1
otherwise, with the failures' output.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from urllib.parse import urlparse

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.servers import MariaDBServer, PostgresServer, RedisServer  # noqa: E402 - after the path is set
from tests.test_docs import programs  # noqa: E402


def _unpack(sdist: Path, into: Path) -> Path:
    with tarfile.open(sdist) as archive:
        archive.extractall(into, filter="data")
    (top,) = into.iterdir()
    return top


def metadata_problems(version: str, urls: list[str], source: Path) -> list[str]:
    """What is wrong with a release's version and project URLs; empty when nothing is.

    Args:
        version: the package's version, as its metadata says.
        urls: the metadata's ``Project-URL`` values, ``"label, url"``.
        source: the unpacked sdist (or the checkout).
    """
    problems = []
    changelog = source / "CHANGELOG.md"
    if not changelog.is_file():
        problems.append("no CHANGELOG.md")
    elif not re.search(rf"^## {re.escape(version)}\b", changelog.read_text(), re.MULTILINE):
        problems.append(f"CHANGELOG.md has no section '## {version}'")
    if not urls:
        problems.append("the metadata has no project URLs")
    for entry in urls:
        label, _, url = entry.partition(",")
        url = url.strip()
        parts = urlparse(url)
        if parts.scheme in ("http", "https"):
            if not parts.netloc:
                problems.append(f"project URL {label!r} is not an address: {url!r}")
        elif parts.scheme or not (source / url).is_file():
            problems.append(f"project URL {label!r} names no file of the sdist: {url!r}")
    return problems


def _environment() -> dict[str, str]:
    # The checkout must not leak in: no PYTHONPATH, no virtualenv of the checkout.
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    return env


def main() -> int:
    """Run every example and README program; report; return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", required=True, type=Path, help="the venv's python")
    parser.add_argument("--sdist", required=True, type=Path, help="the source distribution")
    args = parser.parse_args()
    python = str(args.python.absolute())  # not resolved: a venv python is a symlink
    with tempfile.TemporaryDirectory(prefix="iofence-package-run-") as tmp:
        work = Path(tmp)
        source = _unpack(args.sdist, work / "sdist")
        env = _environment()
        where = subprocess.run(
            [python, "-c", "import fence, fence.adapters; print(fence.__file__)"],
            capture_output=True, text=True, cwd=work, env=env, check=True,
        ).stdout.strip()  # fmt: skip
        if "site-packages" not in where or str(ROOT) in where:
            print(f"check_package: fence comes from {where}, not from the installed wheel")
            return 1
        meta = (
            "import importlib.metadata as m, json; d = m.metadata('iofence'); "
            "print(json.dumps([d['Version'], d.get_all('Project-URL') or []]))"
        )
        version, urls = json.loads(
            subprocess.run(
                [python, "-c", meta], capture_output=True, text=True, cwd=work, env=env, check=True
            ).stdout
        )
        problems = metadata_problems(version, urls, source)
        for problem in problems:
            print(f"check_package: {problem}")
        if problems:
            return 1
        print(f"  ok          iofence {version}: CHANGELOG section, {len(urls)} project URLs")
        command = Path(python).parent / "fence"
        subprocess.run(
            [str(command), "ddl", "--dialect", "sqlite"],
            cwd=work, env=env, check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip

        jobs: list[tuple[str, str]] = [
            (f"examples/{path.name}", path.read_text())
            for path in sorted((source / "examples").glob("*.py"))
        ]
        jobs += [(f"README.md:{p.line}", p.text) for p in programs(source / "README.md")]
        redis_server = RedisServer().start()
        postgres = PostgresServer().start()
        mariadb: MariaDBServer | None = None
        failures = []
        try:
            for i, (name, text) in enumerate(jobs):
                folder = work / f"run-{i}"
                folder.mkdir()
                script = folder / "program.py"
                script.write_text(text)
                run_env = dict(env)
                if "REDIS_URL" in text:
                    import redis

                    with redis.Redis.from_url(redis_server.url) as client:
                        client.flushall()
                    run_env["REDIS_URL"] = redis_server.url
                if "DATABASE_URL" in text:
                    run_env["DATABASE_URL"] = postgres.url
                if "MARIADB_URL" in text:
                    if mariadb is None:
                        mariadb = MariaDBServer().start()
                    run_env["MARIADB_URL"] = mariadb.url()
                started = time.monotonic()
                done = subprocess.run(
                    [python, str(script)],
                    capture_output=True, text=True, cwd=folder, env=run_env, timeout=120,
                )  # fmt: skip
                took = time.monotonic() - started
                status = "ok" if done.returncode == 0 else f"FAILED ({done.returncode})"
                print(f"  {status:<11} {name} ({took:.1f} s)", flush=True)
                if done.returncode != 0:
                    failures.append(f"{name}:\n{done.stdout}{done.stderr}")
        finally:
            redis_server.stop()
            postgres.destroy()
            if mariadb is not None:
                mariadb.destroy()
    for failure in failures:
        print(failure)
    print(f"{len(jobs) - len(failures)} passed, {len(failures)} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
