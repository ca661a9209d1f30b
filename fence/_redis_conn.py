"""The redis-py clients of the managers and guards: which server a client names, and which
connection errors a call may be sent again after. No I/O.

A pooled connection that the server closed while it sat idle (a restart, a failover, an
idle ``timeout``, ``CLIENT KILL``) fails the next command sent on it. Whether redis-py then
reconnects and sends the command again depends on its version and the client's settings:
redis-py 6 and later retry connection errors by default, redis-py 5 does not, and a client
built with ``retry=Retry(NoBackoff(), 0)`` never does. The guards and the managers do not
rely on either: a call that is safe to repeat with the same arguments is sent once more
after such an error, on a new connection, by the guard or manager itself.

"Safe to repeat" is a property of the call, not of the error: the error cannot tell
whether the command reached a server that then died before replying.
"""

from __future__ import annotations

from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError

__all__ = ["closed_connection", "describe_client"]


def describe_client(client: Any) -> str:
    """``host:port/db`` of a redis-py client, without its password."""
    kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", None)
    if isinstance(kwargs, dict):
        if kwargs.get("path"):
            return f"unix:{kwargs['path']}"
        if kwargs.get("host"):
            where = f"{kwargs['host']}:{kwargs.get('port', 6379)}"
            db = kwargs.get("db") or 0
            return where if not db else f"{where}/{db}"
    get_nodes = getattr(client, "get_nodes", None)
    if callable(get_nodes):
        nodes = get_nodes()
        if nodes:
            return "cluster " + ",".join(f"{n.host}:{n.port}" for n in nodes[:3])
    return type(client).__name__


def closed_connection(err: BaseException) -> bool:
    """Whether ``err`` is a connection error on a connection that had been open.

    ``True`` for a connection the server closed or reset while redis-py read from it or
    wrote to it; ``False`` for a failure to connect at all (the server is down: sending
    again would fail the same way, after the client's own retries, if any), for a
    server's state (``LOADING`` is a ``ConnectionError`` in redis-py too), for an empty
    pool, and for every other error, timeouts included (a timeout says nothing about
    whether the command ran).

    Args:
        err: an exception raised by redis-py.
    """
    if not isinstance(err, RedisConnectionError):
        return False
    text = str(err)
    return any(words in text for words in _CLOSED)


#: How redis-py words an error on an open connection, in every version from 5.0 on, sync
#: and asyncio, with and without hiredis.
_CLOSED = ("Connection closed by server", "while reading from", "while writing to socket")
