"""The quorum lock manager's protocol, without I/O: node scripts, votes and decisions.

The quorum manager (:mod:`fence._async.quorum`) runs Redlock over ``N`` independent Redis
nodes and issues fencing tokens. Everything it decides is here: the Lua scripts each node
runs, how their replies are read, and :class:`QuorumAcquire`, the state machine that says
which round to send next. The driver only moves bytes for it; the model checker in
``tests/quorum_model.py`` drives the same machine and the same scripts through every
schedule of a bounded search.

**Fault model.** Within it, every grant gets a token above every token granted before it
(C2) and no two grants share a token, whatever the timing; and, as long as no node's clock
jumps forward, two holders' client deadlines (C10) never overlap.

- Messages may be lost, delayed and reordered; nodes may be partitioned away, stopped,
  killed and restarted, any number of times.
- A node restarts either **with all its data** (every write it acknowledged survives:
  ``appendonly yes`` with ``appendfsync always``) or **empty** (no persistence, or a lost
  disk). A restart that rolls a node back to an older copy of its data (RDB snapshots,
  ``appendfsync everysec``, or a ``dump.rdb`` that a node without persistence loads at
  start-up) is outside the model: keep such nodes without persistence, starting in a
  directory that holds no RDB file (:func:`node_config_warnings` reports a node that
  loaded one).
- For each resource, fewer than a majority of nodes are *unrepaired* at any moment. A node
  is unrepaired for ``R`` from the moment it restarts empty until a grant of ``R`` repairs
  it (below). With 3 nodes: one node at a time may have lost its data; with 5: two.
- Clocks: node clocks may be skewed and may jump, in either direction. Tokens do not depend
  on them. Lease exclusion needs node clocks that do not jump forward and that run at the
  client's rate within ``drift``, as every lease does.

Beyond the model the manager refuses and reports: a grant that a majority of nodes with
intact data cannot back raises ``BackendError(code="DATA_LOST")`` and emits
:attr:`EventKind.REFUSED`. Every node losing its data before a grant repaired any of them,
at once or in turn (a rolling restart of an idle quorum), looks like a new deployment: in
counter mode a driver that saw a grant refuses it (``granted_before`` of
:class:`QuorumAcquire`), a driver started since sets the quorum up again
(:attr:`EventKind.QUORUM_INITIALIZED`; hybrid tokens stay above the node clocks, counter
tokens start at 1). A node rolled back to an older copy of its data cannot be detected.

**Incarnations.** Each node keeps a marker (``<prefix>quorum:node``: ``state`` and ``id``).
A node that answers without one lost its data (or is new): its first script call records a
new incarnation id, in state ``new``. A node takes part in a grant of ``R`` (it is
*eligible* for ``R``) only in state ``genesis`` (its data is continuous since the quorum
was set up), or in state ``recovering`` once ``R`` was repaired under its current id
(``<prefix>{R}:repaired`` holds the id). An ineligible node grants nothing and says so.

**Repair.** After a grant that a majority of holders backed (below), the client writes its
token to every ineligible node that answered, naming the incarnation that node reported
(:data:`REPAIR`). Only a successful grant repairs: its commit came after it read the
node's new incarnation, so its token is above every token that node had stored before it
lost its data. A repair that lands on a later incarnation changes nothing.

**Set-up (genesis).** When all ``N`` nodes answer ``new``, the client marks each
``pending`` (naming its id) and, only if all ``N`` took the mark, ``genesis``. A node can
leave ``new``/``pending`` only by genesis or repair, so if all ``N`` took the mark, there
was a moment at which no node held any data: nothing could have been lost.

Two set-ups at once can leave a minority confirmed under one and the other nodes pending
under another, and a lost confirmation can leave a node pending under a set-up that others
confirmed. A vote that finds fewer than a majority eligible and a node ``pending`` probes
which set-up the others confirmed, and each pending node **joins** it if it was prepared
under it in its current incarnation (GENESIS, join; a node keeps the last set-ups it was
prepared under in its marker, which a restart without data erases). That is the set-up's
own confirmation arriving late: every node was prepared under the set-up, and since then
the joining node lost no data and, pending, granted nothing. A node prepared under another
set-up since (a set-up that crossed this one) still joins; one that restarted empty since
does not.

Only a vote that finds a minority eligible, every other node ``new`` or ``pending`` and no
pending node to join prepares every node again, naming the incarnations it saw. Each
``genesis`` node records the first acquire call it grants to (``used``: its secret and
attempt number; the undo that releases that attempt's lock clears it), and takes that step
only if it granted to no attempt but this one. If every node took it, no grant was handed
out under the old set-up: a grant needs a majority of nodes eligible when it voted. Those
the attempt saw fresh were still fresh in the same incarnation when prepared, so they were
never eligible since (a fresh node that became ``genesis`` and granted carries a mark that
stops the step back); those it saw eligible, fewer than a majority, each carry the mark of
the first attempt they granted to; a node that lost its data since the grant is unrepaired,
and fewer than a majority are. So the argument above holds again.

**Attempts.** Every attempt of one acquire call sends the call's owner secret, with a
number larger for each later attempt; the lock hash records the number of the attempt that
took (or took over) the lock. An undo releases only a lock of its attempt or an earlier
one, a commit counts only where its attempt holds the lock, and an acquire arriving after a
later attempt of its call took the node is refused. Otherwise a late undo of attempt 1
could end the lock attempt 2 was granted on a node, and a contender could take that node
and another while attempt 2's lease runs::

    attempt 1   A grants, B refuses, C's request lost      -> undo A, C (C's undo delayed)
    attempt 2   C and A grant                               -> granted
    late undo   C releases the secret's lock                -> a contender gets B and C

**Why the token needs a second round trip (the commit).** Each node proposes its own
candidate in the acquire script (``max(last + 1, TIME)`` or ``last + 1``) and stores it in
its counter. The token is the largest candidate of the nodes that granted. It is stored
only on the node that proposed it, so a later majority that misses that node could issue
less::

    counters   A=5 B=3 C=3
    acquire 1  grants from A, B      -> candidates 6, 4   -> token 6   (A=6 B=4 C=3)
    acquire 2  grants from B, C      -> candidates 5, 4   -> token 5   < 6: regression

So the client writes the token back (:data:`COMMIT`) before it hands it out, and a node
counts only while it **still holds the caller's lock**. A majority of holders must count.

**Why that is enough (C2).** Acquisition X committed ``T`` on the holders ``Cx`` (a
majority), and a later Y was granted by ``Gy``, a majority of *eligible* nodes. They share
a node ``m``. On ``m`` the two locks did not overlap. If X's came first, Y's grant on ``m``
read a counter of at least ``T`` (``m`` is eligible: it kept its data since X's commit, or
a repair after it gave it a token above ``T``), so Y proposes more than ``T`` and its token,
the maximum, is above ``T``. If Y's lock on ``m`` came first, X's grant on ``m`` came after
Y's commit there, and X's token is above Y's: Y was granted before X, not after. Counting
holders, not just nodes, is what keeps this true when a lease ends early (a node clock
jump): the tokens of two overlapping holders still differ and follow their grants.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from fence._core import MAX_TOKEN, TokenMode, backoff_delay, validate_token
from fence._errors import BackendError, ConfigurationError
from fence._lua import Script
from fence._redis_keys import quorum_keys
from fence._redis_scripts import _PRELUDE
from fence._redis_settings import LOADED_KEYS, Level, judge_settings
from fence.abc import LockInfo

__all__ = [
    "ACQUIRE",
    "COMMIT",
    "FAILED",
    "GENESIS",
    "LOADED_KEYS",
    "NODE_SCRIPTS",
    "QUORUM_RELEASE",
    "REPAIR",
    "REVOKE",
    "SCRIPTS",
    "UNDO",
    "Answer",
    "NodeState",
    "Op",
    "Outcome",
    "QuorumAcquire",
    "Request",
    "Verdict",
    "backoff_delay",
    "commit_needed",
    "describe_nodes",
    "majority",
    "merge_inspections",
    "merge_tokens",
    "node_call",
    "node_config_warnings",
    "node_name",
    "parse_answer",
    "release_verdict",
    "time_until_free",
    "unavailable_error",
    "validity",
]

# -- the node scripts ----------------------------------------------------------------------

# Shared by the scripts that decide whether a node may take part in a grant of a resource.
_ELIGIBLE = """
-- Whether this node may take part in a grant of the resource: its data is continuous
-- since the quorum was set up ('genesis'), or the resource was repaired under the node's
-- current incarnation ('recovering'). A node without a marker lost its data (or is new):
-- it records incarnation new_id in state 'new' (when new_id is given).
-- Returns true and whether the node is a 'genesis' node that granted nothing yet, or
-- false, state, id, genesis id (of a pending node; else '').
local function eligible(marker, tag, new_id)
  local node = redis.call('HMGET', marker, 'state', 'id', 'genesis', 'used')
  local state, id = node[1], node[2]
  if not state then
    if not new_id then return false, 'blank', '', '' end
    state, id = 'new', new_id
    redis.call('HSET', marker, 'state', state, 'id', id)
  end
  if state == 'genesis' then return true, not node[4] end
  if state == 'recovering' and redis.call('GET', tag) == id then return true, false end
  return false, state, id, node[3] or ''
