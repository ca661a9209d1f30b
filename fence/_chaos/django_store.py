"""The Django store of ``fence chaos``: counters as rows of a fenced Django model, read and
saved by the Django ORM inside ``fence.adapters.django.fenced(lease)``.

Each worker process is a Django process of its own: it configures Django in code
(``settings.configure``) against the run's PostgreSQL (or its MariaDB, through PyMySQL
standing in for ``MySQLdb``), with the iofence app and this
module as a second app (the model's label). The counters live in the SQL store's table
layout (``chaos_<namespace>``: ``id``, ``value``, plus the model's ``fence`` and
``deleted``), so that :func:`fence._chaos.sql.final_counters` reads them.

- The registering read is a block's first statement (``Model.objects.get``): the app
  claims the record in its fence register (C8) in the same query, so a stale holder is
  refused before it reads.
- The write is a second block: ``get`` (claimed again) and ``save(update_fields=...)``,
  judged by the model's triggers (C14). The read and the write are two transactions, like
  the other SQL stores', so that only the fence keeps a stale holder out.

The table, the triggers and the register are made in a process of their own (spawned):
Django is configured once per process, and the run's controller stays free of it.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing as mp
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlsplit

from fence._chaos.base import Endpoints, needs_token
from fence._chaos.sql import final_counters, sql_failed
from fence._errors import BackendError, StaleTokenError
from fence._optional import django_app

__all__ = ["DjangoStore", "final", "open_unfenced", "setup"]

#: This module's app label: the chaos model belongs to it.
_APP = "django_store"


def _pymysql_as_mysqldb() -> None:
    """PyMySQL under the name ``MySQLdb``, its modules included (``docs/django.md``):
    Django's MySQL backend imports ``MySQLdb``, ``MySQLdb.err`` and ``MySQLdb.converters``."""
    import sys

    import pymysql

    pymysql.install_as_MySQLdb()
    for name, module in list(sys.modules.items()):
        if name.startswith("pymysql."):
            sys.modules["MySQLdb" + name.removeprefix("pymysql")] = module


def _database(url: str, server: str = "postgres") -> dict[str, Any]:
    """Django's ``DATABASES["default"]`` for the run's ``postgresql+psycopg://`` URL, or
    (``server="mariadb"``) its ``mariadb+pymysql://`` URL."""
    parts = urlsplit(url)
    if server == "mariadb":
        return {
            "ENGINE": "django.db.backends.mysql",
            "HOST": parts.hostname or "127.0.0.1",
            "PORT": str(parts.port or 3306),
            "USER": unquote(parts.username or "root"),
            "PASSWORD": unquote(parts.password or ""),
            "NAME": parts.path.lstrip("/"),
            # A killed server is seen at once (the socket closes); the read timeout only
            # bounds a reply that never comes.
            "OPTIONS": {"connect_timeout": 2, "read_timeout": 30},
        }
    return {
        "ENGINE": "django.db.backends.postgresql",
        "HOST": parts.hostname or "127.0.0.1",
        "PORT": str(parts.port or 5432),
        "USER": unquote(parts.username or "postgres"),
        "PASSWORD": unquote(parts.password or ""),
        "NAME": parts.path.lstrip("/") or "postgres",
        # A killed server must fail the connect fast, not hang the worker past its pauses.
        "OPTIONS": {"connect_timeout": 2},
    }


def _configure(endpoints: Endpoints, server: str = "postgres") -> None:
    """Configure Django in this process (once) against the run's PostgreSQL (or MariaDB)."""
    import django
    from django.conf import settings

    if settings.configured:
        return
    if server == "mariadb":
        _pymysql_as_mysqldb()
    settings.configure(
        INSTALLED_APPS=["fence.adapters.django", __name__],
        DATABASES={"default": _database(endpoints.url(server), server)},
        DEFAULT_AUTO_FIELD="django.db.models.BigAutoField",
        USE_TZ=True,
    )
    django.setup()


@functools.cache
def _model(namespace: str) -> Any:
    """The fenced counter model of ``namespace`` (needs Django configured)."""
    from django.db import models

    fenced_model = django_app()[1].FencedModel

    meta = type("Meta", (), {"app_label": _APP, "db_table": f"chaos_{namespace}"})
    attrs = {
        "__module__": __name__,
        "Meta": meta,
        "id": models.CharField(max_length=64, primary_key=True),
        "value": models.BigIntegerField(),
    }
    return type(f"ChaosCounter_{namespace}", (fenced_model,), attrs)


@dataclass(frozen=True, slots=True)
class _Claim:
    """What ``fenced()`` reads of a lease: its resource (the claim's scope) and its token.
    The worker's lease is its locker's; the store sees only the token."""

    resource: str
    token: int


