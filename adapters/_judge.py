"""The database's judge (C14) as SQLAlchemy sees it: the token inside the fenced
statements, the triggers installed with the tables and checked before the first write, the
judge's refusals as iofence errors, and the opt-out.

The trigger DDL itself is text (``_triggers``); the fenced statements carry their token
themselves (``_sql_statements.TokenOf``). Here:

- :func:`judged_of`, :func:`trigger_ddl`, :func:`install_triggers`: the judge of a Core
  table; ``metadata.create_all`` installs it for every table with a fence column and every
  fence register (an ``after_create`` listener).
- :func:`ensure_judged`: the check that a table's triggers are in place and current, once
  per table and DBAPI connection (in the pool entry's ``info``); the guards, the session
  hook and the unit of work call it before their first write.
- SQLite: the functions the triggers call, registered on every connection a pool opens,
  and the token of each connection's transaction, cleared when the transaction ends.
- MariaDB and MySQL: the session variables the triggers read. An accepted fenced write
  leaves none behind (the judge's ``AFTER`` trigger clears the row's token); a failed
  statement, a ``SET`` of the library's own (:func:`set_token`, the opt-out) or a write
  under :data:`WITHOUT_JUDGE` may, so the end of that transaction clears them, and so does
  the pool when it takes such a connection back: a session variable outlives the
  transaction, and a pooled connection must never carry a token into the next one.
- Engine listeners: a refusal of the judge becomes :class:`fence.UnfencedWriteError` or
  :class:`fence.StaleTokenError` (``handle_error``); a statement marked
  ``.execution_options(unfenced=True)`` opts out in the database too, for itself only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

from sqlalchemy import Engine, Table, event, text
from sqlalchemy.engine import Connection
from sqlalchemy.exc import DBAPIError, SQLAlchemyError
from sqlalchemy.pool import Pool

from fence._errors import ConfigurationError, FenceError

from ._sql_common import judge_error, translate_error
from ._sql_gate import OWN_OPTIONS, UNFENCED
from ._sql_statements import OPTIONAL_INFO, REGISTER_INFO, TOMBSTONE_INFO, fence_of
from ._triggers import (
    CASCADE_VERDICT,
    MARIADB_CHECK_QUERY,
    PG_CHECK_QUERY,
    ROW_TOKEN_VARIABLE,
    SQLITE_CHECK_QUERY,
    TOKEN_SETTING,
    TOKEN_VARIABLE,
    UNFENCED_SETTING,
    UNFENCED_VARIABLE,
    Judged,
    SQLiteState,
    mariadb_judge_ddl,
    pg_drop_ddl,
    pg_judge_ddl,
    sqlite_judge_ddl,
    verdict,
)

#: The options of the judge's DDL: the guards' own, and sent without parameters, so that
#: the ``%`` of a PL/pgSQL ``RAISE`` reaches the server as it is.
_DDL_OPTIONS: Mapping[str, Any] = {**OWN_OPTIONS, "no_parameters": True}

__all__ = [
    "CHECKED_KEY",
    "JUDGED_DIALECTS",
    "REFUSAL_HOOKS",
    "SESSION_DIALECTS",
    "TOKEN_KEY",
    "WITHOUT_JUDGE",
    "clear_token",
    "ensure_judged",
    "forget_judged",
    "hold_token",
    "install",
    "install_triggers",
    "judged_of",
    "judged_on",
    "judged_without_triggers",
    "record_verdict",
    "set_token",
    "sqlite_state",
    "trigger_ddl",
]

#: The dialects whose tables carry the judge.
JUDGED_DIALECTS = frozenset({"postgresql", "sqlite", "mariadb", "mysql"})

#: The dialects whose judge reads session variables that outlive the transaction (MariaDB,
#: MySQL): the library clears them (see :data:`WITHOUT_JUDGE`).
SESSION_DIALECTS = frozenset({"mariadb", "mysql"})

#: The execution option (of an engine or a connection) by which a user accepts to write
#: the fenced tables of a MariaDB or MySQL database (:data:`SESSION_DIALECTS`) whose
#: triggers are not installed: the guards do not check for them, their own checks
#: (C4-C9) hold, but a write that does not go through iofence is not refused by the
#: database.
WITHOUT_JUDGE = "iofence_without_judge"

#: Pool entry ``info`` key of a MariaDB or MySQL connection whose session may hold one of
#: the judge's variables (a statement failed, or the library set one): the end of the
#: transaction, or the pool's reset, clears them.
_SESSION_KEY = "iofence.session_variables"

#: Pool entry ``info`` key of a MariaDB or MySQL connection that wrote under
#: :data:`WITHOUT_JUDGE`: a table without the judge's triggers has no ``AFTER`` trigger to
#: clear the row's token, so every end of a transaction on it clears the variables.
_UNJUDGED_KEY = "iofence.unjudged_writes"

#: Pool entry ``info`` key of the tables whose triggers were checked on the connection
#: (their :attr:`Judged.check_key`).
CHECKED_KEY = "iofence.judged"

#: Pool entry ``info`` key of a SQLite connection's :class:`SQLiteState`.
_SQLITE_KEY = "iofence.sqlite"

#: Connection ``info`` key of the token the library has set in the connection's current
#: transaction (the session hook's claim, :func:`set_token`), ``None`` when none.
TOKEN_KEY = "iofence.token"  # noqa: S105 - a dictionary key, no secret


# -- the judge of a Core table --------------------------------------------------------------


def judged_of(
    table: Table, *, fence: str | None = None, tombstone: str | None = None
) -> Judged | None:
    """The judge of ``table`` as its declaration says: a fence register, a table with a
    fence column (:func:`fence_of`, its tombstone flag by marker), or ``None``.

    Args:
        table: the table.
        fence: the fence column's name, where the caller names it (``RowGuard(fence=)``).
        tombstone: the tombstone flag's name, where the caller names it.
    """
    if table.info.get(REGISTER_INFO):
        return Judged(table.name, table.schema, fence="fence", register=True, key=("scope",))
    column = table.c[fence] if fence is not None and fence in table.c else fence_of(table)
    if column is None:
        return None
    if tombstone is None:
        marked = [c for c in table.columns if c.info.get(TOMBSTONE_INFO)]
        tombstone = marked[0].name if len(marked) == 1 else None
    elif tombstone in table.c:
        tombstone = table.c[tombstone].name
    return Judged(
        table.name,
        table.schema,
        fence=column.name,
        tombstone=tombstone,
        optional=bool(column.info.get(OPTIONAL_INFO)),
        key=tuple(c.name for c in table.primary_key.columns) or None,
    )


def trigger_ddl(judged: Judged, dialect: str) -> list[str]:
    """The judge's DDL for ``dialect`` (``[]`` for a dialect without one).

    Args:
        judged: the table, as :func:`judged_of` gives it.
        dialect: SQLAlchemy's name of the dialect.
    """
    if dialect == "postgresql":
        return pg_judge_ddl(judged)
    if dialect == "mariadb":
        return mariadb_judge_ddl(judged)
    if dialect == "mysql":
        return mariadb_judge_ddl(judged, replace=False)
    if dialect == "sqlite":
        if judged.schema is not None:
            return [
                s.replace(" ON ", f' ON "{judged.schema}".', 1) for s in sqlite_judge_ddl(judged)
            ]
        return sqlite_judge_ddl(judged)
    return []


def install_triggers(
    conn: Connection, table: Table, *, fence: str | None = None, tombstone: str | None = None
) -> None:
    """Install (or upgrade) the database's judge of ``table`` on ``conn``, inside its
    transaction (C14).

    ``metadata.create_all`` does it for every table declared with a fence column and every
    fence register; call it for a table made otherwise (by hand, or before this version).
    With an :class:`~sqlalchemy.ext.asyncio.AsyncConnection`:
    ``await conn.run_sync(install_triggers, table)``.

    Args:
        conn: a connection to PostgreSQL, SQLite, MariaDB or MySQL (other databases:
            nothing is done).
        table: the table: it has a fence column, or is a fence register.
        fence: its fence column, where the declaration does not mark it.
        tombstone: its tombstone flag, where the declaration does not mark it.

    Raises:
        ConfigurationError: the table has no fence column and is no fence register.
    """
    judged = judged_of(table, fence=fence, tombstone=tombstone)
    if judged is None:
        raise ConfigurationError(
            f"table {table.name} has no fence column and is no fence register: nothing to judge"
        )
    for statement in trigger_ddl(judged, conn.dialect.name):
        conn.exec_driver_sql(statement, execution_options=_DDL_OPTIONS)
    forget_judged(conn, judged)


def _after_create(table: Table, connection: Connection, **kw: Any) -> None:
    judged = judged_of(table)
    if judged is not None and connection.dialect.name in JUDGED_DIALECTS:
        for statement in trigger_ddl(judged, connection.dialect.name):
            connection.exec_driver_sql(statement, execution_options=_DDL_OPTIONS)


def _after_drop(table: Table, connection: Connection, **kw: Any) -> None:
    judged = judged_of(table)
    if judged is not None and connection.dialect.name == "postgresql":
        # The triggers went with the table; their function stays unless dropped.
        connection.exec_driver_sql(pg_drop_ddl(judged)[-1], execution_options=_DDL_OPTIONS)


# -- the check ------------------------------------------------------------------------------


def forget_judged(conn: Connection, judged: Judged) -> None:
    """Check ``judged``'s triggers again at the next write on ``conn``'s DBAPI connection."""
    checked = conn.connection.info.get(CHECKED_KEY)
    if checked is not None:
        checked.discard(judged.check_key)


def judged_on(conn: Connection, judged: Judged) -> bool:
    """Whether ``judged``'s triggers need no check on ``conn`` (found in place before, a
    database without the judge, or :data:`WITHOUT_JUDGE`). No I/O."""
    dialect = conn.dialect.name
    if dialect not in JUDGED_DIALECTS:
        return True
    if dialect in SESSION_DIALECTS and conn.get_execution_options().get(WITHOUT_JUDGE):
        conn.connection.info[_UNJUDGED_KEY] = True
        return True
    checked: set[tuple[Any, ...]] | None = conn.connection.info.get(CHECKED_KEY)
    return checked is not None and judged.check_key in checked


def record_verdict(conn: Connection | None, judged: Judged, rows: Any) -> None:
    """Judge the rows of the check of ``judged``'s triggers; remember the table on ``conn``
    if they are in place.

    Raises:
        ConfigurationError: the triggers are missing, disabled or of another version (on
            MariaDB and MySQL: or a foreign key cascades into the table).
    """
    dialect = conn.dialect.name if conn is not None else "postgresql"
    exists, why = verdict(dialect, rows, judged)
    if why is not None:
        if CASCADE_VERDICT in why:  # the triggers are not what is wrong
            raise ConfigurationError(why)
        raise ConfigurationError(f"{why}; {judged.hint(dialect)}")
    if exists and conn is not None and not conn.closed and not conn.invalidated:
        conn.connection.info.setdefault(CHECKED_KEY, set()).add(judged.check_key)


def ensure_judged(conn: Connection, judged: Judged) -> None:
    """Refuse to write a table whose triggers are missing or outdated (C14); the first call
    for a table on a DBAPI connection reads the catalogue, the later ones a set.

    A table that does not exist passes (and is checked again next time): the write that
    follows fails as it always did.

    Args:
        conn: the caller's connection, inside its transaction.
        judged: the table as the caller writes it.

    Raises:
        ConfigurationError: the triggers are missing, disabled or of another version (on
            MariaDB and MySQL: or a foreign key cascades into the table, which fires no
            trigger); the message says what to run.
        BackendError: the catalogue could not be read.
    """
    if judged_on(conn, judged):
        return
    if conn.dialect.name in SESSION_DIALECTS:
        schema = "DATABASE()" if judged.schema is None else ":s"
        query = text(MARIADB_CHECK_QUERY.format(param=":t", schema=schema))
        params = {"t": judged.table}
        if judged.schema is not None:
            params["s"] = judged.schema
    elif conn.dialect.name == "postgresql":
        query = text(PG_CHECK_QUERY.format(param=":t"))
        params = {"t": judged.qualified}
    else:
        schema = f'"{judged.schema}".' if judged.schema else ""
        query = text(SQLITE_CHECK_QUERY.format(param=":t", schema=schema))
        params = {"t": judged.table}
    try:
        rows = conn.execute(query, params, execution_options=OWN_OPTIONS).all()
    except SQLAlchemyError as exc:
        raise translate_error(exc, "the check of the judge's triggers", judged.table) from exc
    record_verdict(conn, judged, rows)


# -- the token of a connection's transaction --------------------------------------------------


def sqlite_state(conn: Connection) -> SQLiteState | None:
    """The judge's state of a SQLite connection, ``None`` if its pool did not register it."""
    found: SQLiteState | None = conn.connection.info.get(_SQLITE_KEY)
    return found


