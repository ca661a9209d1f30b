"""Redis ACL rules that keep raw commands away from fenced keys (C9), without I/O.

Redis cannot tell the guard's client from any other: a raw ``SET`` on a fenced key, or on
a fence key, is an ordinary command to it. What it can do is refuse commands by user.
:func:`acl_rules` returns the ``ACL SETUSER`` rules of two users:

- the guard's user, which runs the guard's scripts: exactly the commands they call, on
  the fenced data keys and the fence namespace;
- an application user, which may read the fenced data keys but not write them, may not
  touch the fence namespace at all (not even to read), runs no scripts and no dangerous
  commands (``FLUSHALL``, ``RESTORE``, ``CONFIG``, ``ACL``, ...), and may write only the
  unfenced keys it is given.

Key patterns are Redis globs. A pattern that could match a key in the fence namespace, or
an application key pattern that could match a fenced data key, is refused: the check
intersects the two globs exactly as Redis matches them (``stringmatchlen``, byte-wise).

These rules are Redis's part of rule C14 (the storage is the last judge): Redis has no
triggers on keys, but it refuses by user, so with them every write to fenced keys that
lands comes from the guard's scripts, which judge its token inside the server.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

from fence import ConfigurationError
from fence._redis_keys import validate_prefix

__all__ = ["AclRules", "acl_rules", "common_match"]

#: The commands the guard's scripts and methods call, besides the connection handshake.
GUARD_COMMANDS = (
    "evalsha",  # every fenced write and read is one EVALSHA
    "script|load",  # reloads a script after NOSCRIPT (a restart, SCRIPT FLUSH, a failover)
    "get",
    "set",
    "hset",
    "hgetall",
    "del",
    "incrby",
    "rpush",
    "xadd",
    "xinfo|stream",  # a stream's last generated id, for the XADD checks
    "type",
    "exists",
)

#: The connection handshake of redis-py (``HELLO`` for RESP3, ``SELECT`` for a db number).
HANDSHAKE = ("ping", "hello", "select", "client|setname", "client|getname", "client|id")


class AclRules(NamedTuple):
    """``ACL SETUSER`` rules for the users around one guard (see :func:`acl_rules`).

    Attributes:
        guard: the rules of the guard's user.
        app: the rules of an application user.
    """

    guard: tuple[str, ...]
    app: tuple[str, ...]


def acl_rules(
    data_keys: Sequence[str], *, prefix: str = "fence:", app_keys: Sequence[str] = ()
) -> AclRules:
    """The ``ACL SETUSER`` rules that make raw commands on fenced keys fail closed.

    Each rule list starts with ``reset`` and ``on``; add a password rule (``>secret`` or
    ``#<sha256>``) when you create the user. Redis 7 or later (``%R~`` read-only patterns).

    Args:
        data_keys: glob patterns of the fenced data keys, e.g. ``["{order:*}:*"]``. None
            may match a key in the fence namespace.
        prefix: the guard's (and the lock managers') key prefix.
        app_keys: glob patterns of unfenced keys the application user may write. None may
            match a fenced data key or a key in the fence namespace.

    Returns:
        The rules of the guard's user and of an application user.

    Raises:
        ConfigurationError: no data key pattern, an empty or unclosed pattern, a pattern
            that reaches where it must not, or a prefix the guard refuses (empty, or with
            braces).

    Example::

        rules = acl_rules(["{order:*}:*"], app_keys=["cache:*"])
        admin.execute_command("ACL", "SETUSER", "order-guard", *rules.guard, ">s3cret")
        admin.execute_command("ACL", "SETUSER", "order-app", *rules.app, ">an0ther")
        guard = RedisGuard(redis.Redis(username="order-guard", password="s3cret"))
    """
    validate_prefix(prefix, reserved=True)
    data_keys, app_keys = _patterns(data_keys, "data_keys"), _patterns(app_keys, "app_keys")
    if not data_keys:
        raise ConfigurationError("acl_rules needs at least one pattern of fenced data keys")
    namespace = _escape(prefix) + "*"
    for pattern in (*data_keys, *app_keys):
        key = common_match(pattern, namespace)
        if key is not None:
            raise ConfigurationError(
                f"key pattern {pattern!r} matches keys in the fence namespace {namespace!r},"
                f" e.g. {_show(key)}; name the fenced keys by a pattern that cannot, e.g."
                " '{order:*}:*'"
            )
    for pattern in app_keys:
        for data in data_keys:
            key = common_match(pattern, data)
            if key is not None:
                raise ConfigurationError(
                    f"app key pattern {pattern!r} matches fenced data keys ({data!r}), e.g."
                    f" {_show(key)}: the application user could write them unfenced; narrow"
                    " one of the patterns"
                )
    guard = (
        "reset",
        "on",
        *(f"+{command}" for command in (*HANDSHAKE, *GUARD_COMMANDS)),
        *(f"~{pattern}" for pattern in data_keys),
        f"~{namespace}",
    )
    # Categories first, subtractions last: -@dangerous removes FLUSHALL, RESTORE, SORT,
    # CONFIG, ACL, KEYS, ... whatever @read or @write added.
    app = (
        "reset",
        "on",
        "+@read",
        "+@connection",
        *(("+@write", "+@transaction") if app_keys else ()),
        "-@dangerous",
        "-@scripting",
        *(f"%R~{pattern}" for pattern in data_keys),
        *(f"~{pattern}" for pattern in app_keys),
    )
    return AclRules(guard, app)


def _patterns(patterns: Sequence[str], what: str) -> tuple[str, ...]:
    if isinstance(patterns, str):
        raise ConfigurationError(f"{what} is a list of patterns, got the str {patterns!r}")
    out = tuple(patterns)
    for pattern in out:
        if not isinstance(pattern, str) or not pattern:
            raise ConfigurationError(f"{what} holds non-empty str patterns, got {pattern!r}")
        _tokens(pattern)  # refuses an unclosed class
    return out


def _show(key: bytes) -> str:
    return repr(key.decode("utf-8", "backslashreplace"))


def _escape(text: str) -> str:
    """``text`` as a glob that matches exactly itself."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


