"""What both SQL guards share: the DDL, scope names, verdicts and error mapping. No I/O.

The SQLAlchemy Core guard (``fence.adapters.sql``) and the psycopg guard
(``fence.adapters.psycopg``) move bytes; everything that decides lives here, once.
"""

from __future__ import annotations

import datetime
import json
import re
import types
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from fence._core import batch_rejection, rejection
from fence._errors import (
    BackendError,
    ConfigurationError,
    FenceError,
    Reason,
    RetryableError,
    StaleTokenError,
    UnfencedWriteError,
)
from fence._events import EventBus, EventKind
from fence._sql_dialect import (
    CHECK_LOGIN,
    JUDGE_FAULTS,
    Fault,
    error_code,
    fault_of,
    first_line,
    mysql_code,
    mysql_message,
)

from .ddl import (
    DEFAULT_FENCE_COLUMN,
    DEFAULT_REGISTER_TABLE,
    DEFAULT_TOMBSTONE_COLUMN,
    FENCE_COLUMN_DDL,
    REGISTER_TABLE_DDL,
    TOMBSTONE_COLUMN_DDL,
)

__all__ = [
    "ABSENT",
    "CHUNK_PARAMS_DEFAULT",
    "DEFAULT_FENCE_COLUMN",
    "DEFAULT_REGISTER_TABLE",
    "DEFAULT_TOMBSTONE_COLUMN",
    "FENCE_COLUMN_DDL",
    "REGISTER_TABLE_DDL",
    "TOMBSTONE_COLUMN_DDL",
    "Probe",
    "RowScope",
    "batch_rejection",
    "batch_verdicts",
    "chunks",
    "closed_connection_error",
    "documented",
    "judge_error",
    "key_order",
    "lock_order",
    "missing_register_error",
    "missing_table",
    "null_fence_error",
    "one_kind",
    "partial_batch_error",
    "probe_passes",
    "probe_rejection",
    "report_accepted",
    "report_rejected",
    "row_scope",
    "scope_verdicts",
    "translate_error",
    "unverifiable_batch",
    "unverifiable_write",
]


# The driver errors that are never a verdict on the token (C5): the write did not happen and
# the transaction may be retried as a whole. Which error is which is the dialect's reading
# (fence._sql_dialect); the codes and words of the guards' errors are here.
_RETRYABLE: dict[Fault, tuple[str, str]] = {
    Fault.SERIALIZATION: ("SERIALIZATION", "serialization failure"),
    Fault.DEADLOCK: ("DEADLOCK", "deadlock detected"),
    Fault.LOCK_TIMEOUT: ("LOCK_TIMEOUT", "lock not available"),
    Fault.CANCELED: ("TIMEOUT", "statement cancelled or timed out"),
}

#: Bind parameters per statement when a batch reads its rows by key in chunks, on a
#: database iofence has no dialect for (the others: ``SQLDialect.max_params``).
CHUNK_PARAMS_DEFAULT = 999

_T = TypeVar("_T")
_F = TypeVar("_F", bound=Callable[..., Any])


def row_scope(table: str, key: Sequence[Any]) -> str:
    """The scope name of one row in errors and events, e.g. ``accounts(42)``.

    Args:
        table: the table name.
        key: the key values, in key-column order.
    """
    return f"{table}({', '.join(repr(v) if isinstance(v, str) else str(v) for v in key)})"


class RowScope:
    """A row's scope name, built only when an error or an event needs it (hot path)."""

    __slots__ = ("key", "table")

    def __init__(self, table: str, key: Sequence[Any]) -> None:
        self.table = table
        self.key = key

    def __str__(self) -> str:
        return row_scope(self.table, self.key)


@dataclass(frozen=True, slots=True)
class Probe:
    """What the diagnostic read after a write that changed nothing found.

    Attributes:
        exists: a row (live or tombstone) holds the key.
        fence: its fence, ``None`` if there is no row or the column is NULL.
        live: the row exists and is not a tombstone.
    """

    exists: bool
    fence: int | None
    live: bool


#: The probe of a key with no row.
ABSENT = Probe(exists=False, fence=None, live=False)


def probe_passes(probe: Probe, token: int, *, need_live: bool) -> bool:
    """Whether the diagnostic read shows that a write with ``token`` would pass (C4).

    An absent row passes an upsert or claim (a missing fence counts as 0) but not an
    update, which needs a live row.
    """
    if not probe.exists:
        return not need_live
    return probe.fence is not None and token >= probe.fence and (probe.live or not need_live)


