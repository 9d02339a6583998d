"""Schedules go in over AMQP and come out on time as webhook calls and AMQP messages."""

from __future__ import annotations

import itertools
from typing import Any

from cronbus.client import CommandClient
from cronbus.sink import Sink
from shared import schedule, timefmt
from tests.support.stack import Stack


def webhook(sink: Sink, path: str = "/hook", **extra: Any) -> dict[str, Any]:
    return {"kind": "webhook", "url": f"{sink.url}{path}", **extra}


async def test_interval_fires_every_second_with_the_pinned_headers(
    stack: Stack, sink: Sink, client: CommandClient
) -> None:
    await stack.start_all(("dispatcher", "executor"))
    reply = await client.send(
        "acme",
        "upsert",
        {
            "schedule": {
                "id": "tick",
                "spec": {"kind": "interval", "every_s": 1},
                "target": webhook(
                    sink, method="POST", headers={"X-Tenant": "acme"}, body={"hello": "world"}
                ),
            }
        },
    )
    assert reply["ok"], reply
    assert reply["created"] is True and reply["schedule"]["version"] == 1
    assert len(reply["schedule"]["next_fires"]) == 5
    assert await sink.wait_for(lambda s: len(s.received) >= 3, timeout_s=10), stack.tails()
    first = sink.received[0]
    assert first.method == "POST" and first.path == "/hook"
    assert first.headers["x-tenant"] == "acme"
    assert first.headers["content-type"] == "application/json"
    assert first.body == b'{"hello":"world"}'
    assert first.schedule == "acme/tick"
    assert first.attempt == 1
    nominal = timefmt.parse_rfc3339_ms(first.fire_time)
    assert nominal % 1000 == 0
    assert first.key == schedule.idempotency_key("acme", "tick", nominal)
    fire_times = [r.fire_time for r in sink.received[:3]]
    assert len(set(fire_times)) == 3
    steps = [
        timefmt.parse_rfc3339_ms(b) - timefmt.parse_rfc3339_ms(a)
        for a, b in itertools.pairwise(fire_times)
    ]
    assert steps == [1000, 1000]
    # On time: delivered within a second of the nominal time.
    assert all(r.at_ms - timefmt.parse_rfc3339_ms(r.fire_time) < 1000 for r in sink.received[:3])
