"""Which tables a piece of SQL text writes: a small lexer, no parser, no I/O.

The gate (``_sql_gate``) reads raw SQL (``text()``, ``exec_driver_sql``, compiled
statements with data-modifying CTEs) to find the tables it writes. A lexer cannot know
everything a statement does, so every answer errs towards "writes": a statement whose write
targets cannot be read is reported as :attr:`Writes.unknown`, and the gate refuses it
where that matters. What no reading of the text can show is stated in the docs: a function
or procedure that writes (``SELECT f()``, ``CALL p()``), a trigger, or dynamic SQL built
from strings inside the database.

It knows the lexical rules of PostgreSQL and SQLite: ``'strings'`` with ``''``,
``E'...'`` with backslash escapes, ``$tag$...$tag$`` dollar quotes, ``"identifiers"``,
SQLite's ```identifiers``` and ``[identifiers]``, ``--`` and nested ``/* */`` comments.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["Target", "Writes", "write_targets"]


@dataclass(frozen=True, slots=True)
class Target:
    """A table named as the target of a write, folded to lower case.

    Attributes:
        schema: the schema, if the name was qualified.
        name: the table name.
    """

    schema: str | None
    name: str


@dataclass(frozen=True, slots=True)
class Writes:
    """What a piece of SQL writes.

    Attributes:
        targets: the tables it writes.
        unknown: it writes something the lexer cannot name (``CALL``, ``DO``,
            ``EXECUTE``, a write keyword in a shape it does not know).
        names: every identifier in it, folded to lower case (for an unknown write).
        occurrences: each write it names, in the order of the text: a table written by
            a statement and by a data-modifying CTE of that statement is there twice.
    """

    targets: frozenset[Target]
    unknown: bool
    names: frozenset[str]
    occurrences: tuple[Target, ...] = ()

    @property
    def writes(self) -> bool:
        """Whether the SQL writes anything."""
        return bool(self.targets) or self.unknown


NOTHING = Writes(frozenset(), False, frozenset())

_TOKEN = re.compile(
    r"""
      (?P<space>\s+)
    | (?P<line>--[^\n]*)
    | (?P<block>/\*)
    | (?P<estring>[eE]'(?:[^'\\]|\\.|'')*')
    | (?P<string>'(?:[^']|'')*')
    | (?P<dollar>\$(?P<tag>[A-Za-z_][A-Za-z_0-9]*)?\$)
    | (?P<quoted>"(?:[^"]|"")*")
    | (?P<backtick>`(?:[^`]|``)*`)
    | (?P<bracket>\[[^\]]*\])
    | (?P<word>[A-Za-z_][A-Za-z_0-9$]*)
    | (?P<param>\$\d+|:[A-Za-z_][A-Za-z_0-9]*|%\([^)]*\)s|%s|\?)
    | (?P<number>\d+(?:\.\d*)?(?:[eE][+-]?\d+)?)
    | (?P<other>.)
    """,
    re.VERBOSE | re.DOTALL,
)

# Words after which UPDATE names no table: ``FOR UPDATE``, ``DO UPDATE SET``, ``ON
# UPDATE CASCADE``, ``BEFORE INSERT OR UPDATE ON t`` in a trigger.
_NOT_A_TABLE = frozenset(
    {
        "set", "of", "nowait", "skip", "on", "cascade", "restrict", "no", "or", "and",
        "for", "from", "where", "returning", "to", "when", "then", "else", "end",
    }
)  # fmt: skip
_SQLITE_CONFLICT = frozenset({"replace", "ignore", "abort", "fail", "rollback"})
# Statements whose writes cannot be read from their text.
_OPAQUE = frozenset({"call", "do", "execute", "exec"})


class _Lexer:
    """Tokens of one SQL text: ``(kind, value)`` with identifiers folded, nothing else kept."""

    def __init__(self, sql: str) -> None:
        self.tokens: list[tuple[str, str]] = []
        self.unclosed = False
        self._lex(sql)

    def _lex(self, sql: str) -> None:
        pos, end = 0, len(sql)
        out = self.tokens
        while pos < end:
            m = _TOKEN.match(sql, pos)
            assert m is not None  # "other" matches any one character
            kind = m.lastgroup
            pos = m.end()
            if kind == "block":
                pos = self._skip_block(sql, pos)
            elif kind == "dollar":
                close = sql.find(m.group("dollar"), pos)
                if close < 0:
                    self.unclosed = True
                    return
                # A dollar-quoted body: code in a DO block, else a constant (see _scan).
                out.append(("body", sql[pos:close]))
                pos = close + len(m.group("dollar"))
            elif kind == "word":
                out.append(("word", m.group().lower()))
            elif kind == "quoted":
                out.append(("ident", m.group()[1:-1].replace('""', '"').lower()))
            elif kind == "backtick":
                out.append(("ident", m.group()[1:-1].replace("``", "`").lower()))
            elif kind == "bracket":
                out.append(("ident", m.group()[1:-1].lower()))
            elif kind == "other":
                ch = m.group()
                if ch in "'\"`[":  # an opening quote that never closes
                    self.unclosed = True
                    return
                out.append(("punct", ch))
            elif kind in ("string", "estring", "param", "number"):
                out.append(("value", ""))

    def _skip_block(self, sql: str, pos: int) -> int:
        depth = 1  # PostgreSQL nests block comments
        while depth:
            opening = sql.find("/*", pos)
            closing = sql.find("*/", pos)
            if closing < 0:
                self.unclosed = True
                return len(sql)
            if 0 <= opening < closing:
                depth += 1
                pos = opening + 2
            else:
                depth -= 1
                pos = closing + 2
        return pos


