"""Throwaway consensus clusters: three etcd members, three ZooKeeper servers, on loopback.

The test suite, the chaos harness and the benchmarks start them from the Debian packages
(``etcd-server``; ``zookeeper`` with a Java runtime), each member in its own folder of one
temporary directory, on free loopback ports, and break them for real: ``SIGKILL`` of the
leader, ``SIGSTOP``/``SIGCONT`` of a member, a restart of one member or of all of them from
their data on disk.

ZooKeeper never runs as root: as root, its JVMs run as the ``zookeeper`` OS user that the
package creates. Each JVM gets a small heap (``-Xmx128m``) so that three fit beside the
rest on a small machine. The servers skip the fsync of their logs (etcd 3.4 cannot; for
ZooKeeper ``forceSync=no``): a killed *process* loses nothing it acknowledged, which is
what the restarts here test; a power cut would.

Every member folder holds ``server.pid``, and the temporary directory ``owner.pid``, so a
later test run can stop servers that a run which died left behind
(:func:`tests.servers.reap_orphans`).
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from fence._chaos.servers import claim_dir, free_port, wait_for_port

__all__ = ["PID_FILE", "EtcdCluster", "ZooKeeperEnsemble", "zookeeper_jar"]

#: The file of a member's folder that holds the member's pid.
PID_FILE = "server.pid"


def _signal(proc: subprocess.Popen[bytes] | None, sig: int) -> None:
    if proc is not None and proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)


class _Member:
    """One server process of a cluster, with its folder and ports."""

    def __init__(self, index: int, folder: Path) -> None:
        self.index = index
        self.dir = folder
        self.proc: subprocess.Popen[bytes] | None = None
        self.paused = False

    @property
    def running(self) -> bool:
        """Started and not killed (it may be stopped with SIGSTOP)."""
        return self.proc is not None and self.proc.poll() is None


class _Cluster:
    """What both clusters share: members, signals, restarts."""

    name = "cluster"
    members: list[_Member]
    dir: Path
    #: Whether a member was signalled or started since the cluster last proved it works.
    dirty = True

    def _spawn(self, member: _Member) -> None:
        raise NotImplementedError

    def _client_port(self, member: _Member) -> int:
        raise NotImplementedError

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Wait until the running members have a leader and serve clients."""
        raise NotImplementedError

    def leader(self) -> int | None:
        """The index of the member that leads now, if any answers."""
        raise NotImplementedError

    def start_member(self, index: int) -> None:
        """Start member ``index`` (again), from the data in its folder."""
        member = self.members[index]
        if member.running:
            self.resume(index)
            return
        self.dirty = True
        self._spawn(member)
        assert member.proc is not None
        (member.dir / PID_FILE).write_text(str(member.proc.pid))
        member.paused = False
        try:
            wait_for_port(self._client_port(member), timeout=60, proc=member.proc)
        except (RuntimeError, TimeoutError) as exc:
            # The server's own words say why (a port taken, a file it could not read).
            raise RuntimeError(
                f"{self.name} member {index} did not start: {exc}; the end of its log:\n"
                f"{self.tail(index, 2000)}"
            ) from None

    def kill(self, index: int) -> None:
        """``SIGKILL`` member ``index``: no shutdown at all."""
        self.dirty = True
        member = self.members[index]
        _signal(member.proc, signal.SIGCONT)
        _signal(member.proc, signal.SIGKILL)
        if member.proc is not None:
            member.proc.wait()
        member.proc = None
        member.paused = False

    def pause(self, index: int) -> None:
        """``SIGSTOP`` member ``index``: it keeps its sockets and answers nothing."""
        self.dirty = True
        _signal(self.members[index].proc, signal.SIGSTOP)
        self.members[index].paused = True

    def resume(self, index: int) -> None:
        """``SIGCONT`` member ``index``."""
        self.dirty = True
        _signal(self.members[index].proc, signal.SIGCONT)
        self.members[index].paused = False

    def restart(self, index: int) -> None:
        """Kill member ``index`` and start it again from its data."""
        self.kill(index)
        self.start_member(index)

    def serving(self) -> bool:
        """A quick look (no write): whether the cluster looks formed now. A cluster that
        nobody touched can still hold an election on its own (a member starved on a loaded
        machine misses its heartbeats), and serves nothing meanwhile."""
        return True

    def heal(self, timeout: float = 60.0) -> None:
        """Bring every member back (resume the stopped, start the killed) and, if anything
        happened to a member since the last check or the cluster does not look formed,
        wait until the cluster works again."""
        for member in self.members:
            if member.running:
                if member.paused:
                    self.resume(member.index)
            else:
                self.start_member(member.index)
        if self.dirty or not self.serving():
            self.wait_ready(timeout)
            self.dirty = False

    def start(self) -> Any:
        """Start every member and wait until the cluster serves clients."""
        claim_dir(self.dir)
        try:
            for member in self.members:
                self.start_member(member.index)
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def kill_all(self) -> None:
        """``SIGKILL`` every member."""
        for member in self.members:
            self.kill(member.index)

    def stop(self) -> None:
        """Kill every member and remove the folders."""
        self.kill_all()
        shutil.rmtree(self.dir, ignore_errors=True)

    def tail(self, index: int, chars: int = 3000) -> str:
        """The end of member ``index``'s log, for error messages."""
        log = self.members[index].dir / "server.log"
        return log.read_text(errors="replace")[-chars:] if log.exists() else ""


