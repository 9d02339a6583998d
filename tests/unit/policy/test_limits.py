"""Rate keys, Retry-After and the breaker's view (pure)."""

from __future__ import annotations

import email.utils
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.executor.settle import Outcome
from shared.contract import models, timefmt, validation
from shared.contract.errors import ValidationFailed
from shared.policy import limits
from shared.rules import plan
from shared.rules.plan import AmqpPlan, WebhookPlan

NOW = timefmt.parse_rfc3339_ms("2027-01-01T00:00:00Z")
CAP = 3_600_000


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        (WebhookPlan("http://Billing.example/x?y"), "acme|http://billing.example:80"),
        (WebhookPlan("https://billing.example/x"), "acme|https://billing.example:443"),
        (WebhookPlan("http://127.0.0.1:8080/x"), "acme|http://127.0.0.1:8080"),
        (WebhookPlan("http://[::1]:9/x"), "acme|http://[::1]:9"),
        (WebhookPlan("http://a/x", rate_key="billing-api"), "acme|billing-api"),
        (AmqpPlan("billing"), "acme|amqp:billing"),
    ],
)
def test_rate_keys_default_to_the_origin_and_are_scoped_to_the_namespace(
    target: WebhookPlan | AmqpPlan, expected: str
) -> None:
    assert limits.rate_key("acme", target) == expected


@given(st.integers(0, 10**7))
def test_retry_after_in_seconds_is_capped(seconds: int) -> None:
    assert limits.retry_after_ms(str(seconds), NOW, CAP) == min(seconds * 1000, CAP)


def test_retry_after_as_an_http_date() -> None:
    later = email.utils.formatdate((NOW + 90_000) / 1000, usegmt=True)
    assert limits.retry_after_ms(later, NOW, CAP) == 90_000
    earlier = email.utils.formatdate((NOW - 90_000) / 1000, usegmt=True)
    assert limits.retry_after_ms(earlier, NOW, CAP) == 0


@pytest.mark.parametrize("value", [None, "", "soon", "-5", "1.5", "٣", "Mon, 99 Foo 2027"])
def test_unreadable_retry_after_is_ignored(value: str | None) -> None:
    assert limits.retry_after_ms(value, NOW, CAP) is None


def test_the_breaker_view() -> None:
    key = "acme|billing-api"
    assert limits.breaker_view(key, 0, 0, 0, NOW)["state"] == "closed"
    opened = limits.breaker_view(key, 20, NOW + 5000, NOW + 9000, NOW)
    assert opened == {
        "rate_key": "billing-api",
        "state": "open",
        "consecutive_failures": 20,
        "open_until": timefmt.format_ms(NOW + 5000),
        "held_until": timefmt.format_ms(NOW + 9000),
    }
    assert limits.breaker_view(key, 20, NOW - 1, 0, NOW)["state"] == "half_open"


def test_a_rate_limit_becomes_a_bucket_with_a_default_burst_of_one_second() -> None:
    item = models.Schedule.model_validate(
        {
            "id": "x",
            "spec": {"kind": "interval", "every_s": 60},
            "target": {
                "kind": "webhook",
                "url": "http://127.0.0.1:9/",
                "rate_limit": {"per_s": 2.5},
            },
        }
    )
    bucket = limits.bucket_of(plan.plan_of(item, 1).target)
    assert bucket == limits.Bucket(400.0, 3)


@pytest.mark.parametrize(
    ("target", "field"),
    [
        ({"rate_limit": {"per_s": 0}}, "target.rate_limit.per_s"),
        ({"rate_limit": {"per_s": 1, "burst": 0}}, "target.rate_limit.burst"),
        ({"rate_limit": {"burst": 3}}, "target.rate_limit.per_s"),
        ({"rate_key": "has space"}, "target.rate_key"),
        ({"rate_key": "x" * 201}, "target.rate_key"),
    ],
)
def test_bad_rate_settings_name_the_field(target: dict[str, object], field: str) -> None:
    with pytest.raises(ValidationFailed) as caught:
        validation.parse_command(
            "upsert",
            {
                "schedule": {
                    "id": "x",
                    "spec": {"kind": "interval", "every_s": 60},
                    "target": {"kind": "webhook", "url": "http://127.0.0.1:9/", **target},
                }
            },
        )
    assert caught.value.details[0]["field"] == field, caught.value.details


# --- what an attempt says of the host (the breaker counts DOWN only) ----------------------


@dataclass(frozen=True)
class _Attempt:
    ok: bool
    http_status: int | None
    reached: bool
    sent: bool = True


@given(st.integers(400, 499).filter(lambda s: s != 429))
def test_a_4xx_about_one_request_says_the_host_is_up(status: int) -> None:
    assert limits.attempt_health(_Attempt(False, status, True)) is limits.Health.UP


@given(st.integers(500, 599))
def test_a_5xx_says_the_host_is_down(status: int) -> None:
    assert limits.attempt_health(_Attempt(False, status, True)) is limits.Health.DOWN


def test_a_429_says_the_host_is_down() -> None:
    assert limits.attempt_health(_Attempt(False, 429, True)) is limits.Health.DOWN


@given(st.one_of(st.none(), st.integers(100, 599)))
def test_no_answer_says_the_host_is_down(status: int | None) -> None:
    """Refused, reset, timed out: nothing came back."""
    assert limits.attempt_health(_Attempt(False, None, False)) is limits.Health.DOWN
    assert limits.attempt_health(_Attempt(True, status, True)) is limits.Health.UP


@given(st.booleans(), st.one_of(st.none(), st.integers(100, 599)), st.booleans())
def test_nothing_sent_says_nothing(ok: bool, status: int | None, reached: bool) -> None:
    found = limits.attempt_health(_Attempt(ok, status, reached, sent=False))
    assert found is limits.Health.UNKNOWN


def test_an_unroutable_amqp_message_says_the_broker_is_up() -> None:
    """The broker returned the message (the outcome AMQP targets give it): one schedule's
    routing key must not open the breaker of every schedule publishing to that exchange."""
    returned = Outcome(False, None, "not routed: returned", reached=True)
    assert limits.attempt_health(returned) is limits.Health.UP
    unanswered = Outcome(False, None, "ConnectionError: refused")
    assert limits.attempt_health(unanswered) is limits.Health.DOWN
