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
  granted before it and the revoke's;
- **liveness**: when no fault strikes (nobody gives up, nothing expires, no revoke, no
  reply lost), every contender gets the lock and leaves, and the queue ends empty, within
  a bounded number of steps: no step sequence without faults reaches a state where
  somebody is stuck (an entry nobody owns ahead of it) or loops. A fault may delay that,
  never prevent it: the check runs from every reachable state, faults included.

With ``lost_reply`` (two contenders) the search adds a join whose reply is lost (ZooKeeper:
with the connection, while the session survives; once per run): the entry was made, the contender
does not know its name. It looks for the entry by the join's guid and goes on with it, or
joins again if it is gone; or the attempt gives up (its deadline came, the link still
down) and the driver's reaper deletes the entry by that guid later, while the contender
may join again. (etcd names its key by the contender's lease, so its repeated, idempotent
transaction is the "finds its entry" step.)

Mutants show that the checker can fail: a driver that trusts any wake-up (not only the
one from a predecessor that owned the lock) breaks exclusion, and so does a driver that
skips the check that its own entry still exists (etcd's keepalive, ZooKeeper's stamp
write) before it takes the lock its predecessor left, and a reader that looks only at the
entry just before it (a reader there lets it in beside the writer ahead of that reader).
For liveness: a driver whose waiter gives up without deleting its entry, one that joins
again after a lost reply without looking for its entry, and one whose reaper never
deletes the entry of a lost join, each leave an entry nobody owns at the head of the
queue. And a reaper that deletes by the acquire's guid (one guid for every join of the
call, as the ZooKeeper driver once did) deletes the entry a later join of the same call holds the
lock with: exclusion breaks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import pytest

from fence._queue import Place, owner_after_predecessor_left, place_in

CONTENDERS = 3

# A contender's phase. LOST: its join's reply was lost; it does not know its entry.
IDLE, JOINED, WAITING, CHECK, HOLDING, DONE, LOST = range(7)


@dataclass(frozen=True)
class Contender:
    writer: bool = True
    phase: int = IDLE
    entry: int | None = None  # the order of its entry in the queue
    place: Place[int] | None = None
    token: int | None = None
    gave_up: bool = False
    lost: int | None = None  # LOST: the entry its join made, unknown to it


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
    reply_lost: bool = False
    sweeps: frozenset[tuple[int, int]] = frozenset()  # (contender, entry) for the reaper


@dataclass(frozen=True)
class Protocol:
    """The decisions a driver makes; the real ones by default."""

    owner_after_left: Callable[[Place[int]], bool] = owner_after_predecessor_left
    checks_entry: bool = True
    place: Callable[[Sequence[int], int, Callable[[int], bool]], Place[int] | None] = place_in
    #: A waiter that gives up deletes its entry (abandon).
    abandons: bool = True
    #: After a lost reply, the contender looks for its entry before it joins again.
    finds_own_entry: bool = True
    #: The reaper deletes the entry of a lost join that its attempt gave up on.
    sweeps_lost_entry: bool = True
    #: Every join has a guid of its own (the reaper deletes that join's entry only); else
    #: one guid serves every join of an acquire, and the reaper deletes all of them.
    guid_per_join: bool = True


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


#: Whether a step is a fault (or a contender giving up), or a step of the protocol.
FAULT, STEP = True, False


