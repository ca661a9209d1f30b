"""Verify a chaos run from its log: the three properties a fenced store must keep.

Every worker does read-modify-write cycles that add 1 to a counter record under the lock and
logs each write the store accepted, with the value it read and the value it wrote. From that
log alone:

1. **No stale write accepted.** Ordered by the value they produced, the accepted writes of one
   record carry tokens that never go down.
2. **No lost update.** The final value of a record equals its initial value plus the number of
   accepted writes (replaying the accepted increments gives the final state), and no two
   accepted writes produced the same value.
3. **No token issued twice.** No two acquisitions of one record got the same token.

With readers (C13), every accepted checked read is checked too:

4. **No stale read accepted.** The value a reader accepted was written under a token not
   newer than the fence it saw with it, and that fence not newer than the reader's token:
   no writer whose lease came after the read lease wrote what it read. The value and its
   writer's token are one that an accepted write produced (or the initial value).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Record", "Verdict", "check"]


@dataclass(frozen=True, slots=True)
class Record:
    """One line of a chaos log.

    Attributes:
        t: wall time in seconds.
        worker: the worker's name.
        event: ``acquired``, ``acquired_read``, ``released``, ``lost``, ``write_ok``,
            ``write_rejected``, ``write_error`` (unknown outcome), ``read_ok`` (a checked
            read accepted under a read lease), ``read_rejected``, ``read_error``,
            ``acquire_error``, ``paused``, ``resumed``, ``fault``. The checker reads the
            writes, the accepted checked reads and the acquisitions; the other events are
            for people and pictures.
        scope: the record (resource) involved, if any.
        token: the lease token, if any (``None`` for an unfenced baseline).
        before: the value the worker read.
        after: the value it wrote.
        detail: anything else.
        written: a checked read: the token the value was written under (``None``: the
            initial value).
        fence: a checked read: the fence read with the value.
    """

    t: float
    worker: str
    event: str
    scope: str | None = None
    token: int | None = None
    before: int | None = None
    after: int | None = None
    detail: str | None = None
    written: int | None = None
    fence: int | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Record:
        """Build a record from one decoded JSON line."""
        return cls(**{k: data.get(k) for k in cls.__dataclass_fields__})  # type: ignore[arg-type]


@dataclass
class Verdict:
    """What the checker found.

    Attributes:
        accepted: accepted writes, per record, and writes of unknown outcome that a
            checked read showed landed (the value it saw, under their token).
        rejected: rejected writes, per record.
        stale_accepted: accepted writes whose token was below one accepted before them.
        lost_updates: per record, accepted writes that the final state does not contain.
        duplicate_values: accepted writes that produced a value another write produced.
        duplicate_tokens: tokens handed to two acquisitions of one record.
        unexplained: per record, value increments that no logged write accounts for (a
            write whose outcome was unknown to its worker may explain one each).
        reads_accepted: accepted checked reads under read leases, per record.
        stale_reads: accepted checked reads that saw a value written under a token newer
            than their fence or their lease, or a value that no accepted write (nor one of
            unknown outcome) produced.
    """

    accepted: dict[str, int] = field(default_factory=dict)
    rejected: dict[str, int] = field(default_factory=dict)
    stale_accepted: list[dict[str, Any]] = field(default_factory=list)
    lost_updates: dict[str, int] = field(default_factory=dict)
    duplicate_values: list[dict[str, Any]] = field(default_factory=list)
    duplicate_tokens: list[dict[str, Any]] = field(default_factory=list)
    unexplained: dict[str, int] = field(default_factory=dict)
    reads_accepted: dict[str, int] = field(default_factory=dict)
    stale_reads: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether every property held."""
        return not (
            self.stale_accepted
            or any(self.lost_updates.values())
            or self.duplicate_values
            or self.duplicate_tokens
            or any(self.unexplained.values())
            or self.stale_reads
        )

    def as_dict(self) -> dict[str, Any]:
        """The verdict as plain data, for the JSON summary."""
        data = asdict(self)
        data["ok"] = self.ok
        data["total_lost_updates"] = sum(self.lost_updates.values())
        data["total_stale_accepted"] = len(self.stale_accepted)
        return data


