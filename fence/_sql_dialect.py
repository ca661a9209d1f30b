"""SQL dialects: what iofence needs to know about one database, in one object. No I/O.

The SQL lock manager (``fence._async.sql`` / ``fence._sync.sql``) and its schema module
(:mod:`fence._sql_schema`) ask the dialect of their engine, never the dialect's name: how
its lease statements are built, how a transaction begins, whether a release is notified
or polled, whether shared locks are decided in one statement or in process (by
:func:`fence._rwlock.decide`, in a transaction), how a driver error is classified, how an
engine is built from a URL, and how the database's clock reads. One object per database,
looked up by SQLAlchemy's dialect name::

    dialect = dialect_for(engine.dialect.name)      # ConfigurationError if unsupported

A new database is a new subclass of :class:`SQLDialect`, registered in :data:`DIALECTS`,
plus its set of lease statements in :mod:`fence._sql_schema`; the driver does not change.
MariaDB (and MySQL's wire protocol and SQL) decide in process, like SQLite, in
transactions that lock the resource's lease row; MySQL itself is not tested.

The row guards (``fence.adapters``) can take from the same object what belongs to a
database rather than to a guard:

- :meth:`SQLDialect.classify`: a driver error (SQLAlchemy's wrapper or the DB-API error
  itself) as a :class:`Fault`, by SQLSTATE on PostgreSQL and by result code (and message)
  on SQLite. The caller turns the fault into its own error: a retryable fault is never a
  verdict on a token (C5). ``fence.adapters._sql_common.translate_error`` classifies the
  same SQLSTATEs and codes by hand.
- :meth:`SQLDialect.insert` and :attr:`SQLDialect.insert_class`: SQLAlchemy's insert
  construct with ``ON CONFLICT`` support (``on_conflict_do_update``) for the dialect.
- :attr:`SQLDialect.returning`, :attr:`SQLDialect.rowcount_after_fetch`,
  :attr:`SQLDialect.max_params`: what a statement may carry and how its row count reads.
"""

from __future__ import annotations

import enum
import functools
import os
from collections.abc import Callable, Hashable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from fence._errors import ConfigurationError

if TYPE_CHECKING:
    from sqlalchemy import Table
    from sqlalchemy.engine import URL, Dialect


__all__ = [
    "CHECK_LOGIN",
    "DIALECTS",
    "JUDGE_FAULTS",
    "MYSQL_DEADLOCK",
    "MYSQL_LOCK_WAIT_TIMEOUT",
    "MYSQL_SIGNAL",
    "PG_CONNECT_TIMEOUT",
    "SQLITE_PRAGMAS",
    "SQLSTATE_REFUSED",
    "SQLSTATE_STALE",
    "SQLSTATE_UNFENCED",
    "Fault",
    "MariaDBDialect",
    "MySQLDialect",
    "PostgreSQLDialect",
    "SQLDialect",
    "SQLiteDialect",
    "dialect_for",
    "dialect_of_url",
    "error_code",
    "fault_of",
    "first_line",
    "mysql_code",
    "mysql_message",
    "set_sqlite_pragmas",
    "sqlite_code",
    "sqlstate",
]

#: What an engine built from a ``sqlite:`` file URL sets on every connection: WAL (readers
#: never block the writer, a commit appends to the log instead of rewriting pages), the
#: matching ``synchronous=NORMAL`` (a power loss can lose the last commits, not corrupt the
#: file), and a busy timeout for writers that meet another writer.
SQLITE_PRAGMAS: dict[str, str | int] = {
    "journal_mode": "WAL",
    "synchronous": "NORMAL",
    "busy_timeout": 5000,
}

#: ``connect_timeout`` (seconds) of a PostgreSQL engine built from a URL, unless the URL or
#: ``engine_options`` give one: a server that accepts connections and then hangs holds a
#: new connection this long at most (psycopg's floor is 2 s).
PG_CONNECT_TIMEOUT = 5

#: What to do about a login the server refused (:attr:`Fault.AUTH`) or a database it does
#: not have (:attr:`Fault.NO_DATABASE`): the same URL fails the same way until it is fixed.
CHECK_LOGIN = "check the user, password and database in the URL"

#: The SQLSTATEs of the database's judge of fenced writes (C14, ``fence.adapters.ddl``): a
#: write without a token, a write whose token is below the row's fence, a write that would
#: lower or drop a fence. Class ``IO`` is no standard class, so no other error has them.
SQLSTATE_UNFENCED = "IOF01"
SQLSTATE_STALE = "IOF02"
SQLSTATE_REFUSED = "IOF03"


