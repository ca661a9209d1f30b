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
from collections.abc import Generator, Iterator

import pytest

from tests.proxy_zookeeper import ZooKeeperProxy
from tests.servers import EtcdCluster, ZooKeeperEnsemble


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """When a test that used a cluster fails, its report shows what each member was doing:
    its mode (ZooKeeper) and the end of its log. A request that no member answered, or an
    election nobody started, is told apart there."""
    report = yield
    if report.failed:
        # By marker, not by the test's fixtures: the conformance suites reach the clusters
        # through fixtures of their backends (request.getfixturevalue), which a test's
        # own fixture values do not list.
        for mark, cluster in list(_STARTED.items()):
            if item.get_closest_marker(mark) is not None:
                report.sections.append((f"{cluster.name} members ({call.when})", state(cluster)))
    return report


#: The clusters this process started, by marker name.
_STARTED: dict[str, ZooKeeperEnsemble | EtcdCluster] = {}


def state(cluster: ZooKeeperEnsemble | EtcdCluster) -> str:
    """Each member's pid, mode (ZooKeeper) and the end of its log."""
    parts = []
    for member in cluster.members:
        pid = member.proc.pid if member.proc is not None else None
        mode = cluster.mode(member.index) if isinstance(cluster, ZooKeeperEnsemble) else ""
        parts.append(
            f"-- member {member.index}: pid {pid}, running {member.running}, paused "
            f"{member.paused} {mode or ''}\n{cluster.tail(member.index, 3000)}"
        )
    return "\n".join(parts)


@pytest.fixture(scope="session")
def etcd_cluster() -> Iterator[EtcdCluster]:
    """Three etcd members for the whole session."""
    cluster = EtcdCluster().start()
    _STARTED["etcd"] = cluster
    yield cluster
    _STARTED.pop("etcd", None)
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
    _STARTED["zookeeper"] = ensemble
    yield ensemble
    _STARTED.pop("zookeeper", None)
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
