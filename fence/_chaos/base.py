"""What the harness, the lockers and the stores of ``fence chaos`` share: where the servers
of a run listen (:class:`Endpoints`) and what a locker and a store offer (the protocols
below).

A pairing (:mod:`fence._chaos.pairings`) names a locker kind and a store kind. The stores
that live in modules of their own (:mod:`fence._chaos.sql`, :mod:`fence._chaos.orm`) build
on this module, never on the pairings, which import them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from fence._errors import ConfigurationError

__all__ = [
    "SOCKET_TIMEOUT",
    "CheckedRead",
    "Endpoints",
    "Held",
    "Locker",
    "SharedStore",
    "Store",
    "needs_token",
]

#: Client-side timeouts of the harness's own connections, in seconds: a request to a
#: killed server fails fast instead of hanging a worker past its pause schedule.
SOCKET_TIMEOUT = 1.0


@dataclass(frozen=True, slots=True)
class Endpoints:
    """Where the servers of a run listen.

    Attributes:
        redis: a ``redis://`` URL, if the run has a Redis server.
        postgres: a SQLAlchemy ``postgresql+psycopg://`` URL, if it has PostgreSQL.
        mariadb: a SQLAlchemy ``mariadb+pymysql://`` URL, if it has MariaDB.
        etcd: an ``etcd://`` URL of the run's 3-member cluster, if it has one.
        zookeeper: a ``zookeeper://`` URL of the run's 3-server ensemble, if it has one.
    """

    redis: str | None = None
    postgres: str | None = None
    mariadb: str | None = None
    etcd: str | None = None
    zookeeper: str | None = None

    def url(self, server: str) -> str:
        """The URL of ``server`` (``"redis"``, ``"postgres"``, ``"mariadb"``, ``"etcd"``,
        ``"zookeeper"``).

        Raises:
            ConfigurationError: the run has no such server.
        """
        found = getattr(self, server, None) if server in _SERVERS else None
        if found is None:
            raise ConfigurationError(f"this chaos run has no {server} server")
        return str(found)


_SERVERS = ("redis", "postgres", "mariadb", "etcd", "zookeeper")


class Held(Protocol):
    """A lease (or a plain lock) a worker holds on one record."""

    @property
    def token(self) -> int | None:
        """The fencing token; ``None`` for an unfenced lock."""
        ...

    def release(self) -> None:
        """Release it.

        Raises:
            NotOwnerError: the lease ended before (it expired while the holder was stopped).
            BackendError: the server failed; the lease will expire by itself.
        """
        ...


class Locker(Protocol):
    """Hands out :class:`Held` locks on records."""

    def acquire(self, record: str, timeout: float, mode: str = "write") -> Held | None:
        """Wait up to ``timeout`` seconds for the lock on ``record`` (a read lease with
        ``mode="read"``); ``None`` if it stayed taken.

        Raises:
            BackendError: the server failed.
        """
        ...

    def close(self) -> None:
        """Close the connections."""
        ...


class Store(Protocol):
    """One integer counter per record, read and written under a lock."""

    def read(self, record: str, token: int | None) -> int:
        """Read the counter; with a token, as a registering read that raises the fence.

        Raises:
            StaleTokenError: a newer token claimed the record; nothing was read.
            BackendError: the server failed.
        """
        ...

    def write(self, record: str, token: int | None, value: int) -> None:
        """Write the counter; with a token, fenced.

        Raises:
            StaleTokenError: a newer token claimed the record; nothing was written.
            BackendError: the server failed; the write may or may not have happened.
        """
        ...

    def close(self) -> None:
        """Close the connections."""
        ...


@dataclass(frozen=True, slots=True)
class CheckedRead:
    """What a reader saw, in one atomic step.

    Attributes:
        value: the counter.
        written: the token it was written under (``None``: the initial value).
        fence: the fence read with it.
    """

    value: int
    written: int | None
    fence: int | None


class SharedStore(Store, Protocol):
    """A store whose values carry the token they were written under (pairings with
    readers)."""

    def checked_read(self, record: str) -> CheckedRead:
        """The counter, its writer's token and the fence, in one atomic step; raises the
        fence of nothing.

        Raises:
            BackendError: the server failed.
        """
        ...


def needs_token(token: int | None) -> int:
    """``token``, which a fenced store cannot do without.

    Raises:
        ConfigurationError: ``token`` is ``None`` (an unfenced locker with a fenced store).
    """
    if token is None:
        raise ConfigurationError("a fenced store needs a token")
    return token
