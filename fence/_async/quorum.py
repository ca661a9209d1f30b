"""The quorum lock manager for asyncio: Redlock over independent Redis nodes, with fencing
tokens that hold under a stated fault model (nodes lost, partitioned, restarted empty;
clocks skewed).

This module only moves bytes. What to send in each round and what the answers mean is
decided by :class:`fence._quorum.QuorumAcquire` and the other rules of :mod:`fence._quorum`,
which also states the fault model; the model checker in ``tests/quorum_model.py`` drives
the same code.
"""

from __future__ import annotations

import functools
import itertools
import random
import warnings
from collections.abc import Sequence
from typing import Any

import redis.asyncio

from fence._acompat import FanOut, cancel_after, shield, sleep
from fence._async.manager import AsyncBaseLockManager
from fence._async.redis import AsyncClient, AsyncRedisDriver
from fence._clock import Clock, system_clock
from fence._core import TokenMode, client_deadline, validate_ttl
from fence._errors import BackendError, ConfigurationError, FenceWarning
from fence._events import EventBus, EventKind, default_bus
from fence._lua import Script
from fence._quorum import (
    FAILED,
    LOADED_KEYS,
    NODE_SCRIPTS,
    Answer,
    Op,
    Outcome,
    QuorumAcquire,
    Request,
    Verdict,
    backoff_delay,
    majority,
    merge_inspections,
    node_call,
    node_config_warnings,
    node_name,
    parse_answer,
    release_verdict,
    unavailable_error,
    validity,
)
from fence._redis_keys import DEFAULT_PREFIX
from fence._redis_scripts import milliseconds
from fence.abc import AcquireReply, LockInfo

__all__ = ["AsyncQuorumDriver", "AsyncQuorumLockManager"]

#: An empty reply handed to a node's ``wait``: without FIFO it only needs the resource.
_NO_REPLY = AcquireReply(None)

#: Forget retry counts of this many waiters at once if waiters vanish without a trace.
_MAX_TRACKED = 10_000


