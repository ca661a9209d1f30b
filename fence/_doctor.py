"""``fence doctor``: read a backend's settings and judge them for fencing tokens.

Each check reads a setting (or a few) and says ``ok``, ``warn`` or ``fail``, with what to do
when it is not ok. The judges (``judge_*``) are plain functions of what was read; the
readers (``*_checks``) do the I/O, each with its backend's own client, and turn every error
of an unreachable or refusing server into a failed check, never an exception.

What is read, by backend:

- Redis: ``INFO`` (version, role), ``CONFIG GET maxmemory-policy maxmemory appendonly
  appendfsync save``, ``TIME`` against this host's clock. On a cluster, every primary.
- PostgreSQL: ``server_version``, ``pg_is_in_recovery()``, ``fsync``, ``synchronous_commit``,
  ``wal_level``, ``clock_timestamp()`` against this host's clock, whether the lease
  table and the fence register exist, and the database's judge (C14): the triggers of every
  table with a fence column and of the register (missing, disabled, of an older version),
  ``session_replication_role``, and the event trigger that judges table rewrites.
- SQLite: the file, ``PRAGMA journal_mode``, ``PRAGMA busy_timeout`` of a connection made as
  the lock manager makes it, the two tables, and the triggers of every fenced table.
- etcd: ``/v3/maintenance/status`` of every endpoint (version, leader, alarms) and
  ``/v3/cluster/member/list``.
- ZooKeeper: the ``srvr`` command of every server (version, mode).
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from fence._core import TokenMode
from fence._optional import sql_judge
from fence._redis_settings import SETTINGS, Finding, judge_role, judge_settings, unreadable
from fence._sql_dialect import CHECK_LOGIN, DIALECTS, Fault, first_line

__all__ = [
    "CLOCK_LIMIT",
    "FAIL",
    "LOCK_WAIT_LIMIT",
    "OK",
    "WARN",
    "Check",
    "etcd_checks",
    "judge_clock",
    "judge_etcd",
    "judge_fenced",
    "judge_mariadb",
    "judge_postgres",
    "judge_redis",
    "judge_sqlite",
    "judge_tables",
    "judge_zookeeper",
    "redis_checks",
    "sql_checks",
    "zookeeper_checks",
]

OK = "ok"
WARN = "warn"
FAIL = "fail"

#: Past this offset (seconds) between this host's clock and the server's, the clock check
#: warns. iofence never reads this host's wall clock for leases or tokens; the offset is a
#: witness of a server clock that may be wrong.
CLOCK_LIMIT = 1.0


@dataclass(frozen=True, slots=True)
class Check:
    """One verdict of ``fence doctor``.

    Attributes:
        status: ``"ok"``, ``"warn"`` or ``"fail"``.
        name: what was checked (``"maxmemory-policy"``, ``"clock"``).
        finding: what was found, in one sentence.
        advice: what to do about it; empty when nothing needs doing.
    """

    status: str
    name: str
    finding: str
    advice: str = ""


# -- judges: no I/O -----------------------------------------------------------------------


def judge_clock(offset: float, uncertainty: float, server: str) -> Check:
    """Judge the offset between this host's clock and the server's.

    Args:
        offset: server clock minus this host's clock, in seconds, at the middle of the
            round trip.
        uncertainty: half the round trip, in seconds.
        server: how the server's clock was read (``"TIME"``, ``"clock_timestamp()"``).
    """
    finding = (
        f"the server's {server} is {offset:+.3f} s from this host's clock (±{uncertainty:.3f} s)"
    )
    if abs(offset) - uncertainty <= CLOCK_LIMIT:
        return Check(OK, "clock", finding)
    return Check(
        WARN,
        "clock",
        finding,
        "run NTP (chrony, systemd-timesyncd) on both hosts. iofence reads only the server's "
        "clock for expiry and hybrid tokens, never this host's; but hybrid tokens survive a "
        "failover only while the servers' clocks agree, and this offset says one clock is off",
    )


def judge_redis(settings: Mapping[str, str], token_mode: TokenMode) -> list[Check]:
    """Judge a Redis server's eviction and persistence settings (C3, C12).

    The verdicts are those of :func:`fence._redis_settings.judge_settings`, the judge the
    managers warn with, here with the guards' fences judged too.

    Args:
        settings: ``CONFIG GET`` results for ``maxmemory-policy``, ``maxmemory``,
            ``appendonly``, ``appendfsync`` and ``save``.
        token_mode: the token mode the managers use.
    """
    return [_check(finding) for finding in judge_settings(settings, token_mode, fences=True)]


def _check(finding: Finding) -> Check:
    """A :class:`fence._redis_settings.Finding` as a check."""
    return Check(finding.level.value, finding.name, finding.finding, finding.advice)


def judge_postgres(settings: Mapping[str, str]) -> list[Check]:
    """Judge a PostgreSQL server's durability settings for tokens and fences (C2, C3).

    Args:
        settings: ``fsync``, ``synchronous_commit``, ``wal_level`` and ``in_recovery``
            (``"on"``/``"off"``).
    """
    checks = []
    if settings.get("in_recovery") == "on":
        checks.append(
            Check(
                FAIL,
                "role",
                "the server is a standby (pg_is_in_recovery()): it refuses every write, so "
                "every acquire and guarded write fails",
                "point the URL at the primary",
            )
        )
    fsync = settings.get("fsync", "")
    if fsync == "off":
        checks.append(
            Check(
                FAIL,
                "fsync",
                "fsync off: a crash of the machine can lose acknowledged commits or corrupt the "
                "database; fences go back and counter tokens repeat",
                "set fsync = on (postgresql.conf, then reload)",
            )
        )
    else:
        checks.append(Check(OK, "fsync", f"fsync {fsync or 'unknown'}"))
    sync = settings.get("synchronous_commit", "")
    if sync == "off":
        checks.append(
            Check(
                WARN,
                "synchronous_commit",
                "synchronous_commit off: a crash loses the last commits (up to 3 x "
                "wal_writer_delay); fences raised by them go back, counter tokens repeat; "
                "hybrid tokens survive as long as the clock does not go back",
                "set synchronous_commit = on, at least for the lease and fence statements "
                "(ALTER ROLE ... SET synchronous_commit = on)",
            )
        )
    else:
        checks.append(
            Check(
                OK,
                "synchronous_commit",
                f"synchronous_commit {sync or 'unknown'}: a commit is durable when it returns",
            )
        )
    wal = settings.get("wal_level", "")
    if wal == "minimal":
        checks.append(
            Check(
                WARN,
                "wal_level",
                "wal_level minimal: no standby can follow and no point-in-time recovery is "
                "possible; after a lost disk the last dump comes back, with older fences",
                "wal_level = replica (restart needed), with a synchronous standby "
                "(synchronous_standby_names) to fail over to",
            )
        )
    else:
        checks.append(
            Check(
                OK,
                "wal_level",
                f"wal_level {wal or 'unknown'}: a standby can follow; fail over only to a "
                "synchronous one, or counter tokens can repeat",
            )
        )
    return checks


def _sqlite_journal_mode(path: str) -> str | None:
    """The journal mode the SQLite file has, read through a read-only connection."""
    import sqlite3
    from pathlib import Path

    try:
        with contextlib.closing(
            sqlite3.connect(Path(path).resolve().as_uri() + "?mode=ro", uri=True)
        ) as db:
            row = db.execute("PRAGMA journal_mode").fetchone()
    except sqlite3.Error:
        return None
    return str(row[0]) if row else None


#: Past this ``innodb_lock_wait_timeout`` (seconds) the doctor warns.
LOCK_WAIT_LIMIT = 50


def judge_mariadb(settings: Mapping[str, str]) -> list[Check]:
    """Judge a MariaDB server's settings for the SQL lock manager and the guards.

    Args:
        settings: ``isolation`` (``@@tx_isolation``), ``found_rows`` (``"on"``
            when the connection counts rows found), ``innodb_lock_wait_timeout``,
            ``innodb_flush_log_at_trx_commit``, ``log_bin`` and ``binlog_format``.
    """
    checks = []
    isolation = settings.get("isolation", "").upper().replace("_", "-")
    if isolation in ("READ-UNCOMMITTED", "SERIALIZABLE"):
        checks.append(
            Check(
                WARN,
                "isolation",
                f"transaction isolation {isolation}: the lock manager and the guards are "
                "tested under REPEATABLE READ and READ COMMITTED; SERIALIZABLE turns plain "
                "reads into shared locks (more deadlocks, error 1213, retryable)",
                "keep the default, REPEATABLE READ (or READ COMMITTED)",
            )
        )
    else:
        checks.append(
            Check(
                OK,
                "isolation",
                f"transaction isolation {isolation or 'unknown'}: each of the manager's "
                "transactions locks the lease row first; deadlocks (1213) and lock wait "
                "timeouts (1205) are retryable errors",
            )
        )
    if settings.get("found_rows") == "on":
        checks.append(
            Check(OK, "found_rows", "the connections count rows found (CLIENT_FOUND_ROWS)")
        )
    else:
        checks.append(
            Check(
                FAIL,
                "found_rows",
                "the connections count rows changed, not found: a renewal that writes the "
                "same expiry would read as a lost lease",
                "connect with CLIENT_FOUND_ROWS (SQLAlchemy's pymysql and aiomysql dialects "
                "do unless client_flag is overridden in connect_args)",
            )
        )
    wait = settings.get("innodb_lock_wait_timeout", "")
    if wait.isdigit() and int(wait) > LOCK_WAIT_LIMIT:
        checks.append(
            Check(
                WARN,
                "innodb_lock_wait_timeout",
                f"innodb_lock_wait_timeout {wait} s: a statement stranded behind a long "
                "transaction on a lease row keeps its server thread (and the row) that long, "
                "after its caller gave up",
                f"at most {LOCK_WAIT_LIMIT} s (the default); the manager's callers keep "
                "their own deadlines",
            )
        )
    else:
        checks.append(
            Check(OK, "innodb_lock_wait_timeout", f"innodb_lock_wait_timeout {wait or '?'} s")
        )
    flush = settings.get("innodb_flush_log_at_trx_commit", "")
    if flush != "1":
        checks.append(
            Check(
                WARN,
                "innodb_flush_log_at_trx_commit",
                f"innodb_flush_log_at_trx_commit {flush or 'unknown'}: a crash of the "
                "machine loses up to a second of commits; fences raised by them go back, "
                "counter tokens repeat; hybrid tokens survive as long as the clock does "
                "not go back",
                "set innodb_flush_log_at_trx_commit = 1",
            )
        )
    else:
        checks.append(
            Check(OK, "innodb_flush_log_at_trx_commit", "1: a commit is durable when it returns")
        )
    binlog = settings.get("binlog_format", "").upper()
    if settings.get("log_bin", "").upper() in ("ON", "1") and binlog == "STATEMENT":
        checks.append(
            Check(
                WARN,
                "binlog_format",
                "binlog_format STATEMENT: the lock manager's upserts (INSERT ... ON "
                "DUPLICATE KEY UPDATE) are unsafe for statement-based replication, and a "
                "replica may apply them otherwise",
                "binlog_format = ROW (or MIXED)",
            )
        )
    else:
        checks.append(
            Check(
                OK,
                "binlog_format",
                f"binlog {settings.get('log_bin', '?')}, format {binlog or '?'}",
            )
        )
    return checks


def judge_sqlite(journal_mode: str, busy_timeout_ms: int) -> list[Check]:
    """Judge a SQLite database's journal mode and a connection's busy timeout.

    Args:
        journal_mode: ``PRAGMA journal_mode`` of the file.
        busy_timeout_ms: ``PRAGMA busy_timeout`` of a connection made as the lock manager
            makes it.
    """
    checks = []
    mode = journal_mode.lower()
    if mode == "wal":
        checks.append(Check(OK, "journal_mode", "wal: readers do not block the writer"))
    else:
        checks.append(
            Check(
                WARN,
                "journal_mode",
                f"{mode}: every write blocks every reader of the file, so lock calls and guarded "
                "writes of other processes wait on each other (a lock manager built from a "
                "sqlite:// URL turns WAL on when it connects; engines you build do not)",
                "run PRAGMA journal_mode=WAL once; the file keeps it",
            )
        )
    if busy_timeout_ms <= 0:
        checks.append(
            Check(
                WARN,
                "busy_timeout",
                "0 ms: a lock call that meets another writer fails at once (SQLITE_BUSY)",
                "give the connections a busy timeout: sqlite:///file.db?timeout=5",
            )
        )
    else:
        checks.append(
            Check(
                OK,
                "busy_timeout",
                f"{busy_timeout_ms} ms for connections made from this URL: a lock call waits "
                "that long for another writer, then raises BackendError(code='BUSY')",
            )
        )
    return checks


def judge_tables(
    lease_table: str,
    has_lease: bool,
    register: str,
    has_register: bool,
    *,
    shared: str | None = None,
    has_shared: bool = True,
    lacking: Sequence[str] = (),
) -> list[Check]:
    """Judge whether the lease table, its shared table and the fence register exist.

    Args:
        lease_table: the lease table's name, as shown.
        has_lease: whether it exists.
        register: the fence register's name, as shown.
        has_register: whether it exists.
        shared: the shared locks' table (``<lease_table>_shared``), as shown; ``None``
            leaves it unjudged.
        has_shared: whether it exists.
        lacking: the columns of shared locks an existing lease table lacks (a table made by
            a version before them).
    """
    checks = []
    if not has_lease:
        checks.append(
            Check(
                FAIL,
                "lease table",
                f"{lease_table} is missing: the SQL lock manager refuses every call until it "
                "exists",
                "create it: fence ddl --dialect DIALECT (or SQLLockManager(..., "
                "create_table=True) once)",
            )
        )
    elif lacking:
        checks.append(
            Check(
                FAIL,
                "lease table",
                f"{lease_table} lacks {', '.join(lacking)}: it was made before shared locks, "
                "and the SQL lock manager refuses its calls until it is migrated",
                "migrate it once with the statements of fence.lease_upgrade_ddl(DIALECT), "
                "before the new managers start",
            )
        )
    else:
        checks.append(Check(OK, "lease table", f"{lease_table} exists"))
    if shared is not None:
        if has_shared:
            checks.append(Check(OK, "shared table", f"{shared} exists"))
        else:
            checks.append(
                Check(
                    FAIL,
                    "shared table",
                    f"{shared} is missing: the SQL lock manager keeps the readers and waiters "
                    "of shared locks there",
                    "create it: fence ddl --dialect DIALECT (all the lock manager's tables), "
                    "or fence.lease_upgrade_ddl(DIALECT) for a lease table of an earlier "
                    "version",
                )
            )
    if has_register:
        checks.append(Check(OK, "fence register", f"{register} exists"))
    else:
        checks.append(
            Check(
                WARN,
                "fence register",
                f"{register} is missing: claims through a register (the session hook, "
                "UnitOfWork, FenceRegister) are refused until it exists",
                "create it: fence ddl --dialect DIALECT; not needed if only row guards are used",
            )
        )
    return checks


def judge_fenced(
    dialect: str,
    tables: Sequence[tuple[str, str | None, str]],
    *,
    role: str = "origin",
    rewrite: str | None = None,
) -> list[Check]:
    """Judge the database's judge (C14): the triggers of every fenced table.

    Args:
        dialect: ``"postgresql"``, ``"sqlite"``, ``"mariadb"`` or ``"mysql"``.
        tables: ``(table, problem, what to run)`` for every table with a fence column and
            the register; ``problem`` is ``None`` where the triggers are in place and current.
        role: the session's ``session_replication_role`` (PostgreSQL): under ``replica``
            no ordinary trigger fires.
        rewrite: the signature of the judge of table rewrites (PostgreSQL), ``""`` if it
            is missing, ``None`` where there is none to have (SQLite).
    """
    checks = []
    for table, problem, hint in tables:
        if problem is not None:
            checks.append(
                Check(
                    FAIL,
                    "judge",
                    f"{problem}: writes that bypass the guards reach {table} unjudged, and "
                    "the guards refuse to write it",
                    hint,
                )
            )
    if not any(problem is not None for _, problem, _ in tables):
        count = len(tables)
        checks.append(
            Check(
                OK,
                "judge",
                f"every fenced table carries current triggers ({count} with the register)"
                if count
                else "no table with a fence column",
            )
        )
    if role == "replica":
        checks.append(
            Check(
                FAIL,
                "session_replication_role",
                "replica: ordinary triggers do not fire in this session, so nothing judges "
                "its writes",
                "leave it at origin; replication apply workers alone run as replica",
            )
        )
    if rewrite is not None:
        if rewrite:
            checks.append(Check(OK, "rewrite judge", "an event trigger refuses table rewrites"))
        else:
            checks.append(
                Check(
                    WARN,
                    "rewrite judge",
                    "missing: an ALTER TABLE that rewrites a fenced table (ALTER COLUMN ... "
                    "TYPE ... USING) fires no row trigger, and nothing refuses it",
                    "as a superuser, once per database: the statements of "
                    "fence.adapters.ddl.rewrite_trigger_ddl()",
                )
            )
    return checks


@dataclass(frozen=True, slots=True)
class _Member:
    """What one consensus member answered: its address, or the error."""

    where: str
    error: str = ""
    version: str = ""
    role: str = ""  # "leader", "follower", ... ; "" when unknown
    leader: str = ""  # the leader this member knows (etcd: a member id)
    name: str = ""
    alarms: tuple[str, ...] = ()


def judge_etcd(
    members: Sequence[_Member], cluster_size: int | None, names: Mapping[str, str]
) -> list[Check]:
    """Judge the endpoints of an etcd URL: reachable, one leader (so a quorum), no alarm.

    A member knows a leader only while a quorum of the cluster elects one, so the leader
    check is the quorum check; the member list says whether the URL names every member.

    Args:
        members: what each endpoint of the URL answered.
        cluster_size: how many members the cluster lists, if one answered.
        names: member names by member id, from the member list.
    """
    checks = _judge_members("etcd", members)
    up = [m for m in members if not m.error]
    if not up:
        checks.append(
            Check(
                FAIL,
                "endpoints",
                f"none of the URL's {len(members)} endpoints answers: every lock call fails",
                "check the URL and that the members run",
            )
        )
        return checks
    if len(up) < len(members):
        checks.append(
            Check(
                WARN,
                "endpoints",
                f"{len(up)} of the URL's {len(members)} endpoints answer",
                "start the stopped members, or take the ones that left out of the URL",
            )
        )
    else:
        checks.append(Check(OK, "endpoints", f"all {len(members)} answer"))
    leaders = {m.leader for m in up if m.leader not in ("", "0")}
    if not leaders:
        checks.append(
            Check(
                FAIL,
                "leader",
                "no member knows a leader: the cluster has no quorum and every lock call fails",
                "start the stopped members; check the members' logs",
            )
        )
    elif len(leaders) > 1:
        checks.append(
            Check(
                WARN,
                "leader",
                f"members name different leaders ({', '.join(sorted(leaders))}): an election "
                "may be under way",
                "run fence doctor again; if it stays, check the network between the members",
            )
        )
    else:
        (leader,) = leaders
        at = next((m.where for m in up if m.role == "leader"), "an endpoint not in the URL")
        checks.append(Check(OK, "leader", f"member {names.get(leader) or leader} at {at}"))
    if cluster_size is not None and cluster_size > len(members):
        checks.append(
            Check(
                WARN,
                "endpoints",
                f"the URL names {len(members)} of the cluster's {cluster_size} members: the "
                "lock manager talks only to those",
                "name every member's client URL in the etcd:// URL",
            )
        )
    return checks


def judge_zookeeper(members: Sequence[_Member]) -> list[Check]:
    """Judge the servers of a ZooKeeper ensemble: reachable, serving, a quorum, one leader.

    Args:
        members: what each host of the URL answered to ``srvr``.
    """
    checks = _judge_members("zookeeper", members)
    total = len(members)
    majority = total // 2 + 1
    serving = [m for m in members if not m.error and m.role != "not serving"]
    if len(serving) < majority:
        checks.append(
            Check(
                FAIL,
                "quorum",
                f"{len(serving)} of {total} servers serve: no quorum, every lock call fails",
                "start the stopped servers",
            )
        )
    elif len(serving) < total:
        lose = len(serving) - majority + 1
        checks.append(
            Check(
                WARN,
                "quorum",
                f"{len(serving)} of {total} servers serve: a quorum, but losing {lose} more "
                "stops every lock call",
                "start the stopped servers",
            )
        )
    else:
        checks.append(Check(OK, "quorum", f"all {total} servers serve"))
    roles = [m.role for m in serving]
    leaders = [m.where for m in serving if m.role == "leader"]
    if "standalone" in roles:
        checks.append(
            Check(
                WARN,
                "leader",
                "a standalone server: no failover, its loss stops every lock call",
                "run an ensemble of 3 or 5 servers",
            )
        )
    elif len(leaders) == 1:
        checks.append(Check(OK, "leader", leaders[0]))
    elif len(leaders) > 1:
        checks.append(
            Check(
                WARN,
                "leader",
                f"{len(leaders)} servers say they lead: an election may be under way",
                "run fence doctor again",
            )
        )
    elif serving and all(roles):
        checks.append(Check(FAIL, "leader", "no server leads", "check the servers' logs"))
    return checks


def _judge_members(kind: str, members: Sequence[_Member]) -> list[Check]:
    """One check per member, and one per alarm it raised."""
    checks = []
    for member in members:
        if member.error:
            checks.append(
                Check(
                    WARN,
                    "member",
                    f"{member.where}: {member.error}",
                    "start it, or take it out of the URL if it left the cluster",
                )
            )
            continue
        label = f" ({member.name})" if member.name else ""
        role = member.role or "role unknown (srvr refused)"
        status = WARN if member.role == "not serving" else OK
        advice = "it has no quorum: start the stopped servers" if status == WARN else ""
        checks.append(
            Check(
                status, "member", f"{member.where}{label}: {kind} {member.version}, {role}", advice
            )
        )
        for alarm in member.alarms:
            checks.append(
                Check(
                    FAIL,
                    "alarm",
                    f"{member.where}: {alarm}: the cluster refuses writes",
                    "etcdctl alarm list; for NOSPACE: compact, defragment, etcdctl alarm disarm",
                )
            )
    return checks


# -- readers: one backend each --------------------------------------------------------------


def _clock_offset(read_server_seconds: Callable[[], float]) -> tuple[float, float]:
    """The offset to the server's clock from the best of three readings (shortest trip)."""
    best: tuple[float, float] | None = None
    for _ in range(3):
        before = time.time()
        server = read_server_seconds()
        after = time.time()
        sample = (server - (before + after) / 2, (after - before) / 2)
        if best is None or sample[1] < best[1]:
            best = sample
    assert best is not None
    return best


