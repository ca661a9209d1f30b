"""The ZooKeeper lock manager's protocol, without I/O: node layout, data, order, hosts, and
the driver's bookkeeping of its nodes and watches.

Layout of resource ``R`` under the root ``/fence`` (the root is configurable)::

    /fence/<R, percent-encoded>                   persistent; its data version counts joins
    /fence/<R>/<guid>-lock-0000000042             ephemeral sequential: a writer
    /fence/<R>/<guid>-read-0000000043             ephemeral sequential: a reader (C13)

Every join is one multi-operation: create the contender's node *and* set the resource
node's data (a version bump). So the resource node's data version changes with every join,
and a join that names the version it read (``set(R, version=v)``) succeeds only if nobody
joined since: that is how a first attempt on a free lock knows, in the same round trip,
that its node is the only one. All operations of a multi share one zxid, so the stat the
``set`` returns carries the new node's ``czxid``: the fencing token.

The node that comes first (smallest sequence number; ZooKeeper assigns sequence numbers
and zxids in the same order) holds the lock, with every reader's node before the first
writer's (kazoo's read/write recipe, with tokens); see :mod:`fence._queue`.

The ``guid`` is new for every join (random; it says nothing of the owner's secret). A join
whose reply is lost with the connection may have made its node; the contender then looks
for the node with its guid before it joins again (kazoo's lock recipe does the same), so
it never leaves behind a node that nobody tracks. A fresh guid per join keeps two joins of
one acquire apart: a node that a join gave up on is deleted, by name or by guid, without
any risk of deleting the node a later join of the same acquire holds the lock with.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote, urlsplit

from fence._core import MAX_TOKEN
from fence._errors import ConfigurationError, InvalidTokenError
from fence._queue import Place

__all__ = [
    "DEFAULT_ROOT",
    "MARK",
    "READ_MARK",
    "Hold",
    "Node",
    "SessionTimeoutProbe",
    "Watcher",
    "Watches",
    "decode_data",
    "encode_data",
    "is_writer_node",
    "new_guid",
    "own_node",
    "parse_hosts",
    "queue_order",
    "resource_of_node",
    "resource_path",
    "token_of",
    "validate_root",
]

DEFAULT_ROOT = "/fence"

#: Between the contender's guid and the sequence number in a writer's node's name.
MARK = "-lock-"
#: The same in a reader's node's name (C13).
READ_MARK = "-read-"

_SEQUENCE_DIGITS = 10


def validate_root(root: object) -> str:
    """The root path, if it is absolute, without a trailing ``/``, and not ``/`` itself."""
    if not isinstance(root, str) or not root.startswith("/") or root == "/":
        raise ConfigurationError(f"root must be an absolute ZooKeeper path, got {root!r}")
    if root.endswith("/") or "//" in root or "\x00" in root:
        raise ConfigurationError(f"root must be a plain path like /fence, got {root!r}")
    return root


def resource_path(root: str, resource: str) -> str:
    """The node of ``resource``: one path segment, percent-encoded (``.`` too, so that
    no resource names ``.`` or ``..``)."""
    return f"{root}/{quote(resource, safe='').replace('.', '%2E')}"


def resource_of_node(name: str) -> str:
    """The resource whose node is the root's child ``name`` (see :func:`resource_path`)."""
    return unquote(name)


def new_guid() -> str:
    """A join's node-name prefix: 16 random hex digits."""
    return secrets.token_hex(8)


def _sequence(name: str) -> int | None:
    for marker in (MARK, READ_MARK):
        head, mark, digits = name.rpartition(marker)
        if mark and head and len(digits) == _SEQUENCE_DIGITS and digits.isdigit():
            return int(digits)
    return None


def is_writer_node(name: str) -> bool:
    """Whether the lock node ``name`` is a writer's (else a reader's)."""
    return name.rpartition(READ_MARK)[1] == ""


def own_node(children: Iterable[str], guid: str, mark: str) -> str | None:
    """The lock node among ``children`` that the join named ``guid`` made with ``mark``
    (a writer's or a reader's), or ``None``."""
    prefix = guid + mark
    for name in children:
        if name.startswith(prefix) and _sequence(name) is not None:
            return name
    return None


def queue_order(children: Iterable[str]) -> list[str]:
    """The lock nodes among ``children``, first come first (by sequence number)."""
    nodes = [(seq, name) for name in children if (seq := _sequence(name)) is not None]
    return [name for _, name in sorted(nodes)]


def token_of(zxid: int) -> int:
    """A node's ``czxid`` as a fencing token (C1).

    A zxid is ``epoch << 32 | counter``: below ``2**53`` until the ensemble has elected
    about two million leaders. Past that it is refused, never rounded.

    Raises:
        InvalidTokenError: the zxid is not in ``1 .. 2**53 - 1``.
    """
    if not 1 <= zxid <= MAX_TOKEN:
        raise InvalidTokenError(
            f"ZooKeeper zxid {zxid:#x} is not a usable token (1 .. 2**53 - 1)", value=zxid
        )
    return zxid


def encode_data(holder: str, ttl: float) -> bytes:
    """A node's data: the holder's label and its lease time (never its secret)."""
    return json.dumps({"holder": holder, "ttl": ttl}, separators=(",", ":")).encode()


def decode_data(data: bytes) -> tuple[str | None, float | None]:
    """The holder's label and lease time from a node's data (``None`` where unreadable)."""
    try:
        value = json.loads(data.decode())
    except (UnicodeDecodeError, ValueError):
        return None, None
    if not isinstance(value, dict):
        return None, None
    holder = value.get("holder")
    ttl = value.get("ttl")
    return (
        holder if isinstance(holder, str) else None,
        float(ttl) if isinstance(ttl, int | float) and not isinstance(ttl, bool) else None,
    )


