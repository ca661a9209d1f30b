"""What a Redis server's settings mean for tokens and fences, without I/O (C2, C3, C12).

One judge for every reader of the settings: the Redis lock manager's warnings on first use,
the quorum manager's check of each node, and ``fence doctor``. Each reads the same
``CONFIG GET`` names (:data:`SETTINGS`) and gets the same :class:`Finding` objects; the
managers warn about every finding that is not ``ok``, and the doctor prints them all.

What differs between them is said by the parameters, not by a second judge:

- ``token_mode``: counter tokens are only as durable as the counter key, so they need the
  AOF fsynced on every write; hybrid tokens survive a lost counter (C3).
- ``fences``: whether the guards' fence keys are judged as well. A lost fence lets a stale
  writer in, whatever the token mode, so the doctor (which cannot tell whether guards use
  the server) asks for persistence in every mode; a lock manager judges what C2 needs of its
  own tokens. Eviction is judged either way: fence keys and counters have no ttl (C12).
- ``quorum``: the server is a node of the quorum manager, whose fault model
  (:mod:`fence._quorum`) wants a node to come back either with every write it acknowledged
  (``appendfsync always``) or empty (no persistence at all, detected and repaired), never
  with an older copy of its data (RDB snapshots, ``appendfsync everysec``), in either token
  mode.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fence._core import TokenMode

__all__ = [
    "LOADED_KEYS",
    "SETTINGS",
    "Finding",
    "Level",
    "judge_role",
    "judge_settings",
    "unreadable",
]

#: The ``CONFIG GET`` names every judge reads, one ``CONFIG GET`` each (Redis before 7.0
#: takes one name per call).
SETTINGS = ("maxmemory-policy", "maxmemory", "appendonly", "appendfsync", "save")


#: Not a ``CONFIG GET`` name: ``INFO persistence``'s count of the keys the server loaded
#: from an RDB file at its last start (Redis 7.0 and later), judged on a quorum node.
LOADED_KEYS = "rdb_last_load_keys_loaded"


class Level(enum.StrEnum):
    """How a finding weighs.

    Attributes:
        OK: nothing to do.
        WARN: a setting that loses tokens or fences in some failure, or could not be read.
        FAIL: a setting that loses them in an ordinary event (a restart, memory pressure).
    """

    OK = "ok"
    WARN = "warn"
    FAIL = "fail"


@dataclass(frozen=True, slots=True)
class Finding:
    """One verdict on a server's settings.

    Attributes:
        level: :class:`Level`.
        name: what was judged (``"maxmemory-policy"``, ``"persistence"``).
        finding: what was found and what it means, in one sentence.
        advice: what to do about it; empty when nothing needs doing.
    """

    level: Level
    name: str
    finding: str
    advice: str = ""

    @property
    def message(self) -> str:
        """The finding and the advice, as one warning says them."""
        text = f"{self.name}: {self.finding}"
        return f"{text}; what to do: {self.advice}" if self.advice else text


_EVICTION_ADVICE = (
    "CONFIG SET maxmemory-policy noeviction (best) or a volatile-* policy, which evicts only "
    "keys with a ttl; and in redis.conf"
)


def judge_settings(
    settings: Mapping[str, str], token_mode: TokenMode, *, fences: bool, quorum: bool = False
) -> list[Finding]:
    """Judge a server's eviction and persistence settings (C2, C3, C12).

    A setting that ``settings`` lacks is not judged (``save``: a missing one counts as no
    snapshots), and persistence not at all without ``appendonly``.

    Args:
        settings: ``CONFIG GET`` results for the names in :data:`SETTINGS`.
        token_mode: the token mode of the managers that use the server (a quorum node
            without persistence is warned about in counter mode: see below).
        fences: judge the persistence of the guards' fence keys too (not on a quorum node,
            which its fault model judges whole).
        quorum: the server is a node of a quorum manager (see the module). Its settings
            may also hold :data:`LOADED_KEYS`, from ``INFO persistence``.

    Returns:
        One finding per setting judged: eviction (``maxmemory-policy``), then persistence.
    """
    findings = []
    policy = settings.get("maxmemory-policy")
    if policy is not None:
        findings.append(_eviction(policy, settings.get("maxmemory"), quorum))
    appendonly = settings.get("appendonly")
    fsync = settings.get("appendfsync")
    save = settings.get("save", "")
    if appendonly is None or (appendonly == "yes" and fsync is None):
        return findings
    if quorum:
        loaded = int(settings.get(LOADED_KEYS, "0") or 0)
        counter = token_mode is TokenMode.COUNTER
        findings.append(_node_persistence(appendonly, fsync or "", save, loaded, counter))
    else:
        counter = token_mode is TokenMode.COUNTER
        findings.append(_persistence(appendonly, fsync or "", save, counter, fences))
    return findings


def _eviction(policy: str, limit: str | None, quorum: bool) -> Finding:
    if not policy.startswith("allkeys-"):
        return Finding(
            Level.OK,
            "maxmemory-policy",
            f"{policy}: fence keys and token counters (no ttl) are never evicted",
        )
    lost = "fence keys and token counters"
    if quorum:
        # Eviction is a partial loss of data: the node's marker may survive it.
        harm = (
            "a partial loss of data that the quorum cannot detect: tokens can repeat and "
            "stale writers get in again"
        )
        lost = "the node marker, token counters and fence keys"
    else:
        harm = "an evicted fence lets a stale token write again"
    unlimited = limit in ("", "0")
    return Finding(
        # With maxmemory 0 the policy is not in force (yet); with maxmemory unread, it may be.
        Level.FAIL if limit is not None and not unlimited else Level.WARN,
        "maxmemory-policy",
        f"{policy}{'' if limit is None else f' (maxmemory {limit})'}: under memory pressure "
        f"Redis may evict {lost}, which have no ttl; {harm}"
        + (" (not in force while maxmemory is 0)" if unlimited else ""),
        _EVICTION_ADVICE,
    )


def _persistence(appendonly: str, fsync: str, save: str, counter: bool, fences: bool) -> Finding:
    """A server of a single-node (or Sentinel, or Cluster) lock manager and its guards."""
    if appendonly == "yes":
        if fsync == "always":
            return Finding(
                Level.OK,
                "persistence",
                "appendonly yes, appendfsync always: every acknowledged write survives a crash "
                "of the machine",
            )
        if fsync == "everysec":
            finding = (
                "appendonly yes, appendfsync everysec: a power cut loses up to about 1 s of "
                "writes, and so can a killed process while a slow disk holds the AOF write "
                "back (up to 2 s; INFO persistence counts it in aof_delayed_fsync) (fences "
                "written then go back"
            )
            if counter:
                return Finding(
                    Level.WARN,
                    "persistence",
                    finding + ", and counter tokens issued then are issued again)",
                    "appendfsync always for counter tokens, or use hybrid tokens",
                )
            return Finding(Level.OK, "persistence", finding + "; hybrid tokens survive it)")
        return Finding(
            Level.WARN if counter or fences else Level.OK,
            "persistence",
            f"appendonly yes, appendfsync {fsync or 'unknown'}: the OS flushes the AOF when it "
            "likes, so a power cut can lose many seconds of fences"
            + (" and counter tokens" if counter else "; hybrid tokens survive it"),
            "appendfsync everysec (hybrid tokens) or always (counter tokens)",
        )
    if save:
        finding = (
            f"appendonly {appendonly}, RDB snapshots only (save {save!r}): a restart goes back "
            "to the last snapshot, and fences raised since are lost: a stale writer gets in "
            "again"
        )
    else:
        finding = (
            f"appendonly {appendonly}, no snapshots: persistence is off: a restart empties "
            "Redis, and every fence is lost: the first stale writer after it gets in"
        )
    finding += (
        "; counter tokens repeat"
        if counter
        else "; hybrid tokens survive it (the server clock moves on)"
    )
    return Finding(
        Level.FAIL if counter else Level.WARN if fences else Level.OK,
        "persistence",
        finding,
        "CONFIG SET appendonly yes, with appendfsync everysec (hybrid tokens) or always "
        "(counter tokens); and in redis.conf. Without Redis guards, hybrid tokens need no "
        "persistence",
    )


def _node_persistence(
    appendonly: str, fsync: str, save: str, loaded: int, counter: bool
) -> Finding:
    """A node of the quorum manager: all its data back after a restart, or none (and, with
    counter tokens, all of it)."""
    if appendonly != "yes" and loaded:
        # The settings say 'no data across a restart', yet the node started with data: a
        # dump.rdb from a SAVE, a BGSAVE or an earlier configuration, loaded as if intact.
        return Finding(
            Level.FAIL,
            "persistence",
            f"appendonly {appendonly}, yet the node loaded {loaded} keys from its RDB file "
            "(dir/dbfilename) when it started: an older copy of its data, which the quorum "
            "cannot tell from intact data",
            "stop the node, delete the RDB file (CONFIG GET dir, dbfilename), start it empty; "
            "start such nodes in a directory that holds no RDB file (see docs/managers.md)",
        )
    if appendonly == "yes":
        if fsync == "always":
            return Finding(
                Level.OK,
                "persistence",
                "appendonly yes, appendfsync always: the node comes back with every write it "
                "acknowledged",
            )
        return Finding(
            Level.WARN,
            "persistence",
            f"appendonly yes, appendfsync {fsync or 'unknown'}: a crash loses the last writes "
            "but keeps the rest, so the node comes back with an older copy of its data that "
            "the quorum cannot tell from intact data",
            "appendfsync always, or no persistence (a node that restarts empty is detected and "
            "repaired)",
        )
    if save:
        return Finding(
            Level.WARN,
            "persistence",
            f"appendonly {appendonly}, RDB snapshots (save {save!r}): a restart brings back the "
            "last snapshot, an older copy of the data that the quorum cannot tell from intact "
            "data",
            "appendonly yes with appendfsync always, or no persistence (save '', appendonly "
            "no): a node that restarts empty is detected and repaired",
        )
    if counter:
        # Every node restarting empty before a grant repaired any of them (at once, or in
        # turn: a rolling restart of an idle quorum) looks like a new deployment to a
        # manager that never saw a grant: it sets the quorum up again, and counter tokens
        # start over at 1.
        return Finding(
            Level.WARN,
            "persistence",
            f"appendonly {appendonly}, no snapshots, counter tokens: a node that restarts "
            "empty is detected and repaired, but if every node does before a grant (a "
            "rolling restart of an idle quorum), a manager started since sets the quorum up "
            "again and counter tokens start over at 1; guards then refuse every write until "
            "tokens pass their fences",
            "hybrid tokens (the default), which stay above the nodes' clocks, or appendonly "
            "yes with appendfsync always",
        )
    return Finding(
        Level.OK,
        "persistence",
        f"appendonly {appendonly}, no snapshots: a node that restarts empty is detected and "
        "repaired",
    )


def judge_role(role: str, version: str, where: str) -> Finding:
    """Judge a server's replication role: only a primary takes the scripts' writes.

    Args:
        role: ``role`` of ``INFO replication``.
        version: ``redis_version`` of ``INFO server``.
        where: the server, for the finding.
    """
    if role == "master":
        return Finding(Level.OK, "reachable", f"{where}: Redis {version}, role master")
    return Finding(
        Level.FAIL,
        "reachable",
        f"{where}: Redis {version}, role {role}: a replica refuses the writes of every acquire "
        "and guarded write",
        "point the URL at the primary",
    )


def unreadable(names: Sequence[str], why: str) -> Finding:
    """The settings that could not be read and so were not judged.

    Args:
        names: the ``CONFIG GET`` names not read.
        why: what happened (``"CONFIG GET is refused (...)"``).
    """
    what = (
        "eviction and persistence"
        if set(names) >= {"maxmemory-policy", "appendonly"}
        else ", ".join(names)
    )
    return Finding(
        Level.WARN,
        "settings",
        f"{why}: {what} cannot be read",
        "check them where the server is configured (a managed service's console): "
        "maxmemory-policy noeviction or volatile-*, appendonly yes",
    )
