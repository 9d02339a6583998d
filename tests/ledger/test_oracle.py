"""The ledger's oracle on hand-made histories (pure: no services, no I/O)."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from shared.contract import timefmt
from shared.rules import schedule
from tests.ledger import mix, oracle

NS = "ledger"
T0 = 1_800_000_000_000  # a whole second, 2027-01-15
SLACK = 10
URL = "http://127.0.0.1:1/fast/s"


def plan(spec: dict[str, Any], policy: str = "fire_all", jitter_s: float = 0) -> Any:
    return mix.plan_of_body(
        {
            "id": "s",
            "spec": spec,
            "target": {"kind": "webhook", "url": URL},
            "misfire": mix.POLICIES[policy],
            "jitter_s": jitter_s,
        }
    )


def timeline(p: Any, **kw: Any) -> oracle.Timeline:
    return oracle.Timeline(NS, "s", [oracle.Rotation(p, T0 - 100, T0 - 50)], **kw)


def request(
    nominal: int,
    arrived: float,
    *,
    attempt: int = 1,
    took: float = SLACK,
    key: str | None = None,
    trigger: bool = False,
) -> oracle.Request:
    return oracle.Request(
        schedule=f"{NS}/s",
        key=key or schedule.idempotency_key(NS, "s", nominal),
        fire_time_ms=nominal,
        attempt=attempt,
        trigger=trigger,
        arrived_ms=arrived,
        answered_ms=arrived + took,
        status=200,
    )


def on_time(t: oracle.Timeline, until: int, skip: frozenset[int] = frozenset()) -> list[Any]:
    p = t.rotations[0].plan
    return [
        request(n, schedule.fire_at_ms(p, t.member, n) + 5)
        for n in oracle.candidates(p, T0, until)
        if n not in skip
    ]


EVERY_2S = {"kind": "interval", "every_s": 2}


def test_all_on_time_is_clean_and_one_missing_is_lost() -> None:
    t = timeline(plan(EVERY_2S))
    horizon = T0 + 20_000
    clean = oracle.judge([t], on_time(t, horizon), [], horizon)
    assert clean.total("expected") == 11
    assert clean.total("lost") == clean.total("unexpected") == clean.total("overlaps") == 0
    missing = oracle.judge([t], on_time(t, horizon, frozenset({T0 + 4000})), [], horizon)
    assert missing.total("lost") == 1
    assert any("lost ledger/s@" in f for f in missing.findings)


def test_jitter_above_the_grace_is_not_lateness() -> None:
    """Defect 1: with skip and jitter 3 s, every occurrence is on time at its due time."""
    p = plan({"kind": "interval", "every_s": 4}, "skip", jitter_s=3)
    t = timeline(p)
    horizon = T0 + 40_000
    verdict = oracle.judge([t], on_time(t, horizon), [], horizon)
    due = [schedule.fire_at_ms(p, t.member, n) for n in oracle.candidates(p, T0, horizon)]
    assert verdict.total("expected") == sum(1 for d in due if d <= horizon) >= 9
    assert verdict.total("lost") == 0
    row = verdict.rows[("skip", "none")]
    assert row.p99_lateness_s < 0.01
    # Delivering only those whose jitter is within the grace loses the others.
    beyond_grace = frozenset(
        n
        for n in oracle.candidates(p, T0, horizon)
        if schedule.jitter_offset_ms(p, t.member, n) > 1000
        and schedule.fire_at_ms(p, t.member, n) <= horizon
    )
    assert beyond_grace
    dropped = oracle.judge([t], on_time(t, horizon, beyond_grace), [], horizon)
    assert dropped.total("lost") == len(beyond_grace)


def test_pause_forbids_what_comes_due_after_its_reply() -> None:
    t = timeline(
        plan(EVERY_2S), pauses=[oracle.Pause(T0 + 5000, T0 + 5100, T0 + 11_000, T0 + 11_100)]
    )
    horizon = T0 + 20_000
    # The occurrence due at +4 s was in flight at the pause (due before its reply): excused.
    delivered = [request(T0 + 4000, T0 + 5200), request(T0 + 6000, T0 + 6005)]
    verdict = oracle.judge([t], delivered, [], horizon)
    assert verdict.total("unexpected") == 1
    assert any("forbidden ledger/s@" + str(T0 + 6000) in f for f in verdict.findings)
    # While paused nothing is required; after the resume (and its settling) it is again.
    # Required: +0 and +2 s (settled before the pause was sent; +4 s was due 1 s before it,
    # too close to be owed), +14..+20 s (after the resume settled).
    assert verdict.rows[("fire_all", "none")].expected == len([0, 2, 14, 16, 18, 20])


def test_catch_up_after_resume_is_allowed_except_under_skip() -> None:
    pause = oracle.Pause(T0 + 5000, T0 + 5100, T0 + 11_000, T0 + 11_100)
    late_copy = [request(T0 + 8000, T0 + 11_200)]
    for policy, unexpected in (("fire_once", 0), ("fire_all", 0), ("skip", 1)):
        t = timeline(plan(EVERY_2S, policy), pauses=[pause])
        assert oracle.judge([t], late_copy, [], T0 + 20_000).total("unexpected") == unexpected


def test_delete_forbids_later_occurrences() -> None:
    t = timeline(plan(EVERY_2S), deleted=(T0 + 6900, T0 + 7000))
    verdict = oracle.judge(
        [t], [request(T0 + 6000, T0 + 7100), request(T0 + 8000, T0 + 8001)], [], T0 + 20_000
    )
    assert verdict.total("unexpected") == 1
    assert verdict.total("lost") == 3  # 0, 2 and 4 s were required and not delivered


def test_duplicates_are_charged_to_the_fault_under_way() -> None:
    t = timeline(plan(EVERY_2S))
    fault = oracle.Fault("kill9-executor", T0 + 30_000, T0 + 31_000)
    copies = [request(T0 + 2000, T0 + 2005), request(T0 + 2000, T0 + 30_500)]
    verdict = oracle.judge([t], copies, [fault], T0 + 3000)
    assert verdict.rows[("fire_all", "kill9-executor")].duplicates == 1
    assert verdict.rows[("fire_all", "none")].duplicates == 0


def test_retries_are_not_duplicates_but_a_wrong_key_is_found() -> None:
    t = timeline(plan(EVERY_2S))
    retried = [request(T0, T0 + 5), request(T0, T0 + 300, attempt=2)]
    assert oracle.judge([t], retried, [], T0 + 1000).total("duplicates") == 0
    wrong = [request(T0, T0 + 5, key="00000000-0000-5000-8000-000000000000")]
    assert oracle.judge([t], wrong, [], T0 + 1000).total("bad_keys") == 1


def test_overlapping_deliveries_of_two_occurrences() -> None:
    t = timeline(plan(EVERY_2S))
    apart = [request(T0, T0 + 5, took=1500), request(T0 + 2000, T0 + 2005, took=1500)]
    assert oracle.judge([t], apart, [], T0 + 2500).total("overlaps") == 0
    together = [request(T0, T0 + 5, took=2500), request(T0 + 2000, T0 + 2005, took=10)]
    assert oracle.judge([t], together, [], T0 + 2500).total("overlaps") == 1
    # Only requests at the sink at the same time count: a late copy of an old occurrence is a
    # duplicate (counted as such), not an overlap.
    later = [
        request(T0, T0 + 5),
        request(T0 + 2000, T0 + 2005),
        request(T0, T0 + 2500, attempt=1),
    ]
    verdict = oracle.judge([t], later, [], T0 + 2500)
    assert (verdict.total("overlaps"), verdict.total("duplicates")) == (0, 1)


def test_a_fault_lets_skip_drop_but_not_fire_all() -> None:
    fault = oracle.Fault("redis-flushall", T0 + 6000, T0 + 8000)
    horizon = T0 + 30_000
    # fire_once and a limited fire_all owe the one time missed (skip may drop it): the times
    # on time after it are no catch-up.
    for policy, lost in (("skip", 0), ("fire_once", 1), ("fire_all(limit)", 1), ("fire_all", 1)):
        t = timeline(plan(EVERY_2S, policy))
        delivered = on_time(t, horizon, frozenset({T0 + 6000}))
        assert oracle.judge([t], delivered, [fault], horizon).total("lost") == lost, policy


def test_fire_once_owes_one_catch_up_per_fault() -> None:
    """Defect 2: a catch-up judged again under backlog can be skipped forever."""
    fault = oracle.Fault("overload", T0 + 6000, T0 + 9000)
    horizon = T0 + 30_000
    for policy, lost in (("fire_once", 1), ("skip", 0)):
        t = timeline(plan(EVERY_2S, policy))
        window = oracle.fault_windows([fault], 2000, 6000).spans[0]
        outside = [r for r in on_time(t, horizon) if not window[0] <= r.fire_time_ms <= window[1]]
        verdict = oracle.judge([t], outside, [fault], horizon)
        assert verdict.total("lost") == lost, policy
        one = [*outside, request(T0 + 14_000, T0 + 15_500)]
        assert oracle.judge([t], one, [fault], horizon).total("lost") == 0


def test_a_command_during_a_fault_may_keep_an_owed_occurrence_from_firing() -> None:
    """fire_all owes what came due during a fault, unless a pause, delete or reset was sent
    before the fault was over (plus the settling time): then the occurrence may never fire."""
    fault = oracle.Fault("kill9-dispatcher", T0 + 6000, T0 + 9000)
    horizon = T0 + 30_000
    delivered = [
        r for r in on_time(timeline(plan(EVERY_2S)), horizon) if r.fire_time_ms < T0 + 6000
    ]
    paused = timeline(plan(EVERY_2S), pauses=[oracle.Pause(T0 + 10_000, T0 + 10_010)])
    assert oracle.judge([paused], delivered, [fault], horizon).total("lost") == 0
    late_pause = timeline(plan(EVERY_2S), pauses=[oracle.Pause(T0 + 25_000, T0 + 25_010)])
    # 6 and 8 s were owed (fire_all); 10..22 s were due when the system was calm again.
    assert oracle.judge([late_pause], delivered, [fault], horizon).total("lost") == 9


def test_backlog_seen_elsewhere_lets_skip_drop() -> None:
    """A first attempt several seconds late marks a backlog: a skip may drop what was due then."""
    skip = oracle.Timeline(NS, "s", [oracle.Rotation(plan(EVERY_2S, "skip"), T0 - 100, T0 - 50)])
    other = oracle.Timeline(NS, "o", [oracle.Rotation(plan(EVERY_2S), T0 - 100, T0 - 50)])
    late = oracle.Request(
        f"{NS}/o",
        schedule.idempotency_key(NS, "o", T0 + 6000),
        T0 + 6000,
        1,
        False,
        T0 + 9000,
        T0 + 9010,
        200,
    )
    delivered = [r for r in on_time(skip, T0 + 20_000) if r.fire_time_ms != T0 + 8000]
    verdict = oracle.judge([skip, other], [*delivered, late], [], T0 + 5000 + 15_000)
    assert verdict.rows[("skip", "none")].lost == 0
    assert verdict.rows[("skip", "none")].skipped == 1


def test_max_fires_bounds_the_count() -> None:
    t = timeline(plan({**EVERY_2S, "max_fires": 2}))
    three = [request(T0, T0 + 5), request(T0 + 2000, T0 + 2005), request(T0 + 4000, T0 + 4005)]
    verdict = oracle.judge([t], three, [], T0 + 10_000)
    assert verdict.total("unexpected") == 1
    assert verdict.total("expected") == 2


def test_end_at_is_forbidden_ground() -> None:
    t = timeline(plan({**EVERY_2S, "end_at": timefmt.format_ms(T0 + 3000)}))
    verdict = oracle.judge([t], [request(T0 + 4000, T0 + 4005)], [], T0 + 10_000)
    assert verdict.total("unexpected") == 1


def test_reset_starts_a_new_rotation() -> None:
    old, new = plan(EVERY_2S), plan({"kind": "interval", "every_s": 3})
    t = oracle.Timeline(
        NS,
        "s",
        [oracle.Rotation(old, T0 - 100, T0 - 50), oracle.Rotation(new, T0 + 4900, T0 + 5000)],
    )
    # +6 s is a time of both rules: allowed by the new one. +8 s only the old one: forbidden.
    verdict = oracle.judge(
        [t], [request(T0 + 6000, T0 + 6005), request(T0 + 8000, T0 + 8005)], [], T0 + 10_000
    )
    assert verdict.total("unexpected") == 1
    assert any(f"@{T0 + 8000}" in f for f in verdict.findings if f.startswith("unexpected"))
    assert any(f"lost ledger/s@{T0 + 9000}" in f for f in verdict.findings)


def test_after_completion_chain() -> None:
    p = plan({"kind": "after_completion", "delay_s": 2, "start_at": timefmt.format_ms(T0)})
    t = timeline(p)
    good = [request(T0, T0 + 5, took=500), request(T0 + 2600, T0 + 2605, took=10)]
    verdict = oracle.judge([t], good, [], T0 + 4000)
    assert verdict.total("unexpected") == verdict.total("lost") == 0
    too_soon = [request(T0, T0 + 5, took=500), request(T0 + 2100, T0 + 2105)]
    assert oracle.judge([t], too_soon, [], T0 + 4000).total("unexpected") == 1
    # The chain stopped: the next one was due at +4.6 s and never came.
    assert oracle.judge([t], good, [], T0 + 10_000).total("lost") == 1


def test_a_delete_during_a_fault_may_end_a_chain_before_its_next_occurrence() -> None:
    """Seed 21933 (short profile): the only dispatcher was killed 0.9 s after a fixed-delay
    occurrence ended; its successor took the shards over after the dead one's leases expired
    (no claim at all for 6.3 s), and a delete sent 3.8 s after the next occurrence's due time
    removed it from the index first. Late, then legitimately deleted: as for a grid time, a
    delete sent before the fault was over (plus the settling time) may keep it from firing."""
    p = plan({"kind": "after_completion", "delay_s": 2, "start_at": timefmt.format_ms(T0)})
    ran = [request(T0, T0 + 5)]
    next_due = T0 + 5 + SLACK + 2000
    fault = oracle.Fault("kill9-dispatcher", T0 + 900, T0 + 3800)
    horizon = T0 + 60_000
    cut = timeline(p, deleted=(next_due + 3800, next_due + 3830))
    verdict = oracle.judge([cut], ran, [fault], horizon)
    assert verdict.total("lost") == 0, verdict.findings
    # Calm at its due time, a delete sent well after it: the chain had stopped.
    assert oracle.judge([cut], ran, [], horizon).total("lost") == 1
    # The delete sent long after the fault and its settling: the chain had stopped.
    late = timeline(p, deleted=(T0 + 30_000, T0 + 30_030))
    assert oracle.judge([late], ran, [fault], horizon).total("lost") == 1


def test_a_chain_link_cut_by_a_host_going_down_counts_from_its_death() -> None:
    """Seed 11, long profile: the other host went down while an occurrence's request was in
    flight. The sink answered it 1.2 s later, but the connection was already cut: the
    executor counted the attempt failed, the next two refused, and ended it dead 43 ms before
    the sink's answer, then placed the next one its delay after that death (1 ms too soon by
    the sink's clock and the oracle's 50 ms slack). The delay counts from what the executors
    saw."""
    p = plan({"kind": "after_completion", "delay_s": 2, "start_at": timefmt.format_ms(T0)})
    first = request(T0, T0 + 11, took=1201)  # answered at the sink at T0 + 1212
    dead_ms = T0 + 1100  # the executor's third attempt refused: dead
    second = request(dead_ms + 2000, dead_ms + 2000 + 5)
    t = timeline(p)
    horizon = dead_ms + 2000 + 1500
    member = f"{NS}/s"
    cut_short = oracle.judge([t], [first, second], [], horizon, unreached={(member, T0): dead_ms})
    assert cut_short.total("unexpected") == 0, cut_short.findings
    # Without the executors' word, the next one looks early against the sink's answer.
    assert oracle.judge([t], [first, second], [], horizon).total("unexpected") == 1


def test_triggers() -> None:
    p = plan(EVERY_2S)
    trig = oracle.Trigger(
        T0 + 1100, T0 + 1200, T0 + 1150, schedule.idempotency_key(NS, "s", T0 + 1150) + "t"
    )
    t = timeline(p, triggers=[trig])
    regular = on_time(t, T0 + 3000)
    assert oracle.judge([t], regular, [], T0 + 3000).total("lost") == 1
    delivered = request(T0 + 1150, T0 + 1300, key=trig.key, trigger=True)
    assert oracle.judge([t], [*regular, delivered], [], T0 + 3000).total("lost") == 0
    regular_key = schedule.idempotency_key(NS, "s", T0 + 1150)
    same = timeline(p, triggers=[dataclasses.replace(trig, key=regular_key)])
    assert oracle.judge([same], regular, [], T0 + 3000).total("bad_keys") == 1
    stranger = request(T0 + 1700, T0 + 1800, trigger=True)
    assert (
        oracle.judge([t], [*regular, delivered, stranger], [], T0 + 3000).total("unexpected") == 1
    )


def test_dst_zone_uses_the_projects_cron_math() -> None:
    """02:30 in Europe/Berlin on 2027-03-28 does not exist: it fires at 03:30 local (01:30Z)."""
    p = plan({"kind": "cron", "expr": "30 2 * * *", "timezone": "Europe/Berlin"})
    start = timefmt.parse_rfc3339_ms("2027-03-27T00:00:00Z")
    found = oracle.candidates(p, start, start + 3 * 86_400_000)
    assert [timefmt.format_ms(n) for n in found] == [
        "2027-03-27T01:30:00Z",
        "2027-03-28T01:30:00Z",
        "2027-03-29T00:30:00Z",
    ]


def test_herd_counts_duplicates_per_kind() -> None:
    key = schedule.idempotency_key(NS, "s", T0)
    expected = {"once": {(f"{NS}/s", T0): key}}
    twice = [request(T0, T0 + 5), request(T0, T0 + 900)]
    verdict = oracle.judge_herd(expected, twice)
    assert verdict.rows[("herd:once", "none")].duplicates == 1
    assert verdict.total("lost") == 0
    assert oracle.judge_herd(expected, []).total("lost") == 1


@settings(max_examples=60, deadline=None)
@given(
    every_s=st.integers(min_value=1, max_value=9),
    jitter_s=st.integers(min_value=0, max_value=8),
    policy=st.sampled_from(sorted(mix.POLICIES)),
    drop=st.integers(min_value=0, max_value=1000),
)
def test_perfect_delivery_is_clean_and_each_loss_counts(
    every_s: int, jitter_s: int, policy: str, drop: int
) -> None:
    p = plan(
        {"kind": "interval", "every_s": every_s},
        policy,
        jitter_s=min(jitter_s, every_s - 1) if every_s > 1 else 0,
    )
    t = timeline(p)
    horizon = T0 + 60_000
    delivered = on_time(t, horizon)
    verdict = oracle.judge([t], delivered, [], horizon)
    assert (verdict.total("lost"), verdict.total("unexpected"), verdict.total("overlaps")) == (
        0,
        0,
        0,
    )
    required = [
        r
        for r in delivered
        if schedule.fire_at_ms(p, t.member, r.fire_time_ms) <= horizon and r.fire_time_ms >= T0
    ]
    gone = required[drop % len(required)].fire_time_ms
    less = oracle.judge([t], [r for r in delivered if r.fire_time_ms != gone], [], horizon)
    assert less.total("lost") == 1


def test_a_fire_once_catch_up_counts_for_the_whole_stretch_across_an_old_rotations_times() -> None:
    """Ledger, seed 52842: a fire_once schedule reset from every 2 s to every 3 s, then a
    fault. The old rotation's times are forbidden after the reset, and one of them fell between
    two of the new rotation's missed times: the stretch was split in two, and the catch-up
    (the latest missed time) counted for the second part only: one lost catch-up reported."""
    every_3s = {"kind": "interval", "every_s": 3, "start_at": timefmt.format_ms(T0)}
    old = plan(EVERY_2S, "fire_once")
    new = plan(every_3s, "fire_once")
    reset = (T0 + 1_000, T0 + 1_010)
    t = oracle.Timeline(
        NS, "s", [oracle.Rotation(old, T0 - 100, T0 - 50), oracle.Rotation(new, *reset)]
    )
    fault = oracle.Fault("broker-restart", T0 + 10_500, T0 + 13_000)
    horizon = T0 + 40_000
    window = oracle.fault_windows([fault], 2000, 6000).spans[0]
    delivered = [
        request(n, n + 5)
        for n in oracle.candidates(new, reset[0], horizon)
        if not window[0] <= n <= window[1]
    ]
    # The missed stretch is 9, 12, 15 and 18 s (the old rotation's 10, 12 ... s lie between);
    # fire_once delivers one catch-up for it, the latest missed time, once the broker is back.
    caught_up = [*delivered, request(T0 + 18_000, T0 + 19_000)]
    assert oracle.judge([t], caught_up, [fault], horizon).total("lost") == 0
    assert oracle.judge([t], delivered, [fault], horizon).total("lost") == 1


def test_a_time_of_the_new_rule_in_the_resets_window_is_not_counted_against_the_old() -> None:
    # The old rotation has used its two fires. The reset is in flight from +8.99 s to +9.01 s,
    # and +9 s is a time of the new rule only: it belongs to the new rotation, not the old one.
    old, new = plan({**EVERY_2S, "max_fires": 2}), plan({"kind": "interval", "every_s": 3})
    t = oracle.Timeline(
        NS,
        "s",
        [oracle.Rotation(old, T0 - 100, T0 - 50), oracle.Rotation(new, T0 + 8990, T0 + 9010)],
    )
    delivered = [request(T0, T0 + 5), request(T0 + 2000, T0 + 2005), request(T0 + 9000, T0 + 9020)]
    verdict = oracle.judge([t], delivered, [], T0 + 10_000)
    assert verdict.total("unexpected") == 0, verdict.findings
    assert verdict.total("lost") == 0, verdict.findings


def test_a_limited_fire_all_owes_its_limit_of_a_stretch_missed_during_a_fault() -> None:
    """Issue 26: fire_all with a window and a limit is judged under faults: a stretch missed
    whole owes min(limit, times in the window); the mix's limit is 1."""
    fault = oracle.Fault("kill9-executor", T0 + 6000, T0 + 9000)
    horizon = T0 + 40_000
    t = timeline(plan(EVERY_2S, "fire_all(limit)"))
    window = oracle.fault_windows([fault], 2000, 6000).spans[0]
    outside = [r for r in on_time(t, horizon) if not window[0] <= r.fire_time_ms <= window[1]]
    assert oracle.judge([t], outside, [fault], horizon).total("lost") == 1
    inside = sorted(n for n in oracle.candidates(t.rotations[0].plan, window[0], window[1]))
    # The last time of the window (14 s) is on time: no catch-up. The latest missed times are
    # replayed late, once the executor is back.
    on_time_last = [*outside, request(inside[-1], inside[-1] + 400)]
    assert oracle.judge([t], on_time_last, [fault], horizon).total("lost") == 1
    one = [*on_time_last, request(inside[-2], T0 + 14_400)]
    assert oracle.judge([t], one, [fault], horizon).total("lost") == 0


