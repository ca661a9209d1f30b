"""The gate: every write SQLAlchemy sends to fenced storage is fenced or refused (C9).

Fenced storage is every table with a fence column (:func:`fence_of`), every fence register
and every other table of a mapped class whose fence lives in one of them (the subclass
table of joined inheritance). The gate sits on the engine events of every
:class:`~sqlalchemy.Engine`, in two places:

1. ``before_execute`` sees each statement object. Inserts, updates and deletes of fenced
   tables go to the session hook when one is installed (it fences what a session bound to
   a lease sends, see ``_orm``); without a binding they are refused with
   :class:`fence.TokenRequiredError` before any I/O.
2. ``before_cursor_execute`` sees the SQL text about to be sent, also for
   ``exec_driver_sql`` (which has no statement object) and for statements whose writes
   hide in a common table expression. It reads the text (``_sql_lex``) and refuses a
   write to fenced storage that step 1 did not judge: every write of the text but one of
   the statement's own table. A data-modifying CTE riding on a statement (wherever it
   hangs; also one that writes the statement's own table again) is judged as a
   statement of its own would be, except that a bound session cannot fence it: the hook
   fences a statement's own table, and the rows a CTE writes are not counted.

Two execution options pass the gate: :data:`UNFENCED`, the documented opt-out for a
deliberate unfenced write, and :data:`OWN`, which marks the guards' and the hook's own
statements (a user's statement the hook fenced, :data:`FENCED_OPTIONS`, passes step 1
only). Neither passes a statement of a transaction the session hook found refused
(:data:`REFUSED`): every statement on its connections is refused, before either step,
until it is rolled back (``exec_driver_sql``, which has no step 1, at step 2). Installing
the gate is idempotent; importing ``fence.adapters.sql`` or ``fence.adapters.orm`` does
it.
"""

from __future__ import annotations

import enum
import gc
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Column, Engine, Table, event
from sqlalchemy.engine import Connection
from sqlalchemy.sql import visitors
from sqlalchemy.sql.dml import UpdateBase
from sqlalchemy.sql.elements import (
    ReleaseSavepointClause,
    RollbackToSavepointClause,
    SavepointClause,
    TextClause,
)
from sqlalchemy.sql.selectable import CTE, Alias, TextualSelect

from fence._errors import TokenRequiredError, UnfencedWriteError

from ._sql_lex import Target, write_targets
from ._sql_statements import DEFAULT_REGISTER, OPTIONAL_INFO, REGISTER_INFO, fence_of

__all__ = [
    "OWN",
    "REFUSED",
    "UNFENCED",
    "Guarded",
    "Kind",
    "classify",
    "install",
    "mark_dependent",
    "mark_register",
    "target_table",
]

#: Execution option for a deliberate unfenced write: ``stmt.execution_options(unfenced=True)``
#: or ``session.execute(stmt, execution_options={"unfenced": True})``. The gate lets it
#: through; nothing fences it.
UNFENCED = "unfenced"

#: Execution option on the statements of the guards and the session hook themselves.
OWN = "iofence"

#: ``{OWN: True}``, passed to ``execute()`` by the guards.
OWN_OPTIONS: Mapping[str, Any] = {OWN: True}

#: ``{OWN: "fenced"}``, on a user's statement the session hook fenced (an ORM
#: ``update()`` / ``delete()`` of a bound session, with its fence predicate): the first
#: listener passes it, and the second still reads its text for any write besides its own
#: table (a data-modifying CTE riding on it, wherever it hangs).
FENCED_OPTIONS: Mapping[str, Any] = {OWN: "fenced"}


class Kind(enum.Enum):
    """How a table is fenced.

    Attributes:
        FENCED: it has a fence column; each row is its own fence scope.
        REGISTER: a fence register; only the register and the hook's claim write it.
        DEPENDENT: a table of a mapped class whose fence lives in another of its tables
            (joined inheritance); only a flush or an ORM statement of that class can
            fence its rows.
    """

    FENCED = "fenced"
    REGISTER = "register"
    DEPENDENT = "dependent"


@dataclass(frozen=True, slots=True)
class Guarded:
    """A table the gate guards.

    Attributes:
        table: the table.
        kind: a :class:`Kind`.
        optional: a :func:`fence.adapters.orm.fenced_version` table: without a token it
            keeps plain optimistic concurrency, so unbound writes pass.
        owner: for a dependent table, the mapped class whose fence covers it.
    """

    table: Table
    kind: Kind
    optional: bool = False
    owner: str | None = None

    def describe(self) -> str:
        """A few words naming the table and why it is fenced, for error messages."""
        name = _display(self.table)
        if self.kind is Kind.REGISTER:
            return f"the fence register {name}"
        if self.kind is Kind.DEPENDENT:
            return f"{name}, a table of the fenced class {self.owner}"
        return f"the fenced table {name}"


