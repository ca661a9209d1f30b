"""An exhaustive, bounded model checker for the quorum lock manager.

It explores every schedule, within bounds, of clients running the real
:class:`fence._quorum.QuorumAcquire` machine (the driver's decisions) against nodes running
the real Lua scripts (``tests/lua_redis.py``), and checks in every reachable state:

- **unique**: no two grants share a token;
- **ordered**: a grant whose acquire started after another grant completed has a larger
  token (the real-time order of grants);
- **exclusive**: no grant while another holder's client deadline (C10) has not passed
  (checked only where node clocks do not jump forward: a lease cannot survive that);
- **live** (searches with ``Bounds.live``): in every state with no message in flight and
  within the fault model, a new client acquiring alone, with no fault, is granted within
  ``Bounds.patience`` attempts (time passing a lease between them) and its token is
  unique and above every token granted before: a set-up completes, a free resource is
  granted.

Schedules: every interleaving of message deliveries; a request lost, its reply lost, or
delayed past the client's timeout (then delivered at any later point, or never); time
passing in whole ticks (leases expire on node clocks), with requests still in flight
(answered late, while their client waits); nodes restarting with their data or
empty (a restart drops the requests in flight to it, as TCP does); node clock skew (fixed
offsets) and jumps; clients acquiring, retrying after a refusal, releasing or pausing (a
paused holder keeps its deadline: that is what ``exclusive`` checks).

A state is the whole world: node stores, incarnations and clock offsets, clients (their
machine, round and answers), messages in flight, the remaining fault budget, and the tokens
granted so far. States are deduplicated by value; the search is a depth-first walk of every
transition from every state not seen before.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from fence._core import TokenMode
from fence._quorum import (
    FAILED,
    SCRIPTS,
    Answer,
    Op,
    Outcome,
    QuorumAcquire,
    Request,
    Verdict,
    node_call,
    parse_answer,
    validity,
)
from tests.frozen import replace
from tests.lua_redis import EMPTY, LuaRedis, ScriptError, Store, purge

TICK_MS = 1000
PREFIX = "fence:"
RESOURCE = "r"
DRIFT = 0.01
MARGIN = 0.002


@dataclass(frozen=True)
class Bounds:
    """What one search explores.

    Attributes:
        nodes: 3 or 5.
        clients: how many clients.
        acquires: acquire calls per client.
        attempts: attempts per acquire call (a refused attempt is retried).
        ttl: the lease, in ticks (seconds), less a millisecond.
        ticks: how far time may run.
        losses: requests or replies that may be lost.
        delays: requests that may be delayed past their client's timeout.
        lossy: the scripts whose requests may be lost (empty: all of them); a narrower
            search goes deeper.
        late: the scripts whose requests may be delayed (empty: all of them).
        slow: requests that may still be in flight when time passes (answered a tick or
            more after they were sent, while the client waits).
        wipes: node restarts without their data.
        restarts: node restarts with their data.
        jumps: node clock jumps, each by one of ``jump_sizes`` ticks.
        jump_sizes: the clock jumps to try.
        skew: fixed clock offsets of the nodes, in ticks.
        mode: the token mode.
        set_up: start with every node set up (``genesis``); else with empty nodes.
        wipe_limit: at most this many nodes may be unrepaired at once (the fault model's
            "fewer than a majority"); ``None``: no limit (beyond the model).
        release: holders may release.
        again: a client that released may start its next acquire call (up to
            ``acquires``); otherwise only a refused call is followed by another.
        live: check liveness (see the module) in every quiescent state.
        patience: the attempts the liveness check allows.
        remember: a client that was granted before passes ``granted_before`` (counter
            mode), as the driver does; a test turns it off to show the checker fails.
        max_states: stop (and fail) past this many states.
    """

    nodes: int = 3
    clients: int = 2
    acquires: int = 1
    attempts: int = 2
    ttl: int = 3
    ticks: int = 6
    losses: int = 0
    delays: int = 0
    lossy: tuple[str, ...] = ()
    late: tuple[str, ...] = ()
    slow: int = 0
    wipes: int = 0
    restarts: int = 0
    jumps: int = 0
    jump_sizes: tuple[int, ...] = (2, -2)
    skew: tuple[int, ...] = ()
    mode: TokenMode = TokenMode.COUNTER
    set_up: bool = True
    wipe_limit: int | None = None
    release: bool = True
    again: bool = False
    live: bool = False
    patience: int = 3
    remember: bool = True
    max_states: int = 700_000


@dataclass(frozen=True)
class Node:
    """A node: its data, how often it restarted empty, its clock offset in ticks."""

    store: Store = EMPTY
    incarnation: int = 0
    offset: int = 0


@dataclass(frozen=True)
class Client:
    """A client and the acquire call it runs.

    ``phase``: ``idle``, ``run`` (a round out), ``retry`` (refused; may try again),
    ``hold`` (granted), ``release`` (releasing), ``done``.
    """

    phase: str = "idle"
    acquires: int = 0
    attempts: int = 0
    machine: QuorumAcquire | None = None
    request: Request | None = None
    answers: tuple[Answer | None, ...] = ()
    start: int = 0
    floor: int = 0
    deadline: float = 0.0
    token: int = 0
    granted: bool = False


@dataclass(frozen=True)
class Message:
    """A request in flight: client ``client``'s ``position``-th call of its round ``round``
    to ``node``; ``orphan`` once the client stopped waiting for it."""

    node: int
    client: int
    round: int
    position: int
    call: tuple[str, tuple[str, ...], tuple[str, ...]]
    orphan: bool = False
    deferred: bool = False


@dataclass(frozen=True)
class World:
    """The whole state of a schedule."""

    now: int
    nodes: tuple[Node, ...]
    clients: tuple[Client, ...]
    messages: tuple[Message, ...] = ()
    rounds: tuple[int, ...] = ()
    losses: int = 0
    delays: int = 0
    slow: int = 0
    wipes: int = 0
    restarts: int = 0
    jumps: int = 0
    tokens: frozenset[int] = frozenset()
    completed: int = 0
    unrepaired: frozenset[int] = frozenset()


class Violation(AssertionError):
    """An invariant failed; ``trace`` is the schedule that led there."""

    def __init__(self, message: str, trace: list[str]) -> None:
        super().__init__(message + "\n  " + "\n  ".join(trace))
        self.trace = trace
        self.rule = message.split(":", 1)[0]


@dataclass
class Report:
    """What a search found."""

    states: int = 0
    transitions: int = 0
    seconds: float = 0.0
    grants: int = 0
    deepest: int = 0
    verdicts: dict[str, int] = field(default_factory=dict)


class Checker:
    """Explores every schedule within ``bounds``.

    Args:
        bounds: what to explore.
        scripts: the node scripts (default: the real ones); a test points the checker at a
            mutation to show it can fail.
        exclusive: check lease exclusion (default: when no clock may jump forward).
    """

    def __init__(
        self,
        bounds: Bounds,
        scripts: dict[str, str] | None = None,
        exclusive: bool | None = None,
    ) -> None:
        self.b = bounds
        self.redis = LuaRedis(scripts or SCRIPTS)
        forward = bounds.jumps > 0 and any(j > 0 for j in bounds.jump_sizes)
        self.exclusive = (not forward) if exclusive is None else exclusive
        self.report = Report()
        self.lived: set[tuple[int, tuple[Node, ...]]] = set()
        # A lease a millisecond short of whole ticks ends on a node one tick after the grant.
        self.ttl = bounds.ttl - 0.001

    # -- the initial world --------------------------------------------------------------

    def initial(self) -> World:
        b = self.b
        skew = b.skew or (0,) * b.nodes
        nodes = []
        for i in range(b.nodes):
            store: Store = EMPTY
            if b.set_up:
                store = ((PREFIX + "quorum:node", (("id", "i0"), ("state", "genesis")), None),)
            nodes.append(Node(store=store, offset=skew[i]))
        clients = tuple(Client() for _ in range(b.clients))
        return World(
            now=0,
            nodes=tuple(nodes),
            clients=clients,
            rounds=(0,) * b.clients,
            losses=b.losses,
            delays=b.delays,
            slow=b.slow,
            wipes=b.wipes,
            restarts=b.restarts,
            jumps=b.jumps,
        )

    # -- running ---------------------------------------------------------------------------

    def node_ms(self, world: World, index: int) -> int:
        return (world.now + world.nodes[index].offset) * TICK_MS

    def execute(self, world: World, message: Message) -> tuple[World, Any]:
        """Node ``message.node`` runs the script; return the world and the raw reply."""
        node = world.nodes[message.node]
        name, keys, args = message.call
        store, reply = self.redis.run(
            name, keys, args, node.store, self.node_ms(world, message.node)
        )
        nodes = list(world.nodes)
        nodes[message.node] = replace(node, store=store)
        world = replace(world, nodes=tuple(nodes))
        if name == "repair" and reply == 1:
            world = replace(world, unrepaired=world.unrepaired - {message.node})
        return world, reply

    def send(self, world: World, index: int, client: Client, request: Request) -> World:
        """Client ``index`` sends ``request``: one message per node."""
        rounds = list(world.rounds)
        rounds[index] += 1
        secret = f"s{index}.{client.acquires}"
        messages = list(world.messages)
        for position, node in enumerate(request.nodes):
            name, keys, args = node_call(
                request,
                position,
                prefix=PREFIX,
                resource=RESOURCE,
                secret=secret,
                ttl_ms=self.b.ttl * TICK_MS - 1,
                holder=f"c{index}",
                mode=self.b.mode.value,
                nonce=f"i{world.nodes[node].incarnation}",
                attempt=client.attempts,
            )
            messages.append(
                Message(node, index, rounds[index], position, (name, tuple(keys), tuple(args)))
            )
        client = replace(client, request=request, answers=(None,) * len(request.nodes))
        return self.set_client(
            replace(world, messages=tuple(sorted(messages, key=_order)), rounds=tuple(rounds)),
            index,
            client,
        )

    def set_client(self, world: World, index: int, client: Client) -> World:
        clients = list(world.clients)
        clients[index] = client
        return replace(world, clients=tuple(clients))

    def answer(self, world: World, message: Message, answer: Answer, trace: list[str]) -> World:
        """Give ``message``'s client its answer; run the machine when the round is whole."""
        index = message.client
        client = world.clients[index]
        answers = list(client.answers)
        answers[message.position] = answer
        client = replace(client, answers=tuple(answers))
        if any(a is None for a in answers):
            return self.set_client(world, index, client)
        assert client.request is not None
        if client.phase == "release":
            phase = "idle" if self.b.again else "done"
            return self.set_client(world, index, replace(client, phase=phase, request=None))
        assert client.machine is not None
        left = validity(self.ttl, world.now - client.start, drift=DRIFT, margin=MARGIN)
        machine, step = client.machine.step(tuple(a for a in answers if a), left=left)
        client = replace(client, machine=machine)
        if isinstance(step, Request):
            return self.send(world, index, client, step)
        return self.finish(world, index, client, step, trace)

    def finish(
        self, world: World, index: int, client: Client, outcome: Outcome, trace: list[str]
    ) -> World:
        """An attempt ended: record a grant and check the invariants."""
        verdicts = self.report.verdicts
        verdicts[outcome.verdict.value] = verdicts.get(outcome.verdict.value, 0) + 1
        if outcome.verdict is not Verdict.GRANTED:
            phase = "retry" if client.attempts < self.b.attempts else "idle"
            if outcome.verdict in (Verdict.UNAVAILABLE, Verdict.DATA_LOST):
                phase = "idle"  # the manager raises: this acquire call is over
            client = replace(client, phase=phase, machine=None, request=None, answers=())
            return self.set_client(world, index, client)
        token = outcome.token
        assert token is not None
        self.report.grants += 1
        where = f"client {index} granted token {token} at t={world.now}"
        if token in world.tokens:
            raise Violation(f"unique: {where}, a token granted before", trace)
        if token <= client.floor:
            raise Violation(
                f"ordered: {where}, not above {client.floor}, granted before it started", trace
            )
        deadline = client.start + self.ttl * (1 - DRIFT) - MARGIN
        if self.exclusive and world.now < deadline:
            for other, holder in enumerate(world.clients):
                if other != index and holder.phase == "hold" and world.now < holder.deadline:
                    raise Violation(
                        f"exclusive: {where} while client {other} holds token {holder.token} "
                        f"until t={holder.deadline:.3f}",
                        trace,
                    )
        client = replace(
            client,
            phase="hold",
            machine=None,
            request=None,
            answers=(),
            token=token,
            deadline=deadline,
            granted=True,
        )
        world = replace(world, tokens=world.tokens | {token}, completed=max(world.completed, token))
        return self.set_client(world, index, client)

    # -- transitions -------------------------------------------------------------------------

    def successors(self, world: World, trace: list[str]) -> Iterator[tuple[str, World]]:
        """Every transition from ``world``, with a label for traces."""
        b = self.b
        messages = world.messages
        # Within a tick, steps on different nodes commute: deliveries are explored node by
        # node, in order (a partial-order reduction). The lowest node with a message not
        # deferred takes its turn; it may defer its messages to let later nodes go first
        # (they are delivered at a later turn or tick). See the module docstring.
        turn = min((m.node for m in messages if not m.deferred), default=None)
        if turn is not None:
            deferred = tuple(replace(m, deferred=True) if m.node == turn else m for m in messages)
            yield f"n{turn} waits", replace(world, messages=deferred)
        for k, message in enumerate(messages):
            if message.node != turn:
                continue
            rest = messages[:k] + messages[k + 1 :]
            base = replace(world, messages=rest)
            label = f"{message.call[0]} c{message.client}->n{message.node}"
            ran, reply = self.execute(base, message)
            if message.orphan:
                yield f"late {label} runs", ran
                continue
            step = f"{label} answered {_short(reply)} at t={world.now}"
            yield step, self.answer(ran, message, _parse(message, reply), [*trace, step])
            name = message.call[0]
            if world.losses and (not b.lossy or name in b.lossy):
                step = f"{label} lost"
                lost = replace(base, losses=world.losses - 1)
                yield step, self.answer(lost, message, FAILED, [*trace, step])
                step = f"{label} runs, its reply lost"
                ran_lost = replace(ran, losses=world.losses - 1)
                yield step, self.answer(ran_lost, message, FAILED, [*trace, step])
            if world.delays and (not b.late or name in b.late):
                step = f"{label} delayed past the client's timeout"
                late = replace(message, orphan=True)
                delayed = replace(
                    base,
                    messages=tuple(sorted((*rest, late), key=_order)),
                    delays=world.delays - 1,
                )
                yield step, self.answer(delayed, message, FAILED, [*trace, step])
        for index, client in enumerate(world.clients):
            if index and client.acquires == 0 and world.clients[index - 1].acquires == 0:
                continue  # clients are alike: the first to start is client 0 (symmetry)
            if client.phase == "idle" and client.acquires < b.acquires:
                started = replace(
                    client,
                    phase="run",
                    acquires=client.acquires + 1,
                    attempts=1,
                    start=world.now,
                    floor=world.completed,
                )
                yield f"c{index} acquires", self.begin(world, index, started)
            elif client.phase == "retry":
                again = replace(client, phase="run", attempts=client.attempts + 1, start=world.now)
                yield f"c{index} tries again", self.begin(world, index, again)
            elif client.phase == "hold" and b.release:
                releasing = replace(client, phase="release", deadline=0.0)
                request = Request(Op.RELEASE, tuple(range(b.nodes)))
                yield f"c{index} releases", self.send(world, index, releasing, request)
        if world.jumps:
            for n in range(b.nodes):
                for size in b.jump_sizes:
                    yield f"n{n} clock {size:+d} at t={world.now}", self.jump(world, n, size)
        in_flight = sum(1 for m in messages if not m.orphan)
        if world.now < b.ticks and in_flight <= world.slow:
            yield "tick", self.tick(replace(world, slow=world.slow - in_flight), 1)
        # Nodes start alike (without skew): the first node to restart is node 0 (symmetry).
        alike = not any(b.skew) and world.wipes == b.wipes and world.restarts == b.restarts
        for n in range(1 if alike else b.nodes):
            if world.wipes and (
                b.wipe_limit is None or len(world.unrepaired | {n}) <= b.wipe_limit
            ):
                step = f"n{n} restarts empty at t={world.now}"
                yield step, self.restart(world, n, [*trace, step], wipe=True)
            if world.restarts:
                step = f"n{n} restarts with its data at t={world.now}"
                yield step, self.restart(world, n, [*trace, step], wipe=False)

    def begin(self, world: World, index: int, client: Client) -> World:
        remembers = self.b.remember and self.b.mode is TokenMode.COUNTER and client.granted
        machine, request = QuorumAcquire.begin(
            self.b.nodes,
            setup_id=f"g{index}.{client.acquires}.{client.attempts}",
            granted_before=remembers,
        )
        return self.send(world, index, replace(client, machine=machine), request)

    # -- liveness -------------------------------------------------------------------------

    def live(self, world: World, trace: list[str]) -> None:
        """A new client, alone and with no fault, is granted from ``world`` (see the module).

        Its requests run at once, in node order; between attempts time passes a lease (the
        leases of clients that stopped expire).
        """
        b = self.b
        key = (world.now, world.nodes)
        if key in self.lived:
            return
        self.lived.add(key)
        verdicts = []
        for attempt in range(1, b.patience + 1):
            machine, step = QuorumAcquire.begin(b.nodes, setup_id=f"live.{attempt}")
            while isinstance(step, Request):
                answers = []
                for position, node in enumerate(step.nodes):
                    name, keys, args = node_call(
                        step,
                        position,
                        prefix=PREFIX,
                        resource=RESOURCE,
                        secret="live",
                        ttl_ms=b.ttl * TICK_MS - 1,
                        holder="live",
                        mode=b.mode.value,
                        nonce=f"i{world.nodes[node].incarnation}",
                        attempt=attempt,
                    )
                    message = Message(node, -1, 0, position, (name, tuple(keys), tuple(args)))
                    world, reply = self.execute(world, message)
                    answers.append(_parse(message, reply))
                machine, step = machine.step(answers, left=self.ttl)
            verdicts.append(step.verdict.value)
            if step.verdict is Verdict.GRANTED:
                token = step.token
                assert token is not None
                if token in world.tokens or token <= world.completed:
                    raise Violation(
                        f"live: a new client alone was granted token {token}, not above "
                        f"{world.completed} or granted before",
                        trace,
                    )
                return
            world = self.tick(world, b.ttl)
        raise Violation(
            f"live: a new client alone, with no fault, was not granted in {b.patience} "
            f"attempts: {verdicts}",
            trace,
        )

    def tick(self, world: World, ticks: int) -> World:
        messages = tuple(replace(m, deferred=False) for m in world.messages)
        world = replace(world, now=world.now + ticks, messages=messages)
        nodes = tuple(
            replace(node, store=purge(node.store, self.node_ms(world, i)))
            for i, node in enumerate(world.nodes)
        )
        return replace(world, nodes=nodes)

    def jump(self, world: World, n: int, size: int) -> World:
        nodes = list(world.nodes)
        nodes[n] = replace(nodes[n], offset=nodes[n].offset + size)
        world = replace(world, nodes=tuple(nodes), jumps=world.jumps - 1)
        return self.tick(world, 0)

    def restart(self, world: World, n: int, trace: list[str], *, wipe: bool) -> World:
        nodes = list(world.nodes)
        node = nodes[n]
        if wipe:
            nodes[n] = replace(node, store=EMPTY, incarnation=node.incarnation + 1)
            world = replace(world, wipes=world.wipes - 1, unrepaired=world.unrepaired | {n})
        else:
            world = replace(world, restarts=world.restarts - 1)
        world = replace(world, nodes=tuple(nodes))
        # The connections break: requests in flight to the node fail, orphans vanish.
        kept = tuple(m for m in world.messages if m.node != n)
        failing = [m for m in world.messages if m.node == n and not m.orphan]
        world = replace(world, messages=kept)
        for message in failing:
            world = self.answer(world, message, FAILED, trace)
        return world

    # -- the search --------------------------------------------------------------------------

    def follow(self, steps: list[str]) -> tuple[World, list[str]]:
        """Walk one schedule from the initial world: each step is the start of a transition's
        label (the first that matches is taken). Returns the world reached and its trace."""
        world, trace = self.initial(), []
        for step in steps:
            for label, nxt in self.successors(world, trace):
                if label.startswith(step):
                    world, trace = nxt, [*trace, label]
                    break
            else:
                labels = [label for label, _ in self.successors(world, trace)]
                raise AssertionError(f"no transition {step!r} after {trace}: {labels}")
        return world, trace

    def run(self, start: tuple[World, list[str]] | None = None) -> Report:
        """Explore every schedule (from ``start``, a world and its trace, if given: see
        :meth:`follow`); raise :class:`Violation` at the first broken invariant."""
        started = time.perf_counter()
        seen: set[World] = set()
        start_world, start_trace = start or (self.initial(), [])
        stack: list[tuple[World, list[str]]] = [(start_world, start_trace)]
        seen.add(start_world)
        report = self.report
        need = self.b.nodes // 2 + 1
        while stack:
            world, trace = stack.pop()
            report.deepest = max(report.deepest, len(trace))
            if self.b.live and not world.messages and len(world.unrepaired) < need:
                self.live(world, trace)
            for label, nxt in self.successors(world, trace):
                report.transitions += 1
                if nxt in seen:
                    continue
                seen.add(nxt)
                if len(seen) > self.b.max_states:
                    raise AssertionError(
                        f"more than {self.b.max_states} states: tighten the bounds"
                    )
                stack.append((nxt, [*trace, label]))
        report.states = len(seen)
        report.seconds = time.perf_counter() - started
        return report


def _order(message: Message) -> tuple[Any, ...]:
    return (message.node, message.client, message.round, message.position, message.orphan)


def _parse(message: Message, reply: Any) -> Answer:
    if isinstance(reply, ScriptError):
        return FAILED
    name = message.call[0]
    op = {"acquire": Op.ACQUIRE, "revoke": Op.REVOKE, "release": Op.RELEASE, "undo": Op.UNDO}.get(
        name
    )
    if name == "genesis":
        op = Op.PROBE if message.call[2][0] == "probe" else Op.PREPARE
    return parse_answer(op or Op.COMMIT, reply)


def _short(reply: Any) -> str:
    return repr(reply)[:40]
