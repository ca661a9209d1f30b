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
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any, NamedTuple

from redis.crc import key_slot

from fence import (
    BackendError,
    ConfigurationError,
    FenceError,
    InvalidResourceError,
    Reason,
    StaleTokenError,
    validate_resource,
    validate_ttl,
)
from fence._core import batch_rejection
from fence._lua import Script

__all__ = [
    "HSET",
    "HSET_MAX_ARGS",
    "MANY",
    "MAX_TTL_MS",
    "MAX_XADD_FIELDS",
    "READ",
    "SET",
    "WRITE",
    "CrossSlotError",
    "FenceScope",
    "KeyLayout",
    "Op",
    "PartialWriteError",
    "RefusedWrite",
    "UnissuedTokenError",
    "WriteRefusedError",
    "command",
    "hash_tag",
    "many_part",
    "resource_of",
]

#: The longest expiry of a value, in milliseconds (about 285,000 years). Redis refuses an
#: expiry whose deadline leaves int64 milliseconds; this bound keeps every one far inside.
MAX_TTL_MS = 2**53 - 1

#: The most fields one XADD entry may have. An entry is one command, which the script
#: builds with Lua's ``unpack``; that stops near 8000 values ("too many results to unpack").
MAX_XADD_FIELDS = 3000

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_U64_MAX = 2**64 - 1


# -- the scripts ------------------------------------------------------------------------

