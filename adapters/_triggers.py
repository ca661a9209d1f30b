"""The database's own judge of fenced writes (C14): trigger DDL as text, and its check. No
I/O, no SQLAlchemy, no driver.

Every fenced table carries triggers that judge each row write against the token of the
writing transaction, whoever sends it; the fence register gets the same judge. The token
travels with the transaction:

- PostgreSQL: a transaction-local setting, ``iofence.token``, set by the fenced statement
  itself (``set_config('iofence.token', <t>, true)`` in its ``SET`` or ``VALUES``, which
  PostgreSQL evaluates before the row's ``BEFORE`` trigger fires) or by the session hook's
  claim at the start of the transaction. It ends with the transaction, so a pooled
  connection never carries it into the next one. The opt-out is another local setting,
  ``iofence.unfenced = on`` (:data:`UNFENCED_SQL`).
- MariaDB and MySQL: session variables, which outlive the transaction. A fenced statement
  assigns ``@iofence_row_token`` as each row is evaluated, before the row's ``BEFORE``
  trigger fires, and the judge's ``AFTER`` trigger clears it once the row is written; a
  plain ``SET @iofence_token = <t>`` gives a transaction its token. The library clears
  both when a transaction ends after a failed statement or a ``SET`` of its own, and when
  the pool takes such a connection back. The opt-out is ``@iofence_unfenced = 1``
  (:data:`MARIADB_UNFENCED_SQL`).
- SQLite: functions the library registers on each connection it touches
  (``iofence_token()``, ``iofence_unfenced()``, ``iofence_set_token(t)``); the triggers call
  them, so a connection without them (the ``sqlite3`` shell, another program) is refused
  with "no such function".

What the judge decides, for a row of a fenced table (``f`` its fence column):

- no token and no opt-out: refused (:data:`SQLSTATE_UNFENCED`);
- an update or delete with a token below ``OLD.f`` (or a NULL fence): refused
  (:data:`SQLSTATE_STALE`); an accepted insert or update gets ``f = token`` (C4), so a
  plain write of the current holder raises the fence;
- a write that lowers a fence, a hard delete of a table with a tombstone flag (or of a
  register row) and ``TRUNCATE``: refused (:data:`SQLSTATE_REFUSED`); the opt-out lets the
  hard delete and ``TRUNCATE`` through, never the lowering.

The triggers carry a signature (:meth:`Judged.signature`: the judge's version and the
columns it was made for) in a comment; the guards, the session hook and the unit of work
read it once per table and connection (:data:`PG_CHECK_QUERY`, :data:`SQLITE_CHECK_QUERY`,
:data:`MARIADB_CHECK_QUERY`, :func:`verdict`) and refuse to write a table whose triggers are
missing or outdated.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fence._sql_dialect import SQLSTATE_REFUSED, SQLSTATE_STALE, SQLSTATE_UNFENCED

__all__ = [
    "CASCADE_VERDICT",
    "JUDGE_VERSION",
    "MARIADB_CHECK_QUERY",
    "MARIADB_UNFENCED_SQL",
    "MAX_TOKEN",
    "PG_CHECK_QUERY",
    "PG_REWRITE_CHECK_QUERY",
    "PG_REWRITE_TRIGGER",
    "PG_TRIGGERS",
    "ROW_TOKEN_VARIABLE",
    "SQLITE_CHECK_QUERY",
    "SQLSTATE_REFUSED",
    "SQLSTATE_STALE",
    "SQLSTATE_UNFENCED",
    "TOKEN_SETTING",
    "TOKEN_VARIABLE",
    "UNFENCED_SETTING",
    "UNFENCED_SQL",
    "UNFENCED_VARIABLE",
    "Judged",
    "SQLiteState",
    "mariadb_drop_ddl",
    "mariadb_judge_ddl",
    "mariadb_qualified",
    "mariadb_trigger_names",
    "parse_signature",
    "pg_drop_ddl",
    "pg_judge_ddl",
    "pg_qualified",
    "pg_rewrite_judge_ddl",
    "sqlite_drop_ddl",
    "sqlite_judge_ddl",
    "verdict",
]

#: The version of the judge. A trigger of another version is outdated: the guards refuse
#: its table until the DDL of this version replaces it (``CREATE OR REPLACE``).
JUDGE_VERSION = 1

#: The highest token (C1), also the judge's bound.
MAX_TOKEN = 2**53 - 1

#: The transaction-local setting (PostgreSQL) that carries the writing transaction's token.
TOKEN_SETTING = "iofence.token"  # noqa: S105 - a setting's name, no secret

#: The transaction-local setting of the opt-out: ``on`` lets a write without a token
#: through (a fence is still never lowered).
UNFENCED_SETTING = "iofence.unfenced"

#: The opt-out, for the rest of the transaction, as a statement (PostgreSQL).
UNFENCED_SQL = f"SET LOCAL {UNFENCED_SETTING} = on"

#: The triggers of a fenced table on PostgreSQL, by the event each judges. Named to sort
#: after the application's own: PostgreSQL fires the ``BEFORE`` triggers of an event in the
#: order of their names, and the judge must see the row as it will be written.
PG_TRIGGERS = {
    "INSERT": "zz_iofence_insert",
    "UPDATE": "zz_iofence_update",
    "DELETE": "zz_iofence_delete",
    "TRUNCATE": "zz_iofence_truncate",
}

#: What the check of a table's triggers reads (PostgreSQL): whether the table exists, the
#: session's ``session_replication_role`` (under ``replica`` the ordinary triggers do not
#: fire), and for each trigger of the table its name, whether it is enabled, and the
#: comment of its function; at least one row. Parameter ``{param}``: the table, quoted.
PG_CHECK_QUERY = (
    "SELECT pg_catalog.to_regclass({param}) IS NOT NULL, "
    "pg_catalog.current_setting('session_replication_role'), t.tgname, t.tgenabled, "
    "pg_catalog.obj_description(t.tgfoid, 'pg_proc') "
    "FROM (SELECT 1) AS one LEFT JOIN pg_catalog.pg_trigger AS t "
    "ON t.tgrelid = pg_catalog.to_regclass({param}) AND NOT t.tgisinternal"
)

#: What the check of a table's triggers reads (SQLite): the table's row and its triggers'
#: (type, name, text). ``{schema}``: an attached database's name and a dot, or nothing;
#: ``{param}``: the table's name.
SQLITE_CHECK_QUERY = (
    "SELECT type, name, sql FROM {schema}sqlite_master "
    "WHERE type IN ('table', 'trigger') AND lower(tbl_name) = lower({param})"
)

_SIGNATURE = re.compile(r"iofence judge (\d+):((?: \w+=\S+)*)")


def _ident(name: str) -> str:
    """``name`` as a quoted identifier (its case kept, as the catalogue spells it)."""
    return '"' + name.replace('"', '""') + '"'


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def pg_qualified(table: str, schema: str | None = None) -> str:
    """``table`` (in ``schema``) quoted for PostgreSQL: also what a ``regclass`` reads."""
    return _ident(table) if schema is None else f"{_ident(schema)}.{_ident(table)}"


@dataclass(frozen=True, slots=True)
class Judged:
    """A table the judge guards, as its triggers are made for it.

    Attributes:
        table: the table's name, as the catalogue spells it.
        schema: its schema (PostgreSQL), ``None`` for the search path.
        fence: the fence column.
        tombstone: the tombstone flag; with it a hard delete is refused (it would drop the
            fence a tombstone keeps, C7).
        register: the table is a fence register: its rows are never deleted.
        optional: a ``fenced_version()`` table: without a token a write keeps plain
            optimistic concurrency and passes, though it never lowers the fence.
        key: the key columns, for SQLite's triggers that raise the fence after a plain
            write (``None``: the ``rowid``).
        check_key: what a check that found the triggers in place is remembered by.
    """

    table: str
    schema: str | None = None
    fence: str = "fence"
    tombstone: str | None = None
    register: bool = False
    optional: bool = False
    key: tuple[str, ...] | None = None
    #: What a check that found the triggers in place is remembered by: the table, the kind
    #: and the fence column (what a writer's verdict depends on).
    check_key: tuple[str | None, str, str, str] = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "check_key", (self.schema, self.table, self.kind, self.fence))

    @property
    def kind(self) -> str:
        """``"register"`` or ``"rows"``."""
        return "register" if self.register else "rows"

    def signature(self) -> str:
        """The text the triggers carry: the judge's version and what it was made for."""
        return (
            f"iofence judge {JUDGE_VERSION}: kind={self.kind} fence={self.fence} "
            f"tombstone={self.tombstone or '-'} optional={int(self.optional)}"
        )

    @property
    def qualified(self) -> str:
        """The table, quoted for PostgreSQL."""
        return pg_qualified(self.table, self.schema)

    @property
    def function(self) -> str:
        """The trigger function's name (PostgreSQL), in the table's schema, quoted."""
        name = f"iofence_judge_{self.table}"
        if len(name.encode()) > 63:  # PostgreSQL cuts identifiers at 63 bytes
            digest = hashlib.sha1(self.table.encode(), usedforsecurity=False).hexdigest()[:8]
            cut = self.table.encode()[:40].decode(errors="ignore")
            name = f"iofence_judge_{cut}_{digest}"
        return pg_qualified(name, self.schema)

    def hint(self, dialect: str) -> str:
        """What to run to install (or upgrade) the triggers, for messages."""
        schema = f" --schema {self.schema}" if self.schema else ""
        if self.register:
            what = f"--register {self.table}{schema}"
            api = "fence.adapters.sql.install_triggers(conn, register_table)"
        else:
            name = f"{self.schema}.{self.table}" if self.schema else self.table
            flag = "" if self.tombstone == "deleted" else " --no-tombstone"
            what = f"--no-register{flag} --table {name}"
            api = "fence.adapters.sql.install_triggers(conn, table)"
        return (
            f"install them with `fence ddl --dialect {dialect} --triggers-only {what}` (or "
            f"{api}, fence.adapters.psycopg.install_triggers(conn, ...)), in a migration"
        )