end

-- A 'genesis' node records the first attempt of an acquire call it grants to ('used':
-- secret/attempt): a set-up under which nothing was granted may be taken up again
-- (GENESIS, prepare), one under which a grant may have been handed out may not.
local function use(marker, unused, secret, attempt)
  if unused then redis.call('HSET', marker, 'used', secret .. '/' .. attempt) end
end
"""

ACQUIRE = (
    _PRELUDE
    + _ELIGIBLE
    + """
-- ACQUIRE (quorum): take the lock on this node if it is free and the node is eligible,
-- proposing the node's next token.
-- KEYS[1] lock hash      KEYS[2] token counter
-- KEYS[3] repaired tag   KEYS[4] node marker     KEYS[5] the guards' fence register
-- KEYS[6] the tombstone a CANCEL of this secret leaves (fence._redis_scripts)
-- ARGV[1] owner secret   ARGV[2] ttl in ms       ARGV[3] holder label
-- ARGV[4] 'hybrid' or 'counter'                  ARGV[5] an incarnation id for a node
--                                                          that has none
-- ARGV[6] the attempt's number (every attempt of an acquire call has a larger one)
-- Returns the proposal (granted; the held token for the same secret), {0, pttl_ms} when
-- another secret (or a later attempt of this call) holds the lock, or
-- {-1, state, id, genesis id} when the node is not eligible. Error 'token space exhausted'
-- when the next token would pass 2**53-1.
local ok, state, id, genesis = eligible(KEYS[4], KEYS[3], ARGV[5])
if not ok then
  return {-1, state, id, genesis}
end
local unused = state
if redis.call('EXISTS', KEYS[6]) == 1 then
  return {0, 0}  -- this acquire was cancelled: refused, as if held, wherever it arrives late
end
local held = redis.call('HMGET', KEYS[1], 'secret', 'token', 'attempt')
if held[1] == ARGV[1] then
  -- An earlier attempt of this call left the lock here: this attempt takes it over, so
  -- that the earlier attempt's undo, arriving late, leaves it alone. An attempt that
  -- arrives after a later one took it is refused.
  if (tonumber(held[3]) or 0) > tonumber(ARGV[6]) then
    return {0, redis.call('PTTL', KEYS[1])}
  end
  redis.call('HSET', KEYS[1], 'attempt', ARGV[6])
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  if unused or redis.call('HGET', KEYS[4], 'used') == ARGV[1] .. '/' .. (held[3] or '') then
    use(KEYS[4], true, ARGV[1], ARGV[6])  -- the mark moves to the attempt that took over
  end
  return tonumber(held[2])
end
if held[1] then
  return {0, redis.call('PTTL', KEYS[1])}
end
local last = tonumber(redis.call('GET', KEYS[2]) or '0') or 0
-- Never below the fence register: a counter that went back must not issue a token the
-- guards refuse.
local fence = tonumber(redis.call('GET', KEYS[5]) or '0') or 0
if fence > last then last = fence end
local token = issue(last, ARGV[4])
if not token then
  return redis.error_reply('ERR fence: token space exhausted for ' .. KEYS[2])
end
local text = string.format('%d', token)
redis.call('SET', KEYS[2], text)
redis.call('HSET', KEYS[1], 'secret', ARGV[1], 'token', text, 'holder', ARGV[3],
  'attempt', ARGV[6])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
use(KEYS[4], unused, ARGV[1], ARGV[6])
return token
"""
)

REVOKE = (
    _PRELUDE
    + _ELIGIBLE
    + """
