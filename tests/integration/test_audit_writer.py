"""Execution rows wait in bounded memory while PostgreSQL is away, and nothing is dropped."""

from __future__ import annotations

import asyncio

import asyncpg

from services.executor.audit import AuditWriter
from shared.contract.rows import Checkpoint, ExecutionRow
from shared.postgres.store import Store


def row(i: int) -> ExecutionRow:
    return ExecutionRow(
        "ns",
        f"s{i}",
        1_800_000_000_000 + i,
        False,
        1,
        "succeeded",
        200,
        None,
        f"key-{i}",
        1_800_000_000_100,
        1_800_000_000_200,
    )


async def test_rows_are_kept_while_postgres_is_away_and_delivering_pauses_when_full(
    database_url: str,
) -> None:
    store = await Store.open(database_url)
    writer = AuditWriter(store, flush_ms=10, max_rows=1000)
    await store.close()  # PostgreSQL is "away" for this writer: its pool is gone
    for i in range(999):
        writer.add(row(i), Checkpoint("ns", f"s{i}", 1, 2, 1) if i == 0 else None)
    assert await writer.flush() is False
    assert writer.pending == 1000  # 999 rows and a checkpoint, kept (in the batch retried)
    # Full: taking more work waits instead of dropping rows.
    waiting = asyncio.create_task(writer.wait_for_room())
    await asyncio.sleep(0.05)
    assert waiting.done() is False
    # PostgreSQL is back: the rows are written and work resumes.
    writer.store = await Store.open(database_url)
    try:
        assert await writer.flush() is True
        await asyncio.wait_for(waiting, 1)
        conn = await asyncpg.connect(database_url)
        try:
            assert await conn.fetchval("SELECT count(*) FROM executions") == 999
        finally:
            await conn.close()
    finally:
        await writer.store.close()
