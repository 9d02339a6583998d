"""The compact Redis encoding: lossless, small, and readable by the Lua version match."""

from __future__ import annotations

import dataclasses
import re

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.contract import models
from shared.rules import compact
from shared.rules.exclusion import CronExclusion, RangeExclusion
from shared.rules.plan import (
    AfterCompletionRule,
    AmqpPlan,
    CronRule,
    IntervalRule,
    MisfireRule,
    OnceRule,
    Plan,
    RetryRule,
    WebhookPlan,
    plan_of,
)

ms = st.integers(min_value=0, max_value=4_000_000_000_000)
text = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=20)
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**53), 2**53), text)
bodies = st.one_of(st.none(), st.dictionaries(text, json_scalars, max_size=4))
headers = st.lists(
    st.tuples(st.from_regex(r"[A-Za-z][A-Za-z0-9-]{0,10}", fullmatch=True), text),
    max_size=3,
    unique_by=lambda h: h[0],
).map(tuple)


def encoded_body(body: object) -> bytes | None:
    from shared.contract import codec  # noqa: PLC0415

    return None if body is None else codec.dumps(body)


rules = st.one_of(
    st.builds(
        CronRule,
        st.sampled_from(["* * * * *", "0 9 * * MON-FRI"]),
        st.sampled_from(["UTC", "Europe/Berlin"]),
    ),
    st.builds(IntervalRule, st.integers(1000, 10**9)),
    st.builds(AfterCompletionRule, st.integers(1000, 10**9)),
    st.builds(OnceRule, ms),
)
targets = st.one_of(
    st.builds(
        WebhookPlan,
        st.sampled_from(["http://sink:8080/hook", "https://sink/hook", "http://[::1]:9/x"]),
        st.sampled_from(["GET", "POST", "PUT"]),
        headers,
        bodies.map(encoded_body),
        st.integers(1, 300_000),
        st.one_of(st.none(), st.frozensets(st.integers(100, 599), min_size=1)),
    ),
    st.builds(
        AmqpPlan,
        st.just("billing"),
        st.sampled_from(["", "remind"]),
        headers,
        bodies.map(encoded_body),
        st.integers(1, 300_000),
    ),
)
plans = st.builds(
    Plan,
    version=st.integers(1, 10**12),
    rule=rules,
    target=targets,
    start_ms=st.one_of(st.none(), ms),
    end_ms=st.one_of(st.none(), ms),
    max_fires=st.one_of(st.none(), st.integers(1, 10**6)),
    jitter_ms=st.integers(0, 86_400_000),
    retry=st.builds(
        RetryRule,
        st.integers(1, 100),
        st.integers(1, 10**6),
        st.floats(1, 100),
        st.integers(1, 10**8),
        st.booleans(),
    ),
    misfire=st.builds(
        MisfireRule,
        st.sampled_from(["skip", "fire_once", "fire_all"]),
        st.integers(0, 10**6),
        st.integers(1, 10**9),
        st.integers(1, 10**5),
    ),
    exclude=st.lists(
        st.one_of(
            st.builds(CronExclusion, st.sampled_from(["* * 25 12 *", "0 0 * * SAT"])),
            st.builds(RangeExclusion, ms, ms),
        ),
        max_size=3,
    ).map(tuple),
    pause_after_failures=st.one_of(st.none(), st.integers(1, 1000)),
)


@given(plans)
def test_round_trip_is_lossless(plan: Plan) -> None:
    raw = compact.encode(plan)
    assert compact.decode(raw) == plan
    # The Lua scripts read the version alone, as the first msgpack object (lib/plan_version.lua).
    unpacker = msgpack.Unpacker()
    unpacker.feed(raw)
    assert unpacker.unpack() == plan.version


@given(plans)
def test_the_json_form_of_earlier_versions_is_still_read(plan: Plan) -> None:
    raw = compact.encode_json(plan)
    match = re.match(rb'^{"v":(\d+)', raw)
    assert match is not None and int(match.group(1)) == plan.version
    assert compact.decode(raw) == plan
    assert compact.version_of(raw) == plan.version
    # A rebuild stores it again in the binary form.
    assert compact.stored_form(raw) == compact.encode(plan)


@given(plans)
def test_deliveries_embed_the_json_form(plan: Plan) -> None:
    assert compact.as_json(compact.encode(plan)) == compact.encode_json(plan)
    assert compact.as_json(compact.encode_json(plan)) == compact.encode_json(plan)


@given(plans, st.integers(1, 10**12))
def test_a_new_version_keeps_everything_else(plan: Plan, version: int) -> None:
    expected = dataclasses.replace(plan, version=version)
    for raw in (compact.encode(plan), compact.encode_json(plan)):
        changed = compact.with_version(raw, version)
        assert compact.decode(changed) == expected
        assert changed == compact.encode(expected)


@pytest.mark.parametrize("version", [*range(0, 256), 2**53, 2**53 + 1, 2**63, 2**64 - 1])
def test_every_version_reads_back_in_the_binary_form(version: int) -> None:
    """The binary form starts with the version as a msgpack integer, and 123 packs as the
    single byte ``{``: telling the forms apart by their first byte alone took it for JSON
    (decode and version_of failed; Lua read no version, so a stale write replaced it)."""
    plan = Plan(version, IntervalRule(60_000), WebhookPlan("http://sink/hook"))
    raw = compact.encode(plan)
    assert not compact.is_json(raw)
    assert compact.version_of(raw) == version
    assert compact.decode(raw) == plan
    assert compact.decode(compact.as_json(raw)) == plan
    assert compact.stored_form(raw) == raw
    assert compact.is_json(compact.stored_form(raw, "json"))
    assert compact.with_version(compact.encode_json(plan), version) == raw


def test_a_typical_schedule_is_small() -> None:
    item = models.Schedule.model_validate(
        {
            "id": "s-000001",
            "spec": {"kind": "interval", "every_s": 60},
            "target": {"kind": "webhook", "url": "http://127.0.0.1:8080/hook"},
        }
    )
    plan = plan_of(item, 1)
    assert compact.encode_json(plan) == b'{"v":1,"i":60000,"u":"http://127.0.0.1:8080/hook"}'
    # Whole seconds stored as seconds, the scheme as a key, keys one byte each: 27 bytes
    # where JSON takes 51.
    assert compact.encode(plan) == b"\x01\x82\x1b<\x1f\xb3127.0.0.1:8080/hook"


def test_times_not_in_whole_seconds_are_kept_in_milliseconds() -> None:
    item = models.Schedule.model_validate(
        {
            "id": "s-000002",
            "spec": {"kind": "interval", "every_s": 1.5, "start_at": "2026-01-01T00:00:00.250Z"},
            "target": {"kind": "webhook", "url": "https://billing.example/hook"},
        }
    )
    plan = plan_of(item, 3)
    assert compact.decode(compact.encode(plan)) == plan
    raw = compact.encode(plan)
    assert msgpack.packb(1500) in raw and msgpack.packb(1767225600250) in raw
    assert b"https" not in raw and b"billing.example/hook" in raw


@given(plans)
def test_version_is_read_without_decoding(plan: Plan) -> None:
    assert compact.version_of(compact.encode(plan)) == plan.version
