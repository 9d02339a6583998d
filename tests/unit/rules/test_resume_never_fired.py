"""Review of the ledger change to `rotation._first_still_owed`: a rotation that never fired
(paused before its first fire, or rebuilt) resumes at the first nominal time that is due (its
jitter offset counted) at or after now, and never at one that came due while it was paused.
Checked against a brute-force walk of the rule's times, for every policy, rule kind, jitter and
window bound."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shared.rules import rotation, schedule
from shared.rules.plan import (
    AfterCompletionRule,
    CronRule,
    IntervalRule,
    MisfireRule,
    OnceRule,
    Plan,
    Rule,
    WebhookPlan,
)

SECOND = 1000
BASE = 1_800_000_000_000
MEMBER = "ns/s"

rules: st.SearchStrategy[Rule] = st.one_of(
    st.builds(IntervalRule, st.integers(SECOND, 120 * SECOND)),
    st.sampled_from(
        [CronRule("* * * * *"), CronRule("*/5 * * * *"), CronRule("0 * * * *", "Europe/Berlin")]
    ),
    st.builds(OnceRule, st.integers(BASE - 600 * SECOND, BASE + 600 * SECOND)),
    st.builds(AfterCompletionRule, st.integers(1, 60 * SECOND)),
)


@st.composite
def plans(draw: st.DrawFn) -> Plan:
    start = draw(st.none() | st.integers(BASE - 3600 * SECOND, BASE + 600 * SECOND))
    end = draw(st.none() | st.integers(BASE - 600 * SECOND, BASE + 7200 * SECOND))
    return Plan(
        version=1,
        rule=draw(rules),
        target=WebhookPlan("http://sink/x"),
        start_ms=start,
        end_ms=end,
        jitter_ms=draw(st.sampled_from([0, 1, 700, 5 * SECOND, 90 * SECOND, 400 * SECOND])),
        misfire=MisfireRule(
            draw(st.sampled_from(["skip", "fire_once", "fire_all"])),
            grace_ms=draw(st.sampled_from([0, SECOND, 30 * SECOND])),
            window_ms=draw(st.sampled_from([SECOND, 3_600_000])),
            limit=draw(st.sampled_from([1, 100])),
        ),
    )


def first_due_from_now(plan: Plan, now: int) -> int | None:
    """Brute force: walk every nominal time from well before now, in order; the first whose
    due time is at or after now."""
    current = schedule.next_nominal(plan, now - plan.jitter_ms - 3600 * SECOND)
    for _ in range(100_000):
        if current is None or schedule.fire_at_ms(plan, MEMBER, current) >= now:
            return current
        current = schedule.next_nominal(plan, current)
    raise AssertionError("no end to the walk")


@settings(max_examples=400, deadline=None)
@given(plans(), st.integers(BASE - 1800 * SECOND, BASE + 1800 * SECOND))
def test_a_never_fired_rotation_resumes_at_the_first_time_due_from_now(
    plan: Plan, now: int
) -> None:
    placement = rotation.place_resume(rotation.Current(plan, "paused", 0, None, None), now, MEMBER)
    if isinstance(plan.rule, IntervalRule | CronRule):
        expected = first_due_from_now(plan, now)
        assert placement.next_nominal == expected
        # Due at or after now: on time, never a catch-up.
        assert not placement.catch_up
    else:
        # A once or a fixed delay starts as a fresh rotation would.
        assert placement.next_nominal == rotation.fresh_start(plan, now, MEMBER)
    if placement.next_nominal is None:
        assert placement.state == "completed"
