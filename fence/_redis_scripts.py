"""The Redis lock manager's Lua scripts, without I/O.

The keys they touch are those of :mod:`fence._redis_keys`: every key of resource ``R``
shares the hash tag ``{R}`` (C12), so one script touches one Redis Cluster slot. The
scripts are given the lock, counter, fence and queue keys, and name the readers,
``queue-writers`` and void keys and the ``signal`` channel from the lock key, whose hash
tag they share.

Tokens in Lua are doubles; every token is below ``2**53`` (C1), so they are exact. They are
written with ``string.format('%d', t)``: passing a number to ``redis.call`` would format it
as ``%.14g`` and lose digits.

The drivers send each script as a :class:`fence._lua.Script` (:data:`DRIVER_SCRIPTS`).
"""

from __future__ import annotations

import math

from fence._lua import Script

__all__ = [
    "ABANDON",
    "ACQUIRE",
    "CANCEL",
    "DRIVER_SCRIPTS",
    "ENQUEUE",
    "INSPECT",
    "RELEASE",
    "RENEW",
    "REVOKE",
    "milliseconds",
]

# Shared Lua prelude, in two parts: the token rule of fence._core.issue_token (small, so a
# script's fast path can use it before the rest is defined), then the queue, the readers
# and the wake-up step. Redis runs a script's whole text on every call: each function
# defined costs the server a closure per call, so a fast path that returns before the
# second part skips them.
_TOKENS = """
local MAX_TOKEN = 9007199254740991

local function now_us()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000000 + tonumber(t[2])
end

local function now_ms()
  return math.floor(now_us() / 1000)
end

-- max(last + 1, TIME in microseconds) for 'hybrid', last + 1 for 'counter'.
local function issue(last, mode)
  local nxt = last + 1
  if mode == 'hybrid' then
    local clock = now_us()
    if clock > nxt then nxt = clock end
  end
  if nxt > MAX_TOKEN then
    return nil
  end
  return nxt
end

-- The largest token known for the resource: the counter, and the guards' fence register
-- (a counter lost with an AOF tail, or evicted, must not take tokens below the fence).
local function last_token(token_key, fence_key)
  local last = tonumber(redis.call('GET', token_key) or '0') or 0
  local fence = tonumber(redis.call('GET', fence_key) or '0') or 0
  if fence > last then return fence end
  return last
end
"""

