"""Throwaway servers on loopback: ``redis-server`` (alone, as a Redis Cluster, behind a
Sentinel), a PostgreSQL cluster and a MariaDB server, with the faults that are caused on
them for real.

``fence chaos`` starts them because it has to kill them; the test suite and the benchmarks
start the same ones. Each runs on a free loopback port in a temporary directory and is
stopped at the end, and each can be broken: ``SIGKILL``, ``SIGSTOP``/``SIGCONT``, a restart
on the same port and directory, PostgreSQL's immediate shutdown (a crash).

Every server directory holds ``owner.pid`` (the process that started it) and the server's
own pid, so a later run can stop what a run that died left behind
(``tests.servers.reap_orphans``).

The defaults favour speed: no AOF for Redis, no fsync and asynchronous commits for
PostgreSQL. A chaos run asks for the durability its checker assumes, that a killed
*process* loses nothing it acknowledged:

- Redis with :data:`REDIS_AOF` (``--appendonly yes --appendfsync always``): Redis writes
  the AOF buffer to the file and flushes it before it sends the replies of the commands in
  it, so ``kill -9`` of the process keeps every acknowledged write. ``everysec`` does not
  promise that: while a background fsync is still running (a busy disk), Redis postpones
  writing the buffer for up to two seconds and replies all the same, and a process killed
  then loses those writes (a chaos run on a loaded machine lost an update that way).
- PostgreSQL with :data:`POSTGRES_DURABLE` (``synchronous_commit=on``: a commit returns
  after its WAL is written), still with ``fsync=off`` (no flush to the disk: a process
  crash keeps the page cache, a power cut would not). ``pg_ctl stop -m immediate`` is a
  crash: no checkpoint, crash recovery on the next start.
- MariaDB with ``innodb-flush-log-at-trx-commit=2``: a commit returns once its redo log
  is written to the operating system, so ``kill -9`` of ``mariadbd`` keeps every
  acknowledged commit (InnoDB's crash recovery replays it); a power cut would not.

PostgreSQL and MariaDB never run as root: as root they run as the ``postgres`` and ``mysql``
OS users (made by the system packages), through ``runuser``.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "MARIADB_PID_FILE",
    "OWNER_FILE",
    "POSTGRES_DURABLE",
    "REDIS_AOF",
    "REDIS_PID_FILE",
    "MariaDBServer",
    "PostgresServer",
    "RedisClusterServers",
    "RedisServer",
    "SentinelSetup",
    "claim_dir",
    "free_port",
    "pg_bindir",
    "wait_for_port",
]

#: The file of a server directory that names the process that started the server.
OWNER_FILE = "owner.pid"

#: The file of a redis-server's (or a Sentinel's) directory that holds its pid.
REDIS_PID_FILE = "redis.pid"

#: The file of a MariaDB server's directory that holds its pid.
MARIADB_PID_FILE = "mariadb.pid"

#: ``redis-server`` arguments under which ``kill -9`` keeps every acknowledged write.
REDIS_AOF = ("--appendonly", "yes", "--appendfsync", "always")

#: PostgreSQL settings under which a crash keeps every acknowledged commit, with room for
#: the connections of every chaos worker.
POSTGRES_DURABLE = {"synchronous_commit": "on", "max_connections": "200"}


def claim_dir(path: Path) -> None:
    """Record that this process owns a server directory, so a later run can reap it."""
    (path / OWNER_FILE).write_text(str(os.getpid()))


def _ephemeral_ports() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now.

    It is picked below the kernel's ephemeral range: a server restarted on its old port
    must not find it taken by some client's outgoing connection.
    """
    low, high = _ephemeral_ports()
    span = (10000, low - 1) if low > 12000 else (high + 1, 65535)
    for _ in range(100):
        port = random.randint(*span)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_port(
    port: int, timeout: float = 30.0, proc: subprocess.Popen[bytes] | None = None
) -> None:
    """Wait until something accepts connections on 127.0.0.1:``port``.

    Raises:
        TimeoutError: nothing listened within ``timeout`` seconds.
        RuntimeError: ``proc`` (the server, if given) exited instead, e.g. it could not bind.
    """
    end = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server for port {port} exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > end:
                raise TimeoutError(f"nothing listens on 127.0.0.1:{port}") from None
            time.sleep(0.02)


