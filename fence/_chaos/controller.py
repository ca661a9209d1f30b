"""The chaos controller: it stops lock holders past their lease and breaks the servers.

**Pauses.** The controller watches the :class:`~fence._chaos.worker.Board`, picks a worker
that holds a lease (preferably one that has read and not yet written: the moment a stale
write is born), sends it ``SIGSTOP`` and, after longer than the lease's ttl, ``SIGCONT``.
Several pauses run at once across workers, but at least two workers keep running, so
somebody takes over the expired leases. A pause *counts* when the stopped worker held a
lease at the moment it stopped (read from the board once the kernel reports the process
stopped, so the answer cannot change under the controller) and stayed stopped longer
than the ttl::

    w1  acquire -> 7, read 41 | SIGSTOP ............... SIGCONT | write 42 with 7 -> REJECTED
    w2       (w1's lease ends) acquire -> 8, read 41, write 42 with 8 -> ok

**Faults.** A :class:`FaultInjector` thread runs a cycle of server faults through the run:
for each server, dropped client connections (``CLIENT KILL TYPE normal`` on Redis,
``pg_terminate_backend`` on PostgreSQL), then a crash and restart (``kill -9`` of
``redis-server``, which reloads its AOF; ``pg_ctl stop -m immediate`` and start, which
runs crash recovery). A consensus cluster loses its leader to ``kill -9`` (the member is
started again from its data) and has a member frozen with ``SIGSTOP`` for a second.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fence._chaos.checker import Record
from fence._chaos.worker import Board, Phase

__all__ = ["Fault", "FaultInjector", "Pauser", "fault_plan"]


def _stopped(pid: int, timeout: float = 0.5) -> bool:
    """Wait until the kernel reports ``pid`` stopped; ``False`` if it did not in time."""
    path = f"/proc/{pid}/stat"
    end = time.monotonic() + timeout
    while True:
        try:
            with open(path, encoding="ascii", errors="replace") as stat:
                state = stat.read().rpartition(")")[2].split()[0]
        except (OSError, IndexError):
            time.sleep(0.02)  # no procfs: give the signal a moment to land
            return True
        if state in ("T", "t"):
            return True
        if time.monotonic() > end:
            return False
        time.sleep(0.001)


def _continue(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass  # it exited while stopped (killed from outside); the runner reports it


@dataclass
class _Pause:
    index: int
    stopped_at: float
    until: float
    held: bool
    phase: int
    token: int
    record: str | None


@dataclass
class Pauser:
    """Stops lease holders with ``SIGSTOP`` for longer than their ttl, several at once.

    Attributes:
        board: the shared board of the workers.
        pids: the worker processes, by board index.
        names: the worker names, by board index.
        records: the record names, by index (as posted on the board).
        ttl: the lease time of the workers.
        log: where ``paused``/``resumed`` records go.
        rng: the random source.
        pause: the range of pause lengths, as multiples of ``ttl`` (both above 1).
        max_inflight: how many workers may be stopped at once.
        prefer_read: the chance of picking a worker between its read and its write when
            there is one; 1.0 stops only such workers.
        gap: seconds between two new pauses, at most.
        extra: seconds added to every pause: how much longer than the ttl the server may
            keep a frozen holder's lease (see :attr:`LockerKind.overhang`).
    """

    board: Board
    pids: Sequence[int]
    names: Sequence[str]
    records: Sequence[str]
    ttl: float
    log: list[Record]
    rng: random.Random
    pause: tuple[float, float] = (1.3, 2.0)
    max_inflight: int = 2
    prefer_read: float = 0.75
    gap: float = 0.05
    extra: float = 0.0
    attempted: int = 0
    counted: int = 0
    between_read_and_write: int = 0
    _active: dict[int, _Pause] = field(default_factory=dict, init=False, repr=False)
    _last_cycle: dict[int, int] = field(default_factory=dict, init=False, repr=False)
    _next_at: float = field(default=0.0, init=False, repr=False)

    def step(self) -> None:
        """Resume the pauses that are due, and maybe start a new one."""
        now = time.monotonic()
        for pause in list(self._active.values()):
            if now >= pause.until:
                self._resume(pause)
        if len(self._active) >= self.max_inflight or now < self._next_at:
            return
        holders = []
        readers = []
        for index in range(len(self.pids)):
            if index in self._active:
                continue
            phase, _, _, cycle = self.board.read(index)
            if self._last_cycle.get(index) == cycle:
                continue  # resumed, but not yet running again: one pause per cycle
            if phase == Phase.READ:
                readers.append(index)
            if phase in (Phase.HOLDING, Phase.READ):
                holders.append(index)
        if readers and self.rng.random() < self.prefer_read:
            self._stop(self.rng.choice(readers))
        elif holders and self.prefer_read < 1.0:
            self._stop(self.rng.choice(holders))
        self._next_at = now + self.rng.uniform(0.0, self.gap)

    def _stop(self, index: int) -> None:
        pid = self.pids[index]
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            return  # it exited; the runner reports it
        stopped = _stopped(pid)
        stopped_at = time.monotonic()
        phase, token, record, cycle = self.board.read(index)
        held = stopped and phase in (Phase.HOLDING, Phase.READ)
        if not held:
            # It let go between the look and the stop: no pause of a holder, thaw it.
            _continue(pid)
            return
        self.attempted += 1
        self._last_cycle[index] = cycle
        length = self.ttl * self.rng.uniform(*self.pause) + self.extra
        name = self.records[record] if 0 <= record < len(self.records) else None
        self._active[index] = _Pause(
            index, stopped_at, stopped_at + length, held, phase, token, name
        )
        self.log.append(
            Record(
                time.time(),
                self.names[index],
                "paused",
                name,
                token or None,
                detail="between read and write" if phase == Phase.READ else "holding the lease",
            )
        )

    def _resume(self, pause: _Pause) -> None:
        _continue(self.pids[pause.index])
        length = time.monotonic() - pause.stopped_at
        del self._active[pause.index]
        counted = pause.held and length > self.ttl
        if counted:
            self.counted += 1
            if pause.phase == Phase.READ:
                self.between_read_and_write += 1
        self.log.append(
            Record(
                time.time(),
                self.names[pause.index],
                "resumed",
                pause.record,
                pause.token or None,
                detail=f"stopped {length:.3f} s (ttl {self.ttl} s)"
                + ("" if counted else ", not counted"),
            )
        )

    def resume_all(self) -> None:
        """Resume every stopped worker now (at the end of a run)."""
        for pause in list(self._active.values()):
            self._resume(pause)


@dataclass(frozen=True, slots=True)
class Fault:
    """One server fault.

    Attributes:
        kind: ``"drop-connections"``, ``"kill"`` or ``"pause"``.
        server: ``"redis"``, ``"postgres"``, ``"mariadb"``, ``"etcd"`` or ``"zookeeper"``.
        action: does it; returns a line for the log.
    """

    kind: str
    server: str
    action: Callable[[], str]


def _drop_redis(server: Any) -> Callable[[], str]:
    def drop() -> str:
        import redis

        client = redis.Redis.from_url(server.url, socket_timeout=5)
        command: Any = client.execute_command  # typed on some client classes only
        try:
            killed = command("CLIENT", "KILL", "TYPE", "normal")
        finally:
            client.close()
        return f"CLIENT KILL TYPE normal on redis ({killed} connections)"

    return drop


def _kill_redis(server: Any, down: float) -> Callable[[], str]:
    def kill() -> str:
        server.kill()
        time.sleep(down)
        server.start()
        return "kill -9 redis-server, restart from the AOF"

    return kill


def _drop_postgres(server: Any) -> Callable[[], str]:
    def drop() -> str:
        import sqlalchemy as sa

        engine = sa.create_engine(server.url, poolclass=sa.NullPool)
        try:
            with engine.begin() as conn:
                killed = conn.execute(
                    sa.text(
                        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                        "WHERE pid <> pg_backend_pid() AND backend_type = 'client backend'"
                    )
                ).scalar_one()
        finally:
            engine.dispose()
        return f"pg_terminate_backend ({killed} connections)"

    return drop


def _kill_postgres(server: Any, down: float) -> Callable[[], str]:
    def kill() -> str:
        server.stop("immediate")
        time.sleep(down)
        server.start()
        return "pg_ctl stop -m immediate, start (crash recovery)"

    return kill


def _drop_mariadb(server: Any) -> Callable[[], str]:
    def drop() -> str:
        import pymysql

        conn = pymysql.connect(
            host="127.0.0.1",
            port=server.port,
            user=server.USER,
            password=server.PASSWORD,
            connect_timeout=5,
            autocommit=True,
        )
        killed = 0
        try:
            with conn.cursor() as cursor:
                cursor.execute(
                    "SELECT id FROM information_schema.processlist "
                    "WHERE id <> CONNECTION_ID() AND user = %s",
                    (server.USER,),
                )
                for (thread,) in cursor.fetchall():
                    try:
                        cursor.execute(f"KILL CONNECTION {int(thread)}")
                        killed += 1
                    except pymysql.err.MySQLError:  # gone meanwhile (1094)
                        pass
        finally:
            conn.close()
        return f"KILL CONNECTION ({killed} connections)"

    return drop


def _kill_mariadb(server: Any, down: float) -> Callable[[], str]:
    def kill() -> str:
        server.kill()
        time.sleep(down)
        server.start()
        return "kill -9 mariadbd, start (crash recovery)"

    return kill


def _leader(cluster: Any) -> int:
    end = time.monotonic() + 10.0
    while True:
        found = cluster.leader()
        if found is not None:
            return int(found)
        if time.monotonic() > end:
            raise RuntimeError(f"the {cluster.name} cluster has no leader")
        time.sleep(0.05)


def _kill_leader(cluster: Any, down: float) -> Callable[[], str]:
    def kill() -> str:
        leader = _leader(cluster)
        cluster.kill(leader)
        time.sleep(down)
        cluster.start_member(leader)
        return f"kill -9 the {cluster.name} leader (member {leader + 1}), restart it from disk"

    return kill


def _pause_member(cluster: Any, length: float, rng: random.Random) -> Callable[[], str]:
    def pause() -> str:
        index = rng.randrange(len(cluster.members))
        cluster.pause(index)
        try:
            time.sleep(length)
        finally:
            cluster.resume(index)
        return f"SIGSTOP {cluster.name} member {index + 1} for {length:.1f} s"

    return pause


def fault_plan(servers: Sequence[Any], down: float = 0.3, seed: int = 0) -> list[Fault]:
    """One cycle of faults over ``servers``: for each, dropped connections then a kill.

    A consensus cluster (etcd, ZooKeeper) gets its own pair: its leader killed with
    ``kill -9`` and started again from its data, and a member frozen with ``SIGSTOP`` for a
    second; the other members carry on meanwhile.

    Args:
        servers: :class:`fence._chaos.servers.RedisServer`,
            :class:`fence._chaos.servers.PostgresServer`,
            :class:`fence._chaos.servers.MariaDBServer`,
            :class:`fence._chaos.clusters.EtcdCluster` or
            :class:`fence._chaos.clusters.ZooKeeperEnsemble` objects.
        down: seconds a killed server stays down before it is started again.
        seed: the random source of the member to freeze.
    """
    plan: list[Fault] = []
    rng = random.Random(seed)
    for server in servers:
        if server.name == "redis":
            plan.append(Fault("drop-connections", "redis", _drop_redis(server)))
            plan.append(Fault("kill", "redis", _kill_redis(server, down)))
        elif server.name in ("etcd", "zookeeper"):
            plan.append(Fault("kill", server.name, _kill_leader(server, down)))
            plan.append(Fault("pause", server.name, _pause_member(server, 1.0, rng)))
        elif server.name == "mariadb":
            plan.append(Fault("drop-connections", "mariadb", _drop_mariadb(server)))
            plan.append(Fault("kill", "mariadb", _kill_mariadb(server, down)))
        else:
            plan.append(Fault("drop-connections", "postgres", _drop_postgres(server)))
            plan.append(Fault("kill", "postgres", _kill_postgres(server, down)))
    return plan


class FaultInjector(threading.Thread):
    """Runs a fault plan in a cycle, a fault ``every`` seconds after the last one ended.

    Args:
        plan: the faults of one cycle.
        every: seconds from the end of a fault (a killed server back up) to the next.
        first: seconds before the first one.
        log: where ``fault`` records go.
    """

    def __init__(self, plan: Sequence[Fault], every: float, first: float, log: list[Record]):
        super().__init__(name="chaos-faults", daemon=True)
        self.plan = list(plan)
        self.every = every
        self.first = first
        self.log = log
        self.done: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self._halt = threading.Event()
        self._start = time.time()

    @property
    def cycles(self) -> int:
        """How many full cycles of the plan ran."""
        return len(self.done) // len(self.plan) if self.plan else 1

    def run(self) -> None:
        """Inject faults until :meth:`finish`."""
        self._start = time.time()
        delay = self.first
        step = 0
        while self.plan and not self._halt.wait(delay):
            fault = self.plan[step % len(self.plan)]
            step += 1
            started = time.time()
            try:
                detail = fault.action()
            except Exception as err:  # reported in the summary, never hidden
                self.errors.append(f"{fault.kind} {fault.server}: {type(err).__name__}: {err}")
                detail = f"{fault.kind} {fault.server} FAILED"
            else:
                self.done.append(
                    {
                        "t": round(started - self._start, 3),
                        "kind": fault.kind,
                        "server": fault.server,
                        "detail": detail,
                    }
                )
            self.log.append(Record(started, "controller", "fault", detail=detail))
            # Counted from the end of the fault (its server back up), not its start: a
            # server slow to restart (a loaded machine) must not eat the workers' time
            # between faults, or a pairing does nothing but fail.
            delay = self.every

    def finish(self) -> None:
        """Stop after the fault under way (a restart completes) and wait for it."""
        self._halt.set()
        if self.is_alive():
            self.join()
