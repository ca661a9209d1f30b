"""The Redis guard's fenced operations and how they become script calls. No I/O.

An operation (:class:`Op`) is built and checked by the guard's methods before any I/O: its
arguments are validated here (ttl, integer range, stream id, sizes). :func:`command` picks
the leanest script of ``_redis_lua.py`` for one write (``SET``, ``HSET`` or the general
``WRITE``) and builds its ``KEYS`` and ``ARGV``; :func:`encode` does it for a batch,
:func:`many_part` for one write of a pipeline's ``MANY`` call. The keys come from
:class:`fence._redis_keys.KeyLayout` (``wire_keys``), as the bytes the client sends: the
checks judged those bytes, and the packer passes bytes through without encoding them again.

Tokens and other integers go as decimal strings (``_redis_lua.py`` says why).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from itertools import chain
from typing import Any, NamedTuple

from fence import ConfigurationError, validate_ttl
from fence._lua import Script
from fence._redis_keys import KeyLayout, check_one_slot

from ._redis_lua import HSET, HSET_MAX_ARGS, MANY, SET, WRITE

__all__ = [
    "MAX_TTL_MS",
    "MAX_XADD_FIELDS",
    "REPEATABLE",
    "Op",
    "Queued",
    "command",
    "encode",
    "many_part",
    "op_claim",
    "op_delete",
    "op_hset",
    "op_incr",
    "op_read",
    "op_rpush",
    "op_set",
    "op_xadd",
    "pipeline_calls",
    "pipeline_replies",
    "stream_id",
]

#: The longest expiry of a value, in milliseconds (about 285,000 years). Redis refuses an
#: expiry whose deadline leaves int64 milliseconds; this bound keeps every one far inside.
MAX_TTL_MS = 2**53 - 1

#: The most fields one XADD entry may have. An entry is one command, which the script
#: builds with Lua's ``unpack``; that stops near 8000 values ("too many results to unpack").
MAX_XADD_FIELDS = 3000

#: The operations that leave the same state when sent twice with the same token, so a
#: call made only of them is sent once more after the server closed its connection under
#: it (:func:`fence._redis_conn.closed_connection`). ``incrby``, ``rpush`` and ``xadd``
#: would apply twice if the first send had run: their caller gets the error instead.
REPEATABLE = frozenset({"set", "hset", "del", "claim", "get", "hgetall"})

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_U64_MAX = 2**64 - 1


class Op(NamedTuple):
    """One fenced operation, ready to be encoded into a :data:`WRITE` call.

    Attributes:
        code: the opcode the script knows (``set``, ``hset``, ``del``, ...).
        key: the data key.
        args: the operation's arguments, already encodable by redis-py.
        must_exist: reject with ``MISSING`` if ``key`` does not exist.
    """

    code: str
    key: str
    args: tuple[Any, ...] = ()
    must_exist: bool = False


def op_set(key: str, value: Any, ttl: float | None, must_exist: bool) -> Op:
    """A fenced ``SET``; ``ttl`` (seconds) expires the value only, never the fence.

    Raises:
        ConfigurationError: a ttl below 1 ms, not finite, or above :data:`MAX_TTL_MS`.
    """
    if ttl is None:
        return Op("set", key, (value, b""), must_exist)
    px = max(1, math.ceil(validate_ttl(ttl) * 1000))
    if px > MAX_TTL_MS:
        raise ConfigurationError(
            f"ttl must be at most {MAX_TTL_MS} ms (about 285,000 years), got {ttl!r} seconds;"
            " leave ttl=None for a value that never expires"
        )
    return Op("set", key, (value, b"%d" % px), must_exist)


def op_hset(key: str, mapping: Mapping[Any, Any], must_exist: bool) -> Op:
    """A fenced ``HSET`` of the fields in ``mapping``."""
    if not mapping:
        raise ConfigurationError("hset needs at least one field")
    return Op("hset", key, tuple(chain.from_iterable(mapping.items())), must_exist)


def op_incr(key: str, amount: int, must_exist: bool) -> Op:
    """A fenced ``INCRBY``; ``amount`` is a signed 64-bit ``int`` (floats are refused)."""
    if isinstance(amount, bool) or not isinstance(amount, int):
        raise ConfigurationError(f"incr amount must be an int, got {amount!r}")
    if not _INT64_MIN <= amount <= _INT64_MAX:
        raise ConfigurationError(
            f"incr amount must fit in a signed 64-bit integer, as Redis counts, got {amount}"
        )
    return Op("incrby", key, (b"%d" % amount,), must_exist)


def op_rpush(key: str, values: Sequence[Any], must_exist: bool) -> Op:
    """A fenced ``RPUSH`` of ``values``."""
    if not values:
        raise ConfigurationError("rpush needs at least one value")
    return Op("rpush", key, tuple(values), must_exist)


_STREAM_ID = re.compile(r"([0-9]+)(?:-([0-9]+|\*))?")


def stream_id(entry_id: object) -> str:
    """The canonical form of an ``XADD`` id: ``*``, ``<ms>-*`` or ``<ms>-<seq>``.

    ``<ms>`` alone means ``<ms>-0``, as in Redis; leading zeros are dropped.

    Raises:
        ConfigurationError: not one of these forms, a part above ``2**64 - 1``, or
            ``0-0`` (Redis takes ids above it only).
    """
    if entry_id == "*":
        return "*"
    match = _STREAM_ID.fullmatch(entry_id) if isinstance(entry_id, str) else None
    if match is None:
        raise ConfigurationError(
            f"an xadd id is '*', '<ms>-<seq>', '<ms>-*' or '<ms>' in decimal digits, got"
            f" {entry_id!r}"
        )
    ms, seq = int(match[1]), match[2]
    number = 0 if seq in (None, "*") else int(seq)
    if ms > _U64_MAX or number > _U64_MAX:
        raise ConfigurationError(f"each part of an xadd id is at most 2**64 - 1, got {entry_id!r}")
    if seq == "*":
        return f"{ms}-*"
    if ms == number == 0:
        raise ConfigurationError(f"an xadd id must be above 0-0, got {entry_id!r}")
    return f"{ms}-{number}"


def op_xadd(
    key: str, fields: Mapping[Any, Any], entry_id: str, maxlen: int | None, must_exist: bool
) -> Op:
    """A fenced ``XADD`` of ``fields``, with an approximate ``MAXLEN`` trim if given.

    Raises:
        ConfigurationError: no fields or more than :data:`MAX_XADD_FIELDS`, a malformed id
            (:func:`stream_id`), or a ``maxlen`` that is not an int in ``0 .. 2**63 - 1``.
    """
    if not fields:
        raise ConfigurationError("xadd needs at least one field")
    if len(fields) > MAX_XADD_FIELDS:
        raise ConfigurationError(
            f"an xadd entry has at most {MAX_XADD_FIELDS} fields, got {len(fields)}; store"
            " a larger record in a hash and add its key to the stream"
        )
    if maxlen is not None and (
        isinstance(maxlen, bool) or not isinstance(maxlen, int) or not 0 <= maxlen <= _INT64_MAX
    ):
        raise ConfigurationError(f"maxlen must be None or an int in 0..2**63-1, got {maxlen!r}")
    args: list[Any] = [stream_id(entry_id), "" if maxlen is None else str(maxlen)]
    for field, value in fields.items():
        args += (field, value)
    return Op("xadd", key, tuple(args), must_exist)


def op_delete(key: str) -> Op:
    """A fenced ``DEL`` that keeps the fence as a tombstone (C7)."""
    return Op("del", key)


def op_claim(key: str) -> Op:
    """Raise the fence without touching data (C8)."""
    return Op("claim", key)


def op_read(key: str, kind: str) -> Op:
    """A registering read (C8): ``kind`` is ``get`` or ``hgetall``."""
    return Op(kind, key)


_OPCODES = {
    code: code.encode()
    for code in ("set", "hset", "del", "incrby", "rpush", "xadd", "claim", "get", "hgetall")
}


def encode(
    layout: KeyLayout, token: int, ops: Sequence[Op], *, issuer: bool, one_slot: bool
) -> tuple[list[bytes], list[Any]]:
    """Build the ``KEYS`` and ``ARGV`` of one :data:`WRITE` call.

    Args:
        layout: the key layout.
        token: the validated token.
        ops: the operations, applied in order.
        issuer: add the issued-counter keys for the issuer check.
        one_slot: check that every data key hashes to one cluster slot (batches).

    Raises:
        CrossSlotError: ``one_slot`` and the keys span several slots.
    """
    keys: list[bytes] = []
    # Numbers and fixed words go as bytes: redis-py passes bytes through but encodes every
    # str and int on each call, which is most of the client's cost of a fenced write.
    argv: list[Any] = [b"%d" % token, b"%d" % len(ops), b"3" if issuer else b"2"]
    for op in ops:
        claim = op.code == "claim"
        fence, key = layout.wire_keys(op.key, data=not claim)
        keys.append(fence)
        # A claim touches no data; its scope may be a bare resource name, which is no key
        # the guard's ACL user may have (KEYS must be accessible). Its fence key stands in.
        keys.append(fence if claim else key)
        if issuer:
            keys.append(layout.wire_name(layout.issuer_key(op.key)))
        argv += (
            _OPCODES.get(op.code) or op.code,
            b"1" if op.must_exist else b"0",
            b"%d" % len(op.args),
            *op.args,
        )
    if one_slot and len(ops) > 1:
        check_one_slot([op.key for op in ops])
    return keys, argv


def command(
    layout: KeyLayout, token: int, op: Op, *, issuer: bool
) -> tuple[Script, list[bytes], list[Any]]:
    """The script, ``KEYS`` and ``ARGV`` of one fenced write, the leanest that does it.

    A plain set and a small hset have scripts of their own with half the arguments of the
    general :data:`WRITE` (packing them is most of the client's cost); everything else,
    and every write under ``must_exist`` or the issuer check, goes through :data:`WRITE`.
    All three reply in the shape :func:`decode` reads.
    """
    if not (op.must_exist or issuer):
        if op.code == "set":
            value, px = op.args
            keys = list(layout.wire_keys(op.key))
            return SET, keys, ([b"%d" % token, value, px] if px else [b"%d" % token, value])
        if op.code == "hset" and len(op.args) <= HSET_MAX_ARGS:
            return HSET, list(layout.wire_keys(op.key)), [b"%d" % token, *op.args]
    keys, argv = encode(layout, token, (op,), issuer=issuer, one_slot=False)
    return WRITE, keys, argv


def many_part(layout: KeyLayout, token: int, op: Op, *, issuer: bool) -> list[Any] | None:
    """The ``KEYS`` and ``ARGV`` of one write inside a :data:`MANY` call, or ``None``.

    Returns ``[fence_key, key, argv...]`` for a plain set or a small hset (the writes
    :data:`MANY` knows); ``None`` for any other write, which goes on its own.
    """
    if op.must_exist or issuer:
        return None
    if op.code == "set":
        value, px = op.args
        head = [*layout.wire_keys(op.key), b"%d" % token]
        return [*head, b"p", value, px] if px else [*head, b"s", value]
    if op.code == "hset" and len(op.args) <= HSET_MAX_ARGS:
        fence, key = layout.wire_keys(op.key)
        return [fence, key, b"%d" % token, b"h", b"%d" % len(op.args), *op.args]
    return None


#: A write queued in a fenced pipeline: token, operation, script, keys, argv (for
#: :data:`MANY`, the write's own part of a call, from :func:`many_part`).
Queued = tuple[int, Op, Script, list[Any], list[Any]]


def pipeline_calls(
    queued: Sequence[Queued],
) -> tuple[list[tuple[Script, list[Any], list[Any]]], list[int]]:
    """The script calls that send a pipeline's writes: a run of writes queued for
    :data:`MANY` goes as one call.

    Returns:
        The calls (script, keys, argv), and per call 0 for one write on its own, else how
        many writes its :data:`MANY` carries (for :func:`pipeline_replies`).
    """
    calls: list[tuple[Script, list[Any], list[Any]]] = []
    runs: list[int] = []
    i, n = 0, len(queued)
    while i < n:
        _, _, script, keys, argv = queued[i]
        if script is not MANY:
            calls.append((script, keys, argv))
            runs.append(0)
            i += 1
            continue
        j = i
        keys, argv = [], []
        while j < n and queued[j][2] is MANY:
            keys += queued[j][3]
            argv += queued[j][4]
            j += 1
        calls.append((MANY, keys, argv))
        runs.append(j - i)
        i = j
    return calls, runs


def pipeline_replies(runs: Sequence[int], replies: Sequence[Any]) -> list[Any]:
    """One reply per queued write, from the replies of :func:`pipeline_calls`' calls."""
    out: list[Any] = []
    for count, reply in zip(runs, replies, strict=True):
        if not count:
            out.append(reply)
        elif isinstance(reply, list):
            out += reply
        else:  # the call failed as a whole (NOSCRIPT, a lost connection): each write did
            out += [reply] * count
    return out
