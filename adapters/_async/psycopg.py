"""Fenced writes to PostgreSQL rows through plain psycopg 3, inside the caller's transaction.

The guards never begin, commit, roll back or close the caller's transaction: they run
their statements on the connection they are given, and a rejected write changes nothing.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import psycopg
from psycopg import sql
from psycopg.pq import TransactionStatus
from psycopg.rows import dict_row

from fence._core import validate_resource, validate_token
from fence._errors import BackendError, ConfigurationError, StaleTokenError
from fence._events import EventBus, default_bus

from .._pg_statements import (
    TYPES_QUERY,
    ColumnType,
    PgRegisterStatements,
    PgRowStatements,
    TableName,
    read_types,
    row_statements,
)
from .._sql_common import (
    ABSENT,
    CHUNK_PARAMS,
    DEFAULT_FENCE_COLUMN,
    DEFAULT_REGISTER_TABLE,
    Probe,
    RowScope,
    batch_rejection,
    batch_verdicts,
    chunks,
    closed_connection_error,
    key_order,
    lock_order,
    null_fence_error,
    probe_passes,
    probe_rejection,
    report_accepted,
    report_rejected,
    translate_error,
)

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


class _Base:
    """Statement execution, error mapping and verdict reporting shared by both guards."""

    def __init__(self, conn: psycopg.AsyncConnection[Any], events: EventBus | None) -> None:
        self.conn = conn
        self.events = events or default_bus
        # Cursors of the connection that :meth:`_count` and :meth:`_run` reuse, one per
        # statement under way: a new psycopg cursor (its adapters and transformer) costs
        # about as much as the guard's own checks. Each is taken off its list for one
        # statement and put back after it (never after an error), so two statements under
        # way at once (threads, tasks) never share one.
        self._cursors: list[psycopg.AsyncCursor[Any]] = []
        self._dict_cursors: list[psycopg.AsyncCursor[dict[str, Any]]] = []

    async def _run(
        self, query: Query, params: Params, action: str, scope: str | RowScope
    ) -> tuple[int, Rows]:
        """Run one statement; return its row count and the rows it returned (as dicts)."""
        if self.conn.closed:
            raise closed_connection_error()
        free = self._dict_cursors
        cur = free.pop() if free else self.conn.cursor(row_factory=dict_row)
        try:
            await cur.execute(query, params)
            # rownumber is None without a result set (cheaper than the description).
            rows = await cur.fetchall() if cur.rownumber is not None else []
        except psycopg.Error as exc:
            raise translate_error(exc, action, str(scope)) from exc
        count = cur.rowcount
        free.append(cur)
        return count, rows

    async def _count(self, query: Query, params: Params, action: str, scope: str | RowScope) -> int:
        """Run one statement that returns no rows; return its row count."""
        if self.conn.closed:
            raise closed_connection_error()
        free = self._cursors
        cur = free.pop() if free else self.conn.cursor()
        try:
            await cur.execute(query, params)
        except psycopg.Error as exc:
            raise translate_error(exc, action, str(scope)) from exc
        count = cur.rowcount
        free.append(cur)
        return count

    async def _many(
        self, query: Query, params: Sequence[Sequence[Any]], action: str, scope: str
    ) -> int:
        """Send one statement with ``executemany``; return the rows it changed in all."""
        try:
            async with self.conn.cursor() as cur:
                await cur.executemany(query, params)
                return cur.rowcount
        except psycopg.Error as exc:
            raise translate_error(exc, action, scope) from exc

    async def _atomically(
        self,
        body: Callable[[], Awaitable[bool]],  # unasync: body: Callable[[], bool],
        action: str,
        scope: str,
    ) -> bool:
        """Run ``body`` in a savepoint, kept if it returns ``True``, else undone.

        Inside a transaction (the usual case) this is ``SAVEPOINT`` ... ``RELEASE`` or
        ``ROLLBACK TO``; the caller's transaction goes on. On an autocommit connection
        outside any transaction it is a transaction of its own. An error in ``body`` undoes
        it too, and propagates.
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
        await self._run(f"SAVEPOINT {_SAVEPOINT}", (), action, scope)
        try:
            keep = await body()
        except BaseException:
            # Undo the batch; an error here (a dead connection) must not hide the first.
            with contextlib.suppress(psycopg.Error, BackendError):
                await self.conn.execute(f"ROLLBACK TO SAVEPOINT {_SAVEPOINT}")
                await self.conn.execute(f"RELEASE SAVEPOINT {_SAVEPOINT}")
            raise
        if not keep:
            await self._run(f"ROLLBACK TO SAVEPOINT {_SAVEPOINT}", (), action, scope)
        await self._run(f"RELEASE SAVEPOINT {_SAVEPOINT}", (), action, scope)
        return keep

    def _accepted(self, scopes: Sequence[str], token: int) -> None:
        if self.events.active:
            report_accepted(self.events, SOURCE, scopes, token)

    def _rejected(self, err: StaleTokenError) -> StaleTokenError:
        if self.events.active:
            report_rejected(self.events, SOURCE, err)
        return err


