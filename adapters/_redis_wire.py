"""How the Redis guard puts its script calls on the wire. No I/O.

A fenced write is one ``EVALSHA``. Through ``execute_command`` redis-py spends more of the
client's time on the way to the socket than the script costs the server: it encodes every
argument, builds the command piece by piece, and wraps the call in layers a fenced write
does not need (a response callback lookup, per-command hooks). The guard packs its own
calls instead: the ``EVALSHA <sha> <numkeys>`` head once per call shape, the keys as the
bytes the key layout judged (``KeyLayout.wire_keys``, in the client's encoding, once per
key: :func:`client_encoding`), the other arguments with the client's own encoder, and sends
them on a connection of the client's own pool with the connection's own retry policy, as
``execute_command`` does (``adapters/_async/redis.py``, ``_round_trip``).

It does so only for the client kinds whose ``execute_command`` path it reproduces: a
``redis.Redis`` or ``redis.asyncio.Redis`` (or a subclass that overrides nothing on that
path) with a connection pool, no pinned single connection, no client-side cache, and
redis-py's own metrics and debug log (``redis.client`` at ``DEBUG``) off. Every other
client (a cluster client, a subclass or an instrumentation wrapper around
``execute_command``, a single-connection client) keeps ``execute_command``, one
``EVALSHA`` per write as before. A pipeline or a transaction is no client for a guard at
all: it would queue the call and hide its verdict (:func:`refuse_pipeline`).
"""

from __future__ import annotations

import inspect
import logging
import types
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import redis
import redis.asyncio
import redis.asyncio.client
import redis.asyncio.cluster
import redis.client
import redis.cluster

from fence import ConfigurationError
from fence._lua import Script

__all__ = [
    "PIPELINES",
    "RAISE_UNLISTED",
    "Wire",
    "client_encoding",
    "pack_calls",
    "refuse_pipeline",
    "takes_command_name",
]

#: redis-py's pipelines and transactions (``MULTI``/``EXEC``), standalone and cluster, sync
#: and asyncio. A command sent on one is queued and answered only by its ``execute()``.
PIPELINES: tuple[type, ...] = (
    redis.client.Pipeline,
    redis.asyncio.client.Pipeline,
    redis.cluster.ClusterPipeline,
    redis.asyncio.cluster.ClusterPipeline,
)


def client_encoding(client: Any) -> tuple[str, str]:
    """The encoding in which ``client`` sends a ``str``, and its error policy: redis-py's
    ``encoding`` and ``encoding_errors``, from the client's encoder (its pool's, or a
    cluster client's own), which every connection of the client shares."""
    encoder = client.get_encoder()
    return encoder.encoding, encoder.encoding_errors


def refuse_pipeline(client: object, guard: str) -> None:
    """Refuse a pipeline or a transaction as a guard's client, before any I/O.

    On a pipeline the guard's ``EVALSHA`` would only be queued: the write method would
    return before the script ran (a stale ``set`` returned ``None``, as an accepted one
    does), and the verdict would come back as a raw reply of the pipeline's
    ``execute()``, which the guard never reads and the caller cannot tell from a result.
    Nothing sound can be returned at the call, so the client is refused instead; the
    guard's own :meth:`pipeline` and :meth:`batch` send several fenced writes in one round
    trip with a verdict for each.

    Args:
        client: the client the guard was given.
        guard: the guard class's name, for the message.

    Raises:
        ConfigurationError: ``client`` is one of :data:`PIPELINES` (or a subclass).
    """
    if isinstance(client, PIPELINES):
        raise ConfigurationError(
            f"{guard} needs a Redis client, not a {type(client).__name__}: a command sent on"
            " a pipeline or a transaction is only queued, so the guard would never see the"
            " script's verdict (a stale write would return None, its refusal left unread in"
            " the pipeline's execute()). Give the guard the client the pipeline came from;"
            " for several fenced writes in one round trip use guard.pipeline() (each write"
            " with its own token and verdict) or guard.batch(token) (all or nothing in one"
            " script, where you would use MULTI/EXEC)."
        )


#: The methods ``execute_command`` runs through, in the redis-py versions the guard
#: supports. A client class whose copy of any of them is not redis-py's own keeps the
#: generic path: whatever it adds (logging, tracing, metrics) still sees every call.
_PATH = ("execute_command", "_execute_command", "_send_command_parse_response", "parse_response")


def _redis_py_own(cls: type) -> dict[str, Any] | None:
    """``cls``'s methods on the ``execute_command`` path, or ``None`` if any is wrapped."""
    found = {}
    for name in _PATH:
        method = inspect.getattr_static(cls, name, None)
        if method is None:
            continue
        if type(method) is not types.FunctionType or hasattr(method, "__wrapped__"):
            return None  # instrumented before this module was imported: never go around it
        found[name] = method
    return found


_OWN: dict[type, dict[str, Any] | None] = {
    redis.Redis: _redis_py_own(redis.Redis),
    redis.asyncio.Redis: _redis_py_own(redis.asyncio.Redis),
}


def _plain_execute(client: object) -> Any:
    """The ``execute_command`` of ``client``'s class if its whole path is redis-py's own."""
    cls = type(client)
    own = next((own for base, own in _OWN.items() if isinstance(client, base)), None)
    if own is None:
        return None
    for name, method in own.items():
        if inspect.getattr_static(cls, name, None) is not method:
            return None
    return own["execute_command"]


def _find_observability() -> Callable[[], Any] | None:
    try:  # redis-py 7.2 and later
        from redis.observability.providers import get_observability_instance
    except ImportError:
        return None
    return get_observability_instance


_OBSERVABILITY = _find_observability()

_CLIENT_LOG = logging.getLogger("redis.client")


