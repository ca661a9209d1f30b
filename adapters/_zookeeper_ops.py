"""The ZooKeeper guard without I/O: its node layout, its multi-operations and its verdicts.

The fence of data node ``/a/b`` is the sibling node ``/a/b.fence`` (persistent, its data the
token in decimal). A fenced write is one multi-operation: a conditional write of the fence
node (``set_data`` at the version the guard last saw, or ``create`` if it saw none) and the
write of the data. ZooKeeper compares versions, never values, so the guard keeps the version
and the fence it last saw of each fence node, and compares the token with that fence before
it sends: the version check proves, in the same atomic step, that the fence is still the one
compared. A guard that saw nothing yet, or an older version, is told so by the failed
multi-operation, reads the fences (one round trip) and sends again. A holder that writes
a node more than once pays one round trip per write, the same as a plain ``set_data``.

A delete removes the data node and leaves the fence node: the tombstone (C7).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kazoo.exceptions import RolledBackError, RuntimeInconsistency

from fence import ConfigurationError, InvalidResourceError, Reason, StaleTokenError
from fence._core import MAX_TOKEN, batch_rejection

__all__ = [
    "FENCE_SUFFIX",
    "Seen",
    "ZkLayout",
    "ZkOp",
    "encode_fence",
    "encode_value",
    "first_failure",
    "parse_fence",
    "verdict",
]

#: The suffix of a fence node's name: the fence of ``/a/b`` is ``/a/b.fence``.
FENCE_SUFFIX = ".fence"

#: How many fence nodes a guard remembers before it forgets them all (a forgotten one
#: costs one more round trip, never a wrong verdict).
CACHE_LIMIT = 100_000


def encode_fence(token: int) -> bytes:
    """A token as a fence node's data: its decimal digits."""
    return b"%d" % token


def parse_fence(scope: str, raw: bytes | None) -> int | None:
    """The fence in a fence node's data, ``None`` if there is no node.

    Raises:
        StaleTokenError: ``UNVERIFIABLE``: the node holds something the guard never writes.
    """
    if raw is None:
        return None
    if raw.isdigit() and len(raw) <= 16:
        value = int(raw)
        if 1 <= value <= MAX_TOKEN:
            return value
    raise StaleTokenError(
        scope,
        0,
        None,
        Reason.UNVERIFIABLE,
        message=f"{scope}: the fence node holds {raw[:40]!r}, not a fence this guard wrote",
    )


def encode_value(path: str, value: object) -> bytes:
    """A value as ZooKeeper stores it: ``bytes`` as they are, ``str`` as UTF-8.

    Raises:
        ConfigurationError: any other type, before any I/O.
    """
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        try:
            return value.encode()
        except UnicodeEncodeError as exc:
            raise ConfigurationError(f"{path}: the value is not valid UTF-8 ({exc})") from exc
    raise ConfigurationError(
        f"{path}: a ZooKeeper value is bytes or str, got {type(value).__name__} {value!r}"
    )


class ZkLayout:
    """Which nodes are data and which are the guard's or the lock manager's.

    A data path is absolute, without a trailing ``/``, an empty, ``.`` or ``..`` component
    or NUL; it is neither under the lock manager's root nor under ``/zookeeper``, and its
    name does not end in :data:`FENCE_SUFFIX`. Any
    other path is refused before any I/O (C9, as C12 does on Redis).

    Args:
        root: the lock manager's root (``/fence`` by default).
    """

    __slots__ = ("root",)

    def __init__(self, root: str) -> None:
        self.root = root

    def data_path(self, path: object) -> str:
        """``path``, once checked.

        Raises:
            InvalidResourceError: not a data path (see the class), before any I/O.
        """
        if not isinstance(path, str) or not path.startswith("/") or path == "/":
            raise InvalidResourceError(
                f"a ZooKeeper data node is an absolute path like /app/x, got {path!r}", value=path
            )
        if path.endswith("/") or "//" in path or "\x00" in path:
            raise InvalidResourceError(f"not a plain ZooKeeper path: {path!r}", value=path)
        if {".", ".."} & set(path.split("/")):
            raise InvalidResourceError(
                f"ZooKeeper refuses . and .. in a path: {path!r}", value=path
            )
        if path == "/zookeeper" or path.startswith("/zookeeper/"):
            raise InvalidResourceError(
                f"{path!r} is under /zookeeper, ZooKeeper's own nodes", value=path
            )
        if path == self.root or path.startswith(self.root + "/"):
            raise InvalidResourceError(
                f"{path!r} is under the lock manager's root {self.root!r}; a data node there"
                " could break a lock queue",
                value=path,
            )
        if path.endswith(FENCE_SUFFIX):
            raise InvalidResourceError(
                f"{path!r} ends in {FENCE_SUFFIX!r}, the name of a fence node; a data node"
                " there could overwrite a fence",
                value=path,
            )
        try:
            path.encode()
        except UnicodeEncodeError as exc:
            raise InvalidResourceError(f"{path!r} is not valid UTF-8 ({exc})", value=path) from exc
        return path

    @staticmethod
    def fence_path(path: str) -> str:
        """The fence node of a checked data path."""
        return path + FENCE_SUFFIX


