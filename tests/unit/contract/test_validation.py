"""Commands and schedules: what is accepted, and errors naming each field and why."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.contract import codec, commands, models, timefmt, validation
from shared.contract.errors import ValidationFailed
from shared.rules import schedule as schedule_math

NOW = timefmt.parse_rfc3339_ms("2026-11-22T12:00:00Z")
#: The namespace the schedules are checked in (AMQP targets may publish to its exchanges).
NAMESPACE = "billing"

PINNED_UPSERT: dict[str, Any] = {
    "schedule": {
        "id": "invoice-42",
        "spec": {"kind": "cron", "expr": "0 9 * * MON-FRI", "timezone": "Europe/Berlin"},
        "target": {
            "kind": "webhook",
            "url": "http://billing:8080/remind",
            "method": "POST",
            "headers": {"X-Tenant": "acme"},
            "body": {"invoice": 42},
            "timeout_s": 10,
        },
        "retry": {"max_attempts": 5, "initial_backoff_s": 1, "multiplier": 2, "max_backoff_s": 60},
        "misfire": {"policy": "fire_once"},
        "jitter_s": 0,
        "priority": 0,
        "labels": {"team": "billing"},
    },
    "expected_version": 3,
}


def schedule(**overrides: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": "s1",
        "spec": {"kind": "interval", "every_s": 60},
        "target": {"kind": "webhook", "url": "http://sink:8080/hook"},
    }
    body.update(overrides)
    return body


def refused(verb: str, body: Any) -> ValidationFailed:
    with pytest.raises(ValidationFailed) as caught:
        command = validation.parse_command(verb, body)
        if isinstance(command, commands.UpsertCommand):
            validation.check_schedule(
                command.schedule, 1, NOW, validation.TargetPolicy(), namespace=NAMESPACE
            )
    return caught.value


def test_the_pinned_examples_are_accepted() -> None:
    command = validation.parse_command("upsert", PINNED_UPSERT)
    assert isinstance(command, commands.UpsertCommand)
    assert command.expected_version == 3
    other_specs = [
        {"kind": "interval", "every_s": 60},
        {"kind": "after_completion", "delay_s": 300},
        {"kind": "once", "at": "2027-01-01T09:00:00Z"},
        {
            "kind": "cron",
            "expr": "*/5 * * * * *",
            "start_at": "2027-01-01T00:00:00Z",
            "end_at": "2027-02-01T00:00:00+01:00",
            "max_fires": 10,
        },
    ]
    for spec in other_specs:
        validation.parse_command("upsert", {"schedule": schedule(spec=spec)})
    for misfire in (
        {"policy": "skip"},
        {"policy": "fire_once"},
        {"policy": "fire_all", "window_s": 3600, "limit": 100},
    ):
        validation.parse_command("upsert", {"schedule": schedule(misfire=misfire)})
    amqp = {
        "kind": "amqp",
        "exchange": "billing",
        "routing_key": "remind",
        "headers": {},
        "body": {},
    }
    validation.parse_command("upsert", {"schedule": schedule(target=amqp)})
    for verb in ("delete", "pause", "resume", "trigger", "get"):
        validation.parse_command(verb, {"id": "invoice-42"})
    validation.parse_command("list", {"limit": 100, "cursor": None, "labels": {"team": "billing"}})


def test_only_id_spec_and_target_are_required() -> None:
    command = validation.parse_command("upsert", {"schedule": schedule()})
    assert isinstance(command, commands.UpsertCommand)
    item = command.schedule
    assert item.retry == models.Retry()
    assert item.misfire.policy == "fire_once"
    assert (item.jitter_s, item.priority, item.paused, item.labels) == (0, 0, False, {})


@pytest.mark.parametrize(
    ("body", "code", "field", "reason"),
    [
        (
            {"schedule": schedule(spec={"kind": "cron", "expr": "0 25 * * *"})},
            "invalid_schedule",
            "spec.expr",
            "hour: 25 is out of range 0-23",
        ),
        (
            {"schedule": schedule(spec={"kind": "cron", "expr": "0 0 30 2 *"})},
            "invalid_schedule",
            "spec.expr",
            "never fires",
        ),
        (
            {
                "schedule": schedule(
                    spec={"kind": "cron", "expr": "* * * * *", "timezone": "Mars/Olympus"}
                )
            },
            "invalid_schedule",
            "spec.timezone",
            "unknown time zone 'Mars/Olympus'",
        ),
        (
            {"schedule": schedule(spec={"kind": "hourly"})},
            "invalid_schedule",
            "spec.kind",
            "must be one of",
        ),
        (
            {"schedule": schedule(spec={"every_s": 5})},
            "invalid_schedule",
            "spec.kind",
            "is required",
        ),
        (
            {"schedule": schedule(spec={"kind": "interval", "every_s": 0.5})},
            "invalid_schedule",
            "spec.every_s",
            "greater than or equal to 1",
        ),
        (
            {"schedule": schedule(spec={"kind": "interval", "every_s": "60"})},
            "invalid_schedule",
            "spec.every_s",
            "must be a number",
        ),
        (
            {"schedule": schedule(spec={"kind": "once", "at": "tomorrow"})},
            "invalid_schedule",
            "spec.at",
            "not an RFC 3339 time",
        ),
        (
            {"schedule": schedule(spec={"kind": "once", "at": "2027-01-01T09:00:00"})},
            "invalid_schedule",
            "spec.at",
            "not an RFC 3339 time",
        ),
        (
            {
                "schedule": schedule(
                    spec={"kind": "interval", "every_s": 60, "end_at": "2020-01-01T00:00:00Z"}
                )
            },
            "invalid_schedule",
            "spec.end_at",
            "in the past",
        ),
        (
            {
                "schedule": schedule(
                    spec={"kind": "once", "at": "2020-01-01T00:00:00Z"}, misfire={"policy": "skip"}
                )
            },
            "invalid_schedule",
            "spec.at",
            "would never fire",
        ),
        (
            {"schedule": schedule(spec={"kind": "interval", "every_s": 60, "color": "red"})},
            "invalid_schedule",
            "spec.color",
            "unknown field",
        ),
        ({"schedule": schedule(colour="red")}, "invalid_schedule", "colour", "unknown field"),
        ({"schedule": schedule(id="has/slash")}, "invalid_schedule", "id", "letters, digits"),
        ({"schedule": schedule(version=4)}, "invalid_schedule", "version", "expected_version"),
        (
            {"schedule": schedule(state="paused")},
            "invalid_schedule",
            "state",
            "pause, resume or delete",
        ),
        (
            {"schedule": schedule(target={"kind": "webhook", "url": "ftp://x/y"})},
            "invalid_schedule",
            "target.url",
            "http:// or https://",
        ),
        (
            {"schedule": schedule(target={"kind": "webhook", "url": "http://169.254.169.254/x"})},
            "invalid_schedule",
            "target.url",
            "not allowed",
        ),
        (
            {
                "schedule": schedule(
                    target={
                        "kind": "webhook",
                        "url": "http://x/",
                        "headers": {"Idempotency-Key": "mine"},
                    }
                )
            },
            "invalid_schedule",
            "target.headers",
            "set by cronbus",
        ),
        (
            {"schedule": schedule(target={"kind": "amqp", "exchange": "cronbus.commands"})},
            "invalid_schedule",
            "target.exchange",
            "reserved",
        ),
        (
            {
                "schedule": schedule(
                    target={"kind": "amqp", "exchange": "", "routing_key": "cronbus.deliveries"}
                )
            },
            "invalid_schedule",
            "target.exchange",
            "default exchange",
        ),
        (
            {"schedule": schedule(target={"kind": "amqp", "exchange": "payroll"})},
            "invalid_schedule",
            "target.exchange",
            "CRONBUS_AMQP_ALLOWED_EXCHANGES",
        ),
        (
            {
                "schedule": schedule(
                    target={"kind": "webhook", "url": "http://x/", "success_codes": [700]}
                )
            },
            "invalid_schedule",
            "target.success_codes",
            "between 100 and 599",
        ),
        (
            {"schedule": schedule(retry={"max_attempts": 0})},
            "invalid_schedule",
            "retry.max_attempts",
            "greater than or equal to 1",
        ),
        (
            {"schedule": schedule(retry={"initial_backoff_s": 10, "max_backoff_s": 5})},
            "invalid_schedule",
            "retry",
            "max_backoff_s must be at least",
        ),
        (
            {"schedule": schedule(misfire={"policy": "fire_all", "limit": 0})},
            "invalid_schedule",
            "misfire.limit",
            "greater than or equal to 1",
        ),
        (
            {"schedule": schedule(labels={"bad key!": "x"})},
            "invalid_schedule",
            "labels",
            "label key",
        ),
        (
            {"schedule": schedule(), "expected_version": -1},
            "invalid_command",
            "expected_version",
            "greater than or equal to 0",
        ),
        ({"schedule": schedule(), "dry_run": True}, "invalid_command", "dry_run", "unknown field"),
        ({}, "invalid_command", "schedule", "is required"),
        ([], "invalid_command", "(body)", "must be a JSON object"),
    ],
)
def test_bad_upserts_name_the_field_and_the_reason(
    body: Any, code: str, field: str, reason: str
) -> None:
    error = refused("upsert", body)
    assert error.code == code
    assert any(d["field"] == field and reason in d["reason"] for d in error.details), error.details
    assert field in str(error) or field == "(body)"


@pytest.mark.parametrize(
    ("verb", "body", "field", "reason"),
    [
        ("delete", {}, "id", "is required"),
        ("pause", {"id": ""}, "id", "letters, digits"),
        ("get", {"id": "x", "extra": 1}, "extra", "unknown field"),
        ("list", {"limit": 0}, "limit", "greater than or equal to 1"),
        ("list", {"limit": 5000}, "limit", "less than or equal to 1000"),
        ("list", {"state": "sleeping"}, "state", "should be"),
    ],
)
def test_bad_commands_name_the_field(verb: str, body: Any, field: str, reason: str) -> None:
    error = refused(verb, body)
    assert error.code == "invalid_command"
    assert any(d["field"] == field and reason in d["reason"] for d in error.details), error.details


def test_unknown_verbs_and_namespaces_are_refused() -> None:
    assert refused("explode", {}).code == "unknown_verb"
    with pytest.raises(ValidationFailed) as caught:
        validation.check_namespace("Bad.NS")
    assert caught.value.details[0]["field"] == "routing_key"


def test_text_that_is_not_json_is_refused() -> None:
    with pytest.raises(ValidationFailed) as caught:
        validation.parse_body(b"{not json")
    assert caught.value.code == "invalid_command"


def test_operator_policy_limits_hosts_exchanges_and_bodies() -> None:
    policy = validation.TargetPolicy(
        allowed_hosts=("*.internal",), allowed_exchanges=("jobs.*",), max_body_bytes=10
    )
    command = validation.parse_command(
        "upsert",
        {
            "schedule": schedule(
                target={
                    "kind": "webhook",
                    "url": "http://evil.example/x",
                    "body": {"a": "0123456789"},
                }
            )
        },
    )
    assert isinstance(command, commands.UpsertCommand)
    with pytest.raises(ValidationFailed) as caught:
        validation.check_schedule(command.schedule, 1, NOW, policy, namespace=NAMESPACE)
    fields = {d["field"] for d in caught.value.details}
    assert fields == {"target.url", "target.body"}
    ok = validation.parse_command(
        "upsert", {"schedule": schedule(target={"kind": "amqp", "exchange": "jobs.nightly"})}
    )
    assert isinstance(ok, commands.UpsertCommand)
    validation.check_schedule(ok.schedule, 1, NOW, policy, namespace=NAMESPACE)


def _webhook(**target: Any) -> dict[str, Any]:
    return {"schedule": schedule(target={"kind": "webhook", "url": "http://sink:8080/h", **target})}


@pytest.mark.parametrize(
    ("body", "field", "reason"),
    [
        ({"schedule": schedule(id="a\x00b")}, "id", "NUL"),
        (_webhook(body={"deep": [{"x": "\x00"}]}), "target.body.deep[0].x", "NUL"),
        ({"schedule": schedule(labels={"k\x00": "v"})}, "labels.'k\\x00'", "NUL"),
        ({"schedule": schedule(id="a\n")}, "id", "letters, digits"),
        ({"schedule": schedule(labels={"team\n": "x"})}, "labels", "label key"),
        ({"schedule": schedule(labels={"team": "x\x1by"})}, "labels", "control"),
        (_webhook(headers={"X-A\n": "v"}), "target.headers", "header name"),
        (_webhook(headers={"X-A": "v\x7f"}), "target.headers", "control"),
        (_webhook(url="https://[::1/"), "target.url", "malformed host or port"),
        (_webhook(url="http://sink:99999/"), "target.url", "malformed host or port"),
        (_webhook(url="http://sink:0/"), "target.url", "between 1 and 65535"),
        (_webhook(url="http://sink/a\x01b"), "target.url", "control"),
        (
            {
                "schedule": schedule(
                    spec={"kind": "cron", "expr": "* * * * *", "timezone": "America"}
                )
            },
            "spec.timezone",
            "unknown time zone",
        ),
        (
            {"schedule": schedule(spec={"kind": "once", "at": "0001-01-01T00:00:00+01:00"})},
            "spec.at",
            "1970-9999",
        ),
        (
            {
                "schedule": schedule(
                    spec={"kind": "interval", "every_s": 1, "end_at": "9999-12-31T23:00:00-05:00"}
                )
            },
            "spec.end_at",
            "1970-9999",
        ),
        (
            {
                "schedule": schedule(
                    spec={"kind": "interval", "every_s": 1, "start_at": "1969-12-31T23:59:59Z"}
                )
            },
            "spec.start_at",
            "between 1970-01-01T00:00:00Z and 9999-12-31T23:59:59.999Z",
        ),
        (
            {"schedule": schedule(target={"kind": "amqp", "exchange": "jobs\r\n"})},
            "target.exchange",
            "control",
        ),
    ],
)
def test_hostile_values_are_field_errors(body: Any, field: str, reason: str) -> None:
    error = refused("upsert", body)
    assert error.code == "invalid_schedule"
    assert any(d["field"] == field and reason in d["reason"] for d in error.details), error.details


def test_a_nul_in_another_command_names_its_field() -> None:
    error = refused("list", {"labels": {"team": "a\x00"}})
    assert error.code == "invalid_command"
    assert error.details == [{"field": "labels.team", "reason": validation.NUL_REASON}]
    assert refused("upsert", {"schedule": schedule(), "x\x00": 1}).details[0]["field"] == (
        "'x\\x00'"
    )


def test_namespaces_refuse_a_trailing_newline() -> None:
    with pytest.raises(ValidationFailed):
        validation.check_namespace("acme\n")
    validation.check_namespace("acme")


def test_message_and_correlation_ids_must_be_printable() -> None:
    validation.check_properties("m-1", None)
    with pytest.raises(ValidationFailed) as caught:
        validation.check_properties("m\x00", "c\n")
    assert [d["field"] for d in caught.value.details] == ["message_id", "correlation_id"]


def test_an_interval_ends_at_the_last_fire_before_the_year_10000() -> None:
    command = validation.parse_command(
        "upsert",
        {
            "schedule": schedule(
                spec={"kind": "interval", "every_s": 86400, "start_at": "9999-12-30T00:00:00Z"}
            )
        },
    )
    assert isinstance(command, commands.UpsertCommand)
    plan = validation.check_schedule(
        command.schedule,
        1,
        timefmt.parse_rfc3339_ms("9999-12-29T00:00:00Z"),
        validation.TargetPolicy(),
        namespace=NAMESPACE,
    )
    upcoming = schedule_math.upcoming(plan, timefmt.parse_rfc3339_ms("9999-12-29T00:00:00Z"), 5)
    assert [timefmt.format_ms(t) for t in upcoming] == [
        "9999-12-30T00:00:00Z",
        "9999-12-31T00:00:00Z",
    ]


JSON_LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
    | st.sampled_from(
        [
            "0001-01-01T00:00:00+01:00",
            "9999-12-31T23:00:00-05:00",
            "https://[::1/",
            "http://a:99999/",
            "America",
            "Etc",
            "x\x00",
            "a\n",
            "* * * * * *",
            "",
        ]
    )
)
JSON_VALUES = st.recursive(
    JSON_LEAVES,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            found += _paths(item, (*prefix, key))
    return found


def _replaced(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    copy = dict(value)
    copy[path[0]] = _replaced(value[path[0]], path[1:], new)
    return copy


@settings(max_examples=400, deadline=None)
@given(data=st.data(), verb=st.sampled_from([*models.VERBS, "explode"]))
def test_any_body_is_a_command_or_a_field_error(data: st.DataObject, verb: str) -> None:
    """Whatever the body, validation answers: a command or ValidationFailed, nothing else."""
    base: Any = {
        "upsert": {"schedule": schedule(labels={"a": "b"}, retry={"max_attempts": 2})},
        "list": {"limit": 5, "labels": {"a": "b"}},
    }.get(verb, {"id": "x"})
    if data.draw(st.booleans()):
        path = data.draw(st.sampled_from(_paths(base)))
        body = _replaced(base, path, data.draw(JSON_VALUES))
    else:
        body = data.draw(JSON_VALUES)
    try:
        command = validation.parse_command(verb, body)
        if isinstance(command, commands.UpsertCommand):
            validation.check_schedule(
                command.schedule, 1, NOW, validation.TargetPolicy(), namespace=NAMESPACE
            )
    except ValidationFailed as failure:
        assert failure.details or failure.code == "unknown_verb"


def test_a_body_nested_too_deep_is_refused_where_it_starts() -> None:
    deep: Any = 1
    for _ in range(validation.MAX_DEPTH + 5):
        deep = [deep]
    error = refused("upsert", _webhook(body={"x": deep}))
    assert error.details == [
        {"field": "target.body", "reason": f"nests deeper than {validation.MAX_DEPTH} levels"}
    ]


@pytest.mark.parametrize(
    ("body", "field", "reason"),
    [
        (schedule(retyr={"max_attempts": 2}), "retyr", "did you mean 'retry'?"),
        (
            schedule(spec={"kind": "interval", "evrey_s": 5}),
            "spec.evrey_s",
            "did you mean 'every_s'?",
        ),
        (schedule(zzz=1), "zzz", "unknown field"),
    ],
)
def test_a_misspelt_field_gets_a_suggestion(body: Any, field: str, reason: str) -> None:
    error = refused("upsert", {"schedule": body})
    assert any(d["field"] == field and reason in d["reason"] for d in error.details), error.details
    if "did you mean" not in reason:
        assert all("did you mean" not in d["reason"] for d in error.details)


def test_a_denied_host_names_the_setting_that_allows_it() -> None:
    error = refused(
        "upsert", {"schedule": schedule(target={"kind": "webhook", "url": "http://10.1.2.3/h"})}
    )
    (detail,) = [d for d in error.details if d["field"] == "target.url"]
    assert "CRONBUS_WEBHOOK_ALLOWED_NETWORKS" in detail["reason"]


def test_a_command_of_many_unknown_fields_gets_few_suggestions() -> None:
    """A suggestion costs a fuzzy match against every known name: thousands of unknown keys in
    one command (a tenant's hostile input) get at most ``MAX_SUGGESTIONS`` of them, so the
    intake's loop is never held up by the matching."""
    near_misses = {f"retry{chr(0x4E00 + n)}": 1 for n in range(2_000)}  # each close to "retry"
    body = {"schedule": schedule(**near_misses)}
    with pytest.raises(ValidationFailed) as refused:
        validation.parse_command("upsert", body)
    suggested = [d for d in refused.value.details if "did you mean" in d["reason"]]
    assert 1 <= len(suggested) <= validation.MAX_SUGGESTIONS
    assert len(refused.value.details) == 2_000


@pytest.mark.parametrize(
    ("url", "policy", "setting"),
    [
        ("http://10.1.2.3/h", validation.TargetPolicy(), "CRONBUS_WEBHOOK_ALLOWED_NETWORKS"),
        (
            "http://203.0.113.9/h",
            validation.TargetPolicy(denied_networks=("203.0.113.0/24",)),
            "CRONBUS_WEBHOOK_DENIED_NETWORKS",
        ),
        (
            "http://evil.example/h",
            validation.TargetPolicy(allowed_hosts=("*.internal",)),
            "CRONBUS_WEBHOOK_ALLOWED_HOSTS",
        ),
    ],
)
def test_a_refused_webhook_names_the_setting_that_refuses_it(
    url: str, policy: validation.TargetPolicy, setting: str
) -> None:
    command = validation.parse_command("upsert", _webhook(url=url))
    assert isinstance(command, commands.UpsertCommand)
    with pytest.raises(ValidationFailed) as caught:
        validation.check_schedule(command.schedule, 1, NOW, policy, namespace=NAMESPACE)
    (detail,) = caught.value.details
    assert detail["field"] == "target.url" and setting in detail["reason"]
    if "DENIED" in setting:
        assert "private, local or reserved" not in detail["reason"]


_JSON_TEXT = st.text(alphabet=st.sampled_from(["a", "\x00", "\\", "u", "0", "{", "["]), max_size=6)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | _JSON_TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_JSON_TEXT, inner, max_size=3),
    max_leaves=80,
)


def _nested(value: Any, depth: int) -> Any:
    for _ in range(depth):
        value = [value]
    return value


@given(_JSON, st.integers(0, 70))
def test_a_body_plainly_structured_by_its_bytes_has_no_structural_problem(
    value: Any, depth: int
) -> None:
    body = {"x": _nested(value, depth)}
    raw = codec.dumps(body)
    if validation.plainly_structured(raw):
        assert validation.structural_problems(body) == []


def test_a_nul_or_deep_nesting_is_never_plainly_structured() -> None:
    assert not validation.plainly_structured(codec.dumps({"id": "a\x00"}))
    assert not validation.plainly_structured(codec.dumps({"a\x00": 1}))
    assert not validation.plainly_structured(codec.dumps(_nested(1, validation.MAX_DEPTH)))
    assert validation.plainly_structured(codec.dumps({"schedule": {"id": "a", "spec": {}}}))
