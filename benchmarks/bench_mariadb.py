#!/usr/bin/env python3
"""MariaDB: the row guard, the session hook and the SQL lock manager against their plain
twins and peers, sync through PyMySQL, in one run.

    python benchmarks/bench_mariadb.py [--quick] [--repeats 7]

Starts its own throwaway MariaDB server (``fence._chaos.servers.MariaDBServer``) on
loopback, then times, interleaving the variants in batches so that all of them see the
same machine:

- **guard**: one-row updates, each in a transaction of its own (the write, then
  ``COMMIT``), on one connection of a URL-built engine. The fenced one is
  ``RowGuard(conn, table).update(...)`` on a table with the database's judge (its
  triggers, installed by ``create_all``: the default), proved by its row count. Baselines:
  the same ``UPDATE`` built once with bind parameters on a twin table without triggers, as
  an application without iofence writes; and the same ``UPDATE`` on the judged table,
  carrying the token the way the guard's statement does (``fence = (@iofence_row_token :=
  :t)``), which is what every writer pays under C14: the first ratio is the whole cost,
  the two others split it into the trigger's and the guard's.
- **orm**: a whole unit of work per operation, as an application runs it: a new session,
  ``get()``, change, ``commit()``. Plain: a ``version_id_col`` model. Hooked: a fenced
  model in a session bound with ``bind()`` (claim on, the documented default), and the
  ``fenced_version()`` drop-in.
- **manager**: uncontended acquire+release pairs of ``fence.connect("mariadb://...")``,
  against its floor (a raw upsert and a raw update, autocommit, on one bare PyMySQL
  connection; and the same through a SQLAlchemy engine with the manager's settings:
  autocommit, no reset on return) and against MariaDB's own ``GET_LOCK`` and
  ``RELEASE_LOCK`` on one bare connection (the peer a MariaDB user reaches for, at its
  fastest; it issues no token, and the lock lives and dies with its session). The same
  pairs of the PostgreSQL manager (``fence.connect("postgresql://...")``) and of redis-py
  ``Lock`` run in the same batches, as the peers a user compares the manager with.
- **hand-off**: four processes loop on one lock of ``fence.connect(url)`` (hold it 0.2 ms,
  then 0.2 ms of work outside it), as in the Redis managers' section: hand-offs per
  second and the latency from the holder's release to the next holder's grant, MariaDB
  (waiters poll, the default ``poll_interval``) against PostgreSQL (``LISTEN``/``NOTIFY``
  wakes them).

Each repetition gives one throughput ratio per row; the median is reported. Besides the
rates, each variant's statements per operation are counted on the server (the growth of
``Questions`` over a run of the variant alone); with PyMySQL every statement, ``COMMIT``
included, is one round trip.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import _harness
import pymysql
import redis
from _harness import Context, Row
from bench_redis_manager import HOLD, OUTSIDE, _gather, handoff_stats
from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    Engine,
    Integer,
    MetaData,
    Table,
    bindparam,
    create_engine,
    text,
    update,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

import fence
from fence._chaos.servers import MariaDBServer
from fence.adapters.orm import bind, fence_register_table, fenced_version
from fence.adapters.orm import fence_column as orm_fence_column
from fence.adapters.sql import FENCE_INFO, RowGuard, fence_column

GROUP = "mariadb"
#: The manager's peers in the acquire+release pairs.
PG_MANAGER = "iofence SQL (PostgreSQL by URL)"
REDIS_PY = "redis-py Lock"
ROWS = 100
TOKEN = 1_000_000


def _cycle() -> Callable[[], int]:
    """1, 2, 3, ...: a fresh value per call."""
    state = [0]

    def step() -> int:
        state[0] += 1
        return state[0]

    return step


def statements_per_call(server: MariaDBServer, fn: Callable[[], object], calls: int) -> float:
    """Statements the server ran per call of ``fn``: the growth of ``Questions`` over
    ``calls`` calls, less the ``SHOW`` that reads it (nothing else may use the server)."""
    admin = pymysql.connect(
        host="127.0.0.1", port=server.port, user=server.USER, password=server.PASSWORD
    )
    try:
        with admin.cursor() as cur:

            def questions() -> int:
                cur.execute("SHOW GLOBAL STATUS LIKE 'Questions'")
                row = cur.fetchone()
                assert row is not None
                return int(row[1])

            before = questions()
            for _ in range(calls):
                fn()
            return round((questions() - before - 1) / calls, 2)
    finally:
        admin.close()


def _counted(
    ctx: Context, variants: dict[str, Callable[[], object]], calls: int = 20
) -> dict[str, float]:
    return {
        name: statements_per_call(ctx.servers.mariadb, fn, calls) for name, fn in variants.items()
    }


# -- 1. the row guard -----------------------------------------------------------------------


def bench_guard(ctx: Context, engine: Engine) -> list[Row]:
    """``RowGuard.update`` on a judged table vs plain UPDATEs; see the module docstring."""
    metadata = MetaData()
    judged = Table(
        "bench_judged",
        metadata,
        Column("id", Integer, primary_key=True, autoincrement=False),
        Column("v", Integer),
        fence_column(),
    )
    # Plain writers' views of the tables: a fence column that the gate is told is not one.
    twin = Table(
        "bench_plain",
        metadata,
        Column("id", Integer, primary_key=True, autoincrement=False),
        Column("v", Integer),
        Column("fence", BigInteger, nullable=False, info={FENCE_INFO: False}),
    )
    judged_plain = Table(
        "bench_judged",
        MetaData(),
        Column("id", Integer, primary_key=True, autoincrement=False),
        Column("v", Integer),
        Column("fence", BigInteger, nullable=False, info={FENCE_INFO: False}),
    )
    metadata.drop_all(engine)
    metadata.create_all(engine)  # the judged table gets its triggers
    with engine.begin() as conn:
        conn.execute(text("SET @iofence_token = 1"))
        for table in (judged_plain, twin):
            conn.execute(table.insert(), [{"id": i, "v": 0, "fence": 1} for i in range(ROWS)])
        conn.execute(text("SET @iofence_token = NULL"))

    plain = update(twin).where(twin.c.id == bindparam("key")).values(v=bindparam("value"))
    with_token = (
        update(judged_plain)
        .where(judged_plain.c.id == bindparam("key"))
        .values(v=bindparam("value"), fence=text("(@iofence_row_token := :token)"))
    )
    nxt = _cycle()
    with engine.connect() as conn:
        guard = RowGuard(conn, judged)  # the default: the row count

        def in_transaction(body: Callable[[Connection, int], object]) -> Callable[[], None]:
            def once() -> None:
                i = nxt()
                with conn.begin():
                    body(conn, i)

            return once

        variants = {
            "plain UPDATE, a table without triggers": in_transaction(
                lambda c, i: c.execute(plain, {"key": i % ROWS, "value": i})
            ),
            "plain UPDATE with the token, the judged table": in_transaction(
                lambda c, i: c.execute(with_token, {"key": i % ROWS, "value": i, "token": TOKEN})
            ),
            "fenced update (default: row count)": in_transaction(
                lambda c, i: guard.update(i % ROWS, TOKEN, {"v": i})
            ),
        }
        rates = _harness.interleaved(
            variants,
            calls=ctx.n(600, 40),
            batch=20,
            repeats=ctx.repeats,
            warmup=ctx.n(60, 10),
        )
        counts = _counted(ctx, variants)
    notes = {
        "fenced update (default: row count)": "one write per transaction, the table judged by "
        "its triggers; statements per write: " + ", ".join(f"{n} {c:g}" for n, c in counts.items()),
    }
    rows = _harness.rate_rows(
        GROUP,
        rates,
        "plain UPDATE, a table without triggers",
        ["fenced update (default: row count)", "plain UPDATE with the token, the judged table"],
        unit="updates/s",
        prefix="guard: ",
        targets={"fenced update (default: row count)": 0.95},
        notes=notes,
    )
    rows += _harness.rate_rows(
        GROUP,
        rates,
        "plain UPDATE with the token, the judged table",
        ["fenced update (default: row count)"],
        unit="updates/s",
        prefix="guard: ",
    )
    for row in rows:
        row.extra["statements"] = counts
    return rows


# -- 2. the session hook --------------------------------------------------------------------


class Base(DeclarativeBase):
    pass


class Fenced(Base):
    __tablename__ = "bench_orm_fenced"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    v: Mapped[int] = mapped_column(Integer)
    fence: Mapped[int] = orm_fence_column()


class Versioned(Base):
    __tablename__ = "bench_orm_versioned"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    v: Mapped[int] = mapped_column(Integer)
    version: Mapped[int] = mapped_column(BigInteger, nullable=False)
    __mapper_args__ = {"version_id_col": version}  # noqa: RUF012


class Dropin(Base):
    """A ``version_id_col`` model turned fenced by ``fenced_version()``."""

    __tablename__ = "bench_orm_dropin"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    v: Mapped[int] = mapped_column(Integer)
    fence: Mapped[int] = mapped_column(BigInteger, nullable=False)
    __mapper_args__ = fenced_version(fence)


REGISTER = fence_register_table(Base.metadata)


def bench_orm(ctx: Context, engine: Engine) -> list[Row]:
    """Units of work, the hook vs ``version_id_col``; see the module docstring."""
    Base.metadata.drop_all(engine)
    Base.metadata.create_all(engine)
    with Session(engine) as s:
        bind(s, token=1, scope="seed")
        s.add_all([Fenced(id=i, v=0) for i in (1, 2)])
        s.commit()
    with Session(engine) as s:
        bind(s, token=1, scope="seed-dropin")
        s.add_all([Dropin(id=i, v=0) for i in (1, 2)])
        s.commit()
    with Session(engine) as s:
        s.add_all([Versioned(id=i, v=0) for i in (1, 2)])
        s.commit()

    def plain_unit() -> None:
        with Session(engine) as s:
            s.get(Versioned, 2).v += 1  # type: ignore[union-attr]
            s.commit()

    def hooked_unit() -> None:
        with Session(engine) as s:
            bind(s, token=TOKEN, scope="bench:2")
            s.get(Fenced, 2).v += 1  # type: ignore[union-attr]
            s.commit()

    def dropin_unit() -> None:
        with Session(engine) as s:
            bind(s, token=TOKEN, scope="bench:dropin")
            s.get(Dropin, 2).v += 1  # type: ignore[union-attr]
            s.commit()

    variants = {
        "version_id_col unit of work": plain_unit,
        "unit of work with the hook, claim": hooked_unit,
        "unit of work, fenced_version() drop-in": dropin_unit,
    }
    rates = _harness.interleaved(
        variants,
        calls=ctx.n(300, 20),
        batch=10,
        repeats=ctx.repeats,
        warmup=ctx.n(30, 5),
    )
    counts = _counted(ctx, variants)
    rows = _harness.rate_rows(
        GROUP,
        rates,
        "version_id_col unit of work",
        unit="units/s",
        prefix="ORM: ",
        targets={
            "unit of work with the hook, claim": 0.95,
            "unit of work, fenced_version() drop-in": 0.95,
        },
        notes={
            "unit of work with the hook, claim": "new session, get(), change, commit(); "
            "statements per unit: " + ", ".join(f"{n} {c:g}" for n, c in counts.items()),
        },
    )
    for row in rows:
        row.extra["statements"] = counts
    return rows


# -- 3. the SQL lock manager ----------------------------------------------------------------


def bench_manager(ctx: Context, url: str) -> list[Row]:
    """Acquire+release of the URL-built manager vs its floor, ``GET_LOCK``, the PostgreSQL
    manager and redis-py ``Lock``."""
    server = ctx.servers.mariadb
    manager = fence.connect(url.replace("mariadb+pymysql://", "mariadb://"), ttl=30)
    manager.create_table()
    pg_manager = fence.connect(ctx.servers.postgres.url, ttl=30)
    pg_manager.create_table()
    client = redis.Redis.from_url(ctx.servers.redis.url)
    engine = create_engine(url, isolation_level="AUTOCOMMIT", pool_reset_on_return=None)
    bare = pymysql.connect(
        host="127.0.0.1",
        port=server.port,
        user=server.USER,
        password=server.PASSWORD,
        database="iofence",
        autocommit=True,
    )
    try:
        with engine.connect() as conn:
            conn.execute(text("DROP TABLE IF EXISTS bench_raw"))
            conn.execute(
                text("CREATE TABLE bench_raw (id INT PRIMARY KEY, owner VARCHAR(64)) ENGINE=InnoDB")
            )
        upsert = (
            "INSERT INTO bench_raw (id, owner) VALUES (1, %s) "
            "ON DUPLICATE KEY UPDATE owner = VALUES(owner)"
        )
        clear = "UPDATE bench_raw SET owner = NULL WHERE id = 1"
        cursor = bare.cursor()

        def ours() -> None:
            manager.acquire("bench").release()

        def raw_pair() -> None:
            cursor.execute(upsert, ("x",))
            cursor.execute(clear)

        def raw_pair_sqlalchemy() -> None:
            with engine.connect() as conn:
                conn.exec_driver_sql(upsert, ("x",))
            with engine.connect() as conn:
                conn.exec_driver_sql(clear)

        def ours_pg() -> None:
            pg_manager.acquire("bench:mariadb-section").release()

        def redis_py() -> None:
            lock = client.lock("bench:redis-py-mariadb", timeout=30)
            lock.acquire(blocking=False)
            lock.release()

        def get_lock_pair() -> None:
            cursor.execute("SELECT GET_LOCK('bench:get-lock', 0)")
            if cursor.fetchone() != (1,):
                raise RuntimeError("GET_LOCK refused an uncontended lock")
            cursor.execute("SELECT RELEASE_LOCK('bench:get-lock')")
            cursor.fetchone()

        variants = {
            "raw upsert + UPDATE (PyMySQL, autocommit)": raw_pair,
            "iofence SQL (MariaDB by URL)": ours,
            "GET_LOCK + RELEASE_LOCK (PyMySQL; no token)": get_lock_pair,
            "raw upsert + UPDATE (SQLAlchemy, autocommit)": raw_pair_sqlalchemy,
            PG_MANAGER: ours_pg,
            REDIS_PY: redis_py,
        }
        rates = _harness.interleaved(
            variants,
            calls=ctx.n(300, 20),
            batch=10,
            repeats=ctx.repeats,
            warmup=ctx.n(30, 5),
        )
        on_mariadb = {k: v for k, v in variants.items() if k not in (PG_MANAGER, REDIS_PY)}
        counts = _counted(ctx, on_mariadb)
    finally:
        manager.close()
        pg_manager.close()
        client.close()
        engine.dispose()
        bare.close()
    statements = ", ".join(f"{n} {c:g}" for n, c in counts.items())
    floor = "raw upsert + UPDATE (PyMySQL, autocommit)"
    rows = _harness.rate_rows(
        GROUP,
        rates,
        floor,
        [name for name in on_mariadb if name != floor],
        unit="pairs/s",
        prefix="manager: ",
        notes={"iofence SQL (MariaDB by URL)": f"statements per pair: {statements}"},
    )
    rows += _harness.rate_rows(
        GROUP,
        rates,
        "GET_LOCK + RELEASE_LOCK (PyMySQL; no token)",
        ["iofence SQL (MariaDB by URL)"],
        unit="pairs/s",
        prefix="manager: ",
    )
    for peer in (PG_MANAGER, REDIS_PY):
        rows += _harness.rate_rows(
            GROUP, rates, peer, ["iofence SQL (MariaDB by URL)"], unit="pairs/s", prefix="manager: "
        )
    for row in rows:
        row.extra["statements"] = counts
    return rows


# -- 4. the contended hand-off ------------------------------------------------------------------

#: The hand-off's managers, by name: the first is the baseline.
HANDOFF_KINDS = ("iofence SQL (PostgreSQL, NOTIFY)", "iofence SQL (MariaDB, polling)")


def _contend(url: str, seconds: float, start_at: float) -> list[tuple[int, int, int]]:
    """Loop on one lock until ``seconds`` pass; return (asked, acquired, releasing) in ns."""
    manager = fence.connect(url, ttl=10)
    manager.acquire(f"bench:handoff:warm:{os.getpid()}", timeout=0).release()  # connect
    held: list[tuple[int, int, int]] = []
    clock = time.monotonic_ns
    try:
        while time.monotonic() < start_at:
            time.sleep(0.001)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            asked = clock()
            lease = manager.acquire("bench:handoff:sql", timeout=10)
            got = clock()
            time.sleep(HOLD)
            releasing = clock()
            lease.release()
            held.append((asked, got, releasing))
            time.sleep(OUTSIDE)
    finally:
        manager.close()
    return held


def bench_handoff(ctx: Context, url: str, procs: int = 4) -> list[Row]:
    """Four processes contending on one lock, MariaDB against PostgreSQL."""
    urls = dict(zip(HANDOFF_KINDS, (ctx.servers.postgres.url, url), strict=True))
    for kind_url in urls.values():
        with fence.connect(kind_url) as manager:
            manager.create_table()
    seconds = ctx.n(2.0, 0.75)
    mp = multiprocessing.get_context("spawn")
    results = mp.Queue()
    commands = [mp.Queue() for _ in range(procs)]
    workers = [
        mp.Process(target=_harness.contend_worker, args=(box, results), daemon=True)
        for box in commands
    ]
    for worker in workers:
        worker.start()
    stats: dict[str, list[dict[str, Any]]] = {kind: [] for kind in HANDOFF_KINDS}
    try:
        for rep in range(max(1, min(ctx.repeats, ctx.n(5, 1)))):
            shift = rep % len(HANDOFF_KINDS)
            for kind in HANDOFF_KINDS[shift:] + HANDOFF_KINDS[:shift]:
                start_at = time.monotonic() + 1.0  # every worker connected before the start
                for box in commands:
                    box.put((_contend, urls[kind], seconds, start_at))
                got = _gather(results, workers, deadline=time.monotonic() + seconds + 60)
                failed = [held for _, held in got if isinstance(held, str)]
                if failed:
                    raise RuntimeError(f"a {kind} worker failed: {failed[0]}")
                stats[kind].append(handoff_stats(got, seconds))
    finally:
        for box in commands:
            box.put(None)
        for worker in workers:
            worker.join(10)
            if worker.is_alive():
                worker.kill()
    base_kind, kind = HANDOFF_KINDS
    rows = []
    for metric, unit, label, higher in (
        ("handoffs_per_s", "hand-offs/s", "hand-offs per second", True),
        ("p50_ms", "ms", "hand-off latency p50", False),
        ("p99_ms", "ms", "hand-off latency p99", False),
    ):
        pairs = [(m[metric], b[metric]) for m, b in zip(stats[kind], stats[base_kind], strict=True)]
        # Times: baseline / variant, so that above 1 means faster hand-offs.
        ratios = [m / b if higher else b / m for m, b in pairs if m > 0 and b > 0]
        rows.append(
            Row(
                group=GROUP,
                name=f"hand-off, 4 processes: {kind}: {label}",
                baseline=base_kind,
                ratio=statistics.median(ratios) if ratios else float("nan"),
                unit=unit,
                better="higher",
                value=statistics.median(m for m, _ in pairs),
                baseline_value=statistics.median(b for _, b in pairs),
                repetitions=len(ratios),
                extra={"ratios": [round(r, 4) for r in ratios]},
            )
        )
    return rows


def collect(ctx: Context) -> list[Row]:
    """The guard, the hook and the manager on MariaDB; see the module docstring."""
    url = ctx.servers.mariadb.url()
    engine = create_engine(url)
    try:
        rows = [*bench_guard(ctx, engine), *bench_orm(ctx, engine)]
    finally:
        engine.dispose()
    by_url = url.replace("mariadb+pymysql://", "mariadb://")  # the manager's own driver
    return rows + bench_manager(ctx, url) + bench_handoff(ctx, by_url)


if __name__ == "__main__":
    raise SystemExit(_harness.standalone(collect, __doc__))
