"""The dispatcher's coalescing window (CRONBUS_CLAIM_COALESCE_MS): fires due a few ms apart
go out together, in one message, each later by at most the window; 0 claims each as it comes
due. Either way every occurrence is delivered once."""

from __future__ import annotations

import functools
import time

import pytest

from cronbus.cli.sink import Sink
from shared.contract import timefmt
from tests.e2e.test_firing import webhook
from tests.e2e.test_operations import metric_sum
from tests.support.commands import CommandClient, an_hour_from_now
from tests.support.stack import Stack

SCHEDULES = 20
#: The schedules' fires are this far apart within each second: 380 ms from first to last.
APART_MS = 20
ROUNDS = 3


@pytest.mark.parametrize("window_ms", [0, 200])
async def test_fires_due_within_the_window_share_a_message(
    stack: Stack, sink: Sink, client: CommandClient, window_ms: int
) -> None:
    await stack.start_all(("dispatcher", "executor"), CRONBUS_CLAIM_COALESCE_MS=str(window_ms))
    base = (int(time.time()) + 3) * 1000
    for i in range(SCHEDULES):
        spec = {
            "kind": "interval",
            "every_s": 1,
            "start_at": timefmt.format_ms(base + i * APART_MS),
        }
        schedule = {"id": f"c{i}", "spec": spec, "target": webhook(sink, f"/c{i}")}
        reply = await client.send("acme", "upsert", {"schedule": schedule})
        assert reply["ok"], reply
    wanted = SCHEDULES * ROUNDS
    assert await sink.wait_for(lambda s: len(s.received) >= wanted, timeout_s=20), stack.tails()
    [dispatcher] = stack.running("dispatcher")
    _, metrics = dispatcher.get("/metrics")
    published = metric_sum(metrics, "cronbus_published_total")
    messages = metric_sum(metrics, "cronbus_delivery_messages_total")
    received = sink.received[:wanted]
    occurrences = {(r.schedule, r.fire_time) for r in received}
    assert len(occurrences) == len(received), "an occurrence was delivered twice"
    late_ms = [r.at_ms - timefmt.parse_rfc3339_ms(r.fire_time) for r in received]
    per_message = published / messages
    if window_ms == 0:
        # Each fire is claimed as it comes due: 20 ms apart, one message each.
        assert per_message < 2, (published, messages)
    else:
        # A second's 20 fires span 380 ms: two or three windows of 200 ms.
        assert per_message >= 5, (published, messages)
        # Held back by the window, not more: some fires wait most of it.
        assert max(late_ms) >= window_ms / 2, late_ms
    assert max(late_ms) < window_ms + 1000, late_ms


def received_at_least(count: int, sink: Sink) -> bool:
    return len(sink.received) >= count


async def test_a_trigger_is_not_held_back_by_the_window(
    stack: Stack, sink: Sink, client: CommandClient
) -> None:
    """The window is the longest allowed and the claim loop sleeps it after every claim: a
    trigger still wakes it and goes out at once, as do schedules created due now."""
    await stack.start_all(("dispatcher", "executor"), CRONBUS_CLAIM_COALESCE_MS="1000")
    schedule = {
        "id": "t",
        # On the epoch's grid a whole hour during the test would be taken for a trigger.
        "spec": {"kind": "interval", "every_s": 3600, "start_at": an_hour_from_now()},
        "target": webhook(sink, "/t"),
    }
    reply = await client.send("acme", "upsert", {"schedule": schedule})
    assert reply["ok"], reply
    for round_ in range(3):
        sent_ms = time.time() * 1000
        triggered = await client.send("acme", "trigger", {"id": "t"})
        assert triggered["ok"], triggered
        assert await sink.wait_for(functools.partial(received_at_least, round_ + 1), timeout_s=10)
        took_ms = sink.received[round_].at_ms - sent_ms
        assert took_ms < 500, (round_, took_ms, stack.tails())