def _sqlite_connect(dbapi_connection: Any, record: Any) -> None:
    if not _is_sqlite(dbapi_connection):
        return
    state = SQLiteState()
    record.info[_SQLITE_KEY] = state
    # Not deterministic: SQLite must call them for every row, never fold them.
    dbapi_connection.create_function("iofence_token", 0, state.get_token)
    dbapi_connection.create_function("iofence_unfenced", 0, state.get_unfenced)
    dbapi_connection.create_function("iofence_set_token", 1, state.set_token)


def _is_sqlite(dbapi_connection: Any) -> bool:
    module = type(dbapi_connection).__module__
    return module.startswith(("sqlite3", "pysqlite2")) or "aiosqlite" in module


_CLEAR_VARIABLES = (
    f"SET {ROW_TOKEN_VARIABLE} = NULL, {TOKEN_VARIABLE} = NULL, {UNFENCED_VARIABLE} = NULL"
)


def _clear_variables(dbapi_connection: Any) -> None:
    """Clear the judge's session variables on a MariaDB or MySQL connection (one round
    trip)."""
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(_CLEAR_VARIABLES)
    finally:
        cursor.close()


def _pool_reset(dbapi_connection: Any, connection_record: Any, reset_state: Any) -> None:
    record = connection_record
    if record is None:
        return
    if record.info.get(_SESSION_KEY) or record.info.get(_UNJUDGED_KEY):
        # The pool takes the connection back (or resets it): no token may stay in the
        # session for its next user. An error here makes the pool discard the connection,
        # and the session, variables and all, ends with it.
        _clear_variables(dbapi_connection)
        record.info.pop(_SESSION_KEY, None)
    record.info.pop(TOKEN_KEY, None)
    state: SQLiteState | None = record.info.get(_SQLITE_KEY)
    if state is not None:
        state.clear()


