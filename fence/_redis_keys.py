"""The Redis key schema of the lock managers and the guards, without I/O (C12).

Every key of resource ``R`` starts with ``<prefix>{R}:`` (:func:`resource_base`), so all of
them share the hash tag ``{R}`` and one script touches one Redis Cluster slot. With the
default prefix ``fence:``:

- ``fence:{R}:lock``: the holder, a hash ``secret``/``token``/``holder`` with a ``PX`` ttl.
- ``fence:{R}:token``: the last token issued for ``R``; an integer string with no ttl. The
  guard's issuer check reads it, and never writes it.
- ``fence:{R}:fence``: the resource's fence register, an integer string with no ttl: the
  fence of every data key of ``R`` in the guard's resource scope. The managers' revoke
  raises it, and no new token is ever issued at or below it.
- ``fence:{R}:key:<K>``: the per-key fence of data key ``K`` in the guard's key scope (no
  ttl).
- ``fence:{R}:readers`` and ``fence:{R}:reader-tokens``: the readers of a shared lock
  (C13): a sorted set of reader secrets by the end of their lease (server milliseconds),
  and a hash of each reader's ``"<token> <holder label>"``.
- ``fence:{R}:queue``, ``fence:{R}:queue-deadlines`` and ``fence:{R}:queue-writers``: the
  wait queue (a sorted set of waiter ids by arrival, a hash of each waiter's heartbeat
  deadline in server milliseconds, and the writers among the waiters). FIFO managers queue
  every waiter; the others queue readers, and writers that wait while readers hold or
  queue, so that a waiting writer keeps new readers out.
- ``fence:{R}:void:<secret>``: left by the manager's ``CANCEL`` for an acquire that gave up
  without knowing its outcome; an attempt with that secret that arrives later is refused.
- ``fence:{R}:repaired``: on a quorum node, the incarnation under which ``R`` was repaired
  (no ttl); and ``fence:quorum:node``, the node's marker, shared by every resource.

and the pub/sub channel ``fence:{R}:signal``, on which a release (or revoke, or a waiter
that gives up while the lock is free) publishes a wake-up: the ids of the waiters whose
turn it is (the queue's head, and with a reader at the head every reader behind it up to
the first writer), or, when nobody is queued and without FIFO, an empty message (wake one
waiter per listening manager).

Only the lock, readers, queue and void keys carry a ttl. Counters and fences never do.

The prefix reserves a namespace: every key that starts with it belongs to fences, token
counters and lock state. A guard refuses such a key as a data key (a write there could
reset a fence), and, in the resource scope, a data key without a hash tag (its register
would not be its resource's). The namespace is a set of bytes on the server: the keys
whose bytes start with the prefix in UTF-8, as the lock managers send it and the ACL
recipe names it; the guard judges each key as the bytes its client sends
(:meth:`KeyLayout.wire_keys`). The Lua scripts name the same keys from the ones they are
given (``fence._redis_scripts``, ``fence._quorum``, ``adapters/_redis_lua.py``).
"""

from __future__ import annotations

import enum
import functools
import hashlib
from collections.abc import Sequence
from typing import NamedTuple

from redis.crc import key_slot

from fence._core import validate_resource
from fence._errors import ConfigurationError, InvalidResourceError

__all__ = [
    "DEFAULT_PREFIX",
    "CrossSlotError",
    "FenceScope",
    "KeyLayout",
    "QuorumKeys",
    "ResourceKeys",
    "check_one_slot",
    "glob_escape",
    "hash_tag",
    "held_resource",
    "quorum_keys",
    "resource_base",
    "resource_keys",
    "resource_of",
    "scan_pattern",
    "slot_of",
    "validate_prefix",
    "waiter_id",
]

#: The key prefix shared by the lock managers and the Redis guard.
DEFAULT_PREFIX = "fence:"

