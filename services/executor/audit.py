"""Execution rows and rotation checkpoints, written to PostgreSQL in batches.

Rows wait in bounded memory; a flush writes them all in two statements. While PostgreSQL is
away the rows stay (delivering goes on); when the buffer is full the executor stops taking
new work instead of dropping rows. Twice a second the writer tells PostgreSQL it is alive and
which rebuild barrier it answered (``services.executor.barrier``); a barrier asked for is
answered as soon as what it covers is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field

import asyncpg

from services.executor.barrier import Barrier
from shared.contract.rows import BackfillProgress, Checkpoint, ExecutionRow
from shared.postgres import barrier
from shared.postgres.store import Store
from shared.runtime import metrics, transient

log = logging.getLogger(__name__)

#: Most rows one statement writes.
MAX_BATCH = 5000
#: How often the writer tells PostgreSQL it is alive, and reads the latest barrier asked for
#: (s); a rebuild takes a writer not heard of for ``barrier.AUDIT_WRITER_ALIVE_S`` for dead.
BARRIER_HEARTBEAT_S = 0.5

#: A flush that failed on these is kept and tried again: PostgreSQL away, or a deadlock with a
#: command (rare: both lock schedules first, in key order) that rolled the whole flush back.
RETRIED: tuple[type[BaseException], ...] = (
    *transient.ERRORS,
    asyncpg.DeadlockDetectedError,
    asyncpg.SerializationError,
)


@dataclass
class _Batch:
    """What one flush writes, kept as it is (with its id) until PostgreSQL has it: a retry
    must be the same flush, or its id would not tell whether it was written."""

    rows: list[ExecutionRow]
    checkpoints: list[Checkpoint]
    backfills: list[BackfillProgress]
    id: uuid.UUID = field(default_factory=uuid.uuid4)

    def __len__(self) -> int:
        return len(self.rows) + len(self.checkpoints) + len(self.backfills)


class AuditWriter:
    def __init__(self, store: Store, flush_ms: int, max_rows: int) -> None:
        self.store = store
        self.flush_s = flush_ms / 1000
        self.max_rows = max_rows
        self.rows: list[ExecutionRow] = []
        self.checkpoints: list[Checkpoint] = []
        #: Backfill completions, written after the rows (see ``Store.write_backfill_progress``).
        self.backfills: list[BackfillProgress] = []
        #: The flush under way (tried again until written), cut from the lists above.
        self._batch: _Batch | None = None
        self._room = asyncio.Event()
        self._room.set()
        self._wake = asyncio.Event()
        #: Rebuild barriers: which one this writer may answer.
        self.barrier = Barrier()
        self.writer = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._heard_at = -BARRIER_HEARTBEAT_S

    def add(self, row: ExecutionRow, checkpoint: Checkpoint | None, *, update: bool = True) -> None:
        """``update=False``: the caller adds more at once, and calls ``update`` after."""
        self.rows.append(row)
        if checkpoint is not None:
            self.checkpoints.append(checkpoint)
        if update:
            self._update()

    def update(self) -> None:
        """After rows added with ``update=False``: the gauge, and the buffer's limit."""
        self._update()

    def add_backfill(self, progress: BackfillProgress) -> None:
        self.backfills.append(progress)
        self._update()

    @property
    def pending(self) -> int:
        buffered = len(self.rows) + len(self.checkpoints) + len(self.backfills)
        return buffered + (len(self._batch) if self._batch is not None else 0)

    def _update(self) -> None:
        pending = self.pending
        metrics.AUDIT_BUFFERED.set(pending)
        if pending >= self.max_rows:
            if self._room.is_set():
                log.warning(
                    "audit buffer full; pausing deliveries",
                    extra={"action": "audit_buffer_full", "rows": pending},
                )
            self._room.clear()
            self._wake.set()
        else:
            self._room.set()

    async def wait_for_room(self) -> None:
        await self._room.wait()

    def _next_batch(self) -> _Batch:
        if self._batch is None:
            self._batch = _Batch(
                self.rows[:MAX_BATCH], self.checkpoints[:MAX_BATCH], self.backfills[:MAX_BATCH]
            )
            del self.rows[: len(self._batch.rows)]
            del self.checkpoints[: len(self._batch.checkpoints)]
            del self.backfills[: len(self._batch.backfills)]
        return self._batch

    async def flush(self) -> bool:
        """Write what is buffered; False when PostgreSQL refused (the rows are kept)."""
        while self.pending:
            batch = self._next_batch()
            try:
                # One transaction, at most once per batch id: a flush retried after a failure,
                # or after a commit whose answer was lost, never counts a fire twice.
                await self.store.write_audit(
                    batch.rows, batch.checkpoints, batch.backfills, flush_id=batch.id
                )
            except RETRIED as exc:
                log.warning(
                    "audit write failed; rows kept",
                    extra={
                        "action": "audit_write_failed",
                        "rows": self.pending,
                        "error": repr(exc),
                    },
                )
                self._update()
                return False
            self._batch = None
            metrics.AUDIT_WRITTEN.inc(len(batch.rows))
            self._update()
        return True

    async def run(self, stopping: asyncio.Event) -> None:
        delay = self.flush_s
        flushed_at = time.monotonic()
        while not stopping.is_set():
            # Woken for the heartbeat too, however long the flush interval is.
            wait = min(delay - (time.monotonic() - flushed_at), BARRIER_HEARTBEAT_S)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), max(wait, 0))
            woken = self._wake.is_set()
            self._wake.clear()
            if woken or self.barrier.asked or time.monotonic() - flushed_at >= delay:
                # Noted before the flush: what it writes covers every settlement it counts.
                answer = self.barrier.answerable()
                ok = await self.flush() and await self.keep_barrier(answer)
                flushed_at = time.monotonic()
                delay = self.flush_s if ok else min(max(delay * 2, 0.5), 5.0)
            else:
                await self.keep_barrier(self.barrier.answered)

    async def keep_barrier(self, answer: int) -> bool:
        """Tell PostgreSQL this writer is alive and answered ``answer`` (written already),
        and learn the latest barrier asked for; at most every ``BARRIER_HEARTBEAT_S`` unless
        there is a new answer. False when PostgreSQL refused."""
        now = time.monotonic()
        if answer <= self.barrier.answered and now - self._heard_at < BARRIER_HEARTBEAT_S:
            return True
        try:
            requested = await barrier.answer(self.store.pool, self.writer, answer)
        except RETRIED:
            return False
        self._heard_at = now
        self.barrier.answered = max(self.barrier.answered, answer)
        self.barrier.learn(requested)
        if self.barrier.asked:
            self._wake.set()  # a rebuild waits: the buffer is written now, not at the interval
        return True

    async def close(self, timeout_s: float) -> int:
        """Last flush on shutdown; returns the rows that could not be written."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not await self.flush():
            if asyncio.get_running_loop().time() >= deadline:
                break
            await asyncio.sleep(0.5)
        left = self.pending
        with contextlib.suppress(*RETRIED, TimeoutError):
            # No rebuild waits for a writer that stopped.
            await asyncio.wait_for(barrier.forget(self.store.pool, self.writer), 1)
        if left:
            log.error(
                "audit rows lost at shutdown: PostgreSQL unreachable",
                extra={"action": "audit_rows_lost", "rows": left},
            )
        return left