#: MariaDB's and MySQL's error numbers of a deadlock (this transaction was rolled back) and
#: of a lock wait that timed out (``innodb_lock_wait_timeout``; only the statement was).
MYSQL_DEADLOCK = 1213
MYSQL_LOCK_WAIT_TIMEOUT = 1205
#: MariaDB's and MySQL's error number of ``SIGNAL SQLSTATE '45000'`` (ER_SIGNAL_EXCEPTION):
#: the judge's triggers refuse with it, and a message ``iofence: ...`` says why.
MYSQL_SIGNAL = 1644


class Fault(enum.Enum):
    """What a driver error says, as :meth:`SQLDialect.classify` reads it.

    Attributes:
        SERIALIZATION: a serialization failure (SQLSTATE 40001; MariaDB 1020, a row changed
            since the snapshot read it): repeat the transaction.
        DEADLOCK: a deadlock was detected (40P01; MariaDB 1213) and this transaction was
            chosen to end.
        LOCK_TIMEOUT: a lock was not available in time (55P03; MariaDB 1205).
        CANCELED: the statement was cancelled or timed out (57014; MariaDB 1317, 1969).
        BUSY: SQLite: the database stayed locked by another writer (``SQLITE_BUSY``,
            ``SQLITE_LOCKED``).
        ABORTED: the transaction was already aborted by an earlier error (25P02).
        MISSING_TABLE: a table or schema does not exist (42P01, 3F000, ``no such table``).
        MISSING_COLUMN: a column does not exist (42703, ``no such column``).
        NO_DATABASE: the server answered, but the database does not exist (3D000): a
            mistake in the URL, never transient.
        CANNOT_OPEN: SQLite cannot open the database file.
        AUTH: the server refused the login (28P01, a wrong password; 28000, a role that
            does not exist or that ``pg_hba.conf`` turns away): never transient.
        CONNECTION: the connection is lost or closed (classes 08 and 57P).
        UNFENCED: the database's judge (C14) refused a write that carries no token
            (:data:`SQLSTATE_UNFENCED`; SQLite, and MariaDB's error 1644: a message
            ``iofence: unfenced ...``).
        STALE: the judge refused a write whose token is below the row's fence
            (:data:`SQLSTATE_STALE`; ``iofence: stale ...``).
        REFUSED: the judge refused a write that would lower or drop a fence: a lowered
            fence, a hard delete where a tombstone keeps it, ``TRUNCATE``
            (:data:`SQLSTATE_REFUSED`; ``iofence: refused ...``).
    """

    SERIALIZATION = "serialization"
    DEADLOCK = "deadlock"
    LOCK_TIMEOUT = "lock_timeout"
    CANCELED = "canceled"
    BUSY = "busy"
    ABORTED = "aborted"
    MISSING_TABLE = "missing_table"
    MISSING_COLUMN = "missing_column"
    NO_DATABASE = "no_database"
    CANNOT_OPEN = "cannot_open"
    AUTH = "auth"
    CONNECTION = "connection"
    UNFENCED = "unfenced"
    STALE = "stale"
    REFUSED = "refused"

    @property
    def retryable(self) -> bool:
        """The statement changed nothing and the transaction may be repeated as a whole;
        never a verdict on a token (C5)."""
        return self in _RETRYABLE


#: The judge's refusals (C14): verdicts on a write, never retryable.
JUDGE_FAULTS = frozenset({Fault.UNFENCED, Fault.STALE, Fault.REFUSED})

_RETRYABLE = frozenset(
    {Fault.SERIALIZATION, Fault.DEADLOCK, Fault.LOCK_TIMEOUT, Fault.CANCELED, Fault.BUSY}
)


def _refused_login(text: str) -> bool:
    """Whether a connection error's message is a refused login: a wrong password
    (28P01), or a user that does not exist or that ``pg_hba.conf`` turns away (28000). Read
    before the missing database, whose message a role's name could resemble."""
    return (
        "authentication failed" in text
        or ("FATAL:  role " in text and "does not exist" in text)
        or "no pg_hba.conf entry" in text
    )


def sqlstate(exc: BaseException) -> str | None:
    """The SQLSTATE of a driver error: of ``exc``, of the DB-API error SQLAlchemy wrapped
    (``exc.orig``), or of its cause; ``None`` if none has one."""
    for candidate in (exc, getattr(exc, "orig", None), exc.__cause__):
        state = getattr(candidate, "sqlstate", None)
        if isinstance(state, str):
            return state
    return None


def sqlite_code(exc: BaseException) -> int | None:
    """The primary SQLite result code of a driver error (the extended code's low byte), as
    :func:`sqlstate` finds it; ``None`` if none has one."""
    for candidate in (exc, getattr(exc, "orig", None), exc.__cause__):
        code = getattr(candidate, "sqlite_errorcode", None)
        if isinstance(code, int):
            return code & 0xFF
    return None


