"""Throwaway servers for a chaos run, with the faults the run injects.

The harness starts its own ``redis-server`` and PostgreSQL cluster on free loopback ports in
temporary directories, so it can kill them. Durability is set so that a killed *process*
loses nothing it acknowledged, which is what the checker assumes:

- Redis runs with ``--appendonly yes --appendfsync everysec``. Redis writes the AOF buffer
  to the file (into the OS page cache) before it sends the replies of the commands in it;
  the fsync once a second only matters when the machine itself goes down. ``kill -9`` of the
  process therefore keeps every acknowledged write.
- PostgreSQL runs with ``synchronous_commit=on`` (a commit returns after its WAL is written)
  and ``fsync=off`` (no flush to the disk: a process crash keeps the page cache, a power cut
  would not). ``pg_ctl stop -m immediate`` is a crash: no checkpoint, crash recovery on the
  next start.

PostgreSQL never runs as root: as root the cluster runs as the ``postgres`` OS user.
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
from pathlib import Path

__all__ = ["PostgresServer", "RedisServer", "free_port", "pg_bindir", "wait_for_port"]


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


class RedisServer:
    """A ``redis-server`` with the AOF on, which the harness can kill and restart.

    Args:
        extra: more ``redis-server`` arguments.

    Raises:
        RuntimeError: ``redis-server`` is not installed.
    """

    name = "redis"

    def __init__(self, *extra: str) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (apt-get install redis-server)")
        self.exe = exe
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="iofence-chaos-redis-"))
        self.extra = list(extra)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0``."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        """Start the server (loading its AOF, if any) and wait until it answers."""
        args = [
            self.exe,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.dir),
            "--save", "",
            "--appendonly", "yes",
            "--appendfsync", "everysec",
            "--daemonize", "no",
            "--logfile", str(self.dir / "redis.log"),
            *self.extra,
        ]  # fmt: skip
        self.proc = subprocess.Popen(  # noqa: S603 - a fixed program found on PATH
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        wait_for_port(self.port)
        return self

    def kill(self) -> None:
        """``kill -9`` the server: no shutdown, no final fsync."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
                self.proc.kill()
            self.proc.wait()
            self.proc = None

    def stop(self) -> None:
        """Kill the server and remove its directory."""
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


def pg_bindir() -> Path:
    """The folder of PostgreSQL's server programs (``initdb``, ``pg_ctl``)."""
    for name in ("pg_ctl", "initdb"):
        found = shutil.which(name)
        if found:
            return Path(os.path.realpath(found)).parent
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"))
    if not candidates:
        raise RuntimeError("PostgreSQL is not installed (apt-get install postgresql)")
    return Path(candidates[-1]).parent


class PostgresServer:
    """A throwaway PostgreSQL cluster, never run as root, which the harness can crash.

    Raises:
        RuntimeError: PostgreSQL is not installed, or the harness runs as root and there
            is no ``postgres`` OS user to run the cluster as, or no ``runuser``.
    """

    name = "postgres"

    def __init__(self) -> None:
        self.bindir = pg_bindir()
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
        self.dir = Path(tempfile.mkdtemp(prefix="iofence-chaos-pg-"))
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
        connections."""
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
            "-c fsync=off -c synchronous_commit=on -c full_page_writes=off "
            "-c max_connections=200"
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

    def crash(self) -> None:
        """``pg_ctl stop -m immediate``: every server process quits at once, no checkpoint."""
        if (self.data / "postmaster.pid").exists():
            self._run(
                str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop"
            )

    def stop(self) -> None:
        """Stop the cluster and remove its files."""
        with contextlib.suppress(subprocess.CalledProcessError):
            self.crash()
        shutil.rmtree(self.dir, ignore_errors=True)
