"""target.secret_headers at upsert: header names valid, secret names safe file names."""

from __future__ import annotations

from typing import Any

import pytest

from shared.contract import commands, validation
from shared.contract.errors import ValidationFailed
from shared.rules import compact, plan


def upsert(secret_headers: Any, **target: Any) -> dict[str, Any]:
    return {
        "schedule": {
            "id": "s",
            "spec": {"kind": "interval", "every_s": 60},
            "target": {
                "kind": "webhook",
                "url": "http://billing:8080/x",
                "secret_headers": secret_headers,
                **target,
            },
        }
    }


@pytest.mark.parametrize(
    ("secret_headers", "target", "reason"),
    [
        ({"Authorization": "../etc/passwd"}, {}, "secret name of 'Authorization' must be"),
        ({"Authorization": "a/b"}, {}, "secret name of 'Authorization' must be"),
        ({"Authorization": ".hidden"}, {}, "secret name of 'Authorization' must be"),
        ({"Authorization": ""}, {}, "secret name of 'Authorization' must be"),
        ({"Authorization": "tok\n"}, {}, "secret name of 'Authorization' must be"),
        ({"Bad Header": "tok"}, {}, "is not a valid header name"),
        ({"Idempotency-Key": "tok"}, {}, "is set by cronbus"),
        ({"webhook-signature": "tok"}, {}, "is set by cronbus"),
        ({"X-Key": "tok"}, {"headers": {"x-key": "v"}}, "both in headers and in secret_headers"),
        ({"X-Key": 5}, {}, "must be a string"),
    ],
)
def test_bad_secret_headers_are_field_errors(
    secret_headers: Any, target: dict[str, Any], reason: str
) -> None:
    with pytest.raises(ValidationFailed) as caught:
        validation.parse_command("upsert", upsert(secret_headers, **target))
    assert caught.value.code == "invalid_schedule"
    fields = [d["field"] for d in caught.value.details]
    assert all(f.startswith("target") for f in fields), caught.value.details
    assert any(reason in d["reason"] for d in caught.value.details), caught.value.details


def test_only_the_names_travel_with_the_plan() -> None:
    command = validation.parse_command(
        "upsert", upsert({"Authorization": "billing-token", "X-Api-Key": "api.key_2"})
    )
    assert isinstance(command, commands.UpsertCommand)
    found = plan.plan_of(command.schedule, 1)
    decoded = compact.decode(compact.encode(found))
    assert decoded == found
    assert isinstance(decoded.target, plan.WebhookPlan)
    assert decoded.target.secret_headers == (
        ("Authorization", "billing-token"),
        ("X-Api-Key", "api.key_2"),
    )