_WAITING = """
-- '<prefix>{R}:' from the lock key '<prefix>{R}:lock'.
local function base_of(lock_key)
  return string.sub(lock_key, 1, -5)
end

-- The queue: '<base>queue' (waiter ids by arrival), '<base>queue-deadlines' (id -> the
-- waiter's heartbeat deadline, ms) and '<base>queue-writers' (the writers among them, with
-- the same scores).
local function writers_of(queue)
  return queue .. '-writers'
end

-- Take a waiter out of the queue; return 1 if it was in it.
local function drop(queue, deadlines, id)
  redis.call('ZREM', writers_of(queue), id)
  redis.call('HDEL', deadlines, id)
  return redis.call('ZREM', queue, id)
end

-- A waiter's attempt is its heartbeat: its place lives while it keeps trying.
local function heartbeat(queue, deadlines, id, lifetime, now)
  redis.call('HSET', deadlines, id, string.format('%d', now + tonumber(lifetime)))
  redis.call('PEXPIRE', queue, lifetime)
  redis.call('PEXPIRE', deadlines, lifetime)
  redis.call('PEXPIRE', writers_of(queue), lifetime)
end

-- Put a waiter at the tail of the queue (or keep its place); return its score.
local function enqueue(queue, deadlines, id, writer, lifetime, now)
  local score = tonumber(redis.call('ZSCORE', queue, id))
  if not score then
    local tail = redis.call('ZRANGE', queue, -1, -1, 'WITHSCORES')
    score = 1
    if tail[2] then score = tonumber(tail[2]) + 1 end
    redis.call('ZADD', queue, string.format('%d', score), id)
    if writer then
      redis.call('ZADD', writers_of(queue), string.format('%d', score), id)
    end
  end
  heartbeat(queue, deadlines, id, lifetime, now)
  return score
end

-- Drop queue heads whose deadline passed; return the live head or nil.
local function queue_head(queue, deadlines, now)
  while true do
    local head = redis.call('ZRANGE', queue, 0, 0)[1]
    if not head then return nil end
    local deadline = tonumber(redis.call('HGET', deadlines, head))
    if deadline and deadline > now then return head end
    drop(queue, deadlines, head)
  end
end

-- The first live writer in the queue and its score, or nil.
local function first_writer(queue, deadlines, now)
  while true do
    local got = redis.call('ZRANGE', writers_of(queue), 0, 0, 'WITHSCORES')
    if not got[1] then return nil end
    local deadline = tonumber(redis.call('HGET', deadlines, got[1]))
    if deadline and deadline > now then return got[1], tonumber(got[2]) end
    drop(queue, deadlines, got[1])
  end
end

-- Readers: '<base>readers' (secret -> the end of its lease, ms) and '<base>reader-tokens'
-- (secret -> '<token> <holder label>'). Drop the readers whose lease ended; return how many
-- hold the lock.
local function live_readers(base, now)
  local readers = base .. 'readers'
  local ended = redis.call('ZRANGEBYSCORE', readers, '-inf', string.format('%d', now))
  for _, secret in ipairs(ended) do
    redis.call('ZREM', readers, secret)
    redis.call('HDEL', base .. 'reader-tokens', secret)
  end
  return redis.call('ZCARD', readers)
end

-- Start or extend a reader's lease; the keys live as long as their longest lease.
local function keep_reader(base, secret, ttl, now)
  redis.call('ZADD', base .. 'readers', string.format('%d', now + tonumber(ttl)), secret)
  for _, key in ipairs({base .. 'readers', base .. 'reader-tokens'}) do
    if redis.call('PTTL', key) < tonumber(ttl) then
      redis.call('PEXPIRE', key, ttl)
    end
  end
end

-- Wake waiters: publish on the resource's channel '<prefix>{R}:signal'. With a queue, the
-- ids of its head and, if the head is a reader, of every reader behind it up to the first
-- writer (a batch, woken together), in one message; without one, nothing with FIFO and an
-- empty message without (each listening manager wakes one of its waiters).
local function wake(signal, queue, deadlines, fifo)
  local head = nil
  local now = 0
  if queue and deadlines then
    now = now_ms()
    head = queue_head(queue, deadlines, now)
  end
  if head then
    local ids = {head}
    if not redis.call('ZSCORE', writers_of(queue), head) then
      for _, id in ipairs(redis.call('ZRANGE', queue, 1, 255)) do
        if redis.call('ZSCORE', writers_of(queue), id) then break end
        local deadline = tonumber(redis.call('HGET', deadlines, id))
        if deadline and deadline > now then ids[#ids + 1] = id end
      end
    end
    redis.call('PUBLISH', signal, table.concat(ids, ' '))
  elseif not fifo then
    redis.call('PUBLISH', signal, '')
  end
end

-- A reader leaves: release its lease; the last reader to leave wakes the waiters.
-- Returns 1 if the secret held a live read lease, else 0.
local function release_reader(lock, queue, deadlines, secret, fifo)
  local base = base_of(lock)
  local ends = redis.call('ZSCORE', base .. 'readers', secret)
  if not ends then return 0 end
  redis.call('ZREM', base .. 'readers', secret)
  redis.call('HDEL', base .. 'reader-tokens', secret)
  local now = now_ms()
  if tonumber(ends) <= now then return 0 end
  if live_readers(base, now) == 0 then
    wake(base .. 'signal', queue, deadlines, fifo)
  end
  return 1
end
"""

_PRELUDE = _TOKENS + _WAITING

