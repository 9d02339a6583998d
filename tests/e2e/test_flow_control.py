"""Overload waits in Redis, not in the broker; a poison delivery message is parked."""

from __future__ import annotations

import asyncio
import re
import time

import aio_pika

from cronbus.cli.sink import Sink
from shared.contract import keys, timefmt
from shared.rabbitmq import amqp
from tests.support.commands import CommandClient
from tests.support.stack import Stack


def gauge(text: str, name: str) -> float:
    values = [float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    return sum(values)


async def test_claiming_stops_above_the_high_water_mark(
    stack: Stack, sink: Sink, client: CommandClient, amqp_url: str
) -> None:
    dispatcher = stack.start(
        "dispatcher",
        CRONBUS_DELIVERY_BATCH="1",
        CRONBUS_CLAIM_BATCH="2",
        CRONBUS_DELIVERIES_HIGH_WATER="5",
    )
    await stack.wait_ready(dispatcher)
    due_at = timefmt.format_ms(int(time.time() * 1000) + 1000)
    for i in range(60):
        reply = await client.send(
            "flow",
            "upsert",
            {
                "schedule": {
                    "id": f"f{i}",
                    "spec": {"kind": "once", "at": due_at},
                    "target": {"kind": "webhook", "url": f"{sink.url}/f{i}"},
                }
            },
        )
        assert reply["ok"], reply
    await asyncio.sleep(7)  # all of them came due; a backlog report ran meanwhile
    connection = await aio_pika.connect(amqp_url)
    try:
        channel = await connection.channel()
        ready = await amqp.ready_messages(channel, keys.DELIVERIES_QUEUE)
    finally:
        await connection.close()
    _, text = await asyncio.to_thread(dispatcher.get, "/metrics")
    due = gauge(text, "cronbus_due_backlog")
    # No executor is running: the queue stopped near its mark, the rest waits in Redis.
    assert 5 < ready < 60, ready
    assert gauge(text, "cronbus_backpressure") == 1
    assert due > 0, text
    await stack.wait_ready(stack.start("executor"))
    assert await sink.wait_for(lambda s: len({r.path for r in s.received}) == 60, 30), stack.tails()
