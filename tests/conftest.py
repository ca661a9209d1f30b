"""Fixtures shared by the whole suite. The real servers are in ``tests/fix_servers.py``."""

from __future__ import annotations

import pytest

from tests.registry import GUARD_HARNESSES, MANAGER_BACKENDS, load_all

pytest_plugins = [
    "tests.fix_servers",
    "tests.fix_quorum",
    "tests.fix_consensus",
    "fence.testing.guards",
]

load_all()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Run conformance tests once per registered manager backend or guard."""
    if "manager_backend" in metafunc.fixturenames:
        metafunc.parametrize(
            "manager_backend",
            [pytest.param(b, id=b.name, marks=b.marks) for b in MANAGER_BACKENDS.values()],
        )
    for name, shared in (("shared_backend", True), ("unshared_backend", False)):
        if name in metafunc.fixturenames:
            metafunc.parametrize(
                name,
                [
                    pytest.param(b, id=b.name, marks=b.marks)
                    for b in MANAGER_BACKENDS.values()
                    if b.shared is shared
                ],
            )
    if "guard_harness_factory" in metafunc.fixturenames:
        metafunc.parametrize(
            "guard_harness_factory",
            [pytest.param(g, id=g.name, marks=g.marks) for g in GUARD_HARNESSES.values()],
        )
