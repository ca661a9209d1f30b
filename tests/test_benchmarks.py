"""The benchmark suite runs end to end and writes well-formed results.

It runs ``benchmarks/run.py --quick`` against real servers (the runner starts its own) and
checks the structure of ``results.json`` and of the generated docs block. It asserts nothing
about speed: the numbers belong in docs/benchmarks.md, not in a test.
"""

from __future__ import annotations

import fcntl
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = [pytest.mark.redis, pytest.mark.postgres, pytest.mark.mariadb]

#: Rows the issue asks for, as (name, baseline): every one must be in a run.
REQUIRED = {
    ("redis: fenced set", "redis: SET"),
    ("redis: fenced set", "redis: raw EVALSHA"),
    ("redis: fenced batch of 10 (one script)", "redis: 10 single fenced sets"),
    ("psycopg: fenced (default: row count)", "psycopg: plain UPDATE"),
    ("psycopg: fenced, returning=True", "psycopg: plain UPDATE RETURNING *"),
    ("Core: fenced (default: row count)", "Core: plain update(), built once"),
    ("Core: fenced, returning=True", "Core: plain update().returning(), built once"),
    ("psycopg 10 rows: fenced upsert_many", "psycopg 10 rows: plain upsert"),
    (
        "Core SQLite 500 rows: fenced update_many",
        "Core SQLite 500 rows: plain update (executemany)",
    ),
    ("ORM: flush with the hook", "ORM: version_id_col flush"),
    ("iofence Redis", "redis-py Lock"),
    ("iofence memory", "redis-py Lock"),
    ("python-redis-lock", "redis-py Lock"),
    ("pottery Redlock (1 node)", "redis-py Lock"),
    ("iofence SQL (PostgreSQL)", "redis-py Lock"),
    ("iofence Redis: hand-off latency p50", "python-redis-lock"),
    ("iofence Redis: hand-offs per second", "python-redis-lock"),
    ("redis-py Lock: hand-off latency p50", "python-redis-lock"),
    ("iofence etcd", "iofence Redis"),
    ("iofence ZooKeeper", "iofence Redis"),
    ("iofence etcd: hand-off latency p50", "iofence Redis"),
    ("iofence ZooKeeper: hand-off latency p50", "iofence Redis"),
    ("iofence etcd fenced put", "etcd put"),
    ("iofence ZooKeeper fenced set", "ZooKeeper set_data"),
    ("iofence etcd: hand-offs per second", "iofence Redis"),
    ("iofence ZooKeeper: hand-offs per second", "iofence Redis"),
    ("iofence SQL (SQLite file by URL)", "redis-py Lock"),
    ("iofence Redis FIFO: acquisitions, busiest / idlest worker", "equal shares"),
    (
        "Redis: 16 readers + 1 writer, shared locks",
        "Redis: the same 17 tasks, one exclusive lock",
    ),
    (
        "PostgreSQL: 16 readers + 1 writer, shared locks",
        "PostgreSQL: the same 17 tasks, one exclusive lock",
    ),
    (
        "eager, body one SET: FencedTask, Redis manager",
        "eager, body one SET: Celery task, unfenced",
    ),
    ("Django SQLite: fenced save()", "Django SQLite: plain save(), atomic()"),
    ("Django PostgreSQL: fenced save()", "Django PostgreSQL: plain save(), atomic()"),
    ("Django SQLite: fenced save()", "Django SQLite: django-concurrency save()"),
    ("Django PostgreSQL: fenced save()", "Django PostgreSQL: django-concurrency save()"),
    (
        "guard: fenced update (default: row count)",
        "guard: plain UPDATE, a table without triggers",
    ),
    (
        "guard: fenced update (default: row count)",
        "guard: plain UPDATE with the token, the judged table",
    ),
    ("ORM: unit of work with the hook, claim", "ORM: version_id_col unit of work"),
    ("manager: iofence SQL (MariaDB by URL)", "manager: raw upsert + UPDATE (PyMySQL, autocommit)"),
    (
        "manager: iofence SQL (MariaDB by URL)",
        "manager: GET_LOCK + RELEASE_LOCK (PyMySQL; no token)",
    ),
    ("manager: iofence SQL (MariaDB by URL)", "manager: iofence SQL (PostgreSQL by URL)"),
    ("manager: iofence SQL (MariaDB by URL)", "manager: redis-py Lock"),
    (
        "hand-off, 4 processes: iofence SQL (MariaDB, polling): hand-offs per second",
        "iofence SQL (PostgreSQL, NOTIFY)",
    ),
    (
        "hand-off, 4 processes: iofence SQL (MariaDB, polling): hand-off latency p50",
        "iofence SQL (PostgreSQL, NOTIFY)",
    ),
}

