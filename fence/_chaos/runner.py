"""``fence chaos``: run every pairing under pauses and server faults, then check the log.

For each pairing the runner prepares the servers, spawns the worker processes, lets the
:class:`~fence._chaos.controller.Pauser` stop lease holders and the
:class:`~fence._chaos.controller.FaultInjector` break the servers, then reads the final
counters and hands the whole log to :func:`fence._chaos.checker.check`. The output is a JSON
summary (stdout, and ``--summary FILE``) and, with ``--timeline FILE``, an SVG picture.

The unfenced baseline (redis-py ``Lock`` with plain ``GET``/``SET``) runs under the same
pauses, each one landing between a worker's read and its write, so it shows the updates a
lease alone loses.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from fence._chaos import pairings as _pairings
from fence._chaos.base import Endpoints
from fence._chaos.checker import Record, check
from fence._chaos.clusters import EtcdCluster, ZooKeeperEnsemble
from fence._chaos.controller import FaultInjector, Pauser, fault_plan
from fence._chaos.pairings import PAIRINGS, PLANNED, Pairing
from fence._chaos.servers import (
    POSTGRES_DURABLE,
    REDIS_AOF,
    MariaDBServer,
    PostgresServer,
    RedisServer,
)
from fence._chaos.timeline import render_svg
from fence._chaos.worker import Board, Phase, WorkerConfig
from fence._chaos.worker import main as worker_main
from fence._interrupt import sigint_ignored

__all__ = ["Settings", "main", "orphans", "run", "soak"]

_ENDPOINTS = ("redis", "postgres", "mariadb", "etcd", "zookeeper")

_LONG = {"duration": 600.0, "workers": 8, "records": 4}
_SOAK = {"duration": 60.0, "workers": 8, "records": 4}  # duration: one slice of a pairing

# Seconds past a lock's ttl (and what the server adds to it) before a lock still held after
# the run counts as an orphan: room for a server that the last fault restarted.
_ORPHAN_SLACK = 10.0
# A soak does not start a slice shorter than this at its end.
_SHORTEST_SLICE = 5.0
_DEFAULT = {"duration": 20.0, "workers": 5, "records": 3}


@dataclass(frozen=True, slots=True)
class Settings:
    """The knobs of a chaos run.

    Attributes:
        pairings: the pairings to run, by name.
        workers: worker processes per pairing.
        records: records (counters) per pairing; fewer records than workers means
            contention.
        ttl: the lease time, in seconds. Pauses last 1.3 to 2 times as long.
        work: seconds a worker spends between its read and its write.
        duration: the longest a pairing runs, in seconds.
        pauses: end a pairing once this many pauses counted and one cycle of faults ran
            (``None``: run for ``duration``).
        faults: inject server faults (fenced pairings).
        fault_every: seconds from the end of a fault (its server back up) to the next.
        seed: the random seed of the controller and the workers.
    """

    pairings: tuple[str, ...]
    workers: int = 5
    records: int = 3
    ttl: float = 0.4
    work: float = 0.02
    duration: float = 20.0
    pauses: int | None = None
    faults: bool = True
    fault_every: float = 1.5
    seed: int = 0


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def _read_log(path: Path) -> list[Record]:
    if not path.exists():
        return []
    records = []
    with path.open(encoding="utf-8") as log:
        for line in log:
            line = line.strip()
            if line:
                with contextlib.suppress(json.JSONDecodeError):  # a line cut by a kill
                    records.append(Record.from_json(json.loads(line)))
    return records


def _wait_ready(board: Board, procs: Sequence[Any], timeout: float) -> None:
    end = time.monotonic() + timeout
    while True:
        phases = [board.read(i)[0] for i in range(len(procs))]
        if all(phase == Phase.READY for phase in phases):
            return
        dead = [p.name for p in procs if not p.is_alive()]
        if dead:
            raise RuntimeError(f"chaos workers {dead} died while starting; see their .stderr logs")
        if time.monotonic() > end:
            raise RuntimeError(f"chaos workers did not start within {timeout:.0f} s")
        time.sleep(0.02)


def _max_inflight(workers: int) -> int:
    # Several pauses at once, but at least two workers keep running to take expired leases.
    return max(1, min(workers - 2, workers // 2 + 1))


def orphans(
    pairing: Pairing,
    endpoints: Endpoints,
    records: Sequence[str],
    ttl: float,
    slack: float = _ORPHAN_SLACK,
) -> list[str]:
    """The records whose lock nobody can take within its ttl (and what the server adds to
    it) plus ``slack`` seconds, once every worker is gone: locks left behind by the run.

    Every worker has stopped by now, each released what it held or lost it, and a killed
    one's lease ends with its ttl; a lock still held after that is an orphan. A lock the
    check took is none, even if its release gets no answer (it is tried again while the
    bound lasts; what is left is the check's own lease, gone with its ttl).
    """
    from fence._errors import BackendError, NotOwnerError

    kind = _pairings.LOCKERS[pairing.locker]
    bound = ttl + kind.overhang(ttl) + slack
    locker = _pairings.open_locker(pairing, endpoints, ttl)
    left: list[str] = []
    try:
        for record in records:
            end = time.monotonic() + bound
            while True:
                try:
                    held = locker.acquire(record, timeout=max(0.1, end - time.monotonic()))
                except BackendError:
                    held = None  # a server still coming back: try again until the bound
                    if time.monotonic() < end:
                        time.sleep(0.1)
                        continue
                if held is not None:
                    while True:
                        try:
                            held.release()
                        except BackendError:
                            if time.monotonic() < end:
                                time.sleep(0.1)
                                continue
                        except NotOwnerError:
                            pass  # the release that got no answer had landed
                        break
                elif time.monotonic() < end:
                    continue
                else:
                    left.append(record)
                break
    finally:
        locker.close()
    return left


#: What the workers' server process imports once, so that no worker imports it again.
_PRELOAD = ["fence._chaos.worker", "sqlalchemy", "psycopg", "redis", "fence.adapters.sql"]


def _worker_context() -> Any:
    """How the workers start: forked from a server process that imported what they need
    once (``forkserver``, where the platform has it), not each a new interpreter that
    imports it all again (``spawn``: seconds per pairing, and far more on a loaded
    machine; still the way where the platform has no forkserver or the temporary
    folder's path is too long for its socket). The server process is started at the
    first worker, while the controller ignores Ctrl-C, so every worker ignores it too; it
    ends with the controller."""
    # The server process listens on a Unix socket in the temporary folder
    # (<tmp>/pymp-XXXXXXXX/listener-XXXXXXXX), and such a path is at most 104 bytes on
    # some systems: with a deeper TMPDIR, spawn.
    deep = len(os.fsencode(tempfile.gettempdir())) + 40 > 104
    if deep or "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def run_pairing(
    pairing: Pairing,
    servers: dict[str, Any],
    settings: Settings,
    workdir: Path,
    round_: int = 0,
) -> tuple[dict[str, Any], list[Record]]:
    """Run one pairing; return its summary and its whole log.

    Args:
        pairing: what runs.
        servers: the run's servers, by kind.
        settings: the run's knobs.
        workdir: where the worker logs go.
        round_: a soak's round; each round gets records of its own.
    """
    endpoints = Endpoints(
        **{
            name: getattr(server, "endpoint", None) or server.url
            for name, server in servers.items()
            if name in _ENDPOINTS
        }
    )
    records = pairing.records(settings.records, round_)
    _pairings.setup(pairing, endpoints, records)
    folder = workdir / (f"{pairing.short}-r{round_}" if round_ else pairing.short)
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(f"{settings.seed}:{pairing.name}")

    ctx = _worker_context()
    n = settings.workers
    array = ctx.RawArray("q", Board.size(n))
    board = Board(array, n)
    names = [f"w{i + 1}" for i in range(n)]
    configs = [
        WorkerConfig(
            name=names[i],
            index=i,
            pairing=pairing.name,
            endpoints=endpoints,
            records=tuple(records),
            ttl=settings.ttl,
            work=settings.work,
            acquire_timeout=max(1.0, 4 * settings.ttl),
            log_path=str(folder / f"{names[i]}.jsonl"),
            seed=rng.randrange(2**32),
        )
        for i in range(n)
    ]
    for i in range(n):
        board.post(i, Phase.STARTING)
    procs = [
        ctx.Process(target=worker_main, args=(config, array), name=f"chaos-{config.name}")
        for config in configs
    ]
    with sigint_ignored():  # the workers inherit it: Ctrl-C is the controller's to handle
        for proc in procs:
            proc.start()
    log: list[Record] = []
    pauser: Pauser | None = None
    injector: FaultInjector | None = None
    stragglers: list[str] = []
    started = time.monotonic()
    try:
        _wait_ready(board, procs, timeout=120)
        pids = [int(proc.pid or 0) for proc in procs]
        pauser = Pauser(
            board=board,
            pids=pids,
            names=names,
            records=records,
            ttl=settings.ttl,
            log=log,
            rng=rng,
            max_inflight=_max_inflight(n),
            # The baseline is stopped only between read and write, so that every pause
            # can cost it an update: its loss is shown, not left to luck.
            prefer_read=0.75 if pairing.fenced else 1.0,
            extra=_pairings.LOCKERS[pairing.locker].overhang(settings.ttl),
        )
        if settings.faults and pairing.fenced:
            plan = fault_plan([servers[name] for name in pairing.servers], seed=settings.seed)
            injector = FaultInjector(plan, settings.fault_every, first=1.0, log=log)
        board.start()
        started = time.monotonic()
        if injector is not None:
            injector.start()
        while True:
            pauser.step()
            elapsed = time.monotonic() - started
            if elapsed >= settings.duration:
                break
            if (
                settings.pauses is not None
                and pauser.counted >= settings.pauses
                and (injector is None or injector.cycles >= 1)
            ):
                break
            if any(not proc.is_alive() for proc in procs):
                break
            time.sleep(0.005)
    finally:
        board.stop()
        if pauser is not None:
            pauser.resume_all()
        if injector is not None:
            injector.finish()
        for proc in procs:
            proc.join(60)
            if proc.is_alive():  # pragma: no cover - a hung worker is a harness bug
                stragglers.append(proc.name)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(proc.pid or 0), signal.SIGCONT)
                proc.kill()
                proc.join(10)
    elapsed = time.monotonic() - started
    assert pauser is not None

    for config in configs:
        log.extend(_read_log(Path(config.log_path)))
    log.sort(key=lambda r: r.t)
    with (folder / "controller.jsonl").open("w", encoding="utf-8") as out:
        for record in log:
            if record.worker == "controller" or record.event in ("paused", "resumed"):
                data = {k: v for k, v in asdict(record).items() if v is not None}
                out.write(json.dumps(data) + "\n")

    final = _pairings.final_values(pairing, endpoints, records)
    verdict = check(log, final)
    left = orphans(pairing, endpoints, records, settings.ttl) if pairing.fenced else []
    events = Counter(record.event for record in log)
    faults = injector.done if injector is not None else []
    kills = Counter(f["server"] for f in faults if f["kind"] == "kill")
    failures = [p.name for p in procs if p.exitcode not in (0, None)]
    summary: dict[str, Any] = {
        "pairing": pairing.name,
        "description": pairing.description,
        "fenced": pairing.fenced,
        # The unfenced baseline is there to lose updates; a fenced pairing never may.
        "expected": "no stale write, no lost update" if pairing.fenced else "lost updates",
        "lock": _pairings.LOCKERS[pairing.locker].name,
        "store": _pairings.STORES[pairing.store].name,
        "workers": n,
        "records": len(records),
        "ttl_s": settings.ttl,
        "elapsed_s": round(elapsed, 2),
        "pauses_injected": pauser.counted,
        "pauses_between_read_and_write": pauser.between_read_and_write,
        "faults_injected": len(faults),
        "server_kills": dict(kills),
        "faults": faults,
        "fault_errors": injector.errors if injector is not None else [],
        "acquired": events["acquired"],
        "accepted": sum(verdict.accepted.values()),
        "rejected": sum(verdict.rejected.values()),
        "reads_rejected": events["read_rejected"],
        "readers": pairing.readers,
        "reads_accepted": sum(verdict.reads_accepted.values()),
        "stale_reads": len(verdict.stale_reads),
        "unknown_outcomes": events["write_error"],
        "backend_errors": events["acquire_error"] + events["read_error"],
        "leases_lost_at_release": events["lost"],
        "final": final,
        "stale_accepted": len(verdict.stale_accepted),
        "lost_updates": sum(verdict.lost_updates.values()),
        "tokens_issued_twice": len(verdict.duplicate_tokens),
        "orphan_locks": left,
        "verdict": verdict.as_dict(),
        "worker_failures": failures,
        "workers_killed": stragglers,
    }
    summary["ok"] = bool(
        verdict.ok and not failures and not stragglers and not summary["fault_errors"] and not left
    )
    return summary, log


def _timeline_path(base: Path, pairing: Pairing, several: bool) -> Path:
    if not several:
        return base
    return base.with_name(f"{base.stem}-{pairing.name.replace('+', '-')}{base.suffix}")


@contextlib.contextmanager
def _servers_for(chosen: Sequence[Pairing]) -> Iterator[dict[str, Any]]:
    """Start the servers the ``chosen`` pairings need; stop them all at the end.

    Raises:
        RuntimeError: a server could not start.
    """
    wanted = {server for pairing in chosen for server in pairing.servers}
    servers: dict[str, Any] = {}
    # The checker assumes that a killed server process loses nothing it acknowledged.
    kinds: tuple[tuple[str, Callable[[], Any]], ...] = (
        ("redis", lambda: RedisServer(*REDIS_AOF)),
        ("postgres", lambda: PostgresServer(POSTGRES_DURABLE)),
        ("mariadb", MariaDBServer),
        ("etcd", EtcdCluster),
        ("zookeeper", ZooKeeperEnsemble),
    )
    try:
        # Every server is made (which finds its programs, or refuses) before any starts,
        # and each is stopped below even if its start fails half way.
        for name, kind in kinds:
            if name in wanted:
                servers[name] = kind()
        for server in servers.values():
            server.start()
        yield servers
    finally:
        for server in servers.values():
            # The SQL servers' stop() keeps their files for a restart; destroy() does not.
            stop = server.destroy if isinstance(server, PostgresServer | MariaDBServer) else None
            (stop or server.stop)()


def _line(summary: dict[str, Any], fenced: bool) -> str:
    verdict = "ok" if summary["ok"] else ("LOSES UPDATES" if not fenced else "FAILED")
    return (
        f"  {summary['elapsed_s']:.1f} s, {summary['pauses_injected']} pauses, "
        f"{summary['faults_injected']} faults, {summary['accepted']} accepted, "
        f"{summary['rejected']} rejected, {summary['stale_accepted']} stale accepted, "
        f"{summary['lost_updates']} lost updates -> {verdict}"
    )


def run(settings: Settings, workdir: Path, timeline: Path | None = None) -> dict[str, Any]:
    """Run the pairings of ``settings``; return the JSON summary as a dict.

    Raises:
        RuntimeError: a server or a worker could not start.
    """
    chosen = [PAIRINGS[name] for name in settings.pairings]
    results: list[dict[str, Any]] = []
    with _servers_for(chosen) as servers:
        for pairing in chosen:
            _say(f"fence chaos: {pairing.name}: {pairing.description} ...")
            summary, log = run_pairing(pairing, servers, settings, workdir)
            results.append(summary)
            _say(_line(summary, pairing.fenced))
            if timeline is not None:
                path = _timeline_path(timeline, pairing, len(chosen) > 1)
                title = (
                    f"fence chaos {pairing.name}: {summary['workers']} workers, ttl "
                    f"{settings.ttl} s, {summary['pauses_injected']} pauses, "
                    f"{summary['faults_injected']} server faults: {summary['accepted']} "
                    f"accepted, {summary['rejected']} rejected, "
                    f"{summary['lost_updates']} lost updates"
                )
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(render_svg(log, title), encoding="utf-8")

    fenced = [r for r in results if r["fenced"]]
    baseline = [r for r in results if not r["fenced"]]
    kills: Counter[str] = Counter()
    for result in fenced:
        kills.update(result["server_kills"])
    return {
        "settings": asdict(settings),
        "pairings": results,
        "not_covered": dict(PLANNED),
        "totals": {
            "pauses_injected": sum(r["pauses_injected"] for r in fenced),
            "faults_injected": sum(r["faults_injected"] for r in fenced),
            "server_kills": dict(kills),
            "accepted": sum(r["accepted"] for r in fenced),
            "rejected": sum(r["rejected"] for r in fenced),
            "stale_accepted": sum(r["stale_accepted"] for r in fenced),
            "lost_updates": sum(r["lost_updates"] for r in fenced),
            "tokens_issued_twice": sum(r["tokens_issued_twice"] for r in fenced),
            "orphan_locks": sum(len(r["orphan_locks"]) for r in fenced),
            "baseline_lost_updates": sum(r["lost_updates"] for r in baseline),
        },
        "ok": all(r["ok"] for r in fenced),
    }


# What a soak adds up, per pairing and in all: (report key, how to read it off a slice).
_SOAK_SUMS: tuple[tuple[str, Callable[[dict[str, Any]], int]], ...] = (
    ("pauses", lambda r: int(r["pauses_injected"])),
    ("pauses_between_read_and_write", lambda r: int(r["pauses_between_read_and_write"])),
    ("server_kills", lambda r: sum(r["server_kills"].values())),
    ("connection_drops", lambda r: sum(f["kind"] == "drop-connections" for f in r["faults"])),
    ("member_freezes", lambda r: sum(f["kind"] == "pause" for f in r["faults"])),
    ("acquired", lambda r: int(r["acquired"])),
    ("writes_accepted", lambda r: int(r["accepted"])),
    ("stale_refused", lambda r: int(r["rejected"])),
    ("reads_accepted", lambda r: int(r["reads_accepted"])),
    ("reads_refused", lambda r: int(r["reads_rejected"])),
    ("unknown_outcomes", lambda r: int(r["unknown_outcomes"])),
    ("lost", lambda r: int(r["lost_updates"])),
    ("stale_accepted", lambda r: int(r["stale_accepted"])),
    ("stale_reads", lambda r: int(r["stale_reads"])),
    ("tokens_issued_twice", lambda r: int(r["tokens_issued_twice"])),
    ("orphan_locks", lambda r: len(r["orphan_locks"])),
    ("worker_failures", lambda r: len(r["worker_failures"]) + len(r["workers_killed"])),
    ("fault_errors", lambda r: len(r["fault_errors"])),
)


def soak(settings: Settings, minutes: float, workdir: Path, keep: bool = False) -> dict[str, Any]:
    """Run the fenced pairings of ``settings`` in turn, ``settings.duration`` seconds each,
    round after round, until ``minutes`` have passed; return the report as a dict.

    The servers start once and live through the whole soak, faults included; every round
    uses records of its own, so each slice is checked on its own log. A slice that fails
    does not stop the soak: the report lists it, and its ``ok`` is false.

    Args:
        settings: the knobs; ``duration`` is one slice, ``pauses`` is ignored.
        minutes: how long the soak runs; the slice running at the end is cut to fit, and
            none shorter than a few seconds starts. The first round runs whole, every
            pairing for at least those few seconds, even past ``minutes``.
        workdir: where the worker logs go.
        keep: keep every slice's logs (otherwise each is removed once checked).

    Raises:
        RuntimeError: a server or a worker could not start.
    """
    chosen = [PAIRINGS[name] for name in settings.pairings if PAIRINGS[name].fenced]
    started = time.monotonic()
    end = started + minutes * 60.0
    slices: list[dict[str, Any]] = []
    per: dict[str, Counter[str]] = {pairing.name: Counter() for pairing in chosen}
    failed: list[dict[str, Any]] = []
    rounds = 0
    with _servers_for(chosen) as servers:
        while rounds == 0 or time.monotonic() + _SHORTEST_SLICE <= end:
            for pairing in chosen:
                left = end - time.monotonic()
                if left < _SHORTEST_SLICE and rounds:
                    break
                part = replace(
                    settings,
                    # The first round runs whole, whatever the time: every pairing is soaked.
                    duration=min(settings.duration, max(left, _SHORTEST_SLICE)),
                    pauses=None,
                    seed=settings.seed + rounds,
                )
                _say(
                    f"fence chaos --soak: round {rounds + 1}, {pairing.name}, "
                    f"{part.duration:.0f} s ({left / 60:.1f} min left) ..."
                )
                summary, _ = run_pairing(pairing, servers, part, workdir, rounds)
                _say(_line(summary, True))
                if not keep:
                    folder = f"{pairing.short}-r{rounds}" if rounds else pairing.short
                    shutil.rmtree(workdir / folder, ignore_errors=True)
                counts = {key: read(summary) for key, read in _SOAK_SUMS}
                per[pairing.name].update(counts)
                per[pairing.name]["slices"] += 1
                entry = {
                    "round": rounds + 1,
                    "pairing": pairing.name,
                    "elapsed_s": summary["elapsed_s"],
                    **counts,
                    "ok": summary["ok"],
                }
                slices.append(entry)
                if not summary["ok"]:
                    failed.append({**entry, "summary": summary})
            rounds += 1
    totals: Counter[str] = Counter()
    for counts in per.values():
        totals.update(counts)
    return {
        "settings": asdict(settings),
        "soak_minutes": minutes,
        "elapsed_s": round(time.monotonic() - started, 1),
        "rounds": rounds,
        "totals": {key: totals[key] for key in ("slices", *(k for k, _ in _SOAK_SUMS))},
        "per_pairing": {name: dict(counts) for name, counts in per.items()},
        "not_covered": dict(PLANNED),
        "slices": slices,
        "failed": failed,
        "ok": bool(slices) and not failed,
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fence chaos",
        description=(
            "Run lock holders under SIGSTOP pauses past their lease and server crashes, "
            "for every pairing of lock manager and storage guard, and check that no stale "
            "write was accepted and no update lost. Starts its own redis-server, "
            "PostgreSQL and MariaDB, and for the consensus pairings a 3-member etcd "
            "cluster and a 3-server ZooKeeper ensemble."
        ),
    )
    names = [*PAIRINGS]
    parser.add_argument(
        "--pairing",
        action="append",
        choices=names,
        metavar="NAME",
        help=f"run only this pairing (repeatable): {', '.join(names)}",
    )
    parser.add_argument("--no-baseline", action="store_true", help="skip the unfenced baseline")
    parser.add_argument(
        "--workers", type=int, help="worker processes per pairing (default 5; --long and --soak 8)"
    )
    parser.add_argument(
        "--records", type=int, help="records per pairing (default 3; --long and --soak 4)"
    )
    parser.add_argument("--ttl", type=float, default=0.4, help="lease ttl in seconds (0.4)")
    parser.add_argument(
        "--work", type=float, default=0.02, help="seconds between read and write (0.02)"
    )
    parser.add_argument(
        "--duration",
        type=float,
        help="seconds per pairing, at most (default 20; --long 600; --soak: one slice, 60)",
    )
    parser.add_argument(
        "--pauses",
        type=int,
        help="end a pairing early once this many pauses counted and every fault ran once",
    )
    parser.add_argument(
        "--long",
        action="store_true",
        help="a long run: 600 s per pairing, 8 workers, 4 records (each overridable)",
    )
    parser.add_argument(
        "--soak",
        type=float,
        metavar="MINUTES",
        help="a soak: the fenced pairings in turn, a slice of --duration seconds each (default "
        "60), round after round for MINUTES; the report adds up pauses, kills, writes "
        "accepted, stale refused, lost, tokens issued twice and orphan locks",
    )
    parser.add_argument(
        "--celery",
        action="store_true",
        help="the Celery scenario instead of the pairings: two real celery workers on the "
        "run's Redis, one frozen past its lease in each job while the other runs the same "
        "job, and a Redis fault while it is frozen (--pauses jobs, default 10; the lease is "
        "--ttl, at least 1 s; --no-faults for none)",
    )
    parser.add_argument("--no-faults", action="store_true", help="pauses only, no server faults")
    parser.add_argument(
        "--fault-every",
        type=float,
        default=1.5,
        help="seconds from the end of a server fault (the server back up) to the next (1.5)",
    )
    parser.add_argument("--seed", type=int, default=0, help="random seed (0)")
    parser.add_argument("--summary", metavar="FILE", help="also write the JSON summary here")
    parser.add_argument(
        "--timeline",
        metavar="FILE",
        help="write an SVG timeline (one file per pairing, suffixed, when several run)",
    )
    parser.add_argument("--keep", metavar="DIR", help="keep the worker logs in DIR")
    return parser


#: The shortest lease of the Celery scenario: a worker process answers slower than the
#: runner's own workers, and a lease that ends before the pause would prove nothing.
_CELERY_TTL = 1.0


def _celery(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``fence chaos --celery``: the Celery scenario on a redis-server of its own."""
    import importlib.util

    for flag, given in (
        ("--pairing", args.pairing),
        ("--soak", args.soak),
        ("--long", args.long or None),
        ("--timeline", args.timeline),
    ):
        if given is not None:
            parser.error(f"{flag} does not go with --celery")
    if importlib.util.find_spec("celery") is None:
        raise RuntimeError("Celery is not installed (pip install iofence[celery])")
    from fence._chaos.celery_scenario import run_celery

    ttl = max(args.ttl, _CELERY_TTL)
    server = RedisServer(*REDIS_AOF)
    faults = [] if args.no_faults else fault_plan([server], seed=args.seed)

    def go(workdir: Path) -> dict[str, Any]:
        _say(f"fence chaos --celery: {args.pauses or 10} jobs, lease {ttl} s ...")
        try:
            server.start()
            result = run_celery(
                server.url, args.pauses or 10, ttl, args.seed, workdir, faults=faults
            )
        finally:
            server.stop()
        _say(
            f"  {result['elapsed_s']:.1f} s, {result['pauses_injected']} pauses, "
            f"{len(result['faults'])} Redis faults, "
            f"{len(result['worker_restarts'])} worker restarts, "
            f"{result['stale_refused']} stale writes refused, {result['stale_accepted']} "
            f"stale accepted, {result['lost_jobs']} jobs lost -> "
            f"{'ok' if result['ok'] else 'FAILED'}"
        )
        return result

    return _finish(args, go)


def _finish(args: argparse.Namespace, go: Callable[[Path], dict[str, Any]]) -> int:
    """Run ``go`` in the work folder (``--keep``'s, or a temporary one), print and write
    the summary; the exit status."""
    if args.keep:
        workdir = Path(args.keep)
        workdir.mkdir(parents=True, exist_ok=True)
        result = go(workdir)
    else:
        with tempfile.TemporaryDirectory(prefix="iofence-chaos-") as tmp:
            result = go(Path(tmp))
    text = json.dumps(result, indent=2)
    if args.summary:
        Path(args.summary).write_text(text + "\n", encoding="utf-8")
    print(text)
    return 0 if result["ok"] else 1


def _interrupted(signum: int, frame: Any) -> None:
    # The first Ctrl-C stops the run; the ones after it must not cut the clean-up short
    # (servers still running, temporary folders left behind).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _say("fence chaos: interrupted; stopping the workers and the servers")
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``fence chaos``.

    Exit status: 0 when every fenced pairing passed, 1 when one did not or the run could
    not start (a missing program, a server that did not come up), 2 for a usage error,
    130 when interrupted (Ctrl-C); the servers and temporary folders are removed in every
    case.
    """
    previous = signal.signal(signal.SIGINT, _interrupted)
    try:
        return _main(argv)
    except KeyboardInterrupt:
        return 130
    except (RuntimeError, OSError) as exc:
        _say(f"fence chaos: {exc}")
        return 1
    except subprocess.CalledProcessError as exc:
        detail = exc.stderr.decode(errors="replace").strip() if exc.stderr else ""
        _say(f"fence chaos: {' '.join(map(str, exc.cmd))} failed ({exc.returncode}) {detail}")
        return 1
    finally:
        signal.signal(signal.SIGINT, previous)


def _main(argv: list[str] | None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    for name in ("ttl", "duration", "fault_every", "records", "workers", "pauses", "soak"):
        value = getattr(args, name)
        if value is not None and not value > 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {value}")
    if args.work < 0:
        parser.error(f"--work must not be negative, got {args.work}")
    if args.soak is not None:
        for flag, given in (
            ("--pauses", args.pauses),
            ("--timeline", args.timeline),
            ("--long", args.long or None),
        ):
            if given is not None:
                parser.error(f"{flag} does not go with --soak")
        if args.pairing and not any(PAIRINGS[name].fenced for name in args.pairing):
            parser.error("--soak runs fenced pairings only; the baseline is not one")
    if args.celery:
        return _celery(parser, args)
    preset = _SOAK if args.soak is not None else (_LONG if args.long else _DEFAULT)
    chosen = list(dict.fromkeys(args.pairing or [*PAIRINGS]))
    if args.no_baseline or args.soak is not None:
        chosen = [name for name in chosen if PAIRINGS[name].fenced]
    settings = Settings(
        pairings=tuple(chosen),
        workers=args.workers or int(preset["workers"]),
        records=args.records or int(preset["records"]),
        ttl=args.ttl,
        work=args.work,
        duration=args.duration or float(preset["duration"]),
        pauses=args.pauses,
        faults=not args.no_faults,
        fault_every=args.fault_every,
        seed=args.seed,
    )
    if settings.workers < 3:
        settings = replace(settings, workers=3)  # two keep running while one is stopped
        _say("fence chaos: using 3 workers, the fewest that let pauses overlap with progress")
    timeline = Path(args.timeline) if args.timeline else None

    def go(workdir: Path) -> dict[str, Any]:
        if args.soak is not None:
            return soak(settings, args.soak, workdir, keep=bool(args.keep))
        return run(settings, workdir, timeline)

    return _finish(args, go)
