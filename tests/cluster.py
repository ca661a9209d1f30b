"""A throwaway Redis Cluster for the tests: three masters on loopback, no replicas.

Each node is a :class:`tests.servers.RedisServer` started with ``--cluster-enabled yes`` in
its own temporary directory, with an explicit cluster bus port (the default, port + 10000,
can pass 65535 for an ephemeral port). ``CLUSTER ADDSLOTSRANGE`` and ``CLUSTER MEET`` join
them, as ``redis-cli --cluster create`` would.
"""

from __future__ import annotations

import time

import redis

from tests.servers import RedisServer, free_port


class RedisClusterServers:
    """Three ``redis-server`` masters joined into one cluster.

    Args:
        masters: how many masters (at least 3, as ``redis-cli --cluster create`` requires).
    """

    def __init__(self, masters: int = 3) -> None:
        # The cluster bus listens on its own port (by default port + 10000, which can pass
        # 65535 for an ephemeral port), so each node gets a free one explicitly.
        self.nodes = []
        self._bus: dict[int, int] = {}
        for _ in range(masters):
            bus = free_port()
            node = RedisServer(
                "--cluster-enabled", "yes",
                "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", "2000",
                "--cluster-port", str(bus),
            )  # fmt: skip
            self._bus[node.port] = bus
            self.nodes.append(node)

    @property
    def ports(self) -> list[int]:
        """The nodes' ports."""
        return [node.port for node in self.nodes]

    @property
    def url(self) -> str:
        """A URL of one node; cluster clients discover the others."""
        return self.nodes[0].url

    def start(self) -> RedisClusterServers:
        """Start every node, join them, split the slots, wait until every node says ``ok``."""
        for node in self.nodes:
            node.start()
        clients = [redis.Redis(host="127.0.0.1", port=port) for port in self.ports]
        try:
            per_node = 16384 // len(clients)
            for index, client in enumerate(clients):
                first = index * per_node
                last = 16383 if index == len(clients) - 1 else first + per_node - 1
                client.execute_command("CLUSTER ADDSLOTSRANGE", first, last)
            head = clients[0]
            for node in self.nodes[1:]:
                head.execute_command("CLUSTER MEET", "127.0.0.1", node.port, self._bus[node.port])
            end = time.monotonic() + 30
            for client in clients:
                while client.cluster("INFO").get("cluster_state") != "ok":
                    if time.monotonic() > end:
                        raise TimeoutError("the test cluster never reached state ok")
                    time.sleep(0.05)
        finally:
            for client in clients:
                client.close()
        return self

    def stop(self) -> None:
        """Kill every node and remove their directories."""
        for node in self.nodes:
            node.stop()
