"""The etcd lock manager's protocol, without I/O: key layout, request bodies, replies.

The manager (:mod:`fence._async.etcd`) speaks etcd's v3 API through the JSON gateway that
every etcd server serves on its client port (``POST /v3/kv/txn``, ``/v3/lease/grant``,
``/v3/watch``...). Keys and values travel base64-encoded, 64-bit numbers as decimal strings.

Layout of resource ``R`` under prefix ``P`` (default ``fence/``)::

    P R \\0 <lease id, 16 hex digits>     a writer's key, value = holder label,
                                          attached to the contender's own lease
    P R \\0 r <lease id, 16 hex digits>   a reader's key (C13), the same otherwise

``R`` cannot contain NUL, so the range ``[P R \\0, P R \\1)`` holds exactly the keys of
``R`` (``order:4`` and ``order:42`` never share a range), and ``[P R \\0 0, P R \\0 g)``
exactly its writers' keys (hex digits sort below ``g``, ``r`` above). The key that was
created first (smallest create revision) holds the lock, with the readers' keys created
before the first writer's; a key's create revision is its fencing token: see
:mod:`fence._queue` for why the tokens only grow.

Each contender's lease id is derived from its owner secret (a keyed hash, 63 bits), so
release and renewal need no state beyond the secret, and a forged secret names a lease
that does not exist. The secret itself is never stored in etcd.
"""

from __future__ import annotations

import base64
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from fence._core import MAX_TOKEN
from fence._errors import ConfigurationError, InvalidTokenError
from fence._queue import Place

__all__ = [
    "DEFAULT_PREFIX",
    "HEADERS",
    "NOT_APPLIED",
    "EtcdReplyError",
    "KeyValue",
    "Queued",
    "acquire_txn",
    "b64",
    "entry_key",
    "is_writer_key",
    "lease_id",
    "lease_seconds",
    "list_range",
    "listed_resource",
    "owner_range",
    "parse_endpoints",
    "predecessor_range",
    "prefix_end",
    "queue_prefix",
    "range_kvs",
    "revision",
    "token_of",
    "validate_prefix",
    "watch_body",
    "writer_range",
]

DEFAULT_PREFIX = "fence/"

#: Sent with every request. ``hasleader`` makes a member that lost its leader refuse at
#: once ("etcdserver: no leader") instead of letting the request hang until it times out,
#: and cancels a watch on such a member, so the client moves to another one.
HEADERS = {"Grpc-Metadata-hasleader": "true"}

#: Error messages that etcd returns before it proposes anything: the request did not
#: happen, and repeating it elsewhere is safe even for a write that is not idempotent.
NOT_APPLIED = (
    "etcdserver: no leader",
    "etcdserver: not capable",
    "etcdserver: too many requests",
    "etcdserver: server stopped",
)


def validate_prefix(prefix: object) -> str:
    """The key prefix, if it is a non-empty ``str`` without NUL bytes."""
    if not isinstance(prefix, str) or not prefix or "\x00" in prefix:
        raise ConfigurationError(f"prefix must be a non-empty str without NUL, got {prefix!r}")
    return prefix


def lease_seconds(ttl: float) -> int:
    """The etcd lease TTL, in whole seconds, for a lease of ``ttl`` seconds.

    etcd counts lease time in whole seconds and reports what is left rounded *down*
    (``LeaseTimeToLive``). One second on top of ``ceil(ttl)`` makes the lease etcd keeps,
    as etcd itself reports it, outlast the client's deadline (C10), which ends before
    ``ttl``. etcd also raises any TTL below its minimum (1.5 election timeouts) to it.
    """
    return math.ceil(ttl) + 1


def lease_id(secret: str, resource: str) -> int:
    """The lease id of the contender with ``secret`` on ``resource``: 63 bits, never 0."""
    digest = hashlib.blake2b(secret.encode(), digest_size=8, person=b"iofence-lease")
    digest.update(resource.encode())
    value = int.from_bytes(digest.digest(), "big") & (2**63 - 1)
    return value or 1


def queue_prefix(prefix: str, resource: str) -> bytes:
    """The first key of ``resource``'s range: ``prefix + resource + NUL``."""
    return prefix.encode() + resource.encode() + b"\x00"


def range_end(start: bytes) -> bytes:
    """The end (exclusive) of the range of keys that begin with ``start`` (ends in NUL)."""
    return start[:-1] + b"\x01"


#: The byte after the queue prefix that marks a reader's key.
READER = b"r"


def entry_key(start: bytes, lease: int, *, reading: bool = False) -> bytes:
    """The queue key of the contender whose lease is ``lease`` (a reader's with
    ``reading``)."""
    return start + (READER if reading else b"") + b"%016x" % lease


def is_writer_key(start: bytes, key: bytes) -> bool:
    """Whether ``key`` of the queue starting at ``start`` is a writer's."""
    return key[len(start) : len(start) + 1] != READER


