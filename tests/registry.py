"""Registries that the conformance suites run over.

Each backend or guard registers itself in a module named ``tests/backend_<name>.py``
(lock managers) or ``tests/guard_<name>.py`` (storage guards); :func:`load_all` imports them
all, so adding an implementation never edits a shared file.

A conformance test asks for the ``manager_backend`` or ``guard_harness_factory`` fixture and
is run once per registered implementation (see ``tests/conftest.py``).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

# -- lock managers ---------------------------------------------------------------------


@dataclass(frozen=True)
class ManagerBackend:
    """How the manager conformance suite builds managers of one backend.

    Attributes:
        name: the test id, e.g. ``"memory"``, ``"redis"``, ``"postgres"``.
        setup: called once per test with the pytest request; returns a context shared by
            every manager the test builds (a URL, a shared in-memory backend, ...). Use
            ``request.getfixturevalue("redis_url")`` and ``request.addfinalizer`` here.
        make: ``make(context, is_async, **options)`` returns a new manager; ``is_async``
            picks the asyncio class. ``options`` are manager keyword arguments (``ttl``,
            ``renew``, ``events``...). Managers built for one test share one lock space.
        marks: pytest marks for the backend (e.g. ``pytest.mark.redis``).
        expiry_slack: seconds the backend may take beyond a ttl to treat a lease as expired
            (SQL backends that check expiry at statement time need none, a polling one some).
        shared: whether the managers grant read leases (C13). The shared-lock suite runs
            on those; on the others it checks that ``mode="read"`` is refused.
    """

    name: str
    setup: Callable[[pytest.FixtureRequest], Any]
    make: Callable[..., Any]
    marks: tuple[pytest.MarkDecorator, ...] = ()
    expiry_slack: float = 0.0
    shared: bool = True


MANAGER_BACKENDS: dict[str, ManagerBackend] = {}


def register_manager_backend(backend: ManagerBackend) -> ManagerBackend:
    """Add a backend to the manager conformance suite."""
    MANAGER_BACKENDS[backend.name] = backend
    return backend


# -- storage guards ---------------------------------------------------------------------


@dataclass(frozen=True)
class GuardHarnessFactory:
    """How the guard conformance suite builds one guard under test.

    Attributes:
        name: the test id, e.g. ``"redis"``, ``"sql-sqlite"``, ``"psycopg"``.
        make: ``make(request, is_async)`` returns a harness (see ``fence.testing.guards``);
            use ``request.getfixturevalue`` for servers and ``request.addfinalizer``.
        marks: pytest marks for the guard.
        features: optional capabilities the harness has (e.g. ``"batch"``).
    """

    name: str
    make: Callable[..., Any]
    marks: tuple[pytest.MarkDecorator, ...] = ()
    features: frozenset[str] = field(default_factory=frozenset)


GUARD_HARNESSES: dict[str, GuardHarnessFactory] = {}


def register_guard_harness(factory: GuardHarnessFactory) -> GuardHarnessFactory:
    """Add a guard to the guard conformance suite."""
    GUARD_HARNESSES[factory.name] = factory
    return factory


def load_all() -> None:
    """Import every ``tests/backend_*.py`` and ``tests/guard_*.py`` module."""
    here = Path(__file__).parent
    for info in pkgutil.iter_modules([str(here)]):
        if info.name.startswith(("backend_", "guard_")):
            importlib.import_module(f"tests.{info.name}")
