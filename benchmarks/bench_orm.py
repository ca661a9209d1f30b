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
- ``unit``: a whole unit of work per operation, as an application runs it: a new session,
  ``get()``, change, ``commit()``. Plain: BEGIN, SELECT, UPDATE, COMMIT, four waits. The
  hook with its default ``claim=True`` sends the register claim with the BEGIN (one
  message, a statement prepared once per connection) and reads its reply just before the
  SELECT leaves: the server claims while the ORM composes the SELECT, and the unit waits
  on three round trips. ``claim=False`` shows the hook
  without the claim; ``fenced_version()`` is the drop-in for ``version_id_col`` in a bound
  session (claim included).

Each repetition gives one throughput ratio ``hooked / plain``; the median is reported
(1.0 means the hook costs nothing; the target is at least 0.9 for the flush).

    python benchmarks/bench_orm.py [--quick] [--repeats 7]
"""

from __future__ import annotations

from collections.abc import Callable

import _harness
from _harness import Context, Row
from sqlalchemy import BigInteger, Engine, Integer, create_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from fence.adapters.orm import (
    bind,
    fence_column,
    fence_register_table,
    fenced_version,
    tombstone_column,
)

GROUP = "orm"


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


class Dropin(Base):
    """A ``version_id_col`` model turned fenced by ``fenced_version()``."""

    __tablename__ = "bench_dropin"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    v: Mapped[int] = mapped_column(Integer)
    fence: Mapped[int] = mapped_column(BigInteger, nullable=False)
    __mapper_args__ = fenced_version(fence)


REGISTER = fence_register_table(Base.metadata)
TOKEN = 1_000_000


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

    def dropin_unit() -> None:
        with Session(engine) as s:
            bind(s, token=TOKEN, scope="bench:dropin")
            s.get(Dropin, 2).v += 1  # type: ignore[union-attr]
            s.commit()

    return {
        "plain": plain_unit,
        "hook claim": hooked(True),
        "hook no-claim": hooked(False),
        "dropin": dropin_unit,
    }


def seed(engine: Engine) -> None:
    """(Re)create the tables with rows 1 and 2 in each."""
    Base.metadata.drop_all(engine)
    Base.metadata.create_all(engine)
    with Session(engine) as s:
        bind(s, token=1, scope="seed")
        s.add_all([Fenced(id=i, v=0) for i in (1, 2)])
        s.commit()
    with Session(engine) as s:
        s.add_all([Versioned(id=i, v=0) for i in (1, 2)])
        s.add_all([Dropin(id=i, v=0) for i in (1, 2)])
        s.commit()


def collect(ctx: Context) -> list[Row]:
    """Flushes and whole units of work, hook vs ``version_id_col``; see the module docstring."""
    engine = create_engine(ctx.servers.postgres.url)
    try:
        seed(engine)
        variants, sessions = flush_variants(engine)
        try:
            flush = _harness.interleaved(
                {
                    "version_id_col flush": variants["plain"],
                    "flush with the hook": variants["hook"],
                },
                calls=ctx.n(1000, 60),
                batch=20,
                repeats=ctx.repeats,
                warmup=ctx.n(100, 10),
            )
        finally:
            for session in sessions:
                session.rollback()
                session.close()
        units = unit_variants(engine)
        unit = _harness.interleaved(
            {
                "version_id_col unit of work": units["plain"],
                "unit of work with the hook, claim": units["hook claim"],
                "unit of work with the hook, no claim": units["hook no-claim"],
                "unit of work, fenced_version() drop-in": units["dropin"],
            },
            calls=ctx.n(300, 20),
            batch=10,
            repeats=ctx.repeats,
            warmup=ctx.n(30, 5),
        )
    finally:
        engine.dispose()
    rows = _harness.rate_rows(
        GROUP,
        flush,
        "version_id_col flush",
        unit="flushes/s",
        prefix="ORM: ",
        targets={"flush with the hook": 0.9},
        notes={
            "flush with the hook": "one session and transaction; each flush changes one "
            "attribute of a loaded object: one UPDATE either way",
        },
    )
    rows += _harness.rate_rows(
        GROUP,
        unit,
        "version_id_col unit of work",
        unit="units/s",
        prefix="ORM: ",
        targets={
            "unit of work with the hook, claim": 0.95,
            "unit of work, fenced_version() drop-in": 0.95,
        },
        notes={
            "unit of work with the hook, claim": "new session, get(), change, commit(); the "
            "claim (C8) leaves with the BEGIN and is read before the SELECT: three waits "
            "where the plain unit has four",
            "unit of work, fenced_version() drop-in": "the version_id_col model with "
            "fenced_version(), in a session bound with the default claim",
        },
    )
    return rows


if __name__ == "__main__":
    raise SystemExit(_harness.standalone(collect, __doc__))