def _where(url: str) -> str:
    """The URL without its credentials."""
    parts = urlsplit(url)
    host = parts.netloc.rsplit("@", 1)[-1]
    return f"{parts.scheme}://{host}{parts.path}"


def redis_checks(
    url: str, *, timeout: float, token_mode: TokenMode, cluster: bool = False
) -> list[Check]:
    """Check a Redis server, or every primary of a Redis Cluster.

    Args:
        url: a ``redis://``, ``rediss://`` or ``unix://`` URL.
        timeout: connect and read timeout, in seconds.
        token_mode: the token mode the managers use.
        cluster: ``url`` names a node of a Redis Cluster.
    """
    import redis
    from redis.backoff import NoBackoff
    from redis.exceptions import RedisError
    from redis.retry import Retry

    options: dict[str, Any] = {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "retry": Retry(NoBackoff(), 0),
    }
    where = _where(url)
    try:
        if cluster:
            client: Any = redis.RedisCluster.from_url(url, **options)
            nodes = [(f"{n.host}:{n.port}", n.redis_connection) for n in client.get_primaries()]
        else:
            client = redis.Redis.from_url(url, **options)
            nodes = [(where, client)]
    except (RedisError, OSError) as exc:
        return [_unreachable(where, exc)]
    try:
        checks: list[Check] = []
        for label, node in nodes:
            found = _redis_node(node, label, token_mode)
            checks += found if len(nodes) == 1 else [_labelled(c, label) for c in found]
        return checks
    finally:
        with contextlib.suppress(RedisError, OSError):
            client.close()


