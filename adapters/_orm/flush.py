"""Statements of a flush, rewritten for a fenced table, and the version column's drop-in.

Inside a flush the gate's engine hook hands this module every insert, update and delete
of the session: for a fenced table it becomes ``fence <= :token`` on UPDATE, a soft delete
(or a fenced hard delete) for DELETE, ``ON CONFLICT ... WHERE fence <= excluded.fence`` for
INSERT (MariaDB, MySQL: ``ON DUPLICATE KEY UPDATE`` with each column set only where the
fence passes); for the other tables of a fenced class, an ``EXISTS`` on the fence row. Each
rewrite is built once per statement the ORM caches, and recorded with how it is judged
(``verdicts``). A statement shape the hook does not know is refused.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    BinaryExpression,
    BindParameter,
    Column,
    Delete,
    Executable,
    Insert,
    Table,
    Update,
    bindparam,
)
from sqlalchemy.engine import Connection
from sqlalchemy.sql import operators
from sqlalchemy.sql.elements import BooleanClauseList
from sqlalchemy.sql.visitors import replacement_traverse

from fence._errors import ConfigurationError
from fence._sql_dialect import DIALECTS

from .. import _sql_gate as gate
from .._sql_gate import Kind
from .._sql_statements import FENCE_INFO, OPTIONAL_INFO, fenced_upsert
from .fenced import Dependent, TableInfo, owner_of, table_info
from .span import CURRENT, Flush
from .verdicts import DONE, JUDGE, Rewrite, bulk_refusal, unknown_shape

__all__ = ["fenced_version", "flush_statement"]

_TOKEN = "_token"  # noqa: S105 - the bind parameter of the token, as in the row guard's statements


def fenced_version(column: Any, **mapper_args: Any) -> dict[str, Any]:
    """``__mapper_args__`` that turn an optimistic-concurrency model into a fenced one.

    The drop-in for ``{"version_id_col": version}``: rename the version column to
    ``fence`` (``BIGINT``) and write::

        class Account(Base):
            __tablename__ = "accounts"
            id: Mapped[int] = mapped_column(primary_key=True)
            fence: Mapped[int] = mapped_column(BigInteger, nullable=False)
            __mapper_args__ = fenced_version(fence)

    In a session bound to a lease (:func:`bind`) the column is a fence: writes carry
    ``fence <= :token`` and set it to the token. In an unbound session the model keeps
    plain optimistic concurrency: each UPDATE checks ``fence = :read_value`` and adds 1,
    and a lost race raises :class:`~sqlalchemy.orm.exc.StaleDataError` as before.

    Args:
        column: the ``mapped_column()`` or :class:`~sqlalchemy.Column` to use.
        mapper_args: more mapper arguments to merge in.

    Returns:
        A dict for ``__mapper_args__``.

    Raises:
        ConfigurationError: ``column`` is not a column.
    """
    col = getattr(column, "column", column)
    if not isinstance(col, Column):
        raise ConfigurationError(f"fenced_version() needs a column, got {column!r}")
    col.info[FENCE_INFO] = True
    col.info[OPTIONAL_INFO] = True
    return {"version_id_col": column, "version_id_generator": _next_version, **mapper_args}


def _next_version(current: int | None) -> int:
    """The next version: the token in a bound flush, else the plain step (``+ 1``)."""
    flush = CURRENT.get()
    if flush is not None and flush.binding is not None:
        return flush.binding.token
    return (current or 0) + 1


def _replace_version(stmt: Any, info: TableInfo, token: BindParameter[Any]) -> tuple[Any, bool]:
    """Swap the ORM's ``version = :read`` for ``fence <= :token`` (the drop-in model)."""
    fence = info.fence
    swapped = False

    def swap(element: Any, **kw: Any) -> Any:
        nonlocal swapped
        if (
            isinstance(element, BinaryExpression)
            and element.left is fence
            and element.operator is operators.eq
            and isinstance(element.right, BindParameter)
        ):
            swapped = True
            return fence <= token
        return None

    opts: dict[str, Any] = {}
    new = replacement_traverse(stmt, opts, swap)
    return new, swapped


def _rewrite_update(stmt: Update, info: TableInfo) -> Executable:
    token = bindparam(_TOKEN, type_=info.fence.type)
    new, swapped = _replace_version(stmt, info, token)
    if not swapped:
        new = new.where(info.fence <= token)
    return new.where(info.live())  # type: ignore[no-any-return]


