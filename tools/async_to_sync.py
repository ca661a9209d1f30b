#!/usr/bin/env python3
"""Generate the sync twins of the asyncio sources.

Every ``_async/`` folder under ``fence/``, ``adapters/`` and ``tests/`` is the source of the
sibling ``_sync/`` folder. The generated files carry a "do not edit" header, are formatted
with ruff, and are committed.

    python tools/async_to_sync.py           # write the _sync files
    python tools/async_to_sync.py --check   # exit 1 if any _sync file is not current

A line of source ending in ``# unasync: remove`` is dropped from the sync output; one ending
in ``# unasync: <code>`` is replaced by ``<code>`` at the same indentation. A substitution in
the table below that no file uses is an error: the table must say only what is needed.
"""

from __future__ import annotations

import argparse
import difflib
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCE_ROOTS = ("fence", "adapters", "tests")

HEADER = (
    "# WARNING: this file is generated from {source} by tools/async_to_sync.py.\n"
    "# Do not edit it; edit the source and run `python tools/async_to_sync.py`.\n"
)

# (pattern, replacement); applied in order to every line of code.
SUBSTITUTIONS: list[tuple[str, str]] = [
    (r"\basync def\b", "def"),
    (r"\basync with\b", "with"),
    (r"\bawait ", ""),
    (r"\b__aenter__\b", "__enter__"),
    (r"\b__aexit__\b", "__exit__"),
    (r"\basynccontextmanager\b", "contextmanager"),
    (r"\bAsync(?=[A-Z])", ""),
    (r"\b_acompat\b", "_compat"),
    (r"\b_async\b", "_sync"),
]

_DIRECTIVE = re.compile(r"^(?P<indent>\s*)(?P<code>.*?)\s*# unasync: (?P<what>.+?)\s*$")


def convert(text: str, used: set[int]) -> str:
    """Return the sync version of one async source file."""
    out: list[str] = []
    for line in text.splitlines(keepends=True):
        match = _DIRECTIVE.match(line)
        if match:
            what = match["what"]
            if what == "remove":
                continue
            line = f"{match['indent']}{what}\n"
            out.append(line)
            continue
        for index, (pattern, replacement) in enumerate(SUBSTITUTIONS):
            new = re.sub(pattern, replacement, line)
            if new != line:
                used.add(index)
                line = new
        out.append(line)
    return "".join(out)


def ruff(args: list[str], text: str, filename: Path) -> str:
    """Run ruff on ``text`` through stdin, as if it were ``filename``."""
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", *args, "--stdin-filename", str(filename), "-"],
        input=text,
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    if proc.returncode not in (0, 1) or not proc.stdout:
        raise SystemExit(f"ruff {' '.join(args)} failed on {filename}:\n{proc.stderr}")
    return proc.stdout


def generate(source: Path, target: Path, used: set[int]) -> str:
    """The full text of ``target`` generated from ``source``."""
    body = convert(source.read_text(), used)
    body = ruff(["check", "--fix", "--select", "I,F401", "--quiet", "--exit-zero"], body, target)
    body = ruff(["format", "--quiet"], body, target)
    header = HEADER.format(source=source.relative_to(ROOT).as_posix())
    return header + body


def pairs() -> list[tuple[Path, Path]]:
    """Every (async source, sync target) pair in the project."""
    found = []
    for root in SOURCE_ROOTS:
        for async_dir in sorted((ROOT / root).rglob("_async")):
            if not async_dir.is_dir():
                continue
            sync_dir = async_dir.with_name("_sync")
            for source in sorted(async_dir.rglob("*.py")):
                found.append((source, sync_dir / source.relative_to(async_dir)))
    return found


def main() -> int:
    """Write or check every generated file; return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only report files not current")
    args = parser.parse_args()

    used: set[int] = set()
    stale: list[str] = []
    expected: set[Path] = set()
    for source, target in pairs():
        expected.add(target)
        text = generate(source, target, used)
        current = target.read_text() if target.exists() else ""
        if current == text:
            continue
        rel = target.relative_to(ROOT).as_posix()
        if args.check:
            stale.append(rel)
            diff = difflib.unified_diff(
                current.splitlines(keepends=True), text.splitlines(keepends=True), rel, rel
            )
            sys.stdout.writelines(list(diff)[:60])
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)
            print(f"wrote {rel}")

    for root in SOURCE_ROOTS:
        for sync_dir in (ROOT / root).rglob("_sync"):
            for orphan in sorted(set(sync_dir.rglob("*.py")) - expected):
                rel = orphan.relative_to(ROOT).as_posix()
                if args.check:
                    stale.append(rel)
                    print(f"{rel} has no source in an _async folder")
                else:
                    orphan.unlink()
                    print(f"removed {rel}")

    unused = [SUBSTITUTIONS[i][0] for i in range(len(SUBSTITUTIONS)) if i not in used]
    if unused:
        print(f"substitutions no file uses (remove them): {unused}", file=sys.stderr)
        return 1
    if stale:
        print(f"\n{len(stale)} generated file(s) are not current: run tools/async_to_sync.py")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
