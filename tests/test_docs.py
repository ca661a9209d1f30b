"""Every Python block of the README and the docs runs as written, and passes ``mypy --strict``.

A block is a complete program, or its first line says what it continues: a block that
starts with ``# continued`` runs after the Python blocks before it in the same file, up to
the last one that does not; one that starts with ``# continued from "Heading"`` runs after
the blocks that the last block under that heading ran after, and that block. Each such
chain runs once, whole, in a fresh directory, with the suite's servers handed in through
``REDIS_URL``, ``DATABASE_URL``, ``MARIADB_URL``, ``QUORUM_URLS``, ``ETCD_URL``,
``ZOOKEEPER_URL`` and ``SENTINEL_URL`` (a Redis primary and replica behind a Sentinel) where
a block reads them.
The README's chains also run a second time in the same directory, on the same servers.
The same chains, ``examples/`` and ``tests/typecheck/`` are type-checked with ``mypy --strict``
against the package as installed (``fence.adapters`` included).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)


@dataclass(frozen=True)
class Program:
    """A chain of blocks: where it ends, and its text."""

    doc: Path
    line: int  # of the last block
    text: str

    @property
    def name(self) -> str:
        return f"{self.doc.name}:{self.line}"


_HEADING = re.compile(r"^#+\s+(.*?)\s*$", re.MULTILINE)
_FROM = re.compile(r'^# continued from "([^"]+)"')


def programs(doc: Path) -> list[Program]:
    """The chains of ``doc``: each block that no later block continues ends one.

    ``# continued`` continues the chain of the block just before; ``# continued from
    "Heading"`` continues the chain of the last block under that heading.
    """
    text = doc.read_text()
    found: list[Program] = []
    chain: list[str] = []
    by_heading: dict[str, list[str]] = {}
    headings = [(m.start(), m.group(1)) for m in _HEADING.finditer(text)]
    for match in _FENCE.finditer(text):
        code = match.group(1)
        line = text.count("\n", 0, match.start()) + 1
        under = [name for at, name in headings if at < match.start()]
        heading = under[-1] if under else ""
        named = _FROM.match(code.lstrip())
        if named is not None:
            base = by_heading.get(named.group(1))
            assert base is not None, f"{doc.name}:{line}: no block under {named.group(1)!r}"
            chain = [*base, code]
        elif code.lstrip().startswith("# continued") and chain:
            found.pop()
            chain = [*chain, code]
        else:
            chain = [code]
        by_heading[heading] = chain
        found.append(Program(doc, line, "\n".join(chain)))
    return found


PROGRAMS = [program for doc in DOCS for program in programs(doc)]


def test_continued_blocks_follow_a_block() -> None:
    for doc in DOCS:
        text = doc.read_text()
        first = _FENCE.search(text)
        if first is not None:
            assert not first.group(1).lstrip().startswith("# continued"), doc.name


def _run(program: Program, request: pytest.FixtureRequest, cwd: Path) -> None:
    """Run ``program`` in ``cwd`` with the servers it names; fail with its output."""
    env = dict(os.environ)
    if "REDIS_URL" in program.text:
        env["REDIS_URL"] = request.getfixturevalue("redis_url")
    if "DATABASE_URL" in program.text:
        env["DATABASE_URL"] = request.getfixturevalue("postgres_url")
    if "MARIADB_URL" in program.text:
        env["MARIADB_URL"] = request.getfixturevalue("mariadb_url")
    if "QUORUM_URLS" in program.text:
        env["QUORUM_URLS"] = ",".join(request.getfixturevalue("quorum_urls"))
    if "ETCD_URL" in program.text:
        env["ETCD_URL"] = request.getfixturevalue("etcd_url")
    if "ZOOKEEPER_URL" in program.text:
        env["ZOOKEEPER_URL"] = request.getfixturevalue("zookeeper_url")
    if "SENTINEL_URL" in program.text:
        env["SENTINEL_URL"] = request.getfixturevalue("sentinel_url")
    script = cwd / "block.py"
    script.write_text(program.text)
    completed = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=120,
    )
    assert completed.returncode == 0, (
        f"{program.name} failed:\n{completed.stdout}{completed.stderr}"
    )


@pytest.mark.parametrize("program", PROGRAMS, ids=lambda p: p.name)
def test_docs_block_runs_as_written(
    program: Program, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    _run(program, request, tmp_path)


README = [program for program in PROGRAMS if program.doc.name == "README.md"]


@pytest.mark.parametrize("program", README, ids=lambda p: p.name)
def test_readme_block_runs_again_in_the_same_place(
    program: Program, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """A newcomer runs a quick start twice: its files and the servers' data are still there."""
    _run(program, request, tmp_path)
    _run(program, request, tmp_path)


def _shadow_package(root: Path) -> Path:
    """A source tree where ``fence.adapters`` sits inside ``fence``, as installed."""
    pkg = root / "fence"
    pkg.mkdir(parents=True)
    for item in (ROOT / "fence").iterdir():
        (pkg / item.name).symlink_to(item)
    (pkg / "adapters").symlink_to(ROOT / "adapters")
    return root


#: The example Django project: its modules are found from its own folder, as Django does.
PROJECT = ROOT / "examples" / "django_project"


def _mypy_ini(src: Path) -> str:
    """The project's mypy settings (pyproject), pointed at the shadow package."""
    settings = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]
    lines = ["[mypy]", f"mypy_path = {src}:{PROJECT}"]
    lines += [f"{k} = {v}" for k, v in settings.items() if k not in ("files", "overrides")]
    for override in settings.get("overrides", []):
        modules = override["module"]
        lines.append(f"[mypy-{','.join(modules)}]")
        lines += [f"{k} = {v}" for k, v in override.items() if k != "module"]
    return "\n".join(lines) + "\n"


#: The core's modules that use a guard (through ``fence._optional``): mypy over the source
#: tree cannot resolve ``fence.adapters`` for them, so they are checked here, laid out as
#: installed, against the guards' own types.
GUARD_USERS = ("fence._optional", "fence.cli", "fence._demo", "fence._chaos.runner")


def test_docs_and_examples_pass_mypy_strict(tmp_path: Path) -> None:
    """The docs' blocks, the examples and the core's users of the guards, in one run."""
    src = _shadow_package(tmp_path / "src")
    users = tmp_path / "guard_users.py"
    users.write_text("".join(f"import {name}\n" for name in GUARD_USERS))
    files = [str(users)]
    for i, program in enumerate(PROGRAMS):
        stem = re.sub(r"\W", "_", program.name)
        path = tmp_path / "blocks" / f"block_{i}_{stem}.py"
        path.parent.mkdir(exist_ok=True)
        path.write_text(program.text)
        files.append(str(path))
    files += [str(p) for p in sorted((ROOT / "examples").glob("*.py"))]
    files += [str(p) for p in sorted(PROJECT.rglob("*.py"))]
    files += [str(p) for p in sorted((ROOT / "tests" / "typecheck").glob("*.py"))]
    config = tmp_path / "mypy.ini"
    config.write_text(_mypy_ini(src))
    completed = subprocess.run(
        [
            sys.executable, "-m", "mypy", "--config-file", str(config),
            "--cache-dir", str(tmp_path / "cache"), *files,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stdout + completed.stderr