class AsyncRowGuard(_Base):
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
        super().__init__(conn, events)
        self.returning = bool(returning)
        self.statements: PgRowStatements = row_statements(
            table,
            (key,) if isinstance(key, str) else tuple(key),
            fence,
            tombstone,
            tombstone_insert,
        )

    async def _probe(self, keyvals: tuple[Any, ...], scope: str) -> Probe:
        _, rows = await self._run(self.statements.probe, keyvals, "diagnostic read", scope)
        if not rows:
            return ABSENT
        fence, dead = rows[0].values()
        return Probe(exists=True, fence=fence, live=not dead)

    async def fence(self, key: Any) -> int | None:
        """The fence of a row, ``None`` if the row does not exist.

        Raises:
            ConfigurationError: the row's fence column is NULL (C9).
            BackendError: the database failed.
        """
        keyvals = self.statements.key_values(key)
        scope = self.statements.scope(keyvals)
        probe = await self._probe(keyvals, scope)
        if probe.exists and probe.fence is None:
            raise null_fence_error(scope)
        return probe.fence

    async def update(
        self, key: Any, token: int, values: Mapping[str, Any]
    ) -> dict[str, Any] | None:
        """Fenced ``UPDATE``: write ``values`` to the row iff ``token >= fence`` (C4, C5).

        One statement: ``UPDATE t SET ..., fence = %s WHERE <key> AND fence <= %s
        [AND NOT deleted] RETURNING *``.

        Args:
            key: the row's key value (a tuple or mapping for a composite key).
            token: the fencing token of the caller's lease.
            values: column name to new value; neither the key nor the fence.

        Returns:
            The updated row, or ``None`` if the guard was built with ``returning=False``.

        Raises:
            InvalidTokenError: ``token`` is not a valid token; nothing was sent.
            StaleTokenError: ``STALE``, ``MISSING`` (no live row) or ``UNVERIFIABLE``
                (NULL fence); nothing was written.
            RetryableError: serialization failure or deadlock; retry the transaction.
            BackendError: the connection is closed or the database failed.
        """
        token = validate_token(token)
        s = self.statements
        keyvals = s.key_values(key)
        # The columns of a dict seen before need no check (other mappings take the check).
        returning = self.returning
        query = s.checked_updates.get((tuple(values), returning)) if type(values) is dict else None
        if query is None:
            values = s.check_values(values, upsert=False)
            if not values:
                raise ConfigurationError("a fenced update needs values; use claim() to only fence")
            shape = (tuple(values), returning)
            query = s.checked_updates[shape] = s.update(shape[0], returning)
        scope = RowScope(s.name, keyvals)
        params = (*values.values(), token, *keyvals, token)
        if returning:
            count, rows = await self._run(query, params, "fenced update", scope)
        else:
            count, rows = await self._count(query, params, "fenced update", scope), []
        if count == 1:
            if self.events.active:
                self._accepted((str(scope),), token)
            return rows[0] if rows else None
        probe = await self._probe(keyvals, str(scope))
        raise self._rejected(probe_rejection(str(scope), token, probe, need_live=True))

    async def upsert(self, token: int, values: Mapping[str, Any]) -> dict[str, Any] | None:
        """Fenced insert-or-replace (``ON CONFLICT DO UPDATE ... WHERE fence <= EXCLUDED.fence``).

        A tombstone comes back to life for a current token; a stale writer cannot bring
        it back (C7).

        Args:
            token: the fencing token.
            values: every column to write, including the key; not the fence.

        Returns:
            The written row, or ``None`` if the guard was built with ``returning=False``.

        Raises:
            StaleTokenError: the row holds a newer (or NULL) fence; nothing was written.
            InvalidTokenError, RetryableError, BackendError: as for :meth:`update`.
        """
        token = validate_token(token)
        s = self.statements
        data = s.check_values(values, upsert=True)
        keyvals = tuple(data[name] for name in s.key_names)
        scope = s.scope(keyvals)
        query, params = s.upsert(tuple(data), self.returning), (*data.values(), token)
        if self.returning:
            count, rows = await self._run(query, params, "fenced upsert", scope)
        else:
            count, rows = await self._count(query, params, "fenced upsert", scope), []
        if count == 1:
            self._accepted((scope,), token)
            return rows[0] if rows else None
        probe = await self._probe(keyvals, scope)
        raise self._rejected(probe_rejection(scope, token, probe, need_live=False))

    async def _raise_fence(
        self, key: Any, token: int, *, delete: bool, action: str
    ) -> dict[str, Any] | None:
        """Set ``fence = token`` on the row, inserting a tombstone if it is absent.

        Returns the row if it is live, else ``None``.
        """
        token = validate_token(token)
        s = self.statements
        keyvals = s.key_values(key)
        scope = s.scope(keyvals)
        count, rows = await self._run(
            s.raise_fence(delete=delete), (token, *keyvals, token), action, scope
        )
        probe: Probe | None = None
        if count != 1:
            probe = await self._probe(keyvals, scope)
            if not probe.exists and s.can_insert_tombstone:
                count, rows = await self._run(
                    s.insert_tombstone(delete=delete), (*keyvals, token), action, scope
                )
                if count != 1:
                    probe = await self._probe(keyvals, scope)
        if count == 1:
            self._accepted((scope,), token)
            row = rows[0]
            if s.tombstone_name is not None and row[s.tombstone_name]:
                return None
            return row
        assert probe is not None
        raise self._rejected(probe_rejection(scope, token, probe, need_live=False))

    async def claim(self, key: Any, token: int) -> int:
        """Raise the row's fence to ``token`` without writing data (C8); return the fence.

        A row that does not exist is claimed with a tombstone holding only its key and
        fence (needs a tombstone column); otherwise the claim is ``MISSING``.

        Raises:
            InvalidTokenError: ``token`` is not a valid token; nothing was sent.
            StaleTokenError: ``STALE``, ``MISSING`` or ``UNVERIFIABLE``; nothing written.
            RetryableError, BackendError: as for :meth:`update`.
        """
        await self._raise_fence(key, token, delete=False, action="fence claim")
        return token

    async def read_for_update(self, key: Any, token: int) -> dict[str, Any] | None:
        """A registering read (C8): raise the fence to ``token`` and return the row.

        The row stays locked until the transaction ends, and a stale reader is refused.

        Returns:
            The row, or ``None`` if it is a tombstone or was absent (a tombstone now holds
            the fence).

        Raises:
            StaleTokenError: as for :meth:`claim`.
        """
        return await self._raise_fence(key, token, delete=False, action="registering read")

    async def delete(self, key: Any, token: int) -> None:
        """Fenced soft delete: mark the row deleted, keep its fence as a tombstone (C7).

        Raises:
            ConfigurationError: the guard has no tombstone column (a hard delete would let
                a stale writer insert the row again); use a fence register instead.
            StaleTokenError: as for :meth:`claim`.
        """
        if self.statements.tombstone_name is None:
            raise ConfigurationError(
                f"a fenced delete of {self.statements.name} needs a tombstone column "
                "(tombstone=...) or a fence register: a hard delete would let a stale "
                "writer insert the row again"
            )
        await self._raise_fence(key, token, delete=True, action="fenced delete")

    # -- many rows --------------------------------------------------------------------

    def _keyed(self, pairs: Sequence[tuple[Any, Any]]) -> list[tuple[tuple[Any, ...], Any]]:
        out: dict[tuple[Any, ...], Any] = {}
        for key, values in pairs:
            keyvals = self.statements.key_values(key)
            if keyvals in out:
                raise ConfigurationError(f"key {keyvals!r} appears twice in the batch")
            out[keyvals] = values
        return list(out.items())

    async def _column_types(self, *, again: bool = False) -> Mapping[str, ColumnType]:
        """The table's column types, read once per connection (again, with ``again``)."""
        s = self.statements
        known = _TYPES.setdefault(self.conn, {})
        types = None if again else known.get(s.regclass)
        if types is None:
            _, rows = await self._run(TYPES_QUERY, (s.regclass,), "column types", s.name)
            if not rows:
                raise ConfigurationError(f"table {s.name} has no columns")
            types = known[s.regclass] = read_types(rows)
        s.check_types(types)
        return types

    async def _read_fences(
        self, keys: Sequence[tuple[Any, ...]], *, lock: bool, action: str
    ) -> dict[tuple[Any, ...], Probe]:
        """Fence and tombstone flag of each row of ``keys`` that exists.

        One statement with the keys in arrays, or, if they cannot travel in arrays,
        statements of at most :data:`CHUNK_PARAMS` parameters each.
        """
        s = self.statements
        width = len(s.key_names)
        reads: list[tuple[Query, Any]]
        types = _TYPES.get(self.conn, {}).get(s.regclass)
        call = None if types is None else s.probe_set_call(keys, types, lock=lock)
        if call is not None:
            reads = [call]
        else:
            per = CHUNK_PARAMS["postgresql"] // width
            reads = [
                (s.probe_many(len(chunk), lock=lock), [v for k in chunk for v in k])
                for chunk in chunks(keys, per)
            ]
        found: dict[tuple[Any, ...], Probe] = {}
        for query, params in reads:
            _, rows = await self._run(query, params, action, s.name)
            for row in rows:
                values = list(row.values())
                found[tuple(values[:width])] = Probe(True, values[width], not values[width + 1])
        return found

    async def _batch_rejection(
        self, keys: Sequence[tuple[Any, ...]], token: int, *, need_live: bool
    ) -> StaleTokenError:
        s = self.statements
        found = await self._read_fences(keys, lock=False, action="diagnostic read")
        errors = batch_verdicts(s.name, keys, found, token, need_live=need_live, everything=True)
        return batch_rejection(s.name, token, errors)

    def _partial(self, count: int, total: int) -> BackendError:
        return BackendError(
            f"a batch on {self.statements.name} wrote {count} of {total} rows; roll the "
            "transaction back",
            code="PARTIAL",
        )

    def _accepted_rows(self, keys: Sequence[tuple[Any, ...]], token: int) -> None:
        if self.events.active:
            self._accepted([self.statements.scope(k) for k in keys], token)

    async def _row_path(
        self,
        keys: Sequence[tuple[Any, ...]],
        token: int,
        writes: Sequence[tuple[Query, list[tuple[Any, ...]]]],
        *,
        need_live: bool,
        action: str,
    ) -> bool:
        """Write a batch row by row, all or nothing (C6), for what arrays cannot carry.

        In a savepoint: read and lock every row (in key order) and refuse the batch before
        the first write if one fails; else send each single-row statement with
        ``executemany`` and keep the savepoint only if the rows written add up to the
        batch (``False`` otherwise).
        """
        s = self.statements

        async def body() -> bool:
            found = await self._read_fences(lock_order(keys), lock=True, action=action)
            errors = batch_verdicts(
                s.name, keys, found, token, need_live=need_live, everything=False
            )
            if errors:
                raise self._rejected(batch_rejection(s.name, token, errors))
            count = 0
            for query, params in writes:
                count += await self._many(query, params, action, s.name)
            return count == len(keys)

        return await self._atomically(body, action, s.name)

    async def update_many(self, token: int, items: Mapping[Any, Mapping[str, Any]]) -> None:
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
        """
        token = validate_token(token)
        s = self.statements
        keyed = [(k, s.check_values(v, upsert=False)) for k, v in self._keyed(list(items.items()))]
        if not keyed:
            return
        keys = [k for k, _ in keyed]
        types = await self._column_types()
        s.check_known({name for _, values in keyed for name in values}, types)
        action = "fenced batch update"
        while True:
            call = s.update_set_call(token, keyed, types)
            if call is None:
                groups: dict[tuple[str, ...], list[tuple[Any, ...]]] = {}
                for keyvals, values in keyed:
                    columns = tuple(sorted(values))
                    row = (*(values[c] for c in columns), token, *keyvals, token)
                    groups.setdefault(columns, []).append(row)
                writes = [(s.update(columns, False), rows) for columns, rows in groups.items()]
                if await self._row_path(keys, token, writes, need_live=True, action=action):
                    self._accepted_rows(keys, token)
                    return
                break
            query, params = call
            count = await self._count(query, params, action, s.name)
            if count == len(keys):
                self._accepted_rows(keys, token)
                return
            if count:
                raise self._partial(count, len(keys))
            fresh = await self._column_types(again=True)
            if fresh == types:
                break
            types = fresh
        raise self._rejected(await self._batch_rejection(keys, token, need_live=True))

    async def upsert_many(self, token: int, rows: Sequence[Mapping[str, Any]]) -> None:
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
        """
        token = validate_token(token)
        s = self.statements
        data = [s.check_values(row, upsert=True) for row in rows]
        if not data:
            return
        columns = tuple(data[0])
        names = set(columns)
        if any(row.keys() != names for row in data):
            raise ConfigurationError(
                f"every row of a batch upsert of {s.name} must set the same columns"
            )
        keyed = key_order(self._keyed([(tuple(row[n] for n in s.key_names), row) for row in data]))
        keys = [k for k, _ in keyed]
        data = [row for _, row in keyed]
        types = await self._column_types()
        s.check_known(columns, types)
        action = "fenced batch upsert"
        while True:
            call = s.upsert_set_call(token, columns, data, types)
            if call is None:
                params = [(*(row[c] for c in columns), token) for row in data]
                writes = [(s.upsert(columns, False), params)]
                if await self._row_path(keys, token, writes, need_live=False, action=action):
                    self._accepted_rows(keys, token)
                    return
                break
            query, named = call

            async def body(query: Query = query, named: Params = named) -> bool:
                return await self._count(query, named, action, s.name) == len(keys)

            if await self._atomically(body, action, s.name):
                self._accepted_rows(keys, token)
                return
            fresh = await self._column_types(again=True)
            if fresh == types:
                break
            types = fresh
        raise self._rejected(await self._batch_rejection(keys, token, need_live=False))


