#!/usr/bin/env python3
"""Run the whole benchmark suite with one command; write results.json and the docs table.

    python benchmarks/run.py            # the full suite (a few minutes)
    python benchmarks/run.py --quick    # a smoke run (well under a minute)
    python benchmarks/run.py --only redis-guard,managers
    python benchmarks/run.py --render benchmarks/results.json   # redo the docs table only

Starts one throwaway redis-server and one PostgreSQL cluster on loopback (the tests' own,
``tests.servers``; the quorum section adds two more redis-servers, the consensus section a
3-member etcd cluster and a 3-server ZooKeeper ensemble, the MariaDB section a MariaDB
server) and runs every section against
them. Every row is a ratio to a baseline measured in the same run, interleaved, as
the median of several repetitions; see ``benchmarks/_harness.py``.

Writes ``benchmarks/results.json`` (machine, versions, rows) and the generated part of
``docs/benchmarks.md`` (between its result markers). ``--output`` and ``--docs`` send them
elsewhere; ``--no-docs`` leaves the docs alone.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _harness
from _harness import ROOT, Context, Row

#: Sections in report order: name -> the module whose ``collect(ctx)`` measures it.
SECTIONS: dict[str, str] = {
    "redis-guard": "bench_redis_guard",
    "sql-guard": "bench_sql_guard",
    "sql-batch": "bench_sql_batch",
    "sql-gate": "bench_sql_gate",
    "orm": "bench_orm",
    "managers": "bench_redis_manager",
    "waiters": "bench_waiters",
    "sql-manager": "bench_sql_manager",
    "quorum": "bench_quorum",
    "consensus": "bench_consensus",
    "consensus-guard": "bench_consensus_guard",
    "shared": "bench_shared",
    "memory": "bench_memory",
    "observe": "bench_observe",
    "celery": "bench_celery",
    "django": "bench_django",
    "mariadb": "bench_mariadb",
}

TITLES = {
    "redis-guard": "1. Fenced Redis writes vs SET and a raw EVALSHA (writes/s)",
    "sql-guard": "2. Fenced SQL UPDATE vs the plain UPDATE (updates/s)",
    "sql-batch": "2a. Fenced SQL batches vs the same plain batch (rows/s)",
    "sql-gate": "2c. Plain statements on a table without a fence, with the adapters' listeners "
    "vs without (statements/s)",
    "orm": "2b. ORM flush with the fence hook vs a version_id_col flush (flushes/s)",
    "managers": "3. Acquire+release pairs per second vs redis-py Lock (one process, uncontended)",
    "waiters": "3a. Many waiters on one Redis lock in one process (one manager, <= 4 connections)",
    "sql-manager": "3b. The SQL manager vs its floor (two plain UPDATEs) and redis-py Lock",
    "quorum": "3c. The quorum manager vs pottery Redlock over three nodes",
    "consensus": "3d. The etcd and ZooKeeper managers (3 servers each) vs the Redis manager",
    "consensus-guard": "3f. Fenced etcd put and ZooKeeper set vs the plain write (writes/s)",
    "shared": "3e. Shared locks: 16 readers + 1 writer on one resource vs the same 17 tasks "
    "under one exclusive lock (lock cycles/s)",
    "handoff": "4. Contended hand-off, 4 processes, vs python-redis-lock",
    "consensus-handoff": "4b. Contended hand-off on etcd and ZooKeeper vs the Redis manager",
    "memory": "5. Memory after many acquire/release cycles (lower is better)",
    "observe": "6. What the metrics collectors cost, in process (vs nothing listening)",
    "celery": "7. A Celery task under a lease (FencedTask) vs the same task unfenced (tasks/s)",
    "django": "8. A fenced Django save() vs a plain save() and optimistic version checks (saves/s)",
    "mariadb": "9. MariaDB: the fenced UPDATE, the ORM unit of work and the SQL manager vs their "
    "plain twins and peers",
}

GROUP_ORDER = list(TITLES)


def section_runner(name: str) -> Callable[[Context], list[Row]]:
    """The ``collect`` of a section."""
    module = importlib.import_module(SECTIONS[name])
    collect: Callable[[Context], list[Row]] = module.collect
    return collect


# -- the run --------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> tuple[dict[str, Any], list[Row]]:
    """Run the chosen sections; return the results document and the rows."""
    names = list(SECTIONS) if not args.only else [n.strip() for n in args.only.split(",")]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        raise SystemExit(f"unknown section(s) {unknown}; choose from {list(SECTIONS)}")
    started = time.perf_counter()
    machine = _harness.machine_info()
    rows: list[Row] = []
    skipped: list[dict[str, str]] = []
    with _harness.Servers() as servers:
        ctx = _harness.make_context(servers, quick=args.quick, repeats=args.repeats)
        for name in names:
            with _harness.timer(ctx, f"section {name}"):
                try:
                    got = section_runner(name)(ctx)
                except ModuleNotFoundError as exc:
                    if exc.name != SECTIONS[name]:
                        raise
                    ctx.log(f"   section {name} skipped: benchmarks/{exc.name}.py is missing")
                    skipped.append({"section": name, "reason": f"{exc.name}.py is missing"})
                    continue
                except Exception as exc:
                    if not args.keep_going:
                        raise
                    ctx.log(traceback.format_exc())
                    skipped.append({"section": name, "reason": f"failed: {exc!r}"})
                    continue
            _harness.check_finite(got)
            rows += got
        versions = {
            **_harness.package_versions(),
            **_harness.server_binaries(),
            **servers.versions(),
        }
    machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    rows.sort(key=lambda row: GROUP_ORDER.index(row.group) if row.group in GROUP_ORDER else 99)
    results = {
        "schema": 1,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "quick": args.quick,
        "repeats": ctx.repeats,
        "seconds": round(time.perf_counter() - started, 1),
        "machine": machine,
        "versions": versions,
        "rows": [row.as_json() for row in rows],
        "targets": {
            "met": [row.name for row in rows if row.meets_target is True],
            "missed": [row.name for row in rows if row.meets_target is False],
        },
        "skipped": skipped,
    }
    return results, rows


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, run, write the results."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run: few calls")
    parser.add_argument("--repeats", type=int, default=None, help="repetitions (default 7, 2)")
    parser.add_argument("--only", default="", help=f"comma-separated sections of {list(SECTIONS)}")
    parser.add_argument(
        "--output", type=Path, default=ROOT / "benchmarks" / "results.json", help="results file"
    )
    parser.add_argument(
        "--docs", type=Path, default=ROOT / "docs" / "benchmarks.md", help="page to update"
    )
    parser.add_argument("--no-docs", action="store_true", help="do not touch the docs page")
    parser.add_argument(
        "--keep-going", action="store_true", help="record a failing section and go on"
    )
    parser.add_argument(
        "--render",
        type=Path,
        default=None,
        metavar="RESULTS",
        help="measure nothing: rewrite the docs table from an existing results.json",
    )
    args = parser.parse_args(argv)

    if args.render is not None:
        results = json.loads(args.render.read_text())
        rows = _harness.rows_from_json(results["rows"])
        _harness.splice(args.docs, _harness.markdown(rows, results, TITLES))
        return 0

    results, rows = run(args)
    print(_harness.text_table(rows))
    if results["skipped"]:
        print(
            "\nskipped:", ", ".join(f"{s['section']} ({s['reason']})" for s in results["skipped"])
        )
    missed = results["targets"]["missed"]
    print(f"\ntargets missed: {', '.join(missed) if missed else 'none'}")
    print(f"{results['seconds']:.0f} s; results in {args.output}")

    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=2, allow_nan=False) + "\n")
    if not args.no_docs:
        _harness.splice(args.docs, _harness.markdown(rows, results, TITLES))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
