"""Review of the policies change: a catch-up chosen by the misfire policy on a resume (or a
rebuild, or a drift repair) must be delivered, not judged again (DESIGN.md, second wave)."""

from __future__ import annotations

from services.executor import settle
from shared.contract.delivery import Occurrence
from shared.contract.entries import split_tail
from shared.rules import compact, rotation, schedule
from shared.rules.plan import IntervalRule, MisfireRule, Plan, WebhookPlan

SECOND = 1000


def fire_once_plan() -> Plan:
    return Plan(
        version=3,
        rule=IntervalRule(10 * SECOND),
        target=WebhookPlan("http://sink/x"),
        misfire=MisfireRule("fire_once", grace_ms=SECOND),
    )


def claimed(plan: Plan, nominal: int, occ_state: str) -> Occurrence:
    """The occurrence an executor receives once the dispatcher claimed this index entry."""
    member = "ns/s"
    tail = occ_state.split("|", 3)[3] if occ_state else "0"
    fires, catch_up = split_tail(tail)
    return Occurrence(
        shard=0,
        member=member,
        token=7,
        fire_ms=schedule.fire_at_ms(plan, member, nominal),
        nominal_ms=nominal,
        attempt=1,
        fires=fires,
        plan=plan,
        namespace="ns",
        id="s",
        trigger_ms=None,
        catch_up=catch_up,
    )


def test_the_catch_up_a_resume_chose_is_delivered_not_judged_again() -> None:
    plan = fire_once_plan()
    # Paused after the fire at 100 s; resumed at 135 s: 110, 120 and 130 s were missed, and
    # fire_once chooses one catch-up, the latest of them (130 s).
    current = rotation.Current(plan, "paused", 1, 100 * SECOND, None)
    placement = rotation.place_resume(current, 135 * SECOND, "ns/s")
    assert placement.next_nominal == 130 * SECOND
    upsert = rotation.index_write("ns", "s", plan, compact.encode(plan), placement)
    assert upsert is not None and upsert.next_fire_ms == 130 * SECOND
    # The executors are backlogged: the catch-up is claimed at 142 s, after 140 s was missed too.
    occ = claimed(plan, 130 * SECOND, upsert.next_occ)
    chosen = settle.missed_choice(occ, 142 * SECOND)
    # Judged again, it is skipped in favour of 140 s: the catch-up the policy chose never fires.
    assert chosen == 130 * SECOND


def test_fire_all_never_drops_an_occurrence_that_is_on_time_because_of_its_jitter() -> None:
    """fire_all's window is a lateness bound: lateness is measured from the due time (nominal +
    jitter), so a nominal older than the window whose due time is not missed still fires."""
    plan = Plan(
        version=1,
        rule=IntervalRule(60 * SECOND),
        target=WebhookPlan("http://sink/x"),
        misfire=MisfireRule("fire_all", grace_ms=SECOND, window_ms=3600 * SECOND, limit=100),
        jitter_ms=7200 * SECOND,  # two hours of jitter, above the one-hour window
    )
    member, now = "ns/s", 1_804_862_809_911
    candidate = 1_804_852_860_000  # missed (nominal + offset is long before now)
    assert schedule.is_missed(plan, member, candidate, now)
    chosen = schedule.resolve_due(plan, candidate, now, member)
    assert chosen is not None
    dropped_on_time = [
        n
        for n in range(candidate, chosen, 60 * SECOND)
        if not schedule.is_missed(plan, member, n, now)
    ]
    assert dropped_on_time == [], f"{len(dropped_on_time)} on-time occurrences dropped"


def test_a_resume_before_the_first_fire_keeps_an_occurrence_its_jitter_makes_due_later() -> None:
    """Ledger, seed 52842: a cron schedule paused before its first fire and resumed 14 ms after
    the nominal time 70 s, whose jitter offset makes it due at 71.632 s. That occurrence is on
    time (lateness is measured from the due time), so the resume must place it, under every
    policy; the resume used to start at the first nominal time after now (75 s)."""
    member = "ns/s"
    for policy in ("skip", "fire_once", "fire_all"):
        plan = Plan(
            version=1,
            rule=IntervalRule(5 * SECOND),
            target=WebhookPlan("http://sink/x"),
            misfire=MisfireRule(policy, grace_ms=SECOND),
            jitter_ms=3 * SECOND,
        )
        nominal = next(
            n
            for n in range(70 * SECOND, 7000 * SECOND, 5 * SECOND)
            if schedule.fire_at_ms(plan, member, n) - n > 1500
        )
        current = rotation.Current(plan, "paused", 0, None, None)
        placement = rotation.place_resume(current, nominal + 14, member)
        assert placement.next_nominal == nominal, policy
