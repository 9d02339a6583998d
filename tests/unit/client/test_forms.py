"""What the client does before and after a round trip (no I/O): a schedule's command form, the
intake's own validation, the chunks of upsert_many, refusals as exceptions."""

from __future__ import annotations

from typing import Any

import pytest

from cronbus import CommandRefused, CronSpec, NotFound, Schedule, WebhookTarget
from cronbus.forms import ItemResult, check, chunks, command_form, refusal
from shared.contract import validation
from shared.contract.errors import ValidationFailed

HOOK = {"kind": "webhook", "url": "http://billing.example/remind"}


def test_a_model_is_sent_as_the_dict_it_was_built_from() -> None:
    as_dict: dict[str, Any] = {
        "id": "invoice-42",
        "spec": {"kind": "cron", "expr": "0 9 * * MON-FRI", "timezone": "Europe/Berlin"},
        "target": HOOK,
        "labels": {"team": "billing"},
    }
    model = Schedule(
        id="invoice-42",
        spec=CronSpec(kind="cron", expr="0 9 * * MON-FRI", timezone="Europe/Berlin"),
        target=WebhookTarget(kind="webhook", url=HOOK["url"]),
        labels={"team": "billing"},
    )
    assert command_form(model) == as_dict
    assert command_form(as_dict) == as_dict


@pytest.mark.parametrize(
    ("verb", "body"),
    [
        (
            "upsert",
            {
                "schedule": {
                    "id": "x",
                    "spec": {"kind": "cron", "expr": "0 25 * * *"},
                    "target": HOOK,
                }
            },
        ),
        (
            "upsert",
            {
                "schedule": {
                    "id": "bad id",
                    "spec": {"kind": "interval", "every_s": 0},
                    "target": HOOK,
                }
            },
        ),
        ("get", {"id": "a\x00b"}),
        ("list", {"limit": 5000}),
        ("backfill", {"id": "x", "from": "2027-01-01T00:00:00", "to": "2027-01-02T00:00:00Z"}),
    ],
)
def test_a_local_refusal_is_the_intakes_own(verb: str, body: dict[str, Any]) -> None:
    with pytest.raises(ValidationFailed) as intake:
        validation.parse_command(verb, body)
    with pytest.raises(CommandRefused) as local:
        check("billing", verb, body)
    assert local.value.code == intake.value.code
    assert local.value.message == str(intake.value)
    assert [{"field": e.field, "reason": e.reason} for e in local.value.errors] == (
        intake.value.details
    )


def test_a_namespace_the_intake_would_refuse_is_refused() -> None:
    with pytest.raises(CommandRefused) as refused:
        check("Billing!", "get", {"id": "x"})
    assert refused.value.code == "invalid_command"
    assert refused.value.errors[0].field == "routing_key"


def test_not_found_is_the_refusal_for_an_unknown_schedule() -> None:
    error = {
        "code": "not_found",
        "message": "no schedule billing/x",
        "details": [{"field": "id", "reason": "no schedule 'x'"}],
    }
    found = CommandRefused.of(error)
    assert isinstance(found, NotFound) and isinstance(found, CommandRefused)
    assert found.reply == {"ok": False, "error": error}
    assert not isinstance(CommandRefused.of({"code": "version_conflict", "message": "m"}), NotFound)


def test_upsert_many_goes_in_chunks_of_at_most_1000_and_200_kb() -> None:
    small = [{"id": f"s{i}"} for i in range(2500)]
    assert [len(c) for c in chunks(small)] == [1000, 1000, 500]
    big = [{"id": f"b{i}", "body": "x" * 50_000} for i in range(9)]
    sizes = [len(c) for c in chunks(big)]
    assert sum(sizes) == 9 and max(sizes) == 3


def test_an_item_result_reads_as_the_reply_did() -> None:
    assert ItemResult("a", True, 3).as_reply() == {"id": "a", "ok": True, "version": 3}
    failure = ValidationFailed(
        "invalid_schedule", "spec: bad", [{"field": "spec", "reason": "bad"}]
    )
    refused = ItemResult("b", False, error=refusal(failure)).as_reply()
    assert refused == {
        "id": "b",
        "ok": False,
        "error": {
            "code": "invalid_schedule",
            "message": "spec: bad",
            "details": [{"field": "spec", "reason": "bad"}],
        },
    }