def mysql_code(exc: BaseException) -> int | None:
    """The MariaDB or MySQL error number of a driver error (PyMySQL's and aiomysql's
    ``args[0]``), as :func:`sqlstate` finds it; ``None`` if none has one."""
    for candidate in (exc, getattr(exc, "orig", None), exc.__cause__):
        if candidate is None or not type(candidate).__module__.startswith(_MYSQL_DRIVERS):
            continue
        args = getattr(candidate, "args", ())
        if args and isinstance(args[0], int) and not isinstance(args[0], bool):
            return args[0]
    return None


def error_code(exc: BaseException) -> str | None:
    """The database's code of a driver error, for messages: ``SQLSTATE 40001``, ``MariaDB
    error 1213``; ``None`` if it has none."""
    code = mysql_code(exc)
    if code is not None:
        return f"MariaDB error {code}"
    state = sqlstate(exc)
    return None if state is None else f"SQLSTATE {state}"


def mysql_message(exc: BaseException) -> str:
    """The message of a MariaDB or MySQL error (the DB-API error's second argument; its
    ``str()`` is the tuple of number and message)."""
    args = _dbapi_error(exc).args
    return args[1] if len(args) > 1 and isinstance(args[1], str) else ""


def first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message, or its type's name if it has none."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _dbapi_error(exc: BaseException) -> BaseException:
    """The DB-API error SQLAlchemy wrapped, or ``exc`` itself."""
    return getattr(exc, "orig", None) or exc


