"""The Lua scripts of the Redis guard.

The scripts are named constants, each with a header that says what ``KEYS`` and ``ARGV``
hold and what it returns, and each is sent as a :class:`fence._lua.Script`. What the guard
does around them without I/O is written once for the sync and the asyncio guard, in
modules of its own: the key layout (C12) in :mod:`fence._redis_keys`, the encoding of fenced
operations into ``KEYS``/``ARGV`` in ``_redis_ops.py``, the decoding of the replies into
results or :class:`fence.StaleTokenError` in ``_redis_replies.py``, the errors in
``_redis_errors.py``.

Integers: tokens are below ``2**53`` and are sent as decimal strings. The scripts compare
them with ``tonumber`` (exact below ``2**53``; a corrupted fence above it still compares
as larger, because rounding is monotonic) and store the token string as it came, so no
number is ever formatted with ``%g`` on the server.
"""

from __future__ import annotations

from fence._lua import Script

__all__ = [
    "HSET",
    "HSET_LUA",
    "HSET_MAX_ARGS",
    "MANY",
    "MANY_LUA",
    "READ",
    "READ_LUA",
    "SET",
    "SET_LUA",
    "WRITE",
    "WRITE_LUA",
]

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
--     reason STALE, MISSING, UNISSUED or UNVERIFIABLE, fence the stored fence ("" if none,
--     {type} if the fence key holds another type), issued the issued counter ("" unless
--     UNISSUED, {type} if it holds another type); nothing is written;
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

-- What a fence or counter key holds: its string, false if it does not exist, or {type}
-- when it holds another type (a list, a hash, ...), which no token can be compared with.
-- Any other error is raised, as redis.call would raise it.
local function stored(key)
  local value = redis.pcall('GET', key)
  if type(value) == 'table' then
    if sub(value.err, 1, 9) ~= 'WRONGTYPE' then error(value) end
    return {redis.call('TYPE', key)['ok']}
  end
  return value
end

-- The verdict of the fence (and the issuer counter) on this token: nil if it passes, else
-- the reason; with the stored fence and, for UNISSUED, the counter.
local function verdict(fkey, ikey, fstr)
  if fstr and (type(fstr) == 'table' or not match(fstr, '^%d+$')) then
    return 'UNVERIFIABLE', ''
  end
  if fstr and tnum < tonumber(fstr) then return 'STALE', '' end
  if ikey then
    local issued = stored(ikey) or '0'
    if type(issued) == 'table' or not match(issued, '^%d+$') or tnum > tonumber(issued) then
      return 'UNISSUED', issued
    end
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
  local fstr = stored(fkey)
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
    fstr = stored(fkey)
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
-- Returns {fence, value}: fence is the stored fence ("" if none; {type} and no value if
-- the fence key holds another type, a list, a hash, ...); value is the string (nil if
-- absent) or the flat field/value array of the hash.
local fence = redis.pcall('GET', KEYS[1])
if type(fence) == 'table' then
  if string.sub(fence.err, 1, 9) ~= 'WRONGTYPE' then error(fence) end
  return {{redis.call('TYPE', KEYS[1])['ok']}, false}
end
fence = fence or ''
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
-- with reason STALE or UNVERIFIABLE (fence {type} if the fence key holds another type);
-- nothing is written then. A SET cannot fail on the data (any type is replaced, px is
-- checked by the client); a failure of the server's state (OOM, READONLY, ...) stops the
-- first write, so it comes with nothing written; a user that may not SET the fence key
-- gets {2, 1, 'NOPERM', detail} before any write. A fence write that fails after the
-- value landed returns {3, 1, 'ERROR', error}.
local token = ARGV[1]
local fstr = redis.pcall('GET', KEYS[1])
if fstr ~= token and fstr then
  if type(fstr) == 'table' then  -- the fence key holds another type: no fence to compare
    if string.sub(fstr.err, 1, 9) ~= 'WRONGTYPE' then error(fstr) end
    return {0, 1, 'UNVERIFIABLE', {redis.call('TYPE', KEYS[1])['ok']}, ''}
  end
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
-- general write script (STALE or UNVERIFIABLE, fence {type} if the fence key holds another
-- type), or {2, 1, 'ERROR', error} when Redis refused the HSET (a key of another type, the
-- server's state), {2, 1, 'NOPERM', detail} when the user may not write the fence key:
-- nothing is written then.
-- A fence write that fails after the fields landed returns {3, 1, 'ERROR', error}.
local token = ARGV[1]
local fstr = redis.pcall('GET', KEYS[1])
if fstr ~= token and fstr then
  if type(fstr) == 'table' then  -- the fence key holds another type: no fence to compare
    if string.sub(fstr.err, 1, 9) ~= 'WRONGTYPE' then error(fstr) end
    return {0, 1, 'UNVERIFIABLE', {redis.call('TYPE', KEYS[1])['ok']}, ''}
  end
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
local match, sub, call, pcall = string.match, string.sub, redis.call, redis.pcall
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
  local fstr = pcall('GET', fkey)
  local reply
  if fstr ~= token and fstr then
    if type(fstr) == 'table' then  -- the fence key holds another type: no fence to compare
      if sub(fstr.err, 1, 9) ~= 'WRONGTYPE' then error(fstr) end
      reply = {0, 1, 'UNVERIFIABLE', {call('TYPE', fkey)['ok']}, ''}
    elseif not match(fstr, '^%d+$') then
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