def test_a_fault_scoped_to_a_host_disturbs_only_its_schedules() -> None:
    """A host down excuses the misses of the schedules on that host, not of the others."""
    fault = oracle.Fault("host-down", T0 + 6000, T0 + 9000, scope="http://127.0.0.1:1/")
    other = oracle.Fault("host-down", T0 + 6000, T0 + 9000, scope="http://127.0.0.1:2/")
    horizon = T0 + 40_000
    t = timeline(plan(EVERY_2S, "skip"))
    missing = on_time(t, horizon, frozenset({T0 + 6000}))
    assert oracle.judge([t], missing, [fault], horizon).total("lost") == 0
    assert oracle.judge([t], missing, [other], horizon).total("lost") == 1


def test_skip_must_not_deliver_a_time_missed_when_it_was_chosen() -> None:
    """Issue 26: skip is judged under faults too: after a delivery that ended at 14 s, a time
    due at 8 s was missed (grace 1 s) and skip must not deliver it; 14 s itself may go."""
    fault = oracle.Fault("kill9-executor", T0 + 6000, T0 + 9000)
    horizon = T0 + 40_000
    t = timeline(plan(EVERY_2S, "skip"))
    window = oracle.fault_windows([fault], 2000, 6000).spans[0]
    outside = [r for r in on_time(t, horizon) if not window[0] <= r.fire_time_ms <= window[1]]
    before = [r for r in outside if r.fire_time_ms < window[0]]
    after = [r for r in outside if r.fire_time_ms > window[0]]
    # The last delivery before the fault ended late, at 14 s: what came next was chosen then.
    ended = dataclasses.replace(before[-1], answered_ms=T0 + 14_000)
    good = [*before[:-1], ended, request(T0 + 14_000, T0 + 14_100), *after]
    assert oracle.judge([t], good, [fault], horizon).total("unexpected") == 0
    bad = [*before[:-1], ended, request(T0 + 8000, T0 + 14_100), *after]
    verdict = oracle.judge([t], bad, [fault], horizon)
    assert verdict.total("unexpected") == 1, verdict.findings
    assert any("missed by then" in f for f in verdict.findings)


