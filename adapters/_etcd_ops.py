"""The etcd guard without I/O: its key layout, its transactions and how it reads their replies.

Data key ``K`` has its fence in the key ``<prefix>guard/K`` (``prefix`` is the lock manager's,
``fence/`` by default), written in the same transaction as ``K`` and never attached to a
lease, so it outlives the data (a tombstone, C7). The fence is 16 decimal digits, zero
padded: every token (``1 .. 2**53 - 1``) fits, and etcd's byte-wise comparison of values is
then the integer comparison, so the transaction itself compares the fence with the token.

etcd fails a comparison of the value of a key that does not exist, so "the fence is missing
or not above the token" takes two comparisons: a transaction whose compare asks for the
missing fence (``create_revision == 0``), and in its failure branch a nested transaction
that compares the value. One key (a put, a delete, a claim, a registering read) is one
round trip whatever its fence. A fence key the guard wrote before exists (fences are never
deleted), so a write on it compares the value alone, in a flat transaction half the size.
A batch names every fence in one flat transaction, each compared as the guard expects to
find it (present if it wrote it, else as a failure said); a wrong expectation costs one
more round trip, never a wrong verdict, because each comparison is exact.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from fence import ConfigurationError, InvalidResourceError, Reason, StaleTokenError
from fence._core import MAX_TOKEN, batch_rejection
from fence._etcd import b64, range_kvs

__all__ = [
    "CACHE_LIMIT",
    "FENCE_DIGITS",
    "EtcdOp",
    "Layout",
    "Verdict",
    "encode_fence",
    "encode_value",
    "judge",
    "parse_fence",
    "results_of",
    "txn",
]

#: Digits of a fence value: ``2**53`` has 16, so every token and the token after it fit.
FENCE_DIGITS = 16

#: How many fence keys a guard remembers as existing before it forgets them all (a
#: forgotten one costs a larger request, never a round trip or a wrong verdict).
CACHE_LIMIT = 100_000

#: The sub-namespace of the prefix that holds the guard's fence keys.
_FENCES = "guard/"


def encode_fence(token: int) -> bytes:
    """A token as the fence value: 16 digits, zero padded, so bytes compare as integers."""
    return b"%016d" % token


def parse_fence(scope: str, raw: bytes | None) -> int | None:
    """The fence stored in a fence key's value, ``None`` if the key is missing.

    Raises:
        StaleTokenError: ``UNVERIFIABLE``: the fence key holds something the guard never
            writes (it was written by hand).
    """
    if raw is None:
        return None
    if len(raw) == FENCE_DIGITS and raw.isdigit():
        value = int(raw)
        if 1 <= value <= MAX_TOKEN:
            return value
    raise StaleTokenError(
        scope,
        0,
        None,
        Reason.UNVERIFIABLE,
        message=f"{scope}: the fence key holds {raw[:40]!r}, not a fence this guard wrote",
    )


def encode_value(key: str, value: object) -> bytes:
    """A value as etcd stores it: ``bytes`` as they are, ``str`` as UTF-8.

    Raises:
        ConfigurationError: any other type, before any I/O.
    """
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        try:
            return value.encode()
        except UnicodeEncodeError as exc:
            raise ConfigurationError(f"{key}: the value is not valid UTF-8 ({exc})") from exc
    raise ConfigurationError(
        f"{key}: an etcd value is bytes or str, got {type(value).__name__} {value!r}"
    )


class Layout:
    """Where the fence of each data key lives, and which keys are the guard's own.

    Every key that starts with ``prefix`` is reserved (the lock manager's queues, the
    fences): the guard refuses it as a data key, so no write path reaches a fence but the
    guard's own (C9, C12).

    Args:
        prefix: the lock manager's key prefix.
    """

    __slots__ = ("_fences", "_known", "prefix")

    def __init__(self, prefix: str) -> None:
        if not isinstance(prefix, str) or not prefix or "\x00" in prefix:
            raise ConfigurationError(f"prefix must be a non-empty str without NUL, got {prefix!r}")
        self.prefix = prefix
        self._fences = (prefix + _FENCES).encode()
        # Checked keys with their bytes and base64 forms: a holder writes a key many times.
        self._known: dict[str, tuple[bytes, bytes, str, str]] = {}

    def data_key(self, key: object) -> bytes:
        """``key`` as etcd stores it, once checked.

        Raises:
            InvalidResourceError: not a non-empty ``str``, a NUL or a lone surrogate in
                it, or a key in the reserved namespace; before any I/O.
        """
        if not isinstance(key, str) or not key:
            raise InvalidResourceError(f"an etcd key is a non-empty str, got {key!r}", value=key)
        if "\x00" in key:
            raise InvalidResourceError(f"an etcd key cannot hold NUL: {key!r}", value=key)
        if key.startswith(self.prefix):
            raise InvalidResourceError(
                f"{key!r} is in the namespace {self.prefix!r} of the lock manager and the"
                " fences; a data key there could overwrite a fence or a lock",
                value=key,
            )
        try:
            return key.encode()
        except UnicodeEncodeError as exc:
            raise InvalidResourceError(f"{key!r} is not valid UTF-8 ({exc})", value=key) from exc

    def fence_key(self, data_key: bytes) -> bytes:
        """The fence key of a checked data key."""
        return self._fences + data_key

    def op(self, code: str, key: str, value: bytes = b"", must_exist: bool = False) -> EtcdOp:
        """One operation on ``key``, checked (see :meth:`data_key`) and encoded."""
        known = self._known.get(key) if type(key) is str else None
        if known is None:
            wire = self.data_key(key)
            fence = self.fence_key(wire)
            known = (wire, fence, b64(wire), b64(fence))
            if len(self._known) >= CACHE_LIMIT:
                self._known.clear()
            self._known[key] = known
        wire, fence, wire64, fence64 = known
        value64 = b64(value) if code == "put" else ""
        return EtcdOp(code, key, wire, fence, wire64, fence64, value64, must_exist)


@dataclass(frozen=True, slots=True)
class EtcdOp:
    """One fenced operation on one data key.

    Attributes:
        code: ``put``, ``delete``, ``claim`` or ``read``.
        key: the data key as the caller named it (for errors and events).
        wire: the data key's bytes.
        fence: its fence key's bytes.
        wire64: the data key in base64, as the JSON gateway takes it.
        fence64: the fence key in base64.
        value64: the value to put in base64 (``put`` only).
        must_exist: a ``put`` that updates: ``MISSING`` if the key is absent.
    """

    code: str
    key: str
    wire: bytes
    fence: bytes
    wire64: str
    fence64: str
    value64: str = ""
    must_exist: bool = False


@functools.lru_cache(maxsize=256)
def _fences64(token: int) -> tuple[str, str]:
    """The fence of ``token`` and of ``token + 1``, in base64 (a holder writes many times
    with one token)."""
    return b64(encode_fence(token)), b64(encode_fence(token + 1))


def _range(key64: str, *, count_only: bool = False) -> dict[str, Any]:
    body: dict[str, Any] = {"key": key64}
    if count_only:
        body["count_only"] = True
    return {"request_range": body}


def _writes(fence64: str, ops: Sequence[EtcdOp]) -> list[dict[str, Any]]:
    """The success branch: each operation, then every fence raised to the token once."""
    out: list[dict[str, Any]] = []
    for op in ops:
        if op.code == "put":
            out.append({"request_put": {"key": op.wire64, "value": op.value64}})
        elif op.code == "delete":
            out.append({"request_delete_range": {"key": op.wire64}})
        elif op.code == "read":
            out.append(_range(op.wire64))
    for key64 in _fence_keys(ops):
        out.append({"request_put": {"key": key64, "value": fence64}})
    return out


def _fence_keys(ops: Sequence[EtcdOp]) -> list[str]:
    if len(ops) == 1:
        return [ops[0].fence64]
    return list(dict.fromkeys(op.fence64 for op in ops))


def _reads(ops: Sequence[EtcdOp]) -> list[dict[str, Any]]:
    """The failure branch: every fence, and whether each key that must exist does."""
    out = [_range(key64) for key64 in _fence_keys(ops)]
    out.extend(_range(op.wire64, count_only=True) for op in ops if op.must_exist)
    return out


def _compare_missing(key64: str) -> dict[str, Any]:
    return {"target": "CREATE", "key": key64, "result": "EQUAL", "create_revision": 0}


def _compare_below(key64: str, next64: str) -> dict[str, Any]:
    # value < fence(token + 1), i.e. fence <= token; 2**53 still has 16 digits.
    return {"target": "VALUE", "key": key64, "result": "LESS", "value": next64}


def _exists(op: EtcdOp) -> dict[str, Any]:
    return {"target": "VERSION", "key": op.wire64, "result": "GREATER", "version": 0}


def txn(token: int, ops: Sequence[EtcdOp], present: Mapping[bytes, bool] | None) -> dict[str, Any]:
    """The one transaction of a fenced write.

    Args:
        token: the checked token.
        ops: the operations, each data key at most once.
        present: for a batch, whether each fence key is expected to exist; ``None`` for one
            fence key, compared both ways in one nested transaction.
    """
    fence64, next64 = _fences64(token)
    extra = [_exists(op) for op in ops if op.must_exist]
    writes = _writes(fence64, ops)
    reads = _reads(ops)
    if present is None:
        (key64,) = {op.fence64 for op in ops}
        nested = {
            "compare": [_compare_below(key64, next64), *extra],
            "success": writes,
            "failure": reads,
        }
        return {
            "compare": [_compare_missing(key64), *extra],
            "success": writes,
            "failure": [{"request_txn": nested}],
        }
    compare = [
        _compare_below(op.fence64, next64)
        if present.get(op.fence, True)
        else _compare_missing(op.fence64)
        for op in {op.fence: op for op in ops}.values()
    ]
    return {"compare": compare + extra, "success": writes, "failure": reads}


def _branch(reply: Mapping[str, Any]) -> tuple[bool, list[Any]]:
    """Whether the write happened, and the responses of the branch that ran."""
    responses = list(reply.get("responses", ()))
    if reply.get("succeeded"):
        return True, responses
    if len(responses) == 1 and "response_txn" in responses[0]:
        inner = responses[0]["response_txn"]
        return bool(inner.get("succeeded")), list(inner.get("responses", ()))
    return False, responses


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the guard learnt from a transaction that did not write.

    Attributes:
        error: the rejection to raise, or ``None`` if nothing was rejected (the batch
            expected a fence key in the state it was not in: send it again with
            :attr:`present`).
        present: which fence keys exist.
    """

    error: StaleTokenError | None
    present: dict[bytes, bool]


