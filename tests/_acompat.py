"""asyncio helpers for the async test sources (``tests/_compat.py`` is the thread twin)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

sleep = asyncio.sleep


async def gather(*fns: Callable[[], Awaitable[Any]]) -> list[Any]:
    """Run each function concurrently, as its own task; return their results in order."""
    return list(await asyncio.gather(*(fn() for fn in fns)))


async def spawn(fn: Callable[[], Awaitable[Any]]) -> asyncio.Task[Any]:
    """Start ``fn`` as a task of its own (a separate owner) and return it."""
    task = asyncio.get_running_loop().create_task(fn())
    await asyncio.sleep(0)
    return task


async def join(task: asyncio.Task[Any]) -> Any:
    """Wait for a task started by :func:`spawn`; return its result or raise its error."""
    return await task