def _labelled(check: Check, label: str) -> Check:
    """The check of one cluster node, named with the node."""
    if check.finding.startswith(label):
        return check
    return Check(check.status, f"{check.name} ({label})", check.finding, check.advice)


def _unreachable(where: str, exc: BaseException) -> Check:
    return Check(
        FAIL,
        "reachable",
        f"{where} did not answer: {exc}",
        "check the host, port, credentials and TLS in the URL, and that the server runs",
    )


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _redis_node(client: Any, where: str, token_mode: TokenMode) -> list[Check]:
    from redis.exceptions import RedisError, ResponseError

    try:
        info = client.info("server")
        replication = client.info("replication")
    except (RedisError, OSError) as exc:
        return [_unreachable(where, exc)]
    version = info.get("redis_version", "?")
    checks = [_check(judge_role(_text(replication.get("role", "?")), version, where))]
    settings: dict[str, str] = {}
    try:
        for name in SETTINGS:
            got = client.config_get(name)
            settings.update({_text(k): _text(v) for k, v in got.items()})
    except ResponseError as exc:
        checks.append(_check(unreadable(SETTINGS, f"CONFIG GET is refused ({exc})")))
    except (RedisError, OSError) as exc:
        return [*checks, _unreachable(where, exc)]
    else:
        checks += judge_redis(settings, token_mode)
        missing = [name for name in SETTINGS if name not in settings]
        if missing:
            checks.append(_check(unreadable(missing, "CONFIG GET returns no value")))

    def server_seconds() -> float:
        seconds, micros = client.time()
        return int(seconds) + int(micros) / 1e6

    try:
        checks.append(judge_clock(*_clock_offset(server_seconds), "TIME"))
    except (RedisError, OSError) as exc:
        checks.append(_unreachable(where, exc))
    return checks


