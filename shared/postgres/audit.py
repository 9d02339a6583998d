"""The executors' audit writes: execution rows, the stats and minutes they add, checkpoints and
backfill progress, each one statement for a whole batch.

Every function runs on the connection it is given, so that ``write_audit`` can put a whole
flush in one transaction: the counters (stats, minutes, uncounted fires) are additions, and an
addition retried after a partial write would count twice.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import asyncpg

from shared.contract import codec
from shared.contract.rows import BackfillProgress, Checkpoint, ExecutionRow, finished_runs
from shared.policy import stats
from shared.postgres import columns
from shared.postgres.sql import QUERIES

#: A connection or a pool: anything that runs a statement.
Executor = asyncpg.Connection | asyncpg.pool.PoolConnectionProxy | asyncpg.Pool


async def write_audit(
    conn: Executor,
    rows: Sequence[ExecutionRow],
    checkpoints: Sequence[Checkpoint],
    backfills: Sequence[BackfillProgress],
) -> None:
    """One flush; the caller holds the transaction.

    Tables are locked in the order the intake locks them (schedules, then the rest), each
    batch in key order, so that concurrent flushes and commands never deadlock.
    """
    if checkpoints:
        await write_checkpoints(conn, checkpoints)
    if rows:
        await write_executions(conn, columns.executions(rows))
        # Stats ride along with the rows: one more statement per batch, never one per fire.
        await write_stats(conn, stats.fold(rows))
        await write_minutes(conn, stats.minutes(rows))
    if backfills:
        await write_backfill_progress(conn, backfills)


async def write_executions(conn: Executor, rows: Sequence[ExecutionRow]) -> None:
    """The latest attempt of an occurrence wins; the triggers these rows finish stop being
    pending runs."""
    batch = sorted(rows, key=lambda r: (r.namespace, r.id, r.nominal_ms, r.is_trigger))
    await conn.execute(
        QUERIES["write_executions"],
        [r.namespace for r in batch],
        [r.id for r in batch],
        [r.nominal_ms for r in batch],
        [r.is_trigger for r in batch],
        [r.attempts for r in batch],
        [r.status for r in batch],
        [r.http_status for r in batch],
        [r.error for r in batch],
        [r.idempotency_key for r in batch],
        [r.started_ms for r in batch],
        [r.finished_ms for r in batch],
        [r.is_backfill for r in batch],
        [r.lateness_ms for r in batch],
        [codec.dumps(r.failed_attempts).decode() for r in batch],
    )
    done = finished_runs(batch)
    if done:
        await conn.execute(
            QUERIES["finish_pending_runs"],
            [r.namespace for r in done],
            [r.id for r in done],
            [r.kind for r in done],
            [r.nominal_ms for r in done],
        )


async def write_checkpoints(conn: Executor, rows: Sequence[Checkpoint]) -> None:
    """The latest fire of a schedule wins; a finished rotation ends its backfill."""
    batch = sorted(columns.checkpoints(rows), key=lambda c: (c.namespace, c.id))
    await conn.execute(
        QUERIES["write_checkpoints"],
        [c.namespace for c in batch],
        [c.id for c in batch],
        [c.last_fire_ms for c in batch],
        [c.next_fire_ms for c in batch],
        [c.fires for c in batch],
        [c.finished for c in batch],
        [c.version for c in batch],
        [c.counted for c in batch],
    )
    finished = [c for c in batch if c.finished]
    if finished:
        # A schedule whose rotation is over takes its backfill with it (complete.lua).
        await conn.execute(
            QUERIES["end_backfills_of_schedules"],
            [c.namespace for c in finished],
            [c.id for c in finished],
        )


async def write_stats(conn: Executor, deltas: Sequence[Any]) -> None:
    """Per-schedule stats deltas (``shared.policy.stats.Delta``)."""
    if deltas:
        await conn.execute(QUERIES["write_stats"], *columns.stats_arguments(deltas))


async def write_minutes(conn: Executor, entries: Sequence[Any]) -> None:
    """Per-namespace minutes (``shared.policy.stats.Minute``)."""
    if not entries:
        return
    await conn.execute(
        QUERIES["write_minutes"],
        [m.namespace for m in entries],
        [m.minute_ms for m in entries],
        [m.fires for m in entries],
        [m.succeeded for m in entries],
        [m.failed_attempts for m in entries],
        [m.dead for m in entries],
    )


async def write_backfill_progress(conn: Executor, items: Sequence[BackfillProgress]) -> None:
    """The backfills that go on and those that ended; the furthest completion of each wins."""
    latest: dict[tuple[str, str, int], BackfillProgress] = {}
    for item in items:
        key = (item.namespace, item.id, item.generation)
        if key not in latest or item.remaining < latest[key].remaining:
            latest[key] = item
    # In key order, as every batch here: two flushes lock the same rows in the same order.
    ordered = [latest[key] for key in sorted(latest)]
    going = [p for p in ordered if p.remaining > 0 and p.next_ms is not None]
    ended = [p for p in ordered if p.remaining <= 0 or p.next_ms is None]
    if going:
        await conn.execute(
            QUERIES["advance_backfills"],
            [p.namespace for p in going],
            [p.id for p in going],
            [p.generation for p in going],
            [p.next_ms for p in going],
            [p.remaining for p in going],
        )
    if ended:
        await conn.execute(
            QUERIES["end_backfills"],
            [p.namespace for p in ended],
            [p.id for p in ended],
            [p.generation for p in ended],
        )
