"""RabbitMQ: robust connections and the topology every service declares at start (idempotent)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import aio_pika
import aiormq.exceptions
from aio_pika.abc import AbstractChannel, AbstractQueue, AbstractRobustConnection

from shared.contract import keys
from shared.rabbitmq import decoding, nodes

log = logging.getLogger(__name__)

#: A delivery message redelivered more often than this is poison: it goes to the DLQ, where
#: the executors settle its occurrences as dead (see ``Executor.settle_dead_letter``).
DELIVERY_LIMIT = 20
#: A command delivered this often without being answered (its consumer died each time) goes to
#: the commands' dead-letter queue instead of being tried again.
COMMAND_DELIVERY_LIMIT = 5
DELIVERIES_ROUTING_KEY = "deliver"
#: How soon a lost connection is tried again (aio-pika's default is 5 s).
RECONNECT_INTERVAL_S = 1.0


async def connect(url: str, name: str) -> AbstractRobustConnection:
    """A connection that reconnects by itself, named so operators can tell who is who.

    ``url`` may list the nodes of a cluster, separated by commas: the connection moves to the
    next when its node is lost (``nodes``). Frames whose strings are not UTF-8 are read rather
    than fatal (``decoding``)."""
    decoding.install()
    return await nodes.connect(url, name, connect_timeout_s=10)


async def declare_topology(channel: AbstractChannel) -> None:
    """Exchanges, queues, bindings and dead-letter queues; safe to run again and concurrently."""
    dead = await channel.declare_exchange(
        keys.DEAD_LETTER_EXCHANGE, aio_pika.ExchangeType.DIRECT, durable=True
    )
    for queue in (keys.COMMANDS_QUEUE, keys.DELIVERIES_QUEUE):
        dlq = await channel.declare_queue(
            keys.dead_letter_queue(queue), durable=True, arguments={"x-queue-type": "quorum"}
        )
        await dlq.bind(dead, routing_key=keys.dead_letter_queue(queue))

    commands = await channel.declare_exchange(
        keys.COMMANDS_EXCHANGE, aio_pika.ExchangeType.TOPIC, durable=True
    )
    commands_queue = await commands_queue_of(channel)
    await commands_queue.bind(commands, routing_key="#")

    deliveries = await channel.declare_exchange(
        keys.DELIVERIES_EXCHANGE, aio_pika.ExchangeType.DIRECT, durable=True
    )
    deliveries_queue = await deliveries_queue_of(channel)
    await deliveries_queue.bind(deliveries, routing_key=DELIVERIES_ROUTING_KEY)

    await channel.declare_exchange(keys.EVENTS_EXCHANGE, aio_pika.ExchangeType.TOPIC, durable=True)


async def commands_queue_of(channel: AbstractChannel) -> AbstractQueue:
    """The commands queue, declared on ``channel`` so that a robust channel restores it (and
    its consumers) after a reconnect."""
    return await channel.declare_queue(
        keys.COMMANDS_QUEUE,
        durable=True,
        arguments=await _commands_queue_arguments(channel),
    )


def partition_queue_arguments() -> dict[str, Any]:
    """A commands partition: one active consumer at a time (the broker's guarantee, whatever
    the dispatchers' leases say), dead letters with the commands' own."""
    arguments = keys.quorum_queue_arguments(
        keys.COMMANDS_QUEUE, delivery_limit=COMMAND_DELIVERY_LIMIT
    )
    arguments["x-single-active-consumer"] = True
    return arguments


async def declare_partitions(channel: AbstractChannel, partitions: int) -> None:
    """The partitions exchange and its queues (dispatchers only: they know how many)."""
    exchange = await channel.declare_exchange(
        keys.PARTITIONS_EXCHANGE, aio_pika.ExchangeType.DIRECT, durable=True
    )
    for partition in range(partitions):
        queue = await partition_queue_of(channel, partition)
        await queue.bind(exchange, routing_key=str(partition))


async def partition_queue_of(channel: AbstractChannel, partition: int) -> AbstractQueue:
    return await channel.declare_queue(
        keys.partition_queue(partition), durable=True, arguments=partition_queue_arguments()
    )


async def _commands_queue_arguments(channel: AbstractChannel) -> dict[str, Any]:
    """The commands queue's arguments: with a delivery limit, unless the queue already exists
    without one.

    A queue's arguments cannot change once declared (the broker answers PRECONDITION_FAILED),
    so an install from before the limit keeps its queue as it is, and the operator adds the
    limit with a policy (docs/security.md). The intake enforces the same limit itself from
    the ``x-delivery-count`` header either way. The probe runs on a channel of its own, since
    the refusal closes the channel it happens on.
    """
    limited = keys.quorum_queue_arguments(
        keys.COMMANDS_QUEUE, delivery_limit=COMMAND_DELIVERY_LIMIT
    )
    underlay = await channel.get_underlay_channel()
    probe = await underlay.connection.channel()
    try:
        await probe.queue_declare(keys.COMMANDS_QUEUE, durable=True, arguments=limited)
    except aiormq.exceptions.ChannelPreconditionFailed:
        log.warning(
            "the commands queue has no delivery limit; add one with a policy (docs/security.md)",
            extra={"action": "commands_queue_without_limit"},
        )
        return keys.quorum_queue_arguments(keys.COMMANDS_QUEUE)
    finally:
        if not probe.is_closed:
            await probe.close()
    return limited


async def deliveries_queue_of(channel: AbstractChannel) -> AbstractQueue:
    return await channel.declare_queue(
        keys.DELIVERIES_QUEUE,
        durable=True,
        arguments=keys.quorum_queue_arguments(keys.DELIVERIES_QUEUE, delivery_limit=DELIVERY_LIMIT),
    )


async def dead_deliveries_queue_of(channel: AbstractChannel) -> AbstractQueue:
    """The dead-letter queue of ``cronbus.deliveries`` (declared with the topology)."""
    return await channel.declare_queue(
        keys.dead_letter_queue(keys.DELIVERIES_QUEUE),
        durable=True,
        arguments={"x-queue-type": "quorum"},
    )


#: Longest wait for a robust channel to be connected again before asking it something.
RECONNECT_WAIT_S = 2.0


async def ready_messages(channel: AbstractChannel, queue: str) -> int:
    """Messages waiting (ready, not yet delivered to a consumer) in a queue.

    Asked on the underlying channel: a passive declare on a robust channel would be recorded
    and replayed at every reconnect, one more each time it is asked. While the broker is away
    the robust channel waits for the reconnect without end: TimeoutError after
    RECONNECT_WAIT_S lets the caller see the outage (and a stopping service stop).
    """
    underlay = await asyncio.wait_for(channel.get_underlay_channel(), RECONNECT_WAIT_S)
    declared = await underlay.queue_declare(queue, passive=True)
    return int(declared.message_count or 0)


async def dead_letter(
    channel: AbstractChannel,
    queue: str,
    body: bytes,
    reason: str,
    properties: dict[str, Any] | None = None,
) -> None:
    """Put a message on ``queue``'s dead-letter queue with the reason in a header."""
    exchange = await channel.get_exchange(keys.DEAD_LETTER_EXCHANGE, ensure=False)
    headers = dict((properties or {}).get("headers") or {})
    headers[keys.DEAD_REASON_HEADER] = reason[:1000]
    message = aio_pika.Message(
        body,
        headers=headers,
        content_type=(properties or {}).get("content_type"),
        correlation_id=(properties or {}).get("correlation_id"),
        reply_to=(properties or {}).get("reply_to"),
        message_id=(properties or {}).get("message_id"),
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
    )
    await exchange.publish(message, routing_key=keys.dead_letter_queue(queue))
