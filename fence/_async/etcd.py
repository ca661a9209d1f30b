"""The etcd lock manager for asyncio: tokens from create revisions, leases as etcd leases.

It speaks etcd's v3 API through the JSON gateway of the members' client port, over httpx:
``httpx.AsyncClient`` here, ``httpx.Client`` in the generated sync twin. The key layout and
the request bodies are in :mod:`fence._etcd`, the queue logic in :mod:`fence._queue`, the
deadlines, reentrancy, waiting loop and renewal watchdog in :mod:`fence._async.manager`.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

import httpx

from fence._acompat import sleep
from fence._async.manager import AsyncBaseLockManager
from fence._clock import Clock
from fence._consensus import lease_settings
from fence._core import LeaseMode, validate_ttl
from fence._errors import BackendError
from fence._etcd import (
    DEFAULT_PREFIX,
    HEADERS,
    EtcdReplyError,
    Queued,
    acquire_txn,
    b64,
    entry_key,
    is_writer_key,
    lease_id,
    lease_seconds,
    list_range,
    listed_resource,
    owner_range,
    parse_endpoints,
    predecessor_range,
    queue_prefix,
    range_end,
    range_kvs,
    reply_error,
    revision,
    token_of,
    validate_prefix,
    watch_body,
    writer_range,
)
from fence._events import EventBus
from fence._queue import Place, owner_after_predecessor_left
from fence.abc import AcquireReply, LockInfo, time_left

__all__ = ["AsyncEtcdDriver", "AsyncEtcdLockManager"]

#: Longest single watch. The manager re-attempts after it, so it bounds what a wake-up lost
#: to a member that went away silently can cost; a waiter also renews its own lease then.
_WAIT_CAP = 5.0

#: How often :meth:`AsyncEtcdDriver.revoke` re-reads the queue for contenders that joined
#: while it ran, before it gives up.
_REVOKE_ROUNDS = 5


class AsyncEtcdDriver:
    """Moves the bytes of :class:`AsyncEtcdLockManager`.

    Every contender on a resource puts one key, attached to a lease of its own, under the
    resource's range; the key created first holds the lock, and its create revision is the
    token. An acquire is a lease grant and one transaction (etcd cannot create a lease
    inside a transaction); renewal is one keepalive; release is one lease revoke, which
    deletes the key with the lease; a waiter watches only its predecessor's key.

    Args:
        endpoints: an ``etcd://h1:2379,h2:2379`` URL (``etcds://`` for TLS; a path sets the
            prefix) or a list of ``host:port`` / ``http://host:port`` endpoints.
        prefix: the key prefix (default: the URL's path, else ``fence/``).
        request_timeout: how long one call may take, in seconds, across every member it
            tries; then it raises a retryable :class:`BackendError`.

    Raises:
        ConfigurationError: no usable endpoint, or a bad argument.
    """

    source = "etcd"
    #: Grants read leases (C13).
    shared = True

    def __init__(
        self,
        endpoints: str | list[str] | tuple[str, ...],
        *,
        prefix: str | None = None,
        request_timeout: float = 5.0,
    ) -> None:
        found, url_prefix = parse_endpoints(endpoints)
        self.endpoints = found
        if prefix is None:
            prefix = url_prefix or DEFAULT_PREFIX
        self.prefix = validate_prefix(prefix)
        self.request_timeout = validate_ttl(request_timeout, what="request_timeout")
        self._current = 0
        # One pool for calls; watches stream on connections of their own, which are closed
        # when the wait ends (HTTP/1.1 cannot share a connection with a running stream).
        self._http = httpx.AsyncClient(
            headers=HEADERS, timeout=self.request_timeout, trust_env=False
        )
        self._watches = httpx.AsyncClient(
            headers=HEADERS,
            timeout=self.request_timeout,
            trust_env=False,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=0),
        )
        self._queued: dict[tuple[str, str], Queued] = {}
        # Leases that replaced the first one of a holder to carry a longer ttl (see renew).
        self._moved: dict[tuple[str, str], int] = {}

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {','.join(self.endpoints)} prefix={self.prefix!r}>"

    # -- one call, with fail-over -----------------------------------------------------------

    def _rotate(self) -> None:
        self._current = (self._current + 1) % len(self.endpoints)

    async def _call(
        self,
        path: str,
        body: dict[str, Any],
        what: str,
        *,
        safe: bool,
        uncertain: list[str] | None = None,
    ) -> dict[str, Any]:
        """POST ``body`` to ``path``; on a member that is down or has no leader, try the next.

        A request etcd may have applied is repeated only when ``safe`` (reads, keepalives,
        the idempotent acquire transaction); otherwise its unknown outcome is raised. When a
        repeated request's first try may have been applied, a note goes to ``uncertain``.

        Raises:
            EtcdReplyError: etcd answered with an error that is a verdict (lease not found).
            BackendError: no member served the request within ``request_timeout``, or the
                outcome of an unsafe request is unknown.
        """
        # Bounded by the caller's deadline too (an acquire with a timeout), not only by ours.
        end = time.monotonic() + time_left(self.request_timeout)
        # A member that stopped (SIGSTOP, a partition) accepts the connection and never
        # answers: each attempt gets a share of the time, so the others get a turn.
        share = max(self.request_timeout / len(self.endpoints), 0.2)
        failures: list[str] = []
        pause = 0.02
        tries = 0
        while True:
            left = end - time.monotonic()
            if left <= 0:
                raise self._unavailable(what, failures)
            endpoint = self.endpoints[self._current]
            try:
                response = await self._http.post(
                    endpoint + path, json=body, timeout=min(left, share)
                )
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
                failures.append(f"{endpoint}: {exc or type(exc).__name__}")  # never sent
            except httpx.TransportError as exc:
                self._rotate()
                if not safe:
                    raise self._unknown(what, endpoint, exc) from exc
                failures.append(f"{endpoint}: {exc or type(exc).__name__}")
                if uncertain is not None:
                    uncertain.append(failures[-1])
                continue
            else:
                data = self._decode(response, what)
                if response.status_code == 200:
                    return data
                error = reply_error(response.status_code, data)
                if not error.unavailable:
                    raise error
                failures.append(f"{endpoint}: {error.message}")
                if not (safe or error.not_applied):
                    self._rotate()
                    raise self._unknown(what, endpoint, error) from error
                if uncertain is not None and not error.not_applied:
                    uncertain.append(failures[-1])
            self._rotate()
            tries += 1
            if tries % len(self.endpoints) == 0:
                # Every member refused: an election is under way, or a majority is down.
                await sleep(max(0.0, min(pause, end - time.monotonic())))
                pause = min(pause * 2, 0.25)

    def _decode(self, response: httpx.Response, what: str) -> dict[str, Any]:
        try:
            data = response.json()
        except ValueError as exc:
            raise BackendError(
                f"etcd answered the {what} with something that is not JSON "
                f"(HTTP {response.status_code}): {response.text[:200]!r}",
                code="RESPONSE",
            ) from exc
        if not isinstance(data, dict):
            raise BackendError(f"etcd answered the {what} with {data!r}", code="RESPONSE")
        return data

    def _unavailable(self, what: str, failures: list[str]) -> BackendError:
        seen = "; ".join(dict.fromkeys(failures[-6:])) or "no answer"
        return BackendError(
            f"etcd did not serve the {what} within {self.request_timeout:g} s ({seen}). A "
            "majority of the members may be down or cut off; the lock state is unknown until "
            "they answer, and the call may be retried",
            code="UNAVAILABLE",
            retryable=True,
        )

    def _unknown(self, what: str, endpoint: str, exc: BaseException) -> BackendError:
        return BackendError(
            f"etcd at {endpoint} did not confirm the {what} ({exc or type(exc).__name__}); "
            "it may or may not have happened. A lease it left behind expires with its ttl",
            code="CONNECTION",
            retryable=True,
        )

    def _refused(self, what: str, error: EtcdReplyError) -> BackendError:
        return BackendError(f"etcd refused the {what}: {error}", code="RESPONSE")

    # -- leases ----------------------------------------------------------------------------

    async def _grant(self, lease: int, seconds: int, what: str) -> int:
        """Grant ``lease`` for ``seconds``; return the TTL etcd granted (it may raise it)."""
        try:
            reply = await self._call(
                "/v3/lease/grant", {"ID": lease, "TTL": seconds}, what, safe=True
            )
        except EtcdReplyError as exc:
            if exc.lease_exists:  # a repeated grant of our own lease id
                return seconds
            raise self._refused(what, exc) from exc
        return int(reply.get("TTL", seconds))

    async def _keepalive(self, lease: int, what: str) -> int:
        """Renew ``lease``; return its TTL in seconds, 0 if it is gone."""
        try:
            reply = await self._call("/v3/lease/keepalive", {"ID": lease}, what, safe=True)
        except EtcdReplyError as exc:
            if exc.lease_not_found:
                return 0
            raise self._refused(what, exc) from exc
        result = reply.get("result", reply)
        return max(int(result.get("TTL", 0)), 0)

    async def _revoke_lease(self, lease: int, what: str, *, safe: bool) -> dict[str, Any] | None:
        """Revoke ``lease`` (deleting its key); the reply, or ``None`` if it was gone."""
        try:
            return await self._call("/v3/lease/revoke", {"ID": lease}, what, safe=safe)
        except EtcdReplyError as exc:
            if exc.lease_not_found:
                return None
            raise self._refused(what, exc) from exc

    async def _exists(self, key: bytes, what: str) -> bool:
        _, count = range_kvs(await self._read({"key": b64(key), "count_only": True}, what))
        return count > 0

    async def _read(self, body: dict[str, Any], what: str) -> dict[str, Any]:
        try:
            return await self._call("/v3/kv/range", body, what, safe=True)
        except EtcdReplyError as exc:
            raise self._refused(what, exc) from exc

    # -- the driver protocol ---------------------------------------------------------------

    async def acquire(
        self,
        resource: str,
        secret: str,
        ttl: float,
        holder: str,
        mode: LeaseMode = LeaseMode.WRITE,
    ) -> AcquireReply:
        """One attempt, of a writer or (``mode`` READ) a reader; see
        :meth:`fence.abc.AsyncDriver.acquire`.

        The first attempt grants the contender's lease and joins the queue in one
        transaction, which also says whether the key came first (for a reader: whether no
        writer's key came before it). A later attempt (after a wait) renews the waiter's
        lease and, unless the wait proved it the owner, reads who comes first.
        """
        queued = self._queued.get((resource, secret))
        if queued is not None:
            return await self._again(secret, queued)
        reading = mode is LeaseMode.READ
        start = queue_prefix(self.prefix, resource)
        lease = lease_id(secret, resource)
        await self._grant(lease, lease_seconds(ttl), "acquire")
        key = entry_key(start, lease, reading=reading)
        txn = acquire_txn(start, key, lease, holder, reading=reading)
        try:
            reply = await self._call("/v3/kv/txn", txn, "acquire", safe=True)
        except EtcdReplyError as exc:
            raise self._refused("acquire", exc) from exc
        answers = [item.get("response_range", {}) for item in reply.get("responses", ())]
        place: Place[bytes] | None
        if reply.get("succeeded"):
            created = revision(reply)  # the put's revision: the key's create revision
            newest, count = range_kvs(answers[1])
            if reading:  # every writer's key is older than this one
                place = Place(count, newest[0].key if count and newest else None)
            else:
                place = Place(count - 1, newest[1].key if count > 1 and len(newest) > 1 else None)
        else:  # the key was there: this very request ran before, its reply was lost
            mine, _ = range_kvs(answers[0])
            first, _ = range_kvs(answers[1])
            if not mine:
                raise BackendError(f"etcd answered the acquire with {reply!r}", code="RESPONSE")
            created = mine[0].create_revision
            if reading:
                owner = not first or first[0].create_revision > created
            else:
                owner = bool(first) and first[0].key == key
            place = Place(0, None) if owner else None
        if place is not None and place.owner:
            return AcquireReply(token_of(created))
        queued = Queued(
            resource, key, lease, ttl, holder, created, place, revision(reply), reading=reading
        )
        self._queued[(resource, secret)] = queued
        return AcquireReply(None, cookie=queued, queued=True)

    async def _again(self, secret: str, queued: Queued) -> AcquireReply:
        resource = queued.resource
        # The waiter's lease is renewed first: the client's deadline starts before this call,
        # so the lease etcd keeps must be renewed after that (C10).
        if not await self._keepalive(queued.lease, "acquire"):
            # Its key went with its lease (it expired during a long wait, or was revoked).
            del self._queued[(resource, secret)]
            mode = LeaseMode.READ if queued.reading else LeaseMode.WRITE
            return await self.acquire(resource, secret, queued.ttl, queued.holder, mode)
        if not queued.owner:
            start = queue_prefix(self.prefix, resource)
            if queued.reading:
                ahead = writer_range(start, max_create=queued.created - 1)
                _, count = range_kvs(await self._read(ahead, "acquire"))
                queued.owner = count == 0
            else:
                first, _ = range_kvs(await self._read(owner_range(start), "acquire"))
                queued.owner = bool(first) and first[0].key == queued.key
        if queued.owner:
            del self._queued[(resource, secret)]
            return AcquireReply(token_of(queued.created))
        queued.place = None
        return AcquireReply(None, cookie=queued, queued=True)

    async def wait(self, resource: str, timeout: float, reply: AcquireReply) -> None:
        """Watch the predecessor's key until it is deleted, or ``timeout`` seconds pass
        (at most a few seconds, and a third of the waiter's own lease)."""
        queued = reply.cookie
        if not isinstance(queued, Queued):
            return
        start = queue_prefix(self.prefix, resource)
        if queued.place is None:
            if queued.reading:  # the last writer's key before this one
                body = writer_range(start, max_create=queued.created - 1)
            else:
                body = predecessor_range(start, queued.created)
            try:
                got = await self._read(body, "wait")
            except BackendError as exc:
                if not exc.retryable:
                    raise
                return  # the next attempt reports a real outage; this one only ends the wait
            before, count = range_kvs(got)
            queued.place = Place(count, before[0].key if before else None)
            queued.seen = revision(got)
        place = queued.place
        if place.owner or place.predecessor is None:
            queued.owner = True
            return
        seconds = min(timeout, _WAIT_CAP, lease_seconds(queued.ttl) / 3)
        if seconds <= 0.001:
            return
        outcome = await self._watch_delete(place.predecessor, queued.seen + 1, seconds)
        if outcome == "deleted":
            queued.owner = owner_after_predecessor_left(place)
            queued.place = None
        elif outcome == "reread":
            queued.place = None

    async def _watch_delete(self, key: bytes, start_revision: int, seconds: float) -> str:
        """Stream a watch of ``key`` from ``start_revision``: ``"deleted"`` once a delete
        arrives, ``"timeout"`` after ``seconds``, ``"reread"`` if the watch broke off."""
        endpoint = self.endpoints[self._current]
        timeout = httpx.Timeout(seconds, connect=min(seconds, self.request_timeout))
        body = watch_body(key, start_revision)
        try:
            async with self._watches.stream(
                "POST", endpoint + "/v3/watch", json=body, timeout=timeout
            ) as response:
                if response.status_code != 200:
                    self._rotate()
                    return "reread"
                async for line in response.aiter_lines():
                    if not line.strip():
                        continue
                    message = json.loads(line)
                    result = message.get("result") if isinstance(message, dict) else None
                    if not isinstance(result, dict) or result.get("canceled"):
                        # An error (the member lost its leader) or a compacted start
                        # revision: events may be missing, so read the queue again.
                        self._rotate()
                        return "reread"
                    for event in result.get("events", ()):
                        if event.get("type") == "DELETE":
                            return "deleted"
        except httpx.TimeoutException:
            return "timeout"
        except (httpx.TransportError, ValueError):
            self._rotate()
            # The next attempt reports a real outage; do not spin against a flapping member.
            await sleep(min(0.05, seconds))
            return "reread"
        return "reread"

    async def abandon(self, resource: str, secret: str) -> None:
        """A waiter gave up: revoke its lease, which takes its key out of the queue and
        wakes the waiter behind it."""
        self._queued.pop((resource, secret), None)
        await self._revoke_lease(lease_id(secret, resource), "abandon", safe=True)

    async def renew(self, resource: str, secret: str, ttl: float) -> bool:
        """One keepalive of the holder's lease; see :meth:`fence.abc.AsyncDriver.renew`.

        etcd cannot change a lease's TTL. A renewal that asks for more time than the lease
        carries moves the key to a new, longer lease (a grant and one transaction; the key
        and its create revision, the token, stay).
        """
        lease = self._moved.get((resource, secret)) or lease_id(secret, resource)
        granted = await self._keepalive(lease, "renewal")
        if granted <= 0:
            self._moved.pop((resource, secret), None)
            return False
        needed = lease_seconds(ttl)
        if needed <= granted:
            return True
        return await self._move(resource, secret, lease, needed)

    async def _move(self, resource: str, secret: str, old: int, seconds: int) -> bool:
        start = queue_prefix(self.prefix, resource)
        lease = lease_id(secret, resource)
        key = entry_key(start, lease)
        if not await self._exists(key, "renewal"):
            key = entry_key(start, lease, reading=True)
        new = lease_id(f"{secret}/{seconds}", resource)
        await self._grant(new, seconds, "renewal")
        txn = {
            "compare": [{"target": "LEASE", "key": b64(key), "result": "EQUAL", "lease": old}],
            "success": [{"request_put": {"key": b64(key), "ignore_value": True, "lease": new}}],
        }
        try:
            reply = await self._call("/v3/kv/txn", txn, "renewal", safe=True)
        except EtcdReplyError as exc:
            raise self._refused("renewal", exc) from exc
        if not reply.get("succeeded"):
            await self._revoke_lease(new, "renewal", safe=True)
            return False
        self._moved[(resource, secret)] = new
        try:
            await self._revoke_lease(old, "renewal", safe=True)
        except BackendError:
            pass  # it has no key any more; it expires with its ttl
        return True

    async def release(self, resource: str, secret: str) -> bool:
        """Revoke the holder's lease, which deletes its key and wakes the next waiter;
        see :meth:`fence.abc.AsyncDriver.release`.

        A revoke whose reply is lost (the member died, the leader changed) is sent again,
        so that the key does not block the queue until its lease expires. If the repeat
        finds the lease gone, the first one probably revoked it, but it may also have
        expired or been revoked just before: that is reported as a :class:`BackendError`
        (the lock is free now; whether it was held to the end is unknown).
        """
        self._queued.pop((resource, secret), None)
        lease = self._moved.pop((resource, secret), None) or lease_id(secret, resource)
        uncertain: list[str] = []
        try:
            await self._call(
                "/v3/lease/revoke", {"ID": lease}, "release", safe=True, uncertain=uncertain
            )
        except EtcdReplyError as exc:
            if not exc.lease_not_found:
                raise self._refused("release", exc) from exc
            if uncertain:
                raise BackendError(
                    f"etcd did not confirm the release ({uncertain[0]}) and the lease is gone "
                    "now: the lock is free, but whether it was still held when released is "
                    "unknown",
                    code="CONNECTION",
                ) from exc
            return False
        return True

    async def inspect(self, resource: str) -> LockInfo | None:
        """The first key of the queue (or, if it is a reader's, every reader's key before
        the first writer's) and its lease's TTL (whole seconds, rounded down by etcd); see
        :meth:`fence.abc.AsyncDriver.inspect`. One call per reader."""
        start = queue_prefix(self.prefix, resource)
        for _ in range(3):
            first, _ = range_kvs(await self._read(owner_range(start), "inspect"))
            if not first:
                return None
            owner = first[0]
            if is_writer_key(start, owner.key):
                info = await self._lease_info(resource, owner, LeaseMode.WRITE)
                if info is not None:
                    return info
                continue
            writers, _ = range_kvs(await self._read(writer_range(start, descend=False), "inspect"))
            body = owner_range(start) | {"limit": 0}
            if writers:
                body["max_create_revision"] = writers[0].create_revision - 1
            keys, _ = range_kvs(await self._read(body, "inspect"))
            readers = []
            for kv in keys:
                info = await self._lease_info(resource, kv, LeaseMode.READ)
                if info is not None:
                    readers.append(info)
            found = LockInfo.of_readers(resource, readers)
            if found is not None:
                return found
        return None

    async def list_page(
        self, prefix: str, cursor: bytes | None, count: int
    ) -> tuple[list[LockInfo], bytes | None]:
        """One range of queue keys (keys only, by key, at most ``count``), then each
        resource in it inspected, and its other keys counted as ``waiters``. The cursor is
        the key after the last resource listed, so a resource comes on one page only."""
        got = await self._read(list_range(self.prefix, prefix, cursor, count), "list")
        keys, _ = range_kvs(got)
        names = list(dict.fromkeys(n for kv in keys if (n := listed_resource(self.prefix, kv.key))))
        rows = []
        for name in names:
            info = await self.inspect(name)
            if info is None:
                continue
            start = queue_prefix(self.prefix, name)
            body = {"key": b64(start), "range_end": b64(range_end(start)), "count_only": True}
            _, queued = range_kvs(await self._read(body, "list"))
            holders = len(info.readers) or 1
            rows.append(dataclasses.replace(info, waiters=max(queued - holders, 0)))
        if not got.get("more") or not keys:
            return rows, None
        if not names:  # keys of no queue under the prefix: step over them
            return rows, keys[-1].key + b"\x00"
        return rows, range_end(queue_prefix(self.prefix, names[-1]))

    async def _lease_info(self, resource: str, kv: Any, mode: LeaseMode) -> LockInfo | None:
        try:
            got = await self._call("/v3/lease/timetolive", {"ID": kv.lease}, "inspect", safe=True)
        except EtcdReplyError as exc:
            raise self._refused("inspect", exc) from exc
        left = int(got.get("TTL", -1))
        if left < 0:
            return None
        label = kv.value.decode("utf-8", "replace") or None
        return LockInfo(resource, token_of(kv.create_revision), float(left), label, mode)

    async def revoke(self, resource: str) -> int:
        """Revoke the lease of the holder and of every waiter queued behind it; return the
        revision after the last revoke, which is above every token issued for ``resource``
        and below every token issued after; see :meth:`fence.abc.AsyncDriver.revoke`.

        The waiters lose their place: their keys were created before the returned token,
        so none of them may become the owner with it. They join the queue again. The
        leases go one by one: a waiter granted the lock while this runs (its predecessor's
        lease went first) has its lease revoked too, in a later round, because the revoke
        returns only once no key created before its token is left.
        """
        start = queue_prefix(self.prefix, resource)
        latest = 0
        for _ in range(_REVOKE_ROUNDS):
            body = owner_range(start) | {"limit": 0}
            if latest:
                body["max_create_revision"] = latest - 1
            got = await self._read(body, "revoke")
            keys, _ = range_kvs(got)
            if not keys:
                return token_of(max(latest, revision(got)))
            for kv in keys:
                reply = await self._revoke_lease(kv.lease, "revoke", safe=True)
                if reply is not None:
                    latest = max(latest, revision(reply))
        raise BackendError(
            f"{resource!r} kept gaining contenders during the revoke; try again",
            code="CONTENDED",
            retryable=True,
        )

    async def close(self) -> None:
        """Close the HTTP connections."""
        self._queued.clear()
        await self._http.aclose()
        await self._watches.aclose()


class AsyncEtcdLockManager(AsyncBaseLockManager):
    """A lock manager on etcd (v3 API): tokens are create revisions, leases are etcd leases.

    The token of a lease is the revision at which its key was created: it comes from the
    cluster's raft log, grows across leader changes and restarts, and needs no clock
    (C2, C3). The lease is an etcd lease renewed by keepalive; etcd deletes the key when
    it expires, by the leader's clock. Waiters queue in creation order and each watches
    only its predecessor's key, so a release wakes one waiter (FIFO, no herd). Shared locks
    (C13): a reader's key waits only for the last writer's key before it, so a writer's
    release wakes the readers behind it together.

    Args:
        endpoints: ``etcd://h1:2379,h2:2379,h3:2379`` (``etcds://`` for TLS; a path sets the
            key prefix) or a list of endpoints. The manager moves to the next member when
            one is down or has lost its leader.
        prefix: the key prefix (default ``fence/``). Leave the keys under it to the
            manager: a key deleted by hand breaks the queue until its lease expires.
        request_timeout: how long one call may take across the members, in seconds
            (default ``ttl / 3`` between 1 and 5 s); then a retryable
            :class:`BackendError` is raised, e.g. when a majority is down.
        ttl: default lease time in seconds. etcd counts whole seconds: the lease etcd keeps
            is ``ceil(ttl) + 1`` s (see :func:`fence._etcd.lease_seconds`).
        renew: default for the renewal watchdog (a keepalive at about ``ttl / 3``).
        drift: fraction of the ttl the client gives up for clock rate differences (C10).
        margin: seconds the client gives up for the request's own latency (C10).
        clock: the monotonic clock for client deadlines.
        events: where to report events.
        reentrant: whether a second acquire by the same owner returns the held lease.

    Raises:
        ConfigurationError: a bad argument.

    Example::

        manager = AsyncEtcdLockManager("etcd://10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379")
        async with manager.lock("order:42", ttl=10) as lease:
            await guard.claim("order:42", lease.token)
            ...
        await manager.close()
    """

    driver: AsyncEtcdDriver

    def __init__(
        self,
        endpoints: str | list[str] | tuple[str, ...],
        *,
        prefix: str | None = None,
        request_timeout: float | None = None,
        ttl: float = 30.0,
        renew: bool = False,
        drift: float = 0.01,
        margin: float = 0.002,
        clock: Clock | None = None,
        events: EventBus | None = None,
        reentrant: bool = True,
    ) -> None:
        ttl, request_timeout = lease_settings(ttl, drift, margin, request_timeout)
        driver = AsyncEtcdDriver(endpoints, prefix=prefix, request_timeout=request_timeout)
        super().__init__(
            driver,
            ttl=ttl,
            renew=renew,
            drift=drift,
            margin=margin,
            clock=clock,
            events=events,
            reentrant=reentrant,
        )