def steps(
    state: State, protocol: Protocol, *, lost_reply: bool = False
) -> Iterator[tuple[str, State, bool]]:
    """Every step that can happen next, the state after it, and whether it is a fault."""
    queue = sorted(state.queue)

    def is_writer(entry: int) -> bool:
        return entry in state.writers

    def sweep(index: int, entry: int) -> frozenset[tuple[int, int]]:
        if not protocol.sweeps_lost_entry:
            return state.sweeps
        return state.sweeps | {(index, entry)}

    for i, c in enumerate(state.contenders):
        if c.phase == IDLE:
            order = state.next_order
            writers = state.writers | {order} if c.writer else state.writers
            made = {"queue": state.queue | {order}, "writers": writers, "next_order": order + 1}
            joined = replace(c, phase=JOINED, entry=order)
            yield f"{i} joins", _with(state, i, joined, **made), STEP
            if lost_reply and not state.reply_lost:
                lost = replace(c, phase=LOST, lost=order)
                yield (
                    f"{i} joins: reply lost",
                    _with(state, i, lost, reply_lost=True, **made),
                    FAULT,
                )
        elif c.phase == LOST:
            assert c.lost is not None
            if not protocol.finds_own_entry:
                # It joins again; the entry it made stays, and nobody knows its name.
                yield f"{i} joins again", _with(state, i, replace(c, phase=IDLE, lost=None)), STEP
            elif c.lost in state.queue:
                found = replace(c, phase=JOINED, entry=c.lost, lost=None)
                yield f"{i} finds its entry", _with(state, i, found), STEP
            else:  # it vanished (expired, revoked): join again
                idle = replace(c, phase=IDLE, lost=None)
                yield f"{i} finds no entry", _with(state, i, idle), STEP
            # The link stays down past the attempt's deadline: the reaper takes the entry
            # over, and the next attempt joins again.
            idle = replace(c, phase=IDLE, lost=None)
            yield f"{i}'s attempt gives up", _with(state, i, idle, sweeps=sweep(i, c.lost)), FAULT
        elif c.phase == JOINED:
            assert c.entry is not None
            place = protocol.place(queue, c.entry, is_writer)
            if place is None:  # its entry vanished: join again
                yield f"{i} rejoins", _with(state, i, replace(c, phase=IDLE, entry=None)), STEP
            elif place.owner:
                yield f"{i} reads: owner", _grant(state, i, c), STEP
            else:
                waiting = replace(c, phase=WAITING, place=place)
                yield f"{i} reads: waits", _with(state, i, waiting), STEP
        elif c.phase == WAITING:
            assert c.place is not None
            if c.place.predecessor not in state.queue:  # the watch fires
                if protocol.owner_after_left(c.place):
                    yield f"{i} woken: owner", _with(state, i, replace(c, phase=CHECK)), STEP
                else:
                    yield f"{i} woken: reads", _with(state, i, replace(c, phase=JOINED)), STEP
        elif c.phase == CHECK:
            if protocol.checks_entry and c.entry not in state.queue:
                gone = replace(c, phase=IDLE, entry=None)
                yield f"{i} check: gone", _with(state, i, gone), STEP
            else:
                yield f"{i} check: granted", _grant(state, i, c), STEP
        elif c.phase == HOLDING:
            done = replace(c, phase=DONE, entry=None)
            yield f"{i} releases", _with(state, i, done, queue=state.queue - {c.entry}), STEP
            if not state.holder_expired:
                # The lease ends after the holder's own deadline (C10): it is out first.
                yield (
                    f"{i} expires",
                    _with(state, i, done, queue=state.queue - {c.entry}, holder_expired=True),
                    FAULT,
                )
        if c.phase in (JOINED, WAITING, CHECK, LOST) and not c.gave_up:
            gone = replace(c, phase=DONE, entry=None, lost=None, gave_up=True)
            left = state.queue - {c.entry} if protocol.abandons else state.queue
            swept = sweep(i, c.lost) if c.lost is not None else state.sweeps
            yield f"{i} gives up", _with(state, i, gone, queue=left, sweeps=swept), FAULT
        if c.phase in (WAITING, CHECK) and not state.waiter_expired and c.entry in state.queue:
            yield (
                f"{i}'s entry expires",
                replace(state, queue=state.queue - {c.entry}, waiter_expired=True),
                FAULT,
            )
    for index, entry in sorted(state.sweeps):
        deleted = {entry}
        owner = state.contenders[index]
        if not protocol.guid_per_join and owner.entry is not None:
            deleted.add(owner.entry)  # the same guid: the acquire's later join too
        yield (
            f"reaper deletes {index}'s entries {sorted(deleted)}",
            replace(state, queue=state.queue - deleted, sweeps=state.sweeps - {(index, entry)}),
            STEP,
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
            FAULT,
        )


@dataclass(frozen=True)
class Search:
    """What a search found.

    Attributes:
        states: how many states are reachable.
        bound: the most protocol steps (no fault) from any reachable state until every
            contender is done: the bound of the liveness property.
    """

    states: int
    bound: int


def _finished(state: State) -> bool:
    return all(c.phase == DONE for c in state.contenders) and not state.queue and not state.sweeps


def explore(
    protocol: Protocol,
    writers: Sequence[bool] = (True,) * CONTENDERS,
    *,
    lost_reply: bool = False,
) -> Search:
    """Visit every reachable state; raise :class:`Violation` on the first bad one.

    Args:
        protocol: the driver's decisions.
        writers: for each contender, whether it is a writer (else a reader).
        lost_reply: add a join whose reply is lost (once per run).
    """
    start = State(contenders=tuple(Contender(w) for w in writers), queue=frozenset())
    seen = {start: 0}  # each state's number
    states = [start]
    calm: list[list[int]] = [[]]  # the numbers of the states after each one's protocol steps
    stack: list[tuple[State, tuple[str, ...]]] = [(start, ())]
    while stack:
        state, trace = stack.pop()
        inside = [i for i, c in enumerate(state.contenders) if c.phase == HOLDING]
        if len(inside) > 1 and any(state.contenders[i].writer for i in inside):
            raise Violation(f"contenders {inside} hold the lock at once after {list(trace)}")
        try:
            following = list(steps(state, protocol, lost_reply=lost_reply))
        except Violation as exc:
            raise Violation(f"{exc} after {list(trace)}") from None
        after_steps = calm[seen[state]]
        for label, after, fault in following:
            number = seen.get(after)
            if number is None:
                number = seen[after] = len(states)
                states.append(after)
                calm.append([])
                stack.append((after, (*trace, label)))
            if not fault:
                after_steps.append(number)
        if not after_steps and not _finished(state):
            raise Violation(f"stuck without a fault: {_describe(state)} after {list(trace)}")
    return Search(len(states), _longest_calm_run(calm, states))