class SQLDialect:
    """One database as iofence sees it; subclass it for another database.

    Instances hold no state of their own: use the ones in :data:`DIALECTS`.

    Attributes:
        name: SQLAlchemy's name of the dialect (``engine.dialect.name``).
        label: the database's name in messages.
        aliases: other names a URL may give the backend (``postgres://``).
        begin: the statement that begins a transaction of the lock manager's driver; it
            takes the locks the transaction needs to see what it decides on (SQLite's
            ``BEGIN IMMEDIATE`` takes the database's write lock).
        notifies: releases are announced to waiters of every process (PostgreSQL's
            ``LISTEN``/``NOTIFY``); otherwise a release wakes the waiters of its own
            process, and the others poll.
        poll_interval: the default longest wait (seconds) of a waiter between two
            attempts: what a lost notification costs, or the polling period.
        decides_in_process: shared locks (C13) and queued writers are decided in process by
            :func:`fence._rwlock.decide`, in one transaction of the driver that runs the
            steps of :attr:`fence._sql_schema.LeaseStatements.steps`; otherwise every call
            is one statement that decides in the database.
        in_process: the database runs in this process (SQLite): no socket to cut at a
            caller's deadline (the busy timeout bounds the wait instead), and a statement
            that runs on a worker thread goes on after its caller is cancelled.
        client_clock: the hybrid token floor also takes the driver's reading of the system
            clock (bound as ``:clock_us``; see :meth:`token_floor`).
        busy_timeout_ms: the busy timeout of an engine built by the manager, in
            milliseconds; ``None`` where a deadline is kept by cutting the socket.
        raw_driver: the DB-API driver whose connections take the lease statements as they
            are (``:name`` parameters), so that a sync driver may skip SQLAlchemy's
            per-statement work; ``None`` if none does.
        timestamp_type: the SQL type of the lease tables' times.
        add_column_if_missing: ``ALTER TABLE ... ADD COLUMN IF NOT EXISTS`` exists.
        clock_sql: an expression for the database's clock, read when it is evaluated.
        returning: ``INSERT``, ``UPDATE`` and ``DELETE`` take ``RETURNING`` (SQLite: 3.35
            or later).
        rowcount_after_fetch: with ``RETURNING``, the driver counts the rows as they are
            fetched (sqlite3), so the row count is known only once they are read.
        max_params: bound parameters one statement may carry, on every version.
        batch_arrays: a batch's rows travel as one array per column (``unnest``).
        locks_rows: ``SELECT ... FOR UPDATE`` locks the rows it reads (SQLite's write lock
            covers the whole database instead).
        begins_on_write: the driver begins a transaction only before a write (Python's
            sqlite3), so a savepoint sent first would be a transaction of its own.
        lock_manager: the SQL lock manager has statements for this database.
        session_hook: the SQLAlchemy session hook (``fence.adapters.orm``) runs on it.
        key_type: the SQL type of the lease tables' key columns (a text type a primary
            key can take).
        table_options: what follows the lease tables' ``CREATE TABLE (...)``.
        locks_first: a dialect that decides in process: a transaction of the driver
            first locks the resource's lease row (the ``claim`` step), creating it if there
            is none (a row that no lease has had yet is marked by ``expires_at < 0``);
            false where :attr:`begin` locks enough (SQLite's database lock).
        upsert_counts_found: an upsert's row count cannot tell an inserted row from an
            existing row it left as it was (``INSERT ... ON DUPLICATE KEY UPDATE`` counts 1
            for both with ``CLIENT_FOUND_ROWS``, 2 for a changed row): a count of 1 is
            settled by reading the fence back in the same transaction.
    """

    name: ClassVar[str]
    label: ClassVar[str]
    aliases: ClassVar[tuple[str, ...]] = ()
    begin: ClassVar[str] = "BEGIN"
    notifies: ClassVar[bool] = False
    poll_interval: ClassVar[float]
    decides_in_process: ClassVar[bool] = False
    in_process: ClassVar[bool] = False
    client_clock: ClassVar[bool] = False
    busy_timeout_ms: ClassVar[int | None] = None
    raw_driver: ClassVar[str | None] = None
    timestamp_type: ClassVar[str]
    add_column_if_missing: ClassVar[bool] = False
    clock_sql: ClassVar[str]
    returning: ClassVar[bool] = True
    rowcount_after_fetch: ClassVar[bool] = False
    max_params: ClassVar[int]
    batch_arrays: ClassVar[bool] = False
    locks_rows: ClassVar[bool] = True
    begins_on_write: ClassVar[bool] = False
    lock_manager: ClassVar[bool] = True
    session_hook: ClassVar[bool] = True
    upsert_counts_found: ClassVar[bool] = False
    key_type: ClassVar[str] = "TEXT"
    table_options: ClassVar[str] = ""
    locks_first: ClassVar[bool] = False
    #: SQLAlchemy's driver for an engine built from a URL that names none, sync and
    #: asyncio (``None``: SQLAlchemy's default).
    _drivers: ClassVar[tuple[str | None, str | None]] = (None, None)

    def __repr__(self) -> str:
        return f"<SQL dialect {self.name}>"

    # -- SQL text -------------------------------------------------------------------------

    @functools.cached_property
    def sqlalchemy(self) -> Dialect:
        """SQLAlchemy's dialect (for quoting and compiling; it never connects)."""
        raise NotImplementedError

    def quote(self, identifier: str) -> str:
        """``identifier`` quoted as this database needs it."""
        return self.sqlalchemy.identifier_preparer.quote(identifier)

    def token_floor(self, now: str) -> str:
        """The hybrid token floor (C3): an expression for the microseconds since the epoch
        of ``now``, an expression of the database's clock (:attr:`clock_sql`)."""
        raise NotImplementedError

    def insert(self, table: Table) -> Any:
        """SQLAlchemy's ``INSERT`` of ``table`` with ``ON CONFLICT`` support
        (``on_conflict_do_update``, ``on_conflict_do_nothing``) for this database."""
        return self.insert_class(table)

    @property
    def insert_class(self) -> type[Any]:
        """The class of :meth:`insert`'s construct."""
        raise NotImplementedError

    # -- errors ---------------------------------------------------------------------------

    def classify(self, exc: BaseException) -> Fault | None:
        """What the driver error ``exc`` says, or ``None`` if it says nothing this dialect
        knows (a constraint, a syntax error, an error that is not the database's).

        Args:
            exc: the DB-API error, SQLAlchemy's wrapper of one, or any exception.
        """
        raise NotImplementedError

    def owns(self, exc: BaseException) -> bool:
        """Whether ``exc`` carries this database's own error code (see :func:`fault_of`)."""
        raise NotImplementedError

    # -- engines --------------------------------------------------------------------------

    def engine_url(self, url: URL, *, asyncio: bool) -> URL:
        """``url`` with the driver an engine built by iofence uses, if it names none."""
        if "+" in url.drivername:
            return url
        driver = self._drivers[1 if asyncio else 0]
        return url if driver is None else url.set(drivername=f"{self.name}+{driver}")

    def engine_options(self, url: URL) -> dict[str, Any]:
        """``create_engine`` arguments of an engine built by iofence for ``url`` (the
        caller's own arguments win)."""
        return {}

    def on_connect(self, url: URL) -> Callable[[Any, Any], None] | None:
        """A ``connect`` event listener for an engine built for ``url``, or ``None``."""
        return None

    def tune_engine(self, engine: Any) -> None:
        """Adjust an engine built by iofence, once created (the ``sync_engine`` of an
        asyncio one)."""

    def is_memory(self, url: URL) -> bool:
        """The URL names a database that lives in one connection (in memory)."""
        return False

    def table_key(self, url: URL, schema: str | None, table: str) -> Hashable:
        """What names one table of the database at ``url`` in this process (of an
        in-memory database: within its engine's pool): the key of the process-wide wake-up
        board of a lease table whose releases are not notified."""
        return (self.name, url.host, url.port, url.database, schema, table)

    def busy_timeout_sql(self, milliseconds: int) -> str:
        """The statement that sets the connection's busy timeout (a dialect with
        :attr:`busy_timeout_ms`)."""
        raise NotImplementedError

    def socket_of(self, connection: Any) -> int | None:
        """The file descriptor of the socket under a pooled SQLAlchemy ``Connection`` (an
        asyncio one's ``sync_connection``), which the lock manager shuts down at a caller's
        deadline; ``None`` if there is none to find."""
        return None


