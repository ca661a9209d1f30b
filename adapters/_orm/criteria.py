"""Criteria statements of a bound session: ORM-enabled ``update()`` / ``delete()``, and Core
ones sent on the session's connection outside a flush; and the tombstones hidden from ORM
queries.

A criteria statement gets the fence predicate and an all-or-nothing gate (every matched
row passes or none is written, C6) and is judged by its row count (``verdicts``). Inserts,
executemany and the bulk paths cannot be fenced row by row and are refused.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

from sqlalchemy import Delete, Insert, false, func, or_, select, update
from sqlalchemy.engine import Connection, Result
from sqlalchemy.orm import Mapper, ORMExecuteState, with_loader_criteria
from sqlalchemy.sql.dml import UpdateBase

from fence._errors import ConfigurationError, UnfencedWriteError
from fence._errors import StaleTokenError as _FenceStale

from .. import _sql_gate as gate
from .._sql_gate import FENCED_OPTIONS, Kind
from . import refusal
from .binding import BINDING_KEY, SessionBinding, bound, session_of
from .fenced import Dependent, MapperInfo, TableInfo, mapper_info, table_info
from .flush import flush_statement
from .span import CURRENT
from .verdicts import JUDGE, Rewrite, bulk_refusal, judge_orm, read_refusal

__all__ = ["INCLUDE_TOMBSTONES", "do_orm_execute", "session_statement"]


# -- Core statements on a bound session's connection --------------------------------------


def session_statement(
    conn: Connection,
    elem: Any,
    multiparams: list[dict[str, Any]],
    params: dict[str, Any],
    options: Mapping[str, Any],
) -> tuple[Any, list[dict[str, Any]], dict[str, Any]] | None:
    """The gate's hook: a flush statement, or a Core write of a session bound to a lease."""
    if not isinstance(elem, UpdateBase):
        return None
    current = CURRENT.get()
    if current is not None and session_of(conn) is current.session:
        if current.binding is not None and current.binding.read_only:
            raise read_refusal(current.binding, elem)
        return flush_statement(conn, current, elem, multiparams, params)
    found = bound(conn)
    if found is None:
        return None  # the gate's rules for a write without a token
    if found.read_only:
        raise read_refusal(found, elem)
    table = gate.target_table(elem)
    guarded = gate.classify(table) if table is not None else None
    path = f"a Core {type(elem).__name__.lower()}() in a session bound to a lease"
    if guarded is None:
        if found.allows(table):
            return elem, multiparams, params
        name = table.name if table is not None else type(elem).__name__
        raise gate.unfenced_table_refusal(f"table {name}", path)
    if guarded.kind is not Kind.FENCED:
        raise UnfencedWriteError(
            f"{path} writes {guarded.describe()}, which a Core statement cannot fence: "
            + (
                "use FenceRegister"
                if guarded.kind is Kind.REGISTER
                else f"write it through the ORM class {guarded.owner}"
            ),
            scope=guarded.table.name,
        )
    if isinstance(elem, Insert):
        raise UnfencedWriteError(
            f"{path} inserts into {guarded.describe()}: a Core insert cannot be fenced. Use "
            "session.add() (a fenced upsert) or RowGuard.upsert / upsert_many",
            scope=guarded.table.name,
        )
    if multiparams:
        raise bulk_refusal(guarded, f"{path} with a list of parameter sets")
    info = table_info(table)
    assert info is not None
    _refuse_managed_values(elem, info)
    new, need_live = _fenced_criteria(elem, info, found.token, found, None)
    criteria = getattr(elem, "whereclause", None)
    JUDGE[new] = Rewrite(info, "criteria", (), criteria=criteria, need_live=need_live)
    return new, multiparams, params


def _refuse_managed_values(stmt: Any, info: TableInfo) -> None:
    values = getattr(stmt, "_values", None) or {}
    names = {getattr(k, "key", k) for k in values}
    managed = {info.fence.key} | ({info.tombstone.key} if info.tombstone is not None else set())
    if names & managed:
        raise ConfigurationError(
            f"{sorted(names & managed)} of {info.table.name} are set by the hook from the "
            "token; leave them out of values()"
        )


# -- ORM-enabled update() and delete() ----------------------------------------------------