@dataclass(frozen=True, slots=True)
class ZkOp:
    """One fenced operation on one data node.

    Attributes:
        code: ``set`` (update), ``create`` (insert or replace), ``delete`` or ``claim``.
        path: the data node.
        value: the data to write (``set``, ``create``).
    """

    code: str
    path: str
    value: bytes = b""

    @property
    def fence(self) -> str:
        """The fence node."""
        return self.path + FENCE_SUFFIX


@dataclass
class Seen:
    """What a guard last saw of the nodes it writes; a hint, never trusted for a verdict.

    Attributes:
        fences: fence node -> ``(data version, fence)``.
        exists: data node -> whether it existed.
    """

    fences: dict[str, tuple[int, int]] = field(default_factory=dict)
    exists: dict[str, bool] = field(default_factory=dict)

    def fence(self, path: str, version: int, fence: int) -> None:
        """Remember a fence node's version and fence."""
        if len(self.fences) >= CACHE_LIMIT:
            self.fences.clear()
            self.exists.clear()
        self.fences[path] = (version, fence)

    def forget(self, path: str) -> None:
        """Forget what was seen of a fence node (the next write sends a ``create``)."""
        self.fences.pop(path, None)


def verdict(
    token: int,
    ops: list[ZkOp],
    fences: dict[str, tuple[bytes, int] | None],
    exists: dict[str, bool],
    scope: str,
) -> StaleTokenError | None:
    """The rejection of a write, from the fences and data nodes read after it failed;
    ``None`` if nothing rejects it (the guard's hint was out of date: send it again).

    Args:
        token: the token presented.
        ops: the operations.
        fences: fence node -> ``(data, version)``, ``None`` if there is none.
        exists: data node -> whether it exists.
        scope: what a batch error names as its scope.
    """
    errors: list[StaleTokenError] = []
    judged: set[str] = set()
    for op in ops:
        if op.fence in judged:
            continue
        read = fences.get(op.fence)
        try:
            fence = parse_fence(op.path, None if read is None else read[0])
        except StaleTokenError as err:
            unverifiable = Reason.UNVERIFIABLE
            errors.append(StaleTokenError(op.path, token, None, unverifiable, message=str(err)))
            judged.add(op.fence)
            continue
        if fence is not None and fence > token:
            errors.append(StaleTokenError(op.path, token, fence, Reason.STALE))
            judged.add(op.fence)
        elif op.code == "set" and not exists.get(op.path, True):
            errors.append(StaleTokenError(op.path, token, fence, Reason.MISSING))
            judged.add(op.fence)
    if not errors:
        return None
    if len(ops) == 1:
        return errors[0]
    return batch_rejection(scope, token, errors)


def first_failure(results: list[Any]) -> tuple[int, BaseException] | None:
    """The operation of a multi-operation that failed, and its error (the others are
    rolled back); ``None`` if every one succeeded."""
    for index, result in enumerate(results):
        if isinstance(result, BaseException) and not isinstance(
            result, RolledBackError | RuntimeInconsistency
        ):
            return index, result
    return None
