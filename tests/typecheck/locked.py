"""What type checkers see of ``manager.locked``: checked by ``tests/test_docs.py``.

Not run: ``mypy --strict`` reads it. Each ``type: ignore`` must be needed (strict warns on
an unused one), so a decorated function whose parameters become ``...``, or that asks
callers for a lease it takes first, fails here.
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any, assert_type

from fence import AsyncLease, AsyncMemoryLockManager, Lease, MemoryLockManager, RetryPolicy
from fence.abc import AsyncLockManager, LockManager


def sync_side(manager: MemoryLockManager, policy: RetryPolicy) -> None:
    @manager.locked("order:{order_id}", ttl=10, timeout=5)
    def pay(lease: Lease, order_id: int, amount: int = 1) -> str:
        return f"{order_id}:{amount}:{lease.token}"

    assert_type(pay(7, 100), str)
    assert_type(pay(order_id=7), str)
    pay("7")  # type: ignore[arg-type]
    pay(7, lease=None)  # type: ignore[call-arg]

    @manager.locked("order:{order_id}", retry=policy)  # no lease: the signature is kept
    def refund(order_id: int, *, reason: str = "") -> int:
        return order_id

    assert_type(refund(7, reason="late"), int)
    refund(7, "late")  # type: ignore[call-arg]
    refund()  # type: ignore[call-arg]

    # A keyword-only lease is passed in too, but PEP 612 cannot take a keyword parameter
    # out of a signature: type checkers still ask the caller for it.
    @manager.locked("order:{order_id}")
    def ship(order_id: int, *, lease: Lease) -> bytes:
        return b""

    ship(7)  # type: ignore[call-arg]


async def async_side(manager: AsyncMemoryLockManager) -> None:
    @manager.locked("order:{order_id}", mode="read")
    async def pay(lease: AsyncLease, order_id: int, amount: int = 1) -> str:
        return f"{order_id}:{amount}:{lease.token}"

    call: Coroutine[Any, Any, str] = pay(7)
    assert_type(await call, str)
    assert_type(await pay(7, 100), str)
    await pay("7")  # type: ignore[arg-type]
    await pay(7, lease=None)  # type: ignore[call-arg]

    @manager.locked("order:{order_id}")
    async def refund(order_id: int) -> int:
        return order_id

    assert_type(await refund(7), int)
    await refund()  # type: ignore[call-arg]


async def through_the_protocols(manager: LockManager, amanager: AsyncLockManager) -> None:
    @manager.locked("job:{job_id}")
    def run(lease: Lease, job_id: int) -> int:
        return lease.token

    @amanager.locked("job:{job_id}")
    async def arun(lease: AsyncLease, job_id: int) -> int:
        return lease.token

    assert_type(run(1), int)
    assert_type(await arun(1), int)
    run()  # type: ignore[call-arg]
