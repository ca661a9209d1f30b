"""The Django app ``fence.adapters.django``: add it to ``INSTALLED_APPS``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from django.apps import AppConfig
from django.db.backends.base.creation import BaseDatabaseCreation
from django.db.backends.base.operations import BaseDatabaseOperations
from django.db.backends.signals import connection_created

from ._state import connection_created as _on_connection

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
        for cls, name in _WHOLE_DATABASE:
            method = getattr(cls, name)
            if not getattr(method, "_iofence", False):
                setattr(cls, name, _unfenced(method))


#: What Django does to a whole database at once, run under the opt-out: the flush
#: (``manage.py flush``, the teardown of every ``TransactionTestCase`` and pytest-django
#: ``transaction=True`` test) wipes every table of the project, fenced ones and the fence
#: register included; a serialized rollback (``serialized_rollback=True``) loads back the
#: rows the test database was made with, their fences as they were. The judge refuses
#: both to a writer without a token (C14); each is an explicit act on the whole database,
#: not the work of a holder.
_WHOLE_DATABASE = (
    (BaseDatabaseOperations, "execute_sql_flush"),
    (BaseDatabaseCreation, "deserialize_db_from_string"),
)


def _unfenced(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` of a connection's operations or creation, run inside ``unfenced()`` on
    that connection: its statements only, the block ends with them."""

    @functools.wraps(method)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        from .blocks import unfenced

        with unfenced(using=self.connection.alias):
            return method(self, *args, **kwargs)

    wrapper._iofence = True  # type: ignore[attr-defined]
    return wrapper
