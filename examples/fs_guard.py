"""Fence your own storage: a guard for files in a directory, on a POSIX file system.

Each file carries its fence in a one-line header, so the fence and the data change in one
atomic step: a write makes a new file next to the old one, syncs it, and renames it over
the old one (``rename`` replaces a name atomically on POSIX). Writers serialize on an
``fcntl`` lock of the directory, so no two of them check the same fence at once; readers
take no lock, since a rename never shows half a file. A delete leaves a tombstone: a
header without data, which keeps the fence (C7). A batch is checked whole before the
first rename and logged in a journal first, so a crash in the middle is finished at the
next open, never left half done (C6).

It relies on what a local POSIX file system promises. A network file system (NFS, SMB)
does not promise all of it: see docs/guard-kit.md.

Run it to see a paused holder refused; ``tests/test_fs_guard.py`` runs the guard kit on it.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from types import EllipsisType

from fence import (
    InvalidResourceError,
    ManualClock,
    MemoryLockManager,
    StaleTokenError,
    accepts,
    rejection,
    validate_token,
)

MAGIC = b"iofence-fs 1"
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,200}")  # no leading dot: ours are hidden
_JOURNAL = ".journal"


class FileGuard:
    """A directory of fenced files: each file name is its own fence scope.

    Args:
        root: the directory; created if missing. A batch a crash interrupted is finished
            here, before the first call.
    """

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        with self._locked():
            self._recover()

    # -- reading, without a lock ------------------------------------------------------------

    def _load(self, name: str) -> tuple[int | None, bytes | None]:
        """The fence and the data of ``name``; ``(None, None)`` if it never existed."""
        try:
            raw = (self.root / name).read_bytes()
        except FileNotFoundError:
            return None, None
        header, _, data = raw.partition(b"\n")
        magic, fence, state = header.rsplit(b" ", 2)
        if magic != MAGIC:
            raise ValueError(f"{name}: not a fenced file")
        return int(fence), (data if state == b"live" else None)

    def read(self, name: str) -> bytes | None:
        """The data of ``name``; ``None`` if absent or deleted."""
        return self._load(self._name(name))[1]

    def fence(self, name: str) -> int | None:
        """The fence of ``name``; ``None`` if it has none."""
        return self._load(self._name(name))[0]

    # -- guarded writes --------------------------------------------------------------------

    def write(self, name: str, data: bytes, *, token: int) -> None:
        """Create or replace the file (a fenced upsert).

        Raises:
            StaleTokenError: ``STALE``, the file's fence is above ``token``; nothing written.
        """
        self._guarded(name, token, data, must_exist=False)

    def update(self, name: str, data: bytes, *, token: int) -> None:
        """Replace the data of a file that exists.

        Raises:
            StaleTokenError: ``STALE``, or ``MISSING`` if there is no data; nothing written.
        """
        self._guarded(name, token, data, must_exist=True)

    def delete(self, name: str, *, token: int) -> None:
        """Delete the data and keep the fence as a tombstone (C7).

        Raises:
            StaleTokenError: ``STALE``; nothing changed.
        """
        self._guarded(name, token, None, must_exist=False)

    def claim(self, name: str, token: int) -> int:
        """Raise the fence without writing data (C8); return the fence.

        Raises:
            StaleTokenError: ``STALE``; nothing changed.
        """
        return self._guarded(name, token, ..., must_exist=False)[0]

    def read_for_update(self, name: str, *, token: int) -> bytes | None:
        """A registering read (C8): raise the fence to ``token`` and return the data.

        Raises:
            StaleTokenError: ``STALE``, a newer holder has been here; nothing changed.
        """
        return self._guarded(name, token, ..., must_exist=False)[1]

    def write_many(self, values: Mapping[str, bytes], *, token: int) -> None:
        """Create or replace several files with one token, all or nothing (C6).

        Raises:
            StaleTokenError: one or more files hold a newer fence; ``rejected`` lists each,
                and nothing is written.
        """
        token = validate_token(token)
        names = {self._name(name): data for name, data in values.items()}
        with self._locked():
            refused = []
            for name in names:
                fence, _ = self._load(name)
                if not accepts(token, fence):
                    refused.append(rejection(name, token, fence))
            if len(refused) == 1:
                raise refused[0]
            if refused:
                top = max(err.fence or 0 for err in refused)
                raise StaleTokenError(str(self.root), token, top, rejected=tuple(refused))
            temps = {name: self._stage(token, data) for name, data in names.items()}
            # The journal makes the renames one step: once it is on disk, the batch is
            # done, and a crash before the last rename is finished by _recover().
            self._atomic_write(_JOURNAL, json.dumps(temps).encode())
            self._recover()

    # -- the machinery ---------------------------------------------------------------------

    def _name(self, name: str) -> str:
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise InvalidResourceError(f"not a file name this guard takes: {name!r}")
        return name

    @contextmanager
    def _locked(self) -> Iterator[None]:
        # One lock for the directory: every writer checks and renames under it.
        with open(self.root / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _guarded(
        self, name: str, token: int, data: bytes | EllipsisType | None, *, must_exist: bool
    ) -> tuple[int, bytes | None]:
        """Check ``token`` against the fence of ``name`` and write, in one locked step.

        ``data`` is the new data, ``None`` for a tombstone, ``...`` to keep the data (a
        claim). Returns the new fence and the data as it was.
        """
        token = validate_token(token)  # before any I/O (C1, C9, C13)
        name = self._name(name)
        with self._locked():
            fence, old = self._load(name)
            if not accepts(token, fence) or (must_exist and old is None):
                raise rejection(name, token, fence, exists=old is not None)
            kept = old if data is ... else data
            if fence != token or data is not ...:
                os.replace(self.root / self._stage(token, kept), self.root / name)
                self._sync_dir()
            return token, old

    def _stage(self, fence: int, data: bytes | None) -> str:
        """A synced temporary file with the header and ``data``; returns its name."""
        state = b"live" if data is not None else b"tombstone"
        body = b"%s %d %s\n%s" % (MAGIC, fence, state, data or b"")
        fd, path = tempfile.mkstemp(dir=self.root, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        return os.path.basename(path)

    def _atomic_write(self, name: str, body: bytes) -> None:
        fd, path = tempfile.mkstemp(dir=self.root, prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(path, self.root / name)
        self._sync_dir()

    def _recover(self) -> None:
        """Finish the batch of the journal, if there is one (under the lock)."""
        journal = self.root / _JOURNAL
        try:
            temps: dict[str, str] = json.loads(journal.read_bytes())
        except FileNotFoundError:
            return
        for name, temp in temps.items():
            if (self.root / temp).exists():
                os.replace(self.root / temp, self.root / name)
        self._sync_dir()
        journal.unlink()
        self._sync_dir()

    def _sync_dir(self) -> None:
        # A rename is durable once the directory is synced.
        fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class FileHarness:
    """The guard behind the guard kit's harness interface (``fence.testing.guards``).

    Scope names are file names; values are ``int`` stored as decimal text.
    """

    features = frozenset({"batch", "registering_read"})

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.guard = FileGuard(root)

    def claim(self, scope: str, token: int) -> int:
        return self.guard.claim(scope, token)

    def fence(self, scope: str) -> int | None:
        return self.guard.fence(scope)

    def create(self, scope: str, token: int, value: int) -> None:
        self.guard.write(scope, b"%d" % value, token=token)

    def update(self, scope: str, token: int, value: int) -> None:
        self.guard.update(scope, b"%d" % value, token=token)

    def delete(self, scope: str, token: int) -> None:
        self.guard.delete(scope, token=token)

    def read(self, scope: str) -> int | None:
        data = self.guard.read(scope)
        return None if data is None else int(data)

    def read_for_update(self, scope: str, token: int) -> int | None:
        data = self.guard.read_for_update(scope, token=token)
        return None if data is None else int(data)

    def batch(self, token: int, values: Mapping[str, int]) -> None:
        self.guard.write_many({k: b"%d" % v for k, v in values.items()}, token=token)

    def close(self) -> None:
        pass


def main() -> None:
    """A holder pauses past its lease; its late write to the file is refused."""
    clock = ManualClock()
    manager = MemoryLockManager(clock=clock)
    with tempfile.TemporaryDirectory() as root:
        files = FileGuard(root)
        old = manager.acquire("report", ttl=10, owner="A")
        clock.advance(11)  # A "paused" past its lease
        new = manager.acquire("report", ttl=10, owner="B")
        files.claim("report.txt", new.token)  # B shuts A out before it reads
        files.write("report.txt", b"B's report", token=new.token)
        try:
            files.write("report.txt", b"A's late report", token=old.token)
        except StaleTokenError as err:
            print(f"A's write refused ({err.reason}): token {err.token} < fence {err.fence}")
        files.delete("report.txt", token=new.token)
        print(f"deleted; the tombstone keeps fence {files.fence('report.txt')}")
        new.release()
    manager.close()


if __name__ == "__main__":
    main()
