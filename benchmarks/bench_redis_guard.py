#!/usr/bin/env python3
"""How much a fenced Redis write costs next to a plain one, on a throwaway redis-server.

    python benchmarks/bench_redis_guard.py [--quick] [--repeats 7]

Compares, in one run and on one connection (sequential round trips over loopback):

- ``SET``: a plain ``SET key value`` (the baseline);
- ``raw EVALSHA``: an ``EVALSHA`` of a script with the same keys and arguments that makes
  the same Redis calls as the fenced set (one ``GET``, one ``SET``) without any logic: the
  floor of any script-based fence;
- ``fenced set``: :meth:`RedisGuard.set` (validation, key layout, the fence check, events);
- ``fenced hset``: :meth:`RedisGuard.hset` of two fields (the general write script) vs a
  plain ``HSET`` of the same two fields;
- ten writes: a fenced batch of 10 (one script, all or nothing) vs 10 single fenced sets,
  and a fenced pipeline of 10 vs a pipeline of 10 plain ``SET`` s.

The single writes are interleaved call by call; each repetition gives one ratio, and the
median is reported. The server's own time per command (``INFO commandstats``) is recorded
beside the fenced row, to show how much of the gap is spent inside Redis.
"""

from __future__ import annotations

import time

import _harness
import redis
from _harness import Context, Row

from fence.adapters.redis import RedisGuard

GROUP = "redis-guard"

#: The same Redis calls as a fenced set of an existing key, and the same reply, no logic.
TRIVIAL_LUA = """
redis.call('GET', KEYS[1])
redis.call('SET', KEYS[2], ARGV[7])
return 1
"""

TOKEN = 1_780_000_000_000_000


def client_pack_usec(client: redis.Redis, guard: RedisGuard, sha: str, calls: int) -> dict:
    """redis-py's own microseconds to turn each command into bytes (no I/O)."""
    from fence.adapters._redis_lua import WRITE, encode, op_set
    from fence.adapters.redis import WRITE_LUA  # noqa: F401 - the script the guard sends

    keys, argv = encode(
        guard.layout,
        TOKEN,
        (op_set("bench:fenced", "v", None, False),),
        issuer=False,
        one_slot=False,
    )
    connection = client.connection_pool.get_connection()
    try:
        commands = {
            "SET": ("SET", "bench:plain", "v"),
            "fenced set": ("EVALSHA", WRITE.sha, len(keys), *keys, *argv),
        }
        out = {}
        for name, args in commands.items():
            start = time.perf_counter()
            for _ in range(calls):
                connection.pack_command(*args)
            out[name] = (time.perf_counter() - start) / calls * 1e6
        out["fenced set arguments"] = len(commands["fenced set"])
        return out
    finally:
        client.connection_pool.release(connection)


def collect(ctx: Context) -> list[Row]:
    """Fenced vs plain writes; see the module docstring."""
    client = redis.Redis.from_url(ctx.servers.redis.url)
    try:
        guard = RedisGuard(client)
        trivial = client.script_load(TRIVIAL_LUA)
        guard.set("bench:fenced", "v", token=TOKEN)  # loads the script, sets the fence
        trivial_keys = ("fence:{bench:raw}:key:bench:raw", "bench:raw")
        trivial_args = (str(TOKEN), "1", "2", "set", "0", "2", "v", "")

        def plain_set() -> None:
            client.set("bench:plain", "v")

        def raw_evalsha() -> None:
            client.evalsha(trivial, 2, *trivial_keys, *trivial_args)

        def fenced_set() -> None:
            guard.set("bench:fenced", "v", token=TOKEN)

        fields = {"a": "v", "b": "w"}

        def plain_hset() -> None:
            client.hset("bench:plain-hash", mapping=fields)

        def fenced_hset() -> None:
            guard.hset("bench:fenced-hash", fields, token=TOKEN)

        singles = _harness.interleaved(
            {
                "SET": plain_set,
                "raw EVALSHA": raw_evalsha,
                "fenced set": fenced_set,
                "HSET": plain_hset,
                "fenced hset": fenced_hset,
            },
            calls=ctx.n(3000, 200),
            repeats=ctx.repeats,
            warmup=ctx.n(200, 20),
        )

        keys10 = [f"{{bench:b}}:k{i}" for i in range(10)]

        def batch_of_10() -> None:
            batch = guard.batch(TOKEN)
            for key in keys10:
                batch.set(key, "v")
            batch.execute()

        def singles_10() -> None:
            for key in keys10:
                guard.set(key, "v", token=TOKEN)

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

        tens = _harness.interleaved(
            {
                "10 single fenced sets": singles_10,
                "fenced batch of 10 (one script)": batch_of_10,
                "pipelined SET x10": plain_pipeline_10,
                "fenced pipeline x10": fenced_pipeline_10,
            },
            calls=ctx.n(300, 30),
            repeats=ctx.repeats,
            warmup=ctx.n(20, 3),
            per_call=10,
        )

        calls = ctx.n(5000, 300)
        # The top-level command's time includes the calls a script makes.
        server = {
            name: _harness.redis_server_usec(client, fn, calls // 3)[command]
            for name, fn, command in (
                ("SET", plain_set, "set"),
                ("raw EVALSHA", raw_evalsha, "evalsha"),
                ("fenced set", fenced_set, "evalsha"),
            )
        }
        packing = client_pack_usec(client, guard, trivial, calls)
    finally:
        client.close()

    rows = _harness.rate_rows(
        GROUP,
        singles,
        "SET",
        ["fenced set", "raw EVALSHA"],
        unit="writes/s",
        prefix="redis: ",
        targets={"fenced set": 0.9},
        notes={
            "raw EVALSHA": "a script with the fenced set's two calls (GET, SET) and no logic: "
            "the floor of any fence done in Lua",
        },
    )
    rows[0].extra["server_usec_per_call"] = server
    rows[0].extra["client_pack_usec_per_call"] = packing
    rows += _harness.rate_rows(
        GROUP, singles, "raw EVALSHA", ["fenced set"], unit="writes/s", prefix="redis: "
    )
    rows += _harness.rate_rows(
        GROUP, singles, "HSET", ["fenced hset"], unit="writes/s", prefix="redis: "
    )
    rows += _harness.rate_rows(
        GROUP,
        tens,
        "10 single fenced sets",
        ["fenced batch of 10 (one script)"],
        unit="writes/s",
        prefix="redis: ",
    )
    rows += _harness.rate_rows(
        GROUP, tens, "pipelined SET x10", ["fenced pipeline x10"], unit="writes/s", prefix="redis: "
    )
    return rows


if __name__ == "__main__":
    raise SystemExit(_harness.standalone(collect, __doc__))
