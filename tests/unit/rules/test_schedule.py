"""Nominal times, misfire decisions, jitter and identities: tables plus properties."""

from __future__ import annotations

import itertools
import uuid

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.contract import timefmt
from shared.rules import schedule
from shared.rules.plan import (
    AfterCompletionRule,
    CronRule,
    IntervalRule,
    MisfireRule,
    OnceRule,
    Plan,
    WebhookPlan,
)

T = timefmt.parse_rfc3339_ms
TARGET = WebhookPlan("http://sink/x")
MINUTE = 60_000


def make(rule: object, **kw: object) -> Plan:
    return Plan(version=1, rule=rule, target=TARGET, **kw)  # type: ignore[arg-type]


def fmt(ms: int | None) -> str | None:
    return None if ms is None else timefmt.format_ms(ms)


@pytest.mark.parametrize(
    ("plan", "after", "expected"),
    [
        (make(IntervalRule(MINUTE)), "2027-01-01T09:00:00Z", "2027-01-01T09:01:00Z"),
        (make(IntervalRule(MINUTE)), "2027-01-01T09:00:59.999Z", "2027-01-01T09:01:00Z"),
        (
            make(IntervalRule(90_000), start_ms=T("2027-01-01T09:00:10Z")),
            "2027-01-01T08:00:00Z",
            "2027-01-01T09:00:10Z",
        ),
        (
            make(IntervalRule(90_000), start_ms=T("2027-01-01T09:00:10Z")),
            "2027-01-01T09:00:10Z",
            "2027-01-01T09:01:40Z",
        ),
        (
            make(IntervalRule(MINUTE), end_ms=T("2027-01-01T09:00:30Z")),
            "2027-01-01T09:00:00Z",
            None,
        ),
        (make(OnceRule(T("2027-01-01T09:00:00Z"))), "2027-01-01T08:59:59Z", "2027-01-01T09:00:00Z"),
        (make(OnceRule(T("2027-01-01T09:00:00Z"))), "2027-01-01T09:00:00Z", None),
        (
            make(CronRule("0 9 * * MON-FRI", "Europe/Berlin")),
            "2027-01-01T12:00:00Z",
            "2027-01-04T08:00:00Z",
        ),
        (
            make(CronRule("30 2 * * *", "Europe/Berlin")),
            "2027-03-27T12:00:00Z",
            "2027-03-28T01:30:00Z",
        ),
        (
            make(CronRule("*/10 * * * * *"), start_ms=T("2027-05-01T00:00:05Z")),
            "2020-01-01T00:00:00Z",
            "2027-05-01T00:00:10Z",
        ),
    ],
)
def test_next_nominal(plan: Plan, after: str, expected: str | None) -> None:
    assert fmt(schedule.next_nominal(plan, T(after))) == expected


def test_after_completion_counts_from_the_finish() -> None:
    plan = make(AfterCompletionRule(300_000))
    finished = T("2027-01-01T09:00:07.250Z")
    assert fmt(schedule.following(plan, T("2027-01-01T09:00:00Z"), finished)) == (
        "2027-01-01T09:05:07.250Z"
    )
    assert schedule.first_nominal(plan, T("2027-01-01T00:00:00Z")) == T("2027-01-01T00:05:00Z")


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        # Last completed 09:00; down until 09:10:30. Candidate 09:01 is missed.
        (MisfireRule("skip"), "2027-01-01T09:11:00Z"),
        (MisfireRule("fire_once"), "2027-01-01T09:10:00Z"),
        (MisfireRule("fire_all"), "2027-01-01T09:01:00Z"),
        (MisfireRule("fire_all", limit=3), "2027-01-01T09:08:00Z"),
        (MisfireRule("fire_all", window_ms=5 * MINUTE), "2027-01-01T09:06:00Z"),
        (MisfireRule("fire_all", window_ms=5 * MINUTE, limit=2), "2027-01-01T09:09:00Z"),
        # A long grace: 9:01 is only late, not missed.
        (MisfireRule("skip", grace_ms=3_600_000), "2027-01-01T09:01:00Z"),
    ],
)
@pytest.mark.parametrize("rule", [IntervalRule(MINUTE), CronRule("* * * * *")])
def test_misfire_policies(rule: object, policy: MisfireRule, expected: str) -> None:
    plan = make(rule, misfire=policy)
    candidate = schedule.following(plan, T("2027-01-01T09:00:00Z"), 0)
    assert fmt(schedule.resolve_due(plan, candidate, T("2027-01-01T09:10:30Z"))) == expected


def test_an_occurrence_late_by_less_than_the_grace_is_not_missed() -> None:
    plan = make(IntervalRule(1000), misfire=MisfireRule("skip", grace_ms=1000))
    assert schedule.resolve_due(plan, 5000, 5900) == 5000
    assert schedule.resolve_due(plan, 5000, 6001) == 6000


