"""An executor's audit flush counts each fire once: all of it in one transaction, a failed
attempt logged once however often its row is written, and an earlier attempt's row that
arrives last still brings the first attempt's lateness (issue 27's review)."""

from __future__ import annotations

import dataclasses
import uuid

import asyncpg
import pytest

from shared.contract.rows import BackfillProgress, Checkpoint, failed_attempt
from shared.postgres.store import Store
from tests.integration.test_console import _execution, _row


async def _stats(store: Store, schedule_id: str) -> dict[str, int]:
    found = await store.schedule_stats("demo", [schedule_id])
    row = found.get(schedule_id, {})
    return {k: row.get(k) or 0 for k in ("fires", "succeeded", "failed")}


async def _minutes(store: Store) -> int:
    return int(
        await store.pool.fetchval(
            "SELECT COALESCE(sum(fires), 0) FROM namespace_minutes WHERE namespace = 'demo'"
        )
    )


async def test_a_flush_that_fails_part_way_writes_nothing_and_its_retry_counts_once(
    store: Store,
) -> None:
    async with store.transaction() as conn:
        await store.put_schedules(conn, [_row("demo", "tick")])
    rows = [_execution("demo", "tick", ago, "succeeded") for ago in (30, 20, 10)]
    # A backfill step PostgreSQL refuses (a NUL in its text) fails the flush's last
    # statement, after the rows, the stats and the minutes were written.
    refused = BackfillProgress("demo\x00", "tick", 1, 10**12, 3)
    with pytest.raises((asyncpg.PostgresError, asyncpg.InterfaceError)):
        await store.write_audit(rows, (), [refused])
    assert await _stats(store, "tick") == {"fires": 0, "succeeded": 0, "failed": 0}
    assert await _minutes(store) == 0
    assert await store.pool.fetchval("SELECT count(*) FROM executions WHERE id = 'tick'") == 0

    await store.write_audit(rows, (), ())
    assert await _stats(store, "tick") == {"fires": 3, "succeeded": 3, "failed": 0}
    assert await _minutes(store) == 3


async def test_a_failed_attempt_is_logged_once_whatever_the_order_its_rows_arrive_in(
    store: Store,
) -> None:
    async with store.transaction() as conn:
        await store.put_schedules(conn, [_row("demo", "flaky")])
    first = _execution("demo", "flaky", 40, "retrying", http_status=503, error="HTTP 503")
    first.failed_attempts = [failed_attempt(first)]
    retried = _execution("demo", "flaky", 40, "succeeded", attempts=2, late_ms=1_500)
    # The retry's row first (another executor flushed sooner), then the first attempt's,
    # twice (a flush retried after its commit was lost on the way back).
    await store.write_executions([retried])
    await store.write_executions([first])
    await store.write_executions([first])
    row = await store.pool.fetchrow(
        "SELECT attempts, status, lateness_ms, failed_attempts FROM executions WHERE id = 'flaky'"
    )
    assert row is not None
    assert row["attempts"] == 2 and row["status"] == "succeeded"
    assert row["lateness_ms"] == 12  # the first attempt's, not the retry's 1,500 ms
    assert [a["attempt"] for a in row["failed_attempts"]] == [1]
    assert row["failed_attempts"][0]["http_status"] == 503


async def test_uncounted_fires_of_an_older_rotation_are_not_added_to_a_restarted_one(
    store: Store,
) -> None:
    first = dataclasses.replace(_row("demo", "tick"), rotation_version=1)
    restarted = dataclasses.replace(first, version=2, rotation_version=2, fires=0)
    async with store.transaction() as conn:
        await store.put_schedules(conn, [first])
    now = first.next_fire_ms or 0
    await store.write_audit(
        (), [Checkpoint("demo", "tick", now, now + 60_000, 1, version=1, counted=False)], ()
    )
    async with store.transaction() as conn:
        await store.put_schedules(conn, [restarted])
    # A late flush of the old rotation's fire (another executor), then the new rotation's.
    late = Checkpoint("demo", "tick", now + 1, now + 60_000, 1, version=1, counted=False)
    await store.write_audit((), [late], ())
    assert await store.pool.fetchval("SELECT fires FROM schedules WHERE id = 'tick'") == 0
    new = Checkpoint("demo", "tick", now + 2, now + 60_000, 1, version=2, counted=False)
    await store.write_audit((), [new], ())
    assert await store.pool.fetchval("SELECT fires FROM schedules WHERE id = 'tick'") == 1


async def test_a_flush_retried_after_its_commit_adds_nothing_twice(store: Store) -> None:
    async with store.transaction() as conn:
        await store.put_schedules(conn, [_row("demo", "tick")])
    rows = [_execution("demo", "tick", ago, "succeeded") for ago in (30, 20, 10)]
    flush = uuid.uuid4()
    assert await store.write_audit(rows, (), (), flush_id=flush) is True
    # The commit's answer was lost (the connection dropped): the writer tries the same batch.
    assert await store.write_audit(rows, (), (), flush_id=flush) is False
    assert await _stats(store, "tick") == {"fires": 3, "succeeded": 3, "failed": 0}
    assert await _minutes(store) == 3
