"""The guard conformance suite: every storage guard, sync and async, must pass it.

One test per rule of the contract (C1, C4-C9). Each runs once per guard registered in
``tests/guard_*.py`` through the harness interface of ``tests/guard_suite.py``. The sync
twin in ``tests/_sync`` is generated from this file.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest

from fence import MAX_TOKEN, InvalidTokenError, Reason, StaleTokenError, TokenRequiredError
from tests.registry import GUARD_HARNESSES, GuardHarnessFactory

IS_ASYNC = True  # unasync: IS_ASYNC = False

#: Fixtures that run a test only over the guards with one optional feature.
FEATURE_FIXTURES = {"batch_factory": "batch", "registering_read_factory": "registering_read"}

BAD_TOKENS: list[Any] = [0, -1, MAX_TOKEN + 1, 2**64, True, False, 1.0, 5.0, "5", b"5"]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize the feature fixtures over the guards that have the feature."""
    for fixture, feature in FEATURE_FIXTURES.items():
        if fixture in metafunc.fixturenames:
            metafunc.parametrize(
                fixture,
                [
                    pytest.param(g, id=g.name, marks=g.marks)
                    for g in GUARD_HARNESSES.values()
                    if feature in g.features
                ],
            )


async def _open(factory: GuardHarnessFactory, request: pytest.FixtureRequest) -> Any:
    harness = factory.make(request, IS_ASYNC)
    assert factory.features <= harness.features
    return harness


@pytest.fixture
async def harness(
    guard_harness_factory: GuardHarnessFactory, request: pytest.FixtureRequest
) -> AsyncIterator[Any]:
    """The guard under test, closed after the test."""
    opened = await _open(guard_harness_factory, request)
    yield opened
    await opened.close()


@pytest.fixture
async def batch_harness(
    batch_factory: GuardHarnessFactory, request: pytest.FixtureRequest
) -> AsyncIterator[Any]:
    """A guard with all-or-nothing batches."""
    opened = await _open(batch_factory, request)
    yield opened
    await opened.close()


@pytest.fixture
async def rr_harness(
    registering_read_factory: GuardHarnessFactory, request: pytest.FixtureRequest
) -> AsyncIterator[Any]:
    """A guard with a registering read."""
    opened = await _open(registering_read_factory, request)
    yield opened
    await opened.close()


async def _stale(method: Any, *args: Any) -> StaleTokenError:
    """Call ``method(*args)`` and return the StaleTokenError it raised."""
    with pytest.raises(StaleTokenError) as caught:
        await method(*args)
    return caught.value


async def test_c1_invalid_tokens_are_refused_and_change_nothing(harness: Any) -> None:
    for bad in BAD_TOKENS:
        with pytest.raises(InvalidTokenError):
            await harness.create("c1", bad, 1)
        with pytest.raises(InvalidTokenError):
            await harness.update("c1", bad, 1)
        with pytest.raises(InvalidTokenError):
            await harness.delete("c1", bad)
        with pytest.raises(InvalidTokenError):
            await harness.claim("c1", bad)
        with pytest.raises(InvalidTokenError):
            await harness.read_for_update("c1", bad)
        if "batch" in harness.features:
            with pytest.raises(InvalidTokenError):
                await harness.batch(bad, {"c1": 1})
    assert await harness.fence("c1") is None
    assert await harness.read("c1") is None
    # The bounds themselves are tokens, and they come back exact (no float rounding).
    await harness.create("c1", 1, 10)
    await harness.create("c1", MAX_TOKEN, 11)
    assert await harness.fence("c1") == MAX_TOKEN
    assert await harness.read("c1") == 11


async def test_c4_accepts_iff_token_not_below_fence(harness: Any) -> None:
    # A missing fence counts as 0: the first token passes and becomes the fence.
    await harness.create("c4", 5, 1)
    assert await harness.fence("c4") == 5
    # Equal tokens pass: a holder writes more than once.
    await harness.create("c4", 5, 2)
    assert await harness.read("c4") == 2
    await harness.update("c4", 7, 3)
    assert await harness.fence("c4") == 7
    err = await _stale(harness.create, "c4", 6, 4)
    assert err.reason is Reason.STALE
    assert await harness.read("c4") == 3
    assert await harness.fence("c4") == 7
    # Integer comparison is exact next to 2**53, where doubles stop being dense.
    await harness.create("c4", MAX_TOKEN - 1, 5)
    await _stale(harness.update, "c4", MAX_TOKEN - 2, 6)
    await harness.update("c4", MAX_TOKEN, 7)
    await _stale(harness.update, "c4", MAX_TOKEN - 1, 8)
    assert await harness.read("c4") == 7
    assert await harness.fence("c4") == MAX_TOKEN