def _metrics_on() -> bool:
    """Whether redis-py's own metrics are on: its ``execute_command`` records every call."""
    return _OBSERVABILITY is not None and bool(_OBSERVABILITY().is_enabled())


#: redis-py before 6.0 repeats a command after a connection error only if the error's
#: class is in the connection's ``retry_on_error``; later versions leave it to the
#: connection's ``Retry``. The guard follows the version it runs on.
RAISE_UNLISTED = hasattr(redis.Redis, "_disconnect_raise")

_NAMED: dict[type, bool] = {}


def takes_command_name(pool: object) -> bool:
    """Whether ``pool.get_connection`` requires a command name (redis-py before 5.3).

    Later versions take none, and warn when given one.
    """
    cls = type(pool)
    named = _NAMED.get(cls)
    if named is None:
        parameter = inspect.signature(cls.get_connection).parameters.get("command_name")  # type: ignore[attr-defined]
        named = parameter is not None and parameter.default is inspect.Parameter.empty
        _NAMED[cls] = named
    return named


class Wire:
    """How one guard sends its calls through one client.

    Args:
        client: the guard's redis-py client.
    """

    __slots__ = ("_encoder", "_execute", "_log", "_pool")

    def __init__(self, client: object) -> None:
        single = getattr(client, "single_connection_client", False) or getattr(
            client, "_single_connection_client", False
        )
        self._execute = None if single else _plain_execute(client)
        # redis-py's sync client logs every failed call at DEBUG level on that logger.
        self._log = _CLIENT_LOG if isinstance(client, redis.Redis) else None
        self._pool: Any = None
        self._encoder: Any = None

    def pool(self, client: Any) -> Any:
        """The pool to send on directly, or ``None`` for ``execute_command``.

        Checked on every call: an instrumentation installed after the guard was built, a
        connection pinned by the client, redis-py's metrics or its debug log turned on,
        each sends the guard back to ``execute_command``.
        """
        execute = self._execute
        if execute is None or type(client).execute_command is not execute:
            return None
        if self._log is not None and self._log.isEnabledFor(logging.DEBUG):
            return None
        if client.connection is not None:
            return None
        pool = client.connection_pool
        if getattr(pool, "cache", None) is not None or _metrics_on():
            return None
        if pool is not self._pool:
            self._encoder = pool.get_encoder()
            self._pool = pool
        return pool

    def pack(self, calls: Iterable[tuple[Script, Sequence[Any], Sequence[Any]]]) -> list[Any]:
        """The bytes of ``EVALSHA`` calls, encoded as the last :meth:`pool`'s client would.

        Raises:
            redis.exceptions.DataError: an argument redis-py cannot encode (``None``, a
                ``bool``, a ``dict``, ...), as ``execute_command`` would.
        """
        return pack_calls(calls, self._encoder)


#: redis-py's default buffer cutoff: an argument above it is sent as a chunk of its own,
#: never copied into the command's buffer.
_CUTOFF = 6000

#: ``$<n>``, the length line of a bulk string without its CRLF, for the common sizes.
_LENGTHS = [b"$%d" % size for size in range(256)]

_HEADS: dict[tuple[str, int, int], bytes] = {}


def _head(script: Script, arity: int, numkeys: int) -> bytes:
    """``*<n> EVALSHA <sha> <numkeys>`` in RESP without the last CRLF, built once per call
    shape."""
    shape = (script.sha, arity, numkeys)
    head = _HEADS.get(shape)
    if head is None:
        if len(_HEADS) >= 4096:
            _HEADS.clear()
        count = b"%d" % numkeys
        head = b"*%d\r\n$7\r\nEVALSHA\r\n$40\r\n%s\r\n$%d\r\n%s" % (
            arity + 3,
            script.sha.encode(),
            len(count),
            count,
        )
        _HEADS[shape] = head
    return head


def pack_calls(
    calls: Iterable[tuple[Script, Sequence[Any], Sequence[Any]]], encoder: Any
) -> list[Any]:
    """Pack ``EVALSHA`` calls (script, keys, argv) into RESP, as redis-py's packer would.

    Arguments are encoded by ``encoder`` (a redis-py ``Encoder``): ``bytes`` pass as they
    are, ``str`` is encoded with the client's encoding, anything else goes through
    ``encoder.encode`` (numbers; ``DataError`` for what redis-py refuses). Small arguments
    share one buffer, joined once; a large one or a ``memoryview`` is a chunk of its own.

    Returns:
        The chunks to send, in order.
    """
    encoding, errors, encode = encoder.encoding, encoder.encoding_errors, encoder.encode
    lengths, crlf = _LENGTHS, b"\r\n"
    out: list[Any] = []
    # Every element is followed by a CRLF: the pieces are joined by it once at the end.
    pieces: list[Any] = []
    for script, keys, argv in calls:
        pieces.append(_head(script, len(keys) + len(argv), len(keys)))
        for part in (keys, argv):
            for arg in part:
                kind = type(arg)
                if kind is str:
                    data = arg.encode(encoding, errors)
                elif kind is bytes:
                    data = arg
                else:
                    data = encode(arg)
                    if type(data) is memoryview:  # sent as it is, as redis-py does
                        pieces += (b"$%d" % data.nbytes, b"")
                        out += (crlf.join(pieces), data)
                        pieces = [b""]
                        continue
                size = len(data)
                if size < 256:
                    pieces += (lengths[size], data)
                elif size <= _CUTOFF:
                    pieces += (b"$%d" % size, data)
                else:
                    pieces += (b"$%d" % size, b"")
                    out += (crlf.join(pieces), data)
                    pieces = [b""]
    pieces.append(b"")
    out.append(crlf.join(pieces))
    return out
