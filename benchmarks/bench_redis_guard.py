#!/usr/bin/env python3
"""How much a fenced Redis write costs next to a plain one, on a throwaway redis-server.

    python benchmarks/bench_redis_guard.py [--quick] [--repeats 7]

Compares, in one run and on one connection (sequential round trips over loopback), each
API called the way the docs show it, with the documented defaults and one write per call:

- ``SET``: a plain ``SET key value`` (the baseline);
- ``raw EVALSHA``: an ``EVALSHA`` of a script with the same keys and arguments that makes
  the same Redis calls as the fenced set (one ``GET``, one ``SET``) without any logic: the
  floor of any script-based fence;
- ``fenced set``: :meth:`RedisGuard.set` (validation, key layout, the fence check, events);
- ``fenced hset``: :meth:`RedisGuard.hset` of two fields vs a plain ``HSET`` of the same
  two fields;
- ten writes: a fenced batch of 10 (one script, all or nothing) vs 10 single fenced sets,
  and a fenced pipeline of 10 vs a pipeline of 10 plain ``SET`` s.

Each fenced write and its plain twin run through four kinds of client: ``redis.Redis``
built from a URL (the rows without a suffix) and by hand (``redis.Redis(host=, port=)``,
", hand-built client"), and the same two of ``redis.asyncio.Redis`` ("asyncio ..."). The
kinds differ in their defaults (redis-py 8 gives a hand-built client a socket timeout, a
URL-built one none), and so in what a call costs.

The variants of one kind are interleaved call by call; each repetition gives one ratio,
and the median is reported. The server's own time per command (``INFO commandstats``) is
recorded beside the fenced row, to show how much of the gap is spent inside Redis, and
the client's time to pack each command into bytes beside it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import _harness
import redis
import redis.asyncio
from _harness import Context, Row

from fence.adapters.redis import AsyncRedisGuard, RedisGuard

GROUP = "redis-guard"

#: The same Redis calls as a fenced set of an existing key, and the same reply, no logic.
TRIVIAL_LUA = """
redis.call('GET', KEYS[1])
redis.call('SET', KEYS[2], ARGV[7])
return 1
"""

TOKEN = 1_780_000_000_000_000

FIELDS = {"a": "v", "b": "w"}

#: name suffix -> how a client of that kind is built from the server's URL and port.
SYNC_KINDS: dict[str, Callable[[str, int], Any]] = {
    "": lambda url, _port: redis.Redis.from_url(url),
    ", hand-built client": lambda _url, port: redis.Redis(host="127.0.0.1", port=port),
}
ASYNC_KINDS: dict[str, Callable[[str, int], Any]] = {
    "": lambda url, _port: redis.asyncio.Redis.from_url(url),
    ", hand-built client": lambda _url, port: redis.asyncio.Redis(host="127.0.0.1", port=port),
}

#: (fenced write, its plain twin) of every kind, as row names without the kind's suffix.
PAIRS = [("fenced set", "SET"), ("fenced hset", "HSET")]
TEN_PAIRS = [("fenced pipeline x10", "pipelined SET x10")]


def client_pack_usec(client: redis.Redis, guard: RedisGuard, calls: int) -> dict[str, Any]:
    """The client's own microseconds to turn each command into bytes (no I/O): redis-py's
    packer for the plain ``SET``, the guard's for its ``EVALSHA``."""
    from fence.adapters._redis_lua import SET
    from fence.adapters._redis_ops import command, op_set
    from fence.adapters._redis_wire import pack_calls

    script, keys, argv = command(
        guard.layout, TOKEN, op_set("bench:fenced", "v", None, False), issuer=False
    )
    assert script is SET
    connection = client.connection_pool.get_connection()
    encoder = client.get_encoder()
    try:
        start = time.perf_counter()
        for _ in range(calls):
            connection.pack_command("SET", "bench:plain", "v")
        plain = (time.perf_counter() - start) / calls * 1e6
        start = time.perf_counter()
        for _ in range(calls):
            pack_calls(((script, keys, argv),), encoder)
        fenced = (time.perf_counter() - start) / calls * 1e6
        return {"SET": plain, "fenced set": fenced, "fenced set arguments": 3 + len(keys + argv)}
    finally:
        client.connection_pool.release(connection)


