"""Pytest fixtures for the consensus clusters: three etcd members, three ZooKeeper servers.

Each cluster starts once per session, on first use (the JVMs and the raft elections cost
seconds, so no test starts its own). Before every test the cluster is healed: a member
that a fault test stopped or killed is resumed or started again from its data, and the
test waits for a leader. Tests do not share keys: every test gets a prefix (etcd) or a
root node (ZooKeeper) of its own, so nothing needs wiping.

The marker of each cluster (``etcd``, ``zookeeper``) is added to every test that uses its
fixtures, by ``tests/fix_servers.py``.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import pytest

from tests.proxy_zookeeper import ZooKeeperProxy
from tests.servers import EtcdCluster, ZooKeeperEnsemble


@pytest.fixture(scope="session")
def etcd_cluster() -> Iterator[EtcdCluster]:
    """Three etcd members for the whole session."""
    cluster = EtcdCluster().start()
    yield cluster
    cluster.stop()


@pytest.fixture
def etcd_url(etcd_cluster: EtcdCluster) -> str:
    """The session cluster's ``etcd://`` URL with a key prefix of the test's own; every
    member is running and a leader is elected."""
    etcd_cluster.heal()
    return f"{etcd_cluster.url}/t-{secrets.token_hex(4)}/"


@pytest.fixture(scope="session")
def zookeeper_ensemble() -> Iterator[ZooKeeperEnsemble]:
    """Three ZooKeeper servers for the whole session (as the ``zookeeper`` user if root)."""
    ensemble = ZooKeeperEnsemble().start()
    yield ensemble
    ensemble.stop()


@pytest.fixture
def zookeeper_url(zookeeper_ensemble: ZooKeeperEnsemble) -> str:
    """The session ensemble's ``zookeeper://`` URL with a root node of the test's own;
    every server is running and one leads."""
    zookeeper_ensemble.heal()
    return f"{zookeeper_ensemble.url}/t-{secrets.token_hex(4)}"


@pytest.fixture
def zookeeper_proxy(
    zookeeper_ensemble: ZooKeeperEnsemble, zookeeper_url: str
) -> Iterator[ZooKeeperProxy]:
    """A proxy of the test's own in front of the first server of the session ensemble
    (healed first), to drop replies or freeze the link; closed after the test."""
    proxy = ZooKeeperProxy(zookeeper_ensemble.hosts.split(",")[0])
    yield proxy
    proxy.close()
