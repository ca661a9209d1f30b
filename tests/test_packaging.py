"""Packaging: ``adapters/`` ships as ``fence.adapters`` and never as a top-level package."""

from __future__ import annotations

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

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
    for extra in ("redis", "sql", "postgres", "all"):
        assert f"Provides-Extra: {extra}" in text


def test_version_is_exposed() -> None:
    assert fence.__version__ == "0.1.0"
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


def test_classifiers_name_only_the_python_the_suite_runs_on() -> None:
    """The suite runs on one CPython (the README's tested versions): the classifiers
    claim no other."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    prefix = "Programming Language :: Python :: "
    named = {c.removeprefix(prefix) for c in project["classifiers"] if c.startswith(prefix)}
    assert {v for v in named if "." in v} == {f"3.{sys.version_info.minor}"}
