"""The SQL store of ``fence chaos``: counters in rows with a fence column, behind
``fence.adapters.sql.RowGuard``, on PostgreSQL or MariaDB; and the table, engine and error
helpers that the ORM store (:mod:`fence._chaos.orm`) shares.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from fence._chaos.base import Endpoints, needs_token
from fence._errors import BackendError
from fence._optional import fence_column, row_guard

if TYPE_CHECKING:
    import sqlalchemy as sa

__all__ = [
    "SQL_SERVERS",
    "RowGuardStore",
    "counter_table",
    "final_counters",
    "setup_counters",
    "sql_engine",
    "sql_failed",
]


def counter_table(metadata: sa.MetaData, namespace: str) -> sa.Table:
    """The counter table of ``namespace``: ``id``, ``value`` and a fence column."""
    import sqlalchemy as sa

    return sa.Table(
        f"chaos_{namespace}",
        metadata,
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("value", sa.BigInteger, nullable=False),
        fence_column(),
    )


#: The SQL servers a chaos run may have, and the name they go by in messages.
SQL_SERVERS = {"postgres": "PostgreSQL", "mariadb": "MariaDB"}


def sql_engine(endpoints: Endpoints, server: str = "postgres") -> sa.Engine:
    """An engine of the run's ``server`` (``"postgres"`` or ``"mariadb"``) with short
    timeouts and a small pool."""
    import sqlalchemy as sa

    connect_args: dict[str, object] = {"connect_timeout": 2}
    if server == "mariadb":
        # A killed server is seen at once (the socket closes); the read timeout only
        # bounds a reply that never comes.
        connect_args["read_timeout"] = 30
    return sa.create_engine(
        endpoints.url(server),
        pool_pre_ping=True,
        pool_size=2,
        connect_args=connect_args,
    )


def sql_failed(what: str, err: Exception, server: str = "postgres") -> BackendError:
    """A retryable :class:`BackendError` for a driver error ``err`` during ``what``."""
    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    name = SQL_SERVERS.get(server, server)
    return BackendError(f"{name} failed the {what}: {first}", code="SQL", retryable=True)


class RowGuardStore:
    """Counters in rows with a fence column, behind ``fence.adapters.sql.RowGuard``, on
    the run's PostgreSQL (or its MariaDB, with ``server="mariadb"``).

    The registering read and the write are two transactions, as a service would run them
    around some work: only the fence, not a row lock held across the work, keeps a stale
    holder out.
    """

    def __init__(self, endpoints: Endpoints, namespace: str, server: str = "postgres") -> None:
        import sqlalchemy as sa

        self._server = server
        self._engine = sql_engine(endpoints, server)
        self._table = counter_table(sa.MetaData(), namespace)

    def read(self, record: str, token: int | None) -> int:
        from sqlalchemy.exc import SQLAlchemyError

        token = needs_token(token)
        try:
            with self._engine.begin() as conn:
                row = row_guard(conn, self._table).read_for_update(record, token)
        except SQLAlchemyError as err:
            raise sql_failed("registering read", err, self._server) from err
        if row is None:
            raise BackendError(f"chaos record {record!r} has no row", code="MISSING")
        return int(row.value)

    def write(self, record: str, token: int | None, value: int) -> None:
        from sqlalchemy.exc import SQLAlchemyError

        token = needs_token(token)
        try:
            with self._engine.begin() as conn:
                row_guard(conn, self._table).update(record, token, {"value": value})
        except SQLAlchemyError as err:
            raise sql_failed("fenced update", err, self._server) from err

    def close(self) -> None:
        self._engine.dispose()


def setup_counters(
    endpoints: Endpoints, namespace: str, records: Sequence[str], server: str = "postgres"
) -> None:
    """Create the counter table of ``namespace`` (dropping an old one) with ``records`` at 0,
    on the run's ``server``."""
    import sqlalchemy as sa

    engine = sql_engine(endpoints, server)
    metadata = sa.MetaData()
    table = counter_table(metadata, namespace)
    try:
        metadata.drop_all(engine)
        metadata.create_all(engine)
        with engine.begin() as conn:
            seed = sa.insert(table).execution_options(unfenced=True)  # before any holder
            conn.execute(seed, [{"id": record, "value": 0} for record in records])
    finally:
        engine.dispose()


def final_counters(
    endpoints: Endpoints, namespace: str, records: Sequence[str], server: str = "postgres"
) -> dict[str, int]:
    """Every counter of ``records`` after the run (0 for a record without a row), on the
    run's ``server``."""
    import sqlalchemy as sa

    engine = sql_engine(endpoints, server)
    table = counter_table(sa.MetaData(), namespace)
    try:
        with engine.connect() as conn:
            rows = conn.execute(sa.select(table.c.id, table.c.value)).all()
    finally:
        engine.dispose()
    found = {str(row.id): int(row.value) for row in rows}
    return {record: found.get(record, 0) for record in records}