def parse_signature(text: str | None) -> dict[str, str] | None:
    """The fields of a signature (``version`` and the ``key=value`` pairs), or ``None``."""
    if not text:
        return None
    found = _SIGNATURE.search(text)
    if found is None:
        return None
    fields = dict(pair.split("=", 1) for pair in found.group(2).split())
    fields["version"] = found.group(1)
    return fields


def _mismatch(found: str | None, expected: Judged) -> str | None:
    """How the signature ``found`` differs from what ``expected`` needs, or ``None``.

    The version, the kind and the fence column must match. The tombstone flag and the
    ``optional`` mode are the table's own: they decide what the judge lets other writers do
    (hard deletes, writes without a token), never how a fenced write is judged.
    """
    fields = parse_signature(found)
    if fields is None:
        return "they carry no iofence signature"
    if fields["version"] != str(JUDGE_VERSION):
        return f"they are version {fields['version']}, this iofence needs {JUDGE_VERSION}"
    for name, value in (("kind", expected.kind), ("fence", expected.fence)):
        if fields.get(name) != value:
            return f"they were made for {name}={fields.get(name)}, the writer uses {name}={value}"
    return None


def verdict(
    dialect: str, rows: Iterable[Sequence[object]], expected: Judged
) -> tuple[bool, str | None]:
    """Whether the table exists and what is wrong with its triggers (``None``: they are in
    place and current), from the rows of the dialect's check query.

    Args:
        dialect: ``"postgresql"``, ``"sqlite"``, ``"mariadb"`` or ``"mysql"``.
        rows: the rows of :data:`PG_CHECK_QUERY`, :data:`SQLITE_CHECK_QUERY` or
            :data:`MARIADB_CHECK_QUERY`.
        expected: the table as the caller writes it.
    """
    rows = list(rows)
    if dialect in ("mariadb", "mysql"):
        return _mariadb_verdict(rows, expected)
    if dialect == "sqlite":
        exists = any(kind == "table" for kind, _, _ in rows)
        names = {str(name): str(sql or "") for kind, name, sql in rows if kind == "trigger"}
        if not exists:
            return False, None
        wanted = _sqlite_names(expected)
        missing = [name for name in wanted if name not in names]
        if missing:
            return True, f"the triggers of {expected.table} are missing ({', '.join(missing)})"
        for name in wanted:
            why = _mismatch(names[name], expected)
            if why is not None:
                return True, f"the triggers of {expected.table} are outdated: {why}"
        return True, None
    if not rows or not rows[0][0]:
        return False, None
    role = str(rows[0][1])
    found = {str(r[2]): (str(r[3]), r[4]) for r in rows if r[2] is not None}
    missing = [name for name in PG_TRIGGERS.values() if name not in found]
    if missing:
        return True, f"the triggers of {expected.qualified} are missing ({', '.join(missing)})"
    for name in PG_TRIGGERS.values():
        enabled, comment = found[name]
        if enabled == "D" or (enabled == "O" and role == "replica"):
            where = "disabled" if enabled == "D" else "not fired in this session"
            return True, (
                f"the trigger {name} of {expected.qualified} is {where} "
                f"(session_replication_role = {role}); nothing would judge the writes"
            )
        why = _mismatch(comment if isinstance(comment, str) else None, expected)
        if why is not None:
            return True, f"the triggers of {expected.qualified} are outdated: {why}"
    return True, None