def set_token(conn: Connection, token: int) -> None:
    """Make ``token`` the token of ``conn``'s transaction (for the writes that carry none of
    their own: the flush of a session bound without a claim). PostgreSQL, MariaDB, MySQL:
    one statement; SQLite: no I/O.

    Raises:
        BackendError: the statement failed.
    """
    dialect = conn.dialect.name
    if dialect == "sqlite":
        state = sqlite_state(conn)
        if state is not None:
            state.token = token
    elif dialect in ("postgresql", *SESSION_DIALECTS):
        if dialect == "postgresql":
            statement = f"SELECT pg_catalog.set_config('{TOKEN_SETTING}', '{int(token)}', true)"
        else:
            conn.connection.info[_SESSION_KEY] = True
            statement = f"SET {TOKEN_VARIABLE} = {int(token)}"
        try:
            conn.exec_driver_sql(statement, execution_options=OWN_OPTIONS)
        except SQLAlchemyError as exc:
            raise translate_error(exc, "setting the transaction's token", "-") from exc
    conn.info[TOKEN_KEY] = token


def hold_token(conn: Connection) -> None:
    """Record that a statement about to run on ``conn`` makes a token the transaction's in
    a session variable (MariaDB, MySQL: the session hook's claim): the end of the
    transaction, or the pool's reset, clears it. No I/O."""
    if conn.dialect.name in SESSION_DIALECTS:
        conn.connection.info[_SESSION_KEY] = True


