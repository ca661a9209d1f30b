"""SQLite files opened by hand in the tests, closed when the block ends.

``with sqlite3.connect(path) as db:`` commits (or rolls back) at the end of the block but does
not close the connection; the garbage collector closes it later, in whatever test runs then,
and Python 3.13 reports that as an unclosed database (a ``ResourceWarning``, an error here).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any

__all__ = ["sqlite_file"]


@contextmanager
def sqlite_file(path: str | Path, **kwargs: Any) -> Iterator[sqlite3.Connection]:
    """A connection to ``path``: committed if the block succeeds, rolled back if it raises,
    closed either way."""
    with closing(sqlite3.connect(path, **kwargs)) as db, db:
        yield db
