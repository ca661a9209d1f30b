"""The lock decorator's pure part: templates, binding, and where the lease goes
(``fence/_decorate.py``); the managers' side is in the conformance suite."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from fence import ConfigurationError
from fence._decorate import LockedCall, template_fields


def test_template_fields_name_the_parameters_they_read() -> None:
    assert template_fields("order:{order_id}") == {"order_id"}
    assert template_fields("user:{user.id}:{items[0]}:{n:03d}") == {"user", "items", "n"}
    assert template_fields("jobs") == set()
    assert template_fields("{{literal}}:{a}") == {"a"}
    for bad in ("{}", "{0}", "x:{0.id}"):
        with pytest.raises(ConfigurationError, match="positional field"):
            template_fields(bad)
    with pytest.raises(ConfigurationError, match="does not parse"):
        template_fields("x:}")
    with pytest.raises(ConfigurationError, match="must be a str"):
        template_fields(b"x")  # type: ignore[arg-type]


def test_the_resource_is_filled_from_the_bound_arguments() -> None:
    def work(lease: Any, user: Any, n: int = 7, *rest: Any, **extra: Any) -> None:
        pass

    call = LockedCall(work, "u:{user.id}:{n:03d}", "M", is_async=False)
    assert call.leading
    assert call.wants_lease
    assert list(call.signature.parameters) == ["user", "n", "rest", "extra"]
    user = SimpleNamespace(id=42)
    assert call.resource((user,), {}) == "u:42:007"
    assert call.resource((), {"user": user, "n": 1}) == "u:42:001"
    with pytest.raises(TypeError):
        call.resource((user,), {"lease": None})
    with pytest.raises(TypeError):
        call.resource((), {})


def test_a_keyword_only_lease_and_no_lease() -> None:
    def keyword(order_id: int, *, lease: Any) -> None:
        pass

    def without(order_id: int) -> None:
        pass

    call = LockedCall(keyword, "o:{order_id}", "M", is_async=False)
    assert (call.leading, call.wants_lease) == (False, True)
    assert call.resource((3,), {}) == "o:3"
    call = LockedCall(without, "o", "M", is_async=False)
    assert (call.leading, call.wants_lease) == (False, False)
    assert call.resource((3,), {}) == "o"
    with pytest.raises(TypeError):
        call.resource((), {})  # refused before any lock, even with no field to fill


def test_positional_only_lease_must_come_first() -> None:
    def first(lease: Any, /, x: int) -> None:
        pass

    def second(x: int, lease: Any, /) -> None:
        pass

    assert LockedCall(first, "{x}", "M", is_async=False).leading
    with pytest.raises(ConfigurationError, match="first parameter"):
        LockedCall(second, "{x}", "M", is_async=False)


def test_an_object_with_an_async_call_is_a_coroutine_function() -> None:
    class Job:
        async def __call__(self, x: int) -> None:
            pass

    LockedCall(Job(), "{x}", "M", is_async=True)
    with pytest.raises(ConfigurationError, match="coroutine function"):
        LockedCall(Job(), "{x}", "M", is_async=False)
    with pytest.raises(ConfigurationError, match="decorates a function"):
        LockedCall(42, "{x}", "M", is_async=False)  # type: ignore[arg-type]