#: Check every fence and every operation, then apply them all: one atomic, fenced step
#: (C4-C8), all or nothing (C6).
WRITE_LUA = """
-- KEYS: for each operation i, a group of STRIDE keys:
--   KEYS[g+1]  the fence key (per-key fence, or the resource's fence register)
--   KEYS[g+2]  the data key (for a claim, the fence key again)
--   KEYS[g+3]  the resource's issued-token counter (only when STRIDE is 3)
-- ARGV[1]  the token, a decimal string (validated by the client: 1 <= t <= 2^53-1)
-- ARGV[2]  N, the number of operations
-- ARGV[3]  STRIDE: 2, or 3 to reject tokens above the issued counter
-- then, for each operation: opcode, must-exist flag ("1"/"0"), argc, argc arguments.
--   set     value, px ("" for no expiry; 1..2^53-1, checked by the client)  -> 1
--   hset    field, value, ...                 -> fields added
--   del                                       -> keys removed (0/1)
--   incrby  amount (a canonical int64, checked by the client)   -> the new value (as a
--           decimal string from 2^53 on, where a Lua number is no longer exact)
--   rpush   value, ...                        -> the list length
--   xadd    id ("*", "<ms>-*" or "<ms>-<seq>": canonical, above 0-0, checked by the
--           client), maxlen ("" for none), field, value, ...  -> the entry id
--   claim                                     -> 1 (raises the fence only)
--   get                                       -> the string value or nil (registering read)
--   hgetall                                   -> the flat field/value array (registering read)
-- Returns, by its first element:
--   {1, result_1, ..., result_N}: every check passed and every operation was applied (a
--     single operation whose result is a number returns just that number: a table reply
--     costs the server about a microsecond more, as much as the fence check itself);
--   {0, i, reason, fence, issued, ...}: the token verdict on each rejected operation i,
--     reason STALE, MISSING, UNISSUED or UNVERIFIABLE, fence the stored fence ("" if none),
--     issued the issued counter ("" unless UNISSUED); nothing is written;
--   {2, i, code, detail, ...}: operations Redis would refuse, whatever the token: code
--     WRONGTYPE, NOT_INTEGER, OVERFLOW, STREAM_ID, STREAM_EXHAUSTED, TOO_LARGE or NOPERM
--     (found by the checks), or ERROR with the server's own error as detail (a single
--     operation's write failed before anything was written); nothing is written;
--   {3, i, 'ERROR', detail}: operation i failed while applying after earlier writes of
--     this call landed (PARTIAL). The checks are meant to make this unreachable; it is
--     reported, never hidden.
-- A batch is checked whole before its first write, against the state its own earlier
-- operations leave (types, integers, stream ids), so no error can surface halfway. A
-- token verdict wins over data refusals: they are only reported when no token is refused.
local token = ARGV[1]
local tnum = tonumber(token)
local n = tonumber(ARGV[2])
local stride = tonumber(ARGV[3])
local match, sub, byte = string.match, string.sub, string.byte
-- Values per HSET/RPUSH call: Lua's unpack fails near 8000 values ("too many results").
local CHUNK = 1000

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

local function failed(r)  -- a redis.pcall error reply
  return type(r) == 'table' and r.err
end

-- Apply one data operation whose arguments start at ARGV[a]. Returns its result, or the
-- error reply and whether part of the operation was written before it.
local function apply(op, a, argc, dkey)
  if op == 'set' then
    local r
    if ARGV[a + 1] == '' then
      r = redis.pcall('SET', dkey, ARGV[a])
    else
      r = redis.pcall('SET', dkey, ARGV[a], 'PX', ARGV[a + 1])
    end
    if r.err then return r, false end
    return 1
  elseif op == 'hset' or op == 'rpush' then
    local cmd, last, out = op == 'hset' and 'HSET' or 'RPUSH', a + argc - 1, 0
    for from = a, last, CHUNK do
      local r = redis.pcall(cmd, dkey, unpack(ARGV, from, math.min(from + CHUNK - 1, last)))
      if failed(r) then return r, from > a end
      if cmd == 'HSET' then out = out + r else out = r end
    end
    return out
  elseif op == 'del' then
    return redis.pcall('DEL', dkey)
  elseif op == 'incrby' then
    local r = redis.pcall('INCRBY', dkey, ARGV[a])
    -- Lua holds the reply as a double: from 2^53 on, read the exact value back instead.
    if type(r) == 'number' and (r >= 9007199254740992 or r <= -9007199254740992) then
      return redis.call('GET', dkey)
    end
    return r
  elseif op == 'xadd' then
    if ARGV[a + 1] == '' then
      return redis.pcall('XADD', dkey, ARGV[a], unpack(ARGV, a + 2, a + argc - 1))
    end
    return redis.pcall('XADD', dkey, 'MAXLEN', '~', ARGV[a + 1], ARGV[a],
                       unpack(ARGV, a + 2, a + argc - 1))
  elseif op == 'get' then
    return redis.pcall('GET', dkey)
  elseif op == 'hgetall' then
    return redis.pcall('HGETALL', dkey)
  end
  return 1  -- claim
end

-- An XADD entry above 1 GiB of fields and values: Redis refuses it after creating the key.
local function too_large(a, argc)
  local size = 0
  for j = a + 2, a + argc - 1 do size = size + #ARGV[j] end
  return size > 1073741824
end

-- One operation (the common case): check, then write the data before the fence. An error
-- of the data write (a wrong type, not an integer, a stream id, the server's state) comes
-- before anything was written, and the fence write's permission is checked up front.
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
  local op, argc = ARGV[4], tonumber(ARGV[6])
  if fstr ~= token and not redis.acl_check_cmd('SET', fkey, token) then
    return {2, 1, 'NOPERM', 'the user may not SET the fence key ' .. fkey}
  end
  if op == 'xadd' and too_large(7, argc) then
    return {2, 1, 'TOO_LARGE', 'the fields and values of the entry exceed 1 GiB'}
  end
  local r, partly = apply(op, 7, argc, dkey)
  if failed(r) then return {partly and 3 or 2, 1, 'ERROR', r.err} end
  if fstr ~= token then
    local w = redis.pcall('SET', fkey, token)
    if w.err then
      local wrote = op ~= 'claim' and op ~= 'get' and op ~= 'hgetall'
      return {wrote and 3 or 2, 1, 'ERROR', w.err}
    end
  end
  if type(r) == 'number' then return r end
  return {1, r}
end

-- A batch. Integers are int64 as Redis parses them (string2ll): "0", or an optional "-"
-- and a digit 1-9 then digits, under 21 bytes, in range. A double holds 53 bits, so a
-- value is kept as two exact halves, hi * 10^9 + lo with 0 <= lo < 10^9.
local BASE = 1000000000
local MAX_HI, MAX_LO, MIN_HI, MIN_LO = 9223372036, 854775807, -9223372037, 145224192

local function int64(s)  -- (hi, lo), or nil if Redis would not take s as an integer
  if s == '0' then return 0, 0 end
  if #s > 20 or not match(s, '^%-?[1-9]%d*$') then return nil end
  local neg = byte(s, 1) == 45  -- '-'
  local digits = neg and sub(s, 2) or s
  local hi, lo = 0, tonumber(digits)
  if #digits > 9 then hi, lo = tonumber(sub(digits, 1, -10)), tonumber(sub(digits, -9)) end
  if neg then
    hi, lo = -hi, -lo
    if lo < 0 then hi, lo = hi - 1, lo + BASE end
  end
  if hi > MAX_HI or (hi == MAX_HI and lo > MAX_LO) then return nil end
  if hi < MIN_HI or (hi == MIN_HI and lo < MIN_LO) then return nil end
  return hi, lo
end

local function add64(ahi, alo, bhi, blo)  -- the sum, or nil if it leaves int64
  local hi, lo = ahi + bhi, alo + blo
  if lo >= BASE then hi, lo = hi + 1, lo - BASE end
  if hi > MAX_HI or (hi == MAX_HI and lo > MAX_LO) then return nil end
  if hi < MIN_HI or (hi == MIN_HI and lo < MIN_LO) then return nil end
  return hi, lo
end

-- Stream ids: two uint64 parts as canonical decimal strings, compared as numbers.
local U64_MAX = '18446744073709551615'
local function ucmp(x, y)
  if #x ~= #y then return #x < #y and -1 or 1 end
  if x == y then return 0 end
  return x < y and -1 or 1
end
local function usucc(x)  -- x + 1 (x below U64_MAX)
  local i = #x
  while byte(x, i) == 57 do i = i - 1 end  -- '9'
  if i == 0 then return '1' .. string.rep('0', #x) end
  return sub(x, 1, i - 1) .. string.char(byte(x, i) + 1) .. string.rep('0', #x - i)
end
local function last_id(dkey)  -- the stream's last generated id, which deletions keep
  local info = redis.call('XINFO', 'STREAM', dkey)
  for j = 1, #info, 2 do
    if info[j] == 'last-generated-id' then return match(info[j + 1], '^(%d+)-(%d+)$') end
  end
end

local COMMANDS = {set = 'SET', hset = 'HSET', del = 'DEL', incrby = 'INCRBY',
                  rpush = 'RPUSH', xadd = 'XADD'}
local WANTS = {hset = 'hash', rpush = 'list', xadd = 'stream', incrby = 'string',
               get = 'string', hgetall = 'hash'}

-- The checks of one operation against the simulated state; return code, detail if Redis
-- would refuse it, else apply its effect to the state.
local types, ints, streams, fences, allowed = {}, {}, {}, {}, {}
local function check(op, a, argc, dkey, now)
  local want = WANTS[op]
  if want and now ~= 'none' and now ~= want then
    return 'WRONGTYPE', op .. ' needs a ' .. want .. ', found a ' .. now
  end
  local cmd = COMMANDS[op]
  if cmd and not redis.acl_check_cmd(cmd, dkey, unpack(ARGV, a, math.min(a + 2, a + argc - 1))) then
    return 'NOPERM', 'the user may not run ' .. cmd .. ' on ' .. dkey
  end
  if op == 'incrby' then
    local v = ints[dkey]
    if now == 'none' then
      v = {0, 0}
    elseif v == nil then
      v = redis.call('GET', dkey)
    end
    if type(v) == 'string' then
      local hi, lo = int64(v)
      if hi == nil then return 'NOT_INTEGER', 'the value is not an integer or out of range' end
      v = {hi, lo}
    end
    local bhi, blo = int64(ARGV[a])
    if bhi == nil then return 'NOT_INTEGER', 'the amount is not a 64-bit integer' end
    local hi, lo = add64(v[1], v[2], bhi, blo)
    if hi == nil then return 'OVERFLOW', 'increment or decrement would overflow' end
    ints[dkey], types[dkey] = {hi, lo}, 'string'
  elseif op == 'xadd' then
    if too_large(a, argc) then
      return 'TOO_LARGE', 'the fields and values of the entry exceed 1 GiB'
    end
    local last = streams[dkey]
    if now == 'none' then
      last = {'0', '0'}
    elseif last == nil then
      last = {last_id(dkey)}
    end
    local lms, lseq = last[1], last[2]
    if lms == U64_MAX and lseq == U64_MAX then
      return 'STREAM_EXHAUSTED', 'the stream has reached the last possible id'
    end
    local id = ARGV[a]
    local ms, seq = match(id, '^(%d+)-(%d+)$')
    if id == '*' then  -- from the clock or last + 1: above last, and exact at the top
      if lseq == U64_MAX then ms, seq = usucc(lms), '0' else ms, seq = lms, usucc(lseq) end
    elseif ms == nil then  -- <ms>-*
      ms = match(id, '^(%d+)-%*$')
      if ms == lms then
        if lseq == U64_MAX then
          return 'STREAM_ID', 'no sequence number is left after ' .. lms .. '-' .. lseq
        end
        seq = usucc(lseq)
      else
        seq = '0'
      end
    end
    local c = ucmp(ms, lms)
    if c < 0 or (c == 0 and ucmp(seq, lseq) <= 0) then
      return 'STREAM_ID', 'the id ' .. ms .. '-' .. seq .. ' is not above the last id '
                          .. lms .. '-' .. lseq
    end
    streams[dkey], types[dkey] = {ms, seq}, 'stream'
  elseif op == 'set' then
    ints[dkey], streams[dkey], types[dkey] = ARGV[a], nil, 'string'
  elseif op == 'del' then
    ints[dkey], streams[dkey], types[dkey] = nil, nil, 'none'
  elseif op == 'hset' or op == 'rpush' then
    types[dkey] = want
  end
  return nil
end

local rejected, refused = {}, {}
local pos = 4
for i = 1, n do
  local g = (i - 1) * stride
  local fkey, dkey = KEYS[g + 1], KEYS[g + 2]
  local op, must, argc = ARGV[pos], ARGV[pos + 1] == '1', tonumber(ARGV[pos + 2])
  local a = pos + 3
  pos = a + argc

  local fstr = fences[fkey]
  if fstr == nil then
    fstr = redis.call('GET', fkey)
    fences[fkey] = fstr
  end
  local reason, issued = verdict(fkey, stride == 3 and KEYS[g + 3], fstr)
  local now = types[dkey]
  if reason == nil and (must or WANTS[op]) and now == nil then
    now = redis.call('TYPE', dkey)['ok']
    types[dkey] = now
  end
  if reason == nil and must and now == 'none' then reason = 'MISSING' end
  if reason then
    for _, v in ipairs({i, reason, fstr or '', issued}) do rejected[#rejected + 1] = v end
  elseif #rejected == 0 then
    local code, detail = check(op, a, argc, dkey, now)
    if code == nil and fstr ~= token and allowed[fkey] == nil then
      allowed[fkey] = redis.acl_check_cmd('SET', fkey, token)
      if not allowed[fkey] then code, detail = 'NOPERM', 'the user may not SET ' .. fkey end
    end
    if code then
      for _, v in ipairs({i, code, detail}) do refused[#refused + 1] = v end
    end
  end
end
if #rejected > 0 then
  table.insert(rejected, 1, 0)
  return rejected
end
if #refused > 0 then
  table.insert(refused, 1, 2)
  return refused
end

-- Apply. Every check passed, so no error is expected; one is reported, never hidden.
local out, wrote = {1}, false
pos = 4
for i = 1, n do
  local g = (i - 1) * stride
  local fkey, dkey = KEYS[g + 1], KEYS[g + 2]
  local op, argc = ARGV[pos], tonumber(ARGV[pos + 2])
  local r, partly = apply(op, pos + 3, argc, dkey)
  if failed(r) then return {(wrote or partly) and 3 or 2, i, 'ERROR', r.err} end
  wrote = wrote or op ~= 'claim'
  out[i + 1] = r
  pos = pos + 3 + argc
  if fences[fkey] ~= token then
    local w = redis.pcall('SET', fkey, token)
    if w.err then return {wrote and 3 or 2, i, 'ERROR', w.err} end
    fences[fkey], wrote = token, true
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


#: The hottest path on its own: one fenced SET, no must-exist, no issuer check. Fewer
#: arguments to pack and parse than the general script, same verdicts and reply shape.
SET_LUA = """
-- KEYS[1] the fence key     KEYS[2] the data key
-- ARGV[1] the token, a decimal string     ARGV[2] the value     ARGV[3] px (optional)
-- Returns 1 when written, else {0, 1, reason, fence, ''} as the general write script,
-- with reason STALE or UNVERIFIABLE; nothing is written then. A SET cannot fail on the
-- data (any type is replaced, px is checked by the client); a failure of the server's
-- state (OOM, READONLY, ...) stops the first write, so it comes with nothing written; a user
-- that may not SET the fence key gets {2, 1, 'NOPERM', detail} before any write. A
-- fence write that fails after the value landed returns {3, 1, 'ERROR', error}.
local token = ARGV[1]
local fstr = redis.call('GET', KEYS[1])
if fstr ~= token and fstr then
  if not string.match(fstr, '^%d+$') then return {0, 1, 'UNVERIFIABLE', fstr, ''} end
  if tonumber(token) < tonumber(fstr) then return {0, 1, 'STALE', fstr, ''} end
