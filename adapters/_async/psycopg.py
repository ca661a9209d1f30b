"""Fenced writes to PostgreSQL rows through plain psycopg 3, inside the caller's transaction.

The guards never begin, commit, roll back or close the caller's transaction: they run
their statements on the connection they are given, and a rejected write changes nothing.
The guards are the flows of ``row_flow`` over the statements of ``_pg_statements`` and the
executor here.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import psycopg
from psycopg import sql
from psycopg.pq import TransactionStatus
from psycopg.rows import dict_row, tuple_row

from fence._errors import BackendError, ConfigurationError
from fence._events import EventBus

from .._pg_statements import (
    JUDGED,
    TYPES_QUERY,
    ColumnType,
    PgRowStatements,
    TableName,
    read_types,
    register_calls,
    row_statements,
)
from .._sql_common import (
    DEFAULT_FENCE_COLUMN,
    DEFAULT_REGISTER_TABLE,
    RowScope,
    closed_connection_error,
    documented,
    translate_error,
)
from .._triggers import PG_CHECK_QUERY, Judged, verdict
from .row_flow import AsyncRegisterFlow, AsyncRowFlow

__all__ = ["AsyncFenceRegister", "AsyncRowGuard"]

SOURCE = "psycopg-guard"
_SAVEPOINT = "iofence_batch"

Rows = list[dict[str, Any]]

#: A statement psycopg can run: a string or a :mod:`psycopg.sql` composition.
Query = str | bytes | sql.SQL | sql.Composed

#: Its parameters: positional, or named (``%(name)s``).
Params = Sequence[Any] | Mapping[str, Any]

# The column types of each table a batch wrote, per connection (search_path is per
# connection): read once, and again when a batch finds that one has changed.
_TYPES: weakref.WeakKeyDictionary[Any, dict[str, dict[str, ColumnType]]] = (
    weakref.WeakKeyDictionary()
)

_CHECK = PG_CHECK_QUERY.format(param="%(t)s")


class AsyncPgExecutor:
    """Runs a guard's statements on a psycopg connection (``row_flow.AsyncExecutor``).

    Args:
        conn: the caller's connection.
    """

    driver = "postgresql"
    counts_rows = True
    counts_many = True

    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self.conn = conn
        # Cursors of the connection that :meth:`run` and :meth:`read` reuse, one per
        # statement under way: a new psycopg cursor (its adapters and transformer) costs
        # about as much as the guard's own checks. Each is taken off its list for one
        # statement and put back after it (never after an error), so two statements under
        # way at once (threads, tasks) never share one.
        self._cursors: list[psycopg.AsyncCursor[tuple[Any, ...]]] = []
        self._dict_cursors: list[psycopg.AsyncCursor[dict[str, Any]]] = []

    async def run(
        self, stmt: Query, params: Params, returning: bool, action: str, scope: str | RowScope
    ) -> tuple[int, Rows]:
        """Run one statement; return its row count and, with ``returning``, the rows it
        returned (as dicts)."""
        if self.conn.closed:
            raise closed_connection_error()
        if returning:
            free = self._dict_cursors
            cur = free.pop() if free else self.conn.cursor(row_factory=dict_row)
            try:
                await cur.execute(stmt, params)
                # rownumber is None without a result set (cheaper than the description).
                rows = await cur.fetchall() if cur.rownumber is not None else []
            except psycopg.Error as exc:
                raise translate_error(exc, action, str(scope)) from exc
            count = cur.rowcount
            free.append(cur)
            return count, rows
        plain = self._cursors
        cursor = plain.pop() if plain else self.conn.cursor(row_factory=tuple_row)
        try:
            await cursor.execute(stmt, params)
        except psycopg.Error as exc:
            raise translate_error(exc, action, str(scope)) from exc
        count = cursor.rowcount
        plain.append(cursor)
        return count, []

    async def read(
        self, stmt: Query, params: Params, action: str, scope: str
    ) -> list[tuple[Any, ...]]:
        """Run a read; return its rows as tuples."""
        if self.conn.closed:
            raise closed_connection_error()
        free = self._cursors
        cur = free.pop() if free else self.conn.cursor(row_factory=tuple_row)
        try:
            await cur.execute(stmt, params)
            rows = await cur.fetchall()
        except psycopg.Error as exc:
            raise translate_error(exc, action, scope) from exc
        free.append(cur)
        return rows

    async def many(
        self, stmt: Query, params: Sequence[Sequence[Any]], action: str, scope: str
    ) -> int:
        """Send one statement with ``executemany``; return the rows it changed in all."""
        try:
            async with self.conn.cursor() as cur:
                await cur.executemany(stmt, params)
                return cur.rowcount
        except psycopg.Error as exc:
            raise translate_error(exc, action, scope) from exc

    async def atomically(
        self,
        body: Callable[[], Awaitable[bool]],  # unasync: body: Callable[[], bool],
        action: str,
        scope: str,
        opener: Any = None,
    ) -> bool:
        """Run ``body`` in a savepoint, kept if it returns ``True``, else undone.

        Inside a transaction (the usual case) this is ``SAVEPOINT`` ... ``RELEASE`` or
        ``ROLLBACK TO``; the caller's transaction goes on. On an autocommit connection
        outside any transaction it is a transaction of its own. An error in ``body`` undoes
        it too, and propagates. psycopg begins its transactions itself: no ``opener``.
        """
        if self.conn.closed:
            raise closed_connection_error()
        idle = self.conn.info.transaction_status == TransactionStatus.IDLE
        if self.conn.autocommit and idle:
            try:
                async with self.conn.transaction():
                    keep = await body()
                    if not keep:
                        raise psycopg.Rollback()
                return keep
            except psycopg.Error as exc:
                raise translate_error(exc, action, scope) from exc
        await self.run(f"SAVEPOINT {_SAVEPOINT}", (), False, action, scope)
        try:
            keep = await body()
        except BaseException:
            # Undo the batch; an error here (a dead connection) must not hide the first.
            with contextlib.suppress(psycopg.Error, BackendError):
                await self.conn.execute(f"ROLLBACK TO SAVEPOINT {_SAVEPOINT}")
                await self.conn.execute(f"RELEASE SAVEPOINT {_SAVEPOINT}")
            raise
        if not keep:
            await self.run(f"ROLLBACK TO SAVEPOINT {_SAVEPOINT}", (), False, action, scope)
        await self.run(f"RELEASE SAVEPOINT {_SAVEPOINT}", (), False, action, scope)
        return keep

    async def column_types(
        self, statements: PgRowStatements, *, again: bool
    ) -> dict[str, ColumnType]:
        """The table's column types, read once per connection (again, with ``again``)."""
        s = statements
        known = _TYPES.setdefault(self.conn, {})
        types = None if again else known.get(s.regclass)
        if types is None:
            _, rows = await self.run(TYPES_QUERY, (s.regclass,), True, "column types", s.name)
            if not rows:
                raise ConfigurationError(f"table {s.name} has no columns")
            types = known[s.regclass] = read_types(rows)
        s.check_types(types)
        return types

    async def judge(self, judged: Judged) -> None:
        """Refuse a table whose triggers are missing or outdated (C14): read from the
        catalogue once per table and connection, a set lookup after that."""
        checked = JUDGED.setdefault(self.conn, set())
        key = (judged.qualified, judged.kind, judged.fence)
        if key in checked:
            return
        rows = await self.read(
            _CHECK, {"t": judged.qualified}, "the check of the judge's triggers", judged.table
        )
        exists, why = verdict("postgresql", rows, judged)
        if why is not None:
            raise ConfigurationError(f"{why}; {judged.hint('postgresql')}")
        if exists:
            checked.add(key)


