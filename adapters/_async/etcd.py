"""The etcd storage guard for asyncio: fenced writes to etcd keys, one transaction each.

``tools/async_to_sync.py`` generates ``adapters/_sync/etcd.py`` from this file. Import the
public names from :mod:`fence.adapters.etcd`. The layout, the transactions and the verdicts
are in :mod:`fence.adapters._etcd_ops`; the HTTP calls, with their fail-over between the
members, are the lock manager's driver's (:class:`fence._async.etcd.AsyncEtcdDriver`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fence import (
    BackendError,
    ConfigurationError,
    EventBus,
    EventKind,
    default_bus,
    validate_token,
)
from fence._async.etcd import AsyncEtcdDriver, AsyncEtcdLockManager
from fence._etcd import EtcdReplyError, b64, range_kvs

from .._etcd_ops import (
    CACHE_LIMIT,
    EtcdOp,
    Layout,
    encode_value,
    judge,
    parse_fence,
    results_of,
    txn,
)

__all__ = ["AsyncEtcdBatch", "AsyncEtcdGuard"]

_SOURCE = "etcd-guard"

#: How often a batch is sent again after it found a fence key in a state it did not
#: expect (another holder created it meanwhile) before it gives up, retryable.
_ROUNDS = 4


class AsyncEtcdGuard:
    """Fenced writes to etcd keys: a write whose token is older than the fence changes
    nothing and raises :class:`fence.StaleTokenError` (C4, C5).

    Each write is one etcd transaction, one round trip, the same as a plain put: it
    compares the fence key (``<prefix>guard/<key>``) with the token and, in the same
    transaction, writes the data and raises the fence. A delete keeps the fence as a
    tombstone (C7); a batch is one transaction, all or nothing (C6).

    Every key starting with ``prefix`` (the lock manager's keys and the fences) is refused
    as a data key before any I/O (C9). Writes that do not go through the guard (etcdctl,
    another client) are not fenced: etcd runs no code of ours.

    **Write-only fencing leaves a hole; claim or read-for-update closes it (C8).** A holder
    that reads, then writes, can lose an update to a paused holder whose late write lands
    between the read and the write. Claim right after acquiring (:meth:`claim`), or read
    with :meth:`read_for_update`, and that write is refused.

    Args:
        client: an :class:`~fence.AsyncEtcdLockManager` (the guard then shares its HTTP
            connections, its members and its prefix), an ``etcd://h1:2379,h2:2379/prefix/``
            URL or a list of endpoints (the guard then has a client of its own, which
            :meth:`close` closes).
        prefix: the prefix of the lock manager's keys (default: the manager's, or the URL's
            path, else ``fence/``); the fences live under it.
        request_timeout: how long one call may take across the members, with a client of
            the guard's own (default 5 s).
        events: where to report accepted and rejected writes (default:
            :data:`fence.default_bus`).

    Raises:
        ConfigurationError: no usable endpoint, a bad prefix, or a client of another kind
            (a lock manager of the other flavour, sync or asyncio).

    Example::

        manager = AsyncEtcdLockManager("etcd://10.0.0.1:2379,10.0.0.2:2379")
        guard = AsyncEtcdGuard(manager)
        async with manager.lock("order:42") as lease:
            await guard.claim("orders/42", lease.token)
            await guard.put("orders/42", b"paid", token=lease.token)
    """

    def __init__(
        self,
        client: AsyncEtcdLockManager | AsyncEtcdDriver | str | list[str] | tuple[str, ...],
        *,
        prefix: str | None = None,
        request_timeout: float = 5.0,
        events: EventBus | None = None,
    ) -> None:
        if isinstance(client, AsyncEtcdLockManager):
            client = client.driver
        if isinstance(client, AsyncEtcdDriver):
            self.driver = client
            self._owns_driver = False
        else:
            given: object = client  # the annotation does not stop a manager of the other kind
            if not isinstance(given, str | list | tuple):
                raise ConfigurationError(
                    f"{type(self).__name__} takes an {AsyncEtcdLockManager.__name__}, its"
                    f" driver, an etcd:// URL or a list of endpoints, not {given!r}"
                )
            self.driver = AsyncEtcdDriver(client, prefix=prefix, request_timeout=request_timeout)
            self._owns_driver = True
        self.layout = Layout(self.driver.prefix if prefix is None else prefix)
        self.events = events or default_bus
        # Fence keys this guard wrote: they exist (a fence key is never deleted), so a
        # write compares their values alone. A hint, never a verdict: a fence key deleted
        # by hand fails the comparison, and the write is sent again the other way.
        self._fenced: set[bytes] = set()

    @property
    def prefix(self) -> str:
        """The prefix of the lock manager's keys and of the fences."""
        return self.layout.prefix

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {','.join(self.driver.endpoints)} prefix={self.prefix!r}>"

    async def close(self) -> None:
        """Close the HTTP client if the guard made it (from a URL or endpoints)."""
        if self._owns_driver:
            self._owns_driver = False
            await self.driver.close()

    async def __aenter__(self) -> AsyncEtcdGuard:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def _op(self, code: str, key: str, value: bytes = b"", must_exist: bool = False) -> EtcdOp:
        return self.layout.op(code, key, value, must_exist)

    # -- fenced writes ------------------------------------------------------------------

    async def put(
        self, key: str, value: bytes | str, *, token: int, must_exist: bool = False
    ) -> None:
        """Put ``value`` at ``key`` if ``token`` passes the fence (C4), and raise the fence.

        Args:
            key: the data key.
            value: ``bytes``, or a ``str`` stored as UTF-8.
            token: the fencing token of the caller's lease.
            must_exist: update semantics: reject with ``MISSING`` if ``key`` is absent.

        Raises:
            InvalidTokenError: a bad token, before any I/O.
            ReadLeaseError: a read lease's token (C13), before any I/O.
            InvalidResourceError: an empty key, a NUL in it, or a key under the prefix,
                before any I/O.
            ConfigurationError: a value that is neither ``bytes`` nor ``str``, before any
                I/O.
            StaleTokenError: ``STALE`` (older than the fence), ``MISSING`` (with
                ``must_exist``), ``UNVERIFIABLE`` (the fence key was written by hand);
                nothing written.
            BackendError: etcd failed: retryable when no member answered in time
                (``UNAVAILABLE``) or the reply was lost (``CONNECTION``; a put is safe to
                send again); ``RESPONSE`` when etcd refused the request.
        """
        token = validate_token(token)
        await self._write(token, (self._op("put", key, encode_value(key, value), must_exist),))

    async def delete(self, key: str, *, token: int) -> bool:
        """Delete ``key`` and keep its fence as a tombstone (C7): a stale writer cannot
        bring the key back.

        Returns:
            Whether the key existed.

        It raises what :meth:`put` raises (never ``MISSING``: deleting nothing still fences).
        """
        token = validate_token(token)
        results = await self._write(token, (self._op("delete", key),))
        return bool(results[0])

    async def claim(self, scope: str, token: int) -> int:
        """Raise the fence of the key ``scope`` to ``token`` without writing data (C8).

        Returns:
            The fence, now ``token``.

        Raises:
            StaleTokenError: the fence is already above ``token`` (``STALE``).

        Otherwise it raises what :meth:`put` raises.
        """
        token = validate_token(token)
        await self._write(token, (self._op("claim", scope),))
        return token

    async def read_for_update(self, key: str, *, token: int) -> bytes | None:
        """A registering read: raise the fence to ``token`` and return the value, in one
        transaction (C8). A stale reader is refused.

        Returns:
            The value, or ``None`` if ``key`` does not exist.

        It raises what :meth:`claim` raises.
        """
        token = validate_token(token)
        results = await self._write(token, (self._op("read", key),))
        value: bytes | None = results[0]
        return value

    async def fence(self, scope: str) -> int | None:
        """The fence of the key ``scope``, or ``None`` if nothing was ever fenced there.

        Raises:
            InvalidResourceError: as :meth:`put`.
            StaleTokenError: ``UNVERIFIABLE``: the fence key was written by hand.
            BackendError: etcd failed.
        """
        fence_key = self.layout.fence_key(self.layout.data_key(scope))
        reply = await self._read({"key": b64(fence_key)}, scope)
        kvs, _ = range_kvs(reply)
        return parse_fence(scope, kvs[0].value if kvs else None)

    async def get(self, key: str) -> tuple[bytes | None, int | None]:
        """Read ``key`` together with its fence, in one atomic step (one transaction).

        A plain read: it does not raise the fence. Under a read lease, check it with
        :func:`fence.check_read`.

        Returns:
            ``(value, fence)``: the value or ``None``, the fence or ``None``.
        """
        wire = self.layout.data_key(key)
        body = {
            "success": [
                {"request_range": {"key": b64(wire)}},
                {"request_range": {"key": b64(self.layout.fence_key(wire))}},
            ]
        }
        reply = await self._txn(body, key)
        responses = reply.get("responses", ())
        values = [range_kvs(item.get("response_range", {}))[0] for item in responses]
        if len(values) != 2:
            raise BackendError(f"etcd answered the read of {key!r} with {reply!r}", code="RESPONSE")
        data, fence = values
        return (data[0].value if data else None), parse_fence(
            key, fence[0].value if fence else None
        )

    # -- batches -----------------------------------------------------------------------

    def batch(self, token: int) -> AsyncEtcdBatch:
        """Start an all-or-nothing batch of writes with one token: one transaction (C6).

        Every fence is compared before anything is written; if any key is rejected, nothing
        is written and the error lists every rejected key.

        Example::

            await guard.batch(lease.token).put("orders/42", b"paid").delete("carts/7").execute()

        Raises:
            InvalidTokenError: a bad token (here, before any operation is added).
        """
        return AsyncEtcdBatch(self, validate_token(token))

    # -- internals ---------------------------------------------------------------------

    async def _txn(self, body: dict[str, Any], what: str) -> dict[str, Any]:
        try:
            return await self.driver._call(
                "/v3/kv/txn", body, f"fenced write of {what!r}", safe=True
            )
        except EtcdReplyError as exc:
            raise BackendError(
                f"etcd refused the write of {what!r}: {exc}", code="RESPONSE"
            ) from exc

    async def _read(self, body: dict[str, Any], what: str) -> dict[str, Any]:
        try:
            return await self.driver._call("/v3/kv/range", body, f"read of {what!r}", safe=True)
        except EtcdReplyError as exc:
            raise BackendError(
                f"etcd refused the read of {what!r}: {exc}", code="RESPONSE"
            ) from exc

    async def _write(self, token: int, ops: Sequence[EtcdOp], scope: str = "") -> list[Any]:
        """One transaction (a batch: more, if a fence key was not in the state expected);
        the result of each operation, or the rejection raised.

        Every request is safe to send again after a lost reply: a repeat finds the fence at
        ``token`` and writes the same again.
        """
        what = scope or ops[0].key
        fences = {op.fence for op in ops}
        seen = self._fenced
        present: dict[bytes, bool] | None
        if fences <= seen:
            present = dict.fromkeys(fences, True)  # the flat form: half the request
        else:
            present = None if len(fences) == 1 else {key: key in seen for key in fences}
        for _ in range(_ROUNDS):
            reply = await self._txn(txn(token, ops, present), what)
            results = results_of(reply, ops)
            if results is not None:
                if len(seen) >= CACHE_LIMIT:
                    seen.clear()
                seen.update(fences)
                if self.events.active:
                    for op in ops:
                        self.events.emit(
                            EventKind.WRITE_ACCEPTED, _SOURCE, op.key, token, op=op.code
                        )
                return results
            verdict = judge(reply, token, ops, what)
            if verdict.error is not None:
                if self.events.active:
                    for err in verdict.error.rejected or (verdict.error,):
                        self.events.emit(
                            EventKind.WRITE_REJECTED, _SOURCE, err.scope, token, reason=err.reason
                        )
                raise verdict.error
            present = verdict.present
            seen.difference_update(key for key, there in present.items() if not there)
        raise BackendError(
            f"the fences of {what!r} kept changing between the batch's attempts; nothing was"
            " written, retry",
            code="CONTENDED",
            retryable=True,
        )


