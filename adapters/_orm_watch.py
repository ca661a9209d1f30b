"""The lost-lease watch of the asyncio unit of work: cancel the task when its lease is lost.

Only the asyncio source uses it; a thread cannot be cancelled, so the sync unit of work
checks the lease before commit instead.
"""

from __future__ import annotations

import asyncio
import contextlib

from fence._async.manager import AsyncLease
from fence._errors import LeaseLostError

__all__ = ["LossWatch"]


class LossWatch:
    """Cancel the current task once ``lease`` is lost or reaches its deadline.

    A lease that is not renewed counts as lost at its client deadline (C10), so the work
    stops there; with renewal it stops when a renewal fails.

    Args:
        lease: the lease the work runs under.
    """

    def __init__(self, lease: AsyncLease) -> None:
        self.lease = lease
        self.fired = False
        self._task = asyncio.current_task()
        self._watcher: asyncio.Task[None] | None = asyncio.get_running_loop().create_task(
            self._run(), name=f"fence-uow-watch:{lease.resource}"
        )

    async def _run(self) -> None:
        if await self.lease.wait_lost() and self._task is not None:
            self.fired = True
            self._task.cancel()

    async def stop(self) -> None:
        """Disarm the watch (before commit: the fences judge the commit, not the clock)."""
        watcher, self._watcher = self._watcher, None
        if watcher is None:
            return
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher

    def error(self) -> LeaseLostError:
        """The error to raise in place of the cancellation it caused (and undo that)."""
        if self._task is not None:
            self._task.uncancel()
        try:
            self.lease.check()
        except LeaseLostError as exc:
            return exc
        except Exception:  # noqa: S110 - any other state: build the error below
            pass
        return LeaseLostError(
            f"lease on {self.lease.resource!r} (token {self.lease.token}) was lost; the "
            "unit of work was cancelled and rolled back",
            resource=self.lease.resource,
            token=self.lease.token,
            cause="lost during the unit of work",
        )