# -- what is fenced -------------------------------------------------------------------------

_CLASSIFIED: weakref.WeakKeyDictionary[Table, Guarded | None] = weakref.WeakKeyDictionary()
_DEPENDENT: weakref.WeakKeyDictionary[Table, str] = weakref.WeakKeyDictionary()
# Lower-cased table name -> the tables of that name that may be guarded, for raw SQL.
_BY_NAME: dict[str, weakref.WeakSet[Table]] = {}


def _display(table: Table) -> str:
    return f"{table.schema}.{table.name}" if table.schema else table.name


def _remember(table: Table) -> None:
    _BY_NAME.setdefault(table.name.lower(), weakref.WeakSet()).add(table)


def classify(table: Any) -> Guarded | None:
    """How ``table`` is fenced, or ``None`` for a table the gate leaves alone.

    Raises:
        ConfigurationError: the table marks more than one fence column.
    """
    try:
        return _CLASSIFIED[table]
    except KeyError:
        pass
    except TypeError:  # not weak-referenceable: not a Table
        return None
    found: Guarded | None = None
    if isinstance(table, Table):
        if table.info.get(REGISTER_INFO):
            found = Guarded(table, Kind.REGISTER)
        else:
            fence = fence_of(table)
            if fence is not None:
                found = Guarded(table, Kind.FENCED, optional=bool(fence.info.get(OPTIONAL_INFO)))
            elif table in _DEPENDENT:
                found = Guarded(table, Kind.DEPENDENT, owner=_DEPENDENT[table])
        if found is not None:
            _remember(table)
    _CLASSIFIED[table] = found
    return found


def forget(table: Table) -> None:
    """Classify ``table`` again at its next use (a column was added, a mark changed)."""
    _CLASSIFIED.pop(table, None)


def mark_dependent(table: Table, owner: str) -> None:
    """Record that ``table`` belongs to the fenced mapped class ``owner`` (joined inheritance)."""
    if table not in _DEPENDENT:
        _DEPENDENT[table] = owner
        forget(table)
        classify(table)


def mark_register(table: Table) -> None:
    """Record that ``table`` is a fence register, written only by the register and claims."""
    if not table.info.get(REGISTER_INFO):
        table.info[REGISTER_INFO] = True
        forget(table)
    classify(table)


def target_table(elem: Any) -> Table | None:
    """The table an insert, update or delete writes, through aliases."""
    table = getattr(elem, "table", None)
    while isinstance(table, Alias):
        table = table.element
    return table if isinstance(table, Table) else None


def _lookup(target: Target) -> Guarded | None:
    for table in list(_BY_NAME.get(target.name, ())):
        if target.schema is not None and table.schema and table.schema.lower() != target.schema:
            continue
        found = classify(table)
        if found is not None:
            return found
    return None


# -- the session hook's part -------------------------------------------------------------

#: The session hook (``_orm``) when installed: ``(conn, elem, multiparams, params,
#: options)`` -> the statement to run instead (a triple, as ``before_execute`` returns), or
#: ``None`` to leave the statement to the gate.
Hook = Callable[
    [Connection, Any, list[dict[str, Any]], dict[str, Any], Mapping[str, Any]],
    tuple[Any, list[dict[str, Any]], dict[str, Any]] | None,
]

#: The session hook's answer to "is this connection a session bound to a lease, and may
#: that session write this table?": ``None`` if unbound, else a callable taking a table
#: name (lower case) that says whether the binding names it as unfenced.
BindingOf = Callable[[Connection], Callable[[Target], bool] | None]

#: The session hook's answer to "does this connection serve a transaction that was
#: refused?": the error to raise for any statement on it, or ``None``.
RefusedOf = Callable[[Connection], Exception | None]

_hooks: dict[str, Any] = {"execute": None, "binding": None, "refused": None}

#: The transactions the session hook found refused, by weak reference to its records
#: (``_orm.refusal``). Every statement of the process asks whether the set is empty; only
#: while it is not does the hook look for the statement's transaction in it.
REFUSED: set[weakref.ref[Any]] = set()


def set_hooks(execute: Hook, binding: BindingOf, refused: RefusedOf) -> None:
    """Install the session hook's parts of the gate (``_orm.install`` calls it)."""
    _hooks["execute"] = execute
    _hooks["binding"] = binding
    _hooks["refused"] = refused