class AsyncFenceRegister(_Base):
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

    def __init__(
        self,
        conn: psycopg.AsyncConnection[Any],
        table: TableName = DEFAULT_REGISTER_TABLE,
        *,
        events: EventBus | None = None,
    ) -> None:
        super().__init__(conn, events)
        self.statements = PgRegisterStatements(table)

    async def fence(self, scope: str) -> int | None:
        """The fence of ``scope``, ``None`` if it was never claimed.

        Raises:
            InvalidResourceError: ``scope`` is not a valid scope name.
            BackendError: the database failed.
        """
        scope = validate_resource(scope, what="scope")
        _, rows = await self._run(self.statements.probe, (scope,), "diagnostic read", scope)
        return rows[0]["fence"] if rows else None

    async def claim(self, scope: str, token: int) -> int:
        """Check ``token`` against the fence of ``scope`` and raise the fence to it (C4, C8).

        Returns:
            The fence, now ``token``.

        Raises:
            InvalidTokenError: ``token`` is not a valid token; nothing was sent.
            InvalidResourceError: ``scope`` is not a valid scope name.
            StaleTokenError: ``STALE``, with the current fence; nothing was written.
            RetryableError: serialization failure or deadlock; retry the transaction.
            BackendError: the connection is closed or the database failed.
        """
        token = validate_token(token)
        scope = validate_resource(scope, what="scope")
        count, _ = await self._run(self.statements.claim, (scope, token), "fence claim", scope)
        if count == 1:
            self._accepted((scope,), token)
            return token
        fence = await self.fence(scope)
        raise self._rejected(
            probe_rejection(scope, token, Probe(True, fence, True), need_live=False)
        )

    async def claim_many(self, scopes: Sequence[str], token: int) -> None:
        """Claim several scopes with one token, all or nothing (C6).

        Raises:
            StaleTokenError: ``.rejected`` lists every scope whose fence is above
                ``token``; no fence was raised.
            InvalidTokenError, InvalidResourceError, RetryableError, BackendError: as for
                :meth:`claim`.
        """
        token = validate_token(token)
        unique = sorted({validate_resource(s, what="scope") for s in scopes})
        if not unique:
            return
        s = self.statements
        action = "fence claim"

        async def body() -> bool:
            count = await self._count(
                s.claim_set(), {"scopes": unique, "tok": token}, action, s.name
            )
            return count == len(unique)

        if await self._atomically(body, action, s.name):
            self._accepted(unique, token)
            return
        _, rows = await self._run(s.probe_set(), {"scopes": unique}, "diagnostic read", s.name)
        fences = {row["scope"]: row["fence"] for row in rows}
        probes = {scope: Probe(scope in fences, fences.get(scope), True) for scope in unique}
        errors = [
            probe_rejection(scope, token, probe, need_live=False)
            for scope, probe in probes.items()
            if not probe_passes(probe, token, need_live=False)
        ] or [probe_rejection(scope, token, probes[scope], need_live=False) for scope in unique]
        raise self._rejected(batch_rejection(s.name, token, errors))

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
        _, rows = await self._run(query, params, "registering read", scope)
        return rows
