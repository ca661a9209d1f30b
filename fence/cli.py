"""The ``fence`` command line: see a lock, end it, print the DDL, check a backend.

::

    fence inspect URL RESOURCE      who holds RESOURCE: holder, token, time left, the fence
    fence revoke URL RESOURCE       end its lease by force and print the new token
    fence list URL [START]          every lock held now (whose resource starts with START)
    fence ddl --dialect D [--table T ...]
                                    the lease table, the fence register and fence columns
    fence doctor URL                check the backend's settings: ok, warn or fail each
    fence demo                      a paused holder's stale write refused (SQLite)
    fence chaos                     every pairing under pauses and server crashes

``URL`` is what :func:`fence.connect` takes: ``redis://``, ``redis+cluster://``,
``postgresql://``, ``sqlite:///file.db``, ``mariadb://``, ``etcd://h1:2379,...``,
``zookeeper://h1:2181,...``.

Exit status: 0 when the command did its job (and every doctor check passed); 1 when it
could not (a server that does not answer, a refusal, a missing driver package, a failed
check); 2 for a usage error (bad arguments, a URL that names no backend); 130 when
interrupted (Ctrl-C).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
import textwrap
import warnings
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import urlsplit

import fence
from fence._core import TokenMode, validate_resource
from fence._errors import BackendError, ConfigurationError, FenceError
from fence._optional import install_hint, sql_ddl, sql_mysql_register_ddl, sql_trigger_ddl

__all__ = ["EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "build_parser", "main"]

#: The command did its job.
EXIT_OK = 0
#: The command could not do its job, or a doctor check failed.
EXIT_FAILED = 1
#: The command line was wrong: arguments, or a URL that names no backend.
EXIT_USAGE = 2
#: Interrupted by SIGINT (Ctrl-C): 128 + 2, as shells report it.
EXIT_INTERRUPTED = 130

# Backends by URL scheme (the part before any "+driver").
_KINDS = {
    "memory": "memory",
    "redis": "redis",
    "rediss": "redis",
    "unix": "redis",
    "postgresql": "sql",
    "postgres": "sql",
    "sqlite": "sql",
    "mariadb": "sql",
    "mysql": "sql",
    "etcd": "etcd",
    "etcds": "etcd",
    "zookeeper": "zookeeper",
    "zk": "zookeeper",
}


#: Other names of ``--dialect`` values: the spellings SQLAlchemy URLs accept too.
_DIALECT_ALIASES = {"postgres": "postgresql"}

#: What to install for a SQLAlchemy driver that no extra of iofence installs, by module.
_DRIVER_PACKAGES = {"psycopg2": "psycopg2-binary", "pg8000": "pg8000"}


class _UsageError(Exception):
    """The command line is wrong: exit 2."""


class _Failed(Exception):
    """The command could not do its job: exit 1."""


class _Interrupted(KeyboardInterrupt):
    """Ctrl-C at a moment that leaves something to say (exit 130)."""


# -- the parser -------------------------------------------------------------------------------


def _url_help(what: str) -> str:
    return (
        f"{what}: redis://, redis+cluster://, postgresql://, sqlite:///file.db, "
        "mariadb://, etcd://h1:2379,..., zookeeper://h1:2181,..."
    )


def _add_backend_options(parser: argparse.ArgumentParser, *, tokens: bool) -> None:
    parser.add_argument(
        "--timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="connect and read timeout (default 5)",
    )
    parser.add_argument(
        "--prefix", default=None, help="Redis key prefix of the managers and guards (fence:)"
    )
    parser.add_argument(
        "--lease-table", default=None, metavar="NAME", help="SQL lease table (fence_leases)"
    )
    parser.add_argument(
        "--register", default=None, metavar="NAME", help="SQL fence register (fence_register)"
    )
    parser.add_argument(
        "--schema", default=None, help="SQL schema of the lease table and the register"
    )
    if tokens:
        parser.add_argument(
            "--token-mode",
            choices=[m.value for m in TokenMode],
            default=None,
            help="Redis and SQL: the managers' token mode (hybrid)",
        )


def _dialect(value: str) -> str:
    name = value.lower()
    return _DIALECT_ALIASES.get(name, name)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``fence`` command."""
    parser = argparse.ArgumentParser(
        prog="fence",
        description="iofence: fencing tokens for distributed locks.",
        epilog="Exit status: 0 ok, 1 failed (or a doctor check failed), 2 usage error, "
        "130 interrupted.",
    )
    parser.add_argument("--version", action="version", version=f"iofence {fence.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    inspect = commands.add_parser(
        "inspect",
        help="who holds a lock: holder, token, time left, and the fence where one is kept",
        description="Show who holds RESOURCE: the holder's label, its token and the time "
        "left on its lease by the backend's clock, the last token issued and the fence, where "
        "the backend keeps them (Redis: fence:{R}:token and fence:{R}:fence; SQL: the lease "
        "row and the fence register's row for RESOURCE; etcd and ZooKeeper keep no fence).",
    )
    inspect.add_argument("url", metavar="URL", help=_url_help("the lock manager's backend"))
    inspect.add_argument("resource", metavar="RESOURCE", help="the locked resource")
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    _add_backend_options(inspect, tokens=False)

    revoke = commands.add_parser(
        "revoke",
        help="end a lock's lease by force and print the new token",
        description="End every lease on RESOURCE, whoever holds it (a hung holder), and print "
        "a token above every token issued for it. On Redis the resource's fence "
        "(fence:{R}:fence) is raised to it; elsewhere, claim it on your guards to refuse the "
        "old holder's writes before the next holder writes.",
    )
    revoke.add_argument("url", metavar="URL", help=_url_help("the lock manager's backend"))
    revoke.add_argument("resource", metavar="RESOURCE", help="the locked resource")
    _add_backend_options(revoke, tokens=True)

    listing = commands.add_parser(
        "list",
        help="every lock held now: holder, token, mode, readers, waiters, time left",
        description="List the locks held now, by resource where the backend keeps an "
        "order (SQL, memory; Redis lists in SCAN order), one row each: the holder's "
        "label, the token, the mode, how many readers and queued waiters, and the time "
        "left by the backend's clock. The backend is read a page at a time (Redis SCAN, "
        "SQL keyset pages), never in one blocking call. START is matched literally: *, ?, "
        "% and _ in it are plain characters.",
    )
    listing.add_argument("url", metavar="URL", help=_url_help("the lock manager's backend"))
    listing.add_argument(
        "start",
        metavar="START",
        nargs="?",
        default="",
        help="list only resources that start with it (default: all)",
    )
    listing.add_argument(
        "--limit", type=int, default=None, metavar="N", help="stop after N locks (default: all)"
    )
    listing.add_argument("--json", action="store_true", help="print one JSON object per lock")
    _add_backend_options(listing, tokens=False)

    ddl_parser = commands.add_parser(
        "ddl",
        help="print the SQL for the lease table, the fence register and fenced tables",
        description="Print the DDL iofence needs, for a migration or for psql / sqlite3: the "
        "SQL lock manager's lease table, the fence register and its judge, and for every "
        "--table the fence column, the tombstone flag and the database's judge (triggers that "
        "refuse stale and unfenced writes, whoever sends them; run it again to upgrade them). "
        "The PostgreSQL and MariaDB scripts run again unharmed (IF NOT EXISTS). "
        + _SQLITE_AGAIN
        + " MariaDB and MySQL: no lease table yet (docs/mariadb.md); their triggers come "
        "between DELIMITER lines, for the mariadb and mysql clients.",
    )
    ddl_parser.add_argument(
        "--dialect",
        required=True,
        type=_dialect,
        choices=["postgresql", "sqlite", "mariadb", "mysql"],
        help="the database (postgres is postgresql)",
    )
    ddl_parser.add_argument(
        "--table",
        action="append",
        default=[],
        metavar="TABLE",
        help="an existing table to fence (repeatable; schema.table is fine)",
    )
    ddl_parser.add_argument("--lease-table", default=None, metavar="NAME", help="(fence_leases)")
    ddl_parser.add_argument("--register", default=None, metavar="NAME", help="(fence_register)")
    ddl_parser.add_argument("--schema", default=None, help="schema of the lease table and register")
    ddl_parser.add_argument("--no-lease-table", action="store_true", help="leave it out")
    ddl_parser.add_argument("--no-register", action="store_true", help="leave it out")
    ddl_parser.add_argument(
        "--no-tombstone", action="store_true", help="no tombstone flag on the tables"
    )
    ddl_parser.add_argument(
        "--triggers-only",
        action="store_true",
        help="only the database's judge of the tables and the register (install or upgrade)",
    )
    ddl_parser.add_argument(
        "--no-triggers",
        action="store_true",
        help="leave the database's judge out (the guards then refuse to write the tables)",
    )

    doctor = commands.add_parser(
        "doctor",
        help="check a backend's settings for fencing: ok, warn or fail, with what to do",
        description="Read the backend's settings and judge them: Redis eviction policy, "
        "persistence and fsync, role, clock offset; PostgreSQL fsync, synchronous_commit, "
        "wal_level, role, clock offset, missing tables; SQLite journal mode, busy timeout, "
        "missing tables; etcd and ZooKeeper members, quorum and leader. Exits 1 if a check "
        "fails.",
    )
    doctor.add_argument("url", metavar="URL", help=_url_help("the backend"))
    doctor.add_argument(
        "--strict", action="store_true", help="exit 1 on a warning too, not only on a failure"
    )
    _add_backend_options(doctor, tokens=True)

    commands.add_parser(
        "demo",
        help="watch a paused lock holder's stale write being refused (SQLite, no server)",
        add_help=False,
    )
    commands.add_parser(
        "chaos",
        help="pause lock holders and crash servers for every lock/guard pairing; check the log",
        add_help=False,
    )
    return parser


