"""Run the quorum's real Lua scripts outside Redis, on a store that is a plain value.

The model checker (``tests/quorum_model.py``) needs to run a node's script thousands of
times on copies of its state. This module runs the scripts' own text in Lua 5.1 (the
version Redis embeds, through ``lupa``) with the few Redis commands they call emulated
over an immutable store: a sorted tuple of ``(key, value, expire_at_ms)``. Replies are
converted as Redis converts them (numbers truncated to integers, ``false`` to nil, tables
to lists, ``{err=...}`` to an error). ``tests/test_quorum_model.py`` checks the emulation
against a real redis-server.

Only what the quorum scripts and the single-node manager's scripts use is emulated
(strings, hashes, sorted sets, ``TIME``, ``PUBLISH``); any other command raises. The
shared-lock model (``tests/test_redis_shared_model.py``) runs the manager's scripts here.
"""

from __future__ import annotations

import functools
from typing import Any

import lupa.lua51 as lua51

#: A node's data: ``((key, value, expire_at_ms or None), ...)`` sorted by key, where a value
#: is a ``str`` (string), a sorted tuple of ``(field, value)`` pairs (hash), or a
#: :class:`ZSet` (sorted set).
Store = tuple[tuple[str, Any, int | None], ...]


class ZSet(tuple[tuple[str, float], ...]):
    """A frozen sorted set: ``(member, score)`` pairs sorted by member."""


class _Z(dict[str, float]):
    """A sorted set while a script runs: member -> score."""

    def ordered(self) -> list[tuple[str, float]]:
        return sorted(self.items(), key=lambda item: (item[1], item[0]))


def _num(value: float) -> str:
    return str(int(value)) if value == int(value) else repr(value)


def _bound(text: str) -> tuple[float, bool]:
    """A ZRANGEBYSCORE bound: ``(value, exclusive)``."""
    exclusive = text.startswith("(")
    body = text[1:] if exclusive else text
    value = {"-inf": float("-inf"), "+inf": float("inf")}.get(body)
    return (float(body) if value is None else value), exclusive


EMPTY: Store = ()


class ScriptError(Exception):
    """A script returned an error reply (``redis.error_reply``) or called something the
    emulation does not know."""


class _Run:
    """The mutable state of one script run."""

    def __init__(self, store: Store, now_ms: int) -> None:
        self.now_ms = now_ms
        self.published: list[tuple[str, str]] = []
        self.data: dict[str, list[Any]] = {
            key: [_thaw(value), exp] for key, value, exp in store if exp is None or exp >= now_ms
        }

    def frozen(self) -> Store:
        out = []
        for key in sorted(self.data):
            value, exp = self.data[key]
            if isinstance(value, _Z):
                if not value:
                    continue
                value = ZSet(sorted(value.items()))
            elif isinstance(value, dict):
                if not value:
                    continue
                value = tuple(sorted(value.items()))
            out.append((key, value, exp))
        return tuple(out)


def _thaw(value: Any) -> Any:
    if isinstance(value, ZSet):
        return _Z(value)
    if isinstance(value, tuple):
        return dict(value)
    return value


def purge(store: Store, now_ms: int) -> Store:
    """``store`` without the keys that expired by ``now_ms`` (Redis: expired once
    ``now > expire_at``)."""
    if all(exp is None or exp >= now_ms for _, _, exp in store):
        return store
    return tuple(item for item in store if item[2] is None or item[2] >= now_ms)