def judged_without_triggers(conn: Connection) -> bool:
    """Whether ``conn`` writes MariaDB's or MySQL's fenced tables under
    :data:`WITHOUT_JUDGE`: no trigger refuses a stale write there, so a row count that
    cannot tell a refused upsert from an accepted one must be proven by a read."""
    return bool(conn.get_execution_options().get(WITHOUT_JUDGE))


def clear_token(conn: Connection) -> None:
    """Take the token out of ``conn``'s transaction again (a refused claim set it): its
    later writes are refused by the judge as writes without a token.

    Raises:
        BackendError: the statement failed.
    """
    dialect = conn.dialect.name
    if dialect == "sqlite":
        state = sqlite_state(conn)
        if state is not None:
            state.token = None
    elif dialect in ("postgresql", *SESSION_DIALECTS):
        if dialect == "postgresql":
            statement = f"SELECT pg_catalog.set_config('{TOKEN_SETTING}', '', true)"
        else:
            statement = f"SET {TOKEN_VARIABLE} = NULL"
        try:
            conn.exec_driver_sql(statement, execution_options=OWN_OPTIONS)
        except SQLAlchemyError as exc:
            raise translate_error(exc, "clearing the transaction's token", "-") from exc
    conn.info.pop(TOKEN_KEY, None)