# -- Redis ------------------------------------------------------------------------------------


class RedisServer:
    """A ``redis-server`` on loopback, without persistence unless asked.

    Args:
        extra: more ``redis-server`` arguments; a later one wins over an earlier one, so
            ``*REDIS_AOF`` (or ``"--appendonly", "yes", "--appendfsync", "always"``) turns
            the AOF on.
        port: its port (default: a free one).
        password: the password clients and its replication link use (``requirepass`` and
            ``masterauth``).

    Raises:
        RuntimeError: ``redis-server`` is not installed.
    """

    name = "redis"

    def __init__(self, *extra: str, port: int | None = None, password: str | None = None) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.exe = exe
        self.port = port or free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="iofence-redis-"))
        self.password = password
        if password is not None:  # for clients, and for this server's replication link
            extra = (*extra, "--requirepass", password, "--masterauth", password)
        self.extra = list(extra)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0`` (with ``:password@`` if the server has one)."""
        auth = f":{self.password}@" if self.password is not None else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        """Start the server (loading its AOF, if any) and wait until it answers.

        Raises:
            RuntimeError: it exited or never answered; the message ends with its log.
        """
        args = [
            self.exe,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.dir),
            "--save", "",
            "--appendonly", "no",
            "--daemonize", "no",
            "--logfile", str(self.dir / "redis.log"),
            *self.extra,
        ]  # fmt: skip
        self.proc = subprocess.Popen(  # noqa: S603 - a fixed program found on PATH
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        claim_dir(self.dir)
        (self.dir / REDIS_PID_FILE).write_text(str(self.proc.pid))
        try:
            wait_for_port(self.port, proc=self.proc)
            self._wait_until_loaded()
        except RuntimeError:
            log = self.dir / "redis.log"
            tail = log.read_text()[-2000:] if log.exists() else ""
            self.proc = None
            raise RuntimeError(f"redis-server did not start on {self.port}:\n{tail}") from None
        return self

    def _wait_until_loaded(self, timeout: float = 30.0) -> None:
        """Wait until PING answers PONG: Redis accepts connections while it still loads its
        AOF, and answers every command with ``-LOADING`` until it is done."""
        end = time.monotonic() + timeout
        while True:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1.0) as sock:
                if self.password is not None:
                    sock.sendall(f"AUTH {self.password}\r\n".encode())
                    sock.recv(64)
                sock.sendall(b"PING\r\n")
                reply = sock.recv(64)
            if reply.startswith(b"+PONG"):
                return
            if time.monotonic() > end:
                raise RuntimeError(f"redis-server on {self.port} still answers {reply!r}")
            time.sleep(0.01)

    def kill(self) -> None:
        """``kill -9`` the server: no shutdown, no final fsync."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
                self.proc.kill()
            self.proc.wait()
            self.proc = None

    def pause(self) -> None:
        """``SIGSTOP`` the server."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """``SIGCONT`` the server."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def restart(self) -> None:
        """``kill -9`` and start again on the same port and directory."""
        self.kill()
        self.start()

    def stop(self) -> None:
        """Kill the server and remove its directory."""
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