def _binding(conn: Connection) -> Callable[[Target], bool] | None:
    found: BindingOf | None = _hooks["binding"]
    return found(conn) if found is not None else None


# -- refusals -----------------------------------------------------------------------------

_HOW = (
    "Write it through a RowGuard (fence.adapters.sql), in a session bound to a lease "
    "(fence.adapters.orm.bind), or mark a deliberate unfenced write with "
    ".execution_options(unfenced=True)"
)


def unbound_refusal(guarded: Guarded, path: str) -> TokenRequiredError:
    """The error for a write to fenced storage that carries no token."""
    if guarded.kind is Kind.REGISTER:
        return UnfencedWriteError(
            f"{path} writes {guarded.describe()}: fence registers are written only by "
            "FenceRegister.claim and the session hook's claim, so that no write can lower "
            "a fence. Use FenceRegister, or .execution_options(unfenced=True) for a "
            "deliberate repair",
            scope=guarded.table.name,
        )
    return TokenRequiredError(
        f"{path} writes {guarded.describe()} without a fencing token. {_HOW}",
        scope=guarded.table.name,
    )


def raw_refusal(guarded: Guarded | None, target: str, path: str) -> UnfencedWriteError:
    """The error for raw SQL that writes fenced storage in a bound session."""
    what = guarded.describe() if guarded is not None else f"table {target}"
    return UnfencedWriteError(
        f"{path} writes {what}, and the session is bound to a lease, but raw SQL cannot "
        "carry the fence: the hook cannot read it. Use the ORM or a Core update()/delete() "
        "(fenced by the hook), a RowGuard, or .execution_options(unfenced=True) for a "
        "deliberate unfenced write",
        scope=target,
    )


def cte_refusal(guarded: Guarded, path: str) -> UnfencedWriteError:
    """The error for a data-modifying CTE that writes fenced storage in a bound session."""
    return UnfencedWriteError(
        f"{path} writes {guarded.describe()} in a session bound to a lease: the hook "
        "fences a statement's own table, not the writes of a CTE riding on it (their rows "
        "are not counted, so they cannot be judged), and a fence register is written only "
        "by FenceRegister and the claim. Write that table with a statement of its own, or "
        "mark a deliberate unfenced write with .execution_options(unfenced=True)",
        scope=guarded.table.name,
    )


def unfenced_table_refusal(target: str, path: str) -> UnfencedWriteError:
    """The error for a bound session writing a table that has no fence."""
    return UnfencedWriteError(
        f"{path} writes {target}, which has no fence column, in a session bound to a "
        "lease: the write would not be fenced. Add a fence column (fence_column()), or "
        "name the table as unfenced: bind(session, lease, unfenced=[...])",
        scope=target,
    )


# -- the two listeners --------------------------------------------------------------------


_SAVEPOINT_CLAUSES = (SavepointClause, RollbackToSavepointClause, ReleaseSavepointClause)


def _refuse_if_refused(conn: Connection, elem: Any) -> None:
    """Raise the session hook's error if ``conn`` serves a transaction it found refused.

    Checked before the opt-outs: a refused transaction refuses everything until it is
    rolled back. A savepoint writes nothing, and SQLAlchemy rolls a failed flush back to
    one, so it passes.
    """
    if isinstance(elem, _SAVEPOINT_CLAUSES):
        return
    refused: RefusedOf = _hooks["refused"]
    err = refused(conn)
    if err is not None:
        raise err


def _passes(options: Mapping[str, Any]) -> bool:
    return bool(options.get(OWN) or options.get(UNFENCED))


def _before_execute(
    conn: Connection,
    elem: Any,
    multiparams: list[dict[str, Any]],
    params: dict[str, Any],
    execution_options: Mapping[str, Any],
) -> tuple[Any, list[dict[str, Any]], dict[str, Any]]:
    if REFUSED:
        _refuse_if_refused(conn, elem)
    if _passes(execution_options):
        return elem, multiparams, params
    hook: Hook | None = _hooks["execute"]
    if hook is not None:
        handled = hook(conn, elem, multiparams, params, execution_options)
        if handled is not None:
            return handled
    if not isinstance(elem, UpdateBase):
        return elem, multiparams, params
    table = target_table(elem)
    guarded = classify(table) if table is not None else None
    if guarded is None or (guarded.kind is Kind.FENCED and guarded.optional):
        return elem, multiparams, params
    raise unbound_refusal(guarded, f"a Core {type(elem).__name__.lower()}()")