def _rewrite_hard_delete(stmt: Delete, info: TableInfo) -> Executable:
    token = bindparam(_TOKEN, type_=info.fence.type)
    new, swapped = _replace_version(stmt, info, token)
    return new if swapped else new.where(info.fence <= token)  # type: ignore[no-any-return]


def _dialect_insert(dialect: str) -> type[Any]:
    found = DIALECTS.get(dialect)
    if found is None:
        labels = " or ".join(d.label for d in DIALECTS.values())
        raise ConfigurationError(
            f"a fenced flush of new rows needs ON CONFLICT: {labels}, not {dialect}"
        )
    return found.insert_class


def _as_upsert(stmt: Insert, dialect: str) -> Any:
    """The ORM's INSERT as a dialect insert, keeping its RETURNING and defaults settings."""
    cls = _dialect_insert(dialect)
    base = object.__new__(cls)
    base.__dict__ = stmt._generate().__dict__  # the ORM's state, without memoized keys
    return base


def _rewrite_insert(stmt: Insert, info: TableInfo, dialect: str) -> Executable:
    """The ORM's INSERT as a fenced upsert."""
    base = _as_upsert(stmt, dialect)
    s = info.statements
    if not hasattr(base, "on_conflict_do_update"):  # MariaDB, MySQL: ON DUPLICATE KEY UPDATE
        names = [c.key for c in s.table.columns if c.key not in s.key_set]
        return fenced_upsert(base, list(s.key), names, info.fence)  # type: ignore[no-any-return]
    excluded = base.excluded
    return base.on_conflict_do_update(  # type: ignore[no-any-return]
        index_elements=list(s.key),
        set_={c.key: excluded[c.key] for c in s.table.columns if c.key not in s.key_set},
        where=info.fence <= excluded[info.fence.key],
    )


def _rewrite_dependent(stmt: Any, dep: Dependent, info: TableInfo, dialect: str) -> Any:
    """A flush statement on another table of a fenced class, tied to the fence row.

    An UPDATE or DELETE runs only where the fence row passes (``EXISTS``), and is judged
    by its row count. An INSERT replaces the row (as the fence table's upsert does); the
    fence row's own upsert in the same flush judges the token, and a refusal rolls the
    whole flush back.
    """
    if isinstance(stmt, Insert):
        base = _as_upsert(stmt, dialect)
        keys = list(dep.table.primary_key.columns)
        others = [c for c in dep.table.columns if c not in keys]
        if not hasattr(base, "on_conflict_do_update"):  # MariaDB, MySQL
            # Without other columns the key is set to itself: a conflict changes nothing.
            sets = [(c.key, base.inserted[c.key]) for c in others or keys]
            return base.on_duplicate_key_update(sets)
        if not others:
            return base.on_conflict_do_nothing(index_elements=keys)
        return base.on_conflict_do_update(
            index_elements=keys, set_={c.key: base.excluded[c.key] for c in others}
        )
    token = bindparam(_TOKEN, type_=info.fence.type)
    passing = dep.exists(info, info.fence <= token)
    if isinstance(stmt, Update):
        passing = passing.where(info.live())
    return stmt.where(passing)


def _key_eq_params(stmt: Any, table: Table) -> dict[str, str] | None:
    """The bind parameter of each key column in ``stmt``'s ``WHERE key = :p AND ...``.

    ``None`` when the criteria are not that shape: the hook judges a flush statement by
    the keys in its parameters, so it must know where they are.
    """
    where = getattr(stmt, "whereclause", None)
    if where is None:
        return None
    terms = list(where.clauses) if isinstance(where, BooleanClauseList) else [where]
    found: dict[str, str] = {}
    for term in terms:
        if (
            isinstance(term, BinaryExpression)
            and term.operator is operators.eq
            and isinstance(term.left, Column)
            and term.left.table is table
            and isinstance(term.right, BindParameter)
        ):
            found[term.left.key] = term.right.key
    if not all(c.key in found for c in table.primary_key.columns):
        return None
    return found


