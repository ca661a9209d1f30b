"""The file-system guard of ``examples/fs_guard.py`` passes the guard kit, and finishes a
batch that a crash interrupted after its journal was written."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from types import ModuleType

import pytest

from fence.testing.guards import GuardFactory

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "fs_guard.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fs_guard", EXAMPLE)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fs_guard = _load()


@pytest.fixture
def fence_guard_harness(tmp_path: Path) -> GuardFactory:
    """The guard on a fresh directory; it has no asyncio API."""
    return GuardFactory(make=lambda: fs_guard.FileHarness(tmp_path / "files"))


def test_a_batch_cut_after_its_journal_is_finished_at_open(tmp_path: Path) -> None:
    guard = fs_guard.FileGuard(tmp_path)
    guard.write("a", b"1", token=3)
    # The state a crash leaves between the journal and the renames: staged files, a journal.
    temps = {"a": guard._stage(5, b"2"), "b": guard._stage(5, b"3")}
    guard._atomic_write(fs_guard._JOURNAL, json.dumps(temps).encode())
    os.replace(tmp_path / temps["a"], tmp_path / "a")  # the first rename happened
    again = fs_guard.FileGuard(tmp_path)
    assert (again.read("a"), again.read("b")) == (b"2", b"3")
    assert (again.fence("a"), again.fence("b")) == (5, 5)
    assert not (tmp_path / fs_guard._JOURNAL).exists()