def test_a_missed_once_is_dropped_by_skip_and_fired_by_fire_once() -> None:
    at = T("2027-01-01T09:00:00Z")
    now = at + 3_600_000
    assert schedule.resolve_due(make(OnceRule(at), misfire=MisfireRule("skip")), at, now) is None
    assert schedule.resolve_due(make(OnceRule(at)), at, now) == at
    window = MisfireRule("fire_all", window_ms=60_000)
    assert schedule.resolve_due(make(OnceRule(at), misfire=window), at, now) is None


def test_fixed_delay_is_never_missed() -> None:
    plan = make(AfterCompletionRule(1000), misfire=MisfireRule("skip"))
    assert schedule.resolve_due(plan, 5000, 10_000_000) == 5000


def test_previous_nominal_of_a_sparse_cron() -> None:
    plan = make(CronRule("0 0 1 * *"))
    before = T("2027-06-15T00:00:00Z")
    assert fmt(schedule.previous_nominal(plan, before, 0)) == "2027-06-01T00:00:00Z"
    assert schedule.previous_nominal(plan, before, T("2027-06-02T00:00:00Z")) is None


def test_upcoming_honours_max_fires_and_the_fires_so_far() -> None:
    plan = make(IntervalRule(MINUTE), max_fires=5)
    now = T("2027-01-01T09:00:30Z")
    assert [fmt(t) for t in schedule.upcoming(plan, now, 10, fires=3)] == [
        "2027-01-01T09:01:00Z",
        "2027-01-01T09:02:00Z",
    ]
    assert schedule.is_exhausted(plan, 5) and not schedule.is_exhausted(plan, 4)


def test_idempotency_key_depends_on_the_identity_only() -> None:
    key = schedule.idempotency_key("billing", "invoice-42", 1_800_000_000_000)
    assert key == schedule.idempotency_key("billing", "invoice-42", 1_800_000_000_000)
    # Pinned: changing the derivation would change every key users deduplicate on.
    assert key == "99fff676-80d8-5300-bc58-4d59d5ed79a5"
    assert key != schedule.idempotency_key("billing", "invoice-42", 1_800_000_000_001)
    assert key != schedule.idempotency_key("billing2", "invoice-42", 1_800_000_000_000)


instants = st.integers(min_value=T("2001-01-01T00:00:00Z"), max_value=T("2080-01-01T00:00:00Z"))
periods = st.integers(min_value=1000, max_value=7 * 86_400_000)


@given(periods, instants, st.one_of(st.none(), instants))
def test_interval_times_are_on_the_grid_and_strictly_after(
    every: int, after: int, start: int | None
) -> None:
    plan = make(IntervalRule(every), start_ms=start)
    found = schedule.next_nominal(plan, after)
    assert found is not None and found > after
    anchor = start or 0
    assert (found - anchor) % every == 0 and found >= anchor
    # Nothing on the grid lies between `after` and the answer.
    assert found - every <= after or found - every < anchor
    # Recomputing from any instant before the answer gives the same answer.
    assert schedule.next_nominal(plan, found - 1) == found


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(["*/7 * * * * *", "0 */5 * * * *", "15 9 * * MON-FRI", "0 0 1 * *"]),
    instants,
    st.integers(min_value=1, max_value=20),
)
def test_previous_inverts_next(expr: str, after: int, steps: int) -> None:
    plan = make(CronRule(expr, "Europe/Berlin"))
    times = [schedule.next_nominal(plan, after)]
    for _ in range(steps):
        last = times[-1]
        assert last is not None
        times.append(schedule.next_nominal(plan, last))
    for earlier, later in itertools.pairwise(times):
        assert later is not None and earlier is not None and later > earlier
        assert schedule.previous_nominal(plan, later, 0) == earlier


@settings(max_examples=200, deadline=None)
@given(
    st.sampled_from([IntervalRule(1000), IntervalRule(MINUTE), CronRule("*/5 * * * * *")]),
    st.sampled_from(["skip", "fire_once", "fire_all"]),
    st.integers(min_value=0, max_value=5000),
    st.integers(min_value=1, max_value=50),
    instants,
    st.integers(min_value=0, max_value=10 * 3_600_000),
)
def test_resolve_due_never_goes_back_nor_skips_what_is_on_time(
    rule: object, policy: str, grace: int, limit: int, last: int, outage: int
) -> None:
    plan = make(rule, misfire=MisfireRule(policy, grace, 3_600_000, limit))  # type: ignore[arg-type]
    candidate = schedule.next_nominal(plan, last)
    assert candidate is not None
    now = candidate + outage
    chosen = schedule.resolve_due(plan, candidate, now)
    assert chosen is not None and chosen >= candidate
    # The chosen time is a real nominal time of the rule.
    assert schedule.next_nominal(plan, chosen - 1) == chosen
    # Whatever is on time (not missed) is never skipped.
    first_on_time = schedule.next_nominal(plan, max(now - grace, candidate) - 1)
    assert first_on_time is not None and chosen <= first_on_time
    if policy == "fire_all":
        replayed = 0
        current: int | None = chosen
        while current is not None and current < now - grace:
            replayed += 1
            current = schedule.next_nominal(plan, current)
        assert replayed <= limit
        assert chosen >= now - 3_600_000


