"""spec.exclude: excluded nominal times are skipped by the rotation, previews and replies."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.contract import models, timefmt, validation
from shared.contract.errors import ValidationFailed
from shared.rules import exclusion, schedule
from shared.rules.exclusion import CronExclusion, RangeExclusion
from shared.rules.plan import (
    AfterCompletionRule,
    CronRule,
    IntervalRule,
    OnceRule,
    Plan,
    WebhookPlan,
)
from tests.unit.cli.test_preview_cli import lines, preview

T = timefmt.parse_rfc3339_ms
TARGET = WebhookPlan("http://sink/x")
SECOND = 1000
MINUTE = 60_000
DAY = 86_400_000


def make(rule: object, *excluded: object, **kw: object) -> Plan:
    return Plan(version=1, rule=rule, target=TARGET, exclude=tuple(excluded), **kw)  # type: ignore[arg-type]


def fmt(values: list[int]) -> list[str]:
    return [timefmt.format_ms(v) for v in values]


def test_a_cron_exclusion_matches_the_local_day_in_the_schedules_zone() -> None:
    # 09:00 in Berlin is 08:00Z; Christmas Day is skipped, the 24th and 26th fire.
    plan = make(CronRule("0 9 * * *", "Europe/Berlin"), CronExclusion("* * 25 12 *"))
    assert fmt(schedule.upcoming(plan, T("2027-12-24T00:00:00Z"), 3)) == [
        "2027-12-24T08:00:00Z",
        "2027-12-26T08:00:00Z",
        "2027-12-27T08:00:00Z",
    ]


def test_the_zone_decides_which_day_an_instant_belongs_to() -> None:
    # 23:30 on the 24th in UTC is 00:30 on the 25th in Berlin: excluded there, not in UTC.
    berlin = make(CronRule("30 23 * * *", "UTC"), CronExclusion("* * 25 12 *"))
    assert schedule.next_nominal(berlin, T("2027-12-24T00:00:00Z")) == T("2027-12-24T23:30:00Z")
    local = make(CronRule("30 0 * * *", "Europe/Berlin"), CronExclusion("* * 25 12 *"))
    assert fmt([schedule.next_nominal(local, T("2027-12-24T00:00:00Z")) or 0]) == [
        "2027-12-25T23:30:00Z"
    ]


def test_a_five_field_exclusion_covers_its_whole_minute() -> None:
    plan = make(IntervalRule(7 * SECOND), CronExclusion("30 12 * * *"))
    begin, end = T("2027-01-01T12:29:00Z"), T("2027-01-01T12:32:00Z")
    times = [t for t in schedule.upcoming(plan, begin, 30) if t < end]
    grid = range(begin + (-begin) % (7 * SECOND), end, 7 * SECOND)
    minute = range(T("2027-01-01T12:30:00Z"), T("2027-01-01T12:31:00Z"))
    assert times == [t for t in grid if t not in minute]
    assert len(times) < len(grid)


def test_a_six_field_exclusion_matches_one_second() -> None:
    plan = make(IntervalRule(SECOND), CronExclusion("5 * * * * *"))
    times = schedule.upcoming(plan, T("2027-01-01T00:00:04Z"), 2)
    assert fmt(times) == ["2027-01-01T00:00:04Z", "2027-01-01T00:00:06Z"]


def test_a_range_is_inclusive_of_from_and_exclusive_of_to() -> None:
    plan = make(
        IntervalRule(MINUTE), RangeExclusion(T("2027-01-01T00:01:00Z"), T("2027-01-01T00:03:00Z"))
    )
    assert fmt(schedule.upcoming(plan, T("2027-01-01T00:00:00Z"), 3)) == [
        "2027-01-01T00:00:00Z",
        "2027-01-01T00:03:00Z",
        "2027-01-01T00:04:00Z",
    ]


def test_a_weekend_exclusion_of_a_one_second_interval_is_cheap_and_counted() -> None:
    plan = make(IntervalRule(SECOND), CronExclusion("* * * * SAT,SUN"))
    friday_last = T("2027-01-08T23:59:59Z")
    found, skipped = schedule.next_nominal_counted(plan, friday_last)
    assert found == T("2027-01-11T00:00:00Z")
    assert skipped == 2 * 86_400


def test_a_once_at_an_excluded_time_never_fires() -> None:
    plan = make(OnceRule(T("2027-12-25T10:00:00Z")), CronExclusion("* * 25 12 *"))
    assert schedule.first_nominal(plan, T("2027-01-01T00:00:00Z")) is None


def test_a_fixed_delay_landing_in_an_exclusion_moves_to_its_end() -> None:
    window = RangeExclusion(T("2027-01-01T00:00:00Z"), T("2027-01-01T01:00:00Z"))
    plan = make(AfterCompletionRule(MINUTE), window)
    found, skipped = schedule.following_counted(plan, 0, T("2027-01-01T00:10:00Z"))
    assert found == T("2027-01-01T01:00:00Z")
    assert skipped == 1


def test_fire_once_catches_up_with_the_latest_time_that_is_not_excluded() -> None:
    plan = make(IntervalRule(MINUTE), CronExclusion("59 * * * *"))
    # Missed 00:55..00:59 at 00:59:30; 00:59 is excluded, so the catch-up is 00:58.
    chosen = schedule.resolve_due(plan, T("2027-01-01T00:55:00Z"), T("2027-01-01T00:59:30Z"))
    assert chosen == T("2027-01-01T00:58:00Z")


crons = st.sampled_from(["* * * * *", "*/5 * * * *", "0 * * * *", "15,45 * * * *", "0 0 * * *"])
cron_exclusions = st.builds(
    CronExclusion,
    st.sampled_from(["* 3 * * *", "*/10 * * * *", "* * * * SAT", "0 * * * *", "30 * * * * *"]),
)
start = T("2027-01-01T00:00:00Z")
range_exclusions = st.builds(
    lambda a, length: RangeExclusion(start + a, start + a + length),
    st.integers(0, 2 * DAY),
    st.integers(1, 6 * 3_600_000),
)
exclusion_lists = st.lists(st.one_of(cron_exclusions, range_exclusions), min_size=1, max_size=4)


@settings(max_examples=60, deadline=None)
@given(
    rule=st.one_of(
        st.builds(IntervalRule, st.sampled_from([SECOND * 13, MINUTE, 7 * MINUTE])),
        st.builds(CronRule, crons, st.sampled_from(["UTC", "Europe/Berlin", "America/New_York"])),
    ),
    excluded=exclusion_lists,
    after=st.integers(0, 2 * DAY),
)
def test_skipping_equals_filtering_the_rules_times(
    rule: IntervalRule | CronRule, excluded: list[exclusion.Exclusion], after: int
) -> None:
    """The times with exclusions are exactly the rule's times that no exclusion matches."""
    plan = make(rule, *excluded)
    bare = dataclasses.replace(plan, exclude=())
    zone = schedule.exclusion_zone(plan)
    expected: list[int] = []
    current = start + after
    for _ in range(20_000):
        nxt = schedule.next_nominal(bare, current)
        assert nxt is not None
        current = nxt
        if not exclusion.is_excluded(plan.exclude, zone, nxt):
            expected.append(nxt)
            if len(expected) == 5:
                break
    got: list[int] = []
    current = start + after
    for _ in range(len(expected)):
        nxt = schedule.next_nominal(plan, current)
        assert nxt is not None
        got.append(nxt)
        current = nxt
    assert got == expected


