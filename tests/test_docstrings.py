"""Every public name has a docstring: the modules, their exports, and the public methods."""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import pytest

PUBLIC_MODULES = [
    "fence",
    "fence.abc",
    "fence.testing",
    "fence.testing.guards",
    "fence.prometheus",
    "fence.otel",
    "fence.cli",
    "fence.adapters",
    "fence.adapters.redis",
    "fence.adapters.etcd",
    "fence.adapters.zookeeper",
    "fence.adapters.sql",
    "fence.adapters.ddl",
    "fence.adapters.alembic",
    "fence.adapters.psycopg",
    "fence.adapters.orm",
    "fence.adapters.celery",
    "fence.adapters.django",
    "fence.adapters.django.fields",
    "fence.adapters.django.operations",
    "fence.adapters.django.apps",
    "fence.adapters.django.locks",
]


def _public_names(module: Any) -> list[str]:
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n in vars(module) if not n.startswith("_")]
    return list(names)


def _missing(module_name: str) -> list[str]:
    module = importlib.import_module(module_name)
    missing = [] if (module.__doc__ or "").strip() else [module_name]
    for name in _public_names(module):
        obj = getattr(module, name)
        if not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        if not (inspect.getdoc(obj) or "").strip():
            missing.append(f"{module_name}.{name}")
        if not inspect.isclass(obj) or issubclass(obj, BaseException):
            continue
        for attr, member in vars(obj).items():
            if attr.startswith("_"):
                continue
            func = member.fget if isinstance(member, property) else member
            if isinstance(func, staticmethod | classmethod):
                func = func.__func__
            if inspect.isfunction(func) and not (func.__doc__ or "").strip():
                missing.append(f"{module_name}.{name}.{attr}")
    return missing


@pytest.mark.parametrize("module_name", PUBLIC_MODULES)
def test_public_names_have_docstrings(module_name: str) -> None:
    assert _missing(module_name) == []
