"""Replies from a newer cronbus (fields added at any level, new state names) are read, not
refused; what users send is still validated strictly."""

from __future__ import annotations

from typing import Any

import pytest

from cronbus import CommandRefused
from cronbus.forms import check
from shared.contract import replies

NOW = "2027-01-04T08:00:00Z"


def newer_reply() -> dict[str, Any]:
    return {
        "id": "invoice-42",
        "spec": {
            "kind": "cron",
            "expr": "0 9 * * *",
            "calendar": "gregorian",
            "exclude": [{"cron": "0 9 25 12 *", "why": "christmas"}],
        },
        "target": {
            "kind": "webhook",
            "url": "http://billing.example/remind",
            "compression": "zstd",
            "rate_limit": {"key": "billing", "per_s": 5, "burst_policy": "smooth"},
        },
        "retry": {"max_attempts": 4, "jitter_kind": "full"},
        "misfire": {"policy": "skip", "grace_s": 60},
        "namespace": "billing",
        "version": 3,
        "state": "draining",
        "paused_reason": "maintenance",
        "fires": 7,
        "last_fire_at": None,
        "next_fires": [NOW],
        "created_at": NOW,
        "updated_at": NOW,
        "owner": "team-billing",
        "breaker": {"rate_key": "billing", "state": "probing", "consecutive_failures": 0},
        "stats": {
            "fires": 7,
            "succeeded": 7,
            "failed": 0,
            "dead": 0,
            "skipped": 0,
            "excluded": 1,
            "consecutive_failures": 0,
            "last_status": "succeeded",
            "last_error": None,
            "last_fire_at": NOW,
            "p99_ms": 12,
        },
    }


def test_a_newer_cronbus_reply_is_read_with_what_it_adds() -> None:
    stored = replies.stored(newer_reply())
    assert (stored.id, stored.version, stored.state) == ("invoice-42", 3, "draining")
    assert stored.paused_reason == "maintenance"
    assert stored.spec.kind == "cron" and stored.spec.expr == "0 9 * * *"
    assert stored.retry.max_attempts == 4 and stored.misfire.policy == "skip"
    assert stored.breaker is not None and stored.breaker.state == "probing"
    assert stored.stats is not None and stored.stats.excluded == 1
    run = replies.triggered(
        {"fire_time": NOW, "idempotency_key": "k", "schedule": newer_reply(), "shard": 3}
    )
    assert run.schedule.state == "draining"


def test_what_users_send_is_still_refused_for_an_unknown_field() -> None:
    reply = newer_reply()
    schedule = {k: reply[k] for k in ("id", "spec", "target", "retry", "misfire")}
    with pytest.raises(CommandRefused) as refused:
        check("billing", "upsert", {"schedule": schedule})
    fields = {e.field for e in refused.value.errors}
    assert {"spec.calendar", "target.compression", "retry.jitter_kind"} <= fields