def prefix_end(start: bytes) -> bytes:
    """The end (exclusive) of the range of every key that begins with ``start``."""
    trimmed = start.rstrip(b"\xff")
    if not trimmed:
        return b"\x00"  # etcd: to the end of the keyspace
    return trimmed[:-1] + bytes([trimmed[-1] + 1])


def list_range(prefix: str, start: str, after: bytes | None, count: int) -> dict[str, Any]:
    """A range request (keys only, by key) for a page of the queue keys of the resources
    that start with ``start``, from the key ``after`` on (the first page: ``None``)."""
    first = prefix.encode() + start.encode()
    return {
        "key": b64(after or first),
        "range_end": b64(prefix_end(first)),
        "limit": count,
        "keys_only": True,
    }


def listed_resource(prefix: str, key: bytes) -> str | None:
    """The resource whose queue key ``key`` is, or ``None`` for a key of no queue."""
    head = prefix.encode()
    end = key.find(b"\x00", len(head))
    if not key.startswith(head) or end <= len(head):
        return None
    return key[len(head) : end].decode("utf-8", "replace")


def b64(data: bytes) -> str:
    """Base64, as the JSON gateway wants bytes fields."""
    return base64.b64encode(data).decode("ascii")


def _unb64(text: object) -> bytes:
    return base64.b64decode(str(text)) if text else b""


@dataclass(frozen=True, slots=True)
class KeyValue:
    """One key as etcd returned it.

    Attributes:
        key: the key.
        create_revision: the store revision at which the key was created.
        lease: the id of the lease the key is attached to (0: none).
        value: the value (the holder's label).
    """

    key: bytes
    create_revision: int
    lease: int
    value: bytes


def _kv(data: Mapping[str, Any]) -> KeyValue:
    return KeyValue(
        key=_unb64(data.get("key")),
        create_revision=int(data.get("create_revision", 0)),
        lease=int(data.get("lease", 0)),
        value=_unb64(data.get("value")),
    )


def range_kvs(reply: Mapping[str, Any]) -> tuple[list[KeyValue], int]:
    """The keys of a range reply and its ``count`` (keys matched, before ``limit``)."""
    kvs = [_kv(item) for item in reply.get("kvs", ())]
    return kvs, int(reply.get("count", len(kvs)))


def revision(reply: Mapping[str, Any]) -> int:
    """The store revision in the reply's header."""
    return int(reply.get("header", {}).get("revision", 0))


@dataclass(eq=False)
class Queued:
    """A contender in the queue of a resource, between its acquire attempts.

    Attributes:
        resource: the resource.
        key: its queue key.
        lease: its lease id.
        ttl: the lease time it asked for, in seconds.
        holder: its label.
        created: the key's create revision (its token, once it owns the lock).
        place: where it stood at the last read (``None``: read again before waiting).
        seen: the store revision of that read; the watch replays every event after it.
        owner: known to own the lock (the predecessor it watched was the owner, and left).
        reading: a reader (C13): only writers' keys ahead keep it out.
    """

    resource: str
    key: bytes
    lease: int
    ttl: float
    holder: str
    created: int
    place: Place[bytes] | None
    seen: int
    owner: bool = False
    reading: bool = False


def token_of(create_revision: int) -> int:
    """A create revision as a fencing token (C1).

    Raises:
        InvalidTokenError: the revision is beyond ``2**53 - 1`` (a store that old has had
            more writes than any cluster makes in centuries; refused rather than rounded).
    """
    if not 1 <= create_revision <= MAX_TOKEN:
        raise InvalidTokenError(
            f"etcd revision {create_revision} is not a usable token (1 .. 2**53 - 1)",
            value=create_revision,
        )
    return create_revision


def _range(start: bytes, *, descend: bool, limit: int, max_create: int = 0) -> dict[str, Any]:
    body: dict[str, Any] = {
        "key": b64(start),
        "range_end": b64(range_end(start)),
        "sort_target": "CREATE",
        "sort_order": "DESCEND" if descend else "ASCEND",
        "limit": limit,
    }
    if max_create:
        body["max_create_revision"] = max_create
    return body


def owner_range(start: bytes) -> dict[str, Any]:
    """A range request for the owner: the key of the range created first."""
    return _range(start, descend=False, limit=1)


def writer_range(
    start: bytes, *, descend: bool = True, limit: int = 1, max_create: int = 0
) -> dict[str, Any]:
    """A range request over the writers' keys of the queue (``[start 0, start g)``), by
    create revision; with ``max_create``, only those created up to it. Its ``count`` is
    how many there are."""
    body = _range(start, descend=descend, limit=limit, max_create=max_create)
    body["key"] = b64(start + b"0")
    body["range_end"] = b64(start + b"g")
    return body


def predecessor_range(start: bytes, create_revision: int) -> dict[str, Any]:
    """A range request for the key created last before ``create_revision``; its
    ``count`` is how many keys come before."""
    return _range(start, descend=True, limit=1, max_create=create_revision - 1)


