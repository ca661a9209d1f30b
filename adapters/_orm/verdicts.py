"""Verdicts of the session hook: each fenced statement is judged by its row count, and a
rejection names every row that refused it (C5, C6); what the hook cannot fence is refused.

The flush's rewritten statements (``flush``) and a bound session's Core statements
(``criteria``) are recorded in :data:`JUDGE` with how to judge them; the engine's
``after_execute`` judges them before the ORM looks at their result. The verdicts come from
the SQL row guard's rules (``_sql_common``).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Table, false, select
from sqlalchemy.engine import Connection
from sqlalchemy.orm import Mapper, ORMExecuteState
from sqlalchemy.orm import exc as orm_exc

from fence._errors import FenceError, ReadLeaseError, Reason, UnfencedWriteError
from fence._errors import StaleTokenError as _FenceStale
from fence._events import EventBus, EventKind
from fence._sql_dialect import DIALECTS, fault_of

from .. import _sql_gate as gate
from .._judge import SESSION_DIALECTS, judged_without_triggers
from .._sql_common import (
    ABSENT,
    Probe,
    batch_rejection,
    probe_passes,
    probe_rejection,
    translate_error,
)
from .._sql_statements import RowStatements
from . import refusal
from .binding import SessionBinding, bound
from .fenced import TableInfo, mapper_of
from .span import CURRENT

__all__ = [
    "DONE",
    "JUDGE",
    "SOURCE",
    "Rewrite",
    "StaleTokenError",
    "after_cursor_execute",
    "after_execute",
    "bulk_refusal",
    "find_blockers",
    "flush_retryable",
    "judge_criteria",
    "judge_orm",
    "judge_refused",
    "read_refusal",
    "reject",
    "unknown_shape",
]


#: The ``source`` of the hook's events.
SOURCE = "orm"


class StaleTokenError(_FenceStale, orm_exc.StaleDataError):
    """A fenced flush or ORM write was rejected; nothing of the flush was kept (C5).

    It is both a :class:`fence.StaleTokenError` and a
    :class:`sqlalchemy.orm.exc.StaleDataError`, so code that handles optimistic
    concurrency failures today handles fencing rejections too. The session is left as
    after any failed flush: call ``session.rollback()`` and run the unit of work again
    under a new lease. Until then the transaction stays refused: its statements and its
    commit raise :class:`fence.TransactionRefusedError`.

    Attributes:
        mapper: the mapper of the rejected row (``None`` for a register claim); dropped
            when the error is pickled.
        key: the primary key of the rejected row as a tuple (``None`` for a claim or a
            criteria ``update()``/``delete()``; see ``rejected``).

    ``scope``, ``token``, ``fence``, ``reason`` and ``rejected`` are as for
    :class:`fence.StaleTokenError`; a batch (several rows of one flush or criteria statement)
    lists one error per rejected row in ``rejected``.

    Example::

        try:
            session.commit()
        except StaleTokenError as err:   # or: except StaleDataError
            session.rollback()
            print(err.mapper, err.key, err.token, err.fence)
    """

    def __init__(
        self,
        scope: str,
        token: int,
        fence: int | None,
        reason: Reason = Reason.STALE,
        *,
        mapper: Mapper[Any] | None = None,
        key: tuple[Any, ...] | None = None,
        rejected: tuple[_FenceStale, ...] = (),
        message: str | None = None,
    ) -> None:
        super().__init__(scope, token, fence, reason, rejected=rejected, message=message)
        self.mapper = mapper
        self.key = key

    def __reduce__(self) -> tuple[Any, ...]:
        # A Mapper does not pickle; the scope names the row.
        state = dict(self.__dict__, mapper=None)
        return (_restore, (type(self), self.args, state))

    @classmethod
    def from_guard(
        cls, err: _FenceStale, mapper: Mapper[Any] | None, key: tuple[Any, ...] | None
    ) -> StaleTokenError:
        """Re-home a guard's :class:`fence.StaleTokenError` with the ORM's data."""
        return cls(
            err.scope,
            err.token,
            err.fence,
            err.reason,
            mapper=mapper,
            key=key,
            rejected=err.rejected,
            message=str(err.args[0]) if err.args else None,
        )


def _restore(cls: type[StaleTokenError], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    err = cls.__new__(cls)
    err.args = args
    err.__dict__.update(state)
    return err


StaleTokenError.__module__ = "fence.adapters.orm"
# Pickled errors name this function by the module the hook had before it became a package
# (which re-exports it), so pickles of either version load in the other.
_restore.__module__ = "fence.adapters._orm"


@dataclass(eq=False)
class Rewrite:
    """How a rewritten statement is judged after it ran.

    Attributes:
        info: the fenced table (for a dependent table: the table of its fence).
        kind: ``update``, ``delete`` or ``insert`` of a flush; ``criteria`` for a Core
            statement of a bound session, judged by the rows that block it.
        key_params: names of the fence-table key values in the ORM's parameters.
        criteria: the criteria of a ``criteria`` statement.
        need_live: whether a tombstone blocks the statement (an update).
    """

    info: TableInfo
    kind: str
    key_params: tuple[str, ...]
    criteria: Any = None
    need_live: bool = True


JUDGE: weakref.WeakKeyDictionary[Any, Rewrite] = weakref.WeakKeyDictionary()
DONE: weakref.WeakSet[Any] = weakref.WeakSet()  # rewritten, nothing to judge


def after_cursor_execute(
    conn: Connection, cursor: Any, statement: str, parameters: Any, context: Any, many: bool
) -> None:
    # The cursor's own count, read while it is open: SQLAlchemy keeps no row count for an
    # INSERT, and a batch of inserts may run as several cursor executions.
    current = CURRENT.get()
    if current is None or current.rowcount is None:
        return
    compiled = getattr(context, "compiled", None)
    found = DIALECTS.get(conn.dialect.name)
    if (
        found is not None
        and found.rowcount_after_fetch
        and getattr(compiled, "effective_returning", None)
    ):
        # sqlite3 counts the rows of a statement with RETURNING as they are fetched, and
        # the ORM fetches them after the hook judged the statement.
        current.late_count = True
    count = cursor.rowcount
    current.rowcount = -1 if count < 0 or current.rowcount < 0 else current.rowcount + count


def after_execute(
    conn: Connection,
    elem: Any,
    multiparams: list[dict[str, Any]],
    params: dict[str, Any],
    execution_options: Mapping[str, Any],
    result: Any,
) -> None:
    judge = JUDGE.get(elem)
    if judge is None:
        return
    try:
        if judge.kind == "criteria":
            judge_criteria(conn, judge, result)
        else:
            _judge_flush(conn, judge, multiparams, params, result)
    except _FenceStale as err:
        refusal.refuse_on(conn, err)
        raise


def judge_refused(context: Any, refused: FenceError) -> None:
    """A fenced flush statement that MariaDB's judge refused, judged as the hook judges a
    statement that wrote nothing (``_judge.REFUSAL_HOOKS``).

    On MariaDB and MySQL an upsert has no ``WHERE``: a row whose fence is above the token
    reaches its ``BEFORE UPDATE`` trigger, which refuses the whole statement (InnoDB undoes
    the rows it wrote before). The rows are read again, with a lock, so that the
    :class:`StaleTokenError` names each row that refused it, with its mapper, as the row
    count's verdict does elsewhere.
    """
    conn = context.connection
    executed = context.execution_context
    compiled = executed.compiled if executed is not None else None
    if conn is None or compiled is None or conn.dialect.name not in SESSION_DIALECTS:
        return
    judge = JUDGE.get(compiled.statement)
    current = CURRENT.get()
    if judge is None or judge.kind == "criteria" or current is None or current.binding is None:
        return
    if not isinstance(refused, _FenceStale):
        return
    current.rowcount = 0
    try:
        _judge_flush(conn, judge, list(executed.compiled_parameters), {}, None)
    except _FenceStale as err:
        refusal.refuse_on(conn, err)
        raise err from context.sqlalchemy_exception or context.original_exception


def flush_retryable(context: Any) -> None:
    """A deadlock (MariaDB error 1213), a lock wait timeout (1205) or another failure that
    leaves nothing changed, inside a bound session's flush on MariaDB or MySQL, as
    :class:`fence.RetryableError` (an engine ``handle_error`` listener): never a verdict
    on the token (C5); roll back and run the unit of work again. No I/O."""
    current = CURRENT.get()
    conn = context.connection
    if current is None or current.binding is None or conn is None:
        return
    if conn.dialect.name not in SESSION_DIALECTS:
        return
    fault = fault_of(context.original_exception)
    if fault is None or not fault.retryable:
        return
    raise translate_error(context.original_exception, "fenced flush", current.binding.scope) from (
        context.sqlalchemy_exception or context.original_exception
    )


def _judge_flush(
    conn: Connection,
    judge: Rewrite,
    multiparams: list[dict[str, Any]],
    params: dict[str, Any],
    result: Any,
) -> None:
    """Judge a rewritten flush statement by its row count (C5, C6)."""
    current = CURRENT.get()
    if current is None:
        return
    assert current.binding is not None
    rows = multiparams or [params]
    token = current.binding.token
    events = current.binding.events
    count = current.rowcount if current.rowcount is not None else result.rowcount
    late, current.late_count = current.late_count, False
    current.rowcount = None
    info = judge.info
    s = info.statements
    keys = [tuple(p.get(name) for name in judge.key_params) for p in rows]
    if late and count != len(rows) and _wrote_all(conn, s, judge, keys, token):
        count = len(rows)
    if judge.kind == "insert" and count > 0 and _counts_found(conn):
        count = _upserted(conn, judge.info, keys, count, token)
    if count == len(rows):
        if events.active:
            for keyvals in keys:
                events.emit(EventKind.WRITE_ACCEPTED, SOURCE, s.scope(keyvals), token)
        return
    mapper = mapper_of(info)
    if count < 0:  # C9: a write whose row count is unknown is refused, not guessed
        raise StaleTokenError(
            s.name,
            token,
            None,
            Reason.UNVERIFIABLE,
            mapper=mapper,
            message=(
                f"{s.name}: the {conn.dialect.name} driver did not report how many rows the "
                "fenced flush changed, so it cannot be verified; roll back"
            ),
        )
    need_live = judge.kind == "update"
    errors = []
    probes = []
    for keyvals in keys:
        probe = _probe(conn, s, keyvals) if None not in keyvals else ABSENT
        probes.append(probe)
        if not probe_passes(probe, token, need_live=need_live):
            errors.append(
                (keyvals, probe_rejection(s.scope(keyvals), token, probe, need_live=need_live))
            )
    if not errors:  # a concurrent writer moved on between the write and the probe
        errors = [
            (k, probe_rejection(s.scope(k), token, p, need_live=need_live))
            for k, p in zip(keys, probes, strict=True)
        ]
    raise reject(events, mapper, token, errors, s.name, batch=len(keys) > 1)


def _wrote_all(
    conn: Connection, s: RowStatements, judge: Rewrite, keys: Sequence[tuple[Any, ...]], token: int
) -> bool:
    """Whether every row of a statement whose count came late holds the write's fence now.

    On SQLite the writer holds the database lock from its first write on, so a row that now
    holds ``token`` was written by this statement (``fence <= token`` passed), or held the
    token already, which the same predicate accepts. A key the database picks (``None``)
    is a new row, which an upsert cannot be refused.
    """
    for keyvals in keys:
        if None in keyvals:
            continue
        probe = _probe(conn, s, keyvals)
        if judge.kind == "delete" and not probe.exists:
            continue
        if not probe.exists or probe.fence != token:
            return False
        if (judge.kind != "delete") != probe.live:
            return False
    return True


def _counts_found(conn: Connection) -> bool:
    found = DIALECTS.get(conn.dialect.name)
    return found is not None and found.upsert_counts_found


def _upserted(
    conn: Connection, info: TableInfo, keys: Sequence[tuple[Any, ...]], count: int, token: int
) -> int:
    """The count of a flush's upsert on MariaDB or MySQL, as rows written (0 if one was not).

    They count the rows an upsert found (``CLIENT_FOUND_ROWS``): 1 for a row inserted,
    2 for a row changed, 1 for a row left as it was, which is a row at the token already
    (accepted: ``fence <= token``) or a refused one. Where the table's triggers are in
    place (checked before the first write) the judge refuses a stale upsert with an error,
    so a count between one and two per row is every row written. Under
    :data:`~fence.adapters._judge.WITHOUT_JUDGE` a row left as it was is proven by its
    fence, read with a lock (the transaction's snapshot may predate a newer holder's
    write): the token if the upsert passed.
    """
    n = len(keys)
    if count == 2 * n or (n <= count < 2 * n and not judged_without_triggers(conn)):
        return n
    if count < n or count > 2 * n:
        return 0
    s = info.statements
    query = select(*s.key, info.fence).where(info.keys_in(keys)).with_for_update()
    fences = {tuple(row[:-1]): row[-1] for row in conn.execute(query)}
    return n if all(fences.get(tuple(k)) == token for k in keys) else 0


def _snapshot_reads(conn: Connection) -> bool:
    """Whether a plain read in ``conn``'s transaction may see an older row than its writes
    do: InnoDB's ``REPEATABLE READ`` reads a snapshot, and writes the latest row. A verdict
    read there locks the row (``FOR SHARE``), which reads the latest; PostgreSQL refuses
    such a write instead (a serialization failure), SQLite has one writer."""
    return conn.dialect.name in SESSION_DIALECTS


def _probe(conn: Connection, s: RowStatements, keyvals: Sequence[Any]) -> Probe:
    query = s.probe()
    if _snapshot_reads(conn):
        query = query.with_for_update(read=True)
    row = conn.execute(query, s.key_params(keyvals)).first()
    if row is None:
        return ABSENT
    fence, dead = tuple(row)
    return Probe(exists=True, fence=fence, live=not dead)


def reject(
    events: EventBus,
    mapper: Mapper[Any] | None,
    token: int,
    errors: Sequence[tuple[tuple[Any, ...] | None, _FenceStale]],
    table: str,
    *,
    batch: bool,
) -> StaleTokenError:
    items = tuple(StaleTokenError.from_guard(err, mapper, key) for key, err in errors)
    if events.active:
        for item in items:
            events.emit(
                EventKind.WRITE_REJECTED,
                SOURCE,
                item.scope,
                token,
                reason=str(item.reason),
                fence=item.fence,
            )
    if not batch:
        return items[0]
    if len(items) == 1:  # one row of a batch: its key, and the batch's list
        only = items[0]
        return StaleTokenError.from_guard(batch_rejection(table, token, items), mapper, only.key)
    return StaleTokenError.from_guard(batch_rejection(table, token, items), mapper, None)


def judge_criteria(conn: Connection, judge: Rewrite, result: Any) -> None:
    """Judge a Core ``update()`` / ``delete()`` of a bound session by its row count."""
    found = bound(conn)
    if found is None:  # pragma: no cover - the statement was rewritten for a binding
        return
    info = judge.info
    count = getattr(result, "rowcount", -1)
    if count is None or count < 0:
        raise StaleTokenError(
            info.table.name,
            found.token,
            None,
            Reason.UNVERIFIABLE,
            message=f"{info.table.name}: the driver did not report the row count of a fenced "
            "update or delete, so it cannot be verified; roll back",
        )
    if count == 0:
        blockers = find_blockers(conn, info, judge.criteria, found.token)
        if blockers:
            errors = [
                (
                    key,
                    probe_rejection(
                        info.statements.scope(key), found.token, probe, need_live=judge.need_live
                    ),
                )
                for key, probe in blockers
            ]
            raise reject(found.events, None, found.token, errors, info.table.name, batch=True)
    elif found.events.active:
        found.events.emit(
            EventKind.WRITE_ACCEPTED, SOURCE, info.table.name, found.token, rows=count
        )


def judge_orm(
    state: ORMExecuteState,
    info: TableInfo,
    criteria: Any,
    result: Any,
    found: SessionBinding,
    mapper: Any,
    need_live: bool,
    *,
    keys: Any = None,
) -> None:
    """Judge an ORM-enabled ``update()`` / ``delete()`` by its row count."""
    token = found.token
    count = getattr(result, "rowcount", -1)
    if count is None or count < 0:
        raise StaleTokenError(
            info.table.name,
            token,
            None,
            Reason.UNVERIFIABLE,
            mapper=mapper,
            message=f"{info.table.name}: the driver did not report the row count of a fenced "
            "update or delete, so it cannot be verified; roll back",
        )
    if count == 0:
        conn = state.session.connection(bind_arguments=state.bind_arguments)
        blockers = find_blockers(conn, info, criteria, token, keys=keys)
        if blockers:
            errors = [
                (
                    key,
                    probe_rejection(info.statements.scope(key), token, probe, need_live=need_live),
                )
                for key, probe in blockers
            ]
            raise reject(found.events, mapper, token, errors, info.table.name, batch=True)
    elif found.events.active:
        found.events.emit(EventKind.WRITE_ACCEPTED, SOURCE, info.table.name, token, rows=count)


def find_blockers(
    conn: Connection, info: TableInfo, criteria: Any, token: int, *, keys: Any = None
) -> list[tuple[tuple[Any, ...], Probe]]:
    """The rows of ``info``'s table that ``criteria`` (or ``keys``) match whose fence is
    above ``token``, with their probes: what refused a criteria statement."""
    s = info.statements
    live = info.tombstone if info.tombstone is not None else false()
    query = select(*s.key, info.fence, live).where(info.fence > token)
    if _snapshot_reads(conn):
        query = query.with_for_update(read=True)
    if keys is not None:
        query = query.where(info.keys_in(keys))
    if criteria is not None:
        query = query.where(criteria)
    width = len(s.key)
    return [
        (tuple(row[:width]), Probe(True, row[width], not row[width + 1]))
        for row in conn.execute(query)
    ]


def unknown_shape(stmt: Any, table: Table) -> UnfencedWriteError:
    return UnfencedWriteError(
        f"the flush sent a {type(stmt).__name__.upper()} on {table.name} in a shape the "
        "fencing hook does not recognise (this SQLAlchemy version may build flush "
        "statements differently), so it cannot be fenced and was refused; nothing was "
        "written",
        scope=table.name,
    )


def bulk_refusal(guarded: gate.Guarded, path: str) -> UnfencedWriteError:
    return UnfencedWriteError(
        f"{path} on {guarded.describe()} is refused: these bulk paths bypass the flush "
        "events, so the fence cannot be set and the row counts of a batch cannot be judged "
        "row by row (C9). Use session.add_all() and flush, RowGuard.update_many / "
        "upsert_many (all or nothing), or a criteria session.execute(update(...).where(...))",
        scope=guarded.table.name,
    )


def read_refusal(found: SessionBinding, elem: Any) -> ReadLeaseError:
    table = gate.target_table(elem)
    path = f"a {type(elem).__name__.lower()} statement"
    return found.refusal(path, table.name if table is not None else None)
