"""The lock decorator's decisions, without I/O: which functions it takes, where the lease
goes, and how a call's arguments name the resource.

``manager.locked(template)`` (``fence/_async/manager.py``, the sync twin generated) is a
thin wrapper around a :class:`LockedCall`: everything about the function is read once, at
decoration time, so that a wrong template or a function of the wrong kind fails where it
is written, not on its first call.
"""

from __future__ import annotations

import inspect
import string
from collections.abc import Callable
from typing import Any

from fence._errors import ConfigurationError

__all__ = ["LockedCall"]

#: The parameter through which a decorated function asks for its lease.
LEASE = "lease"

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _name(fn: Callable[..., object]) -> str:
    return str(getattr(fn, "__qualname__", None) or fn)


def _is_coroutine_function(fn: Callable[..., object]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - an object whose __call__ is async
    )


def check_kind(fn: Callable[..., object], manager: str, *, is_async: bool) -> None:
    """Refuse a function that the lock would not hold for the length of its run.

    A sync manager cannot hold a lock across a coroutine it only creates; an async manager
    has nothing to await in a plain function; a generator's body runs after the call that
    created it has returned, so the lock would be released before it starts.

    Raises:
        ConfigurationError: ``fn`` is not a function of the manager's kind.
    """
    if not callable(fn):
        raise ConfigurationError(f"{manager}.locked decorates a function, got {fn!r}")
    if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
        raise ConfigurationError(
            f"{manager}.locked cannot hold a lock for {_name(fn)!r}, a generator function: "
            "its body runs after the call returns, when the lock is released already"
        )
    if _is_coroutine_function(fn) != is_async:
        if is_async:
            hint = "a plain function; use the sync manager, or make it 'async def'"
        else:
            hint = "a coroutine function; use the asyncio manager, or a plain 'def'"
        raise ConfigurationError(f"{manager}.locked cannot decorate {_name(fn)!r}, {hint}")


def template_fields(template: str) -> set[str]:
    """The argument names a ``str.format`` template reads (``"{order.id}"`` reads ``order``).

    Raises:
        ConfigurationError: the template is not a ``str``, does not parse, or has a
            positional field (``{}``, ``{0}``): fields name parameters.
    """
    if not isinstance(template, str):
        raise ConfigurationError(f"the resource template must be a str, got {template!r}")
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise ConfigurationError(f"resource template {template!r} does not parse: {exc}") from exc
    names: set[str] = set()
    for _, field, _, _ in parsed:
        if field is None:
            continue
        root = field.partition(".")[0].partition("[")[0]
        if not root or root.isdigit():
            raise ConfigurationError(
                f"resource template {template!r} has a positional field {{{field}}}; "
                "name the parameter instead, e.g. 'order:{order_id}'"
            )
        names.add(root)
    return names


class LockedCall:
    """One decorated function, read once: its resource template and where its lease goes.

    Args:
        fn: the decorated function.
        template: the resource, a ``str.format`` template over the function's parameters.
        manager: the manager's class name, for messages.
        is_async: whether the manager is the asyncio one.

    Attributes:
        leading: the function takes the lease as its first parameter (passed by position);
            ``False`` with a keyword-only ``lease``.
        wants_lease: the function has a parameter named ``lease``.
        signature: the caller's view: the function's signature without ``lease``.

    Raises:
        ConfigurationError: ``fn`` is not of the manager's kind (see :func:`check_kind`);
            the template does not parse, or names a parameter ``fn`` does not take (or
            ``lease``, which the caller does not pass); ``lease`` is neither the first
            parameter nor keyword-only.
    """

    __slots__ = ("fields", "leading", "name", "signature", "template", "wants_lease")

    def __init__(
        self, fn: Callable[..., object], template: str, manager: str, *, is_async: bool
    ) -> None:
        check_kind(fn, manager, is_async=is_async)
        fields = template_fields(template)
        signature = inspect.signature(fn)
        parameters = list(signature.parameters.values())
        lease = signature.parameters.get(LEASE)
        self.wants_lease = lease is not None
        self.leading = False
        if lease is not None:
            if lease.kind in _POSITIONAL and parameters[0] is lease:
                self.leading = True
            elif lease.kind is not inspect.Parameter.KEYWORD_ONLY:
                raise ConfigurationError(
                    f"{_name(fn)!r} takes 'lease' where the lock cannot pass it: make it the "
                    "first parameter, or keyword-only (after '*')"
                )
            parameters.remove(lease)
        self.signature = signature.replace(parameters=parameters)
        unknown = fields - set(self.signature.parameters)
        if unknown:
            raise ConfigurationError(
                f"resource template {template!r} names {sorted(unknown)}, which "
                f"{_name(fn)!r} does not take"
                + (" (the lease is not an argument of the call)" if LEASE in unknown else "")
            )
        self.template = template
        self.fields = fields
        self.name = _name(fn)

    def resource(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        """The resource one call locks: the template filled from its arguments.

        Raises:
            TypeError: the arguments do not fit the function's signature (a ``lease``
                passed by the caller included).
        """
        if self.wants_lease and LEASE in kwargs:
            # Checked here too: a function with ``**kwargs`` would bind it there.
            raise TypeError(f"{self.name}() gets its lease from the lock; do not pass 'lease'")
        bound = self.signature.bind(*args, **kwargs)
        if not self.fields:
            return self.template
        bound.apply_defaults()
        return self.template.format(**bound.arguments)
