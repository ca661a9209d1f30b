"""The flows of the SQL guards, written once for every driver: rows and fence registers.

A guard is a flow over two objects chosen when it is built:

- its **statements** (:class:`~fence.adapters._row_statements.RowStatementSet`,
  :class:`~fence.adapters._row_statements.RegisterStatementSet`) build each statement with
  its parameters: SQLAlchemy Core constructs for one dialect, or psycopg ``sql`` text;
- its **executor** (:class:`AsyncExecutor`) runs them on the caller's connection, inside
  the caller's transaction, and maps driver errors to iofence errors.

The flows decide (C4-C9): a write that changed nothing is followed by a diagnostic read that
tells ``STALE`` from ``MISSING`` and ``UNVERIFIABLE``; a batch checks every fence before its
first write, writes all or nothing and lists every rejected item; accepted and rejected
writes are reported to the event bus. Everything they decide with is pure and lives in
``_sql_common`` and ``_row_statements``.

The database judges every write too (C14): the statements hand it their token as they write,
and before a guard's first write the executor checks, once per table and connection, that
the table's triggers are in place and current (``judge``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar, cast

from fence._core import validate_resource, validate_token
from fence._errors import ConfigurationError, StaleTokenError
from fence._events import EventBus, default_bus

from .._row_statements import (
    SCALAR_KEYS,
    Key,
    ManyCall,
    RegisterStatementSet,
    RowStatementSet,
)
from .._sql_common import (
    ABSENT,
    Probe,
    RowScope,
    batch_rejection,
    batch_verdicts,
    lock_order,
    null_fence_error,
    partial_batch_error,
    probe_rejection,
    report_accepted,
    report_rejected,
    scope_verdicts,
    unverifiable_batch,
    unverifiable_write,
)
from .._triggers import Judged

__all__ = ["AsyncExecutor", "AsyncRegisterFlow", "AsyncRowFlow"]

#: A batch's proof by reading its fences back (``_row_path``).
_Verify = Callable[[], Awaitable[bool]]  # unasync: _Verify = Callable[[], bool]

RowT = TypeVar("RowT")
RowT_co = TypeVar("RowT_co", covariant=True)


class AsyncExecutor(Protocol[RowT_co]):
    """Runs the statements of a guard on the caller's connection. Inheriting is optional.

    Every method raises the iofence error for what the driver raised
    (``_sql_common.translate_error``: :class:`fence.RetryableError` for a serialization
    failure, a deadlock or a timeout, :class:`fence.BackendError` otherwise) and
    :class:`fence.BackendError` for a closed connection, before sending anything.
    ``action`` and ``scope`` name what failed in those errors.

    Attributes:
        driver: the driver's name, for messages (``"postgresql"``, ``"sqlite"``).
        counts_rows: the driver reports the row count of a statement; without it only
            ``RETURNING`` proves a write (C9).
        counts_many: the driver reports the row count of ``executemany``.
    """

    driver: str
    counts_rows: bool
    counts_many: bool

    async def run(
        self, stmt: Any, params: Any, returning: bool, action: str, scope: str | RowScope
    ) -> tuple[int, Sequence[RowT_co]]:
        """Run a write; return how many rows it changed and, with ``returning``, the rows
        it returned (else none), as the guard returns them.

        Raises:
            BackendError: also when the driver does not report the row count (C9).
        """
        ...

    async def read(
        self, stmt: Any, params: Any, action: str, scope: str
    ) -> Sequence[Sequence[Any]]:
        """Run a read; return its rows, each a sequence of column values."""
        ...

    async def many(self, stmt: Any, params: Sequence[Any], action: str, scope: str) -> int:
        """Run a statement once per parameter set (``executemany``); return the rows it
        changed in all."""
        ...

    async def atomically(
        self,
        body: Callable[[], Awaitable[bool]],  # unasync: body: Callable[[], bool],
        action: str,
        scope: str,
        opener: Any = None,
    ) -> bool:
        """Run ``body`` in a savepoint, kept if it returns ``True``, else undone.

        The caller's transaction goes on either way; an error in ``body`` undoes the
        savepoint too and propagates. ``opener`` (see ``RowStatementSet.opener``) is sent
        first, outside the savepoint.
        """
        ...

    async def column_types(self, statements: Any, *, again: bool) -> Any:
        """The column types the batch statements cast their arrays to, read from the
        catalogue once per connection (again with ``again``); ``None`` where the
        statements know them."""
        ...

    async def judge(self, judged: Judged) -> None:
        """Refuse to write a table whose triggers (the database's judge, C14) are missing,
        disabled or outdated: read once per table and connection, a set lookup after that.

        Raises:
            ConfigurationError: the triggers are not as the table needs them; the message
                says what to run.
        """
        ...


class _AsyncFlow(Generic[RowT]):
    """What both flows share: the executor, the events, and the C9, C6 and C14 mechanics."""

    executor: AsyncExecutor[RowT]
    events: EventBus
    source: str
    #: The table's triggers were found in place (C14); checked before the first write.
    _judged = False

    async def _judge(self, judged: Judged) -> None:
        await self.executor.judge(judged)
        self._judged = True

    def _accepted(self, scopes: Sequence[str], token: int) -> None:
        if self.events.active:
            report_accepted(self.events, self.source, scopes, token)

    def _rejected(self, err: StaleTokenError) -> StaleTokenError:
        if self.events.active:
            report_rejected(self.events, self.source, err)
        return err

    def _check_rowcount(self, returning: bool, scope: str | RowScope, token: int) -> None:
        # Without RETURNING the row count is the only proof of the write (C9).
        if not returning and not self.executor.counts_rows:
            raise unverifiable_write(str(scope), token, self.executor.driver)

    async def _row_path(
        self,
        name: str,
        token: int,
        expected: int,
        writes: Sequence[ManyCall],
        check: Callable[[], Awaitable[None]],  # unasync: check: Callable[[], None],
        opener: Any,
        action: str,
        verify: _Verify | None = None,
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
        Where the row count cannot prove an upsert (``found_rows``), ``verify`` proves the
        batch instead, by a locking read of every fence after the writes. There (MariaDB,
        MySQL) the database's judge refuses a row that a concurrent transaction fenced
        after ``check`` read it (READ COMMITTED takes no gap locks); that too undoes the
        batch (``False``), and the caller's read of the fences lists every rejected item.
        """
        executor = self.executor
        if not executor.counts_many and verify is None:
            raise unverifiable_batch(name, token, executor.driver)

        async def body() -> bool:
            await check()
            count = 0
            try:
                for stmt, params in writes:
                    count += await executor.many(stmt, params, action, name)
            except StaleTokenError:
                if verify is None:
                    raise
                return False
            if verify is not None:
                return await verify()
            return count == expected

        return await executor.atomically(body, action, name, opener)


class AsyncRowFlow(_AsyncFlow[RowT]):
    """The row guard: each row of one table is its own fence scope (C4-C9).

    Each write is one statement that checks ``fence <= token`` and sets ``fence = token``
    with the data. When it changes nothing, a diagnostic read tells ``MISSING`` from
    ``STALE`` and reports the current fence; the transaction stays usable.

    Args:
        executor: runs the statements on the caller's connection.
        statements: the table's statements.
        events: the bus for ``WRITE_ACCEPTED`` / ``WRITE_REJECTED`` (default bus if omitted).
        source: the source named in those events.
        update_returning: :meth:`update` proves its write by ``RETURNING`` and returns the
            row (else by its row count, and returns ``None``).
        upsert_returning: the same for :meth:`upsert`.
        fence_returning: the same for :meth:`claim` and :meth:`delete`.
        read_returning: the same for :meth:`read_for_update`, which returns ``None``
            without it.
        read_back: without ``read_returning``, :meth:`read_for_update` reads the row after
            raising its fence (a database without ``UPDATE ... RETURNING``: MariaDB, MySQL;
            the row stays locked by the write, so the read sees it as written).
    """

    #: How the user names a tombstone column for this guard (in the error of a delete).
    _tombstone_hint = "tombstone=..."

    def __init__(
        self,
        executor: AsyncExecutor[RowT],
        statements: RowStatementSet,
        events: EventBus | None,
        source: str,
        *,
        update_returning: bool,
        upsert_returning: bool,
        fence_returning: bool,
        read_returning: bool,
        read_back: bool = False,
    ) -> None:
        self.executor = executor
        self.statements = statements
        self.events = events or default_bus
        self.source = source
        self.update_returning = update_returning
        self.upsert_returning = upsert_returning
        self.fence_returning = fence_returning
        self.read_returning = read_returning
        self.read_back = read_back
        # Resolved once for the single-row writes: the executor's run, and whether a write
        # without RETURNING is unverifiable (C9).
        self._run = executor.run if not statements.found_rows else self._run_judged
        self._uncounted = not executor.counts_rows
        self._one_key = len(statements.key_names) == 1

    async def _run_judged(
        self, stmt: Any, params: Any, returning: bool, action: str, scope: str | RowScope
    ) -> tuple[int, Sequence[RowT]]:
        """The executor's run where an upsert has no ``WHERE`` (MariaDB, MySQL): the
        database's judge refuses a stale upsert itself, and its refusal is reported as the
        guard's own (``WRITE_REJECTED``), with the row's scope as the guard names it (the
        triggers name the row only where their DDL was given the key columns)."""
        try:
            return await self.executor.run(stmt, params, returning, action, scope)
        except StaleTokenError as err:
            err.scope = str(scope)
            raise self._rejected(err) from err.__cause__

    # -- reads ------------------------------------------------------------------------

    async def _probe(self, keyvals: tuple[Any, ...], scope: str) -> Probe:
        if self.statements.found_rows:
            # The verdict on a write, read as the write found the row: a plain read would
            # see the transaction's snapshot (REPEATABLE READ), perhaps from before a newer
            # holder wrote.
            found = await self._read_fences([keyvals], None, lock=True, action="diagnostic read")
            return found.get(keyvals, ABSENT)
        stmt, params = self.statements.probe_call(keyvals)
        rows = await self.executor.read(stmt, params, "diagnostic read", scope)
        if not rows:
            return ABSENT
        fence, dead = rows[0]
        return Probe(exists=True, fence=fence, live=not dead)

    async def _settle(
        self, count: int, keyvals: tuple[Any, ...], scope: str, token: int
    ) -> tuple[int, Probe | None]:
        """The count of an upsert where the database counts rows found (``found_rows``): 2
        (a row changed) is 1; 1 (a row inserted, or one left as it was, refused or not) is
        1 only if the fence now is the token, which an accepted upsert sets and a refused
        one, whose fence is above the token, never shows. Also the probe it read."""
        if count == 2:
            return 1, None
        probe = await self._probe(keyvals, scope)
        accepted = probe.exists and probe.fence == token
        return (1 if accepted else 0), probe

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
        stmt, params = self.statements.probe_call(keyvals)
        rows = await self.executor.read(stmt, params, "diagnostic read", scope)
        probe = Probe(exists=True, fence=rows[0][0], live=not rows[0][1]) if rows else ABSENT
        if probe.exists and probe.fence is None:
            raise null_fence_error(scope)
        return probe.fence

    # -- one row ----------------------------------------------------------------------

    async def update(self, key: Key, token: int, values: Mapping[str, Any]) -> RowT | None:
        """Fenced ``UPDATE``: write ``values`` to the row iff ``token >= fence`` (C4, C5).

        One statement: ``UPDATE t SET ..., fence = <token> WHERE <key> AND
        fence <= <token> [AND NOT deleted] RETURNING *``.

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
        # A scalar key of a one-column key needs no call (the first case of key_values).
        keyvals = (key,) if self._one_key and type(key) in SCALAR_KEYS else s.key_values(key)
        returning = self.update_returning
        # The columns of a dict seen before need no check (other mappings take the check).
        hot = s.checked_updates.get((tuple(values), returning)) if type(values) is dict else None
        if hot is None:
            values = s.check_values(values, upsert=False)
            if not values:
                raise ConfigurationError("a fenced update needs values; use claim() to only fence")
            hot = s.checked_update(tuple(values), returning)
        scope = RowScope(s.name, keyvals)
        if not returning and self._uncounted:
            raise unverifiable_write(str(scope), token, self.executor.driver)
        if not self._judged:
            await self._judge(s.judged)
        stmt, names = hot
        count, rows = await self._run(
            stmt, s.update_params(names, keyvals, token, values), returning, "fenced update", scope
        )
        if count == 1:
            if self.events.active:
                self._accepted((str(scope),), token)
            return rows[0] if rows else None
        probe = await self._probe(keyvals, str(scope))
        raise self._rejected(probe_rejection(str(scope), token, probe, need_live=True))

    async def upsert(self, token: int, values: Mapping[str, Any]) -> RowT | None:
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
        keyvals = tuple(data[name] for name in s.key_names)
        scope = s.scope(keyvals)
        returning = self.upsert_returning
        if not returning and self._uncounted:
            raise unverifiable_write(scope, token, self.executor.driver)
        if not self._judged:
            await self._judge(s.judged)
        stmt, params = s.upsert_call(data, token, returning)
        count, rows = await self._run(stmt, params, returning, "fenced upsert", scope)
        probe: Probe | None = None
        if s.found_rows:
            count, probe = await self._settle(count, keyvals, scope, token)
        if count == 1:
            self._accepted((scope,), token)
            return rows[0] if rows else None
        if probe is None:
            probe = await self._probe(keyvals, scope)
        raise self._rejected(probe_rejection(scope, token, probe, need_live=False))

    async def _raise_fence(
        self, key: Key, token: int, *, delete: bool, action: str, read: bool = False
    ) -> RowT | None:
        """Set ``fence = token`` on the row, inserting a tombstone if it is absent.

        For a ``read``, returns the row if ``RETURNING`` returned it and it is live, else
        ``None``; otherwise ``None``.
        """
        token = validate_token(token)
        s = self.statements
        keyvals = s.key_values(key)
        scope = s.scope(keyvals)
        returning = self.read_returning if read else self.fence_returning
        if not returning and self._uncounted:
            raise unverifiable_write(scope, token, self.executor.driver)
        if not self._judged:
            await self._judge(s.judged)
        stmt, params = s.raise_fence_call(keyvals, token, delete, returning)
        count, rows = await self._run(stmt, params, returning, action, scope)
        probe: Probe | None = None
        if count != 1:
            probe = await self._probe(keyvals, scope)
            if not probe.exists and s.can_insert_tombstone:
                stmt, params = s.tombstone_call(keyvals, token, delete, returning)
                count, rows = await self._run(stmt, params, returning, action, scope)
                settled: Probe | None = None
                if s.found_rows:
                    count, settled = await self._settle(count, keyvals, scope, token)
                if count != 1:
                    probe = settled if settled is not None else await self._probe(keyvals, scope)
        if count == 1:
            self._accepted((scope,), token)
            if read and not rows and self.read_back:
                stmt, params = s.row_call(keyvals)
                rows = cast("Sequence[RowT]", await self.executor.read(stmt, params, action, scope))
            if not read or not rows:
                return None
            row = rows[0]
            return None if s.is_dead(row) else row
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

    async def read_for_update(self, key: Key, token: int) -> RowT | None:
        """A registering read (C8): raise the fence to ``token``; return the row if it is live
        and came back by ``RETURNING``, else ``None``."""
        return await self._raise_fence(
            key, token, delete=False, action="registering read", read=True
        )

    async def delete(self, key: Key, token: int) -> None:
        """Fenced soft delete: mark the row deleted, its fence kept as a tombstone (C7)."""
        if self.statements.tombstone_name is None:
            raise ConfigurationError(
                f"a fenced delete of {self.statements.name} needs a tombstone column "
                f"({self._tombstone_hint}) or a fence register: a hard delete would let a "
                "stale writer insert the row again"
            )
        await self._raise_fence(key, token, delete=True, action="fenced delete")

    # -- many rows --------------------------------------------------------------------

    async def _read_fences(
        self, keys: Sequence[tuple[Any, ...]], types: Any, *, lock: bool, action: str
    ) -> dict[tuple[Any, ...], Probe]:
        """Fence and tombstone flag of each row of ``keys`` that exists."""
        s = self.statements
        width = len(s.key_names)
        found: dict[tuple[Any, ...], Probe] = {}
        for stmt, params in s.probe_reads(keys, types, lock=lock):
            for row in await self.executor.read(stmt, params, action, s.name):
                found[tuple(row[:width])] = Probe(True, row[width], not row[width + 1])
        return found

    async def _check_fences(
        self,
        keys: Sequence[tuple[Any, ...]],
        token: int,
        types: Any,
        *,
        need_live: bool,
        action: str,
    ) -> None:
        """Read every fence of a batch, locking the rows in key order; raise if one fails."""
        s = self.statements
        found = await self._read_fences(lock_order(keys), types, lock=s.locks_rows, action=action)
        errors = batch_verdicts(s.name, keys, found, token, need_live=need_live, everything=False)
        if errors:
            raise self._rejected(batch_rejection(s.name, token, errors))

    async def _batch_rejection(
        self, keys: Sequence[tuple[Any, ...]], token: int, types: Any, *, need_live: bool
    ) -> StaleTokenError:
        s = self.statements
        found = await self._read_fences(keys, types, lock=s.found_rows, action="diagnostic read")
        errors = batch_verdicts(s.name, keys, found, token, need_live=need_live, everything=True)
        return self._rejected(batch_rejection(s.name, token, errors))

    def _accepted_rows(self, keys: Sequence[tuple[Any, ...]], token: int) -> None:
        if self.events.active:
            self._accepted([self.statements.scope(k) for k in keys], token)

    async def update_many(self, token: int, items: Mapping[Key, Mapping[str, Any]]) -> None:
        """Fenced update of many rows, all or nothing (C6): by the set path if the statements
        have one for the batch, else row by row."""
        token = validate_token(token)
        s = self.statements
        executor = self.executor
        keyed = s.update_batch(items)
        if not keyed:
            return
        keys = [k for k, _ in keyed]
        self._check_rowcount(False, s.name, token)
        types = await executor.column_types(s, again=False)
        s.check_known({name for _, values in keyed for name in values}, types)
        if not self._judged:
            await self._judge(s.judged)
        action = "fenced batch update"
        while True:
            call = s.update_set_call(token, keyed, types)
            if call is None:

                async def check(types: Any = types) -> None:
                    await self._check_fences(keys, token, types, need_live=True, action=action)

                writes = s.update_rows(token, keyed)
                if await self._row_path(s.name, token, len(keys), writes, check, s.opener, action):
                    self._accepted_rows(keys, token)
                    return
                break
            stmt, params = call
            count, _ = await executor.run(stmt, params, False, action, s.name)
            if count == len(keys):
                self._accepted_rows(keys, token)
                return
            if count:
                raise partial_batch_error(s.name, count, len(keys))
            # A column's type may have changed since the types were read: then the
            # statement wrote nothing, and is sent again with the types as they are now.
            fresh = await executor.column_types(s, again=True)
            if fresh == types:
                break
            types = fresh
        raise await self._batch_rejection(keys, token, types, need_live=True)

    async def upsert_many(self, token: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """Fenced insert-or-replace of many rows, all or nothing (C6): by the set path (in a
        savepoint) if the statements have one for the batch, else row by row."""
        token = validate_token(token)
        s = self.statements
        executor = self.executor
        columns, keyed = s.upsert_batch(rows)
        if not keyed:
            return
        keys = [k for k, _ in keyed]
        data = [row for _, row in keyed]
        self._check_rowcount(False, s.name, token)
        types = await executor.column_types(s, again=False)
        s.check_known(columns, types)
        if not self._judged:
            await self._judge(s.judged)
        action = "fenced batch upsert"
        while True:
            call = s.upsert_set_call(token, columns, data, types)
            if call is None:

                async def check(types: Any = types) -> None:
                    await self._check_fences(keys, token, types, need_live=False, action=action)

                async def verify(types: Any = types) -> bool:
                    found = await self._read_fences(keys, types, lock=True, action=action)
                    return all(k in found and found[k].fence == token for k in keys)

                writes = [s.upsert_rows(token, columns, data)]
                if await self._row_path(
                    s.name,
                    token,
                    len(keys),
                    writes,
                    check,
                    s.opener,
                    action,
                    verify if s.found_rows else None,
                ):
                    self._accepted_rows(keys, token)
                    return
                break
            stmt, params = call

            # In a savepoint, which also undoes the batch if a concurrent transaction
            # inserts one of its absent keys with a newer fence.
            async def body(stmt: Any = stmt, params: Any = params) -> bool:
                count, _ = await executor.run(stmt, params, False, action, s.name)
                return count == len(keys)

            if await executor.atomically(body, action, s.name):
                self._accepted_rows(keys, token)
                return
            fresh = await executor.column_types(s, again=True)
            if fresh == types:
                break
            types = fresh
        raise await self._batch_rejection(keys, token, types, need_live=False)


class AsyncRegisterFlow(_AsyncFlow[RowT]):
    """A fence register: fences kept in a table ``(scope PK, fence)`` (C6, C7, C8).

    Args:
        executor: runs the statements on the caller's connection.
        statements: the register table's statements.
        events: the bus for ``WRITE_ACCEPTED`` / ``WRITE_REJECTED`` (default bus if omitted).
        source: the source named in those events.
        returning: claims are proven by ``RETURNING`` (else by their row count).
    """

    def __init__(
        self,
        executor: AsyncExecutor[RowT],
        statements: RegisterStatementSet,
        events: EventBus | None,
        source: str,
        *,
        returning: bool,
    ) -> None:
        self.executor = executor
        self.statements = statements
        self.events = events or default_bus
        self.source = source
        self.returning = returning

    async def _read_scopes(self, scopes: Sequence[str], *, lock: bool) -> dict[str, Probe]:
        """The fence of each scope that has one."""
        s = self.statements
        found: dict[str, Probe] = {}
        for stmt, params in s.probe_reads(scopes, lock=lock):
            for scope, fence in await self.executor.read(stmt, params, "diagnostic read", s.name):
                found[scope] = Probe(True, fence, True)
        return found

    async def fence(self, scope: str) -> int | None:
        """The fence of ``scope``, ``None`` if it was never claimed.

        Raises:
            InvalidResourceError: ``scope`` is not a valid scope name.
            BackendError: the database failed.
        """
        scope = validate_resource(scope, what="scope")
        stmt, params = self.statements.probe_call(scope)
        rows = await self.executor.read(stmt, params, "diagnostic read", self.statements.name)
        return rows[0][1] if rows else None

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
        returning = self.returning
        self._check_rowcount(returning, scope, token)
        if not self._judged:
            await self._judge(self.statements.judged)
        stmt, params = self.statements.claim_call(scope, token, returning)
        try:
            count, _ = await self.executor.run(stmt, params, returning, "fence claim", scope)
        except StaleTokenError as err:  # the database's judge (MariaDB, MySQL: no WHERE)
            raise self._rejected(err) from err.__cause__
        found_rows = self.statements.found_rows
        if found_rows and count == 2:  # a fence raised
            count = 1
        elif found_rows and count == 1:
            # A scope inserted, or a fence left as it was (see RowStatementSet.found_rows):
            # the fence, read with a lock, is the token only if the claim passed.
            found = await self._read_scopes([scope], lock=True)
            count = 1 if scope in found and found[scope].fence == token else 0
        if count == 1:
            self._accepted((scope,), token)
            return token
        if not found_rows:
            found = await self._read_scopes([scope], lock=False)
        raise self._rejected(scope_verdicts([scope], token, found, everything=True)[0])

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
        executor = self.executor
        self._check_rowcount(False, s.name, token)
        if not self._judged:
            await self._judge(s.judged)
        action = "fence claim"
        call = s.claim_set_call(unique, token)
        if call is None:

            async def check() -> None:
                found = await self._read_scopes(unique, lock=s.locks_rows)
                errors = scope_verdicts(unique, token, found, everything=False)
                if errors:
                    raise self._rejected(batch_rejection(s.name, token, errors))

            async def verify() -> bool:
                found = await self._read_scopes(unique, lock=True)
                return all(k in found and found[k].fence == token for k in unique)

            writes = [s.claim_rows(unique, token)]
            written = await self._row_path(
                s.name,
                token,
                len(unique),
                writes,
                check,
                s.opener,
                action,
                verify if s.found_rows else None,
            )
        else:
            stmt, params = call

            async def body() -> bool:
                count, _ = await executor.run(stmt, params, False, action, s.name)
                return count == len(unique)

            written = await executor.atomically(body, action, s.name)
        if written:
            self._accepted(unique, token)
            return
        found = await self._read_scopes(unique, lock=s.found_rows)
        errors = scope_verdicts(unique, token, found, everything=True)
        raise self._rejected(batch_rejection(s.name, token, errors))