_ANY = frozenset(range(256))
_STAR = None  # a token: any run of bytes

_Token = frozenset[int] | None


def _tokens(pattern: str) -> list[_Token]:
    """A Redis glob as a list of byte sets (one byte each) and stars.

    Mirrors ``stringmatchlen``: ``*``, ``?``, ``[...]`` with ``^``, ranges and ``\\``
    escapes, and ``\\x`` outside a class; a class without its ``]`` is refused.
    """
    p = pattern.encode("utf-8", "surrogatepass")
    out: list[_Token] = []
    i, n = 0, len(p)
    while i < n:
        c = p[i]
        if c == ord("*"):
            if not out or out[-1] is not _STAR:
                out.append(_STAR)
        elif c == ord("?"):
            out.append(_ANY)
        elif c == ord("["):
            i += 1
            negate = i < n and p[i] == ord("^")
            i += negate
            chars: set[int] = set()
            while True:
                if i >= n:
                    raise ConfigurationError(f"key pattern {pattern!r} has a '[' without ']'")
                if p[i] == ord("\\") and n - i >= 2:
                    i += 1
                    chars.add(p[i])
                elif p[i] == ord("]"):
                    break
                elif n - i >= 3 and p[i + 1] == ord("-"):
                    low, high = sorted((p[i], p[i + 2]))
                    chars.update(range(low, high + 1))
                    i += 2
                else:
                    chars.add(p[i])
                i += 1
            out.append(_ANY - chars if negate else frozenset(chars))
        else:
            if c == ord("\\") and n - i >= 2:
                i += 1
            out.append(frozenset((p[i],)))
        i += 1
    return out


def common_match(a: str, b: str) -> bytes | None:
    """A non-empty key that both Redis glob patterns match, or ``None`` if none does.

    Walks the pairs of positions in the two patterns (a product automaton, breadth first),
    so the answer is exact, the key found is a shortest one, and it takes at most
    ``2 * len(a) * len(b)`` steps. (Redis matches no pattern but ``""`` against the empty
    key, and the guard refuses empty keys, so only non-empty keys count.)
    """
    ta, tb = _tokens(a), _tokens(b)
    # A state: (position in a, position in b, whether a byte was consumed). Each reached
    # state -> (the state it came from, the byte consumed on the way, or None).
    start = (0, 0, False)
    came: dict[tuple[int, int, bool], tuple[tuple[int, int, bool], int | None] | None]
    came = {start: None}
    todo = deque([start])
    while todo:
        state = todo.popleft()
        i, j, consumed = state
        a_done, b_done = i == len(ta), j == len(tb)
        if a_done and b_done and consumed:
            out = bytearray()
            step = came[state]
            while step is not None:
                state, byte = step
                if byte is not None:
                    out.append(byte)
                step = came[state]
            return bytes(reversed(out))
        a_star = not a_done and ta[i] is None
        b_star = not b_done and tb[j] is None
        moves: list[tuple[tuple[int, int, bool], int | None]] = []
        if a_star:  # the star matches nothing more
            moves.append(((i + 1, j, consumed), None))
        if b_star:
            moves.append(((i, j + 1, consumed), None))
        if not (a_done or b_done):
            x, y = ta[i], tb[j]
            both = (_ANY if x is None else x) & (_ANY if y is None else y)
            if both:
                nxt = (i if a_star else i + 1, j if b_star else j + 1, True)
                moves.append((nxt, min(both)))
        for nxt, byte in moves:
            if nxt not in came:
                came[nxt] = (state, byte)
                todo.append(nxt)
    return None
