"""A Hypothesis state machine drives the real Redis guard against a model of the contract.

Three clients take a lock from a ``MemoryLockManager`` on a manual clock; expiring a lease
leaves its holder with an old token, as after a GC pause. In random interleavings the
clients claim, read (registering or plain), write, increment and delete, and send batches
that write the key and add to a counter near the ends of int64, so that Redis would
refuse some of them while applying. Every outcome must match the model (C4-C8): no stale
write accepted, every batch all or nothing, and no read-modify-write that registered its
token may lose an update.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from fence import ManualClock, MemoryLockManager, Reason, StaleTokenError, TokenMode
from fence.adapters.redis import RedisGuard, WriteRefusedError

CLIENTS = st.integers(min_value=0, max_value=2)
TTL = 10.0
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
#: Amounts that reach both ends of int64 in a few steps.
AMOUNTS = st.sampled_from([1, -1, 2**62, -(2**62), INT64_MAX, INT64_MIN])


@dataclass
class Client:
    """One lock client: its owner identity, its current token and its last snapshot."""

    owner: object
    token: int | None = None
    #: The token this client registered (claim, registering read or accepted write) with.
    registered: int | None = None
    #: The value it read for a read-modify-write, if that read was protected.
    snapshot: int | None = None


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


class GuardModel(RuleBasedStateMachine):
    """The real guard on one key, and the model it must agree with."""

    client: redis.Redis
    scope: str

    def __init__(self) -> None:
        super().__init__()
        self.client.flushall()
        self.guard = RedisGuard(self.client, scope=self.scope)
        self.key = "{acct:1}:balance"
        self.counter = "{acct:1}:count"
        self.clock = ManualClock()
        self.manager = MemoryLockManager(
            clock=self.clock, token_mode=TokenMode.COUNTER, reentrant=False
        )
        self.clients = [Client(object()) for _ in range(3)]
        # The model: C4-C8 on one scope, and a counter (its own scope per key; the same
        # register per resource).
        self.fence: int | None = None
        self.value: int | None = None
        self.count = 0
        self.count_fence: int | None = None

    def teardown(self) -> None:
        self.manager.close()

    # -- the model's verdict on a fenced call -------------------------------------------

    def _fenced(self, c: Client, call: Any, *, must_exist: bool = False) -> Any:
        """Run ``call`` with ``c``'s token; check the verdict against the model."""
        assert c.token is not None
        token = c.token
        stale = token < (self.fence or 0)
        missing = must_exist and self.value is None
        refused: StaleTokenError | None = None
        try:
            result = call(token)
        except StaleTokenError as err:
            refused = err
        if refused is not None:
            assert stale or missing, f"token {token} wrongly refused at fence {self.fence}"
            assert refused.reason is (Reason.STALE if stale else Reason.MISSING)
            assert (refused.token, refused.fence) == (token, self.fence)
            return refused
        assert not stale, f"stale token {token} accepted at fence {self.fence}"
        assert not missing, "an update of a missing value succeeded"
        self.fence = token
        c.registered = token
        return result

    def _lose_snapshots(self, writer: Client) -> None:
        # A write by the client itself invalidates its own read; other clients' writes
        # must not happen in between, which is what the lost-update check asserts.
        writer.snapshot = None

    # -- rules -------------------------------------------------------------------------

    @rule(i=CLIENTS)
    def acquire(self, i: int) -> None:
        c = self.clients[i]
        lease = self.manager.try_acquire("acct:1", ttl=TTL, owner=c.owner)
        if lease is not None:
            assert c.token is None or lease.token > c.token
            c.token, c.registered, c.snapshot = lease.token, None, None

    @rule()
    def expire(self) -> None:
        """Every holder pauses past its lease; it keeps its (now old) token."""
        self.clock.advance(TTL + 1)

    @precondition(lambda self: any(c.token for c in self.clients))
    @rule(i=CLIENTS)
    def claim(self, i: int) -> None:
        c = self.clients[i]
        if c.token is not None:
            self._fenced(c, lambda t: self.guard.claim(self.key, t))

    @rule(i=CLIENTS)
    def read_for_update(self, i: int) -> None:
        c = self.clients[i]
        if c.token is None:
            return
        outcome = self._fenced(c, lambda t: self.guard.read_for_update(self.key, token=t))
        if not isinstance(outcome, StaleTokenError):
            got = None if outcome is None else int(outcome)
            assert got == self.value
            c.snapshot = got

    @rule(i=CLIENTS)
    def plain_read(self, i: int) -> None:
        c = self.clients[i]
        raw, fence = self.guard.get(self.key)
        assert (None if raw is None else int(raw), fence) == (self.value, self.fence)
        # Only a read after this client registered its current token is protected.
        protected = c.token is not None and c.registered == c.token
        c.snapshot = (None if raw is None else int(raw)) if protected else None

    @rule(i=CLIENTS, value=st.integers(min_value=0, max_value=1000))
    def write(self, i: int, value: int) -> None:
        c = self.clients[i]
        if c.token is None:
            return
        outcome = self._fenced(c, lambda t: self.guard.set(self.key, value, token=t))
        if not isinstance(outcome, StaleTokenError):
            self.value = value
            self._lose_snapshots(c)

    @rule(i=CLIENTS)
    def update(self, i: int) -> None:
        c = self.clients[i]
        if c.token is None:
            return
        outcome = self._fenced(
            c,
            lambda t: self.guard.set(self.key, 7, token=t, must_exist=True),
            must_exist=True,
        )
        if not isinstance(outcome, StaleTokenError):
            self.value = 7
            self._lose_snapshots(c)

    @precondition(lambda self: any(c.snapshot is not None for c in self.clients))
    @rule(i=CLIENTS)
    def read_modify_write(self, i: int) -> None:
        """Write ``snapshot + 1``: if accepted, nobody may have written since the read."""
        c = self.clients[i]
        if c.token is None or c.snapshot is None:
            return
        snapshot = c.snapshot
        before = self.value
        outcome = self._fenced(c, lambda t: self.guard.set(self.key, snapshot + 1, token=t))
        if not isinstance(outcome, StaleTokenError):
            assert before == snapshot, f"lost update: read {snapshot}, overwrote {before}"
            self.value = snapshot + 1
            c.snapshot = self.value

    @rule(i=CLIENTS)
    def delete(self, i: int) -> None:
        c = self.clients[i]
        if c.token is None:
            return
        outcome = self._fenced(c, lambda t: self.guard.delete(self.key, token=t))
        if not isinstance(outcome, StaleTokenError):
            self.value = None
            self._lose_snapshots(c)

    @rule(i=CLIENTS, value=st.integers(min_value=0, max_value=1000), amount=AMOUNTS)
    def batch_with_counter(self, i: int, value: int, amount: int) -> None:
        """Write the key and add to the counter in one batch: both or neither (C6)."""
        c = self.clients[i]
        if c.token is None:
            return
        token = c.token
        per_resource = self.scope == "resource"
        count_fence = self.fence if per_resource else self.count_fence
        stale = token < max(self.fence or 0, count_fence or 0)
        overflow = not INT64_MIN <= self.count + amount <= INT64_MAX
        batch = self.guard.batch(token).set(self.key, value).incr(self.counter, amount)
        refused: StaleTokenError | WriteRefusedError | None = None
        try:
            batch.execute()
        except (StaleTokenError, WriteRefusedError) as err:
            refused = err
        if isinstance(refused, StaleTokenError):
            assert stale, f"token {token} wrongly refused: {refused}"
            return
        if isinstance(refused, WriteRefusedError):
            assert not stale, "a data refusal hid a token verdict"
            assert overflow, f"refused without an overflow: {refused}"
            assert [(r.index, r.reason) for r in refused.refused] == [(1, "OVERFLOW")]
            return
        assert not stale, f"stale token {token} accepted"
        assert not overflow, "an overflowing batch was applied"
        self.value, self.count = value, self.count + amount
        self.fence = token
        self.count_fence = None if per_resource else token
        c.registered = token
        self._lose_snapshots(c)

    # -- invariants --------------------------------------------------------------------

    @invariant()
    def storage_matches_model(self) -> None:
        raw, fence = self.guard.get(self.key)
        assert fence == self.fence
        assert (None if raw is None else int(raw)) == self.value

    @invariant()
    def counter_matches_model(self) -> None:
        raw, fence = self.guard.get(self.counter)
        assert int(raw or 0) == self.count
        assert fence == (self.fence if self.scope == "resource" else self.count_fence)

    @invariant()
    def no_snapshot_outlives_a_foreign_write(self) -> None:
        # A protected snapshot stays equal to the stored value until its owner writes:
        # every other writer has an older token (refused) or a newer one (which makes the
        # owner's next write stale, so that snapshot can never be written back).
        for c in self.clients:
            if c.snapshot is not None and c.registered == c.token == self.fence:
                assert c.snapshot == self.value


@pytest.mark.parametrize("scope", ["key", "resource"])
def test_guard_agrees_with_the_model(client: redis.Redis, scope: str) -> None:
    machine = type("Machine", (GuardModel,), {"client": client, "scope": scope})
    run_state_machine_as_test(
        machine,
        settings=settings(max_examples=60, stateful_step_count=30, deadline=None),
    )
