"""The lease table of the SQL lock manager: its definition, its DDL and its statements.

No I/O happens here. The drivers in ``fence._async.sql`` / ``fence._sync.sql`` run the
statements built by :func:`lease_statements`; users who migrate with Alembic take the DDL from
:func:`lease_table_ddl` or add :func:`lease_table` to their metadata.

One row per resource, kept for ever::

    resource    TEXT PRIMARY KEY      the locked resource
    token       BIGINT NOT NULL       the last token issued for it (C2); never goes down
    owner       TEXT                  the holder's secret; NULL when free
    holder      TEXT                  the holder's label, for inspection
    expires_at  TIMESTAMPTZ NOT NULL  end of the lease by the database's clock (PostgreSQL)
                REAL NOT NULL         the same in Unix seconds (SQLite)

A release or a revoke keeps the row (owner NULL, ``expires_at`` now), so the next token is
computed from the last one and tokens keep increasing.

The module also holds :func:`local_board`, the process-wide :class:`fence._wake.WakeBoard`
of a SQLite lease table, which a release made in this process posts to.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Hashable
from dataclasses import dataclass
from string import Template
from typing import TYPE_CHECKING, Any

from fence._core import MAX_TOKEN, TokenMode
from fence._errors import ConfigurationError
from fence._wake import WakeBoard

if TYPE_CHECKING:
    from sqlalchemy import MetaData, Table
    from sqlalchemy.engine import Dialect

__all__ = [
    "DEFAULT_TABLE",
    "LeaseStatements",
    "WakeBoard",
    "lease_statements",
    "lease_table",
    "lease_table_ddl",
    "local_board",
    "notify_channel",
]

#: The table name used when none is given.
DEFAULT_TABLE = "fence_leases"

_DIALECTS = ("postgresql", "sqlite")


def _dialect(name: str) -> Dialect:
    if name == "postgresql":
        from sqlalchemy.dialects import postgresql

        return postgresql.dialect()  # type: ignore[no-untyped-call]
    if name == "sqlite":
        from sqlalchemy.dialects import sqlite

        return sqlite.dialect()
    raise ConfigurationError(
        f"the SQL lock manager supports {' and '.join(_DIALECTS)}, not {name!r}"
    )


def _qualified(dialect_name: str, table: str, schema: str | None) -> str:
    if not isinstance(table, str) or not table:
        raise ConfigurationError(f"table must be a non-empty str, got {table!r}")
    if schema is not None and (not isinstance(schema, str) or not schema):
        raise ConfigurationError(f"schema must be a non-empty str or None, got {schema!r}")
    quote = _dialect(dialect_name).identifier_preparer.quote
    name = quote(table)
    return name if schema is None else f"{quote(schema)}.{name}"


def notify_channel(table: str = DEFAULT_TABLE, schema: str | None = None) -> str:
    """The PostgreSQL notification channel that releases of this table are announced on.

    A release or a revoke runs ``pg_notify(channel, resource)`` in the same statement, so
    the notification is delivered when (and only if) the release commits.
    """
    channel = f"fence:{schema}.{table}" if schema else f"fence:{table}"
    if len(channel.encode()) > 63:  # NAMEDATALEN - 1: longer channel names are refused
        raise ConfigurationError(f"notification channel {channel!r} is longer than 63 bytes")
    return channel


def lease_table_ddl(
    dialect: str = "postgresql", *, table: str = DEFAULT_TABLE, schema: str | None = None
) -> str:
    """The ``CREATE TABLE`` statement of the lease table, as plain SQL.

    Put it in a migration when the schema is managed by Alembic or by hand; the lock
    manager's ``create_table()`` runs the same statement.

    Args:
        dialect: ``"postgresql"`` or ``"sqlite"``.
        table: the table name.
        schema: the schema (PostgreSQL) or attached database (SQLite); ``None`` for the
            default.

    Raises:
        ConfigurationError: an unsupported dialect or an empty name.

    Example::

        def upgrade() -> None:
            op.execute(lease_table_ddl("postgresql", table="fence_leases"))
    """
    name = _qualified(dialect, table, schema)
    expires = "TIMESTAMPTZ NOT NULL" if dialect == "postgresql" else "REAL NOT NULL"
    return (
        f"CREATE TABLE IF NOT EXISTS {name} (\n"
        "    resource   TEXT PRIMARY KEY,\n"
        f"    token      BIGINT NOT NULL CHECK (token BETWEEN 1 AND {MAX_TOKEN}),\n"
        "    owner      TEXT,\n"
        "    holder     TEXT,\n"
        f"    expires_at {expires}\n"
        ")"
    )


def lease_table(
    metadata: MetaData, *, name: str = DEFAULT_TABLE, schema: str | None = None
) -> Table:
    """Add the lease table to ``metadata`` (for ``metadata.create_all`` or Alembic autogenerate).

    ``expires_at`` is a ``TIMESTAMP WITH TIME ZONE`` on PostgreSQL and a ``REAL`` (Unix
    seconds) on SQLite, as in :func:`lease_table_ddl`.

    Args:
        metadata: the metadata to add the table to.
        name: the table name.
        schema: the schema, or ``None``.
    """
    from sqlalchemy import BigInteger, CheckConstraint, Column, DateTime, Float, Table, Text

    return Table(
        name,
        metadata,
        Column("resource", Text, primary_key=True),
        Column("token", BigInteger, nullable=False),
        Column("owner", Text, nullable=True),
        Column("holder", Text, nullable=True),
        Column(
            "expires_at",
            DateTime(timezone=True).with_variant(Float(), "sqlite"),
            nullable=False,
        ),
        CheckConstraint(f"token BETWEEN 1 AND {MAX_TOKEN}", name=f"{name}_token_range"),
        schema=schema,
    )


@dataclass(frozen=True, slots=True)
class LeaseStatements:
    """The SQL text of every driver call, for one dialect, table and token mode.

    Bound parameters are named ``:resource``, ``:secret``, ``:holder``, ``:ttl`` (seconds)
    and ``:channel``. Each statement is one round trip in autocommit mode.

    Attributes:
        dialect: ``"postgresql"`` or ``"sqlite"``.
        create: the ``CREATE TABLE IF NOT EXISTS``.
        acquire: returns one row ``(token, granted, remaining)``: ``token`` is the issued
            (or kept) token when granted; ``remaining`` the holder's seconds left otherwise.
        renew: returns a row iff the secret holds a live lease, which it extended.
        release: returns a row iff the secret held a live lease, which it ended.
        inspect: returns ``(token, remaining, holder)`` of a live lease, or no row.
        revoke: ends any lease and returns the new token.
        wake: wakes listeners for ``:resource`` without changing anything (PostgreSQL).
        raise_fence: SQLite with a fence register: raises the register's row ``:resource``
            to ``:token`` (run right after ``revoke``); otherwise ``None``.
        lock_row: PostgreSQL: takes the row lock of ``:resource`` (``FOR UPDATE``), so that
            a statement after it in the same transaction sees what a statement that held
            the lock did; ``None`` on SQLite, where ``BEGIN IMMEDIATE`` does that.
    """

    dialect: str
    create: str
    acquire: str
    renew: str
    release: str
    inspect: str
    revoke: str
    wake: str | None
    raise_fence: str | None = None
    lock_row: str | None = None


# Statement templates: ``$table`` is the quoted table name, ``$floor`` the token floor of the
# token mode. Identifiers are quoted by the dialect; values are always bound parameters.

# PostgreSQL. One clock reading per statement: clock_timestamp() moves while a statement runs,
# and the expiry test, the new expiry and the token floor must agree.
_PG_CLOCK = "WITH c AS MATERIALIZED (SELECT clock_timestamp() AS now)"
_PG_FLOOR = "CAST(floor(extract(epoch FROM c.now) * 1000000) AS BIGINT)"

# The upsert changes the row only when the lock is free, expired or already ours; a refused
# attempt writes nothing. The outer query reads the holder's remaining time from the
# statement's snapshot, so a refusal costs no second round trip.
_PG_ACQUIRE = """$clock,
up AS (
    INSERT INTO $table AS l (resource, token, owner, holder, expires_at)
    SELECT :resource, $first, :secret, :holder, c.now + make_interval(secs => :ttl) FROM c
    ON CONFLICT (resource) DO UPDATE SET
        token = CASE WHEN l.owner = EXCLUDED.owner AND l.expires_at > (SELECT now FROM c)
                     THEN l.token
                     ELSE GREATEST(l.token + 1, EXCLUDED.token) END,
        owner = EXCLUDED.owner,
        holder = EXCLUDED.holder,
        expires_at = EXCLUDED.expires_at
    WHERE l.owner IS NULL OR l.expires_at <= (SELECT now FROM c) OR l.owner = EXCLUDED.owner
    RETURNING l.token
)
SELECT (SELECT token FROM up) AS token,
       EXISTS (SELECT 1 FROM up) AS granted,
       (SELECT CAST(extract(epoch FROM h.expires_at - c.now) AS DOUBLE PRECISION)
          FROM $table AS h, c WHERE h.resource = :resource) AS remaining"""

_PG_RENEW = """$clock
UPDATE $table AS l SET expires_at = c.now + make_interval(secs => :ttl) FROM c
WHERE l.resource = :resource AND l.owner = :secret AND l.expires_at > c.now
RETURNING l.token"""

# pg_notify in the releasing statement: delivered when, and only if, the release commits.
_PG_RELEASE = """$clock,
r AS (
    UPDATE $table AS l SET owner = NULL, holder = NULL, expires_at = c.now FROM c
    WHERE l.resource = :resource AND l.owner = :secret AND l.expires_at > c.now
    RETURNING l.token, l.resource
)
SELECT r.token, $notify_r FROM r"""

_PG_INSPECT = """SELECT l.token,
       CAST(extract(epoch FROM l.expires_at - c.now) AS DOUBLE PRECISION), l.holder
