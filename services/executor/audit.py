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
#: (s); ``shared.postgres.barrier`` says when a rebuild takes a writer for dead.
BARRIER_HEARTBEAT_S = 0.5

#: A flush that failed on these is kept and tried again: PostgreSQL away, or a deadlock with a
#: command (rare: both lock schedules first, in key order) that rolled the whole flush back.
RETRIED: tuple[type[BaseException], ...] = (
    *transient.ERRORS,
    asyncpg.DeadlockDetectedError,
    asyncpg.SerializationError,
)

#: What leaves a heartbeat unheard (the rebuild then waits a few seconds for the writer at
#: most): PostgreSQL away, refusing, or without the barrier's table (not migrated yet).
UNHEARD: tuple[type[BaseException], ...] = (*RETRIED, asyncpg.PostgresError)


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
        self._heartbeat_task: asyncio.Task[None] | None = None

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
        """Flush until ``stopping``; the heartbeat goes on until ``close``, so a rebuild keeps
        waiting for this writer while it finishes its deliveries and writes their rows."""
        if self._heartbeat_task is None:
            self._heartbeat_task = asyncio.create_task(
                self._heartbeat(stopping), name="audit-heartbeat"
            )
        await self._flush_loop(stopping)

    async def _flush_loop(self, stopping: asyncio.Event) -> None:
        delay = self.flush_s
        while not stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay)
            self._wake.clear()
            # Noted before the flush: what it writes covers every occurrence it counts.
            answer = self.barrier.answerable()
            ok = await self.flush()
            if ok and answer > self.barrier.answered:
                await self._tell(answer)
            delay = self.flush_s if ok else min(max(delay * 2, 0.5), 5.0)

    async def _heartbeat(self, stopping: asyncio.Event) -> None:
        """Beside the flushes (a long one, or PostgreSQL away, must not make this writer look
        dead to a rebuild): alive, and the latest barrier asked for."""
        while True:
            await self._tell(self.barrier.answered)
            if stopping.is_set():
                self._wake.set()  # the flush loop stops, however long its interval
                await asyncio.sleep(BARRIER_HEARTBEAT_S)
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), BARRIER_HEARTBEAT_S)

    def barrier_may_answer(self) -> None:
        """Occurrences were settled: a barrier waiting for them is answered now."""
        if self.barrier.asked and self.barrier.answerable() > self.barrier.answered:
            self._wake.set()

    async def _tell(self, answer: int) -> None:
        """Tell PostgreSQL this writer is alive and answered ``answer`` (written already),
        and learn the latest barrier asked for. An error is not this writer's to stop for
        (PostgreSQL away, or the migration that adds the table not applied yet): the
        rebuild then waits for it a few seconds at most."""
        try:
            requested = await barrier.answer(self.store.pool, self.writer, answer)
        except UNHEARD as exc:
            log.debug("audit barrier not reached", extra={"error": repr(exc)})
            return
        self.barrier.answered = max(self.barrier.answered, answer)
        self.barrier.learn(requested)
        self.barrier_may_answer()
        if self.barrier.asked:
            self._wake.set()  # a rebuild waits: the buffer is written now, not at the interval

    async def close(self, timeout_s: float) -> int:
        """Last flush on shutdown; returns the rows that could not be written."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not await self.flush():
            if asyncio.get_running_loop().time() >= deadline:
                break
            await asyncio.sleep(0.5)
        left = self.pending
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat_task
        with contextlib.suppress(*UNHEARD, TimeoutError):
            # No rebuild waits for a writer that stopped.
            await asyncio.wait_for(barrier.forget(self.store.pool, self.writer), 1)
        if left:
            log.error(
                "audit rows lost at shutdown: PostgreSQL unreachable",
                extra={"action": "audit_rows_lost", "rows": left},
            )
        return left