def sql_checks(
    engine: Any, *, lease_table: str, schema: str | None, register: str, path: str | None
) -> list[Check]:
    """Check a PostgreSQL, SQLite or MariaDB database through the lock manager's engine.

    Args:
        engine: the SQLAlchemy engine of a :class:`fence.SQLLockManager` built from the URL.
        lease_table: the lease table's name.
        schema: its schema, or ``None``.
        register: the fence register's name (same schema).
        path: the SQLite file, or ``None`` on a server.
    """
    import sqlalchemy as sa

    from fence._sql_schema import SHARED_COLUMNS, shared_table_name

    dialect = engine.dialect.name
    where = _where(str(engine.url)) if path is None else path
    # The file's own journal mode, read before the engine connects: a lock manager built
    # from a URL turns WAL on when it connects, and the doctor changes nothing.
    file_mode = _sqlite_journal_mode(path) if dialect == "sqlite" and path is not None else None
    try:
        with engine.connect() as conn:
            if dialect == "postgresql":
                checks = _postgres(conn, where)
            elif dialect == "sqlite":
                version = conn.exec_driver_sql("SELECT sqlite_version()").scalar()
                checks = [Check(OK, "reachable", f"{where}: SQLite {version}")]
                mode = file_mode
                if mode is None:
                    mode = conn.exec_driver_sql("PRAGMA journal_mode").scalar()
                busy = conn.exec_driver_sql("PRAGMA busy_timeout").scalar()
                checks += judge_sqlite(str(mode), int(busy or 0))
            elif dialect in ("mariadb", "mysql"):
                checks = _mariadb(conn, where)
            else:
                return [
                    Check(
                        FAIL,
                        "dialect",
                        f"{dialect}: the SQL lock manager supports PostgreSQL, SQLite and MariaDB",
                        "use a postgresql://, sqlite:// or mariadb:// URL",
                    )
                ]
            inspector = sa.inspect(conn)
            qualified = f"{schema}.{lease_table}" if schema else lease_table
            qualified_register = f"{schema}.{register}" if schema else register
            has_lease = inspector.has_table(lease_table, schema=schema)
            columns = (
                {c["name"] for c in inspector.get_columns(lease_table, schema=schema)}
                if has_lease
                else set()
            )
            checks += judge_tables(
                qualified,
                has_lease,
                qualified_register,
                inspector.has_table(register, schema=schema),
                shared=shared_table_name(qualified),
                has_shared=inspector.has_table(shared_table_name(lease_table), schema=schema),
                lacking=[c for c in SHARED_COLUMNS if c not in columns],
            )
            checks += _fenced(conn, dialect, register, schema)
            return checks
    except sa.exc.DBAPIError as exc:
        if dialect in DIALECTS and DIALECTS[dialect].classify(exc) in _LOGIN_FAULTS:
            return [_refused(where, exc.orig if exc.orig is not None else exc)]
        return [_unreachable(where, exc.orig if exc.orig is not None else exc)]
    except OSError as exc:
        return [_unreachable(where, exc)]