def _describe(state: State) -> str:
    phases = ["idle", "joined", "waiting", "check", "holding", "done", "lost"]
    who = ", ".join(f"{i}: {phases[c.phase]}" for i, c in enumerate(state.contenders))
    return f"queue {sorted(state.queue)} ({who})"


def _longest_calm_run(calm: list[list[int]], states: list[State]) -> int:
    """The most protocol steps from any state until nothing is left to do; raise
    :class:`Violation` if the protocol steps alone can go round in a circle (then a
    contender may wait for ever without a fault). States are numbered, ``calm[n]`` the
    numbers of the states after the protocol steps of state ``n``."""
    depth = [-1] * len(calm)
    on_path = [False] * len(calm)
    for root in range(len(calm)):
        if depth[root] >= 0:
            continue
        stack = [(root, iter(calm[root]))]
        on_path[root] = True
        while stack:
            number, following = stack[-1]
            for child in following:
                if on_path[child]:
                    raise Violation(
                        f"protocol steps go round in a circle at {_describe(states[child])}"
                    )
                if depth[child] < 0:
                    on_path[child] = True
                    stack.append((child, iter(calm[child])))
                    break
            else:
                stack.pop()
                on_path[number] = False
                depth[number] = 1 + max((depth[c] for c in calm[number]), default=-1)
    return max(depth, default=0)


W, R = True, False


def test_queue_protocol_keeps_exclusion_and_token_order_in_every_interleaving() -> None:
    search = explore(Protocol())
    assert search.states > 10_000  # the search really branched (every interleaving of 3 + faults)
    assert search.bound > 0


@pytest.mark.parametrize("writers", [(W, R, R), (R, W, R)], ids=["w-r-r", "r-w-r"])
def test_read_write_queue_keeps_exclusion_and_token_order(writers: tuple[bool, ...]) -> None:
    """C13 on the same queue: readers share, a writer excludes, tokens order writers."""
    search = explore(Protocol(), writers)
    assert search.states > 10_000


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


# -- a join whose reply is lost --------------------------------------------------------------

#: Two contenders: a lost reply multiplies the states of three by about twenty (to more
#: than a million), past what one test run can afford; two already cover a contender
#: behind the entry of a lost join, and a newcomer beside a holder.
PAIRS = [(W, W), (W, R), (R, W)]


@pytest.mark.parametrize("writers", PAIRS, ids=["w-w", "w-r", "r-w"])
def test_lost_join_reply_leaves_no_orphan_and_keeps_exclusion(writers: tuple[bool, ...]) -> None:
    """A join whose reply is lost, in every interleaving with the other faults: the
    contender finds its entry or the reaper deletes it; exclusion, token order and
    liveness hold."""
    search = explore(Protocol(), writers, lost_reply=True)
    assert search.states > 5 * explore(Protocol(), writers).states  # the new steps branched


def test_checker_catches_a_waiter_that_gives_up_without_deleting_its_entry() -> None:
    with pytest.raises(Violation, match="stuck without a fault"):
        explore(Protocol(abandons=False))


def test_checker_catches_a_driver_that_joins_again_without_looking_for_its_entry() -> None:
    # The entry of the lost join stays at the head of the queue, held by nobody.
    with pytest.raises(Violation, match="stuck without a fault"):
        explore(Protocol(finds_own_entry=False), (W, W), lost_reply=True)


def test_checker_catches_a_reaper_that_leaves_a_lost_join_s_entry() -> None:
    with pytest.raises(Violation, match="stuck without a fault"):
        explore(Protocol(sweeps_lost_entry=False), (W, W), lost_reply=True)


def test_checker_catches_a_reaper_that_deletes_by_the_acquire_s_guid() -> None:
    # The attempt whose reply was lost gives up; the next join of the same acquire gets
    # the lock; the reaper, looking for the first join's entry by the shared guid,
    # deletes the holder's entry too, and a newcomer walks in beside the holder.
    with pytest.raises(Violation, match="hold the lock at once"):
        explore(Protocol(guid_per_join=False), (W, W), lost_reply=True)
