"""Fixtures shared by the whole suite. The real servers are in ``tests/fix_servers.py``."""

from __future__ import annotations

pytest_plugins = ["tests.fix_servers"]