class AsyncRowGuard(AsyncRowFlow[dict[str, Any]]):
    """Fenced writes to the rows of one PostgreSQL table through psycopg (C4-C9).

    The same contract as :class:`fence.adapters.sql.AsyncRowGuard`, on a plain psycopg
    connection: the table needs a fence column ``BIGINT NOT NULL DEFAULT 0``, and a
    tombstone column ``BOOLEAN NOT NULL DEFAULT FALSE`` for fenced deletes. Rows come back
    as dicts.

    Args:
        conn: the caller's connection; the guard runs inside its transaction.
        table: the table name, or ``(schema, name)``.
        key: the key column or columns (a primary key or unique constraint).
        fence: the fence column.
        tombstone: the soft-delete column; ``None`` if the table has none.
        tombstone_insert: whether a tombstone holding only the key and fence can be
            inserted for an absent row (every other column nullable or defaulted). Set it
            to ``False`` when it cannot: claims of absent rows are then ``MISSING``.
        returning: ``True``: :meth:`update` and :meth:`upsert` return the written row
            (``RETURNING *``, its transfer and decoding cost about as much again as the
            check). By default they return ``None`` and the row count proves the write,
            at the cost of a plain ``UPDATE``; :meth:`read_for_update` returns its row
            either way.
        events: the bus for ``WRITE_ACCEPTED`` / ``WRITE_REJECTED``.

    Example::

        async with await psycopg.AsyncConnection.connect(dsn) as conn:
            guard = AsyncRowGuard(conn, "accounts", key="id", tombstone="deleted")
            await guard.update(42, lease.token, {"balance": 10})
    """

    executor: AsyncPgExecutor

    def __init__(
        self,
        conn: psycopg.AsyncConnection[Any],
        table: TableName,
        *,
        key: str | Sequence[str] = "id",
        fence: str = DEFAULT_FENCE_COLUMN,
        tombstone: str | None = None,
        tombstone_insert: bool = True,
        returning: bool | None = None,
        events: EventBus | None = None,
    ) -> None:
        statements = row_statements(
            table,
            (key,) if isinstance(key, str) else tuple(key),
            fence,
            tombstone,
            tombstone_insert,
        )
        self.returning = bool(returning)
        # Claims, deletes and registering reads always return the row.
        super().__init__(
            AsyncPgExecutor(conn),
            statements,
            events,
            SOURCE,
            update_returning=self.returning,
            upsert_returning=self.returning,
            fence_returning=True,
            read_returning=True,
        )
        self.conn = conn

    fence = documented(AsyncRowFlow.fence)

    update = documented(AsyncRowFlow.update, returns=dict[str, Any] | None)

    upsert = documented(AsyncRowFlow.upsert, returns=dict[str, Any] | None)

    claim = documented(AsyncRowFlow.claim)

    read_for_update = documented(
        AsyncRowFlow.read_for_update,
        """A registering read (C8): raise the fence to ``token`` and return the row.

        The row stays locked until the transaction ends, and a stale reader is refused.

        Returns:
            The row, or ``None`` if it is a tombstone or was absent (a tombstone now holds
            the fence).

        Raises:
            StaleTokenError: as for :meth:`claim`.
        """,
        returns=dict[str, Any] | None,
    )

    delete = documented(
        AsyncRowFlow.delete,
        """Fenced soft delete: mark the row deleted, keep its fence as a tombstone (C7).

        Raises:
            ConfigurationError: the guard has no tombstone column (a hard delete would let
                a stale writer insert the row again); use a fence register instead.
            StaleTokenError: as for :meth:`claim`.
        """,
    )

    update_many = documented(
        AsyncRowFlow.update_many,
        """Fenced update of many rows, all or nothing (C6), of any size.

        Every fence is checked before the first row is written; unless every row passes,
        none is written, and the error lists every rejected row. It is one statement with
        one array per column, cast to the column's type: the guard reads the types from the
        catalogue once, before its first batch (see the docs, "Batches").

        Args:
            token: the fencing token.
            items: key to column values; rows may set different columns.

        Raises:
            ConfigurationError: a key twice, a column the table lacks, the key or the fence
                among the values; nothing was written.
            StaleTokenError: ``.rejected`` holds one error per rejected row; nothing
                was written.
            InvalidTokenError, RetryableError, BackendError: as for :meth:`update`.
        """,
    )

    upsert_many = documented(
        AsyncRowFlow.upsert_many,
        """Fenced insert-or-replace of many rows, all or nothing (C6), of any size.

        Every existing fence of the batch is checked before the first row is written. It is
        one statement with one array per column, cast to the column's type, in a savepoint
        that also undoes the batch if a concurrent transaction inserts one of its absent
        keys with a newer fence; the caller's transaction goes on either way.

        Args:
            token: the fencing token.
            rows: the rows, each with its key; all set the same columns.

        Raises:
            StaleTokenError: ``.rejected`` lists every rejected row; nothing was written.
            ConfigurationError: rows set different columns, a key twice, a column the table
                lacks; nothing was written.
            InvalidTokenError, RetryableError, BackendError: as for :meth:`update`.
        """,
    )


