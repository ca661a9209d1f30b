"""``manager.list()``: the parts that need no server (the conformance suite lists on each)."""

from __future__ import annotations

import pytest

from fence import ConfigurationError, MemoryLockManager
from fence._etcd import listed_resource, prefix_end
from fence._redis_keys import glob_escape, held_resource, scan_pattern


class _NoList:
    """A driver without ``list_page``: only the attribute the manager reads first."""

    source = "plain"

    def __init__(self, driver: object) -> None:
        self._driver = driver

    def close(self) -> None:
        pass


def test_a_driver_without_a_list_is_refused_clearly() -> None:
    manager = MemoryLockManager()
    manager.driver = _NoList(manager.driver)  # type: ignore[assignment]
    with pytest.raises(ConfigurationError, match="the memory backend has no list"):
        list(manager.list())


def test_redis_scan_pattern_takes_the_prefix_literally() -> None:
    assert glob_escape("a*b?c[d]e\\f") == "a\\*b\\?c\\[d\\]e\\\\f"
    assert scan_pattern("fence:", "job*") == "fence:{job\\**"
    assert scan_pattern("app[1]:", "") == "app\\[1\\]:{*"
    assert held_resource("fence:", "fence:{job:1}:lock") == "job:1"
    assert held_resource("fence:", "fence:{job:1}:readers") == "job:1"
    assert held_resource("fence:", "fence:{job:1}:token") is None
    assert held_resource("fence:", "fence:{}:lock") is None
    assert held_resource("other:", "fence:{job}:lock") is None


def test_etcd_list_range_ends_after_every_key_of_the_prefix() -> None:
    assert prefix_end(b"fence/job") == b"fence/joc"
    assert prefix_end(b"a\xff\xff") == b"b"
    assert prefix_end(b"\xff") == b"\x00"
    assert listed_resource("fence/", b"fence/job:1\x00r0000000000000001") == "job:1"
    assert listed_resource("fence/", b"fence/\x00x") is None
    assert listed_resource("fence/", b"other/job\x00") is None
