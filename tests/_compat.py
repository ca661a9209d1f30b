"""Thread helpers with the names of ``tests/_acompat.py``, for the generated sync tests."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

sleep = time.sleep


def gather(*fns: Callable[[], Any]) -> list[Any]:
    """Run each function concurrently, in its own thread; return their results in order."""
    with ThreadPoolExecutor(max_workers=len(fns)) as pool:
        futures = [pool.submit(fn) for fn in fns]
        return [f.result() for f in futures]


def spawn(fn: Callable[[], Any]) -> Future[Any]:
    """Start ``fn`` in a thread of its own (a separate owner) and return its future."""
    future: Future[Any] = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=run, daemon=True).start()
    return future


def join(future: Future[Any]) -> Any:
    """Wait for a thread started by :func:`spawn`; return its result or raise its error."""
    return future.result(timeout=60)
