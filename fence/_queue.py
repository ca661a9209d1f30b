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

**Shared locks (C13).** A reader's entry is marked as such (etcd: the key; ZooKeeper: the
node's name). A writer comes first when no entry of any kind is ahead of it; a reader when
no *writer* is ahead of it, so the readers between two writers hold the lock together. A
waiter watches the last entry that keeps it out: a writer the entry just before it, a
reader the last writer before it. When that entry leaves and it was the only one keeping
the waiter out, the waiter owns the lock (new entries only come after it); otherwise it
reads the queue again. So a release wakes one writer, or every reader behind it up to the
next writer; a waiting writer keeps every later reader out (no writer starvation); and the
queue is served in arrival order, readers in batches (etcd's and kazoo's read/write
recipes).

**Tokens (C2).** The token is the order value of the winning entry (etcd: create revision;
ZooKeeper: the node's ``czxid``). Let entry ``x`` be granted before entry ``y``. When ``x``
was granted, no entry ordered before ``x`` existed. If ``y`` were ordered before ``x``, it
was created before ``x`` and still existed then (entries that left never come back): a
contradiction. So ``y`` is ordered after ``x``, and its token is larger. Both engines keep
that order through leader changes and restarts from disk. With readers the same argument
holds whenever ``x`` or ``y`` is a writer (C13: a writer's token is above every token before
it, a reader's above every earlier writer's): if ``y`` were ordered before ``x``, it was
still there when ``x`` was granted, and one of them is a writer, so it kept ``x`` out.
Two readers may be granted in either order; their tokens are distinct.

``tests/test_queue_model.py`` checks the protocol of the drivers, built from the functions
below, over every interleaving of three contenders (writers, and readers beside writers),
and shows that the checker catches a driver that trusts a wake-up from a predecessor that
was not the owner, and a reader that looks only at the entry just before it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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


def place_in(
    order: Sequence[K], mine: K, is_writer: Callable[[K], bool] | None = None
) -> Place[K] | None:
    """The place of ``mine`` in ``order`` (the queue sorted by the engine's order).

    Args:
        order: the entries, first come first.
        mine: the caller's entry.
        is_writer: tells writers' entries from readers' (C13); ``None``: every entry is a
            writer's (an exclusive lock). For a reader only the writers ahead count: the
            place's ``ahead`` is how many writers come before it, its ``predecessor`` the
            last of them.

    Returns ``None`` when ``mine`` is not in the queue (it expired, or was revoked).
    """
    try:
        index = list(order).index(mine)
    except ValueError:
        return None
    before = list(order[:index])
    if is_writer is not None and not is_writer(mine):
        before = [entry for entry in before if is_writer(entry)]
    return Place(len(before), before[-1] if before else None)


def owner_after_predecessor_left(place: Place[K]) -> bool:
    """Whether the entry owns the lock once the predecessor it watched has left.

    True only when the predecessor was the only entry keeping this one out (the owner, or
    for a reader the only writer ahead): no entry can have joined before this one since
    (new entries come last), so none that keeps it out is left. Otherwise one further ahead
    may still be there, and the queue must be read again.
    """
    return place.predecessor_is_owner