def test_fire_once_must_catch_up_the_latest_missed_time_not_an_older_one() -> None:
    fault = oracle.Fault("kill9-executor", T0 + 6000, T0 + 9000)
    horizon = T0 + 40_000
    t = timeline(plan(EVERY_2S, "fire_once"))
    window = oracle.fault_windows([fault], 2000, 6000).spans[0]
    outside = [r for r in on_time(t, horizon) if not window[0] <= r.fire_time_ms <= window[1]]
    before = [r for r in outside if r.fire_time_ms < window[0]]
    after = [r for r in outside if r.fire_time_ms > window[0]]
    ended = dataclasses.replace(before[-1], answered_ms=T0 + 14_500)
    latest = [*before[:-1], ended, request(T0 + 14_000, T0 + 14_600), *after]
    assert oracle.judge([t], latest, [fault], horizon).total("unexpected") == 0
    oldest = [*before[:-1], ended, request(T0 + 6000, T0 + 14_600), *after]
    assert oracle.judge([t], oldest, [fault], horizon).total("unexpected") == 1


def test_an_occurrence_its_down_host_refused_is_unreached_not_lost() -> None:
    """An occurrence attempted while its host refused every connection ends dead without
    reaching a sink: the executors' logs say so, and it is counted unreached, not lost."""
    t = timeline(plan(EVERY_2S))
    horizon = T0 + 20_000
    missing = on_time(t, horizon, frozenset({T0 + 4000}))
    assert oracle.judge([t], missing, [], horizon).total("lost") == 1
    down = oracle.Fault("host-down", T0 + 3000, T0 + 6000, scope="http://127.0.0.1:1/")
    told = {(t.member, T0 + 4000): T0 + 5000}
    verdict = oracle.judge([t], missing, [down], horizon, unreached=told)
    assert verdict.total("lost") == 0 and verdict.total("unreached") == 1


