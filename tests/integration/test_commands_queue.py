"""The commands queue gets a delivery limit on a new install, and an install from before (whose
queue has no limit and cannot change its arguments) still starts."""

from __future__ import annotations

import subprocess
from urllib.parse import unquote, urlsplit

import aio_pika

from shared.contract import keys
from shared.rabbitmq import amqp
from tests.support import services


def queue_arguments(endpoints: services.Endpoints, amqp_url: str) -> str:
    vhost = unquote(urlsplit(amqp_url).path.lstrip("/"))
    listed = subprocess.run(
        [*endpoints.rabbitmqctl, "list_queues", "-p", vhost, "name", "arguments"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return next(line for line in listed.splitlines() if line.startswith(keys.COMMANDS_QUEUE + "\t"))


async def test_a_new_install_declares_the_delivery_limit(
    endpoints: services.Endpoints, amqp_url: str
) -> None:
    connection = await aio_pika.connect_robust(amqp_url)
    try:
        channel = await connection.channel()
        await amqp.declare_topology(channel)
        await amqp.declare_topology(channel)  # again, as every service does
    finally:
        await connection.close()
    limit = f'{{"x-delivery-limit",{amqp.COMMAND_DELIVERY_LIMIT}}}'
    assert limit in queue_arguments(endpoints, amqp_url)


async def test_an_older_queue_without_the_limit_is_kept_and_still_consumed(
    endpoints: services.Endpoints, amqp_url: str
) -> None:
    connection = await aio_pika.connect_robust(amqp_url)
    try:
        channel = await connection.channel()
        await channel.declare_queue(
            keys.COMMANDS_QUEUE,
            durable=True,
            arguments=keys.quorum_queue_arguments(keys.COMMANDS_QUEUE),
        )
        await amqp.declare_topology(channel)
        queue = await amqp.commands_queue_of(channel)
        commands = await channel.get_exchange(keys.COMMANDS_EXCHANGE)
        await commands.publish(aio_pika.Message(b"{}"), routing_key="acme.get")
        message = await queue.get(timeout=5, fail=False)
        assert message is not None and message.body == b"{}"
        await message.ack()
    finally:
        await connection.close()
    assert "x-delivery-limit" not in queue_arguments(endpoints, amqp_url)