def _transaction_ending(conn: Connection, *args: Any) -> None:
    if conn.closed or conn.invalidated:
        return
    info = conn.connection.info
    if info.get(_SESSION_KEY) or info.get(_UNJUDGED_KEY):
        # Before COMMIT or ROLLBACK is sent (the events fire first); the variables are not
        # transactional, so they are cleared all the same. A connection that cannot be
        # cleared is discarded: its session, and its variables, end with it, and its
        # transaction with them, uncommitted. The driver's error has not been through
        # SQLAlchemy's handling here: it is wrapped as SQLAlchemy wraps a failed COMMIT (an
        # OperationalError, the connection invalidated), so that the caller sees what a
        # commit without a token in its session would have raised.
        try:
            _clear_variables(conn.connection.dbapi_connection)
        except Exception as exc:
            conn.invalidate()
            dialect = conn.dialect
            raise DBAPIError.instance(
                _CLEAR_VARIABLES,
                None,
                exc,
                dialect.loaded_dbapi.Error,
                connection_invalidated=True,
                dialect=dialect,
            ) from exc
        info.pop(_SESSION_KEY, None)
    _transaction_ended(conn)


def _transaction_ended(conn: Connection, *args: Any) -> None:
    if conn.closed or conn.invalidated:
        return  # the DBAPI connection, and what it carried, is gone
    info = conn.connection.info
    info.pop(TOKEN_KEY, None)
    state: SQLiteState | None = info.get(_SQLITE_KEY)
    if state is not None:
        state.clear()


def _savepoint_undone(conn: Connection, *args: Any) -> None:
    # A setting made inside the savepoint went with it: set the token again if needed.
    if not conn.closed and not conn.invalidated:
        conn.connection.info.pop(TOKEN_KEY, None)


# -- the opt-out, as the database sees it -------------------------------------------------


_PREVIOUS = "iofence.unfenced_previous"
_RESTORE = text(f"SELECT pg_catalog.set_config('{UNFENCED_SETTING}', :v, true)")
_RESTORE_MARIADB = text(f"SET {UNFENCED_VARIABLE} = :v")