-- REVOKE (quorum, first round): end whatever lease the resource has on this node and take
-- the lock for the revoker, proposing a token above the counter and the deleted lease's.
-- KEYS[1] lock hash      KEYS[2] token counter
-- KEYS[3] repaired tag   KEYS[4] node marker     KEYS[5] the guards' fence register
-- ARGV[1] the revoker's secret   ARGV[2] ttl in ms   ARGV[3] 'hybrid' or 'counter'
-- ARGV[4] an incarnation id for a node that has none   ARGV[5] the attempt's number
-- Returns the proposal, or {-1, state, id, genesis id} when the node is not eligible.
local ok, state, id, genesis = eligible(KEYS[4], KEYS[3], ARGV[4])
if not ok then
  return {-1, state, id, genesis}
end
use(KEYS[4], state, ARGV[1], ARGV[5])
local last = tonumber(redis.call('GET', KEYS[2]) or '0') or 0
local held = tonumber(redis.call('HGET', KEYS[1], 'token') or '0') or 0
if held > last then last = held end
local fence = tonumber(redis.call('GET', KEYS[5]) or '0') or 0
if fence > last then last = fence end
local token = issue(last, ARGV[3])
if not token then
  return redis.error_reply('ERR fence: token space exhausted for ' .. KEYS[2])
end
local text = string.format('%d', token)
redis.call('DEL', KEYS[1])
redis.call('SET', KEYS[2], text)
redis.call('HSET', KEYS[1], 'secret', ARGV[1], 'token', text, 'holder', 'revoke',
  'attempt', ARGV[5])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return token
