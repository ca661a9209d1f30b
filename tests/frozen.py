"""A quicker :func:`dataclasses.replace` for the model checkers' frozen states.

The exhaustive searches (``tests/quorum_model.py``, ``tests/test_redis_shared_model.py``)
build millions of states with ``replace``; the standard one re-runs ``__init__`` and spent
half of a search's time. This one copies the instance's fields and sets the changed ones:
it refuses a name that is not a field, as ``dataclasses.replace`` does, and suits only
plain frozen dataclasses (no ``__post_init__``, no ``init=False`` fields, no slots), which
:func:`replace` checks once per class.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")

_FIELDS: dict[type, frozenset[str]] = {}


def _fields(cls: type) -> frozenset[str]:
    names = _FIELDS.get(cls)
    if names is None:
        fields = dataclasses.fields(cls)
        if (
            hasattr(cls, "__post_init__")
            or hasattr(cls, "__slots__")
            or any(not f.init for f in fields)
        ):
            raise TypeError(f"{cls.__name__}: use dataclasses.replace")
        names = _FIELDS[cls] = frozenset(f.name for f in fields)
    return names


def replace(obj: T, /, **changes: Any) -> T:
    """``dataclasses.replace(obj, **changes)`` without re-running ``__init__``."""
    cls = type(obj)
    if not changes.keys() <= _fields(cls):
        raise TypeError(f"{cls.__name__} has no field(s) {sorted(changes.keys() - _fields(cls))}")
    new = object.__new__(cls)
    state = new.__dict__
    state.update(obj.__dict__)
    state.update(changes)
    return new