end
if fstr ~= token and not redis.acl_check_cmd('SET', KEYS[1], token) then
  return {2, 1, 'NOPERM', 'the user may not SET the fence key ' .. KEYS[1]}
end
if ARGV[3] then
  redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
else
  redis.call('SET', KEYS[2], ARGV[2])
end
if fstr ~= token then
  local w = redis.pcall('SET', KEYS[1], token)
  if w.err then return {3, 1, 'ERROR', w.err} end
end
return 1
"""

#: A fenced HSET of a few fields, on its own for the same reason as :data:`SET_LUA`.
HSET_LUA = """
-- KEYS[1] the fence key     KEYS[2] the data key
-- ARGV[1] the token, a decimal string     ARGV[2..] field, value, ... (at most HSET_MAX_ARGS)
-- Returns the number of fields added when written, else {0, 1, reason, fence, ''} as the
-- general write script (STALE or UNVERIFIABLE), or {2, 1, 'ERROR', error} when Redis
-- refused the HSET (a key of another type, the server's state), {2, 1, 'NOPERM', detail}
-- when the user may not write the fence key: nothing is written then.
-- A fence write that fails after the fields landed returns {3, 1, 'ERROR', error}.
local token = ARGV[1]
local fstr = redis.call('GET', KEYS[1])
if fstr ~= token and fstr then
  if not string.match(fstr, '^%d+$') then return {0, 1, 'UNVERIFIABLE', fstr, ''} end
  if tonumber(token) < tonumber(fstr) then return {0, 1, 'STALE', fstr, ''} end
end
if fstr ~= token and not redis.acl_check_cmd('SET', KEYS[1], token) then
  return {2, 1, 'NOPERM', 'the user may not SET the fence key ' .. KEYS[1]}
end
local r = redis.pcall('HSET', KEYS[2], unpack(ARGV, 2))
if type(r) == 'table' and r.err then return {2, 1, 'ERROR', r.err} end
if fstr ~= token then
  local w = redis.pcall('SET', KEYS[1], token)
  if w.err then return {3, 1, 'ERROR', w.err} end
end
return r
"""

#: The most arguments (fields and values) :data:`HSET_LUA` takes; more go to :data:`WRITE`,
#: which applies them in chunks (Lua's ``unpack`` stops near 8000 values).
HSET_MAX_ARGS = 1000

#: Several independent fenced sets and hsets in one call: a pipeline's run of them.
MANY_LUA = """
-- KEYS[2i-1] the fence key of write i     KEYS[2i] its data key
-- ARGV: for each write i: its token (a decimal string), 's' (set), 'p' (set with px) or
--   'h' (hset), then its arguments: the value; the value and px; or argc, then argc
--   fields and values (at most HSET_MAX_ARGS).
-- Returns one reply per write, as SET_LUA and HSET_LUA would: 1 or the number of fields
-- added when written, else {0, 1, reason, fence, ''}, {2, 1, code, detail} (nothing of
-- that write was written) or {3, 1, 'ERROR', error}. Each write stands alone: a refused
-- write does not stop the others.
local out, a = {}, 1
local match, call, pcall = string.match, redis.call, redis.pcall
for i = 1, #KEYS / 2 do
  local fkey, dkey = KEYS[2 * i - 1], KEYS[2 * i]
  local token, kind = ARGV[a], ARGV[a + 1]
  local first, last
  if kind == 'h' then
    first, last = a + 3, a + 2 + tonumber(ARGV[a + 2])
  elseif kind == 'p' then
    first, last = a + 2, a + 3
  else
    first, last = a + 2, a + 2
  end
  a = last + 1
  local fstr = call('GET', fkey)
  local reply
  if fstr ~= token and fstr then
    if not match(fstr, '^%d+$') then
      reply = {0, 1, 'UNVERIFIABLE', fstr, ''}
    elseif tonumber(token) < tonumber(fstr) then
      reply = {0, 1, 'STALE', fstr, ''}
    end
  end
  if reply == nil and fstr ~= token and not redis.acl_check_cmd('SET', fkey, token) then
    reply = {2, 1, 'NOPERM', 'the user may not SET the fence key ' .. fkey}
  end
  if reply == nil then
    local r
    if kind == 'h' then
      r = pcall('HSET', dkey, unpack(ARGV, first, last))
    elseif kind == 'p' then
      r = pcall('SET', dkey, ARGV[first], 'PX', ARGV[last])
    else
      r = pcall('SET', dkey, ARGV[first])
    end
    if type(r) == 'table' and r.err then
      reply = {2, 1, 'ERROR', r.err}
    else
      reply = (kind == 'h') and r or 1
      if fstr ~= token then
        local w = pcall('SET', fkey, token)
        if w.err then reply = {3, 1, 'ERROR', w.err} end
      end
    end
  end
  out[i] = reply
end
return out
"""

WRITE = Script.of("fenced-write", WRITE_LUA)
SET = Script.of("fenced-set", SET_LUA)
HSET = Script.of("fenced-hset", HSET_LUA)
MANY = Script.of("fenced-many", MANY_LUA)
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


@dataclass(frozen=True, slots=True)
class RefusedWrite:
    """One operation Redis would refuse whatever the token, in a :class:`WriteRefusedError`.

    Attributes:
        index: the operation's position in its batch (0 for a single write).
        key: the data key.
        op: the guard method: ``set``, ``hset``, ``delete``, ``incr``, ``rpush``, ``xadd``,
            ``claim``, ``read_for_update`` or ``hgetall_for_update``.
        reason: ``WRONGTYPE`` (the key holds another type), ``NOT_INTEGER`` (``incr`` on a
            value Redis does not read as a 64-bit integer), ``OVERFLOW`` (the sum leaves
            int64), ``STREAM_ID`` (an ``xadd`` id at or below the stream's last id),
            ``STREAM_EXHAUSTED`` (the stream reached the last possible id), ``TOO_LARGE``
            (an entry above 1 GiB), ``NOPERM`` (the ACL of the guard's user forbids the
            command), or ``ERROR`` (another error of the server, in ``detail``).
        detail: a sentence: what Redis said or would say.
    """

    index: int
    key: str
    op: str
    reason: str
    detail: str


class WriteRefusedError(FenceError):
    """Redis would refuse some operations of a write, whatever the token; nothing was written.

    The guard checks every operation of a batch inside its script before the first write
    (C6), and a single write's data command runs before its fence is raised, so a data
    error never leaves half a write behind. This is not a verdict on the token: the token
    may be current. Fix the data or the call, then write again. When a batch has stale
    tokens too, :class:`fence.StaleTokenError` is raised instead: the token verdict wins.

    Attributes:
        token: the token of the write.
        refused: one :class:`RefusedWrite` per refused operation, in batch order.
    """

    def __init__(
        self, token: int, refused: Sequence[RefusedWrite], *, message: str | None = None
    ) -> None:
        refused = tuple(refused)
        if message is None:
            items = "; ".join(
                f"#{r.index} {r.op} {r.key!r}: {r.reason} ({r.detail})" for r in refused
            )
            what = f"{len(refused)} operations of this" if len(refused) > 1 else "this"
            message = (
                f"Redis would refuse {what} write with token {token}, so nothing was"
                f" written: {items}. This is not a token verdict: fix the data or the call"
                " and write again."
            )
        super().__init__(message)
        self.token = token
        self.refused = refused


class PartialWriteError(BackendError):
    """A fenced write failed halfway: some of its operations were applied (``code="PARTIAL"``).

    The guard's checks are meant to make this impossible (C6); when a case nobody foresaw
    gets through, it is reported, never hidden. The operations in ``applied`` were written
    and their fences raised; ``failed`` was not (or only in part); later ones were not.
    Inspect the keys before trying again, and please report it.

    Attributes:
        token: the token of the write.
        applied: the indices of the operations that were applied.
        failed: the operation that failed, with the server's error as ``detail``.
    """

    def __init__(
        self,
        token: int,
        *,
        applied: Sequence[int],
        failed: RefusedWrite,
        message: str | None = None,
    ) -> None:
        applied = tuple(applied)
        if message is None:
            done = (
                f"operations {list(applied)} were applied and their fences raised"
                if applied
                else "its data may have been written without its fence"
            )
            message = (
                f"PARTIAL: a fenced write with token {token} failed while applying #"
                f"{failed.index} {failed.op} {failed.key!r} ({failed.detail}) after part of"
                f" it landed: {done}. All-or-nothing is broken for this write: inspect"
                " these keys before writing again, and report it (the guard's checks should"
                " have refused it before any write)."
            )
        super().__init__(message, code="PARTIAL", retryable=False)
        self.token = token
        self.applied = applied
        self.failed = failed


for _cls in (
    CrossSlotError,
    UnissuedTokenError,
    RefusedWrite,
    WriteRefusedError,
    PartialWriteError,
):
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
        fence = layout.fence_key(op.key, data=op.code != "claim")
        keys.append(fence)
        # A claim touches no data; its scope may be a bare resource name, which is no key
        # the guard's ACL user may have (KEYS must be accessible). Its fence key stands in.
        keys.append(fence if op.code == "claim" else op.key)
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


def command(
    layout: KeyLayout, token: int, op: Op, *, issuer: bool
) -> tuple[Script, list[str], list[Any]]:
    """The script, ``KEYS`` and ``ARGV`` of one fenced write, the leanest that does it.

    A plain set and a small hset have scripts of their own with half the arguments of the
    general :data:`WRITE` (packing them is most of the client's cost); everything else,
    and every write under ``must_exist`` or the issuer check, goes through :data:`WRITE`.
    All three reply in the shape :func:`decode` reads.
    """
    if not (op.must_exist or issuer):
        if op.code == "set":
            value, px = op.args
            keys = [layout.fence_key(op.key), op.key]
            return SET, keys, ([b"%d" % token, value, px] if px else [b"%d" % token, value])
        if op.code == "hset" and len(op.args) <= HSET_MAX_ARGS:
            return HSET, [layout.fence_key(op.key), op.key], [b"%d" % token, *op.args]
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
        head = [layout.fence_key(op.key), op.key, b"%d" % token]
        return [*head, b"p", value, px] if px else [*head, b"s", value]
    if op.code == "hset" and len(op.args) <= HSET_MAX_ARGS:
        key = op.key
        return [layout.fence_key(key), key, b"%d" % token, b"h", b"%d" % len(op.args), *op.args]
    return None


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


#: The guard method behind each opcode, for errors.
METHODS = {
    "set": "set",
    "hset": "hset",
    "del": "delete",
    "incrby": "incr",
    "rpush": "rpush",
    "xadd": "xadd",
    "claim": "claim",
    "get": "read_for_update",
    "hgetall": "hgetall_for_update",
}

#: Error replies that are about the server's state, not one operation: the code the guard
#: raises them with, whether retrying may help, and what to do.
SERVER_STATES: dict[str, tuple[str, bool, str]] = {
    "OOM": ("OOM", False, "Redis is at maxmemory; free memory or raise maxmemory"),
    "READONLY": ("READONLY", True, "this server is a read-only replica; write to the master"),
    "MISCONF": ("MISCONF", False, "Redis refuses writes after a failed save; check its disk"),
    "NOREPLICAS": ("NOREPLICAS", True, "too few replicas for min-replicas-to-write"),
    "NOPERM": ("PERMISSION", False, "the ACL of the guard's user forbids it; see acl_rules()"),
    "BUSY": ("BUSY", True, "a long script is running; retry when it is done"),
    "LOADING": ("LOADING", True, "Redis is loading its dataset; retry shortly"),
    "MASTERDOWN": ("MASTERDOWN", True, "the replica lost its master; retry after failover"),
    "CLUSTERDOWN": ("CLUSTERDOWN", True, "the cluster is down; retry when it is back"),
    "TRYAGAIN": ("TRYAGAIN", True, "the slot is being migrated; retry"),
}

#: A data error reply (from ``redis.pcall``) -> the reason of its RefusedWrite.
_DATA_ERRORS = (
    ("WRONGTYPE", "WRONGTYPE"),
    ("NOPERM", "NOPERM"),
    ("ERR The user executing the script can't", "NOPERM"),  # Redis 7.0 inside a script
    ("ERR value is not an integer", "NOT_INTEGER"),
    ("ERR increment or decrement would overflow", "OVERFLOW"),
    ("ERR The ID specified in XADD", "STREAM_ID"),
    ("ERR The stream has exhausted", "STREAM_EXHAUSTED"),
    ("ERR Elements are too large", "TOO_LARGE"),
)


def server_state(message: str) -> str | None:
    """The :data:`SERVER_STATES` entry an error reply starts with, if any."""
    word = message.split(" ", 1)[0]
    return word if word in SERVER_STATES else None


def _text(raw: Any) -> str:
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)


def _refusal(ops: Sequence[Op], at: Any, code: Any, detail: Any) -> RefusedWrite:
    index = int(at) - 1
    op = ops[index]
    reason, text = _text(code), _text(detail)
    if reason == "ERROR":
        reason = next((r for prefix, r in _DATA_ERRORS if text.startswith(prefix)), "ERROR")
    return RefusedWrite(index, op.key, METHODS.get(op.code, op.code), reason, text)


def decode(token: int, ops: Sequence[Op], reply: Any) -> list[Any] | FenceError:
    """Turn a :data:`WRITE` or :data:`SET` reply into per-operation results, or an error.

    Returns:
        The results in operation order, or the error to raise: a
        :class:`fence.StaleTokenError` (for several operations, ``rejected`` lists one
        error per rejected key, C6), a :class:`WriteRefusedError`, a
        :class:`fence.BackendError` for a server state that refused the first write, or a
        :class:`PartialWriteError`.
    """
    if not isinstance(reply, list | tuple):  # a single operation's number, bare
        return [reply]
    status = int(reply[0])
    if status == 1:
        results = list(reply[1:])
        for i, op in enumerate(ops):
            if op.code == "incrby":  # above 2**53 the script sends the exact decimal string
                results[i] = int(results[i])
        return results
    if status == 2:
        refused = [_refusal(ops, *reply[at : at + 3]) for at in range(1, len(reply), 3)]
        state = server_state(refused[0].detail) if len(refused) == 1 else None
        if state is not None and refused[0].reason == "ERROR":
            code, retryable, advice = SERVER_STATES[state]
            item = refused[0]
            return BackendError(
                f"{item.key}: Redis refused the {item.op} with token {token} before writing"
                f" anything: {item.detail} ({advice})",
                code=code,
                retryable=retryable,
            )
        return WriteRefusedError(token, refused)
    if status == 3:
        failed = _refusal(ops, *reply[1:4])
        return PartialWriteError(token, applied=range(failed.index), failed=failed)
    errors: list[StaleTokenError] = []
    for at in range(1, len(reply), 4):
        op = ops[int(reply[at]) - 1]
        reason = _text(reply[at + 1])
        fence = _int_or_none(reply[at + 2])
        if reason == "UNISSUED":
            errors.append(
                UnissuedTokenError(op.key, token, fence, issued=_int_or_none(reply[at + 3]) or 0)
            )
        else:
            errors.append(StaleTokenError(op.key, token, fence, Reason(reason)))
    if len(ops) == 1:
        return errors[0]
    return batch_rejection(resource_of(errors[0].scope), token, errors)


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