def test_dead_without_an_answer_is_lost_unless_its_host_was_down_then() -> None:
    """Unreached is no loophole: an occurrence ended dead with no HTTP answer (a delivery that
    raised, a timeout on a healthy host) is lost unless a host-down fault of its own host
    was under way when it ended dead."""
    t = timeline(plan(EVERY_2S))
    horizon = T0 + 20_000
    missing = on_time(t, horizon, frozenset({T0 + 4000}))
    told = {(t.member, T0 + 4000): T0 + 5000}
    assert oracle.judge([t], missing, [], horizon, unreached=told).total("lost") == 1
    elsewhere = oracle.Fault("host-down", T0 + 3000, T0 + 6000, scope="http://127.0.0.1:2/")
    assert oracle.judge([t], missing, [elsewhere], horizon, unreached=told).total("lost") == 1
    later = oracle.Fault("host-down", T0 + 12_000, T0 + 14_000, scope="http://127.0.0.1:1/")
    assert oracle.judge([t], missing, [later], horizon, unreached=told).total("lost") == 1


def test_fire_once_times_on_time_after_the_fault_are_no_catch_up() -> None:
    """A fire_once catch-up is a missed time delivered late. Times the fault's window spans
    but that came due after the system was back, delivered on time, do not pay for the
    missed times before them: fire_once that dropped its catch-up is a lost delivery."""
    fault = oracle.Fault("kill9-executor", T0 + 6000, T0 + 9000)
    horizon = T0 + 40_000
    t = timeline(plan(EVERY_2S, "fire_once"))
    # Missed during the fault: 6 and 8 s. Back at 9 s: 10, 12 and 14 s come due on time.
    dropped = on_time(t, horizon, frozenset({T0 + 6000, T0 + 8000}))
    verdict = oracle.judge([t], dropped, [fault], horizon)
    assert verdict.total("lost") == 1, verdict.findings
    caught_up = [*dropped, request(T0 + 8000, T0 + 9500)]
    assert oracle.judge([t], caught_up, [fault], horizon).total("lost") == 0


