"""The SQLAlchemy ORM session hook, written once as sync listeners. No asyncio here.

``AsyncSession`` runs its ``sync_session`` inside a greenlet, so the same listeners serve
both. The hook works at three points:

- ``SessionEvents``: ``before_flush`` refuses writes without a token, and writes of
  unfenced models in a bound session (C9), before any I/O; ``after_begin`` claims the
  bound scope in a fence register (C8) before the first read; ``before_commit`` checks the
  lease; ``do_orm_execute`` fences ORM-enabled ``update()`` / ``delete()`` and refuses
  bulk paths; the transaction events mark the span of each flush.
- Mapper events (``before_insert`` / ``before_update``) set the fence attribute to the
  token, so the ORM writes it and keeps it in the identity map.
- The gate's engine hook (``_sql_gate``) hands this module every insert, update and delete
  of a session: inside a flush it rewrites them for a fenced table (``fence <= :token`` on
  UPDATE, a soft delete for DELETE, ``ON CONFLICT ... WHERE fence <= excluded.fence`` for
  INSERT) and for the other tables of a fenced class (an ``EXISTS`` on the fence row);
  outside a flush it fences a Core ``update()`` / ``delete()`` of a bound session. Each is
  judged by its row count before the ORM looks at it; a statement shape it does not know
  is refused. What the hook cannot fence (raw SQL, Core inserts) the gate refuses.

The statements and the verdicts come from the SQL row guard (``_sql_statements``,
``_sql_common``).
"""

from __future__ import annotations

import contextvars
import re
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    BigInteger,
    BinaryExpression,
    BindParameter,
    Boolean,
    Column,
    ColumnElement,
    Delete,
    Engine,
    Executable,
    Insert,
    Table,
    Update,
    bindparam,
    event,
    false,
    func,
    literal,
    or_,
    select,
    text,
    true,
    tuple_,
    update,
)
from sqlalchemy import inspect as sa_inspect
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection, Result
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import (
    MappedColumn,
    Mapper,
    ORMExecuteState,
    Session,
    SessionTransaction,
    mapped_column,
    with_loader_criteria,
)
from sqlalchemy.orm import exc as orm_exc
from sqlalchemy.orm.attributes import flag_modified, instance_state
from sqlalchemy.pool import Pool
from sqlalchemy.sql import operators
from sqlalchemy.sql.dml import UpdateBase
from sqlalchemy.sql.elements import BooleanClauseList
from sqlalchemy.sql.visitors import replacement_traverse
from sqlalchemy.util import await_only

from fence._core import LeaseMode, check_read, validate_mode, validate_resource, validate_token
from fence._errors import (
    ConfigurationError,
    FenceError,
    LeaseExpiredError,
    LeaseLostError,
    ReadLeaseError,
    Reason,
    TokenRequiredError,
    UnfencedWriteError,
)
from fence._errors import StaleTokenError as _FenceStale
from fence._events import EventBus, EventKind, default_bus

from . import _sql_gate as gate
from ._sql_common import (
    ABSENT,
    Probe,
    batch_rejection,
    missing_register_error,
    missing_table,
    probe_passes,
    probe_rejection,
    translate_error,
)
from ._sql_gate import OWN_OPTIONS, Kind
from ._sql_lex import Target
from ._sql_statements import (
    DEFAULT_REGISTER,
    FENCE_INFO,
    OPTIONAL_INFO,
    TOMBSTONE_INFO,
    RowStatements,
    register_statements,
    row_statements,
)
from ._sync.sql import FenceRegister

if TYPE_CHECKING:
    from fence._async.manager import AsyncLease
    from fence._sync.manager import Lease

__all__ = [
    "BINDING_KEY",
    "INCLUDE_TOMBSTONES",
    "OPTIONAL_INFO",
    "SessionBinding",
    "StaleTokenError",
    "bind",
    "binding",
    "check_lease",
    "fence_column",
    "fenced_version",
    "install",
    "mapper_info",
    "table_info",
    "tombstone_column",
    "unbind",
]

SOURCE = "orm"

#: ``Session.info`` key of the :class:`SessionBinding`.
BINDING_KEY = "iofence.binding"

#: ``Session.info`` key of the connection whose transaction a read binding checked at its
#: begin: its commit checks the fence again on it.
_READ_CHECK_KEY = "iofence.read_check"
#: ``Session.info`` key of the connections of a session's transaction whose claim was sent
#: without waiting for its reply: its commit judges any reply still unread.
_CLAIMED_KEY = "iofence.claimed"

_TOKEN = "_token"  # noqa: S105 - the bind parameter of the token, as in the row guard's statements


