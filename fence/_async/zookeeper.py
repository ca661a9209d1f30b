"""The ZooKeeper lock manager for asyncio: ephemeral sequential nodes, tokens from zxids.

Built on kazoo, ZooKeeper's maintained Python client, which runs its connection on threads
of its own. The asyncio code never blocks on it: every request is one of kazoo's
``*_async`` calls, whose completion wakes the event loop through
``loop.call_soon_threadsafe`` (:func:`fence._acompat.completed`); no thread of a pool is
parked on a wait. The generated sync twin blocks on the same calls instead.

The node layout and the data are in :mod:`fence._zookeeper`, the queue logic in
:mod:`fence._queue`, the deadlines, reentrancy, waiting loop and renewal watchdog in
:mod:`fence._async.manager`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kazoo.client import KazooClient, KazooState
from kazoo.exceptions import (
    BadVersionError,
    ConnectionLoss,
    NodeExistsError,
    NoNodeError,
    OperationTimeoutError,
    SessionExpiredError,
)
from kazoo.retry import KazooRetry

from fence._acompat import Waiter, completed
from fence._async.manager import AsyncBaseLockManager
from fence._clock import Clock
from fence._consensus import lease_settings
from fence._core import LeaseMode, validate_ttl
from fence._errors import BackendError, ConfigurationError
from fence._events import EventBus
from fence._queue import owner_after_predecessor_left, place_in
from fence._zookeeper import (
    DEFAULT_ROOT,
    MARK,
    READ_MARK,
    Hold,
    Node,
    SessionTimeoutProbe,
    Watcher,
    Watches,
    decode_data,
    encode_data,
    is_writer_node,
    new_guid,
    own_node,
    parse_hosts,
    queue_order,
    resource_of_node,
    resource_path,
    token_of,
    validate_root,
)
from fence.abc import AcquireReply, LockInfo, time_left

__all__ = ["AsyncZooKeeperDriver", "AsyncZooKeeperLockManager"]

_log = logging.getLogger("fence.zookeeper")

#: Longest single wait. The manager re-attempts after it, so it bounds what a wake-up lost
#: with a dropped connection can cost.
_WAIT_CAP = 5.0

#: Errors after which the connection (or the session) is being re-established.
_TRANSIENT = (ConnectionLoss, OperationTimeoutError, SessionExpiredError)


def _transient(exc: BaseException) -> bool:
    """Whether ``exc``, the outcome of a kazoo request, says the link broke under it (the
    request may or may not have been applied), rather than what ZooKeeper decided.

    Besides kazoo's own connection errors: a reply that kazoo cannot pair with its request
    (a server answering out of order, ZOOKEEPER-1863) ends kazoo's connection thread with a
    ``RuntimeError('xids do not match ...')``, which it also sets on the pending request.
    """
    if isinstance(exc, _TRANSIENT):
        return True
    return (
        isinstance(exc, RuntimeError)
        and bool(exc.args)
        and str(exc.args[0]).startswith("xids do not match")
    )


#: How often :meth:`AsyncZooKeeperDriver.revoke` retries when the queue changes under it.
_REVOKE_ROUNDS = 5

_BLATHER = 5  # kazoo's most verbose level: the session line the probe reads


class _Dropped(BackendError):
    """The connection dropped with a request on its way that is not safe to send again:
    it may or may not have happened."""


class _Reaper:
    """Deletes this session's lock nodes that their owner no longer keeps.

    ZooKeeper deletes an ephemeral node only when its session ends, and a session lives as
    long as its process talks to the ensemble. A lease, though, ends after its ttl when the
    holder stops renewing, and a waiter's node must leave the queue when the waiter stops
    waiting. So the driver keeps, for every node it created, the monotonic time until which
    its contender keeps it, and this thread deletes the node after that:

    - a holder's node: ``ttl`` after the last acquire or renewal was *sent*, so never
      before the holder's own deadline (C10) ends; deleted only at the data version of
      the last renewal this session saw succeed, so a renewal that lands first wins;
    - a waiter's node: a while after the waiter's last attempt (it tries every few seconds);
    - a node whose creation answered too late for its caller (a timeout, a cancelled
      task), or whose release failed;
    - the node of a join whose outcome nobody learnt (its reply was lost with the
      connection, and the contender could not look for the node before it gave up): found
      by the join's guid once the connection is back.

    A holder that is frozen (``SIGSTOP``, a VM pause) freezes this thread too; then the
    session expires on the ensemble's side after the session timeout (at least the ttl),
    and ZooKeeper deletes the node itself.
    """

    def __init__(self, client: Any, request_timeout: float) -> None:
        self._client = client
        self._request_timeout = request_timeout
        self._cond = threading.Condition()
        self._holds: dict[str, Hold] = {}
        self._sweeps: dict[tuple[str, str], float] = {}
        self._thread: threading.Thread | None = None
        self._closed = False

    def start(self) -> None:
        """Start the thread (once)."""
        with self._cond:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(
                    target=self._run, name="fence-zookeeper-reaper", daemon=True
                )
                self._thread.start()

    def hold(self, path: str, until: float, version: int) -> None:
        """Keep ``path`` until ``until`` (monotonic), then delete it at ``version`` (-1: any)."""
        with self._cond:
            old = self._holds.get(path)
            generation = old.generation + 1 if old else 0
            self._holds[path] = Hold(until, version, generation=generation)
            self._cond.notify()

    def busy(self, path: str) -> None:
        """A write to ``path`` is under way: do not delete it until :meth:`idle`."""
        with self._cond:
            hold = self._holds.get(path)
            if hold is not None:
                hold.busy = True
                hold.generation += 1

    def idle(self, path: str) -> None:
        """The write to ``path`` failed: the last known hold applies again."""
        with self._cond:
            hold = self._holds.get(path)
            if hold is not None:
                hold.busy = False
                hold.generation += 1
                self._cond.notify()

    def forget(self, path: str) -> None:
        """Stop looking after ``path`` (released, or known gone)."""
        with self._cond:
            self._holds.pop(path, None)

    def orphan(self, result: Any, parent: str, guid: str) -> None:
        """Delete whatever the join ``result`` (named ``guid``, under ``parent``) creates,
        once it completes: its caller gave up waiting for the answer."""
        result.rawlink(functools.partial(self._adopt, parent=parent, guid=guid))

    def _adopt(self, result: Any, parent: str, guid: str) -> None:
        try:
            created = result.get(block=False)
        except (ConnectionLoss, OperationTimeoutError):  # the answer is lost: look for it
            self.sweep(parent, guid)
            return
        except Exception:  # the join failed (or its session ended): nothing to delete
            return
        if isinstance(created, list) and created and isinstance(created[0], str):
            self.hold(created[0], 0.0, -1)

    def sweep(self, parent: str, guid: str) -> None:
        """Delete the nodes of the join ``guid`` under ``parent`` once connected: a join
        whose answer was lost may have made one."""
        with self._cond:
            self._sweeps[(parent, guid)] = 0.0
            self._cond.notify()

    def close(self) -> None:
        """Stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(self._request_timeout + 1.0)

    def _next(self) -> tuple[list[tuple[str, Hold, int]], list[tuple[str, str]], float]:
        now = time.monotonic()
        due = []
        wake = now + 60.0
        for path, hold in self._holds.items():
            if hold.busy:
                continue
            at = max(hold.until, hold.settle)
            if at <= now:
                due.append((path, Hold(hold.until, hold.version), hold.generation))
            else:
                wake = min(wake, at)
        sweeps = [key for key, at in self._sweeps.items() if at <= now]
        for at in self._sweeps.values():
            if at > now:
                wake = min(wake, at)
        return due, sweeps, wake

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                due, sweeps, wake = self._next()
                if not due and not sweeps:
                    self._cond.wait(max(0.0, wake - time.monotonic()))
                    continue
            for path, hold, generation in due:
                self._reap(path, hold, generation)
            for parent, guid in sweeps:
                self._sweep(parent, guid)

    def _call(self, result: Any) -> Any:
        if not result.wait(self._request_timeout):
            raise OperationTimeoutError()
        return result.get(block=False)

    def _retry_later(self, path: str, generation: int, delay: float) -> None:
        with self._cond:
            hold = self._holds.get(path)
            if hold is not None and hold.generation == generation:
                hold.settle = time.monotonic() + delay

    def _reap(self, path: str, hold: Hold, generation: int) -> None:
        version = hold.version
        try:
            if version == -2:  # a renewal changed the node without this session hearing back
                stat = self._call(self._client.exists_async(path))
                if stat is None:
                    raise NoNodeError()
                with self._cond:
                    current = self._holds.get(path)
                    if current is None or current.generation != generation or current.busy:
                        return  # a renewal came through, or is under way: it decides
                version = stat.version
            self._call(self._client.delete_async(path, version))
        except NoNodeError:
            pass
        except BadVersionError:
            # A write landed that this session did not see succeed (its reply was lost,
            # or it is on the way). Let it settle, then delete at the version found then.
            with self._cond:
                current = self._holds.get(path)
                if current is not None and current.generation == generation:
                    current.version = -2
                    current.settle = time.monotonic() + 2 * self._request_timeout
            return
        except Exception:
            # kazoo's verdicts, no answer in time, and whatever kazoo's connection thread
            # failed with (it sets that on every pending request): this thread must outlive
            # them all, or nothing is reaped any more.
            self._retry_later(path, generation, 0.5)
            return
        with self._cond:
            current = self._holds.get(path)
            if current is not None and current.generation == generation:
                del self._holds[path]

    def _sweep(self, parent: str, guid: str) -> None:
        try:
            # Through the leader first: a server the session moved to may not have
            # applied the join yet.
            self._call(self._client.sync_async(parent))
            children = self._call(self._client.get_children_async(parent))
            for name in children:
                if name.startswith((guid + MARK, guid + READ_MARK)):
                    try:
                        self._call(self._client.delete_async(f"{parent}/{name}"))
                    except NoNodeError:
                        pass
        except NoNodeError:
            pass
        except Exception:  # as in _reap: this thread outlives every failure
            with self._cond:
                if (parent, guid) in self._sweeps:
                    self._sweeps[(parent, guid)] = time.monotonic() + 0.5
            return
        with self._cond:
            self._sweeps.pop((parent, guid), None)


