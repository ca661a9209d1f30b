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
    voids       JSONB                 PostgreSQL: the tombstones of acquires that gave up,
                                      ``{secret: end in Unix seconds}`` (see ``void``)

A release or a revoke keeps the row (owner NULL, ``expires_at`` now), so the next token is
computed from the last one and tokens keep increasing.

What differs between databases (column types, quoting, the clock) comes from their
:class:`fence._sql_dialect.SQLDialect`; each dialect has its own set of statements here
(:func:`postgresql_statements`, :func:`sqlite_statements`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from string import Template
from typing import TYPE_CHECKING, Any

from fence._core import MAX_TOKEN, TokenMode
from fence._errors import ConfigurationError
from fence._sql_dialect import (
    MySQLDialect,
    PostgreSQLDialect,
    SQLDialect,
    SQLiteDialect,
    dialect_for,
)

if TYPE_CHECKING:
    from sqlalchemy import MetaData, Table

__all__ = [
    "DEFAULT_TABLE",
    "MYSQL_STEPS",
    "SHARED_COLUMNS",
    "SQLITE_STEPS",
    "STATEMENT_SETS",
    "VOID_COLUMNS",
    "LeaseStatements",
    "lease_schema_ddl",
    "lease_statements",
    "lease_table",
    "lease_table_ddl",
    "lease_upgrade_ddl",
    "mysql_statements",
    "notify_channel",
    "postgresql_statements",
    "shared_table_ddl",
    "shared_table_name",
    "sqlite_statements",
]

#: The table name used when none is given.
DEFAULT_TABLE = "fence_leases"

#: The lease table's columns of shared locks (C13): a table made before them lacks them,
#: and :func:`lease_upgrade_ddl` adds them.
SHARED_COLUMNS = ("readers", "read_until", "wtoken")


#: The lease table's column of tombstones, with its SQL type, by dialect name: where a
#: statement runs on after its client gave up (a server's connection), the clean-up of an
#: acquire leaves a tombstone in the resource's row that refuses the acquire's statement
#: should it run later (:func:`postgresql_statements`, ``void``). A table made before them
#: lacks the column, and :func:`lease_upgrade_ddl` adds it. SQLite runs a statement to its
#: end in the client's process before the clean-up starts, and has none.
VOID_COLUMNS: dict[str, tuple[str, str]] = {"postgresql": ("voids", "JSONB")}


def _shared_columns(dialect: SQLDialect) -> list[tuple[str, str]]:
    """The columns of :data:`SHARED_COLUMNS` with their SQL types, for ``dialect``."""
    types = ("INTEGER NOT NULL DEFAULT 0", dialect.timestamp_type, "BIGINT NOT NULL DEFAULT 0")
    return list(zip(SHARED_COLUMNS, types, strict=True))


def _added_columns(dialect: SQLDialect) -> list[tuple[str, str]]:
    """The lease table's columns added after its first version, with their SQL types:
    those of shared locks, then the tombstones' (:data:`VOID_COLUMNS`) where there are."""
    void = VOID_COLUMNS.get(dialect.name)
    return _shared_columns(dialect) + ([void] if void is not None else [])


def _qualified(dialect: SQLDialect, table: str, schema: str | None) -> str:
    if not isinstance(table, str) or not table:
        raise ConfigurationError(f"table must be a non-empty str, got {table!r}")
    if schema is not None and (not isinstance(schema, str) or not schema):
        raise ConfigurationError(f"schema must be a non-empty str or None, got {schema!r}")
    quote = dialect.quote
    name = quote(table)
    return name if schema is None else f"{quote(schema)}.{name}"


def notify_channel(
    table: str = DEFAULT_TABLE, schema: str | None = None, *, writers: bool = False
) -> str:
    """The PostgreSQL notification channel that releases of this table are announced on.

    A release or a revoke runs ``pg_notify(channel, resource)`` in the same statement, so
    the notification is delivered when (and only if) the release commits. With
    ``writers``: the channel on which the last reader of a shared lock announces that it
    left (C13); only waiting writers need that one (``<channel>:w``).
    """
    channel = f"fence:{schema}.{table}" if schema else f"fence:{table}"
    if writers:
        channel += ":w"
    if len(channel.encode()) > 63:  # NAMEDATALEN - 1: longer channel names are refused
        raise ConfigurationError(f"notification channel {channel!r} is longer than 63 bytes")
    return channel


def shared_table_name(table: str = DEFAULT_TABLE) -> str:
    """The name of the shared-lock table that goes with lease table ``table``
    (``<table>_shared``)."""
    return f"{table}_shared"


def lease_table_ddl(
    dialect: str = "postgresql", *, table: str = DEFAULT_TABLE, schema: str | None = None
) -> str:
    """The ``CREATE TABLE`` statement of the lease table, as plain SQL.

    The lock manager needs a second table as well, ``<table>_shared`` (readers and
    waiters of shared locks, C13): :func:`lease_schema_ddl` gives both statements, and
    :func:`lease_upgrade_ddl` the migration of a lease table made by an earlier version.
    Put them in a migration when the schema is managed by Alembic or by hand; the lock
    manager's ``create_table()`` runs the same statements.

    Args:
        dialect: ``"postgresql"``, ``"sqlite"``, ``"mariadb"`` or ``"mysql"``.
        table: the table name.
        schema: the schema (PostgreSQL), attached database (SQLite) or database
            (MariaDB); ``None`` for the default.

    Raises:
        ConfigurationError: an unsupported dialect or an empty name.

    Example::

        def upgrade() -> None:
            for statement in lease_schema_ddl("postgresql", table="fence_leases"):
                op.execute(statement)
    """
    found = dialect_for(dialect)
    name = _qualified(found, table, schema)
    expires = f"{found.timestamp_type} NOT NULL"
    shared = ",\n".join(f"    {column:<10} {kind}" for column, kind in _added_columns(found))
    return (
        f"CREATE TABLE IF NOT EXISTS {name} (\n"
        f"    resource   {found.key_type} PRIMARY KEY,\n"
        f"    token      BIGINT NOT NULL CHECK (token BETWEEN 1 AND {MAX_TOKEN}),\n"
        "    owner      TEXT,\n"
        "    holder     TEXT,\n"
        f"    expires_at {expires},\n"
        f"{shared}\n"
        f"){found.table_options}"
    )


def shared_table_ddl(
    dialect: str = "postgresql", *, table: str = DEFAULT_TABLE, schema: str | None = None
) -> str:
    """The ``CREATE TABLE`` statement of ``<table>_shared``: one row per reader of a shared
    lock and per queued waiter (C13).

    Args:
        dialect: ``"postgresql"``, ``"sqlite"``, ``"mariadb"`` or ``"mysql"``.
        table: the lease table's name (the shared table is named after it).
        schema: the schema, or ``None``.

    Raises:
        ConfigurationError: an unsupported dialect or an empty name.
    """
    found = dialect_for(dialect)
    name = _qualified(found, shared_table_name(table), schema)
    expires = f"{found.timestamp_type} NOT NULL"
    return (
        f"CREATE TABLE IF NOT EXISTS {name} (\n"
        f"    resource   {found.key_type} NOT NULL,\n"
        f"    member     {found.key_type} NOT NULL,\n"
        "    kind       CHAR(1) NOT NULL CHECK (kind IN ('r', 'R', 'W')),\n"
        "    token      BIGINT,\n"
        "    holder     TEXT,\n"
        f"    expires_at {expires},\n"
        "    seq        BIGINT NOT NULL DEFAULT 0,\n"
        "    PRIMARY KEY (resource, member)\n"
        f"){found.table_options}"
    )


def lease_schema_ddl(
    dialect: str = "postgresql", *, table: str = DEFAULT_TABLE, schema: str | None = None
) -> list[str]:
    """Every ``CREATE TABLE`` the SQL lock manager needs: the lease table and its shared
    table, in that order (:func:`lease_table_ddl`, :func:`shared_table_ddl`).

    Raises:
        ConfigurationError: an unsupported dialect or an empty name.
    """
    return [
        lease_table_ddl(dialect, table=table, schema=schema),
        shared_table_ddl(dialect, table=table, schema=schema),
    ]


def lease_upgrade_ddl(
    dialect: str = "postgresql", *, table: str = DEFAULT_TABLE, schema: str | None = None
) -> list[str]:
    """The migration of a lease table made by an earlier version: the columns of shared
    locks (C13, three) and, on PostgreSQL, the column of tombstones (``voids``, see
    :data:`VOID_COLUMNS`) on the lease table, and the new shared table. Run once, before
    the new version's managers start; managers of an earlier version keep working on the
    migrated table (they ignore the new columns), but they know nothing of readers: do not
    mix them with shared locks.

    PostgreSQL adds the columns with ``ADD COLUMN IF NOT EXISTS`` (a metadata change, no
    table rewrite), so its statements also migrate a table that has some of them already;
    SQLite has no ``IF NOT EXISTS`` there, so its statements are for a table made before
    shared locks.

    Raises:
        ConfigurationError: an unsupported dialect or an empty name.
    """
    found = dialect_for(dialect)
    name = _qualified(found, table, schema)
    shared = shared_table_ddl(dialect, table=table, schema=schema)
    columns = _added_columns(found)
    if found.add_column_if_missing:
        adds = ",\n".join(f"    ADD COLUMN IF NOT EXISTS {c} {kind}" for c, kind in columns)
        return [f"ALTER TABLE {name}\n{adds}", shared]
    return [*(f"ALTER TABLE {name} ADD COLUMN {c} {kind}" for c, kind in columns), shared]


def lease_table(
    metadata: MetaData, *, name: str = DEFAULT_TABLE, schema: str | None = None
) -> Table:
    """Add the lease table, and its shared table, to ``metadata`` (for
    ``metadata.create_all`` or Alembic autogenerate); return the lease table.

    ``expires_at`` and ``read_until`` are ``TIMESTAMP WITH TIME ZONE`` on PostgreSQL and
    ``REAL`` (Unix seconds) on SQLite, as in :func:`lease_schema_ddl`; ``voids`` is
    ``JSONB`` on PostgreSQL (on SQLite the column is there, as ``JSON``, and unused).

    Args:
        metadata: the metadata to add the tables to.
        name: the lease table's name (the shared table is ``<name>_shared``).
        schema: the schema, or ``None``.
    """
    from sqlalchemy import (
        JSON,
        BigInteger,
        CheckConstraint,
        Column,
        DateTime,
        Double,
        Float,
        Integer,
        PrimaryKeyConstraint,
        String,
        Table,
        Text,
        text,
    )
    from sqlalchemy.dialects.postgresql import JSONB

    when = (
        DateTime(timezone=True)
        .with_variant(Float(), "sqlite")
        .with_variant(Double(), "mysql", "mariadb")
    )
    # MariaDB: a key cannot be TEXT, and compares as bytes (see MySQLDialect.key_type).
    key = Text().with_variant(String(255, collation="utf8mb4_bin"), "mysql", "mariadb")
    Table(
        shared_table_name(name),
        metadata,
        Column("resource", key, nullable=False),
        Column("member", key, nullable=False),
        Column("kind", String(1), nullable=False),
        Column("token", BigInteger, nullable=True),
        Column("holder", Text, nullable=True),
        Column("expires_at", when, nullable=False),
        Column("seq", BigInteger, nullable=False, server_default=text("0")),
        PrimaryKeyConstraint("resource", "member"),
        CheckConstraint("kind IN ('r', 'R', 'W')", name=f"{name}_shared_kind"),
        schema=schema,
        **_MYSQL_TABLE,
    )
    return Table(
        name,
        metadata,
        Column("resource", key, primary_key=True),
        Column("token", BigInteger, nullable=False),
        Column("owner", Text, nullable=True),
        Column("holder", Text, nullable=True),
        Column("expires_at", when, nullable=False),
        Column("readers", Integer, nullable=False, server_default=text("0")),
        Column("read_until", when, nullable=True),
        Column("wtoken", BigInteger, nullable=False, server_default=text("0")),
        Column("voids", JSON().with_variant(JSONB(), "postgresql"), nullable=True),
        CheckConstraint(f"token BETWEEN 1 AND {MAX_TOKEN}", name=f"{name}_token_range"),
        schema=schema,
        **_MYSQL_TABLE,
    )


# MariaDB's table options in lease_table(), as MySQLDialect.table_options: the kinds 'r'
# (a reader) and 'R' (a queued reader) must differ, and keys compare as bytes. Other
# dialects ignore them.
_MYSQL_TABLE: dict[str, Any] = {
    f"{prefix}_{option}": value
    for prefix in ("mysql", "mariadb")
    for option, value in (("engine", "InnoDB"), ("charset", "utf8mb4"), ("collate", "utf8mb4_bin"))
}


@dataclass(frozen=True, slots=True)
class LeaseStatements:
    """The SQL text of every driver call, for one dialect, table and token mode.

    Bound parameters are named ``:resource``, ``:secret``, ``:holder``, ``:ttl`` (seconds),
    ``:queue_ttl`` (seconds) and ``:channel``. Each statement is one round trip in
    autocommit mode. Statements that are ``None`` for a dialect are done otherwise there
    (SQLite: in one ``BEGIN IMMEDIATE`` transaction of the driver, in process; see
    :attr:`fence._sql_dialect.SQLDialect.decides_in_process`).

    Attributes:
        dialect: the dialect's name, ``"postgresql"``, ``"sqlite"``, ``"mariadb"`` or
            ``"mysql"``.
        create: the ``CREATE TABLE IF NOT EXISTS`` statements (:func:`lease_schema_ddl`).
        acquire: a writer's attempt (MariaDB: the ``claim`` of the lease row that
            begins the driver's transactions, which decide every attempt); returns one
            row ``(token, granted, remaining, flag)``: ``token`` is the issued (or kept)
            token when granted; ``remaining`` the seconds until the lock may change
            otherwise (the holder's, the readers'), if known; ``flag`` on PostgreSQL
            whether the caller has a place in the queue, on SQLite whether the resource
            has readers or queued waiters (then the driver decides in a transaction:
            this statement grants only the exclusive way).
        acquire_read: a reader's attempt, as ``acquire`` (PostgreSQL).
        renew: returns a row iff the secret holds a live write lease, which it extended.
        renew_read: the same for a read lease.
        release: returns a row iff the secret held a live write lease, which it ended.
        release_read: the same for a read lease.
        abandon: takes a waiter out of the queue; returns a row iff it was queued.
        inspect: returns ``(kind, token, remaining, holder)`` rows of the live leases:
            ``"w"`` for the writer, ``"r"`` for each reader, or no row.
        revoke: ends every lease and returns the new token (MariaDB: ends the writer's
            lease, in the driver's transaction, which reads the token back).
        wake: wakes listeners for ``:resource`` without changing anything (PostgreSQL).
        raise_fence: SQLite with a fence register: raises the register's row ``:resource``
            to ``:token`` (run right after ``revoke``); otherwise ``None``.
        void: PostgreSQL: the first statement of the clean-up of an acquire that gave up
            (the driver's ``cancel``). It leaves the tombstone of ``:secret`` in the row of
            ``:resource`` for ``:ttl`` seconds (creating the row if there is none, with a
            token of its own), which refuses every later attempt of that secret, and takes
            the row's lock, so that the statements after it in the same transaction see
            what an attempt that held the lock did; ``None`` on SQLite, where
            ``BEGIN IMMEDIATE`` takes the lock and no statement outlives its client.
        steps: a dialect that decides in process: the statements of the driver's
            transactions (SQLite: :data:`SQLITE_STEPS`); empty on PostgreSQL.
        list_page: one keyset page of the locks held now: the first ``:count`` resources
            above ``:after`` (``''`` for the first page) whose first ``:length``
            characters are ``:prefix``, by resource; rows ``(resource, kind, token,
            remaining, holder, waiters)`` as ``inspect``'s, with the resource's queued
            waiters on each.
    """

    dialect: str
    create: tuple[str, ...]
    acquire: str
    acquire_read: str | None
    renew: str
    renew_read: str
    release: str
    release_read: str
    abandon: str
    inspect: str
    revoke: str
    wake: str | None
    raise_fence: str | None = None
    void: str | None = None
    steps: dict[str, str] = field(default_factory=dict)
    list_page: str = ""


# Statement templates: ``$table`` is the quoted table name, ``$shared`` its shared table's,
# ``$floor`` the token floor of the token mode. Identifiers are quoted by the dialect;
# values are always bound parameters.

# PostgreSQL. One clock reading per statement: clock_timestamp() moves while a statement runs,
# and the expiry test, the new expiry and the token floor must agree.
_PG_CLOCK = "WITH c AS MATERIALIZED (SELECT $clock_sql AS now)"

# Shared locks on PostgreSQL (C13). Exclusion rests on the resource's row of the lease
# table, which every acquire locks (the upsert), and which a statement waiting for that lock
# reads again at its latest version once it gets it; a subquery, in contrast, sees the
# statement's snapshot. So the row itself says whether readers hold the lock: ``readers``
# counts the read leases granted since the last writer (+1 per grant, -1 per release) and
# ``read_until`` is past the end of every one of them (a grant and a renewal push it out);
# a writer is granted only if ``readers = 0`` or ``read_until`` has passed. ``wtoken`` is the
# token of the last writer (or revoke): a read lease with a lower token belongs to a lease
# that a writer came after, and neither its renewal nor its release counts any more. The
# queue (who waits, in what order) is read from the snapshot: it decides fairness, never
# exclusion. Locks are taken in one order, a reader's own row of the shared table before
# the resource's row, or the resource's row before the waiter's own queue row, so that no
# two statements wait for each other.

# Tombstones (PostgreSQL). An acquire that gave up without its statement's answer (the
# caller's deadline cut the connection, the task was cancelled, the connection broke) does
# not know whether that statement will still run: the server may not even have read it yet
# (a loaded or frozen server, a slow network), and once it has, it runs to its end whether
# the client is there or not. Releasing after it is not enough, because nothing orders the
# two: the statement can reach the row after the release. Row locks do not order them
# either: the release queues behind a statement that waits for the row in the tuple-lock
# queue, but an INSERT ... ON CONFLICT whose row is being written by another transaction
# waits for that transaction itself, outside the queue, and whoever wakes first goes
# first. So the clean-up (``void``, then the releases, in one transaction) leaves a
# tombstone of the attempt's secret in the resource's row, and every acquire reads it in
# the row it locks, which is the row's latest version whenever the statement started:
#
#   t=0  A's acquire is sent; the server has not read it yet
#   t=1  A gives up: void (tombstone of A's secret, row lock), release: nothing; commit
#   t=2  the server runs A's acquire: it locks the row, finds the tombstone, and changes
#        nothing but a row version (no grant, no place in the queue)
#
# Had A's statement locked the row first, the clean-up would have waited for it and then
# released what it took. The tombstone is keyed by the secret, which no later attempt
# uses again (each acquire() call has its own), and stays at least its ttl (the lease's):
# the next clean-up of the resource drops those whose time is up. A statement of a
# tombstoned secret updates the row to itself (``$void``), so that its ``RETURNING``
# tells the statement's other parts not to queue it: those read the snapshot, which may
# predate the tombstone.

# A writer: granted when nobody holds the lock and nobody live is queued ahead of it; a
# refused writer joins the queue (or keeps its place) while readers hold or queue. The
# holder's remaining time comes from the statement's snapshot, so a refusal costs no second
# round trip.
_PG_ACQUIRE = """$clock,
me AS MATERIALIZED (
    SELECT q.seq FROM $shared AS q
    WHERE q.resource = :resource AND q.member = :secret AND q.kind = 'W'
),
up AS (
    INSERT INTO $table AS l (resource, token, owner, holder, expires_at, wtoken)
    SELECT :resource, f.t, :secret, :holder, c.now + make_interval(secs => :ttl), f.t
    FROM c, (SELECT $first AS t FROM c) AS f
    ON CONFLICT (resource) DO UPDATE SET
        token = CASE WHEN $void OR $mine THEN l.token
                     ELSE GREATEST(l.token + 1, EXCLUDED.token) END,
        owner = CASE WHEN $void THEN l.owner ELSE EXCLUDED.owner END,
        holder = CASE WHEN $void THEN l.holder ELSE EXCLUDED.holder END,
        expires_at = CASE WHEN $void THEN l.expires_at ELSE EXCLUDED.expires_at END,
        readers = CASE WHEN $void OR $mine THEN l.readers ELSE 0 END,
        read_until = CASE WHEN $void OR $mine THEN l.read_until END,
        wtoken = CASE WHEN $void OR $mine THEN l.wtoken
                      ELSE GREATEST(l.token + 1, EXCLUDED.token) END
    WHERE $void OR $mine OR (
        (l.owner IS NULL OR l.expires_at <= (SELECT now FROM c))
        AND (l.readers = 0 OR l.read_until <= (SELECT now FROM c))
        AND NOT $ahead_any)
    RETURNING l.token, $void AS voided
),
granted AS (SELECT up.token FROM up WHERE NOT up.voided),
gone AS (
    DELETE FROM $shared AS q USING c
    WHERE q.resource = :resource AND EXISTS (SELECT 1 FROM granted)
      AND (q.member = :secret OR q.expires_at < c.now - interval '60 seconds')
),
wait AS (
    INSERT INTO $shared AS q (resource, member, kind, expires_at, seq)
    SELECT :resource, :secret, 'W', c.now + make_interval(secs => :queue_ttl), $us FROM c
    WHERE NOT EXISTS (SELECT 1 FROM up) AND (
        EXISTS (SELECT 1 FROM me)
        OR EXISTS (SELECT 1 FROM $table AS h WHERE h.resource = :resource
                   AND h.readers > 0 AND h.read_until > c.now)
        OR EXISTS (SELECT 1 FROM $shared AS r WHERE r.resource = :resource
                   AND r.kind = 'R' AND r.expires_at > c.now))
    ON CONFLICT (resource, member) DO UPDATE SET expires_at = EXCLUDED.expires_at
    RETURNING 1
)
SELECT (SELECT token FROM granted) AS token,
       EXISTS (SELECT 1 FROM granted) AS granted,
       (SELECT CAST(extract(epoch FROM CASE
                    WHEN h.owner IS NOT NULL AND h.expires_at > c.now THEN h.expires_at
                    WHEN h.readers > 0 AND h.read_until > c.now THEN h.read_until
                    END - c.now) AS DOUBLE PRECISION)
          FROM $table AS h, c WHERE h.resource = :resource) AS remaining,
       EXISTS (SELECT 1 FROM wait) AS queued"""

_PG_MINE = "(l.owner = EXCLUDED.owner AND l.expires_at > (SELECT now FROM c))"

# The secret has a tombstone in the row (its acquire gave up): the attempt changes nothing.
_PG_VOID_OF = "(l.voids -> CAST(:secret AS TEXT) IS NOT NULL)"

# Somebody live queued ahead of the caller (anywhere, if it has no place): any waiter for a
# writer, a writer for a reader.
_PG_AHEAD = """EXISTS (SELECT 1 FROM $shared AS q, c
            WHERE q.resource = :resource AND q.kind IN ($kinds) AND q.member <> :secret
              AND q.expires_at > c.now
              AND (NOT EXISTS (SELECT 1 FROM me)
                   OR (q.seq, q.member) < ((SELECT seq FROM me), :secret)))"""

# A reader: granted when no writer holds the lock and no live writer is queued ahead of it;
# its row in the shared table carries its token and lease. The same secret again (an
# attempt whose reply was lost) keeps its token. A refused reader joins the queue. A
# tombstoned secret changes nothing, as a writer's.
_PG_ACQUIRE_READ = """$clock,
mine AS (
    UPDATE $shared AS q SET expires_at = c.now + make_interval(secs => :ttl) FROM c
    WHERE q.resource = :resource AND q.member = :secret AND q.kind = 'r'
      AND q.expires_at > c.now
      AND q.token > (SELECT h.wtoken FROM $table AS h WHERE h.resource = :resource)
    RETURNING q.token
),
me AS MATERIALIZED (
    SELECT q.seq FROM $shared AS q
    WHERE q.resource = :resource AND q.member = :secret AND q.kind = 'R'
),
up AS (
    INSERT INTO $table AS l (resource, token, owner, holder, expires_at, readers, read_until)
    SELECT :resource, $first, NULL, NULL, c.now, 1, c.now + make_interval(secs => :ttl) FROM c
    ON CONFLICT (resource) DO UPDATE SET
        token = CASE WHEN $void OR EXISTS (SELECT 1 FROM mine) THEN l.token
                     ELSE GREATEST(l.token + 1, EXCLUDED.token) END,
        readers = CASE WHEN $void OR EXISTS (SELECT 1 FROM mine) THEN l.readers
                       WHEN l.readers > 0 AND l.read_until > (SELECT now FROM c)
                       THEN l.readers + 1
                       ELSE 1 END,
        read_until = CASE WHEN $void THEN l.read_until
                          WHEN l.readers > 0 AND l.read_until > (SELECT now FROM c)
                          THEN GREATEST(l.read_until, EXCLUDED.read_until)
                          ELSE EXCLUDED.read_until END
    WHERE $void OR EXISTS (SELECT 1 FROM mine) OR (
        (l.owner IS NULL OR l.expires_at <= (SELECT now FROM c)) AND NOT $ahead_writer)
    RETURNING l.token, $void AS voided
),
granted AS (SELECT up.token FROM up WHERE NOT up.voided),
ins AS (
    INSERT INTO $shared AS q (resource, member, kind, token, holder, expires_at, seq)
    SELECT :resource, :secret, 'r', g.token, :holder, c.now + make_interval(secs => :ttl), 0
    FROM granted AS g, c WHERE NOT EXISTS (SELECT 1 FROM mine)
    ON CONFLICT (resource, member) DO UPDATE SET
        kind = 'r', token = EXCLUDED.token, holder = EXCLUDED.holder,
        expires_at = EXCLUDED.expires_at, seq = 0
),
gone AS (
    DELETE FROM $shared AS q USING c
    WHERE q.resource = :resource AND q.member <> :secret AND EXISTS (SELECT 1 FROM granted)
      AND q.expires_at < c.now - interval '60 seconds'
),
wait AS (
    INSERT INTO $shared AS q (resource, member, kind, expires_at, seq)
    SELECT :resource, :secret, 'R', c.now + make_interval(secs => :queue_ttl), $us FROM c
    WHERE NOT EXISTS (SELECT 1 FROM up)
    ON CONFLICT (resource, member) DO UPDATE SET expires_at = EXCLUDED.expires_at
    RETURNING 1
)
SELECT COALESCE((SELECT token FROM mine), (SELECT token FROM granted)) AS token,
       EXISTS (SELECT 1 FROM granted) AS granted,
       (SELECT CAST(extract(epoch FROM h.expires_at - c.now) AS DOUBLE PRECISION)
          FROM $table AS h, c WHERE h.resource = :resource AND h.owner IS NOT NULL
          AND h.expires_at > c.now) AS remaining,
       EXISTS (SELECT 1 FROM wait) AS queued"""

_PG_RENEW = """$clock
UPDATE $table AS l SET expires_at = c.now + make_interval(secs => :ttl) FROM c
WHERE l.resource = :resource AND l.owner = :secret AND l.expires_at > c.now
RETURNING l.token"""

# A reader's own row first, then the resource's row (the lock order): the renewal counts
# only if no writer came after the lease (wtoken), and pushes read_until out.
_PG_RENEW_READ = """$clock,
r AS (
    UPDATE $shared AS q SET expires_at = c.now + make_interval(secs => :ttl) FROM c
    WHERE q.resource = :resource AND q.member = :secret AND q.kind = 'r'
      AND q.expires_at > c.now
    RETURNING q.token
)
UPDATE $table AS l SET read_until = GREATEST(l.read_until, c.now + make_interval(secs => :ttl))
FROM c
WHERE l.resource = :resource AND l.wtoken < (SELECT token FROM r)
RETURNING l.token"""

# pg_notify in the releasing statement: delivered when, and only if, the release commits.
_PG_RELEASE = """$clock,
r AS (
    UPDATE $table AS l SET owner = NULL, holder = NULL, expires_at = c.now FROM c
    WHERE l.resource = :resource AND l.owner = :secret AND l.expires_at > c.now
    RETURNING l.token, l.resource
)
SELECT r.token, $notify_r FROM r"""

# The last reader to leave wakes the waiting writers (on the writers' channel).
_PG_RELEASE_READ = """$clock,
d AS (
    DELETE FROM $shared AS q USING c
    WHERE q.resource = :resource AND q.member = :secret AND q.kind = 'r'
      AND q.expires_at > c.now
    RETURNING q.token
),
u AS (
    UPDATE $table AS l SET readers = GREATEST(l.readers - 1, 0),
        read_until = CASE WHEN l.readers > 1 THEN l.read_until END
    WHERE l.resource = :resource AND l.wtoken < (SELECT token FROM d)
    RETURNING l.token, l.resource, l.readers
)
SELECT u.token, CASE WHEN u.readers = 0 THEN $notify_writers END FROM u"""

_PG_ABANDON = """DELETE FROM $shared AS q
WHERE q.resource = :resource AND q.member = :secret AND q.kind IN ('R', 'W')
RETURNING q.kind, $notify_q"""

_PG_INSPECT = """$clock
SELECT 'w', l.token, CAST(extract(epoch FROM l.expires_at - c.now) AS DOUBLE PRECISION),
       l.holder
FROM $table AS l, c
WHERE l.resource = :resource AND l.owner IS NOT NULL AND l.expires_at > c.now
UNION ALL
SELECT 'r', q.token, CAST(extract(epoch FROM q.expires_at - c.now) AS DOUBLE PRECISION),
       q.holder
FROM $shared AS q, $table AS l, c
WHERE q.resource = :resource AND q.kind = 'r' AND q.expires_at > c.now
  AND l.resource = q.resource AND q.token > l.wtoken"""

# Every reader's row goes first (the lock order), then the resource's row takes a token
# above every one issued.
_PG_REVOKE = """$clock,
d AS (
    DELETE FROM $shared AS q WHERE q.resource = :resource AND q.kind = 'r'
    RETURNING q.token
),
up AS (
    INSERT INTO $table AS l (resource, token, owner, holder, expires_at, wtoken)
    SELECT :resource, f.t, NULL, NULL, c.now, f.t FROM c, (SELECT $first AS t FROM c) AS f
    ON CONFLICT (resource) DO UPDATE SET
        token = GREATEST(l.token + 1, EXCLUDED.token, (SELECT max(token) + 1 FROM d)),
        owner = NULL,
        holder = NULL,
        expires_at = EXCLUDED.expires_at,
        readers = 0,
        read_until = NULL,
        wtoken = GREATEST(l.token + 1, EXCLUDED.token, (SELECT max(token) + 1 FROM d))
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

# The clean-up's first statement (see "Tombstones" above): the tombstone of :secret for
# :ttl seconds, beside those of other secrets whose time is not up, in the resource's row,
# which it creates if there is none (with a token of its own, as a revoke does) so that an
# attempt still on its way conflicts with it and reads it.
_PG_VOID = """$clock
INSERT INTO $table AS l (resource, token, owner, holder, expires_at, wtoken, voids)
SELECT :resource, f.t, NULL, NULL, c.now, f.t,
       jsonb_build_object(CAST(:secret AS TEXT), extract(epoch FROM c.now) + :ttl)
FROM c, (SELECT $first AS t FROM c) AS f
ON CONFLICT (resource) DO UPDATE SET voids = COALESCE(
    (SELECT jsonb_object_agg(v.key, v.value) FROM jsonb_each(l.voids) AS v
     WHERE CAST(v.value AS DOUBLE PRECISION) > (SELECT extract(epoch FROM now) FROM c)),
    CAST('{}' AS JSONB)) || EXCLUDED.voids
RETURNING l.token"""

# An operator's list (``fence list``): one keyset page over the primary key, never a scan
# in one statement. The prefix is compared with substr(), not LIKE, so that its ``%`` and
# ``_`` are plain characters and no escape is needed.
_PG_LIST = """$clock,
h AS (
    SELECT l.resource FROM $table AS l, c
    WHERE l.owner IS NOT NULL AND l.expires_at > c.now
      AND l.resource > :after AND substr(l.resource, 1, :length) = :prefix
    UNION
    SELECT q.resource FROM $shared AS q JOIN $table AS l ON l.resource = q.resource, c
    WHERE q.kind = 'r' AND q.expires_at > c.now AND q.token > l.wtoken
      AND q.resource > :after AND substr(q.resource, 1, :length) = :prefix
),
p AS (SELECT h.resource FROM h ORDER BY h.resource LIMIT :count),
w AS (
    SELECT q.resource, count(*) AS n FROM $shared AS q, c
    WHERE q.resource IN (SELECT p.resource FROM p) AND q.kind IN ('R', 'W')
      AND q.expires_at > c.now
    GROUP BY q.resource
)
SELECT l.resource, 'w', l.token,
       CAST(extract(epoch FROM l.expires_at - c.now) AS DOUBLE PRECISION), l.holder,
       COALESCE((SELECT w.n FROM w WHERE w.resource = l.resource), 0)
FROM p JOIN $table AS l ON l.resource = p.resource, c
WHERE l.owner IS NOT NULL AND l.expires_at > c.now
UNION ALL
SELECT q.resource, 'r', q.token,
       CAST(extract(epoch FROM q.expires_at - c.now) AS DOUBLE PRECISION), q.holder,
       COALESCE((SELECT w.n FROM w WHERE w.resource = q.resource), 0)
FROM p JOIN $shared AS q ON q.resource = p.resource JOIN $table AS l ON l.resource = q.resource, c
WHERE q.kind = 'r' AND q.expires_at > c.now AND q.token > l.wtoken
ORDER BY 1"""

_PG_WAKE = "SELECT CAST(pg_notify(:channel, :resource) AS TEXT)"
_PG_NOTIFY = "CAST(pg_notify(:channel, $alias.resource) AS TEXT)"
_PG_NOTIFY_WRITERS = "CAST(pg_notify(:channel_w, $alias.resource) AS TEXT)"

# SQLite: ``$now`` is the database's clock in Unix seconds (SQLiteDialect.clock_sql), and
# the hybrid token floor also takes the driver's reading (SQLiteDialect.token_floor).

# SQLite has no data-modifying CTE, so the upsert always takes the conflict branch and keeps
# the holder's values when the lock is not free: one statement and one row back, granted or
# not. Every SET expression reads the row as it was before the update. It grants only the
# exclusive way: with a reader or a waiter in the shared table (its last column says so),
# the driver decides in a transaction instead (SQLITE_STEPS). SQLite runs one writer at a
# time, so what a statement reads is what is there: the shared table itself says who reads.
_SQLITE_ACQUIRE = """INSERT INTO $table (resource, token, owner, holder, expires_at)
VALUES (:resource, $first, :secret, :holder, $now + :ttl)
ON CONFLICT (resource) DO UPDATE SET
    token = CASE WHEN owner = excluded.owner AND expires_at > $now THEN token
                 WHEN $free THEN max(token + 1, excluded.token)
                 ELSE token END,
    owner = CASE WHEN $free THEN excluded.owner ELSE owner END,
    holder = CASE WHEN $free THEN excluded.holder ELSE holder END,
    expires_at = CASE WHEN $free THEN excluded.expires_at ELSE expires_at END
RETURNING token, owner IS NOT NULL AND owner = :secret, expires_at - $now,
    EXISTS (SELECT 1 FROM $shared AS q WHERE q.resource = :resource AND q.expires_at > $now)"""
_SQLITE_FREE = """(owner = excluded.owner AND expires_at > $now) OR (
        (owner IS NULL OR expires_at <= $now)
        AND NOT EXISTS (SELECT 1 FROM $shared AS q
                        WHERE q.resource = excluded.resource AND q.expires_at > $now))"""

_SQLITE_RENEW = """UPDATE $table SET expires_at = $now + :ttl
WHERE resource = :resource AND owner = :secret AND expires_at > $now
RETURNING token"""

_SQLITE_RENEW_READ = """UPDATE $shared SET expires_at = $now + :ttl
WHERE resource = :resource AND member = :secret AND kind = 'r' AND expires_at > $now
RETURNING token"""

_SQLITE_RELEASE = """UPDATE $table SET owner = NULL, holder = NULL, expires_at = $now
WHERE resource = :resource AND owner = :secret AND expires_at > $now
RETURNING token"""

_SQLITE_RELEASE_READ = """DELETE FROM $shared
WHERE resource = :resource AND member = :secret AND kind = 'r' AND expires_at > $now
RETURNING token"""

_SQLITE_ABANDON = """DELETE FROM $shared
WHERE resource = :resource AND member = :secret AND kind IN ('R', 'W')
RETURNING kind"""

_SQLITE_INSPECT = """SELECT 'w', token, expires_at - $now, holder FROM $table
WHERE resource = :resource AND owner IS NOT NULL AND expires_at > $now
UNION ALL
SELECT 'r', token, expires_at - $now, holder FROM $shared
WHERE resource = :resource AND kind = 'r' AND expires_at > $now"""

_SQLITE_LIST = """WITH n AS (SELECT $now AS now),
h AS (
    SELECT l.resource FROM $table AS l, n
    WHERE l.owner IS NOT NULL AND l.expires_at > n.now
      AND l.resource > :after AND substr(l.resource, 1, :length) = :prefix
    UNION
    SELECT q.resource FROM $shared AS q, n
    WHERE q.kind = 'r' AND q.expires_at > n.now
      AND q.resource > :after AND substr(q.resource, 1, :length) = :prefix
),
p AS (SELECT h.resource FROM h ORDER BY h.resource LIMIT :count),
w AS (
    SELECT q.resource, count(*) AS c FROM $shared AS q, n
    WHERE q.resource IN (SELECT p.resource FROM p) AND q.kind IN ('R', 'W')
      AND q.expires_at > n.now
    GROUP BY q.resource
)
SELECT l.resource, 'w', l.token, l.expires_at - n.now, l.holder,
       coalesce((SELECT w.c FROM w WHERE w.resource = l.resource), 0)
FROM p JOIN $table AS l ON l.resource = p.resource, n
WHERE l.owner IS NOT NULL AND l.expires_at > n.now
UNION ALL
SELECT q.resource, 'r', q.token, q.expires_at - n.now, q.holder,
       coalesce((SELECT w.c FROM w WHERE w.resource = q.resource), 0)
FROM p JOIN $shared AS q ON q.resource = p.resource, n
WHERE q.kind = 'r' AND q.expires_at > n.now
ORDER BY 1"""

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

#: SQLite: the steps of the transactions (``BEGIN IMMEDIATE``) in which the driver decides
#: shared locks and queued writers, with the rule of :mod:`fence._memory`: what the lease
#: row and the shared table hold now (``state``, ``entries``), then the writes.
SQLITE_STEPS = {
    # (token, owner, the owner's seconds left, the first token a new lease may take, now)
    "state": """SELECT l.token, l.owner, l.expires_at - n.now, $first, n.now
FROM (SELECT $now AS now) AS n LEFT JOIN $table AS l ON l.resource = :resource""",
    # (member, kind, token, seconds left, seq, holder) of every row of the resource
    "entries": """SELECT member, kind, token, expires_at - $now, seq, holder FROM $shared
WHERE resource = :resource""",
    "write": """INSERT INTO $table (resource, token, owner, holder, expires_at)
VALUES (:resource, :token, :secret, :holder, $now + :ttl)
ON CONFLICT (resource) DO UPDATE SET token = excluded.token, owner = excluded.owner,
    holder = excluded.holder, expires_at = excluded.expires_at""",
    "count": """INSERT INTO $table (resource, token, owner, holder, expires_at)
VALUES (:resource, :token, NULL, NULL, $now)
ON CONFLICT (resource) DO UPDATE SET token = excluded.token""",
    "put": """INSERT INTO $shared (resource, member, kind, token, holder, expires_at, seq)
VALUES (:resource, :secret, :kind, :token, :holder, $now + :ttl, :seq)
ON CONFLICT (resource, member) DO UPDATE SET kind = excluded.kind, token = excluded.token,
    holder = excluded.holder, expires_at = excluded.expires_at, seq = excluded.seq""",
    "drop": "DELETE FROM $shared WHERE resource = :resource AND member = :secret",
    "sweep": "DELETE FROM $shared WHERE resource = :resource AND expires_at < $now - 60",
    "drop_readers": "DELETE FROM $shared WHERE resource = :resource AND kind = 'r'",
}


# MariaDB (and MySQL): no RETURNING on UPDATE, no data-modifying CTE, no notifications. Every
# acquire and revoke is a transaction of the driver (MySQLDialect.locks_first) that first
# claims the resource's lease row (``claim``: an upsert, which locks the row whether it was
# there or not; a SELECT ... FOR UPDATE of a missing row would take a gap lock, which two
# transactions share and then deadlock on as both insert), then reads and decides in
# process with the rule of fence._memory, as on SQLite. A row the claim creates has no
# token yet: ``expires_at < 0`` marks it, and ``state`` reads its token as NULL. Every
# transaction on a resource holds its lease row from its first statement to its commit,
# so they run one at a time; ``state`` and ``entries`` are plain reads, whose snapshot
# (REPEATABLE READ) is taken after the claim got the row; a reader's renewal, which could
# otherwise commit after that snapshot, locks the lease row too (_MY_RENEW_READ). The
# single statements outside transactions (renew, release, a reader's renewal and release,
# a waiter leaving) report by their row count, of rows found (CLIENT_FOUND_ROWS), not
# changed. ``$now`` is the server's clock in Unix seconds (MySQLDialect.clock_sql), fixed
# for a statement.
_MY_CLAIM = """INSERT INTO $table (resource, token, owner, holder, expires_at)
VALUES (:resource, 1, NULL, NULL, -1)
ON DUPLICATE KEY UPDATE resource = resource"""

_MY_RENEW = """UPDATE $table SET expires_at = $now + :ttl
WHERE resource = :resource AND owner = :secret AND expires_at > $now"""

# A reader's renewal locks the resource's lease row first, as the driver's transactions do:
# a writer's acquire reads the shared table in its snapshot and may judge this reader
# expired; the renewal waits for that transaction to end and finds the reader gone or
# expired, instead of extending a lease the writer is granted over. STRAIGHT_JOIN keeps
# the transactions' order of locks (lease row, then shared rows), so the two cannot
# deadlock; the lease row's no-op assignment makes its lock exclusive at any isolation.
_MY_RENEW_READ = """UPDATE $table AS l STRAIGHT_JOIN $shared AS q ON q.resource = l.resource
SET l.token = l.token, q.expires_at = $now + :ttl
WHERE l.resource = :resource AND q.member = :secret AND q.kind = 'r'
  AND q.expires_at > $now"""

_MY_RELEASE = """UPDATE $table SET owner = NULL, holder = NULL, expires_at = $now
WHERE resource = :resource AND owner = :secret AND expires_at > $now"""

_MY_RELEASE_READ = """DELETE FROM $shared
WHERE resource = :resource AND member = :secret AND kind = 'r' AND expires_at > $now"""

_MY_ABANDON = """DELETE FROM $shared
WHERE resource = :resource AND member = :secret AND kind IN ('R', 'W')"""

# MySQL evaluates SET from left to right, each assignment seeing the ones before it: the
# token is computed while expires_at still holds the mark of a new row.
_MY_REVOKE = """UPDATE $table SET
    token = CASE WHEN expires_at < 0 THEN $first ELSE GREATEST(token + 1, $first) END,
    owner = NULL, holder = NULL, expires_at = $now
WHERE resource = :resource"""

# A subquery with LIMIT cannot be the right side of IN (error 1235): the page is joined.
_MY_LIST = """WITH n AS (SELECT $now AS now),
h AS (
    SELECT l.resource FROM $table AS l, n
    WHERE l.owner IS NOT NULL AND l.expires_at > n.now
      AND l.resource > :after AND substr(l.resource, 1, :length) = :prefix
    UNION
    SELECT q.resource FROM $shared AS q, n
    WHERE q.kind = 'r' AND q.expires_at > n.now
      AND q.resource > :after AND substr(q.resource, 1, :length) = :prefix
),
p AS (SELECT h.resource FROM h ORDER BY h.resource LIMIT :count),
w AS (
    SELECT q.resource, count(*) AS c FROM $shared AS q JOIN p ON p.resource = q.resource, n
    WHERE q.kind IN ('R', 'W') AND q.expires_at > n.now
    GROUP BY q.resource
)
SELECT l.resource, 'w', l.token, l.expires_at - n.now, l.holder,
       coalesce((SELECT w.c FROM w WHERE w.resource = l.resource), 0)
FROM p JOIN $table AS l ON l.resource = p.resource, n
WHERE l.owner IS NOT NULL AND l.expires_at > n.now
UNION ALL
SELECT q.resource, 'r', q.token, q.expires_at - n.now, q.holder,
       coalesce((SELECT w.c FROM w WHERE w.resource = q.resource), 0)
FROM p JOIN $shared AS q ON q.resource = p.resource, n
WHERE q.kind = 'r' AND q.expires_at > n.now
ORDER BY 1"""

_MY_FIRST_FENCED = """GREATEST($floor, (SELECT coalesce(max(fence), 0) + 1 FROM $register
                             WHERE scope = :resource))"""
_MY_RAISE_FENCE = """INSERT INTO $register (scope, fence) VALUES (:resource, :token)
ON DUPLICATE KEY UPDATE fence = GREATEST(fence, VALUES(fence))"""

#: MariaDB: the steps of the driver's transactions, as :data:`SQLITE_STEPS` (the lease row
#: exists once ``claim`` ran, so the writes to it are updates).
MYSQL_STEPS = {
    "claim": _MY_CLAIM,
    "state": """SELECT CASE WHEN l.expires_at < 0 THEN NULL ELSE l.token END, l.owner,
    l.expires_at - n.now, $first, n.now
FROM (SELECT $now AS now) AS n LEFT JOIN $table AS l ON l.resource = :resource""",
    "entries": SQLITE_STEPS["entries"],
    "write": """UPDATE $table SET token = :token, owner = :secret, holder = :holder,
    expires_at = $now + :ttl
WHERE resource = :resource""",
    "count": """UPDATE $table SET token = :token,
    expires_at = CASE WHEN expires_at < 0 THEN $now ELSE expires_at END
WHERE resource = :resource""",
    "put": """INSERT INTO $shared (resource, member, kind, token, holder, expires_at, seq)
VALUES (:resource, :secret, :kind, :token, :holder, $now + :ttl, :seq)
ON DUPLICATE KEY UPDATE kind = VALUES(kind), token = VALUES(token), holder = VALUES(holder),
    expires_at = VALUES(expires_at), seq = VALUES(seq)""",
    "drop": SQLITE_STEPS["drop"],
    "sweep": SQLITE_STEPS["sweep"],
    "drop_readers": SQLITE_STEPS["drop_readers"],
    "token": "SELECT token FROM $table WHERE resource = :resource",
}


def lease_statements(
    dialect: str | SQLDialect,
    *,
    table: str = DEFAULT_TABLE,
    schema: str | None = None,
    token_mode: TokenMode = TokenMode.HYBRID,
    notify: bool = True,
    fence_table: str | None = None,
) -> LeaseStatements:
    """Build the statements of the SQL lock manager (C2, C3, C10, C11, C13 in SQL).

    A new token is ``max(last + 1, clock)`` in hybrid mode (the clock in microseconds since
    the epoch, read by the database: ``clock_timestamp()`` on PostgreSQL, ``julianday('now')``
    on SQLite) and ``last + 1`` in counter mode: :func:`fence.issue_token` in SQL. Each
    dialect has its own set (:data:`STATEMENT_SETS`, by the dialect's name).

    Args:
        dialect: ``"postgresql"`` or ``"sqlite"`` (or a :class:`SQLDialect`).
        table: the table name.
        schema: the schema, or ``None``.
        token_mode: :class:`fence.TokenMode`.
        notify: PostgreSQL: a release or revoke runs ``pg_notify(:channel, resource)`` in
            the same statement, the release of the last reader ``pg_notify(:channel_w,
            resource)`` (without it the statements take neither parameter).
        fence_table: the guards' fence register ``(scope, fence)`` in the same schema: new
            tokens go above its row for the resource, and a revoke raises that row (in the
            same statement on PostgreSQL; in :attr:`LeaseStatements.raise_fence`, run
            right after, on SQLite).

    Raises:
        ConfigurationError: an unsupported dialect or a bad name.
    """
    found = dialect_for(dialect)
    build = STATEMENT_SETS.get(found.name)
    if build is None:
        raise ConfigurationError(f"the SQL lock manager has no statements for {found.name}")
    return build(
        found,
        table=table,
        schema=schema,
        token_mode=TokenMode(token_mode),
        notify=notify,
        fence_table=fence_table,
    )


def _names(
    dialect: SQLDialect, table: str, schema: str | None, fence_table: str | None
) -> tuple[str, str, tuple[str, ...], str | None]:
    """The quoted lease table, shared table and register, and the tables' DDL."""
    name = _qualified(dialect, table, schema)
    shared = _qualified(dialect, shared_table_name(table), schema)
    create = tuple(lease_schema_ddl(dialect.name, table=table, schema=schema))
    register = None if fence_table is None else _qualified(dialect, fence_table, schema)
    return name, shared, create, register


def postgresql_statements(
    dialect: PostgreSQLDialect,
    *,
    table: str,
    schema: str | None,
    token_mode: TokenMode,
    notify: bool,
    fence_table: str | None,
) -> LeaseStatements:
    """The statements on PostgreSQL: every call is one statement, shared locks included;
    see :func:`lease_statements`.

    Raises:
        ConfigurationError: a bad name.
    """
    name, shared, create, register = _names(dialect, table, schema, fence_table)
    floor = dialect.token_floor("c.now")
    values = {
        "table": name,
        "shared": shared,
        "clock": Template(_PG_CLOCK).substitute(clock_sql=dialect.clock_sql),
        "floor": floor if token_mode is TokenMode.HYBRID else "1",
        "us": floor,
        "mine": _PG_MINE,
        "void": _PG_VOID_OF,
    }
    for alias in ("r", "up", "u", "q"):
        values[f"notify_{alias}"] = (
            Template(_PG_NOTIFY).substitute(alias=alias) if notify else "NULL"
        )
    values["notify_writers"] = (
        Template(_PG_NOTIFY_WRITERS).substitute(alias="u") if notify else "NULL"
    )
    values["first"] = values["floor"]
    values["reg"] = ""
    if register is not None:
        values["register"] = register
        values["first"] = Template(_PG_FIRST_FENCED).substitute(values)
        values["reg"] = Template(_PG_RAISE_FENCE).substitute(values)
    values["ahead_any"] = Template(_PG_AHEAD).substitute(values, kinds="'R', 'W'")
    values["ahead_writer"] = Template(_PG_AHEAD).substitute(values, kinds="'W'")

    def pg(template: str) -> str:
        return Template(template).substitute(values)

    return LeaseStatements(
        dialect.name,
        create,
        acquire=pg(_PG_ACQUIRE),
        acquire_read=pg(_PG_ACQUIRE_READ),
        renew=pg(_PG_RENEW),
        renew_read=pg(_PG_RENEW_READ),
        release=pg(_PG_RELEASE),
        release_read=pg(_PG_RELEASE_READ),
        abandon=pg(_PG_ABANDON),
        inspect=pg(_PG_INSPECT),
        revoke=pg(_PG_REVOKE),
        wake=_PG_WAKE,
        void=pg(_PG_VOID),
        list_page=pg(_PG_LIST),
    )


def sqlite_statements(
    dialect: SQLiteDialect,
    *,
    table: str,
    schema: str | None,
    token_mode: TokenMode,
    notify: bool = False,
    fence_table: str | None,
) -> LeaseStatements:
    """The statements on SQLite: one statement per call where it can, and the steps of the
    driver's transactions (:data:`SQLITE_STEPS`) for shared locks, queued writers and
    revokes; see :func:`lease_statements`. ``notify`` is ignored: SQLite has no
    notifications.

    Raises:
        ConfigurationError: a bad name.
    """
    name, shared, create, register = _names(dialect, table, schema, fence_table)
    now = dialect.clock_sql
    values = {
        "table": name,
        "shared": shared,
        "now": now,
        "floor": dialect.token_floor(now) if token_mode is TokenMode.HYBRID else "1",
    }
    values["free"] = Template(_SQLITE_FREE).substitute(values)
    values["first"] = values["floor"]
    raise_fence = None
    if register is not None:
        values["register"] = register
        values["first"] = Template(_SQLITE_FIRST_FENCED).substitute(values)
        raise_fence = Template(_SQLITE_RAISE_FENCE).substitute(values)
    acquire, renew, renew_read, release, release_read, abandon, inspect, revoke = (
        Template(t).substitute(values)
        for t in (
            _SQLITE_ACQUIRE,
            _SQLITE_RENEW,
            _SQLITE_RENEW_READ,
            _SQLITE_RELEASE,
            _SQLITE_RELEASE_READ,
            _SQLITE_ABANDON,
            _SQLITE_INSPECT,
            _SQLITE_REVOKE,
        )
    )
    return LeaseStatements(
        dialect.name,
        create,
        acquire,
        None,
        renew,
        renew_read,
        release,
        release_read,
        abandon,
        inspect,
        revoke,
        wake=None,
        raise_fence=raise_fence,
        steps={k: Template(v).substitute(values) for k, v in SQLITE_STEPS.items()},
        list_page=Template(_SQLITE_LIST).substitute(values),
    )


def mysql_statements(
    dialect: MySQLDialect,
    *,
    table: str,
    schema: str | None,
    token_mode: TokenMode,
    notify: bool = False,
    fence_table: str | None,
) -> LeaseStatements:
    """The statements on MariaDB (and MySQL): single statements for renewals, releases and
    reads, and the steps of the driver's transactions (:data:`MYSQL_STEPS`) for acquires
    and revokes; ``acquire`` is the claim of the lease row that begins them. ``notify`` is
    ignored: there are no notifications.

    Raises:
        ConfigurationError: a bad name.
    """
    name, shared, create, register = _names(dialect, table, schema, fence_table)
    now = dialect.clock_sql
    values = {
        "table": name,
        "shared": shared,
        "now": now,
        "floor": dialect.token_floor(now) if token_mode is TokenMode.HYBRID else "1",
    }
    values["first"] = values["floor"]
    raise_fence = None
    if register is not None:
        values["register"] = register
        values["first"] = Template(_MY_FIRST_FENCED).substitute(values)
        raise_fence = Template(_MY_RAISE_FENCE).substitute(values)

    def my(template: str) -> str:
        return Template(template).substitute(values)

    return LeaseStatements(
        dialect.name,
        create,
        acquire=my(_MY_CLAIM),
        acquire_read=None,
        renew=my(_MY_RENEW),
        renew_read=my(_MY_RENEW_READ),
        release=my(_MY_RELEASE),
        release_read=my(_MY_RELEASE_READ),
        abandon=my(_MY_ABANDON),
        inspect=Template(_SQLITE_INSPECT).substitute(values),
        revoke=my(_MY_REVOKE),
        wake=None,
        raise_fence=raise_fence,
        steps={k: my(v) for k, v in MYSQL_STEPS.items()},
        list_page=my(_MY_LIST),
    )


#: The lock manager's statement set of each dialect, by the dialect's name: a new database
#: is a dialect in :mod:`fence._sql_dialect` and a builder here.
STATEMENT_SETS: dict[str, Callable[..., LeaseStatements]] = {
    "postgresql": postgresql_statements,
    "sqlite": sqlite_statements,
    "mariadb": mysql_statements,
    "mysql": mysql_statements,
}