def flush_statement(
    conn: Connection,
    current: Flush,
    elem: Any,
    multiparams: list[dict[str, Any]],
    params: dict[str, Any],
) -> tuple[Any, list[dict[str, Any]], dict[str, Any]] | None:
    """Rewrite an insert, update or delete sent by a flush (or refuse it)."""
    if elem in JUDGE or elem in DONE:
        return elem, multiparams, params
    table = gate.target_table(elem)
    guarded = gate.classify(table) if table is not None else None
    found = current.binding
    if guarded is None:
        if found is not None and not found.allows(table):
            name = table.name if table is not None else type(elem).__name__
            raise gate.unfenced_table_refusal(f"table {name}", "a flush")
        return elem, multiparams, params
    assert table is not None
    if guarded.kind is Kind.REGISTER:
        raise gate.unbound_refusal(guarded, "a flush")
    if found is None:
        if guarded.optional:
            return elem, multiparams, params  # a fenced_version() model without a lease
        if not current.flushing:
            raise bulk_refusal(guarded, "Session.bulk_save_objects / bulk_*_mappings")
        raise gate.unbound_refusal(guarded, "a flush")
    if not current.flushing:
        raise bulk_refusal(guarded, "Session.bulk_save_objects / bulk_*_mappings")
    token = found.token
    rows = multiparams or [params]
    if guarded.kind is Kind.DEPENDENT:
        return _flush_dependent(conn, current, elem, table, rows, token)
    info = table_info(table)
    assert info is not None
    s = info.statements
    fence_key = info.fence.key
    if isinstance(elem, Update):
        new = info.rewrites.get(elem)
        if new is None:
            where = _key_eq_params(elem, table)
            if where is None:
                raise unknown_shape(elem, table)
            new = info.rewrites[elem] = _rewrite_update(elem, info)
            JUDGE[new] = Rewrite(info, "update", tuple(where[c.key] for c in s.key))
        rows = [{**p, fence_key: token, _TOKEN: token} for p in rows]
    elif isinstance(elem, Delete):
        if info.tombstone is not None:
            new = info.rewrites.get(Delete)
            if new is None:
                # The guard's soft delete, as a statement of the hook's own.
                new = s.raise_fence(delete=True, returning=False).execution_options()
                info.rewrites[Delete] = new
                JUDGE[new] = Rewrite(info, "delete", tuple(f"_key_{c.key}" for c in s.key))
            where = _key_eq_params(elem, table)
            if where is None:
                raise unknown_shape(elem, table)
            rows = [s.params([p[where[c.key]] for c in s.key], token, {}) for p in rows]
        else:
            new = info.rewrites.get(elem)
            if new is None:
                where = _key_eq_params(elem, table)
                if where is None:
                    raise unknown_shape(elem, table)
                new = info.rewrites[elem] = _rewrite_hard_delete(elem, info)
                JUDGE[new] = Rewrite(info, "delete", tuple(where[c.key] for c in s.key))
            rows = [{**p, _TOKEN: token} for p in rows]
    elif isinstance(elem, Insert):
        if elem.select is not None:
            raise unknown_shape(elem, table)
        new = info.rewrites.get(elem)
        if new is None:
            new = info.rewrites[elem] = _rewrite_insert(elem, info, conn.dialect.name)
            JUDGE[new] = Rewrite(info, "insert", tuple(c.key for c in s.key))
        rows = [{**p, fence_key: token} for p in rows]
    else:
        raise unknown_shape(elem, table)
    current.rowcount = 0
    if len(rows) == 1:
        return new, [], rows[0]
    return new, rows, {}


def _flush_dependent(
    conn: Connection,
    current: Flush,
    elem: Any,
    table: Table,
    rows: list[dict[str, Any]],
    token: int,
) -> tuple[Any, list[dict[str, Any]], dict[str, Any]]:
    owner = owner_of(table)
    if owner is None:
        raise unknown_shape(elem, table)
    info, dep = owner
    new = dep.rewrites.get(elem)
    if new is None:
        if isinstance(elem, Insert):
            if elem.select is not None:
                raise unknown_shape(elem, table)
            new = _rewrite_dependent(elem, dep, info, conn.dialect.name)
            DONE.add(new)
        elif isinstance(elem, Update | Delete):
            where = _key_eq_params(elem, table)
            if where is None:
                raise unknown_shape(elem, table)
            by_column = {d.key: where[d.key] for _, d in dep.link}
            new = _rewrite_dependent(elem, dep, info, conn.dialect.name)
            kind = "update" if isinstance(elem, Update) else "delete"
            JUDGE[new] = Rewrite(info, kind, tuple(by_column[d.key] for _, d in dep.link))
        else:
            raise unknown_shape(elem, table)
        dep.rewrites[elem] = new
    if new in JUDGE:
        current.rowcount = 0
        rows = [{**p, _TOKEN: token} for p in rows]
    if len(rows) == 1:
        return new, [], rows[0]
    return new, rows, {}