def _late_end_then(
    t: oracle.Timeline, fault: oracle.Fault, horizon: int, ended_ms: int, replayed: list[int]
) -> list[oracle.Request]:
    """On time outside the fault's window; the last delivery before it ends at ``ended_ms``;
    then ``replayed`` (nominal times of the window) delivered one after the other."""
    window = oracle.fault_windows([fault], 2000, 6000).spans[0]
    outside = [r for r in on_time(t, horizon) if not window[0] <= r.fire_time_ms <= window[1]]
    before = [r for r in outside if r.fire_time_ms < window[0]]
    after = [r for r in outside if r.fire_time_ms > window[0]]
    ended = dataclasses.replace(before[-1], answered_ms=ended_ms)
    late = [request(n, ended_ms + 100 * (i + 1)) for i, n in enumerate(replayed)]
    return [*before[:-1], ended, *late, *after]


def test_a_fire_all_replaying_more_than_its_limit_is_unexpected() -> None:
    """Issue 34: a broken fire_all limit is caught. The delivery before the fault ended at
    14 s: 4, 6, 8, 10 and 12 s were missed then (grace 1 s), and the mix's limit is 1, so
    only 12 s may be replayed; replaying from 4 s on is five, over the limit."""
    fault = oracle.Fault("kill9-executor", T0 + 6000, T0 + 9000)
    horizon = T0 + 40_000
    t = timeline(plan(EVERY_2S, "fire_all(limit)"))
    kept = _late_end_then(t, fault, horizon, T0 + 14_000, [T0 + 12_000, T0 + 14_000])
    verdict = oracle.judge([t], kept, [fault], horizon)
    assert verdict.total("unexpected") == verdict.total("lost") == 0, verdict.findings
    every = [T0 + n for n in range(4000, 16_000, 2000)]
    broken = oracle.judge(
        [t], _late_end_then(t, fault, horizon, T0 + 14_000, every), [fault], horizon
    )
    assert broken.total("unexpected") >= 1
    assert any("over its limit 1" in f for f in broken.findings), broken.findings