#: Execution option that lets an ORM query see tombstones (soft-deleted rows).
INCLUDE_TOMBSTONES = "include_tombstones"


def _hide_tombstones(state: ORMExecuteState) -> None:
    """Add ``NOT deleted`` for every fenced class with a tombstone column in the query.

    A soft-deleted row is deleted for the ORM: queries, ``get()`` and refreshes skip it.
    """
    if state.execution_options.get(INCLUDE_TOMBSTONES):
        return
    statement: Any = state.statement
    raw = getattr(statement, "_raw_columns", None)
    if raw is None:  # a FromStatement (select().from_statement(text(...)))
        mappers = state.all_mappers
    else:
        # The entities at the top level of a select(), as ORMExecuteState.all_mappers finds
        # them, read from the columns' annotations (all_mappers builds every column's
        # description: most of the cost of a get() in this hook).
        mappers = [ent.mapper for col in raw if (ent := col._annotations.get("parententity"))]
    options = [opt for opt in map(_tombstone_criteria, mappers) if opt is not None]
    if options:
        state.statement = statement.options(*dict.fromkeys(options))


_CRITERIA: weakref.WeakKeyDictionary[Mapper[Any], Any] = weakref.WeakKeyDictionary()


def _tombstone_criteria(mapper: Mapper[Any]) -> Any:
    """The ``NOT deleted`` loader criteria of a class, built once (``None``: no tombstones)."""
    try:
        return _CRITERIA[mapper]
    except KeyError:
        pass
    info = mapper_info(mapper)
    found = None
    if info is not None and info.table.tombstone is not None:
        found = with_loader_criteria(
            mapper.class_, info.table.tombstone == false(), include_aliases=True
        )
    _CRITERIA[mapper] = found
    return found


def do_orm_execute(state: ORMExecuteState) -> Result[Any] | None:
    if state.is_select:
        _hide_tombstones(state)
        return None
    if not (state.is_update or state.is_delete or state.is_insert):
        return None
    refusal.check(state.session)  # before the verdicts on the write itself
    stmt: Any = state.statement
    mapper = state.bind_mapper
    minfo = mapper_info(mapper) if mapper is not None else None
    table = gate.target_table(stmt)
    guarded = gate.classify(table) if table is not None else None
    found: SessionBinding | None = state.session.info.get(BINDING_KEY)
    if found is not None and found.read_only:
        raise found.refusal(
            "session.execute() of a write", table.name if table is not None else None
        )
    if found is None:
        if guarded is None or (guarded.kind is Kind.FENCED and guarded.optional):
            return None
        raise gate.unbound_refusal(guarded, "session.execute()")
    if guarded is None:
        return None  # the engine hook refuses it unless the binding names it unfenced
    if guarded.kind is Kind.REGISTER:
        raise gate.unbound_refusal(guarded, "session.execute()")
    if state.is_insert:
        raise bulk_refusal(guarded, "session.execute(insert(...))")
    if state.is_executemany:
        raise bulk_refusal(guarded, "session.execute(update(...), [rows])")
    sync = state.execution_options.get("synchronize_session", "auto")
    if sync == "evaluate":
        raise ConfigurationError(
            "synchronize_session='evaluate' cannot follow a fenced update or delete: its "
            "gate (every matched row passes or none is written) runs in the database. Use "
            "'auto', 'fetch' or False"
        )
    if guarded.kind is Kind.DEPENDENT:
        if minfo is None or table not in minfo.dependents:
            raise UnfencedWriteError(
                f"session.execute() writes {guarded.describe()}: write it through the ORM "
                f"class {guarded.owner}",
                scope=guarded.table.name,
            )
        try:
            return _dependent_criteria(state, stmt, minfo, minfo.dependents[table], found)
        except _FenceStale as err:
            refusal.refuse(state.session, err)
            raise
    info = table_info(table)
    assert info is not None
    token = found.token
    _refuse_managed_values(stmt, info)
    fenced, judge_live = _fenced_criteria(stmt, info, token, found, mapper)
    try:
        result = state.invoke_statement(statement=fenced.execution_options(**FENCED_OPTIONS))
        judge_orm(state, info, stmt.whereclause, result, found, mapper, judge_live)
    except _FenceStale as err:
        refusal.refuse(state.session, err)
        raise
    return result


