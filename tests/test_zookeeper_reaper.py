"""The ZooKeeper driver's reaper thread outlives whatever a request fails with.

kazoo sets the error its connection thread died of (``RuntimeError('xids do not match')``
when a reply cannot be paired with its request) on every pending request, the reaper's
deletes included. The reaper must take it as a failed attempt and try again, not die: a
dead reaper deletes no node any more, and the nodes it kept for a timed-out acquire or a
failed release would block their resources until the session ends. The real fault is in
``tests/_async/test_zookeeper_links.py`` (a reply with another request's xid); this
drives the reaper alone, with a stand-in client whose first delete fails that way.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from fence._sync.zookeeper import _Reaper


class _Result:
    def __init__(self, error: BaseException | None) -> None:
        self._error = error

    def wait(self, timeout: float) -> bool:
        return True

    def get(self, block: bool = True) -> Any:
        if self._error is not None:
            raise self._error
        return True


class _Client:
    """Fails the first delete as kazoo does when its connection thread dies."""

    def __init__(self) -> None:
        self.deleted: list[str] = []
        self.failures = 0
        self.done = threading.Event()

    def delete_async(self, path: str, version: int = -1) -> _Result:
        if self.failures == 0:
            self.failures += 1
            return _Result(RuntimeError("xids do not match, expected %r received %r", 6, 1006))
        self.deleted.append(path)
        self.done.set()
        return _Result(None)


def test_the_reaper_survives_a_request_that_fails_with_kazoo_s_connection_error() -> None:
    client = _Client()
    reaper = _Reaper(client, request_timeout=1.0)
    reaper.start()
    try:
        reaper.hold("/locks/r/node-1", time.monotonic(), -1)
        assert client.done.wait(30), "the reaper never deleted the node"
        assert client.failures == 1
        assert client.deleted == ["/locks/r/node-1"]
        assert reaper._thread is not None
        assert reaper._thread.is_alive()
    finally:
        reaper.close()