@settings(max_examples=40, deadline=None)
@given(excluded=exclusion_lists, before=st.integers(DAY, 3 * DAY))
def test_previous_nominal_is_never_excluded(
    excluded: list[exclusion.Exclusion], before: int
) -> None:
    plan = make(IntervalRule(MINUTE), *excluded)
    found = schedule.previous_nominal(plan, start + before, start)
    if found is not None:
        assert not schedule.is_excluded(plan, found)
        assert found < start + before
        # Nothing that is not excluded lies between it and `before`.
        following = schedule.next_nominal(plan, found)
        assert following is None or following >= start + before


def schedule_of(exclude: object, spec: dict[str, object] | None = None) -> models.Schedule:
    return models.Schedule.model_validate(
        {
            "id": "x",
            "spec": {**(spec or {"kind": "interval", "every_s": 60}), "exclude": exclude},
            "target": {"kind": "webhook", "url": "http://127.0.0.1:9/"},
        }
    )


@pytest.mark.parametrize(
    ("exclude", "field", "reason"),
    [
        ([{"cron": "* * 32 * *"}], "spec.exclude[0].cron", "day-of-month"),
        (
            [{"from": "2027-01-02T00:00:00Z", "to": "2027-01-01T00:00:00Z"}],
            "spec.exclude[0]",
            "after",
        ),
        ([{"from": "2027-01-02T00:00:00Z"}], "spec.exclude[0]", "both"),
        ([{"cron": "* * * * *", "from": "2027-01-01T00:00:00Z"}], "spec.exclude[0]", "not both"),
        ([{"cron": "* * * * *", "holiday": True}], "spec.exclude[0].holiday", "unknown field"),
        ([{"cron": "* * 25 12 *"}] * 101, "spec.exclude", "at most 100"),
    ],
)
def test_bad_exclusions_name_the_entry_and_the_reason(
    exclude: object, field: str, reason: str
) -> None:
    with pytest.raises(ValidationFailed) as caught:
        validation.parse_command(
            "upsert",
            {
                "schedule": {
                    "id": "x",
                    "spec": {"kind": "interval", "every_s": 60, "exclude": exclude},
                    "target": {"kind": "webhook", "url": "http://127.0.0.1:9/"},
                }
            },
        )
    details = caught.value.details
    assert any(d["field"] == field and reason in d["reason"] for d in details), details


