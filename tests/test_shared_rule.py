"""The shared-lock rule (C13) without I/O: ``fence._rwlock.decide``, ``fence.check_read``,
``fence.validate_mode`` and ``LockInfo.of_readers``."""

from __future__ import annotations

import pickle

import pytest

from fence import (
    ConfigurationError,
    LeaseMode,
    LockInfo,
    LockUpgradeError,
    ReadLeaseError,
    Reason,
    StaleTokenError,
    UnfencedWriteError,
    check_read,
    validate_mode,
)
from fence._rwlock import Holder, Waiting, decide

W = Holder("w", 5, 1.0)
R1 = Holder("r1", 6, 2.0)
R2 = Holder("r2", 7, 3.0)


def test_a_writer_needs_the_lock_free_and_nobody_ahead() -> None:
    assert decide("x", False, None, [], []).granted
    assert not decide("x", False, W, [], []).granted
    refused = decide("x", False, None, [R1, R2], [])
    assert not refused.granted
    assert refused.wait == 3.0  # the last reader's lease
    assert refused.queued  # beside readers, it joins the queue (keeps new readers out)
    alone = decide("x", False, W, [], [])
    assert not alone.queued  # behind a writer only: the exclusive way
    queue = [Waiting("a", False, 1.5), Waiting("x", True, 2.5)]
    ahead = decide("x", False, None, [], queue)
    assert not ahead.granted
    assert ahead.wait == 1.5
    assert ahead.placed
    assert decide("x", False, None, [], queue[1:]).granted


def test_a_reader_needs_no_writer_holding_or_queued_ahead() -> None:
    assert decide("x", True, None, [R1], []).granted
    assert not decide("x", True, W, [], []).granted
    writer_queued = [Waiting("q", True, 1.0)]
    refused = decide("x", True, None, [R1], writer_queued)
    assert not refused.granted
    assert refused.queued
    readers_queued = [Waiting("a", False, 1.0), Waiting("x", False, 1.0)]
    assert decide("x", True, None, [], readers_queued).granted  # readers go together
    behind = [Waiting("x", False, 1.0), Waiting("q", True, 1.0)]
    assert decide("x", True, None, [], behind).granted  # the writer came after it


def test_the_same_secret_keeps_its_lease() -> None:
    assert decide("w", False, W, [], []).kept == 5
    assert decide("r2", True, None, [R1, R2], [Waiting("q", True, 1.0)]).kept == 7


def test_checked_reads() -> None:
    check_read("s", 7, None)
    check_read("s", 7, 7)
    with pytest.raises(StaleTokenError) as info:
        check_read("s", 7, 8)
    assert info.value.reason is Reason.STALE
    assert (info.value.scope, info.value.token, info.value.fence) == ("s", 7, 8)


def test_modes() -> None:
    assert validate_mode("read") is LeaseMode.READ
    assert validate_mode(LeaseMode.WRITE) is LeaseMode.WRITE
    for bad in ("Read", "", None, 1, "exclusive"):
        with pytest.raises(ConfigurationError):
            validate_mode(bad)


def test_readers_info() -> None:
    assert LockInfo.of_readers("r", []) is None
    infos = [LockInfo("r", 9, 1.0, "b", LeaseMode.READ), LockInfo("r", 8, 4.0, "a", LeaseMode.READ)]
    found = LockInfo.of_readers("r", infos)
    assert found is not None
    assert (found.token, found.remaining, found.holder, found.mode) == (9, 4.0, "b", "read")
    assert [r.token for r in found.readers] == [8, 9]


def test_the_new_errors_carry_their_data_and_pickle() -> None:
    upgrade = LockUpgradeError("no", resource="r", token=3)
    assert isinstance(upgrade, ConfigurationError)
    refused = ReadLeaseError("no", scope="t", token=4)
    assert isinstance(refused, UnfencedWriteError)
    for err in (upgrade, refused):
        back = pickle.loads(pickle.dumps(err))
        assert type(back) is type(err)
        assert back.__dict__ == err.__dict__
