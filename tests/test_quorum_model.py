"""The quorum protocol, checked by an exhaustive bounded search (``tests/quorum_model.py``).

Each search drives the real :class:`fence._quorum.QuorumAcquire` machine and the real node
scripts through every schedule within its bounds and fails on the first state that breaks
an invariant (unique tokens, tokens ordered by the real-time order of grants, exclusive
leases; in the set-up search, liveness: from every quiescent state a new client alone is
granted). The number of states explored is printed (``pytest -s`` shows it; ``-rP`` too).

The checker is shown able to fail: pointed at the old rule (a node that restarted empty
votes as if it had its data) it finds the counter-example of issue 16; pointed at an undo
that releases whatever the acquire call's secret holds, it finds the lease overlap that an
undo of one attempt arriving after the next attempt's grant causes; with a node clock
that jumps forward it finds the lease overlap every lease-based lock has (the tokens still
hold, which is why the guards are needed); with a set-up that is never taken up again it
finds two set-ups at once that leave the quorum refusing for ever; with a client that
forgets its grant it finds the rolling restart that repeats counter token 1 (issue 28).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import redis

from fence._core import TokenMode
from fence._quorum import SCRIPTS, Op, Request, node_call, parse_answer
from tests.lua_redis import EMPTY, LuaRedis
from tests.quorum_model import Bounds, Checker, Violation

HYBRID = TokenMode.HYBRID

#: Two attempts per acquire call; a lost acquire request, a delayed undo.
RETRIES = Bounds(
    ttl=1, attempts=2, ticks=0, losses=1, lossy=("acquire",), delays=1, late=("undo",),
    release=False,
)  # fmt: skip

#: One client, two acquire calls; every node may restart empty, in turn or at once.
ROLLING = Bounds(clients=1, acquires=2, ttl=1, attempts=1, ticks=0, wipes=3, again=True)

#: name -> bounds; every search is exhaustive within its bounds. A fault a search does not
#: name is off in it.
SEARCHES = {
    # 3 nodes, counter tokens: a lost request or reply, a node restarting empty, leases
    # expiring.
    "n3-counter-loss-wipe": Bounds(ttl=1, attempts=1, ticks=1, losses=1, wipes=1, release=False),
    # ... a request delayed past its client's timeout and run at any later point.
    "n3-counter-delay-wipe": Bounds(ttl=1, attempts=1, ticks=1, delays=1, wipes=1, release=False),
    # ... a request answered a tick late while its client waits; holders release.
    "n3-counter-slow-wipe": Bounds(ttl=1, attempts=1, ticks=2, slow=1, wipes=1),
    # hybrid tokens, node clocks skewed and one jump either way (exclusion is not checked
    # here: a forward jump ends a lease early, see below)
    "n3-hybrid-clocks": Bounds(
        mode=HYBRID, ttl=1, attempts=1, ticks=1, skew=(0, 1, -1), jumps=1, jump_sizes=(1, -1),
        release=False,
    ),
    # three clients contending, a node restarting empty
    "n3-three-clients": Bounds(clients=3, ttl=1, attempts=1, ticks=0, wipes=1, release=False),
    # five nodes, a node restarting empty
    "n5-counter-wipe": Bounds(nodes=5, ttl=1, attempts=1, ticks=0, wipes=1, release=False),
    # five nodes, two restarting empty (the most the model allows), a lost message,
    # successive grants
    "n5-counter-two-wipes": Bounds(
        nodes=5, clients=1, acquires=3, ttl=1, attempts=1, ticks=0, losses=1, wipes=2,
        wipe_limit=2,
    ),
    # a new quorum: every node empty, two clients setting it up at once; and from every
    # quiescent state a new client alone is granted (a set-up completes). Holders do not
    # release: with the set-up taken up again, releases more than double the states
    # (about 500,000); a holder's lease expires for the new client instead.
    "n3-set-up": Bounds(set_up=False, ttl=1, attempts=1, ticks=0, live=True, release=False),
    # a node that restarts with its data, a lost message
    "n3-restart-with-data": Bounds(ttl=1, attempts=1, ticks=0, losses=1, restarts=1),
    # two attempts per acquire call, with the call's one secret: an attempt's lost request,
    # its undo delayed past the client's timeout and run after the next attempt's grant
    "n3-retries-late-undo": RETRIES,
    # nodes without persistence, counter tokens: every node restarting empty in turn
    # (beyond the fault model), around and between a client's two acquire calls; the
    # client, which saw a grant, never hands out a token again (it refuses: DATA_LOST)
    "n3-rolling-restart": ROLLING,
}  # fmt: skip


#: The searches that take longest (minutes on a busy machine): more than the default timeout.
LONG = {"n3-retries-late-undo"}


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.timeout(900)) if n in LONG else n for n in SEARCHES],
)
def test_no_schedule_breaks_an_invariant(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    bounds = SEARCHES[name]
    report = Checker(bounds).run()
    with capsys.disabled():
        print(
            f"\n[quorum model] {name}: {report.states} states, {report.transitions} "
            f"transitions, depth {report.deepest}, {report.seconds:.1f}s, outcomes "
            f"{dict(sorted(report.verdicts.items()))}"
        )
    assert report.states > 1000  # the search went somewhere
    assert report.verdicts.get("granted", 0) > 0  # and granted leases
    if name == "n3-rolling-restart":
        assert report.verdicts.get("data_lost", 0) > 0  # and refused after the restarts


# -- the checker can fail -----------------------------------------------------------------

#: The old rule: every node votes, whether or not it kept its data.
OLD_RULE = {
    name: text.replace(
        "local function eligible(marker, tag, new_id)",
        "local function eligible(marker, tag, new_id)\n  if true then return true end",
    )
    for name, text in SCRIPTS.items()
}


def test_the_checker_finds_the_counter_example_under_the_old_rule() -> None:
    bounds = Bounds(ttl=1, attempts=1, ticks=0, losses=1, wipes=1, release=False)
    assert OLD_RULE != SCRIPTS
    with pytest.raises(Violation) as found:
        Checker(bounds, scripts=OLD_RULE).run()
    print(f"\n[quorum model] old rule: {found.value}")
    # two grants with one token, or a second grant while the first lease runs: either way
    # a node that restarted empty carried it
    assert found.value.rule in ("unique", "exclusive")
    assert any("restarts empty" in step for step in found.value.trace)


#: The undo as it was: it released whatever the call's secret held, whichever attempt of the
#: call took it.
ANY_ATTEMPT_UNDO = {
    **SCRIPTS,
    "undo": SCRIPTS["undo"].replace(
        "held[1] ~= ARGV[1] or (tonumber(held[2]) or 0) > tonumber(ARGV[2])", "held[1] ~= ARGV[1]"
    ),
}


def test_the_checker_finds_the_overlap_a_late_undo_of_an_earlier_attempt_causes() -> None:
    """Attempt 1's undo, delayed, ends the lock attempt 2 was granted on a node: a contender
    gets that node and another, a majority, while attempt 2's lease runs."""
    assert ANY_ATTEMPT_UNDO != SCRIPTS
    with pytest.raises(Violation) as found:
        Checker(RETRIES, scripts=ANY_ATTEMPT_UNDO).run()
    print(f"\n[quorum model] undo of any attempt: {found.value}")
    assert found.value.rule == "exclusive"
    assert any(step.startswith("late undo") for step in found.value.trace)
    assert any("tries again" in step for step in found.value.trace)