# The keys of a resource, after its base '<prefix>{R}:'.
_LOCK = "lock"
_COUNTER = "token"
_FENCE = "fence"
_KEY_FENCE = "key:"
_SIGNAL = "signal"
_QUEUE = "queue"
_DEADLINES = "queue-deadlines"
_QUEUE_WRITERS = "queue-writers"
_VOID = "void:"
_READERS = "readers"
_READER_TOKENS = "reader-tokens"
_REPAIRED = "repaired"
# A quorum node's marker: no hash tag, the quorum's nodes are standalone servers.
_NODE_MARKER = "quorum:node"


# -- the prefix -------------------------------------------------------------------------


def validate_prefix(prefix: object, *, reserved: bool = False) -> str:
    """Return ``prefix`` if it can start the keys of every resource, else raise.

    Args:
        prefix: the key prefix of the lock managers and the guards.
        reserved: ``prefix`` names the fence namespace a guard reserves (or that ACL rules
            keep the application out of), which must not be every key.

    Raises:
        ConfigurationError: not a ``str``, or it contains ``{`` or ``}``, which would
            move the hash tag off the resource name; with ``reserved``, an empty prefix.
    """
    if not isinstance(prefix, str) or "{" in prefix or "}" in prefix:
        raise ConfigurationError(f"a Redis key prefix must be a str without braces, got {prefix!r}")
    if reserved and not prefix:
        raise ConfigurationError(
            "prefix must not be empty: every key starting with it is reserved for fences"
            " and lock state, and an empty prefix would reserve every key; use the lock"
            " manager's prefix (the default is 'fence:')"
        )
    return prefix


# -- hash tags and slots ----------------------------------------------------------------


def hash_tag(key: str) -> str | None:
    """The Redis Cluster hash tag of ``key`` (``"a"`` for ``"x{a}y"``), or ``None``.

    Same rule as the server: the text between the first ``{`` and the first ``}`` after it,
    if that is not empty.
    """
    start = key.find("{")
    if start < 0:
        return None
    end = key.find("}", start + 1)
    if end < 0 or end == start + 1:
        return None
    return key[start + 1 : end]


def resource_of(key: str) -> str:
    """The resource a data key belongs to: its hash tag, or the whole key if it has none.

    This is exactly what decides the key's cluster slot, so the fence keys built from it
    (``fence:{R}:...``) live in the key's slot.
    """
    tag = hash_tag(key)
    return key if tag is None else tag


def slot_of(key: str) -> int:
    """The Redis Cluster slot of ``key`` (UTF-8)."""
    return key_slot(key.encode("utf-8"))


