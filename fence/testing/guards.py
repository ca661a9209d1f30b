"""The guard kit: the conformance suite of a storage guard, as a pytest plugin.

A guard of your own storage passes the kit when it keeps the contract as iofence's guards
do: accepted iff ``token >= fence`` (C4), refused with nothing written and both tokens in
the error (C5), batches all or nothing (C6), tombstones (C7), claims and registering reads
(C8), no write without a token (C9) and none with a read lease's token (C13), errors that
pickle, and the same verdicts as :class:`fence.testing.MemoryGuard` over random
histories. iofence's own guards run through the same kit.

Load the plugin (``pytest -p fence.testing.guards``, or ``pytest_plugins =
["fence.testing.guards"]`` in your root ``conftest.py``; nothing loads it unasked), then
define a fixture named ``fence_guard_harness`` in a test module. It returns a
:class:`GuardFactory` that makes your guard, on a fresh storage, behind the
:class:`GuardHarness` interface; the kit adds its tests, as the class ``GuardKit``, to that
module::

    import pytest
    from fence.testing.guards import GuardFactory

    @pytest.fixture
    def fence_guard_harness(tmp_path):
        return GuardFactory(make=lambda: MyHarness(tmp_path))

Each test runs once on the sync harness and once on the asyncio one
(:attr:`GuardFactory.make_async`), or is skipped when the guard has no asyncio API.
Parametrize the fixture to run the kit over several guards or storages.
"""

from __future__ import annotations

import asyncio
import pickle
import random
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import pytest

from fence._core import MAX_TOKEN, ReadToken
from fence._errors import (
    InvalidTokenError,
    ReadLeaseError,
    Reason,
    StaleTokenError,
    TokenRequiredError,
)
from fence.testing import _differential

__all__ = [
    "FEATURES",
    "AsyncGuardHarness",
    "GuardFactory",
    "GuardHarness",
    "GuardKit",
    "pytest_pycollect_makeitem",
]

#: The optional features a harness may declare in ``features``: ``"batch"``
#: (:meth:`GuardHarness.batch` is all or nothing, C6) and ``"registering_read"``
#: (:meth:`GuardHarness.read_for_update` raises the fence, C8).
FEATURES = frozenset({"batch", "registering_read"})

#: The name of the fixture that points the kit at a guard.
FIXTURE = "fence_guard_harness"

_T = TypeVar("_T")


class GuardHarness(Protocol):
    """A guard under test, driven through scope names and ``int`` values.

    The harness maps a scope name (a short string such as ``"c4"``) to a place of its
    storage (a key, a row, a file) and runs each call as one guarded operation of the
    guard. Every write checks its token first: ``InvalidTokenError`` for anything that is
    no token (C1: ``bool``, floats, strings, out of range), ``TokenRequiredError`` or
    ``InvalidTokenError`` for ``None`` (C9), ``ReadLeaseError`` for a
    :class:`fence.ReadToken` (C13), all before any I/O. A refused write raises
    :class:`fence.StaleTokenError` with ``scope`` (a string that contains the scope name),
    ``token`` (the token presented), ``fence`` (the current fence; ``None`` or ``0`` where
    there is none), ``reason`` (``STALE``, or ``MISSING`` for an update of nothing) and,
    for a batch, ``rejected`` (one error per refused scope), and writes nothing.

    Attributes:
        features: the optional features the harness has (see :data:`FEATURES`).
    """

    features: frozenset[str]

    def claim(self, scope: str, token: int) -> int:
        """Raise the fence without writing data (C8); return the fence."""
        ...

    def fence(self, scope: str) -> int | None:
        """The current fence, ``None`` if there is none (not a guarded call)."""
        ...

    def create(self, scope: str, token: int, value: int) -> None:
        """A fenced insert-or-replace (upsert): creates the value, or replaces it."""
        ...

    def update(self, scope: str, token: int, value: int) -> None:
        """A fenced update; ``MISSING`` if there is no value (never, or deleted)."""
        ...

    def delete(self, scope: str, token: int) -> None:
        """A fenced delete that keeps the fence as a tombstone (C7)."""
        ...

    def read(self, scope: str) -> int | None:
        """The current value, ``None`` if absent or deleted (not a guarded call)."""
        ...

    def read_for_update(self, scope: str, token: int) -> int | None:
        """A registering read (C8): raise the fence and return the value, or refuse."""
        ...

    def batch(self, token: int, values: Mapping[str, int]) -> None:
        """Create or replace several values, all or nothing (C6), with ``"batch"``."""
        ...

    def close(self) -> None:
        """Release what the harness opened."""
        ...