# -- PostgreSQL -----------------------------------------------------------------------------

_PG_FUNCTION = """\
CREATE OR REPLACE FUNCTION {function}() RETURNS trigger LANGUAGE plpgsql AS $iofence$
DECLARE
    tok bigint := NULLIF(pg_catalog.current_setting('{token}', true), '')::bigint;
    opted boolean;
    scope text;
BEGIN
    -- The guard's own write, accepted: its token, not below the row's fence; and an insert
    -- with a token, which takes the token as its fence (C4).
    IF TG_OP = 'UPDATE' AND NEW.{f} = tok AND OLD.{f} <= tok AND tok BETWEEN 1 AND {max} THEN
        RETURN NEW;
    ELSIF TG_OP = 'INSERT' AND tok BETWEEN 1 AND {max} THEN
        NEW.{f} := tok;
        RETURN NEW;
    END IF;
    IF tok IS NOT NULL AND (tok < 1 OR tok > {max}) THEN
        RAISE EXCEPTION USING ERRCODE = '{unfenced}', TABLE = TG_TABLE_NAME,
            SCHEMA = TG_TABLE_SCHEMA,
            MESSAGE = 'iofence: unfenced ' || lower(TG_OP) || ': ' || tok || ' is not a token';
    END IF;
    opted := pg_catalog.current_setting('{optout}', true) IS NOT DISTINCT FROM 'on';
    IF TG_OP = 'TRUNCATE' THEN
        IF opted THEN
            RETURN NULL;
        END IF;
        RAISE EXCEPTION USING ERRCODE = '{refused}', TABLE = TG_TABLE_NAME,
            SCHEMA = TG_TABLE_SCHEMA, HINT = '{hint}',
            MESSAGE = 'iofence: refused TRUNCATE of ' || TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME
                || ': it would drop every fence';
    END IF;
    IF tok IS NULL THEN
        IF {refuse_no_token} THEN
            RAISE EXCEPTION USING ERRCODE = '{unfenced}', TABLE = TG_TABLE_NAME,
                SCHEMA = TG_TABLE_SCHEMA, HINT = '{hint}',
                MESSAGE = 'iofence: unfenced ' || lower(TG_OP) || ' of ' || TG_TABLE_SCHEMA
                    || '.' || TG_TABLE_NAME || ': the transaction carries no fencing token';
        END IF;
        IF TG_OP = 'UPDATE'
                AND (NEW.{f} < OLD.{f} OR (NEW.{f} IS NULL AND OLD.{f} IS NOT NULL)) THEN
            RAISE EXCEPTION USING ERRCODE = '{refused}', TABLE = TG_TABLE_NAME,
                SCHEMA = TG_TABLE_SCHEMA,
                MESSAGE = 'iofence: refused update of ' || TG_TABLE_SCHEMA || '.'
                    || TG_TABLE_NAME || ': it would lower the fence from ' || OLD.{f} || ' to '
                    || coalesce(NEW.{f}::text, 'NULL');
        END IF;
        IF TG_OP = 'DELETE' THEN
            RETURN OLD;
        END IF;
        RETURN NEW;
    END IF;
    IF OLD.{f} IS NULL OR tok < OLD.{f} THEN
        scope := {scope};
        RAISE EXCEPTION USING ERRCODE = '{stale}', TABLE = TG_TABLE_NAME,
            SCHEMA = TG_TABLE_SCHEMA,
            MESSAGE = 'iofence: stale token ' || tok || ' for ' || scope || ', whose fence is '
                || coalesce(OLD.{f}::text, 'NULL'),
            DETAIL = pg_catalog.json_build_object(
                'scope', scope, 'token', tok, 'fence', OLD.{f})::text;
    END IF;
    IF TG_OP = 'DELETE' THEN
{delete}        RETURN OLD;
    END IF;
    IF NEW.{f} < OLD.{f} THEN
        RAISE EXCEPTION USING ERRCODE = '{refused}', TABLE = TG_TABLE_NAME,
            SCHEMA = TG_TABLE_SCHEMA,
            MESSAGE = 'iofence: refused update of ' || TG_TABLE_SCHEMA || '.' || TG_TABLE_NAME
                || ': it would lower the fence from ' || OLD.{f} || ' to ' || NEW.{f};
    END IF;
    NEW.{f} := tok;
    RETURN NEW;
END
$iofence$"""

