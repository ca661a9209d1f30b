"""``fence demo``: the pause story, played by real processes on SQLite, with no server.

Two worker processes share one SQLite file: the lease table of the SQL lock manager and an
``accounts`` table whose rows carry a fence column. Worker A takes the lease, reads the
balance and checks its lease; then the demo freezes it with SIGSTOP, the way a GC pause or a
VM migration would, for longer than the lease. Worker B takes over and deposits. When A is
thawed it writes the balance it computed before the pause.

With fencing, A's write carries its old token and the guard refuses it: B's deposit stays.
With ``--unfenced`` the same story uses a plain ``UPDATE`` and B's deposit is silently lost.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from multiprocessing.queues import Queue
from pathlib import Path
from typing import Any

from fence._interrupt import sigint_ignored
from fence._optional import fence_column, row_guard

__all__ = ["main"]

RESOURCE = "account:42"
TTL = 1.0
PAUSE = 2.0
START_BALANCE = 100


def _tables(metadata: Any) -> Any:
    import sqlalchemy as sa

    return sa.Table(
        "accounts",
        metadata,
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("balance", sa.Integer, nullable=False),
        fence_column(),
    )


def _worker(
    name: str,
    db: str,
    deposit: int,
    fenced: bool,
    events: Queue[tuple[float, str, str]],
    control: Connection | None,
) -> None:
    """One worker process: acquire, read, check the lease, (maybe pause), write."""
    import sqlalchemy as sa

    from fence import SQLLockManager, StaleTokenError

    def say(text: str) -> None:
        events.put((time.time(), name, text))

    engine = sa.create_engine(f"sqlite:///{db}")
    accounts = _tables(sa.MetaData())
    manager = SQLLockManager(f"sqlite:///{db}", ttl=TTL)
    try:
        lease = manager.acquire(RESOURCE, timeout=30)
        say(f"acquires {RESOURCE} -> token {lease.token} (ttl {TTL:.0f} s)")
        with engine.connect() as conn:
            balance = conn.execute(sa.select(accounts.c.balance).where(accounts.c.id == 42))
            before = int(balance.scalar_one())
        after = before + deposit
        say(f"reads balance = {before}; will write {after} (a deposit of {deposit})")
        lease.check()
        say(f"checks its lease: valid, {lease.remaining():.2f} s left")
        if control is not None:
            control.send("ready")
            control.recv()  # A is frozen here by SIGSTOP, between its check and its write
        with engine.begin() as conn:
            if fenced:
                guard = row_guard(conn, accounts)
                try:
                    guard.update(42, lease.token, {"balance": after})
                except StaleTokenError as err:
                    say(
                        f"writes balance = {after} with token {lease.token} -> REJECTED "
                        f"({err.reason}: the fence is {err.fence}); nothing written"
                    )
                    return
                say(f"writes balance = {after} with token {lease.token} -> accepted")
            else:
                # The baseline: a plain UPDATE that says it means to bypass the fence.
                plain = sa.update(accounts).where(accounts.c.id == 42).values(balance=after)
                conn.execute(plain.execution_options(unfenced=True))
                say(f"writes balance = {after} (plain UPDATE, no token) -> accepted")
        try:
            lease.release()
            say("releases the lease")
        except Exception as err:  # the lease may be gone; the demo reports it
            say(f"release fails: {type(err).__name__}: {err}")
    finally:
        manager.close()
        engine.dispose()


def _setup(db: str) -> None:
    import sqlalchemy as sa

    from fence import SQLLockManager

    engine = sa.create_engine(f"sqlite:///{db}")
    metadata = sa.MetaData()
    accounts = _tables(metadata)
    metadata.create_all(engine)
    with engine.begin() as conn:
        seed = sa.insert(accounts).values(id=42, balance=START_BALANCE)
        conn.execute(seed.execution_options(unfenced=True))  # the opening balance, no holder
    engine.dispose()
    manager = SQLLockManager(f"sqlite:///{db}")
    manager.create_table()
    manager.close()


def _final_balance(db: str) -> tuple[int, int]:
    import sqlalchemy as sa

    engine = sa.create_engine(f"sqlite:///{db}")
    with engine.connect() as conn:
        row = conn.execute(sa.text("SELECT balance, fence FROM accounts WHERE id = 42")).one()
    engine.dispose()
    return int(row[0]), int(row[1])


def run(fenced: bool, workdir: Path, out: Any = None) -> int:
    """Play the story; return the final balance minus the expected one (0 when nothing
    was lost)."""
    out = out or sys.stdout
    db = str(workdir / "demo.db")
    _setup(db)
    ctx = mp.get_context("spawn")
    events: Queue[tuple[float, str, str]] = ctx.Queue()
    lines: list[tuple[float, str, str]] = []

    def note(who: str, text: str) -> None:
        lines.append((time.time(), who, text))

    control, a_end = ctx.Pipe()
    a = ctx.Process(target=_worker, args=("A", db, 50, fenced, events, a_end))
    b = ctx.Process(target=_worker, args=("B", db, 30, fenced, events, None))
    start = time.time()
    try:
        with sigint_ignored():  # Ctrl-C is the parent's to handle: see the finally
            a.start()
        if not control.poll(60) or control.recv() != "ready":
            raise RuntimeError("worker A did not start")
        assert a.pid is not None
        os.kill(a.pid, signal.SIGSTOP)
        note(
            "--", f"SIGSTOP A for {PAUSE:.0f} s: a GC pause, a VM freeze (its lease is {TTL:.0f} s)"
        )
        control.send("go")  # buffered: A reads it only once it is thawed
        with sigint_ignored():
            b.start()
        b.join(60)
        remaining = PAUSE - (time.time() - lines[-1][0])
        if remaining > 0:
            time.sleep(remaining)
        note("--", "SIGCONT A: it wakes up and carries on where it stopped")
        os.kill(a.pid, signal.SIGCONT)
        a.join(60)
    finally:
        # Interrupted (Ctrl-C) or failed: a worker left frozen would hang the exit, which
        # waits for every child.
        for proc in (a, b):
            if proc.pid is not None and proc.is_alive():
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
                proc.join(10)
        control.close()
    while not events.empty():
        lines.append(events.get())
    events.close()
    balance, fence = _final_balance(db)

    mode = "fenced (RowGuard)" if fenced else "UNFENCED (plain UPDATE)"
    print(f"iofence demo: a lock holder pauses past its lease; writes are {mode}", file=out)
    print(f"  SQLite file {db}, SQL lock manager, two worker processes\n", file=out)
    for t, who, text in sorted(lines):
        print(f"  t={t - start:6.3f}s  {who:>2}  {text}", file=out)
    expected = START_BALANCE + 30  # B's deposit must survive; A's must be refused
    print(file=out)
    if balance == expected:
        print(
            f"final: balance = {balance} (fence {fence}). B's deposit is kept; A learned that "
            "its write was refused and can retry under a new lease.",
            file=out,
        )
    else:
        print(
            f"final: balance = {balance}, but B deposited 30 onto {START_BALANCE}: B's deposit "
            "is LOST. The paused holder overwrote it and nobody was told.",
            file=out,
        )
    return balance - expected


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``fence demo``."""
    parser = argparse.ArgumentParser(prog="fence demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--unfenced", action="store_true", help="play the story without fencing")
    parser.add_argument("--keep", metavar="DIR", help="keep the SQLite file in DIR")
    args = parser.parse_args(argv)
    if args.keep:
        workdir = Path(args.keep)
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "demo.db").unlink(missing_ok=True)
        lost = run(not args.unfenced, workdir)
    else:
        with tempfile.TemporaryDirectory(prefix="iofence-demo-") as tmp:
            lost = run(not args.unfenced, Path(tmp))
    # Unfenced, the loss is the point of the story; fenced, a loss would be a bug.
    return 1 if lost and not args.unfenced else 0
