"""The quorum lock manager's logic, without I/O: majorities, validity, token merge.

The quorum manager (:mod:`fence._async.quorum`) runs Redlock over ``N`` independent Redis
nodes and issues fencing tokens that survive the loss of a minority of them. Every rule it
follows is a plain function here, so that it can be read, and tested, apart from the
sockets.

**Why the token needs a second round trip.** Each node issues its own candidate in the
acquire script (``max(last + 1, TIME)`` or ``last + 1``, as the single-node manager does),
and stores it in its own counter. The client takes the largest candidate of the nodes that
granted the lock. That token is only stored on the node that proposed it, so a later
majority that misses that node could issue less::

    counters   A=5 B=3 C=3
    acquire 1  grants from A, B      -> candidates 6, 4   -> token 6   (A=6 B=4 C=3)
    acquire 2  grants from B, C      -> candidates 5, 4   -> token 5   < 6: regression

So the client writes the token back (:data:`COMMIT`) before it hands it out. A node counts
towards the commit only while it still holds the caller's lock. The commit goes to every
node that answered the acquire, and a majority of lock holders must accept it.

**Why that is enough (C2).** Let acquisition X commit token ``T`` on the set ``Mc`` of
nodes (a majority, each holding X's lock at that moment). A later acquisition Y is granted
by a majority ``My``. ``Mc`` and ``My`` share a node ``m``. On ``m``, Y's grant came after
X's lock there was gone (released or expired), so after X's commit on ``m``, and Y read a
counter of at least ``T``. Y's candidate from ``m`` is above ``T``, and so is Y's token,
the maximum. The commit can only raise counters, so concurrent commits cannot undo it.

**Losing data on nodes (C3).** A node that restarts empty forgets its counter. Token ``T``
is safe as long as the nodes still holding a counter ``>= T`` and any grant majority
intersect. The commit goes to every node that answered, so when all ``N`` nodes were up at
commit time any minority may lose its data afterwards: the rest is still a majority. Each
acquisition writes its token back to every reachable node, which repairs a wiped node.
When a majority loses its data at once, counter-mode tokens go back; hybrid tokens
(``TIME`` in microseconds) stay ahead as long as the nodes' clocks do not go back.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from fence._core import MAX_TOKEN, validate_token
from fence._errors import ConfigurationError
from fence.abc import LockInfo

__all__ = [
    "COMMIT",
    "backoff_delay",
    "commit_needed",
    "majority",
    "merge_inspections",
    "merge_tokens",
    "time_until_free",
    "validity",
]

COMMIT = """
-- COMMIT: record the quorum's token on one node, after the acquire (or revoke) round.
-- Raises the token counter to the token and, if the caller still holds the lock, writes
-- the token into the lock hash, so that INSPECT, REVOKE and a reentrant ACQUIRE see it.
-- KEYS[1] lock hash      KEYS[2] token counter
-- KEYS[3] guard fence register (revoke only: raised to the token as well)
-- ARGV[1] owner secret (ignored for a revoke)
-- ARGV[2] the token, as a decimal string
-- Returns 1 if the caller holds the lock here (always 1 for a revoke), else 0. Counters
-- and fences only ever go up: a late or repeated commit cannot lower them.
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
  return 1
end
if redis.call('HGET', KEYS[1], 'secret') == ARGV[1] then
  redis.call('HSET', KEYS[1], 'token', ARGV[2])
  return 1
end
return 0
"""


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

    Each candidate is a node's ``max(last + 1, TIME)`` (hybrid) or ``last + 1`` (counter),
    so the maximum is ``max(max(last) + 1, max(TIME))``: above every counter of the
    granting nodes and, in hybrid mode, at least the latest of their clocks.

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


def commit_needed(proposals: Sequence[int], nodes: int) -> bool:
    """Whether the commit round can be skipped: not when every node granted the same token.

    A node that grants the lock stores its proposal as its counter and in the lock hash
    (a node that already held the lock for this owner keeps a token its counter is not
    below). If all ``nodes`` granted and proposed the same token, every node already holds
    what the commit would write, so the commit would change nothing. That is the steady
    state of counter mode with every node up; hybrid proposals carry each node's clock and
    almost never agree.

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


def backoff_delay(
    attempt: int, *, base: float, cap: float, rng: random.Random | None = None
) -> float:
    """A jittered exponential backoff: uniform in ``[d / 2, d]``.

    ``d = min(cap, base * 2**attempt)``.

    Redlock retries after a random delay, so that clients that split the votes between
    them do not collide again on the next attempt.

    Args:
        attempt: how many attempts failed before this one (0 for the first retry).
        base: the delay before the first retry, in seconds.
        cap: the longest delay, in seconds.
        rng: the random source (default: the :mod:`random` module's).
    """
    ceiling = min(cap, base * 2 ** min(attempt, 30))
    return (rng or random).uniform(ceiling / 2, ceiling)


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
