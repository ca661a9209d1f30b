"""The SQL lock manager on MariaDB (PyMySQL, aiomysql for asyncio) in the manager
conformance suite.

Every test gets a database of its own on the session's server (the ``mariadb_url``
fixture), whose lease tables are created with the plain DDL users put in their migrations.
"""

from __future__ import annotations

from typing import Any

import pytest
from sqlalchemy.engine import make_url

from fence._async.sql import AsyncSQLLockManager
from fence._sql_schema import lease_schema_ddl
from fence._sync.sql import SQLLockManager
from tests.registry import ManagerBackend, register_manager_backend


def _setup(request: pytest.FixtureRequest) -> str:
    import pymysql

    url: str = request.getfixturevalue("mariadb_url")
    parsed = make_url(url)
    conn = pymysql.connect(
        host=parsed.host,
        port=parsed.port,
        user=parsed.username,
        password=parsed.password,
        database=parsed.database,
        autocommit=True,
    )
    try:
        with conn.cursor() as cursor:
            for statement in lease_schema_ddl("mariadb"):
                cursor.execute(statement)
    finally:
        conn.close()
    return url


def _make(url: str, is_async: bool, **options: Any) -> Any:
    if is_async:
        return AsyncSQLLockManager(url.replace("+pymysql", "+aiomysql"), **options)
    return SQLLockManager(url, **options)


register_manager_backend(ManagerBackend("mariadb", _setup, _make, marks=(pytest.mark.mariadb,)))