def probe_rejection(scope: str, token: int, probe: Probe, *, need_live: bool) -> StaleTokenError:
    """The error for a fenced write that changed nothing, from what the probe found (C5, C9).

    Args:
        scope: the row or register scope.
        token: the presented token.
        probe: the diagnostic read.
        need_live: the write was an update, which needs a live row (``MISSING`` otherwise).
    """
    return rejection(
        scope,
        token,
        probe.fence,
        exists=probe.live if need_live else probe.exists,
        fence_is_null=probe.exists and probe.fence is None,
    )


def batch_verdicts(
    table: str,
    keys: Sequence[tuple[Any, ...]],
    found: Mapping[tuple[Any, ...], Probe],
    token: int,
    *,
    need_live: bool,
    everything: bool,
) -> list[StaleTokenError]:
    """One error per row of a batch that the probes show would not pass (C5, C6).

    Args:
        table: the table name, for the scopes.
        keys: the batch's keys, in its order.
        found: the probe of each key that has a row (absent keys are :data:`ABSENT`).
        token: the presented token.
        need_live: the batch is an update, which needs live rows.
        everything: the write already failed, so if no row fails now (a concurrent writer
            moved on between the write and the read), list every row rather than none.
    """
    errors = []
    for keyvals in keys:
        probe = found.get(keyvals, ABSENT)
        if not probe_passes(probe, token, need_live=need_live):
            errors.append(
                probe_rejection(row_scope(table, keyvals), token, probe, need_live=need_live)
            )
    if not errors and everything:
        errors = [
            probe_rejection(row_scope(table, k), token, found.get(k, ABSENT), need_live=need_live)
            for k in keys
        ]
    return errors


def scope_verdicts(
    scopes: Sequence[str], token: int, found: Mapping[str, Probe], *, everything: bool
) -> list[StaleTokenError]:
    """One error per register scope whose fence is above ``token`` (C5, C6).

    Args:
        scopes: the scopes, in the batch's order.
        found: the fence of each scope that has one (absent scopes are :data:`ABSENT`).
        token: the presented token.
        everything: the claim already failed, so if no scope fails now (a concurrent
            writer moved on between the claim and the read), list every scope.
    """
    errors = [
        probe_rejection(scope, token, found.get(scope, ABSENT), need_live=False)
        for scope in scopes
        if not probe_passes(found.get(scope, ABSENT), token, need_live=False)
    ]
    if not errors and everything:
        errors = [
            probe_rejection(scope, token, found.get(scope, ABSENT), need_live=False)
            for scope in scopes
        ]
    return errors


def unverifiable_write(scope: str, token: int, driver: str) -> StaleTokenError:
    """The refusal of a write whose driver reports neither ``RETURNING`` nor row counts (C9)."""
    return StaleTokenError(
        scope,
        token,
        None,
        Reason.UNVERIFIABLE,
        message=(
            f"{scope}: the {driver} driver reports neither RETURNING nor row counts, so a "
            "fenced write cannot be verified; nothing was written"
        ),
    )


def unverifiable_batch(table: str, token: int, driver: str) -> StaleTokenError:
    """The refusal of a row-by-row batch whose driver does not count ``executemany`` (C9)."""
    return StaleTokenError(
        table,
        token,
        None,
        Reason.UNVERIFIABLE,
        message=(
            f"{table}: the {driver} driver does not report the row count of executemany, "
            "so a batch cannot be verified; nothing was written"
        ),
    )


def partial_batch_error(table: str, count: int, total: int) -> BackendError:
    """The error for a batch that wrote some of its rows only (it never should: C6)."""
    return BackendError(
        f"a batch on {table} wrote {count} of {total} rows; roll the transaction back",
        code="PARTIAL",
    )


def chunks(items: Sequence[_T], size: int) -> Iterator[Sequence[_T]]:
    """``items`` cut into slices of at most ``size``."""
    for start in range(0, len(items), max(1, size)):
        yield items[start : start + size]


def key_order(pairs: list[tuple[tuple[Any, ...], _T]]) -> list[tuple[tuple[Any, ...], _T]]:
    """``(key, item)`` pairs sorted by key, as given if the keys do not sort.

    An upsert takes its row locks in the order of its rows; in key order, two batches that
    share keys wait for each other instead of deadlocking.
    """
    try:
        return sorted(pairs, key=lambda pair: pair[0])
    except TypeError:
        return pairs