@given(st.integers(min_value=1, max_value=86_400_000), st.text(min_size=1, max_size=40), instants)
def test_jitter_is_deterministic_and_within_bounds(jitter: int, member: str, nominal: int) -> None:
    plan = make(IntervalRule(MINUTE), jitter_ms=jitter)
    offset = schedule.jitter_offset_ms(plan, member, nominal)
    assert 0 <= offset < jitter
    assert offset == schedule.jitter_offset_ms(plan, member, nominal)
    assert schedule.fire_at_ms(plan, member, nominal) == nominal + offset


@given(st.text(max_size=20), st.text(max_size=40), st.integers(0, 2**53))
def test_idempotency_key_is_the_rfc4122_uuid5_of_the_identity(
    namespace: str, schedule_id: str, nominal: int
) -> None:
    expected = uuid.uuid5(schedule.IDEMPOTENCY_NAMESPACE, f"{namespace}/{schedule_id}@{nominal}")
    assert schedule.idempotency_key(namespace, schedule_id, nominal) == str(expected)


def test_jitter_is_not_lateness() -> None:
    # Every 4 s with jitter 3 s and skip: an occurrence whose offset is past the grace is
    # on time until its due time (nominal + offset) plus the grace.
    plan = make(IntervalRule(4000), jitter_ms=3000, misfire=MisfireRule("skip", grace_ms=1000))
    member = "ns/jittered"
    nominal = next(
        n for n in range(4000, 400_000, 4000) if schedule.jitter_offset_ms(plan, member, n) > 1500
    )
    due = schedule.fire_at_ms(plan, member, nominal)
    assert schedule.resolve_due(plan, nominal, due + 900, member) == nominal
    assert not schedule.is_missed(plan, member, nominal, due + 1000)
    assert schedule.is_missed(plan, member, nominal, due + 1001)
    assert schedule.resolve_due(plan, nominal, due + 1001, member) != nominal


@settings(max_examples=300, deadline=None)
@given(
    st.sampled_from([IntervalRule(1000), IntervalRule(4000), CronRule("*/5 * * * * *")]),
    st.sampled_from(["skip", "fire_once", "fire_all"]),
    st.integers(min_value=0, max_value=20_000),
    st.integers(min_value=0, max_value=3000),
    st.text(min_size=1, max_size=20),
    instants,
    st.integers(min_value=0, max_value=3_600_000),
)
def test_with_jitter_nothing_on_time_is_skipped_and_what_fires_was_due(
    rule: object, policy: str, jitter: int, grace: int, member: str, last: int, outage: int
) -> None:
    plan = make(
        rule,
        jitter_ms=jitter,
        misfire=MisfireRule(policy, grace, 3_600_000, 10),  # type: ignore[arg-type]
    )
    candidate = schedule.next_nominal(plan, last)
    assert candidate is not None
    now = candidate + outage
    chosen = schedule.resolve_due(plan, candidate, now, member)
    assert chosen is not None and chosen >= candidate
    assert schedule.next_nominal(plan, chosen - 1) == chosen
    # Every nominal time before the chosen one was missed (its due time past the grace).
    current: int | None = candidate
    while current is not None and current < chosen:
        assert schedule.is_missed(plan, member, current, now)
        current = schedule.next_nominal(plan, current)
    if policy == "skip":
        assert not schedule.is_missed(plan, member, chosen, now)


def test_a_trigger_at_the_instant_of_a_regular_occurrence_has_another_key() -> None:
    whole_second = T("2027-01-04T08:00:00Z")
    regular = schedule.idempotency_key("billing", "invoice-42", whole_second)
    triggered = schedule.trigger_key("billing", "invoice-42", whole_second)
    assert triggered != regular
    # Regular keys are those of earlier versions, byte for byte (targets deduplicate on them).
    assert regular == str(
        uuid.uuid5(schedule.IDEMPOTENCY_NAMESPACE, f"billing/invoice-42@{whole_second}")
    )
    assert schedule.occurrence_key("billing", "invoice-42", whole_second, trigger=False) == regular
    assert schedule.occurrence_key("billing", "invoice-42", whole_second, trigger=True) == triggered


ids = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,20}", fullmatch=True)
namespaces = st.from_regex(r"[a-z0-9][a-z0-9_-]{0,10}", fullmatch=True)


@given(namespaces, ids, st.integers(0, 2**53), namespaces, ids, st.integers(0, 2**53))
def test_a_trigger_key_never_equals_a_regular_key(
    namespace: str, schedule_id: str, at: int, other_ns: str, other_id: str, other_at: int
) -> None:
    triggered = schedule.trigger_key(namespace, schedule_id, at)
    assert triggered == schedule.trigger_key(namespace, schedule_id, at)
    assert triggered == str(
        uuid.uuid5(schedule.IDEMPOTENCY_NAMESPACE, f"{namespace}/{schedule_id}@{at}#trigger")
    )
    # Whatever the identities, a trigger's key is not a regular occurrence's key.
    assert triggered != schedule.idempotency_key(namespace, schedule_id, at)
    assert triggered != schedule.idempotency_key(other_ns, other_id, other_at)