def _before_cursor_execute(
    conn: Connection,
    cursor: Any,
    statement: str,
    parameters: Any,
    context: Any,
    executemany: bool,
) -> None:
    if REFUSED and (context is None or context.compiled is None):
        _refuse_if_refused(conn, None)  # exec_driver_sql, which has no before_execute
    elem = None
    if context is not None:
        options = context.execution_options
        if options.get(OWN) is True or options.get(UNFENCED):
            return  # FENCED_OPTIONS go on: the hook judged only the statement's own table
        compiled = context.compiled
        elem = compiled.statement if compiled is not None else None
    writes = write_targets(statement)
    if not writes.writes:
        return
    # The table of an insert, update or delete statement was judged by _before_execute (or
    # fenced by the session hook); every other write of its text was not: a data-modifying
    # CTE, also one that writes that same table once more.
    others = writes.occurrences
    if isinstance(elem, UpdateBase):
        others = _without_own(others, target_table(elem))
        if not others and not writes.unknown:
            return
    raw = elem is None or isinstance(elem, TextClause | TextualSelect)
    path = "raw SQL" if raw else _cte_path(elem)
    allows = _binding(conn)
    for target in dict.fromkeys(others):
        guarded = _lookup(target)
        if allows is None:
            if guarded is not None and not (guarded.kind is Kind.FENCED and guarded.optional):
                raise unbound_refusal(guarded, path)
        elif guarded is not None:
            raise raw_refusal(guarded, target.name, path) if raw else cte_refusal(guarded, path)
        elif not allows(target):
            raise unfenced_table_refusal(target.name, path)
    if writes.unknown:
        if allows is not None:
            raise raw_refusal(None, "an unknown table", f"{path} whose writes cannot be read")
        for name in writes.names:
            guarded = _lookup(Target(None, name))
            if guarded is not None and not (guarded.kind is Kind.FENCED and guarded.optional):
                raise unbound_refusal(guarded, f"{path} whose writes cannot be read")


def _without_own(writes: tuple[Target, ...], table: Table | None) -> tuple[Target, ...]:
    """``writes`` less one write of ``table`` (a statement writes its own table once),
    named with its schema if one is, else by its name alone."""
    if table is None:
        return writes
    name = table.name.lower()
    schema = table.schema.lower() if table.schema else None
    for loose in (False, True):
        for i, target in enumerate(writes):
            if target.name == name and (
                target.schema == schema or (loose and (target.schema is None or schema is None))
            ):
                return writes[:i] + writes[i + 1 :]
    return writes


def _cte_path(elem: Any) -> str:
    """How an error names a statement object whose text writes more than its own table."""
    keyword = getattr(getattr(elem, "keyword", None), "value", None)  # UNION, EXCEPT, ...
    kind = str(keyword or type(elem).__name__).lower()
    return f"a data-modifying CTE riding on {kind}()"


def writing_ctes(elem: Any) -> list[CTE]:
    """The data-modifying CTEs of a statement object, wherever they hang (added to it, in
    a subquery, a ``values()``, another CTE), and those of SQL text (``text().cte()``)
    that the lexer finds writing."""
    found = []
    for item in visitors.iterate(elem):
        if isinstance(item, CTE):
            inner = item.element
            text = inner.element if isinstance(inner, TextualSelect) else None
            if isinstance(inner, UpdateBase) or (
                isinstance(text, TextClause) and write_targets(text.text).writes
            ):
                found.append(item)
    return list(dict.fromkeys(found))


def _column_attached(column: Column[Any], table: Any) -> None:
    if isinstance(table, Table):
        forget(table)
        if classify(table) is not None:
            _remember(table)


_INSTALLED = False


def install() -> None:
    """Install the gate's listeners (once per process).

    They are class-level listeners on :class:`~sqlalchemy.Engine` (every engine, also
    under an ``AsyncEngine``) and on :class:`~sqlalchemy.Column` (to learn of fence
    columns as tables are defined). Tables defined before the gate was installed are found
    once, here.
    """
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    event.listen(Engine, "before_execute", _before_execute, retval=True)
    event.listen(Engine, "before_cursor_execute", _before_cursor_execute)
    event.listen(Column, "after_parent_attach", _column_attached)
    classify(DEFAULT_REGISTER)
    # Tables defined before this module was imported: a one-time look at live objects, so
    # that import order cannot leave a fenced table unknown to the raw-SQL check.
    for obj in gc.get_objects():
        if isinstance(obj, Table):
            classify(obj)