def test_a_fire_all_replaying_a_time_older_than_its_window_is_unexpected() -> None:
    """A fire_all with a 30 s window (and a limit of 100): a delivery that ended 44 s in may
    replay the missed times of the last 30 s, never one due 38 s before."""
    fault = oracle.Fault("kill9-executor", T0 + 6000, T0 + 9000)
    horizon = T0 + 80_000
    windowed = {"policy": "fire_all", "window_s": 30, "limit": 100}
    body = {"id": "s", "spec": EVERY_2S, "target": {"kind": "webhook", "url": URL}}
    t = timeline(mix.plan_of_body({**body, "misfire": windowed}))
    window = oracle.fault_windows([fault], 2000, 6000).spans[0]
    outside = [r for r in on_time(t, horizon) if not window[0] <= r.fire_time_ms <= window[1]]
    before = [r for r in outside if r.fire_time_ms < window[0]]
    ended = dataclasses.replace(before[-1], answered_ms=T0 + 44_000)
    rest = [r for r in outside if r.fire_time_ms > T0 + 44_000]
    recent = [*before[:-1], ended, request(T0 + 16_000, T0 + 44_100), *rest]
    assert oracle.judge([t], recent, [fault], horizon).total("unexpected") == 0
    old = [*before[:-1], ended, request(T0 + 6000, T0 + 44_100), *rest]
    verdict = oracle.judge([t], old, [fault], horizon)
    assert any("out of its window" in f for f in verdict.findings), verdict.findings