def lock_order(keys: Sequence[_T]) -> list[_T]:
    """The keys sorted, so that batches lock shared rows in one order; as given if unorderable."""
    try:
        return sorted(keys)  # type: ignore[type-var]
    except TypeError:
        return list(keys)


def one_kind(values: Sequence[Any]) -> type | bool | None:
    """The one Python type of the values (``None`` aside), ``None`` if all are ``None``, or
    ``False`` if they mix types (or, for times, naive and aware values).

    psycopg sends a list as one array of one element type and cannot send a list that
    mixes types (``1`` and ``2.5``), nor keep naive and aware datetimes apart in one array.
    """
    kinds = set(map(type, values))
    kinds.discard(type(None))
    if len(kinds) > 1:
        return False
    if not kinds:
        return None
    kind = kinds.pop()
    mixed_zones = issubclass(kind, datetime.datetime | datetime.time) and (
        len({v.tzinfo is None for v in values if v is not None}) > 1
    )
    return False if mixed_zones else kind


def null_fence_error(scope: str) -> ConfigurationError:
    """The error for reading a fence that is NULL: the column must be NOT NULL (C9)."""
    return ConfigurationError(
        f"{scope}: the fence column is NULL, so no write can be verified; declare it "
        "BIGINT NOT NULL DEFAULT 0 and set the NULL rows to 0"
    )


def missing_table(exc: BaseException) -> bool:
    """Whether a driver error says a table does not exist (PostgreSQL 42P01, SQLite)."""
    return fault_of(exc) is Fault.MISSING_TABLE


def missing_register_error(table: str) -> ConfigurationError:
    """The error for a claim on a fence register table that was never created."""
    return ConfigurationError(
        f"the fence register table {table} does not exist: create it with "
        "fence_register_table(metadata) and metadata.create_all(), or in a migration with "
        "REGISTER_TABLE_DDL (fence.adapters.sql); pass its name with register= if it is "
        "not fence_register"
    )


def closed_connection_error(what: str = "the connection") -> BackendError:
    """The error for a guard used on a closed connection, before any statement is sent."""
    return BackendError(
        f"{what} is closed; nothing was written. Open a new connection and run the whole "
        "transaction again",
        code="CONNECTION",
    )


# The table named by a SQLite trigger's message: "... of <table>: ..." / "... from <table>: ...".
_SQLITE_TABLE = re.compile(r"(?:of a row of|of|from) ([^\s:]+)")
# A stale write's message of MariaDB's triggers, which carry no detail of their own.
_MARIADB_STALE = re.compile(
    r"^iofence: stale token (\d+) for (.*), whose fence is (\d+|NULL)$", re.S
)


def judge_error(exc: BaseException, token: int | None = None) -> FenceError | None:
    """The iofence error for a refusal of the database's judge (C14), or ``None`` if
    ``exc`` is none: :class:`fence.StaleTokenError` (``STALE``) for a token below the row's
    fence, :class:`fence.UnfencedWriteError` for a write without a token or one that would
    lower or drop a fence. Nothing was written either way.

    Args:
        exc: what the driver raised (a DB-API error, or SQLAlchemy's wrapper of one).
        token: the token of the writing transaction, where the error does not say it
            (SQLite's triggers cannot put it in their message).
    """
    fault = fault_of(exc)
    if fault not in JUDGE_FAULTS:
        return None
    orig = getattr(exc, "orig", None) or exc
    text = mysql_message(orig) if mysql_code(orig) is not None else first_line(orig)
    diag = getattr(orig, "diag", None)
    table = getattr(diag, "table_name", None)
    if table is None:
        found = _SQLITE_TABLE.search(text)
        table = found.group(1) if found else None
    message = f"{text} (refused by the database's judge, C14; nothing was written)"
    if fault is Fault.STALE:
        detail: dict[str, Any] = {}
        raw = getattr(diag, "message_detail", None)
        if raw:
            try:
                detail = json.loads(raw)
            except ValueError:
                detail = {}
        stale = _MARIADB_STALE.match(text)
        if stale is not None:
            fence = stale.group(3)
            detail = {
                "token": int(stale.group(1)),
                "scope": stale.group(2),
                "fence": None if fence == "NULL" else int(fence),
            }
        written = detail.get("token", token)
        return StaleTokenError(
            str(detail.get("scope") or table or "?"),
            int(written) if written is not None else 0,
            detail.get("fence"),
            Reason.STALE,
            message=message,
        )
    return UnfencedWriteError(message, scope=table)


