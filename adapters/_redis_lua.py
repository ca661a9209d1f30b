"""The Lua scripts of the Redis guard and the I/O-free code around them.

The scripts are named constants, each with a header that says what ``KEYS`` and ``ARGV``
hold and what it returns. Around them lives everything the guard does without I/O, written
once for the sync and the asyncio guard: the key layout (C12), the encoding of fenced
operations into ``KEYS``/``ARGV``, and the decoding of the replies into results or
:class:`fence.StaleTokenError`.

Integers: tokens are below ``2**53`` and are sent as decimal strings. The scripts compare
them with ``tonumber`` (exact below ``2**53``; a corrupted fence above it still compares
as larger, because rounding is monotonic) and store the token string as it came, so no
number is ever formatted with ``%g`` on the server.
"""

from __future__ import annotations

import enum
import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from redis.crc import key_slot

from fence import (
    ConfigurationError,
    InvalidResourceError,
    Reason,
    StaleTokenError,
    validate_resource,
    validate_ttl,
)

__all__ = [
    "READ",
    "WRITE",
    "CrossSlotError",
    "FenceScope",
    "KeyLayout",
    "Op",
    "Script",
    "UnissuedTokenError",
    "hash_tag",
    "resource_of",
]


# -- the scripts ------------------------------------------------------------------------

