"""A differential test: one generated history, every guard, and the reference model.

Hypothesis generates sequences of holders' operations (tokens that are newer, equal and
older than the fences they meet; creates, updates, deletes, claims, registering reads and
batches, some with an item that fails while it is applied) over scopes with odd names,
and runs each sequence against every guard (Redis, SQLAlchemy Core on SQLite and on
PostgreSQL, psycopg, and the ORM session hook) and against
:class:`fence.testing.MemoryGuard`, the reference. After every step the verdicts (accepted,
or the reason, the fence and every rejected scope), the fences and the data must be
identical.

The bad item of a batch is the one thing each storage refuses in its own way while
applying it: on SQL a value that breaks a ``CHECK`` constraint, on Redis two increments
of one key that overflow a 64-bit integer. The reference refuses it as a data error after
the token check (a stale token wins), with nothing written.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest
import redis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from psycopg import sql
from sqlalchemy import (
    BigInteger,
    CheckConstraint,
    Column,
    Engine,
    MetaData,
    String,
    Table,
    create_engine,
    select,
)
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, registry
from sqlalchemy.orm.attributes import flag_modified

from fence import FenceError, Reason, StaleTokenError
from fence.adapters import psycopg as pg_guard
from fence.adapters.orm import INCLUDE_TOMBSTONES, bind
from fence.adapters.redis import RedisGuard
from fence.adapters.sql import RowGuard, fence_column, tombstone_column
from fence.testing import MemoryGuard, _differential

BAD = -1  # a value each storage refuses while applying it
SCOPES = ["a", "b", "x:{y}", "fence:z", "ü", "k}{"]

# -- verdicts ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Verdict:
    """What a call came to, in terms every guard shares."""

    kind: str  # "ok", "stale" or "data"
    result: Any = None
    reason: Reason | None = None
    fence: int | None = None
    rejected: frozenset[tuple[str, Reason, int | None]] = frozenset()


def judge(call: Callable[[], Any], scope_of: Callable[[str], str]) -> Verdict:
    try:
        result = call()
    except StaleTokenError as err:
        items = err.rejected or (err,)
        return Verdict(
            "stale",
            reason=err.reason,
            fence=err.fence,
            rejected=frozenset((scope_of(e.scope), e.reason, e.fence) for e in items),
        )
    except (FenceError, IntegrityError) as err:
        return Verdict("data", result=type(err).__name__)
    return Verdict("ok", result=result)


# -- the reference ---------------------------------------------------------------------------


class Reference(_differential.Reference):
    """The guard kit's reference (MemoryGuard), with the batch's bad item refused as a data
    error after the token check."""

    name = "reference"

    def scope_of(self, raw: str) -> str:
        return raw

    def batch(self, token: int, values: Mapping[str, int]) -> None:
        good = {k: (0 if v == BAD else v) for k, v in values.items()}
        if BAD in values.values():
            shadow = MemoryGuard()  # the token check alone, on a copy of the fences
            for scope in values:
                fence = self.guard.fence(scope)
                if fence is not None:
                    shadow.claim(scope, fence)
            shadow.write_many(token, good)  # raises the stale verdict if there is one
            raise FenceError("a batch item fails while it is applied")
        self.guard.write_many(token, good)

    def state(self, scope: str) -> tuple[int | None, int | None]:
        return self.read(scope), self.fence(scope)


# -- the guards under test --------------------------------------------------------------------


class RedisSide:
    name = "redis"

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url)
        self.guard = RedisGuard(self.client)
        self.ns = secrets.token_hex(4)

    def key(self, scope: str) -> str:
        return f"{{{self.ns}}}:{scope}"

    def scope_of(self, raw: str) -> str:
        return raw.removeprefix(f"{{{self.ns}}}:")

    def create(self, scope: str, token: int, value: int) -> None:
        self.guard.set(self.key(scope), value, token=token)

    def update(self, scope: str, token: int, value: int) -> None:
        self.guard.set(self.key(scope), value, token=token, must_exist=True)

    def delete(self, scope: str, token: int) -> None:
        self.guard.delete(self.key(scope), token=token)

    def claim(self, scope: str, token: int) -> None:
        self.guard.claim(self.key(scope), token)

    def read_for_update(self, scope: str, token: int) -> int | None:
        raw = self.guard.read_for_update(self.key(scope), token=token)
        return None if raw is None else int(raw)

    def batch(self, token: int, values: Mapping[str, int]) -> None:
        batch = self.guard.batch(token)
        for scope, value in values.items():
            if value == BAD:  # 0 + (2**63 - 1) + 1 overflows INCRBY
                batch.incr(self.key(scope), 2**63 - 1).incr(self.key(scope), 1)
            else:
                batch.set(self.key(scope), value)
        batch.execute()

    def state(self, scope: str) -> tuple[int | None, int | None]:
        raw = self.client.get(self.key(scope))
        return (None if raw is None else int(raw)), self.guard.fence(self.key(scope))

    def close(self) -> None:
        self.client.close()


def _table(name: str) -> Table:
    return Table(
        name,
        MetaData(),
        Column("k", String(64), primary_key=True),
        Column("v", BigInteger, nullable=True),
        fence_column(),
        tombstone_column(),
        CheckConstraint("v IS NULL OR v >= 0", name=f"{name}_v"),
    )


class CoreSide:
    """The Core row guard; every call its own transaction."""

    def __init__(self, engine: Engine, label: str) -> None:
        self.name = label
        self.engine = engine
        self.table = _table(f"diff_{secrets.token_hex(4)}")
        with engine.begin() as conn:
            self.table.create(conn)

    def scope_of(self, raw: str) -> str:
        for scope in SCOPES:
            if raw == f"{self.table.name}({scope!r})":
                return scope
        return raw

    def _run(self, fn: Callable[[RowGuard], Any]) -> Any:
        with self.engine.begin() as conn:
            return fn(RowGuard(conn, self.table))

    def create(self, scope: str, token: int, value: int) -> None:
        self._run(lambda g: g.upsert(token, {"k": scope, "v": value}))

    def update(self, scope: str, token: int, value: int) -> None:
        self._run(lambda g: g.update(scope, token, {"v": value}))

    def delete(self, scope: str, token: int) -> None:
        self._run(lambda g: g.delete(scope, token))

    def claim(self, scope: str, token: int) -> None:
        self._run(lambda g: g.claim(scope, token))

    def read_for_update(self, scope: str, token: int) -> int | None:
        row = self._run(lambda g: g.read_for_update(scope, token))
        return None if row is None else int(row.v)

    def batch(self, token: int, values: Mapping[str, int]) -> None:
        self._run(lambda g: g.upsert_many(token, [{"k": k, "v": v} for k, v in values.items()]))

    def state(self, scope: str) -> tuple[int | None, int | None]:
        t = self.table
        with self.engine.connect() as conn:
            row = conn.execute(select(t.c.v, t.c.fence, t.c.deleted).where(t.c.k == scope)).first()
        if row is None:
            return None, None
        return (None if row.deleted else row.v), row.fence

    def close(self) -> None:
        with self.engine.begin() as conn:
            self.table.drop(conn)


class OrmSide(CoreSide):
    """The session hook: creates, updates and deletes of live rows are flushes of a mapped
    class; what a session has no way to say (a claim, a registering read, the delete of a
    row it cannot load, a batch with a bad item) goes through the row guard, on the same
    table and under the same fence rule."""

    def __init__(self, engine: Engine, label: str) -> None:
        super().__init__(engine, label)

        class Row:
            k: str
            v: int | None
            deleted: bool

            def __init__(self, **values: Any) -> None:
                for name, value in values.items():
                    setattr(self, name, value)

        registry().map_imperatively(Row, self.table)
        self.Row = Row

    def _session(self, token: int) -> Session:
        s = Session(self.engine)
        bind(s, token=token, claim=False)
        return s

    def _load(self, s: Session, scope: str) -> Any:
        return s.get(self.Row, scope, execution_options={INCLUDE_TOMBSTONES: True})

    def create(self, scope: str, token: int, value: int) -> None:
        with self._session(token) as s:
            s.add(self.Row(k=scope, v=value))
            s.commit()

    def update(self, scope: str, token: int, value: int) -> None:
        with self._session(token) as s:
            row = self._load(s, scope)
            if row is None:  # a row that never existed: the ORM has nothing to update
                raise StaleTokenError(f"{self.table.name}({scope!r})", token, None, Reason.MISSING)
            row.v = value
            flag_modified(row, "v")  # the same value is a write too, as for every guard
            s.commit()

    def delete(self, scope: str, token: int) -> None:
        with self._session(token) as s:
            row = self._load(s, scope)
            if row is not None and not row.deleted:
                s.delete(row)
                s.commit()
                return
        super().delete(scope, token)

    def batch(self, token: int, values: Mapping[str, int]) -> None:
        if BAD in values.values():
            super().batch(token, values)
            return
        with self._session(token) as s:
            s.add_all([self.Row(k=k, v=v) for k, v in values.items()])
            s.commit()


class PsycopgSide:
    name = "psycopg"

    def __init__(self, conninfo: str) -> None:
        self.conn = psycopg.connect(conninfo, autocommit=False)
        self.name_ = f"diffpg_{secrets.token_hex(4)}"
        with self.conn.transaction():
            self.conn.execute(
                sql.SQL(
                    "CREATE TABLE {} (k TEXT PRIMARY KEY, v BIGINT CHECK (v IS NULL OR v >= 0), "
                    "fence BIGINT NOT NULL DEFAULT 0, deleted BOOLEAN NOT NULL DEFAULT FALSE)"
                ).format(sql.Identifier(self.name_))
            )
            pg_guard.install_triggers(self.conn, self.name_, tombstone="deleted")
        self.guard = pg_guard.RowGuard(self.conn, self.name_, key="k", tombstone="deleted")

    def scope_of(self, raw: str) -> str:
        for scope in SCOPES:
            if raw == f"{self.name_}({scope!r})":
                return scope
        return raw

    def _run(self, fn: Callable[[], Any]) -> Any:
        with self.conn.transaction():
            return fn()

    def create(self, scope: str, token: int, value: int) -> None:
        self._run(lambda: self.guard.upsert(token, {"k": scope, "v": value}))

    def update(self, scope: str, token: int, value: int) -> None:
        self._run(lambda: self.guard.update(scope, token, {"v": value}))

    def delete(self, scope: str, token: int) -> None:
        self._run(lambda: self.guard.delete(scope, token))

    def claim(self, scope: str, token: int) -> None:
        self._run(lambda: self.guard.claim(scope, token))

    def read_for_update(self, scope: str, token: int) -> int | None:
        row = self._run(lambda: self.guard.read_for_update(scope, token))
        return None if row is None else int(row["v"])

    def batch(self, token: int, values: Mapping[str, int]) -> None:
        rows = [{"k": k, "v": v} for k, v in values.items()]
        self._run(lambda: self.guard.upsert_many(token, rows))

    def state(self, scope: str) -> tuple[int | None, int | None]:
        query = sql.SQL("SELECT v, fence, deleted FROM {} WHERE k = %s").format(
            sql.Identifier(self.name_)
        )
        with self.conn.transaction():
            row = self.conn.execute(query, (scope,)).fetchone()
        if row is None:
            return None, None
        return (None if row[2] else row[0]), row[1]

    def close(self) -> None:
        with self.conn.transaction():
            self.conn.execute(sql.SQL("DROP TABLE {}").format(sql.Identifier(self.name_)))
        self.conn.close()


# -- the histories ---------------------------------------------------------------------------

tokens = st.integers(min_value=1, max_value=6)
scopes = st.sampled_from(SCOPES)
values = st.integers(min_value=0, max_value=99)
steps = st.one_of(
    st.tuples(st.just("create"), scopes, tokens, values),
    st.tuples(st.just("update"), scopes, tokens, values),
    st.tuples(st.just("delete"), scopes, tokens, st.none()),
    st.tuples(st.just("claim"), scopes, tokens, st.none()),
    st.tuples(st.just("read_for_update"), scopes, tokens, st.none()),
    st.tuples(
        st.just("batch"),
        st.dictionaries(scopes, st.one_of(values, st.just(BAD)), min_size=1, max_size=3),
        tokens,
        st.none(),
    ),
)


def _call(side: Any, step: tuple[Any, ...]) -> Callable[[], Any]:
    op, target, token, value = step
    if op == "batch":
        return lambda: side.batch(token, target)
    if value is None:
        return lambda: getattr(side, op)(target, token)
    return lambda: getattr(side, op)(target, token, value)


@pytest.fixture(scope="module")
def sides(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Callable[[], list[Any]]]:
    """Makes a fresh set of guards (new tables, a new Redis namespace) for one history."""
    server = request.getfixturevalue("postgres_server")
    redis_url = request.getfixturevalue("redis_server").url
    sqlite = create_engine(f"sqlite:///{tmp_path_factory.mktemp('diff') / 'diff.db'}")
    postgres = create_engine(server.url)

    def make() -> list[Any]:
        return [
            RedisSide(redis_url),
            CoreSide(sqlite, "core-sqlite"),
            CoreSide(postgres, "core-postgres"),
            PsycopgSide(server.conninfo),
            OrmSide(sqlite, "orm-sqlite"),
            OrmSide(postgres, "orm-postgres"),
        ]

    yield make
    sqlite.dispose()
    postgres.dispose()


@pytest.mark.redis
@pytest.mark.postgres
@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(history=st.lists(steps, min_size=1, max_size=12))
def test_every_guard_agrees_with_the_reference(
    sides: Callable[[], list[Any]], history: list[Any]
) -> None:
    reference = Reference()
    under_test = sides()
    try:
        _compare(reference, under_test, history)
    finally:
        for side in under_test:
            side.close()


def _compare(reference: Reference, under_test: list[Any], history: list[Any]) -> None:
    touched: set[str] = set()
    for i, step in enumerate(history):
        expected = judge(_call(reference, step), reference.scope_of)
        touched |= set(step[1]) if step[0] == "batch" else {step[1]}
        for side in under_test:
            got = judge(_call(side, step), side.scope_of)
            where = f"step {i} {step} on {side.name}"
            assert got.kind == expected.kind, f"{where}: {got} != reference {expected}"
            if got.kind == "stale":
                assert (got.reason, got.fence, got.rejected) == (
                    expected.reason,
                    expected.fence,
                    expected.rejected,
                ), where
            elif got.kind == "ok" and step[0] == "read_for_update":
                assert got.result == expected.result, where
            for scope in sorted(touched):
                assert side.state(scope) == reference.state(scope), f"{where}, scope {scope!r}"
