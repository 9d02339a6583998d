"""A backfilled delivery in the executions table: a row of its own beside the regular
occurrence it replays, so neither hides the other's outcome."""

from __future__ import annotations

import random

from services.executor import settle
from services.executor.settle import Outcome
from shared.contract import delivery, entries, keys
from shared.postgres.store import Store
from shared.rules import compact, schedule
from shared.rules.plan import IntervalRule, Plan, RetryRule, WebhookPlan

MINUTE = 60_000
AT = 1_800_000_000_000  # a whole minute
PLAN = Plan(
    version=1,
    rule=IntervalRule(MINUTE),
    target=WebhookPlan("http://sink/x"),
    retry=RetryRule(max_attempts=3),
)


def occurrence(member: str, attempt: int) -> delivery.Occurrence:
    item = entries.Claimed(0, member, AT, AT, attempt, 7, 1, compact.encode(PLAN), False)
    [occ] = delivery.decode(delivery.encode([item]))
    return occ


def settled(member: str, attempt: int, ok: bool) -> settle.Settlement:
    occ = occurrence(member, attempt)
    outcome = Outcome(ok, 200 if ok else 500)
    return settle.settle(
        occ, occ.idempotency_key, outcome, AT + 10, AT + 20, AT + 20, random.Random(0)
    )


async def test_a_backfill_delivery_keeps_the_regular_occurrences_row_as_it_was(
    store: Store,
) -> None:
    # The regular occurrence died after its third attempt; the backfill replays it and succeeds.
    dead = settled(keys.member("ns", "x"), 3, ok=False)
    assert dead.row.status == "dead"
    await store.write_executions([dead.row])
    replayed = settled(keys.backfill_member("ns", "x"), 1, ok=True)
    await store.write_executions([replayed.row])
    rows = await store.recent_executions("ns", "x", 10)
    assert sorted((r["is_backfill"], r["status"], r["attempts"]) for r in rows) == [
        (False, "dead", 3),
        (True, "succeeded", 1),
    ]
    # Both carry the regular occurrence's key: the receiver deduplicates on it.
    assert {r["idempotency_key"] for r in rows} == {schedule.idempotency_key("ns", "x", AT)}


async def test_a_failing_backfill_attempt_does_not_turn_a_success_into_retrying(
    store: Store,
) -> None:
    ok = settled(keys.member("ns", "x"), 1, ok=True)
    failing = settled(keys.backfill_member("ns", "x"), 1, ok=False)
    assert failing.row.status == "retrying"
    # One batch, as the executor writes them.
    await store.write_executions([ok.row, failing.row])
    rows = await store.recent_executions("ns", "x", 10)
    assert sorted((r["is_backfill"], r["status"]) for r in rows) == [
        (False, "succeeded"),
        (True, "retrying"),
    ]
