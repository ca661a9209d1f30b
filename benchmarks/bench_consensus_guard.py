#!/usr/bin/env python3
"""The etcd and ZooKeeper guards against the plain write they replace, in one run.

    python benchmarks/bench_consensus_guard.py [--quick] [--repeats 7]

Starts a 3-member etcd cluster and a 3-server ZooKeeper ensemble on loopback
(``tests.servers``) and measures, interleaved, writes per second of one process on one
key or node:

1. a fenced etcd ``put`` (one transaction: the fence compared, data and fence written)
   against a plain ``put`` of the same key, over the same HTTP client;
2. a fenced ZooKeeper ``set`` (one multi-operation: the fence node written at the version
   the guard saw, and the data) against a plain ``set_data`` of the same node, on the same
   session.

Both fenced writes are one round trip, as the plain ones; the target is 0.9.
"""

from __future__ import annotations

from typing import Any

import _harness
from _harness import Context, Row

from fence._etcd import b64
from fence.adapters.etcd import EtcdGuard
from fence.adapters.zookeeper import ZooKeeperGuard

GROUP = "consensus-guard"
ETCD_BASELINE = "etcd put"
ZOOKEEPER_BASELINE = "ZooKeeper set_data"
TARGET = 0.9


def write_rates(ctx: Context) -> dict[str, list[float]]:
    """Writes per second of each variant, per repetition."""
    etcd = EtcdGuard(ctx.servers.etcd.url + "/bench-guard/")
    zookeeper = ZooKeeperGuard(ctx.servers.zookeeper.url + "/bench-guard")
    try:
        value = b"x" * 64
        plain_key = b64(b"bench/guard/plain")
        body = {"key": plain_key, "value": b64(value)}
        call: Any = etcd.driver._call
        token = 1
        etcd.put("bench/guard/fenced", value, token=token)
        zookeeper.create("/bench/guard/fenced", value, token=token)
        zookeeper.create("/bench/guard/plain", value, token=token)
        client = zookeeper.driver._client

        def etcd_plain() -> None:
            call("/v3/kv/put", body, "put", safe=True)

        def etcd_fenced() -> None:
            etcd.put("bench/guard/fenced", value, token=token)

        def zookeeper_plain() -> None:
            client.set("/bench/guard/plain", value)

        def zookeeper_fenced() -> None:
            zookeeper.set("/bench/guard/fenced", value, token=token)

        return _harness.interleaved(
            {
                ETCD_BASELINE: etcd_plain,
                "iofence etcd fenced put": etcd_fenced,
                ZOOKEEPER_BASELINE: zookeeper_plain,
                "iofence ZooKeeper fenced set": zookeeper_fenced,
            },
            calls=ctx.n(400, 40),
            batch=10,
            repeats=ctx.repeats,
            warmup=ctx.n(40, 5),
        )
    finally:
        etcd.close()
        zookeeper.close()


def collect(ctx: Context) -> list[Row]:
    """Fenced against plain writes on etcd and ZooKeeper; see the module docstring."""
    with _harness.timer(ctx, "consensus guards: fenced vs plain writes"):
        rates = write_rates(ctx)
    rows = _harness.rate_rows(
        GROUP,
        rates,
        ETCD_BASELINE,
        ["iofence etcd fenced put"],
        unit="writes/s",
        targets={"iofence etcd fenced put": TARGET},
        notes={"iofence etcd fenced put": "one transaction: compare the fence key, put both"},
    )
    rows += _harness.rate_rows(
        GROUP,
        rates,
        ZOOKEEPER_BASELINE,
        ["iofence ZooKeeper fenced set"],
        unit="writes/s",
        targets={"iofence ZooKeeper fenced set": TARGET},
        notes={
            "iofence ZooKeeper fenced set": "one multi-operation: the fence node at its "
            "version, and the data"
        },
    )
    return rows


if __name__ == "__main__":
    raise SystemExit(_harness.standalone(collect, __doc__))