# -- etcd -------------------------------------------------------------------------------------


class _EtcdMember(_Member):
    def __init__(self, index: int, folder: Path) -> None:
        super().__init__(index, folder)
        self.name = f"m{index + 1}"
        self.client_port = free_port()
        self.peer_port = free_port()
        self.member_id: str | None = None

    @property
    def client_url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"


class EtcdCluster(_Cluster):
    """Three (or ``size``) ``etcd`` members on loopback.

    Args:
        size: how many members.
        heartbeat_ms: raft heartbeat interval.
        election_ms: raft election timeout; a leader that died is replaced after about
            this long.

    Raises:
        RuntimeError: ``etcd`` is not installed.
    """

    name = "etcd"

    def __init__(self, size: int = 3, *, heartbeat_ms: int = 100, election_ms: int = 1000):
        exe = shutil.which("etcd")
        if exe is None:
            raise RuntimeError("etcd is not installed (apt-get install etcd-server)")
        self.exe = exe
        self.heartbeat_ms = heartbeat_ms
        self.election_ms = election_ms
        self.dir = Path(tempfile.mkdtemp(prefix="iofence-etcd-"))
        self.members: list[_Member] = []
        for index in range(size):
            folder = self.dir / f"m{index + 1}"
            folder.mkdir()
            self.members.append(_EtcdMember(index, folder))
        self.token = f"iofence-{os.getpid()}-{self.dir.name}"

    def _etcd(self, index: int) -> _EtcdMember:
        member = self.members[index]
        assert isinstance(member, _EtcdMember)
        return member

    @property
    def endpoints(self) -> list[str]:
        """``host:port`` of every member's client port."""
        return [f"127.0.0.1:{self._etcd(i).client_port}" for i in range(len(self.members))]

    @property
    def url(self) -> str:
        """``etcd://127.0.0.1:<p1>,127.0.0.1:<p2>,...``."""
        return "etcd://" + ",".join(self.endpoints)

    def _client_port(self, member: _Member) -> int:
        assert isinstance(member, _EtcdMember)
        return member.client_port

    def _spawn(self, member: _Member) -> None:
        assert isinstance(member, _EtcdMember)
        peers = ",".join(
            f"{m.name}=http://127.0.0.1:{m.peer_port}"
            for m in (self._etcd(i) for i in range(len(self.members)))
        )
        args = [
            self.exe,
            "--name", member.name,
            "--data-dir", str(member.dir / "data"),
            "--listen-client-urls", member.client_url,
            "--advertise-client-urls", member.client_url,
            "--listen-peer-urls", f"http://127.0.0.1:{member.peer_port}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{member.peer_port}",
            "--initial-cluster", peers,
            "--initial-cluster-state", "new",
            "--initial-cluster-token", self.token,
            "--heartbeat-interval", str(self.heartbeat_ms),
            "--election-timeout", str(self.election_ms),
            "--logger", "zap",
            "--log-level", "warn",
            "--log-outputs", str(member.dir / "server.log"),
        ]  # fmt: skip
        member.proc = subprocess.Popen(  # noqa: S603 - a fixed program found on PATH
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    def _post(self, member: _EtcdMember, path: str, body: dict[str, Any], timeout: float) -> Any:
        request = urllib.request.Request(  # noqa: S310 - a loopback http URL built here
            member.client_url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "Grpc-Metadata-hasleader": "true"},
        )
        with urllib.request.urlopen(request, timeout=timeout) as reply:  # noqa: S310
            return json.loads(reply.read())

    def status(self, index: int, timeout: float = 1.0) -> dict[str, Any] | None:
        """Member ``index``'s ``/v3/maintenance/status``, or ``None`` if it does not answer."""
        member = self._etcd(index)
        if not member.running or member.paused:
            return None
        try:
            found = self._post(member, "/v3/maintenance/status", {}, timeout)
        except (OSError, ValueError, urllib.error.URLError):
            return None
        member.member_id = str(found.get("header", {}).get("member_id"))
        return dict(found)

    def leader(self) -> int | None:
        """The index of the leader, as the members that answer see it."""
        seen = [s for s in (self.status(i) for i in range(len(self.members))) if s]
        ids = {self._etcd(i).member_id: i for i in range(len(self.members))}
        for found in seen:
            lead = str(found.get("leader", "0"))
            if lead in ids:
                return ids[lead]
        return None

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Wait until every running member knows the leader and serves a linearizable read."""
        end = time.monotonic() + timeout
        while True:
            ok = True
            for member in self.members:
                if not member.running or member.paused:
                    continue
                assert isinstance(member, _EtcdMember)
                try:
                    self._post(member, "/v3/kv/range", {"key": "AA=="}, 2.0)
                except (OSError, ValueError, urllib.error.URLError):
                    ok = False
                    break
            if ok and self.leader() is not None:
                return
            if time.monotonic() > end:
                tails = "\n".join(self.tail(i, 800) for i in range(len(self.members)))
                raise TimeoutError(f"the etcd cluster has no leader after {timeout} s:\n{tails}")
            time.sleep(0.05)


# -- ZooKeeper --------------------------------------------------------------------------------


def zookeeper_jar() -> Path:
    """The ZooKeeper server jar of the Debian package (its manifest names its classpath)."""
    jar = Path(os.environ.get("IOFENCE_ZOOKEEPER_JAR", "/usr/share/java/zookeeper.jar"))
    if not jar.exists():
        raise RuntimeError(
            f"no ZooKeeper server at {jar} (apt-get install zookeeper default-jre-headless)"
        )
    return jar


class _ZooKeeperMember(_Member):
    def __init__(self, index: int, folder: Path) -> None:
        super().__init__(index, folder)
        self.myid = index + 1
        self.client_port = free_port()
        self.quorum_port = free_port()
        self.election_port = free_port()


class ZooKeeperEnsemble(_Cluster):
    """Three (or ``size``) ZooKeeper servers on loopback, never run as root.

    Args:
        size: how many servers.
        tick_ms: ZooKeeper's ``tickTime``; sessions may last 2 ticks to 120 s.

    Raises:
        RuntimeError: Java or the ZooKeeper jar is missing, or the suite runs as root and
            there is no ``zookeeper`` user to run the servers as.
    """

    name = "zookeeper"

    def __init__(self, size: int = 3, *, tick_ms: int = 200) -> None:
        java = shutil.which("java")
        if java is None:
            raise RuntimeError("java is not installed (apt-get install default-jre-headless)")
        self.java = java
        self.jar = zookeeper_jar()
        self.tick_ms = tick_ms
        self._user: tuple[int, int] | None = None
        if os.geteuid() == 0:  # looked up before the folder is made: a refusal leaves nothing
            try:
                pw = pwd.getpwnam("zookeeper")
            except KeyError:
                raise RuntimeError(
                    "running as root needs the 'zookeeper' OS user (the zookeeper package "
                    "creates it): ZooKeeper never runs as root"
                ) from None
            self._user = (pw.pw_uid, pw.pw_gid)
        self.dir = Path(tempfile.mkdtemp(prefix="iofence-zk-"))
        if self._user is not None:
            os.chmod(self.dir, 0o755)  # noqa: S103 - the zookeeper user must enter it
        self.members: list[_Member] = []
        for index in range(size):
            folder = self.dir / f"z{index + 1}"
            (folder / "data").mkdir(parents=True)
            member = _ZooKeeperMember(index, folder)
            (folder / "data" / "myid").write_text(f"{member.myid}\n")
            self.members.append(member)
        for index in range(size):
            member = self._zk(index)
            self._configure(member)
            if self._user is not None:
                for path in (member.dir, member.dir / "data", *member.dir.rglob("*")):
                    os.chown(path, *self._user)

    def _zk(self, index: int) -> _ZooKeeperMember:
        member = self.members[index]
        assert isinstance(member, _ZooKeeperMember)
        return member

    @property
    def hosts(self) -> str:
        """``127.0.0.1:<p1>,127.0.0.1:<p2>,...``, as kazoo takes them."""
        return ",".join(f"127.0.0.1:{self._zk(i).client_port}" for i in range(len(self.members)))

    @property
    def url(self) -> str:
        """``zookeeper://127.0.0.1:<p1>,...``."""
        return "zookeeper://" + self.hosts

    def _client_port(self, member: _Member) -> int:
        assert isinstance(member, _ZooKeeperMember)
        return member.client_port

    def _configure(self, member: _ZooKeeperMember) -> None:
        servers = "\n".join(
            f"server.{m.myid}=127.0.0.1:{m.quorum_port}:{m.election_port}"
            for m in (self._zk(i) for i in range(len(self.members)))
        )
        (member.dir / "zoo.cfg").write_text(
            f"tickTime={self.tick_ms}\n"
            # A follower that hears nothing from the leader for syncLimit ticks leaves it and
            # an election follows, during which no request is served: 5 s, not 2 s, so
            # that a starved JVM on a loaded machine does not set one off (a leader killed
            # or stopped on purpose is still replaced within seconds).
            "initLimit=50\n"
            "syncLimit=25\n"
            f"dataDir={member.dir / 'data'}\n"
            f"clientPort={member.client_port}\n"
            "clientPortAddress=127.0.0.1\n"
            f"minSessionTimeout={2 * self.tick_ms}\n"
            "maxSessionTimeout=120000\n"
            "admin.enableServer=false\n"
            "4lw.commands.whitelist=srvr,ruok\n"
            "forceSync=no\n"
            f"{servers}\n"
        )

    def _spawn(self, member: _Member) -> None:
        assert isinstance(member, _ZooKeeperMember)
        args = [
            self.java,
            "-Xmx128m",
            "-Xms16m",
            "-Xss512k",
            "-XX:+UseSerialGC",
            "-XX:TieredStopAtLevel=1",
            "-XX:-UsePerfData",
            "-Djava.net.preferIPv4Stack=true",
            "-Dzookeeper.cnxTimeout=1000",
            "-Dorg.slf4j.simpleLogger.defaultLogLevel=warn",
            "-Dorg.slf4j.simpleLogger.showDateTime=true",
            "-cp",
            self._classpath(),
            "org.apache.zookeeper.server.quorum.QuorumPeerMain",
            str(member.dir / "zoo.cfg"),
        ]
        log = open(member.dir / "server.log", "ab")  # noqa: SIM115 - the child keeps it
        try:
            extra: dict[str, Any] = {}
            if self._user is not None:
                extra = {"user": self._user[0], "group": self._user[1], "extra_groups": []}
            member.proc = subprocess.Popen(  # noqa: S603 - java from PATH, fixed arguments
                args, stdout=log, stderr=log, cwd=member.dir, **extra
            )
        finally:
            log.close()

    def _classpath(self) -> str:
        # The jar's manifest names its libraries; slf4j-simple (when the package brought
        # it) sends ZooKeeper's warnings to the server's log instead of nowhere.
        simple = self.jar.parent / "slf4j-simple.jar"
        return f"{self.jar}:{simple}" if simple.exists() else str(self.jar)

    def mode(self, index: int, timeout: float = 1.0) -> str | None:
        """``leader``, ``follower`` or ``standalone`` from member ``index``'s ``srvr``, or
        ``None`` if it does not serve (down, stopped, or without a quorum)."""
        member = self._zk(index)
        if not member.running or member.paused:
            return None
        try:
            with socket.create_connection(("127.0.0.1", member.client_port), timeout) as sock:
                sock.sendall(b"srvr")
                data = b""
                while chunk := sock.recv(4096):
                    data += chunk
        except OSError:
            return None
        for line in data.decode(errors="replace").splitlines():
            if line.startswith("Mode:"):
                return line.split(":", 1)[1].strip()
        return None

    def serving(self) -> bool:
        """Whether every running member serves, one of them as the leader (``srvr``)."""
        modes = [self.mode(m.index) for m in self.members if m.running and not m.paused]
        return bool(modes) and all(modes) and modes.count("leader") == 1

    def leader(self) -> int | None:
        """The index of the leader, if one serves."""
        for index in range(len(self.members)):
            if self.mode(index) == "leader":
                return index
        return None

    def version(self) -> str:
        """The servers' version, from the package's jar name (``zookeeper-3.8.0.jar``)."""
        for jar in sorted(self.jar.resolve().parent.glob("zookeeper-[0-9]*.jar")):
            return jar.stem.removeprefix("zookeeper-")
        return "?"

    def wait_ready(self, timeout: float = 60.0, *, restart_after: float | None = None) -> None:
        """Wait until every running member serves, one of them as the leader, and a write
        through each running member commits.

        The write matters: a leader that was frozen still calls itself leader for a while
        after it wakes, until it finds out that its followers moved on.

        A member can fail to rejoin on its own: ZooKeeper 3.8 followers were seen to loop
        in their sync with a leader that had been frozen and woke (``Got zxid ...
        expected 0x1``, the connection dropped, again), for minutes. After
        ``restart_after`` seconds (a third of ``timeout`` by default) without a working
        ensemble, every running member is restarted once from its data, as an operator
        would; the ensemble keeps its data and its zxids.
        """
        start = time.monotonic()
        end = start + timeout
        restart_at = start + (timeout / 3 if restart_after is None else restart_after)
        restarted = False
        while True:
            running = [m.index for m in self.members if m.running and not m.paused]
            modes = [self.mode(index) for index in running]
            formed = bool(modes) and all(modes) and modes.count("leader") == 1
            if formed and all(self._write(index, end) for index in running):
                return
            if not restarted and running and time.monotonic() > restart_at:
                restarted = True
                for index in running:
                    self.kill(index)
                for index in running:
                    self.start_member(index)
                continue
            if time.monotonic() > end:
                tails = "\n".join(self.tail(i, 800) for i in range(len(self.members)))
                raise TimeoutError(f"the ZooKeeper ensemble did not form in {timeout} s:\n{tails}")
            time.sleep(0.05)

    def _write(self, index: int, end: float) -> bool:
        """Whether a write through member ``index`` commits (kazoo, the zookeeper extra)."""
        from kazoo.client import KazooClient
        from kazoo.exceptions import KazooException
        from kazoo.handlers.threading import KazooTimeoutError

        client = KazooClient(
            hosts=f"127.0.0.1:{self._zk(index).client_port}",
            timeout=4.0,
            connection_retry={"max_tries": 0},
        )
        try:
            client.start(timeout=max(0.5, min(3.0, end - time.monotonic())))
            client.ensure_path("/iofence-ready")
            client.set("/iofence-ready", b"")
        except (KazooException, KazooTimeoutError, OSError):
            return False
        finally:
            with contextlib.suppress(Exception):
                client.stop()
                client.close()
        return True