class AsyncEtcdBatch:
    """An all-or-nothing group of fenced writes with one token: one etcd transaction (C6).

    Build it with :meth:`AsyncEtcdGuard.batch`, add operations (each method returns the
    batch, so calls chain), then ``await batch.execute()``. Each data key appears at most
    once (etcd refuses a transaction that writes a key twice); a claim of a key the batch
    also writes adds nothing.
    """

    def __init__(self, guard: AsyncEtcdGuard, token: int) -> None:
        self.guard = guard
        self.token = token
        self.ops: list[EtcdOp] = []
        self._written: set[bytes] = set()

    def __len__(self) -> int:
        return len(self.ops)

    def _add(self, op: EtcdOp) -> AsyncEtcdBatch:
        if op.code != "claim":
            if op.wire in self._written:
                raise ConfigurationError(
                    f"{op.key!r} is written twice in one batch; etcd refuses a transaction"
                    " that writes a key twice: write it once"
                )
            self._written.add(op.wire)
        self.ops.append(op)
        return self

    def put(self, key: str, value: bytes | str, *, must_exist: bool = False) -> AsyncEtcdBatch:
        """Add a fenced put; see :meth:`AsyncEtcdGuard.put`.

        Raises:
            ConfigurationError: ``key`` is already written by this batch, before any I/O.
        """
        return self._add(self.guard._op("put", key, encode_value(key, value), must_exist))

    def delete(self, key: str) -> AsyncEtcdBatch:
        """Add a fenced delete that leaves a tombstone; see :meth:`AsyncEtcdGuard.delete`.

        Raises:
            ConfigurationError: ``key`` is already written by this batch, before any I/O.
        """
        return self._add(self.guard._op("delete", key))

    def claim(self, key: str) -> AsyncEtcdBatch:
        """Add a claim of the fence of ``key``; see :meth:`AsyncEtcdGuard.claim`."""
        return self._add(self.guard._op("claim", key))

    async def execute(self) -> list[Any]:
        """Compare every fence, then apply every write, in one transaction.

        Returns:
            The result of each operation, in order: ``True`` for put and claim, whether the
            key existed for delete.

        Raises:
            StaleTokenError: some keys were rejected; ``rejected`` has one error per
                rejected key, and nothing was written.
            BackendError: etcd failed; ``CONTENDED`` (retryable) if the fences kept
                changing under the batch.
        """
        if not self.ops:
            return []
        scope = ", ".join(dict.fromkeys(op.key for op in self.ops))
        return await self.guard._write(self.token, self.ops, scope)