FROM $table AS l, (SELECT clock_timestamp() AS now) AS c
WHERE l.resource = :resource AND l.owner IS NOT NULL AND l.expires_at > c.now"""

_PG_REVOKE = """$clock,
up AS (
    INSERT INTO $table AS l (resource, token, owner, holder, expires_at)
    SELECT :resource, $first, NULL, NULL, c.now FROM c
    ON CONFLICT (resource) DO UPDATE SET
        token = GREATEST(l.token + 1, EXCLUDED.token),
        owner = NULL,
        holder = NULL,
        expires_at = EXCLUDED.expires_at
    RETURNING l.token, l.resource
)$reg
SELECT up.token, $notify_up FROM up"""

# With a fence register (the guards' ``(scope, fence)`` table): a new token is also above
# the register's row for the resource, and a revoke raises that row to its token.
_PG_FIRST_FENCED = """GREATEST($floor, (SELECT COALESCE(max(g.fence), 0) + 1 FROM $register AS g
                            WHERE g.scope = :resource))"""
_PG_RAISE_FENCE = """,
reg AS (
    INSERT INTO $register AS g (scope, fence) SELECT up.resource, up.token FROM up
    ON CONFLICT (scope) DO UPDATE SET fence = GREATEST(g.fence, EXCLUDED.fence)
)"""

_PG_WAKE = "SELECT CAST(pg_notify(:channel, :resource) AS TEXT)"
_PG_LOCK_ROW = "SELECT 1 FROM $table WHERE resource = :resource FOR UPDATE"
_PG_NOTIFY = "CAST(pg_notify(:channel, $alias.resource) AS TEXT)"

# SQLite: the database's clock in Unix seconds. SQLite reads the clock once per statement
# step, so every use in one statement sees the same instant (millisecond resolution).
_SQLITE_NOW = "((julianday('now') - 2440587.5) * 86400.0)"
_SQLITE_FLOOR = f"CAST({_SQLITE_NOW} * 1000000 AS INTEGER)"

# SQLite has no data-modifying CTE, so the upsert always takes the conflict branch and keeps
# the holder's values when the lock is not free: one statement and one row back, granted or
# not. Every SET expression reads the row as it was before the update.
_SQLITE_ACQUIRE = """INSERT INTO $table (resource, token, owner, holder, expires_at)
VALUES (:resource, $first, :secret, :holder, $now + :ttl)
ON CONFLICT (resource) DO UPDATE SET
    token = CASE WHEN owner = excluded.owner AND expires_at > $now THEN token
                 WHEN $free THEN max(token + 1, excluded.token)
                 ELSE token END,
    owner = CASE WHEN $free THEN excluded.owner ELSE owner END,
    holder = CASE WHEN $free THEN excluded.holder ELSE holder END,
    expires_at = CASE WHEN $free THEN excluded.expires_at ELSE expires_at END