def test_the_checker_finds_the_lease_overlap_a_forward_clock_jump_causes() -> None:
    """A node clock that jumps forward ends its leases early: a second holder can be granted
    while the first one's deadline runs. No lease survives that; the tokens do (the search
    above with jumps finds no duplicate or out-of-order token)."""
    bounds = Bounds(
        mode=HYBRID, ttl=2, attempts=1, ticks=1, jumps=2, jump_sizes=(2,), release=False,
        wipes=0, losses=0,
    )  # fmt: skip
    with pytest.raises(Violation) as found:
        Checker(bounds, exclusive=True).run()
    assert found.value.rule == "exclusive"
    assert any("clock +2" in step for step in found.value.trace)


# -- the emulation the checker runs the scripts on ----------------------------------------


@pytest.mark.redis
def test_the_script_emulation_answers_as_redis_does(redis_url: str) -> None:
    """The same calls on a real redis-server and on the emulation give the same replies and
    leave the same keys (times aside: counter tokens, no expiry in between)."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    emulation = LuaRedis(SCRIPTS)
    store = EMPTY
    prefix = "model-diff:"
    for key in client.scan_iter(f"{prefix}*"):
        client.delete(key)
    calls = [
        (Request(Op.ACQUIRE, (0,)), "a"),  # a blank node: 'new'
        (Request(Op.PREPARE, (0,), None, ("n1",), "g"), "a"),
        (Request(Op.CONFIRM, (0,), None, ("n1",), "g"), "a"),
        (Request(Op.ACQUIRE, (0,)), "a"),  # granted
        (Request(Op.ACQUIRE, (0,)), "b"),  # held
        (Request(Op.COMMIT, (0,), 5), "a"),
        (Request(Op.COMMIT, (0,), 6), "b"),  # not the holder
        (Request(Op.RELEASE, (0,)), "b"),
        (Request(Op.RELEASE, (0,)), "a"),
        (Request(Op.REVOKE, (0,)), "r"),
        (Request(Op.FENCE, (0,), 9), "r"),
        (Request(Op.UNDO, (0,)), "r"),
        (Request(Op.REPAIR, (0,), 11, ("n1",)), "a"),  # a genesis node: no repair
        (Request(Op.PROBE, (0,)), "a"),
    ]
    try:
        for request, secret in calls:
            name, keys, args = node_call(
                request, 0, prefix=prefix, resource="r", secret=secret, ttl_ms=60_000,
                holder="h", mode="counter", nonce="n1", attempt=1,
            )  # fmt: skip
            script = client.register_script(SCRIPTS[name])
            real = script(keys=keys, args=args)
            store, emulated = emulation.run(name, tuple(keys), tuple(args), store, 1_000_000)
            if request.op is Op.ACQUIRE and isinstance(real, list) and real[0] == 0:
                assert emulated[0] == 0  # held; the pttl depends on the clock
                continue
            assert parse_answer(request.op, real) == parse_answer(request.op, emulated), name
            assert real == emulated, name
        for key, value, _ in store:
            if isinstance(value, tuple):
                assert client.hgetall(key) == dict(value), key
            else:
                assert client.get(key) == value, key
        assert {k for k in client.scan_iter(f"{prefix}*") if not k.endswith(":signal")} == {
            key for key, _, _ in store
        }
    finally:
        for key in client.scan_iter(f"{prefix}*"):
            client.delete(key)
        client.close()


#: GENESIS as it was: a set-up node is never prepared again, whether or not it granted.
NO_RESTART = {
    **SCRIPTS,
    "genesis": SCRIPTS["genesis"].replace(
        "node[1] == 'genesis' and (not node[4] or node[4] == ARGV[4])", "false"
    ),
}


def test_the_checker_finds_two_set_ups_at_once_that_leave_the_quorum_refusing() -> None:
    """Without taking up again a set-up under which nothing was granted, two clients setting
    up a quorum at once can leave one node set up under the first and the others prepared
    under the second: every later acquire is refused with ``DATA_LOST``, for ever (issue
    28). The liveness property finds it."""
    assert NO_RESTART != SCRIPTS
    with pytest.raises(Violation) as found:
        Checker(SEARCHES["n3-set-up"], scripts=NO_RESTART).run()
    print(f"\n[quorum model] no restart of a set-up: {found.value}")
    assert found.value.rule == "live"
    assert "data_lost" in str(found.value)


def test_the_checker_finds_the_token_a_rolling_restart_repeats() -> None:
    """A client that does not remember its grant takes nodes that all restarted empty for
    a new quorum, sets it up again and hands out counter token 1 once more."""
    with pytest.raises(Violation) as found:
        Checker(replace(ROLLING, remember=False)).run()
    print(f"\n[quorum model] no memory of a grant: {found.value}")
    assert found.value.rule in ("unique", "ordered")
    assert sum("restarts empty" in step for step in found.value.trace) == 3