def results_of(reply: Mapping[str, Any], ops: Sequence[EtcdOp]) -> list[Any] | None:
    """The result of each operation of a transaction that wrote, ``None`` if it did not.

    ``put`` and ``claim`` give ``True``; ``delete`` whether the key existed; ``read`` the
    value (``None`` if absent).
    """
    wrote, responses = _branch(reply)
    if not wrote:
        return None
    out: list[Any] = []
    at = 0
    for op in ops:
        if op.code == "claim":
            out.append(True)
            continue
        answer = responses[at] if at < len(responses) else {}
        at += 1
        if op.code == "delete":
            out.append(int(answer.get("response_delete_range", {}).get("deleted", 0)) > 0)
        elif op.code == "read":
            kvs, _ = range_kvs(answer.get("response_range", {}))
            out.append(kvs[0].value if kvs else None)
        else:
            out.append(True)
    return out


def judge(reply: Mapping[str, Any], token: int, ops: Sequence[EtcdOp], scope: str) -> Verdict:
    """The verdict of a transaction that did not write, from its failure branch.

    Args:
        reply: the transaction's reply.
        token: the token presented.
        ops: the operations.
        scope: what a batch error names as its scope.
    """
    _, responses = _branch(reply)
    fences = list(dict.fromkeys(op.fence for op in ops))
    checked = [op for op in ops if op.must_exist]
    values: dict[bytes, bytes | None] = {}
    for key, answer in zip(fences, responses, strict=False):
        kvs, _ = range_kvs(answer.get("response_range", {}))
        values[key] = kvs[0].value if kvs else None
    counts = {}
    for op, answer in zip(checked, responses[len(fences) :], strict=False):
        _, count = range_kvs(answer.get("response_range", {}))
        counts[op.wire] = count
    errors: list[StaleTokenError] = []
    seen: set[bytes] = set()
    for op in ops:
        try:
            fence = parse_fence(op.key, values.get(op.fence))
        except StaleTokenError as err:
            if op.fence not in seen:
                unverifiable = Reason.UNVERIFIABLE
                errors.append(StaleTokenError(op.key, token, None, unverifiable, message=str(err)))
                seen.add(op.fence)
            continue
        if fence is not None and fence > token:
            if op.fence not in seen:
                errors.append(StaleTokenError(op.key, token, fence, Reason.STALE))
                seen.add(op.fence)
        elif op.must_exist and counts.get(op.wire, 1) == 0:
            errors.append(StaleTokenError(op.key, token, fence, Reason.MISSING))
    present = {key: values.get(key) is not None for key in fences}
    if not errors:
        return Verdict(None, present)
    if len(ops) == 1:
        return Verdict(errors[0], present)
    return Verdict(batch_rejection(scope, token, errors), present)
