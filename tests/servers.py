"""The suite's throwaway real servers, and the reaping of those a dead run left behind.

The servers themselves (redis-server alone, as a Redis Cluster or behind a Sentinel, a
PostgreSQL cluster, a MariaDB server, three etcd members, three ZooKeeper servers) are the
ones ``fence chaos`` starts: :mod:`fence._chaos.servers` and :mod:`fence._chaos.clusters`,
re-exported here. Each runs on a free loopback port in a temporary directory and is stopped
at the end, with the faults tests cause for real: SIGKILL, SIGSTOP/SIGCONT, restart.
PostgreSQL, MariaDB and ZooKeeper never run as root: when the suite runs as root they run as
the ``postgres``, ``mysql`` and ``zookeeper`` OS users (created by the system packages).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
from pathlib import Path

from fence._chaos.clusters import PID_FILE, EtcdCluster, ZooKeeperEnsemble
from fence._chaos.servers import (
    MARIADB_PID_FILE,
    OWNER_FILE,
    REDIS_PID_FILE,
    MariaDBServer,
    PostgresServer,
    RedisClusterServers,
    RedisServer,
    SentinelSetup,
    claim_dir,
    free_port,
    wait_for_port,
)

__all__ = [
    "OWNER_FILE",
    "EtcdCluster",
    "MariaDBServer",
    "PostgresServer",
    "RedisClusterServers",
    "RedisServer",
    "SentinelSetup",
    "ZooKeeperEnsemble",
    "claim_dir",
    "flush_redis",
    "free_port",
    "reap_orphans",
    "wait_for_port",
]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def reap_orphans() -> list[str]:
    """Stop servers left behind by test runs that died (killed by a timeout, say).

    A server directory whose owner process is gone is stopped (PostgreSQL with an immediate
    shutdown, MariaDB, redis-server and the members of a consensus cluster with SIGKILL) and
    removed. Returns the directories reaped.
    """
    reaped = []
    for path in Path(tempfile.gettempdir()).glob("iofence-*"):
        owner = path / OWNER_FILE
        try:
            pid = int(owner.read_text())
        except (OSError, ValueError):
            continue
        if _alive(pid):
            continue
        pidfile = path / "data" / "postmaster.pid"
        if pidfile.exists():
            with contextlib.suppress(OSError, ValueError, IndexError):
                os.kill(int(pidfile.read_text().split()[0]), signal.SIGQUIT)
        mariadb_pid = path / MARIADB_PID_FILE
        if mariadb_pid.exists():
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(mariadb_pid.read_text()), signal.SIGKILL)
        redis_pid = path / REDIS_PID_FILE
        if redis_pid.exists():
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(redis_pid.read_text()), signal.SIGKILL)
        for member_pid in path.glob(f"*/{PID_FILE}"):  # etcd members, ZooKeeper servers
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(member_pid.read_text()), signal.SIGKILL)
        shutil.rmtree(path, ignore_errors=True)
        reaped.append(str(path))
    return reaped


def flush_redis(url: str) -> None:
    """Delete every key and cached script of the redis-server at ``url``."""
    import redis

    with redis.Redis.from_url(url) as client:
        client.flushall()
        client.script_flush()
