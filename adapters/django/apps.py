"""The Django app ``fence.adapters.django``: add it to ``INSTALLED_APPS``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from django.apps import AppConfig
from django.core.management.commands import flush as flush_command
from django.db.backends.base.creation import BaseDatabaseCreation
from django.db.backends.base.operations import BaseDatabaseOperations
from django.db.backends.signals import connection_created

from ._state import connection_created as _on_connection
from ._state import refused_early, state_of

__all__ = ["IofenceConfig"]


class IofenceConfig(AppConfig):  # type: ignore[misc]
    """The iofence app: when it is ready, every connection Django makes carries the
    execute wrapper (and on SQLite the judge's functions). The fenced models' tables are
    known as their classes are made (``class_prepared``)."""

    name = "fence.adapters.django"
    label = "iofence"
    verbose_name = "iofence"

    def ready(self) -> None:
        """Hook the connections, and Django's wipe and restore of a whole database."""
        connection_created.connect(_on_connection, dispatch_uid="iofence")
        if not getattr(flush_command.sql_flush, "_iofence", False):
            flush_command.sql_flush = _made_by_flush(flush_command.sql_flush)
        for cls, name, ours in _WHOLE_DATABASE:
            method = getattr(cls, name)
            if not getattr(method, "_iofence", False):
                setattr(cls, name, _unfenced_if(method, ours))


class _FlushList(list):  # type: ignore[type-arg]
    """The statements the ``flush`` command built, as it built them."""

    made: tuple[str, ...] = ()


def _made_by_flush(sql_flush: Callable[..., list[str]]) -> Callable[..., list[str]]:
    """The ``flush`` command's ``sql_flush``, whose list it hands to ``execute_sql_flush``
    is marked as its own."""

    @functools.wraps(sql_flush)
    def wrapper(*args: Any, **kwargs: Any) -> list[str]:
        found = _FlushList(sql_flush(*args, **kwargs))
        found.made = tuple(found)
        return found

    wrapper._iofence = True  # type: ignore[attr-defined]
    return wrapper


def _flush_s_own(self: Any, sql_list: Any) -> bool:
    """The list is the one the ``flush`` command built, unchanged."""
    return isinstance(sql_list, _FlushList) and tuple(sql_list) == sql_list.made


def _the_test_databases_own(self: Any, data: Any) -> bool:
    """The data is what Django serialized when it made the test database."""
    made = getattr(self.connection, "_test_serialized_contents", None)
    return made is not None and data == made


#: What Django does to a whole database at once, run under the opt-out, with the test of
#: its arguments that makes it Django's own act: the flush (``manage.py flush``, the
#: teardown of every ``TransactionTestCase`` and pytest-django ``transaction=True`` test)
#: wipes every table of the project, fenced ones and the fence register included; a
#: serialized rollback (``serialized_rollback=True``) loads back the rows the test
#: database was made with, their fences as they were. The judge refuses both to a writer
#: without a token (C14); each is an explicit act on the whole database, not the work of a
#: holder. Any other statements or data given to these methods are judged.
_WHOLE_DATABASE: tuple[tuple[type, str, Callable[[Any, Any], bool]], ...] = (
    (BaseDatabaseOperations, "execute_sql_flush", _flush_s_own),
    (BaseDatabaseCreation, "deserialize_db_from_string", _the_test_databases_own),
)


def _unfenced_if(
    method: Callable[..., Any], ours: Callable[[Any, Any], bool]
) -> Callable[..., Any]:
    """``method`` of a connection's operations or creation, run inside ``unfenced()`` on
    that connection when ``ours(self, argument)`` says Django made its argument (its
    statements only, the block ends with them); judged as any other writer otherwise."""

    @functools.wraps(method)
    def wrapper(self: Any, argument: Any) -> Any:
        from .blocks import unfenced

        if not ours(self, argument):
            if isinstance(argument, (list, tuple)):  # statements: refuse the whole list
                state = state_of(self.connection)  # before any is sent
                for statement in argument:
                    if isinstance(statement, str):
                        refused_early(state, statement)
            return method(self, argument)
        with unfenced(using=self.connection.alias):
            return method(self, argument)

    wrapper._iofence = True  # type: ignore[attr-defined]
    return wrapper
