"""The project's lock manager, from Django's settings.

``IOFENCE_LOCKS`` names the backend as :func:`fence.connect` reads it (``redis://...``,
``postgresql://...``, ``etcd://...``); without it the locks live in Django's own
``default`` database (PostgreSQL or SQLite), through the SQL lock manager (extra
``iofence[sql]``), which makes its lease table on first use::

    # settings.py
    IOFENCE_LOCKS = "redis://localhost:6379/0"

    # anywhere
    from fence.adapters.django import fenced
    from fence.adapters.django.locks import lock_manager

    with lock_manager().lock("account:42") as lease, fenced(lease):
        ...
"""

from __future__ import annotations

import atexit
import threading
from typing import Any
from urllib.parse import quote

from django.conf import settings
from django.db import DEFAULT_DB_ALIAS, connections

from fence._connect import connect
from fence._errors import ConfigurationError

__all__ = ["SETTING", "close_managers", "lock_manager", "lock_url"]

#: The setting that names the lock backend.
SETTING = "IOFENCE_LOCKS"

_MANAGERS: dict[str, Any] = {}
_LOCK = threading.Lock()
_AT_EXIT: list[bool] = []


def lock_url(using: str = DEFAULT_DB_ALIAS) -> str:
    """The URL of the project's lock backend: :data:`SETTING`, else Django's database
    ``using`` as a SQLAlchemy URL.

    Args:
        using: the database alias to take the locks to when the setting is absent.

    Raises:
        ConfigurationError: no setting, and the database is neither PostgreSQL, SQLite
            nor MariaDB.
    """
    url = getattr(settings, SETTING, None)
    if url:
        return str(url)
    db = connections[using].settings_dict
    vendor = connections[using].vendor
    if vendor == "sqlite":
        name = str(db["NAME"])
        if name == ":memory:" or name.startswith("file:"):
            raise ConfigurationError(
                f"{using}: an in-memory SQLite database cannot hold locks; set {SETTING}"
            )
        return f"sqlite:///{name}"
    mariadb = vendor == "mysql" and bool(connections[using].mysql_is_mariadb)
    if vendor == "postgresql" or mariadb:
        user = quote(str(db.get("USER") or ""), safe="")
        password = quote(str(db.get("PASSWORD") or ""), safe="")
        auth = f"{user}:{password}@" if password else (f"{user}@" if user else "")
        host = str(db.get("HOST") or "")
        port = f":{db['PORT']}" if db.get("PORT") else ""
        scheme = "mariadb+pymysql" if mariadb else "postgresql+psycopg"
        return f"{scheme}://{auth}{host}{port}/{quote(str(db['NAME']), safe='')}"
    raise ConfigurationError(
        f"{using}: the SQL lock manager runs on PostgreSQL, SQLite and MariaDB, not "
        f"{connections[using].display_name}; set {SETTING} to another backend (redis://, "
        "etcd://, zookeeper://)"
    )


def lock_manager(using: str = DEFAULT_DB_ALIAS, **options: Any) -> Any:
    """The project's lock manager, one per process and URL (made on first use).

    The process owns it: :func:`close_managers` closes it at exit (``atexit``), so a
    caller never closes it; a test that wants a fresh one calls :func:`close_managers`.

    On Django's database (no :data:`SETTING`) the SQL lock manager makes its lease table
    if it is missing (``create_table=True``, unless ``options`` says otherwise).

    Args:
        using: the database alias, when the setting is absent.
        options: keyword arguments of the manager, used when it is made (``ttl=``...).

    Raises:
        ConfigurationError: see :func:`lock_url`.
    """
    url = lock_url(using)
    with _LOCK:
        manager = _MANAGERS.get(url)
        if manager is None:
            if not getattr(settings, SETTING, None):
                options.setdefault("create_table", True)
            manager = connect(url, **options)
            _MANAGERS[url] = manager
            if not _AT_EXIT:
                atexit.register(close_managers)
                _AT_EXIT.append(True)
    return manager


def close_managers() -> None:
    """Close the managers :func:`lock_manager` made (their connections and pools); the
    next call of :func:`lock_manager` makes a new one. Registered with ``atexit`` when the
    first is made. A manager that fails to close does not keep the others open."""
    with _LOCK:
        managers = list(_MANAGERS.values())
        _MANAGERS.clear()
    for manager in managers:
        try:
            manager.close()
        except Exception:  # noqa: S112 - at exit, the others still close
            continue
