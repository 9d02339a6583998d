"""Key names, shard hashing, RFC 3339 times and the SQL query file."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.contract import delivery, keys, timefmt
from shared.contract.entries import Claimed
from shared.postgres import sql
from shared.rules import compact, schedule
from shared.rules.plan import IntervalRule, Plan, WebhookPlan


def test_shard_keys_share_one_hash_tag() -> None:
    names = keys.RedisKeys("cronbus").shard_keys(3)
    assert names == (
        "cronbus:{3}:due",
        "cronbus:{3}:lease",
        "cronbus:{3}:occ",
        "cronbus:{3}:sched",
        "cronbus:{3}:seq",
    )
    assert keys.RedisKeys().epoch == "cronbus:meta:epoch"


def test_shard_is_stable_across_processes_and_spread() -> None:
    # Pinned values: a change would move every schedule to another shard.
    assert keys.shard_of("billing", "invoice-42", 16) == keys.shard_of("billing", "invoice-42", 16)
    assert [keys.shard_of("ns", f"s{i}", 16) for i in range(5)] == [
        keys.shard_of("ns", f"s{i}", 16) for i in range(5)
    ]
    counts = [0] * 16
    for i in range(16_000):
        counts[keys.shard_of("ns", f"s{i}", 16)] += 1
    assert min(counts) > 800 and max(counts) < 1200


def test_members_and_triggers() -> None:
    assert keys.member("ns", "a.b") == "ns/a.b"
    assert keys.split_member("ns/a.b") == ("ns", "a.b", None)
    assert keys.split_member(keys.trigger_member("ns", "x", 17)) == ("ns", "x", 17)


def test_dead_letter_arguments() -> None:
    args = keys.quorum_queue_arguments("cronbus.deliveries", delivery_limit=20)
    assert args == {
        "x-queue-type": "quorum",
        "x-dead-letter-exchange": "cronbus.dead",
        "x-dead-letter-routing-key": "cronbus.deliveries.dead",
        "x-delivery-limit": 20,
    }


@pytest.mark.parametrize(
    ("text", "ms"),
    [
        ("1970-01-01T00:00:00Z", 0),
        ("2027-01-01T09:00:00Z", 1798794000000),
        ("2027-01-01T10:00:00+01:00", 1798794000000),
        ("2027-01-01t09:00:00.25z", 1798794000250),
        ("2027-01-01T09:00:00.123456789Z", 1798794000123),
    ],
)
def test_rfc3339_parsing(text: str, ms: int) -> None:
    assert timefmt.parse_rfc3339_ms(text) == ms


@pytest.mark.parametrize(
    "text", ["2027-01-01", "2027-01-01T09:00:00", "2027-13-01T00:00:00Z", "now", ""]
)
def test_rfc3339_refuses_what_is_not(text: str) -> None:
    with pytest.raises(ValueError, match=r"RFC 3339|not a valid"):
        timefmt.parse_rfc3339_ms(text)


@given(st.integers(0, 253_402_300_799_999))
def test_format_and_parse_round_trip(ms: int) -> None:
    text = timefmt.format_ms(ms)
    assert text.endswith("Z")
    assert timefmt.parse_rfc3339_ms(text) == ms


def test_query_file_parses_into_named_blocks() -> None:
    parsed = sql.parse_queries("-- a --\n-- what a does\nSELECT 1;\n\n-- b_c --\nSELECT 2;\n")
    assert parsed == {"a": "-- what a does\nSELECT 1;", "b_c": "SELECT 2;"}
    with pytest.raises(ValueError, match="twice"):
        sql.parse_queries("-- a --\nSELECT 1;\n-- a --\nSELECT 2;\n")
    assert {"get_schedule", "write_executions", "live_schedules_page"} <= set(sql.QUERIES)
    assert next(number for number, _, _ in sql.migrations()) == 1


def test_a_delivered_trigger_carries_the_trigger_key() -> None:
    plan = compact.encode(Plan(version=1, rule=IntervalRule(1000), target=WebhookPlan("http://x")))
    at = 1_800_000_000_000
    claims = [
        Claimed(0, keys.member("ns", "x"), at, at, 1, 7, 0, plan),
        Claimed(0, keys.trigger_member("ns", "x", at), at, at, 1, 8, 0, plan),
    ]
    regular, triggered = delivery.decode(delivery.encode(claims))
    assert regular.idempotency_key == schedule.idempotency_key("ns", "x", at)
    assert triggered.is_trigger and triggered.idempotency_key == schedule.trigger_key("ns", "x", at)
    assert triggered.idempotency_key != regular.idempotency_key
