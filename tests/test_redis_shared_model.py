"""An exhaustive check of the Redis manager's shared (read/write) locks, on its real scripts.

The model runs the single-node manager's own Lua scripts (:mod:`fence._redis_scripts`:
ACQUIRE, ENQUEUE, RENEW, RELEASE, ABANDON, CANCEL, REVOKE) in the emulation of
``tests/lua_redis.py``, for three contenders (readers and writers), with and without FIFO,
and explores *every* interleaving of their steps and of time: each contender tries, waits
(a refused attempt), tries again, joins the queue from its wait (FIFO writers), gives up
(ABANDON) or cancels (CANCEL), holds, renews, releases; time passes in whole ticks, so
leases and queue places expire; an administrator revokes. A contender that cancels from
its wait has a request whose reply it never had (another ACQUIRE, or a FIFO writer's
ENQUEUE), which may reach the server at any later step, or never. Each script is one
atomic step, as on the server. It checks, at every grant and after every step:

- **exclusion**: never a writer beside anyone (a holder whose lease ended is out: its
  client deadline ended first, C10);
- **tokens (C13)**: a writer's token is above every token issued before, readers' and
  revokes' included; a reader's is above every earlier writer's and revoke's;
- **no starvation, FIFO**: no reader is granted while a live writer is queued ahead of it
  (or, if the reader is not queued, at all); no writer while anyone live is queued ahead;
- **no lost wake-up**: a step that lets a queued waiter in (a release, the last reader
  leaving, a waiter giving up, a revoke) publishes that waiter's id; one that lets an
  unqueued waiter in (without FIFO) publishes the empty wake-up;
- **no orphan**: once a contender has cancelled, it holds neither the lock nor a read lease
  nor a place in the queue, whatever arrives after CANCEL; a request of its that arrives
  late is refused (a place left behind would be woken by the next release, and the
  waiters behind it would wait for it to expire).

ACQUIRE and RELEASE have a fast path for a writer, run before the rest of the prelude is
defined (nobody queued, no reader). A second search runs every ACQUIRE and RELEASE twice,
as written and with the fast path turned off, and fails where the two differ in reply,
writes or wake-ups: the fast path is an optimisation of the general path, never a rule of
its own. A last test runs both paths on a real redis-server and on the emulation.

Mutants of the scripts show that the checker can fail: a reader that ignores queued
writers, a writer that ignores readers, a wake-up that names only the head of a batch of
readers, a fast grant that ignores readers, a fast release that ignores the queue, and
the scripts as they were before CANCEL's tombstone refused a late attempt's place (an
ACQUIRE that queues a cancelled reader behind a writer, an ENQUEUE that queues a
cancelled writer).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis

from fence._redis_keys import resource_keys, waiter_id
from fence._redis_scripts import (
    ABANDON,
    ACQUIRE,
    CANCEL,
    ENQUEUE,
    RELEASE,
    RENEW,
    REVOKE,
)
from tests.frozen import replace
from tests.lua_redis import EMPTY, LuaRedis, Store, ZSet

TICK = 1000  # ms
TTL = 2 * TICK
QUEUE_LIFE = 3 * TICK
START = 1_000_000_000  # server ms; TIME works from it
KEYS = resource_keys("fence:", "r")

IDLE, WAIT, HOLD, DONE = "idle", "wait", "hold", "done"
#: Holds the lock without a client: an attempt that arrived after its CANCEL's tombstone
#: had expired. Nobody releases or renews it; it ends with its ttl.
ORPHAN = "orphan"
HELD = (HOLD, ORPHAN)

SCRIPTS = {
    "acquire": ACQUIRE,
    "enqueue": ENQUEUE,
    "renew": RENEW,
    "release": RELEASE,
    "abandon": ABANDON,
    "cancel": CANCEL,
    "revoke": REVOKE,
}


@dataclass(frozen=True)
class Bounds:
    """What one search explores.

    Attributes:
        modes: each contender's mode, ``"r"`` or ``"w"``.
        fifo: the managers' FIFO option.
        attempts: acquire attempts per contender.
        ticks: how far time may run.
        renews: renewals in all.
        revokes: revokes in all.
        give_ups: waiters giving up (ABANDON) or cancelling (CANCEL), in all.
    """

    modes: tuple[str, ...] = ("r", "r", "w")
    fifo: bool = False
    attempts: int = 2
    ticks: int = 3
    renews: int = 1
    revokes: int = 1
    give_ups: int = 1


@dataclass(frozen=True)
class Contender:
    mode: str
    phase: str = IDLE
    attempts: int = 0
    queued: bool = False  # its last reply said it has a place in the queue
    lease_end: int = 0
    token: int = 0
    cancelled: bool = False  # it sent CANCEL: nothing of its own may stay
    late: str = ""  # a request sent before CANCEL that has not reached the server yet
    # Its late request arrived after the tombstone had expired (it lives the lease's ttl):
    # what it took is bounded by its ttl (a lock) or the queue's (a place), not refused.
    stray: bool = False


@dataclass(frozen=True)
class State:
    store: Store
    now: int
    contenders: tuple[Contender, ...]
    top: int = 0  # the largest token issued (a grant or a revoke)
    top_exclusive: int = 0  # the largest issued to a writer or by a revoke
    ticks: int = 0
    renews: int = 0
    revokes: int = 0
    give_ups: int = 0


class Violation(AssertionError):
    """A reachable state breaks an invariant."""


def secret(index: int) -> str:
    return f"s{index}"


class Model:
    """The transitions of one configuration, on one script runner."""

    def __init__(self, bounds: Bounds, lua: LuaRedis) -> None:
        self.bounds = bounds
        self.lua = lua
        self.fifo = "1" if bounds.fifo else "0"

    def run(self, name: str, keys: list[str], args: list[str], state: State) -> Any:
        store, reply, published = self.lua.run_published(
            name, tuple(keys), tuple(args), state.store, state.now
        )
        if isinstance(reply, Exception):
            raise Violation(f"{name} failed: {reply}")
        return store, reply, published

    # -- the scripts, as the driver calls them ---------------------------------------------

    def acquire(self, state: State, index: int) -> tuple[Store, Any, Any]:
        c = state.contenders[index]
        keys = [KEYS.lock, KEYS.token, KEYS.fence, KEYS.queue, KEYS.deadlines]
        args = [
            secret(index),
            str(TTL),
            f"h{index}",
            "counter",
            waiter_id(secret(index)),
            str(QUEUE_LIFE),
            c.mode,
            self.fifo,
        ]
        return self.run("acquire", keys, args, state)

    def enqueue(self, state: State, index: int) -> tuple[Store, Any, Any]:
        keys = [KEYS.lock, KEYS.queue, KEYS.deadlines]
        args = [waiter_id(secret(index)), str(QUEUE_LIFE), secret(index)]
        return self.run("enqueue", keys, args, state)

    def grantable(self, state: State, index: int) -> bool:
        _, reply, _ = self.acquire(state, index)
        return not isinstance(reply, list)

    # -- the search ------------------------------------------------------------------------

    def steps(self, state: State) -> Iterator[tuple[int | None, str, State, tuple[Any, ...]]]:
        """Every step that can happen next: ``(actor, label, state after, published)``."""
        b = self.bounds
        queue_keys = [KEYS.lock, KEYS.queue, KEYS.deadlines]
        for i, c in enumerate(state.contenders):
            if c.phase in (IDLE, WAIT) and c.attempts < b.attempts:
                store, reply, published = self.acquire(state, i)
                after = replace(state, store=store)
                if isinstance(reply, list):
                    waiting = replace(c, phase=WAIT, attempts=c.attempts + 1, queued=reply[2] == 1)
                    yield i, f"{i} refused", self._with(after, i, waiting), published
                else:
                    yield (
                        i,
                        f"{i} granted {reply}",
                        self._grant(state, after, i, int(reply)),
                        published,
                    )
            enqueues = c.phase == WAIT and b.fifo and c.mode == "w" and not c.queued
            if enqueues:
                # The FIFO wait queues the writer, and tries at once if it is first in line.
                store, go, published = self.enqueue(state, i)
                del go  # go: try again at once, which the search does anyway
                queued = replace(c, queued=True)
                yield (
                    i,
                    f"{i} enqueues",
                    self._with(replace(state, store=store), i, queued),
                    published,
                )
            if c.phase == WAIT and state.give_ups < b.give_ups:
                store, _, published = self.run(
                    "abandon", queue_keys, [waiter_id(secret(i)), self.fifo], state
                )
                gone = replace(state, store=store, give_ups=state.give_ups + 1)
                yield i, f"{i} gives up", self._with(gone, i, replace(c, phase=DONE)), published
            if c.phase == WAIT and state.give_ups < b.give_ups:
                store, _, published = self.run(
                    "cancel",
                    queue_keys,
                    [secret(i), str(TTL), waiter_id(secret(i)), self.fifo],
                    state,
                )
                gone = replace(state, store=store, give_ups=state.give_ups + 1)
                # What may still be on its way, to arrive at any later step or never: the
                # attempt whose reply was lost, or the FIFO wait's ENQUEUE.
                for late in ("acquire", "enqueue") if enqueues else ("acquire",):
                    done = replace(c, phase=DONE, cancelled=True, late=late)
                    yield (
                        i,
                        f"{i} cancels ({late} on its way)",
                        self._with(gone, i, done),
                        published,
                    )
            if c.late:
                stray = not _alive(state, KEYS.void_prefix + secret(i))
                label = f"{i}'s {c.late} arrives after its CANCEL" + (
                    " and its tombstone" if stray else ""
                )
                if c.late == "acquire":
                    store, reply, published = self.acquire(state, i)
                    if not isinstance(reply, list):
                        if not stray:
                            raise Violation(f"{i}'s attempt after its CANCEL was granted")
                        orphan = replace(
                            self._grant(state, replace(state, store=store), i, int(reply)),
                            contenders=state.contenders,
                        )
                        held = replace(
                            c, phase=ORPHAN, late="", stray=True, lease_end=state.now + TTL
                        )
                        yield i, label + " (granted)", self._with(orphan, i, held), published
                        continue
                else:
                    store, _, published = self.enqueue(state, i)
                arrived = replace(state, store=store)
                yield i, label, self._with(arrived, i, replace(c, late="", stray=stray)), published
            if c.phase == HOLD:
                store, released, published = self.run(
                    "release", queue_keys, [secret(i), self.fifo], state
                )
                if released != 1:
                    raise Violation(f"{i} held the lock, yet its release found nothing")
                done = replace(state, store=store)
                yield i, f"{i} releases", self._with(done, i, replace(c, phase=DONE)), published
                if state.renews < b.renews:
                    store, renewed, published = self.run(
                        "renew", [KEYS.lock], [secret(i), str(TTL)], state
                    )
                    if renewed != 1:
                        raise Violation(f"{i} held the lock, yet its renewal failed")
                    kept = replace(c, lease_end=state.now + TTL)
                    after = replace(state, store=store, renews=state.renews + 1)
                    yield i, f"{i} renews", self._with(after, i, kept), published
        if state.ticks < b.ticks:
            now = state.now + TICK
            contenders = tuple(
                replace(c, phase=DONE) if c.phase in HELD and c.lease_end <= now else c
                for c in state.contenders
            )
            ticked = replace(state, now=now, contenders=contenders, ticks=state.ticks + 1)
            yield None, "tick", ticked, ()
        if state.revokes < b.revokes:
            keys = [KEYS.lock, KEYS.token, KEYS.fence, KEYS.queue, KEYS.deadlines]
            store, token, published = self.run("revoke", keys, ["counter", self.fifo], state)
            if int(token) <= state.top:
                raise Violation(f"revoke returned {token} after {state.top}")
            contenders = tuple(
                replace(c, phase=DONE) if c.phase in HELD else c for c in state.contenders
            )
            after = replace(
                state,
                store=store,
                contenders=contenders,
                top=int(token),
                top_exclusive=int(token),
                revokes=state.revokes + 1,
            )
            yield None, "revoke", after, published

    def check_no_orphans(self, state: State) -> None:
        """A contender that cancelled holds nothing and has no place in the queue (unless
        a request of its arrived after the tombstone had expired: see ``stray``)."""
        holder = dict(_hash(state.store, KEYS.lock)).get("secret")
        readers = _zset(state.store, KEYS.readers)
        queue = _zset(state.store, KEYS.queue)
        for i, c in enumerate(state.contenders):
            if not c.cancelled or c.stray:
                continue
            if holder == secret(i) or secret(i) in readers:
                raise Violation(f"{i} cancelled, yet it holds the lock")
            if waiter_id(secret(i)) in queue:
                raise Violation(f"{i} cancelled, yet it has an orphan place in the queue")

    def _with(self, state: State, index: int, contender: Contender) -> State:
        contenders = list(state.contenders)
        contenders[index] = contender
        return replace(state, contenders=tuple(contenders))

    def _grant(self, before: State, after: State, index: int, token: int) -> State:
        c = before.contenders[index]
        others = [o for j, o in enumerate(before.contenders) if j != index and o.phase in HELD]
        if c.mode == "w" and others:
            raise Violation(f"writer {index} granted beside holders {others}")
        if c.mode == "r" and any(o.mode == "w" for o in others):
            raise Violation(f"reader {index} granted beside a writer")
        above = before.top if c.mode == "w" else before.top_exclusive
        if token <= above:
            raise Violation(f"{c.mode} {index} got token {token}, not above {above}")
        self._check_order(before, index)
        holder = replace(
            c, phase=HOLD, attempts=c.attempts + 1, lease_end=before.now + TTL, token=token
        )
        after = replace(
            after,
            top=max(before.top, token),
            top_exclusive=token if c.mode == "w" else before.top_exclusive,
        )
        return self._with(after, index, holder)

    def _check_order(self, state: State, index: int) -> None:
        """No starvation, FIFO: nobody that must go first is queued, live, ahead."""
        queue = _zset(state.store, KEYS.queue)
        writers = _zset(state.store, KEYS.queue_writers)
        deadlines = dict(_hash(state.store, KEYS.deadlines))
        mine = queue.get(waiter_id(secret(index)))
        mode = state.contenders[index].mode
        for member, score in queue.items():
            live = int(deadlines.get(member, "0")) > state.now
            ahead = mine is None or score < mine
            if live and ahead and (mode == "w" or member in writers):
                raise Violation(f"{mode} {index} granted while {member} is queued ahead of it")

    def check_wake_ups(
        self, actor: int | None, before: State, after: State, published: tuple[Any, ...]
    ) -> None:
        """A step that lets another waiter in names it (or wakes every unqueued waiter);
        the actor's own reply tells it to try again (ENQUEUE's answer)."""
        ids = {i for _, message in published for i in message.split()}
        empty = any(message == "" for _, message in published)
        deadlines = dict(_hash(after.store, KEYS.deadlines))
        queue = {m for m in _zset(after.store, KEYS.queue) if int(deadlines[m]) > after.now}
        for i, c in enumerate(after.contenders):
            if i == actor or c.phase != WAIT or before.contenders[i].phase != WAIT:
                continue
            if self.grantable(before, i) or not self.grantable(after, i):
                continue
            wid = waiter_id(secret(i))
            if wid in queue:
                if wid not in ids:
                    raise Violation(f"waiter {i} can go now but was not woken: {published}")
            elif not c.queued and not self.bounds.fifo and not empty:
                raise Violation(f"unqueued waiter {i} can go now but nothing woke: {published}")
            # A waiter told it was queued whose place is gone or dead missed its heartbeat
            # (its attempts come every queue_ttl/3): its own timer wakes it.


def _alive(state: State, key: str) -> bool:
    """``key`` exists at ``state.now`` (it has not expired)."""
    return any(k == key and (end is None or end > state.now) for k, _, end in state.store)


def _entry(store: Store, key: str) -> Any:
    for k, value, _ in store:
        if k == key:
            return value
    return ()


def _zset(store: Store, key: str) -> dict[str, float]:
    return dict(_entry(store, key))


def _hash(store: Store, key: str) -> tuple[tuple[str, str], ...]:
    return tuple(_entry(store, key))


#: Where ACQUIRE and RELEASE take their fast path (before the prelude), and the text that
#: turns it off: what is left is the general path, the reference the fast path must match.
FAST_PATHS = {
    "acquire": ("local fast = ARGV[7] == 'w'", "local fast = false"),
    "release": (
        "if not KEYS[3] or redis.call('EXISTS', KEYS[2]) == 0 then",
        "if false then",
    ),
}


def general_paths(scripts: dict[str, str]) -> dict[str, str]:
    """``scripts`` with the fast paths turned off."""
    out = dict(scripts)
    for name, (fast, off) in FAST_PATHS.items():
        assert out[name].count(fast) == 1, fast
        out[name] = out[name].replace(fast, off)
    return out


class Twin(Model):
    """A model that runs every ACQUIRE and RELEASE on the reference scripts as well, and
    fails where the two differ in reply, writes or wake-ups."""

    def __init__(self, bounds: Bounds, lua: LuaRedis, reference: LuaRedis) -> None:
        super().__init__(bounds, lua)
        self.reference = reference

    def run(self, name: str, keys: list[str], args: list[str], state: State) -> Any:
        got = super().run(name, keys, args, state)
        if name in FAST_PATHS:
            want = self.reference.run_published(
                name, tuple(keys), tuple(args), state.store, state.now
            )
            if tuple(got) != tuple(want):
                raise Violation(
                    f"the fast path of {name} {args} differs from the general path: {got} != {want}"
                )
        return got


def explore(
    bounds: Bounds,
    scripts: dict[str, str] | None = None,
    reference: dict[str, str] | None = None,
) -> int:
    """Visit every reachable state; raise :class:`Violation` on the first bad one. Returns
    how many states there are. With ``reference`` scripts, every ACQUIRE and RELEASE must
    also match them (:class:`Twin`)."""
    lua = LuaRedis(scripts or SCRIPTS)
    model = Model(bounds, lua) if reference is None else Twin(bounds, lua, LuaRedis(reference))
    start = State(EMPTY, START, tuple(Contender(mode) for mode in bounds.modes))
    seen = {start}
    stack: list[tuple[State, tuple[str, ...]]] = [(start, ())]
    while stack:
        state, trace = stack.pop()
        try:
            following = list(model.steps(state))
        except Violation as exc:
            raise Violation(f"{exc} after {list(trace)}") from None
        for actor, label, after, published in following:
            try:
                if label != "tick":
                    model.check_wake_ups(actor, state, after, published)
                model.check_no_orphans(after)
            except Violation as exc:
                raise Violation(f"{exc} after {[*trace, label]}") from None
        for _, label, after, _ in following:
            if after not in seen:
                seen.add(after)
                stack.append((after, (*trace, label)))
    return len(seen)


CONFIGS = [
    pytest.param(Bounds(modes=("r", "w", "r")), id="r-w-r"),
    pytest.param(Bounds(modes=("r", "w", "w"), fifo=True, renews=0), id="fifo-r-w-w"),
]


@pytest.mark.parametrize("bounds", CONFIGS)
def test_shared_locks_keep_their_promises_in_every_interleaving(bounds: Bounds) -> None:
    states = explore(bounds)
    assert states > 5_000  # the search really branched


def _mutant(name: str, old: str, new: str) -> dict[str, str]:
    scripts = dict(SCRIPTS)
    assert scripts[name].count(old) == 1, old
    scripts[name] = scripts[name].replace(old, new)
    return scripts


def test_checker_catches_a_reader_that_ignores_queued_writers() -> None:
    scripts = _mutant(
        "acquire",
        "if writer and (not place or score < place) then ahead = writer end",
        "",
    )
    with pytest.raises(Violation, match="queued ahead"):
        explore(Bounds(modes=("r", "w", "r")), scripts)


def test_checker_catches_a_writer_that_ignores_readers() -> None:
    scripts = _mutant("acquire", "elseif readers > 0 and not reading then", "elseif false then")
    with pytest.raises(Violation, match="beside"):
        explore(Bounds(modes=("r", "w", "r")), scripts)


def test_checker_catches_a_wake_up_that_misses_readers_of_the_batch() -> None:
    scripts = {
        name: text.replace("if deadline and deadline > now then ids[#ids + 1] = id end", "")
        for name, text in SCRIPTS.items()
    }
    assert scripts != SCRIPTS
    with pytest.raises(Violation, match="not woken"):
        explore(Bounds(modes=("w", "r", "r")), scripts)


def test_checker_catches_a_late_attempt_that_takes_a_place_after_its_cancel() -> None:
    """ACQUIRE as it was before the tombstone refused a place: a reader whose acquire was
    cancelled arrives while a writer holds the lock, and queues."""
    scripts = _mutant("acquire", "  if void then return {0, wait_ms, 0} end\n", "")
    with pytest.raises(Violation, match="orphan place"):
        explore(Bounds(modes=("r", "w", "r")), scripts)


def test_checker_catches_a_late_enqueue_that_takes_a_place_after_its_cancel() -> None:
    """ENQUEUE as it was before it read the tombstone: a FIFO writer's wait queues it after
    its acquire was cancelled."""
    scripts = _mutant(
        "enqueue",
        "if redis.call('EXISTS', base_of(KEYS[1]) .. 'void:' .. ARGV[3]) == 1\n    or ",
        "if ",
    )
    with pytest.raises(Violation, match="orphan place"):
        explore(Bounds(modes=("r", "w", "w"), fifo=True, renews=0), scripts)


TWIN_CONFIGS = [
    # Two ticks: leases expire; queue places (three ticks) expire in the FIFO search.
    pytest.param(Bounds(modes=("w", "w", "r"), ticks=2), id="w-w-r"),
    pytest.param(Bounds(modes=("w", "w", "w"), fifo=True, renews=0), id="fifo-w-w-w"),
]


@pytest.mark.parametrize("bounds", TWIN_CONFIGS)
def test_fast_paths_match_the_general_paths_in_every_interleaving(bounds: Bounds) -> None:
    states = explore(bounds, reference=general_paths(SCRIPTS))
    assert states > 5_000


def test_checker_catches_a_fast_grant_that_ignores_readers() -> None:
    scripts = _mutant(
        "acquire",
        "redis.call('EXISTS', KEYS[4], base .. 'readers', base .. 'void:' .. ARGV[1])",
        "redis.call('EXISTS', KEYS[4], base .. 'void:' .. ARGV[1])",
    )
    with pytest.raises(Violation, match="fast path of acquire"):
        explore(Bounds(modes=("r", "w", "w")), scripts, reference=general_paths(SCRIPTS))


def test_checker_catches_a_fast_release_that_ignores_the_queue() -> None:
    scripts = _mutant(
        "release",
        "if not KEYS[3] or redis.call('EXISTS', KEYS[2]) == 0 then",
        "if true then",
    )
    with pytest.raises(Violation, match="fast path of release"):
        explore(Bounds(modes=("w", "w", "r")), scripts, reference=general_paths(SCRIPTS))


def test_the_emulation_runs_the_manager_scripts_as_redis_does(redis_url: str) -> None:
    """The fast and the general paths of ACQUIRE and RELEASE, on a real redis-server and
    on the emulation the search runs: the same replies (waits aside: they depend on the
    clock), the same keys, the same holders and queue order."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    keys = resource_keys("model-diff:", "r")
    lua = LuaRedis(SCRIPTS)
    store = EMPTY
    acquire_keys = [keys.lock, keys.token, keys.fence, keys.queue, keys.deadlines]

    def acquire(name: str, mode: str) -> list[Any]:
        return [acquire_keys, [name, "60000", "h", "counter", waiter_id(name), "60000", mode, "0"]]

    def release(name: str) -> list[Any]:
        return [[keys.lock, keys.queue, keys.deadlines], [name, "0"]]

    calls = [
        ("acquire", *acquire("a", "w")),  # fast: granted
        ("acquire", *acquire("b", "w")),  # fast: refused, no place
        ("release", *release("b")),  # not the holder
        ("release", *release("a")),  # fast: nobody queued
        ("acquire", *acquire("c", "r")),  # a reader: the general path
        ("acquire", *acquire("d", "w")),  # refused beside a reader: queued
        ("acquire", *acquire("e", "w")),  # a queue: the general path
        ("release", *release("c")),  # the last reader wakes the queue's head
        ("acquire", *acquire("d", "w")),
        ("acquire", *acquire("a", "w")),  # refused, queued behind e
        ("release", *release("d")),  # a queue: the general path
        ("acquire", *acquire("e", "w")),
        ("acquire", *acquire("a", "w")),
        ("release", *release("e")),
        ("acquire", *acquire("a", "w")),  # the queue is empty again: fast
        ("release", *release("a")),
    ]
    for key in client.scan_iter("model-diff:*"):
        client.delete(key)
    try:
        for name, script_keys, args in calls:
            real = client.register_script(SCRIPTS[name])(keys=script_keys, args=args)
            store, emulated, _ = lua.run_published(
                name, tuple(script_keys), tuple(args), store, START
            )
            if isinstance(real, list):  # {0, wait_ms, queued}: the wait is the clock's
                assert isinstance(emulated, list), (name, args, emulated)
                real, emulated = [real[0], real[2]], [emulated[0], emulated[2]]
            assert real == emulated, (name, args)
            assert set(client.scan_iter("model-diff:*")) == {k for k, _, _ in store}, name
            for key, value, _ in store:
                if isinstance(value, str):
                    assert client.get(key) == value, key
                elif isinstance(value, ZSet):  # scores of readers and deadlines: clock times
                    by_score = sorted(value, key=lambda item: (item[1], item[0]))
                    assert client.zrange(key, 0, -1) == [m for m, _ in by_score], key
                elif key == keys.deadlines:  # deadlines: clock times
                    assert set(client.hkeys(key)) == set(dict(value)), key
                else:
                    assert client.hgetall(key) == dict(value), key
    finally:
        for key in client.scan_iter("model-diff:*"):
            client.delete(key)
        client.close()