# -- entry point ------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``fence`` command; return its exit status.

    A usage error exits 2 (argparse exits on its own); a failure prints one line and
    returns 1; Ctrl-C returns 130. None of them prints a traceback.
    """
    try:
        return _main(argv)
    except KeyboardInterrupt as exc:
        note = f": {exc}" if isinstance(exc, _Interrupted) else ""
        print(f"fence: interrupted{note}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except _UsageError as exc:
        print(f"fence: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except _Failed as exc:
        print(f"fence: {exc}", file=sys.stderr)
        return EXIT_FAILED


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "demo":
        from fence._demo import main as demo

        return demo(rest)
    if args.command == "chaos":
        from fence._chaos.runner import main as chaos

        return chaos(rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command is None:
        # A usage error: the help goes to stderr, as argparse's own errors do, so that
        # nothing reaches a pipe that expected a command's output.
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    # Library and driver logs (kazoo's reconnection attempts) would mix with the output;
    # what matters reaches the user as an error, in one line.
    if not logging.getLogger().handlers:
        logging.getLogger().addHandler(logging.NullHandler())
    if getattr(args, "timeout", 1) <= 0:
        raise _UsageError(f"--timeout must be positive, got {args.timeout}")
    run = {
        "inspect": _inspect,
        "revoke": _revoke,
        "list": _list,
        "ddl": _ddl,
        "doctor": _doctor,
    }
    return run[args.command](args)


# -- shared helpers ---------------------------------------------------------------------------


def _backend(url: str) -> tuple[str, str]:
    """The backend kind of ``url`` and its scheme variant (``"cluster"`` of redis+cluster)."""
    try:
        scheme = urlsplit(url).scheme.lower() if "://" in url else ""
    except ValueError as exc:  # "Invalid IPv6 URL"
        raise _UsageError(f"not a URL: {url!r} ({exc})") from None
    if not scheme:
        raise _UsageError(f"not a URL: {url!r}; {_url_help('use')}")
    base, _, variant = scheme.partition("+")
    kind = _KINDS.get(base)
    if kind is None:
        raise _UsageError(f"no lock manager for {scheme!r}; {_url_help('use')}")
    if kind == "memory":
        raise _UsageError(
            "memory:// locks live inside one process: no other process, this command "
            "included, can see them"
        )
    return kind, variant if kind == "redis" else ""


def _missing_package(exc: ModuleNotFoundError) -> _Failed:
    top = (exc.name or "").split(".")[0]
    hint = install_hint(top)
    if hint is not None:
        return _Failed(f"{top} is not installed: {hint}")
    package = _DRIVER_PACKAGES.get(top)
    if package is not None:  # a driver the URL names after its "+"
        return _Failed(
            f"{top} is not installed: the URL asks for the {top} driver (pip install "
            f"{package}); or name no driver, postgresql://, for psycopg 3 (pip install "
            "'iofence[postgres]')"
        )
    return _Failed(f"a module is missing: {exc}")


def _where(url: str) -> str:
    """The URL without credentials, for messages."""
    scheme, _, rest = url.partition("://")
    netloc, slash, path = rest.partition("/")
    return f"{scheme}://{netloc.rsplit('@', 1)[-1]}{slash}{path.split('?', 1)[0]}"


def _sqlite_path(url: str) -> str | None:
    """The file of a sqlite:// URL (``None`` for another URL); refuses an in-memory one."""
    from fence._doctor import sqlite_file

    if not urlsplit(url).scheme.lower().startswith("sqlite"):
        return None
    from sqlalchemy.engine import make_url

    path = sqlite_file(make_url(url).database)
    if path is None:
        raise _UsageError(
            "an in-memory SQLite database lives inside one process; name a file: "
            "sqlite:///path/to/locks.db"
        )
    return path


