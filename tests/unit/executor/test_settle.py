"""What the executor decides after claiming an occurrence, without I/O."""

from __future__ import annotations

import random

from services.executor import settle
from shared.contract.delivery import Occurrence
from shared.contract.entries import split_tail
from shared.rules import schedule
from shared.rules.plan import IntervalRule, MisfireRule, Plan, WebhookPlan

SECOND = 1000


def occurrence(plan: Plan, nominal: int, *, catch_up: bool = False, attempt: int = 1) -> Occurrence:
    member = "ns/s"
    return Occurrence(
        shard=0,
        member=member,
        token=7,
        fire_ms=schedule.fire_at_ms(plan, member, nominal),
        nominal_ms=nominal,
        attempt=attempt,
        fires=0,
        plan=plan,
        namespace="ns",
        id="s",
        trigger_ms=None,
        catch_up=catch_up,
    )


def skip_plan() -> Plan:
    return Plan(
        version=4,
        rule=IntervalRule(10 * SECOND),
        target=WebhookPlan("http://sink/x"),
        misfire=MisfireRule("skip", grace_ms=SECOND),
    )


def test_a_missed_occurrence_is_replaced_by_a_catch_up_that_is_then_delivered() -> None:
    plan = skip_plan()
    late = occurrence(plan, 100 * SECOND)
    now = 125 * SECOND  # the executors were busy: 25 s late
    chosen = settle.missed_choice(late, now)
    assert chosen == 130 * SECOND
    settlement = settle.skip(late, "key", chosen, now)
    assert settlement.completion is not None
    fires, catch_up = split_tail(settlement.completion.next_occ.split("|", 3)[3])
    assert catch_up and fires == 0
    assert settlement.checkpoint is not None and settlement.checkpoint.version == 4
    # Still backlogged when the catch-up is claimed, 12 s after its time: it is delivered.
    chosen_occurrence = occurrence(plan, 130 * SECOND, catch_up=True)
    assert settle.missed_choice(chosen_occurrence, 142 * SECOND) == 130 * SECOND
    # Without the mark it would be judged again, and skipped again.
    assert settle.missed_choice(occurrence(plan, 130 * SECOND), 142 * SECOND) == 150 * SECOND


def test_a_late_completion_marks_the_next_occurrence_it_chose() -> None:
    plan = skip_plan()
    on_time = occurrence(plan, 100 * SECOND)
    # The delivery itself ran long: its successor at 110 s is missed by 125 s.
    result = settle.settle(on_time, "k", settle.Outcome(True), 100_000, 125_000, 125_000, None)  # type: ignore[arg-type]
    completion = result.completion
    assert completion is not None and completion.next_fire_ms == 130 * SECOND
    assert split_tail(completion.next_occ.split("|", 3)[3]) == (1, True)
    # On time: no mark, and the default resting state.
    result = settle.settle(on_time, "k", settle.Outcome(True), 100_000, 101_000, 101_000, None)  # type: ignore[arg-type]
    assert result.completion is not None and result.completion.next_fire_ms == 110 * SECOND
    assert result.completion.next_occ == ""


def test_retries_and_triggers_are_never_judged() -> None:
    plan = skip_plan()
    assert settle.missed_choice(occurrence(plan, 100 * SECOND, attempt=2), 10**9) == 100 * SECOND


def test_a_permanent_failure_ends_dead_at_once_and_the_rotation_goes_on() -> None:
    plan = Plan(version=1, rule=IntervalRule(10 * SECOND), target=WebhookPlan("http://sink/x"))
    occ = occurrence(plan, 100 * SECOND)
    assert plan.retry.max_attempts > 1
    refused = settle.Outcome(False, None, "not published: refused by policy", permanent=True)
    settlement = settle.settle(occ, "key", refused, 100_000, 100_010, 100_010, random.Random(0))
    assert settlement.event == "dead" and settlement.retry_delay_ms is None
    assert settlement.row.status == "dead" and settlement.row.attempts == 1
    assert settlement.row.error == "not published: refused by policy"
    assert settlement.completion is not None and settlement.completion.next_fire_ms is not None
    # An ordinary failure with attempts left is retried.
    failed = settle.Outcome(False, None, "HTTP 500")
    again = settle.settle(occ, "key", failed, 100_000, 100_010, 100_010, random.Random(0))
    assert again.event == "failed" and again.retry_delay_ms is not None
