"""The chaos checker finds each kind of violation in a log, and passes a clean one."""

from __future__ import annotations

from fence._chaos.checker import Record, check
from fence._chaos.timeline import render_svg


def clean_log() -> list[Record]:
    return [
        Record(1.0, "w1", "acquired", "r", 10),
        Record(1.1, "w1", "write_ok", "r", 10, 0, 1),
        Record(1.2, "w1", "released", "r", 10),
        Record(2.0, "w2", "acquired", "r", 11),
        Record(2.1, "w2", "write_ok", "r", 11, 1, 2),
        Record(2.2, "w1", "write_rejected", "r", 10, 1, 2),
        Record(2.3, "w2", "released", "r", 11),
    ]


def test_clean_run_passes() -> None:
    verdict = check(clean_log(), {"r": 2})
    assert verdict.ok
    assert verdict.accepted == {"r": 2}
    assert verdict.rejected == {"r": 1}
    assert verdict.as_dict()["total_lost_updates"] == 0


def test_stale_write_accepted_is_found() -> None:
    log = [*clean_log(), Record(3.0, "w1", "write_ok", "r", 10, 2, 3)]
    verdict = check(log, {"r": 3})
    assert not verdict.ok
    assert verdict.stale_accepted == [
        {"scope": "r", "token": 10, "after_token": 11, "worker": "w1", "value": 3}
    ]


def test_lost_update_is_found() -> None:
    # Both read 1 and wrote 2: one increment vanished.
    log = [
        Record(1.0, "w1", "write_ok", "r", None, 0, 1),
        Record(2.0, "w2", "write_ok", "r", None, 1, 2),
        Record(2.5, "w1", "write_ok", "r", None, 1, 2),
    ]
    verdict = check(log, {"r": 2})
    assert not verdict.ok
    assert verdict.lost_updates == {"r": 1}
    assert verdict.duplicate_values[0]["value"] == 2


def shared_log() -> list[Record]:
    """Writers 10 and 12, readers 11 and 13 between them, each read checked."""
    return [
        *clean_log()[:3],
        Record(1.5, "w3", "acquired_read", "r", 11),
        Record(1.6, "w3", "read_ok", "r", 11, 1, written=10, fence=10),
        Record(2.5, "w2", "acquired", "r", 12),
        Record(2.6, "w2", "write_ok", "r", 12, 1, 2),
        Record(2.7, "w3", "read_rejected", "r", 11, 2, fence=12),
        Record(3.0, "w1", "acquired_read", "r", 13),
        Record(3.1, "w1", "read_ok", "r", 13, 2, written=12, fence=12),
    ]


def test_checked_reads_pass_when_no_newer_writer_wrote_what_they_read() -> None:
    verdict = check(shared_log(), {"r": 2})
    assert verdict.ok, verdict
    assert verdict.reads_accepted == {"r": 2}
    assert verdict.stale_reads == []


def test_stale_read_accepted_is_found() -> None:
    stale = [
        # A fence above the read lease: a newer writer wrote, yet the read was accepted.
        Record(4.0, "w3", "read_ok", "r", 11, 2, written=12, fence=12),
        # A value under a token newer than the fence read with it.
        Record(4.1, "w1", "read_ok", "r", 13, 2, written=12, fence=10),
        # A value no accepted write produced.
        Record(4.2, "w1", "read_ok", "r", 13, 7, written=12, fence=12),
    ]
    verdict = check([*shared_log(), *stale], {"r": 2})
    assert not verdict.ok
    assert [s["value"] for s in verdict.stale_reads] == [2, 2, 7]
    assert "fence newer than the read lease" in verdict.stale_reads[0]["problems"]
    assert verdict.stale_reads[1]["problems"] == [
        "written under a token newer than the fence it was read with"
    ]
    assert verdict.stale_reads[2]["problems"] == ["a value no accepted write produced"]


def test_token_issued_twice_is_found() -> None:
    log = [Record(1.0, "w1", "acquired", "r", 10), Record(2.0, "w2", "acquired", "r", 10)]
    verdict = check(log, {})
    assert not verdict.ok
    assert verdict.duplicate_tokens == [{"scope": "r", "token": 10, "workers": ["w1", "w2"]}]


def test_unknown_outcomes_explain_extra_increments_only() -> None:
    log = [*clean_log(), Record(3.0, "w2", "write_error", "r", 11, 2, 3)]
    assert check(log, {"r": 3}).ok
    assert check(log, {"r": 2}).ok
    assert not check(log, {"r": 4}).ok


def test_timeline_svg() -> None:
    log = [*clean_log(), Record(1.5, "w1", "paused"), Record(2.5, "w1", "resumed")]
    log.append(Record(1.8, "controller", "fault", detail="kill -9 redis"))
    svg = render_svg(log, "run")
    assert svg.startswith("<svg")
    assert svg.count("<circle") >= 2 + 1  # two accepted writes + the legend
    assert "stopped (SIGSTOP)" in svg
    assert "kill -9 redis" in svg
    assert render_svg([], "empty").startswith("<svg")


def test_a_read_shows_that_a_write_of_unknown_outcome_landed() -> None:
    """A writer's reply was lost (a dropped connection), but its write landed, and a reader
    saw its value: that write counts as accepted, and the read is not stale."""
    log = [
        *clean_log(),
        Record(3.0, "w2", "acquired", "r", 12),
        Record(3.1, "w2", "write_error", "r", 12, 2, 3),
        Record(3.5, "w3", "acquired_read", "r", 13),
        Record(3.6, "w3", "read_ok", "r", 13, 3, written=12, fence=12),
    ]
    verdict = check(log, {"r": 3})
    assert verdict.ok, verdict
    assert verdict.accepted == {"r": 3}
    assert verdict.unexplained == {"r": 0}
    assert not check(log, {"r": 4}).ok  # the unknown write explains one increment, once


def test_a_landed_write_of_unknown_outcome_is_held_to_the_token_order() -> None:
    """The read proves the write of unknown outcome landed, so it is judged like an
    accepted one: under token 9, after token 11 wrote, it is a stale write accepted."""
    log = [
        *clean_log(),
        Record(3.1, "w1", "write_error", "r", 9, 2, 3),
        Record(3.6, "w3", "read_ok", "r", 13, 3, written=9, fence=11),
    ]
    verdict = check(log, {"r": 3})
    assert not verdict.ok
    assert verdict.stale_accepted == [
        {"scope": "r", "token": 9, "after_token": 11, "worker": "w1", "value": 3}
    ]
    assert verdict.stale_reads == []
