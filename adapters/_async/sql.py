"""Fenced writes to SQL rows through SQLAlchemy Core, inside the caller's transaction.

The guards never begin, commit, roll back or close the caller's transaction: they run
their statements on the connection they are given, and a rejected write changes nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import CursorResult, Executable, Row, Table
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncConnection

from fence._core import validate_resource, validate_token
from fence._errors import (
    BackendError,
    ConfigurationError,
    Reason,
    StaleTokenError,
)
from fence._events import EventBus, default_bus

from .._sql_common import (
    ABSENT,
    CHUNK_PARAMS,
    CHUNK_PARAMS_DEFAULT,
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
from .._sql_gate import OWN_OPTIONS
from .._sql_statements import (
    DEFAULT_REGISTER,
    Key,
    RegisterStatements,
    RowStatements,
    register_statements,
    row_statements,
)

__all__ = ["AsyncFenceRegister", "AsyncRowGuard"]

SOURCE = "sql-guard"


class _Base:
    """Statement execution, error mapping and verdict reporting shared by both guards."""

    def __init__(self, conn: AsyncConnection, events: EventBus | None) -> None:
        self.conn = conn
        self.events = events or default_bus
        self.dialect = conn.dialect.name
        self.sane_rowcount = conn.dialect.supports_sane_rowcount
        self.sane_multi_rowcount = conn.dialect.supports_sane_multi_rowcount
        # Bind parameters per statement when a batch reads its rows in chunks.
        self.chunk_params = CHUNK_PARAMS.get(self.dialect, CHUNK_PARAMS_DEFAULT)

    def _returning(self, choice: bool | None, supported: bool, what: str) -> bool:
        if choice is None:
            return supported
        if choice and not supported:
            raise ConfigurationError(f"the {self.dialect} dialect has no {what} RETURNING")
        return choice

    def _check_rowcount(self, returning: bool, scope: str | RowScope, token: int) -> None:
        # Without RETURNING the row count is the only proof of the write (C9).
        if not returning and not self.sane_rowcount:
            scope = str(scope)
            raise StaleTokenError(
                scope,
                token,
                None,
                Reason.UNVERIFIABLE,
                message=(
                    f"{scope}: the {self.dialect} driver reports neither RETURNING nor row "
                    "counts, so a fenced write cannot be verified; nothing was written"
                ),
            )

    async def _execute(
        self,
        stmt: Executable,
        params: Mapping[str, Any] | None,
        action: str,
        scope: str | RowScope,
    ) -> CursorResult[Any]:
        if self.conn.closed:
            raise closed_connection_error()
        try:
            return await self.conn.execute(stmt, params, execution_options=OWN_OPTIONS)
        except SQLAlchemyError as exc:
            raise translate_error(exc, action, str(scope)) from exc

    async def _in_savepoint(
        self,
        stmt: Executable,
        params: Mapping[str, Any] | None,
        expected: int,
        returning: bool,
        action: str,
        scope: str,
    ) -> int:
        """Run ``stmt`` in a savepoint; undo it and return 0 unless it changed ``expected``."""
        if self.conn.closed:
            raise closed_connection_error()
        try:
            savepoint = await self.conn.begin_nested()
            try:
                result = await self.conn.execute(stmt, params, execution_options=OWN_OPTIONS)
                count, _ = _changed(result, returning)
            except BaseException:
                # Undo the batch; an error here (a dead connection) must not hide the first.
                with contextlib.suppress(SQLAlchemyError):
                    await savepoint.rollback()
                raise
            if count == expected:
                await savepoint.commit()
                return count
            await savepoint.rollback()
            return 0
        except SQLAlchemyError as exc:
            raise translate_error(exc, action, scope) from exc

    async def _row_path(
        self,
        name: str,
        token: int,
        expected: int,
        writes: Sequence[tuple[Executable, list[dict[str, Any]]]],
        check: Callable[[], Awaitable[None]],  # unasync: check: Callable[[], None],
        opener: Executable,
        action: str,
    ) -> bool:
        """Write a batch row by row, all or nothing (C6): SQLite, or what arrays cannot carry.

        In a savepoint: ``check`` reads every fence and raises the rejection before the first
        write; then each single-row statement goes with ``executemany``, and unless the rows
        written add up to ``expected`` the savepoint undoes the batch (``False``). No
        statement holds more than a chunk of the batch, so no limit on parameters applies.
        On SQLite ``opener``, a write that changes nothing, comes first: it begins the caller's
        transaction (the sqlite3 driver begins one only before a write; a savepoint sent
        first would be a transaction of its own, and releasing it would commit) and takes
        the write lock, so the fences read stay as they are until the transaction ends.
        """
        if not self.sane_multi_rowcount:
            raise StaleTokenError(
                name,
                token,
                None,
                Reason.UNVERIFIABLE,
                message=(
                    f"{name}: the {self.dialect} driver does not report the row count of "
                    "executemany, so a batch cannot be verified; nothing was written"
                ),
            )
        if self.conn.closed:
            raise closed_connection_error()
        try:
            if self.dialect == "sqlite":
                await self.conn.execute(opener, execution_options=OWN_OPTIONS)
            savepoint = await self.conn.begin_nested()
            try:
                await check()
                count = 0
                for stmt, params in writes:
                    result = await self.conn.execute(stmt, params, execution_options=OWN_OPTIONS)
                    count += _changed(result, False)[0]
            except BaseException:
                # Undo the batch; an error here (a dead connection) must not hide the first.
                with contextlib.suppress(SQLAlchemyError):
                    await savepoint.rollback()
                raise
            if count == expected:
                await savepoint.commit()
                return True
            await savepoint.rollback()
            return False
        except SQLAlchemyError as exc:
            raise translate_error(exc, action, name) from exc

    def _accepted(self, scopes: Sequence[str], token: int) -> None:
        if self.events.active:
            report_accepted(self.events, SOURCE, scopes, token)

    def _rejected(self, err: StaleTokenError) -> StaleTokenError:
        if self.events.active:
            report_rejected(self.events, SOURCE, err)
        return err


def _changed(result: CursorResult[Any], returning: bool) -> tuple[int, list[Row[Any]]]:
    """How many rows a write changed, and the rows it returned."""
    if returning:
        rows = list(result.all())
        return len(rows), rows
    if result.rowcount < 0:  # C9: a write that cannot be verified is refused, not guessed
        raise BackendError(
            "the driver did not report how many rows the fenced write changed, so it cannot "
            "be verified; roll the transaction back",
            code="UNVERIFIABLE",
        )
    return result.rowcount, []


class AsyncRowGuard(_Base):
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
        super().__init__(conn, events)
        self.statements: RowStatements = row_statements(table, fence, tombstone, key)
        dialect = conn.dialect
        # RETURNING for the reads that return a row; for writes only when asked for, or
        # when the driver cannot count rows (then RETURNING is the proof of the write).
        self.update_returning = self._returning(returning, dialect.update_returning, "UPDATE")
        self.insert_returning = self._returning(returning, dialect.insert_returning, "INSERT")
        counts = self.sane_rowcount and returning is None
        self.write_update_returning = self.update_returning and not counts
        self.write_insert_returning = self.insert_returning and not counts

    # -- reads ------------------------------------------------------------------------

    async def _probe(self, keyvals: tuple[Any, ...], scope: str) -> Probe:
        s = self.statements
        result = await self._execute(s.probe(), s.key_params(keyvals), "diagnostic read", scope)
        row = result.first()
        if row is None:
            return ABSENT
        fence, dead = tuple(row)
        return Probe(exists=True, fence=fence, live=not dead)

    async def fence(self, key: Key) -> int | None:
        """The fence of a row, ``None`` if the row does not exist.

        Args:
            key: the key value (a tuple or mapping for a composite key).

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

    # -- one row ----------------------------------------------------------------------

    async def update(self, key: Key, token: int, values: Mapping[str, Any]) -> Row[Any] | None:
        """Fenced ``UPDATE``: write ``values`` to the row iff ``token >= fence`` (C4, C5).

        One statement: ``UPDATE t SET ..., fence = :t WHERE <key> AND fence <= :t
        [AND NOT deleted] RETURNING *``.

        Args:
            key: the row's key value (a tuple or mapping for a composite key).
            token: the fencing token of the caller's lease.
            values: column name to new value; neither the key nor the fence.

        Returns:
            The updated row, or ``None`` when the guard runs on row counts.

        Raises:
            InvalidTokenError: ``token`` is not a valid token; nothing was sent.
            StaleTokenError: ``STALE`` (a newer token wrote), ``MISSING`` (no live row) or
                ``UNVERIFIABLE`` (NULL fence); nothing was written.
            RetryableError: serialization failure or deadlock; retry the transaction.
            BackendError: the connection is closed or the database failed.
        """
        token = validate_token(token)
        s = self.statements
        keyvals = s.key_values(key)
        returning = self.write_update_returning
        # The columns of a dict seen before need no check (other mappings take the check).
        hot = s.checked_updates.get((tuple(values), returning)) if type(values) is dict else None
        if hot is None:
            values = s.check_values(values, upsert=False)
            if not values:
                raise ConfigurationError("a fenced update needs values; use claim() to only fence")
            shape = (tuple(values), returning)
            names = tuple(f"_v_{name}" for name in shape[0])
            hot = s.checked_updates[shape] = (s.update(shape[0], returning), names)
        scope = RowScope(s.name, keyvals)
        self._check_rowcount(returning, scope, token)
        stmt, names = hot
        result = await self._execute(
            stmt, s.update_params(names, keyvals, token, values), "fenced update", scope
        )
        count, rows = _changed(result, returning)
        if count == 1:
            if self.events.active:
                self._accepted((str(scope),), token)
            return rows[0] if rows else None
        probe = await self._probe(keyvals, str(scope))
        raise self._rejected(probe_rejection(str(scope), token, probe, need_live=True))

    async def upsert(self, token: int, values: Mapping[str, Any]) -> Row[Any] | None:
        """Fenced insert-or-replace: insert the row, or replace it iff ``token >= fence``.

        One statement: ``INSERT ... ON CONFLICT (key) DO UPDATE SET ... WHERE
        t.fence <= excluded.fence``. A tombstone comes back to life for a current token;
        a stale writer cannot bring it back (C7).

        Args:
            token: the fencing token.
            values: every column to write, including the key; not the fence.

        Returns:
            The written row, or ``None`` when the guard runs on row counts.

        Raises:
            InvalidTokenError: ``token`` is not a valid token; nothing was sent.
            StaleTokenError: the row holds a newer fence (or a NULL one); nothing written.
            ConfigurationError: the dialect has no ``ON CONFLICT`` (only PostgreSQL and
                SQLite are supported).
            RetryableError, BackendError: as for :meth:`update`.
        """
        token = validate_token(token)
        s = self.statements
        data = s.check_values(values, upsert=True)
        keyvals = s.key_values({name: data[name] for name in s.key_names})
        scope = s.scope(keyvals)
        returning = self.write_insert_returning
        self._check_rowcount(returning, scope, token)
        stmt = s.upsert(self.dialect, token, data, returning)
        result = await self._execute(stmt, None, "fenced upsert", scope)
        count, rows = _changed(result, returning)
        if count == 1:
            self._accepted((scope,), token)
            return rows[0] if rows else None
        probe = await self._probe(keyvals, scope)
        raise self._rejected(probe_rejection(scope, token, probe, need_live=False))

    async def _raise_fence(
        self, key: Key, token: int, *, delete: bool, action: str, read: bool = False
    ) -> tuple[Row[Any] | None, bool]:
        """Set ``fence = token`` on the row (inserting a tombstone if it is absent).

        Returns the row (when ``RETURNING`` is used: for a ``read``, or when asked for)
        and whether it is live.
        """
        token = validate_token(token)
        s = self.statements
        keyvals = s.key_values(key)
        scope = s.scope(keyvals)
        if read:
            returning = self.update_returning and self.insert_returning
        else:
            returning = self.write_update_returning and self.write_insert_returning
        self._check_rowcount(returning, scope, token)
        result = await self._execute(
            s.raise_fence(delete=delete, returning=returning),
            s.params(keyvals, token, {}),
            action,
            scope,
        )
        count, rows = _changed(result, returning)
        probe: Probe | None = None
        if count != 1:
            probe = await self._probe(keyvals, scope)
            if not probe.exists and s.can_insert_tombstone:
                stmt = s.insert_tombstone(
                    self.dialect, keyvals, token, delete=delete, returning=returning
                )
                result = await self._execute(stmt, None, action, scope)
                count, rows = _changed(result, returning)
                if count != 1:
                    probe = await self._probe(keyvals, scope)
        if count == 1:
            self._accepted((scope,), token)
            row = rows[0] if rows else None
            dead = s.tombstone is not None and row is not None and row._mapping[s.tombstone]
            return row, not dead and (probe is None or probe.live)
        assert probe is not None
        raise self._rejected(probe_rejection(scope, token, probe, need_live=False))

    async def claim(self, key: Key, token: int) -> int:
        """Raise the row's fence to ``token`` without writing data (C8); return the fence.

        Call it right after acquiring the lease, before reading the row: from then on a
        stale holder's write is refused. A row that does not exist is claimed by inserting
        a tombstone holding only its key and fence, which needs a tombstone column and no
        other NOT NULL column without a default; otherwise the claim is ``MISSING``.

        Args:
            key: the row's key value.
            token: the fencing token.

        Raises:
            InvalidTokenError: ``token`` is not a valid token; nothing was sent.
            StaleTokenError: ``STALE`` (a newer fence), ``MISSING`` (no row and no way to
                insert a tombstone) or ``UNVERIFIABLE``; nothing was written.
            RetryableError, BackendError: as for :meth:`update`.
        """
        await self._raise_fence(key, token, delete=False, action="fence claim")
        return token

    async def read_for_update(self, key: Key, token: int) -> Row[Any] | None:
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
        """
        row, live = await self._raise_fence(
            key, token, delete=False, action="registering read", read=True
        )
        return row if live else None

    async def delete(self, key: Key, token: int) -> None:
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
        """
        if self.statements.tombstone is None:
            raise ConfigurationError(
                f"a fenced delete of {self.statements.name} needs a tombstone column "
                "(tombstone_column()) or a fence register: a hard delete would let a stale "
                "writer insert the row again"
            )
        await self._raise_fence(key, token, delete=True, action="fenced delete")

    # -- many rows --------------------------------------------------------------------

    def _keyed(self, pairs: Iterable[tuple[Key, Any]]) -> list[tuple[tuple[Any, ...], Any]]:
        """Normalise the keys of ``(key, item)`` pairs; refuse a key given twice."""
        out: dict[tuple[Any, ...], Any] = {}
        for key, values in pairs:
            keyvals = self.statements.key_values(key)
            if keyvals in out:
                raise ConfigurationError(f"key {keyvals!r} appears twice in the batch")
            out[keyvals] = values
        return list(out.items())

    async def _read_fences(
        self, keys: Sequence[tuple[Any, ...]], *, lock: bool, action: str
    ) -> dict[tuple[Any, ...], Probe]:
        """Fence and tombstone flag of each row of ``keys`` that exists, read in chunks."""
        s = self.statements
        width = len(s.key)
        reads: list[tuple[Executable, dict[str, Any]]]
        call = s.probe_set_call(self.conn.dialect, keys, lock=lock)
        if call is not None:
            reads = [call]
        else:
            stmt = s.probe_keys(lock=lock)
            reads = [
                (stmt, {"_keys": [k[0] for k in chunk] if width == 1 else list(chunk)})
                for chunk in chunks(keys, self.chunk_params // width)
            ]
        found: dict[tuple[Any, ...], Probe] = {}
        for read, params in reads:
            result = await self._execute(read, params, action, s.name)
            for row in result:
                found[tuple(row[:width])] = Probe(True, row[width], not row[width + 1])
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

    async def _check_fences(
        self, keys: Sequence[tuple[Any, ...]], token: int, *, need_live: bool, action: str
    ) -> None:
        """Read every fence of a batch (locking the rows, off SQLite); raise if one fails."""
        s = self.statements
        lock = self.dialect != "sqlite"
        found = await self._read_fences(lock_order(keys), lock=lock, action=action)
        errors = batch_verdicts(s.name, keys, found, token, need_live=need_live, everything=False)
        if errors:
            raise self._rejected(batch_rejection(s.name, token, errors))

    async def update_many(self, token: int, items: Mapping[Key, Mapping[str, Any]]) -> None:
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
        """
        token = validate_token(token)
        s = self.statements
        keyed = [(k, s.check_values(v, upsert=False)) for k, v in self._keyed(items.items())]
        if not keyed:
            return
        keys = [k for k, _ in keyed]
        self._check_rowcount(False, s.name, token)
        call = s.update_set_call(self.conn.dialect, token, keyed)
        if call is None:
            groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
            for keyvals, values in keyed:
                columns = tuple(sorted(values))
                groups.setdefault(columns, []).append(s.params(keyvals, token, values))
            writes = [(s.update(columns, False), rows) for columns, rows in groups.items()]
            action = "fenced batch update"

            async def check() -> None:
                await self._check_fences(keys, token, need_live=True, action=action)

            if await self._row_path(
                s.name, token, len(keys), writes, check, s.open_write(), action
            ):
                self._accepted_rows(keys, token)
                return
            raise self._rejected(await self._batch_rejection(keys, token, need_live=True))
        stmt, params = call
        result = await self._execute(stmt, params, "fenced batch update", s.name)
        count, _ = _changed(result, False)
        if count == len(keys):
            self._accepted_rows(keys, token)
            return
        if count:
            raise self._partial(count, len(keys))
        raise self._rejected(await self._batch_rejection(keys, token, need_live=True))

    async def upsert_many(self, token: int, rows: Sequence[Mapping[str, Any]]) -> None:
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
        """
        token = validate_token(token)
        s = self.statements
        data = [s.check_values(row, upsert=True) for row in rows]
        keyed = self._keyed((tuple(row[n] for n in s.key_names), row) for row in data)
        if not keyed:
            return
        columns = tuple(data[0])
        names = set(columns)
        if any(row.keys() != names for row in data):
            raise ConfigurationError(
                f"every row of a batch upsert of {s.name} must set the same columns"
            )
        keyed = key_order(keyed)
        keys = [k for k, _ in keyed]
        data = [row for _, row in keyed]
        self._check_rowcount(False, s.name, token)
        call = s.upsert_set_call(self.conn.dialect, token, columns, data)
        action = "fenced batch upsert"
        if call is None:
            stmt = s.upsert_row(self.dialect, columns)
            params = [{**{f"_v_{n}": row[n] for n in columns}, "_token": token} for row in data]

            async def check() -> None:
                await self._check_fences(keys, token, need_live=False, action=action)

            written = await self._row_path(
                s.name, token, len(keys), [(stmt, params)], check, s.open_write(), action
            )
        else:
            count = await self._in_savepoint(call[0], call[1], len(keys), False, action, s.name)
            written = count == len(keys)
        if written:
            self._accepted_rows(keys, token)
            return
        raise self._rejected(await self._batch_rejection(keys, token, need_live=False))


class AsyncFenceRegister(_Base):
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

    def __init__(
        self,
        conn: AsyncConnection,
        table: Table | None = None,
        *,
        returning: bool | None = None,
        events: EventBus | None = None,
    ) -> None:
        super().__init__(conn, events)
        self.statements: RegisterStatements = register_statements(
            table if table is not None else DEFAULT_REGISTER
        )
        supported = self._returning(returning, conn.dialect.insert_returning, "INSERT")
        # A claim returns nothing: its row count proves it, unless the driver cannot count.
        self.returning = supported and not (self.sane_rowcount and returning is None)

    async def _read_scopes(self, scopes: Sequence[str], *, lock: bool) -> dict[str, Probe]:
        """The fence of each scope that has one, read in chunks."""
        s = self.statements
        whole = s.probe_scopes_set(self.conn.dialect, lock=lock)
        reads: list[tuple[Executable, dict[str, Any]]]
        if whole is not None:
            reads = [(whole, {"_scopes": list(scopes)})]
        else:
            stmt = s.probe_scopes(lock=lock)
            reads = [(stmt, {"_scopes": list(c)}) for c in chunks(scopes, self.chunk_params)]
        found: dict[str, Probe] = {}
        for read, params in reads:
            result = await self._execute(read, params, "diagnostic read", s.name)
            for row in result:
                scope, fence = tuple(row)
                found[scope] = Probe(True, fence, True)
        return found

    def _rejections(
        self, scopes: Sequence[str], token: int, found: Mapping[str, Probe], *, everything: bool
    ) -> list[StaleTokenError]:
        """One error per scope above ``token``; with ``everything``, every scope if none is
        (a concurrent writer moved on between the claim and the read)."""
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

    async def fence(self, scope: str) -> int | None:
        """The fence of ``scope``, ``None`` if it was never claimed.

        Raises:
            InvalidResourceError: ``scope`` is not a valid scope name.
            BackendError: the database failed.
        """
        scope = validate_resource(scope, what="scope")
        result = await self._execute(
            self.statements.probe(scope), None, "diagnostic read", self.statements.name
        )
        row = result.first()
        return None if row is None else tuple(row)[1]

    async def claim(self, scope: str, token: int) -> int:
        """Check ``token`` against the fence of ``scope`` and raise the fence to it (C4, C8).

        The register row stays locked until the caller's transaction ends.

        Args:
            scope: the fence scope, usually the locked resource (``"order:42"``).
            token: the fencing token of the caller's lease.

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
        self._check_rowcount(self.returning, scope, token)
        stmt = self.statements.claim(self.dialect, scope, token, self.returning)
        result = await self._execute(stmt, None, "fence claim", scope)
        if _changed(result, self.returning)[0] == 1:
            self._accepted((scope,), token)
            return token
        found = await self._read_scopes([scope], lock=False)
        raise self._rejected(self._rejections([scope], token, found, everything=True)[0])

    async def claim_many(self, scopes: Sequence[str], token: int) -> None:
        """Claim several scopes with one token, all or nothing (C6), any number of them.

        Every fence is checked before the first is raised. On PostgreSQL it is one
        statement (the scopes in one array) in a savepoint; on SQLite, a read of the fences
        and then the single claim, in a savepoint (see the docs, "Batches").

        Args:
            scopes: the scopes (duplicates are ignored).
            token: the fencing token.

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
        self._check_rowcount(False, s.name, token)
        action = "fence claim"
        stmt = s.claim_set(self.conn.dialect) if self.dialect == "postgresql" else None
        if stmt is None:
            params = [{"_scope": scope, "_token": token} for scope in unique]

            async def check() -> None:
                found = await self._read_scopes(unique, lock=self.dialect != "sqlite")
                errors = self._rejections(unique, token, found, everything=False)
                if errors:
                    raise self._rejected(batch_rejection(s.name, token, errors))

            written = await self._row_path(
                s.name,
                token,
                len(unique),
                [(s.claim_row(self.dialect), params)],
                check,
                s.open_write(),
                action,
            )
        else:
            params_set = {"_scopes": unique, "_token": token}
            count = await self._in_savepoint(stmt, params_set, len(unique), False, action, s.name)
            written = count == len(unique)
        if written:
            if self.events.active:
                self._accepted(unique, token)
            return
        found = await self._read_scopes(unique, lock=False)
        errors = self._rejections(unique, token, found, everything=True)
        raise self._rejected(batch_rejection(s.name, token, errors))

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
        return await self._execute(statement, params, "registering read", scope)
