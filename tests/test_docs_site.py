"""``tools/check_links.py``: every internal link of the built docs site resolves.

The site itself is built by ``scripts/test-docs`` (Sphinx, a minute), which runs the check
over it; here the check runs over a small site written by hand.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

from check_links import broken_links  # noqa: E402 - tools/ is not a package


def _site(root: Path) -> Path:
    (root / "api").mkdir(parents=True)
    (root / "_modules").mkdir()
    (root / "index.html").write_text(
        '<a href="api/ref.html#fence.Lease">ok</a> <a href="#top">ok</a> <p id="top"></p>'
        '<a href="https://example.org/x.html#y">elsewhere</a> <a href="mailto:a@b">mail</a>'
        '<a href="api/ref.html#gone">no anchor</a> <img src="_images/missing.svg">'
        '<a href="api/">folder</a> <a href="../outside.html">out</a>'
    )
    (root / "api" / "index.html").write_text('<a href="../index.html#top">up</a>')
    (root / "api" / "ref.html").write_text('<dt id="fence.Lease"></dt><a name="old"></a>')
    (root / "_modules" / "src.html").write_text(
        '<a href="../api/ref.html#fence.Other">[docs]</a> <a href="../api/none.html">x</a>'
    )
    return root


def test_broken_internal_links_are_named(tmp_path: Path) -> None:
    assert broken_links(_site(tmp_path / "site")) == [
        "_modules/src.html: ../api/none.html (no such file)",
        "index.html: api/ref.html#gone (no anchor 'gone')",
        "index.html: _images/missing.svg (no such file)",
        "index.html: ../outside.html (outside the site)",
    ]


def test_the_command_fails_on_a_broken_link(tmp_path: Path) -> None:
    site = _site(tmp_path / "site")
    tool = [sys.executable, str(ROOT / "tools" / "check_links.py"), str(site)]
    done = subprocess.run(tool, capture_output=True, text=True)
    assert done.returncode == 1
    assert "4 broken internal links" in done.stdout
    (site / "_modules" / "src.html").unlink()
    (site / "index.html").write_text('<a href="api/ref.html#old">ok</a> <p id="top"></p>')
    done = subprocess.run(tool, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def test_scripts_test_docs_installs_what_is_missing(tmp_path: Path) -> None:
    """``scripts/test-docs`` in a copy of the checkout whose .venv logs what it is asked."""
    for name in ("scripts/test-docs", "tools/check_links.py"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes((ROOT / name).read_bytes())
    (tmp_path / "scripts" / "test-docs").chmod(0o755)
    bin_dir = tmp_path / ".venv" / "bin"
    bin_dir.mkdir(parents=True)
    log, installed = tmp_path / "log", tmp_path / "installed"
    # The import check fails until pip has run; Sphinx writes a page; the rest is Python.
    (bin_dir / "python").write_text(
        "#!/bin/sh\n"
        f'echo "$1 $2" >> {log}\n'
        'case "$1 $2" in\n'
        f'  "-c "*) test -e {installed} ;;\n'
        f'  "-m pip") touch {installed} ;;\n'
        '  "-m sphinx") mkdir -p build/docs/html && echo "<p>" > build/docs/html/index.html ;;\n'
        f'  *) exec {sys.executable} "$@" ;;\n'
        "esac\n"
    )
    (bin_dir / "python").chmod(0o755)

    def build() -> list[str]:
        log.write_text("")
        done = subprocess.run(
            [str(tmp_path / "scripts" / "test-docs")], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stdout + done.stderr
        assert "0 broken internal links" in done.stdout
        return [line.split(" ")[1] if line.startswith("-m") else "check" for line in
                log.read_text().splitlines() if not line.startswith("-c")]  # fmt: skip

    assert build() == ["pip", "pip", "sphinx", "check"]  # pip itself, then the package
    assert build() == ["sphinx", "check"]  # nothing missing: nothing installed