class StaleTokenError(_FenceStale, orm_exc.StaleDataError):
    """A fenced flush or ORM write was rejected; nothing of the flush was kept (C5).

    It is both a :class:`fence.StaleTokenError` and a
    :class:`sqlalchemy.orm.exc.StaleDataError`, so code that handles optimistic
    concurrency failures today handles fencing rejections too. The session is left as
    after any failed flush: call ``session.rollback()`` and run the unit of work again
    under a new lease.

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


# -- what is fenced --------------------------------------------------------------------


@dataclass(eq=False)
class _TableInfo:
    """A table with a fence column, and the statements the hook runs on it."""

    statements: RowStatements
    optional: bool
    rewrites: weakref.WeakKeyDictionary[Any, Any] = field(default_factory=weakref.WeakKeyDictionary)

    @property
    def table(self) -> Table:
        return self.statements.table

    @property
    def fence(self) -> Column[Any]:
        return self.statements.fence

    @property
    def tombstone(self) -> Column[Any] | None:
        return self.statements.tombstone

    def live(self) -> ColumnElement[bool]:
        return self.tombstone == false() if self.tombstone is not None else true()


@dataclass(eq=False)
class _Dependent:
    """A table of a fenced class other than the one holding the fence (joined inheritance).

    Attributes:
        table: the table.
        link: pairs of (fence-table key column, this table's column of equal value).
        rewrites: its rewritten flush statements.
    """

    table: Table
    link: tuple[tuple[Column[Any], Column[Any]], ...]
    rewrites: weakref.WeakKeyDictionary[Any, Any] = field(default_factory=weakref.WeakKeyDictionary)

    def exists(self, fenced: _TableInfo, *where: ColumnElement[bool]) -> ColumnElement[bool]:
        """``EXISTS`` a fence row of this table's row where ``where`` holds.

        The fence table is always the subquery's own FROM, also when the statement
        around it joins that table already (an ``UPDATE ... FROM``).
        """
        link = (f == d for f, d in self.link)
        query = select(literal(1)).select_from(fenced.table).where(*link, *where)
        return query.correlate_except(fenced.table).exists()


@dataclass(eq=False)
class _MapperInfo:
    table: _TableInfo  # the table that holds the fence
    attr: str  # the mapped attribute of the fence column
    required: bool  # no token -> TokenRequiredError (else plain optimistic concurrency)
    dependents: dict[Table, _Dependent]  # the class's other tables


_TABLES: weakref.WeakKeyDictionary[Table, _TableInfo | None] = weakref.WeakKeyDictionary()
_MAPPERS: weakref.WeakKeyDictionary[Mapper[Any], _MapperInfo | None] = weakref.WeakKeyDictionary()


def table_info(table: Any) -> _TableInfo | None:
    """The fencing of ``table``: ``None`` unless it has a fence column (:func:`fence_of`)."""
    try:
        return _TABLES[table]
    except KeyError:
        pass
    except TypeError:  # not weak-referenceable: not a Table
        return None
    guarded = gate.classify(table)
    info = None
    if guarded is not None and guarded.kind is Kind.FENCED:
        statements = row_statements(table, None, None, None)
        info = _TableInfo(statements, optional=bool(statements.fence.info.get(OPTIONAL_INFO)))
    _TABLES[table] = info
    return info


def _tables(mapper: Mapper[Any]) -> list[Table]:
    return [t for t in mapper.tables if isinstance(t, Table)]


def mapper_info(mapper: Mapper[Any]) -> _MapperInfo | None:
    """The fencing of a mapped class: ``None`` unless one of its tables is fenced.

    Raises:
        ConfigurationError: two of its tables hold a fence, or a table of the class cannot
            be linked to the fence row (no column of equal value).
    """
    try:
        return _MAPPERS[mapper]
    except KeyError:
        pass
    fenced = [t for t in _tables(mapper) if table_info(t) is not None]
    info = None
    if len(fenced) > 1:
        raise ConfigurationError(
            f"{mapper.class_.__name__} has fence columns in {len(fenced)} tables "
            f"({', '.join(t.name for t in fenced)}); a row has one fence: keep it in the "
            "base table"
        )
    if fenced:
        tinfo = table_info(fenced[0])
        assert tinfo is not None
        prop = mapper.get_property_by_column(tinfo.fence)
        dependents = {}
        for table in _tables(mapper):
            if table is not tinfo.table:
                dependents[table] = _dependent(mapper, tinfo, table)
        info = _MapperInfo(tinfo, prop.key, not tinfo.optional, dependents)
    _MAPPERS[mapper] = info
    return info


def _dependent(mapper: Mapper[Any], tinfo: _TableInfo, table: Table) -> _Dependent:
    link = []
    for key_col in tinfo.statements.key:
        prop = mapper.get_property_by_column(key_col)
        same = [c for c in getattr(prop, "columns", ()) if getattr(c, "table", None) is table]
        if not same:
            raise ConfigurationError(
                f"{mapper.class_.__name__}: table {table.name} has no column mapped with "
                f"{tinfo.table.name}.{key_col.name}, so its rows cannot be tied to their fence"
            )
        link.append((key_col, same[0]))
    gate.mark_dependent(table, mapper.class_.__name__)
    return _Dependent(table, tuple(link))


def _mapper_constructed(mapper: Mapper[Any], class_: type) -> None:
    # Tell the gate about the other tables of a fenced class as soon as it is mapped, so
    # raw SQL on them is refused before the class is first used.
    tables = _tables(mapper)
    if len(tables) > 1 and any(table_info(t) is not None for t in tables):
        for table in tables:
            if table_info(table) is None:
                gate.mark_dependent(table, class_.__name__)


# -- declaring the columns, typed -------------------------------------------------------


def fence_column(name: str | None = None, **kwargs: Any) -> MappedColumn[int]:
    """The fence column of a mapped class: ``BIGINT NOT NULL DEFAULT 0`` (C4, C9).

    The typed twin of :func:`fence.adapters.sql.fence_column`, for SQLAlchemy 2's
    annotated declarative style; it passes ``mypy --strict``::

        class Account(Base):
            __tablename__ = "accounts"
            id: Mapped[int] = mapped_column(primary_key=True)
            balance: Mapped[int]
            fence: Mapped[int] = fence_column()

    A column named ``fence`` is a fence even unmarked (:func:`fence_of`); this marks it
    under any name. The plain DDL, for migrations, is
    ``ALTER TABLE t ADD COLUMN fence BIGINT NOT NULL DEFAULT 0``.

    Args:
        name: the column name in the database (default: the attribute's name).
        kwargs: passed on to :func:`~sqlalchemy.orm.mapped_column` (``comment=...``).
    """
    kwargs["info"] = {**kwargs.get("info", {}), FENCE_INFO: True}
    kwargs.update(nullable=False, default=0, server_default=text("0"))
    if name is None:
        return mapped_column(BigInteger, **kwargs)
    return mapped_column(name, BigInteger, **kwargs)


def tombstone_column(name: str | None = None, **kwargs: Any) -> MappedColumn[bool]:
    """A soft-delete flag of a mapped class: ``BOOLEAN NOT NULL DEFAULT FALSE`` (C7).

    The typed twin of :func:`fence.adapters.sql.tombstone_column`::

        deleted: Mapped[bool] = tombstone_column()

    With it a fenced delete keeps the row, and its fence, as a tombstone; ORM queries
    skip tombstones (see :data:`INCLUDE_TOMBSTONES`).

    Args:
        name: the column name in the database (default: the attribute's name).
        kwargs: passed on to :func:`~sqlalchemy.orm.mapped_column`.
    """
    kwargs["info"] = {**kwargs.get("info", {}), TOMBSTONE_INFO: True}
    kwargs.update(nullable=False, default=False, server_default=false())
    if name is None:
        return mapped_column(Boolean, **kwargs)
    return mapped_column(name, Boolean, **kwargs)


# -- the binding -----------------------------------------------------------------------


@dataclass(eq=False)
class SessionBinding:
    """What :func:`bind` attached to a session (``session.info[BINDING_KEY]``).

    Attributes:
        token: the fencing token every fenced write of the session carries.
        scope: the fence-register scope claimed at the start of each transaction.
        lease: the lease the token came from, if one was given.
        claim: whether the scope is claimed (C8).
        register: the fence register table.
        check_lease: whether ``commit()`` checks the lease first.
        events: the event bus for ``WRITE_ACCEPTED`` / ``WRITE_REJECTED``.
        unfenced: the tables the session may write without a fence (``bind(unfenced=)``).
        read_only: bound to a read lease (C13): every write is refused, and the claim is a
            check that does not raise the fence.
        eager: on psycopg, read the claim's reply as the transaction begins instead of just
            before its first statement (the unit of work sets it, so that a stale holder is
            refused before the block runs at all).
    """

    token: int
    scope: str
    lease: Lease | AsyncLease | None
    claim: bool
    register: Table
    check_lease: bool
    events: EventBus
    unfenced: frozenset[Table] = frozenset()
    read_only: bool = False
    eager: bool = False

    def refusal(self, path: str, scope: str | None = None) -> ReadLeaseError:
        """The error for a write of a session bound to a read lease."""
        return ReadLeaseError(
            f"{path} in a session bound to a read lease (token {self.token}, "
            f"{self.scope!r}): a read lease is shared with other readers, so it never "
            "writes. Take a write lease for work that writes (manager.write_lock, "
            "UnitOfWork(mode='write'))",
            scope=scope,
            token=self.token,
        )

    def allows(self, table: Table | None) -> bool:
        """Whether the session may write ``table`` although it has no fence."""
        return table is not None and table in self.unfenced

    def allows_name(self, target: Target) -> bool:
        """:meth:`allows` for a table named in raw SQL."""
        return any(
            t.name.lower() == target.name
            and (target.schema is None or t.schema is None or t.schema.lower() == target.schema)
            for t in self.unfenced
        )


def _sync_session(session: Any) -> Session:
    sync = getattr(session, "sync_session", session)
    if not isinstance(sync, Session):
        raise ConfigurationError(
            f"bind() needs a Session or an AsyncSession, got {type(session).__name__}"
        )
    return sync


def _unfenced_tables(items: Iterable[Any]) -> frozenset[Table]:
    tables: set[Table] = set()
    for item in items:
        if isinstance(item, Table):
            found = [item]
        else:
            try:
                found = list(sa_inspect(item).tables)
            except Exception:  # anything not a mapped class is the caller's mistake
                raise ConfigurationError(
                    f"unfenced= takes mapped classes and tables, got {item!r}"
                ) from None
        for table in found:
            guarded = gate.classify(table)
            if guarded is not None:
                raise ConfigurationError(
                    f"unfenced= names {guarded.describe()}: it is fenced, it cannot be "
                    "written unfenced"
                )
            tables.add(table)
    return frozenset(tables)


def bind(
    session: Any,
    lease: Lease | AsyncLease | None = None,
    *,
    token: int | None = None,
    scope: str | None = None,
    claim: bool = True,
    register: Table | None = None,
    check_lease: bool = True,
    events: EventBus | None = None,
    unfenced: Iterable[Any] = (),
    mode: LeaseMode | str | None = None,
) -> SessionBinding:
    """Bind a session to a lease: every write of the session is fenced, or refused.

    From now on, for mapped classes with a fence column (``fence_column()``,
    ``fenced_version()``, or a column named ``fence``):

    - a flushed UPDATE adds ``fence <= :token`` (and ``NOT deleted``) and sets
      ``fence = :token``; the other tables of a joined-inheritance class get an
      ``EXISTS`` on their fence row;
    - a flushed DELETE becomes a soft delete that keeps the row as a tombstone (C7) with
      a :func:`tombstone_column`, else a fenced hard delete, allowed only with a register
      claim (the register row is then the tombstone);
    - a flushed INSERT becomes a fenced upsert: a row with the same key is replaced (a
      tombstone revived) iff the token passes, else :class:`StaleTokenError`;
    - ``session.execute(update(...))`` / ``delete(...)``, and a Core ``update()`` /
      ``delete()`` on ``session.connection()``, get the same predicate, gated so that
      every matched row passes or none is written (C6).

    Everything else that would write is refused before any I/O with
    :class:`fence.UnfencedWriteError`: a write of a class or table without a fence (name
    it in ``unfenced`` to allow it), raw SQL (``text()``, ``exec_driver_sql``) that writes,
    Core inserts and the bulk paths. A statement marked
    ``.execution_options(unfenced=True)`` is the explicit, unfenced way out.

    With ``claim=True`` (the default) every transaction of the session starts by claiming
    ``scope`` in the fence register (its fence is raised to the token if it is not above
    it, else the claim is refused) before its first statement runs. A stale holder is
    refused at its first read, and on PostgreSQL the register row stays locked until
    commit, so a newer holder's claim waits for a transaction already under way (C8).
    Without the claim a stale write that lands between this session's read and its write
    is accepted, then overwritten.

    Bound to a read lease (C13: ``manager.read_lock``, or ``mode="read"``), the session is
    read-only: every write path above (flush, ORM and Core statements, raw SQL, bulk
    paths, tables named in ``unfenced``) raises :class:`fence.ReadLeaseError` before any
    I/O, and the claim becomes a check that never raises the fence (concurrent readers
    would refuse each other): each transaction starts by reading the register row of
    ``scope``, and its commit reads it again, and either raises :class:`StaleTokenError`
    if the fence is above the lease's token, that is, if a writer whose lease came after
    this reader's has written (:func:`fence.check_read`). Only a statement marked
    ``.execution_options(unfenced=True)`` still writes.

    Bind before the session's first statement; the binding lasts until :func:`unbind`
    or the session is garbage collected.

    Args:
        session: a :class:`~sqlalchemy.orm.Session` or
            :class:`~sqlalchemy.ext.asyncio.AsyncSession` (its ``sync_session`` is bound).
        lease: the lease whose token and resource to use.
        token: the token, instead of a lease.
        scope: the register scope to claim (default: the lease's resource).
        claim: claim the scope at the start of each transaction (C8).
        register: the register table (default ``fence_register``, see
            :func:`fence_register_table`); it must exist.
        check_lease: raise :class:`fence.LeaseLostError` from ``commit()`` when the lease
            is lost or expired, before anything commits.
        events: the event bus (default: :data:`fence.default_bus`).
        unfenced: mapped classes or tables without a fence that the session may write
            (an audit log, say); their writes are not fenced.
        mode: ``"read"`` binds read-only (the default for a read lease); ``"write"``
            (the default otherwise) is refused for a read lease.

    Returns:
        The :class:`SessionBinding`.

    Raises:
        InvalidTokenError: the token is not valid (C1).
        InvalidResourceError: the scope is not a valid name.
        ConfigurationError: neither or both of ``lease`` and ``token``; no scope to claim;
            the session already runs a transaction (the claim would come after a read);
            ``unfenced`` names something that is fenced or not mapped; or
            ``mode="write"`` with a read lease.

    Example::

        with manager.lock("order:42") as lease, Session(engine) as session:
            bind(session, lease)
            order = session.get(Order, 42)       # the claim runs first
            order.state = "paid"
            session.commit()                     # UPDATE ... WHERE fence <= :token
    """
    sync = _sync_session(session)
    if (lease is None) == (token is None):
        raise ConfigurationError("bind() needs either a lease or a token")
    held = LeaseMode.WRITE if lease is None else getattr(lease, "mode", LeaseMode.WRITE)
    wanted = held if mode is None else validate_mode(mode)
    if held is LeaseMode.READ and wanted is LeaseMode.WRITE:
        raise ConfigurationError(
            f"bind(mode='write') with a read lease on {lease.resource!r}: a read lease "
            "never writes; take a write lease for work that writes"
            if lease is not None
            else "a read lease never writes"
        )
    if lease is not None:
        token = lease.token
        if scope is None:
            scope = lease.resource
    token = validate_token(token, read=wanted is LeaseMode.READ)
    if claim:
        if scope is None:
            raise ConfigurationError("bind(token=..., claim=True) needs the scope to claim")
        if sync.in_transaction():
            raise ConfigurationError(
                "bind() before the session's first statement: this transaction already "
                "began, so the claim would come after a read. Commit or roll back first, "
                "or pass claim=False"
            )
    scope = validate_resource(scope if scope is not None else "-", what="scope")
    found = SessionBinding(
        token=token,
        scope=scope,
        lease=lease,
        claim=claim,
        register=register if register is not None else DEFAULT_REGISTER,
        check_lease=check_lease and lease is not None,
        events=events or default_bus,
        unfenced=_unfenced_tables(unfenced),
        read_only=wanted is LeaseMode.READ,
    )
    if register is not None:
        gate.mark_register(register)
    sync.info[BINDING_KEY] = found
    return found


def unbind(session: Any) -> SessionBinding | None:
    """Remove the session's binding; return it (``None`` if it had none).

    Afterwards a write of a fenced class raises :class:`fence.TokenRequiredError` (a
    :func:`fenced_version` model goes back to plain optimistic concurrency).
    """
    found: SessionBinding | None = _sync_session(session).info.pop(BINDING_KEY, None)
    return found


def binding(session: Any) -> SessionBinding | None:
    """The session's :class:`SessionBinding`, or ``None``."""
    found: SessionBinding | None = _sync_session(session).info.get(BINDING_KEY)
    return found


# Which session a connection serves, recorded when the session's transaction begins on it.
_SESSION_OF: weakref.WeakKeyDictionary[Connection, weakref.ref[Session]] = (
    weakref.WeakKeyDictionary()
)


def _session_of(conn: Connection) -> Session | None:
    ref = _SESSION_OF.get(conn)
    session = ref() if ref is not None else None
    if session is None or not session.in_transaction():
        return None
    return session


def _bound(conn: Connection) -> SessionBinding | None:
    session = _session_of(conn)
    if session is None:
        return None
    found: SessionBinding | None = session.info.get(BINDING_KEY)
    return found


def _allows_of(conn: Connection) -> Any:
    # The gate asks only about a statement that writes: a read-only session refuses it.
    found = _bound(conn)
    if found is not None and found.read_only:
        raise found.refusal("raw SQL that writes")
    return found.allows_name if found is not None else None


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
    flush = _CURRENT.get()
    if flush is not None and flush.binding is not None:
        return flush.binding.token
    return (current or 0) + 1


# -- the span of a flush ----------------------------------------------------------------


@dataclass(eq=False)
class _Flush:
    """One flush (or bulk save) of one session, from its inner transaction's start to end."""

    session: Session
    transaction: SessionTransaction
    binding: SessionBinding | None
    flushing: bool = False  # a mapper event fired: a flush, not a bulk save
    rowcount: int | None = None  # rows changed by the rewritten statement running now
    late_count: bool = False  # its count is known only once its rows are fetched


_CURRENT: contextvars.ContextVar[_Flush | None] = contextvars.ContextVar(
    "iofence_orm_flush", default=None
)


def _after_transaction_create(session: Session, transaction: SessionTransaction) -> None:
    # A flush and the legacy bulk_* methods run in an inner (non-nested) transaction.
    if transaction.parent is not None and not transaction.nested:
        _CURRENT.set(_Flush(session, transaction, session.info.get(BINDING_KEY)))


def _after_transaction_end(session: Session, transaction: SessionTransaction) -> None:
    current = _CURRENT.get()
    if current is not None and current.transaction is transaction:
        _CURRENT.set(None)
    if transaction.parent is None:
        session.info.pop(_READ_CHECK_KEY, None)
        session.info.pop(_CLAIMED_KEY, None)


def _before_flush(session: Session, flush_context: Any, instances: Any) -> None:
    found: SessionBinding | None = session.info.get(BINDING_KEY)
    seen: dict[Mapper[Any], _MapperInfo | None] = {}
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
    tables = _tables(mapper)
    guarded = [g for g in map(gate.classify, tables) if g is not None]
    if guarded:  # a register or a table of a fenced class, mapped on its own
        raise gate.unbound_refusal(guarded[0], f"flush of {type(obj).__name__}")
    if found is not None and not all(found.allows(t) for t in tables):
        raise gate.unfenced_table_refusal(
            f"{type(obj).__name__} (table {', '.join(t.name for t in tables)})",
            "a flush",
        )


def _set_fence(mapper: Mapper[Any], connection: Connection, target: Any) -> None:
    current = _CURRENT.get()
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


def _mark_flushing(mapper: Mapper[Any], connection: Connection, target: Any) -> None:
    current = _CURRENT.get()
    if current is not None:
        current.flushing = True


# -- statements of a flush ---------------------------------------------------------------


@dataclass(eq=False)
class _Rewrite:
    """How a rewritten statement is judged after it ran.

    Attributes:
        info: the fenced table (for a dependent table: the table of its fence).
        kind: ``update``, ``delete`` or ``insert`` of a flush; ``criteria`` for a Core
            statement of a bound session, judged by the rows that block it.
        key_params: names of the fence-table key values in the ORM's parameters.
        criteria: the criteria of a ``criteria`` statement.
        need_live: whether a tombstone blocks the statement (an update).
    """

    info: _TableInfo
    kind: str
    key_params: tuple[str, ...]
    criteria: Any = None
    need_live: bool = True


_JUDGE: weakref.WeakKeyDictionary[Any, _Rewrite] = weakref.WeakKeyDictionary()
_DONE: weakref.WeakSet[Any] = weakref.WeakSet()  # rewritten, nothing to judge


def _replace_version(stmt: Any, info: _TableInfo, token: BindParameter[Any]) -> tuple[Any, bool]:
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


def _rewrite_update(stmt: Update, info: _TableInfo) -> Executable:
    token = bindparam(_TOKEN, type_=info.fence.type)
    new, swapped = _replace_version(stmt, info, token)
    if not swapped:
        new = new.where(info.fence <= token)
    return new.where(info.live())  # type: ignore[no-any-return]


def _rewrite_hard_delete(stmt: Delete, info: _TableInfo) -> Executable:
    token = bindparam(_TOKEN, type_=info.fence.type)
    new, swapped = _replace_version(stmt, info, token)
    return new if swapped else new.where(info.fence <= token)  # type: ignore[no-any-return]


def _dialect_insert(dialect: str) -> type[Any]:
    if dialect == "postgresql":
        return postgresql.Insert
    if dialect == "sqlite":
        return sqlite.Insert
    raise ConfigurationError(
        f"a fenced flush of new rows needs ON CONFLICT: PostgreSQL or SQLite, not {dialect}"
    )


def _as_upsert(stmt: Insert, dialect: str) -> Any:
    """The ORM's INSERT as a dialect insert, keeping its RETURNING and defaults settings."""
    cls = _dialect_insert(dialect)
    base = object.__new__(cls)
    base.__dict__ = stmt._generate().__dict__  # the ORM's state, without memoized keys
    return base


def _rewrite_insert(stmt: Insert, info: _TableInfo, dialect: str) -> Executable:
    """The ORM's INSERT as a fenced upsert."""
    base = _as_upsert(stmt, dialect)
    s = info.statements
    excluded = base.excluded
    return base.on_conflict_do_update(  # type: ignore[no-any-return]
        index_elements=list(s.key),
        set_={c.key: excluded[c.key] for c in s.table.columns if c.key not in s.key_set},
        where=info.fence <= excluded[info.fence.key],
    )


def _rewrite_dependent(stmt: Any, dep: _Dependent, info: _TableInfo, dialect: str) -> Any:
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


def _unknown_shape(stmt: Any, table: Table) -> UnfencedWriteError:
    return UnfencedWriteError(
        f"the flush sent a {type(stmt).__name__.upper()} on {table.name} in a shape the "
        "fencing hook does not recognise (this SQLAlchemy version may build flush "
        "statements differently), so it cannot be fenced and was refused; nothing was "
        "written",
        scope=table.name,
    )


def _flush_statement(
    conn: Connection,
    current: _Flush,
    elem: Any,
    multiparams: list[dict[str, Any]],
    params: dict[str, Any],
) -> tuple[Any, list[dict[str, Any]], dict[str, Any]] | None:
    """Rewrite an insert, update or delete sent by a flush (or refuse it)."""
    if elem in _JUDGE or elem in _DONE:
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
            raise _bulk_refusal(guarded, "Session.bulk_save_objects / bulk_*_mappings")
        raise gate.unbound_refusal(guarded, "a flush")
    if not current.flushing:
        raise _bulk_refusal(guarded, "Session.bulk_save_objects / bulk_*_mappings")
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
                raise _unknown_shape(elem, table)
            new = info.rewrites[elem] = _rewrite_update(elem, info)
            _JUDGE[new] = _Rewrite(info, "update", tuple(where[c.key] for c in s.key))
        rows = [{**p, fence_key: token, _TOKEN: token} for p in rows]
    elif isinstance(elem, Delete):
        if info.tombstone is not None:
            new = info.rewrites.get(Delete)
            if new is None:
                # The guard's soft delete, as a statement of the hook's own.
                new = s.raise_fence(delete=True, returning=False).execution_options()
                info.rewrites[Delete] = new
                _JUDGE[new] = _Rewrite(info, "delete", tuple(f"_key_{c.key}" for c in s.key))
            where = _key_eq_params(elem, table)
            if where is None:
                raise _unknown_shape(elem, table)
            rows = [s.params([p[where[c.key]] for c in s.key], token, {}) for p in rows]
        else:
            new = info.rewrites.get(elem)
            if new is None:
                where = _key_eq_params(elem, table)
                if where is None:
                    raise _unknown_shape(elem, table)
                new = info.rewrites[elem] = _rewrite_hard_delete(elem, info)
                _JUDGE[new] = _Rewrite(info, "delete", tuple(where[c.key] for c in s.key))
            rows = [{**p, _TOKEN: token} for p in rows]
    elif isinstance(elem, Insert):
        if elem.select is not None:
            raise _unknown_shape(elem, table)
        new = info.rewrites.get(elem)
        if new is None:
            new = info.rewrites[elem] = _rewrite_insert(elem, info, conn.dialect.name)
            _JUDGE[new] = _Rewrite(info, "insert", tuple(c.key for c in s.key))
        rows = [{**p, fence_key: token} for p in rows]
    else:
        raise _unknown_shape(elem, table)
    current.rowcount = 0
    if len(rows) == 1:
        return new, [], rows[0]
    return new, rows, {}


def _flush_dependent(
    conn: Connection,
    current: _Flush,
    elem: Any,
    table: Table,
    rows: list[dict[str, Any]],
    token: int,
) -> tuple[Any, list[dict[str, Any]], dict[str, Any]]:
    owner = _owner(current.session, table)
    if owner is None:
        raise _unknown_shape(elem, table)
    info, dep = owner
    new = dep.rewrites.get(elem)
    if new is None:
        if isinstance(elem, Insert):
            if elem.select is not None:
                raise _unknown_shape(elem, table)
            new = _rewrite_dependent(elem, dep, info, conn.dialect.name)
            _DONE.add(new)
        elif isinstance(elem, Update | Delete):
            where = _key_eq_params(elem, table)
            if where is None:
                raise _unknown_shape(elem, table)
            by_column = {d.key: where[d.key] for _, d in dep.link}
            new = _rewrite_dependent(elem, dep, info, conn.dialect.name)
            kind = "update" if isinstance(elem, Update) else "delete"
            _JUDGE[new] = _Rewrite(info, kind, tuple(by_column[d.key] for _, d in dep.link))
        else:
            raise _unknown_shape(elem, table)
        dep.rewrites[elem] = new
    if new in _JUDGE:
        current.rowcount = 0
        rows = [{**p, _TOKEN: token} for p in rows]
    if len(rows) == 1:
        return new, [], rows[0]
    return new, rows, {}


def _owner(session: Session, table: Table) -> tuple[_TableInfo, _Dependent] | None:
    """The fence of a dependent table: from the fenced class it belongs to."""
    for mapper in list(_MAPPERS):
        info = _MAPPERS.get(mapper)
        if info is not None and table in info.dependents:
            return info.table, info.dependents[table]
    return None


def _after_cursor_execute(
    conn: Connection, cursor: Any, statement: str, parameters: Any, context: Any, many: bool
) -> None:
    # The cursor's own count, read while it is open: SQLAlchemy keeps no row count for an
    # INSERT, and a batch of inserts may run as several cursor executions.
    current = _CURRENT.get()
    if current is None or current.rowcount is None:
        return
    compiled = getattr(context, "compiled", None)
    if conn.dialect.name == "sqlite" and getattr(compiled, "effective_returning", None):
        # sqlite3 counts the rows of a statement with RETURNING as they are fetched, and
        # the ORM fetches them after the hook judged the statement.
        current.late_count = True
    count = cursor.rowcount
    current.rowcount = -1 if count < 0 or current.rowcount < 0 else current.rowcount + count


def _after_execute(
    conn: Connection,
    elem: Any,
    multiparams: list[dict[str, Any]],
    params: dict[str, Any],
    execution_options: Mapping[str, Any],
    result: Any,
) -> None:
    judge = _JUDGE.get(elem)
    if judge is None:
        return
    if judge.kind == "criteria":
        _judge_criteria(conn, judge, result)
        return
    current = _CURRENT.get()
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
    if count == len(rows):
        if events.active:
            for keyvals in keys:
                events.emit(EventKind.WRITE_ACCEPTED, SOURCE, s.scope(keyvals), token)
        return
    mapper = _mapper_of(current.session, info)
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
    raise _reject(events, mapper, token, errors, s.name, batch=len(keys) > 1)


def _wrote_all(
    conn: Connection, s: RowStatements, judge: _Rewrite, keys: Sequence[tuple[Any, ...]], token: int
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


def _probe(conn: Connection, s: RowStatements, keyvals: Sequence[Any]) -> Probe:
    row = conn.execute(s.probe(), s.key_params(keyvals)).first()
    if row is None:
        return ABSENT
    fence, dead = tuple(row)
    return Probe(exists=True, fence=fence, live=not dead)


def _reject(
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


def _mapper_of(session: Session | None, info: _TableInfo) -> Mapper[Any] | None:
    for mapper, found in list(_MAPPERS.items()):
        if found is not None and found.table is info:
            return mapper
    return None


def _bulk_refusal(guarded: gate.Guarded, path: str) -> UnfencedWriteError:
    return UnfencedWriteError(
        f"{path} on {guarded.describe()} is refused: these bulk paths bypass the flush "
        "events, so the fence cannot be set and the row counts of a batch cannot be judged "
        "row by row (C9). Use session.add_all() and flush, RowGuard.update_many / "
        "upsert_many (all or nothing), or a criteria session.execute(update(...).where(...))",
        scope=guarded.table.name,
    )


# -- Core statements on a bound session's connection --------------------------------------


def _session_statement(
    conn: Connection,
    elem: Any,
    multiparams: list[dict[str, Any]],
    params: dict[str, Any],
    options: Mapping[str, Any],
) -> tuple[Any, list[dict[str, Any]], dict[str, Any]] | None:
    """The gate's hook: a flush statement, or a Core write of a session bound to a lease."""
    if not isinstance(elem, UpdateBase):
        return None
    current = _CURRENT.get()
    if current is not None and _session_of(conn) is current.session:
        if current.binding is not None and current.binding.read_only:
            raise _read_refusal(current.binding, elem)
        return _flush_statement(conn, current, elem, multiparams, params)
    found = _bound(conn)
    if found is None:
        return None  # the gate's rules for a write without a token
    if found.read_only:
        raise _read_refusal(found, elem)
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
        raise _bulk_refusal(guarded, f"{path} with a list of parameter sets")
    info = table_info(table)
    assert info is not None
    _refuse_managed_values(elem, info)
    new, need_live = _fenced_criteria(elem, info, found.token, found, None)
    criteria = getattr(elem, "whereclause", None)
    _JUDGE[new] = _Rewrite(info, "criteria", (), criteria=criteria, need_live=need_live)
    return new, multiparams, params


def _read_refusal(found: SessionBinding, elem: Any) -> ReadLeaseError:
    table = gate.target_table(elem)
    path = f"a {type(elem).__name__.lower()} statement"
    return found.refusal(path, table.name if table is not None else None)


def _refuse_managed_values(stmt: Any, info: _TableInfo) -> None:
    values = getattr(stmt, "_values", None) or {}
    names = {getattr(k, "key", k) for k in values}
    managed = {info.fence.key} | ({info.tombstone.key} if info.tombstone is not None else set())
    if names & managed:
        raise ConfigurationError(
            f"{sorted(names & managed)} of {info.table.name} are set by the hook from the "
            "token; leave them out of values()"
        )


def _judge_criteria(conn: Connection, judge: _Rewrite, result: Any) -> None:
    found = _bound(conn)
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
        blockers = _blockers(conn, info, judge.criteria, found.token)
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
            raise _reject(found.events, None, found.token, errors, info.table.name, batch=True)
    elif found.events.active:
        found.events.emit(
            EventKind.WRITE_ACCEPTED, SOURCE, info.table.name, found.token, rows=count
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


def _do_orm_execute(state: ORMExecuteState) -> Result[Any] | None:
    if state.is_select:
        _hide_tombstones(state)
        return None
    if not (state.is_update or state.is_delete or state.is_insert):
        return None
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
        raise _bulk_refusal(guarded, "session.execute(insert(...))")
    if state.is_executemany:
        raise _bulk_refusal(guarded, "session.execute(update(...), [rows])")
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
        return _dependent_criteria(state, stmt, minfo, minfo.dependents[table], found)
    info = table_info(table)
    assert info is not None
    token = found.token
    _refuse_managed_values(stmt, info)
    fenced, judge_live = _fenced_criteria(stmt, info, token, found, mapper)
    result = state.invoke_statement(statement=fenced.execution_options(**OWN_OPTIONS))
    _judge_orm(state, info, stmt.whereclause, result, found, mapper, judge_live)
    return result


def _judge_orm(
    state: ORMExecuteState,
    info: _TableInfo,
    criteria: Any,
    result: Any,
    found: SessionBinding,
    mapper: Any,
    need_live: bool,
    *,
    keys: Any = None,
) -> None:
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
        blockers = _blockers(conn, info, criteria, token, keys=keys)
        if blockers:
            errors = [
                (
                    key,
                    probe_rejection(info.statements.scope(key), token, probe, need_live=need_live),
                )
                for key, probe in blockers
            ]
            raise _reject(found.events, mapper, token, errors, info.table.name, batch=True)
    elif found.events.active:
        found.events.emit(EventKind.WRITE_ACCEPTED, SOURCE, info.table.name, token, rows=count)


def _fenced_criteria(
    stmt: Any, info: _TableInfo, token: int, found: SessionBinding, mapper: Any
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
        return soft.execution_options(**stmt.get_execution_options()), False
    return stmt.where(*gate_terms, info.live()).values({fence: token}), True


def _matched_keys(mapper: Mapper[Any], info: _TableInfo, criteria: Any) -> Any:
    """The fence-table keys of the rows of ``mapper`` that ``criteria`` match."""
    attrs = [mapper.get_property_by_column(c).class_attribute for c in info.statements.key]
    query = select(*attrs)
    return query.where(criteria) if criteria is not None else query


def _keys_in(info: _TableInfo, keys: Any) -> ColumnElement[bool]:
    key = info.statements.key
    return key[0].in_(keys) if len(key) == 1 else tuple_(*key).in_(keys)


def _dependent_criteria(
    state: ORMExecuteState, stmt: Any, minfo: _MapperInfo, dep: _Dependent, found: SessionBinding
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
    is_delete = isinstance(stmt, Delete)
    keys = _matched_keys(mapper, info, stmt.whereclause)
    fence = info.fence
    live = info.tombstone if info.tombstone is not None else false()
    locked = (
        select(fence.label("f"), live.label("dead"))
        .where(_keys_in(info, keys))
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
        .where(_keys_in(info, keys), blocking == 0)
        .values(values)
        .execution_options(**OWN_OPTIONS)
    )
    conn = state.session.connection(bind_arguments=state.bind_arguments)
    raised = conn.execute(raise_fences)
    if raised.rowcount == 0:
        _judge_orm(state, info, None, raised, found, mapper, not is_delete, keys=keys)
    passing = dep.exists(info, fence == token)
    return state.invoke_statement(statement=stmt.where(passing).execution_options(**OWN_OPTIONS))


def _blockers(
    conn: Connection, info: _TableInfo, criteria: Any, token: int, *, keys: Any = None
) -> list[tuple[tuple[Any, ...], Probe]]:
    s = info.statements
    live = info.tombstone if info.tombstone is not None else false()
    query = select(*s.key, info.fence, live).where(info.fence > token)
    if keys is not None:
        query = query.where(_keys_in(info, keys))
    if criteria is not None:
        query = query.where(criteria)
    width = len(s.key)
    return [
        (tuple(row[:width]), Probe(True, row[width], not row[width + 1]))
        for row in conn.execute(query)
    ]


# -- claim and lease check ----------------------------------------------------------------


_CLAIMS: weakref.WeakKeyDictionary[Table, dict[str, Any]] = weakref.WeakKeyDictionary()


def _claim_statement(register: Table, dialect: str) -> Any:
    """The register claim of one scope with bind parameters, derived once per register and
    dialect (hot path) from the register guard's own (:meth:`RegisterStatements.claim_row`):
    ``INSERT ... ON CONFLICT (scope) DO UPDATE SET fence = :t WHERE fence <= :t``.
    """
    per_table = _CLAIMS.setdefault(register, {})
    found = per_table.get(dialect)
    if found is None:
        row = register_statements(register).claim_row(dialect)
        found = per_table[dialect] = row.execution_options(**OWN_OPTIONS)
    return found


def _after_begin(session: Session, transaction: SessionTransaction, connection: Connection) -> None:
    _SESSION_OF[connection] = weakref.ref(session)
    found: SessionBinding | None = session.info.get(BINDING_KEY)
    if found is None or not found.claim or transaction.nested:
        return
    if found.read_only:
        _check_read(connection, found)
        session.info[_READ_CHECK_KEY] = connection
        return
    if connection.dialect.driver == "psycopg":
        claim = _send_claim(connection, found)  # its reply is read before the first statement
        if found.eager:
            del _IN_FLIGHT[claim.raw]
            _judge_claim(connection, found, _read_claim(claim))
        else:  # or, at the latest, as the session commits (_before_commit)
            session.info.setdefault(_CLAIMED_KEY, []).append(connection)
        return
    stmt = _claim_statement(found.register, connection.dialect.name)
    try:
        result = connection.execute(stmt, {"_scope": found.scope, "_token": found.token})
    except SQLAlchemyError as exc:
        if missing_table(exc):
            raise missing_register_error(found.register.name) from exc
        raise translate_error(exc, "fence claim", found.scope) from exc
    _judge_claim(connection, found, result.rowcount)


def _judge_claim(connection: Connection, found: SessionBinding, claimed: int) -> None:
    """Accept a claim that raised the fence; hand any other to the register guard."""
    if claimed == 1:
        if found.events.active:
            found.events.emit(EventKind.WRITE_ACCEPTED, SOURCE, found.scope, found.token)
        return
    # Refused (or unknown): the register guard runs the claim again and judges it (C5).
    try:
        FenceRegister(connection, found.register, events=found.events).claim(
            found.scope, found.token
        )
    except _FenceStale as err:
        raise StaleTokenError.from_guard(err, None, None) from None


@dataclass(eq=False, slots=True)
class _ClaimInFlight:
    """A claim sent with its transaction's ``BEGIN`` whose reply is not read yet."""

    found: SessionBinding
    raw: Any
    name: bytes
    prepare: bytes
    execute: bytes
    fresh: bool
    prepared: set[bytes]


# The claims sent and not read yet, by psycopg connection (at most one each).
_IN_FLIGHT: weakref.WeakKeyDictionary[Any, _ClaimInFlight] = weakref.WeakKeyDictionary()


def _send_claim(connection: Connection, found: SessionBinding) -> _ClaimInFlight:
    """Send the claim with the transaction's ``BEGIN`` and return before its reply (psycopg 3).

    psycopg starts a transaction with a ``BEGIN`` of its own, a round trip before the first
    statement. Here ``BEGIN`` (with the connection's isolation level, as psycopg builds it)
    and the claim go as one simple-protocol message, and the reply is read only when the
    transaction's first statement is about to be sent (or at its commit or rollback,
    whichever comes first): :func:`_claim_before_statement`. The server runs the claim
    while the application composes that statement, so a bound transaction waits on one
    round trip fewer than an unbound one.

    Nothing else is sent before the reply is read and judged: a stale holder is refused
    before its first statement leaves, and that statement runs after the claim took the
    register row's lock, so it sees what an older holder that held the lock committed
    (C8). A path that reaches the driver around SQLAlchemy while the reply is pending is
    refused by libpq itself ("another command is already in progress") and sends nothing.

    The claim is the register guard's upsert (``INSERT ... ON CONFLICT (scope) DO UPDATE
    SET fence = $2 WHERE fence <= $2``) without ``RETURNING``: its command tag carries the
    row count, and a refusal (count 0) goes to the register guard, which judges it.

    It runs as a statement prepared once per connection (``PREPARE`` goes in the first
    transaction's message; the name is known from then on by the connection's pool
    entry), so PostgreSQL neither parses nor plans it again. A server session that lost
    it (``DEALLOCATE``, ``DISCARD ALL``, a transaction pooler that moved the connection)
    answers ``26000``: the transaction is rolled back and the message sent again with the
    ``PREPARE``. A search path changed since is honoured: PostgreSQL parses a prepared
    statement again when ``search_path`` changed.
    """
    pg = _psycopg()
    register = found.register
    raw: Any = connection.connection.driver_connection
    left = _IN_FLIGHT.pop(raw, None)
    if left is not None:  # a claim whose transaction ended without any event (defensive)
        _read_claim(left)
    claim = _PG_CLAIMS.get(register)
    if claim is None:
        claim = _PG_CLAIMS[register] = _pg_claim(register, raw)
    name, prepare = claim
    execute = b"%s; EXECUTE %s(%s, %d)" % (
        _pg_begin(raw, pg),
        name,
        _pg_literal(found.scope, raw),
        found.token,
    )
    prepared: set[bytes] = connection.connection.info.setdefault(_PREPARED_KEY, set())
    fresh = name not in prepared
    pgconn = raw.pgconn
    try:
        pgconn.send_query(prepare + execute if fresh else execute)
        pgconn.flush()  # what does not leave now leaves when the reply is read
    except pg.errors.Error as exc:
        raise translate_error(exc, "fence claim", found.scope) from exc
    sent = _IN_FLIGHT[raw] = _ClaimInFlight(found, raw, name, prepare, execute, fresh, prepared)
    return sent


def _read_claim(claim: _ClaimInFlight) -> int:
    """Read a claim's reply, sending it again if the server session lost the statement.

    Returns:
        The claim's row count: 1 if the fence was raised (or the row inserted), 0 if it
        was refused.
    """
    pg = _psycopg()
    raw, name, found = claim.raw, claim.name, claim.found
    fresh = claim.fresh
    results = _pg_read(raw, found)
    for _attempt in range(3):
        last = results[-1]
        if last.status == pg.COMMAND_OK:
            claim.prepared.add(name)
            return int(last.command_tuples or 0)
        state = last.error_field(pg.SQLSTATE)
        if state == b"26000" and not fresh:  # the session lost the statement
            claim.prepared.discard(name)
            _pg_send(raw, b"ROLLBACK", found)
            fresh = True
        elif state == b"42P05" and fresh:  # the session has it already (a pooler's)
            claim.prepared.add(name)
            fresh = False
        else:
            break
        results = _pg_send(raw, claim.prepare + claim.execute if fresh else claim.execute, found)
    raise _pg_error(raw, results, found)


def _take_claim(conn: Connection) -> _ClaimInFlight | None:
    """The claim in flight on ``conn``'s DBAPI connection, taken off the list."""
    if not _IN_FLIGHT or conn.closed or conn.invalidated:
        return None  # an invalidated connection's claim went with it
    return _IN_FLIGHT.pop(conn.connection.driver_connection, None)


def _claim_before_statement(
    conn: Connection, cursor: Any, statement: str, parameters: Any, context: Any, many: bool
) -> None:
    """Judge the claim in flight on this connection before its first statement is sent."""
    if _IN_FLIGHT:
        claim = _take_claim(conn)
        if claim is not None:
            _judge_claim(conn, claim.found, _read_claim(claim))


def _claim_before_commit(conn: Connection, *_xid: Any) -> None:
    """Judge the claim in flight before a transaction that sent nothing else commits (or
    prepares, for a two-phase commit)."""
    _claim_before_statement(conn, None, "", None, None, False)


def _claim_before_rollback(conn: Connection, *_twophase: Any) -> None:
    """Read the claim in flight before a rollback; the rollback undoes it either way."""
    if _IN_FLIGHT:
        claim = _take_claim(conn)
        if claim is not None:
            try:
                _read_claim(claim)
            except FenceError:
                pass  # refused or failed: the transaction ends here anyway


def _claim_before_reset(dbapi_connection: Any, record: Any, reset_state: Any) -> None:
    """Read a claim still in flight on a connection the pool takes back (a session that
    was dropped without being closed), so the pool's rollback can be sent."""
    if _IN_FLIGHT:
        claim = _IN_FLIGHT.pop(record.driver_connection, None)
        if claim is not None and reset_state.asyncio_safe:
            try:
                _read_claim(claim)
            except FenceError:
                pass  # the pool's rollback follows, or the connection is discarded


class _Psycopg:
    """What the claim's hot path uses of psycopg, imported once (psycopg is optional)."""

    def __init__(self) -> None:
        from psycopg import AsyncConnection, IsolationLevel, errors, generators, pq

        self.AsyncConnection = AsyncConnection
        self.IsolationLevel = IsolationLevel
        self.errors = errors
        self.execute = generators.execute
        self.COMMAND_OK = pq.ExecStatus.COMMAND_OK
        self.SQLSTATE = pq.DiagnosticField.SQLSTATE
        self.begins: dict[tuple[Any, Any, Any], bytes] = {}


_PSYCOPG: list[_Psycopg] = []


def _psycopg() -> _Psycopg:
    if not _PSYCOPG:
        _PSYCOPG.append(_Psycopg())
    return _PSYCOPG[0]


def _pg_begin(raw: Any, pg: _Psycopg) -> bytes:
    """``BEGIN`` with the connection's transaction characteristics, as psycopg sends it."""
    shape = (raw.isolation_level, raw.read_only, raw.deferrable)
    begin = pg.begins.get(shape)
    if begin is None:
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
        begin = pg.begins[shape] = b" ".join(words)
    return begin


def _pg_claim(register: Table, raw: Any) -> tuple[bytes, bytes]:
    """The name of a register's prepared claim and the ``PREPARE`` that defines it.

    The statement is the psycopg register guard's claim in its prepared form
    (:meth:`PgRegisterStatements.prepared_claim`). The name is derived from the statement's
    text, so two processes that share a server session (through a transaction pooler) and
    name the same statement mean the same one.
    """
    import hashlib

    from ._pg_statements import PgRegisterStatements

    table = (register.schema, register.name) if register.schema else register.name
    body = PgRegisterStatements(table).prepared_claim().as_bytes(raw)
    name = b"iofence_claim_" + hashlib.sha1(body, usedforsecurity=False).hexdigest()[:16].encode()
    return name, b"PREPARE %s AS %s; " % (name, body)


#: Scopes that are their own SQL literal between quotes: printable ASCII without a quote
#: or a backslash reads the same in every server encoding and string setting.
_PLAIN_SCOPE = re.compile(r"[ -&(-\[\]-~]*")


def _pg_literal(value: str, raw: Any) -> bytes:
    if _PLAIN_SCOPE.fullmatch(value):
        return b"'%s'" % value.encode("ascii")
    from psycopg import sql as pg_sql

    return pg_sql.Literal(value).as_bytes(raw)


def _pg_read(raw: Any, found: SessionBinding) -> list[Any]:
    """Finish sending what is queued on psycopg's connection and read its results."""
    pg = _psycopg()
    try:
        if isinstance(raw, pg.AsyncConnection):
            results: list[Any] = await_only(raw.wait(pg.execute(raw.pgconn)))
        else:
            results = raw.wait(pg.execute(raw.pgconn))
    except pg.errors.Error as exc:
        raise translate_error(exc, "fence claim", found.scope) from exc
    return results


def _pg_send(raw: Any, query: bytes, found: SessionBinding) -> list[Any]:
    """Send one simple-protocol message on psycopg's connection and return its results."""
    pg = _psycopg()
    try:
        raw.pgconn.send_query(query)
    except pg.errors.Error as exc:
        raise translate_error(exc, "fence claim", found.scope) from exc
    return _pg_read(raw, found)


def _pg_error(raw: Any, results: list[Any], found: SessionBinding) -> FenceError:
    """The error of a claim's message that failed, in the ``FenceError`` family."""
    from psycopg import errors, pq

    for result in results:
        if result.status not in (pq.ExecStatus.COMMAND_OK, pq.ExecStatus.TUPLES_OK):
            failure = errors.error_from_result(result, encoding=raw.info.encoding)
            err: FenceError = (
                missing_register_error(found.register.name)
                if missing_table(failure)
                else translate_error(failure, "fence claim", found.scope)
            )
            err.__cause__ = failure
            return err
    return translate_error(RuntimeError("the claim returned no rows"), "fence claim", found.scope)


# Each register's prepared claim (its name and its PREPARE), composed once; the names a
# connection has prepared live in its pool entry's info, under this key.
_PG_CLAIMS: weakref.WeakKeyDictionary[Table, tuple[bytes, bytes]] = weakref.WeakKeyDictionary()
_PREPARED_KEY = "iofence.prepared_claims"


def _check_read(connection: Connection, found: SessionBinding) -> None:
    """A read binding's check (C13): refused if a writer newer than the lease has claimed
    the scope. It reads the register row and never raises the fence."""
    fence = FenceRegister(connection, found.register, events=found.events).fence(found.scope)
    try:
        check_read(found.scope, found.token, fence)
    except _FenceStale as err:
        raise StaleTokenError.from_guard(err, None, None) from None


def _before_commit(session: Session) -> None:
    found: SessionBinding | None = session.info.get(BINDING_KEY)
    if found is None:
        return
    # A claim whose transaction sent nothing else is judged here, before the flush and the
    # commit: SQLAlchemy 2.0.28 loses a refusal raised inside a two-phase prepare in a
    # rollback of its own there (IllegalStateChangeError).
    for connection in session.info.pop(_CLAIMED_KEY, ()):
        _claim_before_commit(connection)
    if found.read_only:
        # Read again at the end: what the transaction read was written under a token no
        # newer than the lease (a newer writer's claim commits with its writes).
        connection = session.info.pop(_READ_CHECK_KEY, None)
        if connection is not None:
            _check_read(connection, found)
    if not found.check_lease or found.lease is None:
        return
    check_lease(found.lease)


def check_lease(lease: Lease | AsyncLease) -> None:
    """Raise :class:`fence.LeaseLostError` unless ``lease`` is still valid.

    An expired lease counts as lost here: the work must not commit on it.
    """
    try:
        lease.check()
    except LeaseLostError:
        raise
    except LeaseExpiredError as exc:
        raise LeaseLostError(
            f"lease on {lease.resource!r} (token {lease.token}) is no longer valid before "
            f"commit: {exc}; nothing was committed",
            resource=lease.resource,
            token=lease.token,
            remaining=exc.remaining,
            cause="the lease ran out before commit",
        ) from exc


# -- installation -------------------------------------------------------------------------

_INSTALLED = False


def install() -> None:
    """Install the listeners (once per process; importing ``fence.adapters.orm`` does it).

    They are class-level listeners on :class:`~sqlalchemy.orm.Session` (and so on every
    ``AsyncSession.sync_session``), on :class:`~sqlalchemy.orm.Mapper`, on
    :class:`~sqlalchemy.Engine` (also through the gate, ``_sql_gate``) and on
    :class:`~sqlalchemy.pool.Pool` (a claim still in flight when a connection returns).
    Writes to tables without a fence, outside a session bound to a lease, pass untouched.
    """
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    gate.install()
    gate.set_hooks(_session_statement, _allows_of)
    event.listen(Session, "before_flush", _before_flush)
    event.listen(Session, "after_transaction_create", _after_transaction_create)
    event.listen(Session, "after_transaction_end", _after_transaction_end)
    event.listen(Session, "after_begin", _after_begin)
    event.listen(Session, "before_commit", _before_commit)
    event.listen(Session, "do_orm_execute", _do_orm_execute)
    event.listen(Mapper, "before_insert", _set_fence)
    event.listen(Mapper, "before_update", _set_fence)
    event.listen(Mapper, "before_delete", _mark_flushing)
    event.listen(Mapper, "after_mapper_constructed", _mapper_constructed)
    event.listen(Engine, "after_cursor_execute", _after_cursor_execute)
    event.listen(Engine, "after_execute", _after_execute)
    event.listen(Engine, "before_cursor_execute", _claim_before_statement)
    event.listen(Engine, "commit", _claim_before_commit)
    event.listen(Engine, "prepare_twophase", _claim_before_commit)
    event.listen(Engine, "rollback", _claim_before_rollback)
    event.listen(Engine, "rollback_twophase", _claim_before_rollback)
    event.listen(Pool, "reset", _claim_before_reset)
    for mapper in _all_mappers():
        _mapper_constructed(mapper, mapper.class_)


def _all_mappers() -> list[Mapper[Any]]:
    from sqlalchemy.orm import mapperlib

    found: list[Mapper[Any]] = []
    for registry in list(mapperlib._mapper_registries):
        found.extend(registry.mappers)
    return found