class AsyncZooKeeperDriver:
    """Moves the bytes of :class:`AsyncZooKeeperLockManager`.

    One kazoo client (one session) per driver. Every contender joins the resource's queue
    with one multi-operation (an ephemeral sequential node and a version bump of the
    resource node); on a free lock the same round trip proves the node is alone, after one
    read of the queue. A waiter watches only its predecessor. Renewal is one write to the
    holder's node; release is one delete.

    Args:
        hosts: ``zookeeper://h1:2181,h2:2181/root`` (the path sets the root), a kazoo hosts
            string ``h1:2181,h2:2181`` or a list of ``host:port``.
        root: the parent of every resource node (default: the URL's path, else ``/fence``).
        session_timeout: the session timeout to ask for, in seconds. The server may grant
            less (``maxSessionTimeout``); a lease may not be longer than what it granted.
        request_timeout: how long one call may take, waiting for a connection included.

    Raises:
        ConfigurationError: a bad argument.
    """

    source = "zookeeper"
    #: Grants read leases (C13).
    shared = True

    def __init__(
        self,
        hosts: str | list[str] | tuple[str, ...],
        *,
        root: str | None = None,
        session_timeout: float = 30.0,
        request_timeout: float = 5.0,
    ) -> None:
        found, url_root = parse_hosts(hosts)
        self.hosts = found
        self.root = validate_root(root if root is not None else url_root or DEFAULT_ROOT)
        self.session_timeout = validate_ttl(session_timeout, what="session_timeout")
        self.request_timeout = validate_ttl(request_timeout, what="request_timeout")
        self._probe = SessionTimeoutProbe()
        # A logger of its own, outside logging's registry: the probe reads the granted
        # session timeout from it; warnings go on to the "fence" logger's handlers.
        self._logger = logging.Logger("fence.zookeeper.kazoo", _BLATHER)
        self._logger.parent = _log
        self._logger.addFilter(self._probe)
        self._client: Any = KazooClient(
            hosts=found,
            timeout=self.session_timeout,
            logger=self._logger,
            connection_retry=KazooRetry(
                max_tries=-1, delay=0.05, backoff=2, max_jitter=0.2, max_delay=1.0
            ),
        )
        self._reaper = _Reaper(self._client, self.request_timeout)
        self._watches = Watches()
        self._nodes: dict[tuple[str, str], Node] = {}
        self._lock = threading.Lock()
        self._reviving: object = None  # the dead connection thread being replaced
        self._session_at_loss: tuple[int, bytes] | None = None
        self._connect_waiters: list[Any] = []
        self._started = False
        self._closed = False
        self._had_session = False

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.hosts} root={self.root!r}>"

    @property
    def granted_session_timeout(self) -> float | None:
        """The session timeout the ensemble granted, in seconds (``None`` before a session)."""
        return self._probe.granted

    # -- the connection ----------------------------------------------------------------------

    def _on_state(self, state: str) -> None:
        """kazoo's state listener (on its connection thread; must not block)."""
        if state == KazooState.CONNECTED:
            self._had_session = True
            self._logger.setLevel(logging.WARNING)  # the probe has what it needs
            with self._lock:
                waiters, self._connect_waiters = self._connect_waiters, []
            for waiter in waiters:
                waiter.wake()
        else:  # SUSPENDED or LOST: the next session line must reach the probe again
            if state == KazooState.LOST:
                # Read before kazoo forgets it: the session to resume should kazoo's
                # connection thread have ended on its own (see _revive_if_dead).
                # (client_id says None by now: kazoo marks the client not live first.)
                sid = getattr(self._client, "_session_id", None)
                passwd = getattr(self._client, "_session_passwd", b"")
                self._session_at_loss = (int(sid), bytes(passwd)) if sid else None
            self._logger.setLevel(_BLATHER)
            self._watches.wake_all()

    async def _connected(self, what: str, end: float) -> None:
        if self._closed:
            raise ConfigurationError(f"{self!r} is closed")
        if not self._started:
            self._started = True
            self._client.add_listener(self._on_state)
            self._client.start_async()
            self._reaper.start()
        while not self._client.connected:
            self._revive_if_dead()
            left = end - time.monotonic()
            if left <= 0:
                raise BackendError(
                    f"ZooKeeper at {self.hosts} gave no connection for the {what} in time "
                    f"(the caller's deadline, or {self.request_timeout:g} s). A majority of "
                    "the ensemble may be down or cut off (a server without a quorum refuses "
                    "clients); the lock state is unknown until it answers, and the call may "
                    "be retried",
                    code="UNAVAILABLE",
                    retryable=True,
                )
            waiter = Waiter()
            with self._lock:
                self._connect_waiters.append(waiter)
            if self._client.connected:
                break
            await waiter.wait(min(left, 0.25))

    def _revive_if_dead(self) -> None:
        """Start kazoo's connection again if its thread ended on its own.

        kazoo's connection thread ends when the client is stopped, and also when it meets
        an error it does not handle (a reply it cannot pair with its request, kazoo issue
        254). Then the client stays disconnected for good: every call would wait for a
        connection until its deadline, forever.

        It starts again on the session it had: kazoo forgets the session when its thread
        ends, so it is put back first. While the ensemble has not expired that session,
        every node (and lease) of it is still this manager's, and a request cut off by the
        failure is sent again like one cut off by a dropped connection. Should the session
        have expired meanwhile, ZooKeeper says so and kazoo starts a new one, as after any
        expiry: the nodes are gone, and the leases are reported lost at their renewal.
        """
        routine = getattr(getattr(self._client, "_connection", None), "_connection_routine", None)
        stopped = getattr(self._client, "_stopped", None)
        if routine is None or stopped is None or routine.is_alive() or stopped.is_set():
            return
        with self._lock:
            if self._closed or self._reviving is routine:
                return  # closed, or being started again already
            self._reviving = routine
        _log.warning(
            "kazoo's connection to ZooKeeper at %s ended on its own; starting it again on "
            "the same session",
            self.hosts,
        )

        def revive() -> None:
            try:
                session = self._session_at_loss
                if session is not None:
                    self._client._session_id, self._client._session_passwd = session
                self._client.start_async()
                if self._closed:  # close() came meanwhile: it may have stopped it before
                    self._client.stop()
            except Exception:  # pragma: no cover - the next caller tries again
                _log.warning("starting kazoo's connection again failed", exc_info=True)
                with self._lock:
                    self._reviving = None

        # start_async() joins kazoo's old threads: off the event loop, on a thread of its own.
        threading.Thread(target=revive, name="fence-zookeeper-revive", daemon=True).start()

    async def _ready(self, ttl: float, what: str, end: float) -> None:
        """Connected, and ``ttl`` fits in the session the ensemble granted."""
        await self._connected(what, end)
        granted = self._probe.granted
        if granted is None:
            raise ConfigurationError(
                "could not learn the session timeout ZooKeeper granted (kazoo did not log "
                "it); without it a lease could outlive the session that keeps its node"
            )
        if ttl > granted:
            raise ConfigurationError(
                f"ttl {ttl:g} s is longer than the ZooKeeper session ({granted:g} s granted): "
                "a holder that stops answering loses its node when its session expires, "
                f"before its lease would end. Use a ttl of at most {granted:g} s, or ask for a "
                "longer session_timeout (the server caps it at its maxSessionTimeout)"
            )

    async def _op(
        self,
        what: str,
        start: Callable[[], Any],
        end: float,
        *,
        safe: bool = True,
        on_late: Callable[[Any], None] | None = None,
        uncertain: list[str] | None = None,
    ) -> Any:
        """Run one kazoo request, after the connection is there, until ``end`` (the
        caller's deadline or ``request_timeout``, whichever comes first).

        A request interrupted by a dropped connection is sent again once the connection
        is back if ``safe`` (with a note in ``uncertain``); otherwise :class:`_Dropped` is
        raised: its outcome is unknown. One that gets no answer in time raises, and one
        whose caller is cancelled stops waiting; ``on_late(result)`` then sees it complete.

        Raises:
            KazooException: ZooKeeper's verdict (no node, bad version...).
            BackendError: no connection or no answer in time; :class:`_Dropped`.
        """
        while True:
            await self._connected(what, end)
            result = start()
            try:
                return await completed(result, end - time.monotonic())
            except TimeoutError as exc:
                if on_late is not None:
                    on_late(result)
                raise BackendError(
                    f"ZooKeeper at {self.hosts} did not answer the {what} in time (the "
                    f"caller's deadline, or {self.request_timeout:g} s); the lock state is "
                    "unknown until it does, and the call may be retried",
                    code="CONNECTION",
                    retryable=True,
                ) from exc
            except Exception as exc:
                if not _transient(exc):
                    raise  # ZooKeeper's verdict: the caller decides
                if uncertain is not None:
                    uncertain.append(type(exc).__name__)
                if not safe:
                    raise _Dropped(
                        f"the connection to ZooKeeper dropped during the {what} "
                        f"({type(exc).__name__}); it may or may not have happened",
                        code="CONNECTION",
                        retryable=True,
                    ) from exc
                if time.monotonic() >= end:
                    raise BackendError(
                        f"ZooKeeper at {self.hosts} could not serve the {what} within "
                        f"{self.request_timeout:g} s ({type(exc).__name__})",
                        code="UNAVAILABLE",
                        retryable=True,
                    ) from exc
            except BaseException as exc:
                # Cancelled (asyncio) with the request on its way, or with its answer not
                # yet taken: it may have landed, or land later.
                if on_late is not None and not isinstance(exc, Exception):
                    on_late(result)
                raise

    def _deadline(self) -> float:
        # Bounded by the caller's deadline too (an acquire with a timeout), not only by ours.
        return time.monotonic() + time_left(self.request_timeout)

    # -- the queue -------------------------------------------------------------------------

    async def _children(self, parent: str, end: float, what: str) -> tuple[list[str], int]:
        """The resource node's children and its data version (creating it if missing)."""
        while True:
            try:
                children, stat = await self._op(
                    what, lambda: self._client.get_children_async(parent, include_data=True), end
                )
                return list(children), int(stat.version)
            except NoNodeError:
                await self._make_path(parent, end, what)

    async def _make_path(self, path: str, end: float, what: str) -> None:
        """Create ``path`` and its missing ancestors, as persistent empty nodes (one
        request each; kazoo's ``ensure_path`` reads every level first)."""
        parts = path.strip("/").split("/")
        for depth in range(1, len(parts) + 1):
            node = "/" + "/".join(parts[:depth])
            try:
                await self._op(what, functools.partial(self._client.create_async, node, b""), end)
            except NodeExistsError:
                pass

    async def _join(
        self, parent: str, data: bytes, version: int, end: float, mark: str = MARK
    ) -> tuple[str, int, list[str] | None] | None:
        """One multi-operation: create the contender's node (named with a new guid and
        ``mark``: a writer's or a reader's) and bump the resource node's version (only from
        ``version``, unless it is -1).

        Returns ``(name, czxid, None)``; or ``(name, 0, children)`` when the reply was lost
        with the connection and the node was found among ``children`` afterwards (its
        czxid is unknown until the write that grants the lock reads it); or ``None`` when
        ``version`` was stale (somebody joined since the read).

        A join whose reply is lost is not simply sent again: it may have made its node, and
        a second one would leave the first ahead in the queue, held by nobody, until the
        session ends (kazoo's lock recipe looks for its node too)::

            join (create guid-lock-, set R)   ->  applied; the reply lost with the connection
            reconnect, sync, read R's children
              guid-lock-0000000007 is there   ->  that is the node: go on with it
              no node with the guid           ->  it never landed: send the join again

        Whatever this call cannot settle (its deadline came, it was cancelled) the reaper
        does: it deletes the node when a late reply brings its name, or looks for the guid
        once the connection is back.
        """
        guid = new_guid()
        late = functools.partial(self._reaper.orphan, parent=parent, guid=guid)

        def start() -> Any:
            txn = self._client.transaction()
            txn.create(f"{parent}/{guid}{mark}", data, ephemeral=True, sequence=True)
            txn.set_data(parent, b"", version=version)
            return txn.commit_async()

        while True:
            try:
                results = await self._op("acquire", start, end, safe=False, on_late=late)
                break
            except _Dropped:
                pass
            try:
                # Through the leader first: the server the session reconnected to may not
                # have applied the join yet. Once the session has moved, ZooKeeper refuses
                # what the old connection had not yet handed on, so this read is final.
                await self._op("acquire", lambda: self._client.sync_async(parent), end)
                children, _ = await self._children(parent, end, "acquire")
            except BaseException:
                self._reaper.sweep(parent, guid)
                raise
            name = own_node(children, guid, mark)
            if name is not None:
                return name, 0, children
        failed = [r for r in results if isinstance(r, Exception)]
        if not failed:
            name = str(results[0]).rsplit("/", 1)[1]
            return name, int(results[1].mzxid), None  # one zxid for the whole multi
        if any(isinstance(r, BadVersionError) for r in failed):
            return None
        if any(isinstance(r, NoNodeError) for r in failed):
            raise NoNodeError()
        raise BackendError(f"ZooKeeper refused the acquire: {failed!r}", code="RESPONSE")

    async def _stamp(self, node: Node, end: float, what: str) -> bool:
        """Write the node's data through the leader: proves the node (and the session) is
        still there after the call began, and dates the lease (``mtime``). Returns whether
        the node existed."""
        path = node.path
        self._reaper.busy(path)
        try:
            stat = await self._op(
                what,
                lambda: self._client.set_async(path, encode_data(node.holder, node.ttl), -1),
                end,
            )
        except NoNodeError:
            self._reaper.forget(path)
            return False
        except BaseException:
            self._reaper.idle(path)
            raise
        node.version = int(stat.version)
        node.czxid = int(stat.czxid)  # unknown until now if the join's reply was lost
        return True

    def _hold_waiter(self, node: Node, sent: float) -> None:
        # A waiter tries again every few seconds; its node stays that long and more.
        self._reaper.hold(node.path, sent + 3 * _WAIT_CAP + 2 * self.request_timeout, -1)

    def _grant(self, key: tuple[str, str], node: Node, sent: float) -> AcquireReply:
        node.granted = True
        node.place = None
        self._reaper.hold(node.path, sent + node.ttl, node.version)
        self._nodes[key] = node
        return AcquireReply(token_of(node.czxid))

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

        The first attempt reads the queue and joins it in one multi-operation; on a free
        lock (for a reader: one without writers) that multi-operation itself proves the
        node first (two round trips). A later attempt of a waiter whose predecessor, the
        owner, left is one write.
        """
        sent = time.monotonic()
        # Bounded by the caller's deadline too (an acquire with a timeout): a blocking
        # call cannot be cut off from outside.
        end = sent + time_left(self.request_timeout)
        await self._ready(ttl, "acquire", end)
        key = (resource, secret)
        node = self._nodes.get(key)
        if node is not None:
            return await self._again(key, node, sent, end)
        parent = resource_path(self.root, resource)
        data = encode_data(holder, ttl)
        reading = mode is LeaseMode.READ
        mark = READ_MARK if reading else MARK
        children, version = await self._children(parent, end, "acquire")
        order = queue_order(children)
        # A reader needs no writer ahead; a writer nobody ahead.
        alone = not any(map(is_writer_node, order)) if reading else not order
        joined = await self._join(parent, data, version if alone else -1, end, mark)
        if joined is None:  # somebody joined between the read and the write
            alone = False
            joined = await self._join(parent, data, -1, end, mark)
            assert joined is not None  # a join at any version is never refused for it
        name, czxid, seen = joined
        node = Node(resource, parent, name, czxid, 0, ttl, holder, reading=reading)
        self._nodes[key] = node
        if alone and seen is None:
            # The resource node's version proves nobody joined since it was empty.
            return self._grant(key, node, sent)
        self._hold_waiter(node, sent)
        return await self._look(key, node, sent, end, seen)

    async def _look(
        self,
        key: tuple[str, str],
        node: Node,
        sent: float,
        end: float,
        children: list[str] | None = None,
    ) -> AcquireReply:
        if children is None:
            children, _ = await self._children(node.parent, end, "acquire")
        place = place_in(queue_order(children), node.name, is_writer_node)
        if place is None:  # the node is gone (revoked, or the session expired)
            return await self._rejoin(key, node, end)
        if place.owner:
            # This read may lag the leader; the write confirms the node is still there.
            if not await self._stamp(node, end, "acquire"):
                return await self._rejoin(key, node, end)
            return self._grant(key, node, sent)
        node.place = place
        return AcquireReply(None, cookie=node, queued=True)

    async def _again(
        self, key: tuple[str, str], node: Node, sent: float, end: float
    ) -> AcquireReply:
        self._hold_waiter(node, sent)
        if node.owner:
            if not await self._stamp(node, end, "acquire"):
                return await self._rejoin(key, node, end)
            return self._grant(key, node, sent)
        return await self._look(key, node, sent, end)

    async def _rejoin(self, key: tuple[str, str], node: Node, end: float) -> AcquireReply:
        self._nodes.pop(key, None)
        self._reaper.forget(node.path)
        resource, secret = key
        if time.monotonic() >= end:
            raise BackendError(
                f"the queue node of {resource!r} vanished twice within one call "
                "(revoked, or the session expired); try again",
                code="UNAVAILABLE",
                retryable=True,
            )
        mode = LeaseMode.READ if node.reading else LeaseMode.WRITE
        return await self.acquire(resource, secret, node.ttl, node.holder, mode)

    async def wait(self, resource: str, timeout: float, reply: AcquireReply) -> None:
        """Watch the predecessor node until it is deleted, or ``timeout`` seconds pass (at
        most a few seconds)."""
        node = reply.cookie
        if not isinstance(node, Node) or node.place is None:
            return
        place = node.place
        if place.predecessor is None:
            node.owner = True
            return
        seconds = min(timeout, _WAIT_CAP)
        if seconds <= 0.001:
            return
        path = f"{node.parent}/{place.predecessor}"
        watcher = Watcher(Waiter())
        self._watches.add(path, watcher)
        try:
            end = time.monotonic() + min(seconds, self.request_timeout)
            stat = await self._op(
                "wait", lambda: self._client.exists_async(path, watch=self._watches.fire), end
            )
            if stat is None:
                watcher.deleted = True
            else:
                await watcher.waiter.wait(seconds)
        except BackendError as exc:
            if not exc.retryable:
                raise
            # The next attempt reports a real outage; this one only ends the wait.
        finally:
            self._watches.remove(path, watcher)
        node.place = None
        if watcher.deleted:
            node.owner = owner_after_predecessor_left(place)

    async def abandon(self, resource: str, secret: str) -> None:
        """A waiter gave up: delete its node, which wakes the waiter behind it."""
        node = self._nodes.pop((resource, secret), None)
        if node is None:
            return
        self._reaper.forget(node.path)
        try:
            await self._op(
                "abandon", lambda: self._client.delete_async(node.path), self._deadline()
            )
        except NoNodeError:
            pass
        except BackendError:
            self._reaper.hold(node.path, 0.0, -1)
            raise

    async def renew(self, resource: str, secret: str, ttl: float) -> bool:
        """One write to the holder's node; see :meth:`fence.abc.AsyncDriver.renew`."""
        node = self._nodes.get((resource, secret))
        if node is None or not node.granted:
            return False
        sent = time.monotonic()
        # Bounded by the caller's deadline too (the watchdog's: the lease's own).
        end = sent + time_left(self.request_timeout)
        await self._ready(ttl, "renewal", end)
        node.ttl = ttl
        if not await self._stamp(node, end, "renewal"):
            self._nodes.pop((resource, secret), None)
            return False
        self._reaper.hold(node.path, sent + ttl, node.version)
        return True

    async def release(self, resource: str, secret: str) -> bool:
        """Delete the holder's node, which wakes the next waiter; see
        :meth:`fence.abc.AsyncDriver.release`."""
        node = self._nodes.pop((resource, secret), None)
        if node is None:
            return False
        if not node.granted:  # a waiter's node: it holds nothing
            self._reaper.hold(node.path, 0.0, -1)
            return False
        self._reaper.forget(node.path)
        uncertain: list[str] = []
        try:
            # A delete interrupted by a dropped connection is sent again once it is back, so
            # the node does not block the queue.
            await self._op(
                "release",
                lambda: self._client.delete_async(node.path),
                self._deadline(),
                uncertain=uncertain,
            )
        except NoNodeError as exc:
            if uncertain:
                # The first delete probably went through; the node may also have been
                # revoked, reaped or expired just before.
                raise BackendError(
                    f"ZooKeeper did not confirm the release ({uncertain[0]}) and the node is "
                    "gone now: the lock is free, but whether it was still held when released "
                    "is unknown",
                    code="CONNECTION",
                ) from exc
            return False
        except BackendError:
            self._reaper.hold(node.path, 0.0, -1)  # delete it once the connection is back
            raise
        return True

    async def inspect(self, resource: str) -> LockInfo | None:
        """The first node of the queue (or, if it is a reader's, every reader's node before
        the first writer's); ``remaining`` by the leader's clock (the node's ``mtime`` and a
        write's); see :meth:`fence.abc.AsyncDriver.inspect`."""
        end = self._deadline()
        parent = resource_path(self.root, resource)
        for _ in range(3):
            children, _ = await self._children(parent, end, "inspect")
            order = queue_order(children)
            if not order:
                return None
            holders = order[:1]
            if not is_writer_node(order[0]):
                writers = [i for i, name in enumerate(order) if is_writer_node(name)]
                holders = order[: writers[0]] if writers else order
            found = []
            try:
                for name in holders:
                    data, stat = await self._op(
                        "inspect",
                        functools.partial(self._client.get_async, f"{parent}/{name}"),
                        end,
                    )
                    found.append((name, data, stat))
            except NoNodeError:
                continue
            clock = await self._op("inspect", lambda: self._client.set_async(parent, b""), end)
            infos = []
            for name, data, stat in found:
                holder, ttl = decode_data(data)
                left = (int(stat.mtime) + (ttl or 0.0) * 1000 - int(clock.mtime)) / 1000
                mode = LeaseMode.WRITE if is_writer_node(name) else LeaseMode.READ
                infos.append(
                    LockInfo(resource, token_of(int(stat.czxid)), max(left, 0.0), holder, mode)
                )
            if infos[0].mode is LeaseMode.WRITE:
                return infos[0]
            return LockInfo.of_readers(resource, infos)
        return None

    async def list_page(
        self, prefix: str, cursor: str | None, count: int
    ) -> tuple[list[LockInfo], str | None]:
        """The next ``count`` resources after ``cursor``, by resource, each inspected, with
        its other nodes counted as ``waiters``.

        ZooKeeper does not page a node's children: each page reads the root's whole list
        of children (one resource node each, kept after release) and pages it here. Each
        held resource costs an inspect, whose clock reading is one write to its node.
        """
        end = self._deadline()
        try:
            children = await self._op(
                "list", lambda: self._client.get_children_async(self.root), end
            )
        except NoNodeError:
            return [], None
        names = sorted(
            name
            for name in map(resource_of_node, children)
            if name.startswith(prefix) and (cursor is None or name > cursor)
        )
        page = names[:count]
        rows = []
        for name in page:
            info = await self.inspect(name)
            if info is None:
                continue
            parent = resource_path(self.root, name)
            try:
                nodes = await self._op(
                    "list",
                    functools.partial(self._client.get_children_async, parent),
                    self._deadline(),
                )
            except NoNodeError:
                continue
            holders = len(info.readers) or 1
            rows.append(
                dataclasses.replace(info, waiters=max(len(queue_order(nodes)) - holders, 0))
            )
        return rows, (page[-1] if len(names) > count else None)

    async def revoke(self, resource: str) -> int:
        """Delete the holder's node and every waiter's, and bump the resource node, in one
        multi-operation; return its zxid, above every token issued for ``resource`` and
        below every token issued after; see :meth:`fence.abc.AsyncDriver.revoke`.

        The waiters lose their place: their nodes were created before the returned token,
        so none of them may become the owner with it. They join the queue again.
        """
        end = self._deadline()
        parent = resource_path(self.root, resource)
        for _ in range(_REVOKE_ROUNDS):
            children, version = await self._children(parent, end, "revoke")
            order = queue_order(children)

            def start(order: list[str] = order, version: int = version) -> Any:
                txn = self._client.transaction()
                for name in order:
                    txn.delete(f"{parent}/{name}")
                txn.set_data(parent, b"", version=version)
                return txn.commit_async()

            results = await self._op("revoke", start, end)
            if not any(isinstance(r, Exception) for r in results):
                return token_of(int(results[-1].mzxid))
        raise BackendError(
            f"{resource!r} kept gaining contenders during the revoke; try again",
            code="CONTENDED",
            retryable=True,
        )

    async def close(self) -> None:
        """Stop the reaper, close the session (ZooKeeper deletes its nodes) and the client.
        A client that never had a session returns at once (within half a second)."""
        if self._closed:
            return
        self._closed = True
        self._nodes.clear()
        self._reaper.close()
        if not self._started:
            return
        done = Waiter()

        def stop() -> None:
            try:
                self._client.stop()
                self._client.close()
            except Exception:  # pragma: no cover - kazoo logs its own trouble
                _log.debug("closing the ZooKeeper client failed", exc_info=True)
            finally:
                done.wake()

        # kazoo's stop() joins its threads: off the event loop, on a thread of its own.
        threading.Thread(target=stop, name="fence-zookeeper-close", daemon=True).start()
        # Without a session the ensemble holds nothing of ours to delete, and stop() may
        # wait out a handshake that a silent server never answers (kazoo joins its
        # connection thread for up to the session timeout): a close, or a Ctrl-C, would
        # take that long. Its threads are daemons and end on their own.
        await done.wait(self.request_timeout + 15.0 if self._had_session else _NO_SESSION_WAIT)