_PG_HARD_DELETE = """\
        IF NOT opted THEN
            RAISE EXCEPTION USING ERRCODE = '{refused}', TABLE = TG_TABLE_NAME,
                SCHEMA = TG_TABLE_SCHEMA, HINT = '{hint}',
                MESSAGE = 'iofence: refused hard delete from ' || TG_TABLE_SCHEMA || '.'
                    || TG_TABLE_NAME || ': {why}';
        END IF;
"""

# The row's scope in a stale write's error: the table and its primary key, as the guards
# name it (``accounts(42)``, ``accounts('a', 2)``); read from the catalogue only then.
_PG_ROW_SCOPE = (
    "TG_TABLE_NAME || coalesce('(' || (SELECT pg_catalog.string_agg(CASE "
    "pg_catalog.jsonb_typeof(o.j -> a.attname) WHEN 'string' THEN pg_catalog.quote_literal("
    "o.j ->> a.attname) ELSE o.j ->> a.attname END, ', ' ORDER BY k.n) FROM pg_catalog.pg_index i "
    "CROSS JOIN LATERAL pg_catalog.unnest(i.indkey) WITH ORDINALITY AS k(attnum, n) "
    "JOIN pg_catalog.pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum "
    "CROSS JOIN (SELECT pg_catalog.to_jsonb(OLD) AS j) o "
    "WHERE i.indrelid = TG_RELID AND i.indisprimary) || ')', '')"
)


def _in_message(text: str) -> str:
    """``text`` inside a quoted literal of the function's body."""
    return text.replace("'", "''")


def pg_judge_ddl(judged: Judged) -> list[str]:
    """The judge of one table on PostgreSQL: its function, the function's signature, and
    the four triggers. Running it again replaces them (an upgrade); run it in a transaction
    so that the table is never without a judge.

    Args:
        judged: the table and its columns.
    """
    f = _ident(judged.fence)
    opt_out_hint = f"a deliberate unfenced write opts out first: {UNFENCED_SQL}"
    if judged.register:
        delete = _PG_HARD_DELETE.format(
            why="a fence register keeps its rows for ever (they are the tombstones)",
            refused=SQLSTATE_REFUSED,
            hint=opt_out_hint,
        )
        scope = f"OLD.{_ident('scope')}"
    elif judged.tombstone is not None:
        delete = _PG_HARD_DELETE.format(
            why=_in_message(
                f"it would drop the fence that the tombstone flag {judged.tombstone} keeps; "
                "delete through a guard (a soft delete)"
            ),
            refused=SQLSTATE_REFUSED,
            hint=opt_out_hint,
        )
        scope = _PG_ROW_SCOPE
    else:
        delete = ""
        scope = _PG_ROW_SCOPE
    function = _PG_FUNCTION.format(
        function=judged.function,
        token=TOKEN_SETTING,
        optout=UNFENCED_SETTING,
        f=f,
        max=MAX_TOKEN,
        unfenced=SQLSTATE_UNFENCED,
        stale=SQLSTATE_STALE,
        refused=SQLSTATE_REFUSED,
        hint="write through a guard or a session bound to a lease; " + opt_out_hint,
        # Without a token a fenced_version() model keeps plain optimistic concurrency.
        refuse_no_token="false" if judged.optional else "NOT opted",
        scope=scope,
        delete=delete,
    )
    out = [
        function,
        f"COMMENT ON FUNCTION {judged.function}() IS {_literal(judged.signature())}",
    ]
    for event, name in PG_TRIGGERS.items():
        level = "STATEMENT" if event == "TRUNCATE" else "ROW"
        out.append(f"DROP TRIGGER IF EXISTS {name} ON {judged.qualified}")
        out.append(
            f"CREATE TRIGGER {name} BEFORE {event} ON {judged.qualified} "
            f"FOR EACH {level} EXECUTE FUNCTION {judged.function}()"
        )
    return out


#: The name of the event trigger that judges table rewrites (PostgreSQL).
PG_REWRITE_TRIGGER = "iofence_rewrite"

