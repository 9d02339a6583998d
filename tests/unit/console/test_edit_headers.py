"""The console's edit form and hidden header values: kept in place, never redirected."""

from __future__ import annotations

from typing import Any

import pytest

from services.console import web

STORED: dict[str, Any] = {
    "id": "x",
    "target": {
        "kind": "webhook",
        "url": "https://billing.example/remind",
        "method": "POST",
        "headers": {"Authorization": "Bearer tenant-secret", "X-Tenant": "acme"},
    },
}


def edited(**target: Any) -> dict[str, Any]:
    return {"id": "x", "target": {**STORED["target"], **target}}


def test_a_hidden_value_goes_back_while_the_target_stays_put() -> None:
    form = edited(headers={"Authorization": web.HIDDEN, "X-Tenant": "acme-2"})
    headers = web._with_header_values(form, STORED)["target"]["headers"]
    assert headers == {"Authorization": "Bearer tenant-secret", "X-Tenant": "acme-2"}


@pytest.mark.parametrize(
    "change",
    [
        {"url": "https://evil.example/"},
        {"method": "PUT"},
        {"kind": "amqp", "exchange": "acme"},
    ],
)
def test_a_hidden_value_is_never_sent_to_a_changed_target(change: dict[str, Any]) -> None:
    form = edited(headers={"Authorization": web.HIDDEN}, **change)
    with pytest.raises(ValueError, match=r"target\.headers\.Authorization: its value is hidden"):
        web._with_header_values(form, STORED)


def test_a_value_typed_again_may_go_to_a_new_target() -> None:
    form = edited(url="https://new.example/", headers={"Authorization": "Bearer typed-again"})
    result = web._with_header_values(form, STORED)
    assert result["target"]["headers"] == {"Authorization": "Bearer typed-again"}
