"""The retry policy's decisions: which errors it retries, its backoff, and its typing.

The loops themselves, over real managers, guards and units of work, are in
``tests/_async/test_retry.py`` and its sync twin.
"""

from __future__ import annotations

import asyncio
import pickle
import random
import subprocess
import sys
from pathlib import Path

import pytest

import fence
from fence import (
    AcquireTimeout,
    AsyncRetryPolicy,
    BackendError,
    ConfigurationError,
    FenceError,
    InvalidResourceError,
    InvalidTokenError,
    LeaseExpiredError,
    LeaseLostError,
    NotOwnerError,
    Reason,
    RetryableError,
    RetryPolicy,
    StaleTokenError,
    TokenRequiredError,
    UnfencedWriteError,
    exponential_backoff,
    is_retryable,
)
from fence.adapters.orm import StaleTokenError as OrmStaleTokenError

ROOT = Path(__file__).resolve().parent.parent


def _stale(reason: Reason = Reason.STALE) -> StaleTokenError:
    return StaleTokenError("order:42", 33, 34, reason)


RETRYABLE: list[BaseException] = [
    _stale(),
    StaleTokenError("a", 5, 7, rejected=(_stale(), StaleTokenError("b", 5, 7))),
    LeaseExpiredError("ran out", resource="r", token=3, remaining=0.0),
    LeaseLostError("lost", resource="r", token=3, cause="renewal failed"),
    RetryableError("serialization failure", code="40001"),
    BackendError("connection dropped before the write", code="CONNECTION", retryable=True),
]

NOT_RETRYABLE: list[BaseException] = [
    _stale(Reason.MISSING),
    _stale(Reason.UNVERIFIABLE),
    StaleTokenError("a", 5, 7, rejected=(_stale(), _stale(Reason.MISSING))),
    TokenRequiredError("no token", scope="accounts"),
    UnfencedWriteError("raw SQL", scope="accounts"),
    InvalidTokenError("bad", value=0),
    InvalidResourceError("bad", value=""),
    ConfigurationError("bad setting"),
    NotOwnerError("not held", resource="r"),
    AcquireTimeout("busy", resource="r", timeout=1.0),
    BackendError("bad reply", code="BACKEND"),
    FenceError("any other"),
    ValueError("not ours"),
    asyncio.CancelledError(),
    KeyboardInterrupt(),
]


@pytest.mark.parametrize("error", RETRYABLE, ids=repr)
def test_retryable_errors(error: BaseException) -> None:
    assert is_retryable(error)
    assert is_retryable(pickle.loads(pickle.dumps(error)))  # it crossed a process pool


@pytest.mark.parametrize("error", NOT_RETRYABLE, ids=repr)
def test_errors_that_are_not_retried(error: BaseException) -> None:
    assert not is_retryable(error)


def test_the_orm_hooks_stale_error_is_retryable() -> None:
    error = OrmStaleTokenError("accounts(7)", 3, 4, Reason.STALE)
    assert is_retryable(error)


@pytest.mark.parametrize(
    "error",
    [ConfigurationError("x"), InvalidTokenError("x"), TokenRequiredError("x"), KeyboardInterrupt()],
    ids=repr,
)
def test_no_predicate_can_retry_errors_that_repeat(error: BaseException) -> None:
    schedule = RetryPolicy(attempts=5, on=lambda _: True).schedule()
    schedule.next()
    assert schedule.failed(error) is None


def test_a_predicate_can_widen_what_is_retried() -> None:
    policy = RetryPolicy(3, on=lambda e: is_retryable(e) or isinstance(e, AcquireTimeout))
    schedule = policy.schedule()
    schedule.next()
    assert schedule.failed(AcquireTimeout("busy")) is not None
    assert schedule.failed(NotOwnerError("x")) is None


def test_attempts_limit_the_schedule() -> None:
    schedule = RetryPolicy(attempts=3, backoff=lambda n: 0.0).schedule()
    delays = []
    for _ in range(4):
        schedule.next()
        delays.append(schedule.failed(_stale()))
    assert delays == [0.0, 0.0, None, None]


def test_exponential_backoff_doubles_up_to_the_cap_with_jitter() -> None:
    backoff = exponential_backoff(0.1, 1.0, rng=random.Random(7))
    for n, ceiling in enumerate([0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]):
        for _ in range(20):
            assert ceiling / 2 <= backoff(n) <= ceiling


@pytest.mark.parametrize(
    "kwargs",
    [{"attempts": 0}, {"attempts": True}, {"attempts": 2.0}, {"timeout": 0}, {"timeout": -1}],
    ids=repr,
)
def test_bad_settings_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigurationError):
        RetryPolicy(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        AsyncRetryPolicy(**kwargs)  # type: ignore[arg-type]


def test_bad_backoff_bounds_are_refused() -> None:
    with pytest.raises(ConfigurationError):
        exponential_backoff(2.0, 1.0)
    with pytest.raises(ConfigurationError):
        exponential_backoff(-1.0, 1.0)


def test_a_policy_refuses_the_other_kind_of_function() -> None:
    async def coroutine_function() -> None:
        pass

    def plain_function() -> None:
        pass

    with pytest.raises(ConfigurationError, match="AsyncRetryPolicy"):
        RetryPolicy()(coroutine_function)
    with pytest.raises(ConfigurationError, match="RetryPolicy"):
        AsyncRetryPolicy()(plain_function)  # type: ignore[arg-type]


TYPED = """
from collections.abc import Callable, Coroutine
from typing import Any, assert_type

from fence import AsyncRetryPolicy, RetryPolicy


@RetryPolicy(attempts=3)
def deposit(account_id: int, amount: int, *, note: str = "") -> str:
    return note


@AsyncRetryPolicy(attempts=3)
async def adeposit(account_id: int, amount: int) -> int:
    return amount


async def main() -> None:
    assert_type(deposit(7, 100, note="x"), str)
    assert_type(adeposit, Callable[[int, int], Coroutine[Any, Any, int]])  # E: names kept
    assert_type(await adeposit(7, 100), int)
    deposit("7", 100)  # E: the decorated function keeps its parameters
    await adeposit(7, amount="100")  # E: and so does the async one
"""


def test_decorated_functions_keep_their_signature_for_type_checkers(tmp_path: Path) -> None:
    source = tmp_path / "typed.py"
    source.write_text(TYPED)
    completed = subprocess.run(
        [
            sys.executable, "-m", "mypy", "--strict", "--no-incremental",
            "--python-version", "3.11", str(source),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )  # fmt: skip
    errors = [line for line in completed.stdout.splitlines() if ": error:" in line]
    expected = [str(n) for n, line in enumerate(TYPED.splitlines(), 1) if "# E:" in line]
    # An error on each wrong call, and nowhere else: the parameters survived the decorator.
    assert [line.split(":")[1] for line in errors] == expected, completed.stdout
    # assert_type is exact: the parameters keep their names, more than Callable[[int, int]]
    assert 'is of type "def adeposit(account_id: int, amount: int)' in errors[0]
    assert 'Argument 1 to "deposit" has incompatible type "str"' in errors[1]
    assert 'Argument "amount" to "adeposit" has incompatible type "str"' in errors[2]


def test_the_public_names() -> None:
    assert fence.RetryPolicy.__module__ == "fence"
    assert fence.AsyncRetryPolicy.__module__ == "fence"
    assert RetryPolicy().attempts == 5