def _name_at(tokens: list[tuple[str, str]], i: int) -> tuple[Target | None, int]:
    """A possibly schema-qualified table name starting at ``tokens[i]``."""
    parts: list[str] = []
    while i < len(tokens) and tokens[i][0] in ("word", "ident"):
        parts.append(tokens[i][1])
        if (
            i + 2 < len(tokens)
            and tokens[i + 1] == ("punct", ".")
            and tokens[i + 2][0]
            in (
                "word",
                "ident",
            )
        ):
            i += 2
            continue
        i += 1
        break
    if not parts:
        return None, i
    name = parts[-1]
    schema = parts[-2] if len(parts) >= 2 else None
    return Target(schema, name), i


def _skip(tokens: list[tuple[str, str]], i: int, *words: str) -> int:
    while i < len(tokens) and tokens[i][0] == "word" and tokens[i][1] in words:
        i += 1
    return i


def _word(tokens: list[tuple[str, str]], i: int) -> str | None:
    return tokens[i][1] if i < len(tokens) and tokens[i][0] == "word" else None


def _scan(tokens: list[tuple[str, str]]) -> tuple[list[Target], bool, set[str]]:
    targets: list[Target] = []  # each write, in order
    names: set[str] = set()
    unknown = False
    at_start = True  # the first word of a statement
    statement = ""  # and that word
    for i, (kind, value) in enumerate(tokens):
        if kind == "body":
            if statement != "do":
                continue  # a string constant (or a function body, which runs when called)
            inner = _Lexer(value)
            t, u, n = _scan(inner.tokens)
            targets += t
            unknown = unknown or u or inner.unclosed
            names |= n
            continue
        if kind == "ident":
            names.add(value)
        if kind == "punct" and value == ";":
            at_start, statement = True, ""
            continue
        if kind != "word":
            if kind != "punct" or value != "(":
                at_start = False
            continue
        names.add(value)
        first = at_start
        at_start = False
        if first:
            statement = value
        if first and value in _OPAQUE:
            unknown = True
        elif value in ("insert", "replace"):
            j = i + 1
            if value == "insert" and _word(tokens, j) == "or":
                if _word(tokens, j + 1) not in _SQLITE_CONFLICT:
                    continue  # "INSERT OR UPDATE ON t": a trigger's event list
                j += 2
            if _word(tokens, j) != "into":
                if value == "insert":
                    unknown = unknown or first
                continue
            target, _ = _name_at(tokens, j + 1)
            if target is None:
                unknown = True
            else:
                targets.append(target)
        elif value == "update":
            if _word(tokens, i - 1) == "key" and _word(tokens, i - 2) == "duplicate":
                continue  # MySQL's "ON DUPLICATE KEY UPDATE c = ...": the INSERT's own row
            j = i + 1
            if _word(tokens, j) == "or" and _word(tokens, j + 1) in _SQLITE_CONFLICT:
                j += 2
            j = _skip(tokens, j, "only")
            if j >= len(tokens) or tokens[j][0] == "punct" or _word(tokens, j) in _NOT_A_TABLE:
                if first:
                    unknown = True
                continue
            target, _ = _name_at(tokens, j)
            if target is None:
                unknown = True
            else:
                targets.append(target)
        elif value in ("delete", "merge"):
            j = i + 1
            expected = "from" if value == "delete" else "into"
            if _word(tokens, j) != expected:
                unknown = unknown or first
                continue
            target, _ = _name_at(tokens, _skip(tokens, j + 1, "only"))
            if target is None:
                unknown = True
            else:
                targets.append(target)
        elif value == "truncate" and first:
            j = _skip(tokens, i + 1, "table", "only")
            while True:
                target, j = _name_at(tokens, j)
                if target is None:
                    unknown = True
                    break
                targets.append(target)
                if j < len(tokens) and tokens[j] == ("punct", "*"):
                    j += 1
                if j < len(tokens) and tokens[j] == ("punct", ","):
                    j = _skip(tokens, j + 1, "only")
                    continue
                break
        elif value == "copy" and first:
            target, j = _name_at(tokens, i + 1)
            depth = 0
            while j < len(tokens):  # the column list, then FROM (a write) or TO (a read)
                tok = tokens[j]
                if tok == ("punct", "("):
                    depth += 1
                elif tok == ("punct", ")"):
                    depth -= 1
                elif depth == 0 and tok[0] == "word":
                    break
                j += 1
            if _word(tokens, j) == "from":
                if target is None:
                    unknown = True
                else:
                    targets.append(target)
    return targets, unknown, names


_CACHE: dict[str, Writes] = {}
_CACHE_SIZE = 4096
# Every writing statement has one of these words; most reads have none and skip the lexer.
_MAY_WRITE = re.compile(
    r"\b(?:insert|update|delete|merge|truncate|copy|replace|call|do|exec|execute)\b",
    re.IGNORECASE,
)


def write_targets(sql: str) -> Writes:
    """The tables ``sql`` writes (one or several statements), remembered per text.

    Args:
        sql: SQL text, as written or as compiled.

    Returns:
        A :class:`Writes`. Text that does not lex (a quote or comment left open) is an
        unknown write.
    """
    found = _CACHE.get(sql)
    if found is not None:
        return found
    if _MAY_WRITE.search(sql) is None:
        found = NOTHING
    else:
        lexer = _Lexer(sql)
        targets, unknown, names = _scan(lexer.tokens)
        if not targets and not unknown and not lexer.unclosed:
            found = NOTHING
        else:
            unknown = unknown or lexer.unclosed
            found = Writes(frozenset(targets), unknown, frozenset(names), tuple(targets))
    if len(_CACHE) >= _CACHE_SIZE:
        _CACHE.clear()
    _CACHE[sql] = found
    return found