def parse_hosts(spec: str | Sequence[str]) -> tuple[str, str | None]:
    """The kazoo hosts string and the root from a ``zookeeper://`` URL or a host list.

    ``zookeeper://h1:2181,h2:2181,h3:2181/app/locks`` gives ``("h1:2181,h2:2181,h3:2181",
    "/app/locks")``; without a path the root is ``None`` (the default applies). A plain
    ``"h1:2181,h2:2181"`` string or a list of ``host:port`` items works too.

    Raises:
        ConfigurationError: no host, or another scheme.
    """
    root: str | None = None
    if isinstance(spec, str):
        if "://" in spec:
            parts = urlsplit(spec)
            if parts.scheme.lower() not in ("zookeeper", "zk"):
                raise ConfigurationError(
                    f"not a ZooKeeper URL: {spec!r} (use zookeeper://host:2181,...)"
                )
            hosts = [h.strip() for h in parts.netloc.split(",") if h.strip()]
            if parts.path not in ("", "/"):
                root = validate_root(parts.path.rstrip("/"))
        else:
            hosts = [h.strip() for h in spec.split(",") if h.strip()]
    else:
        hosts = []
        for item in spec:
            if not isinstance(item, str) or not item.strip():
                raise ConfigurationError(f"not a ZooKeeper host: {item!r}")
            hosts.append(item.strip())
    if not hosts or any("/" in host for host in hosts):
        raise ConfigurationError(f"no ZooKeeper hosts in {spec!r}")
    return ",".join(hosts), root


class SessionTimeoutProbe(logging.Filter):
    """Learns the session timeout the server granted from kazoo's own log line.

    ZooKeeper may grant a shorter session than asked (``maxSessionTimeout``), and kazoo
    keeps the granted value to itself: it only logs it. The lock manager must know it,
    because a holder's node vanishes when its session expires. This filter sits on the
    private logger the driver gives kazoo; it records the value and drops kazoo's chatter
    below WARNING.

    Attributes:
        granted: the last granted session timeout in seconds, ``None`` before a session.
    """

    def __init__(self) -> None:
        super().__init__()
        self.granted: float | None = None

    def filter(self, record: logging.LogRecord) -> bool:
        """Record a negotiated timeout; let warnings and errors through."""
        if "negotiated session timeout" in str(record.msg):
            args = record.args
            if isinstance(args, tuple) and len(args) >= 3 and isinstance(args[2], int | float):
                self.granted = float(args[2]) / 1000.0
        return record.levelno >= logging.WARNING


# -- a driver's bookkeeping --------------------------------------------------------------


@dataclass(eq=False)
class Node:
    """One of this session's lock nodes, between the calls of its contender.

    Attributes:
        resource: the resource.
        parent: the resource's node.
        name: the node's name (``<guid>-lock-<sequence>``).
        czxid: the zxid that created it (the token, once it owns the lock); 0 while
            unknown (the node was found after its join's reply was lost: the write that
            grants the lock reads it).
        version: its data version as of this session's last write to it.
        ttl: the lease time asked for, in seconds.
        holder: the holder's label.
        place: where it stood at the last read (``None``: read again before waiting).
        owner: known to own the lock (the predecessor it watched was the owner, and left).
        granted: it holds the lock (acquire returned its token).
        reading: a reader (C13): only writers' nodes ahead keep it out.
    """

    resource: str
    parent: str
    name: str
    czxid: int
    version: int
    ttl: float
    holder: str
    place: Place[str] | None = None
    owner: bool = False
    granted: bool = False
    reading: bool = False

    @property
    def path(self) -> str:
        """The node's path."""
        return f"{self.parent}/{self.name}"


@dataclass
class Hold:
    """How long the reaper of a driver keeps one of its session's nodes.

    Attributes:
        until: the monotonic time after which the node is deleted.
        version: the data version to delete it at (-1: any; -2: read it first).
        busy: a write to the node is under way: not before it ends.
        generation: counts the changes of the hold, so that a deletion decided on an
            older one is dropped.
        settle: not before this monotonic time (a write this session did not see land).
    """

    until: float
    version: int
    busy: bool = False
    generation: int = 0
    settle: float = 0.0


class Watches:
    """Local waiters per predecessor path, woken by one kazoo watch callback."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiters: dict[str, list[Watcher]] = {}

    def add(self, path: str, watcher: Watcher) -> None:
        """Wake ``watcher`` on the next event of ``path``."""
        with self._lock:
            self._waiters.setdefault(path, []).append(watcher)

    def remove(self, path: str, watcher: Watcher) -> None:
        """Stop waking ``watcher`` for ``path``."""
        with self._lock:
            found = self._waiters.get(path, [])
            if watcher in found:
                found.remove(watcher)
            if not found:
                self._waiters.pop(path, None)

    def fire(self, event: Any) -> None:
        """A kazoo watch event (on kazoo's thread): wake the waiters of its path."""
        with self._lock:
            if event.path is None:  # a connection event: every watch is gone
                woken = [w for ws in self._waiters.values() for w in ws]
            else:
                woken = list(self._waiters.get(event.path, ()))
        for watcher in woken:
            watcher.deleted = watcher.deleted or event.type == "DELETED"
            watcher.waiter.wake()

    def wake_all(self) -> None:
        """The connection dropped: let every waiter look again."""
        with self._lock:
            woken = [w for ws in self._waiters.values() for w in ws]
        for watcher in woken:
            watcher.waiter.wake()


@dataclass(eq=False)
class Watcher:
    """A waiter for the deletion of its predecessor's node.

    Attributes:
        waiter: what :meth:`Watches.fire` wakes (a ``Waiter``).
        deleted: the watched node was deleted.
    """

    waiter: Any
    deleted: bool = False
