"""The Django app ``fence.adapters.django``: add it to ``INSTALLED_APPS``."""

from __future__ import annotations

from django.apps import AppConfig
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
        """Hook the connections."""
        connection_created.connect(_on_connection, dispatch_uid="iofence")