#: A login the server refused and a database it does not have: the server answered.
_LOGIN_FAULTS = frozenset({Fault.AUTH, Fault.NO_DATABASE})


def _refused(where: str, exc: BaseException) -> Check:
    """The server answered and refused the URL's user, password or database."""
    return Check(
        FAIL, "reachable", f"{where} refused the connection: {first_line(exc)}", CHECK_LOGIN
    )


def _fenced(conn: Any, dialect: str, register: str, schema: str | None) -> list[Check]:
    """Read the judge of every table with a fence column (and of the register)."""
    judge = sql_judge()
    found: list[tuple[str, str | None, str]] = []
    rewrite: str | None = None
    role = "origin"
    if dialect == "postgresql":
        candidates = conn.exec_driver_sql(_PG_FENCED).all()
        for table_schema, table, has_tombstone in candidates:
            owner = None if table_schema == (schema or "public") else table_schema
            judged = judge.Judged(table, owner, register=table == register)
            rows = conn.exec_driver_sql(
                judge.PG_CHECK_QUERY.format(param="%(t)s"), {"t": judged.qualified}
            ).all()
            judged = _as_installed(judge, judged, rows, has_tombstone)
            _, problem = judge.verdict("postgresql", rows, judged)
            found.append((judged.qualified, problem, judged.hint(dialect)))
            if rows:
                role = str(rows[0][1])
        rewrite = conn.exec_driver_sql(judge.PG_REWRITE_CHECK_QUERY).scalar() or ""
    elif dialect in ("mariadb", "mysql"):
        # Without a schema, the URL's database: where the guards look for the triggers.
        where = "DATABASE()" if schema is None else "%(s)s"
        query = judge.MARIADB_CHECK_QUERY.format(param="%(t)s", schema=where)
        for table, has_tombstone in conn.exec_driver_sql(
            _MARIADB_FENCED.format(schema=where), {"s": schema}
        ).all():
            judged = judge.Judged(str(table), register=table == register)
            rows = conn.exec_driver_sql(query, {"t": table, "s": schema}).all()
            judged = _as_installed(judge, judged, rows, bool(has_tombstone), body=5)
            _, problem = judge.verdict(dialect, rows, judged)
            found.append((str(table), problem, judged.hint(dialect)))
    else:
        names = conn.exec_driver_sql(
            "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'"
        ).scalars()
        for table in list(names):
            columns = {row[1] for row in conn.exec_driver_sql(f'PRAGMA table_info("{table}")')}
            if "fence" not in columns:
                continue
            judged = judge.Judged(table, register=table == register)
            rows = conn.exec_driver_sql(
                judge.SQLITE_CHECK_QUERY.format(param="?", schema=""), (table,)
            ).all()
            _, problem = judge.verdict("sqlite", rows, judged)
            found.append((table, problem, judged.hint(dialect)))
    return judge_fenced(dialect, found, role=role, rewrite=rewrite)


