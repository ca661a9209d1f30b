"""The ZooKeeper storage guard for asyncio: fenced writes to nodes, one multi-operation each.

``tools/async_to_sync.py`` generates ``adapters/_sync/zookeeper.py`` from this file. Import
the public names from :mod:`fence.adapters.zookeeper`. The layout, the hints and the
verdicts are in :mod:`fence.adapters._zookeeper_ops`; the session, its connection and the
requests are the lock manager's driver's (:class:`fence._async.zookeeper.AsyncZooKeeperDriver`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from kazoo.exceptions import (
    ConnectionLoss,
    KazooException,
    NodeExistsError,
    NoNodeError,
    NotEmptyError,
    OperationTimeoutError,
    SessionExpiredError,
)

from fence import (
    BackendError,
    ConfigurationError,
    EventBus,
    EventKind,
    StaleTokenError,
    default_bus,
    validate_token,
)
from fence._acompat import completed
from fence._async.zookeeper import AsyncZooKeeperDriver, AsyncZooKeeperLockManager

from .._zookeeper_ops import (
    Seen,
    ZkLayout,
    ZkOp,
    encode_fence,
    encode_value,
    first_failure,
    parse_fence,
    verdict,
)

__all__ = ["AsyncZooKeeperBatch", "AsyncZooKeeperGuard"]

_SOURCE = "zookeeper-guard"

#: How often a write is sent again after its hints proved out of date (another writer
#: moved a fence, a node appeared or went) before it gives up, retryable.
_ROUNDS = 5

_TRANSIENT = (ConnectionLoss, OperationTimeoutError, SessionExpiredError)

#: Data nodes (a method of the guard is named ``set``).
_Paths = set[str]

#: One request of a multi-operation: ``(kind, path, data, version)``.
_Step = tuple[str, str, bytes, int]


def _parent(path: str) -> str:
    return path.rsplit("/", 1)[0] or "/"


class AsyncZooKeeperGuard:
    """Fenced writes to ZooKeeper nodes: a write whose token is older than the fence
    changes nothing and raises :class:`fence.StaleTokenError` (C4, C5).

    The fence of node ``/a/b`` is its sibling ``/a/b.fence``. Each write is one
    multi-operation: the fence node written at the version the guard last saw (which
    proves it still holds the fence the token was compared with) and the data node
    written, atomically. A holder writing a node it wrote or read before pays one round
    trip, the same as a plain ``set_data``; the first write of a node this guard has not
    seen, and a write after another guard moved the fence, pay one more (a read of the
    fences). A delete keeps the fence node as a tombstone (C7); a batch is one
    multi-operation, all or nothing (C6).

    Every path under the lock manager's root, and every node whose name ends in
    ``.fence``, is refused as a data node before any I/O (C9). Writes that do not go
    through the guard are not fenced: ZooKeeper runs no code of ours. ``get_children``
    of a parent lists the fence nodes beside the data nodes.

    **Write-only fencing leaves a hole; claim or read-for-update closes it (C8).** Claim
    right after acquiring (:meth:`claim`), or read with :meth:`read_for_update`, and a
    paused holder's late write is refused.

    Args:
        client: an :class:`~fence.AsyncZooKeeperLockManager` (the guard then shares its
            session and its root), a ``zookeeper://h1:2181,h2:2181/root`` URL or a kazoo
            hosts string (the guard then has a session of its own, which :meth:`close`
            closes).
        root: the lock manager's root (default: the manager's, or the URL's path, else
            ``/fence``); data nodes under it are refused.
        request_timeout: how long one call may take, with a session of the guard's own.
        events: where to report accepted and rejected writes (default:
            :data:`fence.default_bus`).

    Raises:
        ConfigurationError: a bad URL or root, or a client of another kind (a lock manager
            of the other flavour, sync or asyncio).

    Example::

        manager = AsyncZooKeeperLockManager("zookeeper://10.0.0.1:2181,10.0.0.2:2181")
        guard = AsyncZooKeeperGuard(manager)
        async with manager.lock("order:42") as lease:
            await guard.claim("/orders/42", lease.token)
            await guard.set("/orders/42", b"paid", token=lease.token)
    """

    def __init__(
        self,
        client: AsyncZooKeeperLockManager
        | AsyncZooKeeperDriver
        | str
        | list[str]
        | tuple[str, ...],
        *,
        root: str | None = None,
        request_timeout: float = 5.0,
        events: EventBus | None = None,
    ) -> None:
        if isinstance(client, AsyncZooKeeperLockManager):
            client = client.driver
        if isinstance(client, AsyncZooKeeperDriver):
            self.driver = client
            self._owns_driver = False
        else:
            given: object = client  # the annotation does not stop a manager of the other kind
            if not isinstance(given, str | list | tuple):
                raise ConfigurationError(
                    f"{type(self).__name__} takes a {AsyncZooKeeperLockManager.__name__}, its"
                    f" driver, a zookeeper:// URL or a list of hosts, not {given!r}"
                )
            self.driver = AsyncZooKeeperDriver(client, root=root, request_timeout=request_timeout)
            self._owns_driver = True
        self.layout = ZkLayout(self.driver.root if root is None else root)
        self.events = events or default_bus
        self._seen = Seen()

    @property
    def root(self) -> str:
        """The lock manager's root: no data node lies under it."""
        return self.layout.root

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.driver.hosts} root={self.root!r}>"

    async def close(self) -> None:
        """Close the session if the guard opened it (from a URL or hosts)."""
        if self._owns_driver:
            self._owns_driver = False
            await self.driver.close()

    async def __aenter__(self) -> AsyncZooKeeperGuard:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _op(self, code: str, path: str, value: object = b"") -> ZkOp:
        path = self.layout.data_path(path)
        return ZkOp(code, path, encode_value(path, value) if code in ("set", "create") else b"")

    # -- fenced writes ------------------------------------------------------------------

    async def set(self, path: str, value: bytes | str, *, token: int) -> None:
        """Set the data of ``path`` if ``token`` passes the fence (C4); an update: the node
        must exist.

        Args:
            path: the data node.
            value: ``bytes``, or a ``str`` stored as UTF-8.
            token: the fencing token of the caller's lease.

        Raises:
            InvalidTokenError: a bad token, before any I/O.
            ReadLeaseError: a read lease's token (C13), before any I/O.
            InvalidResourceError: not a data path (under the root, a ``.fence`` name, not
                absolute), before any I/O.
            ConfigurationError: a value that is neither ``bytes`` nor ``str``, before any
                I/O.
            StaleTokenError: ``STALE`` (older than the fence), ``MISSING`` (no node),
                ``UNVERIFIABLE`` (the fence node was written by hand); nothing written.
            BackendError: ZooKeeper failed: retryable when no connection or answer came in
                time; ``RESPONSE`` when it refused the request (an ACL).
        """
        token = validate_token(token)
        await self._write(token, [self._op("set", path, value)])

    async def create(self, path: str, value: bytes | str = b"", *, token: int) -> None:
        """Create ``path`` with ``value``, or replace its data if it exists, if ``token``
        passes the fence (a fenced upsert, C5). Missing parents are created, empty and
        unfenced.

        It raises what :meth:`set` raises (never ``MISSING``).
        """
        token = validate_token(token)
        await self._write(token, [self._op("create", path, value)])

    async def delete(self, path: str, *, token: int) -> bool:
        """Delete ``path`` and keep its fence node as a tombstone (C7): a stale writer
        cannot bring the node back.

        Returns:
            Whether the node existed.

        Raises:
            BackendError: ``NOT_EMPTY``: the node has children; nothing written.

        Otherwise it raises what :meth:`set` raises (never ``MISSING``: deleting nothing
        still fences).
        """
        token = validate_token(token)
        results = await self._write(token, [self._op("delete", path)])
        return bool(results[0])

    async def claim(self, scope: str, token: int) -> int:
        """Raise the fence of the node ``scope`` to ``token`` without writing data (C8).

        Returns:
            The fence, now ``token``.

        Raises:
            StaleTokenError: the fence is already above ``token`` (``STALE``).

        Otherwise it raises what :meth:`set` raises.
        """
        token = validate_token(token)
        await self._write(token, [self._op("claim", scope)])
        return token

    async def read_for_update(self, path: str, *, token: int) -> bytes | None:
        """A registering read (C8): raise the fence to ``token``, then read the data, sent
        together (one round trip): ZooKeeper answers a session's requests in order, so the
        read sees the node after the fence was raised. A stale reader is refused.

        Returns:
            The data, or ``None`` if the node does not exist.

        It raises what :meth:`claim` raises.
        """
        token = validate_token(token)
        results = await self._write(token, [self._op("claim", path)], read=True)
        value: bytes | None = results[-1]
        return value

    async def fence(self, scope: str) -> int | None:
        """The fence of the node ``scope``, or ``None`` if nothing was ever fenced there.

        Raises:
            InvalidResourceError: as :meth:`set`.
            StaleTokenError: ``UNVERIFIABLE``: the fence node was written by hand.
            BackendError: ZooKeeper failed.
        """
        path = self.layout.data_path(scope)
        (read,) = await self._reads([ZkLayout.fence_path(path)], [], "fence")
        return parse_fence(path, read[0] if read else None)

    async def get(self, path: str) -> tuple[bytes | None, int | None]:
        """Read the data of ``path``, then its fence, sent together (one round trip).

        A plain read: it does not raise the fence. The fence is read after the data, so it
        is at least the fence the data was written under: :func:`fence.check_read` on it
        never passes a read that a newer writer changed.

        Returns:
            ``(data, fence)``: the data or ``None``, the fence or ``None``.
        """
        path = self.layout.data_path(path)
        data, fence = await self._reads([path, ZkLayout.fence_path(path)], [], "read")
        return (data[0] if data else None), parse_fence(path, fence[0] if fence else None)

    # -- batches -----------------------------------------------------------------------

    def batch(self, token: int) -> AsyncZooKeeperBatch:
        """Start an all-or-nothing batch of writes with one token: one multi-operation (C6).

        Every fence is checked in the same multi-operation as the writes; if any node is
        rejected, nothing is written and the error lists every rejected node.

        Raises:
            InvalidTokenError: a bad token (here, before any operation is added).
        """
        return AsyncZooKeeperBatch(self, validate_token(token))

    # -- internals ---------------------------------------------------------------------

    def _steps(
        self, token: int, ops: Sequence[ZkOp], absent: _Paths
    ) -> tuple[list[_Step], list[tuple[str, str]]]:
        """The requests of one multi-operation and, for each, ``(role, path)``: fences
        first (at the version last seen, or created), then the data."""
        steps: list[_Step] = []
        roles: list[tuple[str, str]] = []
        fence = encode_fence(token)
        for path in dict.fromkeys(op.fence for op in ops):
            seen = self._seen.fences.get(path)
            if seen is None:
                steps.append(("create", path, fence, -1))
            else:
                steps.append(("set", path, fence, seen[0]))
            roles.append(("fence", path))
        for op in ops:
            if op.code == "set":
                steps.append(("set", op.path, op.value, -1))
            elif op.code == "create":
                kind = "set" if self._seen.exists.get(op.path) else "create"
                steps.append((kind, op.path, op.value, -1))
            elif op.code == "delete" and op.path not in absent:
                steps.append(("delete", op.path, b"", -1))
            else:
                continue
            roles.append(("data", op.path))
        return steps, roles

    def _start(self, steps: list[_Step], read: str | None, reads: list[Any]) -> Callable[[], Any]:
        client = self.driver._client

        def start() -> Any:
            txn = client.transaction()
            for kind, path, data, version in steps:
                if kind == "create":
                    txn.create(path, data)
                elif kind == "set":
                    txn.set_data(path, data, version)
                else:
                    txn.delete(path)
            result = txn.commit_async()
            if read is not None:
                # Sent right behind the multi-operation on the same session: answered after it.
                reads[:] = [client.get_async(read)]
            return result

        return start

    async def _write(
        self, token: int, ops: Sequence[ZkOp], scope: str = "", *, read: bool = False
    ) -> list[Any]:
        """One multi-operation (more if the hints were out of date); the result of each
        operation (and the data read, with ``read``), or the rejection raised."""
        what = scope or ops[0].path
        end = self.driver._deadline()
        absent: _Paths = set()
        for _ in range(_ROUNDS):
            # A fence seen above the token only grows: no write can pass, read why.
            if not any(
                seen is not None and seen[1] > token
                for seen in (self._seen.fences.get(op.fence) for op in ops)
            ):
                steps, roles = self._steps(token, ops, absent)
                reads: list[Any] = []
                start = self._start(steps, ops[0].path if read else None, reads)
                try:
                    results = await self.driver._op(f"fenced write of {what!r}", start, end)
                except KazooException as exc:
                    raise BackendError(
                        f"ZooKeeper refused the write of {what!r}: {exc!r}", code="RESPONSE"
                    ) from exc
                failed = first_failure(results)
                if failed is None:
                    return await self._landed(token, ops, roles, steps, results, reads, end)
                index, error = failed
                (role, path), kind = roles[index], steps[index][0]
                if isinstance(error, NoNodeError) and kind == "create":
                    # A parent is missing: made only for a write that nothing refuses (an
                    # update there finds no node), so a rejected write creates nothing.
                    rejection = await self._diagnose(token, ops, what, absent, end)
                    if rejection is None:
                        await self.driver._make_path(_parent(path), end, "fenced write")
                        continue
                    self._rejected(token, rejection)
                if role == "data":
                    if isinstance(error, NotEmptyError):
                        raise BackendError(
                            f"{path!r} has children: ZooKeeper deletes no node with children;"
                            " nothing written",
                            code="NOT_EMPTY",
                        )
                    if not isinstance(error, NodeExistsError | NoNodeError):
                        raise BackendError(
                            f"ZooKeeper refused the write of {path!r}: {error!r}; nothing written",
                            code="RESPONSE",
                        )
                    self._seen.exists[path] = isinstance(error, NodeExistsError)
                    if any(op.path == path and op.code == "create" for op in ops):
                        continue  # an upsert that guessed wrong: the other request now
            rejection = await self._diagnose(token, ops, what, absent, end)
            if rejection is not None:
                self._rejected(token, rejection)
        raise BackendError(
            f"the fences of {what!r} kept changing between the write's attempts; nothing was"
            " written, retry",
            code="CONTENDED",
            retryable=True,
        )

    def _rejected(self, token: int, rejection: StaleTokenError) -> NoReturn:
        """Report ``rejection`` and raise it."""
        if self.events.active:
            for err in rejection.rejected or (rejection,):
                self.events.emit(
                    EventKind.WRITE_REJECTED, _SOURCE, err.scope, token, reason=err.reason
                )
        raise rejection

    async def _landed(
        self,
        token: int,
        ops: Sequence[ZkOp],
        roles: list[tuple[str, str]],
        steps: list[_Step],
        results: list[Any],
        reads: list[Any],
        end: float,
    ) -> list[Any]:
        """Remember what the multi-operation left, report it, and return the results."""
        deleted: set[str] = set()
        for (role, path), step, result in zip(roles, steps, results, strict=True):
            kind = step[0]
            if role == "fence":
                version = 0 if kind == "create" else int(result.version)
                self._seen.fence(path, version, token)
            elif kind == "delete":
                deleted.add(path)
                self._seen.exists[path] = False
            else:
                self._seen.exists[path] = True
        out: list[Any] = [op.path in deleted if op.code == "delete" else True for op in ops]
        if reads:
            try:
                data, _ = await completed(reads[0], end - time.monotonic())
            except NoNodeError:
                data = None
            except (TimeoutError, *_TRANSIENT) as exc:
                raise BackendError(
                    f"ZooKeeper raised the fence of {ops[0].path!r} but the read behind it"
                    f" failed ({type(exc).__name__}); read again",
                    code="CONNECTION",
                    retryable=True,
                ) from exc
            out.append(data)
        if self.events.active:
            for op in ops:
                self.events.emit(EventKind.WRITE_ACCEPTED, _SOURCE, op.path, token, op=op.code)
        return out

    async def _diagnose(
        self, token: int, ops: Sequence[ZkOp], scope: str, absent: _Paths, end: float
    ) -> StaleTokenError | None:
        """Read every fence and every data node the write needs, in one round trip; the
        rejection, or ``None`` once the hints are brought up to date."""
        fences = list(dict.fromkeys(op.fence for op in ops))
        nodes = list(dict.fromkeys(op.path for op in ops if op.code in ("set", "delete")))
        reads = await self._reads(fences, nodes, "fenced write", end)
        found: dict[str, tuple[bytes, int] | None] = {}
        for path, read in zip(fences, reads, strict=False):
            found[path] = read
            if read is None:
                self._seen.forget(path)
            else:
                try:
                    value = parse_fence(path, read[0])
                except StaleTokenError:
                    continue
                if value is not None:
                    self._seen.fence(path, read[1], value)
        exists = {path: reads[len(fences) + i] is not None for i, path in enumerate(nodes)}
        for path, there in exists.items():
            self._seen.exists[path] = there
            if not there:
                absent.add(path)
            else:
                absent.discard(path)
        return verdict(token, list(ops), found, exists, scope)

    async def _reads(
        self, gets: list[str], checks: list[str], what: str, end: float | None = None
    ) -> list[Any]:
        """Read the nodes ``gets`` (``(data, version)`` each) and whether the nodes
        ``checks`` exist (a stat or ``None``), sent together: one round trip. A node
        that does not exist reads as ``None``."""
        if end is None:
            end = self.driver._deadline()
        client = self.driver._client
        while True:
            await self.driver._connected(what, end)
            pending = [client.get_async(path) for path in gets]
            pending += [client.exists_async(path) for path in checks]
            out: list[Any] = []
            try:
                for result in pending:
                    try:
                        got = await completed(result, end - time.monotonic())
                    except NoNodeError:
                        got = None
                    if got is not None and len(out) < len(gets):
                        got = (got[0], int(got[1].version))
                    out.append(got)
                return out
            except TimeoutError as exc:
                raise BackendError(
                    f"ZooKeeper at {self.driver.hosts} did not answer the {what} in time",
                    code="CONNECTION",
                    retryable=True,
                ) from exc
            except _TRANSIENT as exc:
                if time.monotonic() >= end:
                    raise BackendError(
                        f"ZooKeeper at {self.driver.hosts} could not serve the {what} in time"
                        f" ({type(exc).__name__})",
                        code="UNAVAILABLE",
                        retryable=True,
                    ) from exc
            except KazooException as exc:
                raise BackendError(
                    f"ZooKeeper refused the {what}: {exc!r}", code="RESPONSE"
                ) from exc


