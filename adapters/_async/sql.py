"""Fenced writes to SQL rows through SQLAlchemy Core, inside the caller's transaction.

The guards never begin, commit, roll back or close the caller's transaction: they run
their statements on the connection they are given, and a rejected write changes nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
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
    Probe,
    RowScope,
    batch_rejection,
    closed_connection_error,
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
        self, stmt: Executable, expected: int, returning: bool, action: str, scope: str
    ) -> int:
        """Run ``stmt`` in a savepoint; undo it and return 0 unless it changed ``expected``."""
        if self.conn.closed:
            raise closed_connection_error()
        try:
            savepoint = await self.conn.begin_nested()
            try:
                result = await self.conn.execute(stmt, execution_options=OWN_OPTIONS)
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
        returning: use ``RETURNING`` (default: where the dialect has it); ``False`` falls
            back on row counts.
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
        self.update_returning = self._returning(returning, dialect.update_returning, "UPDATE")
        self.insert_returning = self._returning(returning, dialect.insert_returning, "INSERT")

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
        data = s.check_values(values, upsert=False)
        if not data:
            raise ConfigurationError("a fenced update needs values; use claim() to only fence")
        scope = RowScope(s.name, keyvals)
        returning = self.update_returning
        self._check_rowcount(returning, scope, token)
        result = await self._execute(
            s.update(tuple(data), returning), s.params(keyvals, token, data), "fenced update", scope
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
        returning = self.insert_returning
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
        self, key: Key, token: int, *, delete: bool, action: str
    ) -> tuple[Row[Any] | None, bool]:
        """Set ``fence = token`` on the row (inserting a tombstone if it is absent).

        Returns the row (when ``RETURNING`` is used) and whether it is live.
        """
        token = validate_token(token)
        s = self.statements
        keyvals = s.key_values(key)
        scope = s.scope(keyvals)
        returning = self.update_returning and self.insert_returning
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
        row, live = await self._raise_fence(key, token, delete=False, action="registering read")
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

    def _keyed(self, items: Mapping[Key, Mapping[str, Any]]) -> list[tuple[tuple[Any, ...], Any]]:
        out: dict[tuple[Any, ...], Any] = {}
        for key, values in items.items():
            keyvals = self.statements.key_values(key)
            if keyvals in out:
                raise ConfigurationError(f"key {keyvals!r} appears twice in the batch")
            out[keyvals] = values
        return list(out.items())

    async def _batch_rejection(
        self, keys: Sequence[tuple[Any, ...]], token: int, *, need_live: bool
    ) -> StaleTokenError:
        s = self.statements
        result = await self._execute(s.probe_many(keys), None, "diagnostic read", s.name)
        width = len(s.key)
        found = {tuple(row[:width]): Probe(True, row[width], not row[width + 1]) for row in result}
        errors = []
        for keyvals in keys:
            probe = found.get(keyvals, ABSENT)
            if probe_passes(probe, token, need_live=need_live):
                continue
            errors.append(probe_rejection(s.scope(keyvals), token, probe, need_live=need_live))
        if not errors:  # a concurrent writer moved on between the write and the read
            errors = [
                probe_rejection(s.scope(k), token, found.get(k, ABSENT), need_live=need_live)
                for k in keys
            ]
        return batch_rejection(s.name, token, errors)

    def _partial(self, count: int, total: int) -> BackendError:
        return BackendError(
            f"a batch on {self.statements.name} wrote {count} of {total} rows; roll the "
            "transaction back",
            code="PARTIAL",
        )

    async def update_many(self, token: int, items: Mapping[Key, Mapping[str, Any]]) -> None:
        """Fenced update of many rows in one statement, all or nothing (C6).

        The statement first locks every target row (in key order) and counts those that
        pass; unless all do, it writes none. The error then lists every rejected row.

        Args:
            token: the fencing token.
            items: key to column values; the rows may set different columns.

        Raises:
            InvalidTokenError: ``token`` is not a valid token; nothing was sent.
            StaleTokenError: with ``.rejected`` holding one error per rejected row
                (``STALE``, ``MISSING`` or ``UNVERIFIABLE``); nothing was written.
            RetryableError, BackendError: as for :meth:`update`.
        """
        token = validate_token(token)
        s = self.statements
        keyed = [(k, s.check_values(v, upsert=False)) for k, v in self._keyed(items)]
        if not keyed:
            return
        keys = [k for k, _ in keyed]
        returning = self.update_returning
        self._check_rowcount(returning, s.name, token)
        result = await self._execute(
            s.update_many(token, keyed, returning), None, "fenced batch update", s.name
        )
        count, _ = _changed(result, returning)
        if count == len(keys):
            self._accepted([s.scope(k) for k in keys], token)
            return
        if count:
            raise self._partial(count, len(keys))
        raise self._rejected(await self._batch_rejection(keys, token, need_live=True))

    async def upsert_many(self, token: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """Fenced insert-or-replace of many rows, all or nothing (C6).

        Every existing fence of the batch is checked before the first row is written; on
        PostgreSQL a savepoint also undoes the batch if a concurrent transaction inserts
        one of its absent keys with a newer fence.

        Args:
            token: the fencing token.
            rows: the rows, each with its key; all set the same columns.

        Raises:
            StaleTokenError: with ``.rejected`` listing every rejected row; nothing written.
            ConfigurationError: not PostgreSQL or SQLite, or rows with different columns.
            RetryableError, BackendError: as for :meth:`update`.
        """
        token = validate_token(token)
        s = self.statements
        data = [s.check_values(row, upsert=True) for row in rows]
        keyed = self._keyed({tuple(row[n] for n in s.key_names): row for row in data})
        if not keyed:
            return
        keys = [k for k, _ in keyed]
        returning = self.insert_returning
        self._check_rowcount(returning, s.name, token)
        stmt = s.upsert_many(self.dialect, token, data, keys, returning)
        if self.dialect != "postgresql":
            # SQLite runs the statement under its single write lock: the gate is exact.
            result = await self._execute(stmt, None, "fenced batch upsert", s.name)
            count, _ = _changed(result, returning)
        else:
            count = await self._in_savepoint(
                stmt, len(keys), returning, "fenced batch upsert", s.name
            )
        if count == len(keys):
            self._accepted([s.scope(k) for k in keys], token)
            return
        if count:
            raise self._partial(count, len(keys))
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
        returning: use ``RETURNING`` (default: where the dialect has it).
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
        self.returning = self._returning(returning, conn.dialect.insert_returning, "INSERT")

    async def _probe(self, scopes: Sequence[str]) -> dict[str, int]:
        s = self.statements
        result = await self._execute(s.probe(scopes), None, "diagnostic read", s.name)
        return dict(tuple(row) for row in result)

    async def fence(self, scope: str) -> int | None:
        """The fence of ``scope``, ``None`` if it was never claimed.

        Raises:
            InvalidResourceError: ``scope`` is not a valid scope name.
            BackendError: the database failed.
        """
        scope = validate_resource(scope, what="scope")
        return (await self._probe([scope])).get(scope)

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
        await self._claim([scope], token)
        return token

    async def claim_many(self, scopes: Sequence[str], token: int) -> None:
        """Claim several scopes with one token, all or nothing (C6).

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
        if unique:
            await self._claim(unique, token)

    async def _claim(self, scopes: list[str], token: int) -> None:
        s = self.statements
        label = scopes[0] if len(scopes) == 1 else s.name
        self._check_rowcount(self.returning, label, token)
        stmt = s.claim(self.dialect, scopes, token, self.returning)
        if len(scopes) > 1 and self.dialect == "postgresql":
            count = await self._in_savepoint(
                stmt, len(scopes), self.returning, "fence claim", label
            )
        else:
            result = await self._execute(stmt, None, "fence claim", label)
            count, _ = _changed(result, self.returning)
        if count == len(scopes):
            self._accepted(scopes, token)
            return
        if count:
            raise BackendError(
                f"a claim of {len(scopes)} scopes raised {count}; roll the transaction back",
                code="PARTIAL",
            )
        fences = await self._probe(scopes)
        probes = {scope: Probe(scope in fences, fences.get(scope), True) for scope in scopes}
        # Every scope above the token; if none is (a concurrent writer moved on between
        # the claim and the read), every scope of the claim.
        errors = [
            probe_rejection(scope, token, probe, need_live=False)
            for scope, probe in probes.items()
            if not probe_passes(probe, token, need_live=False)
        ] or [probe_rejection(scope, token, probes[scope], need_live=False) for scope in scopes]
        raise self._rejected(
            errors[0] if len(scopes) == 1 else batch_rejection(s.name, token, errors)
        )

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
