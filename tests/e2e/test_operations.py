"""Operating cronbus like a hosted scheduler, end to end with two executors: exclusions,
per-schedule stats, auto-pause."""

from __future__ import annotations

from typing import Any

from cronbus.client import CommandClient
from cronbus.sink import Sink
from shared import timefmt
from tests.support.stack import Stack

TWO_EXECUTORS = ("dispatcher", "executor", "executor")


def webhook(sink: Sink, path: str = "/hook", **extra: Any) -> dict[str, Any]:
    return {"kind": "webhook", "url": f"{sink.url}{path}", **extra}


def second_of(rfc3339: str) -> int:
    return timefmt.parse_rfc3339_ms(rfc3339) // 1000 % 60


async def test_excluded_times_are_neither_delivered_nor_shown_and_are_counted(
    stack: Stack, sink: Sink, client: CommandClient
) -> None:
    await stack.start_all(TWO_EXECUTORS)
    reply = await client.send(
        "acme",
        "upsert",
        {
            "schedule": {
                "id": "odd-seconds",
                # Every second, except the even ones (a 6-field cron covers one second).
                "spec": {"kind": "interval", "every_s": 1, "exclude": [{"cron": "*/2 * * * * *"}]},
                "target": webhook(sink),
            }
        },
    )
    assert reply["ok"], reply
    shown = reply["schedule"]["next_fires"]
    assert len(shown) == 5 and all(second_of(t) % 2 == 1 for t in shown), shown
    assert reply["schedule"]["spec"]["exclude"] == [{"cron": "*/2 * * * * *"}]
    assert await sink.wait_for(lambda s: len(s.received) >= 4, timeout_s=15), stack.tails()
    fired = [second_of(r.fire_time) for r in sink.received]
    assert all(second % 2 == 1 for second in fired), fired

    refused = await client.send(
        "acme",
        "upsert",
        {
            "schedule": {
                "id": "never",
                "spec": {"kind": "cron", "expr": "0 9 * * *", "exclude": [{"cron": "* * * * *"}]},
                "target": webhook(sink),
            }
        },
    )
    assert refused["ok"] is False
    assert refused["error"]["code"] == "invalid_schedule"
    assert refused["error"]["details"][0]["field"] == "spec.exclude"
    missing = await client.send("acme", "get", {"id": "never"})
    assert missing["error"]["code"] == "not_found"