class PostgreSQLDialect(SQLDialect):
    """PostgreSQL, through psycopg 3: one statement per call, releases notified."""

    name = "postgresql"
    label = "PostgreSQL"
    aliases = ("postgres",)
    notifies = True
    poll_interval = 2.0
    timestamp_type = "TIMESTAMPTZ"
    add_column_if_missing = True
    clock_sql = "clock_timestamp()"
    # The protocol allows 65,535 parameters per statement.
    max_params = 30_000
    batch_arrays = True
    _drivers = ("psycopg", "psycopg")

    @functools.cached_property
    def sqlalchemy(self) -> Dialect:
        """SQLAlchemy's dialect (for quoting and compiling; it never connects)."""
        from sqlalchemy.dialects import postgresql

        return postgresql.dialect()  # type: ignore[no-untyped-call]

    def token_floor(self, now: str) -> str:
        """See :meth:`SQLDialect.token_floor`."""
        return f"CAST(floor(extract(epoch FROM {now}) * 1000000) AS BIGINT)"

    @property
    def insert_class(self) -> type[Any]:
        """See :attr:`SQLDialect.insert_class`."""
        from sqlalchemy.dialects import postgresql

        return postgresql.Insert

    def classify(self, exc: BaseException) -> Fault | None:
        """See :meth:`SQLDialect.classify`. By SQLSTATE; an error raised while connecting
        carries none, so the database and the credentials are also read from its message."""
        state = sqlstate(exc)
        text = str(_dbapi_error(exc))
        if state == "40001":
            return Fault.SERIALIZATION
        if state == "40P01":
            return Fault.DEADLOCK
        if state in ("42P01", "3F000"):
            return Fault.MISSING_TABLE
        if state == "42703":
            return Fault.MISSING_COLUMN
        if state in ("28P01", "28000") or (state is None and _refused_login(text)):
            return Fault.AUTH
        if state == "3D000" or ("database" in text and "does not exist" in text):
            return Fault.NO_DATABASE
        if state == "55P03":
            return Fault.LOCK_TIMEOUT
        if state == "57014":
            return Fault.CANCELED
        if state == "25P02":
            return Fault.ABORTED
        if state is not None and state.startswith(("08", "57P")):
            return Fault.CONNECTION
        return _JUDGED_STATES.get(state) if state is not None else None

    def owns(self, exc: BaseException) -> bool:
        """See :meth:`SQLDialect.owns`: a SQLSTATE, and no MariaDB error number (PyMySQL's
        errors carry the server's SQLSTATE too, mostly the catch-all ``HY000``)."""
        return sqlstate(exc) is not None and mysql_code(exc) is None

    def socket_of(self, connection: Any) -> int | None:
        """See :meth:`SQLDialect.socket_of`: psycopg's; ``None`` for another driver."""
        try:
            return int(connection.connection.driver_connection.pgconn.socket)
        except Exception:  # a driver other than psycopg, or a broken connection
            return None

    def engine_options(self, url: URL) -> dict[str, Any]:
        """See :meth:`SQLDialect.engine_options`: a ``connect_timeout`` of
        :data:`PG_CONNECT_TIMEOUT` unless the URL gives one."""
        if "connect_timeout" in url.query:
            return {}
        return {"connect_args": {"connect_timeout": PG_CONNECT_TIMEOUT}}


