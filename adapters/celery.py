"""Celery tasks under a lease: :class:`FencedTask` takes the lock before the body runs.

::

    from celery import Celery
    from fence.adapters.celery import FencedTask

    app = Celery("jobs", broker="redis://127.0.0.1:6379/1")
    app.conf.iofence_manager = "redis://127.0.0.1:6379/0"   # or a lock manager

    @app.task(base=FencedTask, bind=True, fence="job:{job_id}", fence_ttl=30)
    def run_job(self: FencedTask, job_id: int) -> None:
        guard.claim(f"job:{job_id}", self.lease.token)   # shut out older holders (C8)
        guard.set(f"{{job:{job_id}}}:state", "done", token=self.lease.token)

Each run formats the resource from the task's arguments, acquires it with the renewal
watchdog on, runs the body with the lease in :attr:`FencedTask.lease`, and releases it
when the body returns or raises. The lease alone cannot stop a worker that paused past
it (a SIGSTOP, a long GC, a frozen VM); the guards can, and the body's writes go through
them with ``self.lease.token``. A run that fails in a way a new lease cures (a write
refused as stale, a lost or expired lease, a transient backend error: what
:func:`fence.is_retryable` says) or that did not get the lock in time
(:class:`fence.AcquireTimeout`) goes back to the queue through Celery's own
:meth:`celery.Task.retry`, under the task's ``max_retries``, and runs under a new lease
with a newer token. See ``docs/celery.md``.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any, ClassVar, NoReturn

from celery import Task
from celery.utils.time import get_exponential_backoff_interval

from fence._async.manager import AsyncBaseLockManager
from fence._connect import connect
from fence._decorate import template_fields
from fence._errors import AcquireTimeout, ConfigurationError, NotOwnerError
from fence._retry import is_retryable
from fence._sync.manager import BaseLockManager, Lease

__all__ = ["CONFIG_KEY", "FencedTask"]

_log = logging.getLogger("fence.celery")

#: The app setting that names the lock manager of every :class:`FencedTask` without its
#: own ``fence_manager``: a lock manager, or a URL for :func:`fence.connect`.
CONFIG_KEY = "iofence_manager"

#: The lease of the run in progress; a context variable, so that each thread of a
#: ``threads`` pool (and each greenlet of ``gevent``/``eventlet``) sees its own.
_current: ContextVar[Lease | None] = ContextVar("fence_celery_lease", default=None)

#: Managers made from URLs, one per URL and process: a prefork child must not share the
#: connections its parent opened before the fork.
_by_url: dict[str, BaseLockManager] = {}
_by_url_pid = os.getpid()
_by_url_lock = threading.Lock()


def _from_url(url: str) -> BaseLockManager:
    global _by_url_pid
    with _by_url_lock:
        if _by_url_pid != os.getpid():
            _by_url.clear()
            _by_url_pid = os.getpid()
        manager = _by_url.get(url)
        if manager is None:
            manager = _by_url[url] = connect(url)
        return manager


class _Template:
    """A task's resource template, read once against the body's signature."""

    __slots__ = ("fields", "name", "signature", "template")

    def __init__(
        self, name: str, template: str | None, run: Callable[..., object], bound: bool
    ) -> None:
        if template is None:
            raise ConfigurationError(
                f"task {name!r} has base=FencedTask but no fence=: name the resource it "
                "locks, e.g. fence='job:{job_id}'"
            )
        fields = template_fields(template)
        signature = inspect.signature(run)
        parameters = list(signature.parameters.values())
        if bound and parameters:
            parameters = parameters[1:]  # the task itself
        signature = signature.replace(parameters=parameters)
        unknown = fields - set(signature.parameters)
        if unknown:
            raise ConfigurationError(
                f"task {name!r}: resource template {template!r} names {sorted(unknown)}, "
                "which the task does not take"
            )
        self.name = name
        self.template = template
        self.fields = fields
        self.signature = signature

    def resource(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        if not self.fields:
            return self.template
        try:
            bound = self.signature.bind(*args, **kwargs)
            bound.apply_defaults()
            return self.template.format(**bound.arguments)
        except (TypeError, LookupError, AttributeError, ValueError) as exc:
            raise ConfigurationError(
                f"task {self.name!r}: resource template {self.template!r} cannot be filled "
                f"from the call's arguments: {exc}"
            ) from exc


class FencedTask(Task):  # type: ignore[misc]  # Celery ships no type information
    """A Celery task whose body runs under a lease on a resource named by its arguments.

    Give it as the base of a task and name the resource with ``fence=``, a ``str.format``
    template over the task's parameters; take ``bind=True`` to read the lease::

        @app.task(base=FencedTask, bind=True, fence="job:{job_id}")
        def run_job(self: FencedTask, job_id: int) -> None:
            guard.set(f"{{job:{job_id}}}:state", "done", token=self.lease.token)

    A run:

    1. formats the resource from the call's arguments (defaults applied);
    2. acquires it from the lock manager with the renewal watchdog on (``fence_renew``),
       waiting at most ``fence_timeout`` seconds; on :class:`fence.AcquireTimeout` the
       task is retried;
    3. runs the body, the lease in :attr:`lease`;
    4. releases the lease, whether the body returned or raised;
    5. retries the task when the body raised an error that a new lease cures
       (:func:`fence.is_retryable`: a write refused as stale, a lost or expired lease, a
       transient backend error).

    Retries go through Celery's :meth:`celery.Task.retry` and obey the task's
    ``max_retries`` (past it, the task fails with the last error: the
    :class:`fence.AcquireTimeout`, the :class:`fence.StaleTokenError`...) and its delay:
    with ``retry_backoff`` (``True`` or a factor in seconds), Celery's exponential
    backoff (``retry_backoff_max``, ``retry_jitter``), else ``default_retry_delay``. Every
    other error fails the task as usual. A body that returns has its result kept even if
    its lease was lost on the way: its guarded writes were accepted, and a stale one
    would have raised.

    The task options, given to ``@app.task(...)`` or set on a subclass:

    Attributes:
        fence: the resource template (``"job:{job_id}"``, ``"user:{user.id}"``).
        fence_manager: the lock manager (a sync one), or a URL for :func:`fence.connect`;
            ``None`` (the default): the app's ``iofence_manager`` setting, either of the
            same. A URL makes one manager per URL and worker process, on first use, so
            that a prefork child never shares its parent's connections.
        fence_ttl: the lease time in seconds (default: the manager's).
        fence_timeout: how long a run waits for the lock, in seconds (default 10; ``0``
            tries once; ``None`` waits as long as it takes, holding the worker).
        fence_renew: run the renewal watchdog while the body runs (default ``True``).
            Without it, a body that outlives ``fence_ttl`` loses its lease; the watchdog
            costs a thread per run, which a short task with a long ``fence_ttl`` can spare.

    Raises:
        ConfigurationError: when the task is made: no ``fence``, a template that does not
            parse or names a parameter the task does not take. When it runs, before any
            I/O: arguments the template cannot be formatted from, no lock manager, an
            asyncio one.
    """

    fence: ClassVar[str | None] = None
    fence_manager: ClassVar[BaseLockManager | str | None] = None
    fence_ttl: ClassVar[float | None] = None
    fence_timeout: ClassVar[float | None] = 10.0
    fence_renew: ClassVar[bool] = True

    _fence_template: ClassVar[_Template | None] = None
    _fence_resolved: tuple[int, BaseLockManager] | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        run = cls.__dict__.get("run")
        if run is None:  # a base class of tasks, not a task
            return
        # Celery makes a task of a function with ``run = fun if bind else staticmethod(fun)``;
        # a task class written by hand has ``run(self, ...)``.
        if isinstance(run, staticmethod):
            function, bound = run.__func__, False
        else:
            function, bound = run, True
        name = str(cls.__dict__.get("name") or cls.__qualname__)
        cls._fence_template = _Template(name, cls.fence, function, bound)

    @property
    def lease(self) -> Lease:
        """The lease of the run in progress (read it from the body).

        Raises:
            ConfigurationError: no fenced run is in progress in this thread or task.
        """
        lease = _current.get()
        if lease is None:
            raise ConfigurationError(
                f"{self.name}: there is a lease only while the task's body runs under it"
            )
        return lease

    def fence_lock_manager(self) -> BaseLockManager:
        """The lock manager of this task in this process, resolved once.

        Raises:
            ConfigurationError: neither ``fence_manager`` nor the app's
                ``iofence_manager`` names one, or it names an asyncio manager or something
                that is not a manager or a URL.
        """
        resolved = self._fence_resolved
        pid = os.getpid()
        if resolved is not None and resolved[0] == pid:
            return resolved[1]
        source = self.fence_manager
        if source is None:
            source = self.app.conf.get(CONFIG_KEY)
        if isinstance(source, str):
            manager = _from_url(source)
        elif isinstance(source, BaseLockManager):
            manager = source
        elif isinstance(source, AsyncBaseLockManager):
            raise ConfigurationError(
                f"task {self.name!r}: Celery runs a task's body as a plain function; give it "
                f"a sync lock manager (fence.connect), not {type(source).__name__}"
            )
        elif source is None:
            raise ConfigurationError(
                f"task {self.name!r} has no lock manager: set app.conf.{CONFIG_KEY} (a lock "
                "manager or a URL), or the task's fence_manager option"
            )
        else:
            raise ConfigurationError(
                f"task {self.name!r}: a lock manager or a URL was expected, got {source!r}"
            )
        self._fence_resolved = (pid, manager)
        return manager

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Run the body under a lease on the resource its arguments name.

        Raises:
            celery.exceptions.Retry: the run is retried (see the class).
            ConfigurationError: see the class.
        """
        template = self._fence_template
        assert template is not None, "FencedTask.__init_subclass__ reads every task"
        resource = template.resource(args, kwargs)
        manager = self.fence_lock_manager()
        try:
            lease = manager.acquire(
                resource, ttl=self.fence_ttl, timeout=self.fence_timeout, renew=self.fence_renew
            )
        except AcquireTimeout as exc:
            self._fence_retry(exc)
        reset = _current.set(lease)
        try:
            result = self.run(*args, **kwargs)
        except BaseException as exc:  # a time limit or a worker's shutdown releases too
            _current.reset(reset)
            _release(lease, failed=True)
            if isinstance(exc, Exception) and is_retryable(exc):
                self._fence_retry(exc)
            raise
        _current.reset(reset)
        _release(lease, failed=False)
        return result

    def _fence_retry(self, exc: Exception) -> NoReturn:
        """Send the task back to the queue; raise ``Retry``, or ``exc`` past max_retries."""
        countdown = None
        backoff = getattr(self, "retry_backoff", False)
        if backoff:
            countdown = get_exponential_backoff_interval(
                factor=int(backoff),
                retries=self.request.retries,
                maximum=getattr(self, "retry_backoff_max", 600),
                full_jitter=getattr(self, "retry_jitter", True),
            )
        raise self.retry(exc=exc, countdown=countdown)


def _release(lease: Lease, *, failed: bool) -> None:
    try:
        lease.release()
    except NotOwnerError:
        # The lease ran out or was lost while the body ran. What the body wrote through
        # the guards was accepted (a stale write raises), so its outcome stands.
        _log.warning(
            "%r was no longer held when the task %s; its guarded writes stand",
            lease,
            "failed" if failed else "returned",
        )