@contextlib.contextmanager
def _quiet_warnings() -> Iterator[None]:
    """Show library warnings (a risky Redis setting) as one line each on stderr."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        finally:
            for warning in caught:
                print(f"fence: warning: {warning.message}", file=sys.stderr)


@contextlib.contextmanager
def _errors(url: str) -> Iterator[None]:
    """Turn library and driver errors into a usage error or a one-line failure."""
    try:
        yield
    except ModuleNotFoundError as exc:
        raise _missing_package(exc) from None
    except BackendError as exc:
        raise _Failed(str(exc)) from None
    except ConfigurationError as exc:
        raise _UsageError(str(exc)) from None
    except ValueError as exc:  # the driver's URL parser: a bad port, say
        raise _UsageError(f"not a usable URL: {_where(url)} ({exc})") from None
    except FenceError as exc:
        raise _Failed(str(exc)) from None
    except OSError as exc:
        raise _Failed(f"{_where(url)}: {exc}") from None
    except Exception as exc:
        # Driver errors that the managers do not wrap (a bad URL that SQLAlchemy or
        # redis-py refuses at connect time, say): one line, never a traceback.
        if type(exc).__module__.split(".")[0] in (
            "sqlalchemy",
            "redis",
            "psycopg",
            "pymysql",
            "kazoo",
            "httpx",
        ):
            if type(exc).__name__ in ("ArgumentError", "NoSuchModuleError"):  # a bad URL, driver
                raise _UsageError(f"not a usable URL: {_where(url)} ({exc})") from None
            raise _Failed(f"{_where(url)}: {type(exc).__name__}: {exc}") from None
        raise


def _manager(args: argparse.Namespace, kind: str) -> Any:
    """The sync lock manager for ``args.url``, built by :func:`fence.connect`."""
    options: dict[str, Any] = {}
    if kind == "redis":
        options["socket_timeout"] = args.timeout
        if args.prefix is not None:
            options["prefix"] = args.prefix
    elif kind == "sql":
        options["table"] = args.lease_table or "fence_leases"
        if args.schema is not None:
            options["schema"] = args.schema
        if urlsplit(args.url).scheme.lower().startswith("postgres"):
            timeout = max(2, math.ceil(args.timeout))  # libpq: whole seconds, at least 2
            options["engine_options"] = {"connect_args": {"connect_timeout": timeout}}
            options["listen"] = False  # nothing here waits for a release
        elif urlsplit(args.url).scheme.lower().startswith(("mariadb", "mysql")):
            options["engine_options"] = {"connect_args": {"connect_timeout": args.timeout}}
    elif kind in ("etcd", "zookeeper"):
        options["request_timeout"] = args.timeout
        _refuse_if_nothing_listens(args.url, kind, args.timeout)
    token_mode = getattr(args, "token_mode", None)
    if token_mode is not None:
        if kind not in ("redis", "sql"):
            raise _UsageError(f"--token-mode is for Redis and SQL; {kind} issues its own tokens")
        options["token_mode"] = TokenMode(token_mode)
    if kind != "redis" and args.prefix is not None:
        raise _UsageError("--prefix is for Redis")
    if kind != "sql" and (args.lease_table or args.register or args.schema):
        raise _UsageError("--lease-table, --register and --schema are for SQL")
    path = _sqlite_path(args.url) if kind == "sql" else None
    if path is not None and not os.path.exists(path):
        raise _Failed(f"no SQLite database at {path}")
    return fence.connect(args.url, **options)


def _refuse_if_nothing_listens(url: str, kind: str, timeout: float) -> None:
    """Fail at once when every endpoint of an etcd or ZooKeeper URL refuses the connection.

    The managers retry a refused connection until their deadline, as a member that
    restarts refuses for a moment; a command run by hand learns sooner that nothing
    listens where the URL points. A port that accepts, or that does not answer in time,
    is left to the manager and its timeout.
    """
    import socket

    from fence._etcd import parse_endpoints
    from fence._zookeeper import parse_hosts

    try:
        if kind == "etcd":
            parts = [urlsplit(e) for e in parse_endpoints(url)[0]]
            default = {"https": 443}
        else:
            parts = [urlsplit(f"//{h.strip()}") for h in parse_hosts(url)[0].split(",")]
            default = {"": 2181}  # kazoo's
        endpoints = [(p.hostname, p.port or default.get(p.scheme, 80)) for p in parts]
    except (ConfigurationError, ValueError):
        return  # the manager says what is wrong with the URL
    refused = []
    for host, port in endpoints:
        if host is None:
            return
        try:
            with socket.create_connection((host, port), timeout=timeout):
                return
        except ConnectionRefusedError:
            refused.append(f"{host}:{port}")
        except OSError:
            return  # no such host, a timeout: the manager's error says it
    name = "etcd" if kind == "etcd" else "ZooKeeper"
    raise _Failed(
        f"{name} at {', '.join(refused)} refused the connection (nothing listens there): "
        "check the host and port in the URL, and that the server runs"
    )


def _resource(value: str) -> str:
    try:
        return validate_resource(value)
    except FenceError as exc:
        raise _UsageError(str(exc)) from None


def _shown(name: str) -> str:
    """``name`` as one line of text: quoted with escapes when it holds a newline, a tab or
    another unprintable character, which would otherwise break the rows or hide in them."""
    return name if name.isprintable() else repr(name)


# -- inspect ----------------------------------------------------------------------------------


def _inspect(args: argparse.Namespace) -> int:
    resource = _resource(args.resource)
    kind, variant = _backend(args.url)
    report: dict[str, Any] = {"resource": resource, "backend": kind, "url": _where(args.url)}
    with _errors(args.url):
        manager = _manager(args, kind)
        try:
            with _quiet_warnings():
                info = manager.inspect(resource)
                report["held"] = info is not None
                if info is not None:
                    report["holder"] = info.holder
                    report["token"] = info.token
                    report["remaining"] = round(info.remaining, 3)
                report.update(_kept(args, kind, variant, manager, resource))
        finally:
            with contextlib.suppress(Exception):
                manager.close()
    if args.json:
        print(json.dumps(report))
        return EXIT_OK
    rows = [("resource", _shown(resource)), ("backend", f"{kind} at {report['url']}")]
    if info is None:
        rows.append(("held by", "nobody: the lock is free"))
    else:
        rows += [
            ("held by", _shown(info.holder) if info.holder else "(no label)"),
            ("token", str(info.token)),
            ("time left", f"{info.remaining:.3f} s by the backend's clock"),
        ]
    if "last_token" in report:
        last = report["last_token"]
        shown = "none issued" if last is None else str(last)
        rows.append(("last token", f"{shown} ({_shown(report['last_token_at'])})"))
    fence_value = report.get("fence")
    rows.append(
        (
            "fence",
            f"{'not set' if fence_value is None else fence_value} ({_shown(report['fence_at'])})",
        )
    )
    rows += [("note", _shown(note)) for note in report.get("notes", [])]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name + ':':<{width + 1}} {value}")
    return EXIT_OK


def _kept(
    args: argparse.Namespace, kind: str, variant: str, manager: Any, resource: str
) -> dict[str, Any]:
    """What the backend keeps beside the lease: the last token issued and the fence."""
    if kind == "redis" and variant in ("", "cluster"):
        return _redis_kept(args, variant == "cluster", resource)
    if kind == "redis":
        return {"fence": None, "fence_at": f"not read on redis+{variant}:// URLs"}
    if kind == "sql":
        return _sql_kept(args, manager, resource)
    name, token = (
        ("etcd", "key's create revision") if kind == "etcd" else ("ZooKeeper", "node's czxid")
    )
    return {
        "fence": None,
        "fence_at": f"{name} keeps none: the guards keep fences with the data",
        "notes": [f"the token is the lock {token}"],
    }


def _redis_kept(args: argparse.Namespace, cluster: bool, resource: str) -> dict[str, Any]:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from fence._redis_keys import DEFAULT_PREFIX, resource_keys

    keys = resource_keys(args.prefix if args.prefix is not None else DEFAULT_PREFIX, resource)
    options: dict[str, Any] = {
        "socket_timeout": args.timeout,
        "socket_connect_timeout": args.timeout,
        "retry": Retry(NoBackoff(), 0),
    }
    factory: Any = redis.RedisCluster if cluster else redis.Redis
    client = factory.from_url(args.url.replace("+cluster://", "://", 1), **options)
    try:
        last, fence_value = client.get(keys.token), client.get(keys.fence)
    finally:
        client.close()
    return {
        "last_token": None if last is None else int(last),
        "last_token_at": keys.token,
        "fence": None if fence_value is None else int(fence_value),
        "fence_at": keys.fence,
        "notes": [
            (
                f"{keys.fence} is the Redis guards' resource fence (scope='resource'); a "
                f"per-key fence (scope='key') is {keys.fence[: -len('fence')]}key:<key>"
            )
        ],
    }


def _sql_kept(args: argparse.Namespace, manager: Any, resource: str) -> dict[str, Any]:
    import sqlalchemy as sa

    table = args.lease_table or "fence_leases"
    register = args.register or "fence_register"
    where = f"{args.schema}." if args.schema else ""
    leases = sa.table(table, sa.column("resource"), sa.column("token"), schema=args.schema)
    fences = sa.table(register, sa.column("scope"), sa.column("fence"), schema=args.schema)
    found: dict[str, Any] = {"last_token_at": f"{where}{table} row"}
    with manager.engine.connect() as conn:
        found["last_token"] = conn.execute(
            sa.select(leases.c.token).where(leases.c.resource == resource)
        ).scalar()
        if sa.inspect(conn).has_table(register, schema=args.schema):
            found["fence"] = conn.execute(
                sa.select(fences.c.fence).where(fences.c.scope == resource)
            ).scalar()
            found["fence_at"] = f"{where}{register} row of scope {resource!r}"
        else:
            found["fence"] = None
            found["fence_at"] = f"no {where}{register} table"
    found["notes"] = ["row guards keep a fence in each row's fence column"]
    return found


# -- list -------------------------------------------------------------------------------------

_LIST_COLUMNS = ("RESOURCE", "HOLDER", "TOKEN", "MODE", "READERS", "WAITERS", "TIME LEFT")


def _list(args: argparse.Namespace) -> int:
    if args.limit is not None and args.limit < 0:
        raise _UsageError(f"--limit must be 0 or more, got {args.limit}")
    kind, _ = _backend(args.url)
    rows: list[tuple[str, ...]] = []
    with _errors(args.url):
        manager = _manager(args, kind)
        try:
            with _quiet_warnings(), _no_list(kind):
                for info in manager.list(args.start, limit=args.limit):
                    if args.json:
                        print(json.dumps(_listed(info)), flush=True)
                        continue
                    rows.append(
                        (
                            _shown(info.resource),
                            _shown(info.holder) if info.holder else "-",
                            str(info.token),
                            info.mode.value,
                            str(len(info.readers)),
                            str(info.waiters),
                            f"{info.remaining:.3f} s",
                        )
                    )
        finally:
            with contextlib.suppress(Exception):
                manager.close()
    if args.json:
        return EXIT_OK
    if not rows:
        print(
            "no locks held"
            + (f" on resources that start with {args.start!r}" if args.start else "")
        )
        return EXIT_OK
    widths = [max(len(row[i]) for row in [_LIST_COLUMNS, *rows]) for i in range(len(_LIST_COLUMNS))]
    for row in [_LIST_COLUMNS, *rows]:
        print(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )
    return EXIT_OK


@contextlib.contextmanager
def _no_list(kind: str) -> Iterator[None]:
    """A backend that has no list fails (exit 1): the command is right, the backend is not."""
    try:
        yield
    except ConfigurationError as exc:
        raise _Failed(f"fence list on {kind}: {exc}") from None


def _listed(info: Any) -> dict[str, Any]:
    return {
        "resource": info.resource,
        "holder": info.holder,
        "token": info.token,
        "mode": info.mode.value,
        "readers": [
            {"holder": r.holder, "token": r.token, "remaining": round(r.remaining, 3)}
            for r in info.readers
        ],
        "waiters": info.waiters,
        "remaining": round(info.remaining, 3),
    }


# -- revoke -----------------------------------------------------------------------------------


def _revoke(args: argparse.Namespace) -> int:
    resource = _resource(args.resource)
    kind, _ = _backend(args.url)
    with _errors(args.url):
        manager = _manager(args, kind)
        try:
            with _quiet_warnings():
                try:
                    token = manager.revoke(resource)
                except KeyboardInterrupt:
                    raise _Interrupted(
                        "the revoke may or may not have ended the lease (see fence inspect)"
                    ) from None
        finally:
            with contextlib.suppress(Exception):
                manager.close()
    print(token)
    if kind == "redis":
        from fence._redis_keys import DEFAULT_PREFIX, resource_keys

        prefix = args.prefix if args.prefix is not None else DEFAULT_PREFIX
        after = (
            f"{resource_keys(prefix, resource).fence} is raised to it: Redis guards with "
            "scope='resource' refuse older tokens from now on"
        )
    else:
        after = (
            "claim it on your guards (RowGuard.claim, FenceRegister.claim, RedisGuard.claim)"
            " to refuse the old holder's writes before the next holder writes"
        )
    print(
        f"fence revoke: every lease on {resource!r} ended; new token {token}; {after}.",
        file=sys.stderr,
    )
    return EXIT_OK


# -- ddl --------------------------------------------------------------------------------------


_SQLITE_AGAIN = (
    "SQLite has no ADD COLUMN IF NOT EXISTS: run the ALTER TABLE lines of a table once (run "
    "again, the script stops at the first, with 'duplicate column name'). Name a table with "
    "--table until it has its columns, and upgrade its judge with --triggers-only, which runs "
    "again and again."
)


def _ddl_script(
    dialect: str,
    tables: Sequence[str] = (),
    *,
    lease_table: str | None = "fence_leases",
    register: str | None = "fence_register",
    schema: str | None = None,
    tombstone: bool = True,
    triggers: bool = True,
    triggers_only: bool = False,
) -> str:
    """The SQL that ``fence ddl`` prints: statements ending in ``;``, with comments.

    Args:
        dialect: ``"postgresql"``, ``"sqlite"``, ``"mariadb"`` or ``"mysql"``.
        tables: existing tables that get a fence column (``schema.table`` is fine).
        lease_table: the SQL lock manager's lease table, or ``None`` to leave it out.
        register: the fence register, or ``None`` to leave it out.
        schema: the schema of the lease table and the register.
        tombstone: give each table the tombstone flag of fenced deletes too.
        triggers: the database's judge of each table and of the register (C14).
        triggers_only: nothing but the judge (an install or an upgrade of the triggers).

    Raises:
        ConfigurationError: an unknown dialect or an empty name.
    """
    from fence._sql_dialect import dialect_for
    from fence._sql_schema import lease_schema_ddl

    quote = dialect_for(dialect).quote
    fence_column_ddl, tombstone_ddl, register_ddl = sql_ddl()
    mysql = dialect in ("mariadb", "mysql")
    if mysql:
        register_ddl = sql_mysql_register_ddl()
    if dialect in ("postgresql", "mariadb"):
        # The library's templates run on SQLite too, which has no ADD COLUMN IF NOT EXISTS;
        # PostgreSQL and MariaDB have it (MySQL has not), so that the whole script can run
        # again (`| psql`, a migration replayed) on tables that have their columns already.
        fence_column_ddl, tombstone_ddl = (
            ddl.replace(" ADD COLUMN ", " ADD COLUMN IF NOT EXISTS ", 1)
            for ddl in (fence_column_ddl, tombstone_ddl)
        )
    trigger_ddl = sql_trigger_ddl()

    def parts_of(name: str, in_schema: str | None = None) -> list[str]:
        parts = [*([in_schema] if in_schema else []), *name.split(".")]
        if not all(parts) or len(parts) > 2:
            raise ConfigurationError(f"not a table name: {name!r}")
        return parts

    def qualified(name: str, in_schema: str | None = None) -> str:
        return ".".join(quote(part) for part in parts_of(name, in_schema))

    def judge(name: str, in_schema: str | None = None, **options: Any) -> list[str]:
        *owner, table = parts_of(name, in_schema)
        found = trigger_ddl(table, dialect=dialect, schema=owner[0] if owner else None, **options)
        if mysql:
            # A trigger's body holds semicolons: the clients split statements at another
            # delimiter meanwhile.
            return ["DELIMITER //", *(statement + " //" for statement in found), "DELIMITER ;"]
        return [statement + ";" for statement in found]

    judge_note = (
        "the database's judge (triggers that refuse a write without a token, with a stale "
        "one, or one that lowers a fence; running it again upgrades them)"
    )
    if triggers_only:
        out = [f"-- iofence: the database's judge for {dialect}; running it again upgrades it."]
        if register is not None:
            out += ["", f"-- {register}: {judge_note}.", *judge(register, schema, register=True)]
        for table in tables:
            flag = "deleted" if tombstone else None
            out += ["", f"-- {table}: {judge_note}.", *judge(table, tombstone=flag)]
        return "\n".join(out) + "\n"
    if dialect == "postgresql":
        out = [
            "-- iofence DDL for postgresql, for a migration or psql: running it again changes",
            "-- nothing but the judge, which it replaces (an upgrade).",
        ]
    elif mysql:
        out = [
            f"-- iofence DDL for {dialect}, for a migration or the {dialect} client: the fence",
            "-- register, the columns of fenced tables and the judge's triggers (whose",
            "-- DELIMITER lines are for the client; a migration runs each statement alone).",
        ]
        if dialect == "mariadb":
            out.append("-- Running it again changes nothing (IF NOT EXISTS).")
        else:
            out.append("-- MySQL has no ADD COLUMN IF NOT EXISTS: run the ALTER TABLE lines once.")
    else:
        out = [f"-- iofence DDL for {dialect}, for a migration or sqlite3."]
        out += ["-- " + line for line in textwrap.wrap(_SQLITE_AGAIN, 88)]
    if lease_table is not None:
        out += [
            "",
            "-- The SQL lock manager's lease table and the readers and waiters of its shared",
            "-- locks (SQLLockManager, fence.lease_schema_ddl).",
            *(s + ";" for s in lease_schema_ddl(dialect, table=lease_table, schema=schema)),
        ]
    if register is not None:
        out += [
            "",
            "-- The fence register: claims of FenceRegister."
            if mysql
            else "-- The fence register: claims of the session hook, UnitOfWork and FenceRegister.",
            register_ddl.format(table=qualified(register, schema)) + ";",
        ]
        if triggers:
            out += [f"-- Its judge: {judge_note}.", *judge(register, schema, register=True)]
    for table in tables:
        name = qualified(table)
        what = "its fence column (existing rows start at 0)"
        if tombstone:
            what += " and the tombstone flag of fenced deletes"
        out += ["", f"-- {table}: {what}.", fence_column_ddl.format(table=name) + ";"]
        if tombstone:
            out.append(tombstone_ddl.format(table=name) + ";")
        if triggers:
            flag = "deleted" if tombstone else None
            out += [f"-- Its judge: {judge_note}.", *judge(table, tombstone=flag)]
    return "\n".join(out) + "\n"


def _ddl(args: argparse.Namespace) -> int:
    try:
        text = _ddl_script(
            args.dialect,
            args.table,
            lease_table=None if args.no_lease_table else (args.lease_table or "fence_leases"),
            register=None if args.no_register else (args.register or "fence_register"),
            schema=args.schema,
            tombstone=not args.no_tombstone,
            triggers=not args.no_triggers,
            triggers_only=args.triggers_only,
        )
    except ModuleNotFoundError as exc:
        raise _missing_package(exc) from None
    except ConfigurationError as exc:
        raise _UsageError(str(exc)) from None
    sys.stdout.write(text)
    return EXIT_OK


# -- doctor -----------------------------------------------------------------------------------


def _doctor(args: argparse.Namespace) -> int:
    from fence import _doctor as doctor

    kind, variant = _backend(args.url)
    mode = TokenMode(args.token_mode or TokenMode.HYBRID)
    with _errors(args.url):
        if kind == "redis":
            if variant not in ("", "cluster"):
                raise _UsageError(
                    f"fence doctor reads redis:// and redis+cluster:// URLs, not redis+{variant}://"
                )
            if args.lease_table or args.register or args.schema:
                raise _UsageError("--lease-table, --register and --schema are for SQL")
            url = args.url.replace("+cluster://", "://", 1)
            checks = doctor.redis_checks(
                url, timeout=args.timeout, token_mode=mode, cluster=variant == "cluster"
            )
        elif kind == "sql":
            manager = _manager(args, kind)
            try:
                checks = doctor.sql_checks(
                    manager.engine,
                    lease_table=args.lease_table or "fence_leases",
                    schema=args.schema,
                    register=args.register or "fence_register",
                    path=_sqlite_path(args.url),
                )
            finally:
                with contextlib.suppress(Exception):
                    manager.close()
        elif kind == "etcd":
            _no_sql_options(args)
            checks = doctor.etcd_checks(args.url, timeout=args.timeout)
        else:
            _no_sql_options(args)
            checks = doctor.zookeeper_checks(args.url, timeout=args.timeout)
    print(f"fence doctor {_where(args.url)}")
    for check in checks:
        print(f"  {check.status:<4}  {check.name}: {check.finding}")
        if check.advice:
            print(f"        -> {check.advice}")
    counts = {s: sum(c.status == s for c in checks) for s in (doctor.OK, doctor.WARN, doctor.FAIL)}
    print(f"{counts['ok']} ok, {counts['warn']} warn, {counts['fail']} fail")
    bad = counts["fail"] + (counts["warn"] if args.strict else 0)
    return EXIT_FAILED if bad else EXIT_OK


def _no_sql_options(args: argparse.Namespace) -> None:
    if args.lease_table or args.register or args.schema or args.prefix is not None:
        raise _UsageError("--prefix is for Redis; --lease-table, --register, --schema for SQL")
    if args.token_mode is not None:
        raise _UsageError("--token-mode is for Redis and SQL")