class AsyncGuardHarness(Protocol):
    """The asyncio twin of :class:`GuardHarness`: the same methods, as coroutines.

    Attributes:
        features: the optional features the harness has (see :data:`FEATURES`).
    """

    features: frozenset[str]

    async def claim(self, scope: str, token: int) -> int:
        """See :meth:`GuardHarness.claim`."""
        ...

    async def fence(self, scope: str) -> int | None:
        """See :meth:`GuardHarness.fence`."""
        ...

    async def create(self, scope: str, token: int, value: int) -> None:
        """See :meth:`GuardHarness.create`."""
        ...

    async def update(self, scope: str, token: int, value: int) -> None:
        """See :meth:`GuardHarness.update`."""
        ...

    async def delete(self, scope: str, token: int) -> None:
        """See :meth:`GuardHarness.delete`."""
        ...

    async def read(self, scope: str) -> int | None:
        """See :meth:`GuardHarness.read`."""
        ...

    async def read_for_update(self, scope: str, token: int) -> int | None:
        """See :meth:`GuardHarness.read_for_update`."""
        ...

    async def batch(self, token: int, values: Mapping[str, int]) -> None:
        """See :meth:`GuardHarness.batch`."""
        ...

    async def close(self) -> None:
        """See :meth:`GuardHarness.close`."""
        ...


@dataclass(frozen=True)
class GuardFactory:
    """What the ``fence_guard_harness`` fixture returns: how to make the guard under test.

    Each test calls one of the two once and closes what it got. A harness starts on a
    storage where no scope the kit names has a fence or a value.

    Attributes:
        make: returns a new :class:`GuardHarness`.
        make_async: returns a new :class:`AsyncGuardHarness`; called on the event loop the
            test runs its calls on. ``None`` when the guard has no asyncio API.
    """

    make: Callable[[], GuardHarness]
    make_async: Callable[[], AsyncGuardHarness] | None = None


class _Blocking:
    """An asyncio harness behind the sync interface: every call runs on one event loop."""

    def __init__(self, make: Callable[[], AsyncGuardHarness]) -> None:
        self._runner = asyncio.Runner()

        async def build() -> AsyncGuardHarness:
            return make()

        self._harness = self._runner.run(build())
        self.features = self._harness.features

    def _run(self, call: Awaitable[_T]) -> _T:
        async def run() -> _T:
            return await call

        return self._runner.run(run())

    def claim(self, scope: str, token: int) -> int:
        return self._run(self._harness.claim(scope, token))

    def fence(self, scope: str) -> int | None:
        return self._run(self._harness.fence(scope))

    def create(self, scope: str, token: int, value: int) -> None:
        self._run(self._harness.create(scope, token, value))

    def update(self, scope: str, token: int, value: int) -> None:
        self._run(self._harness.update(scope, token, value))

    def delete(self, scope: str, token: int) -> None:
        self._run(self._harness.delete(scope, token))

    def read(self, scope: str) -> int | None:
        return self._run(self._harness.read(scope))

    def read_for_update(self, scope: str, token: int) -> int | None:
        return self._run(self._harness.read_for_update(scope, token))

    def batch(self, token: int, values: Mapping[str, int]) -> None:
        self._run(self._harness.batch(token, values))

    def close(self) -> None:
        try:
            self._run(self._harness.close())
        finally:
            self._runner.close()


BAD_TOKENS: list[Any] = [0, -1, MAX_TOKEN + 1, 2**64, True, False, 1.0, 5.0, "5", b"5"]


def _stale(method: Callable[..., Any], *args: Any) -> StaleTokenError:
    """Call ``method(*args)`` and return the StaleTokenError it raised."""
    with pytest.raises(StaleTokenError) as caught:
        method(*args)
    return caught.value


def _refused(expected: Any, call: Callable[[], Any], what: str) -> None:
    """Call ``call``; fail, saying ``what``, unless it raises ``expected``."""
    try:
        call()
    except expected:
        return
    pytest.fail(what)


def _needs(harness: GuardHarness, feature: str) -> None:
    if feature not in harness.features:
        pytest.skip(f"the guard has no {feature!r}")