def _sync_variants(suffix: str, client: redis.Redis) -> tuple[dict[str, Any], dict[str, Any]]:
    """The single writes and the ten-write variants of one sync client kind."""
    guard = RedisGuard(client)
    guard.set("bench:fenced", "v", token=TOKEN)  # loads the script, sets the fence
    keys10 = [f"{{bench:b}}:k{i}" for i in range(10)]

    def fenced_pipeline_10() -> None:
        pipe = guard.pipeline()
        for key in keys10:
            pipe.set(key, "v", token=TOKEN)
        pipe.execute()

    def plain_pipeline_10() -> None:
        pipe = client.pipeline(transaction=False)
        for key in keys10:
            pipe.set(key, "v")
        pipe.execute()

    singles = {
        "SET" + suffix: lambda: client.set("bench:plain", "v"),
        "fenced set" + suffix: lambda: guard.set("bench:fenced", "v", token=TOKEN),
        "HSET" + suffix: lambda: client.hset("bench:plain-hash", mapping=FIELDS),
        "fenced hset" + suffix: lambda: guard.hset("bench:fenced-hash", FIELDS, token=TOKEN),
    }
    tens = {
        "pipelined SET x10" + suffix: plain_pipeline_10,
        "fenced pipeline x10" + suffix: fenced_pipeline_10,
    }
    return singles, tens