_PG_REWRITE = """\
CREATE OR REPLACE FUNCTION {function}() RETURNS event_trigger LANGUAGE plpgsql AS $iofence$
DECLARE
    rewritten oid := pg_catalog.pg_event_trigger_table_rewrite_oid();
BEGIN
    IF pg_catalog.current_setting('{optout}', true) IS NOT DISTINCT FROM 'on' THEN
        RETURN;
    END IF;
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_trigger
               WHERE tgrelid = rewritten AND tgname = '{update}') THEN
        RAISE EXCEPTION USING ERRCODE = '{refused}', HINT = '{hint}',
            MESSAGE = 'iofence: refused rewrite of ' || rewritten::pg_catalog.regclass
                || ': ALTER TABLE would rewrite fenced rows where no row trigger judges them';
    END IF;
END
$iofence$"""


def pg_rewrite_judge_ddl(schema: str | None = None) -> list[str]:
    """The judge of table rewrites (PostgreSQL): an event trigger that refuses an ``ALTER
    TABLE`` (or ``ALTER TYPE``) that rewrites a fenced table, outside the opt-out. A rewrite
    fires no row trigger, so ``ALTER COLUMN ... TYPE ... USING`` could change fences and
    data unjudged. One per database; creating an event trigger needs a superuser.

    Args:
        schema: the schema of its function (default: the first of the search path).
    """
    function = pg_qualified("iofence_judge_rewrite", schema)
    body = _PG_REWRITE.format(
        function=function,
        optout=UNFENCED_SETTING,
        update=PG_TRIGGERS["UPDATE"],
        refused=SQLSTATE_REFUSED,
        hint=f"a migration that rewrites a fenced table opts out first: {UNFENCED_SQL}",
    )
    return [
        body,
        f"COMMENT ON FUNCTION {function}() IS "
        + _literal(f"iofence judge {JUDGE_VERSION}: kind=rewrite"),
        f"DROP EVENT TRIGGER IF EXISTS {PG_REWRITE_TRIGGER}",
        f"CREATE EVENT TRIGGER {PG_REWRITE_TRIGGER} ON table_rewrite EXECUTE FUNCTION {function}()",
    ]


#: Whether the judge of table rewrites is in place (PostgreSQL): one row, its function's
#: signature, or none.
PG_REWRITE_CHECK_QUERY = (
    "SELECT pg_catalog.obj_description(e.evtfoid, 'pg_proc') FROM pg_catalog.pg_event_trigger e "
    "WHERE e.evtname = 'iofence_rewrite' AND e.evtenabled <> 'D'"
)


def pg_drop_ddl(judged: Judged) -> list[str]:
    """The statements that remove the judge of a table (PostgreSQL)."""
    out = [f"DROP TRIGGER IF EXISTS {name} ON {judged.qualified}" for name in PG_TRIGGERS.values()]
    out.append(f"DROP FUNCTION IF EXISTS {judged.function}()")
    return out


# -- SQLite ---------------------------------------------------------------------------------


def _sqlite_names(judged: Judged) -> list[str]:
    base = re.sub(r"\W", "_", judged.table)
    return [
        f"iofence_{base}_{what}"
        for what in ("insert", "update", "delete", "insert_fence", "update_fence")
    ]


def sqlite_judge_ddl(judged: Judged) -> list[str]:
    """The judge of one table on SQLite: ``BEFORE`` triggers that refuse (``RAISE(ABORT,
    'iofence: ...')``), and ``AFTER`` triggers that raise the fence of a plain write of the
    current holder to its token (SQLite's ``BEFORE`` triggers cannot assign ``NEW``).
    Running it again replaces them.

    The triggers call functions that iofence registers on each connection it makes
    (``iofence_token()``, ``iofence_unfenced()``); a connection without them cannot write
    the table at all.

    Args:
        judged: the table and its columns.
    """
    t = _ident(judged.table)
    f = _ident(judged.fence)
    sig = f"/* {judged.signature()} */"
    names = _sqlite_names(judged)
    insert, update, delete, insert_fence, update_fence = names
    name = judged.table.replace("'", "''")
    if judged.key:
        same_row = " AND ".join(f"{_ident(k)} = NEW.{_ident(k)}" for k in judged.key)
    else:
        same_row = "rowid = NEW.rowid"
    # One statement per trigger and one call of iofence_token() per trigger and row: each
    # statement of a trigger program and each call into Python costs about a microsecond
    # per row. The text is joined, never str.format()ed: a table's name may hold braces.
    unfenced = "0" if judged.optional else "iofence_unfenced() = 0"

    def tokenless(op: str) -> str:
        return (
            f"CASE WHEN {unfenced} THEN RAISE(ABORT, 'iofence: unfenced {op} of {name}: the "
            "transaction carries no fencing token') END"
        )

    def judge_old(op: str, extra: str) -> str:
        return (
            f"SELECT CASE WHEN tok IS NULL THEN {tokenless(op)} "  # noqa: S608 - quoted names
            f"WHEN OLD.{f} IS NULL OR tok < OLD.{f} THEN "
            f"RAISE(ABORT, 'iofence: stale token for a row of {name}') END{extra} "
            "FROM (SELECT iofence_token() AS tok);"
        )

    lower = (
        f", CASE WHEN NEW.{f} < OLD.{f} OR (NEW.{f} IS NULL AND OLD.{f} IS NOT NULL) THEN "
        f"RAISE(ABORT, 'iofence: refused update of {name}: it would lower the fence') END"
    )
    hard = ""
    if judged.register or judged.tombstone is not None:
        hard = (
            ", CASE WHEN iofence_unfenced() = 0 THEN RAISE(ABORT, 'iofence: refused hard "  # noqa: S608
            f"delete from {name}: it would drop a fence') END"
        )
    # Text from quoted identifiers and literals of this module only: no value reaches it.
    out = []
    for trigger in names:
        out.append(f"DROP TRIGGER IF EXISTS {_ident(trigger)}")
    out.append(
        f"CREATE TRIGGER {_ident(insert)} BEFORE INSERT ON {t} FOR EACH ROW "
        f"WHEN iofence_token() IS NULL BEGIN {sig} SELECT {tokenless('insert')}; END"
    )
    out.append(
        f"CREATE TRIGGER {_ident(update)} BEFORE UPDATE ON {t} FOR EACH ROW BEGIN {sig} "
        f"{judge_old('update', lower)} END"
    )
    out.append(
        f"CREATE TRIGGER {_ident(delete)} BEFORE DELETE ON {t} FOR EACH ROW BEGIN {sig} "
        f"{judge_old('delete', hard)} END"
    )
    # A plain write of the current holder raises the fence to its token (C4).
    for trigger, event in ((insert_fence, "INSERT"), (update_fence, "UPDATE")):
        out.append(
            f"CREATE TRIGGER {_ident(trigger)} AFTER {event} ON {t} FOR EACH ROW "  # noqa: S608 - quoted identifiers
            f"WHEN NEW.{f} IS NOT coalesce(iofence_token(), NEW.{f}) BEGIN {sig} "
            f"UPDATE {t} SET {f} = iofence_token() WHERE {same_row}; END"
        )
    return out


