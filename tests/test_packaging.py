"""Packaging: ``adapters/`` ships as ``fence.adapters`` and never as a top-level package; the
wheel carries the license, the sdist the whole project; the README reads right on a package
index page. ``scripts/test-package`` installs the wheel and runs the examples with it."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path
from typing import Any

import fence
import fence.adapters

ROOT = Path(__file__).resolve().parent.parent


def test_adapters_is_a_subpackage_of_fence() -> None:
    assert fence.adapters.__name__ == "fence.adapters"
    assert Path(fence.adapters.__file__ or "").resolve().parent == ROOT / "adapters"


def test_wheel_layout(tmp_path: Path) -> None:
    subprocess.run(
        [
            sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
            "--quiet", "--wheel-dir", str(tmp_path), str(ROOT),
        ],
        check=True,
        cwd=tmp_path,
    )  # fmt: skip
    (wheel,) = tmp_path.glob("iofence-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/")[0] for name in names}
    assert "adapters" not in tops
    assert "tests" not in tops
    assert "fence/adapters/__init__.py" in names
    assert "fence/py.typed" in names
    assert "fence/_sync/manager.py" in names
    assert "fence/_async/manager.py" in names
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    text = zipfile.ZipFile(wheel).read(metadata).decode()
    assert "Name: iofence" in text
    assert "Requires-Python: >=3.11" in text
    assert "License-Expression: MIT" in text
    assert "License-File: LICENSE" in text
    license_file = next(n for n in names if n.endswith(".dist-info/licenses/LICENSE"))
    assert zipfile.ZipFile(wheel).read(license_file) == (ROOT / "LICENSE").read_bytes()
    for extra in ("redis", "sql", "postgres", "all"):
        assert f"Provides-Extra: {extra}" in text


def test_version_is_exposed() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert fence.__version__ == project["version"] == "0.2.0"
    completed = subprocess.run(
        [sys.executable, "-m", "fence", "--version"], capture_output=True, text=True, check=True
    )
    assert fence.__version__ in completed.stdout


def test_core_import_needs_no_driver_package() -> None:
    code = (
        "import sys, fence; "
        "assert not {'redis', 'sqlalchemy', 'psycopg'} & set(sys.modules), sorted(sys.modules); "
        "fence.RedisLockManager; assert 'redis' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_dir_shows_the_public_names_and_hides_the_helpers() -> None:
    code = "import json, sys, fence; print(json.dumps([dir(fence), sorted(sys.modules)]))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    names, loaded = json.loads(done.stdout)
    assert set(fence.__all__) <= set(names)  # the lazy managers too, before their first use
    assert "fence._sync.redis" not in loaded  # listing them loaded nothing
    assert not {"Any", "TYPE_CHECKING", "annotations", "importlib"} & set(names)
    assert not [n for n in names if n.startswith("_") and not n.startswith("__")]
    assert "__version__" in names


def test_sdist_ships_the_whole_project(tmp_path: Path) -> None:
    build = "import sys; from setuptools import build_meta; build_meta.build_sdist(sys.argv[1])"
    subprocess.run(
        [sys.executable, "-c", build, str(tmp_path)], cwd=ROOT, check=True, capture_output=True
    )
    (sdist,) = tmp_path.glob("iofence-*.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert {"LICENSE", "README.md", "CHANGELOG.md", "pyproject.toml"} <= names
    # What the tests read beside themselves: tests/test_examples.py finds examples/.
    assert {f"examples/{p.name}" for p in (ROOT / "examples").glob("*.py")} <= names
    assert {f"docs/{p.name}" for p in (ROOT / "docs").iterdir()} <= names
    tests = {str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("*.py")}
    assert tests <= names
    assert {"benchmarks/run.py", "tools/async_to_sync.py", "scripts/test"} <= names
    assert not [name for name in names if "__pycache__" in name or name.endswith(".pyc")]


def test_readme_has_no_link_a_package_index_page_breaks() -> None:
    # On a package index page a relative link or picture points nowhere; there is no
    # public URL to make them absolute, so the README names the files by path instead.
    readme = (ROOT / "README.md").read_text()
    assert re.findall(r"\]\((?!https?://)[^)]*\)", readme) == []


def _check_package() -> Any:
    spec = importlib.util.spec_from_file_location("check_package", ROOT / "tools/check_package.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_release_paperwork_is_checked(tmp_path: Path) -> None:
    """The version has its CHANGELOG section; every project URL names a file that is there."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    urls = [f"{label}, {url}" for label, url in project["urls"].items()]
    problems = _check_package().metadata_problems
    assert problems(project["version"], urls, ROOT) == []
    assert problems("9.9.9", urls, ROOT) == ["CHANGELOG.md has no section '## 9.9.9'"]
    assert problems(project["version"], [], ROOT) == ["the metadata has no project URLs"]
    assert problems(project["version"], ["Docs, docs/gone.md", "Home, https://"], ROOT) == [
        "project URL 'Docs' names no file of the sdist: 'docs/gone.md'",
        "project URL 'Home' is not an address: 'https://'",
    ]
    assert problems("0.2.0", urls, tmp_path)[0] == "no CHANGELOG.md"


def test_declared_pythons_are_the_ones_the_suite_runs_on() -> None:
    """The classifiers name exactly the CPythons scripts/test runs the suite on, and the
    floor of requires-python is the oldest of them."""
    import re

    script = (ROOT / "scripts" / "pythons.sh").read_text()
    match = re.search(r"^PYTHONS=\(([^)]*)\)", script, re.MULTILINE)
    assert match is not None
    runs = match.group(1).split()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    prefix = "Programming Language :: Python :: "
    declared = [
        c[len(prefix) :]
        for c in project["classifiers"]
        if re.fullmatch(r"3\.\d+", c[len(prefix) :])
    ]
    assert sorted(declared) == sorted(runs)
    assert f"3.{sys.version_info.minor}" in runs  # this run is one of them
    oldest = min(runs, key=lambda v: tuple(map(int, v.split("."))))
    assert project["requires-python"] == f">={oldest}"
