"""Fenced writes to SQL rows through SQLAlchemy Core, inside the caller's transaction.

The guards never begin, commit, roll back or close the caller's transaction: they run
their statements on the connection they are given, and a rejected write changes nothing.
The guards are the flows of ``row_flow`` over the statements of ``_sql_statements`` for the
connection's dialect and the executor here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from sqlalchemy import CursorResult, Executable, Row, Table
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection

from fence._errors import BackendError, ConfigurationError
from fence._events import EventBus

from .._judge import ensure_judged
from .._sql_common import RowScope, closed_connection_error, documented, translate_error
from .._sql_gate import OWN_OPTIONS
from .._sql_statements import (
    DEFAULT_REGISTER,
    dialect_register_statements,
    dialect_row_statements,
)
from .._triggers import Judged
from .row_flow import AsyncRegisterFlow, AsyncRowFlow

__all__ = ["AsyncFenceRegister", "AsyncRowGuard"]

SOURCE = "sql-guard"


def _returning(choice: bool | None, supported: bool, what: str, dialect: str) -> bool:
    if choice is None:
        return supported
    if choice and not supported:
        raise ConfigurationError(f"the {dialect} dialect has no {what} RETURNING")
    return choice


def _count(result: CursorResult[Any]) -> int:
    """How many rows a write changed, as the driver reports it."""
    if result.rowcount < 0:  # C9: a write that cannot be verified is refused, not guessed
        raise BackendError(
            "the driver did not report how many rows the fenced write changed, so it cannot "
            "be verified; roll the transaction back",
            code="UNVERIFIABLE",
        )
    return result.rowcount


class AsyncCoreExecutor:
    """Runs a guard's statements on a SQLAlchemy connection (``row_flow.AsyncExecutor``).

    Every statement carries the guards' own execution options, which the gate that refuses
    unfenced writes lets through.

    Args:
        conn: the caller's connection.
    """

    def __init__(self, conn: AsyncConnection) -> None:
        self.conn = conn
        dialect = conn.dialect
        self.driver = dialect.name
        self.counts_rows = dialect.supports_sane_rowcount
        self.counts_many = dialect.supports_sane_multi_rowcount

    async def execute(
        self,
        stmt: Executable,
        params: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None,
        action: str,
        scope: str | RowScope,
    ) -> CursorResult[Any]:
        """Run a statement; return its result."""
        if self.conn.closed:
            raise closed_connection_error()
        try:
            return await self.conn.execute(stmt, params, execution_options=OWN_OPTIONS)
        except SQLAlchemyError as exc:
            raise translate_error(exc, action, str(scope)) from exc

    async def run(
        self,
        stmt: Executable,
        params: Mapping[str, Any] | None,
        returning: bool,
        action: str,
        scope: str | RowScope,
    ) -> tuple[int, list[Row[Any]]]:
        """Run a write; return how many rows it changed and the rows it returned."""
        if self.conn.closed:
            raise closed_connection_error()
        try:
            result = await self.conn.execute(stmt, params, execution_options=OWN_OPTIONS)
        except SQLAlchemyError as exc:
            raise translate_error(exc, action, str(scope)) from exc
        if returning:
            rows = list(result.all())
            return len(rows), rows
        return _count(result), []

    async def read(
        self, stmt: Executable, params: Mapping[str, Any] | None, action: str, scope: str
    ) -> Sequence[Row[Any]]:
        """Run a read; return its rows."""
        return (await self.execute(stmt, params, action, scope)).all()

    async def many(
        self, stmt: Executable, params: Sequence[Mapping[str, Any]], action: str, scope: str
    ) -> int:
        """Run a statement once per parameter set; return the rows it changed in all."""
        return _count(await self.execute(stmt, params, action, scope))

    async def atomically(
        self,
        body: Callable[[], Awaitable[bool]],  # unasync: body: Callable[[], bool],
        action: str,
        scope: str,
        opener: Executable | None = None,
    ) -> bool:
        """Run ``body`` in a savepoint (``begin_nested``), kept if it returns ``True``."""
        conn = self.conn
        if conn.closed:
            raise closed_connection_error()
        try:
            if opener is not None:
                await conn.execute(opener, execution_options=OWN_OPTIONS)
            savepoint = await conn.begin_nested()
            try:
                keep = await body()
            except BaseException:
                # Undo the batch; an error here (a dead connection) must not hide the first.
                with contextlib.suppress(SQLAlchemyError):
                    await savepoint.rollback()
                raise
            if keep:
                await savepoint.commit()
            else:
                await savepoint.rollback()
            return keep
        except SQLAlchemyError as exc:
            raise translate_error(exc, action, scope) from exc

    async def column_types(self, statements: Any, *, again: bool) -> None:
        """Nothing to read: the statements know the column types from their table."""

    async def judge(self, judged: Judged) -> None:
        """Refuse a table whose triggers are missing or outdated (C14): read once per table
        and DBAPI connection (``_judge.ensure_judged``)."""
        if self.conn.closed:
            raise closed_connection_error()
        await self.conn.run_sync(ensure_judged, judged)  # unasync: ensure_judged(self.conn, judged)


class AsyncRowGuard(AsyncRowFlow[Row[Any]]):
    """Fenced writes to the rows of one table; each row is its own fence scope (C4-C9).

    The table needs a fence column (:func:`fence_column`). With a tombstone column
    (:func:`tombstone_column`) it also gets fenced deletes that keep the row as a tombstone,
    and claims of rows that do not exist yet.

    Each write is one statement that checks ``fence <= token`` and sets ``fence = token``
    with the data. When it changes nothing, a diagnostic read tells ``MISSING`` from
    ``STALE`` and reports the current fence; the transaction stays usable.

    Args:
        conn: the caller's connection; the guard runs inside its transaction.
        table: the table.
        fence: the fence column's name (default: the :func:`fence_column` of the table).
        tombstone: the soft-delete column's name (default: its :func:`tombstone_column`).
        key: the columns naming a row (default: the primary key).
        returning: ``True``: writes return the written row (``RETURNING *``, whose
            transfer and decoding cost about as much again as the check). By default writes
            return ``None`` and the row count proves them, at the cost of a plain statement
            (``RETURNING`` only where the driver reports no row count), and
            :meth:`read_for_update` returns its row by ``RETURNING``. ``False``: no
            ``RETURNING`` at all (:meth:`read_for_update` then returns ``None``).
        events: the bus for ``WRITE_ACCEPTED`` / ``WRITE_REJECTED`` (default bus if omitted).

    Raises:
        ConfigurationError: the table lacks a fence column or a key.

    Example::

        async with engine.begin() as conn:
            guard = AsyncRowGuard(conn, accounts)
            await guard.update(42, lease.token, {"balance": 10})
    """

    _tombstone_hint = "tombstone_column()"

    executor: AsyncCoreExecutor

    def __init__(
        self,
        conn: AsyncConnection,
        table: Table,
        *,
        fence: str | None = None,
        tombstone: str | None = None,
        key: Sequence[str] | None = None,
        returning: bool | None = None,
        events: EventBus | None = None,
    ) -> None:
        dialect = conn.dialect
        statements = dialect_row_statements(table, fence, tombstone, key, dialect)
        # RETURNING for the reads that return a row; for writes only when asked for, or
        # when the driver cannot count rows (then RETURNING is the proof of the write).
        update_returning = _returning(returning, dialect.update_returning, "UPDATE", dialect.name)
        insert_returning = _returning(returning, dialect.insert_returning, "INSERT", dialect.name)
        counts = dialect.supports_sane_rowcount and returning is None
        write_update = update_returning and not counts
        write_insert = insert_returning and not counts
        super().__init__(
            AsyncCoreExecutor(conn),
            statements,
            events,
            SOURCE,
            update_returning=write_update,
            upsert_returning=write_insert,
            fence_returning=write_update and write_insert,
            read_returning=update_returning and insert_returning,
            # No UPDATE ... RETURNING (MariaDB, MySQL): the row is read after its fence.
            read_back=returning is not False and not (update_returning and insert_returning),
        )
        self.conn = conn

    fence = documented(AsyncRowFlow.fence)

    update = documented(AsyncRowFlow.update, returns=Row[Any] | None)

    upsert = documented(AsyncRowFlow.upsert, returns=Row[Any] | None)

    claim = documented(AsyncRowFlow.claim)

    read_for_update = documented(
        AsyncRowFlow.read_for_update,
        """A registering read (C8): raise the fence to ``token`` and return the row.

        It locks the row until the transaction ends and refuses a stale reader, so a
        read-modify-write cannot lose an update to a writer whose lease ended.

        Args:
            key: the row's key value.
            token: the fencing token.

        Returns:
            The row, or ``None`` if it is a tombstone or did not exist (then a tombstone
            now holds the fence). ``None`` as well when the guard runs on row counts.

        Raises:
            StaleTokenError: as for :meth:`claim`.
        """,
        returns=Row[Any] | None,
    )

    delete = documented(
        AsyncRowFlow.delete,
        """Fenced soft delete: mark the row deleted and keep its fence as a tombstone (C7).

        A stale writer can neither update nor upsert the row afterwards. Deleting a
        tombstone again raises its fence. A row that does not exist gets a tombstone.

        Args:
            key: the row's key value.
            token: the fencing token.

        Raises:
            ConfigurationError: the table has no tombstone column: a hard delete would let
                a stale writer insert the row again. Add :func:`tombstone_column`, or
                fence the scope with a :class:`AsyncFenceRegister` and delete by hand.
            StaleTokenError: as for :meth:`claim`.
        """,
    )

    update_many = documented(
        AsyncRowFlow.update_many,
        """Fenced update of many rows, all or nothing (C6), of any size.

        Every fence is checked before the first row is written; unless every row passes,
        none is written, and the error lists every rejected row. On PostgreSQL it is one
        statement (one array per column); on SQLite, a read of the fences and then the
        single-row update, in a savepoint (see the docs, "Batches").

        Args:
            token: the fencing token.
            items: key to column values; the rows may set different columns.

        Raises:
            InvalidTokenError: ``token`` is not a valid token; nothing was sent.
            ConfigurationError: a key twice, an unknown column, the key or the fence among
                the values; nothing was sent.
            StaleTokenError: with ``.rejected`` holding one error per rejected row
                (``STALE``, ``MISSING`` or ``UNVERIFIABLE``); nothing was written.
            RetryableError, BackendError: as for :meth:`update`.
        """,
    )

    upsert_many = documented(
        AsyncRowFlow.upsert_many,
        """Fenced insert-or-replace of many rows, all or nothing (C6), of any size.

        Every existing fence of the batch is checked before the first row is written. On
        PostgreSQL it is one statement (one array per column) in a savepoint, which also
        undoes the batch if a concurrent transaction inserts one of its absent keys with a
        newer fence; on SQLite, a read of the fences and then the single-row upsert, in a
        savepoint (see the docs, "Batches").

        Args:
            token: the fencing token.
            rows: the rows, each with its key; all set the same columns.

        Raises:
            StaleTokenError: with ``.rejected`` listing every rejected row; nothing written.
            ConfigurationError: not PostgreSQL or SQLite, rows with different columns, a key
                twice, an unknown column; nothing was sent.
            RetryableError, BackendError: as for :meth:`update`.
        """,
    )


class AsyncFenceRegister(AsyncRegisterFlow[Row[Any]]):
    """A fence register: fences kept in a table ``(scope PK, fence BIGINT)`` (C6, C7, C8).

    :meth:`claim` checks and raises the fence of a scope inside the caller's transaction
    and holds the register row's lock until it commits. Claim a scope first, then write
    any number of rows in any tables: the unit of work is fenced as one. A concurrent
    writer of the same scope waits on the lock and is then judged against the new fence.

    Register rows are never deleted, so they are the tombstones of whatever the scope
    covered: delete your rows by hand after a claim, and a stale writer that claims
    first is still refused.

    Timeline (READ COMMITTED)::

        B: BEGIN; claim("order:42", 34) ... writes ...        COMMIT
        A:        BEGIN; claim("order:42", 33) -> waits on B's lock -> STALE (fence 34)

    Args:
        conn: the caller's connection; the register runs inside its transaction.
        table: the register table (default: ``fence_register``; see
            :func:`fence_register_table` and the DDL in the docs).
        returning: ``True`` to prove claims by ``RETURNING`` (default: by their row count,
            as a plain statement; ``RETURNING`` only where the driver reports no row count).
        events: the bus for ``WRITE_ACCEPTED`` / ``WRITE_REJECTED``.

    Example::

        async with engine.begin() as conn:
            register = AsyncFenceRegister(conn)
            await register.claim("order:42", lease.token)
            await conn.execute(update(orders).where(...).values(...))
            await conn.execute(insert(order_lines).values(...))
    """

    executor: AsyncCoreExecutor

    def __init__(
        self,
        conn: AsyncConnection,
        table: Table | None = None,
        *,
        returning: bool | None = None,
        events: EventBus | None = None,
    ) -> None:
        dialect = conn.dialect
        statements = dialect_register_statements(
            table if table is not None else DEFAULT_REGISTER, dialect
        )
        supported = _returning(returning, dialect.insert_returning, "INSERT", dialect.name)
        # A claim returns nothing: its row count proves it, unless the driver cannot count.
        counts = dialect.supports_sane_rowcount and returning is None
        super().__init__(
            AsyncCoreExecutor(conn), statements, events, SOURCE, returning=supported and not counts
        )
        self.conn = conn

    fence = documented(AsyncRegisterFlow.fence)

    claim = documented(AsyncRegisterFlow.claim)

    claim_many = documented(AsyncRegisterFlow.claim_many)

    async def read(
        self,
        scope: str,
        token: int,
        statement: Executable,
        params: Mapping[str, Any] | None = None,
    ) -> CursorResult[Any]:
        """A registering read (C8): claim ``scope``, then run ``statement`` and return it.

        For read-modify-write: once the claim holds, a stale holder cannot write between
        this read and the caller's own writes.

        Args:
            scope: the fence scope.
            token: the fencing token.
            statement: the read to run after the claim (any executable).
            params: its parameters.

        Raises:
            StaleTokenError: the claim was refused; the read did not run.
            InvalidTokenError, RetryableError, BackendError: as for :meth:`claim`.
        """
        await self.claim(scope, token)
        return await self.executor.execute(statement, params, "registering read", scope)