class CrossSlotError(ConfigurationError):
    """The keys of one fenced call do not hash to one Redis Cluster slot.

    A Lua script may only touch keys of one slot (the server answers ``CROSSSLOT``
    otherwise). The keys of one resource share a hash tag, ``{R}``; a batch must stay
    within one resource. Raised before any I/O when the client can tell.

    Attributes:
        keys: the keys of the call.
    """

    def __init__(self, message: str, *, keys: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.keys = tuple(keys)


CrossSlotError.__module__ = "fence.adapters.redis"


def check_one_slot(keys: Sequence[str]) -> None:
    """Raise :class:`CrossSlotError` unless every key hashes to one cluster slot."""
    slots = {slot_of(key) for key in keys}
    if len(slots) > 1:
        tags = sorted({resource_of(key) for key in keys})
        raise CrossSlotError(
            f"a fenced batch must stay within one resource, but its keys belong to {tags}"
            f" and hash to {len(slots)} cluster slots; Redis runs a script on one slot only"
            " (a cluster answers CROSSSLOT). Give every key of the resource the same hash"
            " tag, e.g. '{order:42}:status' and '{order:42}:items', or split the batch.",
            keys=keys,
        )


# -- the keys of a resource -------------------------------------------------------------


def resource_base(prefix: str, resource: str) -> str:
    """``<prefix>{<resource>}:``, the start of every key of ``resource`` (no checks)."""
    return f"{prefix}{{{resource}}}:"


class ResourceKeys(NamedTuple):
    """The Redis keys of one resource; they all share the hash tag ``{resource}``.

    Attributes:
        lock: the holder hash (ttl: the lease).
        token: the last token issued (no ttl).
        fence: the guards' fence register (no ttl).
        signal: the pub/sub channel a release publishes its wake-up on (not a key).
        queue: the wait queue (sorted set of waiter ids).
        deadlines: the waiters' heartbeat deadlines (hash).
        void_prefix: prepend to a secret for the tombstone of a cancelled acquire.
        readers: the readers of a shared lock, by the end of their lease (sorted set).
        reader_tokens: each reader's token and holder label (hash).
        queue_writers: the writers among the waiters (sorted set).
    """

    lock: str
    token: str
    fence: str
    signal: str
    queue: str
    deadlines: str
    void_prefix: str
    readers: str
    reader_tokens: str
    queue_writers: str


def _manager_base(prefix: str, resource: str) -> str:
    """:func:`resource_base` of a resource a lock manager takes (validated)."""
    resource = validate_resource(resource)
    if resource.startswith("}"):
        raise InvalidResourceError(
            f"a Redis resource name must not start with '}}': the hash tag of {resource!r} "
            "would be empty and its keys would land in different cluster slots",
            value=resource,
        )
    return resource_base(prefix, resource)


@functools.lru_cache(maxsize=4096)
def resource_keys(prefix: str, resource: str) -> ResourceKeys:
    """The keys of ``resource`` under ``prefix`` (C12).

    Args:
        prefix: a key prefix without braces (default :data:`DEFAULT_PREFIX`).
        resource: the resource name.

    Raises:
        InvalidResourceError: not a valid resource name, or it starts with ``}``: the hash
            tag ``{}`` would be empty and Redis Cluster would hash each key on its own,
            scattering one resource's keys over several slots.

    Example::

        >>> resource_keys("fence:", "order:42").token
        'fence:{order:42}:token'
    """
    base = _manager_base(prefix, resource)
    return ResourceKeys(
        lock=base + _LOCK,
        token=base + _COUNTER,
        fence=base + _FENCE,
        signal=base + _SIGNAL,
        queue=base + _QUEUE,
        deadlines=base + _DEADLINES,
        void_prefix=base + _VOID,
        readers=base + _READERS,
        reader_tokens=base + _READER_TOKENS,
        queue_writers=base + _QUEUE_WRITERS,
    )


def glob_escape(text: str) -> str:
    """``text`` as a Redis glob (``SCAN MATCH``) that matches only itself."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def scan_pattern(prefix: str, start: str) -> str:
    """The ``SCAN MATCH`` pattern of every key of the resources that start with ``start``
    (taken literally) under ``prefix``."""
    return f"{glob_escape(prefix)}{{{glob_escape(start)}*"


def held_resource(prefix: str, key: str) -> str | None:
    """The resource whose lock or readers key ``key`` is, or ``None`` for any other key.

    A data key's fence (``<prefix>{R}:key:<K>``) whose ``K`` ends like a lock key is read
    as a resource that is never held; the caller's inspection drops it.
    """
    start = len(prefix) + 1
    for suffix in ("}:" + _LOCK, "}:" + _READERS):
        if key.endswith(suffix) and key.startswith(prefix + "{") and len(key) > start + len(suffix):
            return key[start : -len(suffix)]
    return None


class QuorumKeys(NamedTuple):
    """The keys one quorum call touches on a node.

    Attributes:
        lock: the holder hash (ttl: the lease).
        token: the last token issued (no ttl).
        fence: the guards' fence register (no ttl).
        signal: the channel a release publishes on, to wake a waiter.
        repaired: the incarnation id under which the resource was repaired (no ttl).
        node: the node's marker, shared by every resource (no ttl).
        void: the prefix of the tombstone a cancelled acquire leaves (add the secret).
    """

    lock: str
    token: str
    fence: str
    signal: str
    repaired: str
    node: str
    void: str


def quorum_keys(prefix: str, resource: str) -> QuorumKeys:
    """The keys of ``resource`` on a quorum node (the keys of :func:`resource_keys`).

    The node marker ``<prefix>quorum:node`` has no hash tag: the quorum's nodes are
    standalone servers, never Redis Cluster.

    Example::

        >>> quorum_keys("fence:", "order:42").repaired
        'fence:{order:42}:repaired'
    """
    keys = resource_keys(prefix, resource)
    return QuorumKeys(
        lock=keys.lock,
        token=keys.token,
        fence=keys.fence,
        signal=keys.signal,
        repaired=resource_base(prefix, resource) + _REPAIRED,
        node=prefix + _NODE_MARKER,
        void=keys.void_prefix,
    )


def waiter_id(secret: str) -> str:
    """A short public id for a waiter, derived from its owner secret.

    Queue members and wake keys are visible to anyone who can list keys, so they carry a
    digest of the secret, never the secret itself.
    """
    return hashlib.blake2b(secret.encode(), digest_size=10).hexdigest()


# -- the guard's fences -----------------------------------------------------------------


class FenceScope(enum.StrEnum):
    """What one fence protects.

    Attributes:
        KEY: every data key has its own fence, in the companion key
            ``<prefix>{R}:key:<key>``. Writes to different keys never fence each other.
        RESOURCE: all keys of resource ``R`` share one fence register,
            ``<prefix>{R}:fence`` (the one a lock manager's revoke raises). A write with a
            newer token to any key of ``R`` shuts out older tokens on all of them.
    """

    KEY = "key"
    RESOURCE = "resource"


class KeyLayout:
    """Where the guard keeps fences, for one prefix and fence scope (C12).

    With the default prefix ``fence:``, for a data key ``K`` of resource ``R``
    (:func:`resource_of`):

    - ``fence:{R}:fence``: the resource's fence register (``FenceScope.RESOURCE``);
    - ``fence:{R}:key:K``: the per-key fence of ``K`` (``FenceScope.KEY``);
    - ``fence:{R}:token``: the last token the lock manager issued for ``R`` (read by the
      issuer check, never written by the guard).

    Fence keys are plain integer strings without a TTL; a value's expiry never touches
    them. Every key that starts with the prefix is reserved for fences and the lock
    managers' keys: the layout refuses such a data key, and, in the resource scope, a data
    key without a hash tag (its register would not be its resource's).

    A client sends a ``str`` key in its own encoding (redis-py's ``encoding`` and
    ``encoding_errors``), and that is what the server stores and matches. The guard's keys
    go as :meth:`wire_keys` gives them: encoded once, judged as those bytes, and sent as
    they are. A key the encoding would change (a character it drops, replaces or cannot
    send) is refused: two names would reach Redis as one key with two fences, and a
    dropped character could move a key into the namespace.

    Args:
        prefix: the key prefix; must match the lock manager's. Not empty, no braces.
        scope: a :class:`FenceScope`.
        cluster: whether the client is a cluster client (keys whose resource contains
            ``}`` cannot share a slot with their fence there).
        encoding: the encoding the client sends a ``str`` in (redis-py's ``encoding``).
        errors: its error policy (redis-py's ``encoding_errors``).

    Raises:
        ConfigurationError: an empty prefix, a prefix with braces or an unknown scope; an
            encoding that would not send the prefix as its UTF-8 bytes, where the lock
            managers and the ACL recipe have the namespace (``utf-16``, a prefix it
            cannot represent, an unknown encoding).
    """

    __slots__ = (
        "_fence_keys",
        "_namespace",
        "_wire_keys",
        "cluster",
        "encoding",
        "errors",
        "per_resource",
        "prefix",
        "scope",
    )

    #: Fence keys remembered per data key: a hot key costs one dict lookup, not a parse.
    CACHE_SIZE = 4096

    def __init__(
        self,
        prefix: str,
        scope: FenceScope | str,
        *,
        cluster: bool,
        encoding: str = "utf-8",
        errors: str = "strict",
    ) -> None:
        validate_prefix(prefix, reserved=True)
        try:
            self.scope = FenceScope(scope)
        except ValueError:
            raise ConfigurationError(
                f"fence scope must be 'key' or 'resource', got {scope!r}"
            ) from None
        self.prefix = prefix
        self.per_resource = self.scope is FenceScope.RESOURCE
        self.cluster = cluster
        self.encoding, self.errors = encoding, errors
        self._namespace = _prefix_bytes(prefix, encoding, errors)
        self._fence_keys: dict[str, str] = {}
        self._wire_keys: dict[str, tuple[bytes, bytes]] = {}

    def resource(self, key: str) -> str:
        """The resource of ``key``; on a cluster, refuse one whose fence cannot share its slot.

        Raises:
            InvalidResourceError: ``key`` is not a usable name, or it lies in the fence
                namespace (it starts with the prefix).
            CrossSlotError: on a cluster, the key has no hash tag but contains ``}``.
        """
        validate_resource(key, what="key")
        if key.startswith(self.prefix):
            raise InvalidResourceError(
                f"key {key!r} lies in the fence namespace: every key starting with the"
                f" prefix {self.prefix!r} is reserved for fences, token counters and lock"
                " state, and a write there could reset a fence. Keep data keys outside it,"
                " or give the guard and the lock managers another prefix.",
                value=key,
            )
        resource = resource_of(key)
        if self.cluster and "}" in resource:
            raise CrossSlotError(
                f"key {key!r} has no hash tag but contains '}}': its fence key cannot live in"
                " its cluster slot (the server would answer CROSSSLOT); give it a hash tag,"
                " e.g. '{order:42}:status'",
                keys=(key,),
            )
        return resource

    def fence_key(self, key: str, *, data: bool = True) -> str:
        """The key that holds the fence protecting ``key``.

        Args:
            key: a data key; or, with ``data=False`` (claim, fence), a scope, which in the
                resource scope may also be a bare resource name.
            data: whether ``key`` is a data key.

        Raises:
            InvalidResourceError: as :meth:`resource`; or, in the resource scope, a data
                key without a hash tag.
            CrossSlotError: as :meth:`resource`.
        """
        found = self._fence_keys.get(key) if type(key) is str else None
        if found is not None:
            return found
        resource = self.resource(key)
        if self.per_resource:
            if data and hash_tag(key) is None:
                raise InvalidResourceError(
                    f"key {key!r} has no hash tag, so in the resource scope it would be"
                    " fenced only by a register of its own, outside its lock's claim and"
                    " revoke. Put the resource in braces, e.g."
                    f" {_tagged_example(key)!r} under lock({_tagged_example(key, bare=True)!r});"
                    " claim() and fence() take the bare resource name.",
                    value=key,
                )
            found = resource_base(self.prefix, resource) + _FENCE
        else:
            found = resource_base(self.prefix, resource) + _KEY_FENCE + key
        if data:
            if len(self._fence_keys) >= self.CACHE_SIZE:
                self._fence_keys.clear()
            self._fence_keys[key] = found
        return found

    def issuer_key(self, key: str) -> str:
        """The lock manager's issued-token counter for the resource of ``key``."""
        return resource_base(self.prefix, self.resource(key)) + _COUNTER

    def wire_keys(self, key: str, *, data: bool = True) -> tuple[bytes, bytes]:
        """The fence key of ``key`` and ``key`` itself, as the bytes the client sends.

        The guard sends these bytes as they are, so what is judged here is what the server
        gets: the namespace check runs on the key's bytes, and no subclass of ``str`` can
        show the checks one name and the encoder another.

        Args:
            key: a data key; or, with ``data=False``, a scope (see :meth:`fence_key`).
            data: whether ``key`` is a data key.

        Raises:
            InvalidResourceError: as :meth:`fence_key`; or the key's bytes lie in the fence
                namespace, or the client's encoding would change the key (see the class).
            CrossSlotError: as :meth:`resource`.
        """
        found = self._wire_keys.get(key) if data and type(key) is str else None
        if found is not None:
            return found
        if isinstance(key, str):
            key = str.__str__(key)  # a plain str: no method of a subclass takes part
        fence = self.fence_key(key, data=data)
        sent, whole = self._encode(key)
        if sent is not None and sent.startswith(self._namespace):
            raise InvalidResourceError(
                f"key {key!r} lies in the fence namespace as the client sends it: its"
                f" encoding {self.encoding!r} (errors={self.errors!r}) makes it {sent!r},"
                f" which starts with the prefix {self.prefix!r}, reserved for fences, token"
                " counters and lock state.",
                value=key,
            )
        if not whole or sent is None:
            raise self._changed(key, sent)
        pair = (self._whole(fence, key), sent)
        if data:
            if len(self._wire_keys) >= self.CACHE_SIZE:
                self._wire_keys.clear()
            self._wire_keys[key] = pair
        return pair

    def wire_name(self, name: str) -> bytes:
        """A key the layout built (:meth:`issuer_key`), as the bytes the client sends.

        Raises:
            InvalidResourceError: the client's encoding would change it.
        """
        return self._whole(name, name)

    def _encode(self, name: str) -> tuple[bytes | None, bool]:
        """``name`` as the client encodes it (``None`` if it cannot), and whether the
        encoding keeps it whole: the bytes decode back to ``name``, so that no other name
        is sent as the same bytes."""
        try:
            sent = name.encode(self.encoding, self.errors)
        except (UnicodeError, TypeError):
            return None, False
        try:
            return sent, sent.decode(self.encoding, self.errors) == name
        except (UnicodeError, TypeError):
            return sent, False

    def _whole(self, name: str, key: object) -> bytes:
        """``name`` as the client sends it, if the encoding keeps it whole (see
        :meth:`_encode`); ``key`` is the data key or scope it was built for."""
        sent, whole = self._encode(name)
        if not whole or sent is None:
            raise self._changed(key, sent)
        return sent

    def _changed(self, key: object, sent: bytes | None) -> InvalidResourceError:
        """The error for a key the client's encoding would not send as it is."""
        shown = "cannot send it" if sent is None else f"would send it as {sent!r}"
        return InvalidResourceError(
            f"key {key!r} cannot be sent as it is: the client's encoding {self.encoding!r}"
            f" (errors={self.errors!r}) {shown}, a name that other keys share or that is"
            " not this one, so its fence could not be told apart. Use keys the encoding"
            " represents exactly, or a client with the default encoding, UTF-8.",
            value=key,
        )


def _prefix_bytes(prefix: str, encoding: str, errors: str) -> bytes:
    """The prefix's UTF-8 bytes, if a client with this encoding sends it so.

    Raises:
        ConfigurationError: the client would send the prefix as other bytes, or cannot.
    """
    namespace = prefix.encode("utf-8", "surrogatepass")
    try:
        sent: bytes | None = prefix.encode(encoding, errors)
    except (LookupError, UnicodeError, TypeError):
        sent = None
    if sent != namespace:
        raise ConfigurationError(
            f"a client with encoding {encoding!r} (errors={errors!r}) would send the prefix"
            f" {prefix!r} as {sent!r}, not as {namespace!r}, the bytes by which the lock"
            " managers and the ACL recipe name the fence namespace: every fence of the"
            " guard would lie outside it. Use a client with an encoding that sends the"
            " prefix as UTF-8 does (the default, UTF-8; latin-1 or ASCII for an ASCII"
            " prefix)."
        )
    return namespace


def _tagged_example(key: str, *, bare: bool = False) -> str:
    """``order:9:status`` -> ``{order:9}:status`` (or ``order:9`` with ``bare``)."""
    resource, sep, rest = key.rpartition(":")
    if not resource:
        return key if bare else f"{{{key}}}"
    return resource if bare else f"{{{resource}}}{sep}{rest}"
