"""The SQL lock manager on PostgreSQL (psycopg 3) in the manager conformance suite.

Every test gets its own lease table in the session's cluster, created with the plain DDL
that users put in their migrations, and dropped at the end.
"""

from __future__ import annotations

import secrets
from typing import Any

import psycopg
import pytest

from fence._async.sql import AsyncSQLLockManager
from fence._sql_schema import lease_schema_ddl
from fence._sync.sql import SQLLockManager
from tests.registry import ManagerBackend, register_manager_backend
from tests.servers import PostgresServer


def _setup(request: pytest.FixtureRequest) -> tuple[str, str]:
    server: PostgresServer = request.getfixturevalue("postgres_server")
    url: str = request.getfixturevalue("postgres_url")
    table = f"fence_leases_{secrets.token_hex(4)}"
    with psycopg.connect(server.conninfo, autocommit=True) as conn:
        for statement in lease_schema_ddl("postgresql", table=table):
            conn.execute(statement)

    def drop() -> None:
        with psycopg.connect(server.conninfo, autocommit=True) as conn:
            conn.execute(f'DROP TABLE IF EXISTS "{table}", "{table}_shared"')

    request.addfinalizer(drop)
    return url, table


def _make(context: tuple[str, str], is_async: bool, **options: Any) -> Any:
    url, table = context
    cls = AsyncSQLLockManager if is_async else SQLLockManager
    return cls(url, table=table, **options)


register_manager_backend(ManagerBackend("postgres", _setup, _make, marks=(pytest.mark.postgres,)))
