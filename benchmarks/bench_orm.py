#!/usr/bin/env python3
"""An ORM flush through the session hook vs a plain ORM flush with ``version_id_col``.

Starts its own throwaway PostgreSQL cluster (``tests.servers.PostgresServer``) on loopback
and times, in one run, interleaving the variants in batches so that all see the same
machine:

- ``flush``: one session and transaction; each operation changes one attribute of a loaded
  object and flushes. Plain: ``UPDATE ... SET v, version WHERE id AND version = :read``.
  Hook: ``UPDATE ... SET v, fence WHERE id AND fence <= :token AND NOT deleted``, with the
  row count checked by the hook. Both are one round trip; the difference is the hook's
  Python work.
- ``unit``: a whole unit of work per operation: a new session, ``get()``, change, commit.
  Plain: BEGIN, SELECT, UPDATE, COMMIT. Hook with ``claim=True`` (the default) adds the
  register claim (one more round trip) at the start of the transaction; ``claim=False``
  shows the hook without it.

The ratio is ``plain / hooked`` time per operation: 1.0 means the hook costs nothing; the
target is at least 0.9 for the flush.

    python benchmarks/bench_orm.py [--ops 2000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sqlalchemy import BigInteger, Engine, Integer, create_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from fence.adapters.orm import bind, fence_column, fence_register_table, tombstone_column
from tests.servers import PostgresServer


class Base(DeclarativeBase):
    pass


class Fenced(Base):
    __tablename__ = "bench_fenced"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    v: Mapped[int] = mapped_column(Integer)
    fence: Mapped[int] = fence_column()
    deleted: Mapped[bool] = tombstone_column()


class Versioned(Base):
    __tablename__ = "bench_versioned"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    v: Mapped[int] = mapped_column(Integer)
    version: Mapped[int] = mapped_column(BigInteger, nullable=False)
    __mapper_args__ = {"version_id_col": version}  # noqa: RUF012


REGISTER = fence_register_table(Base.metadata)
TOKEN = 1_000_000


def timed(fn: Callable[[], None], ops: int) -> float:
    """Seconds per call of ``fn()`` over ``ops`` calls."""
    start = time.perf_counter()
    for _ in range(ops):
        fn()
    return (time.perf_counter() - start) / ops


def interleave(variants: dict[str, Callable[[], None]], ops: int, rounds: int) -> dict[str, float]:
    """Median seconds per call of each variant, run in rotating batches of 50."""
    for fn in variants.values():
        timed(fn, 100)  # warm up: compiled caches, prepared statements
    batch = 50
    samples: dict[str, list[float]] = {k: [] for k in variants}
    order = list(variants)
    for n in range(rounds * max(1, ops // batch)):
        shift = n % len(order)
        for key in order[shift:] + order[:shift]:
            samples[key].append(timed(variants[key], batch))
    return {key: statistics.median(values) for key, values in samples.items()}


def flush_variants(engine: Engine) -> tuple[dict[str, Callable[[], None]], list[Session]]:
    plain = Session(engine)
    hooked = Session(engine)
    bind(hooked, token=TOKEN, scope="bench")
    versioned = plain.get(Versioned, 1)
    fenced = hooked.get(Fenced, 1)
    assert versioned is not None
    assert fenced is not None

    def plain_flush() -> None:
        versioned.v += 1
        plain.flush()

    def hooked_flush() -> None:
        fenced.v += 1
        hooked.flush()

    return {"plain": plain_flush, "hook": hooked_flush}, [plain, hooked]


def unit_variants(engine: Engine) -> dict[str, Callable[[], None]]:
    def plain_unit() -> None:
        with Session(engine) as s:
            s.get(Versioned, 2).v += 1  # type: ignore[union-attr]
            s.commit()

    def hooked(claim: bool) -> Callable[[], None]:
        def unit() -> None:
            with Session(engine) as s:
                bind(s, token=TOKEN, scope="bench:2", claim=claim)
                s.get(Fenced, 2).v += 1  # type: ignore[union-attr]
                s.commit()

        return unit

    return {"plain": plain_unit, "hook claim": hooked(True), "hook no-claim": hooked(False)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()

    server = PostgresServer().start()
    try:
        engine = create_engine(server.url)
        Base.metadata.create_all(engine)
        with Session(engine) as s:
            bind(s, token=1, scope="seed")
            s.add_all([Fenced(id=i, v=0) for i in (1, 2)])
            s.commit()
        with Session(engine) as s:
            s.add_all([Versioned(id=i, v=0) for i in (1, 2)])
            s.commit()

        rows: list[dict[str, Any]] = []
        variants, sessions = flush_variants(engine)
        medians = interleave(variants, args.ops, args.rounds)
        for session in sessions:
            session.rollback()
            session.close()
        rows.append(report("flush", "hook", medians))
        medians = interleave(unit_variants(engine), args.ops // 2, args.rounds)
        rows.append(report("unit", "hook claim", medians))
        rows.append(report("unit", "hook no-claim", medians))
        engine.dispose()
    finally:
        server.destroy()

    print(f"{'case':<22} {'plain us':>10} {'hook us':>10} {'ratio':>7}")
    for r in rows:
        print(f"{r['case']:<22} {r['plain']:>10.1f} {r['hook']:>10.1f} {r['ratio']:>7.2f}")
    return 0


def report(case: str, key: str, medians: dict[str, float]) -> dict[str, Any]:
    return {
        "case": f"{case} {key.removeprefix('hook').strip() or ''}".strip(),
        "plain": medians["plain"] * 1e6,
        "hook": medians[key] * 1e6,
        "ratio": medians["plain"] / medians[key],
    }


if __name__ == "__main__":
    raise SystemExit(main())
