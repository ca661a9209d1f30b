"""The I/O-free contract core: tokens (C1, C3), acceptance (C4), rejection (C5), deadlines
(C10), errors and events."""

from __future__ import annotations

import pickle
import subprocess
import sys
from decimal import Decimal
from fractions import Fraction
from typing import Any

import pytest

import fence
from fence import (
    MAX_TOKEN,
    AcquireTimeout,
    BackendError,
    ConfigurationError,
    EventBus,
    EventKind,
    FenceError,
    InvalidResourceError,
    InvalidTokenError,
    LeaseExpiredError,
    LeaseLostError,
    NotOwnerError,
    Reason,
    RetryableError,
    StaleTokenError,
    TokenMode,
    TokenRequiredError,
    TransactionRefusedError,
    accepts,
    client_deadline,
    issue_token,
    rejection,
    validate_resource,
    validate_token,
)
from fence.testing import EventRecorder, ManualClock, MemoryGuard

BAD_TOKENS: list[Any] = [
    True,
    False,
    0,
    -1,
    MAX_TOKEN + 1,
    2**63,
    1.0,
    float("nan"),
    float("inf"),
    "1",
    b"1",
    None,
    Decimal(1),
    Fraction(1),
    [1],
]


@pytest.mark.parametrize("bad", BAD_TOKENS, ids=repr)
def test_c1_bad_tokens_raise_invalid_token(bad: Any) -> None:
    with pytest.raises(InvalidTokenError) as info:
        validate_token(bad)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, FenceError)
    assert info.value.value is bad or info.value.value == bad or bad != bad


@pytest.mark.parametrize("good", [1, 2, 12345, MAX_TOKEN])
def test_c1_good_tokens(good: int) -> None:
    assert validate_token(good) == good
    assert type(validate_token(good)) is int


def test_c1_int_subclass_is_normalised() -> None:
    class MyInt(int):
        pass

    assert type(validate_token(MyInt(7))) is int


class _Liar(int):
    """An int whose conversions and comparisons lie about its value."""

    def __int__(self) -> int:
        return 10**20

    def __index__(self) -> int:
        return 10**20

    def __le__(self, other: object) -> bool:
        return True

    def __ge__(self, other: object) -> bool:
        return True

    def __lt__(self, other: object) -> bool:
        return False

    def __gt__(self, other: object) -> bool:
        return False

    def __format__(self, spec: str) -> str:
        return "100000000000000000000"

    def __str__(self) -> str:
        return "100000000000000000000"


def test_c1_by_conversion_an_int_subclass_cannot_lie_about_its_value() -> None:
    """C1 holds for the value stored, not for what the object says of itself."""
    token = validate_token(_Liar(5))
    assert type(token) is int
    assert token == 5
    assert b"%d" % token == b"5"


@pytest.mark.parametrize("true_value", [0, -1, MAX_TOKEN + 1, 10**20])
def test_c1_by_conversion_the_range_check_uses_the_true_value(true_value: int) -> None:
    with pytest.raises(InvalidTokenError):
        validate_token(_Liar(true_value))


@pytest.mark.parametrize("bad", BAD_TOKENS, ids=repr)
def test_c1_bad_tokens_are_refused_before_any_io(bad: Any) -> None:
    """A guard checks the token before it touches storage: nothing is written."""
    guard = MemoryGuard()
    with pytest.raises(InvalidTokenError):
        guard.write("acct:1", bad, "value")
    with pytest.raises(InvalidTokenError):
        guard.claim("acct:1", bad)
    assert guard.fence("acct:1") is None
    assert guard.read("acct:1") is None


def test_c3_hybrid_token_follows_backend_clock_and_last() -> None:
    assert issue_token(0, 1_000_000) == 1_000_000
    assert issue_token(5_000_000, 1_000_000) == 5_000_001
    # A lost counter (last = 0) still yields a token above everything issued before,
    # as long as the backend clock did not go back.
    before = issue_token(0, 1_700_000_000_000_000)
    after_loss = issue_token(0, 1_700_000_000_000_001)
    assert after_loss > before


def test_c3_counter_mode() -> None:
    assert issue_token(0, 1_700_000_000_000_000, TokenMode.COUNTER) == 1
    assert issue_token(41, 1_700_000_000_000_000, TokenMode.COUNTER) == 42


def test_c3_hybrid_stays_below_2_53_for_centuries() -> None:
    year_2255_us = int((2255 - 1970) * 365.25 * 86400 * 1_000_000)
    assert issue_token(0, year_2255_us) <= MAX_TOKEN