def translate_error(exc: BaseException, action: str, scope: str) -> FenceError:
    """Map a driver exception to the iofence error to raise (chain it with ``from``).

    A serialization failure, a deadlock, a lock or statement timeout and a busy SQLite
    database become :class:`fence.RetryableError`, never a stale verdict (C5). A lost or
    closed connection becomes a :class:`fence.BackendError` with code ``CONNECTION``. A
    refusal of the database's judge is the error :func:`judge_error` gives.

    Args:
        exc: what the driver raised (a DB-API error, or SQLAlchemy's wrapper of one).
        action: what the guard was doing, for the message (``"fenced update"``).
        scope: the scope it was doing it on.
    """
    fault = fault_of(exc)
    if fault in JUDGE_FAULTS:
        judged = judge_error(exc)
        assert judged is not None
        return judged
    state = error_code(exc)
    detail = str(getattr(exc, "orig", None) or exc).strip().splitlines()
    text = detail[0] if detail else type(exc).__name__
    if fault in _RETRYABLE:
        code, what = _RETRYABLE[fault]
        return RetryableError(
            f"{action} on {scope}: {what} ({state}); nothing was written and the "
            "token was not judged. Roll back and retry the whole transaction",
            code=code,
        )
    if fault is Fault.BUSY:
        return RetryableError(
            f"{action} on {scope}: the SQLite database is locked by another writer ({text}); "
            "roll back and retry the whole transaction",
            code="BUSY",
        )
    if fault is Fault.ABORTED:
        return BackendError(
            f"{action} on {scope}: the transaction was already aborted by an earlier error; "
            "roll it back before writing",
            code="ABORTED",
        )
    if fault is Fault.AUTH or fault is Fault.NO_DATABASE:
        return BackendError(
            f"{action} on {scope}: the server refused the login or has no such database "
            f"({text}); {CHECK_LOGIN}",
            code="AUTH" if fault is Fault.AUTH else "DATABASE",
        )
    if fault is Fault.CONNECTION or _looks_disconnected(exc):
        return BackendError(
            f"{action} on {scope}: the connection is lost or closed ({text}); the "
            "transaction did not commit. Run it again on a new connection",
            code="CONNECTION",
        )
    suffix = f" ({state})" if state else ""
    return BackendError(f"{action} on {scope} failed: {text}{suffix}", code="BACKEND")


def _looks_disconnected(exc: BaseException) -> bool:
    if getattr(exc, "connection_invalidated", False):
        return True
    name = type(exc).__name__
    if name == "ResourceClosedError":
        return True
    message = str(exc).lower()
    return "closed" in message and "connection" in message


def report_accepted(bus: EventBus, source: str, scopes: Iterable[str], token: int) -> None:
    """Emit ``WRITE_ACCEPTED`` for each scope (callers check ``bus.active`` first)."""
    for scope in scopes:
        bus.emit(EventKind.WRITE_ACCEPTED, source, scope, token)


def report_rejected(bus: EventBus, source: str, err: StaleTokenError) -> None:
    """Emit ``WRITE_REJECTED`` for each rejected item of ``err`` (callers check ``bus.active``)."""
    for item in err.rejected or (err,):
        bus.emit(
            EventKind.WRITE_REJECTED,
            source,
            item.scope,
            err.token,
            reason=str(item.reason),
            fence=item.fence,
        )


def documented(method: _F, doc: str | None = None, *, returns: object = None) -> _F:
    """``method`` again, as a guard's own method: a flow's method in the guard's class.

    The guards of every driver share their methods (``_async/row_flow.py``). A copy of the
    function (its code is shared) puts each in the guard's class, so the API reference
    lists it there, under the guard's own docstring where the guards differ. It costs
    nothing per call, where a method that delegated would cost a call, and an await, on
    every write.

    Args:
        method: the flow's function.
        doc: the guard's docstring (default: the flow's).
        returns: the return type as the guard's users read it (``Row[Any] | None`` for
            the flow's ``RowT | None``).
    """
    copy = types.FunctionType(
        method.__code__,
        method.__globals__,
        method.__name__,
        method.__defaults__,
        method.__closure__,
    )
    copy.__kwdefaults__ = method.__kwdefaults__
    copy.__qualname__ = method.__qualname__
    copy.__module__ = method.__module__
    copy.__doc__ = method.__doc__ if doc is None else doc
    copy.__annotations__ = dict(method.__annotations__)
    if returns is not None:
        copy.__annotations__["return"] = returns
    return copy  # type: ignore[return-value]
