"""Throwaway real servers for the test suite: redis-server and a PostgreSQL cluster.

Each runs on a free loopback port in a temporary directory and is stopped at the end. The
classes also expose the faults the tests cause for real: SIGKILL, SIGSTOP/SIGCONT, restart.
PostgreSQL never runs as root: when the suite runs as root it runs the cluster as the
``postgres`` OS user (created by the system package).

The consensus clusters (three etcd members, three ZooKeeper servers) are shared with the
chaos harness and the benchmarks: :mod:`fence._chaos.clusters`, re-exported here.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from fence._chaos.clusters import PID_FILE, EtcdCluster, ZooKeeperEnsemble
from fence._chaos.servers import free_port, pg_bindir, wait_for_port

__all__ = [
    "EtcdCluster",
    "PostgresServer",
    "RedisServer",
    "SentinelSetup",
    "ZooKeeperEnsemble",
    "claim_dir",
    "free_port",
    "reap_orphans",
    "wait_for_port",
]

OWNER_FILE = "owner.pid"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def claim_dir(path: Path) -> None:
    """Record that this process owns a server directory, so a later run can reap it."""
    (path / OWNER_FILE).write_text(str(os.getpid()))


def reap_orphans() -> list[str]:
    """Stop servers left behind by test runs that died (killed by a timeout, say).

    A server directory whose owner process is gone is stopped (PostgreSQL with an immediate
    shutdown, redis-server and the members of a consensus cluster with SIGKILL) and
    removed. Returns the directories reaped.
    """
    reaped = []
    for path in Path(tempfile.gettempdir()).glob("iofence-*"):
        owner = path / OWNER_FILE
        try:
            pid = int(owner.read_text())
        except (OSError, ValueError):
            continue
        if _alive(pid):
            continue
        pidfile = path / "data" / "postmaster.pid"
        if pidfile.exists():
            with contextlib.suppress(OSError, ValueError, IndexError):
                os.kill(int(pidfile.read_text().split()[0]), signal.SIGQUIT)
        redis_pid = path / "redis.pid"
        if redis_pid.exists():
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(redis_pid.read_text()), signal.SIGKILL)
        for member_pid in path.glob(f"*/{PID_FILE}"):  # etcd members, ZooKeeper servers
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(member_pid.read_text()), signal.SIGKILL)
        shutil.rmtree(path, ignore_errors=True)
        reaped.append(str(path))
    return reaped


class RedisServer:
    """A ``redis-server`` process on loopback, with the faults tests need."""

    def __init__(self, *extra: str, port: int | None = None, password: str | None = None) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed; run scripts/test to install it")
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
        """Start the server and wait until it answers."""
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
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        claim_dir(self.dir)
        (self.dir / "redis.pid").write_text(str(self.proc.pid))
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
        """SIGKILL the server: no shutdown, no final fsync."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
                self.proc.kill()
            self.proc.wait()
            self.proc = None

    def pause(self) -> None:
        """SIGSTOP the server."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT the server."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def restart(self) -> None:
        """SIGKILL and start again on the same port and directory."""
        self.kill()
        self.start()

    def stop(self) -> None:
        """Kill the server and remove its directory."""
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


class SentinelSetup:
    """A Redis primary, one replica and one Sentinel watching them, on loopback.

    The Sentinel monitors them as :attr:`service` with a quorum of 1, and never fails over
    by itself (``down-after-milliseconds`` is a minute): a test fails over with
    :meth:`failover`. The data nodes and the Sentinel each have their own password, as a
    production setup does, so that the URL's two password options are exercised.
    """

    service = "mymaster"
    password = "data-secret"
    sentinel_password = "sentinel-secret"

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
        replica in sync."""
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
            self.proc = subprocess.Popen(
                [self.primary.exe, str(conf), "--sentinel"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            claim_dir(self.dir)
            (self.dir / "redis.pid").write_text(str(self.proc.pid))
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

    def wait_until(self, check: Any, what: str, timeout: float = 30.0) -> None:
        """Poll ``check()`` until it is true; fail after ``timeout`` seconds."""
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


class PostgresServer:
    """A throwaway PostgreSQL cluster on loopback, never run as root."""

    user = "postgres"

    def __init__(self) -> None:
        self.bindir = pg_bindir()
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="iofence-pg-"))
        self.data = self.dir / "data"
        self.sockets = self.dir / "sockets"
        self._as_user: list[str] = []
        if os.geteuid() == 0:
            try:
                pw = pwd.getpwnam("postgres")
            except KeyError:
                raise RuntimeError("running as root needs the 'postgres' OS user") from None
            os.chmod(self.dir, 0o755)  # noqa: S103 - the postgres user must enter it
            self.sockets.mkdir()
            os.chown(self.dir, pw.pw_uid, pw.pw_gid)
            os.chown(self.sockets, pw.pw_uid, pw.pw_gid)
            self._as_user = ["runuser", "-u", "postgres", "--"]
        else:
            self.sockets.mkdir()

    @property
    def url(self) -> str:
        """A SQLAlchemy URL for the psycopg 3 driver."""
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def conninfo(self) -> str:
        """A libpq connection string for psycopg."""
        return f"host=127.0.0.1 port={self.port} user=postgres dbname=postgres"

    def _run(self, *args: str) -> None:
        subprocess.run(
            [*self._as_user, *args],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            cwd=self.dir,
        )

    def start(self) -> PostgresServer:
        """initdb (first time) and start the cluster; wait until it accepts connections."""
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
        options = (
            f"-p {self.port} -k {self.sockets} -c listen_addresses=127.0.0.1 "
            "-c fsync=off -c synchronous_commit=off -c full_page_writes=off "
            "-c max_connections=100 -c max_prepared_transactions=8"
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
        """Stop the cluster with ``pg_ctl stop -m <mode>`` (``immediate`` is a crash)."""
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
        """SIGSTOP the whole cluster: connections stay open, nothing answers."""
        for pid in self._pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT every process of the cluster."""
        for pid in self._pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def restart(self, mode: str = "immediate") -> None:
        """Stop (by default as a crash) and start again on the same port."""
        self.stop(mode)
        self.start()

    def destroy(self) -> None:
        """Stop the cluster and remove its files."""
        with contextlib.suppress(subprocess.CalledProcessError):
            self.stop("immediate")
        shutil.rmtree(self.dir, ignore_errors=True)
