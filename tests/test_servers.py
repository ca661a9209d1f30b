"""Smoke tests: the suite's servers are real and answer."""

from __future__ import annotations

import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import psycopg
import pymysql
import pytest
import redis

from tests.servers import OWNER_FILE, MariaDBServer, PostgresServer, RedisServer, reap_orphans


def test_redis_server_is_real(redis_server: RedisServer, redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    try:
        info = client.info("server")
        assert int(str(info["redis_version"]).split(".")[0]) >= 6
        assert info["tcp_port"] == redis_server.port
        assert client.set("smoke", "1")
        assert client.get("smoke") == b"1"
    finally:
        client.close()


def test_postgres_server_is_real(postgres_server: PostgresServer) -> None:
    with psycopg.connect(postgres_server.conninfo) as conn:
        version = conn.execute("SHOW server_version_num").fetchone()
        user = conn.execute("SELECT current_user").fetchone()
        row = conn.execute("SELECT setting FROM pg_settings WHERE name = 'port'").fetchone()
    assert version is not None
    assert int(version[0]) >= 120000
    assert user == ("postgres",)
    assert row is not None
    assert int(row[0]) == postgres_server.port


def test_postgres_does_not_run_as_root(postgres_server: PostgresServer) -> None:
    pid = int((postgres_server.data / "postmaster.pid").read_text().split()[0])
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    uid = int(next(line.split()[1] for line in status if line.startswith("Uid:")))
    assert uid != 0


def test_mariadb_server_is_real_and_not_root(mariadb_server: MariaDBServer) -> None:
    conn = pymysql.connect(
        host="127.0.0.1",
        port=mariadb_server.port,
        user=mariadb_server.USER,
        password=mariadb_server.PASSWORD,
    )
    try:
        with conn.cursor() as cursor:
            cursor.execute("SELECT VERSION(), @@port, @@tx_isolation, @@log_bin")
            version, port, isolation, log_bin = cursor.fetchone()
    finally:
        conn.close()
    assert "MariaDB" in version
    assert port == mariadb_server.port
    assert isolation == "REPEATABLE-READ"  # InnoDB's default, which the guards are proved on
    assert log_bin == 0
    pid = int((mariadb_server.dir / "mariadb.pid").read_text())
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    assert int(next(line.split()[1] for line in status if line.startswith("Uid:"))) != 0


def test_servers_of_a_dead_run_are_reaped() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    server = RedisServer().start()
    assert server.proc is not None
    (server.dir / OWNER_FILE).write_text(str(dead.pid))
    reaped = reap_orphans()
    assert str(server.dir) in reaped
    assert not server.dir.exists()
    assert server.proc.wait(timeout=10) == -signal.SIGKILL  # killed by the reaper
    server.proc = None


@pytest.mark.mariadb
def test_a_mariadb_server_of_a_dead_run_is_reaped() -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    server = MariaDBServer().start()
    assert server.proc is not None
    (server.dir / OWNER_FILE).write_text(str(dead.pid))
    assert str(server.dir) in reap_orphans()
    assert not server.dir.exists()
    server.proc.wait(timeout=30)  # runuser ends with the server the reaper killed
    server.proc = None


def test_live_runs_are_not_reaped(redis_server: RedisServer) -> None:
    assert str(redis_server.dir) not in reap_orphans()
    assert redis_server.dir.exists()


def test_a_mariadb_start_waits_for_its_socket_to_listen() -> None:
    """mariadbd listens on its TCP port before its Unix socket (which the set-up uses): a
    socket that is bound but does not listen yet is waited for, and one that never
    listens times out, instead of the set-up's connection being refused."""
    server = MariaDBServer()
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as bound:
            bound.bind(str(server.socket))  # as mariadbd between its bind and its listen
            with pytest.raises(TimeoutError):
                server._wait_for_socket(time.monotonic() + 0.3)
            listening: list[bool] = []

            def listen() -> None:
                listening.append(True)
                bound.listen()

            timer = threading.Timer(0.3, listen)
            timer.start()
            server._wait_for_socket(time.monotonic() + 60.0)
            assert listening  # it returned only once the socket listened
            timer.join()
    finally:
        server.destroy()
