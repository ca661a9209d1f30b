"""The model checkers' quick ``replace`` (``tests/frozen.py``) answers as the standard one."""

from __future__ import annotations

import dataclasses

import pytest

from tests.frozen import replace


@dataclasses.dataclass(frozen=True)
class Point:
    x: int
    y: int = 0
    tags: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Checked:
    x: int

    def __post_init__(self) -> None:
        if self.x < 0:
            raise ValueError("negative")


def test_replace_matches_the_standard_one() -> None:
    point = Point(1, 2, ("a",))
    for changes in ({}, {"x": 5}, {"y": 7, "tags": ()}):
        mine = replace(point, **changes)
        assert mine == dataclasses.replace(point, **changes)
        assert hash(mine) == hash(dataclasses.replace(point, **changes))
    assert point == Point(1, 2, ("a",))  # the original is untouched
    with pytest.raises(dataclasses.FrozenInstanceError):
        replace(point, x=3).x = 4  # type: ignore[misc]


def test_replace_refuses_what_it_cannot_copy_faithfully() -> None:
    with pytest.raises(TypeError, match="no field"):
        replace(Point(1), z=3)
    with pytest.raises(TypeError, match=r"dataclasses\.replace"):
        replace(Checked(1), x=-1)  # __post_init__ would not run