class SQLiteDialect(SQLDialect):
    """SQLite, in process: releases wake this process's waiters, others poll; shared locks
    are decided in ``BEGIN IMMEDIATE`` transactions (SQLite has no data-modifying CTE)."""

    name = "sqlite"
    label = "SQLite"
    begin = "BEGIN IMMEDIATE"
    poll_interval = 0.5
    decides_in_process = True
    in_process = True
    client_clock = True
    busy_timeout_ms = int(SQLITE_PRAGMAS["busy_timeout"])
    raw_driver = "pysqlite"
    timestamp_type = "REAL"
    # The database's clock in Unix seconds. SQLite reads the clock once per statement step,
    # so every use in one statement sees the same instant (millisecond resolution).
    clock_sql = "((julianday('now') - 2440587.5) * 86400.0)"
    rowcount_after_fetch = True
    # SQLITE_MAX_VARIABLE_NUMBER was 999 before 3.32, the lowest any build has had.
    max_params = 999
    locks_rows = False
    begins_on_write = True
    _drivers = (None, "aiosqlite")

    @functools.cached_property
    def sqlalchemy(self) -> Dialect:
        """SQLAlchemy's dialect (for quoting and compiling; it never connects)."""
        from sqlalchemy.dialects import sqlite

        return sqlite.dialect()

    def token_floor(self, now: str) -> str:
        """See :meth:`SQLDialect.token_floor`: the driver's reading of the system clock in
        microseconds (``:clock_us``, read as it sends the statement: SQLite's own reading
        moves in whole milliseconds, and two tokens issued within one would be equal after
        a restore), and never below SQLite's own reading, which is later when the statement
        waited for the write lock."""
        return f"max(:clock_us, CAST({now} * 1000000 AS INTEGER))"

    @property
    def insert_class(self) -> type[Any]:
        """See :attr:`SQLDialect.insert_class`."""
        from sqlalchemy.dialects import sqlite

        return sqlite.Insert

    def classify(self, exc: BaseException) -> Fault | None:
        """See :meth:`SQLDialect.classify`. By result code where the driver gives one, and
        by message (which the wrapped sqlite3 error always has)."""
        message = first_line(_dbapi_error(exc))
        if message.startswith("iofence: "):
            for prefix, fault in _JUDGED_MESSAGES.items():
                if message.startswith(prefix):
                    return fault
        if "no such table" in message:
            return Fault.MISSING_TABLE
        if "no such column" in message or "has no column" in message:
            return Fault.MISSING_COLUMN
        if "unable to open database file" in str(_dbapi_error(exc)):
            return Fault.CANNOT_OPEN
        code = sqlite_code(exc)
        # The message only where no result code came with it: a constraint's name may say
        # "locked" too.
        if code in _SQLITE_BUSY_CODES or (code is None and "locked" in message):
            return Fault.BUSY
        return None

    def owns(self, exc: BaseException) -> bool:
        """See :meth:`SQLDialect.owns`: a SQLite result code."""
        return sqlite_code(exc) is not None

    def engine_options(self, url: URL) -> dict[str, Any]:
        """See :meth:`SQLDialect.engine_options`: an in-memory database gets a
        single-connection :class:`~sqlalchemy.pool.StaticPool`, the only pool that keeps one
        database for all callers."""
        if not self.is_memory(url):
            return {}
        from sqlalchemy.pool import StaticPool

        return {"poolclass": StaticPool, "connect_args": {"check_same_thread": False}}

    def on_connect(self, url: URL) -> Callable[[Any, Any], None] | None:
        """See :meth:`SQLDialect.on_connect`: :data:`SQLITE_PRAGMAS` on every connection to
        a file (the URL's own ``timeout`` wins over the busy timeout)."""
        if self.is_memory(url):
            return None
        pragmas = dict(SQLITE_PRAGMAS)
        if "timeout" in url.query:  # the URL's own busy timeout (seconds) wins
            del pragmas["busy_timeout"]
        return functools.partial(set_sqlite_pragmas, pragmas)

    def is_memory(self, url: URL) -> bool:
        """See :meth:`SQLDialect.is_memory`."""
        return url.database in (None, "", ":memory:") or url.query.get("mode") == "memory"

    def table_key(self, url: URL, schema: str | None, table: str) -> Hashable:
        """See :meth:`SQLDialect.table_key`: a file by its real path."""
        if self.is_memory(url):
            return (self.name, schema, table)
        return (self.name, os.path.realpath(url.database or ""), schema, table)

    def busy_timeout_sql(self, milliseconds: int) -> str:
        """See :meth:`SQLDialect.busy_timeout_sql`."""
        return f"PRAGMA busy_timeout = {milliseconds}"