def _fenced_criteria(
    stmt: Any, info: TableInfo, token: int, found: SessionBinding, mapper: Any
) -> tuple[Any, bool]:
    """The criteria statement with the fence predicate and the all-or-nothing gate."""
    s = info.statements
    fence = info.fence
    criteria = stmt.whereclause
    locked = select(fence.label("f")).select_from(s.table)
    if criteria is not None:
        locked = locked.where(criteria)
    locked_sub = locked.order_by(*s.key).with_for_update().subquery("fence_locked")
    blocking = (
        select(func.count()).select_from(locked_sub).where(locked_sub.c.f > token).scalar_subquery()
    )
    gate_terms = (fence <= token, blocking == 0)
    if isinstance(stmt, Delete):
        if info.tombstone is None:
            if not found.claim:
                raise ConfigurationError(
                    f"a fenced delete on {s.name} needs a tombstone column or a register "
                    "claim (bind(..., claim=True))"
                )
            return stmt.where(*gate_terms), False
        soft = update(mapper.class_ if mapper is not None else s.table)
        if criteria is not None:
            soft = soft.where(criteria)
        soft = soft.where(*gate_terms).values({fence: token, info.tombstone: True})
        # The CTEs added to the delete ride on its soft delete, where the gate reads them.
        for cte, opts in zip(stmt._independent_ctes, stmt._independent_ctes_opts, strict=True):
            soft = soft.add_cte(cte, nest_here=opts.nesting)
        return soft.execution_options(**stmt.get_execution_options()), False
    return stmt.where(*gate_terms, info.live()).values({fence: token}), True


def _matched_keys(mapper: Mapper[Any], info: TableInfo, criteria: Any) -> Any:
    """The fence-table keys of the rows of ``mapper`` that ``criteria`` match."""
    attrs = [mapper.get_property_by_column(c).class_attribute for c in info.statements.key]
    query = select(*attrs)
    return query.where(criteria) if criteria is not None else query


def _dependent_criteria(
    state: ORMExecuteState, stmt: Any, minfo: MapperInfo, dep: Dependent, found: SessionBinding
) -> Result[Any]:
    """An ORM update or delete of a class whose fence is in another of its tables.

    Two statements: first the fence rows of every matched row are raised to the token
    (and made tombstones for a delete), all or none (the same gate as a single table);
    then the statement runs on the rows whose fence now holds the token.
    """
    info = minfo.table
    token = found.token
    mapper = state.bind_mapper
    assert mapper is not None
    if gate.writing_ctes(stmt):
        raise UnfencedWriteError(
            f"session.execute() of {type(stmt).__name__.lower()}({mapper.class_.__name__}) "
            "carries a data-modifying CTE: the statement of a joined subclass runs as two "
            "statements, and the hook fences their own tables, not a CTE's writes. Write "
            "that table with a statement of its own",
            scope=info.table.name,
        )
    is_delete = isinstance(stmt, Delete)
    keys = _matched_keys(mapper, info, stmt.whereclause)
    fence = info.fence
    live = info.tombstone if info.tombstone is not None else false()
    locked = (
        select(fence.label("f"), live.label("dead"))
        .where(info.keys_in(keys))
        .order_by(*info.statements.key)
        .with_for_update()
        .subquery("fence_locked")
    )
    blocked = locked.c.f > token if is_delete else or_(locked.c.f > token, locked.c.dead)
    blocking = select(func.count()).select_from(locked).where(blocked).scalar_subquery()
    values: dict[Any, Any] = {fence: token}
    if is_delete and info.tombstone is not None:
        values[info.tombstone] = True
    raise_fences = (
        update(info.table)
        .where(info.keys_in(keys), blocking == 0)
        .values(values)
        .execution_options(**FENCED_OPTIONS)
    )
    conn = state.session.connection(bind_arguments=state.bind_arguments)
    raised = conn.execute(raise_fences)
    if raised.rowcount == 0:
        judge_orm(state, info, None, raised, found, mapper, not is_delete, keys=keys)
    passing = dep.exists(info, fence == token)
    return state.invoke_statement(statement=stmt.where(passing).execution_options(**FENCED_OPTIONS))