class AsyncZooKeeperBatch:
    """An all-or-nothing group of fenced writes with one token: one multi-operation (C6).

    Build it with :meth:`AsyncZooKeeperGuard.batch`, add operations (each method returns
    the batch, so calls chain), then ``await batch.execute()``. Each data node is written
    at most once; a claim of a node the batch also writes adds nothing.
    """

    def __init__(self, guard: AsyncZooKeeperGuard, token: int) -> None:
        self.guard = guard
        self.token = token
        self.ops: list[ZkOp] = []
        self._written: set[str] = set()

    def __len__(self) -> int:
        return len(self.ops)

    def _add(self, op: ZkOp) -> AsyncZooKeeperBatch:
        if op.code != "claim":
            if op.path in self._written:
                raise ConfigurationError(
                    f"{op.path!r} is written twice in one batch: write it once"
                )
            self._written.add(op.path)
        self.ops.append(op)
        return self

    def set(self, path: str, value: bytes | str) -> AsyncZooKeeperBatch:
        """Add a fenced update; see :meth:`AsyncZooKeeperGuard.set`.

        Raises:
            ConfigurationError: ``path`` is already written by this batch, before any I/O.
        """
        return self._add(self.guard._op("set", path, value))

    def create(self, path: str, value: bytes | str = b"") -> AsyncZooKeeperBatch:
        """Add a fenced create-or-replace; see :meth:`AsyncZooKeeperGuard.create`.

        Raises:
            ConfigurationError: ``path`` is already written by this batch, before any I/O.
        """
        return self._add(self.guard._op("create", path, value))

    def delete(self, path: str) -> AsyncZooKeeperBatch:
        """Add a fenced delete that leaves a tombstone; see
        :meth:`AsyncZooKeeperGuard.delete`.

        Raises:
            ConfigurationError: ``path`` is already written by this batch, before any I/O.
        """
        return self._add(self.guard._op("delete", path))

    def claim(self, path: str) -> AsyncZooKeeperBatch:
        """Add a claim of the fence of ``path``; see :meth:`AsyncZooKeeperGuard.claim`."""
        return self._add(self.guard._op("claim", path))

    async def execute(self) -> list[Any]:
        """Check every fence and apply every write, in one multi-operation.

        Returns:
            The result of each operation, in order: ``True`` for set, create and claim,
            whether the node existed for delete.

        Raises:
            StaleTokenError: some nodes were rejected; ``rejected`` has one error per
                rejected node, and nothing was written.
            BackendError: ZooKeeper failed; ``CONTENDED`` (retryable) if the fences kept
                changing under the batch.
        """
        if not self.ops:
            return []
        scope = ", ".join(dict.fromkeys(op.path for op in self.ops))
        return await self.guard._write(self.token, self.ops, scope)
