"""The plain-SQL store of ``fence chaos``: a worker that writes with its own psycopg
connection and never uses a guard, judged by the database alone (C14).

The counters are the rows of the SQL store's table (:mod:`fence._chaos.sql`), whose
triggers ``create_all`` installed. The worker sends plain SQL: it makes its token the
transaction's (``set_config('iofence.token', ...)``, as any program can) and then runs an
ordinary ``UPDATE``. Nothing on its side compares tokens: the triggers refuse a stale one
(``SQLSTATE IOF02``) and give every row the holder writes the holder's token as its fence.

- The registering read is ``UPDATE ... SET value = value ... RETURNING value``: the judge
  refuses a stale reader and raises the fence for the holder (C8), in one transaction.
- The write is ``UPDATE ... SET value = %s``, in a second transaction.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from fence._chaos.base import Endpoints, needs_token
from fence._chaos.sql import final_counters, setup_counters, sql_failed
from fence._errors import BackendError, Reason, StaleTokenError

__all__ = ["PlainSqlStore", "final", "setup"]

#: The SQLSTATEs of the database's judge: no token, a stale token, a write that lowers a fence.
_REFUSALS = ("IOF01", "IOF02", "IOF03")


class PlainSqlStore:
    """Counters read and written with plain SQL on a psycopg connection of the worker's
    own; the database's triggers are the only judge."""

    def __init__(self, endpoints: Endpoints, namespace: str) -> None:
        url = endpoints.url("postgres").replace("postgresql+psycopg://", "postgresql://")
        self._conninfo = url
        self._table = f"chaos_{namespace}"
        self._conn: Any = None

    def _connection(self) -> Any:
        import psycopg

        if self._conn is None or self._conn.closed or self._conn.broken:
            self._conn = psycopg.connect(self._conninfo, connect_timeout=2, autocommit=True)
        return self._conn

    def _run(self, what: str, record: str, token: int, statement: str, params: Any) -> Any:
        import psycopg
        from psycopg import sql

        query = sql.SQL(statement).format(sql.Identifier(self._table))
        try:
            conn = self._connection()
            with conn.transaction():
                conn.execute("SELECT set_config('iofence.token', %s, true)", (str(token),))
                return conn.execute(query, params).fetchone()
        except psycopg.Error as err:
            if getattr(err, "sqlstate", None) in _REFUSALS:
                raise _refusal(record, token, err) from err
            raise sql_failed(what, err) from err

    def read(self, record: str, token: int | None) -> int:
        """The registering read: judged by the database, it raises the fence to ``token``."""
        token = needs_token(token)
        row = self._run(
            "registering read",
            record,
            token,
            "UPDATE {} SET value = value WHERE id = %s RETURNING value",
            (record,),
        )
        if row is None:
            raise BackendError(f"chaos record {record!r} has no row", code="MISSING")
        return int(row[0])

    def write(self, record: str, token: int | None, value: int) -> None:
        """A plain ``UPDATE``, judged by the database."""
        token = needs_token(token)
        row = self._run(
            "plain update",
            record,
            token,
            "UPDATE {} SET value = %s WHERE id = %s RETURNING id",
            (value, record),
        )
        if row is None:
            raise BackendError(f"chaos record {record!r} has no row", code="MISSING")

    def close(self) -> None:
        """Close the connection."""
        if self._conn is not None:
            self._conn.close()


def _refusal(record: str, token: int, err: Any) -> StaleTokenError:
    """The judge's refusal as the harness logs it (the worker reads no driver error)."""
    detail: dict[str, Any] = {}
    raw = getattr(err.diag, "message_detail", None)
    if raw:
        try:
            detail = json.loads(raw)
        except ValueError:
            detail = {}
    fence = detail.get("fence")
    return StaleTokenError(record, token, fence, Reason.STALE, message=str(err).splitlines()[0])


def setup(endpoints: Endpoints, namespace: str, records: Sequence[str]) -> None:
    """The SQL store's table (and its triggers) with ``records`` at 0."""
    setup_counters(endpoints, namespace, records)


def final(endpoints: Endpoints, namespace: str, records: Sequence[str]) -> dict[str, int]:
    """Every counter after the run."""
    return final_counters(endpoints, namespace, records)