ACQUIRE = (
    _TOKENS
    + """
-- Fast path for a writer, before the rest of the prelude is defined: taken only where the
-- general path below would reach the same reply and the same writes. Nobody queued, no
-- reader (live or expired) and no tombstone for the secret: grant. Held by another writer
-- and nobody queued: refuse, without a place.
local held = redis.call('HMGET', KEYS[1], 'secret', 'token')
if held[1] == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return tonumber(held[2])
end
local fast = ARGV[7] == 'w'
if fast and held[1] then
  if redis.call('EXISTS', KEYS[4]) == 0 then
    return {0, redis.call('PTTL', KEYS[1]), 0}
  end
elseif fast then
  local base = string.sub(KEYS[1], 1, -5)
  if redis.call('EXISTS', KEYS[4], base .. 'readers', base .. 'void:' .. ARGV[1]) == 0 then
    local token = issue(last_token(KEYS[2], KEYS[3]), ARGV[4])
    if not token then
      return redis.error_reply('ERR fence: token space exhausted for ' .. KEYS[2])
    end
    local text = string.format('%d', token)
    redis.call('SET', KEYS[2], text)
    redis.call('HSET', KEYS[1], 'secret', ARGV[1], 'token', text, 'holder', ARGV[3])
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return token
  end
end
"""
    + _WAITING
    + """
-- ACQUIRE: take the lock if free, issuing the next token in the same step; for a writer
-- (exclusive) or a reader (shared, C13).
-- KEYS[1] lock hash      KEYS[2] token counter   KEYS[3] guard fence register
-- KEYS[4] queue          KEYS[5] queue deadlines
-- ARGV[1] owner secret   ARGV[2] ttl in ms       ARGV[3] holder label
-- ARGV[4] 'hybrid' or 'counter'
-- ARGV[5] waiter id      ARGV[6] queue entry lifetime in ms
-- ARGV[7] 'w' for a writer, 'r' for a reader     ARGV[8] '1' with FIFO, else '0'
-- Returns the granted token as a bare number (the same one for the same secret: a retry
-- whose reply was lost; a table reply costs the server a microsecond more), else
-- {0, wait_ms, queued}:
--   wait_ms when not granted, ms until the lock may change without a wake-up (the holder's
--           PTTL, the end of the readers' leases, or the deadline of the waiter ahead),
--           -1 if unknown;
--   queued  1 if the caller has a place in the queue.
-- A writer is granted when nobody holds the lock and nobody is queued ahead of it; a
-- reader when no writer holds it and no writer is queued ahead of it. A refused reader
-- takes a place in the queue, and so does a refused writer while readers hold or queue
-- (so that it keeps new readers out); other refused writers wait the exclusive way (with
-- FIFO, their wait takes a place). A new token is above the counter and the guards'
-- fence register, for readers too. An attempt whose acquire was cancelled (CANCEL left
-- its tombstone) is refused without a place in the queue and without a heartbeat, with
-- wait_ms -1 (or the holder's PTTL, as the fast path says): its client is gone, and a
-- place of its would be woken by the next release while the others wait for it to expire.
-- Error 'token space exhausted' when the next token would pass 2**53-1.
-- (held: the HMGET of the fast path above; the caller's own lock returned there.)
local base = base_of(KEYS[1])
local reading = ARGV[7] == 'r'
local now = now_ms()
local mine = redis.call('ZSCORE', base .. 'readers', ARGV[1])
if mine and tonumber(mine) > now then
  keep_reader(base, ARGV[1], ARGV[2], now)
  local info = redis.call('HGET', base .. 'reader-tokens', ARGV[1]) or '0'
  return tonumber(string.match(info, '^%d+'))
end
local readers = live_readers(base, now)
local queue, deadlines = KEYS[4], KEYS[5]
local void = redis.call('EXISTS', base .. 'void:' .. ARGV[1]) == 1
local place = tonumber(redis.call('ZSCORE', queue, ARGV[5]))
if place and not void then
  heartbeat(queue, deadlines, ARGV[5], ARGV[6], now)
end
local wait_ms = nil
if held[1] then
  wait_ms = redis.call('PTTL', KEYS[1])
elseif void then
  return {0, -1, 0}
elseif readers > 0 and not reading then
  wait_ms = tonumber(redis.call('ZRANGE', base .. 'readers', -1, -1, 'WITHSCORES')[2]) - now
else
  local ahead = nil
  if reading then
    local writer, score = first_writer(queue, deadlines, now)
    if writer and (not place or score < place) then ahead = writer end
  else
    local head = queue_head(queue, deadlines, now)
    if head and head ~= ARGV[5] then ahead = head end
  end
  if ahead then
    wait_ms = tonumber(redis.call('HGET', deadlines, ahead)) - now
  end
end
if wait_ms then
  if void then return {0, wait_ms, 0} end
  if place then
    return {0, wait_ms, 1}
  end
  if reading or readers > 0
      or redis.call('ZCARD', queue) > redis.call('ZCARD', writers_of(queue)) then
    enqueue(queue, deadlines, ARGV[5], not reading, ARGV[6], now)
    return {0, wait_ms, 1}
  end
  return {0, wait_ms, 0}
end
if place then
  drop(queue, deadlines, ARGV[5])
end
local token = issue(last_token(KEYS[2], KEYS[3]), ARGV[4])
if not token then
  return redis.error_reply('ERR fence: token space exhausted for ' .. KEYS[2])
end
local text = string.format('%d', token)
redis.call('SET', KEYS[2], text)
if reading then
  redis.call('HSET', base .. 'reader-tokens', ARGV[1], text .. ' ' .. ARGV[3])
  keep_reader(base, ARGV[1], ARGV[2], now)
else
  redis.call('HSET', KEYS[1], 'secret', ARGV[1], 'token', text, 'holder', ARGV[3])
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return token
"""
)

