"""A backfilled occurrence published to an AMQP target carries the backfill header beside the
other X-Cronbus headers, and the regular occurrence's key as message_id."""

from __future__ import annotations

import asyncio

import aio_pika

from services.executor.targets import AmqpTargets
from shared.contract import delivery, entries, keys, timefmt
from shared.rules import compact, schedule
from shared.rules.plan import AmqpPlan, IntervalRule, Plan

NOMINAL = timefmt.parse_rfc3339_ms("2027-01-01T10:00:00Z")


async def test_an_amqp_backfill_delivery_carries_the_header(amqp_url: str) -> None:
    connection = await aio_pika.connect_robust(amqp_url)
    try:
        channel = await connection.channel()
        exchange = await channel.declare_exchange("ns.jobs", aio_pika.ExchangeType.TOPIC)
        queue = await channel.declare_queue(exclusive=True)
        await queue.bind(exchange, "remind")
        plan = Plan(version=1, rule=IntervalRule(60_000), target=AmqpPlan("ns.jobs", "remind"))
        received = []
        for member in (keys.backfill_member("ns", "s"), keys.member("ns", "s")):
            item = entries.Claimed(0, member, NOMINAL, NOMINAL, 1, 9, 1, compact.encode(plan))
            [occ] = delivery.decode(delivery.encode([item]))
            outcome = await AmqpTargets(connection).deliver(occ, occ.idempotency_key)
            assert outcome.ok, outcome
            message = await queue.get(timeout=5)
            assert message is not None
            await message.ack()
            received.append(message)
        backfilled, regular = received
        assert backfilled.headers["X-Cronbus-Backfill"] == "true"
        assert backfilled.headers["X-Cronbus-Fire-Time"] == "2027-01-01T10:00:00Z"
        assert backfilled.message_id == schedule.idempotency_key("ns", "s", NOMINAL)
        assert backfilled.message_id == regular.message_id
        assert "X-Cronbus-Backfill" not in regular.headers
    finally:
        await asyncio.wait_for(connection.close(), 10)
