"""Who waits for which resource, in one process: the fan-out of one notification listener.

A lock manager keeps one notification listener (Redis pub/sub, PostgreSQL ``LISTEN``) and
any number of waiting tasks and threads. The listener posts what it hears to a
:class:`WakeBoard`; the board wakes the waiters. No I/O here.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from fence._signal import Wakeable

__all__ = ["Cookie", "WakeBoard"]

#: Past this many remembered resources a board forgets them all; a waiter whose cookie
#: predates that then wakes once for nothing, which costs one acquire attempt.
_BOARD_LIMIT = 4096

#: What a driver takes before an acquire attempt and hands to the wait: the board's
#: generation and sequence number at that moment.
Cookie = tuple[int, int]


class WakeBoard:
    """The waiters of one process and the resources that changed since a given moment.

    A driver takes a :meth:`mark` before each acquire attempt and hands it to the wait as
    the cookie. :meth:`attach` refuses to wait when the resource changed after the mark,
    which closes the race between a refused attempt and the start of the wait::

        t=0  B: mark -> (0, 7); acquire refused
        t=1  A releases; the listener posts it: seq 8, resource changed at 8
        t=2  B: attach(cookie (0, 7)) -> changed since 7: retry now instead of sleeping

    A notification wakes every waiter of the resource (:meth:`bump`), the one that has
    waited longest (:meth:`wake_one`, so a release wakes one waiter, not all of them) or
    the waiter with a given key (:meth:`wake_key`, FIFO queues). A new generation (the
    listener's connection was replaced and may have missed notifications) counts as a
    change of every resource. Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._generation = 0
        self._seq = 0
        self._floor = 0
        self._changed: dict[str, int] = {}
        self._waiters: dict[str, OrderedDict[Wakeable, object]] = {}
        self._keyed: dict[tuple[str, object], Wakeable] = {}
        self._placed: dict[str, int] = {}

    def mark(self) -> Cookie:
        """The current moment, to pass to :meth:`attach` later."""
        with self._lock:
            return (self._generation, self._seq)

    def _record(self, resource: str) -> None:
        if len(self._changed) >= _BOARD_LIMIT:
            self._changed.clear()
            self._floor = self._seq
        self._seq += 1
        self._changed[resource] = self._seq

    def bump(self, resource: str) -> None:
        """Record a change of ``resource`` and wake all its waiters."""
        with self._lock:
            self._record(resource)
            waiters = self._waiters.pop(resource, None)
            if waiters:
                for key in waiters.values():
                    if key is not None:
                        self._keyed.pop((resource, key), None)
        for waiter in waiters or ():
            waiter.wake()

    def changed(self, resource: str) -> None:
        """Record a change of ``resource`` without waking anyone attached (a waiter that
        attaches with an older mark retries at once)."""
        with self._lock:
            self._record(resource)

    def wake_one(self, resource: str, prefer: Wakeable | None = None) -> bool:
        """Record a change of ``resource`` and wake the waiter that attached first, or
        ``prefer`` if it waits for ``resource`` (the waiter that reads the notifications:
        it needs no hand-over to another thread or task).

        Returns whether a waiter was woken.
        """
        with self._lock:
            self._record(resource)
            waiters = self._waiters.get(resource)
            if not waiters:
                return False
            if prefer is not None and prefer in waiters:
                waiter, key = prefer, waiters.pop(prefer)
            else:
                waiter, key = waiters.popitem(last=False)
            if key is not None:
                self._keyed.pop((resource, key), None)
            if not waiters:
                del self._waiters[resource]
        waiter.wake()
        return True

    def place(self, resource: str, delta: int) -> None:
        """Count waiters of ``resource`` that hold a place in its queue (+1 when one starts
        waiting, -1 when it stops); see :meth:`wake`."""
        with self._lock:
            count = self._placed.get(resource, 0) + delta
            if count > 0:
                self._placed[resource] = count
            else:
                self._placed.pop(resource, None)

    def wake(self, resource: str, *, writers: bool = False) -> None:
        """A release (or a waiter leaving): wake the waiter that attached first, or, while
        waiters of ``resource`` hold places in its queue (a shared lock), all of them: the
        queue decides who goes, and a batch of readers goes together.

        With ``writers`` (the last reader left: no reader was waiting for that), wake only
        the waiters attached with a key ``("w", ...)``, or the first one if none is.
        """
        if not self._placed.get(resource):
            self.wake_one(resource)
        elif not writers:
            self.bump(resource)
        else:
            with self._lock:
                self._record(resource)
                waiters: OrderedDict[Wakeable, object] = (
                    self._waiters.get(resource) or OrderedDict()
                )
                chosen = [
                    (w, k) for w, k in waiters.items() if isinstance(k, tuple) and k[:1] == ("w",)
                ]
                for waiter, key in chosen:
                    del waiters[waiter]
                    self._keyed.pop((resource, key), None)
                if not waiters:
                    self._waiters.pop(resource, None)
            for waiter, _ in chosen:
                waiter.wake()

    def wake_key(self, resource: str, key: object) -> bool:
        """Record a change of ``resource`` and wake the waiter attached with ``key``.

        Returns whether one was attached.
        """
        with self._lock:
            self._record(resource)
            waiter = self._keyed.pop((resource, key), None)
            if waiter is None:
                return False
            waiters = self._waiters.get(resource)
            if waiters is not None:
                waiters.pop(waiter, None)
                if not waiters:
                    del self._waiters[resource]
        waiter.wake()
        return True

    def new_generation(self) -> None:
        """Count every resource as changed and wake every waiter."""
        with self._lock:
            self._generation += 1
            self._changed.clear()
            self._floor = self._seq
            waiters = [w for ws in self._waiters.values() for w in ws]
            self._waiters.clear()
            self._keyed.clear()
        for waiter in waiters:
            waiter.wake()

    def attach(self, resource: str, waiter: Wakeable, cookie: object, key: object = None) -> bool:
        """Wake ``waiter`` on the next change of ``resource`` (or, with ``key``, on the
        next :meth:`wake_key` for that key).

        Returns ``True`` and attaches nothing if ``resource`` changed since ``cookie`` (or
        the cookie is not one of this board's marks).
        """
        with self._lock:
            if not (isinstance(cookie, tuple) and len(cookie) == 2):
                return True
            generation, seq = cookie
            if generation != self._generation:
                return True
            if self._changed.get(resource, self._floor) > seq:
                return True
            self._waiters.setdefault(resource, OrderedDict())[waiter] = key
            if key is not None:
                self._keyed[(resource, key)] = waiter
            return False

    def detach(self, resource: str, waiter: Wakeable) -> None:
        """Stop waking ``waiter`` for ``resource`` (nothing happens if it was woken)."""
        with self._lock:
            waiters = self._waiters.get(resource)
            if waiters is None:
                return
            key = waiters.pop(waiter, None)
            if key is not None:
                self._keyed.pop((resource, key), None)
            if not waiters:
                del self._waiters[resource]

    def waiting(self, resource: str) -> int:
        """How many waiters are attached for ``resource``."""
        waiters = self._waiters.get(resource)
        return len(waiters) if waiters else 0
