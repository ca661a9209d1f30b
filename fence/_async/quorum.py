"""The quorum lock manager for asyncio: Redlock over independent Redis nodes, with fencing
tokens that survive the loss of a minority of them.

Each node is driven by the single-node Redis driver (:mod:`fence._async.redis`: the same
Lua scripts, key layout and error mapping); this module sends every call to all nodes at
once and counts a majority. The rules (majority, validity, token merge and why the token
needs a commit round) are in :mod:`fence._quorum`.
"""

from __future__ import annotations

import functools
import random
from collections.abc import Sequence
from typing import Any

from fence._acompat import FanOut, cancel_after, shield, sleep
from fence._async.manager import AsyncBaseLockManager
from fence._async.redis import AsyncClient, AsyncRedisDriver
from fence._clock import Clock, system_clock
from fence._core import TokenMode, client_deadline, validate_ttl
from fence._errors import BackendError, ConfigurationError
from fence._events import EventBus, EventKind, default_bus
from fence._quorum import (
    COMMIT,
    backoff_delay,
    commit_needed,
    majority,
    merge_inspections,
    merge_tokens,
    time_until_free,
    validity,
)
from fence._redis_scripts import DEFAULT_PREFIX, resource_keys
from fence.abc import AcquireReply, LockInfo

__all__ = ["AsyncQuorumDriver", "AsyncQuorumLockManager"]

#: An empty reply handed to a node's ``wait``: without FIFO it only needs the resource.
_NO_REPLY = AcquireReply(None)

#: Forget retry counts of this many waiters at once if waiters vanish without a trace.
_MAX_TRACKED = 10_000


#: What a caller should know when a call reached fewer than a majority of nodes.
_CONSEQUENCES = {
    "acquire": "No lease was handed out; what the attempt took was released",
    "release": "Whether the lock was held is unknown; the copies that were not released "
    "expire with their ttl",
    "renewal": "The lease is kept until its deadline while renewals are retried",
}


def _node_name(node: object) -> str:
    if isinstance(node, str):
        return node.rsplit("@", 1)[-1]  # never show a password
    return repr(node)


