"""The wait queue of the consensus-backed managers (etcd, ZooKeeper), without I/O.

Both managers queue the same way, on the engine's own order: every contender writes one
entry under the resource (an etcd key, whose order is its create revision; a ZooKeeper
sequential node, whose order is its sequence number, which follows the zxid). The lock
belongs to the entry that comes first. Entries only ever leave the queue (released,
expired, revoked, given up); a new entry always comes last, because the engine's order
only grows. That one fact carries the whole protocol::

    keys of R (create revision)   owner   waiters and what each watches
    A@17  B@18  C@21              A       B watches A, C watches B
    A released (key deleted)              B is woken: A was the only key before B,
                                          so B is the owner now (no read needed)
    B gave up (key deleted)               C is woken: B was *not* the only key before C
                                          when C looked, so C reads the queue again

Each waiter watches only its predecessor, so a release wakes one waiter (no herd), and the
queue is served in arrival order (FIFO).

**Tokens (C2).** The token is the order value of the winning entry (etcd: create revision;
ZooKeeper: the node's ``czxid``). Let entry ``x`` be granted before entry ``y``. When ``x``
was granted, no entry ordered before ``x`` existed. If ``y`` were ordered before ``x``, it
was created before ``x`` and still existed then (entries that left never come back): a
contradiction. So ``y`` is ordered after ``x``, and its token is larger. Both engines keep
that order through leader changes and restarts from disk.

``tests/test_queue_model.py`` checks the protocol of the drivers, built from the functions
below, over every interleaving of three contenders, and shows that the checker catches a
driver that trusts a wake-up from a predecessor that was not the owner.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

__all__ = ["Place", "owner_after_predecessor_left", "place_in"]

K = TypeVar("K")


@dataclass(frozen=True, slots=True)
class Place(Generic[K]):
    """Where an entry stands in its queue, as one read of the queue saw it.

    Attributes:
        ahead: how many entries come before it.
        predecessor: the entry just before it (``None`` when it comes first).
    """

    ahead: int
    predecessor: K | None

    @property
    def owner(self) -> bool:
        """Whether the entry holds the lock: nothing comes before it."""
        return self.ahead == 0

    @property
    def predecessor_is_owner(self) -> bool:
        """Whether the predecessor was the only entry before this one (the owner)."""
        return self.ahead == 1


def place_in(order: Sequence[K], mine: K) -> Place[K] | None:
    """The place of ``mine`` in ``order`` (the queue sorted by the engine's order).

    Returns ``None`` when ``mine`` is not in the queue (it expired, or was revoked).
    """
    try:
        index = list(order).index(mine)
    except ValueError:
        return None
    return Place(index, order[index - 1] if index else None)


def owner_after_predecessor_left(place: Place[K]) -> bool:
    """Whether the entry owns the lock once the predecessor it watched has left.

    True only when the predecessor was the owner: no entry can have joined before this one
    since (new entries come last), so none is left before it. Otherwise an entry further
    ahead may still be there, and the queue must be read again.
    """
    return place.predecessor_is_owner