"""
)

COMMIT = """
-- COMMIT: record the quorum's token on one node, after the acquire (or revoke) round.
-- Raises the token counter (and, for a revoke, the guards' fence register) to the token
-- and, if the caller still holds the lock, writes the token into the lock hash, so that
-- INSPECT, REVOKE and a reentrant ACQUIRE see it.
-- KEYS[1] lock hash      KEYS[2] token counter
-- KEYS[3] guard fence register (revoke only)
-- ARGV[1] owner secret   ARGV[2] the token, as a decimal string
-- ARGV[3] the attempt's number
-- Returns 1 if the caller's attempt holds the lock here, else 0: only holders count
-- towards the commit, and a late commit of an earlier attempt of the same call neither
-- counts nor touches the lock a later attempt took. Counters and fences only ever go up:
-- a late or repeated commit cannot lower them.
local token = tonumber(ARGV[2])
local last = tonumber(redis.call('GET', KEYS[2]) or '0') or 0
if token > last then
  redis.call('SET', KEYS[2], ARGV[2])
end
if KEYS[3] then
  local fence = tonumber(redis.call('GET', KEYS[3]) or '0') or 0
  if token > fence then
    redis.call('SET', KEYS[3], ARGV[2])
  end
end
local held = redis.call('HMGET', KEYS[1], 'secret', 'attempt')
if held[1] == ARGV[1] and (tonumber(held[2]) or 0) == tonumber(ARGV[3]) then
  redis.call('HSET', KEYS[1], 'token', ARGV[2])
  return 1
end
return 0
"""

REPAIR = """
-- REPAIR: after a grant, give a node that lost its data the grant's token for this
-- resource, and make it eligible for the resource again.
-- KEYS[1] token counter  KEYS[2] repaired tag   KEYS[3] node marker
-- ARGV[1] the incarnation id the node reported in the grant's first round
-- ARGV[2] the grant's token, as a decimal string
-- Returns 1 if repaired, 0 if the node is in another incarnation (it lost its data again
-- since) or never lost it ('genesis').
local node = redis.call('HMGET', KEYS[3], 'state', 'id')
if node[2] ~= ARGV[1] or node[1] == 'genesis' then
  return 0
end
local token = tonumber(ARGV[2])
local last = tonumber(redis.call('GET', KEYS[1]) or '0') or 0
if token > last then
  redis.call('SET', KEYS[1], ARGV[2])
end
redis.call('SET', KEYS[2], ARGV[1])
redis.call('HSET', KEYS[3], 'state', 'recovering')
return 1
"""

GENESIS = """
-- GENESIS: set up a quorum whose nodes all answered 'new' or 'pending' (none holds data),
-- or set up again one under which nothing was granted.
-- KEYS[1] node marker
-- ARGV[1] 'prepare', 'confirm', 'join' or 'probe'
-- ARGV[2] the incarnation id the node reported ('': the node answered as eligible)
-- ARGV[3] the set-up's id   ARGV[4] the acquire attempt: owner secret/attempt number
-- prepare: 'new' or 'pending' -> 'pending' under this set-up; with ARGV[2] '', 'genesis'
-- that granted to no attempt but this one -> 'pending'. confirm: 'pending' under this
-- set-up -> 'genesis'. A client confirms only what it knows every node prepared: its own
-- set-up after every prepare succeeded. join (ARGV[3]: set-up ids that other nodes
-- confirmed, space-separated): 'pending' -> 'genesis' under the first of them that this
-- node was prepared under in this incarnation ('prepared': the last set-ups it was
-- prepared under, since its marker was made).
-- Returns 1 if the node took the step, else 0; probe returns {state, set-up id}.
local node = redis.call('HMGET', KEYS[1], 'state', 'id', 'genesis', 'used', 'prepared')
if ARGV[1] == 'probe' then
  return {node[1] or 'blank', node[3] or ''}
end
local function prepare()
  local prepared = {}
  for setup in string.gmatch(node[5] or '', '%S+') do prepared[#prepared + 1] = setup end
  prepared[#prepared + 1] = ARGV[3]
  while #prepared > 8 do table.remove(prepared, 1) end
  redis.call('HSET', KEYS[1], 'state', 'pending', 'genesis', ARGV[3],
    'prepared', table.concat(prepared, ' '))
  return 1
end
if ARGV[2] == '' then
  if ARGV[1] == 'prepare' and node[1] == 'genesis' and (not node[4] or node[4] == ARGV[4]) then
    redis.call('HDEL', KEYS[1], 'used')
    return prepare()
  end
  if ARGV[1] ~= 'confirm' then
    return 0
  end
elseif node[2] ~= ARGV[2] then
  return 0
end
if ARGV[1] == 'prepare' and (node[1] == 'new' or node[1] == 'pending') then
  return prepare()
end
if ARGV[1] == 'confirm' and node[1] == 'pending' and node[3] == ARGV[3] then
  redis.call('HSET', KEYS[1], 'state', 'genesis')
  return 1
end
if ARGV[1] == 'join' and node[1] == 'pending' then
  for setup in string.gmatch(ARGV[3], '%S+') do
    if string.find(' ' .. (node[5] or '') .. ' ', ' ' .. setup .. ' ', 1, true) then
      redis.call('HSET', KEYS[1], 'state', 'genesis', 'genesis', setup)
      return 1
    end
  end
end
return 0
"""

QUORUM_RELEASE = (
    _PRELUDE
    + _ELIGIBLE
    + """
-- RELEASE (quorum): delete the lock if the caller holds it, and wake one waiter.
-- KEYS[1] lock hash      KEYS[2] signal list
-- KEYS[3] repaired tag   KEYS[4] node marker
-- ARGV[1] owner secret
-- Returns 1 if released; 0 if not held by this secret; -1 if not held because the node is
-- not eligible (it lost its data since): nobody else can be granted the lock there either.
if redis.call('HGET', KEYS[1], 'secret') ~= ARGV[1] then
  if eligible(KEYS[4], KEYS[3], nil) then
    return 0
  end
  return -1
end
redis.call('DEL', KEYS[1])
wake(KEYS[2], nil, nil, nil)
return 1
"""
)

UNDO = (
    _PRELUDE
    + """
-- UNDO (quorum): release what one attempt of an acquire (or revoke) may have taken on this
-- node, and wake one waiter. Every attempt of an acquire call uses the call's secret, so
-- the attempt's number tells them apart: an undo that arrives late, after a later attempt
-- of the same call took the lock here (and was perhaps granted), must leave that lock
-- alone. It needs no eligibility: it only gives up a lock. A 'genesis' node whose first
-- grant went to the attempt whose lock this releases forgets it: that grant was never
-- handed out, and another set-up may take the node up again (GENESIS).
-- KEYS[1] lock hash      KEYS[2] signal list   KEYS[3] node marker
-- ARGV[1] owner secret   ARGV[2] the attempt's number
-- Returns 1 if released, 0 if the lock is not held by this attempt or an earlier one of
-- the same call.
local held = redis.call('HMGET', KEYS[1], 'secret', 'attempt')
if held[1] ~= ARGV[1] or (tonumber(held[2]) or 0) > tonumber(ARGV[2]) then
  return 0
end
redis.call('DEL', KEYS[1])
if redis.call('HGET', KEYS[3], 'used') == ARGV[1] .. '/' .. (held[2] or '') then
  redis.call('HDEL', KEYS[3], 'used')
end
wake(KEYS[2], nil, nil, nil)
return 1
"""
)

#: The scripts by name, as :func:`node_call` names them.
SCRIPTS: dict[str, str] = {
    "acquire": ACQUIRE,
    "revoke": REVOKE,
    "commit": COMMIT,
    "repair": REPAIR,
    "genesis": GENESIS,
    "release": QUORUM_RELEASE,
    "undo": UNDO,
}

#: The scripts as the driver sends them, by name: each built once, with its SHA1.
NODE_SCRIPTS: dict[str, Script] = {
    name: Script.of(f"quorum {name}", source) for name, source in SCRIPTS.items()
}


# -- rounds and answers --------------------------------------------------------------------


class Op(enum.StrEnum):
    """What one round asks every node it goes to.

    Attributes:
        ACQUIRE: take the lock and propose a token (:data:`ACQUIRE`).
        REVOKE: end the lease and take the lock for the revoker (:data:`REVOKE`).
        COMMIT: record the token where the lock is held (:data:`COMMIT`).
        FENCE: a revoke's commit, which raises the guards' fence register too.
        REPAIR: give ineligible nodes the token (:data:`REPAIR`).
        PREPARE: set-up, first step (:data:`GENESIS`).
        CONFIRM: set-up, second step.
        PROBE: ask nodes for their state and set-up id.
        JOIN: make ``pending`` nodes ``genesis`` under a set-up another node confirmed.
        UNDO: release what an attempt that failed may hold (:data:`UNDO`).
        RELEASE: a holder's release, or the end of a revoke (:data:`QUORUM_RELEASE`).
    """

    ACQUIRE = "acquire"
    REVOKE = "revoke"
    COMMIT = "commit"
    FENCE = "fence"
    REPAIR = "repair"
    PREPARE = "prepare"
    CONFIRM = "confirm"
    PROBE = "probe"
    JOIN = "join"
    UNDO = "undo"
    RELEASE = "release"


class NodeState(enum.StrEnum):
    """A node's marker state (see the module docstring).

    Attributes:
        BLANK: no marker (reported by a release or a probe; other scripts create one).
        NEW: the node lost its data, or is new, and nothing decided yet.
        PENDING: set-up prepared.
        RECOVERING: lost its data; eligible for the resources repaired since.
        GENESIS: data continuous since the quorum was set up.
    """

    BLANK = "blank"
    NEW = "new"
    PENDING = "pending"
    RECOVERING = "recovering"
    GENESIS = "genesis"


_FRESH = (NodeState.NEW, NodeState.PENDING)


class Answer(NamedTuple):
    """One node's answer in a round; ``failed`` when it did not answer (or answered an error).

    Attributes:
        failed: no usable answer (timeout, connection refused, an error reply).
        token: ACQUIRE/REVOKE: the node's proposal when it granted.
        held_ttl: ACQUIRE: the other holder's remaining ttl in seconds (``-1.0``: unknown).
        state: ACQUIRE/REVOKE/RELEASE: the node's state when it is not eligible; PROBE: its
            state.
        incarnation: with ``state``: the node's incarnation id.
        genesis: with ``state``: the set-up id of a pending (or, PROBE, set-up) node.
        ok: COMMIT/FENCE: holds the lock; REPAIR/PREPARE/CONFIRM: took the step;
            RELEASE/UNDO: released.
    """

    failed: bool = False
    token: int | None = None
    held_ttl: float | None = None
    state: NodeState | None = None
    incarnation: str | None = None
    genesis: str | None = None
    ok: bool = False

    @property
    def granted(self) -> bool:
        """The node granted the lock (ACQUIRE, REVOKE)."""
        return self.token is not None

    @property
    def eligible(self) -> bool:
        """The node answered and may take part in a grant."""
        return not self.failed and self.state is None


#: A node that did not answer.
FAILED = Answer(failed=True)


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def parse_answer(op: Op, raw: Any) -> Answer:
    """Read one node's script reply for a round of ``op``.

    Raises:
        InvalidTokenError: a proposal is not a valid token (C1).
    """
    if op in (Op.ACQUIRE, Op.REVOKE):
        if isinstance(raw, list):
            if int(raw[0]) == -1:
                return Answer(
                    state=NodeState(_text(raw[1])),
                    incarnation=_text(raw[2]),
                    genesis=_text(raw[3]) or None,
                )
            pttl = int(raw[1])
            # PTTL is truncated to whole ms: add one so a wait does not end just before expiry.
            return Answer(held_ttl=(pttl + 1) / 1000 if pttl >= 0 else -1.0)
        return Answer(token=validate_token(int(raw)))
    if op is Op.PROBE:
        return Answer(state=NodeState(_text(raw[0])), genesis=_text(raw[1]) or None)
    if op in (Op.RELEASE, Op.UNDO) and int(raw) == -1:
        return Answer(state=NodeState.BLANK)
    return Answer(ok=int(raw) == 1)


class Request(NamedTuple):
    """One round: ``op`` to each node in ``nodes``, at once.

    Attributes:
        op: what to ask.
        nodes: the node indexes.
        token: the token, for COMMIT, FENCE and REPAIR.
        incarnations: for REPAIR, PREPARE and CONFIRM: the incarnation id each node
            reported, aligned with ``nodes``.
        genesis: for PREPARE and CONFIRM: the set-up id.
    """

    op: Op
    nodes: tuple[int, ...]
    token: int | None = None
    incarnations: tuple[str, ...] = ()
    genesis: str = ""


def node_call(
    request: Request,
    position: int,
    *,
    prefix: str,
    resource: str,
    secret: str,
    ttl_ms: int,
    holder: str,
    mode: str,
    nonce: str,
    attempt: int,
) -> tuple[str, list[str], list[str]]:
    """The script call that ``request`` sends to its ``position``-th node.

    Args:
        request: the round.
        position: index into ``request.nodes``.
        prefix: the key prefix.
        resource: the resource.
        secret: the caller's owner secret (the revoker's for a revoke).
        ttl_ms: the lease time in ms.
        holder: the holder label.
        mode: ``"hybrid"`` or ``"counter"``.
        nonce: a fresh random id: the incarnation id of a node that has none.
        attempt: the attempt's number: larger for every later attempt with ``secret``.

    Returns:
        ``(script name in SCRIPTS, keys, args)``.
    """
    keys = quorum_keys(prefix, resource)
    op = request.op
    if op is Op.ACQUIRE:
        return (
            "acquire",
            [keys.lock, keys.token, keys.repaired, keys.node, keys.fence, keys.void + secret],
            [secret, str(ttl_ms), holder, mode, nonce, str(attempt)],
        )
    if op is Op.REVOKE:
        return (
            "revoke",
            [keys.lock, keys.token, keys.repaired, keys.node, keys.fence],
            [secret, str(ttl_ms), mode, nonce, str(attempt)],
        )
    if op in (Op.COMMIT, Op.FENCE):
        script_keys = [keys.lock, keys.token]
        if op is Op.FENCE:
            script_keys.append(keys.fence)
        return "commit", script_keys, [secret, str(request.token), str(attempt)]
    if op is Op.REPAIR:
        return (
            "repair",
            [keys.token, keys.repaired, keys.node],
            [request.incarnations[position], str(request.token)],
        )
    if op in (Op.PREPARE, Op.CONFIRM, Op.JOIN):
        args = [op.value, request.incarnations[position], request.genesis, f"{secret}/{attempt}"]
        return "genesis", [keys.node], args
    if op is Op.PROBE:
        return "genesis", [keys.node], ["probe", "", "", ""]
    if op is Op.UNDO:
        return "undo", [keys.lock, keys.signal, keys.node], [secret, str(attempt)]
    return "release", [keys.lock, keys.signal, keys.repaired, keys.node], [secret]


# -- the acquire (and revoke) state machine ----------------------------------------------------


class Verdict(enum.StrEnum):
    """How an acquire (or revoke) attempt ended.

    Attributes:
        GRANTED: the token is the caller's.
        HELD: another holder has a majority: wait on ``wait_on`` (a node that refused).
        SPLIT: nobody won (split vote, a round too slow, a commit not backed): back off.
        RETRY: the quorum's set-up changed under this attempt: try again at once.
        UNAVAILABLE: fewer than a majority of nodes answered.
        DATA_LOST: fewer than a majority of the nodes kept their data for the resource and
            answered: a grant could repeat a token.
    """

    GRANTED = "granted"
    HELD = "held"
    SPLIT = "split"
    RETRY = "retry"
    UNAVAILABLE = "unavailable"
    DATA_LOST = "data_lost"


class Outcome(NamedTuple):
    """The end of an attempt.

    Attributes:
        verdict: see :class:`Verdict`.
        token: the granted token.
        holder_ttl: HELD: seconds until a majority may be free, if known.
        wait_on: HELD: a node that refused, to wait on.
        lost: nodes that answered ``new`` while others kept their data (they lost theirs).
        ineligible: nodes that answered but may not take part in this resource's grants.
        failed: nodes that did not answer the first round.
        set_up: the attempt set the quorum up (every node answered ``new``).
    """

    verdict: Verdict
    token: int | None = None
    holder_ttl: float | None = None
    wait_on: int | None = None
    lost: tuple[int, ...] = ()
    ineligible: tuple[int, ...] = ()
    failed: tuple[int, ...] = ()
    set_up: bool = False


class _Phase(enum.StrEnum):
    VOTE = "vote"
    PREPARE = "prepare"
    CONFIRM = "confirm"
    PROBE = "probe"
    RESUME = "resume"  # joined pending nodes to a set-up found by a probe
    COMMIT = "commit"
    RELEASE = "release"  # a revoke gives its lock back
    REPAIR = "repair"
    UNDO = "undo"


@dataclass(frozen=True)
class QuorumAcquire:
    """One acquire (or revoke) attempt as a state machine; immutable, so it can be copied.

    Start with :meth:`begin`, send each :class:`Request` it returns to its nodes at once,
    and feed the answers to :meth:`step` until it returns an :class:`Outcome`::

        machine, request = QuorumAcquire.begin(3, setup_id="3f2a9c")
        while isinstance(request, Request):
            answers = send(request)          # one Answer per node, in request.nodes order
            machine, request = machine.step(answers, left=validity_left())
        outcome = request

    ``left`` is what :func:`validity` leaves of the lease at that moment; a grant needs it
    positive at the end of the vote, of the commit and of the repair.

    Attributes:
        nodes: the number of nodes.
        revoke: a revoke (forced, with fence) rather than an acquire.
        setup_id: a fresh random id, used if this attempt sets the quorum up.
        granted_before: counter tokens, and the caller saw this quorum grant before: a
            vote that finds no node holding data is a loss of every node's data (a
            rolling restart of nodes without persistence), not a new quorum. It is
            refused (``DATA_LOST``), never set up again with tokens from 1.
    """

    nodes: int
    revoke: bool = False
    setup_id: str = ""
    granted_before: bool = False
    phase: _Phase = _Phase.VOTE
    restart: bool = False
    votes: tuple[Answer, ...] = ()
    token: int | None = None
    set_up: bool = False
    outcome: Outcome | None = None

    @classmethod
    def begin(
        cls, nodes: int, *, revoke: bool = False, setup_id: str = "", granted_before: bool = False
    ) -> tuple[QuorumAcquire, Request]:
        """The machine and its first round: ACQUIRE (or REVOKE) to every node."""
        majority(nodes)
        machine = cls(nodes, revoke, setup_id, granted_before)
        return machine, machine._vote()

    def _vote(self) -> Request:
        return Request(Op.REVOKE if self.revoke else Op.ACQUIRE, tuple(range(self.nodes)))

    @property
    def holding(self) -> tuple[int, ...]:
        """Nodes where this attempt may hold the lock: granted, or no answer (a request that
        timed out may still have run). What a cancelled attempt must release."""
        if not self.votes:
            return tuple(range(self.nodes))
        return tuple(i for i, a in enumerate(self.votes) if a.failed or a.granted)

    def step(
        self, answers: Sequence[Answer], *, left: float
    ) -> tuple[QuorumAcquire, Request | Outcome]:
        """Take the answers to the last request (aligned with its ``nodes``).

        Args:
            answers: one per node of the last request.
            left: the lease time left by :func:`validity` now, in seconds.

        Returns:
            The next machine and either the next request or the outcome.
        """
        phase = self.phase
        answers = tuple(answers)
        if phase is _Phase.VOTE:
            return self._on_vote(answers, left)
        if phase is _Phase.PREPARE:
            if all(a.ok for a in answers):
                request = Request(
                    Op.CONFIRM, tuple(range(self.nodes)), None, self._incarnations(), self.setup_id
                )
                return replace(self, phase=_Phase.CONFIRM), request
            if self.restart:
                # A node granted to another acquire call: a token may have been handed
                # out under the set-up, which stands.
                return self._short(self._report())
            return self._end(Outcome(Verdict.SPLIT, **self._report()))
        if phase is _Phase.CONFIRM:
            machine = replace(self, phase=_Phase.VOTE, votes=(), set_up=True)
            return machine, machine._vote()
        if phase is _Phase.PROBE:
            return self._on_probe(answers)
        if phase is _Phase.RESUME:
            if any(a.ok for a in answers):
                return self._undo(Outcome(Verdict.RETRY, **self._report()))
            # No pending node was prepared under the set-up found (in its incarnation).
            if self._may_restart():
                return self._restart()
            return self._refuse(self._report())
        if phase is _Phase.COMMIT:
            holders = sum(1 for a in answers if a.ok)
            if holders >= majority(self.nodes) and left > 0:
                if self.revoke:
                    request = Request(Op.RELEASE, self._answered())
                    return replace(self, phase=_Phase.RELEASE), request
                return self._granted()
            return self._undo(Outcome(Verdict.SPLIT, **self._report()))
        if phase is _Phase.RELEASE:
            return self._granted()
        if phase is _Phase.REPAIR and left <= 0:
            # The repair round took the rest of the lease: hand out nothing (the repair stands:
            # the grant was backed).
            return self._undo(Outcome(Verdict.SPLIT, **self._report()))
        assert self.outcome is not None, f"no step from {phase}"
        return self, self.outcome

    # -- the vote ------------------------------------------------------------------------

    def _incarnations(self) -> tuple[str, ...]:
        # An eligible node reported no incarnation: '' asks GENESIS to take up its set-up
        # again (a restart), which it does only if the node granted to nobody else.
        return tuple(a.incarnation or "" for a in self.votes)

    def _report(self) -> dict[str, Any]:
        votes = self.votes
        ineligible = tuple(i for i, a in enumerate(votes) if not a.failed and a.state)
        kept = any(a.eligible or a.state is NodeState.RECOVERING for a in votes)
        # A pending node lost nothing: it was prepared under a set-up, and never granted.
        lost = tuple(i for i in ineligible if votes[i].state is NodeState.NEW and kept)
        failed = tuple(i for i, a in enumerate(votes) if a.failed)
        return {"lost": lost, "ineligible": ineligible, "failed": failed, "set_up": self.set_up}

    def _answered(self) -> tuple[int, ...]:
        return tuple(i for i, a in enumerate(self.votes) if a.eligible)

    def _on_vote(
        self, votes: tuple[Answer, ...], left: float
    ) -> tuple[QuorumAcquire, Request | Outcome]:
        machine = replace(self, votes=votes)
        need = majority(self.nodes)
        if all(a.state in _FRESH for a in votes):
            # Every node answered and none holds any data: a new quorum. Set it up, once.
            if self.set_up:
                return machine._end(Outcome(Verdict.SPLIT, **machine._report()))
            if self.granted_before:
                return machine._end(Outcome(Verdict.DATA_LOST, **machine._report()))
            request = Request(
                Op.PREPARE, tuple(range(self.nodes)), None, machine._incarnations(), self.setup_id
            )
            return replace(machine, phase=_Phase.PREPARE), request
        granted = [i for i, a in enumerate(votes) if a.granted]
        if len(granted) >= need and left > 0:
            proposals = [votes[i].token for i in granted]
            token = merge_tokens([t for t in proposals if t is not None])
            machine = replace(machine, token=token)
            if not self.revoke and not commit_needed(proposals, self.nodes):
                return machine._granted()
            op = Op.FENCE if self.revoke else Op.COMMIT
            return replace(machine, phase=_Phase.COMMIT), Request(op, machine._answered(), token)
        report = machine._report()
        eligible = machine._answered()
        if len(eligible) < need:
            if machine._may_restart() and not machine._pending():
                return machine._restart()
            return machine._short(report)
        if granted or self.revoke:
            return machine._undo(Outcome(Verdict.SPLIT, **report))
        refused = [i for i in eligible if not votes[i].granted]
        ttls = [votes[i].held_ttl for i in refused]
        wait = time_until_free(
            [t if t is not None and t >= 0 else None for t in ttls], 0, self.nodes
        )
        return machine._undo(Outcome(Verdict.HELD, holder_ttl=wait, wait_on=refused[0], **report))

    def _pending(self) -> list[int]:
        """The nodes that voted ``pending``: prepared under a set-up, not confirmed."""
        return [i for i, a in enumerate(self.votes) if a.state is NodeState.PENDING]

    def _may_restart(self) -> bool:
        """Every node answered; a minority is set up, the others hold no data (two set-ups
        at once, each of which took some nodes)."""
        return (
            not self.restart
            and not self.granted_before
            and all(a.eligible or a.state in _FRESH for a in self.votes)
        )

    def _restart(self) -> tuple[QuorumAcquire, Request]:
        """Set the quorum up again. If the set-up nodes granted to no acquire call but this
        one, no token was ever handed out under their set-up (GENESIS refuses a node that
        did). Called only once no pending node can join a set-up that another node confirmed
        (see :meth:`_on_probe`): until then the pending node's set-up may stand."""
        request = Request(
            Op.PREPARE, tuple(range(self.nodes)), None, self._incarnations(), self.setup_id
        )
        return replace(self, phase=_Phase.PREPARE, restart=True), request

    def _short(self, report: dict[str, Any]) -> tuple[QuorumAcquire, Request | Outcome]:
        """Fewer than a majority of eligible nodes granted, and no set-up to take up again."""
        if any(self.votes[i].state is NodeState.PENDING for i in report["ineligible"]):
            # A set-up whose confirmations were lost: ask the others which one they took.
            request = Request(Op.PROBE, tuple(i for i, a in enumerate(self.votes) if not a.failed))
            return replace(self, phase=_Phase.PROBE), request
        return self._refuse(report)

    def _refuse(self, report: dict[str, Any]) -> tuple[QuorumAcquire, Request | Outcome]:
        """Fewer than a majority of eligible nodes answered."""
        need = majority(self.nodes)
        eligible = len(self._answered())
        if eligible + len(report["failed"]) >= need or not report["ineligible"]:
            return self._undo(Outcome(Verdict.UNAVAILABLE, **report))
        return self._undo(Outcome(Verdict.DATA_LOST, **report))

    def _on_probe(self, answers: tuple[Answer, ...]) -> tuple[QuorumAcquire, Request | Outcome]:
        # A node confirmed a set-up: the pending nodes that were prepared under it in their
        # current incarnation join it (GENESIS refuses the others), as if the confirmation
        # of its own client had arrived late: since that set-up began, such a node lost no
        # data and granted nothing.
        confirmed = {a.genesis for a in answers if a.state is NodeState.GENESIS and a.genesis}
        pending = self._pending()
        if not confirmed or not pending:
            if self._may_restart():
                return self._restart()
            return self._refuse(self._report())
        request = Request(
            Op.JOIN,
            tuple(pending),
            None,
            tuple(self.votes[i].incarnation or "" for i in pending),
            " ".join(sorted(confirmed)),
        )
        return replace(self, phase=_Phase.RESUME), request

    def _granted(self) -> tuple[QuorumAcquire, Request | Outcome]:
        report = self._report()
        outcome = Outcome(Verdict.GRANTED, self.token, **report)
        repair = [i for i in report["ineligible"] if self.votes[i].incarnation]
        if repair:
            incarnations = tuple(self.votes[i].incarnation or "" for i in repair)
            request = Request(Op.REPAIR, tuple(repair), self.token, incarnations)
            return replace(self, phase=_Phase.REPAIR, outcome=outcome), request
        return replace(self, outcome=outcome), outcome

    def _undo(self, outcome: Outcome) -> tuple[QuorumAcquire, Request | Outcome]:
        stray = self.holding
        if stray:
            return replace(self, phase=_Phase.UNDO, outcome=outcome), Request(Op.UNDO, stray)
        return replace(self, outcome=outcome), outcome

    def _end(self, outcome: Outcome) -> tuple[QuorumAcquire, Outcome]:
        return replace(self, outcome=outcome), outcome


def release_verdict(answers: Sequence[Answer], nodes: int) -> bool | None:
    """Whether a release (or renewal) found the lease held until then.

    Held means: a majority of nodes either held the caller's lock, or lost their data and
    so could grant it to nobody else.

    Returns:
        ``True`` held, ``False`` not held, ``None`` unknown (too many nodes did not answer).
    """
    need = majority(nodes)
    kept = sum(1 for a in answers if a.ok or a.state is NodeState.BLANK)
    failed = sum(1 for a in answers if a.failed)
    if kept >= need:
        return True
    if kept + failed >= need:
        return None
    return False


# -- arithmetic ----------------------------------------------------------------------------


def majority(nodes: int) -> int:
    """How many of ``nodes`` make a majority: ``nodes // 2 + 1``.

    Raises:
        ConfigurationError: ``nodes`` is less than 1.

    Example::

        >>> majority(3), majority(4), majority(5)
        (2, 3, 3)
    """
    if nodes < 1:
        raise ConfigurationError(f"a quorum needs at least one node, got {nodes}")
    return nodes // 2 + 1


def validity(ttl: float, elapsed: float, *, drift: float, margin: float) -> float:
    """Seconds of lease the client may still count on after an acquire round (Redlock).

    ``ttl * (1 - drift) - margin - elapsed``: the lease time, less the clock drift
    allowance (``ttl * drift`` plus the constant ``margin``) and the time the round took.
    Redlock grants the lock only if this is positive. It is the same arithmetic as
    :func:`fence._core.client_deadline`, measured from the moment before the round.

    Example::

        >>> round(validity(10.0, 0.05, drift=0.01, margin=0.002), 3)
        9.848
    """
    return ttl * (1 - drift) - margin - elapsed


def merge_tokens(candidates: Sequence[int]) -> int:
    """The quorum's token: the largest candidate of the nodes that granted the lock.

    Raises:
        ValueError: no candidates.
        InvalidTokenError: a candidate is not a valid token (C1).

    Example::

        >>> merge_tokens([6, 4])
        6
    """
    if not candidates:
        raise ValueError("no token candidates to merge")
    return max(validate_token(token) for token in candidates)


def commit_needed(proposals: Sequence[int | None], nodes: int) -> bool:
    """Whether the commit round can be skipped: not when every node granted the same token.

    A node that grants the lock stores its proposal as its counter and in the lock hash. If
    all ``nodes`` granted and proposed the same token, every node already holds what the
    commit would write, and every node held the lock when it granted: the grant itself is
    the commit. That is the steady state of counter mode with every node up; hybrid
    proposals carry each node's clock and almost never agree.

    Example::

        >>> commit_needed([7, 7, 7], 3), commit_needed([7, 7], 3), commit_needed([7, 8, 7], 3)
        (False, True, True)
    """
    return len(proposals) != nodes or len(set(proposals)) != 1


def time_until_free(holder_ttls: Sequence[float | None], free: int, nodes: int) -> float | None:
    """How long until a majority of nodes may be free, from the refusing nodes' ttls.

    Args:
        holder_ttls: the remaining ttl of the lock on each node that refused (``None``
            where the node did not say).
        free: nodes already free (they granted the lock; the caller released them).
        nodes: the number of nodes.

    Returns:
        Seconds until enough refusing nodes expire to make a majority free, ``0.0`` if
        enough are free now, or ``None`` if the refusing nodes cannot tell.

    Example::

        >>> time_until_free([0.5, 2.0], free=1, nodes=3)
        0.5
    """
    need = majority(nodes) - free
    if need <= 0:
        return 0.0
    known = sorted(ttl for ttl in holder_ttls if ttl is not None)
    if len(known) < need:
        return None
    return known[need - 1]


def merge_inspections(
    resource: str, infos: Sequence[LockInfo | None], nodes: int
) -> LockInfo | None:
    """What the quorum knows about a held lock, from the nodes' answers.

    The lock is held when a majority of nodes report the same token (a committed
    acquisition writes its token to every node holding its lock). ``remaining`` is the
    time until fewer than a majority still hold it.

    Args:
        resource: the resource.
        infos: one answer per node that replied; ``None`` where the lock is free.
        nodes: the number of nodes.
    """
    need = majority(nodes)
    by_token: dict[int, list[LockInfo]] = {}
    for info in infos:
        if info is not None:
            by_token.setdefault(info.token, []).append(info)
    for token, held in by_token.items():
        if len(held) >= need and 1 <= token <= MAX_TOKEN:
            remaining = sorted((info.remaining for info in held), reverse=True)[need - 1]
            holder = next((info.holder for info in held if info.holder), None)
            return LockInfo(resource, token, remaining, holder)
    return None


def node_config_warnings(
    settings: dict[str, str], token_mode: TokenMode = TokenMode.HYBRID
) -> list[str]:
    """What is wrong with a quorum node's settings for the fault model (see the module).

    A node must either keep every write it acknowledged across a restart (``appendonly
    yes``, ``appendfsync always``) or restart empty (no persistence at all), which the
    quorum detects and repairs. A restart that brings back an older copy of the data (RDB
    snapshots, ``appendfsync everysec``, or a ``dump.rdb`` that a node without persistence
    found in its directory and loaded: :data:`LOADED_KEYS` above 0) or an eviction of keys
    without a ttl looks like intact data and cannot be detected. With counter tokens, a
    node that keeps no data is warned about too: every node restarting empty before a grant
    (a rolling restart of an idle quorum) makes a manager started since set the quorum up
    again, and counter tokens start over at 1.

    The verdicts are those of :func:`fence._redis_settings.judge_settings` for a quorum
    node.

    Args:
        settings: ``CONFIG GET`` results for the names of
            :data:`fence._redis_settings.SETTINGS` (missing ones are not judged), and
            :data:`LOADED_KEYS` from ``INFO persistence`` if the node said.
        token_mode: the manager's token mode.

    Returns:
        One sentence per problem; empty when the node fits the fault model.

    Example::

        >>> node_config_warnings({"appendonly": "no", "save": ""})
        []
    """
    findings = judge_settings(settings, token_mode, fences=False, quorum=True)
    return [finding.message for finding in findings if finding.level is not Level.OK]


def describe_nodes(names: Sequence[str], indexes: Sequence[int]) -> str:
    """``names`` at ``indexes``, comma-separated, or ``"none"``."""
    return ", ".join(names[i] for i in indexes) or "none"


def node_name(node: object) -> str:
    """How messages name a node: its URL without the password, or the client's repr."""
    if isinstance(node, str):
        return node.rsplit("@", 1)[-1]  # never show a password
    return repr(node)


#: What a caller should know when a call reached fewer than a majority of nodes.
_CONSEQUENCES = {
    "acquire": "No lease was handed out; what the attempt took was released",
    "release": "Whether the lock was held is unknown; the copies that were not released "
    "expire with their ttl",
    "renewal": "The lease is kept until its deadline while renewals are retried",
    "revoke": "The lease may still be held on a majority; revoke again",
}


def unavailable_error(
    what: str, outcomes: Mapping[int, Any], names: Sequence[str], outcome: Outcome | None = None
) -> BackendError:
    """The error of a call that fewer than a majority of nodes with intact data answered.

    Args:
        what: the call (``"acquire"``, ``"release"``, ``"renewal"``, ``"revoke"``, ...).
        outcomes: node index -> what the node answered (a :class:`fence.BackendError` for
            a node that failed).
        names: every node's name (:func:`node_name`).
        outcome: the attempt's outcome, for an acquire or revoke.

    Returns:
        ``code="DATA_LOST"`` when the outcome says a majority of intact nodes was missing,
        else ``code="QUORUM"``; both retryable.
    """
    need = majority(len(names))
    failed = {i: o for i, o in outcomes.items() if isinstance(o, BackendError)}
    down = ", ".join(f"{names[i]} ({o.code})" for i, o in failed.items())
    consequence = _CONSEQUENCES.get(what, "The outcome is unknown")
    if outcome is not None and outcome.verdict is Verdict.DATA_LOST:
        lost = describe_nodes(names, outcome.ineligible)
        return BackendError(
            f"the {what} was refused: fewer than {need} of the "
            f"{len(names)} Redis nodes hold intact data for this resource and "
            f"answered, so a grant could repeat a token. Lost their data and not yet "
            f"repaired: {lost}; did not answer: {down or 'none'}. {consequence}. A node "
            "is repaired by the next grant that a majority of intact nodes backs: bring "
            "the nodes that did not answer back. If a majority lost its data, see "
            "'Beyond the fault model' in docs/managers.md",
            code="DATA_LOST",
            retryable=True,
        )
    lost = ""
    if outcome is not None and outcome.ineligible:
        lost = " (lost their data and not yet repaired: "
        lost += f"{describe_nodes(names, outcome.ineligible)})"
    return BackendError(
        f"the {what} reached {len(outcomes) - len(failed)} of {len(names)} Redis "
        f"nodes, fewer than the majority of {need} with intact data{lost}; "
        f"failed: {down or 'none'}. {consequence}. Retry when a majority answers",
        code="QUORUM",
        retryable=True,
    )