RENEW = (
    """
-- RENEW: reset the ttl if the caller holds the lock (C11), as the writer or as a reader.
-- KEYS[1] lock hash
-- ARGV[1] owner secret   ARGV[2] ttl in ms
-- Returns 1 if renewed, 0 if the lock is not held by this secret.
-- The writer's renewal returns before the prelude is defined.
if redis.call('HGET', KEYS[1], 'secret') == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
"""
    + _PRELUDE
    + """
local base = base_of(KEYS[1])
local ends = redis.call('ZSCORE', base .. 'readers', ARGV[1])
if not ends then
  return 0
end
local now = now_ms()
if tonumber(ends) <= now then
  return 0
end
keep_reader(base, ARGV[1], ARGV[2], now)
return 1
"""
)

RELEASE = (
    """
-- RELEASE: end the caller's lease if it holds one (C11), as the writer or as a reader, and
-- publish a wake-up (a reader: only the last one).
-- KEYS[1] lock hash      KEYS[2] queue            KEYS[3] queue deadlines
-- ARGV[1] owner secret   ARGV[2] '1' with FIFO, else '0'
-- Returns 1 if released, 0 if the lock is not held by this secret (nothing changed).
-- Fast path, before the prelude is defined: the writer leaves and nobody is queued, so the
-- wake-up is the one wake() would publish without a queue.
local fifo = ARGV[2] == '1'
local writer = redis.call('HGET', KEYS[1], 'secret') == ARGV[1]
if writer then
  redis.call('DEL', KEYS[1])
  if not KEYS[3] or redis.call('EXISTS', KEYS[2]) == 0 then
    if not fifo then
      redis.call('PUBLISH', string.sub(KEYS[1], 1, -5) .. 'signal', '')
    end
    return 1
  end
end
"""
    + _PRELUDE
    + """
if writer then
  wake(base_of(KEYS[1]) .. 'signal', KEYS[2], KEYS[3], fifo)
  return 1
end
return release_reader(KEYS[1], KEYS[2], KEYS[3], ARGV[1], fifo)
"""
)

ENQUEUE = (
    _PRELUDE
    + """
-- ENQUEUE: put a FIFO writer at the tail of the queue (or refresh its place).
-- KEYS[1] lock hash      KEYS[2] queue           KEYS[3] queue deadlines
-- ARGV[1] waiter id      ARGV[2] queue entry lifetime in ms
-- ARGV[3] owner secret
-- Returns 1 if the lock is free (no writer, no reader) and the caller is first in line
-- (try again now), else 0. A request that arrives after its acquire was cancelled (CANCEL
-- left its tombstone), or after its owner took the lock, takes no place and returns 0.
if redis.call('EXISTS', base_of(KEYS[1]) .. 'void:' .. ARGV[3]) == 1
    or redis.call('HGET', KEYS[1], 'secret') == ARGV[3] then
  return 0
end
local now = now_ms()
enqueue(KEYS[2], KEYS[3], ARGV[1], true, ARGV[2], now)
if redis.call('EXISTS', KEYS[1]) == 0 and live_readers(base_of(KEYS[1]), now) == 0
    and queue_head(KEYS[2], KEYS[3], now) == ARGV[1] then
  return 1
end
return 0
"""
)

ABANDON = (
    _PRELUDE
    + """
-- ABANDON: a waiter gave up. Drop its place and, if no writer holds the lock, pass the turn
-- on, so a waiter that left (or took a wake-up it will not use) never holds up the others.
-- KEYS[1] lock hash      KEYS[2] queue           KEYS[3] queue deadlines
-- ARGV[1] waiter id      ARGV[2] '1' with FIFO, else '0'
-- Returns 1 if a wake-up was published, else 0.
drop(KEYS[2], KEYS[3], ARGV[1])
if redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
wake(base_of(KEYS[1]) .. 'signal', KEYS[2], KEYS[3], ARGV[2] == '1')
return 1
"""
)