#: How long ``close()`` waits for kazoo's stop when no session was ever established.
_NO_SESSION_WAIT = 0.5


class AsyncZooKeeperLockManager(AsyncBaseLockManager):
    """A lock manager on ZooKeeper: ephemeral sequential nodes, tokens from the ``czxid``.

    The token of a lease is the zxid that created its node: it comes from the ensemble's
    atomic broadcast, grows across leader elections and restarts, and needs no clock
    (C2, C3). Waiters queue in sequence order and each watches only its predecessor (FIFO,
    no herd). A lease ends when its holder releases it, when it is not renewed within its
    ttl (the holder's own driver deletes the node, never before the holder's deadline), or
    when the holder's session expires (the holder stopped, or lost its connections for the
    session timeout), whichever comes first; a renewal that finds the node gone reports the
    lease lost (C10). Shared locks (C13): a reader's node (``-read-``) waits only for the
    last writer's node before it (kazoo's read/write recipe, with tokens).

    Args:
        hosts: ``zookeeper://h1:2181,h2:2181,h3:2181/root`` (the path sets the root), a
            hosts string or a list of ``host:port``.
        root: the parent node of the resources (default ``/fence``).
        session_timeout: the ZooKeeper session timeout to ask for, in seconds (default: the
            ttl, at least 4 s). A frozen or cut-off holder keeps its locks that long. Every
            lease's ttl must fit in the session the server grants, or acquire raises
            :class:`ConfigurationError`.
        request_timeout: how long one call may take, waiting for a connection included
            (default ``ttl / 3`` between 1 and 5 s); then a retryable
            :class:`BackendError` is raised, e.g. when a majority is down.
        ttl: default lease time in seconds.
        renew: default for the renewal watchdog (one write at about ``ttl / 3``).
        drift: fraction of the ttl the client gives up for clock rate differences (C10).
        margin: seconds the client gives up for the request's own latency (C10).
        clock: the monotonic clock for client deadlines.
        events: where to report events.
        reentrant: whether a second acquire by the same owner returns the held lease.

    Raises:
        ConfigurationError: a bad argument.

    Example::

        manager = AsyncZooKeeperLockManager("zookeeper://zk1:2181,zk2:2181,zk3:2181/locks")
        async with manager.lock("order:42", ttl=10) as lease:
            await guard.claim("order:42", lease.token)
            ...
        await manager.close()
    """

    driver: AsyncZooKeeperDriver

    def __init__(
        self,
        hosts: str | list[str] | tuple[str, ...],
        *,
        root: str | None = None,
        session_timeout: float | None = None,
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
        if session_timeout is None:
            session_timeout = max(ttl, 4.0)
        driver = AsyncZooKeeperDriver(
            hosts,
            root=root,
            session_timeout=session_timeout,
            request_timeout=request_timeout,
        )
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
