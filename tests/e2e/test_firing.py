"""Schedules go in over AMQP and come out on time as webhook calls and AMQP messages."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aio_pika
from aio_pika.abc import AbstractQueue

from cronbus.cli.sink import Sink
from shared.contract import codec, keys, timefmt
from shared.policy import tracing
from shared.rules import schedule
from tests.support.commands import CommandClient, an_hour_from_now
from tests.support.stack import Stack


class EventQueue:
    def __init__(self, queue: AbstractQueue) -> None:
        self.queue = queue

    async def get(self, within_s: float) -> aio_pika.abc.AbstractIncomingMessage | None:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline:
            message = await self.queue.get(fail=False)
            if message is not None:
                await message.ack()
                return message
            await asyncio.sleep(0.1)
        return None


@asynccontextmanager
async def events_queue(amqp_url: str, routing_key: str) -> AsyncIterator[EventQueue]:
    """A queue bound to cronbus.events, as a user watching outcomes would bind one."""
    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel()
        exchange = await channel.declare_exchange(
            keys.EVENTS_EXCHANGE, aio_pika.ExchangeType.TOPIC, durable=True
        )
        queue = await channel.declare_queue(exclusive=True)
        await queue.bind(exchange, routing_key=routing_key)
        yield EventQueue(queue)
    finally:
        await connection.close()


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


async def test_cron_with_seconds_once_and_after_completion(
    stack: Stack, sink: Sink, client: CommandClient
) -> None:
    await stack.start_all(("dispatcher", "executor"))
    now_ms = int(time.time() * 1000)
    at = now_ms - now_ms % 1000 + 3000
    schedules = [
        {
            "id": "even-seconds",
            "spec": {"kind": "cron", "expr": "*/2 * * * * *"},
            "target": webhook(sink, "/cron"),
        },
        {
            "id": "just-once",
            "spec": {"kind": "once", "at": timefmt.format_ms(at)},
            "target": webhook(sink, "/once"),
        },
        {
            "id": "fixed-delay",
            "spec": {"kind": "after_completion", "delay_s": 1},
            "target": webhook(sink, "/delay"),
        },
    ]
    for item in schedules:
        reply = await client.send("acme", "upsert", {"schedule": item})
        assert reply["ok"], reply

    def by(path: str) -> list[Any]:
        return [r for r in sink.received if r.path == path]

    assert await sink.wait_for(
        lambda s: len(by("/cron")) >= 3 and len(by("/delay")) >= 3 and len(by("/once")) >= 1,
        timeout_s=15,
    ), stack.tails()
    cron_times = [timefmt.parse_rfc3339_ms(r.fire_time) for r in by("/cron")]
    assert all(t % 2000 == 0 for t in cron_times)
    assert cron_times == sorted(set(cron_times))

    [once] = by("/once")
    assert timefmt.parse_rfc3339_ms(once.fire_time) == at
    got = await client.send("acme", "get", {"id": "just-once"})
    assert got["ok"]

    delays = by("/delay")
    for previous, current in itertools.pairwise(delays[:3]):
        # Fixed delay: each fire is one second after the previous delivery finished.
        gap = timefmt.parse_rfc3339_ms(current.fire_time) - previous.at_ms
        assert 995 <= gap < 1500, gap
    await asyncio.sleep(1.5)
    assert len(by("/once")) == 1
    state = await client.send("acme", "get", {"id": "just-once"})
    assert state["schedule"]["state"] == "completed"
    assert state["schedule"]["fires"] == 1 and state["schedule"]["next_fires"] == []


async def test_retries_keep_the_key_and_dead_occurrences_let_the_schedule_go_on(
    stack: Stack, sink: Sink, client: CommandClient, amqp_url: str
) -> None:
    attempts_failing = {"/flaky": 2, "/broken": 99}
    sink.respond = lambda r: 500 if r.attempt <= attempts_failing.get(r.path, 0) else 200
    async with events_queue(amqp_url, "acme.dead") as dead_events:
        await stack.start_all(("dispatcher", "executor"))
        retry = {
            "max_attempts": 3,
            "initial_backoff_s": 0.2,
            "multiplier": 2,
            "max_backoff_s": 1,
            "full_jitter": False,
        }
        for name in ("flaky", "broken"):
            reply = await client.send(
                "acme",
                "upsert",
                {
                    "schedule": {
                        "id": name,
                        "spec": {"kind": "interval", "every_s": 3},
                        "target": webhook(sink, f"/{name}"),
                        "retry": retry,
                    }
                },
            )
            assert reply["ok"], reply

        def calls(path: str) -> list[Any]:
            return [r for r in sink.received if r.path == path]

        assert await sink.wait_for(
            lambda s: len(calls("/flaky")) >= 3 and len(calls("/broken")) >= 4, timeout_s=20
        ), stack.tails()
        flaky = calls("/flaky")[:3]
        assert [r.attempt for r in flaky] == [1, 2, 3]
        assert len({r.key for r in flaky}) == 1 and len({r.fire_time for r in flaky}) == 1
        # Backoff 0.2 s then 0.4 s (no jitter) between the attempts.
        assert 150 <= flaky[1].at_ms - flaky[0].at_ms < 1000
        assert 350 <= flaky[2].at_ms - flaky[1].at_ms < 1200
        broken = calls("/broken")
        assert [r.attempt for r in broken[:3]] == [1, 2, 3]
        assert len({r.key for r in broken[:3]}) == 1
        # After the last attempt the occurrence is dead and the schedule goes on.
        assert broken[3].attempt == 1 and broken[3].key != broken[0].key
        event = await dead_events.get(within_s=10)
        assert event is not None
        body = codec.loads(event.body)
        assert (body["id"], body["outcome"], body["attempt"]) == ("broken", "dead", 3)
        assert body["idempotency_key"] == broken[0].key


async def test_amqp_target_and_trigger(
    stack: Stack, sink: Sink, client: CommandClient, amqp_url: str
) -> None:
    connection = await aio_pika.connect(amqp_url)
    channel = await connection.channel()
    # The namespace's own exchange: by default a namespace publishes only to {namespace}(.*).
    exchange = await channel.declare_exchange("acme.billing", aio_pika.ExchangeType.DIRECT)
    queue = await channel.declare_queue("billing-reminders", exclusive=True)
    await queue.bind(exchange, routing_key="remind")
    try:
        await stack.start_all(("dispatcher", "executor"))
        reply = await client.send(
            "acme",
            "upsert",
            {
                "schedule": {
                    "id": "remind",
                    # On the epoch's grid a whole hour during the test would fire it too.
                    "spec": {"kind": "interval", "every_s": 3600, "start_at": an_hour_from_now()},
                    "target": {
                        "kind": "amqp",
                        "exchange": "acme.billing",
                        "routing_key": "remind",
                        "headers": {"x-tenant": "acme"},
                        "body": {"invoice": 42},
                    },
                }
            },
        )
        assert reply["ok"], reply
        before = reply["schedule"]["next_fires"]
        triggered = await client.send("acme", "trigger", {"id": "remind"})
        assert triggered["ok"], triggered
        message = await queue.get(timeout=10, fail=False)
        for _ in range(100):
            if message is not None:
                break
            await asyncio.sleep(0.1)
            message = await queue.get(timeout=10, fail=False)
        assert message is not None, stack.tails()
        await message.ack()
        assert message.message_id == triggered["trigger"]["idempotency_key"]
        assert message.headers["X-Cronbus-Schedule"] == "acme/remind"
        assert message.headers["X-Cronbus-Fire-Time"] == triggered["trigger"]["fire_time"]
        assert message.headers["X-Cronbus-Attempt"] == "1"
        assert message.headers["x-tenant"] == "acme"
        key = triggered["trigger"]["idempotency_key"]
        assert message.headers["traceparent"] == tracing.traceparent(key, 1)
        assert codec.loads(message.body) == {"invoice": 42}
        # A trigger runs outside the rotation: the next regular fires have not moved.
        after = await client.send("acme", "get", {"id": "remind"})
        assert after["schedule"]["next_fires"] == before
        assert after["schedule"]["fires"] == 0
    finally:
        await connection.close()
