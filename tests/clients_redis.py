"""Redis clients the guard must not send around: each keeps ``execute_command``.

The guard packs its own ``EVALSHA`` calls and sends them on a connection of a plain
client's pool (``adapters/_redis_wire.py``). A client class with an ``execute_command`` of
its own (an instrumentation, a tracing or metrics wrapper) must see every call instead,
and a fenced pipeline must be one of the client's pipelines: these subclasses count what
passes through either.
"""

from __future__ import annotations

from typing import Any

import redis
import redis.asyncio


class CountingRedis(redis.Redis):
    """A ``redis.Redis`` that counts the commands passing through ``execute_command``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commands: list[Any] = []

    def execute_command(self, *args: Any, **options: Any) -> Any:
        """Count the command, then run it as redis-py does."""
        self.commands.append(args[0])
        return super().execute_command(*args, **options)

    def pipeline(self, *args: Any, **kwargs: Any) -> Any:
        """Count the pipeline (its commands do not pass through ``execute_command``)."""
        self.commands.append("pipeline")
        return super().pipeline(*args, **kwargs)


class AsyncCountingRedis(redis.asyncio.Redis):
    """A ``redis.asyncio.Redis`` that counts the commands passing through
    ``execute_command``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commands: list[Any] = []

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        """Count the command, then run it as redis-py does."""
        self.commands.append(args[0])
        return await super().execute_command(*args, **options)

    def pipeline(self, *args: Any, **kwargs: Any) -> Any:
        """Count the pipeline (its commands do not pass through ``execute_command``)."""
        self.commands.append("pipeline")
        return super().pipeline(*args, **kwargs)


def counting_client(flavor: str, url: str, **options: Any) -> Any:
    """A counting client of ``flavor`` (``"sync"`` or ``"asyncio"``) for ``url``."""
    cls = AsyncCountingRedis if flavor == "asyncio" else CountingRedis
    return cls.from_url(url, **options)