async def _async_variants(
    suffix: str, client: redis.asyncio.Redis
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The asyncio twin of :func:`_sync_variants`."""
    guard = AsyncRedisGuard(client)
    await guard.set("bench:fenced", "v", token=TOKEN)
    keys10 = [f"{{bench:b}}:k{i}" for i in range(10)]

    async def fenced_pipeline_10() -> None:
        pipe = guard.pipeline()
        for key in keys10:
            pipe.set(key, "v", token=TOKEN)
        await pipe.execute()

    async def plain_pipeline_10() -> None:
        pipe = client.pipeline(transaction=False)
        for key in keys10:
            pipe.set(key, "v")
        await pipe.execute()

    singles: dict[str, Callable[[], Awaitable[object]]] = {
        "asyncio SET" + suffix: lambda: client.set("bench:plain", "v"),
        "asyncio fenced set" + suffix: lambda: guard.set("bench:fenced", "v", token=TOKEN),
        "asyncio HSET" + suffix: lambda: client.hset("bench:plain-hash", mapping=FIELDS),
        "asyncio fenced hset" + suffix: lambda: guard.hset(
            "bench:fenced-hash", FIELDS, token=TOKEN
        ),
    }
    tens = {
        "asyncio pipelined SET x10" + suffix: plain_pipeline_10,
        "asyncio fenced pipeline x10" + suffix: fenced_pipeline_10,
    }
    return singles, tens


async def _collect_async(ctx: Context) -> dict[str, dict[str, list[float]]]:
    """Rates of the asyncio variants, per kind of client: singles, then ten-write ones."""
    server = ctx.servers.redis
    out: dict[str, dict[str, list[float]]] = {"singles": {}, "tens": {}}
    for suffix, build in ASYNC_KINDS.items():
        client = build(server.url, server.port)
        try:
            singles, tens = await _async_variants(suffix, client)
            out["singles"] |= await _harness.ainterleaved(
                singles,
                calls=ctx.n(3000, 200),
                repeats=ctx.repeats,
                warmup=ctx.n(200, 20),
            )
            out["tens"] |= await _harness.ainterleaved(
                tens,
                calls=ctx.n(300, 30),
                repeats=ctx.repeats,
                warmup=ctx.n(20, 3),
                per_call=10,
            )
        finally:
            await client.aclose()
    return out


def collect(ctx: Context) -> list[Row]:
    """Fenced vs plain writes; see the module docstring."""
    server = ctx.servers.redis
    singles: dict[str, list[float]] = {}
    tens: dict[str, list[float]] = {}
    clients = {suffix: build(server.url, server.port) for suffix, build in SYNC_KINDS.items()}
    client = clients[""]
    try:
        guard = RedisGuard(client)
        trivial = client.script_load(TRIVIAL_LUA)
        trivial_keys = ("fence:{bench:raw}:key:bench:raw", "bench:raw")
        trivial_args = (str(TOKEN), "1", "2", "set", "0", "2", "v", "")

        def raw_evalsha() -> None:
            client.evalsha(trivial, 2, *trivial_keys, *trivial_args)

        keys10 = [f"{{bench:b}}:k{i}" for i in range(10)]

        def batch_of_10() -> None:
            batch = guard.batch(TOKEN)
            for key in keys10:
                batch.set(key, "v")
            batch.execute()

        def singles_10() -> None:
            for key in keys10:
                guard.set(key, "v", token=TOKEN)

        for suffix, kind_client in clients.items():
            kind_singles, kind_tens = _sync_variants(suffix, kind_client)
            if not suffix:
                kind_singles["raw EVALSHA"] = raw_evalsha
                kind_tens["10 single fenced sets"] = singles_10
                kind_tens["fenced batch of 10 (one script)"] = batch_of_10
            singles |= _harness.interleaved(
                kind_singles,
                calls=ctx.n(3000, 200),
                repeats=ctx.repeats,
                warmup=ctx.n(200, 20),
            )
            tens |= _harness.interleaved(
                kind_tens,
                calls=ctx.n(300, 30),
                repeats=ctx.repeats,
                warmup=ctx.n(20, 3),
                per_call=10,
            )

        calls = ctx.n(5000, 300)
        # The top-level command's time includes the calls a script makes.
        server_usec = {
            name: _harness.redis_server_usec(client, fn, calls // 3)[command]
            for name, fn, command in (
                ("SET", lambda: client.set("bench:plain", "v"), "set"),
                ("raw EVALSHA", raw_evalsha, "evalsha"),
                ("fenced set", lambda: guard.set("bench:fenced", "v", token=TOKEN), "evalsha"),
                ("HSET", lambda: client.hset("bench:plain-hash", mapping=FIELDS), "hset"),
                (
                    "fenced hset",
                    lambda: guard.hset("bench:fenced-hash", FIELDS, token=TOKEN),
                    "evalsha",
                ),
            )
        }
        packing = client_pack_usec(client, guard, calls)
    finally:
        for kind_client in clients.values():
            kind_client.close()
    rated = asyncio.run(_collect_async(ctx))
    singles |= rated["singles"]
    tens |= rated["tens"]

    rows = _harness.rate_rows(
        GROUP,
        singles,
        "SET",
        ["fenced set", "raw EVALSHA"],
        unit="writes/s",
        prefix="redis: ",
        targets={"fenced set": 0.95},
        notes={
            "raw EVALSHA": "a script with the fenced set's two calls (GET, SET) and no logic: "
            "the floor of any fence done in Lua",
        },
    )
    rows[0].extra["server_usec_per_call"] = server_usec
    rows[0].extra["client_pack_usec_per_call"] = packing
    rows += _harness.rate_rows(
        GROUP, singles, "raw EVALSHA", ["fenced set"], unit="writes/s", prefix="redis: "
    )
    rows += _harness.rate_rows(
        GROUP,
        tens,
        "10 single fenced sets",
        ["fenced batch of 10 (one script)"],
        unit="writes/s",
        prefix="redis: ",
    )
    for flavor in ("", "asyncio "):
        for suffix in SYNC_KINDS:
            for pairs, rates in ((PAIRS, singles), (TEN_PAIRS, tens)):
                for fenced, plain in pairs:
                    name, base = flavor + fenced + suffix, flavor + plain + suffix
                    if name == "fenced set":
                        continue  # the first row, with the server's and the packer's times
                    rows += _harness.rate_rows(
                        GROUP,
                        rates,
                        base,
                        [name],
                        unit="writes/s",
                        prefix="redis: ",
                        targets={name: 0.95},
                    )
    return rows


if __name__ == "__main__":
    raise SystemExit(_harness.standalone(collect, __doc__))