#: Check every fence, then apply every operation: one atomic, fenced step (C4-C8).
WRITE_LUA = """
-- KEYS: for each operation i, a group of STRIDE keys:
--   KEYS[g+1]  the fence key (per-key fence, or the resource's fence register)
--   KEYS[g+2]  the data key
--   KEYS[g+3]  the resource's issued-token counter (only when STRIDE is 3)
-- ARGV[1]  the token, a decimal string (validated by the client: 1 <= t <= 2^53-1)
-- ARGV[2]  N, the number of operations
-- ARGV[3]  STRIDE: 2, or 3 to reject tokens above the issued counter
-- then, for each operation: opcode, must-exist flag ("1"/"0"), argc, argc arguments.
--   set     value, px ("" for no expiry)     -> 1
--   hset    field, value, ...                 -> fields added
--   del                                       -> keys removed (0/1)
--   incrby  amount                            -> the new value
--   rpush   value, ...                        -> the list length
--   xadd    id, maxlen ("" for none), field, value, ...  -> the entry id
--   claim                                     -> 1 (raises the fence only)
--   get                                       -> the string value or nil (registering read)
--   hgetall                                   -> the flat field/value array (registering read)
-- Returns {1, result_1, ..., result_N} when every check passed and every operation was
-- applied (a single operation whose result is a number returns just that number: a table
-- reply costs the server about a microsecond more, as much as the fence check itself),
-- else {0, i, reason, fence, issued, ...} for each rejected operation i, with
-- reason STALE, MISSING, UNISSUED or UNVERIFIABLE, fence the stored fence ("" if none) and
-- issued the issued counter ("" unless UNISSUED); nothing is written then.
-- An operation the data type would refuse (WRONGTYPE, not an integer) raises an error
-- reply before the first write, so a batch never half-applies.
local token = ARGV[1]
local tnum = tonumber(token)
local n = tonumber(ARGV[2])
local stride = tonumber(ARGV[3])
local match = string.match

-- The verdict of the fence (and the issuer counter) on this token: nil if it passes, else
-- the reason; with the stored fence and, for UNISSUED, the counter.
local function verdict(fkey, ikey, fstr)
  if fstr and not match(fstr, '^%d+$') then return 'UNVERIFIABLE', '' end
  if fstr and tnum < tonumber(fstr) then return 'STALE', '' end
  if ikey then
    local issued = redis.call('GET', ikey) or '0'
    if not match(issued, '^%d+$') or tnum > tonumber(issued) then return 'UNISSUED', issued end
  end
  return nil, ''
end

-- Apply one data operation whose arguments start at ARGV[a]; return its result.
local function apply(op, a, argc, dkey)
  if op == 'set' then
    if ARGV[a + 1] == '' then
      redis.call('SET', dkey, ARGV[a])
    else
      redis.call('SET', dkey, ARGV[a], 'PX', ARGV[a + 1])
    end
    return 1
  elseif op == 'hset' then
    return redis.call('HSET', dkey, unpack(ARGV, a, a + argc - 1))
  elseif op == 'del' then
    return redis.call('DEL', dkey)
  elseif op == 'incrby' then
    return redis.call('INCRBY', dkey, ARGV[a])
  elseif op == 'rpush' then
    return redis.call('RPUSH', dkey, unpack(ARGV, a, a + argc - 1))
  elseif op == 'xadd' then
    if ARGV[a + 1] == '' then
      return redis.call('XADD', dkey, ARGV[a], unpack(ARGV, a + 2, a + argc - 1))
    end
    return redis.call('XADD', dkey, 'MAXLEN', '~', ARGV[a + 1], ARGV[a],
                      unpack(ARGV, a + 2, a + argc - 1))
  elseif op == 'get' then
    return redis.call('GET', dkey)
  elseif op == 'hgetall' then
    return redis.call('HGETALL', dkey)
  end
  return 1  -- claim
end

-- One operation (the common case): check, then write the data before the fence, so that
-- a data-type error (WRONGTYPE, not an integer) aborts the script before anything changed.
if n == 1 then
  local fkey, dkey = KEYS[1], KEYS[2]
  local fstr = redis.call('GET', fkey)
  local reason, issued = nil, ''
  -- A holder writing again finds its own token: equal passes (C4) with nothing to parse.
  if fstr ~= token or stride == 3 then
    reason, issued = verdict(fkey, stride == 3 and KEYS[3], fstr)
  end
  if reason == nil and ARGV[5] == '1' and redis.call('EXISTS', dkey) == 0 then
    reason = 'MISSING'
  end
  if reason then return {0, 1, reason, fstr or '', issued} end
  local r = apply(ARGV[4], 7, tonumber(ARGV[6]), dkey)
  if fstr ~= token then redis.call('SET', fkey, token) end
  if type(r) == 'number' then return r end
  return {1, r}
end

-- A batch: check every operation first, against the state as the earlier operations of
-- the batch will leave it (data types, integers, existence), so that no write happens
-- unless all of them will succeed.
local function want_of(op)  -- the type an operation needs; nil: any
  if op == 'set' or op == 'del' or op == 'claim' then return nil
  elseif op == 'hset' or op == 'hgetall' then return 'hash'
  elseif op == 'rpush' then return 'list'
  elseif op == 'xadd' then return 'stream'
  end
  return 'string'
end

local types, ints, fences, rejected = {}, {}, {}, {}
local pos = 4
for i = 1, n do
  local g = (i - 1) * stride
  local fkey, dkey = KEYS[g + 1], KEYS[g + 2]
  local op, must, argc = ARGV[pos], ARGV[pos + 1] == '1', tonumber(ARGV[pos + 2])
  pos = pos + 3 + argc

  local fstr = fences[fkey]
  if fstr == nil then
    fstr = redis.call('GET', fkey)
    fences[fkey] = fstr
  end
  local reason, issued = verdict(fkey, stride == 3 and KEYS[g + 3], fstr)
  local want, now = want_of(op), types[dkey]
  if reason == nil and (must or want) and now == nil then
    now = redis.call('TYPE', dkey)['ok']
    types[dkey] = now
  end
  if reason == nil and must and now == 'none' then reason = 'MISSING' end
  if reason then
    for _, v in ipairs({i, reason, fstr or '', issued}) do rejected[#rejected + 1] = v end
  elseif #rejected == 0 then
    if want and now ~= 'none' and now ~= want then
      return redis.error_reply('WRONGTYPE ' .. op .. ' needs a ' .. want .. ' at ' .. dkey ..
                               ', found a ' .. now)
    end
    if op == 'incrby' then
      local v = ints[dkey]
      if v == nil and now == 'string' then v = redis.call('GET', dkey) end
      if v and not match(v, '^-?%d+$') then
        return redis.error_reply('ERR incrby at ' .. dkey .. ': the value is not an integer')
      end
      ints[dkey], types[dkey] = '0', 'string'
    elseif op == 'set' then
      ints[dkey], types[dkey] = ARGV[pos - argc], 'string'
    elseif op == 'del' then
      ints[dkey], types[dkey] = false, 'none'
    elseif want and op ~= 'get' and op ~= 'hgetall' then
      types[dkey] = want
    end
  end
end
if #rejected > 0 then
  table.insert(rejected, 1, 0)
  return rejected
end

local out = {1}
pos = 4
for i = 1, n do
  local g = (i - 1) * stride
  local fkey, dkey = KEYS[g + 1], KEYS[g + 2]
  local op, argc = ARGV[pos], tonumber(ARGV[pos + 2])
  out[i + 1] = apply(op, pos + 3, argc, dkey)
  pos = pos + 3 + argc
  if fences[fkey] ~= token then
    redis.call('SET', fkey, token)
    fences[fkey] = token
  end
end
return out
"""

