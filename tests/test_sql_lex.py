"""The lexer that finds the tables raw SQL writes (``adapters/_sql_lex.py``).

Every row is one piece of SQL and the tables it must be found to write; a statement whose
target cannot be read must come out as an unknown write, never as a read.
"""

from __future__ import annotations

import pytest

from fence.adapters._sql_lex import Target, write_targets

T = Target

CASES: list[tuple[str, set[Target], bool]] = [
    # reads
    ("SELECT * FROM accounts", set(), False),
    ("select balance from accounts where id = :id for update", set(), False),
    ("SELECT 1 FROM t FOR NO KEY UPDATE OF t NOWAIT", set(), False),
    ("SELECT 'UPDATE accounts SET x = 1'", set(), False),
    ("SELECT $$DELETE FROM accounts$$", set(), False),
    ("SELECT 1 -- UPDATE accounts SET x = 1", set(), False),
    ("SELECT /* DELETE FROM accounts /* nested */ still */ 1", set(), False),
    ('SELECT "update" FROM t', set(), False),
    ("SELECT replace(name, 'a', 'b') FROM accounts", set(), False),
    ("EXPLAIN SELECT 1", set(), False),
    ("SAVEPOINT sa_savepoint_1", set(), False),
    ("CREATE TABLE t (id INT REFERENCES a ON UPDATE CASCADE ON DELETE SET NULL)", set(), False),
    (
        "CREATE TRIGGER x BEFORE INSERT OR UPDATE ON accounts FOR EACH ROW EXECUTE FUNCTION f()",
        set(),
        False,
    ),
    # writes
    ("UPDATE accounts SET balance = 0", {T(None, "accounts")}, False),
    ("update ONLY public.Accounts as a set balance = 0", {T("public", "accounts")}, False),
    ('UPDATE "Public"."Acc""ounts" SET x = 1', {T("public", 'acc"ounts')}, False),
    ("UPDATE OR REPLACE accounts SET x = 1", {T(None, "accounts")}, False),
    ("UPDATE/**/accounts SET x = 1", {T(None, "accounts")}, False),
    ("INSERT INTO accounts (id) VALUES (1)", {T(None, "accounts")}, False),
    ("INSERT OR REPLACE INTO `accounts` VALUES (1)", {T(None, "accounts")}, False),
    ("REPLACE INTO [accounts] VALUES (1)", {T(None, "accounts")}, False),
    (
        "INSERT INTO a (id) VALUES (1) ON CONFLICT (id) DO UPDATE SET x = excluded.x",
        {T(None, "a")},
        False,
    ),
    (
        "INSERT INTO a (id) VALUES (1) ON DUPLICATE KEY UPDATE x = VALUES(x)",
        {T(None, "a")},
        False,
    ),
    ("DELETE FROM accounts WHERE id = ?", {T(None, "accounts")}, False),
    (
        "MERGE INTO accounts a USING src s ON a.id = s.id WHEN MATCHED THEN UPDATE SET x = 1",
        {T(None, "accounts")},
        False,
    ),
    ("TRUNCATE accounts, ONLY b.c *", {T(None, "accounts"), T("b", "c")}, False),
    ("TRUNCATE TABLE accounts", {T(None, "accounts")}, False),
    ("COPY accounts (id, x) FROM STDIN", {T(None, "accounts")}, False),
    ("COPY accounts TO STDOUT", set(), False),
    ("COPY (SELECT * FROM accounts) TO STDOUT", set(), False),
    ("WITH d AS (DELETE FROM accounts RETURNING id) SELECT * FROM d", {T(None, "accounts")}, False),
    ("SELECT 1; UPDATE accounts SET x = 1", {T(None, "accounts")}, False),
    ("EXPLAIN ANALYZE UPDATE accounts SET x = 1", {T(None, "accounts")}, False),
    ("PREPARE p AS DELETE FROM accounts", {T(None, "accounts")}, False),
    (
        "UPDATE accounts SET note = e'it''s \\' UPDATE b SET' WHERE id = $1",
        {T(None, "accounts")},
        False,
    ),
    # unknown writes: the text cannot show what they change
    ("CALL move_money(1, 2)", set(), True),
    ("DO $$BEGIN UPDATE accounts SET x = 1; END$$", {T(None, "accounts")}, True),
    ("EXECUTE p(1)", set(), True),
    ("UPDATE", set(), True),
    ("INSERT accounts VALUES (1)", set(), True),
    ("UPDATE accounts SET x = 'open", {T(None, "accounts")}, True),
    (
        "CREATE FUNCTION f() RETURNS void AS $$ UPDATE accounts SET x = 1 $$ LANGUAGE sql",
        set(),
        False,
    ),
    ("DELETE FROM accounts /* open", {T(None, "accounts")}, True),
]


@pytest.mark.parametrize(("sql", "targets", "unknown"), CASES, ids=[c[0][:40] for c in CASES])
def test_write_targets(sql: str, targets: set[Target], unknown: bool) -> None:
    found = write_targets(sql)
    assert set(found.targets) == targets
    assert found.unknown is unknown
    assert found.writes is bool(targets or unknown)


def test_names_of_an_unknown_write_include_its_body() -> None:
    found = write_targets("DO $$BEGIN PERFORM f(); EXECUTE 'x' || 'y'; END$$")
    assert found.unknown
    assert "perform" in found.names


@pytest.mark.parametrize(
    ("sql", "occurrences"),
    [
        ("UPDATE a SET x = 1", ["a"]),
        ("INSERT INTO a (id) VALUES (1) ON CONFLICT (id) DO UPDATE SET x = 1", ["a"]),
        ("UPDATE a SET x = (SELECT y FROM a FOR UPDATE)", ["a"]),
        ("WITH w AS (UPDATE a SET x = 1 RETURNING id) UPDATE a SET y = 2", ["a", "a"]),
        ("WITH w AS (DELETE FROM b RETURNING id) INSERT INTO a SELECT id FROM w", ["b", "a"]),
        ("INSERT INTO a WITH w AS (UPDATE a SET x = 1 RETURNING id) SELECT id FROM w", ["a", "a"]),
        ("SELECT 1 FROM a FOR UPDATE", []),
    ],
)
def test_each_write_is_counted(sql: str, occurrences: list[str]) -> None:
    """A statement that writes its own table twice (a data-modifying CTE of its table) is
    told from one that writes it once."""
    assert [t.name for t in write_targets(sql).occurrences] == occurrences
