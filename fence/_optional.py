"""The storage guards (``fence.adapters``) as the core reaches them: imported on first use.

The core never needs a guard to import: ``import fence`` and ``fence --help`` load neither
the guards nor their drivers (SQLAlchemy, redis-py). What in ``fence`` does use one (the
``ddl`` command, the demo, the chaos harness) calls a function here, which imports the guard
when called. If the guard's driver package is missing, the :class:`ModuleNotFoundError`
names the extra that installs it (``pip install 'iofence[sql]'``) and keeps the missing
module's name in ``name``.

``fence.adapters`` ships from the repository's ``adapters/`` folder (setuptools
``package-dir``). mypy run over the source tree knows that folder as ``adapters`` and cannot
resolve ``fence.adapters`` from here, so these imports carry an ``import-not-found`` ignore
and the guards' own types count as ``Any`` in that run. Laid out as installed (``adapters``
inside ``fence``), they resolve, and ``tests/test_docs.py`` (``GUARD_USERS``) type-checks
every user of this module against the guards' own types (``unused-ignore`` keeps that run
quiet about the ignores).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import redis
    import sqlalchemy as sa
    from sqlalchemy.orm import Session

    from fence.adapters.etcd import EtcdGuard  # type: ignore[import-not-found, unused-ignore]
    from fence.adapters.orm import SessionBinding  # type: ignore[import-not-found, unused-ignore]
    from fence.adapters.redis import RedisGuard  # type: ignore[import-not-found, unused-ignore]
    from fence.adapters.sql import RowGuard  # type: ignore[import-not-found, unused-ignore]
    from fence.adapters.zookeeper import (  # type: ignore[import-not-found, unused-ignore]
        ZooKeeperGuard,
    )

__all__ = [
    "EXTRAS",
    "bind_session",
    "celery_task",
    "django_app",
    "etcd_guard",
    "fence_column",
    "fence_register_table",
    "install_hint",
    "redis_guard",
    "row_guard",
    "sql_ddl",
    "sql_judge",
    "sql_mysql_register_ddl",
    "sql_trigger_ddl",
    "zookeeper_guard",
]

#: The extra that installs each driver package, by the package's top-level module.
EXTRAS = {
    "redis": "redis",
    "sqlalchemy": "sql",
    "greenlet": "sql",
    "psycopg": "postgres",
    "httpx": "etcd",
    "kazoo": "zookeeper",
}


def install_hint(module: str) -> str | None:
    """``pip install 'iofence[<extra>]'`` for a driver module (``sqlalchemy.orm`` counts as
    ``sqlalchemy``), or ``None`` if no extra installs it.

    Args:
        module: a module name, as :attr:`ModuleNotFoundError.name` gives it.
    """
    extra = EXTRAS.get(module.split(".")[0])
    return None if extra is None else f"pip install 'iofence[{extra}]'"


@contextlib.contextmanager
def _naming_the_extra() -> Iterator[None]:
    """Say which extra to install when an import misses a driver package."""
    try:
        yield
    except ModuleNotFoundError as exc:
        hint = install_hint(exc.name or "")
        if hint is None:
            raise
        top = (exc.name or "").split(".")[0]
        raise ModuleNotFoundError(f"{top} is not installed: {hint}", name=exc.name) from exc


def django_app() -> tuple[Any, Any, Any]:
    """The Django app's modules (``fence.adapters.django``): the blocks (``fenced``,
    ``unfenced``), the models (``FencedModel``, ``FenceRegister``) and the operations
    (``install_fence``). Django must be configured (``django.setup()``) first.

    Raises:
        ModuleNotFoundError: Django is not installed.
    """
    with _naming_the_extra():
        from fence.adapters import django as app  # type: ignore[import-not-found, unused-ignore]
        from fence.adapters.django import (  # type: ignore[import-not-found, unused-ignore]
            models,
            operations,
        )
    return app, models, operations


def celery_task() -> Any:
    """``fence.adapters.celery.FencedTask``, the base class of a task under a lease.

    Raises:
        ModuleNotFoundError: Celery is not installed.
    """
    with _naming_the_extra():
        from fence.adapters.celery import (  # type: ignore[import-not-found, unused-ignore]
            FencedTask,
        )
    return FencedTask


def sql_ddl() -> tuple[str, str, str]:
    """The SQL guard's DDL templates, each with a ``{table}`` field: the fence column, the
    tombstone flag and the fence register (``fence.adapters.ddl.FENCE_COLUMN_DDL``,
    ``TOMBSTONE_COLUMN_DDL``, ``REGISTER_TABLE_DDL``). Loads no database driver."""
    with _naming_the_extra():
        from fence.adapters.ddl import (  # type: ignore[import-not-found, unused-ignore]
            FENCE_COLUMN_DDL,
            REGISTER_TABLE_DDL,
            TOMBSTONE_COLUMN_DDL,
        )
    return str(FENCE_COLUMN_DDL), str(TOMBSTONE_COLUMN_DDL), str(REGISTER_TABLE_DDL)


def sql_judge() -> Any:
    """The database's judge as text (``fence.adapters._triggers``: its check queries, the
    verdict on what they read, the DDL); ``fence doctor`` reads it. Loads no driver."""
    with _naming_the_extra():
        from fence.adapters import _triggers  # type: ignore[import-not-found, unused-ignore]
    return _triggers


def sql_mysql_register_ddl() -> str:
    """The fence register's DDL on MariaDB and MySQL, with a ``{table}`` field
    (``fence.adapters.ddl.MYSQL_REGISTER_TABLE_DDL``). Loads no database driver."""
    with _naming_the_extra():
        from fence.adapters.ddl import (  # type: ignore[import-not-found, unused-ignore]
            MYSQL_REGISTER_TABLE_DDL,
        )
    return str(MYSQL_REGISTER_TABLE_DDL)


def sql_trigger_ddl() -> Callable[..., list[str]]:
    """The database's judge of a table, as DDL (``fence.adapters.ddl.trigger_ddl``). Loads
    no database driver."""
    with _naming_the_extra():
        from fence.adapters.ddl import (  # type: ignore[import-not-found, unused-ignore]
            trigger_ddl,
        )
    found: Callable[..., list[str]] = trigger_ddl
    return found


def fence_column() -> sa.Column[int]:
    """A new fence column named ``fence`` (``fence.adapters.sql.fence_column()``).

    Raises:
        ModuleNotFoundError: SQLAlchemy is not installed.
    """
    with _naming_the_extra():
        from fence.adapters.sql import (  # type: ignore[import-not-found, unused-ignore]
            fence_column as column,
        )
    made: sa.Column[int] = column()
    return made


def fence_register_table(metadata: sa.MetaData) -> sa.Table:
    """The fence register table in ``metadata`` (``fence.adapters.sql.fence_register_table``).

    Args:
        metadata: the metadata the table belongs to.

    Raises:
        ModuleNotFoundError: SQLAlchemy is not installed.
    """
    with _naming_the_extra():
        from fence.adapters.sql import (  # type: ignore[import-not-found, unused-ignore]
            fence_register_table as register,
        )
    made: sa.Table = register(metadata)
    return made


def row_guard(conn: sa.Connection, table: sa.Table) -> RowGuard:
    """A ``fence.adapters.sql.RowGuard`` of ``table`` on ``conn``.

    Args:
        conn: the connection, in the caller's transaction.
        table: a table with a fence column.

    Raises:
        ModuleNotFoundError: SQLAlchemy is not installed.
    """
    with _naming_the_extra():
        from fence.adapters.sql import (  # type: ignore[import-not-found, unused-ignore]
            RowGuard as guard,
        )
    return guard(conn, table)


def redis_guard(client: redis.Redis, **options: Any) -> RedisGuard:
    """A ``fence.adapters.redis.RedisGuard`` on ``client``.

    Args:
        client: a redis-py client.
        options: the guard's keyword arguments (``scope="resource"``...).

    Raises:
        ModuleNotFoundError: redis-py is not installed.
    """
    with _naming_the_extra():
        from fence.adapters.redis import (  # type: ignore[import-not-found, unused-ignore]
            RedisGuard as guard,
        )
    return guard(client, **options)


def etcd_guard(url: str, *, request_timeout: float = 5.0) -> EtcdGuard:
    """A ``fence.adapters.etcd.EtcdGuard`` with a client of its own for ``url``.

    Args:
        url: an ``etcd://`` URL; its path is the lock manager's prefix.
        request_timeout: how long one call may take across the members, in seconds.

    Raises:
        ModuleNotFoundError: httpx is not installed.
    """
    with _naming_the_extra():
        from fence.adapters.etcd import (  # type: ignore[import-not-found, unused-ignore]
            EtcdGuard as guard,
        )
    return guard(url, request_timeout=request_timeout)


def zookeeper_guard(url: str, *, request_timeout: float = 5.0) -> ZooKeeperGuard:
    """A ``fence.adapters.zookeeper.ZooKeeperGuard`` with a session of its own for ``url``.

    Args:
        url: a ``zookeeper://`` URL; its path is the lock manager's root.
        request_timeout: how long one call may take, in seconds.

    Raises:
        ModuleNotFoundError: kazoo is not installed.
    """
    with _naming_the_extra():
        from fence.adapters.zookeeper import (  # type: ignore[import-not-found, unused-ignore]
            ZooKeeperGuard as guard,
        )
    return guard(url, request_timeout=request_timeout)


def bind_session(session: Session, *, token: int, scope: str) -> SessionBinding:
    """Bind ``session`` to ``token`` on ``scope`` with the ORM session hook
    (``fence.adapters.orm.bind``): each of its transactions starts by claiming ``scope``.

    Args:
        session: a SQLAlchemy ORM session.
        token: the fencing token.
        scope: the fence scope the session claims.

    Raises:
        ModuleNotFoundError: SQLAlchemy is not installed.
    """
    with _naming_the_extra():
        from fence.adapters.orm import bind  # type: ignore[import-not-found, unused-ignore]
    return bind(session, token=token, scope=scope)
