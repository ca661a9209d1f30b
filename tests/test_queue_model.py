"""An exhaustive check of the wait queue of the etcd and ZooKeeper managers.

The model runs the drivers' own decision functions (:mod:`fence._queue`) for three
contenders (writers, or readers and writers: C13) over a queue whose order only grows (etcd
create revisions, ZooKeeper sequence numbers), and explores *every* interleaving of their
steps and of the faults the engines
add: a waiter giving up, a waiter's entry vanishing (its lease or session expired during
the wait), a holder's lease expiring, and an administrator's revoke. Each step is one
round trip, atomic on the engine. It checks:

- **mutual exclusion**: never a writer inside the lock beside anyone (readers share it; a
  revoke ends the holders' leases by force: from then on their tokens are fenced out, C8);
- **tokens (C2, C13)**: a writer's token is above every token granted before, readers'
  included, and above the token a revoke returned; a reader's is above every writer's
  granted before it and the revoke's.

Three mutants show that the checker can fail: a driver that trusts any wake-up (not only the
one from a predecessor that owned the lock) breaks exclusion, and so does a driver that
skips the check that its own entry still exists (etcd's keepalive, ZooKeeper's stamp
write) before it takes the lock its predecessor left, and a reader that looks only at the
entry just before it (a reader there lets it in beside the writer ahead of that reader).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import pytest

from fence._queue import Place, owner_after_predecessor_left, place_in

CONTENDERS = 3

# A contender's phase.
IDLE, JOINED, WAITING, CHECK, HOLDING, DONE = range(6)


@dataclass(frozen=True)
class Contender:
    writer: bool = True
    phase: int = IDLE
    entry: int | None = None  # the order of its entry in the queue
    place: Place[int] | None = None
    token: int | None = None
    gave_up: bool = False


@dataclass(frozen=True)
class State:
    contenders: tuple[Contender, ...]
    queue: frozenset[int]  # orders of the entries present
    writers: frozenset[int] = frozenset()  # the orders of writers' entries ever created
    next_order: int = 1
    last_token: int = 0  # the largest token granted or returned by a revoke
    last_exclusive: int = 0  # the largest granted to a writer or returned by a revoke
    revoked: bool = False
    waiter_expired: bool = False
    holder_expired: bool = False


@dataclass(frozen=True)
class Protocol:
    """The decisions a driver makes; the real ones by default."""

    owner_after_left: Callable[[Place[int]], bool] = owner_after_predecessor_left
    checks_entry: bool = True
    place: Callable[[Sequence[int], int, Callable[[int], bool]], Place[int] | None] = place_in


class Violation(AssertionError):
    """A reachable state breaks an invariant."""


def _with(state: State, index: int, contender: Contender, **changes: Any) -> State:
    contenders = list(state.contenders)
    contenders[index] = contender
    return replace(state, contenders=tuple(contenders), **changes)


def _grant(state: State, index: int, contender: Contender) -> State:
    assert contender.entry is not None
    token = contender.entry
    above = state.last_token if contender.writer else state.last_exclusive
    if token <= above:
        raise Violation(f"contender {index} granted token {token}, not above {above}")
    holder = replace(contender, phase=HOLDING, token=token, place=None)
    exclusive = token if contender.writer else state.last_exclusive
    return _with(
        state, index, holder, last_token=max(token, state.last_token), last_exclusive=exclusive
    )


def steps(state: State, protocol: Protocol) -> Iterator[tuple[str, State]]:
    """Every step that can happen next, and the state after it."""
    queue = sorted(state.queue)

    def is_writer(entry: int) -> bool:
        return entry in state.writers

    for i, c in enumerate(state.contenders):
        if c.phase == IDLE:
            order = state.next_order
            joined = replace(c, phase=JOINED, entry=order)
            writers = state.writers | {order} if c.writer else state.writers
            yield (
                f"{i} joins",
                _with(
                    state,
                    i,
                    joined,
                    queue=state.queue | {order},
                    writers=writers,
                    next_order=order + 1,
                ),
            )
        elif c.phase == JOINED:
            assert c.entry is not None
            place = protocol.place(queue, c.entry, is_writer)
            if place is None:  # its entry vanished: join again
                yield f"{i} rejoins", _with(state, i, replace(c, phase=IDLE, entry=None))
            elif place.owner:
                yield f"{i} reads: owner", _grant(state, i, c)
            else:
                waiting = replace(c, phase=WAITING, place=place)
                yield f"{i} reads: waits", _with(state, i, waiting)
        elif c.phase == WAITING:
            assert c.place is not None
            if c.place.predecessor not in state.queue:  # the watch fires
                if protocol.owner_after_left(c.place):
                    yield f"{i} woken: owner", _with(state, i, replace(c, phase=CHECK))
                else:
                    yield f"{i} woken: reads", _with(state, i, replace(c, phase=JOINED))
        elif c.phase == CHECK:
            if protocol.checks_entry and c.entry not in state.queue:
                yield f"{i} check: gone", _with(state, i, replace(c, phase=IDLE, entry=None))
            else:
                yield f"{i} check: granted", _grant(state, i, c)
        elif c.phase == HOLDING:
            done = replace(c, phase=DONE, entry=None)
            yield f"{i} releases", _with(state, i, done, queue=state.queue - {c.entry})
            if not state.holder_expired:
                # The lease ends after the holder's own deadline (C10): it is out first.
                yield (
                    f"{i} expires",
                    _with(state, i, done, queue=state.queue - {c.entry}, holder_expired=True),
                )
        if c.phase in (JOINED, WAITING, CHECK) and not c.gave_up:
            gone = replace(c, phase=DONE, entry=None, gave_up=True)
            yield f"{i} gives up", _with(state, i, gone, queue=state.queue - {c.entry})
        if c.phase in (WAITING, CHECK) and not state.waiter_expired and c.entry in state.queue:
            yield (
                f"{i}'s entry expires",
                replace(state, queue=state.queue - {c.entry}, waiter_expired=True),
            )
    if not state.revoked and state.queue:
        # Every entry goes; the token returned is above all of them.
        token = state.next_order
        holders = [
            replace(c, phase=DONE, entry=None) if c.phase == HOLDING else c
            for c in state.contenders
        ]
        yield (
            "revoke",
            replace(
                state,
                contenders=tuple(holders),
                queue=frozenset(),
                next_order=token + 1,
                last_token=max(state.last_token, token),
                last_exclusive=max(state.last_exclusive, token),
                revoked=True,
            ),
        )


def explore(protocol: Protocol, writers: Sequence[bool] = (True,) * CONTENDERS) -> int:
    """Visit every reachable state; raise :class:`Violation` on the first bad one. Returns
    how many states there are.

    Args:
        protocol: the driver's decisions.
        writers: for each contender, whether it is a writer (else a reader).
    """
    start = State(contenders=tuple(Contender(w) for w in writers), queue=frozenset())
    seen = {start}
    stack = [(start, ())]
    while stack:
        state, trace = stack.pop()
        inside = [i for i, c in enumerate(state.contenders) if c.phase == HOLDING]
        if len(inside) > 1 and any(state.contenders[i].writer for i in inside):
            raise Violation(f"contenders {inside} hold the lock at once after {list(trace)}")
        try:
            following = list(steps(state, protocol))
        except Violation as exc:
            raise Violation(f"{exc} after {list(trace)}") from None
        for label, after in following:
            if after not in seen:
                seen.add(after)
                stack.append((after, (*trace, label)))
    return len(seen)


W, R = True, False


def test_queue_protocol_keeps_exclusion_and_token_order_in_every_interleaving() -> None:
    states = explore(Protocol())
    assert states > 10_000  # the search really branched (every interleaving of 3 + faults)


@pytest.mark.parametrize("writers", [(W, R, R), (R, W, R)], ids=["w-r-r", "r-w-r"])
def test_read_write_queue_keeps_exclusion_and_token_order(writers: tuple[bool, ...]) -> None:
    """C13 on the same queue: readers share, a writer excludes, tokens order writers."""
    states = explore(Protocol(), writers)
    assert states > 10_000


def _predecessor_only(
    order: Sequence[int], mine: int, is_writer: Callable[[int], bool]
) -> Place[int] | None:
    """A reader that looks only at the entry just before it: a reader there (or nothing)
    and it thinks itself in; a writer there and it waits for that one alone."""
    place = place_in(order, mine)
    if place is None or is_writer(mine) or place.predecessor is None:
        return place
    return Place(1 if is_writer(place.predecessor) else 0, place.predecessor)


def test_checker_catches_a_reader_that_looks_only_at_its_predecessor() -> None:
    # W holds, a reader waits behind it, and the reader behind that one walks in.
    with pytest.raises(Violation, match=r"hold the lock at once|granted token"):
        explore(Protocol(place=_predecessor_only), (W, R, R))


def test_checker_catches_a_driver_that_trusts_any_wake_up() -> None:
    with pytest.raises(Violation, match="hold the lock at once"):
        explore(Protocol(owner_after_left=lambda place: True))


def test_checker_catches_a_driver_that_skips_the_entry_check() -> None:
    # Its entry gone (expired during the wait, or revoked), such a waiter still takes the
    # lock: beside a newcomer, or with a token below the revoke's.
    with pytest.raises(Violation, match=r"hold the lock at once|granted token"):
        explore(Protocol(checks_entry=False))