async def test_c5_rejection_changes_nothing_and_says_why(harness: Any) -> None:
    await harness.create("c5", 20, 100)
    err = await _stale(harness.update, "c5", 19, 1)
    assert (err.reason, err.token, err.fence) == (Reason.STALE, 19, 20)
    assert "c5" in err.scope
    assert await harness.read("c5") == 100
    assert await harness.fence("c5") == 20

    # An update of something that does not exist is MISSING, never a success.
    err = await _stale(harness.update, "c5-missing", 3, 1)
    assert (err.reason, err.token) == (Reason.MISSING, 3)
    assert err.fence in (None, 0)
    assert "c5-missing" in err.scope
    assert await harness.read("c5-missing") is None
    # Creation is its own fenced upsert.
    await harness.create("c5-missing", 3, 1)
    assert await harness.read("c5-missing") == 1

    # Stale wins over missing: an old token learns that it is old.
    await harness.claim("c5-claimed", 9)
    err = await _stale(harness.update, "c5-claimed", 8, 1)
    assert (err.reason, err.fence) == (Reason.STALE, 9)
    err = await _stale(harness.update, "c5-claimed", 9, 1)
    assert (err.reason, err.token, err.fence) == (Reason.MISSING, 9, 9)


async def test_c6_batch_is_all_or_nothing(batch_harness: Any) -> None:
    h = batch_harness
    await h.batch(10, {"c6a": 1, "c6b": 2, "c6c": 3})
    assert [await h.read(s) for s in ("c6a", "c6b", "c6c")] == [1, 2, 3]
    assert [await h.fence(s) for s in ("c6a", "c6b", "c6c")] == [10, 10, 10]

    await h.claim("c6a", 12)
    await h.claim("c6c", 13)
    err = await _stale(h.batch, 11, {"c6a": 7, "c6b": 8, "c6c": 9})
    # Every fence is checked before the first write; the error lists every rejected item.
    assert len(err.rejected) == 2
    rejected = sorted(err.rejected, key=lambda e: e.fence or 0)
    assert "c6a" in rejected[0].scope
    assert "c6c" in rejected[1].scope
    assert [(e.reason, e.token, e.fence) for e in rejected] == [
        (Reason.STALE, 11, 12),
        (Reason.STALE, 11, 13),
    ]
    assert err.token == 11
    assert [await h.read(s) for s in ("c6a", "c6b", "c6c")] == [1, 2, 3]
    assert [await h.fence(s) for s in ("c6a", "c6b", "c6c")] == [12, 10, 13]


async def test_c7_delete_leaves_a_tombstone(harness: Any) -> None:
    await harness.create("c7", 5, 1)
    await harness.delete("c7", 6)
    assert await harness.read("c7") is None
    assert await harness.fence("c7") == 6
    # The stale writer cannot bring the value back.
    err = await _stale(harness.create, "c7", 5, 2)
    assert (err.reason, err.fence) == (Reason.STALE, 6)
    assert await harness.read("c7") is None
    # An update of the deleted value is MISSING; a fresh create is fine.
    err = await _stale(harness.update, "c7", 6, 3)
    assert err.reason is Reason.MISSING
    await harness.create("c7", 6, 4)
    assert await harness.read("c7") == 4
    # A stale delete changes nothing either.
    await _stale(harness.delete, "c7", 5)
    assert await harness.read("c7") == 4


async def test_c8_claim_shuts_out_older_tokens_without_writing(harness: Any) -> None:
    await harness.create("c8", 3, 100)
    # The write-only hole, closed: B claims before it reads, so A's late write is refused.
    assert await harness.claim("c8", 4) == 4
    assert await harness.fence("c8") == 4
    assert await harness.read("c8") == 100
    err = await _stale(harness.update, "c8", 3, 70)
    assert (err.reason, err.fence) == (Reason.STALE, 4)
    await harness.update("c8", 4, await harness.read("c8") + 50)
    assert await harness.read("c8") == 150
    # A claim is itself fenced, and equal tokens pass.
    assert await harness.claim("c8", 4) == 4
    err = await _stale(harness.claim, "c8", 2)
    assert (err.reason, err.fence) == (Reason.STALE, 4)
    # Claiming a scope with no data creates a fence and no value.
    assert await harness.claim("c8-empty", 7) == 7
    assert await harness.read("c8-empty") is None
    assert await harness.fence("c8-empty") == 7


async def test_c8_registering_read_raises_the_fence(rr_harness: Any) -> None:
    h = rr_harness
    await h.create("c8r", 3, 100)
    assert await h.read_for_update("c8r", 4) == 100
    assert await h.fence("c8r") == 4
    await _stale(h.update, "c8r", 3, 70)  # the paused holder, refused
    await h.update("c8r", 4, 150)
    assert await h.read("c8r") == 150
    # A stale reader is refused too, and reading a missing value registers the token.
    err = await _stale(h.read_for_update, "c8r", 3)
    assert (err.reason, err.fence) == (Reason.STALE, 4)
    assert await h.read_for_update("c8r-none", 5) is None
    assert await h.fence("c8r-none") == 5


async def test_c9_write_without_token_is_refused(harness: Any) -> None:
    refused = (TokenRequiredError, InvalidTokenError)
    with pytest.raises(refused):
        await harness.create("c9", None, 1)
    with pytest.raises(refused):
        await harness.update("c9", None, 1)
    with pytest.raises(refused):
        await harness.delete("c9", None)
    with pytest.raises(refused):
        await harness.claim("c9", None)
    assert await harness.read("c9") is None
    assert await harness.fence("c9") is None
