"""CRONBUS_AMQP_URL listing several nodes, against the local broker: a node that does not
answer is passed over at start, and a connection whose node is lost moves to the next one
with its consumers; a client closed while its node is lost ends its send cleanly."""

from __future__ import annotations

import asyncio
import contextlib
from urllib.parse import urlsplit, urlunsplit

import aio_pika
import pytest
from yarl import URL

from cronbus.client import Client, NoReply
from shared.rabbitmq import amqp, nodes
from tests.support.services import free_port


def _via(url: str, port: int) -> str:
    parts = urlsplit(url)
    userinfo = parts.netloc.rpartition("@")[0]
    return urlunsplit(parts._replace(netloc=f"{userinfo}@127.0.0.1:{port}"))


class Relay:
    """A loopback port forwarding to the broker, which the test closes to lose the node."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.server: asyncio.Server | None = None
        self.pipes: set[asyncio.StreamWriter] = set()

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self.pipes |= {writer, up_writer}

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()

        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))

    async def lose(self) -> None:
        assert self.server is not None
        self.server.close()
        for pipe in self.pipes:
            pipe.transport.abort()
        await self.server.wait_closed()


async def test_a_dead_first_node_is_passed_over_at_start(amqp_url: str) -> None:
    listed = f"{_via(amqp_url, free_port())},{amqp_url}"
    connection = await amqp.connect(listed, "cronbus-test-nodes")
    try:
        channel = await connection.channel()
        assert not channel.is_closed
    finally:
        await connection.close()


async def test_a_lost_node_moves_the_connection_and_its_consumer_to_the_next(
    amqp_url: str,
) -> None:
    broker_port = urlsplit(amqp_url).port or 5672
    relay = Relay(broker_port)
    listed = f"{_via(amqp_url, await relay.start())},{amqp_url}"
    connection = await nodes.connect(listed, "cronbus-test-nodes", start=0)
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue("nodes-test", auto_delete=False, durable=True)
        received: asyncio.Queue[bytes] = asyncio.Queue()

        async def on_message(message: aio_pika.abc.AbstractIncomingMessage) -> None:
            async with message.process():
                await received.put(message.body)

        await queue.consume(on_message)
        await channel.default_exchange.publish(aio_pika.Message(b"before"), "nodes-test")
        assert await asyncio.wait_for(received.get(), 5) == b"before"

        assert relay.pipes, "the connection did not start on the first node"
        await relay.lose()
        for _ in range(100):  # a bounded wait for the reconnect
            if connection.connected.is_set() and URL(connection.ring.current).port == broker_port:
                break
            await asyncio.sleep(0.05)
        assert URL(connection.ring.current).port == broker_port
        async with asyncio.timeout(5):
            await channel.default_exchange.publish(aio_pika.Message(b"after"), "nodes-test")
            # "before" may come again: its ack could go down with the node.
            while (body := await received.get()) == b"before":
                pass
            assert body == b"after"
    finally:
        await connection.close()
        await relay.lose()


async def test_a_client_closed_while_its_node_is_lost_ends_the_send_with_no_reply(
    amqp_url: str,
) -> None:
    relay = Relay(urlsplit(amqp_url).port or 5672)
    client = Client(_via(amqp_url, await relay.start()), timeout_s=10)
    await client.connect()
    try:
        await relay.lose()  # the only node: the send waits for a reconnect that cannot come
        sending = asyncio.create_task(client.send("ns-closed", "upsert", {"x": 1}))
        await asyncio.sleep(0.05)
        await client.close()
        # Before: AttributeError ('NoneType' object has no attribute 'ready') from the loop.
        async with asyncio.timeout(5):
            with pytest.raises(NoReply):
                await sending
    finally:
        await client.close()
