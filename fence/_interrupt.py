"""Ctrl-C and the worker processes of ``fence demo`` and ``fence chaos``.

Ctrl-C in a terminal sends SIGINT to the whole foreground process group: the workers too. A
worker that gets it dies with a ``KeyboardInterrupt`` traceback, or is left frozen by a
SIGSTOP nobody lifts. So the workers ignore SIGINT (they are started while it is ignored,
which a new process keeps), and the parent alone stops them.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator

__all__ = ["sigint_ignored"]


@contextlib.contextmanager
def sigint_ignored() -> Iterator[None]:
    """Ignore SIGINT for a while; processes started meanwhile keep ignoring it.

    The caller itself does not lose a Ctrl-C that arrives meanwhile: SIGINT is blocked in
    the calling thread as well as ignored, so the kernel keeps it pending, and it is raised
    (as ``KeyboardInterrupt``) once the previous handler is back. The parents of
    ``fence demo`` and ``fence chaos`` start their workers from the main thread; another
    thread that left SIGINT unblocked could still take one meanwhile, and drop it.
    """
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # a pending one lands here
