"""The pause story on the in-memory manager, with a manual clock: runs anywhere, instantly.

python examples/memory_pause.py
"""

from __future__ import annotations

from fence import MemoryLockManager, StaleTokenError
from fence.testing import ManualClock, MemoryGuard


def main() -> int:
    """Play the story; return 0 if the stale write was refused."""
    clock = ManualClock()
    manager = MemoryLockManager(clock=clock)
    store = MemoryGuard()

    a = manager.acquire("order:42", ttl=10, owner="A")
    print(f"t=0   A acquires order:42 -> token {a.token}")
    clock.advance(11)
    print(f"t=11  A is paused; its lease ended (valid={a.valid})")
    b = manager.acquire("order:42", ttl=10, owner="B")
    store.write("order:42", b.token, "paid by B")
    fence_now = store.fence("order:42")
    print(f"t=11  B acquires -> token {b.token}; B writes -> accepted, fence={fence_now}")
    try:
        store.write("order:42", a.token, "paid by A")
    except StaleTokenError as err:
        print(
            f"t=15  A wakes and writes with {a.token} -> REJECTED ({err.reason}), nothing written"
        )
    else:
        print("t=15  A's stale write was accepted: this must never happen")
        return 1
    assert store.read("order:42") == "paid by B"
    b.release()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