def test_an_occurrence_skipped_while_still_on_time_is_lost_under_any_fault() -> None:
    """Issue 34: what skip owes under a fault is what was on time. An executor skipped 6 s
    as missed; its skipped row says when (the Redis clock). At 6.5 s it was within its grace
    (1 s): lost, whatever the fault. At 7.5 s it was missed: allowed."""
    fault = oracle.Fault("kill9-executor", T0 + 6000, T0 + 9000)
    horizon = T0 + 30_000
    t = timeline(plan(EVERY_2S, "skip"))
    dropped = on_time(t, horizon, frozenset({T0 + 6000}))
    on_time_then = {(t.member, T0 + 6000): T0 + 6500}
    verdict = oracle.judge([t], dropped, [fault], horizon, skipped=on_time_then)
    assert verdict.total("lost") == 1, verdict.findings
    assert any("skipped as missed" in f for f in verdict.findings)
    missed_then = {(t.member, T0 + 6000): T0 + 7500}
    assert oracle.judge([t], dropped, [fault], horizon, skipped=missed_then).total("lost") == 0


def test_skipping_by_the_nominal_time_instead_of_the_due_time_is_caught() -> None:
    """The first wave's hole: skip with jitter judged lateness from the nominal time. An
    occurrence whose jitter puts its due time 2.5 s after its nominal time, skipped 1.5 s after
    its nominal time, was not missed (due 1 s later): lost."""
    p = plan({"kind": "interval", "every_s": 4}, "skip", jitter_s=3)
    t = timeline(p)
    horizon = T0 + 60_000
    late_jitter = next(
        n
        for n in oracle.candidates(p, T0 + 8000, horizon)
        if schedule.jitter_offset_ms(p, t.member, n) >= 2500
    )
    fault = oracle.Fault("overload", late_jitter - 3000, late_jitter + 3000)
    dropped = on_time(t, horizon, frozenset({late_jitter}))
    by_nominal = {(t.member, late_jitter): late_jitter + 1500}
    verdict = oracle.judge([t], dropped, [fault], horizon, skipped=by_nominal)
    assert verdict.total("lost") == 1, verdict.findings


