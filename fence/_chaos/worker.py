"""A chaos worker: one process running read-modify-write cycles under the lock.

Each cycle picks a record, acquires its lease, reads the counter with a registering read
(claim and read in one step, C8), waits a little (the work between read and write, the
window a pause hits), writes ``counter + 1`` with the token, and releases. In a pairing
with readers (C13) some cycles are read cycles instead: a read lease, a checked read (the
value, the token it was written under and the fence, atomically), the same wait, a
second checked read, and the release; a read is accepted only if the fence is not above
the read lease's token. Every outcome is
one JSON line of :class:`fence._chaos.checker.Record` in the worker's own log file, written
as it happens, so the log survives whatever the controller does to the process.

The worker tells the controller what it is doing through a :class:`Board` in shared memory,
without locks: a lock shared between processes would deadlock the controller the moment it
stopped a worker holding it.
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import asdict, dataclass
from typing import IO, Any, cast

from fence._chaos.base import Endpoints, Held, Locker, SharedStore, Store
from fence._chaos.checker import Record
from fence._chaos.pairings import PAIRINGS, open_locker, open_store
from fence._errors import BackendError, NotOwnerError, StaleTokenError

__all__ = ["Board", "Phase", "WorkerConfig", "main"]


class Phase:
    """What a worker is doing, as posted on the :class:`Board`."""

    STARTING = -1
    READY = -2
    DONE = -3
    IDLE = 0
    HOLDING = 1  # holds a lease, has not read yet
    READ = 2  # holds a lease, has read, has not written yet


class Board:
    """Shared memory between the controller and the workers: four slots per worker
    (phase, token, record index, cycle number) and two flags (go, stop).

    Args:
        array: a ``multiprocessing`` ``RawArray("q", Board.size(workers))``.
        workers: the number of workers.
    """

    _SLOTS = 4

    def __init__(self, array: Any, workers: int) -> None:
        self.array = array
        self.workers = workers
        self._flags = workers * self._SLOTS

    @classmethod
    def size(cls, workers: int) -> int:
        """The array length a board for ``workers`` needs."""
        return workers * cls._SLOTS + 2

    def post(
        self, index: int, phase: int, token: int = 0, record: int = -1, cycle: int = 0
    ) -> None:
        """Post worker ``index``'s phase; the phase last, so a reader never sees a phase
        with the previous cycle's token."""
        base = index * self._SLOTS
        self.array[base + 1] = token
        self.array[base + 2] = record
        self.array[base + 3] = cycle
        self.array[base] = phase

    def read(self, index: int) -> tuple[int, int, int, int]:
        """Worker ``index``'s ``(phase, token, record index, cycle number)``."""
        base = index * self._SLOTS
        array = self.array
        return int(array[base]), int(array[base + 1]), int(array[base + 2]), int(array[base + 3])

    @property
    def go(self) -> bool:
        """Whether the run started."""
        return bool(self.array[self._flags])

    def start(self) -> None:
        """Start the run."""
        self.array[self._flags] = 1

    @property
    def stopping(self) -> bool:
        """Whether the workers are to finish their cycle and exit."""
        return bool(self.array[self._flags + 1])

    def stop(self) -> None:
        """Ask the workers to finish their cycle and exit."""
        self.array[self._flags + 1] = 1


@dataclass(frozen=True, slots=True)
class WorkerConfig:
    """Everything a worker process needs; picklable.

    Attributes:
        name: the worker's name in the log (``w1``...).
        index: its slot on the board.
        pairing: a key of :data:`fence._chaos.pairings.PAIRINGS`.
        endpoints: the servers.
        records: the records it may lock.
        ttl: the lease time, in seconds.
        work: seconds between the read and the write.
        acquire_timeout: how long one acquire may wait, in seconds.
        log_path: its JSONL log.
        seed: its random seed.
    """

    name: str
    index: int
    pairing: str
    endpoints: Endpoints
    records: tuple[str, ...]
    ttl: float
    work: float
    acquire_timeout: float
    log_path: str
    seed: int


def _short(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:200]