def _database_errors(server: str) -> tuple[type[Exception], ...]:
    """What a database failure raises in a block: Django's errors, and the driver's own.

    The app reads the catalogue (are the triggers in place?) and sets MariaDB's session
    variables on the driver's cursor, outside Django's error wrapper: a server killed at
    that moment raises ``psycopg.Error`` (``pymysql.err.Error``).
    """
    from django.db import DatabaseError

    if server == "mariadb":
        import pymysql

        return DatabaseError, pymysql.err.Error
    import psycopg

    return DatabaseError, psycopg.Error


def _reset() -> None:
    """Drop the worker's Django connection after a database error: a connection a fault
    broke is not reused, the next block connects again."""
    from django.db import connection

    with contextlib.suppress(Exception):
        connection.close()


class DjangoStore:
    """Counters read and saved through the Django ORM inside ``fenced(lease)`` blocks.

    Args:
        endpoints: the run's servers.
        namespace: the pairing's short name (the table's suffix).
        fenced: ``False`` for the opt-out: every block is ``unfenced()``, the token is
            ignored, and the judge lets a stale holder's save through (the broken run the
            checker must catch).
        server: ``"postgres"`` (the run's PostgreSQL) or ``"mariadb"``.
    """

    def __init__(
        self,
        endpoints: Endpoints,
        namespace: str,
        *,
        fenced: bool = True,
        server: str = "postgres",
    ) -> None:
        _configure(endpoints, server)
        self._model = _model(namespace)
        self._fenced = fenced
        self._server = server
        self._errors = _database_errors(server)

    def _block(self, record: str, token: int | None) -> Any:
        app = django_app()[0]
        if not self._fenced:
            return app.unfenced()
        return app.fenced(_Claim(record, needs_token(token)))

    def _get(self, record: str) -> Any:
        try:
            return self._model.objects.get(pk=record)
        except self._model.DoesNotExist:
            raise BackendError(f"chaos record {record!r} has no row", code="MISSING") from None

    def read(self, record: str, token: int | None) -> int:
        """Claim ``record`` and read its counter, in one block (one transaction)."""
        try:
            with self._block(record, token):
                counter = self._get(record)
        except StaleTokenError:
            raise
        except self._errors as err:
            _reset()
            raise sql_failed("claim and read", err, self._server) from err
        return int(counter.value)

    def write(self, record: str, token: int | None, value: int) -> None:
        """Claim ``record`` again and save the new value (a judged ``UPDATE``)."""
        try:
            with self._block(record, token):
                counter = self._get(record)
                counter.value = value
                counter.save(update_fields=["value"])
        except StaleTokenError:
            raise
        except self._errors as err:
            _reset()
            raise sql_failed("fenced save", err, self._server) from err

    def close(self) -> None:
        """Close the Django connection."""
        _reset()


def _prepare(endpoints: Endpoints, namespace: str, records: tuple[str, ...], server: str) -> None:
    """In a spawned process: the app's register and judge, the counter table (replacing an
    old one) with its triggers, and ``records`` at 0."""
    from django.core.management import call_command
    from django.db import connection

    _configure(endpoints, server)
    app, models, operations = django_app()
    # The SQLAlchemy pairings may have made the register already: the same table.
    call_command("migrate", "iofence", verbosity=0, fake_initial=True)
    model = _model(namespace)
    with connection.schema_editor() as editor:
        operations.install_fence(editor, models.FenceRegister)
        table = editor.quote_name(f"chaos_{namespace}")
        cascade = " CASCADE" if connection.vendor == "postgresql" else ""
        editor.execute(f"DROP TABLE IF EXISTS {table}{cascade}", params=None)
        editor.create_model(model)
        operations.install_fence(editor, model)
    with app.unfenced():  # before any holder
        model.objects.bulk_create([model(id=record, value=0) for record in records])
    connection.close()


def setup(
    endpoints: Endpoints, namespace: str, records: Sequence[str], server: str = "postgres"
) -> None:
    """Create the counter table of ``namespace`` with ``records`` at 0, in a spawned process,
    on the run's ``server``.

    Raises:
        BackendError: the database refused (the spawned process's error, as it said it).
    """
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        try:
            pool.apply(_prepare, (endpoints, namespace, tuple(records), server))
        except Exception as err:
            raise BackendError(
                f"the Django setup failed: {type(err).__name__}: {err}", code="SQL"
            ) from err


def open_unfenced(endpoints: Endpoints, namespace: str) -> DjangoStore:
    """The opt-out's store: saves inside ``unfenced()``, no token, no claim."""
    return DjangoStore(endpoints, namespace, fenced=False)


def final(
    endpoints: Endpoints, namespace: str, records: Sequence[str], server: str = "postgres"
) -> dict[str, int]:
    """Every counter after the run (the table is the SQL store's layout)."""
    return final_counters(endpoints, namespace, records, server)