def test_skip_under_a_fault_owes_what_it_delivered_on_time() -> None:
    """The skip row of a fault is no longer 0 expected: the times of the fault's window it
    delivered (chosen on time) are owed, and counted."""
    fault = oracle.Fault("kill9-executor", T0 + 6000, T0 + 9000)
    horizon = T0 + 30_000
    t = timeline(plan(EVERY_2S, "skip"))
    delivered = on_time(t, horizon, frozenset({T0 + 6000}))
    verdict = oracle.judge([t], delivered, [fault], horizon)
    row = verdict.rows[("skip", "kill9-executor")]
    assert row.expected == row.delivered > 0 and row.lost == 0


def test_a_time_passed_over_while_still_on_time_is_lost() -> None:
    """Whatever the decision's moment, it came before the chosen one's first arrival: a time
    passed over whose due time was still within the grace then was on time, and owed. With
    a jitter (3 s) above the interval (2 s), a time can be due after the next one."""
    p = plan(EVERY_2S, "skip", jitter_s=3)
    t = timeline(p)
    horizon = T0 + 60_000
    nominals = oracle.candidates(p, T0 + 8000, horizon)
    due = {n: schedule.fire_at_ms(p, t.member, n) for n in nominals}
    jumped, chosen = next((a, b) for a, b in itertools.pairwise(nominals) if due[a] >= due[b] + 200)
    fault = oracle.Fault("overload", jumped - 1000, chosen + 1000)
    delivered = on_time(t, horizon, frozenset({jumped}))
    verdict = oracle.judge([t], delivered, [fault], horizon)
    assert verdict.total("lost") == 1, verdict.findings
    assert any("passed over" in f for f in verdict.findings)
