"""Sync and async managers on one in-memory backend share one lock space."""

from __future__ import annotations

from fence import AsyncMemoryLockManager, MemoryBackend, MemoryLockManager


async def test_sync_and_async_managers_share_a_backend() -> None:
    backend = MemoryBackend()
    async_manager = AsyncMemoryLockManager(backend)
    sync_manager = MemoryLockManager(backend)
    lease = await async_manager.acquire("shared")
    assert sync_manager.try_acquire("shared") is None
    await lease.release()
    other = sync_manager.try_acquire("shared")
    assert other is not None
    assert other.token > lease.token
    other.release()
    sync_manager.close()
    await async_manager.close()