def test_token_space_exhaustion_is_an_error() -> None:
    with pytest.raises(InvalidTokenError):
        issue_token(MAX_TOKEN, 0, TokenMode.COUNTER)


def test_c4_acceptance_rule() -> None:
    assert accepts(5, None)
    assert accepts(5, 0)
    assert accepts(5, 5)  # equal tokens: a holder writes more than once
    assert accepts(6, 5)
    assert not accepts(4, 5)


def test_c5_rejection_reasons() -> None:
    stale = rejection("t(1)", 4, 5)
    assert stale.reason is Reason.STALE
    assert (stale.scope, stale.token, stale.fence) == ("t(1)", 4, 5)
    missing = rejection("t(1)", 6, 5, exists=False)
    assert missing.reason is Reason.MISSING
    missing_no_fence = rejection("t(2)", 6, None, exists=False)
    assert missing_no_fence.reason is Reason.MISSING
    stale_and_missing = rejection("t(1)", 4, 5, exists=False)
    assert stale_and_missing.reason is Reason.STALE
    null_fence = rejection("t(1)", 6, None, fence_is_null=True)
    assert null_fence.reason is Reason.UNVERIFIABLE
    raced = rejection("t(1)", 6, 5, exists=True)
    assert raced.reason is Reason.STALE


def test_c5_batch_error_lists_every_item() -> None:
    items = (rejection("a", 3, 5), rejection("b", 3, 4, exists=False))
    err = StaleTokenError("batch", 3, None, Reason.STALE, rejected=items)
    assert err.rejected == items
    assert "a" in str(err)
    assert "b" in str(err)


ERRORS: list[FenceError] = [
    InvalidTokenError("bad", value=1.5),
    InvalidResourceError("bad", value=""),
    ConfigurationError("bad ttl"),
    StaleTokenError("orders(id=42)", 33, 34, Reason.STALE),
    StaleTokenError(
        "k", 3, None, Reason.MISSING, rejected=(rejection("k", 3, None, exists=False),)
    ),
    TokenRequiredError("no token", scope="orders"),
    LeaseExpiredError("expired", resource="r", token=3, remaining=-0.5),
    LeaseLostError("lost", resource="r", token=3, remaining=1.0, cause="revoked"),
    NotOwnerError("not yours", resource="r"),
    AcquireTimeout("busy", resource="r", timeout=1.5),
    BackendError("down", code="CONNECTION", retryable=True),
    RetryableError("40001", code="SERIALIZATION"),
    TransactionRefusedError("refused", first=StaleTokenError("s", 3, 4, Reason.STALE)),
]


def _state(err: BaseException) -> dict[str, Any]:
    state = dict(err.__dict__)
    if "rejected" in state:
        state["rejected"] = [_state(e) for e in state["rejected"]]
    if state.get("first") is not None:
        state["first"] = _state(state["first"])
    return {"type": type(err), "args": err.args, **state}


@pytest.mark.parametrize("err", ERRORS, ids=lambda e: type(e).__name__)
def test_errors_pickle_with_their_data(err: FenceError) -> None:
    copy = pickle.loads(pickle.dumps(err))
    assert type(copy) is type(err)
    assert str(copy) == str(err)
    assert _state(copy) == _state(err)
    assert type(err).__module__ == "fence"
    assert isinstance(err, FenceError)


def test_error_hierarchy() -> None:
    assert issubclass(LeaseLostError, LeaseExpiredError)
    assert issubclass(RetryableError, BackendError)
    assert issubclass(AcquireTimeout, TimeoutError)
    assert RetryableError("x").retryable


@pytest.mark.parametrize(
    "bad", ["", "x" * 513, "é" * 257, None, 1, b"r", "a\x00b"], ids=lambda v: repr(v)[:20]
)
def test_bad_resource_names(bad: Any) -> None:
    with pytest.raises(InvalidResourceError):
        validate_resource(bad)


def test_resource_names_up_to_512_bytes() -> None:
    assert validate_resource("x" * 512) == "x" * 512
    assert validate_resource("订单:42") == "订单:42"


def test_c10_client_deadline() -> None:
    # ttl 10 s, 1 % drift, 2 ms margin: the client stops 102 ms before the nominal end.
    assert client_deadline(100.0, 10.0, drift=0.01, margin=0.002) == pytest.approx(109.898)
    with pytest.raises(ConfigurationError):
        client_deadline(0.0, 0.001, drift=0.01, margin=0.002)
    with pytest.raises(ConfigurationError):
        client_deadline(0.0, 10, drift=1.0, margin=0.0)
    with pytest.raises(ConfigurationError):
        client_deadline(0.0, 10, drift=0.0, margin=-1.0)


