"""Triggers in PostgreSQL: their own execution rows, pending until they complete."""

from __future__ import annotations

from shared.contract.rows import ExecutionRow, PendingRun
from shared.postgres.store import Store
from shared.rules import schedule

AT = 1_800_000_000_000  # a whole second


def execution(trigger: bool, status: str = "succeeded", attempts: int = 1) -> ExecutionRow:
    return ExecutionRow(
        "ns",
        "x",
        AT,
        trigger,
        attempts,
        status,
        200 if status == "succeeded" else 500,
        None,
        schedule.occurrence_key("ns", "x", AT, trigger=trigger),
        AT + 5,
        AT + 9,
    )


async def test_a_trigger_at_the_instant_of_a_regular_occurrence_has_its_own_row(
    store: Store,
) -> None:
    # One batch, as the executor writes them: both occurrences keep a row of their own.
    await store.write_executions([execution(False), execution(True)])
    rows = await store.recent_executions("ns", "x", 10)
    assert sorted((r["is_trigger"], r["idempotency_key"]) for r in rows) == [
        (False, schedule.idempotency_key("ns", "x", AT)),
        (True, schedule.trigger_key("ns", "x", AT)),
    ]
    # A later attempt of the trigger replaces the trigger's row only.
    await store.write_executions([execution(True, "dead", attempts=3)])
    rows = await store.recent_executions("ns", "x", 10)
    assert sorted((r["is_trigger"], r["status"], r["attempts"]) for r in rows) == [
        (False, "succeeded", 1),
        (True, "dead", 3),
    ]


async def test_a_trigger_stays_pending_until_its_run_succeeds_or_dies(store: Store) -> None:
    run = PendingRun("ns", "x", "trigger", AT)
    other = PendingRun("ns", "x", "trigger", AT + 1)
    async with store.transaction() as conn:
        assert await store.add_pending_run(conn, run) is True
        assert await store.add_pending_run(conn, run) is False  # that very run is pending
        assert await store.add_pending_run(conn, other) is True
    # A failed attempt with attempts left, and the regular occurrence at the same instant,
    # leave it pending.
    await store.write_executions([execution(True, "retrying"), execution(False)])
    assert await store.pending_run_exists(run)
    await store.write_executions([execution(True, "succeeded", attempts=2)])
    assert not await store.pending_run_exists(run)
    assert await store.pending_run_exists(other)
    # Deleting the schedule drops whatever is still pending.
    async with store.transaction() as conn:
        await store.drop_pending_runs(conn, "ns", "x")
    assert not await store.pending_run_exists(other)