def check(
    records: Iterable[Record],
    final: Mapping[str, int],
    initial: Mapping[str, int] | None = None,
) -> Verdict:
    """Check a chaos log against the final state of the records.

    Args:
        records: every record of the run, from all workers, in any order.
        final: the value of each record read after the run.
        initial: the value of each record before the run (default 0).
    """
    initial = initial or {}
    verdict = Verdict()
    writes: dict[str, list[Record]] = defaultdict(list)
    unknown: dict[str, int] = defaultdict(int)
    unsure: dict[tuple[str, int | None, int | None], Record] = {}
    acquisitions: dict[str, dict[int, list[str]]] = defaultdict(lambda: defaultdict(list))
    reads: list[Record] = []
    for record in records:
        if record.scope is None:
            continue
        if record.event == "read_ok":
            reads.append(record)
        elif record.event == "write_ok":
            writes[record.scope].append(record)
        elif record.event == "write_error":
            unknown[record.scope] += 1
            unsure[(record.scope, record.after, record.token)] = record
        elif record.event == "write_rejected":
            verdict.rejected[record.scope] = verdict.rejected.get(record.scope, 0) + 1
        elif record.event in ("acquired", "acquired_read") and record.token is not None:
            acquisitions[record.scope][record.token].append(record.worker)

    # A write whose outcome its worker did not learn (the reply was lost to a fault) and
    # whose value a checked read saw, under its token: it landed. It counts as accepted,
    # and its token must fit the order of the accepted writes like theirs.
    for read in reads:
        landed = unsure.pop((read.scope or "", read.before, read.written), None)
        if landed is not None and read.written is not None:
            writes[landed.scope or ""].append(landed)
            unknown[landed.scope or ""] -= 1

    for scope in sorted(set(writes) | set(final)):
        accepted = sorted(writes.get(scope, []), key=lambda r: (r.after or 0, r.t))
        verdict.accepted[scope] = len(accepted)
        highest: Record | None = None
        seen_values: dict[int, Record] = {}
        for write in accepted:
            if write.after is not None:
                twin = seen_values.get(write.after)
                if twin is not None:
                    verdict.duplicate_values.append(
                        {
                            "scope": scope,
                            "value": write.after,
                            "workers": [twin.worker, write.worker],
                        }
                    )
                seen_values[write.after] = write
            if write.token is None:
                continue
            if highest is not None and highest.token is not None and write.token < highest.token:
                verdict.stale_accepted.append(
                    {
                        "scope": scope,
                        "token": write.token,
                        "after_token": highest.token,
                        "worker": write.worker,
                        "value": write.after,
                    }
                )
            if highest is None or (highest.token or 0) < write.token:
                highest = write
        expected = initial.get(scope, 0) + len(accepted)
        verdict.lost_updates[scope] = max(0, expected - final.get(scope, 0))
        verdict.unexplained[scope] = max(0, final.get(scope, 0) - expected - unknown[scope])

    produced = {
        (scope, write.after, write.token) for scope, found in writes.items() for write in found
    }
    for read in reads:
        scope = read.scope or ""
        verdict.reads_accepted[scope] = verdict.reads_accepted.get(scope, 0) + 1
        problems = []
        if read.written is not None and (read.fence is None or read.written > read.fence):
            problems.append("written under a token newer than the fence it was read with")
        if read.token is None or (read.fence is not None and read.fence > read.token):
            problems.append("fence newer than the read lease")
        if read.written is not None and (read.token is None or read.written > read.token):
            problems.append("written under a token newer than the read lease")
        if read.written is None:
            if read.before != initial.get(scope, 0):
                problems.append("a value without a writer that is not the initial value")
        elif (scope, read.before, read.written) not in produced:
            problems.append("a value no accepted write produced")  # nor one of unknown outcome
        if problems:
            verdict.stale_reads.append(
                {
                    "scope": scope,
                    "worker": read.worker,
                    "token": read.token,
                    "value": read.before,
                    "written": read.written,
                    "fence": read.fence,
                    "problems": problems,
                }
            )

    for scope, by_token in acquisitions.items():
        for token, workers in by_token.items():
            if len(workers) > 1:
                verdict.duplicate_tokens.append(
                    {"scope": scope, "token": token, "workers": workers}
                )
    return verdict