#: Read a value together with its fence, in one consistent step; raises nothing.
READ_LUA = """
-- KEYS[1]  the fence key
-- KEYS[2]  the data key
-- ARGV[1]  "get" (a string value) or "hgetall" (a hash)
-- Returns {fence, value}: fence is the stored fence ("" if none); value is the string
-- (nil if absent) or the flat field/value array of the hash.
local fence = redis.call('GET', KEYS[1]) or ''
if ARGV[1] == 'hgetall' then
  return {fence, redis.call('HGETALL', KEYS[2])}
end
return {fence, redis.call('GET', KEYS[2])}
"""


@dataclass(frozen=True, slots=True)
class Script:
    """A Lua script and its SHA1, for ``EVALSHA`` with a reload on ``NOSCRIPT``.

    Attributes:
        name: a short name for messages.
        text: the Lua source.
        sha: the SHA1 hex digest ``EVALSHA`` names it by.
    """

    name: str
    text: str
    sha: str

    @classmethod
    def of(cls, name: str, text: str) -> Script:
        """Build a script and compute its SHA1."""
        # Redis names scripts by their SHA1; it is an identifier here, not a security measure.
        digest = hashlib.sha1(text.encode("utf-8"), usedforsecurity=False)
        return cls(name, text, digest.hexdigest())


#: The hottest path on its own: one fenced SET, no must-exist, no issuer check. Fewer
#: arguments to pack and parse than the general script, same verdicts and reply shape.
SET_LUA = """
-- KEYS[1] the fence key     KEYS[2] the data key
-- ARGV[1] the token, a decimal string     ARGV[2] the value     ARGV[3] px (optional)
-- Returns 1 when written, else {0, 1, reason, fence, ''} as the general write script,
-- with reason STALE or UNVERIFIABLE; nothing is written then.
local token = ARGV[1]
local fstr = redis.call('GET', KEYS[1])
if fstr ~= token and fstr then
  if not string.match(fstr, '^%d+$') then return {0, 1, 'UNVERIFIABLE', fstr, ''} end
  if tonumber(token) < tonumber(fstr) then return {0, 1, 'STALE', fstr, ''} end
end
if ARGV[3] then
  redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
else
  redis.call('SET', KEYS[2], ARGV[2])
end
if fstr ~= token then redis.call('SET', KEYS[1], token) end
return 1
"""

WRITE = Script.of("fenced-write", WRITE_LUA)
SET = Script.of("fenced-set", SET_LUA)
READ = Script.of("fenced-read", READ_LUA)


# -- errors -----------------------------------------------------------------------------


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