def _as_installed(judge: Any, judged: Any, rows: Any, has_tombstone: bool, *, body: int = 4) -> Any:
    """The table as its triggers say it was judged (register or rows), so that only a
    missing, disabled or outdated judge counts; the hint names the tombstone flag.

    Args:
        judge: the judge's module.
        judged: the table as the doctor guessed it.
        rows: the rows of the dialect's check query (the trigger's name in column 2).
        has_tombstone: the table has a ``deleted`` column.
        body: the column of the rows with the text that carries the signature.
    """
    kind = None
    for row in rows:
        text = row[body]
        if isinstance(text, bytes):
            text = text.decode()
        fields = judge.parse_signature(text) if row[2] is not None else None
        if fields:
            kind = fields.get("kind")
    register = judged.register if kind is None else kind == "register"
    tombstone = "deleted" if has_tombstone and not register else None
    return judge.Judged(judged.table, judged.schema, register=register, tombstone=tombstone)


# Every table of the database with a fence column, outside the system's schemas, and
# whether it has a boolean ``deleted`` column (the tombstone flag the hint names).
_PG_FENCED = (
    "SELECT n.nspname, c.relname, EXISTS (SELECT 1 FROM pg_catalog.pg_attribute d "
    "WHERE d.attrelid = c.oid AND d.attname = 'deleted' AND NOT d.attisdropped) "
    "FROM pg_catalog.pg_class c JOIN pg_catalog.pg_namespace n ON n.oid = c.relnamespace "
    "JOIN pg_catalog.pg_attribute a ON a.attrelid = c.oid AND a.attname = 'fence' "
    "AND NOT a.attisdropped WHERE c.relkind IN ('r', 'p') "
    "AND n.nspname NOT IN ('pg_catalog', 'information_schema') "
    "AND n.nspname !~ '^pg_' ORDER BY 1, 2"
)


