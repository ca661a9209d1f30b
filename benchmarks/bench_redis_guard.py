#!/usr/bin/env python3
"""How much a fenced write costs next to a plain one, on a throwaway redis-server.

    python benchmarks/bench_redis_guard.py [--ops 3000] [--repeat 15]

Compares, in one run and on one connection (sequential round trips over loopback):

- ``SET``: a plain ``SET key value`` (the baseline);
- ``EVALSHA trivial``: a raw ``EVALSHA`` of a script with the same keys and arguments that
  makes the same Redis calls as the fenced set (one ``GET``, one ``SET``) without any
  logic: the floor of any script-based fence;
- ``fenced set``: :meth:`RedisGuard.set` (validation, key layout, the fence check, events);
- and the same for 100-write pipelines: plain ``SET`` vs :class:`FencedPipeline`.

The single writes are interleaved call by call, ``--ops`` rounds per repetition; each
variant's median throughput over ``--repeat`` repetitions is reported with its ratio to
the baseline. Numbers vary with the machine; the ratios are what matter.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import redis

from fence.adapters.redis import RedisGuard
from tests.servers import RedisServer

TRIVIAL_LUA = """
redis.call('GET', KEYS[1])
redis.call('SET', KEYS[2], ARGV[7])
return {1, 1}
"""


def measure(fn: Callable[[int], None], ops: int) -> float:
    """Run ``fn`` ``ops`` times; return operations per second."""
    start = time.perf_counter()
    for i in range(ops):
        fn(i)
    return ops / (time.perf_counter() - start)


def interleaved(variants: dict[str, Callable[[int], None]], ops: int) -> dict[str, float]:
    """Run the variants one call each in turn, ``ops`` rounds; return each one's ops/s.

    On a shared machine the load changes from second to second; interleaving call by call
    gives every variant the same conditions, so the ratios hold even when the absolute
    numbers move.
    """
    clock = time.perf_counter_ns
    spent = dict.fromkeys(variants, 0)
    items = list(variants.items())
    for i in range(ops):
        shift = i % len(items)
        for name, fn in items[shift:] + items[:shift]:
            start = clock()
            fn(i)
            spent[name] += clock() - start
    return {name: ops * 1e9 / ns for name, ns in spent.items()}


def main() -> int:
    """Run the benchmark and print a table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", type=int, default=3000, help="writes per repetition")
    parser.add_argument("--repeat", type=int, default=15, help="repetitions per variant")
    args = parser.parse_args()

    server = RedisServer().start()
    client = redis.Redis(port=server.port)
    try:
        guard = RedisGuard(client)
        trivial = client.script_load(TRIVIAL_LUA)
        token = 1_780_000_000_000_000
        guard.set("bench:fenced", "v", token=token)  # loads the script, sets the fence
        trivial_keys = ("fence:{bench:raw}:key:bench:raw", "bench:raw")
        trivial_args = (str(token), "1", "2", "set", "0", "2", "v", "")

        def plain_set(i: int) -> None:
            client.set("bench:plain", "v")

        def raw_evalsha(i: int) -> None:
            client.evalsha(trivial, 2, *trivial_keys, *trivial_args)

        def fenced_set(i: int) -> None:
            guard.set("bench:fenced", "v", token=token)

        batch = 100

        def plain_pipeline(i: int) -> None:
            pipe = client.pipeline(transaction=False)
            for _ in range(batch):
                pipe.set("bench:plain", "v")
            pipe.execute()

        def fenced_pipeline(i: int) -> None:
            pipe = guard.pipeline()
            for _ in range(batch):
                pipe.set("bench:fenced", "v", token=token)
            pipe.execute()

        singles = {"SET": plain_set, "EVALSHA trivial": raw_evalsha, "fenced set": fenced_set}
        pipes = {"pipelined SET x100": plain_pipeline, "fenced pipeline x100": fenced_pipeline}
        results: dict[str, list[float]] = {name: [] for name in (*singles, *pipes)}
        for fn in (*singles.values(), *pipes.values()):  # warm up
            measure(fn, 200 if fn in singles.values() else 5)
        for _ in range(args.repeat):
            for name, rate in interleaved(singles, args.ops).items():
                results[name].append(rate)
            for name, fn in pipes.items():
                results[name].append(measure(fn, max(1, args.ops // batch)) * batch)

        print(
            f"redis-server {client.info('server')['redis_version']}, redis-py {redis.__version__}"
        )
        print(f"{args.ops} sequential writes per repetition, median of {args.repeat}\n")
        print(f"{'variant':<22} {'writes/s':>10} {'vs SET':>8} {'vs EVALSHA':>11}")
        base = statistics.median(results["SET"])
        floor = statistics.median(results["EVALSHA trivial"])
        pipe_base = statistics.median(results["pipelined SET x100"])
        for name, samples in results.items():
            median = statistics.median(samples)
            ref = pipe_base if name in pipes else base
            print(f"{name:<22} {median:>10,.0f} {median / ref:>7.2f}x {median / floor:>10.2f}x")
    finally:
        client.close()
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