def sqlite_drop_ddl(judged: Judged) -> list[str]:
    """The statements that remove the judge of a table (SQLite)."""
    return [f"DROP TRIGGER IF EXISTS {_ident(name)}" for name in _sqlite_names(judged)]


# -- MariaDB (and MySQL) --------------------------------------------------------------------

#: The session variable (MariaDB, MySQL) that carries a transaction's token, set by a
#: ``SET`` of its own (``SET @iofence_token = 42``): another program's plain SQL, or
#: :func:`fence.adapters.sql`'s ``set_token``. A session variable outlives the transaction:
#: whoever sets it clears it when the transaction ends (the library does, for its own).
TOKEN_VARIABLE = "@iofence_token"  # noqa: S105 - a variable's name, no secret

#: The session variable (MariaDB, MySQL) that carries the token of one row of a fenced
#: statement: the statement assigns it as the row is evaluated (``fence =
#: (@iofence_row_token := t)``), before the row's ``BEFORE`` trigger fires, and the
#: judge's ``AFTER`` trigger clears it once the row is written, so an accepted write
#: leaves no token in the session and costs no round trip. A statement that fails between
#: the two leaves it set: the library clears it when the transaction ends.
ROW_TOKEN_VARIABLE = "@iofence_row_token"  # noqa: S105 - a variable's name, no secret

#: The session variable (MariaDB, MySQL) of the opt-out: ``1`` lets a write without a
#: token through (a fence is still never lowered).
UNFENCED_VARIABLE = "@iofence_unfenced"

#: The opt-out (MariaDB, MySQL) as a statement; it lasts until the library clears it at the
#: end of the transaction, or until ``SET @iofence_unfenced = NULL``.
MARIADB_UNFENCED_SQL = f"SET {UNFENCED_VARIABLE} = 1"

#: What the check of a table's triggers reads (MariaDB, MySQL): one row per trigger of the
#: table (or one with NULLs), each with the table's name, the names of the foreign keys
#: of the table that write it by themselves (``CASCADE``, ``SET NULL``, ``SET DEFAULT``:
#: InnoDB's cascades fire no trigger), and the trigger's name, event, timing and body;
#: none if the table does not exist. ``{schema}``: the schema as a literal or
#: ``DATABASE()``; ``{param}``: the table's name.
MARIADB_CHECK_QUERY = (
    "SELECT t.TABLE_NAME, (SELECT GROUP_CONCAT(rc.CONSTRAINT_NAME) "
    "FROM information_schema.REFERENTIAL_CONSTRAINTS AS rc "
    "WHERE rc.CONSTRAINT_SCHEMA = t.TABLE_SCHEMA AND rc.TABLE_NAME = t.TABLE_NAME "
    "AND (rc.DELETE_RULE NOT IN ('RESTRICT', 'NO ACTION') "
    "OR rc.UPDATE_RULE NOT IN ('RESTRICT', 'NO ACTION'))), "
    "tr.TRIGGER_NAME, tr.EVENT_MANIPULATION, tr.ACTION_TIMING, tr.ACTION_STATEMENT "
    "FROM information_schema.TABLES AS t LEFT JOIN information_schema.TRIGGERS AS tr "
    "ON tr.EVENT_OBJECT_SCHEMA = t.TABLE_SCHEMA AND tr.EVENT_OBJECT_TABLE = t.TABLE_NAME "
    "WHERE t.TABLE_SCHEMA = {schema} AND t.TABLE_NAME = {param}"
)

#: What the verdict on a table says when a foreign key cascades into it (MariaDB, MySQL).
CASCADE_VERDICT = "has foreign keys that write it by themselves"

# The judge's triggers by what each is for: the three that judge, and the two that clear
# the row's token once the row is written.
_MARIADB_TRIGGERS = {
    "INSERT": ("BEFORE", "INSERT", "insert"),
    "UPDATE": ("BEFORE", "UPDATE", "update"),
    "DELETE": ("BEFORE", "DELETE", "delete"),
    "INSERTED": ("AFTER", "INSERT", "inserted"),
    "UPDATED": ("AFTER", "UPDATE", "updated"),
}