class LuaRedis:
    """Runs scripts on stores. One instance compiles each script once.

    Args:
        scripts: script name -> Lua source, as given to ``SCRIPT LOAD``.
    """

    def __init__(self, scripts: dict[str, str]) -> None:
        self.lua = lua51.LuaRuntime()
        self._run: _Run | None = None
        setup = self.lua.eval(
            """
            function(call)
              redis = {}
              redis.call = function(...) return call(...) end
              redis.error_reply = function(message) return {err = message} end
            end
            """
        )
        setup(self._call)
        self.functions = {
            name: self.lua.eval(f"function(KEYS, ARGV)\n{text}\nend")
            for name, text in scripts.items()
        }
        self.run = functools.lru_cache(maxsize=1 << 18)(self._execute)
        self.run_published = functools.lru_cache(maxsize=1 << 18)(self._execute_published)

    # -- conversions -----------------------------------------------------------------------

    def _to_lua(self, value: Any) -> Any:
        if isinstance(value, list):
            return self.lua.table_from([self._to_lua(v) for v in value])
        if value is None:
            return False
        return value

    def _from_lua(self, value: Any) -> Any:
        if value is None or value is False:
            return None
        if value is True:
            return 1
        if isinstance(value, float):
            return int(value)
        if isinstance(value, int | str):
            return value
        err = value["err"]
        if err is not None:
            raise ScriptError(str(err))
        out = []
        index = 1
        while value[index] is not None:
            out.append(self._from_lua(value[index]))
            index += 1
        return out

    # -- the commands ----------------------------------------------------------------------

    def _call(self, command: str, *args: Any) -> Any:
        run = self._run
        assert run is not None
        name = command.upper()
        args = tuple(str(int(a)) if isinstance(a, float) else str(a) for a in args)
        data = run.data
        key = args[0] if args else ""
        if name == "PUBLISH":
            run.published.append((args[0], args[1]))
            return 0
        if key.endswith(":signal"):
            # Wake-up lists serve BLPOP only, which no script reads: keep them out of the
            # state (PEXPIRE finds no list, RPUSH drops the element).
            return 0 if name == "PEXPIRE" else 1
        if name == "TIME":
            seconds, ms = divmod(run.now_ms, 1000)
            return self._to_lua([str(seconds), str(ms * 1000)])
        entry = data.get(key)
        if name == "GET":
            return entry[0] if entry else False
        if name == "EXISTS":
            # Redis drops a hash or sorted set with its last member.
            return sum(1 for k in args if (e := data.get(k)) and (e[0] or isinstance(e[0], str)))
        if name == "MGET":
            return self._to_lua([(e[0] if (e := data.get(k)) else None) for k in args])
        if name == "SET":
            expire = None
            if len(args) == 4 and args[2].upper() == "PX":
                expire = run.now_ms + int(args[3])
            data[key] = [args[1], expire]
            return self.lua.table_from({"ok": "OK"})
        if name == "DEL":
            return sum(1 for k in args if data.pop(k, None))
        if name == "HDEL":
            found = entry[0] if entry else {}
            return sum(1 for f in args[1:] if found.pop(f, None) is not None)
        if name == "HVALS":
            return self._to_lua(list(entry[0].values()) if entry else [])
        if name.startswith("Z"):
            return self._zset(name, key, args, entry, data)
        if name == "HGET":
            return entry[0].get(args[1], False) if entry else False
        if name == "HMGET":
            found = entry[0] if entry else {}
            return self._to_lua([found.get(f) for f in args[1:]])
        if name == "HSET":
            if entry is None:
                entry = data[key] = [{}, None]
            added = 0
            for field, value in zip(args[1::2], args[2::2], strict=True):
                added += field not in entry[0]
                entry[0][field] = value
            return added
        if name == "PEXPIRE":
            if entry is None:
                return 0
            entry[1] = run.now_ms + int(args[1])
            return 1
        if name == "PTTL":
            if entry is None:
                return -2
            return -1 if entry[1] is None else entry[1] - run.now_ms
        raise ScriptError(f"the emulation does not know {name}")

    def _zset(
        self, name: str, key: str, args: tuple[str, ...], entry: Any, data: dict[str, Any]
    ) -> Any:
        zset: _Z = entry[0] if entry else _Z()
        if name == "ZSCORE":
            score = zset.get(args[1])
            return False if score is None else _num(score)
        if name == "ZCARD":
            return len(zset)
        if name == "ZADD":
            options = {"XX", "NX"}
            flags = [a.upper() for a in args[1:] if a.upper() in options]
            pairs = [a for a in args[1:] if a.upper() not in options]
            added = 0
            for score, member in zip(pairs[0::2], pairs[1::2], strict=True):
                if "XX" in flags and member not in zset:
                    continue
                if "NX" in flags and member in zset:
                    continue
                added += member not in zset
                zset[member] = float(score)
            if entry is None and zset:
                data[key] = [zset, None]
            return added
        if name == "ZREM":
            return sum(1 for m in args[1:] if zset.pop(m, None) is not None)
        scores = "WITHSCORES" in (a.upper() for a in args)
        ordered = zset.ordered()
        if name == "ZRANGE":
            start, stop = int(args[1]), int(args[2])
            count = len(ordered)
            start = max(start + count if start < 0 else start, 0)
            stop = stop + count if stop < 0 else min(stop, count - 1)
            chosen = ordered[start : stop + 1] if start <= stop else []
        elif name == "ZRANGEBYSCORE":
            low, low_open = _bound(args[1])
            high, high_open = _bound(args[2])
            chosen = [
                (m, sc)
                for m, sc in ordered
                if (sc > low if low_open else sc >= low)
                and (sc < high if high_open else sc <= high)
            ]
        else:
            raise ScriptError(f"the emulation does not know {name}")
        out: list[Any] = []
        for member, score in chosen:
            out.append(member)
            if scores:
                out.append(_num(score))
        return self._to_lua(out)

    def _execute(
        self, name: str, keys: tuple[str, ...], args: tuple[str, ...], store: Store, now_ms: int
    ) -> tuple[Store, Any]:
        """Run script ``name`` on ``store`` at ``now_ms``; return the new store and the reply
        (or a :class:`ScriptError` instance as the reply, the store unchanged)."""
        store, reply, _ = self._execute_published(name, keys, args, store, now_ms)
        return store, reply

    def _execute_published(
        self, name: str, keys: tuple[str, ...], args: tuple[str, ...], store: Store, now_ms: int
    ) -> tuple[Store, Any, tuple[tuple[str, str], ...]]:
        """:meth:`_execute`, and the ``(channel, message)`` pairs the run published."""
        run = _Run(store, now_ms)
        self._run = run
        try:
            raw = self.functions[name](
                self.lua.table_from(list(keys)), self.lua.table_from(list(args))
            )
            reply = self._from_lua(raw)
        except ScriptError as exc:
            return store, exc, ()
        finally:
            self._run = None
        return run.frozen(), reply, tuple(run.published)
