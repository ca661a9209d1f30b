"""What a Django connection carries for iofence: the blocks bound to it, the judge's
functions on SQLite, and the execute wrapper that sends the token and refuses unbound
writes (C9, C14).

The token travels with the transaction, as ``docs/database-judge.md`` describes:

- PostgreSQL: ``set_config('iofence.token', <t>, true)``, transaction-local, sent with the
  first statement of the block (in the same query text, so it costs no round trip, where
  the cursor binds its parameters on the client: psycopg 3's ``ClientCursor``, Django's
  default; otherwise as a statement of its own just before).
- SQLite: the functions the triggers call (``iofence_token()`` and the others), registered
  on every connection Django opens (``connection_created``), read a
  :class:`~fence.adapters._triggers.SQLiteState` that the first statement of the block
  fills and the end of the block empties (no I/O).

Every statement of a connection runs through :func:`execute_wrapper`, installed when the
connection is made: a write to a fenced model's table outside a block is refused before
any I/O, and the judge's refusals become :class:`fence.StaleTokenError` and
:class:`fence.UnfencedWriteError`. Inside a block, a deadlock, a lock wait timeout, a
serialization failure and a busy SQLite database become :class:`fence.RetryableError`:
nothing was judged, the block's transaction is rolled back and may be run again.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from django.db import DatabaseError, connections

from fence._errors import ConfigurationError, TokenRequiredError, UnfencedWriteError
from fence._sql_dialect import fault_of

from .._sql_common import judge_error, translate_error
from .._triggers import (
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
    verdict,
)

__all__ = [
    "FENCED_TABLES",
    "REGISTER",
    "Binding",
    "ConnectionState",
    "began",
    "bound_token",
    "claim_sql",
    "connection_created",
    "execute_wrapper",
    "install_wrapper",
    "is_mariadb",
    "refused_early",
    "restore",
    "state_of",
]

#: The tables of the fenced models (lower case), filled when the app is ready.
FENCED_TABLES: dict[str, Judged] = {}

#: The app's fence register, as its judge is made for it.
REGISTER = Judged("iofence_fence_register", fence="fence", register=True, key=("scope",))

#: The vendors whose tables carry the judge (Django's ``mysql`` vendor: MariaDB only).
JUDGED_VENDORS = frozenset({"postgresql", "sqlite", "mysql"})

_ATTR = "_iofence_state"

# A write's target as Django's compilers spell it (INSERT INTO "t", UPDATE "t",
# DELETE FROM "t"); raw SQL in other shapes is left to the judge.
_WRITE = re.compile(
    r"\s*(?:INSERT\s+(?:OR\s+\w+\s+)?INTO|REPLACE\s+INTO|UPDATE|DELETE\s+FROM)\s+[`\"]?(\w+)",
    re.IGNORECASE,
)

# A TRUNCATE's first table (``TRUNCATE [TABLE] [ONLY] [schema.]t``). MariaDB fires no
# trigger for it, so the client refuses it unless the opt-out is open; on PostgreSQL the
# judge refuses it too.
_TRUNCATE = re.compile(
    r"\s*TRUNCATE\s+(?:TABLE\s+)?(?:ONLY\s+)?(?:[`\"]?\w+[`\"]?\.)?[`\"]?(\w+)",
    re.IGNORECASE,
)


@dataclass(eq=False, slots=True)
class Binding:
    """One block open on a connection: :func:`~fence.adapters.django.fenced` (a token)
    or :func:`~fence.adapters.django.unfenced` (``token`` is ``None``).

    Attributes:
        token: the block's token, ``None`` for the opt-out.
        nested: the block began inside the caller's own transaction (a savepoint).
        scope: the resource the block claims at its first statement (C8), or ``None``.
        sent: the database has the block's setting (and its claim).
    """

    token: int | None
    nested: bool
    scope: str | None = None
    sent: bool = False


@dataclass(eq=False, slots=True)
class ConnectionState:
    """iofence's state of one Django connection (a ``DatabaseWrapper``).

    Attributes:
        stack: the blocks open on it, innermost last.
        sqlite: the judge's functions' state (SQLite), ``None`` elsewhere.
        checked: the tables whose triggers were found in place on the current DB-API
            connection (their :attr:`Judged.check_key`).
        session: (MariaDB) the session's variables may hold a block's token or opt-out.
    """

    stack: list[Binding] = field(default_factory=list)
    sqlite: SQLiteState | None = None
    checked: set[tuple[str | None, str, str, str]] = field(default_factory=set)
    session: bool = False


def state_of(conn: Any) -> ConnectionState:
    """The :class:`ConnectionState` of the Django connection ``conn`` (made on first use)."""
    state: ConnectionState | None = getattr(conn, _ATTR, None)
    if state is None:
        state = ConnectionState()
        setattr(conn, _ATTR, state)
    return state


def bound_token(conn: Any | None) -> int | None:
    """The token of the innermost block open on ``conn``; with ``None``, of the only
    connection of this thread that has a block open (``None`` if none or several)."""
    if conn is not None:
        state: ConnectionState | None = getattr(conn, _ATTR, None)
        if state is None:
            return None
        for binding in reversed(state.stack):
            if binding.token is not None:
                return binding.token
        return None
    found = [
        token
        for each in connections.all(initialized_only=True)
        if (token := bound_token(each)) is not None
    ]
    return found[0] if len(found) == 1 else None


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _settings(state: ConnectionState, upto: int) -> tuple[str, str]:
    """The token and opt-out settings the blocks ``stack[:upto]`` stand for (PostgreSQL)."""
    token = ""
    unfenced = ""
    for binding in state.stack[:upto]:
        if binding.token is None:
            unfenced = "on"
        else:
            token = str(binding.token)
    return token, unfenced


def _set_sql(token: str, unfenced: str) -> str:
    return (
        f"SELECT pg_catalog.set_config('{TOKEN_SETTING}', {_literal(token)}, true), "
        f"pg_catalog.set_config('{UNFENCED_SETTING}', {_literal(unfenced)}, true)"
    )


def _mariadb_literal(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "''") + "'"


def _mariadb_set_sql(token: str, unfenced: str) -> str:
    """The ``SET`` of the session's variables (MariaDB) to what ``token`` and ``unfenced``
    (as :func:`_settings` gives them) stand for; empty ones are ``NULL``."""
    return (
        f"SET {TOKEN_VARIABLE} = {int(token) if token else 'NULL'}, "
        f"{UNFENCED_VARIABLE} = {1 if unfenced else 'NULL'}, {ROW_TOKEN_VARIABLE} = NULL"
    )


def is_mariadb(conn: Any) -> bool:
    """Whether the Django connection ``conn`` is to MariaDB (Django's ``mysql`` vendor)."""
    return conn.vendor == "mysql" and bool(conn.mysql_is_mariadb)


def claim_sql(scope: str, token: int, vendor: str = "postgresql") -> str:
    """The claim of ``scope`` (C8): raise its fence in the register to ``token``. The
    register's judge refuses it, as a stale write, if the fence is above the token."""
    if vendor == "mysql":
        return (
            f"INSERT INTO `{REGISTER.table}` (`scope`, `fence`) "  # noqa: S608 - a quoted literal and an int
            f"VALUES ({_mariadb_literal(scope)}, {int(token)}) "
            "ON DUPLICATE KEY UPDATE `fence` = VALUES(`fence`)"
        )
    table = f'"{REGISTER.table}"'
    return (
        f'INSERT INTO {table} ("scope", "fence") VALUES ({_literal(scope)}, {int(token)}) '  # noqa: S608 - a quoted literal and an int
        'ON CONFLICT ("scope") DO UPDATE SET "fence" = excluded."fence"'
    )


def _sync_sqlite(state: ConnectionState) -> None:
    if state.sqlite is None:
        return
    token: int | None = None
    unfenced = False
    for binding in state.stack:
        if binding.token is None:
            unfenced = True
        else:
            token = binding.token
    state.sqlite.token = token
    state.sqlite.unfenced = unfenced


def began(conn: Any) -> None:
    """A block was pushed on ``conn``: on SQLite its functions read it at once (no I/O);
    elsewhere the first statement sends it."""
    if conn.vendor == "sqlite":
        _sync_sqlite(state_of(conn))


def restore(conn: Any, binding: Binding, failed: bool) -> None:
    """The block ``binding`` (just popped) ends: what the connection's transaction carries
    goes back to what the blocks still open stand for.

    PostgreSQL: the end of the transaction ends the setting, and a rolled back savepoint
    takes it with it; a block that ends inside the caller's transaction without an error
    sets it back (one statement, only then). SQLite: no I/O. MariaDB: the session's
    variables outlive the transaction and its savepoints, so every block that sent them
    sets them back (one statement), with an exception or without; if that fails the
    connection is closed, and its session with them.

    Args:
        conn: the Django connection.
        binding: the block that ends.
        failed: the block ends with an exception (its savepoint is rolled back).
    """
    state = state_of(conn)
    if conn.vendor == "sqlite":
        _sync_sqlite(state)
        return
    if conn.vendor == "mysql":
        _restore_mariadb(conn, state, failed)
        return
    if conn.vendor != "postgresql" or not (binding.nested and binding.sent) or failed:
        return
    if conn.needs_rollback:
        return  # Django rolls the savepoint back, and the setting with it
    token, unfenced = _settings(state, len(state.stack))
    with conn.connection.cursor() as cursor:
        cursor.execute(_set_sql(token, unfenced))
    for below in state.stack:
        below.sent = True


def _restore_mariadb(conn: Any, state: ConnectionState, failed: bool) -> None:
    if not state.session:
        return
    raw = conn.connection
    if raw is None:  # closed: the session and its variables are gone
        state.session = False
        return
    token, unfenced = _settings(state, len(state.stack))
    try:
        # The DB-API cursor: Django refuses its own in a transaction marked for rollback.
        with raw.cursor() as cursor:
            cursor.execute(_mariadb_set_sql(token, unfenced))
    except Exception:
        state.session = False
        conn.close()  # a session that may keep the token must not serve another block
        if not failed:
            raise
        return
    state.session = bool(token or unfenced)
    for below in state.stack:
        below.sent = True


def _binds_on_client(raw: Any) -> bool:
    """Whether ``raw`` is a psycopg 3 cursor that merges parameters into the text (Django's
    default), so that one query text can hold two statements."""
    psycopg = sys.modules.get("psycopg")
    return psycopg is not None and isinstance(raw, psycopg.ClientCursor)


def _check(conn: Any, state: ConnectionState, judged: Judged) -> None:
    """Refuse to write a table whose triggers are missing or outdated (C14): read the
    catalogue once per table and DB-API connection."""
    vendor = conn.vendor
    if vendor == "postgresql":
        query = PG_CHECK_QUERY.format(param=_literal(judged.qualified))
    elif vendor == "sqlite":
        query = SQLITE_CHECK_QUERY.format(param=_literal(judged.table), schema="")
    elif is_mariadb(conn):
        query = MARIADB_CHECK_QUERY.format(
            param=_mariadb_literal(judged.table), schema="DATABASE()"
        )
        vendor = "mariadb"
    else:
        raise ConfigurationError(
            f"{judged.table}: iofence has no database judge on {conn.display_name} yet "
            "(C14); fenced Django models run on PostgreSQL, SQLite and MariaDB"
        )
    cursor = conn.connection.cursor()
    try:
        cursor.execute(query)
        rows = cursor.fetchall()
    finally:
        cursor.close()
    exists, why = verdict(vendor, rows, judged)
    if why is not None:
        raise ConfigurationError(
            f"{why}; install them with a migration that runs "
            "fence.adapters.django.operations.InstallFence on the model"
        )
    if exists:
        state.checked.add(judged.check_key)


def refused_early(state: ConnectionState, sql: str) -> Judged | None:
    """The fenced table ``sql`` writes, if the statement is one the client reads as a write
    to one (Django's compilers' shapes, and ``TRUNCATE``); ``None`` otherwise.

    Raises:
        TokenRequiredError: a write to a fenced model's table outside a block.
        UnfencedWriteError: a ``TRUNCATE`` of a fenced model's table (or the fence
            register) outside the opt-out.
    """
    top = state.stack[-1] if state.stack else None
    found = _WRITE.match(sql)
    if found is not None:
        judged = FENCED_TABLES.get(found.group(1).lower())
        if judged is not None and top is None:
            raise TokenRequiredError(
                f"unfenced write to {judged.table}: the model is fenced and no token is "
                "bound; write inside fence.adapters.django.fenced(lease), or opt out "
                "with fence.adapters.django.unfenced() (nothing was sent)",
                scope=judged.table,
            )
        return judged
    found = _TRUNCATE.match(sql)
    if found is None:
        return None
    name = found.group(1).lower()
    judged = REGISTER if name == REGISTER.table else FENCED_TABLES.get(name)
    if judged is not None and (top is None or top.token is not None):
        raise UnfencedWriteError(
            f"TRUNCATE of {judged.table}: it removes every row and its fence, which no "
            "token covers; run it inside fence.adapters.django.unfenced(), as "
            "'manage.py flush' does (nothing was sent)",
            scope=judged.table,
        )
    return judged


def execute_wrapper(
    execute: Callable[..., Any], sql: str, params: Any, many: bool, context: dict[str, Any]
) -> Any:
    """Django's execute wrapper of every statement of a connection (see the module).

    Raises:
        TokenRequiredError: a write to a fenced model's table outside a block; nothing
            was sent.
        StaleTokenError: the judge refused the block's token (a newer holder wrote);
            nothing was written.
        UnfencedWriteError: the judge refused a write without a token, or one that would
            lower or drop a fence.
        RetryableError: inside a block, a deadlock, a lock wait timeout, a serialization
            failure or a busy SQLite database; nothing was judged.
        ConfigurationError: the table's triggers are missing or outdated.
    """
    conn = context["connection"]
    state = state_of(conn)
    top = state.stack[-1] if state.stack else None
    if FENCED_TABLES and isinstance(sql, str):
        judged = refused_early(state, sql)
        if judged is not None and judged.check_key not in state.checked:
            _check(conn, state, judged)
    prefixed = 0
    try:
        if top is not None and not top.sent:
            claim = None
            if top.scope is not None and top.token is not None:
                if REGISTER.check_key not in state.checked:
                    _check(conn, state, REGISTER)
                claim = claim_sql(top.scope, top.token, conn.vendor)
            raw = context["cursor"].cursor
            if conn.vendor == "sqlite":
                _sync_sqlite(state)
                if claim is not None:
                    raw.execute(claim)
            elif conn.vendor == "mysql":
                # Set before it is sent: a SET that fails half way is set back too.
                state.session = True
                raw.execute(_mariadb_set_sql(*_settings(state, len(state.stack))))
                if claim is not None:
                    raw.execute(claim)
            elif conn.vendor == "postgresql":
                token, unfenced = _settings(state, len(state.stack))
                head = [_set_sql(token, unfenced)] + ([claim] if claim is not None else [])
                # One query text holds them all only where psycopg binds on the client.
                if not many and _binds_on_client(raw):
                    text = "; ".join(head)
                    if params is not None:
                        text = text.replace("%", "%%")  # psycopg reads the text as a format
                    sql = f"{text}; {sql}"
                    prefixed = len(head)
                else:
                    for statement in head:
                        raw.execute(statement)
            for binding in state.stack:
                binding.sent = True
        result = execute(sql, params, many, context)
    except Exception as exc:
        written = state.sqlite.get_token() if state.sqlite is not None else None
        cause = exc.__cause__ if isinstance(exc, DatabaseError) and exc.__cause__ else exc
        refused = judge_error(cause, written)
        if refused is not None:
            raise refused from exc
        if top is not None:
            fault = fault_of(cause)
            if fault is not None and fault.retryable:
                raise translate_error(cause, "fenced statement", conn.alias) from exc
        raise
    for _ in range(prefixed):
        context["cursor"].cursor.nextset()  # the caller reads the statement's own results
    return result


def install_wrapper(conn: Any) -> None:
    """Put :func:`execute_wrapper` on ``conn`` (once)."""
    if execute_wrapper not in conn.execute_wrappers:
        conn.execute_wrappers.insert(0, execute_wrapper)


def connection_created(sender: Any, connection: Any, **kwargs: Any) -> None:
    """``connection_created``: the wrapper, and on SQLite the judge's functions."""
    install_wrapper(connection)
    state = state_of(connection)
    state.checked.clear()
    state.session = False  # a new session has no variables
    for binding in state.stack:
        binding.sent = False
    if connection.vendor == "sqlite":
        sqlite = SQLiteState()
        state.sqlite = sqlite
        raw = connection.connection
        # Not deterministic: SQLite must call them for every row, never fold them.
        raw.create_function("iofence_token", 0, sqlite.get_token)
        raw.create_function("iofence_unfenced", 0, sqlite.get_unfenced)
        raw.create_function("iofence_set_token", 1, sqlite.set_token)