RETURNING token, owner IS NOT NULL AND owner = :secret, expires_at - $now"""
_SQLITE_FREE = "(owner IS NULL OR expires_at <= $now OR owner = excluded.owner)"

_SQLITE_RENEW = """UPDATE $table SET expires_at = $now + :ttl
WHERE resource = :resource AND owner = :secret AND expires_at > $now
RETURNING token"""

_SQLITE_RELEASE = """UPDATE $table SET owner = NULL, holder = NULL, expires_at = $now
WHERE resource = :resource AND owner = :secret AND expires_at > $now
RETURNING token"""

_SQLITE_INSPECT = """SELECT token, expires_at - $now, holder FROM $table
WHERE resource = :resource AND owner IS NOT NULL AND expires_at > $now"""

_SQLITE_REVOKE = """INSERT INTO $table (resource, token, owner, holder, expires_at)
VALUES (:resource, $first, NULL, NULL, $now)
ON CONFLICT (resource) DO UPDATE SET
    token = max(token + 1, excluded.token),
    owner = NULL,
    holder = NULL,
    expires_at = excluded.expires_at
RETURNING token"""


_SQLITE_FIRST_FENCED = """max($floor, (SELECT coalesce(max(fence), 0) + 1 FROM $register
                        WHERE scope = :resource))"""
_SQLITE_RAISE_FENCE = """INSERT INTO $register (scope, fence) VALUES (:resource, :token)
ON CONFLICT (scope) DO UPDATE SET fence = max(fence, excluded.fence)
RETURNING fence"""


def lease_statements(
    dialect: str,
    *,
    table: str = DEFAULT_TABLE,
    schema: str | None = None,
    token_mode: TokenMode = TokenMode.HYBRID,
    notify: bool = True,
    fence_table: str | None = None,
) -> LeaseStatements:
    """Build the statements of the SQL lock manager (C2, C3, C10, C11 in SQL).

    A new token is ``max(last + 1, clock)`` in hybrid mode (the clock in microseconds since
    the epoch, read by the database: ``clock_timestamp()`` on PostgreSQL, ``julianday('now')``
    on SQLite) and ``last + 1`` in counter mode: :func:`fence.issue_token` in SQL.

    Args:
        dialect: ``"postgresql"`` or ``"sqlite"``.
        table: the table name.
        schema: the schema, or ``None``.
        token_mode: :class:`fence.TokenMode`.
        notify: PostgreSQL: a release or revoke runs ``pg_notify(:channel, resource)`` in
            the same statement (without it the statements take no ``:channel``).
        fence_table: the guards' fence register ``(scope, fence)`` in the same schema: new
            tokens go above its row for the resource, and a revoke raises that row (in the
            same statement on PostgreSQL; in :attr:`LeaseStatements.raise_fence`, run
            right after, on SQLite).

    Raises:
        ConfigurationError: an unsupported dialect or a bad name.
    """
    mode = TokenMode(token_mode)
    name = _qualified(dialect, table, schema)
    create = lease_table_ddl(dialect, table=table, schema=schema)
    hybrid = mode is TokenMode.HYBRID
    register = None if fence_table is None else _qualified(dialect, fence_table, schema)
    if dialect == "postgresql":
        values = {"table": name, "clock": _PG_CLOCK, "floor": _PG_FLOOR if hybrid else "1"}
        for alias in ("r", "up"):
            values[f"notify_{alias}"] = (
                Template(_PG_NOTIFY).substitute(alias=alias) if notify else "NULL"
            )
        values["first"] = values["floor"]
        values["reg"] = ""
        if register is not None:
            values["register"] = register
            values["first"] = Template(_PG_FIRST_FENCED).substitute(values)
            values["reg"] = Template(_PG_RAISE_FENCE).substitute(values)
        acquire, renew, release, inspect, revoke = (
            Template(t).substitute(values)
            for t in (_PG_ACQUIRE, _PG_RENEW, _PG_RELEASE, _PG_INSPECT, _PG_REVOKE)
        )
        return LeaseStatements(
            "postgresql",
            create,
            acquire,
            renew,
            release,
            inspect,
            revoke,
            _PG_WAKE,
            None,
            Template(_PG_LOCK_ROW).substitute(values),
        )
    values = {"table": name, "now": _SQLITE_NOW, "floor": _SQLITE_FLOOR if hybrid else "1"}
    values["free"] = Template(_SQLITE_FREE).substitute(values)
    values["first"] = values["floor"]
    raise_fence = None
    if register is not None:
        values["register"] = register
        values["first"] = Template(_SQLITE_FIRST_FENCED).substitute(values)
        raise_fence = Template(_SQLITE_RAISE_FENCE).substitute(values)
    acquire, renew, release, inspect, revoke = (
        Template(t).substitute(values)
        for t in (_SQLITE_ACQUIRE, _SQLITE_RENEW, _SQLITE_RELEASE, _SQLITE_INSPECT, _SQLITE_REVOKE)
    )
    return LeaseStatements(
        "sqlite", create, acquire, renew, release, inspect, revoke, None, raise_fence
    )


# -- wake-ups -------------------------------------------------------------------------------

_boards_lock = threading.Lock()
_boards: dict[Hashable, WakeBoard] = {}
_anchored: weakref.WeakKeyDictionary[Any, dict[Hashable, WakeBoard]] = weakref.WeakKeyDictionary()


def local_board(key: Hashable, anchor: object = None) -> WakeBoard:
    """The process-wide board of one lease table, shared by every driver that uses it.

    Args:
        key: what names the table (database file, schema, table).
        anchor: an object the board lives and dies with (the single connection pool of an
            in-memory database); ``None`` for a board that lives as long as the process.
    """
    with _boards_lock:
        boards = _boards if anchor is None else _anchored.setdefault(anchor, {})
        board = boards.get(key)
        if board is None:
            board = boards[key] = WakeBoard()
        return board
