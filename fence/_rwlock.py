"""The shared-lock rule (C13) as one plain function, without I/O.

The in-memory backend runs it under its mutex, and the SQL manager on SQLite inside one
``BEGIN IMMEDIATE`` transaction; the Redis scripts and the PostgreSQL statements say the
same in Lua and SQL, and the etcd and ZooKeeper managers get it from the order of their
queue (:mod:`fence._queue`).

A resource is held by one writer or by readers. Contenders that cannot have it now may
take a place in its queue (in arrival order), which they keep alive by trying again:

- a **writer** is granted when no writer and no reader holds the lock and nobody live is
  queued ahead of it (anywhere, if it has no place);
- a **reader** when no writer holds it and no live *writer* is queued ahead of it. So a
  queued writer keeps every later reader out (no writer starvation), and the queue is
  served in arrival order, consecutive readers together;
- a refused reader takes a place, and so does a refused writer while readers hold the
  lock or queue for it (it must keep new readers out). Other refused writers wait the
  exclusive way: outside the queue, woken by releases, behind everyone queued.

The same secret again (an attempt whose reply was lost) keeps its lease and token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Decision", "Holder", "Waiting", "decide"]


@dataclass(frozen=True, slots=True)
class Holder:
    """A live lease: its owner's secret, its token and the seconds it has left."""

    secret: str
    token: int
    left: float


@dataclass(frozen=True, slots=True)
class Waiting:
    """A live place in the queue: its owner's secret, whether it waits to write, and the
    seconds until its heartbeat runs out."""

    secret: str
    writer: bool
    left: float


@dataclass(frozen=True, slots=True)
class Decision:
    """What one attempt gets.

    Attributes:
        granted: a new lease (the caller issues its token).
        kept: the token of the lease the same secret holds already (extend it).
        wait: refused: seconds until the lock may change without a wake-up, if known.
        queued: refused: the caller has (or takes) a place in the queue.
        placed: the caller had a place before this attempt (a grant gives it up).
    """

    granted: bool = False
    kept: int | None = None
    wait: float | None = None
    queued: bool = False
    placed: bool = False


def decide(
    secret: str,
    reading: bool,
    writer: Holder | None,
    readers: Sequence[Holder],
    queue: Sequence[Waiting],
) -> Decision:
    """Decide one attempt of ``secret`` (a reader if ``reading``).

    Args:
        secret: the contender's secret.
        reading: whether it asks for a read lease.
        writer: the live write lease, if any.
        readers: the live read leases.
        queue: the live places, first come first.
    """
    if writer is not None and writer.secret == secret:
        return Decision(kept=writer.token)
    for reader in readers:
        if reader.secret == secret:
            return Decision(kept=reader.token)
    place = next((i for i, w in enumerate(queue) if w.secret == secret), None)
    before = queue if place is None else queue[:place]
    ahead = [w for w in before if w.writer or not reading]
    placed = place is not None
    if writer is not None:
        wait: float | None = writer.left
    elif readers and not reading:
        wait = max(r.left for r in readers)
    elif ahead:
        wait = ahead[0].left
    else:
        return Decision(granted=True, placed=placed)
    joins = placed or reading or bool(readers) or any(not w.writer for w in queue)
    return Decision(wait=wait, queued=joins, placed=placed)