class _Worker:
    def __init__(self, config: WorkerConfig, board: Board, log: IO[str]) -> None:
        self.config = config
        self.board = board
        self.log = log
        self.rng = random.Random(config.seed)
        self.cycles = 0

    def emit(
        self,
        event: str,
        scope: str | None = None,
        token: int | None = None,
        before: int | None = None,
        after: int | None = None,
        detail: str | None = None,
        written: int | None = None,
        fence: int | None = None,
    ) -> None:
        record = Record(
            time.time(),
            self.config.name,
            event,
            scope,
            token,
            before,
            after,
            detail,
            written,
            fence,
        )
        data = {k: v for k, v in asdict(record).items() if v is not None}
        self.log.write(json.dumps(data, separators=(",", ":")) + "\n")

    def backoff(self) -> None:
        time.sleep(self.rng.uniform(0.02, 0.08))

    def cycle(self, locker: Locker, store: Store) -> None:
        config = self.config
        index = self.rng.randrange(len(config.records))
        record = config.records[index]
        share = PAIRINGS[config.pairing].readers
        if share and self.rng.random() < share:
            self.read_cycle(locker, cast(SharedStore, store), record, index)
            return
        try:
            held = locker.acquire(record, config.acquire_timeout)
        except BackendError as err:
            self.emit("acquire_error", record, detail=_short(err))
            self.backoff()
            return
        if held is None:
            return
        token = held.token
        self.cycles += 1
        self.board.post(config.index, Phase.HOLDING, token or 0, index, self.cycles)
        self.emit("acquired", record, token)
        try:
            self.read_modify_write(store, record, index, token)
        finally:
            # Posted before the release: a pause that lands during the release is not
            # counted as a pause of a holder.
            self.board.post(config.index, Phase.IDLE)
            self.release(held, record, token)

    def read_modify_write(self, store: Store, record: str, index: int, token: int | None) -> None:
        config = self.config
        try:
            before = store.read(record, token)
        except StaleTokenError as err:
            self.emit("read_rejected", record, token, detail=f"{err.reason} fence {err.fence}")
            return
        except BackendError as err:
            self.emit("read_error", record, token, detail=_short(err))
            self.backoff()
            return
        self.board.post(config.index, Phase.READ, token or 0, index, self.cycles)
        if config.work > 0:
            time.sleep(config.work)
        after = before + 1
        try:
            store.write(record, token, after)
        except StaleTokenError as err:
            self.emit(
                "write_rejected", record, token, before, after, f"{err.reason} fence {err.fence}"
            )
        except BackendError as err:
            # The reply was lost: the write may or may not have been applied.
            self.emit("write_error", record, token, before, after, _short(err))
            self.backoff()
        else:
            self.emit("write_ok", record, token, before, after)

    def read_cycle(self, locker: Locker, store: SharedStore, record: str, index: int) -> None:
        config = self.config
        try:
            held = locker.acquire(record, config.acquire_timeout, mode="read")
        except BackendError as err:
            self.emit("acquire_error", record, detail=_short(err))
            self.backoff()
            return
        if held is None:
            return
        token = held.token
        self.cycles += 1
        self.board.post(config.index, Phase.HOLDING, token or 0, index, self.cycles)
        self.emit("acquired_read", record, token)
        try:
            if self.checked_read(store, record, token) and config.work > 0:
                # The window a pause hits: a writer may come in once the lease is over.
                self.board.post(config.index, Phase.READ, token or 0, index, self.cycles)
                time.sleep(config.work)
                self.checked_read(store, record, token)
        finally:
            self.board.post(config.index, Phase.IDLE)
            self.release(held, record, token)

    def checked_read(self, store: SharedStore, record: str, token: int | None) -> bool:
        """One checked read; whether it was accepted (the fence not above ``token``)."""
        try:
            seen = store.checked_read(record)
        except BackendError as err:
            self.emit("read_error", record, token, detail=_short(err))
            return False
        if token is None or (seen.fence is not None and seen.fence > token):
            detail = f"STALE fence {seen.fence}: a writer newer than the read lease wrote"
            self.emit("read_rejected", record, token, seen.value, detail=detail, fence=seen.fence)
            return False
        self.emit("read_ok", record, token, seen.value, written=seen.written, fence=seen.fence)
        return True

    def release(self, held: Held, record: str, token: int | None) -> None:
        try:
            held.release()
        except NotOwnerError:
            self.emit("lost", record, token, detail="the lease had expired before the release")
        except BackendError as err:
            self.emit("lost", record, token, detail=f"release failed: {_short(err)}")
        else:
            self.emit("released", record, token)


def main(config: WorkerConfig, array: Any) -> None:
    """The worker process: connect, post READY, wait for go, cycle until stop."""
    # Library warnings (a lost LISTEN connection during a server crash) go to a file next
    # to the log, not to the terminal of the run.
    logging.basicConfig(
        filename=config.log_path + ".stderr",
        level=logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    logging.captureWarnings(True)
    board = Board(array, (len(array) - 2) // Board._SLOTS)
    board.post(config.index, Phase.STARTING)
    pairing = PAIRINGS[config.pairing]
    locker = open_locker(pairing, config.endpoints, config.ttl)
    store = open_store(pairing, config.endpoints)
    with open(config.log_path, "a", encoding="utf-8", buffering=1) as log:
        worker = _Worker(config, board, log)
        try:
            board.post(config.index, Phase.READY)
            while not board.go:
                if board.stopping:
                    return
                time.sleep(0.005)
            board.post(config.index, Phase.IDLE)
            while not board.stopping:
                worker.cycle(locker, store)
        finally:
            board.post(config.index, Phase.DONE)
            try:
                store.close()
            finally:
                locker.close()