def test_an_exclusion_of_every_time_is_refused_naming_spec_exclude() -> None:
    item = schedule_of([{"cron": "* * * * *"}])
    with pytest.raises(ValidationFailed) as caught:
        validation.check_schedule(
            item, 1, T("2027-01-01T00:00:00Z"), validation.TargetPolicy(), namespace="ns"
        )
    assert caught.value.code == "invalid_schedule"
    assert "spec.exclude" in [d["field"] for d in caught.value.details]


def test_the_definition_keeps_each_entry_as_written() -> None:
    entries = [
        {"cron": "* * 25 12 *"},
        {"from": "2027-01-01T00:00:00Z", "to": "2027-01-02T00:00:00Z"},
    ]
    assert schedule_of(entries).model_dump(mode="json")["spec"]["exclude"] == entries


def test_preview_skips_excluded_times() -> None:
    out = lines(
        preview(
            "--cron",
            "0 9 * * *",
            "--timezone",
            "Europe/Berlin",
            "--after",
            "2027-12-23T00:00:00Z",
            "--count",
            "3",
            "--exclude",
            "* * 25 12 *",
            "--exclude",
            "2027-12-26T00:00:00Z/2027-12-27T00:00:00Z",
        )
    )
    assert out == ["2027-12-23T08:00:00Z", "2027-12-24T08:00:00Z", "2027-12-27T08:00:00Z"]


def test_preview_takes_an_entry_as_json() -> None:
    out = lines(
        preview(
            "--every-s",
            "60",
            "--after",
            "2027-01-01T00:00:00Z",
            "--count",
            "2",
            "--exclude",
            '{"from": "2027-01-01T00:01:00Z", "to": "2027-01-01T00:05:00Z"}',
        )
    )
    assert out == ["2027-01-01T00:05:00Z", "2027-01-01T00:06:00Z"]


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("* * 32 * *", "--exclude: day-of-month"),
        ("* * * * *", "--exclude: excludes every fire time"),
        ('{"from": 1', "--exclude"),
    ],
)
def test_preview_refuses_bad_exclusions(value: str, message: str) -> None:
    result = preview("--every-s", "60", "--after", "2027-01-01T00:00:00Z", "--exclude", value)
    assert result.returncode != 0
    assert message in result.stderr