def acquire_txn(
    start: bytes, key: bytes, lease: int, holder: str, *, reading: bool = False
) -> dict[str, Any]:
    """One transaction: join the queue of ``start`` and read where the key stands.

    If ``key`` does not exist yet, put it (attached to ``lease``) and read, for a writer,
    the two keys created last: this key (just created, so the newest) and its predecessor,
    with the count of the whole range; for a reader (``reading``), the writer created last
    (all writers' keys are older than this one), with the count of the writers. If the key
    exists (an earlier attempt), read it and the owner (a writer) or the first writer (a
    reader).
    """
    compare = [{"target": "CREATE", "key": b64(key), "result": "EQUAL", "create_revision": 0}]
    put = {"key": b64(key), "value": b64(holder.encode()), "lease": lease}
    if reading:
        ahead = writer_range(start, descend=True, limit=1)
        first = writer_range(start, descend=False, limit=1)
    else:
        ahead = _range(start, descend=True, limit=2)
        first = owner_range(start)
    return {
        "compare": compare,
        "success": [{"request_put": put}, {"request_range": ahead}],
        "failure": [{"request_range": {"key": b64(key)}}, {"request_range": first}],
    }


def watch_body(key: bytes, start_revision: int) -> dict[str, Any]:
    """A watch of ``key``'s deletion, from ``start_revision`` on (events are replayed)."""
    return {
        "create_request": {
            "key": b64(key),
            "start_revision": start_revision,
            "filters": ["NOPUT"],
        }
    }


class EtcdReplyError(Exception):
    """An error reply of the JSON gateway (a gRPC status), before it is mapped.

    Attributes:
        status: the HTTP status.
        code: the gRPC status code (5 not found, 9 failed precondition, 14 unavailable...).
        message: etcd's message, e.g. ``"etcdserver: requested lease not found"``.
    """

    def __init__(self, status: int, code: int, message: str) -> None:
        super().__init__(f"{message} (HTTP {status}, gRPC code {code})")
        self.status = status
        self.code = code
        self.message = message

    @property
    def lease_not_found(self) -> bool:
        """The lease named does not exist (expired, revoked, never granted)."""
        return "lease not found" in self.message

    @property
    def lease_exists(self) -> bool:
        """A grant named a lease id that exists already."""
        return "lease already exists" in self.message

    @property
    def unavailable(self) -> bool:
        """The cluster could not serve the request now (no leader, a timeout, overload)."""
        return self.code in (8, 14) or self.status in (429, 503)

    @property
    def not_applied(self) -> bool:
        """etcd refused before proposing: the request certainly did not happen."""
        return any(self.message.startswith(text) for text in NOT_APPLIED)


def reply_error(status: int, data: object) -> EtcdReplyError:
    """The :class:`EtcdReplyError` of a non-200 reply body."""
    code, message = 2, f"HTTP {status}"
    if isinstance(data, Mapping):
        inner = data.get("error", data)
        if isinstance(inner, Mapping):
            code = int(inner.get("code", inner.get("grpc_code", code)))
            message = str(inner.get("message", inner.get("error", message)))
        elif isinstance(inner, str):
            message = inner
            code = int(data.get("code", code))
    return EtcdReplyError(status, code, message)


def parse_endpoints(spec: str | Sequence[str]) -> tuple[list[str], str | None]:
    """Endpoints and key prefix from an ``etcd://`` URL, or a list of endpoints.

    ``etcd://h1:2379,h2:2379,h3:2379`` (``etcds://`` for TLS) gives
    ``["http://h1:2379", ...]``; a path (``etcd://h1:2379/app/locks/``) is the key prefix.
    A list holds ``host:port`` or ``http(s)://host:port`` items.

    Raises:
        ConfigurationError: no endpoint, or an unknown scheme.
    """
    prefix: str | None = None
    if isinstance(spec, str):
        parts = urlsplit(spec)
        scheme = parts.scheme.lower()
        if scheme not in ("etcd", "etcds", "http", "https"):
            raise ConfigurationError(f"not an etcd URL: {spec!r} (use etcd://host:2379,...)")
        web = "https" if scheme in ("etcds", "https") else "http"
        hosts = [host.strip() for host in parts.netloc.split(",") if host.strip()]
        found = [f"{web}://{host}" for host in hosts]
        path = parts.path.lstrip("/")
        if path:
            prefix = path if path.endswith("/") else path + "/"
    else:
        found = []
        for item in spec:
            if not isinstance(item, str) or not item.strip():
                raise ConfigurationError(f"not an etcd endpoint: {item!r}")
            item = item.strip().rstrip("/")
            found.append(item if "://" in item else f"http://{item}")
    if not found:
        raise ConfigurationError(f"no etcd endpoint in {spec!r}")
    return found, prefix
