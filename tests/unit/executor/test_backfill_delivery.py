"""A backfilled occurrence in the executor, without I/O: the regular key and fire time, the
backfill header, never judged by the misfire policy, and its next occurrence."""

from __future__ import annotations

import random

from services.executor import settle, targets
from services.executor.settle import Outcome
from shared.contract import delivery, entries, keys, timefmt
from shared.rules import compact, schedule
from shared.rules.exclusion import CronExclusion
from shared.rules.plan import IntervalRule, MisfireRule, Plan, WebhookPlan

MINUTE = 60_000
NOMINAL = timefmt.parse_rfc3339_ms("2027-01-01T10:00:00Z")
PLAN = Plan(
    version=3,
    rule=IntervalRule(MINUTE),
    target=WebhookPlan("http://sink/x"),
    misfire=MisfireRule("skip", grace_ms=1000),
    exclude=(CronExclusion("1 10 * * *"),),
)


def claimed(member: str) -> delivery.Occurrence:
    # As claim.lua hands it out: a backfill member's "fires" is its backfill's generation.
    item = entries.Claimed(0, member, NOMINAL, NOMINAL, 1, 99, 42, compact.encode(PLAN), False)
    [occ] = delivery.decode(delivery.encode([item]))
    return occ


def test_a_backfill_member_is_the_regular_occurrence_again() -> None:
    occ = claimed(keys.backfill_member("ns", "s"))
    assert (occ.namespace, occ.id, occ.is_backfill, occ.is_trigger) == ("ns", "s", True, False)
    assert occ.backfill_generation == 42
    assert occ.idempotency_key == schedule.idempotency_key("ns", "s", NOMINAL)
    headers = targets.pinned_headers(occ, occ.idempotency_key)
    assert headers["X-Cronbus-Backfill"] == "true"
    assert headers["X-Cronbus-Fire-Time"] == "2027-01-01T10:00:00Z"
    assert headers["Idempotency-Key"] == schedule.idempotency_key("ns", "s", NOMINAL)
    assert "X-Cronbus-Trigger" not in headers
    regular = claimed(keys.member("ns", "s"))
    assert not regular.is_backfill
    assert "X-Cronbus-Backfill" not in targets.pinned_headers(regular, regular.idempotency_key)


def test_a_backfilled_occurrence_is_delivered_however_late_and_goes_on_past_exclusions() -> None:
    occ = claimed(keys.backfill_member("ns", "s"))
    a_year_later = NOMINAL + 365 * 24 * 60 * MINUTE
    assert settle.missed_choice(occ, a_year_later) == NOMINAL
    done = settle.settle(
        occ,
        occ.idempotency_key,
        Outcome(True, 200),
        a_year_later,
        a_year_later,
        a_year_later,
        random.Random(0),
    )
    assert done.completion is not None and done.checkpoint is None
    # 10:01 is excluded: the backfill's next is 10:02 (complete.lua bounds it by `to`).
    assert done.completion.next_fire_ms == NOMINAL + 2 * MINUTE
    assert done.completion.member == "ns/s#b" and not done.completion.finish
    assert done.row.idempotency_key == schedule.idempotency_key("ns", "s", NOMINAL)
    assert not done.row.is_trigger