class RedisClusterServers:
    """A Redis Cluster of ``redis-server`` masters on loopback, no replicas.

    Each node is a :class:`RedisServer` started with ``--cluster-enabled yes`` in its own
    temporary directory. ``CLUSTER ADDSLOTSRANGE`` and ``CLUSTER MEET`` join them, as
    ``redis-cli --cluster create`` would.

    Args:
        masters: how many masters (at least 3, as ``redis-cli --cluster create`` requires).

    Raises:
        RuntimeError: ``redis-server`` is not installed.
    """

    def __init__(self, masters: int = 3) -> None:
        # The cluster bus listens on its own port (by default port + 10000, which can pass
        # 65535 for an ephemeral port), so each node gets a free one explicitly.
        self.nodes: list[RedisServer] = []
        self._bus: dict[int, int] = {}
        for _ in range(masters):
            bus = free_port()
            node = RedisServer(
                "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", "2000",
                "--cluster-port", str(bus),
            )  # fmt: skip
            self._bus[node.port] = bus
            self.nodes.append(node)

    @property
    def ports(self) -> list[int]:
        """The nodes' ports."""
        return [node.port for node in self.nodes]

    @property
    def url(self) -> str:
        """A URL of one node; cluster clients discover the others."""
        return self.nodes[0].url

    def start(self) -> RedisClusterServers:
        """Start every node, join them, split the slots, wait until every node says ``ok``.

        Raises:
            TimeoutError: the cluster did not reach state ``ok`` within 30 seconds.
        """
        import redis

        for node in self.nodes:
            node.start()
        # Any: redis-py types execute_command on some client classes only.
        clients: list[Any] = [redis.Redis(host="127.0.0.1", port=port) for port in self.ports]
        try:
            per_node = 16384 // len(clients)
            for index, client in enumerate(clients):
                first = index * per_node
                last = 16383 if index == len(clients) - 1 else first + per_node - 1
                client.execute_command("CLUSTER ADDSLOTSRANGE", first, last)
            head = clients[0]
            for node in self.nodes[1:]:
                head.execute_command("CLUSTER MEET", "127.0.0.1", node.port, self._bus[node.port])
            end = time.monotonic() + 30
            for client in clients:
                while client.cluster("INFO").get("cluster_state") != "ok":
                    if time.monotonic() > end:
                        raise TimeoutError("the Redis Cluster never reached state ok")
                    time.sleep(0.05)
        finally:
            for client in clients:
                client.close()
        return self

    def stop(self) -> None:
        """Kill every node and remove their directories."""
        for node in self.nodes:
            node.stop()