def _mariadb_ident(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def _mariadb_literal(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "''") + "'"


def mariadb_qualified(table: str, schema: str | None = None) -> str:
    """``table`` (in ``schema``) quoted for MariaDB and MySQL."""
    t = _mariadb_ident(table)
    return t if schema is None else f"{_mariadb_ident(schema)}.{t}"


def mariadb_trigger_names(judged: Judged) -> dict[str, str]:
    """The names of the judge's triggers of a table (MariaDB, MySQL): ``INSERT``,
    ``UPDATE``, ``DELETE`` (``BEFORE``, they judge) and ``INSERTED``, ``UPDATED``
    (``AFTER``, they clear the row's token); at most 64 characters, as MariaDB allows."""
    base = judged.table
    if len(f"iofence_{base}_inserted") > 64:
        digest = hashlib.sha1(base.encode(), usedforsecurity=False).hexdigest()[:8]
        base = f"{base[:40]}_{digest}"
    return {what: f"iofence_{base}_{suffix}" for what, (_, _, suffix) in _MARIADB_TRIGGERS.items()}


# The signature is a string, not a comment: the mariadb and mysql clients drop comments
# (unless --comments) before they send a statement. The row's token comes first, the
# transaction's after it. A refused write takes both out of the session (before SIGNAL):
# what follows in the transaction writes without one, as on PostgreSQL after an error.
_MARIADB_TRIGGER = """\
CREATE {replace}TRIGGER {name} BEFORE {event} ON {table} FOR EACH ROW
BEGIN
    DECLARE signature VARCHAR(200) DEFAULT '{signature}';
    DECLARE tok BIGINT DEFAULT COALESCE({row_token}, {token});
    DECLARE opted BOOLEAN DEFAULT {optout} <=> 1;
    DECLARE msg VARCHAR(1024);
    IF tok IS NOT NULL AND (tok < 1 OR tok > {max}) THEN
        SET {row_token} = NULL, {token} = NULL;
        SET msg = CONCAT('iofence: unfenced {op} of ', {tname}, ': ', tok, ' is not a token');
        SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = msg;
    END IF;
{body}END"""

_MARIADB_CLEAR = """\
CREATE {replace}TRIGGER {name} AFTER {event} ON {table} FOR EACH ROW
BEGIN
    DECLARE signature VARCHAR(200) DEFAULT '{signature}';
    SET {row_token} = NULL;
END"""

_MARIADB_UNFENCED = """\
        IF NOT opted{optional} THEN
            SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT =
                'iofence: unfenced {op} of {name}: the transaction carries no fencing token';
        END IF;
"""

_MARIADB_STALE = """\
        IF OLD.{f} IS NULL OR tok < OLD.{f} THEN
            SET {row_token} = NULL, {token} = NULL;
            SET msg = CONCAT('iofence: stale token ', tok, ' for ', {scope},
                ', whose fence is ', COALESCE(OLD.{f}, 'NULL'));
            SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = msg;
        END IF;
"""

_MARIADB_LOWER = """\
        IF NEW.{f} < OLD.{f} OR (NEW.{f} IS NULL AND OLD.{f} IS NOT NULL) THEN
            SET msg = CONCAT('iofence: refused update of ', {tname},
                ': it would lower the fence from ', OLD.{f}, ' to ', COALESCE(NEW.{f}, 'NULL'));
            SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = msg;
        END IF;
"""

_MARIADB_HARD_DELETE = """\
        IF NOT opted THEN
            SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT =
                'iofence: refused hard delete from {name}: {why}';
        END IF;
"""


def _mariadb_scope(judged: Judged) -> str:
    """The row's scope in a stale write's error, as the guards name it (``accounts(42)``,
    ``accounts('a', 2)``): text keys quoted, numbers not."""
    if judged.register:
        return f"OLD.{_mariadb_ident('scope')}"
    name = _mariadb_literal(judged.table)
    if not judged.key:
        return name
    parts = []
    for column in judged.key:
        old = f"OLD.{_mariadb_ident(column)}"
        parts.append(
            f"IF(JSON_TYPE(JSON_EXTRACT(JSON_OBJECT('v', {old}), '$.v')) = 'STRING', "
            f"QUOTE({old}), {old})"
        )
    return f"CONCAT({name}, '(', CONCAT_WS(', ', {', '.join(parts)}), ')')"


def mariadb_judge_ddl(judged: Judged, *, replace: bool = True) -> list[str]:
    """The judge of one table on MariaDB (and MySQL): three ``BEFORE`` row triggers
    (``INSERT``, ``UPDATE``, ``DELETE``) that refuse with ``SIGNAL SQLSTATE '45000'`` and a
    message ``iofence: ...``, and set the fence of an accepted write to the token (C4); and
    two ``AFTER`` row triggers (``INSERT``, ``UPDATE``) that clear the row's token once the
    row is written. The token is the row's (:data:`ROW_TOKEN_VARIABLE`, set by the fenced
    statement) or else the transaction's (:data:`TOKEN_VARIABLE`); the opt-out is
    :data:`UNFENCED_VARIABLE`.

    ``TRUNCATE`` and InnoDB's foreign-key cascades fire no trigger on MariaDB: see
    ``docs/mariadb.md`` for the privilege that refuses the first, and the check
    (:data:`MARIADB_CHECK_QUERY`) that refuses a table a cascade can write.

    Args:
        judged: the table and its columns.
        replace: ``CREATE OR REPLACE TRIGGER`` (MariaDB: each trigger is replaced in one
            step, the table is never without it); ``False``: ``DROP TRIGGER IF EXISTS``
            then ``CREATE TRIGGER`` (MySQL, which has no ``OR REPLACE`` for triggers).
    """
    f = _mariadb_ident(judged.fence)
    name = judged.table.replace("\\", "\\\\").replace("'", "''")
    tname = _mariadb_literal(judged.table)
    names = mariadb_trigger_names(judged)
    optional = " AND FALSE" if judged.optional else ""
    scope = _mariadb_scope(judged)

    def unfenced(op: str) -> str:
        return _MARIADB_UNFENCED.format(op=op, name=name, optional=optional)

    def stale() -> str:
        return _MARIADB_STALE.format(
            f=f, token=TOKEN_VARIABLE, row_token=ROW_TOKEN_VARIABLE, scope=scope
        )

    lower = _MARIADB_LOWER.format(f=f, tname=tname)
    insert = (
        f"    IF tok IS NOT NULL THEN\n        SET NEW.{f} = tok;\n    ELSE\n"
        f"{unfenced('insert')}    END IF;\n"
    )
    update = (
        f"    IF tok IS NULL THEN\n{unfenced('update')}{lower}    ELSE\n{stale()}{lower}"
        f"        SET NEW.{f} = tok;\n    END IF;\n"
    )
    hard = ""
    if judged.register:
        hard = _MARIADB_HARD_DELETE.format(
            name=name, why="a fence register keeps its rows for ever (they are the tombstones)"
        )
    elif judged.tombstone is not None:
        why = (
            f"it would drop the fence that the tombstone flag {judged.tombstone} keeps; "
            "delete through a guard (a soft delete)"
        ).replace("'", "''")
        hard = _MARIADB_HARD_DELETE.format(name=name, why=why)
    delete = f"    IF tok IS NULL THEN\n{unfenced('delete')}    ELSE\n{stale()}{hard}    END IF;\n"
    bodies = {"INSERT": insert, "UPDATE": update, "DELETE": delete}
    out: list[str] = []
    for what, (timing, event, _) in _MARIADB_TRIGGERS.items():
        trigger = mariadb_qualified(names[what], judged.schema)
        if not replace:
            out.append(f"DROP TRIGGER IF EXISTS {trigger}")
        out.append(
            (_MARIADB_TRIGGER if timing == "BEFORE" else _MARIADB_CLEAR).format(
                replace="OR REPLACE " if replace else "",
                name=trigger,
                event=event,
                table=mariadb_qualified(judged.table, judged.schema),
                signature=judged.signature(),
                token=TOKEN_VARIABLE,
                row_token=ROW_TOKEN_VARIABLE,
                optout=UNFENCED_VARIABLE,
                max=MAX_TOKEN,
                op=event.lower(),
                tname=tname,
                body=bodies.get(what, ""),
            )
        )
    return out


def mariadb_drop_ddl(judged: Judged) -> list[str]:
    """The statements that remove the judge of a table (MariaDB, MySQL)."""
    return [
        f"DROP TRIGGER IF EXISTS {mariadb_qualified(name, judged.schema)}"
        for name in mariadb_trigger_names(judged).values()
    ]


def _mariadb_verdict(rows: list[Sequence[object]], expected: Judged) -> tuple[bool, str | None]:
    if not rows:
        return False, None
    table = expected.table
    cascades = rows[0][1]
    if cascades:
        return True, (
            f"{table} {CASCADE_VERDICT} ({cascades}: CASCADE, SET NULL or SET DEFAULT), and "
            "InnoDB's cascades fire no trigger, so nothing would judge those writes; make "
            "them RESTRICT (or NO ACTION) and delete the rows through a guard"
        )
    found = {str(r[2]): (str(r[3]), str(r[4]), r[5]) for r in rows if r[2] is not None}
    names = mariadb_trigger_names(expected)
    missing = [name for name in names.values() if name not in found]
    if missing:
        return True, f"the triggers of {table} are missing ({', '.join(missing)})"
    for what, name in names.items():
        manipulation, timing, body = found[name]
        wanted_timing, event, _ = _MARIADB_TRIGGERS[what]
        if manipulation.upper() != event or timing.upper() != wanted_timing:
            return True, f"the trigger {name} of {table} is not {wanted_timing} {event}"
        if isinstance(body, bytes):
            body = body.decode()
        why = _mismatch(body if isinstance(body, str) else None, expected)
        if why is not None:
            return True, f"the triggers of {table} are outdated: {why}"
    return True, None


# The state behind the functions SQLite's triggers call, the same for every client that
# registers them (SQLAlchemy's pools, Django's connections).


@dataclass(eq=False, slots=True)
class SQLiteState:
    """What the judge's functions read on one SQLite connection.

    Attributes:
        token: the token of the transaction under way, ``None`` if it has none.
        unfenced: the transaction opted out.
    """

    token: int | None = None
    unfenced: bool = False

    def set_token(self, value: Any) -> Any:
        """``iofence_set_token(t)``: the token of the transaction from now on; returns it."""
        self.token = value if type(value) is int else None
        return value

    def get_token(self) -> int | None:
        """``iofence_token()``: ``None`` (no token) for a value that is no token (C1)."""
        token = self.token
        return token if token is not None and 0 < token <= MAX_TOKEN else None

    def get_unfenced(self) -> int:
        """``iofence_unfenced()``."""
        return 1 if self.unfenced else 0

    def clear(self) -> None:
        """The transaction ended: no token, no opt-out."""
        self.token = None
        self.unfenced = False