def _before_execute(
    conn: Connection,
    elem: Any,
    multiparams: Any,
    params: Any,
    execution_options: Mapping[str, Any],
) -> None:
    if not execution_options.get(UNFENCED) or execution_options.get("iofence"):
        return
    dialect = conn.dialect.name
    if dialect == "sqlite":
        state = sqlite_state(conn)
        if state is not None:
            conn.info[_PREVIOUS] = state.unfenced
            state.unfenced = True
    elif dialect == "postgresql":
        result = conn.exec_driver_sql(
            f"SELECT pg_catalog.current_setting('{UNFENCED_SETTING}', true), "
            f"pg_catalog.set_config('{UNFENCED_SETTING}', 'on', true)",
            execution_options=OWN_OPTIONS,
        )
        conn.info[_PREVIOUS] = result.scalar() or ""
    elif dialect in SESSION_DIALECTS:
        conn.connection.info[_SESSION_KEY] = True
        result = conn.exec_driver_sql(
            f"SELECT {UNFENCED_VARIABLE}, {UNFENCED_VARIABLE} := 1", execution_options=OWN_OPTIONS
        )
        conn.info[_PREVIOUS] = result.scalar()


def _after_execute(
    conn: Connection,
    elem: Any,
    multiparams: Any,
    params: Any,
    execution_options: Mapping[str, Any],
    result: Any,
) -> None:
    if _PREVIOUS not in conn.info:
        return
    previous = conn.info.pop(_PREVIOUS)
    dialect = conn.dialect.name
    if dialect == "sqlite":
        state = sqlite_state(conn)
        if state is not None:
            state.unfenced = bool(previous)
    elif dialect == "postgresql":
        # The opt-out covers the marked statement, not the rest of the transaction.
        conn.execute(_RESTORE, {"v": previous}, execution_options=OWN_OPTIONS)
    elif dialect in SESSION_DIALECTS:
        conn.execute(_RESTORE_MARIADB, {"v": previous}, execution_options=OWN_OPTIONS)


def _handle_error(context: Any) -> None:
    """A refusal of the judge, as the iofence error it stands for."""
    token = None
    conn = context.connection
    if conn is not None and conn.dialect.name in SESSION_DIALECTS and not conn.invalidated:
        # A failed statement may have assigned the row's token without the AFTER trigger
        # that clears it (a duplicate key, a lock timeout, a refusal of the judge).
        with contextlib.suppress(Exception):
            conn.connection.info[_SESSION_KEY] = True
    if conn is not None and conn.dialect.name == "sqlite" and not conn.invalidated:
        state = sqlite_state(conn)
        token = state.get_token() if state is not None else None
    found = judge_error(context.original_exception, token)
    if found is not None:
        if context.connection is not None:
            context.connection.info.pop(_PREVIOUS, None)
        for hook in REFUSAL_HOOKS:
            hook(context, found)  # it raises its own verdict, or leaves this one
        raise found from context.sqlalchemy_exception or context.original_exception


#: Called with SQLAlchemy's exception context and the judge's error before it is raised:
#: the session hook's verdict of its own flush statements (``_orm.verdicts``). SQLAlchemy
#: runs ``handle_error`` listeners in the order they were added, whatever ``insert=``
#: asks, so the hook cannot go ahead of this one.
REFUSAL_HOOKS: list[Callable[[Any, FenceError], None]] = []


_INSTALLED: list[bool] = []


def install() -> None:
    """Install the judge's listeners (once per process; ``fence.adapters.sql`` and
    ``fence.adapters.orm`` do it): ``after_create``/``after_drop`` on every
    :class:`~sqlalchemy.Table`, the SQLite functions on every pool's connections, the end
    of a transaction, the opt-out and the error mapping on every engine."""
    if _INSTALLED:
        return
    _INSTALLED.append(True)
    event.listen(Table, "after_create", _after_create)
    event.listen(Table, "after_drop", _after_drop)
    event.listen(Pool, "connect", _sqlite_connect)
    event.listen(Pool, "reset", _pool_reset)
    event.listen(Engine, "begin", _transaction_ended)
    event.listen(Engine, "commit", _transaction_ending)
    event.listen(Engine, "rollback", _transaction_ending)
    event.listen(Engine, "commit_twophase", _transaction_ending)
    event.listen(Engine, "rollback_twophase", _transaction_ending)
    event.listen(Engine, "rollback_savepoint", _savepoint_undone)
    event.listen(Engine, "before_execute", _before_execute)
    event.listen(Engine, "after_execute", _after_execute)
    event.listen(Engine, "handle_error", _handle_error)
