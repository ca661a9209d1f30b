"""A test kit for code that uses iofence: control time, stall the backend, record events.

Test your own code against a holder that pauses past its lease without sleeping and without
patching ``time``::

    from fence import MemoryLockManager
    from fence.testing import ManualClock, MemoryGuard

    clock = ManualClock()
    manager = MemoryLockManager(clock=clock)
    store = MemoryGuard()

    old = manager.acquire("order:42", ttl=10)
    clock.advance(11)                        # the holder "paused" past its lease
    new = manager.acquire("order:42", ttl=10)
    store.write("order:42", new.token, "B")  # accepted
    store.write("order:42", old.token, "A")  # raises StaleTokenError

The guard kit, the conformance suite for a guard of your own storage, is the pytest plugin
:mod:`fence.testing.guards` (``docs/guard-kit.md``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from fence._clock import ManualClock
from fence._core import (
    accepts,
    batch_rejection,
    check_read,
    rejection,
    validate_resource,
    validate_token,
)
from fence._events import Event, EventBus, EventKind, default_bus
from fence._memory import MemoryBackend

__all__ = ["EventRecorder", "ManualClock", "MemoryBackend", "MemoryGuard", "PausableBackend"]

#: The in-memory backend doubles as the pausable backend: see :meth:`MemoryBackend.pause`,
#: :meth:`MemoryBackend.fail` and :meth:`MemoryBackend.forget_tokens`.
PausableBackend = MemoryBackend


class EventRecorder:
    """Collect the events of a bus, for assertions.

    Use as a context manager, or call :meth:`close` to stop recording::

        with EventRecorder() as events:
            manager.acquire("a").release()
        assert events.kinds() == ["acquired", "released"]
    """

    def __init__(self, bus: EventBus | None = None) -> None:
        self.events: list[Event] = []
        self._lock = threading.Lock()
        self._unsubscribe = (bus or default_bus).subscribe(self._record)

    def _record(self, event: Event) -> None:
        with self._lock:
            self.events.append(event)

    def kinds(self) -> list[str]:
        """The kinds recorded so far, in order."""
        with self._lock:
            return [str(e.kind) for e in self.events]

    def of(self, kind: EventKind | str) -> list[Event]:
        """The events of one kind."""
        with self._lock:
            return [e for e in self.events if e.kind == kind]

    def close(self) -> None:
        """Stop recording."""
        self._unsubscribe()

    def __enter__(self) -> EventRecorder:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@dataclass
class _Cell:
    fence: int
    value: Any
    exists: bool


class MemoryGuard:
    """A fenced key-value store in memory: the reference model of every guard (C4-C8).

    Each key is its own fence scope. A delete leaves a tombstone that keeps the fence (C7).

    Args:
        events: where to report accepted and rejected writes.
    """

    source = "memory-guard"

    def __init__(self, events: EventBus | None = None) -> None:
        self._cells: dict[str, _Cell] = {}
        self._lock = threading.Lock()
        self.events = events or default_bus

    @contextmanager
    def _checked(self, scope: str, token: int, *, must_exist: bool) -> Iterator[_Cell]:
        scope = validate_resource(scope, what="scope")
        token = validate_token(token)
        with self._lock:
            cell = self._cells.get(scope)
            fence = cell.fence if cell else None
            exists = bool(cell and cell.exists)
            if not accepts(token, fence) or (must_exist and not exists):
                err = rejection(scope, token, fence, exists=exists)
                self.events.emit(
                    EventKind.WRITE_REJECTED, self.source, scope, token, reason=err.reason
                )
                raise err
            if cell is None:
                cell = self._cells[scope] = _Cell(token, None, False)
            cell.fence = token
            yield cell
        self.events.emit(EventKind.WRITE_ACCEPTED, self.source, scope, token)

    def write(self, scope: str, token: int, value: Any) -> None:
        """Create or replace the value of ``scope`` (a fenced upsert)."""
        with self._checked(scope, token, must_exist=False) as cell:
            cell.value, cell.exists = value, True

    def update(self, scope: str, token: int, fn: Callable[[Any], Any]) -> Any:
        """Replace the value with ``fn(value)``; ``MISSING`` if there is none. Returns it."""
        with self._checked(scope, token, must_exist=True) as cell:
            cell.value = fn(cell.value)
            return cell.value

    def write_many(self, token: int, values: Mapping[str, Any]) -> None:
        """Create or replace several values with one token, all or nothing (C6).

        Every fence is checked before the first write; if any is above ``token``, nothing
        is written and the error lists every rejected scope in ``rejected``.

        Raises:
            StaleTokenError: one or more scopes hold a newer fence.
        """
        token = validate_token(token)
        scopes = [validate_resource(scope, what="scope") for scope in values]
        with self._lock:
            errors = []
            for scope in scopes:
                cell = self._cells.get(scope)
                fence = cell.fence if cell else None
                if not accepts(token, fence):
                    errors.append(rejection(scope, token, fence))
            if errors:
                for err in errors:
                    self.events.emit(
                        EventKind.WRITE_REJECTED, self.source, err.scope, token, reason=err.reason
                    )
                if len(scopes) == 1:
                    raise errors[0]
                raise batch_rejection(errors[0].scope, token, errors)
            for scope in scopes:
                cell = self._cells.get(scope)
                if cell is None:
                    cell = self._cells[scope] = _Cell(token, None, False)
                cell.fence, cell.value, cell.exists = token, values[scope], True
        for scope in scopes:
            self.events.emit(EventKind.WRITE_ACCEPTED, self.source, scope, token)

    def delete(self, scope: str, token: int) -> None:
        """Delete the value and keep the fence as a tombstone (C7)."""
        with self._checked(scope, token, must_exist=False) as cell:
            cell.value, cell.exists = None, False

    def claim(self, scope: str, token: int) -> int:
        """Raise the fence without writing data (C8); return the fence."""
        with self._checked(scope, token, must_exist=False) as cell:
            return cell.fence

    def read_for_update(self, scope: str, token: int) -> Any:
        """A registering read: raise the fence and return the value, or refuse a stale reader."""
        with self._checked(scope, token, must_exist=False) as cell:
            return cell.value

    def read_checked(self, scope: str, token: int) -> Any:
        """A checked read under a read lease (C13): the value, or
        :class:`fence.StaleTokenError` if a writer newer than ``token`` has written
        (:func:`fence.check_read`). It never raises the fence."""
        with self._lock:
            cell = self._cells.get(scope)
            check_read(scope, token, cell.fence if cell else None)
            return cell.value if cell and cell.exists else None

    def read(self, scope: str) -> Any:
        """The value of ``scope``, or ``None``."""
        cell = self._cells.get(scope)
        return cell.value if cell and cell.exists else None

    def fence(self, scope: str) -> int | None:
        """The fence of ``scope``, or ``None``."""
        cell = self._cells.get(scope)
        return cell.fence if cell else None