def test_event_bus_isolates_failing_listeners(caplog: pytest.LogCaptureFixture) -> None:
    bus = EventBus()
    seen: list[str] = []

    def broken(event: fence.Event) -> None:
        raise RuntimeError("metrics backend down")

    bus.subscribe(broken)
    unsubscribe = bus.subscribe(lambda e: seen.append(e.scope))
    bus.emit(EventKind.ACQUIRED, "test", "r1", 5)
    assert seen == ["r1"]
    assert "metrics backend down" in caplog.text
    unsubscribe()
    bus.emit(EventKind.ACQUIRED, "test", "r2", 6)
    assert seen == ["r1"]


def test_event_bus_inactive_without_listeners() -> None:
    bus = EventBus()
    assert not bus.active
    with EventRecorder(bus) as recorder:
        assert bus.active
        bus.emit(EventKind.WRITE_REJECTED, "g", "k", 3, reason="STALE")
    assert not bus.active
    assert recorder.of(EventKind.WRITE_REJECTED)[0].detail == {"reason": "STALE"}


def test_log_events(caplog: pytest.LogCaptureFixture) -> None:
    bus = EventBus()
    stop = fence.log_events(bus)
    with caplog.at_level("DEBUG", logger="fence"):
        bus.emit(EventKind.LOST, "memory", "r", 9, cause="revoked")
    stop()
    assert "lost" in caplog.text
    assert "revoked" in caplog.text


_LOG_EVENTS = """
import logging, sys
import fence
if sys.argv[1] == "configured":
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
stop = fence.log_events()
manager = fence.MemoryLockManager(ttl=5)
with manager.lock("order:42"):
    fence.default_bus.emit(fence.EventKind.LOST, "memory", "order:42", 1, cause="revoked")
stop()
assert logging.getLogger("fence").handlers == [], "the handler it added is gone"
with manager.lock("order:43"):
    pass
"""


def test_log_events_writes_to_stderr_without_a_logging_configuration() -> None:
    def run(mode: str) -> str:
        done = subprocess.run(
            [sys.executable, "-c", _LOG_EVENTS, mode], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout == ""
        return done.stderr

    bare = run("bare")  # a script that never configured logging
    assert "DEBUG fence: memory acquired order:42 token=" in bare
    assert "DEBUG fence: memory released order:42" in bare
    assert "WARNING fence: memory lost order:42 token=1 {'cause': 'revoked'}" in bare
    assert "order:43" not in bare  # stopped
    # Under a configuration of the application's own, its levels decide: the loss only.
    configured = run("configured")
    assert configured.splitlines() == ["WARNING memory lost order:42 token=1 {'cause': 'revoked'}"]


def test_manual_clock() -> None:
    clock = ManualClock(start=10.0, wall=1000.0)
    ticks: list[float] = []
    unsubscribe = clock.subscribe(lambda: ticks.append(clock.monotonic()))
    clock.advance(2.5)
    assert clock.monotonic() == 12.5
    assert clock.time() == 1002.5
    unsubscribe()
    clock.advance(1)
    assert ticks == [12.5]
    with pytest.raises(ValueError, match="back"):
        clock.advance(-1)
    clock.set_wall(500.0)
    assert clock.time() == 500.0
    assert clock.monotonic() == 13.5


def test_memory_guard_is_the_reference_model() -> None:
    guard = MemoryGuard()
    guard.write("k", 5, "a")
    guard.write("k", 5, "b")  # equal token accepted (C4)
    with pytest.raises(StaleTokenError) as info:
        guard.write("k", 4, "c")
    assert info.value.reason is Reason.STALE
    assert info.value.fence == 5
    assert guard.read("k") == "b"
    with pytest.raises(StaleTokenError) as info:
        guard.update("missing", 9, lambda v: v)
    assert info.value.reason is Reason.MISSING
    guard.delete("k", 6)
    assert guard.read("k") is None
    assert guard.fence("k") == 6  # tombstone keeps the fence (C7)
    with pytest.raises(StaleTokenError):
        guard.write("k", 5, "resurrected")
    assert guard.claim("k", 8) == 8
    with pytest.raises(StaleTokenError):
        guard.read_for_update("k", 7)
