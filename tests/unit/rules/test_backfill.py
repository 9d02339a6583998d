"""Which nominal occurrences a backfill delivers: [from, to), oldest first, at most limit, the
schedule's window and exclusions applied, DST as the rotation has it (pure)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shared.contract import timefmt
from shared.rules import backfill, cron, schedule
from shared.rules.exclusion import CronExclusion, RangeExclusion
from shared.rules.plan import (
    AfterCompletionRule,
    CronRule,
    IntervalRule,
    OnceRule,
    Plan,
    WebhookPlan,
)

T = timefmt.parse_rfc3339_ms
TARGET = WebhookPlan("http://sink/x")
MINUTE = 60_000
HOUR = 3_600_000
DAY = 86_400_000
BASE = T("2027-01-01T00:00:00Z")


def make(rule: object, *excluded: object, **kw: object) -> Plan:
    return Plan(version=1, rule=rule, target=TARGET, exclude=tuple(excluded), **kw)  # type: ignore[arg-type]


def listed(plan: Plan, start: str, end: str, limit: int = 1000) -> list[str]:
    return [timefmt.format_ms(v) for v in backfill.occurrences(plan, T(start), T(end), limit)]


def chained(plan: Plan, from_ms: int, to_ms: int, limit: int) -> list[int]:
    """What the index delivers: the first from the intake, then each completion's next_after,
    while before `to` and under the count (complete.lua's rule)."""
    extent = backfill.extent(plan, from_ms, to_ms, limit)
    out: list[int] = []
    current = extent.first_ms
    while current is not None and len(out) < extent.occurrences:
        out.append(current)
        following = backfill.next_after(plan, current)
        current = following if following is not None and following < to_ms else None
    return out


def test_an_interval_backfill_is_its_grid_in_from_to() -> None:
    plan = make(IntervalRule(HOUR))
    assert listed(plan, "2027-01-01T00:30:00Z", "2027-01-01T03:00:00Z") == [
        "2027-01-01T01:00:00Z",
        "2027-01-01T02:00:00Z",
    ]


def test_from_is_inclusive_and_to_exclusive() -> None:
    plan = make(IntervalRule(HOUR))
    assert listed(plan, "2027-01-01T01:00:00Z", "2027-01-01T03:00:00Z") == [
        "2027-01-01T01:00:00Z",
        "2027-01-01T02:00:00Z",
    ]


def test_the_limit_keeps_the_oldest() -> None:
    plan = make(CronRule("0 9 * * *"))
    assert listed(plan, "2027-01-01T00:00:00Z", "2027-02-01T00:00:00Z", limit=3) == [
        "2027-01-01T09:00:00Z",
        "2027-01-02T09:00:00Z",
        "2027-01-03T09:00:00Z",
    ]


def test_exclusions_and_the_schedules_window_are_not_delivered() -> None:
    plan = make(
        CronRule("0 9 * * *"),
        CronExclusion("* * 2 1 *"),
        RangeExclusion(T("2027-01-04T00:00:00Z"), T("2027-01-05T00:00:00Z")),
        start_ms=T("2027-01-01T10:00:00Z"),
        end_ms=T("2027-01-05T09:00:00Z"),
    )
    assert listed(plan, "2026-12-01T00:00:00Z", "2027-01-10T00:00:00Z") == [
        "2027-01-03T09:00:00Z",
        "2027-01-05T09:00:00Z",
    ]


def test_a_dst_zone_cron_backfill_is_the_rotations_times() -> None:
    # 02:30 does not exist in Berlin on 2027-03-28: it fires at 03:30 local (01:30Z).
    # 02:30 exists twice on 2027-10-31: it fires at the first (00:30Z) only.
    plan = make(CronRule("30 2 * * *", "Europe/Berlin"))
    assert listed(plan, "2027-03-27T00:00:00Z", "2027-03-30T00:00:00Z") == [
        "2027-03-27T01:30:00Z",
        "2027-03-28T01:30:00Z",
        "2027-03-29T00:30:00Z",
    ]
    assert listed(plan, "2027-10-30T00:00:00Z", "2027-11-01T00:00:00Z") == [
        "2027-10-30T00:30:00Z",
        "2027-10-31T00:30:00Z",
    ]
    # A wildcard hour fires at both repeated hours.
    hourly = make(CronRule("0 * * * *", "Europe/Berlin"))
    assert len(listed(hourly, "2027-10-30T22:00:00Z", "2027-10-31T03:00:00Z")) == 5


def test_a_once_schedule_backfills_its_instant_when_inside() -> None:
    plan = make(OnceRule(T("2027-01-02T00:00:00Z")))
    assert listed(plan, "2027-01-01T00:00:00Z", "2027-01-03T00:00:00Z") == ["2027-01-02T00:00:00Z"]
    assert listed(plan, "2027-01-03T00:00:00Z", "2027-01-04T00:00:00Z") == []


def test_after_completion_has_no_nominal_times() -> None:
    plan = make(AfterCompletionRule(MINUTE))
    assert not backfill.has_nominal_times(plan)
    assert backfill.extent(plan, BASE, BASE + DAY, 10) == backfill.Extent(0, None)


intervals = st.integers(min_value=1, max_value=7_200).map(lambda s: s * 1000)
offsets = st.integers(min_value=0, max_value=3 * DAY)
limits = st.integers(min_value=1, max_value=400)


@settings(max_examples=200, deadline=None)
@given(intervals, offsets, st.integers(min_value=1, max_value=2 * DAY), limits, offsets)
def test_an_interval_backfill_is_every_grid_point_oldest_first(
    every: int, start: int, span: int, limit: int, anchor: int
) -> None:
    plan = make(IntervalRule(every), start_ms=BASE + anchor)
    from_ms, to_ms = BASE + start, BASE + start + span
    got = list(backfill.occurrences(plan, from_ms, to_ms, limit))
    # Brute force, independently of the schedule math: the grid from the anchor.
    expected = [t for t in range(BASE + anchor, to_ms, every) if t >= from_ms][:limit]
    assert got == expected
    assert backfill.extent(plan, from_ms, to_ms, limit).occurrences == len(expected)
    assert chained(plan, from_ms, to_ms, limit) == expected


exprs = st.sampled_from(["*/7 * * * *", "0 * * * *", "30 2 * * *", "15 1,2,3 * * *", "0 9 * * 1-5"])
zones = st.sampled_from(["UTC", "Europe/Berlin", "America/New_York", "Australia/Lord_Howe"])
# Spans around the 2027 DST changes of those zones.
starts = st.sampled_from(
    [
        T("2027-03-13T00:00:00Z"),
        T("2027-03-27T00:00:00Z"),
        T("2027-10-30T00:00:00Z"),
        T("2027-04-03T00:00:00Z"),
        T("2027-11-06T00:00:00Z"),
    ]
)


@settings(max_examples=150, deadline=None)
@given(
    exprs,
    zones,
    starts,
    st.integers(min_value=1, max_value=3 * DAY),
    limits,
    st.sampled_from([(), (CronExclusion("0 * * * 0"),)]),
)
def test_a_cron_backfill_is_the_rotations_times_in_order(
    expr: str, zone: str, from_ms: int, span: int, limit: int, excluded: tuple[object, ...]
) -> None:
    plan = make(CronRule(expr, zone), *excluded)
    to_ms = from_ms + span
    got = list(backfill.occurrences(plan, from_ms, to_ms, limit))
    # Oldest first, inside [from, to), at most limit, none excluded.
    assert got == sorted(set(got))
    assert all(from_ms <= t < to_ms for t in got)
    assert len(got) <= limit
    assert not any(schedule.is_excluded(plan, t) for t in got)
    # The same times the rotation walks (its next after each), none skipped: nothing the
    # rule gives between from and the last one is missing.
    walked: list[int] = []
    current = schedule.next_nominal(plan, from_ms - 1)
    while current is not None and current < to_ms and len(walked) < limit:
        walked.append(current)
        current = schedule.next_nominal(plan, current)
    assert got == walked
    # Each is a real match of the expression in the zone (cron's own matcher).
    parsed = cron.parse(expr)
    for t in got:
        assert cron.next_fire_ms(parsed, schedule.zone(zone), t - 1) == t
    assert backfill.extent(plan, from_ms, to_ms, limit).occurrences == len(got)
    assert chained(plan, from_ms, to_ms, limit) == got
