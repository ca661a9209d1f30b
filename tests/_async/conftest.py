"""Fixtures of the asyncio suites (and, generated, of the sync ones)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

SQLITE = "sqlite+aiosqlite"  # unasync: SQLITE = "sqlite"


@pytest.fixture(
    params=[
        pytest.param("sqlite", id="sqlite"),
        pytest.param("postgres", id="postgres", marks=pytest.mark.postgres),
        pytest.param("mariadb", id="mariadb", marks=pytest.mark.mariadb),
    ]
)
async def engine(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[AsyncEngine]:
    """An engine on a SQLite file of the test's own, then on the suite's PostgreSQL, then
    on a MariaDB database of the test's own."""
    if request.param == "sqlite":
        url = f"{SQLITE}:///{tmp_path / 'orm.db'}"
    elif request.param == "mariadb":
        url = request.getfixturevalue("mariadb_url")
        url = url.replace("+pymysql", "+aiomysql")  # unasync: remove
    else:
        url = request.getfixturevalue("postgres_url")
    eng = create_async_engine(url)
    yield eng
    await eng.dispose()
