"""The ORM pairings of ``fence chaos``: counters as mapped objects in sessions bound to the
token by the SQLAlchemy session hook (``fence.adapters.orm``), on PostgreSQL or MariaDB.

The registering read is the hook's claim: every transaction of a bound session starts by
claiming the record in the fence register, so the first ``SELECT`` already refuses a stale
holder (C8). The read and the write are two transactions, like the SQL row guard's, so that
a stale holder's write is stopped by the fence and not by a lock held across its pause.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from fence._chaos.base import Endpoints, needs_token
from fence._chaos.sql import counter_table, sql_engine, sql_failed
from fence._errors import BackendError, StaleTokenError
from fence._optional import bind_session, fence_register_table

if TYPE_CHECKING:
    import sqlalchemy as sa

__all__ = ["OrmStore", "setup"]


@functools.cache
def _mapped(namespace: str) -> tuple[Any, sa.Table, sa.Table]:
    """The mapped counter class of ``namespace``, its table and the fence register table."""
    import sqlalchemy as sa
    from sqlalchemy.orm import registry

    metadata = sa.MetaData()
    table = counter_table(metadata, namespace)
    register = fence_register_table(metadata)
    cls = type(f"ChaosCounter_{namespace}", (), {})
    registry(metadata=metadata).map_imperatively(cls, table)
    return cls, table, register


class OrmStore:
    """Counters read and written through ORM sessions bound with
    ``fence.adapters.orm.bind(session, token=..., scope=record)``."""

    def __init__(self, endpoints: Endpoints, namespace: str, server: str = "postgres") -> None:
        self._server = server
        self._engine = sql_engine(endpoints, server)
        self._counter = _mapped(namespace)[0]

    def _session(self, record: str, token: int) -> Any:
        from sqlalchemy.orm import Session

        session = Session(self._engine, expire_on_commit=False)
        bind_session(session, token=token, scope=record)
        return session

    def read(self, record: str, token: int | None) -> int:
        """Claim ``record`` and read its counter, in one transaction."""
        from sqlalchemy.exc import SQLAlchemyError

        token = needs_token(token)
        try:
            with self._session(record, token) as session:
                counter = session.get(self._counter, record)
                session.commit()
        except StaleTokenError:
            raise  # the hook's error is a SQLAlchemy StaleDataError too: not a failure
        except SQLAlchemyError as err:
            raise sql_failed("claim and read", err, self._server) from err
        if counter is None:
            raise BackendError(f"chaos record {record!r} has no row", code="MISSING")
        return int(counter.value)

    def write(self, record: str, token: int | None, value: int) -> None:
        """Claim ``record`` again and flush the new value (a fenced ``UPDATE``)."""
        from sqlalchemy.exc import SQLAlchemyError

        token = needs_token(token)
        try:
            with self._session(record, token) as session:
                counter = session.get(self._counter, record)
                if counter is None:
                    raise BackendError(f"chaos record {record!r} has no row", code="MISSING")
                counter.value = value
                session.commit()
        except StaleTokenError:
            raise
        except SQLAlchemyError as err:
            raise sql_failed("fenced flush", err, self._server) from err

    def close(self) -> None:
        """Dispose of the engine."""
        self._engine.dispose()


def setup(
    endpoints: Endpoints, namespace: str, records: Sequence[str], server: str = "postgres"
) -> None:
    """Create the counter table (at 0) and the fence register table on the run's
    ``server``."""
    import sqlalchemy as sa

    _, table, register = _mapped(namespace)
    engine = sql_engine(endpoints, server)
    try:
        with engine.begin() as conn:
            register.create(conn, checkfirst=True)
            table.drop(conn, checkfirst=True)
            table.create(conn)
            seed = sa.insert(table).execution_options(unfenced=True)  # before any holder
            conn.execute(seed, [{"id": record, "value": 0} for record in records])
    finally:
        engine.dispose()
