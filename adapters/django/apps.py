"""The Django app ``fence.adapters.django``: add it to ``INSTALLED_APPS``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from django.apps import AppConfig
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
        """Hook the connections, and Django's flush."""
        connection_created.connect(_on_connection, dispatch_uid="iofence")
        flush = BaseDatabaseOperations.execute_sql_flush
        if not getattr(flush, "_iofence", False):
            BaseDatabaseOperations.execute_sql_flush = _flushed_unfenced(flush)


def _flushed_unfenced(flush: Callable[..., Any]) -> Callable[..., Any]:
    """Django's flush (``manage.py flush``, the teardown of ``TransactionTestCase`` and of
    pytest-django's ``transaction=True`` tests) under the opt-out: it is an explicit wipe
    of every table of the project, fenced ones and the fence register included, which the
    judge refuses to any writer without it (C14). Its statements only: the block ends
    with them."""

    @functools.wraps(flush)
    def execute_sql_flush(self: BaseDatabaseOperations, sql_list: list[str]) -> None:
        from .blocks import unfenced

        with unfenced(using=self.connection.alias):
            flush(self, sql_list)

    execute_sql_flush._iofence = True  # type: ignore[attr-defined]
    return execute_sql_flush