class AsyncFenceRegister(AsyncRegisterFlow[dict[str, Any]]):
    """A fence register on PostgreSQL through psycopg (C6, C7, C8).

    Fences live in a table ``(scope PK, fence BIGINT)``. :meth:`claim` checks and raises
    the fence of a scope inside the caller's transaction and keeps the register row locked
    until it commits, so a unit of work spanning many rows and tables is fenced as one.
    Register rows are never deleted: they are the tombstones of what a scope covered.

    Args:
        conn: the caller's connection.
        table: the register table (see the DDL in the docs), or ``(schema, name)``.
        events: the bus for ``WRITE_ACCEPTED`` / ``WRITE_REJECTED``.

    Example::

        async with conn.transaction():
            register = AsyncFenceRegister(conn)
            await register.claim("order:42", lease.token)
            await conn.execute("UPDATE orders SET ... WHERE id = %s", (42,))
    """

    executor: AsyncPgExecutor

    def __init__(
        self,
        conn: psycopg.AsyncConnection[Any],
        table: TableName = DEFAULT_REGISTER_TABLE,
        *,
        events: EventBus | None = None,
    ) -> None:
        # A claim returns its scope.
        super().__init__(
            AsyncPgExecutor(conn), register_calls(table), events, SOURCE, returning=True
        )
        self.conn = conn

    fence = documented(AsyncRegisterFlow.fence)

    claim = documented(AsyncRegisterFlow.claim)

    claim_many = documented(AsyncRegisterFlow.claim_many)

    async def read(
        self, scope: str, token: int, query: Query, params: Sequence[Any] = ()
    ) -> list[dict[str, Any]]:
        """A registering read (C8): claim ``scope``, then run ``query`` and return its rows.

        Args:
            scope: the fence scope.
            token: the fencing token.
            query: the read to run after the claim.
            params: its parameters.

        Returns:
            The rows, as dicts.

        Raises:
            StaleTokenError: the claim was refused; the read did not run.
            InvalidTokenError, RetryableError, BackendError: as for :meth:`claim`.
        """
        await self.claim(scope, token)
        _, rows = await self.executor.run(query, params, True, "registering read", scope)
        return rows
