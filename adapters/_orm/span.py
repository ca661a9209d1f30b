"""The span of a flush: which flush of which session runs now, and what it may write.

``before_flush`` refuses writes without a token, and writes of unfenced models in a bound
session (C9), before any I/O, and every flush of a refused transaction (``refusal``). A
flush (and a legacy bulk save) runs in an inner transaction of the session: its start and
end mark the span (:data:`CURRENT`) in which the engine hook rewrites statements
(``flush``) and judges them (``verdicts``). The mapper events set the fence attribute to
the token, so the ORM writes it and keeps it in the identity map.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from sqlalchemy.engine import Connection
from sqlalchemy.orm import Mapper, Session, SessionTransaction
from sqlalchemy.orm.attributes import flag_modified, instance_state

from fence._errors import ConfigurationError, TokenRequiredError

from .. import _sql_gate as gate
from . import refusal
from .binding import BINDING_KEY, READ_CHECK_KEY, SessionBinding
from .fenced import MapperInfo, mapper_info, tables_of

__all__ = [
    "CURRENT",
    "Flush",
    "after_transaction_create",
    "after_transaction_end",
    "before_flush",
    "mark_flushing",
    "set_fence",
]


@dataclass(eq=False)
class Flush:
    """One flush (or bulk save) of one session, from its inner transaction's start to end."""

    session: Session
    transaction: SessionTransaction
    binding: SessionBinding | None
    flushing: bool = False  # a mapper event fired: a flush, not a bulk save
    rowcount: int | None = None  # rows changed by the rewritten statement running now
    late_count: bool = False  # its count is known only once its rows are fetched


CURRENT: contextvars.ContextVar[Flush | None] = contextvars.ContextVar(
    "iofence_orm_flush", default=None
)


def after_transaction_create(session: Session, transaction: SessionTransaction) -> None:
    # A flush and the legacy bulk_* methods run in an inner (non-nested) transaction.
    if transaction.parent is not None and not transaction.nested:
        CURRENT.set(Flush(session, transaction, session.info.get(BINDING_KEY)))


def after_transaction_end(session: Session, transaction: SessionTransaction) -> None:
    current = CURRENT.get()
    if current is not None and current.transaction is transaction:
        CURRENT.set(None)
    if transaction.parent is None:
        session.info.pop(READ_CHECK_KEY, None)
        refusal.end(session)


def before_flush(session: Session, flush_context: Any, instances: Any) -> None:
    refusal.check(session)
    found: SessionBinding | None = session.info.get(BINDING_KEY)
    seen: dict[Mapper[Any], MapperInfo | None] = {}
    for obj, touched in _changes(session):
        if found is not None and found.read_only and touched():
            raise found.refusal(f"a flush of {type(obj).__name__}", type(obj).__name__)
        mapper = instance_state(obj).mapper
        if mapper in seen:
            info = seen[mapper]
        else:
            info = seen[mapper] = mapper_info(mapper)
        if info is None:
            _check_unfenced_model(mapper, obj, touched(), found)
            continue
        if found is None:
            if info.required and touched():
                raise TokenRequiredError(
                    f"flush of {type(obj).__name__} (table {info.table.table.name}) without "
                    "a fencing token: bind the session to a lease first "
                    "(fence.adapters.orm.bind(session, lease))",
                    scope=info.table.table.name,
                )
        elif obj in session.deleted and info.table.tombstone is None and not found.claim:
            raise ConfigurationError(
                f"a fenced delete of {type(obj).__name__} needs a tombstone column "
                "(tombstone_column()) or a register claim (bind(..., claim=True)): a hard "
                "delete without either would let a stale writer insert the row again"
            )


def _changes(session: Session) -> Iterable[tuple[Any, Any]]:
    """Each object the flush may write, with a check of whether it really writes it."""

    def always() -> bool:
        return True

    for obj in session.new:
        yield obj, always
    for obj in session.deleted:
        yield obj, always
    for obj in session.dirty:
        yield obj, lambda obj=obj: session.is_modified(obj, include_collections=False)


def _check_unfenced_model(
    mapper: Mapper[Any], obj: Any, touched: bool, found: SessionBinding | None
) -> None:
    if not touched:
        return
    tables = tables_of(mapper)
    guarded = [g for g in map(gate.classify, tables) if g is not None]
    if guarded:  # a register or a table of a fenced class, mapped on its own
        raise gate.unbound_refusal(guarded[0], f"flush of {type(obj).__name__}")
    if found is not None and not all(found.allows(t) for t in tables):
        raise gate.unfenced_table_refusal(
            f"{type(obj).__name__} (table {', '.join(t.name for t in tables)})",
            "a flush",
        )


def set_fence(mapper: Mapper[Any], connection: Connection, target: Any) -> None:
    current = CURRENT.get()
    if current is None:
        return
    current.flushing = True
    if current.binding is None:
        return
    info = mapper_info(mapper)
    if info is None:
        return
    state = instance_state(target)
    if state.key is not None and not current.session.is_modified(target, include_collections=False):
        return  # no net change: no UPDATE, and none should be caused
    setattr(target, info.attr, current.binding.token)
    if info.dependents and mapper.version_id_col is None:
        # A change to another table of the class still writes the fence row, even when
        # the fence already holds this token, so every change raises and checks it.
        flag_modified(target, info.attr)


def mark_flushing(mapper: Mapper[Any], connection: Connection, target: Any) -> None:
    current = CURRENT.get()
    if current is not None:
        current.flushing = True