class AsyncQuorumDriver:
    """Moves the bytes of :class:`AsyncQuorumLockManager`: every call goes to all nodes at
    once, and :mod:`fence._quorum` decides.

    Args:
        nodes: the independent Redis nodes (3 or 5): URLs (``redis://host:port/db``) or
            ``redis.asyncio.Redis`` clients (not Redis Cluster). Nodes built from URLs are
            closed by :meth:`close`; clients given are not.
        prefix: the key prefix on every node; no braces.
        token_mode: how each node proposes a token (:class:`fence.TokenMode`).
        socket_timeout: read and connect timeout of each node built from a URL: the time a
            stopped node may cost one call.
        check_config: on first use, warn about node settings that can lose tokens.
        drift: the fraction of the ttl given up for clock drift (Redlock's ``ttl * drift``).
        margin: the constant added to the drift allowance, in seconds.
        clock: the monotonic clock that times each acquire round.
        events: where unreachable nodes (:attr:`EventKind.BACKEND_DOWN`), nodes that lost
            their data (:attr:`EventKind.NODE_DATA_LOST`), refusals
            (:attr:`EventKind.REFUSED`) and the quorum's set-up
            (:attr:`EventKind.QUORUM_INITIALIZED`) are reported.
        retry_base: the first jittered delay after a split vote, in seconds.
        retry_cap: the longest such delay, in seconds.

    Raises:
        ConfigurationError: no nodes, the same URL twice, a Redis Cluster client, or a bad
            node argument.
    """

    source = "quorum"

    def __init__(
        self,
        nodes: Sequence[str | AsyncClient],
        *,
        prefix: str = DEFAULT_PREFIX,
        token_mode: TokenMode = TokenMode.HYBRID,
        socket_timeout: float = 0.5,
        check_config: bool = True,
        drift: float = 0.01,
        margin: float = 0.002,
        clock: Clock | None = None,
        events: EventBus | None = None,
        retry_base: float = 0.005,
        retry_cap: float = 0.2,
    ) -> None:
        if isinstance(nodes, str | bytes) or not isinstance(nodes, Sequence):
            raise ConfigurationError(
                f"nodes must be a list of Redis URLs or clients, got {type(nodes).__name__}"
            )
        self.majority = majority(len(nodes))
        urls = [node for node in nodes if isinstance(node, str)]
        if len(set(urls)) != len(urls) or len({id(n) for n in nodes}) != len(nodes):
            raise ConfigurationError("each node of a quorum must be a different Redis server")
        if any(isinstance(node, redis.asyncio.RedisCluster) for node in nodes):
            raise ConfigurationError(
                "a quorum node must be a standalone Redis server, not a Redis Cluster: the "
                "node marker and the resource's keys are read in one script"
            )
        self.token_mode = TokenMode(token_mode)
        self.socket_timeout = validate_ttl(socket_timeout, what="socket_timeout")
        self.drift = drift
        self.margin = margin
        self.retry_base = validate_ttl(retry_base, what="retry_base")
        self.retry_cap = validate_ttl(retry_cap, what="retry_cap")
        self.clock: Clock = clock or system_clock
        self.events = events or default_bus
        self.names = [node_name(node) for node in nodes]
        self.nodes = [
            AsyncRedisDriver(
                node,
                prefix=prefix,
                token_mode=self.token_mode,
                socket_timeout=socket_timeout,
                check_config=False,  # the quorum has its own rules (node_config_warnings)
            )
            for node in nodes
        ]
        self._unchecked = set(range(len(nodes))) if check_config else set()
        self.prefix = self.nodes[0].prefix
        self._fan = FanOut(2 * len(self.nodes))
        self._down: set[int] = set()
        self._lost: dict[int, str] = {}
        self._attempts: dict[str, int] = {}
        # Every attempt of an acquire call sends the call's secret; its number, larger for
        # each later attempt, keeps a late undo or commit of one attempt off the lock a
        # later attempt took (fence._quorum.UNDO). One counter for the driver is enough:
        # a call's attempts all run here, one after the other.
        self._numbers = itertools.count(1)
        self._rng = random.Random()
        # Counter tokens start at 1 on a new quorum: once this driver saw a grant, every
        # node answering as new means every node lost its data (a rolling restart of
        # nodes without persistence), which is refused rather than set up again.
        self._granted = False

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {len(self.nodes)} nodes prefix={self.prefix!r}>"

    # -- fan-out and failure accounting ---------------------------------------------------

    async def _each(self, what: str, resource: str, calls: dict[int, Any]) -> dict[int, Any]:
        """Run ``calls`` (node index -> zero-argument call) at once; return each outcome.

        A node that fails with :class:`BackendError` is reported once, when it goes from
        answering to failing (:attr:`EventKind.BACKEND_DOWN`, ``detail["node"]`` names it).
        Any other error is a bug or a verdict (token space exhausted) and is raised.
        """
        indexes = list(calls)
        outcomes = await self._fan.run([calls[i] for i in indexes])
        unexpected: Exception | None = None
        result: dict[int, Any] = {}
        for index, outcome in zip(indexes, outcomes, strict=True):
            result[index] = outcome
            if isinstance(outcome, BackendError):
                if index not in self._down:
                    self._down.add(index)
                    self.events.emit(
                        EventKind.BACKEND_DOWN,
                        self.source,
                        resource,
                        node=self.names[index],
                        operation=what,
                        code=outcome.code,
                        error=str(outcome),
                    )
            elif isinstance(outcome, Exception):
                unexpected = unexpected or outcome
            else:
                self._down.discard(index)
        if unexpected is not None:
            raise unexpected
        return result

    async def _round(
        self,
        resource: str,
        request: Request,
        secret: str,
        ttl: float,
        holder: str,
        attempt: int,
    ) -> tuple[list[Answer], dict[int, Any]]:
        """Send one round of the protocol; return one answer per node of ``request``."""
        calls = {}
        mode = self.token_mode.value
        ttl_ms = milliseconds(ttl)
        for position, index in enumerate(request.nodes):
            name, keys, args = node_call(
                request,
                position,
                prefix=self.prefix,
                resource=resource,
                secret=secret,
                ttl_ms=ttl_ms,
                holder=holder,
                mode=mode,
                nonce=f"{self._rng.getrandbits(64):016x}",
                attempt=attempt,
            )
            calls[index] = functools.partial(
                self._call, index, NODE_SCRIPTS[name], keys, args, request.op.value
            )
        what = "acquire" if request.op is Op.ACQUIRE else request.op.value
        outcomes = await self._each(what, resource, calls)
        answers = [
            FAILED if isinstance(outcomes[i], Exception) else parse_answer(request.op, outcomes[i])
            for i in request.nodes
        ]
        return answers, outcomes

    async def _call(
        self, index: int, script: Script, keys: list[str], args: list[str], what: str
    ) -> Any:
        if index in self._unchecked:
            await self._check_config(index)
        # Never sent twice: the quorum's fault model (model-checked) has lost and delayed
        # messages, not duplicated ones; a node that failed a call counts as failed.
        return await self.nodes[index]._run(script, keys, args, what, repeat=False)

    async def _check_config(self, index: int) -> None:
        """Warn once per node about settings outside the fault model (see
        :func:`fence._quorum.node_config_warnings`). Managed services often disable
        ``CONFIG``; then nothing is checked or said."""
        node = self.nodes[index]
        settings = await node.read_settings("CONFIG GET")
        if settings is not None:
            # Settings that keep no data do not stop a start-up from loading a dump.rdb
            # left in the node's directory: ask what the node loaded.
            loaded = await node.loaded_keys("INFO persistence")
            if loaded is not None:
                settings[LOADED_KEYS] = str(loaded)
        self._unchecked.discard(index)
        if settings is None:
            return
        for message in node_config_warnings(settings, self.token_mode):
            warnings.warn(f"quorum node {self.names[index]}: {message}", FenceWarning, stacklevel=2)

    async def _attempt(
        self, resource: str, secret: str, ttl: float, holder: str, *, revoke: bool = False
    ) -> tuple[Outcome, dict[int, Any]]:
        """Run one attempt of :class:`QuorumAcquire` to its outcome.

        Returns the outcome and the first round's raw replies (for error messages). If the
        attempt is cancelled or fails half way, it is undone on every node where it may hold
        the lock.
        """
        clock = self.clock
        start = clock.monotonic()
        number = next(self._numbers)
        step: Request | Outcome
        machine, step = QuorumAcquire.begin(
            len(self.nodes),
            revoke=revoke,
            setup_id=f"{self._rng.getrandbits(64):016x}",
            granted_before=self._granted,
        )
        first: dict[int, Any] = {}
        try:
            while isinstance(step, Request):
                answers, raw = await self._round(resource, step, secret, ttl, holder, number)
                if step.op in (Op.ACQUIRE, Op.REVOKE):
                    first = raw
                left = validity(
                    ttl, clock.monotonic() - start, drift=self.drift, margin=self.margin
                )
                machine, step = machine.step(answers, left=left)
        except BaseException:
            # Cancelled or failed half way: a node may hold the lock for this secret.
            await self._undo(resource, secret, machine.holding, number)
            raise
        if step.verdict is Verdict.GRANTED and self.token_mode is TokenMode.COUNTER:
            self._granted = True
        self._report(resource, machine, step)
        return step, first

    def _report(self, resource: str, machine: QuorumAcquire, outcome: Outcome) -> None:
        """Emit the events an attempt's outcome calls for."""
        events = self.events
        if outcome.set_up:
            events.emit(EventKind.QUORUM_INITIALIZED, self.source, resource, nodes=self.names)
        for index in outcome.lost:
            incarnation = machine.votes[index].incarnation or ""
            if self._lost.get(index) != incarnation:
                self._lost[index] = incarnation
                events.emit(
                    EventKind.NODE_DATA_LOST,
                    self.source,
                    resource,
                    node=self.names[index],
                    incarnation=incarnation,
                )
        if outcome.verdict in (Verdict.DATA_LOST, Verdict.UNAVAILABLE) and outcome.ineligible:
            events.emit(
                EventKind.REFUSED,
                self.source,
                resource,
                reason=outcome.verdict.value,
                ineligible=[self.names[i] for i in outcome.ineligible],
                failed=[self.names[i] for i in outcome.failed],
            )

    def _unavailable(
        self, what: str, outcomes: dict[int, Any], outcome: Outcome | None = None
    ) -> BackendError:
        return unavailable_error(what, outcomes, self.names, outcome)

    @property
    def down(self) -> list[str]:
        """The nodes whose last call failed."""
        return [self.names[i] for i in sorted(self._down)]

    # -- the driver protocol -------------------------------------------------------------

    async def acquire(self, resource: str, secret: str, ttl: float, holder: str) -> AcquireReply:
        """One attempt (:class:`fence._quorum.QuorumAcquire`): take the lock on every node
        at once, count a majority of eligible nodes that granted it within the validity
        time, commit the quorum's token to a majority of holders and repair nodes that lost
        their data; otherwise undo the attempt on every node. See
        :meth:`fence.abc.AsyncDriver.acquire`.

        Raises:
            BackendError: fewer than a majority of nodes answered (``code="QUORUM"``), or
                fewer than a majority of nodes with intact data (``code="DATA_LOST"``).
        """
        outcome, first = await self._attempt(resource, secret, ttl, holder)
        verdict = outcome.verdict
        if verdict is Verdict.GRANTED:
            self._attempts.pop(secret, None)
            return AcquireReply(outcome.token)
        if verdict in (Verdict.UNAVAILABLE, Verdict.DATA_LOST):
            raise self._unavailable("acquire", first, outcome)
        if verdict is Verdict.RETRY:
            return AcquireReply(None, 0.0, None)
        if verdict is Verdict.SPLIT:
            # A split vote (or a round too slow to count): every contender released what it
            # got, so nobody holds a majority. Back off at random rather than be woken by
            # the contenders' releases and collide again.
            attempt = self._attempts.get(secret, 0)
            if len(self._attempts) >= _MAX_TRACKED:
                self._attempts.clear()
            self._attempts[secret] = attempt + 1
            delay = backoff_delay(attempt, base=self.retry_base, cap=self.retry_cap, rng=self._rng)
            return AcquireReply(None, delay, None)
        # A holder has the lock on a majority: wait on one node that refused, where the
        # holder's release will push a wake-up.
        return AcquireReply(None, outcome.holder_ttl, outcome.wait_on)

    async def _undo(self, resource: str, secret: str, indexes: Sequence[int], attempt: int) -> None:
        """Release what attempt number ``attempt`` (or an earlier one) of ``secret`` holds on
        ``indexes``, best effort: a node that does not answer lets it expire with its ttl."""
        if not indexes:
            return
        request = Request(Op.UNDO, tuple(indexes))
        # Shielded: an acquire cancelled half way still undoes what it took.
        await shield(self._round(resource, request, secret, 0.001, "", attempt))

    async def renew(self, resource: str, secret: str, ttl: float) -> bool:
        """Reset the ttl on every node that holds the lock for ``secret``; true if a
        majority did. See :meth:`fence.abc.AsyncDriver.renew`.

        Raises:
            BackendError: too few nodes answered to tell (retryable: the watchdog tries
                again while the lease has time).
        """
        outcomes = await self._each(
            "renewal",
            resource,
            {
                i: functools.partial(node.renew, resource, secret, ttl)
                for i, node in enumerate(self.nodes)
            },
        )
        answers = [
            FAILED if isinstance(o, Exception) else Answer(ok=bool(o)) for o in outcomes.values()
        ]
        verdict = release_verdict(answers, len(self.nodes))
        if verdict is None:
            raise self._unavailable("renewal", outcomes)
        return verdict

    async def release(self, resource: str, secret: str) -> bool:
        """Delete the lock for ``secret`` on every node (each wakes a waiter); true if a
        majority held it (or lost their data, so that nobody else could be granted it).
        See :meth:`fence.abc.AsyncDriver.release`.

        Raises:
            BackendError: too few nodes answered to tell; the lock expires with its ttl on
                the nodes that did not answer.
        """
        request = Request(Op.RELEASE, tuple(range(len(self.nodes))))
        answers, outcomes = await self._round(resource, request, secret, 0.001, "", 0)
        verdict = release_verdict(answers, len(self.nodes))
        if verdict is None:
            raise self._unavailable("release", outcomes)
        return verdict

    async def wait(self, resource: str, timeout: float, reply: AcquireReply) -> None:
        """Block on one refusing node's wake-up list, or sleep out a jittered backoff after
        a split vote; see :meth:`fence.abc.AsyncDriver.wait`."""
        node = reply.cookie
        if not isinstance(node, int):
            await sleep(max(timeout, 0.0))
            return
        try:
            # A node that stops in the middle of a BLPOP would hold the waiter until its
            # read timeout: cut the wait off once the BLPOP's own timeout has long passed.
            # (The thread twin cannot cut a blocking read; there the read timeout bounds it.)
            async with cancel_after(max(timeout, 0.0) + self.socket_timeout):
                await self.nodes[node].wait(resource, timeout, _NO_REPLY)
        except TimeoutError:
            pass
        except BackendError:
            # That node failed; the next attempt asks them all again.
            await sleep(min(max(timeout, 0.0), 0.05))

    async def cancel(self, resource: str, secret: str, ttl: float) -> bool:
        """An acquire gave up without knowing what its last round did (a timeout, a
        cancellation): cancel it on every node, each of which releases what the attempt
        took there and refuses it if it arrives later. True if a majority held it.

        Raises:
            BackendError: a node did not answer; the manager tries again.
        """
        outcomes = await self._each(
            "cancel",
            resource,
            {
                i: functools.partial(node.cancel, resource, secret, ttl)
                for i, node in enumerate(self.nodes)
            },
        )
        failed = [self.names[i] for i, o in outcomes.items() if isinstance(o, BackendError)]
        if failed:
            raise BackendError(
                f"the clean-up of an abandoned acquire of {resource!r} did not reach "
                f"{', '.join(failed)}; it is retried while such a lock could live",
                code="QUORUM",
                retryable=True,
            )
        return sum(1 for o in outcomes.values() if o is True) >= self.majority

    async def abandon(self, resource: str, secret: str) -> None:
        """A waiter gave up: forget its backoff state. Nothing is queued on the nodes."""
        self._attempts.pop(secret, None)

    async def inspect(self, resource: str) -> LockInfo | None:
        """The holder that a majority of nodes agree on (same token), or ``None``.

        Raises:
            BackendError: fewer than a majority of nodes answered.
        """
        outcomes = await self._each(
            "inspect",
            resource,
            {i: functools.partial(node.inspect, resource) for i, node in enumerate(self.nodes)},
        )
        infos = [o for o in outcomes.values() if not isinstance(o, BackendError)]
        if len(infos) < self.majority:
            raise self._unavailable("inspect", outcomes)
        return merge_inspections(resource, infos, len(self.nodes))

    async def list_page(
        self, prefix: str, cursor: tuple[int, str | None] | None, count: int
    ) -> tuple[list[LockInfo], tuple[int, str | None] | None]:
        """One ``SCAN`` step on one node finds resources; each is then inspected on every
        node, and listed only if a majority agrees on its holder (:meth:`inspect`).

        The nodes are scanned one after the other, so a lock held on a majority is found
        on at least one node that answers; a node that fails is passed over. The cursor is
        the node's index and its ``SCAN`` cursor.
        """
        index, step = cursor or (0, None)
        try:
            found, after = await self.nodes[index].list_page(prefix, step, count)
        except BackendError:
            found, after = [], None
        rows = []
        for resource in dict.fromkeys(info.resource for info in found):
            info = await self.inspect(resource)
            if info is not None:
                rows.append(info)
        if after is not None:
            return rows, (index, after)
        if index + 1 < len(self.nodes):
            return rows, (index + 1, None)
        return rows, None

    async def revoke(self, resource: str) -> int:
        """End the lease on every node, and issue and commit a token above every earlier one
        (raising each node's guard fence register ``<prefix>{R}:fence`` to it).

        A revoke takes the lock itself for its two rounds (so a grant racing with it cannot
        share its token), commits with the fence, and releases.

        Raises:
            BackendError: fewer than a majority of nodes with intact data took part; the
                lease may still be held on a majority.
        """
        secret = f"revoke:{self._rng.getrandbits(128):032x}"
        ttl = max(1.0, 4 * self.socket_timeout)
        outcome, first = await self._attempt(resource, secret, ttl, "revoke", revoke=True)
        if outcome.verdict is Verdict.GRANTED:
            assert outcome.token is not None
            return outcome.token
        if outcome.verdict in (Verdict.UNAVAILABLE, Verdict.DATA_LOST):
            raise self._unavailable("revoke", first, outcome)
        raise BackendError(
            f"the revocation of {resource!r} did not reach a majority of nodes that held it "
            f"to the end ({outcome.verdict.value}); revoke again",
            code="QUORUM",
            retryable=True,
        )

    async def close(self) -> None:
        """Close the nodes built from URLs and stop the fan-out."""
        try:
            for node in self.nodes:
                await node.close()
        finally:
            self._fan.close()