class MySQLDialect(SQLDialect):
    """MySQL's wire protocol and SQL, as MariaDB 10.11 and MySQL 8 share them:
    ``INSERT ... ON DUPLICATE KEY UPDATE`` for upserts and claims, no ``RETURNING`` on
    ``UPDATE`` (MariaDB has it on ``INSERT`` and ``DELETE`` only, MySQL nowhere), row
    counts of rows found (``CLIENT_FOUND_ROWS``, which SQLAlchemy's MySQL dialects ask
    for), errors by number. The SQL lock manager decides in process, as on SQLite, in
    transactions that begin by locking the resource's lease row; releases are not
    notified, waiters of other processes poll.

    Only MariaDB is tested; see the docs (``docs/mariadb.md``) for what differs on MySQL.
    """

    name = "mysql"
    label = "MySQL"
    begin = "START TRANSACTION"
    poll_interval = 0.5
    decides_in_process = True
    # Unix seconds, as on SQLite: a DATETIME is read in the session's time zone, which
    # clients need not share.
    timestamp_type = "DOUBLE"
    # The server's clock in Unix seconds, microseconds exact, read once per statement
    # (UTC_TIMESTAMP is the statement's start, like NOW), independent of the session's
    # time zone (UNIX_TIMESTAMP(NOW(6)) goes through it, and is ambiguous in a DST fold).
    clock_sql = "(TIMESTAMPDIFF(MICROSECOND, '1970-01-01', UTC_TIMESTAMP(6)) * 0.000001)"
    returning = False
    # PyMySQL and aiomysql send parameters inline: the limit is max_allowed_packet's, not
    # the protocol's 65,535 placeholders of a prepared statement.
    max_params = 10_000
    upsert_counts_found = True
    # TEXT cannot be a key without a prefix length; a binary collation, so that keys (and
    # the shared table's kinds 'r' and 'R') compare as bytes, as on the other databases.
    key_type = "VARCHAR(255)"
    table_options = " ENGINE=InnoDB DEFAULT CHARSET=utf8mb4 COLLATE=utf8mb4_bin"
    locks_first = True
    _drivers = ("pymysql", "aiomysql")

    @functools.cached_property
    def sqlalchemy(self) -> Dialect:
        """SQLAlchemy's dialect (for quoting and compiling; it never connects)."""
        from sqlalchemy.dialects import mysql

        return mysql.dialect()

    def token_floor(self, now: str) -> str:
        """See :meth:`SQLDialect.token_floor`: ``now`` is :attr:`clock_sql`, in seconds."""
        return f"CAST({now} * 1000000 AS SIGNED)"

    def tune_engine(self, engine: Any) -> None:
        """See :meth:`SQLDialect.tune_engine`: no ``ROLLBACK`` where the server says no
        transaction is open.

        In autocommit mode SQLAlchemy still ends every checkout's use with the driver's
        ``rollback()``, which psycopg skips by itself and PyMySQL and aiomysql send: one
        round trip more for every release, renewal and acquire of the lock manager. The
        server reports in every reply whether a transaction is open
        (``SERVER_STATUS_IN_TRANS``); where it said none is, the ``ROLLBACK`` would undo
        nothing and is not sent. Where the last reply said one is (or the status is not
        known), it is sent as before.
        """
        dialect = engine.dialect
        rollback = dialect.do_rollback

        def do_rollback(dbapi_connection: Any) -> None:
            driver = getattr(dbapi_connection, "driver_connection", dbapi_connection)
            status = getattr(driver, "server_status", None)
            if isinstance(status, int) and not status & _SERVER_STATUS_IN_TRANS:
                return
            rollback(dbapi_connection)

        # The engine's own dialect object: no other engine sees it.
        setattr(dialect, "do_rollback", do_rollback)  # noqa: B010 - mypy: a method

    def socket_of(self, connection: Any) -> int | None:
        """See :meth:`SQLDialect.socket_of`: PyMySQL's or aiomysql's socket."""
        try:
            raw = connection.connection.driver_connection
            sock = getattr(raw, "_sock", None)
            if sock is None:  # aiomysql: the socket under its stream writer
                sock = raw._writer.get_extra_info("socket")
            return int(sock.fileno())
        except Exception:  # another driver, or a broken connection
            return None

    @property
    def insert_class(self) -> type[Any]:
        """See :attr:`SQLDialect.insert_class`: MySQL's ``INSERT`` with
        ``on_duplicate_key_update`` (it has no ``on_conflict_do_update``)."""
        from sqlalchemy.dialects import mysql

        return mysql.Insert

    def classify(self, exc: BaseException) -> Fault | None:
        """See :meth:`SQLDialect.classify`. By error number."""
        code = mysql_code(exc)
        if code is None:
            return None
        if code == MYSQL_SIGNAL:
            message = mysql_message(exc)
            for prefix, fault in _JUDGED_MESSAGES.items():
                if message.startswith(prefix):
                    return fault
            return None
        return _MYSQL_FAULTS.get(code)

    def owns(self, exc: BaseException) -> bool:
        """See :meth:`SQLDialect.owns`: a MariaDB or MySQL error number."""
        return mysql_code(exc) is not None


class MariaDBDialect(MySQLDialect):
    """MariaDB (10.11, from the system packages): SQLAlchemy's ``mariadb://`` dialect; a
    ``mysql://`` URL to a MariaDB server gets :class:`MySQLDialect`, which is the same."""

    name = "mariadb"
    label = "MariaDB"

    @functools.cached_property
    def sqlalchemy(self) -> Dialect:
        """SQLAlchemy's dialect (for quoting and compiling; it never connects)."""
        from sqlalchemy.dialects.mysql import mariadb

        return mariadb.MariaDBDialect()