#: The waiters section's rows, per kind of waiter (their names carry the count of waiters).
WAITER_ROWS = ("wake-up latency p50", "wake-up latency p99", "connections used")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory, worker_id: str) -> tuple[dict, str]:
    """One quick run of the whole suite; its results and the docs page it updated.

    One run serves every test process: with pytest-xdist the tests of this module may land
    in two processes, and the first to get here runs the suite while the other waits on the
    lock and reads what it wrote."""
    shared = tmp_path_factory.getbasetemp()
    if worker_id != "master":
        shared = shared.parent  # the directory every xdist worker's base directory is in
    done = shared / "bench-quick.json"
    with (shared / "bench-quick.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            results, page = _quick_run(tmp_path_factory.mktemp("bench"))
            done.write_text(json.dumps({"results": results, "page": page}))
    saved = json.loads(done.read_text())
    return saved["results"], saved["page"]


def _quick_run(tmp: Path) -> tuple[dict, str]:
    docs = tmp / "benchmarks.md"
    docs.write_text(
        "# Benchmarks\n\nBefore.\n\n"
        "<!-- results:begin (generated by benchmarks/run.py; do not edit) -->\nold table\n"
        "<!-- results:end -->\n\nAfter.\n"
    )
    output = tmp / "results.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "run.py"),
            "--quick",
            "--output",
            str(output),
            "--docs",
            str(docs),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(output.read_text()), docs.read_text()


def test_every_row_has_a_positive_finite_ratio_to_a_named_baseline(
    quick_run: tuple[dict, str],
) -> None:
    results, _ = quick_run
    rows = results["rows"]
    assert rows
    for row in rows:
        for key in ("name", "baseline"):
            assert isinstance(row[key], str), (key, row)
            assert row[key], (key, row)
        assert row["name"] != row["baseline"], row
        for key in ("ratio", "value", "baseline_value"):
            assert isinstance(row[key], float | int), (key, row)
            assert math.isfinite(row[key]), (key, row)
            assert row[key] > 0, (key, row)
        assert row["better"] in ("higher", "lower")
        assert row["repetitions"] >= 1
        if row["target"] is not None:
            assert row["meets_target"] in (True, False)
    keys = [(row["group"], row["name"], row["baseline"]) for row in rows]
    assert len(keys) == len(set(keys)), "a row is reported twice"


def test_the_rows_the_issue_asks_for_are_there(quick_run: tuple[dict, str]) -> None:
    results, _ = quick_run
    present = {(row["name"], row["baseline"]) for row in results["rows"]}
    assert present >= REQUIRED, sorted(REQUIRED - present)
    groups = {row["group"] for row in results["rows"]}
    expected = {"redis-guard", "sql-guard", "managers", "sql-manager", "quorum", "handoff"}
    expected |= {"consensus", "consensus-handoff", "consensus-guard", "mariadb"}
    waiters = [row["name"] for row in results["rows"] if row["group"] == "waiters"]
    for kind in ("asyncio", "thread"):
        for what in WAITER_ROWS:
            assert any(kind in name and name.endswith(what) for name in waiters), (kind, what)
    assert groups >= expected | {"memory", "waiters"}
    memory = [row for row in results["rows"] if row["group"] == "memory"]
    assert {row["better"] for row in memory} == {"lower"}
    assert "orm" in groups
    assert results["skipped"] == []


def test_machine_and_versions_are_recorded(quick_run: tuple[dict, str]) -> None:
    results, _ = quick_run
    machine = results["machine"]
    assert machine["nproc"] >= 1
    assert machine["cpu_model"]
    assert machine["memory_gib"] > 0
    versions = results["versions"]
    for name in (
        "python",
        "redis-server",
        "PostgreSQL",
        "MariaDB",
        "redis",
        "SQLAlchemy",
        "psycopg",
        "python-redis-lock",
        "pottery",
    ):
        assert versions.get(name) not in (None, "", "absent"), name
    assert results["quick"] is True
    met, missed = results["targets"]["met"], results["targets"]["missed"]
    with_target = [row["name"] for row in results["rows"] if row["target"] is not None]
    assert sorted(met + missed) == sorted(with_target)


def test_the_docs_block_is_replaced_and_the_page_kept(quick_run: tuple[dict, str]) -> None:
    results, page = quick_run
    assert page.startswith("# Benchmarks\n\nBefore.\n")
    assert page.rstrip().endswith("After.")
    assert "old table" not in page
    assert page.count("<!-- results:begin") == 1
    assert page.count("<!-- results:end -->") == 1
    for row in results["rows"]:
        assert f"| {row['name']} | {row['baseline']} |" in page
    assert results["versions"]["redis-server"] in page