class AsyncQuorumDriver:
    """Moves the bytes of :class:`AsyncQuorumLockManager`: every call goes to all nodes at
    once, and a majority decides.

    Args:
        nodes: the independent Redis nodes (3 or 5): URLs (``redis://host:port/db``) or
            ``redis.asyncio.Redis`` clients. Nodes built from URLs are closed by
            :meth:`close`; clients given are not.
        prefix: the key prefix on every node; no braces.
        token_mode: how each node proposes a token (:class:`fence.TokenMode`).
        socket_timeout: read and connect timeout of each node built from a URL: the time a
            stopped node may cost one call.
        check_config: on first use, warn about node settings that can lose tokens.
        drift: the fraction of the ttl given up for clock drift (Redlock's ``ttl * drift``).
        margin: the constant added to the drift allowance, in seconds.
        clock: the monotonic clock that times each acquire round.
        events: where unreachable nodes are reported (:attr:`EventKind.BACKEND_DOWN`).
        retry_base: the first jittered delay after a split vote, in seconds.
        retry_cap: the longest such delay, in seconds.

    Raises:
        ConfigurationError: no nodes, the same URL twice, or a bad node argument.
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
        self.token_mode = TokenMode(token_mode)
        self.socket_timeout = validate_ttl(socket_timeout, what="socket_timeout")
        self.drift = drift
        self.margin = margin
        self.retry_base = validate_ttl(retry_base, what="retry_base")
        self.retry_cap = validate_ttl(retry_cap, what="retry_cap")
        self.clock: Clock = clock or system_clock
        self.events = events or default_bus
        self.names = [_node_name(node) for node in nodes]
        self.nodes = [
            AsyncRedisDriver(
                node,
                prefix=prefix,
                token_mode=self.token_mode,
                socket_timeout=socket_timeout,
                check_config=check_config,
            )
            for node in nodes
        ]
        self.prefix = self.nodes[0].prefix
        self._commit = [node.client.register_script(COMMIT) for node in self.nodes]
        self._fan = FanOut(2 * len(self.nodes))
        self._down: set[int] = set()
        self._attempts: dict[str, int] = {}
        self._rng = random.Random()

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

    def _unavailable(self, what: str, outcomes: dict[int, Any]) -> BackendError:
        failed = {i: o for i, o in outcomes.items() if isinstance(o, BackendError)}
        names = ", ".join(f"{self.names[i]} ({o.code})" for i, o in failed.items())
        consequence = _CONSEQUENCES.get(what, "The outcome is unknown")
        return BackendError(
            f"the {what} reached {len(outcomes) - len(failed)} of {len(self.nodes)} Redis "
            f"nodes, fewer than the majority of {self.majority}; failed: {names or 'none'}. "
            f"{consequence}. Retry when a majority answers",
            code="QUORUM",
            retryable=True,
        )

    @property
    def down(self) -> list[str]:
        """The nodes whose last call failed."""
        return [self.names[i] for i in sorted(self._down)]

    # -- the driver protocol -------------------------------------------------------------

    async def acquire(self, resource: str, secret: str, ttl: float, holder: str) -> AcquireReply:
        """One Redlock round: take the lock on every node at once, count a majority that
        granted it within the validity time, and commit the quorum's token; otherwise undo
        the attempt on every node. See :meth:`fence.abc.AsyncDriver.acquire`.

        Raises:
            BackendError: fewer than a majority of nodes answered (``code="QUORUM"``).
        """
        clock = self.clock
        start = clock.monotonic()
        all_nodes = range(len(self.nodes))
        refused: list[int] = []
        granted: list[int] = []
        try:
            outcomes = await self._each(
                "acquire",
                resource,
                {
                    i: functools.partial(self.nodes[i].acquire, resource, secret, ttl, holder)
                    for i in all_nodes
                },
            )
            answered = [i for i, o in outcomes.items() if isinstance(o, AcquireReply)]
            granted = [i for i in answered if outcomes[i].token is not None]
            refused = [i for i in answered if outcomes[i].token is None]
            in_time = validity(ttl, clock.monotonic() - start, drift=self.drift, margin=self.margin)
            if len(granted) >= self.majority and in_time > 0:
                proposals = [outcomes[i].token for i in granted]
                token = merge_tokens(proposals)
                held = len(granted)
                if commit_needed(proposals, len(self.nodes)):
                    held = await self._commit_token(resource, secret, token, answered, fence=False)
                left = validity(
                    ttl, clock.monotonic() - start, drift=self.drift, margin=self.margin
                )
                if held >= self.majority and left > 0:
                    self._attempts.pop(secret, None)
                    return AcquireReply(token)
        except BaseException:
            # Cancelled or failed half way: a node may hold the lock for this secret.
            stray = [i for i in all_nodes if i not in refused]
            await self._undo(resource, secret, stray)
            raise
        # Not granted: release wherever this attempt may hold the lock (granted, or no
        # answer: a request that timed out may still have run).
        stray = [i for i in all_nodes if i not in refused]
        await self._undo(resource, secret, stray)
        if len(answered) < self.majority:
            raise self._unavailable("acquire", outcomes)
        if granted:
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
        # holder's release will publish a wake-up. Always the same one while it refuses:
        # the node's manager subscribes to the resource once, not once per node.
        wait_hint = time_until_free([outcomes[i].holder_ttl for i in refused], 0, len(self.nodes))
        return AcquireReply(None, wait_hint, min(refused))

    async def _commit_token(
        self, resource: str, secret: str, token: int, indexes: Sequence[int], *, fence: bool
    ) -> int:
        """Write ``token`` to the nodes ``indexes``; return how many hold the lock (or, for a
        revoke, took the token)."""
        keys = resource_keys(self.prefix, resource)
        script_keys = [keys.lock, keys.token, keys.fence] if fence else [keys.lock, keys.token]
        args = [secret, str(token)]
        outcomes = await self._each(
            "commit",
            resource,
            {
                i: functools.partial(
                    self.nodes[i]._run, self._commit[i], script_keys, args, "token commit"
                )
                for i in indexes
            },
        )
        return sum(1 for o in outcomes.values() if not isinstance(o, Exception) and int(o) == 1)

    async def _undo(self, resource: str, secret: str, indexes: Sequence[int]) -> None:
        """Release the lock for ``secret`` on ``indexes``, best effort: a node that does not
        answer lets it expire with its ttl."""
        if not indexes:
            return
        calls = {i: functools.partial(self.nodes[i].release, resource, secret) for i in indexes}
        # Shielded: an acquire cancelled half way still undoes what it took.
        await shield(self._each("release", resource, calls))

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
        return self._verdict("renewal", outcomes)

    async def release(self, resource: str, secret: str) -> bool:
        """Delete the lock for ``secret`` on every node (each wakes a waiter); true if a
        majority held it. See :meth:`fence.abc.AsyncDriver.release`.

        Raises:
            BackendError: too few nodes answered to tell; the lock expires with its ttl on
                the nodes that did not answer.
        """
        outcomes = await self._each(
            "release",
            resource,
            {
                i: functools.partial(node.release, resource, secret)
                for i, node in enumerate(self.nodes)
            },
        )
        return self._verdict("release", outcomes)

    def _verdict(self, what: str, outcomes: dict[int, Any]) -> bool:
        done = sum(1 for o in outcomes.values() if o is True)
        if done >= self.majority:
            return True
        failed = sum(1 for o in outcomes.values() if isinstance(o, BackendError))
        if done + failed >= self.majority:
            raise self._unavailable(what, outcomes)
        return False

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

    async def revoke(self, resource: str) -> int:
        """End the lease on every node, and issue and commit a token above every earlier one
        (raising each node's guard fence register ``<prefix>{R}:fence`` to it).

        Raises:
            BackendError: fewer than a majority of nodes took part; the lease may still be
                held on a majority.
        """
        outcomes = await self._each(
            "revoke",
            resource,
            {i: functools.partial(node.revoke, resource) for i, node in enumerate(self.nodes)},
        )
        answered = [i for i, o in outcomes.items() if isinstance(o, int)]
        if len(answered) < self.majority:
            raise self._unavailable("revoke", outcomes)
        token = merge_tokens([outcomes[i] for i in answered])
        if await self._commit_token(resource, "", token, answered, fence=True) < self.majority:
            raise BackendError(
                f"the revocation of {resource!r} issued token {token} but fewer than "
                f"{self.majority} nodes stored it; revoke again",
                code="QUORUM",
                retryable=True,
            )
        return token

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