class UnissuedTokenError(StaleTokenError):
    """The issuer check refused a token that was never issued (reason ``UNVERIFIABLE``).

    The token is above the resource's issued counter ``fence:{R}:token``, kept by a lock
    manager on the same Redis. It is forged or corrupted, comes from another cluster or
    environment, or the counter went back (a lost AOF tail, a failover, a restored backup).

    Attributes:
        issued: the issued counter the guard found, 0 if there was none.
    """

    def __init__(
        self,
        scope: str,
        token: int,
        fence: int | None,
        *,
        issued: int,
        message: str | None = None,
    ) -> None:
        if message is None:
            message = (
                f"{scope}: token {token} was never issued: the issued counter is {issued}"
                " (a forged or corrupted token, a token from another environment, or a"
                " counter that went back)"
            )
        super().__init__(scope, token, fence, Reason.UNVERIFIABLE, message=message)
        self.issued = issued


for _cls in (CrossSlotError, UnissuedTokenError):
    _cls.__module__ = "fence.adapters.redis"
del _cls


# -- key layout -------------------------------------------------------------------------


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

    Args:
        prefix: the key prefix; must match the lock manager's. Not empty, no braces.
        scope: a :class:`FenceScope`.
        cluster: whether the client is a cluster client (keys whose resource contains
            ``}`` cannot share a slot with their fence there).

    Raises:
        ConfigurationError: an empty prefix, a prefix with braces or an unknown scope.
    """

    __slots__ = ("_fence_keys", "cluster", "per_resource", "prefix", "scope")

    #: Fence keys remembered per data key: a hot key costs one dict lookup, not a parse.
    CACHE_SIZE = 4096

    def __init__(self, prefix: str, scope: FenceScope | str, *, cluster: bool) -> None:
        if not isinstance(prefix, str) or "{" in prefix or "}" in prefix:
            raise ConfigurationError(f"prefix must be a str without braces, got {prefix!r}")
        if not prefix:
            raise ConfigurationError(
                "prefix must not be empty: every key starting with it is reserved for fences"
                " and lock state, and an empty prefix would reserve every key; use the lock"
                " manager's prefix (the default is 'fence:')"
            )
        try:
            self.scope = FenceScope(scope)
        except ValueError:
            raise ConfigurationError(
                f"fence scope must be 'key' or 'resource', got {scope!r}"
            ) from None
        self.prefix = prefix
        self.per_resource = self.scope is FenceScope.RESOURCE
        self.cluster = cluster
        self._fence_keys: dict[str, str] = {}

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
            found = f"{self.prefix}{{{resource}}}:fence"
        else:
            found = f"{self.prefix}{{{resource}}}:key:{key}"
        if data:
            if len(self._fence_keys) >= self.CACHE_SIZE:
                self._fence_keys.clear()
            self._fence_keys[key] = found
        return found

    def issuer_key(self, key: str) -> str:
        """The lock manager's issued-token counter for the resource of ``key``."""
        return f"{self.prefix}{{{self.resource(key)}}}:token"


def _tagged_example(key: str, *, bare: bool = False) -> str:
    """``order:9:status`` -> ``{order:9}:status`` (or ``order:9`` with ``bare``)."""
    resource, sep, rest = key.rpartition(":")
    if not resource:
        return key if bare else f"{{{key}}}"
    return resource if bare else f"{{{resource}}}{sep}{rest}"


# -- operations -------------------------------------------------------------------------


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
    """A fenced ``SET``; ``ttl`` (seconds) expires the value only, never the fence."""
    px = b"" if ttl is None else b"%d" % max(1, math.ceil(validate_ttl(ttl) * 1000))
    return Op("set", key, (value, px), must_exist)


def op_hset(key: str, mapping: Mapping[Any, Any], must_exist: bool) -> Op:
    """A fenced ``HSET`` of the fields in ``mapping``."""
    if not mapping:
        raise ConfigurationError("hset needs at least one field")
    args: list[Any] = []
    for field, value in mapping.items():
        args += (field, value)
    return Op("hset", key, tuple(args), must_exist)