CANCEL = (
    _PRELUDE
    + """
-- CANCEL: an acquire gave up without knowing what one of its attempts did (the reply was
-- lost to a timeout, a broken connection or a cancellation). Leave a tombstone for its
-- secret, so that an attempt still on its way is refused when it arrives; release the lock
-- (or the read lease) if an attempt took it; leave the queue. The outcome no longer depends
-- on the order in which the attempt and this script reach the server.
-- KEYS[1] lock hash      KEYS[2] queue           KEYS[3] queue deadlines
-- ARGV[1] owner secret   ARGV[2] tombstone ttl in ms (the lease's ttl)
-- ARGV[3] waiter id      ARGV[4] '1' with FIFO, else '0'
-- Returns 1 if the secret held the lock (released now), else 0. A waiter that leaves the
-- queue passes the turn on, as in ABANDON. A tombstone is never shortened: a FIFO wait's
-- CANCEL (queue_ttl) may follow its acquire's (the lease's ttl), whose attempt may still
-- be on its way.
local void = base_of(KEYS[1]) .. 'void:' .. ARGV[1]
if redis.call('PTTL', void) < tonumber(ARGV[2]) then
  redis.call('SET', void, '1', 'PX', ARGV[2])
end
local queued = drop(KEYS[2], KEYS[3], ARGV[3])
local fifo = ARGV[4] == '1'
if redis.call('HGET', KEYS[1], 'secret') == ARGV[1] then
  redis.call('DEL', KEYS[1])
  wake(base_of(KEYS[1]) .. 'signal', KEYS[2], KEYS[3], fifo)
  return 1
end
local held = release_reader(KEYS[1], KEYS[2], KEYS[3], ARGV[1], fifo)
if held == 0 and queued == 1 and redis.call('EXISTS', KEYS[1]) == 0 then
  wake(base_of(KEYS[1]) .. 'signal', KEYS[2], KEYS[3], fifo)
end
return held
"""
)

INSPECT = (
    _PRELUDE
    + """
-- INSPECT: who holds the lock.
-- KEYS[1] lock hash
-- Returns {'w', token, pttl_ms, holder} for a writer, {'r', token, ms_left, holder, ...}
-- (three items per reader) for readers, or nil when free. Never a secret.
local held = redis.call('HMGET', KEYS[1], 'token', 'holder')
if held[1] then
  return {'w', tonumber(held[1]), redis.call('PTTL', KEYS[1]), held[2] or ''}
end
local base = base_of(KEYS[1])
local now = now_ms()
local live = redis.call('ZRANGEBYSCORE', base .. 'readers', '(' .. string.format('%d', now),
  '+inf', 'WITHSCORES')
if #live == 0 then
  return nil
end
local out = {'r'}
for i = 1, #live, 2 do
  local info = redis.call('HGET', base .. 'reader-tokens', live[i]) or ''
  local token, holder = string.match(info, '^(%d+) ?(.*)$')
  out[#out + 1] = tonumber(token or '0')
  out[#out + 1] = tonumber(live[i + 1]) - now
  out[#out + 1] = holder or ''
end
return out
"""
)

REVOKE = (
    _PRELUDE
    + """
-- REVOKE: end whatever leases the resource has (the writer's, or every reader's), issue a
-- token above every token issued so far and above the guards' fence register, and raise
-- the register to it, so a hung holder's writes are refused from now on (C8, C12).
-- Publishes a wake-up.
-- KEYS[1] lock hash      KEYS[2] token counter   KEYS[3] guard fence register
-- KEYS[4] queue          KEYS[5] queue deadlines
-- ARGV[1] 'hybrid' or 'counter'                  ARGV[2] '1' with FIFO, else '0'
-- Returns the new token. Error 'token space exhausted' as in ACQUIRE.
local last = last_token(KEYS[2], KEYS[3])
local held = tonumber(redis.call('HGET', KEYS[1], 'token') or '0') or 0
if held > last then last = held end
local base = base_of(KEYS[1])
for _, info in ipairs(redis.call('HVALS', base .. 'reader-tokens')) do
  local token = tonumber(string.match(info, '^%d+') or '0') or 0
  if token > last then last = token end
end
local token = issue(last, ARGV[1])
if not token then
  return redis.error_reply('ERR fence: token space exhausted for ' .. KEYS[2])
end
local text = string.format('%d', token)
redis.call('SET', KEYS[2], text)
redis.call('SET', KEYS[3], text)
redis.call('DEL', KEYS[1], base .. 'readers', base .. 'reader-tokens')
wake(base .. 'signal', KEYS[4], KEYS[5], ARGV[2] == '1')
return token
"""
)


#: The scripts as the driver sends them, by name: each built once, with its SHA1.
DRIVER_SCRIPTS: dict[str, Script] = {
    name: Script.of(name, source)
    for name, source in (
        ("acquire", ACQUIRE),
        ("renew", RENEW),
        ("release", RELEASE),
        ("enqueue", ENQUEUE),
        ("abandon", ABANDON),
        ("cancel", CANCEL),
        ("inspect", INSPECT),
        ("revoke", REVOKE),
    )
}


def milliseconds(seconds: float) -> int:
    """``seconds`` as whole milliseconds, rounded up and at least 1.

    Rounding up keeps the server's ttl at least as long as the one the client counts on.
    """
    return max(1, math.ceil(seconds * 1000 - 1e-6))