# The status flag of the MySQL protocol's replies: a transaction is open on the session.
_SERVER_STATUS_IN_TRANS = 0x0001

# The modules of the DB-API drivers whose errors carry a MariaDB or MySQL error number as
# ``args[0]`` (aiomysql raises PyMySQL's).
_MYSQL_DRIVERS = ("pymysql", "MySQLdb", "asyncmy", "mariadb", "mysql.connector")

_MYSQL_FAULTS = {
    1020: Fault.SERIALIZATION,  # ER_CHECKREAD: innodb_snapshot_isolation (MariaDB 11.6+)
    MYSQL_DEADLOCK: Fault.DEADLOCK,
    MYSQL_LOCK_WAIT_TIMEOUT: Fault.LOCK_TIMEOUT,
    3572: Fault.LOCK_TIMEOUT,  # MySQL: NOWAIT
    1317: Fault.CANCELED,  # ER_QUERY_INTERRUPTED: KILL QUERY
    1969: Fault.CANCELED,  # MariaDB: max_statement_time
    3024: Fault.CANCELED,  # MySQL: max_execution_time
    1146: Fault.MISSING_TABLE,
    1054: Fault.MISSING_COLUMN,
    1049: Fault.NO_DATABASE,
    1044: Fault.AUTH,
    1045: Fault.AUTH,
    1698: Fault.AUTH,
    1053: Fault.CONNECTION,  # server shutdown in progress
    1927: Fault.CONNECTION,  # MariaDB: connection killed
    2002: Fault.CONNECTION,
    2003: Fault.CONNECTION,
    2006: Fault.CONNECTION,
    2013: Fault.CONNECTION,
    2055: Fault.CONNECTION,
    4031: Fault.CONNECTION,  # MySQL: disconnected after inactivity
}

_JUDGED_STATES = {
    SQLSTATE_UNFENCED: Fault.UNFENCED,
    SQLSTATE_STALE: Fault.STALE,
    SQLSTATE_REFUSED: Fault.REFUSED,
}
# The messages of the judge's triggers on SQLite (``RAISE(ABORT, ...)``), which carry no code
# of their own beyond SQLITE_CONSTRAINT.
_JUDGED_MESSAGES = {
    "iofence: unfenced": Fault.UNFENCED,
    "iofence: stale": Fault.STALE,
    "iofence: refused": Fault.REFUSED,
}

# sqlite3 result codes: SQLITE_BUSY, SQLITE_LOCKED (extended codes keep the low byte).
_SQLITE_BUSY_CODES = frozenset({5, 6})


def set_sqlite_pragmas(
    pragmas: Mapping[str, str | int], dbapi_connection: Any, record: Any
) -> None:
    """Set ``pragmas`` on a new SQLite connection (a ``connect`` event listener)."""
    cursor = dbapi_connection.cursor()
    try:
        for name, value in pragmas.items():
            cursor.execute(f"PRAGMA {name} = {value}")
    finally:
        cursor.close()


#: The supported dialects by SQLAlchemy's name.
DIALECTS: dict[str, SQLDialect] = {
    dialect.name: dialect
    for dialect in (PostgreSQLDialect(), SQLiteDialect(), MariaDBDialect(), MySQLDialect())
}
_BY_BACKEND = {
    **DIALECTS,
    **{alias: dialect for dialect in DIALECTS.values() for alias in dialect.aliases},
}


def dialect_for(name: str | SQLDialect) -> SQLDialect:
    """The dialect SQLAlchemy calls ``name`` (``engine.dialect.name``); a dialect is
    returned as it is.

    Raises:
        ConfigurationError: no supported database has that name.
    """
    if isinstance(name, SQLDialect):
        return name
    found = DIALECTS.get(name)
    if found is None:
        labels = [d.label for d in DIALECTS.values() if d.lock_manager]
        listed = ", ".join(labels[:-1]) + f" and {labels[-1]}" if len(labels) > 1 else labels[0]
        raise ConfigurationError(f"the SQL lock manager supports {listed}, not {name!r}")
    return found


def fault_of(exc: BaseException) -> Fault | None:
    """What a driver error says, read by the dialect whose error code it carries; ``None``
    for an error without one (see :meth:`SQLDialect.classify`). For code that holds no
    dialect, such as a guard's error mapping shared by every driver."""
    for dialect in DIALECTS.values():
        if dialect.owns(exc):
            return dialect.classify(exc)
    return None


def dialect_of_url(url: URL) -> SQLDialect | None:
    """The dialect of a URL's backend (``postgres://`` included), or ``None``."""
    return _BY_BACKEND.get(url.get_backend_name())