def op_incr(key: str, amount: int, must_exist: bool) -> Op:
    """A fenced ``INCRBY``; ``amount`` is an ``int`` (floats are refused)."""
    if isinstance(amount, bool) or not isinstance(amount, int):
        raise ConfigurationError(f"incr amount must be an int, got {amount!r}")
    return Op("incrby", key, (str(amount),), must_exist)


def op_rpush(key: str, values: Sequence[Any], must_exist: bool) -> Op:
    """A fenced ``RPUSH`` of ``values``."""
    if not values:
        raise ConfigurationError("rpush needs at least one value")
    return Op("rpush", key, tuple(values), must_exist)


def op_xadd(
    key: str, fields: Mapping[Any, Any], entry_id: str, maxlen: int | None, must_exist: bool
) -> Op:
    """A fenced ``XADD`` of ``fields``, with an approximate ``MAXLEN`` trim if given."""
    if not fields:
        raise ConfigurationError("xadd needs at least one field")
    if maxlen is not None and (isinstance(maxlen, bool) or not isinstance(maxlen, int)):
        raise ConfigurationError(f"maxlen must be an int or None, got {maxlen!r}")
    args: list[Any] = [entry_id, "" if maxlen is None else str(maxlen)]
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
) -> tuple[list[str], list[Any]]:
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
    keys: list[str] = []
    # Numbers and fixed words go as bytes: redis-py passes bytes through but encodes every
    # str and int on each call, which is most of the client's cost of a fenced write.
    argv: list[Any] = [b"%d" % token, b"%d" % len(ops), b"3" if issuer else b"2"]
    for op in ops:
        keys.append(layout.fence_key(op.key, data=op.code != "claim"))
        keys.append(op.key)
        if issuer:
            keys.append(layout.issuer_key(op.key))
        argv += (
            _OPCODES.get(op.code) or op.code,
            b"1" if op.must_exist else b"0",
            b"%d" % len(op.args),
            *op.args,
        )
    if one_slot and len(ops) > 1:
        check_one_slot([op.key for op in ops])
    return keys, argv


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


def _int_or_none(raw: Any) -> int | None:
    if raw is None or raw in ("", b""):
        return None
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return int(text) if text.isdigit() else None


def decode(token: int, ops: Sequence[Op], reply: Any) -> list[Any] | StaleTokenError:
    """Turn a :data:`WRITE` reply into per-operation results, or the rejection.

    Returns:
        The results in operation order, or the :class:`fence.StaleTokenError` to raise
        (for several operations, ``rejected`` lists one error per rejected key, C6).
    """
    if not isinstance(reply, list | tuple):  # a single operation's number, bare
        return [reply]
    if int(reply[0]) == 1:
        return list(reply[1:])
    errors: list[StaleTokenError] = []
    for at in range(1, len(reply), 4):
        op = ops[int(reply[at]) - 1]
        reason = reply[at + 1]
        reason = reason.decode() if isinstance(reason, bytes) else str(reason)
        fence = _int_or_none(reply[at + 2])
        if reason == "UNISSUED":
            errors.append(
                UnissuedTokenError(op.key, token, fence, issued=_int_or_none(reply[at + 3]) or 0)
            )
        else:
            errors.append(StaleTokenError(op.key, token, fence, Reason(reason)))
    if len(errors) == 1 and len(ops) == 1:
        return errors[0]
    first = errors[0]
    return StaleTokenError(first.scope, token, first.fence, first.reason, rejected=tuple(errors))


def parse_fence(scope: str, raw: Any) -> int | None:
    """The fence stored at a fence key, or ``None``; raise if it is not an integer.

    Raises:
        StaleTokenError: reason ``UNVERIFIABLE``, the fence key holds something else.
    """
    if raw is None or raw in ("", b""):
        return None
    value = _int_or_none(raw)
    if value is None:
        raise StaleTokenError(
            scope,
            0,
            None,
            Reason.UNVERIFIABLE,
            message=f"{scope}: the fence key holds {raw!r}, not an integer; refusing to guess",
        )
    return value
