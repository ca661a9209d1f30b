"""The event hook: every manager and guard reports what it does here.

Attach metrics or logging with :meth:`EventBus.subscribe`. When nobody listens, reporting
costs one attribute check.
"""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Event", "EventBus", "EventKind", "default_bus", "log_events"]

_log = logging.getLogger("fence")


class EventKind(enum.StrEnum):
    """What happened.

    Attributes:
        ACQUIRED: a lease was granted (``token``, ``duration`` = time to acquire).
        WAITED: an acquire had to wait (``duration`` = time spent waiting).
        RENEWED: a lease was extended.
        RENEW_FAILED: one renewal attempt failed but the lease still has time.
        LOST: a lease was lost (``detail["cause"]``).
        RELEASED: a lease was released.
        REVOKED: a lease was revoked by an operator (``token`` = the raised fence).
        WRITE_ACCEPTED: a guard accepted a write.
        WRITE_REJECTED: a guard rejected a write (``detail["reason"]``).
        BACKEND_DOWN: a backend or node did not answer.
        NODE_DATA_LOST: a quorum node answered without its data (it restarted empty); it
            takes no part in grants until a grant repairs it (``detail["node"]``).
        REFUSED: a quorum manager refused a call it could not show safe, e.g. too few
            nodes with intact data (``detail["reason"]``, ``detail["ineligible"]``).
        QUORUM_INITIALIZED: a quorum manager found every node empty and set the quorum up
            (a new deployment, or every node lost its data before a grant repaired any of
            them: at once, or in turn).
        RETRYING: a retry policy runs a unit of work again after a retryable error
            (``duration`` = the delay before the next attempt, ``detail["attempt"]`` = the
            attempt that failed, from 1, ``detail["error"]`` = the error's class name).
    """

    ACQUIRED = "acquired"
    WAITED = "waited"
    RENEWED = "renewed"
    RENEW_FAILED = "renew_failed"
    LOST = "lost"
    RELEASED = "released"
    REVOKED = "revoked"
    WRITE_ACCEPTED = "write_accepted"
    WRITE_REJECTED = "write_rejected"
    BACKEND_DOWN = "backend_down"
    NODE_DATA_LOST = "node_data_lost"
    REFUSED = "refused"
    QUORUM_INITIALIZED = "quorum_initialized"
    RETRYING = "retrying"


@dataclass(frozen=True, slots=True)
class Event:
    """One report from a manager or guard.

    Attributes:
        kind: an :class:`EventKind`.
        source: who reported it, e.g. ``"memory"``, ``"redis"``, ``"sql-guard"``.
        scope: the resource (managers) or fence scope (guards).
        token: the token involved, if any.
        duration: seconds, for kinds that measure something.
        detail: anything else, as plain data.
    """

    kind: EventKind
    source: str
    scope: str
    token: int | None = None
    duration: float | None = None
    detail: dict[str, Any] = field(default_factory=dict)


Listener = Callable[[Event], None]


class EventBus:
    """Fan events out to listeners.

    A listener that raises is logged and skipped: a metrics bug must never break a lock.
    """

    def __init__(self) -> None:
        self._listeners: tuple[Listener, ...] = ()
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        """Whether anyone listens; reporters skip building events when not."""
        return bool(self._listeners)

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Add ``listener``; return a function that removes it."""
        with self._lock:
            self._listeners = (*self._listeners, listener)

        def unsubscribe() -> None:
            with self._lock:
                self._listeners = tuple(x for x in self._listeners if x is not listener)

        return unsubscribe

    def emit(
        self,
        kind: EventKind,
        source: str,
        scope: str,
        token: int | None = None,
        duration: float | None = None,
        **detail: Any,
    ) -> None:
        """Report an event to every listener."""
        listeners = self._listeners
        if not listeners:
            return
        event = Event(kind, source, scope, token, duration, detail)
        for listener in listeners:
            try:
                listener(event)
            except Exception:
                _log.exception("fence event listener %r failed on %s", listener, kind)


#: The bus every manager and guard reports to unless given another.
default_bus = EventBus()


def log_events(
    bus: EventBus | None = None, logger: logging.Logger | None = None
) -> Callable[[], None]:
    """Log every event on ``bus`` (default: :data:`default_bus`) at DEBUG, losses at WARNING.

    The lines go wherever the logging configuration sends ``logger`` (default: the
    ``fence`` logger), and each record carries its :class:`Event` as ``record.fence_event``
    for structured formatters. To see the DEBUG lines under a configuration of your own,
    let DEBUG through for that logger: ``logging.getLogger("fence").setLevel("DEBUG")``.

    With no configuration at all (no handler on the logger or above it: a script that
    never called :func:`logging.basicConfig`), Python would drop the DEBUG lines and print
    only the losses. Then the events are written to stderr instead: a handler is added to
    the logger, with DEBUG let through on it, until logging stops.

    Args:
        bus: the bus to listen to (default: :data:`default_bus`).
        logger: where to log (default: the ``fence`` logger).

    Returns:
        A function that stops the logging (and removes the stderr handler, if one was
        added).
    """
    target = logger or _log
    loud = {
        EventKind.LOST,
        EventKind.WRITE_REJECTED,
        EventKind.BACKEND_DOWN,
        EventKind.NODE_DATA_LOST,
        EventKind.REFUSED,
        EventKind.QUORUM_INITIALIZED,
    }

    def listener(event: Event) -> None:
        level = logging.WARNING if event.kind in loud else logging.DEBUG
        if target.isEnabledFor(level):
            target.log(
                level,
                "%s %s %s token=%s %s",
                event.source,
                event.kind,
                event.scope,
                event.token,
                event.detail or "",
                extra={"fence_event": event},
            )

    unsubscribe = (bus or default_bus).subscribe(listener)
    if target.hasHandlers():
        return unsubscribe
    handler = logging.StreamHandler()  # stderr
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    # The events, and the warnings Python would have printed anyway; not the DEBUG lines
    # of the library's other loggers, which the lowered level lets through too.
    handler.addFilter(lambda r: r.levelno >= logging.WARNING or hasattr(r, "fence_event"))
    level = target.level
    target.addHandler(handler)
    target.setLevel(logging.DEBUG)

    def stop() -> None:
        unsubscribe()
        target.removeHandler(handler)
        if target.level == logging.DEBUG:  # unless changed since
            target.setLevel(level)

    return stop
