"""The SQL lock manager on SQLite in the manager conformance suite: a database file, and an
in-memory database shared through one StaticPool engine."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine
from sqlalchemy.pool import StaticPool

from fence._async.sql import AsyncSQLLockManager
from fence._sql_schema import lease_schema_ddl
from fence._sync.sql import SQLLockManager
from tests.registry import ManagerBackend, register_manager_backend
from tests.sqlite_files import sqlite_file


def _setup_file(request: pytest.FixtureRequest) -> str:
    tmp_path: Path = request.getfixturevalue("tmp_path")
    path = tmp_path / "locks.db"
    with sqlite_file(path) as conn:
        for statement in lease_schema_ddl("sqlite"):
            conn.execute(statement)
    return f"sqlite:///{path}"


def _make_file(url: str, is_async: bool, **options: Any) -> Any:
    cls = AsyncSQLLockManager if is_async else SQLLockManager
    return cls(url, **options)


class _MemoryDatabase:
    """One in-memory database for every manager of a test, created by the first one."""

    def __init__(self, request: pytest.FixtureRequest) -> None:
        self.engine: Engine | AsyncEngine | None = None
        request.addfinalizer(self.dispose)

    def get(self, is_async: bool) -> Engine | AsyncEngine:
        if self.engine is None:
            options: dict[str, Any] = {
                "poolclass": StaticPool,
                "connect_args": {"check_same_thread": False},
            }
            if is_async:
                self.engine = create_async_engine("sqlite+aiosqlite://", **options)
            else:
                self.engine = create_engine("sqlite://", **options)
                with self.engine.begin() as conn:
                    for statement in lease_schema_ddl("sqlite"):
                        conn.exec_driver_sql(statement)
        return self.engine

    def dispose(self) -> None:
        engine = self.engine
        if isinstance(engine, AsyncEngine):
            asyncio.run(engine.dispose())
        elif engine is not None:
            engine.dispose()


def _make_memory(database: _MemoryDatabase, is_async: bool, **options: Any) -> Any:
    engine = database.get(is_async)
    if isinstance(engine, AsyncEngine):
        # A fresh in-memory database has no table: the manager creates it on first use.
        return AsyncSQLLockManager(engine, create_table=True, **options)
    return SQLLockManager(engine, **options)


register_manager_backend(ManagerBackend("sqlite", _setup_file, _make_file))
register_manager_backend(ManagerBackend("sqlite-memory", _MemoryDatabase, _make_memory))