class AsyncQuorumLockManager(AsyncBaseLockManager):
    """A lock manager on a quorum of independent Redis nodes (Redlock) that issues fencing
    tokens which survive the loss of a minority of the nodes (C2, C3, C10, C11).

    Acquire sends the single-node acquire script to every node at once. It counts if a
    majority granted it within the validity time (``ttl * (1 - drift) - margin`` less the
    time the round took); otherwise the attempt is released on every node. The token is the
    largest the granting nodes proposed, written back to the nodes (a second round trip)
    before it is handed out, so any later majority sees it. See ``docs/managers.md``.

    It has no shared locks: ``mode="read"`` raises :class:`ConfigurationError` before any
    I/O (its protocol is model-checked for the exclusive lock only).

    Args:
        nodes: 3 or 5 independent Redis servers (not replicas of each other): URLs or
            ``redis.asyncio.Redis`` clients. The manager closes only what it built.
        prefix: the key prefix on every node; no braces.
        token_mode: :attr:`TokenMode.HYBRID` (default) keeps tokens ahead even if a majority
            of nodes lose their data; :attr:`TokenMode.COUNTER` survives the loss of a
            minority only.
        socket_timeout: the per-node timeout of nodes built from URLs, in seconds (default:
            ``ttl / 10``, between 0.1 and 1 s). A stopped node costs each call this long.
        check_config: on first use, warn about node settings that can lose tokens.
        retry_base: first jittered delay after a split vote, in seconds.
        retry_cap: longest jittered delay after a split vote, in seconds.
        ttl: default lease time in seconds.
        renew: default for the renewal watchdog.
        drift: fraction of the ttl given up for clock drift (C10; Redlock's factor 0.01).
        margin: the constant part of the drift allowance, in seconds (Redlock's 2 ms).
        clock: the monotonic clock for client deadlines and acquire rounds.
        events: where to report events; unreachable nodes are
            :attr:`EventKind.BACKEND_DOWN` with ``detail["node"]``.
        reentrant: whether a second acquire by the same owner returns the held lease.

    Raises:
        ConfigurationError: a bad argument (no nodes, a node given twice, a bad ttl).

    Example::

        manager = AsyncQuorumLockManager(
            ["redis://10.0.0.1:6379/0", "redis://10.0.0.2:6379/0", "redis://10.0.0.3:6379/0"],
            ttl=10,
            renew=True,
        )
        async with manager.lock("order:42") as lease:
            await guard.claim("order:42", lease.token)
            ...
        await manager.close()
    """

    driver: AsyncQuorumDriver

    def __init__(
        self,
        nodes: Sequence[str | AsyncClient],
        *,
        prefix: str = DEFAULT_PREFIX,
        token_mode: TokenMode = TokenMode.HYBRID,
        socket_timeout: float | None = None,
        check_config: bool = True,
        retry_base: float = 0.005,
        retry_cap: float = 0.2,
        ttl: float = 30.0,
        renew: bool = False,
        drift: float = 0.01,
        margin: float = 0.002,
        clock: Clock | None = None,
        events: EventBus | None = None,
        reentrant: bool = True,
    ) -> None:
        ttl = validate_ttl(ttl)
        client_deadline(0.0, ttl, drift=drift, margin=margin)  # fail before any client exists
        if socket_timeout is None:
            socket_timeout = min(1.0, max(0.1, ttl / 10))
        clock = clock or system_clock
        events = events or default_bus
        driver = AsyncQuorumDriver(
            nodes,
            prefix=prefix,
            token_mode=token_mode,
            socket_timeout=socket_timeout,
            check_config=check_config,
            drift=drift,
            margin=margin,
            clock=clock,
            events=events,
            retry_base=retry_base,
            retry_cap=retry_cap,
        )
        super().__init__(
            driver,
            ttl=ttl,
            renew=renew,
            drift=drift,
            margin=margin,
            clock=clock,
            events=events,
            reentrant=reentrant,
        )