# Every base table of the schema with a fence column, and whether it has a ``deleted``
# column (the tombstone flag the hint names). ``{schema}``: ``DATABASE()`` or a parameter.
_MARIADB_FENCED = (
    "SELECT c.TABLE_NAME, EXISTS (SELECT 1 FROM information_schema.COLUMNS AS d "
    "WHERE d.TABLE_SCHEMA = c.TABLE_SCHEMA AND d.TABLE_NAME = c.TABLE_NAME "
    "AND d.COLUMN_NAME = 'deleted') "
    "FROM information_schema.COLUMNS AS c JOIN information_schema.TABLES AS t "
    "ON t.TABLE_SCHEMA = c.TABLE_SCHEMA AND t.TABLE_NAME = c.TABLE_NAME "
    "WHERE c.TABLE_SCHEMA = {schema} AND c.COLUMN_NAME = 'fence' "
    "AND t.TABLE_TYPE = 'BASE TABLE' ORDER BY 1"
)


def _postgres(conn: Any, where: str) -> list[Check]:
    row = conn.exec_driver_sql(
        "SELECT current_setting('server_version'), pg_is_in_recovery(), "
        "current_setting('fsync'), current_setting('synchronous_commit'), "
        "current_setting('wal_level')"
    ).one()
    version, recovery, fsync, sync, wal = row
    checks = [Check(OK, "reachable", f"{where}: PostgreSQL {version}")]
    settings = {
        "in_recovery": "on" if recovery else "off",
        "fsync": str(fsync),
        "synchronous_commit": str(sync),
        "wal_level": str(wal),
    }
    checks += judge_postgres(settings)

    def server_seconds() -> float:
        return float(conn.exec_driver_sql("SELECT extract(epoch FROM clock_timestamp())").scalar())

    checks.append(judge_clock(*_clock_offset(server_seconds), "clock_timestamp()"))
    return checks


