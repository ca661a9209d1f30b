"""The differential check of the guard kit: random histories, a guard and the reference.

A history is a list of holders' operations over a few scopes, with tokens that are newer,
equal and older than the fences they meet. Each step runs on the guard under test and on
:class:`fence.testing.MemoryGuard`, the reference model of the contract; the verdicts
(accepted, or the reason, the fence and every rejected scope), the values and the fences
must then be identical. The histories come from :class:`random.Random` with a fixed seed,
so a failure is the same on every run and the kit needs no test library beyond pytest.

No I/O here: the guard is reached through the harness the kit hands in.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fence._errors import StaleTokenError
from fence.testing import MemoryGuard

#: A step: (operation, scope or {scope: value} for a batch, token, value or None).
Step = tuple[str, Any, int, int | None]


@dataclass(frozen=True)
class Verdict:
    """What a call came to, in terms every guard shares."""

    kind: str  # "ok" or "stale"
    result: Any = None
    reason: str | None = None
    fence: int = 0
    rejected: frozenset[tuple[str, str, int]] = frozenset()


def history(rng: random.Random, scopes: Sequence[str], features: frozenset[str]) -> list[Step]:
    """A random history over ``scopes``, with only the operations the guard has.

    Args:
        rng: the source of randomness (seeded by the caller).
        scopes: the scope names the history writes.
        features: the harness's features; ``"batch"`` and ``"registering_read"`` add
            batches and registering reads.
    """
    ops = ["create", "update", "delete", "claim"]
    if "registering_read" in features:
        ops.append("read_for_update")
    if "batch" in features:
        ops.append("batch")
    steps: list[Step] = []
    for _ in range(rng.randint(1, 10)):
        op = rng.choice(ops)
        token = rng.randint(1, 6)
        if op == "batch":
            chosen = rng.sample(list(scopes), rng.randint(1, min(3, len(scopes))))
            steps.append((op, {s: rng.randint(0, 99) for s in chosen}, token, None))
        elif op in ("create", "update"):
            steps.append((op, rng.choice(scopes), token, rng.randint(0, 99)))
        else:
            steps.append((op, rng.choice(scopes), token, None))
    return steps


def _scope_of(raw: str, scopes: Sequence[str]) -> str:
    # A guard names a scope its own way ("{ns}:s1", "table('s1')"); the kit's names are
    # chosen so that none contains another.
    for scope in scopes:
        if scope in raw:
            return scope
    return raw


def judge(call: Callable[[], Any], scopes: Sequence[str]) -> Verdict:
    """Run ``call`` and say what it came to.

    Args:
        call: one step on one side.
        scopes: the history's scope names, to read the guard's names of them in errors.
    """
    try:
        result = call()
    except StaleTokenError as err:
        items = err.rejected or (err,)
        return Verdict(
            "stale",
            reason=str(err.reason),
            fence=err.fence or 0,
            rejected=frozenset(
                (_scope_of(e.scope, scopes), str(e.reason), e.fence or 0) for e in items
            ),
        )
    return Verdict("ok", result=result)


class Reference:
    """:class:`MemoryGuard` behind the harness interface."""

    features = frozenset({"batch", "registering_read"})

    def __init__(self) -> None:
        self.guard = MemoryGuard()

    def create(self, scope: str, token: int, value: int) -> None:
        """A fenced upsert."""
        self.guard.write(scope, token, value)

    def update(self, scope: str, token: int, value: int) -> None:
        """A fenced update, ``MISSING`` if there is no value."""
        self.guard.update(scope, token, lambda _: value)

    def delete(self, scope: str, token: int) -> None:
        """A fenced delete that leaves a tombstone."""
        self.guard.delete(scope, token)

    def claim(self, scope: str, token: int) -> int:
        """Raise the fence without writing data."""
        return self.guard.claim(scope, token)

    def read_for_update(self, scope: str, token: int) -> int | None:
        """A registering read."""
        value: int | None = self.guard.read_for_update(scope, token)
        return value

    def batch(self, token: int, values: dict[str, int]) -> None:
        """An all-or-nothing multi-write."""
        self.guard.write_many(token, values)

    def read(self, scope: str) -> int | None:
        """The value, ``None`` if there is none."""
        value: int | None = self.guard.read(scope)
        return value

    def fence(self, scope: str) -> int | None:
        """The fence, ``None`` if there is none."""
        return self.guard.fence(scope)


def _call(side: Any, step: Step) -> Callable[[], Any]:
    op, target, token, value = step
    if op == "batch":
        return lambda: side.batch(token, target)
    if value is None:
        return lambda: getattr(side, op)(target, token)
    return lambda: getattr(side, op)(target, token, value)


def compare(harness: Any, steps: list[Step], scopes: Sequence[str]) -> None:
    """Run ``steps`` on ``harness`` and on a fresh reference; raise at the first difference.

    Args:
        harness: the guard under test (the sync interface of the kit).
        steps: the history.
        scopes: the scope names the history writes.

    Raises:
        AssertionError: a verdict, a value or a fence differs from the reference's.
    """
    reference = Reference()
    touched: set[str] = set()
    for i, step in enumerate(steps):
        expected = judge(_call(reference, step), scopes)
        got = judge(_call(harness, step), scopes)
        where = f"step {i} {step} of {steps}"
        assert got.kind == expected.kind, f"{where}: {got} != reference {expected}"
        if got.kind == "stale":
            assert (got.reason, got.fence, got.rejected) == (
                expected.reason,
                expected.fence,
                expected.rejected,
            ), f"{where}: {got} != reference {expected}"
        elif step[0] in ("read_for_update", "claim"):
            assert got.result == expected.result, f"{where}: {got} != reference {expected}"
        touched |= set(step[1]) if step[0] == "batch" else {step[1]}
        for scope in sorted(touched):
            state = (harness.read(scope), harness.fence(scope) or 0)
            want = (reference.read(scope), reference.fence(scope) or 0)
            assert state == want, f"{where}, scope {scope!r}: {state} != reference {want}"