class SentinelSetup:
    """A Redis primary, one replica and one Sentinel watching them, on loopback.

    The Sentinel monitors them as :attr:`service` with a quorum of 1, and never fails over
    by itself (``down-after-milliseconds`` is a minute): a caller fails over with
    :meth:`failover`. The data nodes and the Sentinel each have their own password, as a
    production setup does, so that the URL's two password options are exercised.

    Raises:
        RuntimeError: ``redis-server`` is not installed.
    """

    service = "mymaster"
    password = "data-secret"  # noqa: S105 - a throwaway server's password
    sentinel_password = "sentinel-secret"  # noqa: S105 - a throwaway server's password

    def __init__(self) -> None:
        # Either may be the primary; a replica's first sync starts at once, not after 5 s.
        sync = ("--repl-diskless-sync-delay", "0")
        self.primary = RedisServer(*sync, password=self.password)
        self.replica = RedisServer(*sync, password=self.password)
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="iofence-sentinel-"))
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The ``redis+sentinel://`` URL of the service, both passwords in it."""
        return (
            f"redis+sentinel://:{self.password}@127.0.0.1:{self.port}/{self.service}/0"
            f"?sentinel_password={self.sentinel_password}"
        )

    def sentinel(self) -> Any:
        """A redis-py client of the Sentinel (the caller closes it)."""
        import redis

        return redis.Redis(port=self.port, password=self.sentinel_password, decode_responses=True)

    def start(self) -> SentinelSetup:
        """Start the primary, the replica and the Sentinel; wait until the Sentinel sees the
        replica in sync.

        Raises:
            RuntimeError: a server did not start, or the Sentinel never saw the replica.
        """
        try:
            self.primary.start()
            self.replica.extra += ["--replicaof", "127.0.0.1", str(self.primary.port)]
            self.replica.start()
            conf = self.dir / "sentinel.conf"
            conf.write_text(
                f"port {self.port}\n"
                "bind 127.0.0.1\n"
                f"dir {self.dir}\n"
                f"logfile {self.dir / 'sentinel.log'}\n"
                f"requirepass {self.sentinel_password}\n"
                f"sentinel monitor {self.service} 127.0.0.1 {self.primary.port} 1\n"
                f"sentinel auth-pass {self.service} {self.password}\n"
                f"sentinel down-after-milliseconds {self.service} 60000\n"
                f"sentinel failover-timeout {self.service} 60000\n"
            )
            self.proc = subprocess.Popen(  # noqa: S603 - redis-server from PATH, fixed arguments
                [self.primary.exe, str(conf), "--sentinel"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            claim_dir(self.dir)
            (self.dir / REDIS_PID_FILE).write_text(str(self.proc.pid))
            wait_for_port(self.port, proc=self.proc)
            self.wait_until(lambda: self._replica_seen(self.replica.port), "sees the replica")
        except BaseException:
            self.stop()
            raise
        return self

    def _replica_seen(self, port: int) -> bool:
        with self.sentinel() as client:
            replicas = client.sentinel_slaves(self.service)
        return any(
            int(info["port"]) == port
            and info["flags"] == "slave"
            and info.get("master-link-status") == "ok"
            for info in replicas
        )

    def master_port(self) -> int:
        """The port of the primary the Sentinel names now."""
        with self.sentinel() as client:
            _, port = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", self.service)
        return int(port)

    def wait_until(self, check: Callable[[], bool], what: str, timeout: float = 30.0) -> None:
        """Poll ``check()`` until it is true.

        Raises:
            RuntimeError: it was still false after ``timeout`` seconds; the message ends
                with the Sentinel's log.
        """
        end = time.monotonic() + timeout
        while not check():
            if time.monotonic() > end:
                log = self.dir / "sentinel.log"
                tail = log.read_text()[-3000:] if log.exists() else ""
                raise RuntimeError(f"the Sentinel never {what} within {timeout}s:\n{tail}")
            time.sleep(0.05)

    def failover(self, to: RedisServer) -> None:
        """``SENTINEL FAILOVER``, then wait until the Sentinel names ``to`` as the primary and
        ``to`` acts as one.

        The Sentinel refuses (``NOGOODSLAVE``) until it has heard from the replica lately
        (a replica that was stopped answers its pings again within about a second), so the
        command is repeated, within a bound, until it is accepted.

        Raises:
            RuntimeError: the failover was not accepted, or did not happen, in time.
        """
        import redis

        def accepted() -> bool:
            with self.sentinel() as client:
                try:
                    client.execute_command("SENTINEL", "FAILOVER", self.service)
                except redis.ResponseError as exc:
                    if "NOGOODSLAVE" in str(exc):
                        return False
                    raise
            return True

        self.wait_until(accepted, "accepted SENTINEL FAILOVER")

        def promoted() -> bool:
            if self.master_port() != to.port:
                return False
            with redis.Redis.from_url(to.url) as client:
                return bool(client.execute_command("ROLE")[0] in (b"master", "master"))

        self.wait_until(promoted, f"named {to.port} the primary")

    def stop(self) -> None:
        """Stop the Sentinel and both servers and remove their directories."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            self.proc.wait()
            self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)
        for server in (self.replica, self.primary):
            with contextlib.suppress(ProcessLookupError):
                if server.proc is not None:
                    os.kill(server.proc.pid, signal.SIGCONT)
            server.stop()


# -- PostgreSQL -------------------------------------------------------------------------------


def pg_bindir() -> Path:
    """The folder of PostgreSQL's server programs (``initdb``, ``pg_ctl``).

    Raises:
        RuntimeError: PostgreSQL is not installed.
    """
    for name in ("pg_ctl", "initdb"):
        found = shutil.which(name)
        if found:
            return Path(os.path.realpath(found)).parent
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not candidates:
        raise RuntimeError("PostgreSQL is not installed (apt-get install postgresql)")
    return Path(candidates[-1]).parent


class PostgresServer:
    """A throwaway PostgreSQL cluster on loopback, never run as root.

    Args:
        settings: server settings (``-c name=value``) that replace or add to
            :attr:`SETTINGS`, e.g. :data:`POSTGRES_DURABLE`.

    Raises:
        RuntimeError: PostgreSQL is not installed, or this process runs as root and there
            is no ``postgres`` OS user to run the cluster as, or no ``runuser``.
    """

    name = "postgres"
    user = "postgres"

    #: The settings of every cluster: fast (no fsync, asynchronous commits), room for the
    #: connections of a test run, and for two-phase commits.
    SETTINGS: Mapping[str, str] = {
        "fsync": "off",
        "synchronous_commit": "off",
        "full_page_writes": "off",
        "max_connections": "100",
        "max_prepared_transactions": "8",
    }

    def __init__(self, settings: Mapping[str, str] | None = None) -> None:
        self.bindir = pg_bindir()
        self.settings = {**self.SETTINGS, **(settings or {})}
        self._as_user: list[str] = []
        pw: pwd.struct_passwd | None = None
        # Every program and user is looked up before the folder is made, so that a missing
        # one leaves nothing behind.
        if os.geteuid() == 0:
            try:
                pw = pwd.getpwnam("postgres")
            except KeyError:
                raise RuntimeError("running as root needs the 'postgres' OS user") from None
            if shutil.which("runuser") is None:
                raise RuntimeError(
                    "runuser is not installed (apt-get install util-linux); as root, "
                    "PostgreSQL runs as the 'postgres' user through it"
                )
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="iofence-pg-"))
        self.data = self.dir / "data"
        self.sockets = self.dir / "sockets"
        if pw is not None:
            os.chmod(self.dir, 0o755)  # noqa: S103 - the postgres user must enter it
            self.sockets.mkdir()
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
            os.chown(self.sockets, pw.pw_uid, pw.pw_gid)
            self._as_user = ["runuser", "-u", "postgres", "--"]
        else:
            self.sockets.mkdir()

    @property
    def url(self) -> str:
        """A SQLAlchemy URL (psycopg 3 driver) for the ``postgres`` database."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def conninfo(self) -> str:
        """A libpq connection string for psycopg."""
        return f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres"

    def _run(self, *args: str) -> None:
        subprocess.run(  # noqa: S603 - PostgreSQL's own programs, fixed arguments
            [*self._as_user, *args],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            cwd=self.dir,
        )

    def start(self) -> PostgresServer:
        """``initdb`` (the first time) and start the cluster; wait until it accepts
        connections.

        Raises:
            subprocess.CalledProcessError: ``initdb`` or ``pg_ctl start`` failed.
        """
        claim_dir(self.dir)
        if not self.data.exists():
            self._run(
                str(self.bindir / "initdb"),
                "-D", str(self.data),
                "-U", "postgres",
                "--auth=trust",
                "--no-sync",
                "-E", "UTF8",
                "--locale=C",
            )  # fmt: skip
        options = f"-p {self.port} -k {self.sockets} -c listen_addresses=127.0.0.1 " + " ".join(
            f"-c {name}={value}" for name, value in self.settings.items()
        )
        self._run(
            str(self.bindir / "pg_ctl"),
            "-D", str(self.data),
            "-o", options,
            "-l", str(self.dir / "postgres.log"),
            "-w", "-t", "60",
            "start",
        )  # fmt: skip
        wait_for_port(self.port)
        return self

    def stop(self, mode: str = "fast") -> None:
        """Stop the cluster with ``pg_ctl stop -m <mode>`` (``immediate`` is a crash: every
        server process quits at once, no checkpoint); its files stay for a restart.

        Raises:
            subprocess.CalledProcessError: ``pg_ctl stop`` failed.
        """
        if (self.data / "postmaster.pid").exists():
            self._run(str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop")

    def _pids(self) -> list[int]:
        """The postmaster and every process it started (backends, background workers)."""
        pidfile = self.data / "postmaster.pid"
        root = int(pidfile.read_text().split()[0])
        children: dict[int, list[int]] = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = stat.read_text().rsplit(")", 1)[1].split()
                children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        found, todo = [], [root]
        while todo:
            pid = todo.pop()
            found.append(pid)
            todo.extend(children.get(pid, []))
        return found

    def pause(self) -> None:
        """``SIGSTOP`` the whole cluster: connections stay open, nothing answers."""
        for pid in self._pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)

    def resume(self) -> None:
        """``SIGCONT`` every process of the cluster."""
        for pid in self._pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def restart(self, mode: str = "immediate") -> None:
        """Stop (by default as a crash) and start again on the same port."""
        self.stop(mode)
        self.start()

    def destroy(self) -> None:
        """Stop the cluster (as a crash) and remove its files."""
        with contextlib.suppress(subprocess.CalledProcessError):
            self.stop("immediate")
        shutil.rmtree(self.dir, ignore_errors=True)


# -- MariaDB ----------------------------------------------------------------------------------


class MariaDBServer:
    """A throwaway MariaDB server on loopback, never run as root.

    ``mariadb-install-db`` makes the system tables in a temporary directory, then
    ``mariadbd`` serves them on a free loopback port, with no configuration file read
    (``--no-defaults``: the system's ``/etc/mysql`` never applies, and no server of the
    system packages is touched). The settings favour speed: a small buffer pool, the log
    flushed once a second, no binary log. A user :attr:`USER` with :attr:`PASSWORD` may do
    anything, from 127.0.0.1.

    Raises:
        RuntimeError: MariaDB is not installed (``apt-get install mariadb-server``), or
            this process runs as root and there is no ``mysql`` OS user or no ``runuser``.
    """

    name = "mariadb"
    USER = "iofence"
    PASSWORD = "iofence"  # noqa: S105 - a throwaway server on loopback

    #: ``mariadbd`` settings of every server.
    SETTINGS: Mapping[str, str] = {
        "innodb-buffer-pool-size": "64M",
        "innodb-log-file-size": "32M",
        "innodb-flush-log-at-trx-commit": "2",
        "innodb-doublewrite": "0",
        "max-connections": "200",
        "character-set-server": "utf8mb4",
        # The usual default: case-insensitive, as most servers the guards will meet.
        "collation-server": "utf8mb4_general_ci",
    }

    def __init__(self, settings: Mapping[str, str] | None = None) -> None:
        self.settings = {**self.SETTINGS, **(settings or {})}
        programs = {}
        for program in ("mariadbd", "mariadb-install-db"):
            found = shutil.which(program) or shutil.which(program, path="/usr/sbin:/usr/bin")
            if found is None:
                raise RuntimeError(f"{program} is not installed (apt-get install mariadb-server)")
            programs[program] = found
        self.mariadbd = programs["mariadbd"]
        self.install_db = programs["mariadb-install-db"]
        self._as_user: list[str] = []
        pw: pwd.struct_passwd | None = None
        if os.geteuid() == 0:
            try:
                pw = pwd.getpwnam("mysql")
            except KeyError:
                raise RuntimeError("running as root needs the 'mysql' OS user") from None
            if shutil.which("runuser") is None:
                raise RuntimeError(
                    "runuser is not installed (apt-get install util-linux); as root, "
                    "MariaDB runs as the 'mysql' user through it"
                )
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="iofence-mariadb-"))
        self.data = self.dir / "data"
        self.socket = self.dir / "mariadb.sock"
        # Its internal temporary tables go here, not to the machine's /tmp, where another
        # server's or a clean-up's hands can reach them (MariaDB error 6 on their delete).
        self.tmp = self.dir / "tmp"
        self.tmp.mkdir()
        self.proc: subprocess.Popen[bytes] | None = None
        if pw is not None:
            os.chmod(self.dir, 0o755)  # noqa: S103 - the mysql user must enter it
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
            os.chown(self.tmp, pw.pw_uid, pw.pw_gid)
            self._as_user = ["runuser", "-u", "mysql", "--"]

    def url(self, database: str = "iofence", driver: str = "pymysql") -> str:
        """A SQLAlchemy URL of ``database`` through ``driver`` (``pymysql``, ``aiomysql``)."""
        return f"mariadb+{driver}://{self.USER}:{self.PASSWORD}@127.0.0.1:{self.port}/{database}"

    def _settings(self) -> list[str]:
        return [f"--{name}={value}" for name, value in self.settings.items()]

    def start(self) -> MariaDBServer:
        """Make the system tables (the first time) and start the server; wait until it
        accepts connections, and (the first time) create :attr:`USER` and the database
        ``iofence``.

        Raises:
            RuntimeError: ``mariadb-install-db`` failed (with what it said), or the server
                exited (with the end of its log).
            TimeoutError: it did not listen within a minute.
        """
        claim_dir(self.dir)
        first = not self.data.exists()
        if first:
            made = subprocess.run(  # noqa: S603 - MariaDB's own program, fixed arguments
                [
                    *self._as_user,
                    self.install_db,
                    "--no-defaults",
                    f"--datadir={self.data}",
                    # The bootstrap server's temporary files too: not the machine's /tmp.
                    f"--tmpdir={self.tmp}",
                    "--auth-root-authentication-method=normal",
                    "--skip-test-db",
                    "--skip-name-resolve",
                    *self._settings(),
                ],
                check=False,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                cwd=self.dir,
            )
            if made.returncode != 0:
                tail = made.stderr.decode(errors="replace")[-2000:]
                raise RuntimeError(
                    f"mariadb-install-db failed (exit {made.returncode}); it said:\n{tail}"
                )
        log = self.dir / "mariadb.log"
        self.proc = subprocess.Popen(  # noqa: S603 - MariaDB's own program, fixed arguments
            [
                *self._as_user,
                self.mariadbd,
                "--no-defaults",
                f"--datadir={self.data}",
                f"--socket={self.socket}",
                f"--tmpdir={self.tmp}",
                f"--port={self.port}",
                "--bind-address=127.0.0.1",
                f"--pid-file={self.dir / MARIADB_PID_FILE}",
                f"--log-error={log}",
                "--skip-log-bin",
                "--skip-name-resolve",
                *self._settings(),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=self.dir,
        )
        try:
            wait_for_port(self.port, timeout=60.0, proc=self.proc)
            # The TCP port listens before the Unix socket does (mariadbd binds and listens
            # on them in turn): a loaded machine can keep the socket refusing for a while,
            # and the set-up below connects through it.
            self._wait_for_socket(time.monotonic() + 60.0)
        except (RuntimeError, TimeoutError) as exc:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
            raise RuntimeError(f"{exc}; the end of its log:\n{tail}") from None
        if first:
            self._setup()
        return self

    def _wait_for_socket(self, end: float) -> None:
        """Wait until the server accepts a connection on its Unix socket.

        Raises:
            RuntimeError: the server exited.
            TimeoutError: not by ``end``.
        """
        while True:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                try:
                    sock.connect(str(self.socket))
                    return
                except OSError:
                    pass
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"mariadbd exited with {self.proc.returncode}")
            if time.monotonic() > end:
                raise TimeoutError(f"mariadbd's socket {self.socket} refused connections")
            time.sleep(0.05)

    def _setup(self) -> None:
        import pymysql

        conn = pymysql.connect(unix_socket=str(self.socket), user="root", password="")
        try:
            with conn.cursor() as cursor:
                for statement in (
                    f"CREATE USER '{self.USER}'@'127.0.0.1' IDENTIFIED BY '{self.PASSWORD}'",
                    f"GRANT ALL ON *.* TO '{self.USER}'@'127.0.0.1' WITH GRANT OPTION",
                    "CREATE DATABASE iofence",
                ):
                    cursor.execute(statement)
        finally:
            conn.close()

    def _signal(self, sig: int) -> None:
        pidfile = self.dir / MARIADB_PID_FILE
        with contextlib.suppress(OSError, ValueError):
            os.kill(int(pidfile.read_text()), sig)

    def pause(self) -> None:
        """``SIGSTOP`` the server: connections stay open, nothing answers."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        """``SIGCONT`` the server."""
        self._signal(signal.SIGCONT)

    @property
    def endpoint(self) -> str:
        """:meth:`url` of the database ``iofence`` through PyMySQL (a chaos run's endpoint)."""
        return self.url()

    def kill(self) -> None:
        """``kill -9`` the server: no shutdown at all; :meth:`start` recovers from its
        files (InnoDB's crash recovery).

        With ``innodb-flush-log-at-trx-commit=2`` (:attr:`SETTINGS`) a commit returns once
        its redo log is written to the operating system (flushed to the disk once a
        second): a killed process keeps every acknowledged commit, a power cut would not.
        """
        if self.proc is None:
            return
        self._signal(signal.SIGCONT)
        self._signal(signal.SIGKILL)
        self.proc.wait()  # runuser ends with its child
        self.proc = None

    def stop(self) -> None:
        """Stop the server (``SIGTERM``, a clean shutdown); its files stay for a restart."""
        if self.proc is None:
            return
        self._signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.proc.wait()
        self.proc = None

    def destroy(self) -> None:
        """Stop the server and remove its files."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)
