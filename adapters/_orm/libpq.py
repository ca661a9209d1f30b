"""A transport on psycopg 3's libpq connection: it sends simple-protocol messages and reads
their results, past psycopg's own execution, which waits for each reply before it returns.

It knows nothing of what it sends: the claim (``claim``) composes the messages and judges
the results. Errors are psycopg's own (:attr:`Driver.Error`); the caller translates them.
psycopg is optional for the session hook, so it is imported when first needed.
"""

from __future__ import annotations

import re
from typing import Any

from sqlalchemy.util import await_only

__all__ = [
    "Driver",
    "begin",
    "driver",
    "exchange",
    "failure",
    "literal",
    "read",
    "rows",
    "send",
]


class Driver:
    """What the hot path uses of psycopg, imported once (psycopg is optional)."""

    def __init__(self) -> None:
        from psycopg import AsyncConnection, IsolationLevel, errors, generators, pq

        self.AsyncConnection = AsyncConnection
        self.IsolationLevel = IsolationLevel
        self.Error = errors.Error
        self.execute = generators.execute
        self.COMMAND_OK = pq.ExecStatus.COMMAND_OK
        self.SQLSTATE = pq.DiagnosticField.SQLSTATE
        self.begins: dict[tuple[Any, Any, Any], bytes] = {}


_DRIVER: list[Driver] = []


def driver() -> Driver:
    """The :class:`Driver`, made on first use."""
    if not _DRIVER:
        _DRIVER.append(Driver())
    return _DRIVER[0]


def begin(raw: Any, pg: Driver) -> bytes:
    """``BEGIN`` with the connection's transaction characteristics, as psycopg sends it."""
    shape = (raw.isolation_level, raw.read_only, raw.deferrable)
    command = pg.begins.get(shape)
    if command is None:
        level, read_only, deferrable = shape
        words = [b"BEGIN"]
        if level is not None:
            words.append(
                b"ISOLATION LEVEL " + pg.IsolationLevel(level).name.replace("_", " ").encode()
            )
        if read_only is not None:
            words.append(b"READ ONLY" if read_only else b"READ WRITE")
        if deferrable is not None:
            words.append(b"DEFERRABLE" if deferrable else b"NOT DEFERRABLE")
        command = pg.begins[shape] = b" ".join(words)
    return command


#: Text that is its own SQL literal between quotes: printable ASCII without a quote or a
#: backslash reads the same in every server encoding and string setting.
_PLAIN = re.compile(r"[ -&(-\[\]-~]*")


def literal(value: str, raw: Any) -> bytes:
    """``value`` as an SQL string literal for ``raw``'s server session."""
    if _PLAIN.fullmatch(value):
        return b"'%s'" % value.encode("ascii")
    from psycopg import sql as pg_sql

    return pg_sql.Literal(value).as_bytes(raw)


def send(raw: Any, query: bytes) -> None:
    """Send one simple-protocol message and return without waiting for its reply; what
    does not leave now leaves when the reply is read (:func:`read`)."""
    pgconn = raw.pgconn
    pgconn.send_query(query)
    pgconn.flush()


def read(raw: Any) -> list[Any]:
    """Finish sending what is queued on psycopg's connection and read its results."""
    pg = driver()
    if isinstance(raw, pg.AsyncConnection):
        results: list[Any] = await_only(raw.wait(pg.execute(raw.pgconn)))
    else:
        results = raw.wait(pg.execute(raw.pgconn))
    return results


def exchange(raw: Any, query: bytes) -> list[Any]:
    """Send one simple-protocol message on psycopg's connection and return its results."""
    raw.pgconn.send_query(query)
    return read(raw)


def failure(raw: Any, results: list[Any]) -> Exception | None:
    """The first of ``results`` that failed, as the psycopg error it stands for."""
    from psycopg import errors, pq

    for result in results:
        if result.status not in (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK):
            found: Exception = errors.error_from_result(result, encoding=raw.info.encoding)
            return found
    return None


def rows(results: list[Any]) -> list[tuple[Any, ...]]:
    """The rows of the first of ``results`` that returned rows, as text (``None`` for
    NULL; ``True``/``False`` for a boolean's ``t``/``f``)."""
    from psycopg import pq

    for result in results:
        if result.status == pq.ExecStatus.TUPLES_OK:
            out = []
            for i in range(result.ntuples):
                row: list[Any] = []
                for j in range(result.nfields):
                    value = result.get_value(i, j)
                    if value is None:
                        row.append(None)
                    elif result.ftype(j) == 16:  # bool
                        row.append(value == b"t")
                    else:
                        row.append(value.decode())
                out.append(tuple(row))
            return out
    return []