def _mariadb(conn: Any, where: str) -> list[Check]:
    version = str(conn.exec_driver_sql("SELECT VERSION()").scalar())
    # MariaDB before 11.1 names it tx_isolation; MySQL 8 knows only transaction_isolation.
    isolation_of = "tx_isolation" if "mariadb" in version.lower() else "transaction_isolation"
    row = conn.exec_driver_sql(
        f"SELECT @@{isolation_of}, @@innodb_lock_wait_timeout, "
        "@@innodb_flush_log_at_trx_commit, @@log_bin, @@binlog_format"
    ).one()
    isolation, wait, flush, log_bin, binlog = row
    checks = [Check(OK, "reachable", f"{where}: MariaDB {version}")]
    try:
        from pymysql.constants import CLIENT

        flags = int(conn.connection.driver_connection.client_flag)
        found_rows = "on" if flags & CLIENT.FOUND_ROWS else "off"
    except Exception:  # another driver: nothing to read the flag from
        found_rows = "unknown"
    settings = {
        "isolation": str(isolation),
        "found_rows": found_rows,
        "innodb_lock_wait_timeout": str(wait),
        "innodb_flush_log_at_trx_commit": str(flush),
        "log_bin": str(log_bin),
        "binlog_format": str(binlog),
    }
    checks += judge_mariadb(settings)

    def server_seconds() -> float:
        return float(
            conn.exec_driver_sql(
                "SELECT TIMESTAMPDIFF(MICROSECOND, '1970-01-01', UTC_TIMESTAMP(6)) * 0.000001"
            ).scalar()
        )

    checks.append(judge_clock(*_clock_offset(server_seconds), "UTC_TIMESTAMP(6)"))
    return checks


def etcd_checks(url: str, *, timeout: float) -> list[Check]:
    """Check every endpoint of an ``etcd://`` URL: status, leader, alarms, members.

    Args:
        url: ``etcd://h1:2379,h2:2379,h3:2379`` (``etcds://`` for TLS).
        timeout: per request, in seconds.
    """
    import httpx

    from fence._etcd import parse_endpoints

    endpoints, _ = parse_endpoints(url)
    members: list[_Member] = []
    size: int | None = None
    names: dict[str, str] = {}
    with httpx.Client(timeout=timeout) as http:
        for endpoint in endpoints:
            where = endpoint.split("://", 1)[-1]
            try:
                reply = http.post(f"{endpoint}/v3/maintenance/status", json={})
                reply.raise_for_status()
                status = reply.json()
                if size is None:
                    listed = http.post(f"{endpoint}/v3/cluster/member/list", json={})
                    listed.raise_for_status()
                    found = listed.json().get("members", [])
                    size = len(found)
                    names = {str(m.get("ID", "")): str(m.get("name", "")) for m in found}
            except (httpx.HTTPError, ValueError) as exc:
                members.append(_Member(where, error=str(exc) or type(exc).__name__))
                continue
            me = str(status.get("header", {}).get("member_id", ""))
            leader = str(status.get("leader", ""))
            members.append(
                _Member(
                    where,
                    version=str(status.get("version", "?")),
                    role="leader" if me and me == leader else "follower",
                    leader=leader,
                    name=names.get(me, ""),
                    alarms=tuple(str(e) for e in status.get("errors", []) or []),
                )
            )
    return judge_etcd(members, size, names)


def zookeeper_checks(url: str, *, timeout: float) -> list[Check]:
    """Check every server of a ``zookeeper://`` URL with the ``srvr`` command.

    ``srvr`` is the one four-letter command ZooKeeper allows by default
    (``4lw.commands.whitelist``); a server that refuses it counts as reachable, role
    unknown.

    Args:
        url: ``zookeeper://h1:2181,h2:2181,h3:2181/root``.
        timeout: per server, in seconds.
    """
    from fence._zookeeper import parse_hosts

    hosts, _ = parse_hosts(url)
    members = [_srvr(host, timeout) for host in hosts.split(",")]
    return judge_zookeeper(members)


def _srvr(host: str, timeout: float) -> _Member:
    name, _, port = host.rpartition(":")
    if not name:
        name, port = port, "2181"
    try:
        with socket.create_connection((name.strip("[]"), int(port)), timeout=timeout) as sock:
            sock.sendall(b"srvr")
            chunks = []
            while chunk := sock.recv(4096):
                chunks.append(chunk)
    except (OSError, ValueError) as exc:
        return _Member(host, error=str(exc) or type(exc).__name__)
    text = b"".join(chunks).decode("utf-8", "replace")
    if "not in the whitelist" in text:
        return _Member(host, version="?", role="")
    if "not currently serving" in text:
        return _Member(host, version="?", role="not serving")
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    version = fields.get("Zookeeper version", "?").strip().split("-", 1)[0].split(",", 1)[0]
    return _Member(host, version=version, role=fields.get("Mode", "").strip())


def sqlite_file(database: str | None) -> str | None:
    """The file of a SQLite URL's database, or ``None`` for an in-memory database."""
    if not database or database == ":memory:" or "mode=memory" in database:
        return None
    if database.startswith("file:"):
        database = database[len("file:") :].split("?", 1)[0]
    return os.path.abspath(database)