#: Every guarded call of the harness, as ``(name, call(harness, scope, token))``.
_PATHS: list[tuple[str, Callable[[Any, str, Any], Any]]] = [
    ("create", lambda h, s, t: h.create(s, t, 1)),
    ("update", lambda h, s, t: h.update(s, t, 1)),
    ("delete", lambda h, s, t: h.delete(s, t)),
    ("claim", lambda h, s, t: h.claim(s, t)),
    ("read_for_update", lambda h, s, t: h.read_for_update(s, t)),
    ("batch", lambda h, s, t: h.batch(t, {s: 1})),
]

_FEATURE_OF = {"read_for_update": "registering_read", "batch": "batch"}


def _paths(harness: GuardHarness) -> list[tuple[str, Callable[[Any, str, Any], Any]]]:
    return [
        (name, call) for name, call in _PATHS if _FEATURE_OF.get(name) in (None, *harness.features)
    ]


class GuardKit:
    """The conformance tests, added to each test module that defines ``fence_guard_harness``.

    Each test names the rule of the contract it checks.
    """

    @pytest.fixture(params=["sync", "async"])
    def fence_guard(
        self, request: pytest.FixtureRequest, fence_guard_harness: object
    ) -> Iterator[GuardHarness]:
        """The guard under test, sync or asyncio (behind the sync interface), closed after."""
        factory = fence_guard_harness
        if not isinstance(factory, GuardFactory):
            raise TypeError(f"the fixture {FIXTURE} returns a GuardFactory, not {factory!r}")
        harness: GuardHarness
        if request.param == "async":
            if factory.make_async is None:
                pytest.skip("the guard has no asyncio API")
            harness = _Blocking(factory.make_async)
        else:
            harness = factory.make()
        unknown = harness.features - FEATURES
        assert not unknown, f"unknown features {sorted(unknown)}"
        yield harness
        harness.close()

    def test_c1_invalid_tokens_are_refused_and_change_nothing(
        self, fence_guard: GuardHarness
    ) -> None:
        """C1: what is no token is refused before any I/O; the bounds are tokens."""
        h = fence_guard
        for bad in BAD_TOKENS:
            for name, call in _paths(h):
                _refused(
                    InvalidTokenError,
                    lambda: call(h, "c1", bad),  # noqa: B023 - called at once
                    f"{name} took {bad!r}",
                )
        assert h.fence("c1") is None
        assert h.read("c1") is None
        # The bounds themselves are tokens, and they come back exact (no float rounding).
        h.create("c1", 1, 10)
        h.create("c1", MAX_TOKEN, 11)
        assert h.fence("c1") == MAX_TOKEN
        assert h.read("c1") == 11

    def test_c4_accepts_iff_token_not_below_fence(self, fence_guard: GuardHarness) -> None:
        """C4: accepted iff ``token >= fence``, a missing fence counting as 0."""
        h = fence_guard
        h.create("c4", 5, 1)
        assert h.fence("c4") == 5
        # Equal tokens pass: a holder writes more than once.
        h.create("c4", 5, 2)
        assert h.read("c4") == 2
        h.update("c4", 7, 3)
        assert h.fence("c4") == 7
        err = _stale(h.create, "c4", 6, 4)
        assert err.reason is Reason.STALE
        assert h.read("c4") == 3
        assert h.fence("c4") == 7
        # Integer comparison is exact next to 2**53, where doubles stop being dense.
        h.create("c4", MAX_TOKEN - 1, 5)
        _stale(h.update, "c4", MAX_TOKEN - 2, 6)
        h.update("c4", MAX_TOKEN, 7)
        _stale(h.update, "c4", MAX_TOKEN - 1, 8)
        assert h.read("c4") == 7
        assert h.fence("c4") == MAX_TOKEN

    def test_c5_rejection_changes_nothing_and_says_why(self, fence_guard: GuardHarness) -> None:
        """C5: a refusal writes nothing and carries the scope, both tokens and the reason."""
        h = fence_guard
        h.create("c5", 20, 100)
        err = _stale(h.update, "c5", 19, 1)
        assert (err.reason, err.token, err.fence) == (Reason.STALE, 19, 20)
        assert "c5" in err.scope
        assert h.read("c5") == 100
        assert h.fence("c5") == 20

        # An update of something that does not exist is MISSING, never a success.
        err = _stale(h.update, "c5-missing", 3, 1)
        assert (err.reason, err.token) == (Reason.MISSING, 3)
        assert err.fence in (None, 0)
        assert "c5-missing" in err.scope
        assert h.read("c5-missing") is None
        # Creation is its own fenced upsert.
        h.create("c5-missing", 3, 1)
        assert h.read("c5-missing") == 1

        # Stale wins over missing: an old token learns that it is old.
        h.claim("c5-claimed", 9)
        err = _stale(h.update, "c5-claimed", 8, 1)
        assert (err.reason, err.fence) == (Reason.STALE, 9)
        err = _stale(h.update, "c5-claimed", 9, 1)
        assert (err.reason, err.token, err.fence) == (Reason.MISSING, 9, 9)

    def test_c6_batch_is_all_or_nothing(self, fence_guard: GuardHarness) -> None:
        """C6: every fence is checked before the first write; every refusal is listed."""
        h = fence_guard
        _needs(h, "batch")
        h.batch(10, {"c6a": 1, "c6b": 2, "c6c": 3})
        assert [h.read(s) for s in ("c6a", "c6b", "c6c")] == [1, 2, 3]
        assert [h.fence(s) for s in ("c6a", "c6b", "c6c")] == [10, 10, 10]

        h.claim("c6a", 12)
        h.claim("c6c", 13)
        err = _stale(h.batch, 11, {"c6a": 7, "c6b": 8, "c6c": 9})
        assert len(err.rejected) == 2
        rejected = sorted(err.rejected, key=lambda e: e.fence or 0)
        assert "c6a" in rejected[0].scope
        assert "c6c" in rejected[1].scope
        assert [(e.reason, e.token, e.fence) for e in rejected] == [
            (Reason.STALE, 11, 12),
            (Reason.STALE, 11, 13),
        ]
        assert err.token == 11
        assert [h.read(s) for s in ("c6a", "c6b", "c6c")] == [1, 2, 3]
        assert [h.fence(s) for s in ("c6a", "c6b", "c6c")] == [12, 10, 13]

    def test_c7_delete_leaves_a_tombstone(self, fence_guard: GuardHarness) -> None:
        """C7: a delete keeps the fence, so a stale writer cannot bring the value back."""
        h = fence_guard
        h.create("c7", 5, 1)
        h.delete("c7", 6)
        assert h.read("c7") is None
        assert h.fence("c7") == 6
        err = _stale(h.create, "c7", 5, 2)
        assert (err.reason, err.fence) == (Reason.STALE, 6)
        assert h.read("c7") is None
        # An update of the deleted value is MISSING; a fresh create is fine.
        err = _stale(h.update, "c7", 6, 3)
        assert err.reason is Reason.MISSING
        h.create("c7", 6, 4)
        assert h.read("c7") == 4
        # A stale delete changes nothing either.
        _stale(h.delete, "c7", 5)
        assert h.read("c7") == 4

    def test_c8_claim_shuts_out_older_tokens_without_writing(
        self, fence_guard: GuardHarness
    ) -> None:
        """C8: a claim raises the fence and writes no data."""
        h = fence_guard
        h.create("c8", 3, 100)
        # The write-only hole, closed: B claims before it reads, so A's late write is refused.
        assert h.claim("c8", 4) == 4
        assert h.fence("c8") == 4
        assert h.read("c8") == 100
        err = _stale(h.update, "c8", 3, 70)
        assert (err.reason, err.fence) == (Reason.STALE, 4)
        h.update("c8", 4, 150)
        assert h.read("c8") == 150
        # A claim is itself fenced, and equal tokens pass.
        assert h.claim("c8", 4) == 4
        err = _stale(h.claim, "c8", 2)
        assert (err.reason, err.fence) == (Reason.STALE, 4)
        # Claiming a scope with no data creates a fence and no value.
        assert h.claim("c8-empty", 7) == 7
        assert h.read("c8-empty") is None
        assert h.fence("c8-empty") == 7

    def test_c8_registering_read_raises_the_fence(self, fence_guard: GuardHarness) -> None:
        """C8: a registering read returns the value and raises the fence in one step."""
        h = fence_guard
        _needs(h, "registering_read")
        h.create("c8r", 3, 100)
        assert h.read_for_update("c8r", 4) == 100
        assert h.fence("c8r") == 4
        _stale(h.update, "c8r", 3, 70)  # the paused holder, refused
        h.update("c8r", 4, 150)
        assert h.read("c8r") == 150
        # A stale reader is refused too, and reading a missing value registers the token.
        err = _stale(h.read_for_update, "c8r", 3)
        assert (err.reason, err.fence) == (Reason.STALE, 4)
        assert h.read_for_update("c8r-none", 5) is None
        assert h.fence("c8r-none") == 5

    def test_c9_unbound_writer_is_refused_on_every_path(self, fence_guard: GuardHarness) -> None:
        """C9: a write without a token is refused before any I/O, on every path."""
        h = fence_guard
        for name, call in _paths(h):
            _refused(
                (TokenRequiredError, InvalidTokenError),
                lambda: call(h, "c9", None),  # noqa: B023 - called at once
                f"{name} took no token",
            )
        assert h.read("c9") is None
        assert h.fence("c9") is None

    def test_c13_read_tokens_are_refused_on_every_path(self, fence_guard: GuardHarness) -> None:
        """C13: a read lease's token fences no write, claim or registering read."""
        h = fence_guard
        h.create("c13", 5, 1)
        for name, call in _paths(h):
            _refused(
                ReadLeaseError,
                lambda: call(h, "c13", ReadToken(9)),  # noqa: B023 - called at once
                f"{name} took a read token",
            )
        assert (h.read("c13"), h.fence("c13")) == (1, 5)

    def test_stale_holder_is_refused_on_every_path(self, fence_guard: GuardHarness) -> None:
        """C5, C9: token 10 under fence 20 is refused on every path, with nothing written."""
        h = fence_guard
        for name, call in _paths(h):
            scope = f"stale-{name}"
            h.create(scope, 20, 7)
            err = _stale(lambda: call(h, scope, 10))  # noqa: B023 - called at once
            items = err.rejected or (err,)
            assert [(e.reason, e.token, e.fence) for e in items] == [(Reason.STALE, 10, 20)], name
            assert scope in items[0].scope, name
            assert (h.read(scope), h.fence(scope)) == (7, 20), name

    def test_current_holder_lands_on_every_path(self, fence_guard: GuardHarness) -> None:
        """C4, C9: the current holder's token 25 over fence 20 lands on every path."""
        h = fence_guard
        expected = {"create": 1, "update": 1, "delete": None, "claim": 7}
        expected |= {"read_for_update": 7, "batch": 1}
        for name, call in _paths(h):
            scope = f"current-{name}"
            h.create(scope, 20, 7)
            call(h, scope, 25)
            assert (h.read(scope), h.fence(scope)) == (expected[name], 25), name

    def test_errors_pickle_with_their_data(self, fence_guard: GuardHarness) -> None:
        """Errors cross process boundaries with their data: both tokens, scope, reason."""
        h = fence_guard
        h.create("pk", 8, 1)
        errors = [_stale(h.update, "pk", 7, 2), _stale(h.update, "pk-none", 9, 2)]
        if "batch" in h.features:
            h.claim("pk-b", 8)
            errors.append(_stale(h.batch, 7, {"pk": 1, "pk-b": 2}))
        for err in errors:
            copy = pickle.loads(pickle.dumps(err))  # noqa: S301 - pickled just above
            assert type(copy) is type(err)
            assert (copy.scope, copy.token, copy.fence, copy.reason) == (
                err.scope,
                err.token,
                err.fence,
                err.reason,
            )
            assert [(e.scope, e.fence) for e in copy.rejected] == [
                (e.scope, e.fence) for e in err.rejected
            ]
            assert str(copy) == str(err)
        with pytest.raises(InvalidTokenError) as caught:
            h.create("pk", "8", 1)  # type: ignore[arg-type]
        copy = pickle.loads(pickle.dumps(caught.value))  # noqa: S301 - pickled just above
        assert type(copy) is type(caught.value)
        assert str(copy) == str(caught.value)

    def test_agrees_with_the_memory_guard(self, fence_guard: GuardHarness) -> None:
        """Random histories give the verdicts, values and fences of ``MemoryGuard``."""
        rng = random.Random(31)  # the same histories on every run
        for i in range(15):
            scopes = [f"d{i:02d}s{j}" for j in range(3)]
            steps = _differential.history(rng, scopes, fence_guard.features)
            _differential.compare(fence_guard, steps, scopes)


def pytest_pycollect_makeitem(
    collector: pytest.Module | pytest.Class, name: str, obj: object
) -> pytest.Class | None:
    """Add :class:`GuardKit` to a test module that defines the ``fence_guard_harness``.

    Args:
        collector: the module or class being collected.
        name: an attribute of it.
        obj: the attribute's value.
    """
    if name != FIXTURE or not isinstance(collector, pytest.Module):
        return None
    kit: pytest.Class = pytest.Class.from_parent(collector, name="GuardKit")
    # The class is the kit's, not an attribute of the module it runs in.
    kit.obj = GuardKit
    return kit
