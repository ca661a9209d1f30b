"""What a chaos run exercises: pairings of a lock (the token issuer) and a store (the guard).

A pairing names a *locker* kind and a *store* kind. Every worker of the run opens one of each:

- a :class:`~fence._chaos.base.Locker` hands out leases on records, with a token (``None``
  for the unfenced baseline);
- a :class:`~fence._chaos.base.Store` keeps one integer counter per record and offers the
  two halves of a read-modify-write cycle: a *registering read* (the read raises the fence
  to the token, C8) and a fenced write of the new value.

Adding a pairing means adding a :class:`StoreKind` or :class:`LockerKind` (a few factory
functions) and one :class:`Pairing` line.

A pairing with readers (:attr:`Pairing.readers`, C13) mixes read cycles into the writers'
cycles: a reader takes a read lease and makes checked reads
(:meth:`~fence._chaos.base.SharedStore.checked_read`: the value, the token it was written
under, and the fence, in one atomic step), accepted iff the fence is not above its token.

The Redis stores are here; the SQL row guard's store is in :mod:`fence._chaos.sql`, the ORM
session hook's in :mod:`fence._chaos.orm`, the Django app's (workers that are Django
processes) in :mod:`fence._chaos.django_store`. The guards themselves come from
``fence.adapters`` through :mod:`fence._optional`. A pairing whose server or client this
machine lacks is left out, and :data:`PLANNED` says what is missing; the summary of every
run repeats it.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fence._chaos import django_store, orm, plain_sql, sql
from fence._chaos.base import (
    SOCKET_TIMEOUT,
    CheckedRead,
    Endpoints,
    Held,
    Locker,
    Store,
    needs_token,
)
from fence._errors import BackendError, NotOwnerError
from fence._optional import etcd_guard, redis_guard, zookeeper_guard

if TYPE_CHECKING:
    from fence._sync.manager import BaseLockManager, Lease

__all__ = [
    "LOCKERS",
    "PAIRINGS",
    "PLANNED",
    "STORES",
    "LockerKind",
    "Pairing",
    "StoreKind",
]


@dataclass(frozen=True, slots=True)
class LockerKind:
    """How to build a locker.

    Attributes:
        name: its name in the summary.
        server: the server it needs.
        open: ``open(endpoints, ttl)`` builds one (in a worker).
        setup: ``setup(endpoints)`` prepares the server once per run (tables).
        overhang: ``overhang(ttl)``: how much longer than ``ttl`` the server may keep the
            lease of a frozen holder (etcd rounds leases up to whole seconds; ZooKeeper
            keeps a frozen client's nodes until its session expires). Pauses last that
            much longer, so that they outlast the lease on the server too.
    """

    name: str
    server: str
    open: Callable[[Endpoints, float], Locker]
    setup: Callable[[Endpoints], None]
    overhang: Callable[[float], float] = lambda ttl: 0.0


@dataclass(frozen=True, slots=True)
class StoreKind:
    """How to build a store.

    Attributes:
        name: its name in the summary.
        server: the server it needs.
        open: ``open(endpoints, namespace)`` builds one (in a worker).
        setup: ``setup(endpoints, namespace, records)`` creates the counters at 0.
        final: ``final(endpoints, namespace, records)`` reads every counter after the run.
    """

    name: str
    server: str
    open: Callable[[Endpoints, str], Store]
    setup: Callable[[Endpoints, str, Sequence[str]], None]
    final: Callable[[Endpoints, str, Sequence[str]], dict[str, int]]


@dataclass(frozen=True, slots=True)
class Pairing:
    """A lock paired with a store.

    Attributes:
        name: the name on the command line and in the summary.
        short: a short prefix for record names and tables.
        locker: a key of :data:`LOCKERS`.
        store: a key of :data:`STORES`.
        fenced: whether writes carry tokens; the unfenced baseline is expected to lose
            updates, a fenced pairing never.
        description: one line for people.
        readers: the share of cycles that are read cycles under a read lease (C13); the
            store must be a :class:`~fence._chaos.base.SharedStore`.
    """

    name: str
    short: str
    locker: str
    store: str
    fenced: bool
    description: str
    readers: float = 0.0

    @property
    def servers(self) -> tuple[str, ...]:
        """The servers this pairing needs, lock first."""
        names = [LOCKERS[self.locker].server, STORES[self.store].server]
        return tuple(dict.fromkeys(names))

    def records(self, count: int, round_: int = 0) -> list[str]:
        """The names of ``count`` records of this pairing; a soak's later rounds
        (``round_`` > 0) get records of their own."""
        if round_:
            return [f"{self.short}:r{round_}:{i}" for i in range(count)]
        return [f"{self.short}:{i}" for i in range(count)]


# -- Redis clients ------------------------------------------------------------------------


def _redis_client(url: str) -> Any:
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    # No retries inside redis-py: a write repeated after a lost reply is an unknown outcome
    # the worker must log as such, not a second attempt it never heard of.
    return redis.Redis.from_url(
        url,
        socket_timeout=SOCKET_TIMEOUT,
        socket_connect_timeout=SOCKET_TIMEOUT,
        retry=Retry(NoBackoff(), 0),
    )


def _redis_failed(what: str, err: Exception) -> BackendError:
    return BackendError(f"Redis failed the {what}: {err}", code="CONNECTION", retryable=True)


def _counter_key(record: str) -> str:
    # The hash tag is the record, so the guard's fence key shares the record's slot (C12).
    return f"chaos:{{{record}}}:counter"


# -- lockers ------------------------------------------------------------------------------


class _LeaseHeld:
    def __init__(self, lease: Lease) -> None:
        self._lease = lease

    @property
    def token(self) -> int | None:
        return self._lease.token

    def release(self) -> None:
        self._lease.release()


class _FenceLocker:
    """An iofence lock manager: leases with tokens, no renewal (a pause must cost the lease)."""

    def __init__(self, manager: BaseLockManager) -> None:
        self._manager = manager

    def acquire(self, record: str, timeout: float, mode: str = "write") -> Held | None:
        from fence._errors import AcquireTimeout

        try:
            lease = self._manager.acquire(record, mode=mode, timeout=timeout, renew=False)
        except AcquireTimeout:
            return None
        return _LeaseHeld(lease)

    def close(self) -> None:
        self._manager.close()


def _open_redis_manager(endpoints: Endpoints, ttl: float) -> Locker:
    from fence._sync.redis import RedisLockManager

    return _FenceLocker(RedisLockManager(endpoints.url("redis"), ttl=ttl))


def _sql_manager(endpoints: Endpoints, ttl: float, server: str = "postgres") -> BaseLockManager:
    from fence._sync.sql import SQLLockManager

    options = {"pool_pre_ping": True, "connect_args": {"connect_timeout": 2}}
    return SQLLockManager(endpoints.url(server), ttl=ttl, engine_options=options)


def _open_sql_manager(endpoints: Endpoints, ttl: float) -> Locker:
    return _FenceLocker(_sql_manager(endpoints, ttl))


def _open_mariadb_manager(endpoints: Endpoints, ttl: float) -> Locker:
    return _FenceLocker(_sql_manager(endpoints, ttl, "mariadb"))


def _setup_sql_manager(endpoints: Endpoints, server: str = "postgres") -> None:
    from fence._sync.sql import SQLLockManager

    manager = _sql_manager(endpoints, 1.0, server)
    try:
        assert isinstance(manager, SQLLockManager)
        manager.create_table()
    finally:
        manager.close()


def _setup_mariadb_manager(endpoints: Endpoints) -> None:
    _setup_sql_manager(endpoints, "mariadb")


def _nothing(endpoints: Endpoints) -> None:
    return None


class _RedisPyHeld:
    def __init__(self, lock: Any, record: str) -> None:
        self._lock = lock
        self._record = record

    @property
    def token(self) -> int | None:
        return None

    def release(self) -> None:
        from redis.exceptions import LockNotOwnedError, RedisError

        try:
            self._lock.release()
        except LockNotOwnedError as err:
            raise NotOwnerError(
                f"the redis-py lock on {self._record!r} had expired: {err}", resource=self._record
            ) from err
        except RedisError as err:
            raise _redis_failed("lock release", err) from err


class _RedisPyLocker:
    """redis-py's ``Lock``: a lease without a token, the usual unfenced setup."""

    def __init__(self, url: str, ttl: float) -> None:
        self._client = _redis_client(url)
        self._ttl = ttl

    def acquire(self, record: str, timeout: float, mode: str = "write") -> Held | None:
        from redis.exceptions import RedisError

        lock = self._client.lock(
            f"chaos-lock:{record}",
            timeout=self._ttl,
            sleep=0.01,
            blocking_timeout=timeout,
            thread_local=False,
        )
        try:
            got = lock.acquire()
        except RedisError as err:
            raise _redis_failed("lock acquire", err) from err
        return _RedisPyHeld(lock, record) if got else None

    def close(self) -> None:
        self._client.close()


def _open_redis_py_lock(endpoints: Endpoints, ttl: float) -> Locker:
    return _RedisPyLocker(endpoints.url("redis"), ttl)


def _open_etcd_manager(endpoints: Endpoints, ttl: float) -> Locker:
    from fence._sync.etcd import EtcdLockManager

    return _FenceLocker(EtcdLockManager(endpoints.url("etcd") + "/chaos/", ttl=ttl))


def _etcd_overhang(ttl: float) -> float:
    from fence._etcd import lease_seconds

    # The whole seconds etcd grants, the half second its leader takes to notice, and the
    # election timeout (1 s) by which a new leader extends every lease.
    return lease_seconds(ttl) - ttl + 1.5


def zookeeper_session(ttl: float) -> float:
    """The session timeout of the chaos run's ZooKeeper workers: short, so that a frozen
    worker's session (and its node) ends soon after its lease."""
    return max(1.0, ttl)


def _open_zookeeper_manager(endpoints: Endpoints, ttl: float) -> Locker:
    from fence._sync.zookeeper import ZooKeeperLockManager

    manager = ZooKeeperLockManager(
        endpoints.url("zookeeper") + "/chaos", ttl=ttl, session_timeout=zookeeper_session(ttl)
    )
    return _FenceLocker(manager)


def _zookeeper_overhang(ttl: float) -> float:
    # A frozen worker's node goes when its session expires (rounded up to the next tick);
    # a new leader gives every session its full timeout again.
    return 2 * zookeeper_session(ttl) - ttl + 0.5


# -- Redis stores -------------------------------------------------------------------------


class _RedisGuardStore:
    """Counters in Redis strings, behind ``fence.adapters.redis.RedisGuard``."""

    def __init__(self, url: str) -> None:
        self._client = _redis_client(url)
        self._guard = redis_guard(self._client)

    def read(self, record: str, token: int | None) -> int:
        value = self._guard.read_for_update(_counter_key(record), token=needs_token(token))
        return int(value or 0)

    def write(self, record: str, token: int | None, value: int) -> None:
        self._guard.set(_counter_key(record), value, token=needs_token(token), must_exist=True)

    def close(self) -> None:
        self._client.close()


class _RedisGuardSharedStore:
    """Counters in Redis strings behind the Redis guard, each stored with the token it was
    written under (``"<count>:<token>"``), for pairings with readers."""

    def __init__(self, url: str) -> None:
        self._client = _redis_client(url)
        self._guard = redis_guard(self._client)

    def read(self, record: str, token: int | None) -> int:
        raw = self._guard.read_for_update(_counter_key(record), token=needs_token(token))
        return _parse_counter(raw)[0]

    def write(self, record: str, token: int | None, value: int) -> None:
        token = needs_token(token)
        self._guard.set(_counter_key(record), f"{value}:{token}", token=token, must_exist=True)

    def checked_read(self, record: str) -> CheckedRead:
        raw, fence = self._guard.get(_counter_key(record))
        value, written = _parse_counter(raw)
        return CheckedRead(value, written, fence)

    def close(self) -> None:
        self._client.close()


def _parse_counter(raw: Any) -> tuple[int, int | None]:
    """A shared store's counter: ``"<count>:<token>"`` (or a bare count, initially)."""
    text = (raw.decode() if isinstance(raw, bytes) else str(raw or "0")).strip()
    count, _, token = text.partition(":")
    return int(count or 0), int(token) if token else None


def _final_redis_shared_counters(
    endpoints: Endpoints, namespace: str, records: Sequence[str]
) -> dict[str, int]:
    client = _redis_client(endpoints.url("redis"))
    try:
        values = client.mget([_counter_key(record) for record in records])
    finally:
        client.close()
    return {record: _parse_counter(value)[0] for record, value in zip(records, values, strict=True)}


class _RedisPlainStore:
    """Counters in Redis strings with plain ``GET``/``SET``: the unfenced baseline."""

    def __init__(self, url: str) -> None:
        self._client = _redis_client(url)

    def read(self, record: str, token: int | None) -> int:
        from redis.exceptions import RedisError

        try:
            return int(self._client.get(_counter_key(record)) or 0)
        except RedisError as err:
            raise _redis_failed("GET", err) from err

    def write(self, record: str, token: int | None, value: int) -> None:
        from redis.exceptions import RedisError

        try:
            self._client.set(_counter_key(record), value)
        except RedisError as err:
            raise _redis_failed("SET", err) from err

    def close(self) -> None:
        self._client.close()


def _setup_redis_counters(endpoints: Endpoints, namespace: str, records: Sequence[str]) -> None:
    client = _redis_client(endpoints.url("redis"))
    try:
        client.mset({_counter_key(record): 0 for record in records})
    finally:
        client.close()


def _final_redis_counters(
    endpoints: Endpoints, namespace: str, records: Sequence[str]
) -> dict[str, int]:
    client = _redis_client(endpoints.url("redis"))
    try:
        values = client.mget([_counter_key(record) for record in records])
    finally:
        client.close()
    return {record: int(value or 0) for record, value in zip(records, values, strict=True)}


# -- etcd and ZooKeeper stores -----------------------------------------------------------

#: How long one call of the consensus guards may take: a leader election takes about a
#: second, and a worker whose write timed out logs an unknown outcome and goes on.
_CONSENSUS_TIMEOUT = 2.0


def _etcd_key(record: str) -> str:
    return f"chaos-data/{record}"


def _zookeeper_path(record: str) -> str:
    return f"/chaos-data/{record}"


class _EtcdGuardStore:
    """Counters in etcd keys, behind ``fence.adapters.etcd.EtcdGuard``; the manager's prefix
    (``chaos/``) is the guard's, so the data keys live beside it."""

    def __init__(self, url: str) -> None:
        self._guard = etcd_guard(url + "/chaos/", request_timeout=_CONSENSUS_TIMEOUT)

    def read(self, record: str, token: int | None) -> int:
        value = self._guard.read_for_update(_etcd_key(record), token=needs_token(token))
        return int(value or 0)

    def write(self, record: str, token: int | None, value: int) -> None:
        self._guard.put(_etcd_key(record), str(value), token=needs_token(token), must_exist=True)

    def close(self) -> None:
        self._guard.close()


def _setup_etcd_counters(endpoints: Endpoints, namespace: str, records: Sequence[str]) -> None:
    guard = etcd_guard(endpoints.url("etcd") + "/chaos/")
    try:
        batch = guard.batch(1)  # below every token: a create revision of the run's cluster
        for record in records:
            batch.put(_etcd_key(record), "0")
        batch.execute()
    finally:
        guard.close()


def _final_etcd_counters(
    endpoints: Endpoints, namespace: str, records: Sequence[str]
) -> dict[str, int]:
    guard = etcd_guard(endpoints.url("etcd") + "/chaos/")
    try:
        return {record: int(guard.get(_etcd_key(record))[0] or 0) for record in records}
    finally:
        guard.close()


class _ZooKeeperGuardStore:
    """Counters in ZooKeeper nodes, behind ``fence.adapters.zookeeper.ZooKeeperGuard``."""

    def __init__(self, url: str) -> None:
        self._guard = zookeeper_guard(url + "/chaos", request_timeout=_CONSENSUS_TIMEOUT)

    def read(self, record: str, token: int | None) -> int:
        path = _zookeeper_path(record)
        value = self._guard.read_for_update(path, token=needs_token(token))
        return int(value or 0)

    def write(self, record: str, token: int | None, value: int) -> None:
        self._guard.set(_zookeeper_path(record), str(value), token=needs_token(token))

    def close(self) -> None:
        self._guard.close()


def _setup_zookeeper_counters(endpoints: Endpoints, namespace: str, records: Sequence[str]) -> None:
    guard = zookeeper_guard(endpoints.url("zookeeper") + "/chaos")
    try:
        batch = guard.batch(1)  # below every token: a zxid of the run's ensemble
        for record in records:
            batch.create(_zookeeper_path(record), "0")
        batch.execute()
    finally:
        guard.close()


def _final_zookeeper_counters(
    endpoints: Endpoints, namespace: str, records: Sequence[str]
) -> dict[str, int]:
    guard = zookeeper_guard(endpoints.url("zookeeper") + "/chaos")
    try:
        # Through the leader: the guard's server may lag behind the last writer's.
        guard.fence(_zookeeper_path(records[0]))
        guard.driver._client.sync("/chaos-data")
        return {record: int(guard.get(_zookeeper_path(record))[0] or 0) for record in records}
    finally:
        guard.close()


# -- the tables ---------------------------------------------------------------------------

#: Lock kinds, by name.
LOCKERS: dict[str, LockerKind] = {
    "redis-manager": LockerKind("fence.RedisLockManager", "redis", _open_redis_manager, _nothing),
    "sql-manager": LockerKind(
        "fence.SQLLockManager (PostgreSQL)", "postgres", _open_sql_manager, _setup_sql_manager
    ),
    "mariadb-manager": LockerKind(
        "fence.SQLLockManager (MariaDB)", "mariadb", _open_mariadb_manager, _setup_mariadb_manager
    ),
    "redis-py-lock": LockerKind("redis-py Lock (no token)", "redis", _open_redis_py_lock, _nothing),
    "etcd-manager": LockerKind(
        "fence.EtcdLockManager (3 members)", "etcd", _open_etcd_manager, _nothing, _etcd_overhang
    ),
    "zookeeper-manager": LockerKind(
        "fence.ZooKeeperLockManager (3 servers)",
        "zookeeper",
        _open_zookeeper_manager,
        _nothing,
        _zookeeper_overhang,
    ),
}

#: Store kinds, by name.
STORES: dict[str, StoreKind] = {
    "redis-guard": StoreKind(
        "fence.adapters.redis.RedisGuard (Redis)",
        "redis",
        lambda endpoints, namespace: _RedisGuardStore(endpoints.url("redis")),
        _setup_redis_counters,
        _final_redis_counters,
    ),
    "sql-guard": StoreKind(
        "fence.adapters.sql.RowGuard (PostgreSQL)",
        "postgres",
        sql.RowGuardStore,
        sql.setup_counters,
        sql.final_counters,
    ),
    "sql-guard-mariadb": StoreKind(
        "fence.adapters.sql.RowGuard (MariaDB)",
        "mariadb",
        functools.partial(sql.RowGuardStore, server="mariadb"),
        functools.partial(sql.setup_counters, server="mariadb"),
        functools.partial(sql.final_counters, server="mariadb"),
    ),
    "redis-guard-shared": StoreKind(
        "fence.adapters.redis.RedisGuard, values tagged with their writer's token",
        "redis",
        lambda endpoints, namespace: _RedisGuardSharedStore(endpoints.url("redis")),
        _setup_redis_counters,
        _final_redis_shared_counters,
    ),
    "redis-plain": StoreKind(
        "plain GET/SET (no token)",
        "redis",
        lambda endpoints, namespace: _RedisPlainStore(endpoints.url("redis")),
        _setup_redis_counters,
        _final_redis_counters,
    ),
    "orm-hook": StoreKind(
        "fence.adapters.orm session hook (PostgreSQL)",
        "postgres",
        orm.OrmStore,
        orm.setup,
        sql.final_counters,
    ),
    "orm-hook-mariadb": StoreKind(
        "fence.adapters.orm session hook (MariaDB)",
        "mariadb",
        functools.partial(orm.OrmStore, server="mariadb"),
        functools.partial(orm.setup, server="mariadb"),
        functools.partial(sql.final_counters, server="mariadb"),
    ),
    "etcd-guard": StoreKind(
        "fence.adapters.etcd.EtcdGuard (etcd, 3 members)",
        "etcd",
        lambda endpoints, namespace: _EtcdGuardStore(endpoints.url("etcd")),
        _setup_etcd_counters,
        _final_etcd_counters,
    ),
    "zookeeper-guard": StoreKind(
        "fence.adapters.zookeeper.ZooKeeperGuard (ZooKeeper, 3 servers)",
        "zookeeper",
        lambda endpoints, namespace: _ZooKeeperGuardStore(endpoints.url("zookeeper")),
        _setup_zookeeper_counters,
        _final_zookeeper_counters,
    ),
    "plain-sql": StoreKind(
        "plain SQL on the worker's own psycopg connection, judged by the database's triggers",
        "postgres",
        plain_sql.PlainSqlStore,
        plain_sql.setup,
        plain_sql.final,
    ),
    "django": StoreKind(
        "fence.adapters.django: a fenced model saved inside fenced(lease) (PostgreSQL)",
        "postgres",
        django_store.DjangoStore,
        django_store.setup,
        django_store.final,
    ),
    "django-mariadb": StoreKind(
        "fence.adapters.django: a fenced model saved inside fenced(lease) (MariaDB)",
        "mariadb",
        functools.partial(django_store.DjangoStore, server="mariadb"),
        functools.partial(django_store.setup, server="mariadb"),
        functools.partial(django_store.final, server="mariadb"),
    ),
    "django-unfenced": StoreKind(
        "fence.adapters.django: the same model saved inside unfenced(), the opt-out",
        "postgres",
        django_store.open_unfenced,
        django_store.setup,
        django_store.final,
    ),
}

_FENCED = [
    Pairing(
        "redis+redis",
        "rr",
        "redis-manager",
        "redis-guard",
        True,
        "Redis lock manager, Redis guard (registering read + fenced SET)",
    ),
    Pairing(
        "redis+sql",
        "rs",
        "redis-manager",
        "sql-guard",
        True,
        "Redis lock manager, SQL row guard on PostgreSQL",
    ),
    Pairing(
        "sql+sql",
        "ss",
        "sql-manager",
        "sql-guard",
        True,
        "SQL lock manager and SQL row guard, both on PostgreSQL",
    ),
    Pairing(
        "redis+redis-rw",
        "rw",
        "redis-manager",
        "redis-guard-shared",
        True,
        "Redis lock manager with readers and writers (C13): writers do registering reads "
        "and fenced SETs, readers checked reads under read leases",
        readers=0.5,
    ),
    Pairing(
        "sql+orm",
        "so",
        "sql-manager",
        "orm-hook",
        True,
        "SQL lock manager, SQLAlchemy ORM sessions bound to the token, on PostgreSQL",
    ),
    Pairing(
        "sql+plain-sql",
        "sp",
        "sql-manager",
        "plain-sql",
        True,
        "SQL lock manager; workers write plain SQL on their own connections, no guard: "
        "the database's triggers judge every write (C14)",
    ),
    # The MariaDB pairings (dropped below where MariaDB or PyMySQL is missing).
    Pairing(
        "mariadb+mariadb",
        "mm",
        "mariadb-manager",
        "sql-guard-mariadb",
        True,
        "SQL lock manager and SQL row guard, both on MariaDB",
    ),
    Pairing(
        "redis+mariadb",
        "rm",
        "redis-manager",
        "sql-guard-mariadb",
        True,
        "Redis lock manager, SQL row guard on MariaDB",
    ),
    Pairing(
        "mariadb+orm",
        "mo",
        "mariadb-manager",
        "orm-hook-mariadb",
        True,
        "SQL lock manager, SQLAlchemy ORM sessions bound to the token, on MariaDB",
    ),
    # The Django pairings (dropped below where Django is not installed).
    Pairing(
        "redis+django",
        "dj",
        "redis-manager",
        "django",
        True,
        "Redis lock manager; Django worker processes read and save a fenced model inside "
        "fenced(lease), judged by the model's triggers (C14)",
    ),
    Pairing(
        "sql+django",
        "sj",
        "sql-manager",
        "django",
        True,
        "SQL lock manager; Django worker processes read and save a fenced model inside "
        "fenced(lease), both on PostgreSQL",
    ),
    Pairing(
        "mariadb+django",
        "mj",
        "mariadb-manager",
        "django-mariadb",
        True,
        "SQL lock manager; Django worker processes read and save a fenced model inside "
        "fenced(lease), both on MariaDB (PyMySQL as MySQLdb)",
    ),
]

#: Pairings that this machine cannot run: name -> what is missing.
PLANNED: dict[str, str] = {}


def _missing_for(server: str) -> str | None:
    """What this machine lacks to run ``server`` and its client, or ``None``."""
    import shutil

    if server == "etcd":
        if importlib.util.find_spec("httpx") is None:
            return "httpx is not installed (pip install iofence[etcd])"
        if shutil.which("etcd") is None:
            return "etcd is not installed (apt-get install etcd-server)"
    if server == "mariadb":
        if importlib.util.find_spec("pymysql") is None:
            return "PyMySQL is not installed (pip install iofence[mysql])"
        for program in ("mariadbd", "mariadb-install-db"):
            if shutil.which(program) is None and shutil.which(program, path="/usr/sbin") is None:
                return f"{program} is not installed (apt-get install mariadb-server)"
    if server == "zookeeper":
        if importlib.util.find_spec("kazoo") is None:
            return "kazoo is not installed (pip install iofence[zookeeper])"
        from fence._chaos.clusters import zookeeper_jar

        if shutil.which("java") is None:
            return "java is not installed (apt-get install default-jre-headless)"
        try:
            zookeeper_jar()
        except RuntimeError as exc:
            return str(exc)
    return None


#: The consensus guards' pairings with their own manager, in the summary.
_SAME = {
    "etcd": "etcd guard on the same cluster",
    "zookeeper": "ZooKeeper guard on the same ensemble",
}

for _server, _short in (("etcd", "e"), ("zookeeper", "z")):
    _missing = _missing_for(_server)
    for _store, _label, _target in (
        ("redis-guard", "Redis guard", "redis"),
        ("sql-guard", "SQL row guard", "sql"),
        (f"{_server}-guard", _SAME[_server], _server),
    ):
        _name = f"{_server}+{_target}"
        if _missing is not None:
            PLANNED[_name] = f"{_missing}; the pairing runs once it is"
            continue
        _FENCED.append(
            Pairing(
                _name,
                _short + _target[0],
                f"{_server}-manager",
                _store,
                True,
                f"{LOCKERS[_server + '-manager'].name}, {_label}",
            )
        )


_BASELINES = [
    Pairing(
        "baseline",
        "base",
        "redis-py-lock",
        "redis-plain",
        False,
        "unfenced: redis-py Lock with plain GET/SET",
    ),
    Pairing(
        "redis+django-unfenced",
        "du",
        "redis-manager",
        "django-unfenced",
        False,
        "the opt-out: the Django pairing's workers save inside unfenced(), so the judge "
        "lets a stale holder's save through",
    ),
]

if importlib.util.find_spec("django") is None:
    for _pairing in [*_FENCED, *_BASELINES]:
        if _pairing.store.startswith("django"):
            PLANNED[_pairing.name] = (
                "Django is not installed (pip install iofence[django]); the pairing runs once it is"
            )
    _FENCED = [p for p in _FENCED if p.name not in PLANNED]
    _BASELINES = [p for p in _BASELINES if p.name not in PLANNED]

_missing = _missing_for("mariadb")
if _missing is not None:
    for _pairing in _FENCED:
        if "mariadb" in _pairing.servers:
            PLANNED[_pairing.name] = f"{_missing}; the pairing runs once it is"
    _FENCED = [p for p in _FENCED if p.name not in PLANNED]

#: Every pairing, by name; the fenced ones first, the unfenced baselines last.
PAIRINGS: dict[str, Pairing] = {pairing.name: pairing for pairing in (*_FENCED, *_BASELINES)}


def open_locker(pairing: Pairing, endpoints: Endpoints, ttl: float) -> Locker:
    """Build the locker of ``pairing``."""
    return LOCKERS[pairing.locker].open(endpoints, ttl)


def open_store(pairing: Pairing, endpoints: Endpoints) -> Store:
    """Build the store of ``pairing``."""
    return STORES[pairing.store].open(endpoints, pairing.short)


def setup(pairing: Pairing, endpoints: Endpoints, records: Sequence[str]) -> None:
    """Prepare the servers for a run of ``pairing``: tables, counters at 0."""
    LOCKERS[pairing.locker].setup(endpoints)
    STORES[pairing.store].setup(endpoints, pairing.short, records)


def final_values(pairing: Pairing, endpoints: Endpoints, records: Sequence[str]) -> dict[str, int]:
    """Read every counter of ``pairing`` after the run."""
    return STORES[pairing.store].final(endpoints, pairing.short, records)
